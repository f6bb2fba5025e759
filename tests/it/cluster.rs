//! The fleet against a real Redis Cluster of three nodes started by the test:
//! every Lua step touches one pool's keys, which share a hash tag, so each
//! runs on one node whichever node holds the pool.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{draw, pool_toml, redis_cluster::RedisCluster, TestEnv};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

#[tokio::test]
async fn the_fleet_runs_on_a_redis_cluster() {
    let cluster = RedisCluster::start(3, 0).await;
    let mut env = TestEnv::new(&[("REDIS_URL", &cluster.url)]).await;
    // Several pools, so their hash tags land on different nodes.
    let combos: &[(&str, &[(u64, u64)])] = &[
        ("a", &[(0, 80), (2, 15), (10, 5)]),
        ("b", &[(0, 90), (3, 10)]),
    ];
    let pools = ["gift-a", "gift-b", "gift-c", "gift-d"];
    for (i, pool) in pools.iter().enumerate() {
        let storage = if i % 2 == 0 { "list" } else { "sparse" };
        env.load(&pool_toml(
            pool,
            &format!("storage = \"{storage}\"\nrefill_at = 0.5"),
            combos,
        ))
        .await;
    }
    env.start_fleet().await;
    let client = env.client().await;
    for pool in pools {
        let mut rewards = 0;
        for user in 0..12 {
            let r = client.call("draw", &draw(pool, user, 50), T).await.unwrap();
            assert_eq!(r["status"], "ok", "{pool}: {r}");
            rewards += r["reward"].as_i64().unwrap();
        }
        // The refill the last draw asked for runs after its reply.
        let deadline = tokio::time::Instant::now() + T;
        let s = loop {
            let s = env.status(pool).await;
            if s.generation >= 4 || tokio::time::Instant::now() > deadline {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        assert_eq!(s.drawn, 600);
        assert!(s.generation >= 4, "refills ran on the cluster: {s:?}");
        assert_eq!(s.stocked, s.drawn + s.in_pool);
        assert_eq!(env.wait_ledger(pool, rewards).await, rewards);
    }

    // A red packet and a lottery on the same cluster.
    prizepool::settle::apply(
        &env.db,
        &[prizepool::messages::SettleRequest::new(
            "topup:1",
            1,
            "coin",
            1000,
            "topup",
            json!({}),
        )],
    )
    .await
    .unwrap();
    let created = client
        .call("refill", &json!({"type": "redpacket.create", "packet_id": "rp-c", "sender": 1, "total": 1000, "count": 5, "min": 1, "expires_in_s": 600}), T)
        .await
        .unwrap();
    assert_eq!(created["status"], "ok", "{created}");
    let first = client.call("draw", &draw("rp-c", 9, 1), T).await.unwrap();
    assert_eq!(first["status"], "ok", "{first}");
    let again = client.call("draw", &draw("rp-c", 9, 1), T).await.unwrap();
    assert_eq!(again["error"]["code"], "already_grabbed");
    let mut redis = env.redis.clone();
    let packet = prizepool::kinds::red_packet::status(&mut redis, &env.keys("rp-c"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        packet.total,
        packet.grabbed + packet.refunded + packet.in_packet
    );

    let now = chrono::Utc::now();
    env.load_activities(&common::activity_toml(
        "lot-c",
        now - chrono::Duration::hours(1),
        now + chrono::Duration::hours(1),
        "{ id = \"x\", weight = 1, stock = 2 }",
    ))
    .await;
    let grant = client
        .call("draw", &json!({"type": "lottery.grant", "grant_id": "g", "activity": "lot-c", "user_id": 4, "chances": 1}), T)
        .await
        .unwrap();
    assert_eq!(grant["status"], "ok");
    let won = client.call("draw", &draw("lot-c", 4, 1), T).await.unwrap();
    assert_eq!(won["status"], "ok", "{won}");
    assert_eq!(won["chances_left"], 0);
    env.stop_workers().await;
}
