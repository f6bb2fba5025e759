//! SPEC §3 rules for list-mode lucky-gift pools, against a real Redis (and
//! Postgres for the config registry).
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeMap;

use common::{pool_toml, TestEnv};
use prizepool::kinds::lucky_gift::{self, CodeTable, DrawStep, Drawn, StockOutcome};

async fn draw(env: &TestEnv, pool: &str, count: u32) -> DrawStep {
    let mut redis = env.redis.clone();
    let storage = lucky_gift::storage_of(&mut redis, &env.keys(pool))
        .await
        .unwrap()
        .unwrap_or(lucky_gift::Storage::List);
    let id = ulid::Ulid::new().to_string();
    lucky_gift::draw_once(
        &mut redis,
        &env.keys(pool),
        storage,
        &id,
        count,
        3600,
        &env.tokens("rq", &id).answer,
    )
    .await
    .unwrap()
}

fn drawn(step: DrawStep) -> Drawn {
    match step {
        DrawStep::Drawn(d) => d,
        other => panic!("expected a draw, got {other:?}"),
    }
}

async fn table(env: &TestEnv, pool: &str) -> CodeTable {
    let mut redis = env.redis.clone();
    lucky_gift::load_codes(&mut redis, &env.keys(pool))
        .await
        .unwrap()
        .unwrap()
        .0
}

/// Stocks the batch after the pool's current one, as a refill would.
async fn refill(env: &TestEnv, pool: &str) -> StockOutcome {
    let (_, config, codes) = prizepool::pools::latest(&env.db, pool)
        .await
        .unwrap()
        .unwrap();
    let gen = env.status(pool).await.generation;
    let mut redis = env.redis.clone();
    lucky_gift::stock_next(&mut redis, &env.keys(pool), &config, &codes, gen, 7, 30_000)
        .await
        .unwrap()
}

/// A pool file for `storage` (see `common::pool_toml`).
fn pool_toml_in(storage: &str, id: &str, extra: &str, combos: &[(&str, &[(u64, u64)])]) -> String {
    pool_toml(id, &format!("storage = \"{storage}\"\n{extra}"), combos)
}

/// Runs a rule test once per storage mode: every SPEC §3 rule holds for both.
macro_rules! both_storages {
    ($($name:ident),* $(,)?) => {
        $(mod $name {
            #[tokio::test]
            async fn list() {
                super::$name("list").await
            }
            #[tokio::test]
            async fn sparse() {
                super::$name("sparse").await
            }
        })*
    };
}

both_storages!(
    each_batch_holds_exactly_the_config_and_combos_run_contiguously,
    a_draw_is_all_or_nothing_and_may_span_batches,
    the_prize_at_the_refill_point_carries_the_trigger,
    unknown_pool_and_count_above_max_count,
    gated_jackpots_wait_at_the_head_for_the_first_draw_that_may_win_them,
    waiting_jackpots_are_not_touched_by_gated_draws,
    a_reload_frees_parked_prizes_that_are_no_jackpot_any_more,
    fifty_concurrent_refills_for_one_trigger_stock_one_batch,
);

const COMBOS: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 20), (1, 5), (7, 2)]),
    ("b", &[(0, 15), (2, 4)]),
    ("c", &[(0, 10), (3, 3), (9, 1)]),
    ("d", &[(0, 8), (4, 2)]),
];
const BATCH: u32 = 27 + 19 + 14 + 10;

async fn each_batch_holds_exactly_the_config_and_combos_run_contiguously(storage: &str) {
    let env = TestEnv::new(&[]).await;
    let pool = "exact";
    env.load(&pool_toml_in(
        storage,
        pool,
        "refill_at = 1.0\nmax_count = 1000",
        COMBOS,
    ))
    .await;
    let codes = table(&env, pool).await;
    let mut orders = Vec::new();
    for batch in 0..12 {
        if batch > 0 {
            assert!(matches!(
                refill(&env, pool).await,
                StockOutcome::Stocked { .. }
            ));
        }
        // Draw the whole batch in uneven pieces.
        let mut prizes = Vec::new();
        let mut left = BATCH;
        let mut step = 1;
        while left > 0 {
            let n = step.min(left);
            prizes.extend(drawn(draw(&env, pool, n).await).codes);
            left -= n;
            step = step % 9 + 1;
        }
        assert_eq!(env.status(pool).await.in_pool, 0);
        let mut counts: BTreeMap<(String, u64), u64> = BTreeMap::new();
        let mut runs: Vec<String> = Vec::new();
        for code in prizes {
            let (combo, m) = codes.decode(code).unwrap();
            *counts.entry((combo.to_owned(), m)).or_default() += 1;
            if runs.last().map(String::as_str) != Some(combo) {
                runs.push(combo.to_owned());
            }
        }
        let expected: BTreeMap<(String, u64), u64> = COMBOS
            .iter()
            .flat_map(|(c, s)| s.iter().map(move |(m, n)| ((c.to_string(), *m), *n)))
            .collect();
        assert_eq!(counts, expected, "batch {batch} differs from the config");
        // Each combo is one contiguous run: four combos, four runs.
        assert_eq!(runs.len(), 4, "batch {batch} interleaves combos: {runs:?}");
        orders.push(runs);
    }
    orders.sort();
    orders.dedup();
    // 12 batches over 24 possible orders: all equal would mean no shuffling.
    assert!(
        orders.len() > 1,
        "combo order never changed across 12 batches"
    );
}

async fn a_draw_is_all_or_nothing_and_may_span_batches(storage: &str) {
    let env = TestEnv::new(&[]).await;
    let pool = "aon";
    env.load(&pool_toml_in(storage, pool, "refill_at = 1.0", COMBOS))
        .await;
    drawn(draw(&env, pool, BATCH - 3).await);
    let before = env.status(pool).await;
    assert_eq!(before.in_pool, 3);
    assert_eq!(
        draw(&env, pool, 5).await,
        DrawStep::Short {
            in_pool: 3,
            generation: 1
        }
    );
    let after = env.status(pool).await;
    assert_eq!(before, after, "a short draw changed the pool");
    // With the next batch stocked the same draw spans the boundary.
    refill(&env, pool).await;
    let d = drawn(draw(&env, pool, 5).await);
    assert_eq!(d.codes.len(), 5);
    let s = env.status(pool).await;
    assert_eq!(s.stocked, s.drawn + s.in_pool);
    assert_eq!(s.in_pool, u64::from(BATCH) - 2);
}

async fn the_prize_at_the_refill_point_carries_the_trigger(storage: &str) {
    let env = TestEnv::new(&[]).await;
    let pool = "flag";
    // 10 prizes, refill_at 0.5: the 5th prize drawn is flagged.
    env.load(&pool_toml_in(
        storage,
        pool,
        "refill_at = 0.5",
        &[("only", &[(0, 10)])],
    ))
    .await;
    assert_eq!(drawn(draw(&env, pool, 4).await).trigger, None);
    assert_eq!(drawn(draw(&env, pool, 1).await).trigger, Some(1));
    assert_eq!(drawn(draw(&env, pool, 5).await).trigger, None);
}

async fn unknown_pool_and_count_above_max_count(storage: &str) {
    let env = TestEnv::new(&[]).await;
    assert!(matches!(
        draw(&env, "nope", 1).await,
        DrawStep::Refused(r) if r.code == prizepool::messages::ErrorCode::UnknownPool
    ));
    env.load(&pool_toml_in(storage, "small", "max_count = 3", COMBOS))
        .await;
    assert_eq!(
        draw(&env, "small", 4).await,
        DrawStep::TooMany { max_count: 3 }
    );
}

async fn gated_jackpots_wait_at_the_head_for_the_first_draw_that_may_win_them(storage: &str) {
    let env = TestEnv::new(&[]).await;
    let pool = "jp";
    // unit_price 10; jackpots (>= 100x) open once today's consumption reaches 100.
    env.load(&pool_toml_in(
        storage,
        pool,
        "refill_at = 1.0\njackpot = { min_multiplier = 100, daily_consumption_threshold = 100 }",
        &[("c", &[(0, 8), (100, 2)])],
    ))
    .await;
    let codes = table(&env, pool).await;
    let multipliers = |d: &Drawn| {
        d.codes
            .iter()
            .map(|c| codes.decode(*c).unwrap().1)
            .collect::<Vec<_>>()
    };
    // Consumption so far 10 per prize drawn; the ninth prize takes it to 90.
    let mut seen = Vec::new();
    for _ in 0..8 {
        let d = drawn(draw(&env, pool, 1).await);
        seen.extend(multipliers(&d));
    }
    assert_eq!(
        seen,
        vec![0; 8],
        "a gated jackpot was won below the threshold"
    );
    let s = env.status(pool).await;
    assert_eq!(s.in_pool, 2, "both jackpots are still in the pool");
    // Gated, nothing else left: short, and nothing moves.
    assert!(matches!(draw(&env, pool, 1).await, DrawStep::Short { .. }));
    assert_eq!(env.status(pool).await, s);
    // Next batch: a draw of 1 at consumption 90 is still gated; it takes a
    // normal prize and sets aside the jackpots met on the way. The draw after
    // it reaches 110 >= 100 and wins both waiting jackpots first.
    refill(&env, pool).await;
    let d = drawn(draw(&env, pool, 1).await);
    assert!(multipliers(&d)[0] < 100);
    // Both jackpots of batch 1 wait; those of batch 2 that came before its
    // first blank wait too (both, once in 45 shuffles).
    let waiting = env.status(pool).await.held_jackpots;
    assert!((2..=4).contains(&waiting), "{waiting} jackpots wait");
    let d = drawn(draw(&env, pool, 2).await);
    assert_eq!(
        multipliers(&d),
        vec![100, 100],
        "the waiting jackpots come first"
    );
    let s = env.status(pool).await;
    assert_eq!(s.held_jackpots, waiting - 2);
    assert_eq!(s.stocked, s.drawn + s.in_pool);
}

async fn waiting_jackpots_are_not_touched_by_gated_draws(storage: &str) {
    let env = TestEnv::new(&[]).await;
    let pool = "pile";
    // Every batch: 1 jackpot among 9 blanks; the threshold is never reached.
    env.load(&pool_toml_in(storage,
        pool,
        "refill_at = 1.0\njackpot = { min_multiplier = 50, daily_consumption_threshold = 1000000000 }",
        &[("c", &[(0, 9), (50, 1)])],
    ))
    .await;
    for _ in 0..30 {
        // Draw blanks until only gated prizes are left.
        while let DrawStep::Drawn(_) = draw(&env, pool, 1).await {}
        refill(&env, pool).await;
    }
    // The next gated draw sets aside the last batch's jackpot if it is first.
    drawn(draw(&env, pool, 1).await);
    let s = env.status(pool).await;
    assert!(s.held_jackpots >= 29, "{} jackpots wait", s.held_jackpots);
    let waiting = s.held_jackpots as usize;
    let mut redis = env.redis.clone();
    let held_before: Vec<String> = redis::cmd("LRANGE")
        .arg(env.keys(pool).held())
        .arg(0)
        .arg(-1)
        .query_async(&mut redis)
        .await
        .unwrap();
    drawn(draw(&env, pool, 5).await);
    let held_after: Vec<String> = redis::cmd("LRANGE")
        .arg(env.keys(pool).held())
        .arg(0)
        .arg(-1)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(
        &held_after[..waiting],
        &held_before[..],
        "the waiting pile was rewritten"
    );
    let s = env.status(pool).await;
    assert_eq!(s.stocked, s.drawn + s.in_pool);
}

/// The codes of the prizes parked in `held` (an element is `"<code>"` or
/// `"<code>:<generation>:<position>"`, where it came from).
async fn held_codes(env: &TestEnv, pool: &str) -> Vec<u32> {
    let mut redis = env.redis.clone();
    let held: Vec<String> = redis::cmd("LRANGE")
        .arg(env.keys(pool).held())
        .arg(0)
        .arg(-1)
        .query_async(&mut redis)
        .await
        .unwrap();
    held.iter()
        .map(|h| h.split(':').next().unwrap().parse().unwrap())
        .collect()
}

async fn a_reload_frees_parked_prizes_that_are_no_jackpot_any_more(storage: &str) {
    let env = TestEnv::new(&[]).await;
    let pool = "regate";
    let combos: &[(&str, &[(u64, u64)])] = &[("c", &[(0, 8), (50, 1), (100, 1)])];
    let rule = |min: u64| {
        format!("refill_at = 1.0\nmax_count = 100\njackpot = {{ min_multiplier = {min}, daily_consumption_threshold = 1000000000 }}")
    };
    env.load(&pool_toml_in(storage, pool, &rule(50), combos))
        .await;
    // The gate never opens: every 50x and 100x prize is parked in turn.
    for _ in 0..10 {
        while let DrawStep::Drawn(_) = draw(&env, pool, 1).await {}
        refill(&env, pool).await;
    }
    let codes = table(&env, pool).await;
    let multiplier = |code: &u32| codes.decode(*code).unwrap().1;
    let parked: Vec<u32> = held_codes(&env, pool).await;
    let fifties = parked.iter().filter(|c| multiplier(c) == 50).count();
    assert!(fifties >= 9 && parked.len() >= 18, "parked: {parked:?}");
    let before = env.status(pool).await;

    // Only 100x is a jackpot now: the parked 50x prizes are drawable at
    // once, before any other prize, while the 100x ones stay gated.
    env.load(&pool_toml_in(storage, pool, &rule(100), combos))
        .await;
    let s = env.status(pool).await;
    assert_eq!(s.stocked, s.drawn + s.in_pool, "a reload moves no prize");
    assert_eq!((s.stocked, s.drawn), (before.stocked, before.drawn));
    let won = drawn(draw(&env, pool, fifties as u32).await);
    assert_eq!(won.codes.len(), fifties);
    assert!(
        won.codes.iter().all(|c| multiplier(c) == 50),
        "the freed prizes come first: {:?}",
        won.codes.iter().map(multiplier).collect::<Vec<_>>()
    );
    // The next draw takes fresh prizes and no parked 100x one.
    let next = drawn(draw(&env, pool, 2).await);
    assert!(
        next.codes.iter().all(|c| multiplier(c) < 100),
        "{:?}",
        next.codes
    );
    let held: Vec<u32> = held_codes(&env, pool).await;
    assert!(held.iter().all(|c| multiplier(c) == 100), "{held:?}");
    // Every parked 100x prize is still there. The fresh draw may have
    // parked more: each batch holds one 100x prize, and a draw of two may
    // finish one batch and start the next, so it walks past at most two.
    assert!(
        (parked.len() - fifties..=parked.len() - fifties + 2).contains(&held.len()),
        "parked before {parked:?} ({fifties} of 50x), held after {held:?}, next draw {:?}",
        next.codes
    );
    let s = env.status(pool).await;
    assert_eq!(s.stocked, s.drawn + s.in_pool, "conservation");
}

/// Makes the pool's current batch due for its successor, as a draw that
/// takes its refill point (or finds the pool short) or `prizepool pool
/// refill` does.
async fn make_due(env: &TestEnv, pool: &str) {
    let generation = env.status(pool).await.generation;
    let mut redis = env.redis.clone();
    redis::cmd("HSET")
        .arg(env.keys(pool).meta())
        .arg("due")
        .arg(generation)
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_batch_is_stocked_only_when_a_draw_made_it_due() {
    for storage in ["list", "sparse"] {
        let env = TestEnv::new(&[]).await;
        let pool = "due";
        env.load(&pool_toml_in(
            storage,
            pool,
            "refill_at = 0.5",
            &[("c", &[(0, 90), (5, 10)])],
        ))
        .await;
        let (_, config, codes) = prizepool::pools::latest(&env.db, pool)
            .await
            .unwrap()
            .unwrap();
        let keys = env.keys(pool);
        let stock = |trigger| {
            let mut redis = env.redis.clone();
            let (keys, config, codes) = (&keys, &config, &codes);
            async move {
                lucky_gift::stock_next(&mut redis, keys, config, codes, trigger, 50, 30_000)
                    .await
                    .unwrap()
            }
        };
        // Nobody took batch 1's refill point: a request for batch 2 is refused.
        assert_eq!(
            stock(1).await,
            StockOutcome::NotDue { generation: 1 },
            "{storage}"
        );
        // A draw of 49 stops before the point; still not due.
        assert_eq!(drawn(draw(&env, pool, 49).await).trigger, None);
        assert_eq!(stock(1).await, StockOutcome::NotDue { generation: 1 });
        // The draw that takes the point makes it due, once.
        assert_eq!(drawn(draw(&env, pool, 2).await).trigger, Some(1));
        assert!(matches!(
            stock(1).await,
            StockOutcome::Stocked { generation: 2, .. }
        ));
        assert_eq!(stock(2).await, StockOutcome::NotDue { generation: 2 });
        // A short draw makes the current batch due too (its urgent refill).
        assert!(matches!(
            draw(&env, pool, 1000).await,
            DrawStep::Short { .. }
        ));
        assert!(matches!(
            stock(2).await,
            StockOutcome::Stocked { generation: 3, .. }
        ));
        let s = env.status(pool).await;
        assert_eq!((s.stocked, s.drawn), (300, 51), "{storage}");
        assert_eq!(s.stocked, s.drawn + s.in_pool);
    }
}

async fn fifty_concurrent_refills_for_one_trigger_stock_one_batch(storage: &str) {
    let env = TestEnv::new(&[]).await;
    let pool = "race";
    env.load(&pool_toml_in(
        storage,
        pool,
        "",
        &[("c", &[(0, 3000), (5, 100)])],
    ))
    .await;
    let (_, config, codes) = prizepool::pools::latest(&env.db, pool)
        .await
        .unwrap()
        .unwrap();
    make_due(&env, pool).await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        // Separate connections, so the calls really interleave in Redis.
        let url = env.config.redis_url.clone();
        let (keys, config, codes) = (env.keys(pool), config.clone(), codes.clone());
        tasks.push(tokio::spawn(async move {
            let mut redis = prizepool::redis_conn::connect(&url).await.unwrap();
            loop {
                match lucky_gift::stock_next(&mut redis, &keys, &config, &codes, 1, 50, 30_000)
                    .await
                    .unwrap()
                {
                    StockOutcome::Busy { retry_in } => {
                        tokio::time::sleep(retry_in.min(std::time::Duration::from_millis(5))).await
                    }
                    other => return other,
                }
            }
        }));
    }
    let mut stocked = 0;
    for t in tasks {
        match t.await.unwrap() {
            StockOutcome::Stocked { generation, .. } => {
                assert_eq!(generation, 2);
                stocked += 1;
            }
            StockOutcome::AlreadyDone { generation } => assert_eq!(generation, 2),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(stocked, 1);
    let s = env.status(pool).await;
    assert_eq!((s.generation, s.stocked, s.in_pool), (2, 6200, 6200));
}

#[tokio::test]
async fn a_dead_stocking_attempt_is_cleaned_up_by_the_next() {
    let env = TestEnv::new(&[]).await;
    let pool = "crash";
    env.load(&pool_toml(pool, "", &[("c", &[(0, 50), (5, 10)])]))
        .await;
    let keys = env.keys(pool);
    make_due(&env, pool).await;
    let mut redis = env.redis.clone();
    // An attempt claims the lease, pushes half a batch, and dies.
    let (status, _): (String, i64) = prizepool::kinds::lucky_gift::scripts::STOCK_BEGIN
        .key(keys.meta())
        .key(keys.queue())
        .arg(1)
        .arg("dead")
        .arg(0)
        .arg(1)
        .invoke_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(status, "claimed");
    let pushed: i64 = prizepool::kinds::lucky_gift::scripts::STOCK_PUSH
        .key(keys.meta())
        .key(keys.queue())
        .arg("dead")
        .arg(0)
        .arg(1)
        .arg(&["0", "0", "0"][..])
        .invoke_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(pushed, 3);
    // Draws never see the hidden tail.
    drawn(draw(&env, pool, 60).await);
    assert!(matches!(draw(&env, pool, 1).await, DrawStep::Short { .. }));
    // Its lease (1 ms at time 0) is long gone: the next attempt trims and stocks.
    assert!(matches!(
        refill(&env, pool).await,
        StockOutcome::Stocked {
            generation: 2,
            size: 60
        }
    ));
    let s = env.status(pool).await;
    assert_eq!((s.stocked, s.drawn, s.in_pool), (120, 60, 60));
    let len: u64 = redis::cmd("LLEN")
        .arg(keys.queue())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(len, 60);
}

#[tokio::test]
async fn list_mode_costs_about_two_bytes_per_prize() {
    let env = TestEnv::new(&[("REFILL_CHUNK", "4000")]).await;
    let pool = "mem";
    env.load(&pool_toml(
        pool,
        "",
        &[
            ("a", &[(0, 90_000), (1, 8000), (10, 2000)]),
            ("b", &[(0, 99_000), (3, 1000)]),
        ],
    ))
    .await;
    let bytes = lucky_gift::storage_bytes(
        &mut env.redis.clone(),
        &env.keys(pool),
        lucky_gift::Storage::List,
    )
    .await
    .unwrap();
    let per_prize = bytes as f64 / 200_000.0;
    println!("list mode: {bytes} bytes for 200000 prizes = {per_prize:.3} bytes/prize");
    assert!(per_prize <= 2.5, "{per_prize} bytes per prize");
}

#[tokio::test]
async fn sparse_mode_stores_only_non_zero_prizes() {
    let env = TestEnv::new(&[]).await;
    env.load(&pool_toml_in(
        "sparse",
        "zeros",
        "",
        &[("a", &[(0, 50_000)])],
    ))
    .await;
    env.load(&pool_toml_in(
        "sparse",
        "sp",
        "",
        &[
            ("a", &[(0, 90_000), (1, 8000), (10, 2000)]),
            ("b", &[(0, 99_000), (3, 1000)]),
        ],
    ))
    .await;
    let mut redis = env.redis.clone();
    let bytes_of = |pool: &str| {
        let (keys, mut redis) = (env.keys(pool), redis.clone());
        async move {
            lucky_gift::storage_bytes(&mut redis, &keys, lucky_gift::Storage::Sparse)
                .await
                .unwrap()
        }
    };
    let zeros = bytes_of("zeros").await;
    let sp = bytes_of("sp").await;
    let stored: u64 = redis::cmd("HLEN")
        .arg(env.keys("zeros").sparse())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(stored, 0, "zero prizes take no entry");
    let per_prize = sp as f64 / 11_000.0;
    println!("sparse mode: {zeros} bytes for 50000 zeros, {sp} bytes for 11000 non-zero prizes = {per_prize:.1} bytes each");
    assert!(zeros < 1_000, "{zeros} bytes for a pool of zeros");
    assert!(per_prize <= 64.0, "{per_prize} bytes per non-zero prize");
    // Every prize still comes out: a whole batch has exactly the config's prizes.
    let mut counts = std::collections::BTreeMap::new();
    let codes = table(&env, "sp").await;
    for _ in 0..200 {
        for c in drawn(draw(&env, "sp", 1000).await).codes {
            *counts.entry(codes.decode(c).unwrap().1).or_insert(0u64) += 1;
        }
    }
    assert_eq!(
        counts,
        [(0, 189_000), (1, 8000), (3, 1000), (10, 2000)]
            .into_iter()
            .collect()
    );
    assert!(
        matches!(draw(&env, "sp", 1).await, DrawStep::Short { .. }),
        "past the stocked range is short, not a zero"
    );
}

#[tokio::test]
async fn sparse_stocking_after_a_dead_attempt_trims_its_leftovers() {
    let env = TestEnv::new(&[]).await;
    let pool = "sp-crash";
    env.load(&pool_toml_in(
        "sparse",
        pool,
        "",
        &[("c", &[(0, 500), (5, 100)])],
    ))
    .await;
    let keys = env.keys(pool);
    make_due(&env, pool).await;
    let mut redis = env.redis.clone();
    let step = |name: &str| {
        let mut inv = prizepool::kinds::lucky_gift::scripts::SPARSE_STOCK.prepare_invoke();
        inv.key(keys.meta())
            .key(keys.sparse())
            .key(keys.segments())
            .key(keys.flags())
            .arg(name)
            .arg("dead");
        inv
    };
    let (status, start): (String, i64) = step("begin")
        .arg(1)
        .arg(0)
        .arg(1)
        .invoke_async(&mut redis)
        .await
        .unwrap();
    assert_eq!((status.as_str(), start), ("claimed", 600));
    // Half a batch staged at indices 600.. (bucket 9 holds 576..639), then the attempt dies.
    let (status, _): (String, i64) = step("push")
        .arg(0)
        .arg(1)
        .arg(9)
        .arg("30.1;31.1;")
        .arg(10)
        .arg("0.1;")
        .invoke_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(status, "ok");
    drawn(draw(&env, pool, 600).await);
    assert!(
        matches!(draw(&env, pool, 1).await, DrawStep::Short { .. }),
        "staged prizes stay invisible"
    );
    assert!(matches!(
        refill(&env, pool).await,
        StockOutcome::Stocked {
            generation: 2,
            size: 600
        }
    ));
    let codes = table(&env, pool).await;
    let mut fives = 0;
    for c in drawn(draw(&env, pool, 600).await).codes {
        if codes.decode(c).unwrap().1 == 5 {
            fives += 1;
        }
    }
    assert_eq!(
        fives, 100,
        "the dead attempt's prizes did not leak into the batch"
    );
    let s = env.status(pool).await;
    assert_eq!((s.stocked, s.drawn, s.in_pool), (1200, 1200, 0));
}
