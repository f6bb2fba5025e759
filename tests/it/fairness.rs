//! The fair shuffle (`src/fairness.rs`) against an independent
//! implementation of `docs/fairness.md` (`scripts/fairness-reference.py`):
//! both must derive the same commitment, key, shuffles and lucky-gift
//! batches from the same seeds, for random seeds, contexts and sizes.
#![allow(clippy::unwrap_used)]

use prizepool::fairness::{lucky_gift_batch, lucky_gift_context, Seed};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

fn reference(args: &[&str]) -> Value {
    let out = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/fairness-reference.py"
        ))
        .args(args)
        .output()
        .expect("python3 runs the reference implementation");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn shuffles_match_an_independent_implementation() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(20261124);
    for n in [0usize, 1, 2, 3, 17, 1000] {
        let seed = Seed(rng.random());
        let context = format!("ctx\n{}\u{00e9}", rng.random::<u32>());
        let mut items: Vec<usize> = (0..n).collect();
        seed.stream(&context).shuffle(&mut items);
        let theirs = reference(&[&seed.to_hex(), &context, &n.to_string()]);
        assert_eq!(theirs["commitment"], seed.commitment());
        assert_eq!(theirs["shuffle"], json!(items), "n = {n}");
    }
}

#[test]
fn lucky_gift_batches_match_an_independent_implementation() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for round in 0..4u64 {
        let seed = Seed(rng.random());
        let combos: Vec<Vec<(u64, u64)>> = (0..rng.random_range(1..6))
            .map(|_| {
                (0..rng.random_range(1..5))
                    .map(|_| (rng.random_range(0..1000), rng.random_range(0..40)))
                    .collect()
            })
            .collect();
        let (generation, version) = (round * 13 + 1, round as i64 + 2);
        let ours = lucky_gift_batch(
            &mut seed.stream(&lucky_gift_context("pool-x", generation, version)),
            &combos,
        );
        let theirs = reference(&[
            &seed.to_hex(),
            "pool-x",
            &generation.to_string(),
            &version.to_string(),
            &json!(combos).to_string(),
        ]);
        assert_eq!(theirs, json!(ours), "round {round}");
    }
}

use crate::common;

use std::{collections::BTreeMap, time::Duration};

use common::{pool_toml, TestEnv};
use prizepool::{
    audit,
    kinds::{
        answer::Tokens,
        lucky_gift::{self, Batch, CodeTable, PoolConfig},
        Ask, Kinds, Step,
    },
};

/// A pool of three combos with one distinguished prize each, so the
/// positions of those prizes and the order of the combos can be counted.
fn stats_config() -> PoolConfig {
    let text = pool_toml(
        "stat",
        "refill_at = 0.5",
        &[
            ("a", &[(0, 9), (7, 1)]),
            ("b", &[(0, 4), (3, 1)]),
            ("c", &[(0, 2), (5, 1), (50, 2)]),
        ],
    );
    lucky_gift::parse_file(&text).unwrap().remove(0)
}

/// Batch `g` of the stats pool, shuffled from seed `seed`, as (combo id,
/// multiplier) per position.
fn batch_of(config: &PoolConfig, table: &CodeTable, seed: &Seed, g: u64) -> Vec<(String, u64)> {
    let mut stream = seed.stream(&lucky_gift_context(&config.id, g, 1));
    Batch::build_fair(config, table, &mut stream)
        .codes
        .iter()
        .map(|c| {
            let (combo, m) = table.decode(*c).unwrap();
            (combo.to_owned(), m)
        })
        .collect()
}

/// Pearson's statistic of `observed` counts against equal expectations.
fn chi_square_uniform(observed: &[u64]) -> f64 {
    let total: u64 = observed.iter().sum();
    let expected = total as f64 / observed.len() as f64;
    observed
        .iter()
        .map(|&o| (o as f64 - expected).powi(2) / expected)
        .sum()
}

/// Pearson's statistic of independence of a contingency table.
fn chi_square_independence(table: &[Vec<u64>]) -> f64 {
    let total: u64 = table.iter().flatten().sum();
    let rows: Vec<u64> = table.iter().map(|r| r.iter().sum()).collect();
    let cols: Vec<u64> = (0..table[0].len())
        .map(|j| table.iter().map(|r| r[j]).sum())
        .collect();
    let mut chi2 = 0.0;
    for (i, row) in table.iter().enumerate() {
        for (j, &o) in row.iter().enumerate() {
            let e = rows[i] as f64 * cols[j] as f64 / total as f64;
            chi2 += (o as f64 - e).powi(2) / e;
        }
    }
    chi2
}

// Upper 0.001 quantiles of the chi-square distribution (tables; the last by
// the Wilson-Hilferty approximation). The seeds are fixed, so each
// statistic is one number that either passes or fails, every run.
const CHI2_999_DF5: f64 = 20.515;
const CHI2_999_DF9: f64 = 27.877;
const CHI2_999_DF81: f64 = 126.2;

/// The statistics of a run of batches: (combo-order counts over the six
/// orders, position counts of the 7x prize inside combo `a`, contingency
/// of that position between consecutive batches).
fn batch_statistics(batches: &[Vec<(String, u64)>]) -> (Vec<u64>, Vec<u64>, Vec<Vec<u64>>) {
    let mut orders: BTreeMap<String, u64> = BTreeMap::new();
    let mut positions = vec![0u64; 10];
    let mut pairs = vec![vec![0u64; 10]; 10];
    let mut previous: Option<usize> = None;
    for batch in batches {
        let mut order = String::new();
        for (combo, _) in batch {
            if !order.ends_with(combo.as_str()) {
                order.push_str(combo);
            }
        }
        *orders.entry(order).or_default() += 1;
        let start = batch.iter().position(|(c, _)| c == "a").unwrap();
        let at = batch[start..].iter().position(|p| p.1 == 7).unwrap();
        positions[at] += 1;
        if let Some(p) = previous {
            pairs[p][at] += 1;
        }
        previous = Some(at);
    }
    let mut order_counts: Vec<u64> = orders.into_values().collect();
    order_counts.resize(6, 0);
    (order_counts, positions, pairs)
}

fn fails_a_test(batches: &[Vec<(String, u64)>]) -> Vec<&'static str> {
    let (orders, positions, pairs) = batch_statistics(batches);
    let mut failed = Vec::new();
    if chi_square_uniform(&orders) >= CHI2_999_DF5 {
        failed.push("combo order");
    }
    if chi_square_uniform(&positions) >= CHI2_999_DF9 {
        failed.push("prize position");
    }
    // A table with an empty row or column is as dependent as it gets.
    let degenerate = pairs.iter().any(|r| r.iter().sum::<u64>() == 0)
        || (0..10).any(|j| pairs.iter().map(|r| r[j]).sum::<u64>() == 0);
    if degenerate || chi_square_independence(&pairs) >= CHI2_999_DF81 {
        failed.push("independence");
    }
    failed
}

/// Over many committed batches (a fresh seed each, as the refill worker
/// draws them; here from a fixed generator so the run is reproducible):
/// every batch pays exactly the configured return; the combo order, the
/// prize positions and consecutive batches pass chi-square tests. The same
/// tests catch a batch that is sorted and a seed that is reused.
#[test]
fn committed_batches_pay_exactly_and_pass_chi_square_tests() {
    let config = stats_config();
    let table = CodeTable::extend(None, &config);
    let configured: u64 = config
        .combos
        .iter()
        .flat_map(|c| c.stock.iter().map(|(m, n)| m * n))
        .sum();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let n = 6000u64;
    let batches: Vec<Vec<(String, u64)>> = (1..=n)
        .map(|g| batch_of(&config, &table, &Seed(rng.random()), g))
        .collect();
    for (g, batch) in batches.iter().enumerate() {
        let paid: u64 = batch.iter().map(|p| p.1).sum();
        assert_eq!(paid, configured, "batch {}", g + 1);
        assert_eq!(batch.len() as u64, config.batch_size());
    }
    assert_eq!(fails_a_test(&batches), Vec::<&str>::new());

    // Mutations the tests must catch. A sorted batch:
    let sorted: Vec<Vec<(String, u64)>> = batches
        .iter()
        .map(|b| {
            let mut b = b.clone();
            b.sort();
            b
        })
        .collect();
    assert!(fails_a_test(&sorted).contains(&"prize position"));
    // One seed reused for every batch (with the same context).
    let seed = Seed(rng.random());
    let reused: Vec<Vec<(String, u64)>> = (1..=n)
        .map(|_| batch_of(&config, &table, &seed, 1))
        .collect();
    assert!(fails_a_test(&reused).contains(&"independence"));
}

/// Draws `count` from `pool` straight through the seam (no broker) and
/// records the result in the audit trail as the audit consumer would.
async fn draw_and_record(env: &TestEnv, kinds: &Kinds, pool: &str, n: usize, count: u32) -> Step {
    let request_id = format!("{pool}-{n}");
    let fingerprint = prizepool::kinds::fingerprint("draw", &[&pool, &1i64, &count]);
    let ttl = env.config.result_ttl.as_secs();
    let tokens = Tokens::new(
        &env.config.redis_prefix,
        "rq",
        &request_id,
        fingerprint,
        ttl,
    );
    let ask = Ask {
        request_id: &request_id,
        pool,
        user: 1,
        count,
        token: &tokens.answer,
        result_ttl_s: ttl,
    };
    let kind = kinds.resolve(pool).await.unwrap().unwrap();
    let step = kinds.draw(kind, &ask).await.unwrap();
    if let Step::Awarded(award) = &step {
        // The stored answer holds what the reply says (the audit consumer
        // trusts a record by its seal, `draw_records_need_the_fleets_seal…`).
        let mut redis = env.redis.clone();
        let stored = lucky_gift::stored_award(
            &mut redis,
            &env.scripts,
            &env.config.redis_prefix,
            &env.keys(pool),
            pool,
            &request_id,
            1,
            count,
            ttl,
        )
        .await
        .unwrap()
        .expect("the answer is stored");
        assert_eq!(Some(stored.serial), award.result.serial);
        assert_eq!(stored.positions, award.result.positions);
        audit::record_draw(&env.db, &award.result).await.unwrap();
    }
    step
}

/// Stocks the batch after `trigger` as the refill worker does (the
/// commitment recorded in Postgres first).
async fn refill(env: &TestEnv, pool: &str, trigger: u64) {
    let mut redis = env.redis.clone();
    let keys = env.keys(pool);
    let (version, config, table) = lucky_gift::stored_config(&mut redis, &keys)
        .await
        .unwrap()
        .unwrap();
    let recorder = audit::PgRecorder::new(&env.db);
    let outcome = lucky_gift::stock_committed(
        &mut redis, &keys, &config, version, &table, trigger, 500, 30_000, "test", &recorder,
    )
    .await
    .unwrap();
    assert!(
        matches!(outcome, lucky_gift::StockOutcome::Stocked { .. }),
        "{outcome:?}"
    );
}

/// Draws batch 1 of `pool` to its end, 8 prizes a draw (refilling at its
/// refill point), which reveals it; answers the draws' results in order.
async fn use_up_batch_one(
    env: &TestEnv,
    kinds: &Kinds,
    pool: &str,
) -> Vec<prizepool::messages::DrawResult> {
    use_up_batch_one_by(env, kinds, pool, 8).await
}

/// [`use_up_batch_one`], `count` prizes a draw.
async fn use_up_batch_one_by(
    env: &TestEnv,
    kinds: &Kinds,
    pool: &str,
    count: u32,
) -> Vec<prizepool::messages::DrawResult> {
    let mut results = Vec::new();
    for n in 0..40 {
        match draw_and_record(env, kinds, pool, n, count).await {
            Step::Awarded(a) => {
                if let Some(r) = &a.refill {
                    refill(env, pool, r.trigger).await;
                }
                let revealed = a.result.revealed.iter().any(|r| r.generation == 1);
                results.push(a.result);
                if revealed {
                    return results;
                }
            }
            other => panic!("{other:?}"),
        }
    }
    panic!("batch 1 of {pool} was never revealed");
}

/// The request id of the first draw in `results` (8 prizes each, from
/// position 0 of batch 1) whose prizes are not the ones `seed` puts there.
fn first_unfair(
    results: &[prizepool::messages::DrawResult],
    seed: &str,
    pool: &str,
) -> Option<String> {
    let composition = lucky_gift::composition(
        &lucky_gift::parse_file(&pool_toml(pool, "refill_at = 0.5\nmax_count = 100", SMALL))
            .unwrap()[0],
    );
    let order = prizepool::fairness::lucky_gift_order(
        &Seed::from_hex(seed).unwrap(),
        pool,
        1,
        1,
        &composition,
    );
    results.iter().enumerate().find_map(|(n, r)| {
        let got: Vec<(String, u64)> = r
            .prizes
            .iter()
            .map(|p| match p {
                prizepool::messages::Prize::Multiplier { multiplier, combo } => {
                    (combo.clone(), *multiplier)
                }
                other => panic!("{other:?}"),
            })
            .collect();
        (got[..] != order[8 * n..8 * n + 8]).then(|| r.request_id.clone())
    })
}

const SMALL: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 30), (1, 10), (5, 5)]),
    ("b", &[(0, 20), (2, 10), (10, 5)]),
];

/// A batch sorted in Redis before it is drawn is caught by the verifier,
/// at the first draw that got a prize the seed did not put there; a seed
/// used for a second batch is caught too.
#[tokio::test]
async fn a_sorted_batch_and_a_reused_seed_are_caught() {
    let env = TestEnv::new(&[]).await;
    let kinds = Kinds::new(env.redis.clone(), &env.config.redis_prefix);
    let mut redis = env.redis.clone();
    for pool in ["honest", "sorted", "reused"] {
        env.load(&pool_toml(pool, "refill_at = 0.5\nmax_count = 100", SMALL))
            .await;
    }
    // Sort batch 1 of "sorted" in place (flags stay where they were).
    let q = env.keys("sorted").queue();
    let items: Vec<String> = redis::cmd("LRANGE")
        .arg(&q)
        .arg(0)
        .arg(-1)
        .query_async(&mut redis)
        .await
        .unwrap();
    let mut codes: Vec<u32> = items
        .iter()
        .map(|i| i.split('f').next().unwrap().parse().unwrap())
        .collect();
    codes.sort();
    for (i, item) in items.iter().enumerate() {
        let flag = item.find('f').map(|at| &item[at..]).unwrap_or("");
        redis::cmd("LSET")
            .arg(&q)
            .arg(i)
            .arg(format!("{}{flag}", codes[i]))
            .query_async::<()>(&mut redis)
            .await
            .unwrap();
    }
    use_up_batch_one(&env, &kinds, "honest").await;
    let results = use_up_batch_one(&env, &kinds, "sorted").await;
    let honest = audit::verify(&env.db, "honest", Some(1)).await.unwrap();
    assert!(honest.ok, "{honest:?}");
    assert_eq!(honest.batches[0].status, "ok");
    assert!(honest.batches[0].complete, "{honest:?}");
    assert_eq!(honest.batches[0].prizes_checked, 80);
    // Ordinary draws (one run of one batch each) are recorded lean: their
    // run and the SHA-256 of their prizes, no value per prize.
    let (lean, all): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE prizes IS NULL AND length(prizes_sha256) = 32), count(*)
         FROM fair_draws WHERE pool = 'honest'",
    )
    .fetch_one(&env.db)
    .await
    .unwrap();
    assert_eq!((lean, all), (10, 10));
    let sorted = audit::verify(&env.db, "sorted", Some(1)).await.unwrap();
    assert!(!sorted.ok, "{sorted:?}");
    let m = sorted.batches[0].first_mismatch.clone().unwrap();
    let seed = sorted.batches[0].seed.clone().unwrap();
    let expected = first_unfair(&results, &seed, "sorted");
    assert!(expected.is_some(), "the sorted batch is the fair one");
    assert_eq!(m.request_id, expected, "{m:?}");

    // The same verdicts from the command line, and the reveal in `pool status`.
    let out = env
        .cli(&["audit", "verify", "sorted", "--generation", "1", "--json"])
        .await;
    assert_eq!(out.status.code(), Some(1));
    let verdict: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        verdict["batches"][0]["first_mismatch"]["request_id"],
        json!(expected)
    );
    let out = env.cli(&["audit", "verify", "honest"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("batch 1: ok") && text.contains("verdict: ok"),
        "{text}"
    );
    let out = env.cli(&["pool", "status", "honest"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!(
            "last revealed  batch 1 (config v1): seed = {}",
            honest.batches[0].seed.clone().unwrap()
        )),
        "{text}"
    );
    assert!(text.contains("committed      batch 2"), "{text}");

    // "reused": batch 2 is stocked with batch 1's seed.
    use_up_batch_one(&env, &kinds, "reused").await;
    let first = audit::verify(&env.db, "reused", Some(1)).await.unwrap();
    assert!(first.ok, "{first:?}");
    let seed = first.batches[0].seed.clone().unwrap();
    let meta = env.keys("reused").meta();
    let s = env.status("reused").await;
    let g = s.generation;
    // Make the next batch due and plant the old seed as its pending seed.
    redis::cmd("HSET")
        .arg(&meta)
        .arg("due")
        .arg(g)
        .arg("fair_next")
        .arg(format!("{}|{seed}", g + 1))
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
    refill(&env, "reused", g).await;
    let again = audit::verify(&env.db, "reused", Some(1)).await.unwrap();
    assert!(!again.ok, "{again:?}");
    let reason = again.batches[0].first_mismatch.clone().unwrap().reason;
    assert!(reason.contains("reused"), "{reason}");
}

/// A draw across a batch boundary keeps its full record (its runs and
/// prizes), the others the lean one; the verifier reads both, and checks
/// every prize of the batch either way.
#[tokio::test]
async fn a_draw_across_a_batch_boundary_keeps_its_full_record() {
    let env = TestEnv::new(&[]).await;
    let kinds = Kinds::new(env.redis.clone(), &env.config.redis_prefix);
    env.load(&pool_toml(
        "edge",
        "refill_at = 0.5\nmax_count = 100",
        SMALL,
    ))
    .await;
    // 7 prizes a draw: the 12th takes positions 77..79 of batch 1 and
    // 0..3 of batch 2.
    let results = use_up_batch_one_by(&env, &kinds, "edge", 7).await;
    let crossing: Vec<&str> = results
        .iter()
        .filter(|r| r.positions.len() > 1)
        .map(|r| r.request_id.as_str())
        .collect();
    assert_eq!(crossing.len(), 1, "{results:?}");
    let full: Vec<String> = sqlx::query_scalar(
        "SELECT request_id FROM fair_draws
         WHERE pool = 'edge' AND prizes IS NOT NULL AND positions IS NOT NULL AND generation IS NULL",
    )
    .fetch_all(&env.db)
    .await
    .unwrap();
    assert_eq!(full, crossing);
    let (lean,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM fair_draws WHERE pool = 'edge' AND prizes IS NULL")
            .fetch_one(&env.db)
            .await
            .unwrap();
    assert_eq!(lean as usize, results.len() - 1);
    let verdict = audit::verify(&env.db, "edge", None).await.unwrap();
    assert!(verdict.ok, "{verdict:?}");
    let first = &verdict.batches[0];
    assert_eq!((first.generation, first.status), (1, "ok"), "{verdict:?}");
    assert!(first.complete, "{verdict:?}");
    assert_eq!(first.prizes_checked, 80);
    assert_eq!(first.draws_checked as usize, results.len());
    assert_eq!(verdict.batches[1].status, "unrevealed", "{verdict:?}");
}

/// The positions a draw reply names, prize by prize: (generation, position).
fn positions_of(reply: &Value) -> Vec<(u64, u64)> {
    reply["positions"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|run| {
            let g = run["generation"].as_u64().unwrap();
            let p = run["position"].as_u64().unwrap();
            (p..p + run["count"].as_u64().unwrap()).map(move |p| (g, p))
        })
        .collect()
}

/// Through the whole fleet: every reply names its prizes' positions, the
/// audit consumer records the commitments, draws and reveals, and the
/// verifier accepts the honest batch and names the first draw of a batch
/// whose prizes were swapped in Redis before they were drawn.
#[tokio::test]
async fn the_verifier_names_the_first_draw_of_a_tampered_batch() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "fair",
        "refill_at = 0.5\nmax_count = 100",
        SMALL,
    ))
    .await;
    env.start_fleet().await;
    // The settle worker is ready before its audit consumer has bound the
    // audit queue (it does so beside it): an event published before the
    // binding reaches no audit queue, so the first draw waits for it.
    wait_for_audit_consumer(&env).await;
    let client = env.client().await;
    let call = |i: i64| {
        let client = &client;
        async move {
            let reply = client
                .call(
                    "draw",
                    &common::draw("fair", i, 10),
                    Duration::from_secs(10),
                )
                .await
                .unwrap();
            assert_eq!(reply["status"], "ok", "{reply}");
            assert_eq!(positions_of(&reply).len(), 10, "{reply}");
            reply
        }
    };
    // Past batch 1's refill point: batch 2 is committed and stocked.
    let mut replies = Vec::new();
    for i in 0..4 {
        replies.push(call(i).await);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while env.status("fair").await.generation < 2 {
        assert!(tokio::time::Instant::now() < deadline, "batch 2 never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Batch 2 sits behind the 40 prizes left of batch 1: swap two of its
    // prizes that differ (neither the refill flag).
    let mut redis = env.redis.clone();
    let q = env.keys("fair").queue();
    let items: Vec<String> = redis::cmd("LRANGE")
        .arg(&q)
        .arg(40)
        .arg(119)
        .query_async(&mut redis)
        .await
        .unwrap();
    let i = (0..80).find(|&i| !items[i].contains('f')).unwrap();
    let j = (i + 1..80)
        .find(|&j| !items[j].contains('f') && items[j] != items[i])
        .unwrap();
    for (at, value) in [(i, &items[j]), (j, &items[i])] {
        redis::cmd("LSET")
            .arg(&q)
            .arg(40 + at)
            .arg(value)
            .query_async::<()>(&mut redis)
            .await
            .unwrap();
    }
    // Draw batch 2 to its end and into batch 3 (which reveals batch 2).
    for k in 4..17 {
        replies.push(call(k).await);
    }
    let tampered = replies
        .iter()
        .find(|r| positions_of(r).contains(&(2, i as u64)))
        .map(|r| r["request_id"].as_str().unwrap().to_owned());
    assert!(tampered.is_some());
    let revealed: Vec<u64> = replies
        .iter()
        .flat_map(|r| r["revealed"].as_array().cloned().unwrap_or_default())
        .map(|r| r["generation"].as_u64().unwrap())
        .collect();
    assert_eq!(revealed, vec![1, 2]);
    // The audit consumer records asynchronously: wait for all 17 draws.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (draws,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM fair_draws WHERE pool = 'fair'")
                .fetch_one(&env.db)
                .await
                .unwrap();
        let (reveals,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM fair_reveals WHERE pool = 'fair'")
                .fetch_one(&env.db)
                .await
                .unwrap();
        if draws == 17 && reveals == 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "audit trail: {draws} draws, {reveals} reveals"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let verdict = audit::verify(&env.db, "fair", None).await.unwrap();
    assert!(!verdict.ok);
    let by_generation: BTreeMap<u64, &audit::BatchVerdict> =
        verdict.batches.iter().map(|b| (b.generation, b)).collect();
    assert_eq!(by_generation[&1].status, "ok", "{verdict:?}");
    assert!(by_generation[&1].complete);
    assert_eq!(by_generation[&2].status, "mismatch");
    let m = by_generation[&2].first_mismatch.clone().unwrap();
    assert_eq!(m.request_id, tampered, "{m:?}");
    // The draw is an ordinary one (one run of one batch), recorded by the
    // SHA-256 of its prizes rather than the prizes: the verifier names it
    // and the positions of its run, `i` among them, not the prize.
    let tampered_positions: Vec<u64> = replies
        .iter()
        .find(|r| r["request_id"].as_str() == tampered.as_deref())
        .map(|r| positions_of(r).into_iter().map(|(_, p)| p).collect())
        .unwrap();
    let (first, last) = (tampered_positions[0], *tampered_positions.last().unwrap());
    assert!((first..=last).contains(&(i as u64)));
    assert!(
        m.reason.contains(&format!("positions {first} to {last}")) && m.reason.contains("SHA-256"),
        "{m:?}"
    );
    assert_eq!(m.position, None, "{m:?}");
    // Batch 3 is committed (recorded before it was visible) and secret.
    assert_eq!(by_generation[&3].status, "unrevealed");
    let state = lucky_gift::fair_state(&mut redis, &env.keys("fair"))
        .await
        .unwrap();
    assert!(state
        .committed
        .iter()
        .any(|(g, _, c)| *g == 3 && Some(c) == by_generation[&3].commitment.as_ref()));

    // Anyone who may publish on the events exchange cannot write the trail:
    // a draw that never happened and a commitment to another seed are
    // dead-lettered, not recorded.
    let conn = prizepool::amqp::connect(&env.config.amqp_url, "forger")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let seed = Seed([3; 32]);
    let forged = [
        (
            "draw.completed",
            json!({"type": "draw.completed", "request_id": "forged-1", "status": "ok",
            "pool": "fair", "user_id": 9, "prizes": [{"multiplier": 10, "combo": "b"}], "serial": 9999,
            "version": 1, "positions": [{"generation": 3, "position": 0, "count": 1}]}),
        ),
        (
            "pool.refilled",
            json!({"type": "pool.refilled", "pool": "fair", "generation": 4, "size": 80,
            "version": 1, "urgent": false, "commitment": seed.commitment(),
            "composition": [{"combo": "a", "stock": [[0, 30], [1, 10], [5, 5]]},
                            {"combo": "b", "stock": [[0, 20], [2, 10], [10, 5]]}]}),
        ),
    ];
    // A draw record needs the fleet's seal over exactly its content: one
    // with a seal of another key, and a real draw's record sealed with the
    // fleet's key but with one field changed afterwards, go the same way.
    let sealer = fleet_sealer(&env).await;
    let mut wrong_seal = forged[0].1.clone();
    wrong_seal["seal"] = json!(prizepool::ledger::Sealer::new("not the fleet's key")
        .seal_record(&record_bytes(&wrong_seal)));
    let mut changed = replies[0].clone();
    changed["type"] = json!("draw.completed");
    changed["seal"] = json!(sealer.seal_record(&record_bytes(&changed)));
    changed["user_id"] = json!(changed["user_id"].as_i64().unwrap() + 1);
    let forged = [
        forged[0].clone(),
        forged[1].clone(),
        ("draw.completed", wrong_seal),
        ("draw.completed", changed),
    ];
    for (key, body) in &forged {
        channel
            .basic_publish(
                prizepool::amqp::EVENTS.into(),
                (*key).into(),
                Default::default(),
                body.to_string().as_bytes(),
                lapin::BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while env.queue_depth(audit::ROUTE.dlq).await < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "forged events not dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (forged_rows,): (i64,) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM fair_draws WHERE request_id = 'forged-1')
              + (SELECT count(*) FROM fair_batches WHERE pool = 'fair' AND generation = 4)",
    )
    .fetch_one(&env.db)
    .await
    .unwrap();
    assert_eq!(forged_rows, 0);
    // The changed record did not replace the real one (nor add a row).
    let (users,): (Vec<i64>,) = sqlx::query_as(
        "SELECT array_agg(user_id) FROM fair_draws WHERE pool = 'fair' AND request_id = $1",
    )
    .bind(replies[0]["request_id"].as_str().unwrap())
    .fetch_one(&env.db)
    .await
    .unwrap();
    assert_eq!(users, vec![replies[0]["user_id"].as_i64().unwrap()]);

    // The audit's dead letters are listed with their reasons, and a replay
    // takes them back to the audit queue alone: a consumer of the events
    // exchange sees none of them again.
    let spy = "spy.draw.completed";
    channel
        .queue_declare(spy.into(), Default::default(), Default::default())
        .await
        .unwrap();
    channel
        .queue_bind(
            spy.into(),
            prizepool::amqp::EVENTS.into(),
            "draw.completed".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let letters = prizepool::amqp::dlq::list(&conn, audit::ROUTE, 10)
        .await
        .unwrap();
    assert_eq!(letters.len(), 4, "{letters:?}");
    assert!(letters.iter().all(|l| !l.reason.is_empty()), "{letters:?}");
    let report = tokio::time::timeout(
        Duration::from_secs(30),
        prizepool::amqp::dlq::replay(&conn, audit::ROUTE, usize::MAX, false),
    )
    .await
    .expect("the replay ends")
    .unwrap();
    assert_eq!(report.moved, 4, "{report:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while env.queue_depth(audit::ROUTE.dlq).await < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "replayed forgeries dead-lettered again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(env.queue_depth(spy).await, 0, "a replay is not an event");
    let (forged_rows,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM fair_draws WHERE request_id = 'forged-1'")
            .fetch_one(&env.db)
            .await
            .unwrap();
    assert_eq!(forged_rows, 0);
    let _ = conn.close(200, "bye".into()).await;
    env.stop_workers().await;
}

/// Waits until the audit queue exists and is consumed.
async fn wait_for_audit_consumer(env: &TestEnv) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let conn = prizepool::amqp::connect(&env.config.amqp_url, "test")
        .await
        .unwrap();
    loop {
        // A passive declare of a queue not declared yet closes its channel.
        let channel = conn.create_channel().await.unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let queue = channel
            .queue_declare(audit::ROUTE.queue.into(), passive, Default::default())
            .await;
        if queue.is_ok_and(|q| q.consumer_count() > 0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no audit consumer");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = conn.close(200, "bye".into()).await;
}

/// The fleet's seal key, as the workers of `env` load it.
async fn fleet_sealer(env: &TestEnv) -> prizepool::ledger::Sealer {
    let mut redis = env.redis.clone();
    prizepool::ledger::Sealer::load(&mut redis, &env.config.redis_prefix, None)
        .await
        .unwrap()
}

/// The canonical bytes of a draw record: its `DrawResult`, serialised.
fn record_bytes(event: &Value) -> Vec<u8> {
    let result: prizepool::messages::DrawResult = serde_json::from_value(event.clone()).unwrap();
    serde_json::to_vec(&result).unwrap()
}

/// The audit records a draw only under the fleet's seal over its exact
/// content (no Redis is asked): a record without a seal, with another
/// key's seal or with a field changed after sealing is refused, alone
/// (dead-lettered by the consumer) or inside a group (the others are
/// recorded); the sealed record is recorded once however often it comes.
#[tokio::test]
async fn draw_records_need_the_fleets_seal_over_their_exact_content() {
    let env = TestEnv::new(&[]).await;
    let kinds = Kinds::new(env.redis.clone(), &env.config.redis_prefix);
    env.load(&pool_toml(
        "sealed",
        "refill_at = 0.5\nmax_count = 100",
        SMALL,
    ))
    .await;
    let worker = audit::AuditWorker::new(
        env.db.clone(),
        env.redis.clone(),
        &env.config.redis_prefix,
        fleet_sealer(&env).await,
    );
    // Two real draws, sealed the way the draw worker seals their events.
    let draws_seal = prizepool::ledger::FleetSealer::default();
    let mut events = Vec::new();
    for n in 0..2 {
        let request_id = format!("sealed-{n}");
        let fingerprint = prizepool::kinds::fingerprint("draw", &[&"sealed", &1i64, &8u32]);
        let ttl = env.config.result_ttl.as_secs();
        let tokens = Tokens::new(
            &env.config.redis_prefix,
            "rq",
            &request_id,
            fingerprint,
            ttl,
        );
        let ask = Ask {
            request_id: &request_id,
            pool: "sealed",
            user: 1,
            count: 8,
            token: &tokens.answer,
            result_ttl_s: ttl,
        };
        let kind = kinds.resolve("sealed").await.unwrap().unwrap();
        let Step::Awarded(award) = kinds.draw(kind, &ask).await.unwrap() else {
            panic!("no award")
        };
        let fields = serde_json::to_vec(&award.result).unwrap();
        let event = audit::draw_completed(&draws_seal, &env.config, &fields);
        let event: Value = serde_json::from_slice(&event).unwrap();
        // The event is the reply but for its type and seal.
        let mut reply = event.clone();
        reply.as_object_mut().unwrap().remove("seal").unwrap();
        reply["type"] = json!("draw_result");
        assert_eq!(
            reply,
            prizepool::messages::with_type("draw_result", &award.result)
        );
        events.push(event);
    }
    let recorded = |request_id: &'static str| {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM fair_draws WHERE request_id = $1")
            .bind(request_id)
            .fetch_one(&env.db)
    };
    let refused = |result: Result<(), prizepool::amqp::HandleError>| {
        matches!(result, Err(prizepool::amqp::HandleError::Invalid(_)))
    };

    // Missing, of another key, not hex, or over other content: refused.
    let mut unsealed = events[0].clone();
    unsealed.as_object_mut().unwrap().remove("seal");
    let mut other_key = events[0].clone();
    other_key["seal"] =
        json!(prizepool::ledger::Sealer::new("upstream's guess")
            .seal_record(&record_bytes(&events[0])));
    let mut junk = events[0].clone();
    junk["seal"] = json!("not a seal");
    let mut forged = vec![unsealed, other_key, junk];
    for change in [
        ("user_id", json!(2)),
        ("serial", json!(events[0]["serial"].as_i64().unwrap() + 100)),
        ("request_id", json!("sealed-x")),
        ("version", json!(events[0]["version"].as_i64().unwrap() + 1)),
        ("reward", json!(1_000_000)),
    ] {
        let mut changed = events[0].clone();
        changed[change.0] = change.1;
        forged.push(changed);
    }
    let mut moved = events[0].clone();
    moved["positions"][0]["position"] =
        json!(moved["positions"][0]["position"].as_u64().unwrap() + 1);
    forged.push(moved);
    let mut renamed = events[0].clone();
    renamed["prizes"][0]["combo"] = json!("z");
    forged.push(renamed);
    for event in &forged {
        assert!(refused(worker.record(event).await), "{event}");
    }
    assert_eq!(recorded("sealed-0").await.unwrap(), 0);
    let (rows,): (i64,) = sqlx::query_as("SELECT count(*) FROM fair_draws")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(rows, 0);

    // The sealed record is recorded, once, alone or again in a group; the
    // bad records of a group are left out and the others recorded.
    worker.record(&events[0]).await.unwrap();
    assert_eq!(recorded("sealed-0").await.unwrap(), 1);
    let mut group: Vec<Value> = forged.clone();
    group.push(events[0].clone());
    group.push(events[1].clone());
    group.push(events[1].clone());
    worker
        .record(&json!({"type": "draw.completed.batch", "events": group}))
        .await
        .unwrap();
    assert_eq!(recorded("sealed-0").await.unwrap(), 1);
    assert_eq!(recorded("sealed-1").await.unwrap(), 1);
    let (rows, users): (i64, Vec<i64>) =
        sqlx::query_as("SELECT count(*), array_agg(DISTINCT user_id) FROM fair_draws")
            .fetch_one(&env.db)
            .await
            .unwrap();
    assert_eq!((rows, users), (2, vec![1]));
}

/// With Postgres away, a batch is still stocked at once (draws never wait
/// for the audit trail); its commitment reaches Postgres later, from the
/// `pool.refilled` event, and the seed revealed afterwards matches it.
#[tokio::test]
async fn stocking_goes_on_while_postgres_is_away_and_the_commitment_comes_later() {
    let env = TestEnv::new(&[]).await;
    let kinds = Kinds::new(env.redis.clone(), &env.config.redis_prefix);
    env.load(&pool_toml(
        "away",
        "refill_at = 0.5\nmax_count = 100",
        SMALL,
    ))
    .await;
    // Draw to batch 1's refill point.
    let mut n = 0;
    let trigger = loop {
        let Step::Awarded(a) = draw_and_record(&env, &kinds, "away", n, 8).await else {
            panic!("short")
        };
        n += 1;
        if let Some(r) = a.refill {
            break r.trigger;
        }
    };
    let away = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/nowhere")
        .unwrap();
    let recorder = audit::PgRecorder::new(&away);
    let mut redis = env.redis.clone();
    let keys = env.keys("away");
    let (version, config, table) = lucky_gift::stored_config(&mut redis, &keys)
        .await
        .unwrap()
        .unwrap();
    let started = std::time::Instant::now();
    let outcome = lucky_gift::stock_committed(
        &mut redis, &keys, &config, version, &table, trigger, 500, 30_000, "t", &recorder,
    )
    .await
    .unwrap();
    assert!(matches!(
        outcome,
        lucky_gift::StockOutcome::Stocked { generation: 2, .. }
    ));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let committed = recorder.take().unwrap();
    let rows = |g: i64| {
        sqlx::query_scalar::<_, String>(
            "SELECT commitment FROM fair_batches WHERE pool = 'away' AND generation = $1",
        )
        .bind(g)
        .fetch_all(&env.db)
    };
    assert!(rows(2).await.unwrap().is_empty());
    // The event the refill worker publishes brings it to Postgres.
    let event = json!({"type": "pool.refilled", "pool": "away", "generation": 2, "size": 80,
        "version": version, "urgent": false, "commitment": committed.commitment,
        "composition": committed.composition});
    let worker = audit::AuditWorker::new(
        env.db.clone(),
        env.redis.clone(),
        &env.config.redis_prefix,
        fleet_sealer(&env).await,
    );
    worker.record(&event).await.unwrap();
    assert_eq!(rows(2).await.unwrap(), vec![committed.commitment.clone()]);
    // Batch 2, used up later, reveals the seed of that commitment.
    for _ in 0..30 {
        n += 1;
        let Step::Awarded(a) = draw_and_record(&env, &kinds, "away", n, 8).await else {
            panic!("short")
        };
        if let Some(r) = a.refill {
            refill(&env, "away", r.trigger).await;
        }
        if a.result.revealed.iter().any(|r| r.generation == 2) {
            break;
        }
    }
    let verdict = audit::verify(&env.db, "away", Some(2)).await.unwrap();
    assert!(
        verdict.ok && verdict.batches[0].status == "ok",
        "{verdict:?}"
    );
    assert!(verdict.batches[0].complete, "{verdict:?}");
}

/// Every lottery award records the random value and the weights its pick
/// used, and recomputing the pick from them gives the prize awarded; a
/// prize whose stock ran out is no longer among the weights.
#[tokio::test]
async fn lottery_draws_record_their_random_value_and_weights() {
    let env = TestEnv::new(&[]).await;
    let now = chrono::Utc::now();
    env.load_activities(&common::activity_toml(
        "spin",
        now - chrono::Duration::hours(1),
        now + chrono::Duration::hours(1),
        r#"{ id = "ipad", weight = 40, stock = 3 }, { id = "coupon", weight = 50, stock = 100 }"#,
    ))
    .await;
    let kinds = Kinds::new(env.redis.clone(), &env.config.redis_prefix);
    let mut redis = env.redis.clone();
    prizepool::kinds::lottery::grant(&mut redis, &env.keys("spin"), "spin", "g-1", 7, 60)
        .await
        .unwrap();
    let mut ipads = 0;
    for n in 0..60 {
        let request_id = format!("spin-{n}");
        let fingerprint = prizepool::kinds::fingerprint("draw", &[&"spin", &7i64, &1u32]);
        let ttl = env.config.result_ttl.as_secs();
        let tokens = Tokens::new(
            &env.config.redis_prefix,
            "rq",
            &request_id,
            fingerprint,
            ttl,
        );
        let ask = Ask {
            request_id: &request_id,
            pool: "spin",
            user: 7,
            count: 1,
            token: &tokens.answer,
            result_ttl_s: ttl,
        };
        let kind = kinds.resolve("spin").await.unwrap().unwrap();
        let Step::Awarded(award) = kinds.draw(kind, &ask).await.unwrap() else {
            panic!("no award")
        };
        let pick = award
            .result
            .pick
            .clone()
            .expect("a wheel draw records its pick");
        let prize = match &award.result.prizes[0] {
            prizepool::messages::Prize::Item { prize, .. } => prize.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(pick.prize(), Some(prize.as_str()), "{pick:?}");
        assert!(pick.value < 1 << 52);
        let names: Vec<&str> = pick.weights.iter().map(|w| w.prize.as_str()).collect();
        let expected: Vec<&str> = if ipads < 3 {
            vec!["ipad", "coupon", "points-10"]
        } else {
            vec!["coupon", "points-10"]
        };
        assert_eq!(names, expected, "draw {n}");
        // The value is below the largest multiple of the total in 2^52.
        let total: u64 = pick.weights.iter().map(|w| w.weight).sum();
        assert!(pick.value < (1u64 << 52) - (1u64 << 52) % total);
        if prize == "ipad" {
            ipads += 1;
        }
        // A replay answers the same pick.
        let Step::Awarded(again) = kinds.draw(kind, &ask).await.unwrap() else {
            panic!("no replay")
        };
        assert_eq!(again.result.pick, Some(pick));
    }
    assert_eq!(ipads, 3, "three ipads in 60 draws at 40/91 each");
}

/// Lottery draws (docs/fairness.md, "Lotteries"): the same values, value
/// and pick as the reference, for random seeds, activities, periods and
/// request ids, over weights whose rejection zone is small and large.
#[test]
fn lottery_picks_match_an_independent_implementation() {
    use prizepool::fairness::{lottery_context, lottery_pick, lottery_values};
    let mut rng = rand::rngs::StdRng::seed_from_u64(20261130);
    for i in 0..12 {
        let seed = Seed(rng.random());
        let activity = format!("act-{}", rng.random::<u16>());
        let period = rng.random_range(0..2_000_000_000u64);
        let request = format!("req-{i}-\u{00e9}");
        let weights: Vec<u64> = match i % 3 {
            0 => vec![1, 100, 500],
            1 => (0..5).map(|_| rng.random_range(1..1_000_000_000)).collect(),
            // A total just above 2^51: about half the values are rejected.
            _ => vec![1 << 50, (1 << 50) + 1],
        };
        let context = lottery_context(&activity, period, &request);
        let values = lottery_values(&seed, &context, 0, 12);
        let (value, pick) = lottery_pick(&values, &weights).unwrap();
        let theirs = reference(&[
            "lottery",
            &seed.to_hex(),
            &activity,
            &period.to_string(),
            &request,
            &serde_json::to_string(&weights).unwrap(),
        ]);
        assert_eq!(theirs["context"], context);
        assert_eq!(theirs["values"], json!(values[..4]), "{theirs}");
        assert_eq!(
            (theirs["value"].as_u64(), theirs["pick"].as_u64()),
            (Some(value), Some(pick as u64)),
            "{theirs}"
        );
    }
}
