//! Everything the fleet publishes fits the wire: grouped ledger entries and
//! fairness records are cut between bodies into messages within 64 KiB,
//! however many one delivery causes, so a `draw.batch` at every limit at
//! once (`MAX_BATCH` at its top, 128-byte request ids of characters JSON
//! escapes, 128-byte pool names, draws of 100 prizes) is paid in full and
//! recorded in full; and a grouped letter dead-lettered for its size is
//! replayed as messages that fit, once. All over the wire, through the
//! fleet, with copies of every settle message and `draw.completed` event
//! caught on queues of the test's own.
#![allow(clippy::unwrap_used)]

use crate::{
    big_draws::{wait_for_audit_consumer, wait_recorded},
    common,
};

use std::time::Duration;

use common::TestEnv;
use futures_util::StreamExt;
use prizepool::{
    amqp, audit,
    messages::{MAX_ID_LEN, MAX_MESSAGE_BYTES},
};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(60);

/// A pool whose every prize pays (so every draw is a ledger entry) and
/// whose batches hold `stock` prizes of one 64-byte combo.
fn paying_pool(id: &str, stock: u64) -> String {
    let combo = format!("c{}", "o".repeat(63));
    format!(
        "[[pools]]\nid = \"{id}\"\nkind = \"lucky_gift\"\nunit_price = 3\nmax_count = 100\nrefill_at = 0.5\n\
         [[pools.combos]]\nid = \"{combo}\"\nstock = {{ \"1\" = {stock}, \"2\" = {stock} }}\n"
    )
}

/// A request id of exactly [`MAX_ID_LEN`] bytes, mostly `"` and `\` (each
/// two bytes once written in JSON), unique by `n`.
fn escaped_id(n: usize) -> String {
    let head = format!("{n:06}-");
    let mut id = head.clone();
    while id.len() < MAX_ID_LEN {
        id.push(if id.len() % 2 == 0 { '"' } else { '\\' });
    }
    id
}

/// A `draw.batch` of as many entries from `entries` as one request message
/// holds and the fleet takes (its reply must have room for every entry
/// shortened to its id, status and error: see `DrawBatch::check_reply_room`).
fn batch_that_fits(entries: impl Iterator<Item = Value>) -> (Value, usize) {
    let mut requests = Vec::new();
    let frame = r#"{"type":"draw.batch","requests":[]}"#.len();
    let (mut bytes, mut reply) = (frame, frame);
    for entry in entries {
        let size = serde_json::to_vec(&entry).unwrap().len() + 1;
        let shortest = serde_json::to_vec(&json!({
            "type": "draw_result", "request_id": entry["request_id"], "status": "rejected",
            "pool": entry["pool"], "user_id": entry["user_id"],
            "error": {"code": "insufficient_funds", "message": ""},
        }))
        .unwrap()
        .len()
            + 1;
        if bytes + size > MAX_MESSAGE_BYTES || reply + shortest > MAX_MESSAGE_BYTES {
            break;
        }
        bytes += size;
        reply += shortest;
        requests.push(entry);
    }
    let n = requests.len();
    (json!({"type": "draw.batch", "requests": requests}), n)
}

/// Every message `consumer` receives until none has come for a while.
async fn drain(consumer: &mut lapin::Consumer) -> Vec<Vec<u8>> {
    let mut bodies = Vec::new();
    while let Ok(Some(delivery)) =
        tokio::time::timeout(Duration::from_secs(3), consumer.next()).await
    {
        bodies.push(delivery.unwrap().data);
    }
    bodies
}

/// The bodies a (possibly grouped) message carries.
fn bodies_of(message: &[u8], field: &str) -> Vec<Value> {
    let value: Value = serde_json::from_slice(message).unwrap();
    match value.get(field) {
        Some(Value::Array(items)) => items.clone(),
        _ => vec![value],
    }
}

/// The bodies of `messages` (grouped under `field`), one per `key`.
fn distinct(messages: &[Vec<u8>], field: &str, key: &str) -> Vec<Value> {
    let mut seen = std::collections::BTreeMap::new();
    for body in messages.iter().flat_map(|m| bodies_of(m, field)) {
        let id = body[key].as_str().unwrap().to_owned();
        seen.entry(id).or_insert(body);
    }
    seen.into_values().collect()
}

/// What the reply to `batch` promised in all: every entry is an award, and
/// an entry the reply shortened past its totals is read whole by sending it
/// again alone, as the protocol tells a caller to (a replay draws nothing).
async fn promised(rpc: &amqp::rpc::RpcClient, batch: &Value, reply: &[u8]) -> i64 {
    assert!(
        reply.len() <= MAX_MESSAGE_BYTES,
        "a reply of {} bytes",
        reply.len()
    );
    let value: Value = serde_json::from_slice(reply).unwrap();
    let results = value["results"].as_array().unwrap();
    let requests = batch["requests"].as_array().unwrap();
    assert_eq!(results.len(), requests.len(), "{value}");
    let mut paid = 0;
    for (r, request) in results.iter().zip(requests) {
        assert_eq!(r["status"], "ok", "{r}");
        paid += match r["reward"].as_i64() {
            Some(reward) => reward,
            None => {
                assert_eq!(r["omitted"], true, "{r}");
                let mut alone = request.clone();
                alone["type"] = json!("draw");
                let whole = rpc.call("draw", &alone, T).await.unwrap();
                assert_eq!(whole["status"], "ok", "{whole}");
                whole["reward"].as_i64().unwrap()
            }
        };
    }
    paid
}

async fn dlq_depths(env: &TestEnv) -> Vec<(&'static str, u32)> {
    let mut depths = Vec::new();
    for dlq in [
        amqp::DRAW.dlq,
        amqp::REFILL.dlq,
        amqp::SETTLE.dlq,
        audit::ROUTE.dlq,
    ] {
        depths.push((dlq, env.queue_depth(dlq).await));
    }
    depths
}

/// One fleet, three batches, each past what one message of its effects
/// could hold: 128-byte escaped ids on a 128-byte pool name (as many
/// entries as the request holds), 1,000 entries of short ids, and 40 draws
/// of 100 prizes. Every settle message and event fits; every award is paid
/// and recorded once; nothing is dead-lettered.
#[tokio::test]
async fn a_batch_at_every_limit_publishes_only_messages_that_fit() {
    let mut env = TestEnv::new(&[("MAX_BATCH", "1000")]).await;
    let long_pool = format!("p{}", "l".repeat(MAX_ID_LEN - 1));
    env.load(&paying_pool(&long_pool, 20_000)).await;
    env.load(&paying_pool("short", 20_000)).await;
    env.start_fleet().await;
    wait_for_audit_consumer(&env).await;
    let (_settle_conn, mut settles) = env.listen_on(amqp::EXCHANGE, "settle").await;
    let (_events_conn, mut events) = env.listen("draw.completed").await;
    let rpc = env.client().await;

    let (escaped, n_escaped) = batch_that_fits((0..).map(|i| {
        json!({"request_id": escaped_id(i), "pool": long_pool, "user_id": i64::MAX - i as i64, "count": 1})
    }));
    assert!(n_escaped > 100, "{n_escaped} entries");
    let (short, n_short) = batch_that_fits((0..1000).map(
        |i| json!({"request_id": format!("s{i}"), "pool": "short", "user_id": i, "count": 1}),
    ));
    assert!(n_short > 400, "{n_short} entries");
    let (big, n_big) = batch_that_fits((0..40).map(
        |i| json!({"request_id": format!("b{i}"), "pool": "short", "user_id": i, "count": 100}),
    ));
    assert_eq!(n_big, 40);

    let mut paid_long = 0;
    let mut paid_short = 0;
    for (batch, n, pool) in [
        (&escaped, n_escaped, long_pool.as_str()),
        (&short, n_short, "short"),
        (&big, n_big, "short"),
    ] {
        let body = serde_json::to_vec(batch).unwrap();
        assert!(body.len() <= MAX_MESSAGE_BYTES);
        let reply = rpc.request("draw", &body, T).await.unwrap();
        let paid = promised(&rpc, batch, &reply).await;
        assert_eq!(batch["requests"].as_array().unwrap().len(), n);
        if pool == "short" {
            paid_short += paid;
        } else {
            paid_long += paid;
        }
    }

    // The ledger pays what the replies promised, and the trail records every
    // draw.
    assert_eq!(env.wait_ledger(&long_pool, paid_long).await, paid_long);
    assert_eq!(env.wait_ledger("short", paid_short).await, paid_short);
    wait_recorded(&env, &long_pool, n_escaped as i64).await;
    wait_recorded(&env, "short", (n_short + n_big) as i64).await;

    // Every settle message and event fits; the entries of one delivery went
    // out in several messages.
    let settle_messages = drain(&mut settles).await;
    let event_messages = drain(&mut events).await;
    let largest = |messages: &[Vec<u8>]| messages.iter().map(Vec::len).max().unwrap_or(0);
    eprintln!(
        "{} settle messages (largest {} bytes), {} event messages (largest {} bytes)",
        settle_messages.len(),
        largest(&settle_messages),
        event_messages.len(),
        largest(&event_messages)
    );
    assert!(largest(&settle_messages) <= MAX_MESSAGE_BYTES);
    assert!(largest(&event_messages) <= MAX_MESSAGE_BYTES);
    // Each entry and record is there (a replay of an omitted entry sends
    // its entry and event again, under the same ids).
    let entries = distinct(&settle_messages, "entries", "entry_id");
    assert_eq!(entries.len(), n_escaped + n_short + n_big);
    let recorded = distinct(&event_messages, "events", "request_id");
    assert_eq!(recorded.len(), n_escaped + n_short + n_big);
    assert!(
        settle_messages.len() >= 6,
        "{} settle messages",
        settle_messages.len()
    );

    for pool in [long_pool.as_str(), "short"] {
        let verdict = audit::verify(&env.db, pool, None).await.unwrap();
        assert!(verdict.ok, "{verdict:?}");
        let status = env.status(pool).await;
        assert_eq!(status.stocked, status.drawn + status.in_pool, "{status:?}");
    }
    for (dlq, depth) in dlq_depths(&env).await {
        assert_eq!(depth, 0, "{dlq}");
    }
    rpc.close().await;
    env.stop_workers().await;
}

/// Publishes `body` into `route`'s dead-letter queue, as the consumer that
/// refused it for its size would have.
async fn dead_letter(env: &TestEnv, route: amqp::Route, body: Vec<u8>) {
    let (conn, channel) = env.confirm_channel("dead-letter").await;
    let mut headers = lapin::types::FieldTable::default();
    headers.insert(
        amqp::ERROR_HEADER.into(),
        lapin::types::AMQPValue::LongString(
            format!(
                "message is {} bytes, the limit is {MAX_MESSAGE_BYTES}",
                body.len()
            )
            .into_bytes()
            .into(),
        ),
    );
    channel
        .basic_publish(
            "".into(),
            route.dlq.into(),
            lapin::options::BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            &body,
            lapin::BasicProperties::default()
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let _ = conn.close(200, "bye".into()).await;
}

/// Letters of the size an earlier version could publish, a `settle.batch`
/// and a `draw.completed.batch` of 1,000 draws each, are replayed by
/// `prizepool dlq replay` as messages that fit: every entry is paid and
/// every draw recorded, once; a second replay finds nothing.
#[tokio::test]
async fn a_grouped_letter_too_big_for_its_queue_is_replayed_in_parts() {
    let mut env = TestEnv::new(&[("MAX_BATCH", "1000")]).await;
    env.load(&paying_pool("short", 20_000)).await;
    // Draws, but nobody settles or records yet.
    env.start_draw_worker().await;
    env.start_refill_worker().await;
    let (_settle_conn, mut settles) = env.listen_on(amqp::EXCHANGE, "settle").await;
    let (_events_conn, mut events) = env.listen("draw.completed").await;
    let rpc = env.client().await;
    let (batch, n) = batch_that_fits((0..1000).map(
        |i| json!({"request_id": format!("r{i}"), "pool": "short", "user_id": i, "count": 1}),
    ));
    let reply = rpc
        .request("draw", &serde_json::to_vec(&batch).unwrap(), T)
        .await
        .unwrap();
    let paid = promised(&rpc, &batch, &reply).await;

    // Every entry and event in one letter each, far past the limit; the
    // messages the fleet sent are gone from the work queues.
    let entries = distinct(&drain(&mut settles).await, "entries", "entry_id");
    let records = distinct(&drain(&mut events).await, "events", "request_id");
    assert_eq!((entries.len(), records.len()), (n, n));
    let settle_letter =
        serde_json::to_vec(&json!({"type": "settle.batch", "entries": entries})).unwrap();
    let audit_letter =
        serde_json::to_vec(&json!({"type": "draw.completed.batch", "events": records})).unwrap();
    assert!(settle_letter.len() > MAX_MESSAGE_BYTES && audit_letter.len() > MAX_MESSAGE_BYTES);
    let (conn, channel) = env.confirm_channel("purge").await;
    for queue in [amqp::SETTLE.queue, audit::ROUTE.queue] {
        channel
            .queue_purge(queue.into(), Default::default())
            .await
            .unwrap();
    }
    let _ = conn.close(200, "bye".into()).await;
    dead_letter(&env, amqp::SETTLE, settle_letter).await;
    dead_letter(&env, audit::ROUTE, audit_letter).await;

    for queue in ["prizepool.settle", "prizepool.audit"] {
        let out = env.cli(&["dlq", "replay", queue, "--json"]).await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["moved"], 1, "{report}");
        assert_eq!(report["split"], 1, "{report}");
        assert!(report["parts"].as_u64().unwrap() >= 2, "{report}");
    }
    assert_eq!(env.queue_depth(amqp::SETTLE.dlq).await, 0);

    env.start_settle_worker().await;
    assert_eq!(env.wait_ledger("short", paid).await, paid);
    wait_recorded(&env, "short", n as i64).await;
    let verdict = audit::verify(&env.db, "short", None).await.unwrap();
    assert!(verdict.ok, "{verdict:?}");
    // Each part was taken: nothing came back to the dead-letter queues.
    for (dlq, depth) in dlq_depths(&env).await {
        assert_eq!(depth, 0, "{dlq}");
    }
    let again = env
        .cli(&["dlq", "replay", "prizepool.settle", "--json"])
        .await;
    let report: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(report["moved"], 0, "{report}");
    let (entries,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM ledger_entries WHERE ref->>'pool' = 'short'")
            .fetch_one(&env.db)
            .await
            .unwrap();
    assert_eq!(entries as usize, n, "each entry paid once");
    rpc.close().await;
    env.stop_workers().await;
}
