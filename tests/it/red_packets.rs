//! Red packets (SPEC §4) on the real fleet: escrow, split, one share per
//! user under concurrency, settlement, expiry and refund.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::HashMap, sync::Arc, time::Duration};

use common::{draw, TestEnv};
use prizepool::{amqp, kinds::red_packet};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);

/// One grab of `packet` through the red-packet kind's step; the amount
/// awarded, if any.
async fn grab_share(
    conn: &mut prizepool::redis_conn::RedisConn,
    keys: &prizepool::scripts::PoolKeys,
    packet: &str,
    request_id: &str,
    user: i64,
) -> Option<i64> {
    let fingerprint = prizepool::kinds::fingerprint("draw", &[&packet, &user, &1u32]);
    let tokens = prizepool::kinds::Tokens::new("t", "rq", request_id, fingerprint, 60);
    let ask = prizepool::kinds::Ask {
        request_id,
        pool: packet,
        user,
        count: 1,
        token: &tokens.answer,
        result_ttl_s: 60,
    };
    match red_packet::grab(conn, keys, &ask).await.unwrap() {
        prizepool::kinds::Step::Awarded(award) => award.result.reward,
        _ => None,
    }
}

async fn balance(env: &TestEnv, account: i64) -> i64 {
    prizepool::settle::balances(&env.db, account)
        .await
        .unwrap()
        .into_iter()
        .find(|b| b.asset == "coin")
        .map_or(0, |b| b.balance)
}

fn create(packet: &str, sender: i64, total: i64, count: i64, min: i64, expires_in_s: i64) -> Value {
    json!({"type": "redpacket.create", "packet_id": packet, "sender": sender, "total": total,
           "count": count, "min": min, "expires_in_s": expires_in_s})
}

async fn packet(env: &TestEnv, id: &str) -> Option<red_packet::PacketStatus> {
    let mut redis = env.redis.clone();
    red_packet::status(&mut redis, &env.keys(id)).await.unwrap()
}

#[tokio::test]
async fn creation_escrows_the_total_or_refuses_without_side_effects() {
    let mut env = TestEnv::new(&[]).await;
    env.start_refill_worker().await;
    let client = env.client().await;
    // No funds: refused, nothing stocked, the id stays free.
    let reply = client
        .call("refill", &create("rp-poor", 7, 10_000, 10, 1, 3600), T)
        .await
        .unwrap();
    assert_eq!(reply["type"], "redpacket_result");
    assert_eq!(reply["status"], "rejected");
    assert_eq!(reply["error"]["code"], "insufficient_funds", "{reply}");
    assert!(packet(&env, "rp-poor").await.is_none());
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM pools")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(n, 0);

    env.fund(7, 25_000).await;
    let reply = client
        .call("refill", &create("rp-1", 7, 10_000, 10, 1, 3600), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(
        (reply["count"].as_i64(), reply["total"].as_i64()),
        (Some(10), Some(10_000))
    );
    assert!(reply["expires_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(balance(&env, 7).await, 15_000);
    let (sum, shares): (i64, i64) = sqlx::query_as(
        "SELECT sum(amount)::bigint, count(*) FROM red_packet_shares WHERE packet_id = 'rp-1'",
    )
    .fetch_one(&env.db)
    .await
    .unwrap();
    assert_eq!((sum, shares), (10_000, 10));
    let s = packet(&env, "rp-1").await.unwrap();
    assert_eq!((s.total, s.in_packet, s.shares_left), (10_000, 10_000, 10));

    // The same packet again: the first result, escrowed once.
    let again = client
        .call("refill", &create("rp-1", 7, 10_000, 10, 1, 3600), T)
        .await
        .unwrap();
    assert_eq!(again, reply);
    assert_eq!(balance(&env, 7).await, 15_000);

    // Impossible parameters are bad input.
    for bad in [
        create("rp-x", 7, 100, 0, 1, 60),
        create("rp-x", 7, 9, 10, 1, 60),
        create("rp-x", 7, -5, 1, 1, 60),
        create("rp-x", 7, 100, 2, -1, 60),
        create("rp-x", 7, 100_000, 5_001, 1, 60),
        create("rp-x", 7, 100, 2, 1, 0),
    ] {
        let reply = client.call("refill", &bad, T).await.unwrap();
        assert_eq!(reply["error"]["code"], "invalid_request", "{bad}: {reply}");
    }
    assert_eq!(balance(&env, 7).await, 15_000);
    env.stop_workers().await;
}

#[tokio::test]
async fn two_thousand_grabs_by_three_hundred_users_on_two_processes() {
    let mut env = TestEnv::new(&[]).await;
    env.start_refill_worker().await;
    env.start_settle_worker().await;
    let client = Arc::new(env.client().await);
    env.fund(1, 1_000_000).await;
    let total = 100_000;
    let reply = client
        .call("refill", &create("rp-crowd", 1, total, 200, 10, 3600), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");

    let spawn = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_draw-worker"))
            .envs(env.env())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut procs = [spawn(), spawn()];
    // 2,000 grabs: users 0..300, each several times, interleaved.
    let mut tasks = Vec::new();
    for i in 0..2000u32 {
        let client = client.clone();
        let user = i64::from((i * 7919) % 300);
        tasks.push(tokio::spawn(async move {
            (
                user,
                client
                    .call("draw", &draw("rp-crowd", user, 1), T)
                    .await
                    .unwrap(),
            )
        }));
    }
    let mut won: HashMap<i64, (i64, i64)> = HashMap::new();
    let mut codes: HashMap<String, u32> = HashMap::new();
    let mut repeats = Vec::new();
    for t in tasks {
        let (user, reply) = t.await.unwrap();
        if reply["status"] == "ok" {
            let share = &reply["prizes"][0];
            let prev = won.insert(
                user,
                (
                    share["share"].as_i64().unwrap(),
                    share["amount"].as_i64().unwrap(),
                ),
            );
            assert!(prev.is_none(), "user {user} got two shares");
            assert_eq!(reply["reward"], share["amount"]);
        } else {
            let code = reply["error"]["code"].as_str().unwrap().to_owned();
            if code == "already_grabbed" {
                repeats.push((user, reply["previous"].clone()));
            }
            *codes.entry(code).or_default() += 1;
        }
    }
    assert_eq!(won.len(), 200, "every share went to a distinct user");
    assert_eq!(won.values().map(|(_, a)| a).sum::<i64>(), total);
    assert!(won.values().all(|(_, a)| *a >= 10));
    assert!(
        codes
            .keys()
            .all(|c| c == "already_grabbed" || c == "sold_out"),
        "{codes:?}"
    );
    assert!(codes["already_grabbed"] > 0 && codes["sold_out"] > 0);
    // A repeat grabber is shown the share they hold.
    for (user, previous) in repeats {
        let (share, amount) = won[&user];
        assert_eq!(previous, json!({"share": share, "amount": amount}));
    }
    let s = packet(&env, "rp-crowd").await.unwrap();
    assert_eq!((s.grabbed, s.grabbed_count, s.in_packet), (total, 200, 0));
    assert_eq!(s.total, s.grabbed + s.refunded + s.in_packet);
    // Each grab credited once.
    assert_eq!(
        env.wait_ledger("rp-crowd", 0).await,
        0,
        "escrow and credits cancel out"
    );
    for (user, (_, amount)) in won.iter().take(20) {
        assert_eq!(
            balance(&env, *user).await - if *user == 1 { 1_000_000 - total } else { 0 },
            *amount
        );
    }
    for p in &mut procs {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &p.id().to_string()])
            .status();
        assert!(p.wait().unwrap().success());
    }
    env.stop_workers().await;
}

#[tokio::test]
async fn expiry_closes_the_packet_and_refunds_the_rest_exactly() {
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(3, 50_000).await;
    let reply = client
        .call("refill", &create("rp-exp", 3, 30_000, 10, 100, 2), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    let mut grabbed = 0;
    for user in 100..104 {
        let r = client
            .call("draw", &draw("rp-exp", user, 1), T)
            .await
            .unwrap();
        assert_eq!(r["status"], "ok", "{r}");
        grabbed += r["reward"].as_i64().unwrap();
    }
    // Nobody closes it by hand: the delayed expiry message does.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !packet(&env, "rp-exp").await.unwrap().closed {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the packet never closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let late = client
        .call("draw", &draw("rp-exp", 200, 1), T)
        .await
        .unwrap();
    assert_eq!(late["error"]["code"], "pool_closed", "{late}");
    let s = packet(&env, "rp-exp").await.unwrap();
    assert_eq!(
        (s.grabbed, s.refunded, s.in_packet),
        (grabbed, 30_000 - grabbed, 0)
    );
    // The refund reaches the sender's balance once: 50,000 - 30,000 + refund.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while balance(&env, 3).await != 50_000 - grabbed {
        assert!(
            tokio::time::Instant::now() < deadline,
            "refund not settled: {}",
            balance(&env, 3).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (refunds,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM ledger_entries WHERE reason = 'red_packet_refund'")
            .fetch_one(&env.db)
            .await
            .unwrap();
    assert_eq!(refunds, 1);
    // Expiring again (a duplicate message) refunds nothing more.
    client
        .send(
            "refill",
            &json!({"type": "redpacket.expire", "packet_id": "rp-exp"}),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(balance(&env, 3).await, 50_000 - grabbed);
    assert_eq!(env.queue_depth(amqp::REFILL.dlq).await, 0);
    env.stop_workers().await;
}

/// A refill worker called without a broker, for races the queue would
/// serialise.
fn worker(env: &TestEnv) -> prizepool::refill::RefillWorker {
    prizepool::refill::RefillWorker::new(env.config.clone(), env.redis.clone(), env.db.clone())
}

/// A create as the refill worker reads it (its `type` checked).
fn decode_create(body: &Value) -> Value {
    assert_eq!(body["type"], "redpacket.create", "not a create: {body}");
    body.clone()
}

/// An expiry as the refill worker reads it (its `type` checked).
fn decode_expire(body: &Value) -> Value {
    assert_eq!(body["type"], "redpacket.expire", "not an expire: {body}");
    body.clone()
}

fn reply_of(outcome: &prizepool::ledger::Unsealed) -> Value {
    serde_json::from_slice(outcome.reply.as_ref().unwrap()).unwrap()
}

/// The escrow entry of a packet, as the ledger holds it (negative).
async fn escrowed(env: &TestEnv, packet: &str) -> i64 {
    let row: Option<(i64,)> =
        sqlx::query_as("SELECT amount FROM ledger_entries WHERE entry_id = $1")
            .bind(format!("redpacket:{packet}:escrow"))
            .fetch_optional(&env.db)
            .await
            .unwrap();
    row.map_or(0, |(a,)| -a)
}

/// Escrowed = grabbed + refunded + still in the packet.
async fn assert_escrow_holds(env: &TestEnv, id: &str) -> red_packet::PacketStatus {
    let s = packet(env, id).await.unwrap();
    assert_eq!(escrowed(env, id).await, s.total, "{id}: {s:?}");
    assert_eq!(s.total, s.grabbed + s.refunded + s.in_packet, "{id}: {s:?}");
    s
}

async fn wait_depth(env: &TestEnv, queue: &str, expected: u32) -> u32 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let depth = env.queue_depth(queue).await;
        if depth == expected || tokio::time::Instant::now() > deadline {
            return depth;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_packet_id_is_bound_to_what_it_first_asked() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&common::pool_toml("gift-taken", "", &[("c1", &[(0, 10)])]))
        .await;
    let now = chrono::Utc::now();
    env.load_activities(&common::activity_toml(
        "act-taken",
        now - chrono::Duration::hours(1),
        now + chrono::Duration::hours(1),
        "{ id = \"ipad\", weight = 1, stock = 1 }",
    ))
    .await;
    env.start_refill_worker().await;
    let client = env.client().await;
    env.fund(7, 100_000).await;
    let first = create("rp-bound", 7, 10_000, 10, 5, 3600);
    let reply = client.call("refill", &first, T).await.unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    // The same content again: the first answer.
    assert_eq!(client.call("refill", &first, T).await.unwrap(), reply);
    let before = packet(&env, "rp-bound").await.unwrap();

    let mut other_asset = first.clone();
    other_asset["asset"] = "gem".into();
    let others = [
        create("rp-bound", 8, 10_000, 10, 5, 3600),
        create("rp-bound", 7, 20_000, 10, 5, 3600),
        create("rp-bound", 7, 10_000, 20, 5, 3600),
        create("rp-bound", 7, 10_000, 10, 1, 3600),
        create("rp-bound", 7, 10_000, 10, 5, 60),
        other_asset,
        // Ids of another kind: refused, nothing escrowed.
        create("gift-taken", 7, 10_000, 10, 1, 3600),
        create("act-taken", 7, 10_000, 10, 1, 3600),
    ];
    for other in &others {
        let r = client.call("refill", other, T).await.unwrap();
        assert_eq!(r["type"], "redpacket_result", "{other}: {r}");
        assert_eq!(r["status"], "rejected", "{other}: {r}");
        assert_eq!(r["error"]["code"], "invalid_request", "{other}: {r}");
    }
    assert_eq!(balance(&env, 7).await, 90_000);
    assert_eq!(packet(&env, "rp-bound").await.unwrap(), before);
    assert_escrow_holds(&env, "rp-bound").await;
    for id in ["gift-taken", "act-taken"] {
        assert_eq!(escrowed(&env, id).await, 0);
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM red_packets WHERE id = $1")
            .bind(id)
            .fetch_one(&env.db)
            .await
            .unwrap();
        assert_eq!(n, 0, "{id}");
    }
    assert_eq!(env.status("gift-taken").await.stocked, 10);
    // Every refusal was dead-lettered; the first answer still replays.
    assert_eq!(
        wait_depth(&env, amqp::REFILL.dlq, others.len() as u32).await,
        others.len() as u32
    );
    assert_eq!(client.call("refill", &first, T).await.unwrap(), reply);
    env.stop_workers().await;
}

#[tokio::test]
async fn extreme_or_malformed_creates_are_refused_at_once_and_the_worker_goes_on() {
    let mut env = TestEnv::new(&[]).await;
    env.start_refill_worker().await;
    let client = env.client().await;
    env.fund(7, 100_000).await;
    let max = red_packet::split::MAX_TOTAL;
    let mut bad = vec![
        create("rp-x", 7, 10_000, 10, i64::MAX, 3600),
        create("rp-x", 7, 10_000, 10, i64::MIN, 3600),
        create("rp-x", 7, 10_000, 10, i64::MAX / 9, 3600),
        create("rp-x", 7, 10_000, 10, 1_001, 3600),
        create("rp-x", 7, 10_000, i64::MAX, 1, 3600),
        create("rp-x", 7, 10_000, i64::MIN, 1, 3600),
        create("rp-x", 7, 10_000, -1, 1, 3600),
        create("rp-x", 7, i64::MAX, 10, 1, 3600),
        create("rp-x", 7, i64::MIN, 10, 1, 3600),
        create("rp-x", 7, 0, 1, 0, 3600),
        create("rp-x", 7, max + 1, 10, 1, 3600),
        create("rp-x", 7, 10_000, 10, 1, i64::MAX),
        create("rp-x", 7, 10_000, 10, 1, -1),
        create("rp-x", 7, 10_000, 10, 1, red_packet::MAX_EXPIRES_IN_S + 1),
        create("rp-x", -1, 10_000, 10, 1, 3600),
        create("rp{x}", 7, 10_000, 10, 1, 3600),
        create("", 7, 10_000, 10, 1, 3600),
    ];
    let mut wrong_types = Vec::new();
    for (field, value) in [
        ("total", json!("10000")),
        ("total", json!(100.5)),
        ("total", json!(null)),
        ("total", json!(18_446_744_073_709_551_615u64)),
        ("count", json!(1e30)),
        ("min", json!([1])),
        ("expires_in_s", json!({})),
        ("sender", json!(true)),
        ("packet_id", json!(42)),
        ("asset", json!(7)),
    ] {
        let mut body = create("rp-x", 7, 10_000, 10, 1, 3600);
        body[field] = value;
        wrong_types.push(body);
    }
    for field in ["packet_id", "sender", "total", "count", "expires_in_s"] {
        let mut body = create("rp-x", 7, 10_000, 10, 1, 3600);
        body.as_object_mut().unwrap().remove(field);
        wrong_types.push(body);
    }
    bad.extend(wrong_types);
    for body in &bad {
        let r = client.call("refill", body, T).await.unwrap();
        assert_eq!(r["status"], "rejected", "{body}: {r}");
        assert_eq!(r["error"]["code"], "invalid_request", "{body}: {r}");
    }
    assert_eq!(balance(&env, 7).await, 100_000);
    assert!(packet(&env, "rp-x").await.is_none());
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM pools")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(n, 0);
    // The edges that are allowed work: every share exactly `min`, and the
    // largest total in one share.
    let r = client
        .call("refill", &create("rp-x", 7, 10_000, 10, 1_000, 3600), T)
        .await
        .unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    let s = assert_escrow_holds(&env, "rp-x").await;
    assert_eq!((s.in_packet, s.shares_left), (10_000, 10));
    env.fund(9, max).await;
    let r = client
        .call("refill", &create("rp-max", 9, max, 1, 0, 60), T)
        .await
        .unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(assert_escrow_holds(&env, "rp-max").await.in_packet, max);
    // The most shares a packet may have are stocked in one step.
    let most = i64::from(red_packet::split::MAX_SHARES);
    let r = client
        .call("refill", &create("rp-many", 7, 10 * most, most, 10, 60), T)
        .await
        .unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    let s = assert_escrow_holds(&env, "rp-many").await;
    assert_eq!((s.in_packet, s.shares_left), (10 * most, most as usize));
    env.stop_workers().await;
}

#[tokio::test]
async fn a_forged_expiry_closes_nothing_early() {
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(3, 50_000).await;
    let reply = client
        .call("refill", &create("rp-long", 3, 30_000, 10, 100, 86_400), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    let forged = json!({"type": "redpacket.expire", "packet_id": "rp-long",
                        "expires_at": "2020-01-01T00:00:00Z"});
    let r = client.call("refill", &forged, T).await.unwrap();
    assert_eq!(r["type"], "redpacket_result", "{r}");
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["closed"], false, "{r}");
    assert_eq!(r["expires_at"], reply["expires_at"], "{r}");
    // Without a reply, and with no expiry at all.
    client.send("refill", &forged).await.unwrap();
    client
        .send(
            "refill",
            &json!({"type": "redpacket.expire", "packet_id": "rp-long"}),
        )
        .await
        .unwrap();
    // The packet stays open and grabbable.
    let g = client
        .call("draw", &draw("rp-long", 500, 1), T)
        .await
        .unwrap();
    assert_eq!(g["status"], "ok", "{g}");
    let s = assert_escrow_holds(&env, "rp-long").await;
    assert!(!s.closed);
    assert_eq!(s.refunded, 0);
    assert_eq!(s.grabbed, g["reward"].as_i64().unwrap());
    // An expiry for an unknown packet is refused and changes nothing.
    let r = client
        .call(
            "refill",
            &json!({"type": "redpacket.expire", "packet_id": "rp-none",
                    "expires_at": "2020-01-01T00:00:00Z"}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(r["error"]["code"], "invalid_request", "{r}");
    assert!(packet(&env, "rp-none").await.is_none());
    // Malformed expiries are bad input.
    for bad in [
        json!({"type": "redpacket.expire", "packet_id": "rp-long", "expires_at": 12}),
        json!({"type": "redpacket.expire", "packet_id": "rp-long", "expires_at": "soon"}),
        json!({"type": "redpacket.expire", "packet_id": "rp-long", "closed": true}),
        json!({"type": "redpacket.expire", "packet_id": "rp{long}"}),
        json!({"type": "redpacket.expire"}),
    ] {
        let r = client.call("refill", &bad, T).await.unwrap();
        assert_eq!(r["error"]["code"], "invalid_request", "{bad}: {r}");
    }
    // Balances: only the escrow and the grab moved.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while balance(&env, 500).await != s.grabbed {
        assert!(tokio::time::Instant::now() < deadline, "grab not settled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(balance(&env, 3).await, 20_000);
    let (refunds,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM ledger_entries WHERE reason = 'red_packet_refund'")
            .fetch_one(&env.db)
            .await
            .unwrap();
    assert_eq!(refunds, 0);
    assert!(!packet(&env, "rp-long").await.unwrap().closed);
    env.stop_workers().await;
}

#[tokio::test]
async fn escrow_holds_under_concurrent_grabs_forged_expiries_and_duplicate_creates() {
    let env = TestEnv::new(&[]).await;
    let w = Arc::new(worker(&env));
    env.fund(1, 1_000_000).await;
    let body = create("rp-race", 1, 50_000, 40, 10, 3600);
    // Twenty copies of one create at once: one escrow, one answer.
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (w, req) = (w.clone(), decode_create(&body));
        tasks.push(tokio::spawn(async move { w.step(&req).await.unwrap() }));
    }
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(reply_of(&t.await.unwrap()));
    }
    assert!(replies.iter().all(|r| *r == replies[0]), "{replies:?}");
    assert_eq!(replies[0]["status"], "ok");
    assert_eq!(balance(&env, 1).await, 950_000);
    assert_escrow_holds(&env, "rp-race").await;

    // Grabs by 60 users (each several times) and forged expiries, at once.
    let keys = env.keys("rp-race");
    let forged = decode_expire(&json!({"type": "redpacket.expire", "packet_id": "rp-race",
                                       "expires_at": "2000-01-01T00:00:00Z"}));
    let mut grabs = Vec::new();
    let mut expiries = Vec::new();
    for i in 0..180i64 {
        let (mut conn, keys) = (env.redis.clone(), keys.clone());
        let user = (i * 7) % 60;
        grabs.push(tokio::spawn(async move {
            let id = format!("grab-{i}");
            let g = grab_share(&mut conn, &keys, "rp-race", &id, user).await;
            (user, g)
        }));
        if i % 10 == 0 {
            let (w, req) = (w.clone(), forged.clone());
            expiries.push(tokio::spawn(async move { w.step(&req).await }));
        }
    }
    let mut won = HashMap::new();
    for t in grabs {
        let (user, g) = t.await.unwrap();
        if let Some(amount) = g {
            assert!(
                won.insert(user, amount).is_none(),
                "user {user} got two shares"
            );
        }
    }
    for t in expiries {
        let outcome = t.await.unwrap().unwrap();
        assert_eq!(reply_of(&outcome)["closed"], false);
        assert!(outcome.ledger.is_empty(), "an early expiry refunds nothing");
    }
    assert_eq!(won.len(), 40);
    let s = assert_escrow_holds(&env, "rp-race").await;
    assert!(!s.closed);
    assert_eq!(s.grabbed, won.values().sum::<i64>());
    assert_eq!((s.grabbed, s.refunded, s.in_packet), (50_000, 0, 0));
}

#[tokio::test]
async fn a_create_sent_twice_at_once_with_different_contents_has_one_winner() {
    let env = TestEnv::new(&[]).await;
    let w = Arc::new(worker(&env));
    env.fund(1, 1_000_000).await;
    let mut debited = 0;
    for round in 0..8 {
        let id = format!("rp-twice-{round}");
        let a = decode_create(&create(&id, 1, 10_000, 10, 1, 3600));
        let b = decode_create(&create(&id, 1, 20_000, 5, 1, 3600));
        let (ra, rb) = tokio::join!(w.step(&a), w.step(&b));
        let winner = match (ra, rb) {
            (Ok(o), Err(amqp::HandleError::Invalid(_))) => (o, 10_000),
            (Err(amqp::HandleError::Invalid(_)), Ok(o)) => (o, 20_000),
            (a, b) => panic!("round {round}: {a:?} / {b:?}"),
        };
        let reply = reply_of(&winner.0);
        assert_eq!(reply["status"], "ok", "{reply}");
        assert_eq!(reply["total"], winner.1);
        debited += winner.1;
        assert_eq!(balance(&env, 1).await, 1_000_000 - debited);
        let s = assert_escrow_holds(&env, &id).await;
        assert_eq!((s.total, s.in_packet), (winner.1, winner.1));
    }
}

#[tokio::test]
async fn closing_refunds_once_and_lets_the_keys_expire() {
    let env = TestEnv::new(&[]).await;
    let w = worker(&env);
    env.fund(4, 10_000).await;
    let created = w
        // Expires in 3 s: time for the grab and the early expiry below on a
        // busy machine.
        .step(&decode_create(&create("rp-short", 4, 10_000, 5, 1, 3)))
        .await
        .unwrap();
    assert_eq!(reply_of(&created)["status"], "ok");
    let keys = env.keys("rp-short");
    let mut conn = env.redis.clone();
    let amount = grab_share(&mut conn, &keys, "rp-short", "g-1", 77)
        .await
        .expect("a share");
    // The close step itself checks the stored expiry, whoever calls it.
    let early = red_packet::close(&mut conn, &keys).await.unwrap();
    let red_packet::Close::Early { expires_at } = early else {
        panic!("closed early: {early:?}")
    };
    assert_eq!(
        red_packet::wire_time(expires_at),
        reply_of(&created)["expires_at"]
    );
    let expire = decode_expire(&json!({"type": "redpacket.expire", "packet_id": "rp-short"}));
    // Due in a few seconds: an early call leaves it open.
    let early = w.step(&expire).await.unwrap();
    assert_eq!(reply_of(&early)["closed"], false);
    assert!(!packet(&env, "rp-short").await.unwrap().closed);
    // Due at the whole second the create answered (at most two away).
    let due: chrono::DateTime<chrono::Utc> = reply_of(&created)["expires_at"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let wait = (due - chrono::Utc::now()).num_milliseconds().max(0) + 100;
    tokio::time::sleep(Duration::from_millis(wait.unsigned_abs())).await;
    // A closer that dies after the Redis step: the next expiry records the
    // close, refunds and announces it, once.
    let step = red_packet::close(&mut conn, &keys).await.unwrap();
    assert_eq!(
        step,
        red_packet::Close::Closed {
            refunded: 10_000 - amount,
            now: true
        }
    );
    let mut announced = 0;
    for _ in 0..3 {
        let closed = w.step(&expire).await.unwrap();
        announced += closed
            .effects
            .iter()
            .filter(|e| e.routing_key == red_packet::CLOSED_EVENT)
            .count();
        let reply = reply_of(&closed);
        assert_eq!(reply["closed"], true, "{reply}");
        assert_eq!(reply["refunded"], 10_000 - amount);
        // The refund is re-sent on every replay; its entry id makes it once.
        assert_eq!(closed.ledger.len(), 1);
        assert_eq!(closed.ledger[0].entry_id, "redpacket:rp-short:refund");
        assert_eq!(closed.ledger[0].amount, 10_000 - amount);
        prizepool::settle::apply(&env.db, &closed.ledger)
            .await
            .unwrap();
    }
    assert_eq!(announced, 1);
    assert_eq!(balance(&env, 4).await, 10_000 - amount);
    let s = assert_escrow_holds(&env, "rp-short").await;
    assert!(s.closed);
    assert_eq!(
        (s.grabbed, s.refunded, s.in_packet),
        (amount, 10_000 - amount, 0)
    );
    // Each user's share lives in the packet's meta hash: no grabbed hash.
    let grabbed_hash: i64 = redis::cmd("EXISTS")
        .arg(keys.grabbed())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(grabbed_hash, 0);
    for key in [keys.meta()] {
        let ttl: i64 = redis::cmd("TTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(
            ttl > 0 && ttl <= red_packet::CLOSED_RETENTION_S as i64,
            "{key}: {ttl}"
        );
    }
    // Once the retention is over and the keys are gone, a replayed create
    // answers as first created and stocks nothing again.
    for key in [keys.meta(), keys.grabbed()] {
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let again = w
        .step(&decode_create(&create("rp-short", 4, 10_000, 5, 1, 3)))
        .await
        .unwrap();
    assert_eq!(reply_of(&again), reply_of(&created));
    assert!(packet(&env, "rp-short").await.is_none());
    let closed = w.step(&expire).await.unwrap();
    assert_eq!(reply_of(&closed)["refunded"], 10_000 - amount);
}

/// A packet whose expiry comes while Postgres is away: grabs go on (they
/// are Redis steps), the close waits for Postgres without dead-lettering,
/// and once it is back the packet closes once, the refund is paid once and
/// escrow = grabbed + refunded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiry_while_postgres_is_away_closes_and_refunds_once_it_is_back() {
    let pg = common::PrivatePostgres::init();
    pg.start();
    let url = pg.url();
    let mut env = TestEnv::new(&[("DATABASE_URL", &url), ("TRANSIENT_RETRY_MS", "1000")]).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(3, 50_000).await;
    // Six seconds to expiry: the grabs and the stop below come before it
    // even on a loaded machine (with three, the last grab once found the
    // packet closed), and the expiry still comes due during the outage.
    let expires_in = Duration::from_secs(6);
    let created = tokio::time::Instant::now();
    let reply = client
        .call(
            "refill",
            &create("rp-pg", 3, 30_000, 10, 100, expires_in.as_secs() as i64),
            T,
        )
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    let mut grabbed = 0;
    for user in 100..103 {
        let r = client
            .call("draw", &draw("rp-pg", user, 1), T)
            .await
            .unwrap();
        assert_eq!(r["status"], "ok", "{r}");
        grabbed += r["reward"].as_i64().unwrap();
    }

    pg.stop();
    // Grabs while Postgres is away are answered from Redis.
    let r = client
        .call("draw", &draw("rp-pg", 103, 1), T)
        .await
        .unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    grabbed += r["reward"].as_i64().unwrap();
    // The expiry arrives during the outage; give it time to be tried and
    // retried (six seconds past it, about what the 3 s expiry had).
    assert!(
        created.elapsed() < expires_in,
        "the grabs took longer than the expiry"
    );
    tokio::time::sleep_until(created + expires_in + Duration::from_secs(6)).await;
    assert_eq!(
        env.queue_depth(amqp::REFILL.dlq).await,
        0,
        "nothing dead-lettered"
    );
    pg.start();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while balance(&env, 3).await != 50_000 - grabbed {
        assert!(
            tokio::time::Instant::now() < deadline,
            "refund not settled: {}",
            balance(&env, 3).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = assert_escrow_holds(&env, "rp-pg").await;
    assert!(s.closed, "{s:?}");
    assert_eq!(
        (s.grabbed, s.refunded, s.in_packet),
        (grabbed, 30_000 - grabbed, 0)
    );
    let late = client
        .call("draw", &draw("rp-pg", 200, 1), T)
        .await
        .unwrap();
    assert_eq!(late["error"]["code"], "pool_closed", "{late}");
    let (refunds, closes): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM ledger_entries WHERE reason = 'red_packet_refund'),
                (SELECT count(*) FROM red_packets WHERE id = 'rp-pg' AND closed_at IS NOT NULL)",
    )
    .fetch_one(&env.db)
    .await
    .unwrap();
    assert_eq!((refunds, closes), (1, 1));
    for route in amqp::ROUTES {
        assert_eq!(env.queue_depth(route.dlq).await, 0, "{}", route.dlq);
    }
    client.close().await;
    env.stop_workers().await;
}

/// A packet stocked before each user's share moved into its meta hash
/// keeps its shares in its grabbed hash, and one share a user still holds.
#[tokio::test]
async fn a_packet_of_the_earlier_layout_gives_one_share_per_user() {
    let env = TestEnv::new(&[]).await;
    let keys = env.keys("rp-old");
    let mut redis = env.redis.clone();
    let expires = prizepool::scripts::now_ms() + 3_600_000;
    let (status, n): (String, i64) = prizepool::kinds::red_packet::scripts::STOCK
        .key(keys.meta())
        .key(keys.shares())
        .arg(1)
        .arg(300)
        .arg(expires)
        .arg("coin")
        .arg("1:100")
        .arg("2:100")
        .arg("3:100")
        .invoke_async(&mut redis)
        .await
        .unwrap();
    assert_eq!((status.as_str(), n), ("stocked", 3));
    // The earlier layout: no `grabs` field in meta.
    let _: i64 = redis::cmd("HDEL")
        .arg(keys.meta())
        .arg("grabs")
        .query_async(&mut redis)
        .await
        .unwrap();
    let e = &keys;
    assert_eq!(
        grab_share(&mut redis, e, "rp-old", "rq-1", 7).await,
        Some(100)
    );
    assert_eq!(grab_share(&mut redis, e, "rp-old", "rq-2", 7).await, None);
    assert_eq!(
        grab_share(&mut redis, e, "rp-old", "rq-3", 8).await,
        Some(100)
    );
    let grabbed: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.grabbed())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(
        grabbed,
        HashMap::from([
            ("7".to_owned(), "1:100".to_owned()),
            ("8".to_owned(), "2:100".to_owned())
        ])
    );
    let p = packet(&env, "rp-old").await.unwrap();
    assert_eq!((p.grabbed, p.grabbed_count, p.in_packet), (200, 2, 100));
}
