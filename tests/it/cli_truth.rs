//! The `prizepool` command line tells the truth: an audit of a pool that
//! does not exist fails, a rejected or unanswered draw is no success, a
//! TOML error says where it is, a missing demo pool file is an error, and
//! every `--json` output is an object with named fields.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{activity_toml, pool_toml, TestEnv};
use prizepool::amqp;
use serde_json::Value;

fn text(out: &std::process::Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Fails when `v` holds a positional tuple: an array of arrays, or an
/// array whose elements are not all of one JSON kind.
fn assert_named(v: &Value, path: &str) {
    match v {
        Value::Array(items) => {
            let kind = |x: &Value| std::mem::discriminant(x);
            if let Some(first) = items.first() {
                assert!(
                    !first.is_array()
                        && items.iter().all(|x| kind(x) == kind(first) || x.is_null()),
                    "{path} is a positional tuple: {v}"
                );
            }
            for (i, x) in items.iter().enumerate() {
                assert_named(x, &format!("{path}[{i}]"));
            }
        }
        Value::Object(fields) => {
            for (k, x) in fields {
                assert_named(x, &format!("{path}.{k}"));
            }
        }
        _ => {}
    }
}

/// Runs a `--json` command and checks it printed one object of named fields.
async fn json_object(env: &TestEnv, args: &[&str]) -> Value {
    let out = env.cli(args).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{args:?}: {stderr}");
    let v: Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"));
    assert!(v.is_object(), "{args:?} printed {v}");
    assert_named(&v, &args.join(" "));
    v
}

#[tokio::test]
async fn auditing_a_pool_that_does_not_exist_fails() {
    let env = TestEnv::new(&[]).await;
    let out = env.cli(&["audit", "verify", "no-such-pool"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("no pool named no-such-pool"), "{stderr}");
    assert!(!stdout.contains("verdict: ok"), "{stdout}");
    let out = env
        .cli(&["audit", "verify", "no-such-pool", "--json"])
        .await;
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&v["ok"], &v["error"]),
        (&Value::Bool(false), &Value::from("unknown_pool"))
    );
    // A pool that exists is verified as before: its first batch is
    // committed and still secret, which is no mismatch.
    env.load(&pool_toml("known", "", &[("c1", &[(0, 9), (2, 1)])]))
        .await;
    let out = env.cli(&["audit", "verify", "known"]).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("batch 1: unrevealed"), "{stdout}");
}

#[tokio::test]
async fn a_rejected_draw_fails_and_an_unanswered_one_names_its_queued_request() {
    let mut env = TestEnv::new(&[]).await;
    // No worker: the request is taken by the broker and waits.
    let out = env
        .cli(&[
            "draw",
            "--pool",
            "nowhere",
            "--user",
            "1",
            "--request-id",
            "wait-1",
            "--timeout",
            "1",
            "--retries",
            "0",
        ])
        .await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(3), "{stdout}{stderr}");
    assert!(
        stderr.contains("wait-1") && stderr.contains("stays queued"),
        "{stderr}"
    );
    let v: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (&v["request_id"], &v["status"]),
        (&Value::from("wait-1"), &Value::from("no_reply"))
    );
    assert_eq!(
        env.queue_depth(amqp::DRAW.queue).await,
        1,
        "the request is queued"
    );

    // Once a worker runs, it answers the queued request; asking again with
    // the same id reads that answer: a rejection, which exits 1.
    env.start_draw_worker().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while env.queue_depth(amqp::DRAW.queue).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the queued draw was never taken"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = env
        .cli(&[
            "draw",
            "--pool",
            "nowhere",
            "--user",
            "1",
            "--request-id",
            "wait-1",
        ])
        .await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    let reply: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(reply["status"], "rejected");
    assert_eq!(reply["error"]["code"], "unknown_pool");
    assert!(stderr.contains("rejected: unknown_pool"), "{stderr}");
    env.stop_workers().await;
}

#[tokio::test]
async fn toml_errors_keep_their_line_and_column_and_a_missing_demo_file_is_an_error() {
    let env = TestEnv::new(&[]).await;
    let dir = common::tempdir("cli-truth");
    let pools = dir.join("pools.toml");
    let good = pool_toml("p1", "", &[("c1", &[(0, 9), (2, 1)])]);
    // Line 4 of the file: `unit_price = "ten"`, the value at column 14.
    std::fs::write(
        &pools,
        good.replace("unit_price = 10", "unit_price = \"ten\""),
    )
    .unwrap();
    assert_eq!(good.lines().nth(3), Some("unit_price = 10"));
    let out = env.cli(&["pool", "load", pools.to_str().unwrap()]).await;
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("line 4, column 14"), "{stderr}");
    // A syntax error too.
    std::fs::write(&pools, format!("{good}\n[[pools]\n")).unwrap();
    let out = env.cli(&["pool", "load", pools.to_str().unwrap()]).await;
    let (_, stderr) = text(&out);
    let line = good.lines().count() + 2;
    assert!(stderr.contains(&format!("line {line}, column")), "{stderr}");
    // Activities alike.
    let now = chrono::Utc::now();
    let activity = activity_toml(
        "act",
        now,
        now + chrono::Duration::days(1),
        "{ id = \"a\", weight = 1, stock = 5 }",
    );
    let bad = activity.replace("strategy = \"wheel\"", "strategy = 7");
    let line = bad.lines().position(|l| l.starts_with("strategy")).unwrap() + 1;
    let acts = dir.join("activities.toml");
    std::fs::write(&acts, bad).unwrap();
    let out = env.cli(&["activity", "load", acts.to_str().unwrap()]).await;
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("line {line}, column 12")),
        "{stderr}"
    );

    let missing = dir.join("no-such-pools.toml");
    let out = env
        .cli(&["demo", "--pool-file", missing.to_str().unwrap()])
        .await;
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("no-such-pools.toml"), "{stderr}");
}

#[tokio::test]
async fn every_json_output_is_an_object_with_named_fields() {
    let env = TestEnv::new(&[]).await;
    env.load(&pool_toml("named", "", &[("c1", &[(0, 9), (2, 1)])]))
        .await;
    let now = chrono::Utc::now();
    env.load_activities(&activity_toml(
        "named-act",
        now - chrono::Duration::hours(1),
        now + chrono::Duration::days(1),
        "{ id = \"a\", weight = 1, stock = 5 }",
    ))
    .await;
    let status = json_object(&env, &["pool", "status", "named", "--json"]).await;
    assert_eq!(status["fairness"]["committed"][0]["generation"], 1);
    assert_eq!(
        status["fairness"]["committed"][0]["commitment"]
            .as_str()
            .unwrap()
            .len(),
        64
    );
    let stats = json_object(&env, &["activity", "stats", "named-act", "--json"]).await;
    assert_eq!(stats["prizes"][0]["prize"], "a");
    assert_eq!(stats["prizes"][0]["stock_left"], 5);
    json_object(&env, &["balance", "7", "--json"]).await;
    json_object(&env, &["audit", "verify", "named", "--json"]).await;
    // A pool stocked as sub-pools prints its total and each sub-pool, named.
    env.load(&pool_toml(
        "named-sh",
        "shards = 2",
        &[("c1", &[(0, 9), (2, 1)])],
    ))
    .await;
    let sharded = json_object(&env, &["pool", "status", "named-sh", "--json"]).await;
    assert_eq!(sharded["shards"].as_array().unwrap().len(), 2, "{sharded}");
    json_object(&env, &["audit", "verify", "named-sh", "--json"]).await;
    // The queues exist once a client declared them.
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    amqp::declare_topology(
        &conn.create_channel().await.unwrap(),
        env.config.delivery_limit,
    )
    .await
    .unwrap();
    json_object(&env, &["dlq", "list", "prizepool.draw", "--json"]).await;
    let status = json_object(&env, &["status", "--json"]).await;
    assert!(status["queues"][0]["queue"].is_string(), "{status}");
    assert_eq!(status["pools"][0]["pool"], "named", "{status}");
    json_object(
        &env,
        &["dlq", "replay", "prizepool.draw", "--dry-run", "--json"],
    )
    .await;
    json_object(
        &env,
        &[
            "dlq",
            "drop",
            "prizepool.draw",
            "--all",
            "--dry-run",
            "--json",
        ],
    )
    .await;
}
