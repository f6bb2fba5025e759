//! `DRAW_SHARDS = 3` on the shared broker: upstreams still publish to
//! `prizepool` with key `draw`, the broker spreads the requests over three
//! quorum queues, every draw worker consumes all three, and every rule holds
//! per shard: each request is answered once, draws once, and the ledger pays
//! exactly what the replies promised. Going back to one shard removes the
//! spreading and keeps consuming what the other shards still hold.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{process::Command, time::Duration};

use common::{
    draw,
    load::{assert_invariants, draws_through_a_fault, Load},
    pool_toml, TestEnv,
};
use prizepool::amqp::{draw_shard, DRAW_SPREAD, EXCHANGE};

const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 300), (1, 60), (5, 20)]),
    ("b", &[(0, 200), (2, 50), (10, 10)]),
];

/// `(source, destination, routing key)` of every binding in `vhost`.
fn bindings(vhost: &str) -> Vec<(String, String, String)> {
    let out = Command::new("rabbitmqctl")
        .args(["list_bindings", "-q", "-p", vhost])
        .args(["source_name", "destination_name", "routing_key"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (f.len() == 3).then(|| (f[0].to_owned(), f[1].to_owned(), f[2].to_owned()))
        })
        .collect()
}

fn bound(vhost: &str, source: &str, destination: &str) -> bool {
    bindings(vhost)
        .iter()
        .any(|(s, d, k)| s == source && d == destination && k == "draw")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_draw_shards_answer_every_draw_once_with_the_ledger_exact() {
    let mut env = TestEnv::new(&[("DRAW_SHARDS", "3")]).await;
    env.load(&pool_toml("sh", "max_count = 100", GIFT)).await;
    env.load(&pool_toml("sq", "max_count = 100", GIFT)).await;
    // The client declares the topology as its configuration says.
    let client = env.client().await;
    let shards: Vec<String> = (0..3).map(draw_shard).collect();
    assert!(
        !bound(&env.vhost, EXCHANGE, &shards[0]),
        "key draw no longer goes straight to prizepool.draw: {:?}",
        bindings(&env.vhost)
    );
    assert!(bound(&env.vhost, EXCHANGE, DRAW_SPREAD));
    for shard in &shards {
        assert!(bound(&env.vhost, DRAW_SPREAD, shard), "{shard} is bound");
    }

    // Before any worker runs: 90 requests on key `draw` land on the three
    // shards, each on one of them (a shard left empty by chance: 3 × (2/3)^90).
    for i in 0..90 {
        let mut body = draw("sq", 1 + i % 7, 2);
        body["request_id"] = format!("q-{i}").into();
        client.send("draw", &body).await.unwrap();
    }
    let mut depths = Vec::new();
    for shard in &shards {
        depths.push(env.queue_depth(shard).await);
    }
    assert_eq!(
        depths.iter().sum::<u32>(),
        90,
        "each request on one shard: {depths:?}"
    );
    assert!(
        depths.iter().all(|&d| d > 0),
        "every shard took some: {depths:?}"
    );

    // Two draw workers, each consuming every shard.
    env.start_draw_worker().await;
    env.start_fleet().await;
    for shard in &shards {
        assert_eq!(env.consumers(shard).await, 2, "{shard}");
    }
    let (n, count) = (600, 3);
    let replies = draws_through_a_fault(
        &env,
        Load {
            tag: "s",
            pool: "sh",
            n,
            count,
            in_flight: 30,
            at: 0,
        },
        || async {},
    )
    .await;
    assert_invariants(&env, "sh", n, count, &replies).await;
    // The requests sent without a reply were drawn once each too.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while env.status("sq").await.drawn < 180 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the 90 queued draws were drawn"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        env.status("sq").await.drawn,
        180,
        "each queued draw drew once"
    );
    for shard in &shards {
        assert_eq!(env.queue_depth(shard).await, 0, "{shard} drained");
    }
    env.stop_workers().await;
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn going_back_to_one_shard_drains_the_others_and_routes_straight_again() {
    let env3 = TestEnv::new(&[("DRAW_SHARDS", "3")]).await;
    env3.load(&pool_toml("dn", "max_count = 100", GIFT)).await;
    let client = env3.client().await;
    for i in 0..60 {
        let mut body = draw("dn", 1 + i % 7, 1);
        body["request_id"] = format!("d-{i}").into();
        client.send("draw", &body).await.unwrap();
    }
    client.close().await;
    // The same vhost, prefix and database, now with one shard.
    let mut env1 = env3.sharing(|c| c.draw_shards = 1);
    env1.start_fleet().await;
    assert!(bound(&env1.vhost, EXCHANGE, &draw_shard(0)));
    assert!(!bindings(&env1.vhost).iter().any(|(s, ..)| s == DRAW_SPREAD));
    // Shards 1 and 2 are still consumed until they are drained and deleted.
    for k in 1..3 {
        assert_eq!(env1.consumers(&draw_shard(k)).await, 1);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while env1.status("dn").await.drawn < 60 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "every queued draw was drawn"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(env1.status("dn").await.drawn, 60);
    env1.stop_workers().await;
}

/// The documented way down from four shards to one: lower `DRAW_SHARDS`,
/// then delete the shards that are empty. Shards 1 and 2 are deleted while
/// shard 3 still holds requests: the workers of one shard still find and
/// consume shard 3 across the gap, and every request on it is drawn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_left_past_a_deleted_one_is_still_consumed() {
    let env4 = TestEnv::new(&[("DRAW_SHARDS", "4")]).await;
    env4.load(&pool_toml("dg", "max_count = 100", GIFT)).await;
    // The client declares the four shards; requests then go on shard 3 alone.
    env4.client().await.close().await;
    let conn = prizepool::amqp::connect(&env4.config.amqp_url, "test")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel.confirm_select(Default::default()).await.unwrap();
    for i in 0..20 {
        let mut body = draw("dg", 1 + i % 5, 1);
        body["request_id"] = format!("g-{i}").into();
        channel
            .basic_publish(
                "".into(),
                draw_shard(3).as_str().into(),
                Default::default(),
                body.to_string().as_bytes(),
                lapin::BasicProperties::default().with_content_type("application/json".into()),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    env4.wait_depth(&draw_shard(3), 20).await;
    for k in 1..3 {
        channel
            .queue_delete(draw_shard(k).as_str().into(), Default::default())
            .await
            .unwrap();
    }
    let _ = conn.close(200, "bye".into()).await;

    let mut env1 = env4.sharing(|c| c.draw_shards = 1);
    env1.start_fleet().await;
    assert_eq!(
        env1.consumers(&draw_shard(3)).await,
        1,
        "shard 3 is consumed"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let drawn = env1.status("dg").await.drawn;
        if drawn == 20 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "drew {drawn} of the 20 requests on shard 3"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env1.wait_depth(&draw_shard(3), 0).await;
    env1.stop_workers().await;
}
