//! The draw scripts driven with generated states on the real Redis: pools
//! of random combos in both storages, jackpot rules that gate or not, long
//! runs of gated jackpots (past Lua's `unpack` limit), short and empty
//! pools, counts far above what the pool holds, and refills in between.
//! After every call the step either completed (its prizes left the pool and
//! were answered) or changed nothing (only the batch's `due` mark may move,
//! and a refusal is remembered), and conservation holds exactly. Every
//! prize an answer names is the one its batch's committed seed put at the
//! position the answer gives, no position is drawn twice, a parked prize is
//! a jackpot, and a seed is revealed only once its whole batch is drawn.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeMap;

use common::TestEnv;
use prizepool::{
    kinds::lucky_gift::{self, CodeTable, DrawStep, Storage},
    scripts::PoolKeys,
};
use proptest::prelude::*;

/// Everything a draw may touch, minus the `due` mark and the result keys.
async fn snapshot(env: &TestEnv, keys: &PoolKeys, day: &str) -> Vec<String> {
    let mut redis = env.redis.clone();
    let mut meta: BTreeMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(keys.meta())
        .query_async(&mut redis)
        .await
        .unwrap();
    meta.remove("due");
    // The answer store's epochs (`ep`: start, length, buckets, count, as
    // big-endian u32 each): their start is the clock when the first answer
    // was stored, which two pools drawn a moment apart need not share;
    // their geometry must agree.
    if let Some(epochs) = meta.get_mut("ep") {
        *epochs = epochs
            .chunks(16)
            .flat_map(|e| e.get(4..).unwrap_or_default().to_vec())
            .collect();
    }
    let meta: BTreeMap<String, String> = meta
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
        .collect();
    let mut out = vec![format!("{meta:?}")];
    for list in [keys.queue(), keys.held()] {
        let items: Vec<String> = redis::cmd("LRANGE")
            .arg(&list)
            .arg(0)
            .arg(-1)
            .query_async(&mut redis)
            .await
            .unwrap();
        out.push(items.join(","));
    }
    let sparse: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.sparse())
        .query_async(&mut redis)
        .await
        .unwrap();
    out.push(format!("{sparse:?}"));
    for set in [keys.segments(), keys.flags()] {
        let items: Vec<String> = redis::cmd("ZRANGE")
            .arg(&set)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut redis)
            .await
            .unwrap();
        out.push(items.join(","));
    }
    let spent: Option<String> = redis::cmd("GET")
        .arg(keys.spent(day))
        .query_async(&mut redis)
        .await
        .unwrap();
    out.push(spent.unwrap_or_default());
    out
}

/// A generated pool: combos of (multiplier, stock) and a jackpot rule.
#[derive(Clone, Debug)]
struct Case {
    storage: Storage,
    combos: Vec<Vec<(u64, u64)>>,
    /// Multipliers at or above this are jackpots.
    jackpot_min: u64,
    /// Today's consumption needed before jackpots may be won.
    threshold: i64,
    counts: Vec<u32>,
    /// Before step `i`, a reload moving the jackpot minimum to `reloads[i]`.
    reloads: Vec<Option<u64>>,
}

fn case() -> impl Strategy<Value = Case> {
    let combo = prop::collection::btree_map(0u64..6, 1u64..40, 1..4)
        .prop_map(|m| m.into_iter().map(|(k, v)| (k * 100, v)).collect::<Vec<_>>());
    (
        prop::bool::ANY,
        prop::collection::vec(combo, 1..4),
        prop::sample::select(vec![100u64, 300, 500, 1000]),
        prop::sample::select(vec![0i64, 50, 500, 1 << 52]),
        prop::collection::vec(
            prop_oneof![1u32..5, 5u32..60, Just(999), Just(1000), Just(1001)],
            1..25,
        ),
        prop::collection::vec(
            prop::option::weighted(0.2, prop::sample::select(vec![100u64, 300, 500, 1000])),
            25,
        ),
    )
        .prop_map(
            |(sparse, combos, jackpot_min, threshold, counts, reloads)| Case {
                storage: if sparse {
                    Storage::Sparse
                } else {
                    Storage::List
                },
                combos,
                jackpot_min,
                threshold,
                counts,
                reloads,
            },
        )
}

fn toml(id: &str, case: &Case) -> String {
    let storage = match case.storage {
        Storage::List => "list",
        Storage::Sparse => "sparse",
    };
    let mut text = format!(
        "[[pools]]\nid = \"{id}\"\nkind = \"lucky_gift\"\nunit_price = 10\nstorage = \"{storage}\"\nmax_count = 1000\nrefill_at = 0.5\njackpot = {{ min_multiplier = {}, daily_consumption_threshold = {} }}\n",
        case.jackpot_min, case.threshold
    );
    for (i, combo) in case.combos.iter().enumerate() {
        let items: Vec<String> = combo
            .iter()
            .map(|(m, n)| format!("\"{m}\" = {n}"))
            .collect();
        text.push_str(&format!(
            "[[pools.combos]]\nid = \"c{i}\"\nstock = {{ {} }}\n",
            items.join(", ")
        ));
    }
    text
}

/// Loads `case` as pool `id` straight into Redis (no registry needed).
async fn load(env: &TestEnv, id: &str, case: &Case) -> (lucky_gift::PoolConfig, CodeTable) {
    let config = lucky_gift::parse_file(&toml(id, case)).unwrap().remove(0);
    let table = CodeTable::extend(None, &config);
    let mut redis = env.redis.clone();
    let keys = env.keys(id);
    lucky_gift::configure(&mut redis, &keys, &config, 1, &table)
        .await
        .unwrap();
    stock(env, id, &config, &table, 0).await;
    (config, table)
}

async fn stock(
    env: &TestEnv,
    id: &str,
    config: &lucky_gift::PoolConfig,
    table: &CodeTable,
    trigger: u64,
) {
    let mut redis = env.redis.clone();
    let outcome = lucky_gift::stock_next(
        &mut redis,
        &env.keys(id),
        config,
        table,
        trigger,
        500,
        30_000,
    )
    .await
    .unwrap();
    assert!(
        matches!(outcome, lucky_gift::StockOutcome::Stocked { .. }),
        "{outcome:?}"
    );
}

/// Multiset of codes one batch of `config` holds.
fn batch_codes(config: &lucky_gift::PoolConfig, table: &CodeTable) -> BTreeMap<u32, u64> {
    let mut codes = BTreeMap::new();
    for combo in &config.combos {
        for (multiplier, n) in &combo.stock {
            *codes
                .entry(table.code_of(&combo.id, *multiplier).unwrap())
                .or_default() += n;
        }
    }
    codes
}

/// What the draws of one case said about the committed batches.
#[derive(Default)]
struct Fair {
    /// Each batch's order (codes by position), recomputed from its seed.
    orders: BTreeMap<u64, Vec<u32>>,
    /// Positions drawn, per batch.
    drawn: BTreeMap<u64, std::collections::BTreeSet<u64>>,
    /// Positions parked in `held`, per batch.
    parked: BTreeMap<u64, std::collections::BTreeSet<u64>>,
}

/// The fairness record of a draw holds: each prize is the one its batch's
/// seed put at the position the draw names, no position is drawn twice, a
/// parked prize is a jackpot of its batch, and a batch's seed is revealed
/// only once every one of its positions has been drawn.
async fn check_positions(
    env: &TestEnv,
    id: &str,
    config: &lucky_gift::PoolConfig,
    table: &CodeTable,
    d: &lucky_gift::Drawn,
    jackpot_min: u64,
    fair: &mut Fair,
) -> Result<(), TestCaseError> {
    let mut redis = env.redis.clone();
    let seeds: BTreeMap<u64, (i64, String)> = d
        .revealed
        .iter()
        .map(|r| (r.generation, (r.version, r.seed.clone())))
        .collect();
    let mut read = Vec::new();
    for run in &d.positions {
        for p in run.position..run.position + run.count {
            read.push((run.generation, p));
        }
    }
    let listed: Vec<(u64, u64)> = d
        .held_back
        .iter()
        .map(|h| (h.generation, h.position))
        .collect();
    for &(g, _) in read.iter().chain(&listed) {
        prop_assert!(g > 0, "every batch here is committed");
        if fair.orders.contains_key(&g) {
            continue;
        }
        let (version, seed) = match seeds.get(&g) {
            Some(known) => known.clone(),
            None => {
                let record: String = redis::cmd("HGET")
                    .arg(env.keys(id).meta())
                    .arg(format!("c:{g}"))
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                let (v, seed) = record.split_once('|').unwrap();
                (v.parse().unwrap(), seed.to_owned())
            }
        };
        let seed = prizepool::fairness::Seed::from_hex(&seed).unwrap();
        let context = prizepool::fairness::lucky_gift_context(id, g, version);
        let batch = lucky_gift::Batch::build_fair(config, table, &mut seed.stream(&context));
        fair.orders.insert(g, batch.codes);
    }
    // A draw that names the rule covers every position it read: those
    // whose prize reaches the rule were held back, each run says how many.
    let (at, parked) = match d.held_back_min_multiplier {
        None => (read, listed),
        Some(min) => {
            prop_assert!(listed.is_empty());
            prop_assert_eq!(min, jackpot_min, "the record names the pool's rule");
            let is_jackpot = |&(g, p): &(u64, u64)| {
                fair.orders[&g]
                    .get(p as usize)
                    .is_some_and(|code| table.decode(*code).unwrap().1 >= min)
            };
            let mut k = 0;
            for run in &d.positions {
                let held = read[k..k + run.count as usize]
                    .iter()
                    .filter(|at| is_jackpot(at))
                    .count();
                prop_assert_eq!(held as u64, run.held_back, "the run's held-back count");
                k += run.count as usize;
            }
            read.into_iter().partition(|at| !is_jackpot(at))
        }
    };
    prop_assert_eq!(at.len(), d.codes.len(), "every prize names its position");
    for (&(g, p), code) in at.iter().zip(&d.codes) {
        prop_assert_eq!(
            fair.orders[&g].get(p as usize),
            Some(code),
            "batch {} position {}",
            g,
            p
        );
        prop_assert!(
            fair.drawn.entry(g).or_default().insert(p),
            "position {}:{} drawn twice",
            g,
            p
        );
    }
    for &(g, p) in &parked {
        let code = fair.orders[&g][p as usize];
        prop_assert!(
            table.decode(code).unwrap().1 >= jackpot_min,
            "a parked prize is a jackpot"
        );
        prop_assert!(
            fair.drawn.get(&g).is_none_or(|s| !s.contains(&p)),
            "position {}:{} parked after it was drawn",
            g,
            p
        );
        prop_assert!(fair.parked.entry(g).or_default().insert(p), "parked twice");
    }
    for r in &d.revealed {
        let size = config.batch_size() as usize;
        prop_assert_eq!(
            fair.drawn.get(&r.generation).map_or(0, |s| s.len()),
            size,
            "batch {} revealed before all of it was drawn",
            r.generation
        );
    }
    Ok(())
}

async fn run(env: &TestEnv, n: usize, case: Case) -> Result<(), TestCaseError> {
    let id = format!("p{n}");
    let keys = env.keys(&id);
    let day = prizepool::scripts::utc_day();
    let (config, table) = load(env, &id, &case).await;
    let one_batch = batch_codes(&config, &table);
    let mut batches = 1u64;
    let mut drawn: BTreeMap<u32, u64> = BTreeMap::new();
    let mut redis = env.redis.clone();
    let mut version = 1;
    let mut fair = Fair::default();
    let mut jackpot_min = case.jackpot_min;
    for (i, count) in case.counts.iter().enumerate() {
        if let Some(reloaded_min) = case.reloads.get(i).copied().flatten() {
            jackpot_min = reloaded_min;
            // A reload with another jackpot rule: prizes parked under the
            // old one are sorted anew, none created or lost (checked below).
            version += 1;
            let reloaded = Case {
                jackpot_min,
                ..case.clone()
            };
            let config = lucky_gift::parse_file(&toml(&id, &reloaded))
                .unwrap()
                .remove(0);
            lucky_gift::configure(&mut redis, &keys, &config, version, &table)
                .await
                .unwrap();
        }
        let before = snapshot(env, &keys, &day).await;
        let status_before = env.status(&id).await;
        let rid = format!("{id}-r{i}");
        let step = lucky_gift::draw_once(
            &mut redis,
            &keys,
            case.storage,
            &rid,
            *count,
            600,
            &env.tokens("rq", &rid).answer,
        )
        .await
        .unwrap();
        let after = snapshot(env, &keys, &day).await;
        let status = env.status(&id).await;
        match &step {
            DrawStep::Drawn(d) => {
                prop_assert_eq!(d.codes.len() as u32, *count);
                check_positions(env, &id, &config, &table, d, jackpot_min, &mut fair).await?;
                prop_assert_eq!(status.drawn, status_before.drawn + u64::from(*count));
                for c in &d.codes {
                    *drawn.entry(*c).or_default() += 1;
                }
                // The answer is remembered: the same request replays it.
                let again = lucky_gift::draw_once(
                    &mut redis,
                    &keys,
                    case.storage,
                    &rid,
                    *count,
                    600,
                    &env.tokens("rq", &rid).answer,
                )
                .await
                .unwrap();
                prop_assert_eq!(again, DrawStep::Replayed(d.clone()));
            }
            DrawStep::Short { .. } | DrawStep::TooMany { .. } => {
                prop_assert_eq!(&before, &after, "a refused step changed the pool");
                // A short pool gets its next batch, as the refill worker would.
                if matches!(step, DrawStep::Short { .. }) {
                    stock(env, &id, &config, &table, status.generation).await;
                    batches += 1;
                }
            }
            other => prop_assert!(false, "unexpected {other:?}"),
        }
        // Conservation, exactly: stocked = drawn + in the pool, prize by prize.
        let status = env.status(&id).await;
        prop_assert_eq!(status.stocked, status.drawn + status.in_pool);
        prop_assert_eq!(status.stocked, batches * one_batch.values().sum::<u64>());
        if case.storage == Storage::List {
            let mut in_pool: BTreeMap<u32, u64> = BTreeMap::new();
            for list in [keys.queue(), keys.held()] {
                let items: Vec<String> = redis::cmd("LRANGE")
                    .arg(&list)
                    .arg(0)
                    .arg(-1)
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                for item in items {
                    let code = item
                        .split(['f', ':'])
                        .next()
                        .unwrap()
                        .parse::<u32>()
                        .unwrap();
                    *in_pool.entry(code).or_default() += 1;
                }
            }
            for (code, n) in &one_batch {
                prop_assert_eq!(
                    drawn.get(code).copied().unwrap_or(0) + in_pool.get(code).copied().unwrap_or(0),
                    n * batches,
                    "code {}",
                    code
                );
            }
        }
    }
    Ok(())
}

#[test]
fn draw_steps_complete_or_change_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let env = rt.block_on(TestEnv::new(&[]));
    let n = std::sync::atomic::AtomicUsize::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 24,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&case(), |case| {
            let n = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            rt.block_on(run(&env, n, case))
        })
        .unwrap();
}

/// A gated draw that walks a run of 9,000 jackpots (past Lua's `unpack`
/// limit of about 8,000 values) completes in both storages: the jackpots
/// wait in `held`, nothing is lost, and later draws still work.
#[test]
fn a_gated_draw_walks_a_long_jackpot_run() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let env = rt.block_on(TestEnv::new(&[]));
    for (n, storage) in [Storage::List, Storage::Sparse].into_iter().enumerate() {
        let case = Case {
            storage,
            // A combo of 9,000 jackpots and one of 5 zeros, in random order:
            // either the first draw walks the whole jackpot run into `held`,
            // or the second one walks it and puts it back.
            combos: vec![vec![(500, 9_000)], vec![(0, 5)]],
            jackpot_min: 500,
            threshold: 1 << 52,
            counts: vec![],
            reloads: vec![],
        };
        rt.block_on(async {
            let id = format!("long{n}");
            let (_config, table) = load(&env, &id, &case).await;
            let keys = env.keys(&id);
            let mut redis = env.redis.clone();
            let step = lucky_gift::draw_once(
                &mut redis,
                &keys,
                storage,
                "all-zeros",
                5,
                600,
                &env.tokens("rq", "all-zeros").answer,
            )
            .await
            .unwrap();
            let DrawStep::Drawn(d) = step else {
                panic!("{storage:?}: {step:?}")
            };
            assert_eq!(d.codes.len(), 5);
            let s = env.status(&id).await;
            assert!([0, 9_000].contains(&s.held_jackpots), "{storage:?}: {s:?}");
            assert_eq!((s.drawn, s.in_pool), (5, 9_000), "{storage:?}");
            let held = s.held_jackpots;
            // Gated and nothing winnable left: short, and nothing moves.
            let step = lucky_gift::draw_once(
                &mut redis,
                &keys,
                storage,
                "gated",
                1,
                600,
                &env.tokens("rq", "gated").answer,
            )
            .await
            .unwrap();
            assert!(matches!(step, DrawStep::Short { .. }), "{step:?}");
            let s = env.status(&id).await;
            assert_eq!((s.held_jackpots, s.drawn, s.in_pool), (held, 5, 9_000));
            // A reload that makes 500x no jackpot frees the whole run at
            // once, however long `held` is.
            let freed = Case {
                jackpot_min: 1000,
                ..case.clone()
            };
            let config = lucky_gift::parse_file(&toml(&id, &freed))
                .unwrap()
                .remove(0);
            lucky_gift::configure(&mut redis, &keys, &config, 2, &table)
                .await
                .unwrap();
            let step = lucky_gift::draw_once(
                &mut redis,
                &keys,
                storage,
                "freed",
                1000,
                600,
                &env.tokens("rq", "freed").answer,
            )
            .await
            .unwrap();
            assert!(matches!(step, DrawStep::Drawn(_)), "{storage:?}: {step:?}");
            let s = env.status(&id).await;
            assert_eq!((s.drawn, s.in_pool), (1_005, 8_000), "{storage:?}");
            assert_eq!(s.stocked, s.drawn + s.in_pool);
        });
    }
}

/// Copies every key of pool `from` to pool `to` (the same state under
/// another hash tag).
async fn copy_pool(env: &TestEnv, from: &str, to: &str) {
    let mut redis = env.redis.clone();
    let prefix = &env.config.redis_prefix;
    let pattern = format!("{prefix}:{{{from}}}:*");
    let names: Vec<String> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut redis)
        .await
        .unwrap();
    for name in names {
        let dump: Vec<u8> = redis::cmd("DUMP")
            .arg(&name)
            .query_async(&mut redis)
            .await
            .unwrap();
        let target = name.replacen(&format!("{{{from}}}"), &format!("{{{to}}}"), 1);
        let _: () = redis::cmd("RESTORE")
            .arg(&target)
            .arg(0)
            .arg(dump)
            .arg("REPLACE")
            .query_async(&mut redis)
            .await
            .unwrap();
    }
}

/// One Lua call applying many draws of a pool answers each exactly as one
/// call per draw does, in order, from the same state, and leaves the same
/// state: the jackpot gate counts each draw's consumption in turn, a refill
/// point is taken once, and a short or too-large draw in the middle changes
/// nothing while the draws after it go on.
async fn coalesced(env: &TestEnv, n: usize, case: Case) -> Result<(), TestCaseError> {
    let (one, many) = (format!("one{n}"), format!("many{n}"));
    let day = prizepool::scripts::utc_day();
    load(env, &one, &case).await;
    copy_pool(env, &one, &many).await;
    let mut redis = env.redis.clone();
    let mut singles = Vec::new();
    let mut pending = Vec::new();
    for (i, count) in case.counts.iter().enumerate() {
        let rid = format!("{one}-r{i}");
        let token = env.tokens("rq", &rid).answer;
        singles.push(
            lucky_gift::draw_once(
                &mut redis,
                &env.keys(&one),
                case.storage,
                &rid,
                *count,
                600,
                &token,
            )
            .await
            .unwrap(),
        );
        pending.push(lucky_gift::Pending {
            request_id: rid,
            count: *count,
            result_ttl_s: 600,
            token,
        });
    }
    let steps = lucky_gift::draw_many(
        &mut redis,
        lucky_gift::draw_script(case.storage),
        &env.keys(&many),
        case.storage,
        &pending,
    )
    .await
    .unwrap();
    prop_assert_eq!(steps.len(), singles.len());
    for (step, single) in steps.into_iter().zip(&singles) {
        prop_assert_eq!(&step.unwrap(), single);
    }
    prop_assert_eq!(
        snapshot(env, &env.keys(&one), &day).await,
        snapshot(env, &env.keys(&many), &day).await
    );
    Ok(())
}

#[test]
fn a_coalesced_call_draws_exactly_what_one_call_per_draw_draws() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let env = rt.block_on(TestEnv::new(&[]));
    let n = std::sync::atomic::AtomicUsize::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 24,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&case(), |case| {
            let n = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            rt.block_on(coalesced(&env, n, case))
        })
        .unwrap();
}
