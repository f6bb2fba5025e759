//! One seal key for the fleet when `LEDGER_SEAL_KEY` is unset and Redis
//! loses the key it keeps: a process that notices first puts the fleet's
//! key back; a process that finds another key there (made by a worker
//! started after the loss) switches to it; and what the old key sealed
//! still checks, so rewards dead-lettered meanwhile replay into the ledger.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::TestEnv;
use prizepool::{
    amqp,
    ledger::{FleetSealer, Sealer, KEY_RING},
    messages::{EntryRef, SettleRequest},
};

/// The names of the key and its ring in Redis, for `env`.
fn names(env: &TestEnv) -> (String, String) {
    let key = format!("{}:ledger-seal-key", env.config.redis_prefix);
    let ring = format!("{key}{KEY_RING}");
    (key, ring)
}

async fn lose_the_key(env: &TestEnv) {
    let (key, ring) = names(env);
    let mut redis = env.redis.clone();
    redis::cmd("DEL")
        .arg(&key)
        .arg(&ring)
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
}

fn reward(id: &str, amount: i64) -> SettleRequest {
    SettleRequest::fleet(
        format!("draw:seal:{id}:1"),
        42,
        "coin",
        amount,
        "lucky_gift",
        EntryRef::prize("seal", id),
    )
}

#[tokio::test]
async fn the_first_process_to_notice_puts_the_fleets_key_back() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let old = FleetSealer::with_refresh(Duration::ZERO);
    let k1 = old.get(&mut redis, &env.config).await.unwrap();
    lose_the_key(&env).await;
    // The worker that reads the key again finds none and restores its own;
    // a worker started afterwards reads that same key.
    let again = old.get(&mut redis, &env.config).await.unwrap();
    assert!(again.same_key(&k1));
    let started_later = Sealer::load(&mut redis, &env.config.redis_prefix, None)
        .await
        .unwrap();
    assert!(started_later.same_key(&k1));
    let sealed = k1.seal(reward("r0", 1));
    assert!(started_later.check(&sealed).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_redis_lost_becomes_one_key_again_and_its_dead_letters_replay() {
    let mut env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    // A worker of the fleet holds the key kept in Redis.
    let old = FleetSealer::with_refresh(Duration::ZERO);
    let k1 = old.get(&mut redis, &env.config).await.unwrap();
    // Redis loses the key (and its ring); a worker started now makes a new
    // one before the old worker reads the key again.
    lose_the_key(&env).await;
    let k2 = Sealer::load(&mut redis, &env.config.redis_prefix, None)
        .await
        .unwrap();
    assert!(!k2.same_key(&k1));
    // A reward the old worker sealed meanwhile is a forgery to the new key,
    // and a settle worker started now dead-letters it.
    let sealed = k1.seal(reward("r1", 600));
    assert!(k2.check(&sealed).is_err());
    env.start_settle_worker().await;
    let client = env.client().await;
    client
        .send("settle", &serde_json::to_value(&sealed).unwrap())
        .await
        .unwrap();
    env.wait_depth(amqp::SETTLE.dlq, 1).await;

    // The old worker reads the key again: it now seals with the fleet's
    // key, and what its old key sealed checks for everyone.
    let switched = old.get(&mut redis, &env.config).await.unwrap();
    assert!(switched.same_key(&k2), "the fleet has one key again");
    let fresh = Sealer::load(&mut redis, &env.config.redis_prefix, None)
        .await
        .unwrap();
    assert!(fresh.same_key(&k2));
    assert!(fresh.check(&sealed).is_ok());
    assert!(fresh.check(&switched.seal(reward("r2", 5))).is_ok());
    // A forgery is still a forgery.
    let forged = Sealer::new("an upstream's guess").seal(reward("r3", 1_000_000));
    assert!(fresh.check(&forged).is_err());

    // The dead letter replays into the ledger once the settle worker has
    // read the key again (it does every few seconds).
    let conn = amqp::connect(&env.config.amqp_url, "test").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if env.queue_depth(amqp::SETTLE.dlq).await > 0 {
            amqp::dlq::replay(&conn, amqp::SETTLE, usize::MAX, false)
                .await
                .unwrap();
        }
        let balances = prizepool::ledger::balances(&env.db, 42).await.unwrap();
        if balances
            .iter()
            .any(|b| b.asset == "coin" && b.balance == 600)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replayed reward never landed: {balances:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(env.queue_depth(amqp::SETTLE.dlq).await, 0);
    let _ = conn.close(200, "bye".into()).await;
    client.close().await;
    env.stop_workers().await;
}
