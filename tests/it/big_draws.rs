//! Issue 25, point 4 (and issue 26, point 8): big draws fit the wire.
//! Pools of `max_count = 10000` with 64-byte combo ids load; a draw of
//! 10,000 prizes is answered in one message of at most 64 KiB in the
//! compact `prize_codes` form, which the client and `prizepool draw` expand
//! to the full list; the ledger pays what the reply promises, conservation
//! holds, a retry replays the identical answer, the audit trail verifies;
//! a draw of 100 prizes keeps the plain list; batch replies stay within
//! 64 KiB. All over the wire, through the fleet.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::BTreeMap, time::Duration};

use common::TestEnv;
use futures_util::StreamExt;
use prizepool::{
    audit,
    client::{Client, ClientConfig},
    messages::{DrawRequest, DrawResult, Prize, MAX_MESSAGE_BYTES, PRIZE_LIST_MAX},
};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

/// A combo id of exactly 64 bytes, `n`-th of its pool.
fn combo(n: usize) -> String {
    let id = format!("combo-{n}-with-a-long.name_for:live-gifts-");
    format!("{id}{}", "x".repeat(64 - id.len()))
}

/// A pool of `combos` combos of 64-byte ids, each 10,000 prizes of seven
/// multipliers, `max_count = 10000`.
fn big_pool(id: &str, combos: usize, extra: &str) -> String {
    let mut text = format!(
        "[[pools]]\nid = \"{id}\"\nkind = \"lucky_gift\"\nunit_price = 10\nmax_count = 10000\nrefill_at = 0.5\n{extra}\n"
    );
    for n in 0..combos {
        text.push_str(&format!(
            "[[pools.combos]]\nid = \"{}\"\nstock = {{ \"0\" = 7000, \"1\" = 1500, \"2\" = 900, \"5\" = 450, \"10\" = 140, \"100\" = 9, \"1000\" = 1 }}\n",
            combo(n)
        ));
    }
    text
}

/// The (combo, multiplier) pairs of a result's prizes.
fn pairs(prizes: &[Prize]) -> Vec<(String, u64)> {
    prizes
        .iter()
        .map(|p| match p {
            Prize::Multiplier { multiplier, combo } => (combo.clone(), *multiplier),
            other => panic!("not a lucky-gift prize: {other:?}"),
        })
        .collect()
}

/// A reply read as a `DrawResult` with its prizes expanded, as a consumer
/// of the wire would.
fn expanded(reply: &[u8]) -> DrawResult {
    let mut result: DrawResult = serde_json::from_slice(reply).unwrap();
    result.expand_prizes().unwrap();
    result
}

fn draw_body(request_id: &str, pool: &str, user: i64, count: u32) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "type": "draw", "request_id": request_id, "pool": pool, "user_id": user, "count": count,
    }))
    .unwrap()
}

/// Waits until the audit consumer listens (it binds its queue beside the
/// settle worker, so the first events could otherwise reach no audit queue).
pub(crate) async fn wait_for_audit_consumer(env: &TestEnv) {
    let deadline = tokio::time::Instant::now() + T;
    let conn = prizepool::amqp::connect(&env.config.amqp_url, "test")
        .await
        .unwrap();
    loop {
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

/// Waits until the pool has stocked batch `generation`.
async fn wait_generation(env: &TestEnv, pool: &str, generation: u64) {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let status = env.status(pool).await;
        if status.generation >= generation {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "batch {generation} of {pool} never came: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the audit trail holds `n` draws of `pool`.
pub(crate) async fn wait_recorded(env: &TestEnv, pool: &str, n: i64) {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let (draws,): (i64,) = sqlx::query_as("SELECT count(*) FROM fair_draws WHERE pool = $1")
            .bind(pool)
            .fetch_one(&env.db)
            .await
            .unwrap();
        if draws == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "audit trail of {pool}: {draws} draws, {n} expected"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The whole contract for draws of 10,000 prizes: the reply fits, expands
/// to exactly 10,000 prizes whose multipliers sum to the total, the ledger
/// pays the reward, a retry replays the identical bytes, the sealed
/// `draw.completed` event fits a message too, conservation holds, the
/// client and the CLI expand the compact form, and the audit verifier
/// checks every one of the 20,000 prizes against the revealed seed.
#[tokio::test]
async fn draws_of_ten_thousand_prizes_fit_one_message() {
    let mut env = TestEnv::new(&[("DRAW_EVENTS", "each")]).await;
    // Batches of 20,000 prizes with 64-byte combo ids: the second draw of
    // 10,000 spans two batches and reveals the first.
    env.load(&big_pool("big", 2, "")).await;
    env.start_fleet().await;
    wait_for_audit_consumer(&env).await;
    let (_events_conn, mut events) = env.listen("draw.completed").await;
    let rpc = env.client().await;

    let first_id = ulid::Ulid::new().to_string();
    let first = rpc
        .request("draw", &draw_body(&first_id, "big", 42, 10_000), T)
        .await
        .unwrap();
    assert!(
        first.len() <= MAX_MESSAGE_BYTES,
        "a reply of {} bytes",
        first.len()
    );
    eprintln!("a reply of 10,000 prizes: {} bytes", first.len());
    let raw: Value = serde_json::from_slice(&first).unwrap();
    assert_eq!(raw["status"], "ok", "{raw}");
    assert!(raw.get("prizes").is_none(), "a big draw lists no prizes");
    assert_eq!(raw["prize_codes"]["count"], 10_000);
    let result = expanded(&first);
    let prizes = pairs(&result.prizes);
    assert_eq!(prizes.len(), 10_000);
    let total: u64 = prizes.iter().map(|(_, m)| m).sum();
    assert_eq!(result.total_multiplier, Some(total));
    assert_eq!(result.reward, Some(total as i64 * 10));
    assert!(prizes.iter().all(|(c, _)| c.len() == 64));
    let covered: u64 = result.positions.iter().map(|r| r.count).sum();
    assert_eq!(covered, 10_000, "the positions cover every prize");

    // The answer kept in Redis is compact too: the pool's prize codes, a
    // run of equal codes written once.
    let (_, stored) = env.stored_answer("big", &first_id).await;
    let stored = stored.expect("the answer is kept");
    eprintln!("the stored answer of 10,000 prizes: {} bytes", stored.len());
    assert!(
        stored.len() <= MAX_MESSAGE_BYTES / 2,
        "{} bytes kept",
        stored.len()
    );
    assert!(
        String::from_utf8_lossy(&stored).contains('*'),
        "equal codes in a row are kept as runs"
    );

    // A retry of the same request replays the identical answer.
    let again = rpc
        .request("draw", &draw_body(&first_id, "big", 42, 10_000), T)
        .await
        .unwrap();
    assert_eq!(again, first, "a retry replays the identical bytes");

    // The second draw needs the next batch: the first took its refill point.
    wait_generation(&env, "big", 2).await;
    let client = Client::connect(
        ClientConfig::new(&env.config.amqp_url)
            .linger(Duration::from_millis(2))
            .timeout(T),
    )
    .await
    .unwrap();
    let second_id = ulid::Ulid::new().to_string();
    let second = client
        .draw(DrawRequest {
            request_id: second_id.clone(),
            pool: "big".into(),
            user_id: 43,
            count: 10_000,
        })
        .await
        .unwrap();
    assert!(second.prize_codes.is_none(), "the client expands");
    assert_eq!(second.prizes.len(), 10_000);
    assert_eq!(
        second.total_multiplier,
        Some(pairs(&second.prizes).iter().map(|(_, m)| m).sum())
    );
    assert!(
        second.revealed.iter().any(|r| r.generation == 1),
        "the second draw used up batch 1: {:?}",
        second.revealed
    );
    // The client's expansion is the wire's: the same request read raw.
    let raw_second = rpc
        .request("draw", &draw_body(&second_id, "big", 43, 10_000), T)
        .await
        .unwrap();
    assert!(raw_second.len() <= MAX_MESSAGE_BYTES);
    assert_eq!(expanded(&raw_second), second);
    // The first result through the client (a replay) is the same too.
    let replayed = client
        .draw(DrawRequest {
            request_id: first_id.clone(),
            pool: "big".into(),
            user_id: 42,
            count: 10_000,
        })
        .await
        .unwrap();
    assert_eq!(replayed, result);
    client.close().await;

    // `prizepool draw` prints the expanded list.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_prizepool"))
        .args([
            "draw",
            "--pool",
            "big",
            "--user",
            "42",
            "--count",
            "10000",
            "--request-id",
            &first_id,
        ])
        .envs(env.env())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: DrawResult = serde_json::from_slice(&out.stdout).unwrap();
    assert!(printed.prize_codes.is_none());
    assert_eq!(printed, result, "the CLI prints the expanded answer");

    // Each draw's sealed event fits a message and carries the compact form.
    let mut seen = BTreeMap::new();
    while seen.len() < 2 {
        let delivery = tokio::time::timeout(T, events.next())
            .await
            .expect("draw.completed events")
            .unwrap()
            .unwrap();
        assert!(delivery.data.len() <= MAX_MESSAGE_BYTES);
        let event: Value = serde_json::from_slice(&delivery.data).unwrap();
        assert_eq!(event["type"], "draw.completed");
        assert!(event["seal"].is_string());
        assert!(event["prize_codes"].is_object());
        let id = event["request_id"].as_str().unwrap().to_owned();
        seen.insert(id, delivery.data.len());
    }
    assert!(seen.contains_key(&first_id) && seen.contains_key(&second_id));

    // The ledger pays exactly what the two replies promised, once each.
    let promised = result.reward.unwrap() + second.reward.unwrap();
    assert_eq!(env.wait_ledger("big", promised).await, promised);
    // Conservation: stocked = drawn + still in the pool.
    let status = env.status("big").await;
    assert_eq!(status.drawn, 20_000);
    assert_eq!(status.stocked, status.drawn + status.in_pool, "{status:?}");

    // The audit trail keeps each draw as one compact value and verifies
    // every prize of the batch the two draws used up.
    wait_recorded(&env, "big", 2).await;
    let kept: Vec<Value> = sqlx::query_scalar("SELECT prizes FROM fair_draws WHERE pool = 'big'")
        .fetch_all(&env.db)
        .await
        .unwrap();
    assert!(kept.iter().all(|p| p["count"] == 10_000), "{kept:?}");
    let verdict = audit::verify(&env.db, "big", Some(1)).await.unwrap();
    assert!(verdict.ok, "{verdict:?}");
    let batch = &verdict.batches[0];
    assert_eq!(batch.status, "ok", "{batch:?}");
    assert!(batch.complete, "{batch:?}");
    assert_eq!(batch.prizes_checked, 20_000);
    rpc.close().await;
    env.stop_workers().await;
}

/// The plain list stays for ordinary draws: 100 prizes (the documented
/// threshold) are listed one by one; 101 come in the compact form.
#[tokio::test]
async fn draws_up_to_the_threshold_keep_the_prize_list() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&big_pool("plain", 1, "")).await;
    env.start_fleet().await;
    let rpc = env.client().await;
    let reply = rpc
        .call("draw", &common::draw("plain", 1, PRIZE_LIST_MAX as u32), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(reply["prizes"].as_array().unwrap().len(), 100);
    assert!(reply.get("prize_codes").is_none());
    assert_eq!(reply["prizes"][0]["combo"].as_str().unwrap().len(), 64);
    let reply = rpc
        .call(
            "draw",
            &common::draw("plain", 2, PRIZE_LIST_MAX as u32 + 1),
            T,
        )
        .await
        .unwrap();
    assert!(reply.get("prizes").is_none(), "{reply}");
    assert_eq!(reply["prize_codes"]["count"], 101);
    let mut result: DrawResult = serde_json::from_value(reply).unwrap();
    result.expand_prizes().unwrap();
    assert_eq!(result.prizes.len(), 101);
    assert_eq!(
        result.total_multiplier,
        Some(pairs(&result.prizes).iter().map(|(_, m)| m).sum())
    );
    rpc.close().await;
    env.stop_workers().await;
}

/// Issue 26, point 8: a `draw.batch` of 40 entries of 1,000 prizes would
/// take over a megabyte listed and ~150 KB compact; its reply stays within 64 KiB, answers every entry
/// in order with its totals, and an entry shortened to fit (`omitted`)
/// replays whole when sent alone. Through the batching client, a hundred
/// concurrent draws of 100 prizes each get their full lists, and the
/// ledger pays exactly what the answers say.
#[tokio::test]
async fn batch_replies_stay_within_64_kib() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&big_pool("many", 4, "")).await;
    env.start_fleet().await;
    let rpc = env.client().await;
    let entries: Vec<Value> = (0..40)
        .map(|i| {
            serde_json::json!({"request_id": format!("batch-{i}"), "pool": "many", "user_id": 100 + i, "count": 1000})
        })
        .collect();
    let body = serde_json::to_vec(&serde_json::json!({"type": "draw.batch", "requests": entries}))
        .unwrap();
    let reply = rpc.request("draw", &body, T).await.unwrap();
    eprintln!("a batch reply of 40 × 1,000 prizes: {} bytes", reply.len());
    assert!(reply.len() <= MAX_MESSAGE_BYTES, "{} bytes", reply.len());
    let batch: Value = serde_json::from_slice(&reply).unwrap();
    let results = batch["results"].as_array().unwrap();
    assert_eq!(results.len(), 40);
    let mut promised = 0;
    let mut omitted = 0;
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r["request_id"], format!("batch-{i}"), "request order");
        assert_eq!(r["status"], "ok", "{r}");
        let reward = r["reward"].as_i64().expect("every entry keeps its totals");
        promised += reward;
        let whole = if r["omitted"] == true {
            omitted += 1;
            assert!(r.get("prize_codes").is_none() && r.get("prizes").is_none());
            // Sent again alone, the entry replays its whole answer.
            let alone = rpc
                .request(
                    "draw",
                    &draw_body(&format!("batch-{i}"), "many", 100 + i as i64, 1000),
                    T,
                )
                .await
                .unwrap();
            assert!(alone.len() <= MAX_MESSAGE_BYTES);
            expanded(&alone)
        } else {
            let mut result: DrawResult = serde_json::from_value(r.clone()).unwrap();
            result.expand_prizes().unwrap();
            result
        };
        assert!(!whole.omitted);
        assert_eq!(whole.prizes.len(), 1000);
        assert_eq!(whole.reward, Some(reward));
        assert_eq!(
            whole.total_multiplier,
            Some(pairs(&whole.prizes).iter().map(|(_, m)| m).sum())
        );
    }
    eprintln!("{omitted} of 40 entries shortened");
    assert!(
        omitted > 0,
        "40 compact answers of 1,000 prizes share 64 KiB"
    );

    // The batching client: 100 concurrent draws of 100 prizes (listed, about
    // 9 KB each) gather into batches whose replies cannot hold them all.
    let client = Client::connect(
        ClientConfig::new(&env.config.amqp_url)
            .linger(Duration::from_millis(20))
            .batch_size(100)
            .timeout(T),
    )
    .await
    .unwrap();
    let calls = (0..100).map(|u| {
        let client = &client;
        async move {
            client
                .draw(prizepool::client::draw_request("many", 1000 + u, 100))
                .await
                .unwrap()
        }
    });
    let answers = futures_util::future::join_all(calls).await;
    for a in &answers {
        assert_eq!(a.status, prizepool::messages::Status::Ok, "{a:?}");
        assert!(!a.omitted);
        assert_eq!(a.prizes.len(), 100);
        promised += a.reward.unwrap();
    }
    let (messages, entries, _, _) = client.stats().snapshot();
    assert!(
        entries > messages,
        "the client batched: {entries} entries in {messages} messages"
    );
    client.close().await;
    assert_eq!(env.wait_ledger("many", promised).await, promised);
    let status = env.status("many").await;
    assert_eq!(status.drawn, 40 * 1000 + 100 * 100);
    assert_eq!(status.stocked, status.drawn + status.in_pool, "{status:?}");
    rpc.close().await;
    env.stop_workers().await;
}

/// A sparse pool (only non-zero prizes stored) answers a draw of 10,000
/// prizes the same way: one compact reply within 64 KiB, paid as promised.
#[tokio::test]
async fn sparse_pools_answer_big_draws_compactly() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&big_pool("sparse", 2, "storage = \"sparse\""))
        .await;
    env.start_fleet().await;
    let rpc = env.client().await;
    let id = ulid::Ulid::new().to_string();
    let reply = rpc
        .request("draw", &draw_body(&id, "sparse", 9, 10_000), T)
        .await
        .unwrap();
    assert!(reply.len() <= MAX_MESSAGE_BYTES, "{} bytes", reply.len());
    let result = expanded(&reply);
    assert_eq!(result.status, prizepool::messages::Status::Ok, "{result:?}");
    assert_eq!(result.prizes.len(), 10_000);
    let total: u64 = pairs(&result.prizes).iter().map(|(_, m)| m).sum();
    assert_eq!(result.total_multiplier, Some(total));
    let again = rpc
        .request("draw", &draw_body(&id, "sparse", 9, 10_000), T)
        .await
        .unwrap();
    assert_eq!(again, reply);
    let promised = result.reward.unwrap();
    assert_eq!(env.wait_ledger("sparse", promised).await, promised);
    let status = env.status("sparse").await;
    assert_eq!(status.drawn, 10_000);
    assert_eq!(status.stocked, status.drawn + status.in_pool, "{status:?}");
    rpc.close().await;
    env.stop_workers().await;
}
