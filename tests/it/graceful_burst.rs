//! SIGTERM to the whole fleet (two draw workers, refill and settle) half a
//! second into a burst of 10,000 draws published as fast as possible, then
//! the fleet started again: every request is answered exactly once.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{process::Command, time::Duration};

use common::{pool_toml, raw::Raw, spawn_binary, wait_exit, TestEnv};
use serde_json::json;

const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 300), (1, 60), (5, 20)]),
    ("b", &[(0, 200), (2, 50), (10, 10)]),
];

fn fleet(env: &TestEnv) -> Vec<std::process::Child> {
    vec![
        spawn_binary(env, "draw-worker", env!("CARGO_BIN_EXE_draw-worker")),
        spawn_binary(env, "draw-worker", env!("CARGO_BIN_EXE_draw-worker")),
        spawn_binary(env, "refill-worker", env!("CARGO_BIN_EXE_refill-worker")),
        spawn_binary(env, "settle-worker", env!("CARGO_BIN_EXE_settle-worker")),
    ]
}

async fn stop(workers: &mut [std::process::Child]) {
    for w in workers.iter() {
        Command::new("kill")
            .args(["-TERM", &w.id().to_string()])
            .status()
            .unwrap();
    }
    for w in workers.iter_mut() {
        let status = wait_exit(w, Duration::from_secs(60)).await;
        assert!(status.success(), "exit status {status:?}");
    }
}

/// Before the consuming channel closes, RabbitMQ's quorum-queue client may
/// still hold the session's last acks back (it sends a channel's
/// settlements only as the queue applies earlier ones); closing at once
/// dropped them, and the restarted fleet answered those requests again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_the_whole_fleet_in_a_burst_answers_each_once() {
    const N: usize = 10_000;
    let env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "burst",
        "refill_at = 0.5\nmax_count = 4000",
        GIFT,
    ))
    .await;
    let mut workers = fleet(&env);
    let raw = Raw::new(&env).await;
    let messages: Vec<(&str, Vec<u8>, String)> = (0..N)
        .map(|i| {
            let id = format!("b-{i}");
            let body = json!({"type": "draw", "request_id": id, "pool": "burst",
                              "user_id": 1 + (i % 200) as i64, "count": 1 + (i % 10) as u32});
            ("draw", serde_json::to_vec(&body).unwrap(), id)
        })
        .collect();
    let replies = || raw.by_id();
    // Wait until the fleet consumes, then burst and stop it mid-burst.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while env.consumers(prizepool::amqp::DRAW.queue).await < 2 {
        assert!(tokio::time::Instant::now() < deadline, "no draw workers");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::join!(raw.publish_all(&messages), async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop(&mut workers).await;
    });
    let at_stop = replies().len();
    eprintln!("{at_stop} of {N} answered when the fleet stopped");

    let mut restarted = fleet(&env);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
    while replies().len() < N && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Time for a late duplicate to show up.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop(&mut restarted).await;
    let replies = replies();
    assert_eq!(replies.len(), N, "every request answered");
    let doubled: Vec<_> = replies.iter().filter(|(_, r)| r.len() > 1).collect();
    assert!(
        doubled.is_empty(),
        "{} requests answered twice, e.g. {:?}",
        doubled.len(),
        doubled.first()
    );
    assert_eq!(env.queue_depth(prizepool::amqp::DRAW.dlq).await, 0);
}
