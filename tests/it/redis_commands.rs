//! What each step costs Redis, counted on a private server with `INFO
//! commandstats` (a count, not a time): a later change that adds a command
//! to the path every draw takes fails here.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::BTreeMap, time::Duration};

use common::{free_port, pool_toml, redis_server, tempdir, KillOnDrop, TestEnv};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);

/// A private Redis and a test environment whose workers use it.
async fn private_env() -> (KillOnDrop, TestEnv, redis::aio::MultiplexedConnection) {
    let dir = tempdir("cmds");
    let port = free_port();
    let server = redis_server(port, &dir, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let conn = loop {
        if let Ok(c) = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
        {
            break c;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "private redis did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let env = TestEnv::new(&[("REDIS_URL", &url)]).await;
    (server, env, conn)
}

/// Calls per command since the last reset.
async fn commandstats(conn: &mut redis::aio::MultiplexedConnection) -> BTreeMap<String, u64> {
    prizepool::redis_conn::command_calls(conn)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

async fn reset(conn: &mut redis::aio::MultiplexedConnection) {
    prizepool::redis_conn::reset_stats(conn).await.unwrap();
}

fn draw_as(id: &str, pool: &str, user: i64, count: u32) -> Value {
    json!({"type": "draw", "request_id": id, "pool": pool, "user_id": user, "count": count})
}

/// Claims enough ids that every claim group has opened its epoch, as in a
/// fleet that has run for a while (a group's first claim of an epoch also
/// writes the group's meta hash).
async fn warm_claim_groups(env: &TestEnv) {
    let fp = prizepool::kinds::fingerprint("warm", &[]);
    let ids: Vec<String> = (0..8_000).map(|i| format!("warm-{i}")).collect();
    for chunk in ids.chunks(500) {
        let calls = chunk.iter().map(|id| {
            let mut redis = env.redis.clone();
            let mut tokens =
                prizepool::kinds::Tokens::new(&env.config.redis_prefix, "rq", id, fp, 90_000);
            async move {
                prizepool::kinds::answer::claim(&mut redis, &env.scripts, &mut tokens)
                    .await
                    .unwrap()
            }
        });
        futures_util::future::join_all(calls).await;
    }
}

/// Sends `n` draws one after the other and returns the commands they cost.
async fn count_draws(
    env: &TestEnv,
    conn: &mut redis::aio::MultiplexedConnection,
    tag: &str,
    body: impl Fn(usize) -> Value,
    n: usize,
) -> (u64, BTreeMap<String, u64>) {
    let client = env.client().await;
    // One draw first: the worker loads its scripts and learns the pool.
    let warm = client.call("draw", &body(usize::MAX), T).await.unwrap();
    assert_eq!(warm["status"], "ok", "{tag}: {warm}");
    warm_claim_groups(env).await;
    reset(conn).await;
    for i in 0..n {
        let reply = client.call("draw", &body(i), T).await.unwrap();
        assert!(
            reply["status"] == "ok" || reply["type"] == "draw_result.batch",
            "{tag}: {reply}"
        );
    }
    let stats = commandstats(conn).await;
    (stats.values().sum(), stats)
}

#[tokio::test]
async fn a_lucky_gift_draw_of_ten_costs_at_most_twelve_commands() {
    let (_server, mut env, mut conn) = private_env().await;
    env.load(&pool_toml(
        "cmd",
        "max_count = 100",
        &[("a", &[(0, 4_000), (1, 3_000), (5, 1_000)])],
    ))
    .await;
    env.start_draw_worker().await;
    let n = 50;
    let (total, stats) = count_draws(
        &env,
        &mut conn,
        "single",
        |i| draw_as(&format!("one-{i}"), "cmd", (i % 7) as i64, 10),
        n,
    )
    .await;
    let per = total as f64 / n as f64;
    println!("lucky gift, 10 prizes: {per:.2} commands a draw: {stats:?}");
    // The claim: FCALL, TIME, HMGET of its store's epochs, MGET of its
    // buckets, SET of its bucket. The draw: FCALL, HMGET of the pool's
    // meta (answer store epochs included), MGET of the answer's buckets,
    // LPOP, HSET of meta, SET of the answer's bucket. Now and then a bucket
    // splits (one write in 128).
    assert!(per <= 11.5, "{per:.2} commands a draw: {stats:?}");
    // Two round trips: the claim's script and the draw's.
    assert_eq!(
        stats.get("fcall").copied().unwrap_or(0),
        2 * n as u64,
        "{stats:?}"
    );
    assert_eq!(
        stats.get("lpop").copied().unwrap_or(0),
        n as u64,
        "{stats:?}"
    );
    env.stop_workers().await;
}

#[tokio::test]
async fn a_red_packet_grab_costs_at_most_twelve_commands() {
    let (_server, mut env, mut conn) = private_env().await;
    env.start_fleet().await;
    env.fund(1, 1_000_000).await;
    let client = env.client().await;
    let created = client
        .call(
            "refill",
            &json!({"type": "redpacket.create", "packet_id": "rp-cmd", "sender": 1,
                    "total": 100_000, "count": 1_000, "min": 1, "expires_in_s": 3600}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(created["status"], "ok", "{created}");
    let n = 50;
    let (total, stats) = count_draws(
        &env,
        &mut conn,
        "grab",
        |i| draw_as(&format!("grab-{i}"), "rp-cmd", (i % 10_000) as i64, 1),
        n,
    )
    .await;
    let per = total as f64 / n as f64;
    println!("red-packet grab: {per:.2} commands a grab: {stats:?}");
    // The claim (5) and the grab: FCALL, HMGET of meta (the user's share
    // included), MGET, LPOP, HSET of meta (totals and the user's share),
    // SET of the answer's bucket.
    assert!(per <= 11.5, "{per:.2} commands a grab: {stats:?}");
    assert_eq!(
        stats.get("fcall").copied().unwrap_or(0),
        2 * n as u64,
        "{stats:?}"
    );
    env.stop_workers().await;
}

#[tokio::test]
async fn a_lottery_draw_costs_at_most_twelve_commands() {
    let (_server, mut env, mut conn) = private_env().await;
    let now = chrono::Utc::now();
    env.load_activities(&common::activity_toml(
        "act-cmd",
        now - chrono::Duration::hours(1),
        now + chrono::Duration::hours(1),
        "{ id = \"x\", weight = 1, stock = 1000 }, { id = \"y\", weight = 3, stock = 1000 }",
    ))
    .await;
    env.start_draw_worker().await;
    let client = env.client().await;
    let n = 50;
    for user in 0..n as i64 {
        let g = client
            .call(
                "draw",
                &json!({"type": "lottery.grant", "grant_id": format!("g-{user}"), "activity": "act-cmd", "user_id": user, "chances": 2}),
                T,
            )
            .await
            .unwrap();
        assert_eq!(g["status"], "ok", "{g}");
    }
    let (total, stats) = count_draws(
        &env,
        &mut conn,
        "lottery",
        |i| draw_as(&format!("lot-{i}"), "act-cmd", (i % n) as i64, 1),
        n,
    )
    .await;
    let per = total as f64 / n as f64;
    println!("lottery draw: {per:.2} commands a draw: {stats:?}");
    // The claim (5) and the draw: FCALL, HMGET of meta (the activity, its
    // counts, the day's visits and the user's chances), MGET, PFADD of the
    // day's visitors, HSET of meta, SET of the answer's bucket.
    assert!(per <= 11.5, "{per:.2} commands a draw: {stats:?}");
    assert_eq!(
        stats.get("fcall").copied().unwrap_or(0),
        2 * n as u64,
        "{stats:?}"
    );
    env.stop_workers().await;
}
