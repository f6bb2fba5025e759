//! Several broker addresses in `AMQP_URL`: every connection picks a live
//! node in random order, so a stopped node costs a failed attempt, never the
//! fleet. The queue arguments never change in a way RabbitMQ refuses for a
//! queue declared before (the leader locator is a broker setting for that
//! reason).
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{draw, free_port, pool_toml, TestEnv};
use lapin::{options::QueueDeclareOptions, types::FieldTable};
use prizepool::amqp;

const T: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_dead_node_in_the_list_is_skipped() {
    let mut env = TestEnv::new(&[]).await;
    // A node that answers nothing, listed with the live one.
    let dead = format!("amqp://guest:guest@127.0.0.1:{}/{}", free_port(), env.vhost);
    env.config.amqp_url = format!("{dead},{}", env.config.amqp_url);
    env.load(&pool_toml("multi", "", &[("a", &[(0, 50), (2, 50)])]))
        .await;
    env.start_fleet().await;
    // Random order: over a dozen connections, both orders come up.
    for user in 0..12 {
        let client = amqp::rpc::RpcClient::connect(&env.config).await.unwrap();
        let reply = client
            .call("draw", &draw("multi", user, 2), T)
            .await
            .unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
        client.close().await;
    }
    // With no live node at all, the error names every node, redacted.
    let err = amqp::connect(&format!("{dead},{dead}"), "t")
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(err.matches("connecting to RabbitMQ").count(), 2, "{err}");
    assert!(!err.contains("guest:guest"), "{err}");
    env.stop_workers().await;
}

#[tokio::test]
async fn queues_declared_without_a_leader_locator_are_declared_again() {
    let env = TestEnv::new(&[]).await;
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let channel = conn.create_channel().await.unwrap();
    // The dead-letter queue as an older release declared it: any argument
    // added since would make RabbitMQ refuse the fleet's declaration.
    let mut old = FieldTable::default();
    old.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(
            amqp::DRAW.dlq.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            old,
        )
        .await
        .unwrap();
    amqp::declare_topology(&channel, env.config.delivery_limit)
        .await
        .unwrap();
    let _ = conn.close(200, "bye".into()).await;
}
