//! Red packets (SPEC §4) on the real fleet: escrow, split, one share per
//! user under concurrency, settlement, expiry and refund.
#![allow(clippy::unwrap_used)]

mod common;

use std::{collections::HashMap, sync::Arc, time::Duration};

use common::{draw, TestEnv};
use prizepool::{amqp, kinds::red_packet, messages::SettleRequest};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);

async fn fund(env: &TestEnv, account: i64, amount: i64) {
    let topup = SettleRequest::new(
        format!("topup:{account}:{amount}"),
        account,
        "coin",
        amount,
        "topup",
        json!({}),
    );
    prizepool::settle::apply(&env.db, &[topup]).await.unwrap();
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
    red_packet::status(&mut redis, &env.scripts, &env.keys(id))
        .await
        .unwrap()
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

    fund(&env, 7, 25_000).await;
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
    fund(&env, 1, 1_000_000).await;
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
    fund(&env, 3, 50_000).await;
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
