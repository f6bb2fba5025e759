//! A pool that stays short does not hold the draws of other pools: a draw
//! waiting for its pool's refill holds no worker slot. Over the wire,
//! through a draw worker.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{pool_toml, TestEnv};
use serde_json::{json, Value};
use tokio::time::Instant;

const T: Duration = Duration::from_secs(60);

/// Twelve draws of a pool that stays short (no refill worker, each asking
/// more than the pool holds) are sent first, eight draws of a stocked pool
/// behind them, to a worker of four slots that lets a short draw wait 6 s.
/// Every stocked draw is answered while the first short ones still wait;
/// every short draw is answered `pool_exhausted`, and none takes a prize.
#[tokio::test]
async fn draws_waiting_for_a_short_pool_leave_the_slots_to_other_pools() {
    let mut env = TestEnv::new(&[("SHORT_POOL_WAIT_MS", "6000"), ("CONCURRENCY", "4")]).await;
    env.load(&pool_toml(
        "short",
        "refill_at = 1.0\nmax_count = 100",
        &[("a", &[(0, 5)])],
    ))
    .await;
    env.load(&pool_toml(
        "stocked",
        "max_count = 100",
        &[("a", &[(0, 500), (1, 500)])],
    ))
    .await;
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let rpc = env.client().await;
    let began = Instant::now();
    let call = |pool: &'static str, i: i64, count: u32, after: Duration| {
        let rpc = &rpc;
        async move {
            tokio::time::sleep(after).await;
            let body = serde_json::to_vec(&json!({
                "type": "draw", "request_id": format!("{pool}-{i}"), "pool": pool, "user_id": i, "count": count,
            }))
            .unwrap();
            let reply: Value =
                serde_json::from_slice(&rpc.request("draw", &body, T).await.unwrap()).unwrap();
            (pool, reply, began.elapsed())
        }
    };
    let calls = (0..12)
        .map(|i| call("short", i, 50, Duration::ZERO))
        .chain((0..8).map(|i| call("stocked", i, 1, Duration::from_millis(300))));
    let answered = futures_util::future::join_all(calls).await;
    let times = |pool: &str| {
        answered
            .iter()
            .filter(|(p, _, _)| *p == pool)
            .map(|(_, _, at)| *at)
            .collect::<Vec<_>>()
    };
    let last_stocked = times("stocked").into_iter().max().unwrap();
    let first_short = times("short").into_iter().min().unwrap();
    eprintln!(
        "last stocked draw answered after {last_stocked:?}, first short one after {first_short:?}"
    );
    for (pool, reply, _) in &answered {
        match *pool {
            "short" => assert_eq!(reply["error"]["code"], "pool_exhausted", "{reply}"),
            _ => assert_eq!(reply["status"], "ok", "{reply}"),
        }
    }
    // Every stocked draw is answered before any short one's wait is over:
    // waiting in their slots, the first four short draws would hold all of
    // them for 6 s.
    assert!(
        last_stocked < first_short,
        "the stocked pool's draws waited behind the short pool's"
    );
    let short = env.status("short").await;
    assert_eq!((short.drawn, short.in_pool), (0, 5), "{short:?}");
    rpc.close().await;
    env.stop_workers().await;
}
