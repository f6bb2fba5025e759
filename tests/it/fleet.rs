//! The fleet over real RabbitMQ, Redis and Postgres: replies, settlement,
//! refills, idempotency, bad input, dead letters, shutdown and reconnection.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{draw, pool_toml, spawn_binary, wait_exit, TestEnv};
use prizepool::{amqp, messages::SettleRequest};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(20);

/// A credit of `amount` coins to `account`, booked under `pool` (what the
/// ledger totals of these tests sum by).
fn topup(id: impl Into<String>, account: i64, amount: i64, pool: &str) -> SettleRequest {
    SettleRequest::new(
        id,
        account,
        "coin",
        amount,
        "topup",
        json!({ "pool": pool }),
    )
}

const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 300), (1, 60), (5, 20)]),
    ("b", &[(0, 200), (2, 50), (10, 10)]),
];

#[tokio::test]
async fn draws_refill_and_settle_with_conservation() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "refill_at = 0.5\nmax_count = 100", GIFT))
        .await;
    env.start_fleet().await;
    let client = env.client().await;
    let mut rewards = 0;
    let mut prizes = 0;
    for i in 0..60 {
        let reply = client.call("draw", &draw("g", i % 7, 50), T).await.unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
        assert_eq!(reply["type"], "draw_result");
        let total: u64 = reply["prizes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["multiplier"].as_u64().unwrap())
            .sum();
        assert_eq!(reply["total_multiplier"].as_u64().unwrap(), total);
        assert_eq!(reply["reward"].as_i64().unwrap(), total as i64 * 10);
        rewards += reply["reward"].as_i64().unwrap();
        prizes += reply["prizes"].as_array().unwrap().len() as u64;
    }
    assert_eq!(prizes, 3000);
    let s = env.status("g").await;
    assert!(s.generation >= 5, "refills kept up: {s:?}");
    assert_eq!(s.drawn, 3000);
    assert_eq!(s.stocked, s.drawn + s.in_pool);
    assert_eq!(env.wait_ledger("g", rewards).await, rewards);
    env.stop_workers().await;
}

#[tokio::test]
async fn a_sparse_pool_draws_refills_and_settles_through_the_fleet() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "sp",
        "storage = \"sparse\"\nrefill_at = 0.5\nmax_count = 100",
        GIFT,
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    let mut rewards = 0;
    let mut multipliers = std::collections::BTreeMap::new();
    for i in 0..64 {
        let reply = client
            .call("draw", &draw("sp", i % 5, 60), T)
            .await
            .unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
        rewards += reply["reward"].as_i64().unwrap();
        for p in reply["prizes"].as_array().unwrap() {
            *multipliers
                .entry(p["multiplier"].as_u64().unwrap())
                .or_insert(0u64) += 1;
        }
    }
    // 3,840 prizes = exactly six batches of 640: the config six times over.
    let expected: std::collections::BTreeMap<u64, u64> = [
        (0, 6 * 500),
        (1, 6 * 60),
        (2, 6 * 50),
        (5, 6 * 20),
        (10, 6 * 10),
    ]
    .into_iter()
    .collect();
    assert_eq!(multipliers, expected);
    let s = env.status("sp").await;
    assert_eq!(s.stocked, s.drawn + s.in_pool);
    assert_eq!(env.wait_ledger("sp", rewards).await, rewards);
    env.stop_workers().await;
}

#[tokio::test]
async fn a_redelivered_draw_replays_its_first_result() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "", GIFT)).await;
    env.start_fleet().await;
    let client = env.client().await;
    let request = draw("g", 9, 40);
    let first = client.call("draw", &request, T).await.unwrap();
    let second = client.call("draw", &request, T).await.unwrap();
    assert_eq!(first["status"], "ok");
    assert_eq!(first, second);
    assert_eq!(env.status("g").await.drawn, 40);
    let reward = first["reward"].as_i64().unwrap();
    assert_eq!(env.wait_ledger("g", reward).await, reward);
    let (entries,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM ledger_entries WHERE account = 9")
            .fetch_one(&env.db)
            .await
            .unwrap();
    assert_eq!(entries, i64::from(reward != 0));
    env.stop_workers().await;
}

#[tokio::test]
async fn unknown_pool_is_rejected_at_once() {
    let mut env = TestEnv::new(&[]).await;
    env.start_draw_worker().await;
    let client = env.client().await;
    let reply = client.call("draw", &draw("gift-9", 1, 1), T).await.unwrap();
    assert_eq!(reply["status"], "rejected");
    assert_eq!(reply["error"]["code"], "unknown_pool");
    env.stop_workers().await;
}

#[tokio::test]
async fn a_short_pool_asks_for_a_refill_then_gives_up_with_pool_exhausted() {
    let mut env = TestEnv::new(&[("SHORT_POOL_WAIT_MS", "300")]).await;
    env.load(&pool_toml("s", "refill_at = 1.0", &[("a", &[(0, 10)])]))
        .await;
    // No refill worker: the urgent refill stays in its queue.
    env.start_draw_worker().await;
    let client = env.client().await;
    let reply = client.call("draw", &draw("s", 1, 11), T).await.unwrap();
    assert_eq!(reply["error"]["code"], "pool_exhausted", "{reply}");
    assert_eq!(env.status("s").await.in_pool, 10, "nothing was drawn");
    assert_eq!(
        env.queue_depth(amqp::REFILL.queue).await,
        1,
        "one urgent refill requested"
    );
    // With a refill worker the same draw succeeds.
    env.start_refill_worker().await;
    let reply = client.call("draw", &draw("s", 1, 11), T).await.unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    let s = env.status("s").await;
    assert_eq!((s.generation, s.drawn, s.in_pool), (2, 11, 9));
    env.stop_workers().await;
}

#[tokio::test]
async fn fifty_refill_requests_for_one_trigger_through_the_queue_stock_one_batch() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("r", "", GIFT)).await;
    // A draw past the refill point makes batch 1 due for its successor.
    let mut redis = env.redis.clone();
    let step = prizepool::kinds::lucky_gift::draw_once(
        &mut redis,
        &env.keys("r"),
        prizepool::kinds::lucky_gift::Storage::List,
        "past-the-flag",
        400,
        3600,
        &env.tokens("rq", "past-the-flag").answer,
    )
    .await
    .unwrap();
    assert!(
        matches!(&step, prizepool::kinds::lucky_gift::DrawStep::Drawn(d) if d.trigger == Some(1)),
        "{step:?}"
    );
    let client = env.client().await;
    for _ in 0..50 {
        client
            .send(
                "refill",
                &json!({"type": "refill", "pool": "r", "trigger": 1}),
            )
            .await
            .unwrap();
    }
    env.start_refill_worker().await;
    env.start_refill_worker().await;
    let deadline = tokio::time::Instant::now() + T;
    while env.queue_depth(amqp::REFILL.queue).await > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.stop_workers().await;
    let s = env.status("r").await;
    assert_eq!((s.generation, s.stocked, s.drawn), (2, 1280, 400));
}

#[tokio::test]
async fn every_class_of_bad_input_is_answered_dead_lettered_and_survived() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "max_count = 5", GIFT)).await;
    env.start_draw_worker().await;
    let client = env.client().await;
    let oversize = format!(
        r#"{{"type":"draw","request_id":"big","pool":"g","user_id":1,"count":1,"pad":"{}"}}"#,
        "x".repeat(70_000)
    );
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("not json", b"{oops".to_vec()),
        (
            "wrong type",
            br#"{"type":"draw","request_id":"w","pool":"g","user_id":"one","count":1}"#.to_vec(),
        ),
        (
            "missing field",
            br#"{"type":"draw","request_id":"m","pool":"g","count":1}"#.to_vec(),
        ),
        (
            "count zero",
            br#"{"type":"draw","request_id":"z","pool":"g","user_id":1,"count":0}"#.to_vec(),
        ),
        (
            "count above max_count",
            br#"{"type":"draw","request_id":"x","pool":"g","user_id":1,"count":6}"#.to_vec(),
        ),
        (
            "unknown type",
            br#"{"type":"teleport","request_id":"u"}"#.to_vec(),
        ),
        ("oversize", oversize.into_bytes()),
    ];
    for (name, body) in &cases {
        let reply = client.call_raw("draw", body, T).await.unwrap();
        assert_eq!(reply["status"], "rejected", "{name}: {reply}");
        assert_eq!(reply["error"]["code"], "invalid_request", "{name}: {reply}");
    }
    // Still running.
    let reply = client.call("draw", &draw("g", 1, 5), T).await.unwrap();
    assert_eq!(reply["status"], "ok");
    env.stop_workers().await;

    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let letters = amqp::dlq::list(&conn, amqp::DRAW, 100).await.unwrap();
    assert_eq!(letters.len(), cases.len());
    for l in &letters {
        assert_eq!(l.code.as_deref(), Some("invalid_request"));
        assert_ne!(l.reason, "unknown");
    }
    // Listing leaves them in place; a dry run moves nothing.
    let dry = amqp::dlq::replay(&conn, amqp::DRAW, 100, true)
        .await
        .unwrap();
    assert_eq!((dry.moved, dry.messages.len()), (0, cases.len()));
    // Replay moves them back with their properties and headers.
    let moved = amqp::dlq::replay(&conn, amqp::DRAW, 3, false)
        .await
        .unwrap();
    assert_eq!(moved.moved, 3);
    assert_eq!(
        env.queue_depth(amqp::DRAW.dlq).await as usize,
        cases.len() - 3
    );
    assert_eq!(env.queue_depth(amqp::DRAW.queue).await, 3);
    let ch = conn.create_channel().await.unwrap();
    let got = ch
        .basic_get(amqp::DRAW.queue.into(), Default::default())
        .await
        .unwrap()
        .unwrap();
    let props = &got.delivery.properties;
    assert!(props.reply_to().is_some() && props.correlation_id().is_some());
    assert!(props
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .contains_key(amqp::ERROR_HEADER));
}

#[tokio::test]
async fn settlement_applies_each_entry_once() {
    let mut env = TestEnv::new(&[("SETTLE_BATCH_SIZE", "7")]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let entry = |i: i64| topup(format!("topup:{i}"), 77, 100 + i, "topups");
    // Every entry three times, interleaved, plus a bad one.
    for _ in 0..3 {
        for i in 0..20 {
            client.send("settle", &json!(entry(i))).await.unwrap();
        }
    }
    client
        .send("settle", &json!({"type": "settle", "entry_id": "bad"}))
        .await
        .unwrap();
    let expected: i64 = (0..20).map(|i| 100 + i).sum();
    assert_eq!(env.wait_ledger("topups", expected).await, expected);
    let balances = prizepool::settle::balances(&env.db, 77).await.unwrap();
    assert_eq!(balances[0].balance, expected);
    // Direct replays of a committed batch change nothing either.
    let batch: Vec<SettleRequest> = (0..20).map(entry).collect();
    assert_eq!(
        prizepool::settle::apply(&env.db, &batch)
            .await
            .unwrap()
            .inserted,
        0
    );
    assert_eq!(
        prizepool::settle::balances(&env.db, 77).await.unwrap()[0].balance,
        expected
    );
    let deadline = tokio::time::Instant::now() + T;
    while env.queue_depth(amqp::SETTLE.dlq).await < 1 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(env.queue_depth(amqp::SETTLE.dlq).await, 1);
    env.stop_workers().await;
}

/// Spawns a worker binary pointed at `env`.
#[tokio::test]
async fn two_draw_worker_processes_conserve_prizes_and_the_ledger_matches() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("two", "refill_at = 0.5\nmax_count = 100", GIFT))
        .await;
    env.start_refill_worker().await;
    env.start_settle_worker().await;
    let mut procs = vec![
        spawn_binary(&env, "draw-worker", env!("CARGO_BIN_EXE_draw-worker")),
        spawn_binary(&env, "draw-worker", env!("CARGO_BIN_EXE_draw-worker")),
    ];
    let client = std::sync::Arc::new(env.client().await);
    let mut tasks = Vec::new();
    for user in 0..20 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for i in 0..15 {
                out.push(
                    client
                        .call(
                            "draw",
                            &draw("two", user, 1 + (i * 7 + user as u32) % 60),
                            T,
                        )
                        .await
                        .unwrap(),
                );
            }
            out
        }));
    }
    let mut prizes = 0u64;
    let mut rewards = 0i64;
    for t in tasks {
        for reply in t.await.unwrap() {
            assert_eq!(reply["status"], "ok", "{reply}");
            prizes += reply["prizes"].as_array().unwrap().len() as u64;
            rewards += reply["reward"].as_i64().unwrap();
        }
    }
    let s = env.status("two").await;
    assert_eq!(s.drawn, prizes);
    assert_eq!(s.stocked, s.drawn + s.in_pool);
    assert_eq!(env.wait_ledger("two", rewards).await, rewards);
    for p in &mut procs {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &p.id().to_string()])
            .status();
        assert!(wait_exit(p, Duration::from_secs(15)).await.success());
    }
    env.stop_workers().await;
}

#[tokio::test]
async fn sigterm_drains_in_flight_draws_and_exits_zero() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "drain",
        "refill_at = 0.5\nmax_count = 100",
        GIFT,
    ))
    .await;
    env.start_refill_worker().await;
    env.start_settle_worker().await;
    let mut worker = spawn_binary(&env, "draw-worker", env!("CARGO_BIN_EXE_draw-worker"));
    let client = env.client().await;
    // Wait until the worker consumes, then load the queue and stop it mid-flight.
    let reply = client.call("draw", &draw("drain", 1, 1), T).await.unwrap();
    assert_eq!(reply["status"], "ok");
    let mut requests = Vec::new();
    for i in 0..300 {
        let req = draw("drain", i % 10, 10);
        client.send("draw", &req).await.unwrap();
        requests.push(req);
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status();
    let status = wait_exit(&mut worker, Duration::from_secs(15)).await;
    assert!(status.success(), "exit status {status:?}");
    // Whatever it did not finish is still queued: a second worker finishes it,
    // and every request is drawn exactly once.
    env.start_draw_worker().await;
    let deadline = tokio::time::Instant::now() + T;
    while env.status("drain").await.drawn < 1 + 300 * 10 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.stop_workers().await;
    let s = env.status("drain").await;
    assert_eq!(s.drawn, 1 + 300 * 10, "each request drawn once");
    assert_eq!(s.stocked, s.drawn + s.in_pool);
    assert_eq!(env.queue_depth(amqp::DRAW.queue).await, 0);
}

#[tokio::test]
async fn workers_reconnect_after_the_broker_drops_their_connections() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("rc", "", GIFT)).await;
    env.start_fleet().await;
    let client = env.client().await;
    assert_eq!(
        client.call("draw", &draw("rc", 1, 3), T).await.unwrap()["status"],
        "ok"
    );
    client.close().await;
    let out = std::process::Command::new("rabbitmqctl")
        .args(["close_all_connections", "-p", &env.vhost, "test"])
        .output()
        .unwrap();
    assert!(out.status.success());
    // A new client; the workers come back on their own.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let reply: Value = loop {
        let attempt = async {
            let client = prizepool::amqp::rpc::RpcClient::connect(&env.config).await?;
            client
                .call("draw", &draw("rc", 1, 3), Duration::from_secs(3))
                .await
        };
        match attempt.await {
            Ok(v) => break v,
            Err(e) => assert!(tokio::time::Instant::now() < deadline, "no recovery: {e:#}"),
        }
    };
    assert_eq!(reply["status"], "ok");
    env.stop_workers().await;
}

#[tokio::test]
async fn settlement_survives_a_database_outage_without_loss_or_doubling() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let entry = |i: i64| json!(topup(format!("outage:{i}"), 55, 10, "outage"));
    for i in 0..10 {
        client.send("settle", &entry(i)).await.unwrap();
    }
    assert_eq!(env.wait_ledger("outage", 100).await, 100);

    // The database refuses every connection, and the open ones are cut.
    let admin = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/postgres")
        .await
        .unwrap();
    let db = &env.db_name;
    sqlx::query(&format!("ALTER DATABASE {db} ALLOW_CONNECTIONS false"))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()")
        .bind(db)
        .execute(&admin)
        .await
        .unwrap();
    // Entries arrive during the outage, some of them twice.
    for i in 10..30 {
        client.send("settle", &entry(i)).await.unwrap();
    }
    for i in 20..30 {
        client.send("settle", &entry(i)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Nothing was acked: the messages wait, unacked, in the queue.
    assert_eq!(env.queue_depth(amqp::SETTLE.dlq).await, 0);

    sqlx::query(&format!("ALTER DATABASE {db} ALLOW_CONNECTIONS true"))
        .execute(&admin)
        .await
        .unwrap();
    // Everything lands once: 30 entries of 10.
    assert_eq!(env.wait_ledger("outage", 300).await, 300);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(env.wait_ledger("outage", 300).await, 300);
    assert_eq!(
        prizepool::settle::balances(&env.db, 55).await.unwrap()[0].balance,
        300
    );
    env.stop_workers().await;
}

#[tokio::test]
async fn an_entry_the_ledger_refuses_is_dead_lettered_and_its_batch_still_lands() {
    let mut env = TestEnv::new(&[("SETTLE_BATCH_WAIT_MS", "200")]).await;
    let client = env.client().await;
    let entry = |id: &str, amount: i64| json!(topup(id, 66, amount, "refused"));
    // The second credit would overflow the balance (SQLSTATE 22003).
    for (id, amount) in [
        ("big", prizepool::ledger::MAX_AMOUNT - 5),
        ("overflow", 10),
        ("small-1", 1),
        ("small-2", 2),
    ] {
        client.send("settle", &entry(id, amount)).await.unwrap();
    }
    env.start_settle_worker().await;
    let expected = prizepool::ledger::MAX_AMOUNT - 5 + 3;
    assert_eq!(env.wait_ledger("refused", expected).await, expected);
    let deadline = tokio::time::Instant::now() + T;
    while env.queue_depth(amqp::SETTLE.dlq).await < 1 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.stop_workers().await;
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let letters = amqp::dlq::list(&conn, amqp::SETTLE, 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert!(
        letters[0].body.contains("overflow") && letters[0].reason.contains("refused by the ledger"),
        "{:?}",
        letters[0]
    );
}

#[tokio::test]
async fn a_settle_batch_lands_without_its_bad_entries_which_are_dead_lettered_alone() {
    let mut env = TestEnv::new(&[("SETTLE_BATCH_WAIT_MS", "100")]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let entry = |id: &str, amount: i64| json!(topup(id, 88, amount, "batched"));
    let reply = client
        .call(
            "settle",
            &json!({"type": "settle.batch", "entries": [
                entry("b-1", 10),
                {"type": "settle", "entry_id": "b-missing-fields"},
                entry("b-2", 20),
                entry("b-1", 10),
                entry("b-huge", prizepool::ledger::MAX_AMOUNT - 100),
                entry("b-overflow", 100),
                entry("b-3", 30),
            ]}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    // Six entries decode; the overflowing one is refused by the ledger.
    assert_eq!(reply["entries"], 5, "{reply}");
    // Not a batch at all: the whole message is dead-lettered and answered.
    let bad = client
        .call(
            "settle",
            &json!({"type": "settle.batch", "entries": "b-4"}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(bad["status"], "rejected", "{bad}");

    let expected = prizepool::ledger::MAX_AMOUNT - 40;
    let total = env.wait_ledger("batched", expected).await;
    assert_eq!(total, expected);
    let deadline = tokio::time::Instant::now() + T;
    while env.queue_depth(amqp::SETTLE.dlq).await < 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.stop_workers().await;
    // b-1 once, b-2, b-3 and b-huge: the ledger sum is exact, nothing doubled.
    let balances = prizepool::settle::balances(&env.db, 88).await.unwrap();
    assert_eq!(balances[0].balance, expected);
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let letters = amqp::dlq::list(&conn, amqp::SETTLE, 10).await.unwrap();
    assert_eq!(letters.len(), 3, "{letters:?}");
    // Each bad entry is a message of its own: none carries the good ones.
    assert!(
        letters.iter().all(|l| !l.body.contains("b-2")),
        "{letters:?}"
    );
    assert!(letters
        .iter()
        .any(|l| l.body.contains("b-missing-fields") && !l.body.contains("settle.batch")));
    assert!(letters.iter().any(|l| l.body.contains("b-overflow")
        && !l.body.contains("settle.batch")
        && l.reason.contains("refused by the ledger")));
    assert!(letters
        .iter()
        .any(|l| l.body.contains("settle.batch") && l.reason.contains("entries")));
}

#[tokio::test]
async fn concurrent_ledger_entries_travel_in_few_messages_and_none_is_lost() {
    let env = TestEnv::new(&[]).await;
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let channel = conn.create_channel().await.unwrap();
    amqp::declare_topology(&channel, env.config.delivery_limit)
        .await
        .unwrap();
    let publisher = amqp::Publisher::new(conn.create_channel().await.unwrap())
        .await
        .unwrap();
    let (ledger, task) = amqp::grouped::Grouper::start(publisher, prizepool::ledger::ENTRIES);
    let entries: Vec<SettleRequest> = (0..500)
        .map(|i| topup(format!("group:{i}"), 5, 1 + i, "grouped"))
        .collect();
    // 500 deliveries settling at once, as a busy draw worker's would.
    let all = futures_util::future::join_all(
        entries
            .iter()
            .map(|e| ledger.publish(vec![serde_json::to_vec(e).unwrap()])),
    )
    .await;
    assert!(all.iter().all(Result::is_ok), "{all:?}");
    drop(ledger);
    task.await.unwrap();

    let messages = env.queue_depth(amqp::SETTLE.queue).await as usize;
    assert!(
        (1..100).contains(&messages),
        "500 entries took {messages} messages"
    );
    let mut env = env;
    env.start_settle_worker().await;
    let expected: i64 = (0..500).map(|i| 1 + i).sum();
    assert_eq!(env.wait_ledger("grouped", expected).await, expected);
    env.stop_workers().await;
}

/// Receives event messages until they hold `expected` events; returns the
/// messages' types and the events (the members of a batch, in order).
async fn receive_draw_events(
    consumer: &mut lapin::Consumer,
    expected: usize,
) -> (Vec<String>, Vec<Value>) {
    use futures_util::StreamExt;
    let (mut types, mut events) = (Vec::new(), Vec::new());
    while events.len() < expected {
        let delivery = tokio::time::timeout(T, consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{} of {expected} events arrived", events.len()))
            .unwrap()
            .unwrap();
        let message: Value = serde_json::from_slice(&delivery.data).unwrap();
        let kind = message["type"].as_str().unwrap().to_owned();
        match kind.as_str() {
            "draw.completed" => events.push(message),
            "draw.completed.batch" => events.extend(message["events"].as_array().unwrap().clone()),
            other => panic!("unexpected event type {other}"),
        }
        types.push(kind);
    }
    (types, events)
}

/// Fires `n` draws at once and returns their replies.
async fn concurrent_draws(env: &TestEnv, pool: &str, n: i64) -> Vec<Value> {
    let client = env.client().await;
    let requests: Vec<Value> = (0..n).map(|i| draw(pool, i, 3)).collect();
    let replies =
        futures_util::future::join_all(requests.iter().map(|r| client.call("draw", r, T))).await;
    replies.into_iter().map(Result::unwrap).collect()
}

/// Every reply has exactly one event, equal to it but for its type and the
/// fleet's seal (for the audit trail, `docs/fairness.md`).
fn assert_one_event_per_reply(replies: &[Value], events: &[Value]) {
    let mut by_id: std::collections::HashMap<String, Value> = events
        .iter()
        .map(|e| (e["request_id"].as_str().unwrap().to_owned(), e.clone()))
        .collect();
    assert_eq!(by_id.len(), events.len(), "an event came twice");
    for reply in replies {
        assert_eq!(reply["status"], "ok", "{reply}");
        let id = reply["request_id"].as_str().unwrap();
        let mut event = by_id
            .remove(id)
            .unwrap_or_else(|| panic!("no event for {id}"));
        assert_eq!(event["type"], "draw.completed");
        let seal = event.as_object_mut().unwrap().remove("seal");
        assert!(
            seal.as_ref()
                .and_then(Value::as_str)
                .is_some_and(|s| s.len() == 64),
            "{seal:?}"
        );
        event["type"] = reply["type"].clone();
        assert_eq!(&event, reply);
    }
    assert!(by_id.is_empty(), "events of no draw: {by_id:?}");
}

#[tokio::test]
async fn concurrent_draws_tell_each_event_once_in_grouped_messages() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("ev", "refill_at = 0.5\nmax_count = 100", GIFT))
        .await;
    let (_conn, mut consumer) = env.listen("draw.completed").await;
    env.start_fleet().await;
    let replies = concurrent_draws(&env, "ev", 300).await;
    let (types, events) = receive_draw_events(&mut consumer, replies.len()).await;
    assert_one_event_per_reply(&replies, &events);
    assert!(
        types.len() < replies.len() && types.iter().any(|t| t == "draw.completed.batch"),
        "300 concurrent draws took {} event messages",
        types.len()
    );
    // Under light load a group holds one event, which goes out plain.
    let client = env.client().await;
    let lone = client.call("draw", &draw("ev", 1, 2), T).await.unwrap();
    let (types, events) = receive_draw_events(&mut consumer, 1).await;
    assert_eq!(types, ["draw.completed"]);
    assert_one_event_per_reply(&[lone], &events);
    env.stop_workers().await;
}

#[tokio::test]
async fn draw_events_each_sends_one_message_per_draw_and_off_sends_none() {
    let mut env = TestEnv::new(&[("DRAW_EVENTS", "each")]).await;
    env.load(&pool_toml("ev", "refill_at = 0.5\nmax_count = 100", GIFT))
        .await;
    let (_conn, mut consumer) = env.listen("draw.completed").await;
    env.start_fleet().await;
    let replies = concurrent_draws(&env, "ev", 100).await;
    let (types, events) = receive_draw_events(&mut consumer, replies.len()).await;
    assert_one_event_per_reply(&replies, &events);
    assert!(types.iter().all(|t| t == "draw.completed"), "{types:?}");
    env.stop_workers().await;

    env.config.draw_events = prizepool::config::DrawEvents::Off;
    env.start_fleet().await;
    let replies = concurrent_draws(&env, "ev", 50).await;
    assert!(replies.iter().all(|r| r["status"] == "ok"));
    // The replies came after the draws' confirms, so an event would be here.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stray = tokio::time::timeout(
        Duration::from_millis(300),
        futures_util::StreamExt::next(&mut consumer),
    )
    .await;
    assert!(stray.is_err(), "an event with DRAW_EVENTS=off: {stray:?}");
    env.stop_workers().await;
}
