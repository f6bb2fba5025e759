//! A graceful stop under a full queue: 10,000 draws in flight, every draw
//! worker sent SIGTERM, then a new worker started. Every request is answered
//! exactly once (replies are counted by request id, duplicates included),
//! the ledger pays exactly what the replies promised and conservation holds.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{process::Command, time::Duration};

use common::{pool_toml, raw::Raw, spawn_binary, wait_exit, TestEnv};
use serde_json::json;

const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 300), (1, 60), (5, 20)]),
    ("b", &[(0, 200), (2, 50), (10, 10)]),
];

fn draw_worker(env: &TestEnv) -> std::process::Child {
    spawn_binary(env, "draw-worker", env!("CARGO_BIN_EXE_draw-worker"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_ten_thousand_draws_in_flight_answers_each_once() {
    const N: usize = 10_000;
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("stop", "refill_at = 0.5\nmax_count = 100", GIFT))
        .await;
    env.start_refill_worker().await;
    env.start_settle_worker().await;
    let mut workers = vec![draw_worker(&env), draw_worker(&env)];

    // A reply queue of our own, so that a second reply to one request is seen.
    let raw = Raw::new(&env).await;
    let messages: Vec<(&str, Vec<u8>, String)> = (0..N)
        .map(|i| {
            let id = format!("g-{i}");
            let body = json!({"type": "draw", "request_id": id, "pool": "stop",
                              "user_id": 1 + (i % 100) as i64, "count": 1 + (i % 3) as u32});
            ("draw", serde_json::to_vec(&body).unwrap(), id)
        })
        .collect();
    raw.publish_all(&messages).await;
    // Replies by request id, every copy kept.
    let replies = || raw.by_id();

    // Stop every draw worker while most of the queue is still ahead of them.
    let count = || replies().len();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count() < 500 {
        assert!(tokio::time::Instant::now() < deadline, "no draws answered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for w in &workers {
        Command::new("kill")
            .args(["-TERM", &w.id().to_string()])
            .status()
            .unwrap();
    }
    for w in &mut workers {
        let status = wait_exit(w, Duration::from_secs(30)).await;
        assert!(status.success(), "exit status {status:?}");
    }
    let at_stop = count();
    eprintln!("{at_stop} of {N} answered when the workers stopped");
    assert!(
        at_stop < N,
        "the stop came after the last draw: nothing was in flight"
    );

    // A new worker finishes the queue.
    let mut restarted = draw_worker(&env);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    while count() < N && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Time for a late duplicate to show up.
    tokio::time::sleep(Duration::from_secs(2)).await;
    Command::new("kill")
        .args(["-TERM", &restarted.id().to_string()])
        .status()
        .unwrap();
    assert!(wait_exit(&mut restarted, Duration::from_secs(30))
        .await
        .success());

    let replies = replies();
    assert_eq!(replies.len(), N, "every request answered");
    let doubled: Vec<_> = replies.iter().filter(|(_, r)| r.len() > 1).collect();
    assert!(
        doubled.is_empty(),
        "{} requests answered twice, e.g. {:?}",
        doubled.len(),
        doubled.first()
    );
    let (mut promised, mut prizes) = (0i64, 0u64);
    for r in replies.values().map(|r| &r[0]) {
        match r["status"].as_str() {
            Some("ok") => {
                promised += r["reward"].as_i64().unwrap();
                prizes += r["prizes"].as_array().unwrap().len() as u64;
            }
            _ => assert_eq!(r["error"]["code"], "pool_exhausted", "{r}"),
        }
    }
    assert_eq!(
        env.wait_ledger("stop", promised).await,
        promised,
        "ledger = replies"
    );
    let s = env.status("stop").await;
    assert_eq!(
        s.drawn, prizes,
        "each answered draw drew once, refusals none"
    );
    assert_eq!(s.stocked, s.drawn + s.in_pool, "conservation");
    assert_eq!(env.queue_depth(prizepool::amqp::DRAW.queue).await, 0);
    assert_eq!(env.queue_depth(prizepool::amqp::DRAW.dlq).await, 0);
    env.stop_workers().await;
}
