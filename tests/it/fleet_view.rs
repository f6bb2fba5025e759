//! `prizepool status`: one view of the fleet, as an operator reads it while
//! things go wrong: a worker kind that is not running, dead letters that
//! arrive, a pool that runs short, a ledger that stalls, a Postgres that is
//! away, and draw shards.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{draw, pool_toml, TestEnv};
use prizepool::amqp;
use serde_json::Value;
use tokio::io::AsyncBufReadExt;

const T: Duration = Duration::from_secs(20);

async fn status(env: &TestEnv, args: &[&str]) -> (Option<i32>, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_prizepool"))
        .arg("status")
        .args(args)
        .envs(env.env())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn status_json(env: &TestEnv) -> Value {
    let (code, stdout, stderr) = status(env, &["--json"]).await;
    assert_eq!(code, Some(0), "{stderr}");
    let v: Value = serde_json::from_str(&stdout).unwrap();
    assert!(v.is_object(), "{v}");
    v
}

/// The problems of a status, as (kind, subject).
fn problems(v: &Value) -> Vec<(String, String)> {
    v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["kind"].as_str().unwrap().to_owned(),
                p["subject"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn has(v: &Value, kind: &str, subject: &str) -> bool {
    problems(v).contains(&(kind.to_owned(), subject.to_owned()))
}

fn queue<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["queue"] == name)
        .unwrap()
}

#[tokio::test]
async fn status_shows_queues_pools_payouts_and_what_looks_wrong() {
    let mut env = TestEnv::new(&[]).await;
    // Every prize pays 3 x 10 coins; max_count 5 of a 10-prize batch.
    env.load(&pool_toml("view", "max_count = 5", &[("c1", &[(3, 10)])]))
        .await;
    // No refill worker: its queue has no consumer and the pool runs short.
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;
    for user in 0..2 {
        let reply = client
            .call("draw", &draw("view", user, 3), T)
            .await
            .unwrap();
        assert_eq!(reply["reward"], 90, "{reply}");
    }
    assert_eq!(env.wait_ledger("view", 180).await, 180);
    let bad = client
        .call_raw("draw", b"{\"type\":\"draw\"}", T)
        .await
        .unwrap();
    assert_eq!(bad["error"]["code"], "invalid_request");
    env.wait_depth(amqp::DRAW.dlq, 1).await;

    let v = status_json(&env).await;
    assert!(
        queue(&v, "prizepool.draw")["consumers"].as_u64().unwrap() >= 1,
        "{v}"
    );
    assert_eq!(queue(&v, "prizepool.refill")["consumers"], 0, "{v}");
    assert_eq!(queue(&v, "prizepool.draw")["dlq_messages"], 1, "{v}");
    let pool = &v["pools"][0];
    assert_eq!(
        (&pool["pool"], &pool["prizes_drawn"], &pool["in_pool"]),
        (&Value::from("view"), &Value::from(6), &Value::from(4))
    );
    assert_eq!(pool["batches"], 1);
    assert_eq!(pool["payouts"][0]["asset"], "coin");
    assert_eq!(
        (
            &pool["payouts"][0]["amount"],
            &pool["payouts"][0]["entries"]
        ),
        (&Value::from(180), &Value::from(2))
    );
    assert!(has(&v, "no_consumers", "prizepool.refill"), "{v}");
    assert!(!has(&v, "no_consumers", "prizepool.draw"), "{v}");
    assert!(has(&v, "dead_letters", "prizepool.draw.dlq"), "{v}");
    assert!(has(&v, "pool_short", "view"), "{v}");
    assert_eq!(v["settle"]["lag_seconds"], 0, "{v}");
    let (code, text, _) = status(&env, &[]).await;
    assert_eq!(code, Some(0));
    assert!(
        text.contains("WRONG no_consumers prizepool.refill"),
        "{text}"
    );
    assert!(text.contains("WRONG pool_short view"), "{text}");

    // --watch prints again and flags a dead-letter queue that grew.
    let mut watch = tokio::process::Command::new(env!("CARGO_BIN_EXE_prizepool"))
        .args(["status", "--json", "--watch", "1"])
        .envs(env.env())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
    assert!(!has(&first, "dlq_growing", "prizepool.draw.dlq"), "{first}");
    client.call_raw("draw", b"[]", T).await.unwrap();
    env.wait_depth(amqp::DRAW.dlq, 2).await;
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let line = tokio::time::timeout_at(deadline, lines.next_line())
            .await
            .expect("--watch printed no status flagging the growing DLQ")
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        if has(&v, "dlq_growing", "prizepool.draw.dlq") {
            break;
        }
    }
    watch.kill().await.unwrap();

    // A ledger stall: the settle worker stops, settlements queue up, and the
    // ledger's last entry is two minutes old.
    client.close().await;
    env.stop_workers().await;
    let mut draws_only = env.sharing(|_| {});
    draws_only.start_draw_worker().await;
    let client = draws_only.client().await;
    let reply = client.call("draw", &draw("view", 9, 2), T).await.unwrap();
    assert_eq!(reply["reward"], 60, "{reply}");
    env.wait_depth(amqp::SETTLE.queue, 1).await;
    sqlx::query("UPDATE ledger_entries SET created_at = now() - interval '2 minutes'")
        .execute(&env.db)
        .await
        .unwrap();
    let v = status_json(&env).await;
    assert!(v["settle"]["queued"].as_u64().unwrap() >= 1, "{v}");
    assert!(v["settle"]["lag_seconds"].as_i64().unwrap() >= 120, "{v}");
    assert!(has(&v, "settle_lagging", "prizepool.settle"), "{v}");
    assert!(has(&v, "no_consumers", "prizepool.settle"), "{v}");
    client.close().await;
    draws_only.stop_workers().await;
}

/// With `DRAW_SHARDS` > 1 every draw shard is a queue of its own: status
/// lists each, flags one nobody consumes, and judges the dead-letter queue
/// they share once.
#[tokio::test]
async fn status_sees_every_draw_shard() {
    let mut env = TestEnv::new(&[("DRAW_SHARDS", "2")]).await;
    let shards = |env: &TestEnv| {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_prizepool"));
        cmd.args(["status", "--json"])
            .envs(env.env())
            .env("DRAW_SHARDS", "2")
            .env("RUST_LOG", "warn");
        cmd
    };
    let run = |mut cmd: tokio::process::Command| async move {
        let out = cmd.output().await.unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v
    };
    // Before any worker: every queue is missing, which the report says, and
    // nothing else is printed (no log line per probe the broker refused).
    let mut quiet = shards(&env);
    quiet.env_remove("RUST_LOG");
    let out = quiet.output().await.unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(has(&v, "queue_missing", "prizepool.draw.1"), "{v}");
    env.start_draw_worker().await;
    let client = env.client().await;
    let bad = client.call_raw("draw", b"[]", T).await.unwrap();
    assert_eq!(bad["error"]["code"], "invalid_request");
    env.wait_depth(amqp::DRAW.dlq, 1).await;

    let v = run(shards(&env)).await;
    for shard in ["prizepool.draw", "prizepool.draw.1"] {
        assert!(queue(&v, shard)["consumers"].as_u64().unwrap() >= 1, "{v}");
        assert!(!has(&v, "no_consumers", shard), "{v}");
    }
    assert_eq!(queue(&v, "prizepool.draw.1")["dlq"], "prizepool.draw.dlq");
    let dead = problems(&v)
        .into_iter()
        .filter(|p| p == &("dead_letters".to_owned(), "prizepool.draw.dlq".to_owned()))
        .count();
    assert_eq!(dead, 1, "{v}");

    client.close().await;
    env.stop_workers().await;
    let v = run(shards(&env)).await;
    assert!(has(&v, "no_consumers", "prizepool.draw.1"), "{v}");
    assert!(has(&v, "no_consumers", "prizepool.draw"), "{v}");
}

/// A ledger stall because Postgres is away: the status still shows the
/// queues, and says what is wrong instead of failing; once Postgres is
/// back the status reads the pools again.
#[tokio::test]
async fn status_reports_a_postgres_that_is_away() {
    let pg = common::PrivatePostgres::init();
    pg.start();
    let url = pg.url();
    let mut env = TestEnv::new(&[("DATABASE_URL", &url)]).await;
    env.load(&pool_toml("away", "max_count = 5", &[("c1", &[(3, 10)])]))
        .await;
    env.start_draw_worker().await;
    pg.stop();
    let v = status_json(&env).await;
    assert!(has(&v, "postgres_unreachable", "postgres"), "{v}");
    assert!(
        queue(&v, "prizepool.draw")["consumers"].as_u64().unwrap() >= 1,
        "{v}"
    );
    assert!(has(&v, "no_consumers", "prizepool.settle"), "{v}");
    assert_eq!(v["settle"]["lag_seconds"], Value::Null, "{v}");
    let (code, text, _) = status(&env, &[]).await;
    assert_eq!(code, Some(0));
    assert!(
        text.contains("WRONG postgres_unreachable postgres"),
        "{text}"
    );
    pg.start();
    let v = status_json(&env).await;
    assert!(!has(&v, "postgres_unreachable", "postgres"), "{v}");
    assert_eq!(v["pools"][0]["pool"], "away", "{v}");
    env.stop_workers().await;
}

/// A pool stocked as sub-pools: a draw takes its prizes from one of them,
/// so a sub-pool short alone is flagged even while the whole pool holds
/// more than `max_count`.
#[tokio::test]
async fn status_flags_a_short_sub_pool() {
    let mut env = TestEnv::new(&[]).await;
    // Two sub-pools of 10 prizes each; max_count 5.
    env.load(&pool_toml(
        "split",
        "shards = 2\nmax_count = 5",
        &[("c1", &[(3, 10)])],
    ))
    .await;
    env.start_draw_worker().await;
    let client = env.client().await;
    // User 0 draws from sub-pool 0 only (user_id mod 2), and no refill
    // worker runs: 4 prizes left there, 10 in the other.
    for _ in 0..2 {
        let reply = client.call("draw", &draw("split", 0, 3), T).await.unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
    }
    let v = status_json(&env).await;
    let pool = &v["pools"][0];
    assert_eq!(
        (&pool["pool"], &pool["in_pool"]),
        (&Value::from("split"), &Value::from(14)),
        "{v}"
    );
    assert_eq!(pool["sub_pools"][0]["pool"], "split~0", "{v}");
    assert_eq!(pool["sub_pools"][0]["in_pool"], 4, "{v}");
    assert!(has(&v, "pool_short", "split~0"), "{v}");
    assert!(!has(&v, "pool_short", "split~1"), "{v}");
    assert!(!has(&v, "pool_short", "split"), "{v}");
    client.close().await;
    env.stop_workers().await;
}
