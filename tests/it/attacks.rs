//! The fleet attacked over its wire contract only, the way a hostile or
//! careless upstream would: every message type and field malformed, ids
//! reused across pools and kinds, internal messages forged, concurrent
//! copies, odd AMQP properties. Whatever arrives, each request gets one
//! clear answer, no money or prize is created or destroyed, and the worker
//! goes on serving.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::HashMap, sync::Mutex, time::Duration};

use chrono::{Duration as Days, Utc};
use common::{activity_toml, pool_toml, raw::Raw, TestEnv};
use lapin::{
    types::{AMQPValue, FieldTable},
    BasicProperties,
};
use prizepool::{amqp, kinds::red_packet};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn draw_as(request_id: &str, pool: &str, user: i64, count: u32) -> Value {
    json!({"type": "draw", "request_id": request_id, "pool": pool, "user_id": user, "count": count})
}

fn grant(id: &str, activity: &str, user: i64, chances: u32) -> Value {
    json!({"type": "lottery.grant", "grant_id": id, "activity": activity, "user_id": user, "chances": chances})
}

fn create(packet: &str, sender: i64, total: i64, count: i64, min: i64, expires_in_s: i64) -> Value {
    json!({"type": "redpacket.create", "packet_id": packet, "sender": sender, "total": total,
           "count": count, "min": min, "expires_in_s": expires_in_s})
}

fn settle(entry_id: &str, account: i64, amount: i64, reason: &str) -> Value {
    json!({"type": "settle", "entry_id": entry_id, "account": account, "asset": "coin",
           "amount": amount, "reason": reason})
}

fn code(reply: &Value) -> &str {
    reply["error"]["code"].as_str().unwrap_or("")
}

/// Credits `amount` coins to `account` straight in the ledger.
async fn balance_of(env: &TestEnv, account: i64, asset: &str) -> i64 {
    prizepool::settle::balances(&env.db, account)
        .await
        .unwrap()
        .into_iter()
        .find(|b| b.asset == asset)
        .map_or(0, |b| b.balance)
}

async fn coins(env: &TestEnv, account: i64) -> i64 {
    balance_of(env, account, "coin").await
}

/// Waits until `account` holds `expected` of `asset` (or the time is up)
/// and returns what it holds.
async fn wait_balance(env: &TestEnv, account: i64, asset: &str, expected: i64) -> i64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let b = balance_of(env, account, asset).await;
        if b == expected || tokio::time::Instant::now() > deadline {
            return b;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `queue` holds at least `n` messages (or the time is up) and
/// returns its depth.
async fn wait_depth(env: &TestEnv, queue: &str, n: u32) -> u32 {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let depth = env.queue_depth(queue).await;
        if depth >= n || tokio::time::Instant::now() > deadline {
            return depth;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn packet(env: &TestEnv, id: &str) -> Option<red_packet::PacketStatus> {
    let mut redis = env.redis.clone();
    red_packet::status(&mut redis, &env.keys(id)).await.unwrap()
}

/// Escrowed total of `packet` in the ledger (its escrow entry, negated).
async fn escrowed(env: &TestEnv, packet: &str) -> i64 {
    let row: Option<(i64,)> =
        sqlx::query_as("SELECT amount FROM ledger_entries WHERE entry_id = $1")
            .bind(format!("redpacket:{packet}:escrow"))
            .fetch_optional(&env.db)
            .await
            .unwrap();
    row.map_or(0, |(a,)| -a)
}

/// Sum of all ledger entries of `asset`: what the fleet created out of
/// nothing on top of top-ups.
async fn ledger_sum(env: &TestEnv, asset: &str, reasons: &[&str]) -> i64 {
    let reasons: Vec<String> = reasons.iter().map(|r| (*r).to_owned()).collect();
    let (sum,): (i64,) = sqlx::query_as(
        "SELECT coalesce(sum(amount), 0)::bigint FROM ledger_entries WHERE asset = $1 AND reason = ANY($2)",
    )
    .bind(asset)
    .bind(&reasons)
    .fetch_one(&env.db)
    .await
    .unwrap();
    sum
}

/// Every balance equals the sum of its account's entries.
async fn assert_balances_follow_entries(env: &TestEnv) {
    let rows: Vec<(i64, String, i64, i64)> = sqlx::query_as(
        "SELECT b.account, b.asset, b.balance, coalesce((SELECT sum(amount) FROM ledger_entries e WHERE e.account = b.account AND e.asset = b.asset), 0)::bigint FROM balances b",
    )
    .fetch_all(&env.db)
    .await
    .unwrap();
    for (account, asset, balance, sum) in rows {
        assert_eq!(balance, sum, "account {account} {asset}");
        assert!(
            balance >= 0,
            "account {account} {asset} is overdrawn: {balance}"
        );
    }
}

// ---------------------------------------------------------------------------
// Money: ids reused after their answer expired, across pools and activities
// ---------------------------------------------------------------------------

/// Forgets the stored answer and the claim of `request_id` on `pool`, as
/// `RESULT_TTL_S` does a day later.
async fn expire_answer(env: &TestEnv, pool: &str, request_id: &str) {
    env.forget_answer(pool, request_id).await;
}

#[tokio::test]
async fn a_request_id_reused_on_another_pool_after_expiry_is_paid_in_full() {
    let mut env = TestEnv::new(&[]).await;
    // Two pools alike (one of each storage): the same serials, the same rewards.
    env.load(&pool_toml("pa", "", &[("a", &[(3, 100)])])).await;
    env.load(&pool_toml(
        "pb",
        "storage = \"sparse\"",
        &[("a", &[(3, 100)])],
    ))
    .await;
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let first = client
        .call("draw", &draw_as("x-1", "pa", 5, 2), T)
        .await
        .unwrap();
    assert_eq!(first["reward"], 60, "{first}");
    assert_eq!(env.wait_ledger("pa", 60).await, 60);
    // A day later the id is free again; an upstream uses it on another pool.
    expire_answer(&env, "pa", "x-1").await;
    let second = client
        .call("draw", &draw_as("x-1", "pb", 5, 2), T)
        .await
        .unwrap();
    assert_eq!(second["status"], "ok", "{second}");
    assert_eq!(second["reward"], 60, "{second}");
    // Both replies promised 60; the ledger must pay both.
    assert_eq!(env.wait_ledger("pb", 60).await, 60, "pb's reward is unpaid");
    assert_eq!(wait_balance(&env, 5, "coin", 120).await, 120);
    let (a, b) = (env.status("pa").await, env.status("pb").await);
    assert_eq!((a.drawn, b.drawn), (2, 2));
    env.stop_workers().await;
}

#[tokio::test]
async fn a_request_id_reused_on_another_activity_after_expiry_is_paid_in_full() {
    let mut env = TestEnv::new(&[]).await;
    let now = Utc::now();
    for id in ["act-a", "act-b"] {
        env.load_activities(&format!(
            "[[activities]]\nid = \"{id}\"\nstrategy = \"wheel\"\nstarts_at = \"{}\"\nends_at = \"{}\"\nprizes = [ {{ id = \"x\", weight = 1, stock = 10 }} ]\n",
            (now - Days::hours(1)).to_rfc3339(),
            (now + Days::hours(1)).to_rfc3339(),
        ))
        .await;
    }
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;
    for act in ["act-a", "act-b"] {
        let g = client
            .call("draw", &grant(&format!("g-{act}"), act, 5, 1), T)
            .await
            .unwrap();
        assert_eq!(g["status"], "ok", "{g}");
    }
    let first = client
        .call("draw", &draw_as("l-1", "act-a", 5, 1), T)
        .await
        .unwrap();
    assert_eq!(first["status"], "ok", "{first}");
    assert_eq!(wait_balance(&env, 5, "item:x", 1).await, 1);
    expire_answer(&env, "act-a", "l-1").await;
    let second = client
        .call("draw", &draw_as("l-1", "act-b", 5, 1), T)
        .await
        .unwrap();
    assert_eq!(second["status"], "ok", "{second}");
    assert_eq!(second["prizes"][0]["prize"], "x", "{second}");
    // Two prizes awarded, two paid.
    assert_eq!(wait_balance(&env, 5, "item:x", 2).await, 2);
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// Money: overdrafts raced through the settle queue and red-packet escrow
// ---------------------------------------------------------------------------

#[tokio::test]
async fn concurrent_debits_never_overdraw_an_account() {
    let mut env = TestEnv::new(&[("SETTLE_BATCH_SIZE", "4")]).await;
    // Two settle workers compete for the same accounts.
    env.start_settle_worker().await;
    env.start_settle_worker().await;
    env.start_refill_worker().await;
    let client = env.client().await;

    // Thirty withdrawals of 10 against a balance of 100, all at once.
    env.fund(1, 100).await;
    let calls = (0..30).map(|i| {
        let client = &client;
        async move {
            client
                .call(
                    "settle",
                    &settle(&format!("wd-{i}"), 1, -10, "withdrawal"),
                    T,
                )
                .await
                .unwrap()
        }
    });
    let replies: Vec<Value> = futures_util::future::join_all(calls).await;
    let ok = replies.iter().filter(|r| r["status"] == "ok").count();
    let poor = replies
        .iter()
        .filter(|r| code(r) == "insufficient_funds")
        .count();
    assert_eq!((ok, poor), (10, 20), "{replies:?}");
    assert_eq!(coins(&env, 1).await, 0);

    // Fifteen withdrawals inside one settle.batch.
    env.fund(2, 100).await;
    let entries: Vec<Value> = (0..15)
        .map(|i| settle(&format!("wb-{i}"), 2, -10, "purchase"))
        .collect();
    let reply = client
        .call(
            "settle",
            &json!({"type": "settle.batch", "entries": entries}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(reply["entries"], 10, "{reply}");
    assert_eq!(
        reply["refused"].as_array().map(Vec::len),
        Some(5),
        "{reply}"
    );
    assert_eq!(coins(&env, 2).await, 0);

    // A red packet and a withdrawal race for the same 1,000 coins.
    for round in 0..6 {
        let sender = 100 + round;
        env.fund(sender, 1_000).await;
        let rp = format!("rp-race-{round}");
        let wd = format!("wd-race-{round}");
        let (cb, wb) = (
            create(&rp, sender, 1_000, 5, 1, 3600),
            settle(&wd, sender, -1_000, "withdrawal"),
        );
        let (c, w) = tokio::join!(client.call("refill", &cb, T), client.call("settle", &wb, T));
        let (c, w) = (c.unwrap(), w.unwrap());
        let won = usize::from(c["status"] == "ok") + usize::from(w["status"] == "ok");
        assert_eq!(won, 1, "round {round}: {c} / {w}");
        assert_eq!(coins(&env, sender).await, 0, "round {round}");
        if c["status"] == "ok" {
            assert_eq!(escrowed(&env, &rp).await, 1_000);
            assert_eq!(packet(&env, &rp).await.unwrap().in_packet, 1_000);
        } else {
            assert_eq!(code(&c), "insufficient_funds", "{c}");
            assert!(packet(&env, &rp).await.is_none());
        }
    }
    // Ten packets from one sender at once, with room for three of them,
    // on two refill workers.
    env.start_refill_worker().await;
    env.fund(300, 1_000).await;
    let creates = (0..10).map(|i| {
        let client = &client;
        async move {
            client
                .call(
                    "refill",
                    &create(&format!("rp-many-{i}"), 300, 300, 3, 1, 3600),
                    T,
                )
                .await
                .unwrap()
        }
    });
    let made: Vec<Value> = futures_util::future::join_all(creates).await;
    let ok = made.iter().filter(|r| r["status"] == "ok").count();
    assert_eq!(ok, 3, "{made:?}");
    assert!(made
        .iter()
        .filter(|r| r["status"] != "ok")
        .all(|r| code(r) == "insufficient_funds"));
    assert_eq!(coins(&env, 300).await, 100);
    assert_balances_follow_entries(&env).await;
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// Kind mix-ups and forged internal messages on one fleet
// ---------------------------------------------------------------------------

#[tokio::test]
async fn every_kind_mix_up_and_forged_internal_message_moves_nothing() {
    let mut env = TestEnv::new(&[("SHORT_POOL_WAIT_MS", "300")]).await;
    env.load(&pool_toml("g", "", &[("a", &[(0, 50), (2, 50)])]))
        .await;
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "act",
        now - Days::hours(1),
        now + Days::hours(1),
        "{ id = \"x\", weight = 1, stock = 5 }",
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 10_000).await;
    let made = client
        .call("refill", &create("rp", 7, 1_000, 4, 1, 3600), T)
        .await
        .unwrap();
    assert_eq!(made["status"], "ok", "{made}");

    let invalid: Vec<(&str, Value)> = vec![
        // A kind's draw with another kind's count.
        ("draw", draw_as("m-1", "rp", 8, 2)),
        ("draw", draw_as("m-2", "act", 8, 2)),
        // A packet or activity under another kind's id.
        ("refill", create("g", 7, 100, 1, 1, 60)),
        ("refill", create("act", 7, 100, 1, 1, 60)),
        // Refills for pools that are not lucky gifts, or never triggered.
        (
            "refill",
            json!({"type": "refill", "pool": "rp", "trigger": 0}),
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "rp", "trigger": 1}),
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "act", "trigger": 0}),
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "act", "trigger": 1}),
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "nope", "trigger": 0}),
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "g", "trigger": 1, "urgent": "yes"}),
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "g", "trigger": -1}),
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "g", "trigger": 1.5}),
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "g", "trigger": "1"}),
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "g", "trigger": 1, "generation": 9}),
        ),
        // Expiries for ids that are not packets.
        (
            "refill",
            json!({"type": "redpacket.expire", "packet_id": "g"}),
        ),
        (
            "refill",
            json!({"type": "redpacket.expire", "packet_id": "act",
                          "expires_at": "2000-01-01T00:00:00Z"}),
        ),
        // Facts and replies published as if they were requests.
        (
            "draw",
            json!({"type": "draw.completed", "request_id": "f-1", "status": "ok", "pool": "g",
                        "user_id": 8, "prizes": [{"multiplier": 2, "combo": "a"}],
                        "total_multiplier": 2, "reward": 20, "asset": "coin"}),
        ),
        (
            "draw",
            json!({"type": "draw.completed.batch", "events": []}),
        ),
        (
            // A batch of draws is a draw-queue message only.
            "refill",
            json!({"type": "draw.batch", "requests": [draw_as("f-2", "g", 8, 1)]}),
        ),
        (
            "draw",
            json!({"type": "draw_result", "request_id": "f-3", "status": "ok"}),
        ),
        (
            "draw",
            json!({"type": "grant_result", "grant_id": "f-4", "status": "ok", "chances": 9}),
        ),
        (
            "draw",
            json!({"type": "redpacket.grab", "request_id": "f-5", "pool": "rp", "user_id": 8}),
        ),
        ("draw", create("rp-2", 7, 100, 1, 1, 60)),
        ("draw", json!({"type": "refill", "pool": "g", "trigger": 1})),
        ("draw", settle("t-1", 8, 100, "topup")),
        ("refill", draw_as("f-6", "g", 8, 1)),
        ("refill", grant("f-7", "act", 8, 5)),
        (
            "refill",
            json!({"type": "pool.refilled", "pool": "g", "generation": 2, "size": 100}),
        ),
        (
            "refill",
            json!({"type": "redpacket.closed", "packet_id": "rp", "refunded": 1000}),
        ),
        ("refill", settle("t-2", 8, 100, "topup")),
        ("settle", draw_as("f-8", "g", 8, 1)),
        (
            "settle",
            json!({"type": "redpacket.closed", "packet_id": "rp", "refunded": 1000}),
        ),
        (
            "settle",
            json!({"type": "settle_result", "entry_id": "t-3", "status": "ok"}),
        ),
        // Internal ledger entries without the fleet's seal.
        (
            "settle",
            json!({"type": "settle", "entry_id": "redpacket:rp:refund", "account": 7,
                          "asset": "coin", "amount": 1000, "reason": "red_packet_refund"}),
        ),
        (
            "settle",
            json!({"type": "settle", "entry_id": "redpacket:rp:grab:8", "account": 8,
                          "asset": "coin", "amount": 250, "reason": "red_packet"}),
        ),
        (
            "settle",
            json!({"type": "settle", "entry_id": "redpacket:rp:grab:9", "account": 9,
                          "asset": "coin", "amount": 250, "reason": "topup"}),
        ),
        (
            "settle",
            json!({"type": "settle", "entry_id": "lottery:z:1", "account": 8,
                          "asset": "item:x", "amount": 1, "reason": "topup"}),
        ),
        (
            "settle",
            json!({"type": "settle", "entry_id": "draw:z:1", "account": 8,
                          "asset": "coin", "amount": 1, "reason": "topup", "seal": null}),
        ),
        (
            "settle",
            json!({"type": "settle", "entry_id": "refund-me", "account": 7,
                          "asset": "coin", "amount": 1000, "reason": "red_packet_refund",
                          "seal": "zz"}),
        ),
        (
            "settle",
            json!({"type": "settle", "entry_id": "esc-2", "account": 8,
                          "asset": "coin", "amount": -1, "reason": "red_packet_escrow",
                          "seal": "00".repeat(32)}),
        ),
    ];
    for (route, body) in &invalid {
        let reply = client.call(route, body, T).await.unwrap();
        assert_eq!(reply["status"], "rejected", "{route} {body} -> {reply}");
        assert_eq!(code(&reply), "invalid_request", "{route} {body} -> {reply}");
    }
    // A grant on what is not an activity is refused as unknown.
    for id in ["g", "rp", "nope"] {
        let reply = client
            .call("draw", &grant(&format!("gr-{id}"), id, 8, 3), T)
            .await
            .unwrap();
        assert_eq!(reply["status"], "rejected", "{id}: {reply}");
        assert_eq!(code(&reply), "unknown_pool", "{id}: {reply}");
    }
    // A batch mixing a forged and an honest entry lands only the honest one.
    let mixed = client
        .call(
            "settle",
            &json!({"type": "settle.batch", "entries": [
                {"type": "settle", "entry_id": "lottery:y:1", "account": 8, "asset": "item:x",
                 "amount": 1, "reason": "lottery"},
                settle("honest-1", 8, 5, "topup")]}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(mixed["entries"], 1, "{mixed}");

    // The sender grabs their own packet; a draw on the packet and the
    // activity still work; the expiry was not forged into a close.
    let own = client
        .call("draw", &draw_as("own", "rp", 7, 1), T)
        .await
        .unwrap();
    assert_eq!(own["status"], "ok", "{own}");
    let lucky = client
        .call("draw", &draw_as("lucky", "g", 8, 3), T)
        .await
        .unwrap();
    assert_eq!(lucky["status"], "ok", "{lucky}");

    let s = env.status("g").await;
    assert_eq!((s.drawn, s.stocked), (3, s.drawn + s.in_pool));
    assert_eq!(s.generation, 1, "no forged refill stocked a batch");
    let p = packet(&env, "rp").await.unwrap();
    assert!(!p.closed);
    assert_eq!(p.grabbed, own["reward"].as_i64().unwrap());
    assert_eq!(
        p.grabbed + p.refunded + p.in_packet,
        escrowed(&env, "rp").await
    );
    let mut redis = env.redis.clone();
    let chances = prizepool::kinds::lottery::chances_left(&mut redis, &env.keys("act"), 8)
        .await
        .unwrap();
    assert_eq!(chances, None, "no chance was granted");
    // The ledger: the sender's escrow and grab, the lucky reward, the honest
    // top-up, and nothing else.
    let lucky_reward = lucky["reward"].as_i64().unwrap();
    assert_eq!(
        wait_balance(&env, 7, "coin", 10_000 - 1_000 + p.grabbed).await,
        10_000 - 1_000 + p.grabbed
    );
    assert_eq!(
        wait_balance(&env, 8, "coin", lucky_reward + 5).await,
        lucky_reward + 5
    );
    assert_eq!(coins(&env, 9).await, 0);
    assert_eq!(balance_of(&env, 8, "item:x").await, 0);
    assert_balances_follow_entries(&env).await;
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// Malformed bodies on every queue
// ---------------------------------------------------------------------------

/// `base` with `field` set to `value` (or removed when `value` is `None`).
fn with(base: &Value, field: &str, value: Option<Value>) -> Value {
    let mut body = base.clone();
    match value {
        Some(v) => body[field] = v,
        None => {
            body.as_object_mut().unwrap().remove(field);
        }
    }
    body
}

/// Every field of `base` (but `type`) missing, null, of each wrong JSON
/// type and out of range; plus an unknown extra field.
fn field_attacks(base: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    let fields: Vec<String> = base
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "type")
        .cloned()
        .collect();
    for field in &fields {
        let is_id = base[field.as_str()].is_string();
        out.push(with(base, field, None));
        out.push(with(base, field, Some(Value::Null)));
        out.push(with(base, field, Some(json!([]))));
        out.push(with(base, field, Some(json!({}))));
        out.push(with(base, field, Some(json!(true))));
        if is_id {
            out.push(with(base, field, Some(json!(12))));
            out.push(with(base, field, Some(json!(""))));
            out.push(with(base, field, Some(json!("a{b}"))));
            out.push(with(base, field, Some(json!("}:x:{"))));
            out.push(with(base, field, Some(json!("a\u{200b}b"))));
            out.push(with(base, field, Some(json!("ид"))));
            out.push(with(base, field, Some(json!("a\nb"))));
            let too_long = if field == "entry_id" {
                prizepool::messages::MAX_ENTRY_ID_LEN + 1
            } else {
                prizepool::messages::MAX_ID_LEN + 1
            };
            out.push(with(base, field, Some(json!("x".repeat(too_long)))));
        } else {
            out.push(with(base, field, Some(json!("12"))));
            out.push(with(base, field, Some(json!(1.5))));
            out.push(with(base, field, Some(json!(1e308))));
            out.push(with(
                base,
                field,
                Some(json!(18_446_744_073_709_551_615u64)),
            ));
            out.push(with(base, field, Some(json!(9_223_372_036_854_775_808u64))));
        }
    }
    out.push(with(base, "surprise", Some(json!(1))));
    out
}

#[tokio::test]
async fn every_field_of_every_message_type_is_checked_and_nothing_moves() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "", &[("a", &[(0, 50), (2, 50)])]))
        .await;
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "act",
        now - Days::hours(1),
        now + Days::hours(1),
        "{ id = \"x\", weight = 1, stock = 5 }",
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 10_000).await;
    let made = client
        .call("refill", &create("rp", 7, 1_000, 4, 1, 3600), T)
        .await
        .unwrap();
    assert_eq!(made["status"], "ok", "{made}");

    let bases: Vec<(&str, Value, &str)> = vec![
        ("draw", draw_as("d-1", "g", 8, 1), "draw_result"),
        ("draw", draw_as("d-2", "rp", 8, 1), "draw_result"),
        ("draw", draw_as("d-3", "act", 8, 1), "draw_result"),
        ("draw", grant("gr-1", "act", 8, 2), "grant_result"),
        (
            "refill",
            create("rp-new", 7, 500, 2, 1, 60),
            "redpacket_result",
        ),
        (
            "refill",
            json!({"type": "redpacket.expire", "packet_id": "rp", "expires_at": "2000-01-01T00:00:00Z"}),
            "redpacket_result",
        ),
        (
            "refill",
            json!({"type": "refill", "pool": "g", "trigger": 1, "urgent": true}),
            "refill_result",
        ),
        ("settle", settle("s-1", 8, 100, "topup"), "settle_result"),
    ];
    let mut sent = HashMap::<&str, u32>::new();
    for (route, base, reply_type) in &bases {
        for body in field_attacks(base) {
            // Some variants are still valid requests (an optional field
            // removed, a null where a default applies): skip exactly those.
            let optional = match body["type"].as_str() {
                Some("redpacket.create") => "min",
                Some("redpacket.expire") => "expires_at",
                _ => "",
            };
            let base_len = base.as_object().unwrap().len();
            let body_len = body.as_object().unwrap().len();
            let dropped = body_len + 1 == base_len && body.get(optional).is_none();
            let nulled = optional == "expires_at" && body[optional].is_null();
            if dropped || nulled {
                continue;
            }
            let reply = client.call(route, &body, T).await.unwrap();
            assert_eq!(reply["status"], "rejected", "{route} {body} -> {reply}");
            assert_eq!(code(&reply), "invalid_request", "{route} {body} -> {reply}");
            *sent.entry(route).or_default() += 1;
            if *reply_type != "settle_result" && *reply_type != "redpacket_result" {
                assert_eq!(reply["type"], *reply_type, "{route} {body} -> {reply}");
            }
        }
    }
    // Raw bodies that are not objects of the contract.
    let mut raw: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"null".to_vec(),
        b"[]".to_vec(),
        br#"[{"type":"draw","request_id":"arr","pool":"g","user_id":8,"count":1}]"#.to_vec(),
        br#""draw""#.to_vec(),
        b"42".to_vec(),
        b"true".to_vec(),
        b"\xff\xfe{}".to_vec(),
        b"\xef\xbb\xbf{\"type\":\"draw\",\"request_id\":\"bom\",\"pool\":\"g\",\"user_id\":8,\"count\":1}"
            .to_vec(),
        br#"{"type":"draw","request_id":"sur\ud800","pool":"g","user_id":8,"count":1}"#.to_vec(),
        br#"{"type":"draw","request_id":"tail","pool":"g","user_id":8,"count":1} x"#.to_vec(),
        br#"{"type":"draw","request_id":"two","pool":"g","user_id":8,"count":1}{"type":"draw"}"#
            .to_vec(),
        br#"{"type":"draw","request_id":"neg0","pool":"g","user_id":8,"count":-0}"#.to_vec(),
        br#"{"type":"draw","request_id":"exp","pool":"g","user_id":8,"count":1e0}"#.to_vec(),
        br#"{"type":"draw","request_id":"d-dup","pool":"g","user_id":8,"count":1,"count":"1"}"#
            .to_vec(),
        br#"{"type":"draw","type":"teleport","request_id":"t-dup","pool":"g","user_id":8,"count":1}"#
            .to_vec(),
        br#"{"type":"draw","request_id":"nul","pool":"g\u0000","user_id":8,"count":1}"#.to_vec(),
        b"{\"type\":\"draw\",\"request_id\":\"raw\xc3\x28\",\"pool\":\"g\",\"user_id\":8,\"count\":1}"
            .to_vec(),
        br#"{"type":"settle.batch","entries":[],"entries":null}"#.to_vec(),
    ];
    raw.push(format!("{}1{}", "[".repeat(30_000), "]".repeat(30_000)).into_bytes());
    raw.push(
        format!(
            r#"{{"type":"draw","request_id":"huge","pool":"{}","user_id":8,"count":1}}"#,
            "g".repeat(1 << 20)
        )
        .into_bytes(),
    );
    for route in ["draw", "refill", "settle"] {
        for body in &raw {
            let reply = client.call_raw(route, body, T).await.unwrap();
            assert_eq!(
                reply["status"],
                "rejected",
                "{route} {} -> {reply}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            );
            assert_eq!(
                code(&reply),
                "invalid_request",
                "{route} {} -> {reply}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            );
            *sent.entry(route).or_default() += 1;
        }
    }
    // Every refusal is in its queue's DLQ, once.
    for (route, q) in [
        ("draw", amqp::DRAW),
        ("refill", amqp::REFILL),
        ("settle", amqp::SETTLE),
    ] {
        let n = sent[route];
        assert_eq!(wait_depth(&env, q.dlq, n).await, n, "{route}");
    }
    // Nothing moved: no draw, grab, chance, packet, refill or entry.
    let s = env.status("g").await;
    assert_eq!((s.drawn, s.generation), (0, 1));
    let p = packet(&env, "rp").await.unwrap();
    assert_eq!((p.grabbed, p.in_packet, p.closed), (0, 1_000, false));
    assert!(packet(&env, "rp-new").await.is_none());
    let (entries,): (i64,) = sqlx::query_as("SELECT count(*) FROM ledger_entries")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(entries, 2, "the funding top-up and the escrow only");
    // The fleet goes on: each request type is answered normally.
    let ok = client
        .call("draw", &draw_as("fine", "g", 8, 1), T)
        .await
        .unwrap();
    assert_eq!(ok["status"], "ok", "{ok}");
    let ok = client
        .call("draw", &draw_as("fine-rp", "rp", 8, 1), T)
        .await
        .unwrap();
    assert_eq!(ok["status"], "ok", "{ok}");
    let ok = client
        .call("draw", &grant("fine-gr", "act", 8, 1), T)
        .await
        .unwrap();
    assert_eq!(ok["status"], "ok", "{ok}");
    let ok = client
        .call("settle", &settle("fine-s", 8, 1, "topup"), T)
        .await
        .unwrap();
    assert_eq!(ok["status"], "ok", "{ok}");
    env.stop_workers().await;
}

#[tokio::test]
async fn a_rejected_settle_batch_is_answered_with_a_settle_result() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let r = client
        .call(
            "settle",
            &json!({"type": "settle.batch", "entries": "x"}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(code(&r), "invalid_request", "{r}");
    assert_eq!(r["type"], "settle_result", "{r}");
    env.stop_workers().await;
}

#[tokio::test]
async fn a_rejected_expiry_is_answered_with_a_redpacket_result() {
    let mut env = TestEnv::new(&[]).await;
    env.start_refill_worker().await;
    let client = env.client().await;
    let r = client
        .call(
            "refill",
            &json!({"type": "redpacket.expire", "packet_id": "rp-none"}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(code(&r), "invalid_request", "{r}");
    assert_eq!(r["packet_id"], "rp-none", "{r}");
    assert_eq!(r["type"], "redpacket_result", "{r}");
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// AMQP properties: no reply_to, a reply_to nobody reads, odd headers
// ---------------------------------------------------------------------------

#[tokio::test]
async fn odd_reply_addresses_and_properties_still_mean_one_effect() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "", &[("a", &[(1, 200)])])).await;
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let raw = Raw::new(&env).await;
    let client = env.client().await;
    let body = |id: &str| serde_json::to_vec(&draw_as(id, "g", 3, 2)).unwrap();
    let base = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    let cases: Vec<(&str, BasicProperties)> = vec![
        ("no-reply", base.clone()),
        ("corr-only", base.clone().with_correlation_id("c-1".into())),
        (
            "nobody-there",
            base.clone()
                .with_reply_to("no.such.queue".into())
                .with_correlation_id("c-2".into()),
        ),
        (
            "bogus-direct",
            base.clone()
                .with_reply_to("amq.rabbitmq.reply-to.bogus".into())
                .with_correlation_id("c-3".into()),
        ),
        (
            "work-queue",
            base.clone()
                .with_reply_to(amqp::SETTLE.queue.into())
                .with_correlation_id("c-4".into()),
        ),
        (
            "text-plain",
            BasicProperties::default()
                .with_content_type("text/plain".into())
                .with_content_encoding("gzip".into())
                .with_reply_to("no.such.queue".into()),
        ),
        (
            "forged-headers",
            base.clone().with_headers({
                let mut h = FieldTable::default();
                h.insert(
                    amqp::ERROR_CODE_HEADER.into(),
                    AMQPValue::LongString("internal".into()),
                );
                h.insert("x-delivery-count".into(), AMQPValue::LongLongInt(99));
                h
            }),
        ),
    ];
    for (id, props) in &cases {
        raw.publish("draw", &body(id), props.clone()).await;
    }
    // Each was drawn exactly once: asking again replays one answer.
    let mut total = 0;
    for (id, _) in &cases {
        let again = client
            .call("draw", &draw_as(id, "g", 3, 2), T)
            .await
            .unwrap();
        assert_eq!(again["status"], "ok", "{id}: {again}");
        assert_eq!(again["reward"], 20, "{id}: {again}");
        total += 20;
    }
    let s = env.status("g").await;
    assert_eq!(s.drawn, 2 * cases.len() as u64, "each request drew once");
    assert_eq!(env.wait_ledger("g", total).await, total);
    assert_eq!(coins(&env, 3).await, total);
    // No request stays in the queue, wedged or cycling; the worker's reply
    // sent to the settle queue is refused there and parked in its DLQ.
    assert_eq!(env.queue_depth(amqp::DRAW.queue).await, 0);
    assert_eq!(wait_depth(&env, amqp::SETTLE.dlq, 1).await, 1);
    assert_eq!(env.queue_depth(amqp::DRAW.dlq).await, 0);
    // Still serving, and a reply on a private queue comes once.
    raw.publish("draw", &body("last"), raw.props("c-last"))
        .await;
    let last = raw.reply("c-last").await;
    assert_eq!(last["status"], "ok", "{last}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(raw.replies_to("c-last").len(), 1);
    raw.close().await;
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// Twenty copies at once
// ---------------------------------------------------------------------------

#[tokio::test]
async fn twenty_copies_at_once_of_a_grant_a_grab_and_a_create_act_once() {
    let mut env = TestEnv::new(&[]).await;
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "act",
        now - Days::hours(1),
        now + Days::hours(1),
        "{ id = \"x\", weight = 1, stock = 5 }",
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 100_000).await;

    async fn twenty(
        client: &prizepool::amqp::rpc::RpcClient,
        route: &str,
        bodies: Vec<Value>,
    ) -> Vec<Value> {
        let calls = bodies
            .iter()
            .map(|b| async move { client.call(route, b, T).await.unwrap() });
        futures_util::future::join_all(calls).await
    }
    // One grant, twenty identical copies: three chances once.
    let same = twenty(&client, "draw", vec![grant("g-1", "act", 5, 3); 20]).await;
    assert!(same.iter().all(|r| r["status"] == "ok"), "{same:?}");
    // Twenty grants under one id for twenty users: one winner.
    let users: Vec<Value> = (0..20).map(|u| grant("g-2", "act", 100 + u, 4)).collect();
    let raced = twenty(&client, "draw", users).await;
    assert_eq!(
        raced.iter().filter(|r| r["status"] == "ok").count(),
        1,
        "{raced:?}"
    );
    let mut redis = env.redis.clone();
    // Each user's chances are the activity's meta fields `u:<user>`.
    let meta: HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(env.keys("act").meta())
        .query_async(&mut redis)
        .await
        .unwrap();
    let meta: HashMap<String, String> = meta
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
        .collect();
    let chances: HashMap<String, i64> = meta
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("u:")?.to_owned(), v.parse().unwrap())))
        .collect();
    assert_eq!(chances.get("5"), Some(&3), "{chances:?}");
    assert_eq!(chances.values().sum::<i64>(), 7, "{chances:?}");

    // One create, twenty copies; and twenty other creates under its id.
    let creates = twenty(
        &client,
        "refill",
        vec![create("rp", 7, 5_000, 10, 1, 3600); 20],
    )
    .await;
    assert!(creates.iter().all(|r| *r == creates[0]), "{creates:?}");
    assert_eq!(creates[0]["status"], "ok");
    let others: Vec<Value> = (0..20)
        .map(|i| create("rp", 7, 5_000 + i, 10, 1, 3600))
        .collect();
    let others = twenty(&client, "refill", others).await;
    assert!(
        others
            .iter()
            .filter(|r| r["total"] != 5_000)
            .all(|r| code(r) == "invalid_request"),
        "{others:?}"
    );
    assert_eq!(coins(&env, 7).await, 95_000);

    // One grab, twenty copies; twenty grabs under one id for twenty users;
    // twenty grabs by one user under twenty ids.
    let grabs = twenty(&client, "draw", vec![draw_as("gb-1", "rp", 5, 1); 20]).await;
    assert!(
        grabs.iter().all(|r| *r == grabs[0] && r["status"] == "ok"),
        "{grabs:?}"
    );
    let by_users: Vec<Value> = (0..20).map(|u| draw_as("gb-2", "rp", 200 + u, 1)).collect();
    let by_users = twenty(&client, "draw", by_users).await;
    assert_eq!(
        by_users.iter().filter(|r| r["status"] == "ok").count(),
        1,
        "{by_users:?}"
    );
    let by_ids: Vec<Value> = (0..20)
        .map(|i| draw_as(&format!("gb-3-{i}"), "rp", 6, 1))
        .collect();
    let by_ids = twenty(&client, "draw", by_ids).await;
    assert_eq!(
        by_ids.iter().filter(|r| r["status"] == "ok").count(),
        1,
        "{by_ids:?}"
    );
    assert!(by_ids
        .iter()
        .filter(|r| r["status"] != "ok")
        .all(|r| code(r) == "already_grabbed"));
    let p = packet(&env, "rp").await.unwrap();
    assert_eq!(p.grabbed_count, 3);
    assert_eq!(
        p.grabbed + p.in_packet + p.refunded,
        escrowed(&env, "rp").await
    );
    let paid = ledger_sum(&env, "coin", &["red_packet"]).await;
    let deadline = tokio::time::Instant::now() + T;
    let mut paid_now = paid;
    while paid_now != p.grabbed && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        paid_now = ledger_sum(&env, "coin", &["red_packet"]).await;
    }
    assert_eq!(paid_now, p.grabbed);
    assert_balances_follow_entries(&env).await;
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// A packet grabbed while it expires
// ---------------------------------------------------------------------------

#[tokio::test]
async fn grabs_racing_the_expiry_keep_escrow_whole() {
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 10_000).await;
    let made = client
        .call("refill", &create("rp-short", 7, 10_000, 200, 1, 2), T)
        .await
        .unwrap();
    assert_eq!(made["status"], "ok", "{made}");
    // Grabs keep coming, before and across the expiry.
    let calls = (0..150).map(|i| {
        let client = &client;
        async move {
            tokio::time::sleep(Duration::from_millis(20 * i)).await;
            client
                .call(
                    "draw",
                    &draw_as(&format!("gx-{i}"), "rp-short", 1000 + i as i64, 1),
                    T,
                )
                .await
                .unwrap()
        }
    });
    let replies: Vec<Value> = futures_util::future::join_all(calls).await;
    let won: i64 = replies
        .iter()
        .filter(|r| r["status"] == "ok")
        .map(|r| r["reward"].as_i64().unwrap())
        .sum();
    for r in &replies {
        assert!(r["status"] == "ok" || code(r) == "pool_closed", "{r}");
    }
    // Wait for the close and its refund.
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let p = packet(&env, "rp-short").await.unwrap();
        if p.closed {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never closed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let p = packet(&env, "rp-short").await.unwrap();
    assert_eq!(p.grabbed, won);
    assert_eq!(p.grabbed + p.refunded + p.in_packet, 10_000);
    assert_eq!(p.in_packet, 0);
    assert_eq!(wait_balance(&env, 7, "coin", p.refunded).await, p.refunded);
    let deadline = tokio::time::Instant::now() + T;
    while ledger_sum(&env, "coin", &["red_packet"]).await != won {
        assert!(tokio::time::Instant::now() < deadline, "grabs unpaid");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Expiry forged again after the close refunds nothing more.
    let again = client
        .call(
            "refill",
            &json!({"type": "redpacket.expire", "packet_id": "rp-short"}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(again["status"], "ok", "{again}");
    let replay = client
        .call("refill", &create("rp-short", 7, 10_000, 200, 1, 2), T)
        .await
        .unwrap();
    assert_eq!(replay["status"], "ok", "{replay}");
    assert!(packet(&env, "rp-short").await.unwrap().closed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(coins(&env, 7).await, p.refunded);
    assert_balances_follow_entries(&env).await;
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// Refusals of grants, and the extremes of valid values
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_grant_refused_as_unknown_stays_refused() {
    let mut env = TestEnv::new(&[]).await;
    env.start_draw_worker().await;
    let client = env.client().await;
    let early = grant("g-early", "later", 5, 3);
    let first = client.call("draw", &early, T).await.unwrap();
    assert_eq!(code(&first), "unknown_pool", "{first}");
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "later",
        now - Days::hours(1),
        now + Days::hours(1),
        "{ id = \"x\", weight = 1, stock = 5 }",
    ))
    .await;
    // The id's first answer was "no": it stays the answer, and grants nothing.
    let again = client.call("draw", &early, T).await.unwrap();
    assert_eq!(again, first);
    let mut redis = env.redis.clone();
    let chances = prizepool::kinds::lottery::chances_left(&mut redis, &env.keys("later"), 5)
        .await
        .unwrap();
    assert_eq!(chances, None);
    env.stop_workers().await;
}

#[tokio::test]
async fn the_longest_valid_ids_are_paid() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("edge", "", &[("a", &[(1, 200)])]))
        .await;
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "act",
        now - Days::hours(1),
        now + Days::hours(1),
        "{ id = \"x\", weight = 1, stock = 5 }",
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    let (rid, pid) = ("r".repeat(128), "p".repeat(128));
    let drawn = client
        .call("draw", &draw_as(&rid, "edge", 5, 2), T)
        .await
        .unwrap();
    assert_eq!(drawn["reward"], 20, "{drawn}");
    env.fund(7, 1_000).await;
    let made = client
        .call("refill", &create(&pid, 7, 1_000, 1, 0, 3600), T)
        .await
        .unwrap();
    assert_eq!(made["status"], "ok", "{made}");
    let got = client
        .call("draw", &draw_as("grab-long", &pid, 6, 1), T)
        .await
        .unwrap();
    assert_eq!(got["reward"], 1_000, "{got}");
    let g = client
        .call("draw", &grant("g-l", "act", 8, 1), T)
        .await
        .unwrap();
    assert_eq!(g["status"], "ok", "{g}");
    let won = client
        .call("draw", &draw_as(&"l".repeat(128), "act", 8, 1), T)
        .await
        .unwrap();
    assert_eq!(won["status"], "ok", "{won}");
    let asset = won["prizes"][0]["asset"].as_str().unwrap().to_owned();
    let (a, b, c) = (
        wait_balance(&env, 5, "coin", 20).await,
        wait_balance(&env, 6, "coin", 1_000).await,
        wait_balance(&env, 8, &asset, 1).await,
    );
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let letters = amqp::dlq::list(&conn, amqp::SETTLE, 10).await.unwrap();
    let reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
    assert_eq!((a, b, c), (20, 1_000, 1), "dead letters: {reasons:?}");
    assert!(letters.is_empty(), "{reasons:?}");
    env.stop_workers().await;
}

#[tokio::test]
async fn the_extremes_of_valid_values_are_served_and_paid() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "edge",
        "max_count = 2000",
        &[("a", &[(1, 20_000)])],
    ))
    .await;
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "act",
        now - Days::hours(1),
        now + Days::hours(1),
        "{ id = \"x\", weight = 1, stock = 5 }",
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    let top = i64::MAX;
    let id128 = "i".repeat(64);
    // The largest user id, a long id, a count whose reply nearly fills 64 KiB.
    let big = client
        .call("draw", &draw_as(&id128, "edge", top, 2_000), T)
        .await
        .unwrap();
    assert_eq!(big["status"], "ok", "{}", &big.to_string()[..200]);
    assert_eq!(big["reward"], 20_000);
    let zero = client
        .call("draw", &draw_as("u0", "edge", 0, 1), T)
        .await
        .unwrap();
    assert_eq!(zero["reward"], 10, "{zero}");
    assert_eq!(env.wait_ledger("edge", 20_010).await, 20_010);
    assert_eq!(coins(&env, top).await, 20_000);
    assert_eq!(coins(&env, 0).await, 10);
    // A packet sent by and grabbed by the largest user id; a lottery draw too.
    env.fund(top, 1_000).await;
    let made = client
        .call("refill", &create(&"p".repeat(64), top, 1_000, 1, 0, 1), T)
        .await
        .unwrap();
    assert_eq!(made["status"], "ok", "{made}");
    let got = client
        .call("draw", &draw_as("grab-top", &"p".repeat(64), top, 1), T)
        .await
        .unwrap();
    assert_eq!(got["reward"], 1_000, "{got}");
    let g = client
        .call("draw", &grant(&id128, "act", top, 1_000_000), T)
        .await
        .unwrap();
    assert_eq!(g["chances_left"], 1_000_000, "{g}");
    let won = client
        .call("draw", &draw_as("lot-top", "act", top, 1), T)
        .await
        .unwrap();
    assert_eq!(won["status"], "ok", "{won}");
    assert_eq!(won["chances_left"], 999_999, "{won}");
    let asset = won["prizes"][0]["asset"].as_str().unwrap().to_owned();
    assert_eq!(wait_balance(&env, top, &asset, 1).await, 1);
    assert_eq!(wait_balance(&env, top, "coin", 21_000).await, 21_000);
    // The largest exact amount a top-up may carry, and one past it.
    let max = (1i64 << 53) - 1;
    let r = client
        .call("settle", &settle("max-1", 77, max, "topup"), T)
        .await
        .unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    let r = client
        .call("settle", &settle("max-2", 77, 1, "topup"), T)
        .await
        .unwrap();
    assert_eq!(r["status"], "rejected", "{r}");
    let r = client
        .call("settle", &settle("max-3", 78, max + 1, "topup"), T)
        .await
        .unwrap();
    assert_eq!(code(&r), "invalid_request", "{r}");
    assert_eq!(coins(&env, 77).await, max);
    assert_eq!(coins(&env, 78).await, 0);
    assert_balances_follow_entries(&env).await;
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// Every kind of request in flight while the fleet stops and starts again
// ---------------------------------------------------------------------------

/// Streams lucky draws, red-packet grabs and creates, lottery draws and
/// top-ups at the fleet, stops it mid-stream (with `grace` for the work in
/// hand), starts it again, and checks that every request was answered
/// exactly once and every effect paid once.
/// What happens to the fleet mid-stream.
enum Fault {
    /// The workers stop (with this grace, in ms) and start again.
    Stop(&'static str),
    /// The private AOF Redis at `port` (files in `dir`) is killed with
    /// SIGKILL and started again on its files a second later.
    KillRedis {
        server: Mutex<Option<common::KillOnDrop>>,
        port: u16,
        dir: std::path::PathBuf,
    },
    /// The private Postgres is stopped for five seconds.
    StopPostgres(common::PrivatePostgres),
}

const AOF: [&str; 4] = ["--appendonly", "yes", "--appendfsync", "always"];

/// A private Redis with AOF on a free port, up and answering.
async fn private_aof_redis() -> (Fault, String) {
    let dir = common::tempdir("aof-attack");
    let port = common::free_port();
    let server = common::redis_server(port, &dir, &AOF);
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "private redis did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (
        Fault::KillRedis {
            server: Mutex::new(Some(server)),
            port,
            dir,
        },
        url,
    )
}

async fn mixed_traffic_across_a_stop(grace: &'static str) {
    mixed_traffic_through(Fault::Stop(grace), &[("SHUTDOWN_GRACE_MS", grace)]).await;
}

async fn mixed_traffic_through(fault: Fault, overrides: &[(&str, &str)]) {
    let grace = match &fault {
        Fault::Stop(g) => *g,
        Fault::KillRedis { .. } => "kill-redis",
        Fault::StopPostgres(_) => "stop-postgres",
    };
    let mut env = TestEnv::new(overrides).await;
    env.load(&pool_toml(
        "g",
        "refill_at = 0.5",
        &[("a", &[(0, 100), (1, 50), (2, 50)])],
    ))
    .await;
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "act",
        now - Days::hours(1),
        now + Days::hours(1),
        "{ id = \"x\", weight = 5, stock = 40 }",
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 10_000_000).await;
    for p in 0..4 {
        let r = client
            .call(
                "refill",
                &create(&format!("rp-{p}"), 7, 30_000, 300, 1, 3600),
                T,
            )
            .await
            .unwrap();
        assert_eq!(r["status"], "ok", "{r}");
    }
    for u in 0..100 {
        let r = client
            .call("draw", &grant(&format!("gr-{u}"), "act", 20_000 + u, 3), T)
            .await
            .unwrap();
        assert_eq!(r["status"], "ok", "{r}");
    }

    let mut requests: Vec<(&str, Value)> = Vec::new();
    for i in 0..1200i64 {
        let body = match i % 6 {
            0 | 1 => draw_as(&format!("d-{i}"), "g", i % 40, 2),
            2 => draw_as(
                &format!("gb-{i}"),
                &format!("rp-{}", (i / 6) % 4),
                10_000 + i,
                1,
            ),
            3 => draw_as(&format!("l-{i}"), "act", 20_000 + i % 100, 1),
            4 => settle(&format!("t-{i}"), 500, 1, "topup"),
            _ if i % 60 == 5 => create(&format!("rp-s-{i}"), 7, 1_000, 10, 1, 3600),
            _ => draw_as(&format!("d-{i}"), "g", i % 40, 1),
        };
        let route = match body["type"].as_str().unwrap() {
            "settle" => "settle",
            "redpacket.create" => "refill",
            _ => "draw",
        };
        requests.push((route, body));
    }
    let id_of = |b: &Value| {
        ["request_id", "entry_id", "packet_id"]
            .iter()
            .find_map(|f| b[*f].as_str())
            .unwrap()
            .to_owned()
    };
    let raw = Raw::new(&env).await;
    let answered = |raw: &Raw| {
        let replies = raw.replies.lock().unwrap();
        let mut ids: Vec<&str> = replies.iter().filter_map(|(c, _)| c.as_deref()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    };
    let n = requests.len();
    let messages: Vec<(&str, Vec<u8>, String)> = requests
        .iter()
        .map(|(route, body)| (*route, serde_json::to_vec(body).unwrap(), id_of(body)))
        .collect();
    raw.publish_all(&messages).await;
    // Stop with requests in hand and more queued behind them.
    while answered(&raw) < n / 5 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stopped_at = (
        answered(&raw),
        env.queue_depth(amqp::DRAW.queue).await,
        env.queue_depth(amqp::SETTLE.queue).await,
    );
    match &fault {
        Fault::Stop(_) => {
            env.stop_workers().await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            env.start_fleet().await;
        }
        Fault::KillRedis { server, port, dir } => {
            server.lock().unwrap().take();
            tokio::time::sleep(Duration::from_secs(1)).await;
            *server.lock().unwrap() = Some(common::redis_server(*port, dir, &AOF));
            let mut redis = env.redis.clone();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while redis::cmd("PING")
                .query_async::<String>(&mut redis)
                .await
                .is_err()
            {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "redis did not come back"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Fault::StopPostgres(pg) => {
            pg.stop();
            tokio::time::sleep(Duration::from_secs(5)).await;
            pg.start();
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while answered(&raw) < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {n} answered",
            answered(&raw)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // One answer per request; what the answers say is what moved.
    let by_id: HashMap<String, Vec<Value>> = {
        let replies = raw.replies.lock().unwrap();
        let mut m: HashMap<String, Vec<Value>> = HashMap::new();
        for (c, v) in replies.iter() {
            m.entry(c.clone().unwrap()).or_default().push(v.clone());
        }
        m
    };
    let first = |b: &Value| by_id[&id_of(b)][0].clone();
    let (mut lucky_reward, mut lucky_prizes) = (0i64, 0u64);
    let mut grabbed: HashMap<String, i64> = HashMap::new();
    let (mut lottery_won, mut topups) = (0i64, 0i64);
    for (_, body) in &requests {
        let r = first(body);
        match (body["type"].as_str().unwrap(), body["pool"].as_str()) {
            ("draw", Some("g")) => {
                if r["status"] == "ok" {
                    lucky_reward += r["reward"].as_i64().unwrap();
                    lucky_prizes += r["prizes"].as_array().unwrap().len() as u64;
                } else {
                    assert_eq!(code(&r), "pool_exhausted", "{body} -> {r}");
                }
            }
            ("draw", Some("act")) => {
                if r["status"] == "ok" {
                    lottery_won += 1;
                } else {
                    assert_eq!(code(&r), "no_chances", "{body} -> {r}");
                }
            }
            ("draw", Some(rp)) => {
                assert_eq!(r["status"], "ok", "{body} -> {r}");
                *grabbed.entry(rp.to_owned()).or_default() += r["reward"].as_i64().unwrap();
            }
            ("settle", _) => {
                assert_eq!(r["status"], "ok", "{body} -> {r}");
                topups += 1;
            }
            _ => assert_eq!(r["status"], "ok", "{body} -> {r}"),
        }
    }
    let s = env.status("g").await;
    assert_eq!(s.drawn, lucky_prizes, "{s:?}");
    assert_eq!(s.stocked, s.drawn + s.in_pool, "{s:?}");
    assert_eq!(env.wait_ledger("g", lucky_reward).await, lucky_reward);
    for p in 0..4 {
        let id = format!("rp-{p}");
        let st = packet(&env, &id).await.unwrap();
        assert_eq!(st.grabbed, grabbed[&id], "{id}");
        assert_eq!(
            st.grabbed + st.in_packet + st.refunded,
            escrowed(&env, &id).await
        );
    }
    let all_grabbed: i64 = grabbed.values().sum();
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let paid = (
            ledger_sum(&env, "coin", &["red_packet"]).await,
            coins(&env, 500).await,
        );
        let lottery_paid: (i64,) = sqlx::query_as(
            "SELECT coalesce(sum(amount), 0)::bigint FROM ledger_entries WHERE reason = 'lottery'",
        )
        .fetch_one(&env.db)
        .await
        .unwrap();
        if (paid.0, paid.1, lottery_paid.0) == (all_grabbed, topups, lottery_won) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "paid {paid:?} / lottery {lottery_paid:?}, promised {all_grabbed} / {topups} / {lottery_won}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_balances_follow_entries(&env).await;

    // Nothing is answered twice, even after everything settled down.
    env.stop_workers().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let replies = raw.replies.lock().unwrap();
    let mut count: HashMap<&str, usize> = HashMap::new();
    for (c, _) in replies.iter() {
        *count.entry(c.as_deref().unwrap()).or_default() += 1;
    }
    let twice: Vec<(&&str, &usize)> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{} requests answered more than once (stopped at {stopped_at:?} answered): {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    assert_eq!(count.len(), n);
    eprintln!(
        "{n} requests; at the fault ({grace}): (answered, draws queued, settles queued) = {stopped_at:?}; each answered once"
    );
    if let Fault::KillRedis { server, dir, .. } = fault {
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_in_flight_across_a_graceful_stop_is_answered_and_paid_once() {
    mixed_traffic_across_a_stop("5000").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_in_flight_across_a_stop_cut_short_is_answered_and_paid_once() {
    mixed_traffic_across_a_stop("0").await;
}

#[tokio::test]
async fn a_prize_with_the_longest_valid_id_is_paid() {
    let mut env = TestEnv::new(&[]).await;
    let now = Utc::now();
    // The asset `item:<prize>` must be a valid id itself.
    let prize = "z".repeat(prizepool::messages::MAX_ID_LEN - "item:".len());
    env.load_activities(&format!(
        "[[activities]]\nid = \"act\"\nstrategy = \"wheel\"\nstarts_at = \"{}\"\nends_at = \"{}\"\nprizes = [ {{ id = \"{prize}\", weight = 1, stock = 5 }} ]\n",
        (now - Days::hours(1)).to_rfc3339(),
        (now + Days::hours(1)).to_rfc3339(),
    ))
    .await;
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let g = client
        .call("draw", &grant("g-1", "act", 8, 1), T)
        .await
        .unwrap();
    assert_eq!(g["status"], "ok", "{g}");
    let won = client
        .call("draw", &draw_as("l-1", "act", 8, 1), T)
        .await
        .unwrap();
    assert_eq!(won["status"], "ok", "{won}");
    let asset = format!("item:{prize}");
    assert_eq!(won["prizes"][0]["asset"], asset.as_str(), "{won}");
    let paid = wait_balance(&env, 8, &asset, 1).await;
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let letters = amqp::dlq::list(&conn, amqp::SETTLE, 10).await.unwrap();
    let reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
    assert_eq!(paid, 1, "dead letters: {reasons:?}");
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// Reloads while draws run
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_and_kind_changes_while_draws_run_conserve_and_pay_what_was_said() {
    let mut env = TestEnv::new(&[]).await;
    let combos: &[(&str, &[(u64, u64)])] = &[("a", &[(0, 60), (1, 60), (3, 20)])];
    env.load(&pool_toml("g", "refill_at = 0.5", combos)).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 10_000).await;
    let draws = (0..400i64).map(|i| {
        let client = &client;
        async move {
            tokio::time::sleep(Duration::from_millis((i % 100) as u64 * 5)).await;
            client
                .call("draw", &draw_as(&format!("d-{i}"), "g", i % 30, 2), T)
                .await
                .unwrap()
        }
    });
    let reloads = async {
        for round in 0..6 {
            tokio::time::sleep(Duration::from_millis(60)).await;
            let (price, asset) = if round % 2 == 0 {
                (20, "gem")
            } else {
                (10, "coin")
            };
            let text = pool_toml(
                "g",
                &format!("refill_at = 0.5\nasset = \"{asset}\""),
                combos,
            )
            .replace("unit_price = 10", &format!("unit_price = {price}"));
            env.load(&text).await;
            // Another kind under the pool's id is refused, by the operator's
            // loader and over the wire.
            let activity = prizepool::kinds::lottery::parse_file(&activity_toml(
                "g",
                Utc::now() - Days::hours(1),
                Utc::now() + Days::hours(1),
                "{ id = \"x\", weight = 1, stock = 5 }",
            ))
            .unwrap();
            let mut redis = env.redis.clone();
            let refused = prizepool::kinds::lottery::load(
                &env.db,
                &mut redis,
                &env.config.redis_prefix,
                &activity,
            )
            .await;
            assert!(refused.is_err(), "an activity took a lucky-gift pool's id");
            let r = client
                .call("refill", &create("g", 7, 100, 1, 1, 60), T)
                .await
                .unwrap();
            assert_eq!(code(&r), "invalid_request", "{r}");
        }
    };
    let (replies, ()) = tokio::join!(futures_util::future::join_all(draws), reloads);
    let mut promised: HashMap<String, i64> = HashMap::new();
    let mut prizes = 0u64;
    for r in &replies {
        assert_eq!(r["status"], "ok", "{r}");
        *promised
            .entry(r["asset"].as_str().unwrap().to_owned())
            .or_default() += r["reward"].as_i64().unwrap();
        prizes += r["prizes"].as_array().unwrap().len() as u64;
        let price = r["reward"].as_i64().unwrap() / r["total_multiplier"].as_i64().unwrap().max(1);
        if r["total_multiplier"].as_i64().unwrap() > 0 {
            let expected = if r["asset"] == "gem" { 20 } else { 10 };
            assert_eq!(price, expected, "a reply mixes versions: {r}");
        }
    }
    let s = env.status("g").await;
    assert_eq!(s.drawn, prizes, "{s:?}");
    assert_eq!(s.stocked, s.drawn + s.in_pool, "{s:?}");
    for (asset, amount) in &promised {
        let deadline = tokio::time::Instant::now() + T;
        loop {
            let paid = prizepool::settle::pool_total(&env.db, "g", asset)
                .await
                .unwrap();
            if paid == *amount {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{asset}: paid {paid}, promised {amount}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // The replays say and pay what they first said.
    for (i, r) in replies.iter().enumerate().step_by(37) {
        let again = client
            .call(
                "draw",
                &draw_as(&format!("d-{i}"), "g", i as i64 % 30, 2),
                T,
            )
            .await
            .unwrap();
        assert_eq!(&again, r);
    }
    assert_balances_follow_entries(&env).await;
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// Replies stay within the wire limit
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_settle_batch_refused_entry_by_entry_is_answered_within_64_kib() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    // As many overdrafts as fit in one 64 KiB batch, each refused with a
    // reason of its own; and as many bad entries.
    for (tag, bad) in [("od", false), ("bad", true)] {
        let mut entries = Vec::new();
        loop {
            let i = entries.len();
            let entry = if bad {
                json!({"type": "settle", "entry_id": format!("{tag}{i}"), "account": i,
                       "asset": "c", "amount": 1, "reason": "x"})
            } else {
                json!({"type": "settle", "entry_id": format!("{tag}{i}"), "account": i,
                       "asset": "c", "amount": -1, "reason": "purchase"})
            };
            entries.push(entry);
            let size = serde_json::to_vec(&json!({"type": "settle.batch", "entries": entries}))
                .unwrap()
                .len();
            if size > prizepool::messages::MAX_MESSAGE_BYTES || entries.len() > 1000 {
                entries.pop();
                break;
            }
        }
        let body = json!({"type": "settle.batch", "entries": entries});
        let reply = client
            .request("settle", &serde_json::to_vec(&body).unwrap(), T)
            .await
            .unwrap();
        let parsed: Value = serde_json::from_slice(&reply).unwrap();
        assert_eq!(parsed["entries"], 0, "{tag}");
        assert_eq!(
            parsed["refused"].as_array().map(Vec::len),
            Some(entries.len()),
            "{tag}"
        );
        assert!(
            reply.len() <= prizepool::messages::MAX_MESSAGE_BYTES,
            "{tag}: a reply of {} bytes to a batch of {} entries",
            reply.len(),
            entries.len()
        );
    }
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// A reward to an account at the top of the exact range
// ---------------------------------------------------------------------------

#[tokio::test]

async fn a_reward_to_a_full_account_is_paid_or_not_drawn() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "", &[("a", &[(3, 100)])])).await;
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;
    // An upstream tops the user up to the largest exact balance.
    let max = (1i64 << 53) - 1;
    let r = client
        .call("settle", &settle("fill", 5, max - 10, "topup"), T)
        .await
        .unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    let drawn = client
        .call("draw", &draw_as("d-1", "g", 5, 2), T)
        .await
        .unwrap();
    // Either the draw is refused and takes nothing, or its reward is paid.
    if drawn["status"] == "ok" {
        let reward = drawn["reward"].as_i64().unwrap();
        assert_eq!(
            env.wait_ledger("g", reward).await,
            reward,
            "the reply promised {reward}; the ledger holds {} for the user",
            coins(&env, 5).await
        );
    } else {
        assert_eq!(env.status("g").await.drawn, 0, "{drawn}");
    }
    env.stop_workers().await;
}

// ---------------------------------------------------------------------------
// A request refused as invalid binds nothing
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_request_refused_as_invalid_leaves_its_id_free() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "max_count = 5", &[("a", &[(1, 100)])]))
        .await;
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "act",
        now - Days::hours(1),
        now + Days::hours(1),
        "{ id = \"x\", weight = 1, stock = 5 }",
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 1_000).await;
    let made = client
        .call("refill", &create("rp", 7, 1_000, 4, 1, 3600), T)
        .await
        .unwrap();
    assert_eq!(made["status"], "ok", "{made}");
    let g = client
        .call("draw", &grant("g-1", "act", 5, 1), T)
        .await
        .unwrap();
    assert_eq!(g["status"], "ok", "{g}");
    let mut bound = Vec::new();
    for (id, pool, bad, good) in [
        ("i-1", "g", 6, 5),
        ("i-2", "rp", 2, 1),
        ("i-3", "act", 2, 1),
    ] {
        let refused = client
            .call("draw", &draw_as(id, pool, 5, bad), T)
            .await
            .unwrap();
        assert_eq!(code(&refused), "invalid_request", "{refused}");
        let fixed = client
            .call("draw", &draw_as(id, pool, 5, good), T)
            .await
            .unwrap();
        if fixed["status"] != "ok" {
            bound.push(format!("{pool}: {fixed}"));
        }
    }
    assert!(
        bound.is_empty(),
        "ids bound by invalid requests: {bound:#?}"
    );
    env.stop_workers().await;
}

#[tokio::test]
async fn a_request_of_exactly_64_kib_is_served_and_one_byte_more_is_refused() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "", &[("a", &[(1, 100)])])).await;
    env.start_draw_worker().await;
    let client = env.client().await;
    let padded = |id: &str, size: usize| {
        let text = serde_json::to_string(&draw_as(id, "g", 5, 1)).unwrap();
        let pad = size - text.len();
        // Whitespace between tokens is still JSON.
        format!("{}{}{}", &text[..1], " ".repeat(pad), &text[1..]).into_bytes()
    };
    let limit = prizepool::messages::MAX_MESSAGE_BYTES;
    let fits = padded("edge-fit", limit);
    assert_eq!(fits.len(), limit);
    let r = client.call_raw("draw", &fits, T).await.unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    let over = padded("edge-over", limit + 1);
    let r = client.call_raw("draw", &over, T).await.unwrap();
    assert_eq!(code(&r), "invalid_request", "{r}");
    assert_eq!(r["request_id"], "edge-over", "{r}");
    assert_eq!(env.status("g").await.drawn, 1);
    env.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_in_flight_across_a_redis_killed_with_aof_is_answered_and_paid_once() {
    let (fault, url) = private_aof_redis().await;
    mixed_traffic_through(fault, &[("REDIS_URL", &url)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_in_flight_across_a_postgres_outage_is_answered_and_paid_once() {
    let pg = common::PrivatePostgres::init();
    pg.start();
    let url = pg.url();
    mixed_traffic_through(
        Fault::StopPostgres(pg),
        &[("DATABASE_URL", &url), ("TRANSIENT_RETRY_MS", "1000")],
    )
    .await;
}

#[tokio::test]
async fn twenty_copies_of_a_ledger_entry_at_once_land_once() {
    let mut env = TestEnv::new(&[("SETTLE_BATCH_SIZE", "3")]).await;
    env.start_settle_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let calls = |bodies: Vec<Value>| {
        let client = &client;
        async move {
            let calls = bodies
                .iter()
                .map(|b| async move { client.call("settle", b, T).await.unwrap() });
            futures_util::future::join_all(calls).await
        }
    };
    // The same top-up twenty times at once: applied once, answered ok each time.
    let same = calls(vec![settle("t-1", 1, 100, "topup"); 20]).await;
    assert!(same.iter().all(|r| r["status"] == "ok"), "{same:?}");
    assert_eq!(coins(&env, 1).await, 100);
    // One id, twenty amounts at once: one lands, the rest are refused.
    let amounts: Vec<Value> = (1..=20).map(|a| settle("t-2", 2, a, "topup")).collect();
    let raced = calls(amounts).await;
    let landed: Vec<&Value> = raced.iter().filter(|r| r["status"] == "ok").collect();
    assert_eq!(landed.len(), 1, "{raced:?}");
    let balance = coins(&env, 2).await;
    assert!((1..=20).contains(&balance), "{balance}");
    // One batch holding one entry six hundred times.
    let entries = vec![settle("t-3", 3, 7, "topup"); 600];
    let body = json!({"type": "settle.batch", "entries": entries});
    let reply = client.call("settle", &body, T).await.unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(coins(&env, 3).await, 7);
    // The same batch from twenty publishers at once.
    let batches = calls(vec![body; 20]).await;
    assert!(batches.iter().all(|r| r["status"] == "ok"), "{batches:?}");
    assert_eq!(coins(&env, 3).await, 7);
    assert_balances_follow_entries(&env).await;
    env.stop_workers().await;
}
