//! `draw.batch`: many draws in one message. Every entry keeps the rules of
//! the single draw it stands for (its own id, idempotency, validation and
//! all-or-nothing step), one bad or short entry never affects the others,
//! and the reply carries one result per entry in request order.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::HashMap, time::Duration};

use chrono::{Days, Utc};
use common::{activity_toml, pool_toml, TestEnv};
use prizepool::amqp;
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);

const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 300), (1, 60), (5, 20)]),
    ("b", &[(0, 200), (2, 50), (10, 10)]),
];

fn entry(request_id: &str, pool: &str, user: i64, count: u32) -> Value {
    json!({"request_id": request_id, "pool": pool, "user_id": user, "count": count})
}

fn batch(entries: Vec<Value>) -> Value {
    json!({"type": "draw.batch", "requests": entries})
}

/// The results of a `draw_result.batch` reply, checked to be one.
fn results(reply: &Value) -> Vec<Value> {
    assert_eq!(reply["type"], "draw_result.batch", "{reply}");
    reply["results"].as_array().unwrap().clone()
}

fn code(reply: &Value) -> &str {
    reply["error"]["code"].as_str().unwrap_or("")
}

/// The rewards `results` promised, summed by pool.
fn promised_by_pool(results: &[Value]) -> HashMap<String, i64> {
    let mut by_pool = HashMap::new();
    for r in results.iter().filter(|r| r["status"] == "ok") {
        *by_pool
            .entry(r["pool"].as_str().unwrap().to_owned())
            .or_default() += r["reward"].as_i64().unwrap();
    }
    by_pool
}

#[tokio::test]
async fn a_batch_answers_every_entry_in_request_order_and_pays_each_once() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("p1", "", GIFT)).await;
    env.load(&pool_toml("p2", "", GIFT)).await;
    env.start_fleet().await;
    let client = env.client().await;

    let entries: Vec<Value> = (0..12)
        .map(|i| {
            entry(
                &format!("b-{i}"),
                if i % 3 == 0 { "p2" } else { "p1" },
                100 + i,
                (i % 4 + 1) as u32,
            )
        })
        .collect();
    let reply = client
        .call("draw", &batch(entries.clone()), T)
        .await
        .unwrap();
    let rs = results(&reply);
    assert_eq!(rs.len(), entries.len());
    for (r, e) in rs.iter().zip(&entries) {
        assert_eq!(r["type"], "draw_result");
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["request_id"], e["request_id"]);
        assert_eq!(r["pool"], e["pool"]);
        assert_eq!(r["user_id"], e["user_id"]);
        assert_eq!(
            r["prizes"].as_array().unwrap().len() as u64,
            e["count"].as_u64().unwrap()
        );
    }
    // Entries of one pool take its prizes in the order asked.
    for pool in ["p1", "p2"] {
        let serials: Vec<i64> = rs
            .iter()
            .filter(|r| r["pool"] == pool)
            .map(|r| r["serial"].as_i64().unwrap())
            .collect();
        assert!(
            serials.windows(2).all(|w| w[0] < w[1]),
            "{pool}: {serials:?}"
        );
    }
    // The ledger pays exactly what the results promised; conservation holds.
    let promised = promised_by_pool(&rs);
    for pool in ["p1", "p2"] {
        let want = promised.get(pool).copied().unwrap_or(0);
        assert_eq!(env.wait_ledger(pool, want).await, want, "{pool}");
        let s = env.status(pool).await;
        assert_eq!(s.stocked, s.drawn + s.in_pool);
    }
    let total_drawn = env.status("p1").await.drawn + env.status("p2").await.drawn;
    let asked: u64 = entries.iter().map(|e| e["count"].as_u64().unwrap()).sum();
    assert_eq!(total_drawn, asked);
    env.stop_workers().await;
}

#[tokio::test]
async fn duplicates_inside_a_batch_and_across_batches_replay_the_first_answer() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("d", "", GIFT)).await;
    env.start_fleet().await;
    let client = env.client().await;

    let first = vec![
        entry("dup-a", "d", 1, 3),
        entry("dup-a", "d", 1, 3),
        entry("dup-b", "d", 2, 2),
        // The same id for other content: refused alone, nothing moves.
        entry("dup-a", "d", 9, 3),
    ];
    let rs = results(&client.call("draw", &batch(first), T).await.unwrap());
    assert_eq!(rs[0]["status"], "ok", "{}", rs[0]);
    assert_eq!(rs[1], rs[0], "a duplicate inside the batch replays");
    assert_eq!(rs[2]["status"], "ok");
    assert_eq!(code(&rs[3]), "invalid_request", "{}", rs[3]);
    assert_eq!(rs[3]["request_id"], "dup-a");

    // Again in another batch, in another order, and alone.
    let again = results(
        &client
            .call(
                "draw",
                &batch(vec![entry("dup-b", "d", 2, 2), entry("dup-a", "d", 1, 3)]),
                T,
            )
            .await
            .unwrap(),
    );
    assert_eq!(again[0], rs[2]);
    assert_eq!(again[1], rs[0]);
    let single = client
        .call(
            "draw",
            &json!({"type": "draw", "request_id": "dup-a", "pool": "d", "user_id": 1, "count": 3}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(single, rs[0]);

    let want = rs[0]["reward"].as_i64().unwrap() + rs[2]["reward"].as_i64().unwrap();
    assert_eq!(env.wait_ledger("d", want).await, want);
    let s = env.status("d").await;
    assert_eq!(s.drawn, 5, "two draws of 3 and 2 prizes, each once");
    assert_eq!(s.stocked, s.drawn + s.in_pool);

    // The same new batch sent three times at the same moment (an upstream
    // retrying before its first copy was answered): every copy gets the
    // same answers, and each entry is drawn and paid once.
    let twin: Vec<Value> = (0..6)
        .map(|i| entry(&format!("twin-{i}"), "d", 20 + i, 1 + (i % 3) as u32))
        .collect();
    let body = batch(twin.clone());
    let (a, b, c) = tokio::join!(
        client.call("draw", &body, T),
        client.call("draw", &body, T),
        client.call("draw", &body, T)
    );
    let (a, b, c) = (
        results(&a.unwrap()),
        results(&b.unwrap()),
        results(&c.unwrap()),
    );
    assert_eq!(a, b);
    assert_eq!(a, c);
    assert!(a.iter().all(|r| r["status"] == "ok"), "{a:?}");
    let twins: i64 = a.iter().map(|r| r["reward"].as_i64().unwrap()).sum();
    assert_eq!(env.wait_ledger("d", want + twins).await, want + twins);
    let s = env.status("d").await;
    assert_eq!(
        s.drawn,
        5 + 1 + 2 + 3 + 1 + 2 + 3,
        "each twin entry drawn once"
    );
    assert_eq!(s.stocked, s.drawn + s.in_pool);
    env.stop_workers().await;
}

#[tokio::test]
async fn a_bad_entry_is_answered_and_dead_lettered_alone() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "max_count = 5", GIFT)).await;
    env.start_fleet().await;
    let client = env.client().await;

    let entries = vec![
        entry("ok-1", "g", 1, 2),
        json!("not an object"),
        json!({"type": "lottery.grant", "request_id": "wrong-type", "pool": "g", "user_id": 1, "count": 1}),
        json!({"request_id": "no-count", "pool": "g", "user_id": 1}),
        entry("zero", "g", 1, 0),
        json!({"request_id": "huge", "pool": "g", "user_id": 1, "count": 4_294_967_296_u64}),
        json!({"request_id": "neg", "pool": "g", "user_id": 1, "count": -1}),
        entry("too-many", "g", 1, 6),
        json!({"request_id": "extra", "pool": "g", "user_id": 1, "count": 1, "reward": 1000}),
        entry("ok:2", "g", 2, 1),
        entry("unknown", "nowhere", 1, 1),
        entry("ok-3", "g", 3, 5),
        entry("{bad}:id", "g", 4, 1),
        entry("has space", "g", 5, 1),
        entry(&"x".repeat(10_000), "g", 6, 1),
        json!({"request_id": 17, "pool": "g", "user_id": 7, "count": 1}),
        json!({"request_id": "float-user", "pool": "g", "user_id": 1.5, "count": 1}),
    ];
    let rs = results(
        &client
            .call("draw", &batch(entries.clone()), T)
            .await
            .unwrap(),
    );
    assert_eq!(rs.len(), entries.len());
    let bad = [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 14, 15, 16];
    for (i, r) in rs.iter().enumerate() {
        if bad.contains(&i) {
            assert_eq!(r["status"], "rejected", "{i}: {r}");
            assert_eq!(code(r), "invalid_request", "{i}: {r}");
            assert_eq!(r["type"], "draw_result");
        } else if i == 10 {
            assert_eq!(code(r), "unknown_pool", "{r}");
        } else {
            assert_eq!(r["status"], "ok", "{i}: {r}");
            assert_eq!(r["request_id"], entries[i]["request_id"]);
        }
    }
    // Each bad entry carries its id back when it had a usable one.
    assert_eq!(rs[3]["request_id"], "no-count");
    assert_eq!(rs[7]["request_id"], "too-many");

    // The bad entries, and only they, wait in the DLQ, each as a draw of its own.
    env.wait_depth(amqp::DRAW.dlq, bad.len() as u32).await;
    let want: i64 = [0, 9, 11]
        .iter()
        .map(|&i| rs[i]["reward"].as_i64().unwrap())
        .sum();
    assert_eq!(env.wait_ledger("g", want).await, want);
    // An entry refused for its count bound nothing: the same id may be used
    // for the draw the upstream meant.
    let retry = results(
        &client
            .call("draw", &batch(vec![entry("too-many", "g", 1, 5)]), T)
            .await
            .unwrap(),
    );
    assert_eq!(retry[0]["status"], "ok", "{}", retry[0]);
    env.stop_workers().await;
}

#[tokio::test]
async fn a_malformed_envelope_is_refused_whole_and_dead_lettered() {
    let mut env = TestEnv::new(&[("MAX_BATCH", "4")]).await;
    env.load(&pool_toml("m", "", GIFT)).await;
    env.start_fleet().await;
    let client = env.client().await;

    let five: Vec<Value> = (0..5)
        .map(|i| entry(&format!("m-{i}"), "m", 1, 1))
        .collect();
    let envelopes = [
        json!({"type": "draw.batch"}),
        json!({"type": "draw.batch", "requests": {"request_id": "x"}}),
        json!({"type": "draw.batch", "requests": []}),
        json!({"type": "draw.batch", "requests": five}),
        json!({"type": "draw.batch", "requests": [entry("m-x", "m", 1, 1)], "extra": 1}),
    ];
    for envelope in &envelopes {
        let reply = client.call("draw", envelope, T).await.unwrap();
        assert_eq!(reply["type"], "draw_result.batch", "{reply}");
        assert_eq!(reply["status"], "rejected", "{reply}");
        assert_eq!(code(&reply), "invalid_request", "{reply}");
        assert_eq!(reply["results"], json!([]), "{reply}");
    }
    env.wait_depth(amqp::DRAW.dlq, envelopes.len() as u32).await;
    assert_eq!(env.status("m").await.drawn, 0, "nothing drawn");
    // The worker goes on.
    let ok = results(
        &client
            .call("draw", &batch(five[..4].to_vec()), T)
            .await
            .unwrap(),
    );
    assert!(ok.iter().all(|r| r["status"] == "ok"), "{ok:?}");
    env.stop_workers().await;
}

#[tokio::test]
async fn a_short_pool_in_the_middle_of_a_batch_refuses_only_its_own_entries() {
    let mut env = TestEnv::new(&[("SHORT_POOL_WAIT_MS", "300")]).await;
    env.load(&pool_toml("short", "refill_at = 1.0", &[("a", &[(0, 10)])]))
        .await;
    env.load(&pool_toml("full", "", GIFT)).await;
    // No refill worker: the short pool stays short.
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let entries = vec![
        entry("s-1", "full", 1, 2),
        entry("s-2", "short", 1, 6),
        entry("s-3", "short", 2, 6),
        entry("s-4", "full", 3, 2),
        entry("s-5", "short", 3, 4),
    ];
    let rs = results(&client.call("draw", &batch(entries), T).await.unwrap());
    assert_eq!(rs[0]["status"], "ok");
    assert_eq!(rs[1]["status"], "ok", "the first 6 of 10 prizes: {}", rs[1]);
    assert_eq!(code(&rs[2]), "pool_exhausted", "{}", rs[2]);
    assert_eq!(rs[3]["status"], "ok");
    assert_eq!(rs[4]["status"], "ok", "the last 4 prizes: {}", rs[4]);
    let s = env.status("short").await;
    assert_eq!((s.drawn, s.in_pool), (10, 0));
    // The refusal is remembered: sent again, it stays refused.
    let again = results(
        &client
            .call("draw", &batch(vec![entry("s-3", "short", 2, 6)]), T)
            .await
            .unwrap(),
    );
    assert_eq!(again[0], rs[2]);
    env.stop_workers().await;
}

#[tokio::test]
async fn entries_that_cross_a_refill_point_get_one_refill_and_conserve_prizes() {
    let mut env = TestEnv::new(&[]).await;
    // 100 prizes a batch, refilled at half.
    env.load(&pool_toml(
        "r",
        "refill_at = 0.5",
        &[("a", &[(0, 80), (3, 20)])],
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    let mut all = Vec::new();
    for b in 0..5 {
        let entries: Vec<Value> = (0..20)
            .map(|i| entry(&format!("r-{b}-{i}"), "r", i64::from(i), 3))
            .collect();
        let rs = results(&client.call("draw", &batch(entries), T).await.unwrap());
        assert!(rs.iter().all(|r| r["status"] == "ok"), "{rs:?}");
        all.extend(rs);
    }
    let s = env.status("r").await;
    assert_eq!(s.drawn, 300);
    assert_eq!(s.stocked, s.drawn + s.in_pool);
    assert!(
        s.generation >= 3,
        "refilled as the batches used them: {s:?}"
    );
    let want = promised_by_pool(&all)["r"];
    assert_eq!(env.wait_ledger("r", want).await, want);
    env.stop_workers().await;
}

#[tokio::test]
async fn a_batch_mixes_kinds_and_each_follows_its_own_rule() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("gift", "", GIFT)).await;
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "spring",
        now - Days::new(1),
        now + Days::new(1),
        "{ id = \"ipad\", weight = 1, stock = 1 }",
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    let granted = client
        .call(
            "draw",
            &json!({"type": "lottery.grant", "grant_id": "g-1", "activity": "spring", "user_id": 7, "chances": 1}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(granted["status"], "ok", "{granted}");
    let rs = results(
        &client
            .call(
                "draw",
                &batch(vec![
                    entry("k-1", "spring", 7, 1),
                    entry("k-2", "gift", 7, 2),
                    // One chance only: the second lottery draw is refused.
                    entry("k-3", "spring", 7, 1),
                ]),
                T,
            )
            .await
            .unwrap(),
    );
    assert_eq!(rs[0]["status"], "ok", "{}", rs[0]);
    assert_eq!(rs[1]["status"], "ok", "{}", rs[1]);
    assert_eq!(code(&rs[2]), "no_chances", "{}", rs[2]);
    env.stop_workers().await;
}

/// Batches in flight across a graceful stop of one draw worker and a
/// `kill -9` of another: every batch is answered (a batch answered twice,
/// possible only around the killed worker, answers the same both times),
/// every draw in it is paid once, and conservation holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_in_flight_across_a_stop_and_a_kill_are_answered_and_paid_once() {
    use common::{raw::Raw, spawn_binary, wait_exit};
    use std::process::Command;
    const BATCHES: usize = 600;
    const PER: usize = 10;
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "inflight",
        "refill_at = 0.5\nmax_count = 100",
        GIFT,
    ))
    .await;
    env.load(&pool_toml(
        "inflight2",
        "refill_at = 0.5\nmax_count = 100",
        GIFT,
    ))
    .await;
    env.start_refill_worker().await;
    env.start_settle_worker().await;
    let worker =
        |env: &TestEnv| spawn_binary(env, "draw-worker", env!("CARGO_BIN_EXE_draw-worker"));
    let mut stopped = worker(&env);
    let mut killed = worker(&env);

    let raw = Raw::new(&env).await;
    let messages: Vec<(&str, Vec<u8>, String)> = (0..BATCHES)
        .map(|b| {
            let entries: Vec<Value> = (0..PER)
                .map(|i| {
                    let n = b * PER + i;
                    entry(
                        &format!("f-{n}"),
                        if n.is_multiple_of(2) {
                            "inflight"
                        } else {
                            "inflight2"
                        },
                        1 + (n % 50) as i64,
                        1 + (n % 3) as u32,
                    )
                })
                .collect();
            (
                "draw",
                serde_json::to_vec(&batch(entries)).unwrap(),
                format!("batch-{b}"),
            )
        })
        .collect();
    raw.publish_all(&messages).await;
    let replies = || {
        let mut by_batch: HashMap<String, Vec<Value>> = HashMap::new();
        for (corr, reply) in raw.replies.lock().unwrap().iter() {
            by_batch
                .entry(corr.clone().unwrap_or_default())
                .or_default()
                .push(reply.clone());
        }
        by_batch
    };
    let deadline = tokio::time::Instant::now() + T;
    while replies().len() < 40 {
        assert!(tokio::time::Instant::now() < deadline, "no batch answered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Command::new("kill")
        .args(["-KILL", &killed.id().to_string()])
        .status()
        .unwrap();
    Command::new("kill")
        .args(["-TERM", &stopped.id().to_string()])
        .status()
        .unwrap();
    assert!(wait_exit(&mut stopped, T).await.success());
    let _ = wait_exit(&mut killed, T).await;
    let at_stop = replies().len();
    assert!(at_stop < BATCHES, "nothing was in flight at the stop");

    let mut restarted = worker(&env);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    while replies().len() < BATCHES && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    Command::new("kill")
        .args(["-TERM", &restarted.id().to_string()])
        .status()
        .unwrap();
    assert!(wait_exit(&mut restarted, T).await.success());

    let replies = replies();
    assert_eq!(replies.len(), BATCHES, "every batch answered");
    let mut by_request: HashMap<String, Value> = HashMap::new();
    for copies in replies.values() {
        assert!(
            copies.iter().all(|c| c == &copies[0]),
            "a batch answered twice answers the same: {copies:?}"
        );
        for r in results(&copies[0]) {
            let id = r["request_id"].as_str().unwrap().to_owned();
            assert!(
                by_request.insert(id, r).is_none(),
                "a request in two batches"
            );
        }
    }
    assert_eq!(by_request.len(), BATCHES * PER);
    let (mut prizes, mut paid) = (HashMap::<String, u64>::new(), HashMap::<String, i64>::new());
    for r in by_request.values() {
        match r["status"].as_str() {
            Some("ok") => {
                let pool = r["pool"].as_str().unwrap().to_owned();
                *prizes.entry(pool.clone()).or_default() +=
                    r["prizes"].as_array().unwrap().len() as u64;
                *paid.entry(pool).or_default() += r["reward"].as_i64().unwrap();
            }
            _ => assert_eq!(code(r), "pool_exhausted", "{r}"),
        }
    }
    for pool in ["inflight", "inflight2"] {
        let want = paid.get(pool).copied().unwrap_or(0);
        assert_eq!(
            env.wait_ledger(pool, want).await,
            want,
            "{pool}: ledger = replies"
        );
        let s = env.status(pool).await;
        assert_eq!(
            s.drawn,
            prizes.get(pool).copied().unwrap_or(0),
            "{pool}: drawn once"
        );
        assert_eq!(s.stocked, s.drawn + s.in_pool, "{pool}: conservation");
    }
    assert_eq!(env.queue_depth(amqp::DRAW.queue).await, 0);
    assert_eq!(env.queue_depth(amqp::DRAW.dlq).await, 0);
    env.stop_workers().await;
}

/// Hundreds of draws of one pool at once through the seam: the worker
/// coalesces them into shared Lua calls, and each is still drawn once,
/// with serials that name every draw exactly once, and conservation holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_draws_of_one_pool_share_calls_and_each_is_drawn_once() {
    use prizepool::kinds::{Ask, Kinds, Step};
    let env = TestEnv::new(&[]).await;
    env.load(&pool_toml("hot", "max_count = 100", GIFT)).await;
    let kinds = std::sync::Arc::new(Kinds::new(env.redis.clone(), &env.config.redis_prefix));
    let kind = kinds.resolve("hot").await.unwrap().unwrap();
    let tasks: Vec<_> = (0..300)
        .map(|i| {
            let kinds = kinds.clone();
            let token = env.tokens("rq", &format!("hot-{i}")).answer;
            tokio::spawn(async move {
                let id = format!("hot-{i}");
                let ask = Ask {
                    request_id: &id,
                    pool: "hot",
                    user: i,
                    count: 2,
                    token: &token,
                    result_ttl_s: 600,
                };
                kinds.draw(kind, &ask).await.unwrap()
            })
        })
        .collect();
    let mut serials = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Step::Awarded(award) => {
                assert_eq!(award.result.prizes.len(), 2);
                serials.push(award.result.serial.unwrap());
            }
            other => panic!("{other:?}"),
        }
    }
    serials.sort_unstable();
    let expected: Vec<i64> = (1..=300).map(|i| 2 * i).collect();
    assert_eq!(serials, expected, "each draw applied once, none lost");
    let s = env.status("hot").await;
    assert_eq!(s.drawn, 600);
    assert_eq!(s.stocked, s.drawn + s.in_pool);
}
