//! The `prizepool` command line as an operator uses it, and recovery from a
//! Redis connection loss on a throwaway Redis server.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{process::Command, time::Duration};

use common::{draw, free_port, pool_toml, redis_server, KillOnDrop, TestEnv};

#[tokio::test]
async fn pool_load_rejects_a_bad_file_whole_and_status_reports_the_pool() {
    let env = TestEnv::new(&[]).await;
    let dir = std::env::temp_dir().join(format!("pp-{}", ulid::Ulid::new()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = pool_toml("ok-pool", "", &[("c1", &[(0, 90), (5, 10)])]);
    let bad = format!(
        "{good}\n{}",
        pool_toml("bad-pool", "", &[("c9", &[(0, 10)])]).replace("\"0\" = 10", "\"0\" = -4")
    );
    let bad_path = dir.join("bad.toml");
    std::fs::write(&bad_path, &bad).unwrap();
    let out = env.cli(&["pool", "load", bad_path.to_str().unwrap()]).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad-pool") && err.contains("c9") && err.contains("stock.\"0\""),
        "{err}"
    );
    // Nothing changed: the good pool of the same file was not loaded either.
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM pools")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(n, 0);
    let out = env.cli(&["pool", "status", "ok-pool"]).await;
    assert!(!out.status.success());

    let good_path = dir.join("good.toml");
    std::fs::write(&good_path, &good).unwrap();
    let out = env
        .cli(&["pool", "load", good_path.to_str().unwrap()])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("version 1"));
    let out = env
        .cli(&["pool", "load", good_path.to_str().unwrap()])
        .await;
    assert!(String::from_utf8_lossy(&out.stdout).contains("version 2"));
    let out = env.cli(&["pool", "status", "ok-pool", "--json"]).await;
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["stocked"], 100);
    assert_eq!(status["in_pool"], 100);
    assert_eq!(status["generation"], 1);
    assert_eq!(status["version"], 2);
    assert_eq!(status["spent_today"], 0);
}

#[tokio::test]
async fn pool_status_reports_the_memory_of_either_storage() {
    let env = TestEnv::new(&[]).await;
    let combos: &[(&str, &[(u64, u64)])] = &[("c1", &[(0, 9_000), (5, 1_000)])];
    env.load(&pool_toml("in-list", "", combos)).await;
    env.load(&pool_toml("in-sparse", "storage = \"sparse\"", combos))
        .await;
    // The line's byte count, and what follows it.
    let memory = |out: std::process::Output| {
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("memory"))
            .unwrap_or_else(|| panic!("no memory line in:\n{text}"))
            .trim()
            .to_owned();
        let (bytes, rest) = line.split_once(" bytes ").unwrap();
        (bytes.parse::<u64>().unwrap(), rest.to_owned())
    };
    let (list, how) = memory(env.cli(&["pool", "status", "in-list"]).await);
    assert!(how.starts_with("(list)"), "{how}");
    assert!(list > 0 && list as f64 / 10_000.0 <= 2.5, "{list} bytes");
    // Sparse storage keeps only the 1,000 non-zero prizes.
    let (sparse, how) = memory(env.cli(&["pool", "status", "in-sparse"]).await);
    assert_eq!(how, "(sparse)");
    assert!(
        sparse > 0 && sparse as f64 / 1_000.0 <= 64.0,
        "{sparse} bytes"
    );
}

#[tokio::test]
async fn draw_and_balance_commands() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("cli", "", &[("c1", &[(3, 100)])]))
        .await;
    env.start_fleet().await;
    let out = env
        .cli(&["draw", "--pool", "cli", "--user", "5", "--count", "4"])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["reward"], 120);
    assert_eq!(env.wait_ledger("cli", 120).await, 120);
    let out = env.cli(&["balance", "5", "--json"]).await;
    let balances: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        balances,
        serde_json::json!({"account": 5, "balances": [{"asset": "coin", "balance": 120}]})
    );
    env.stop_workers().await;
}

#[tokio::test]
async fn draws_resume_after_redis_drops_every_connection() {
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("pp-redis-{port}"));
    std::fs::create_dir_all(&dir).unwrap();
    let _server = redis_server(port, &dir, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .is_err()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "redis-server did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut env = TestEnv::new(&[("REDIS_URL", &url)]).await;
    env.load(&pool_toml("rr", "", &[("c1", &[(0, 90), (2, 10)])]))
        .await;
    env.start_draw_worker().await;
    let client = env.client().await;
    assert_eq!(
        client
            .call("draw", &draw("rr", 1, 2), Duration::from_secs(10))
            .await
            .unwrap()["status"],
        "ok"
    );
    let mut admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // Drop every client connection, ours included (the admin one comes back too).
    let _: redis::RedisResult<()> = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query_async(&mut admin)
        .await;
    let reply = client
        .call("draw", &draw("rr", 1, 2), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    // The harness's own connection was dropped too; its first command may fail.
    let mut redis = env.redis.clone();
    let _: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut redis).await;
    assert_eq!(env.status("rr").await.drawn, 4);
    env.stop_workers().await;
}

/// GET `path` from `addr` over plain HTTP/1.0; returns (status, body).
async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).await.unwrap();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn a_worker_serves_health_readiness_and_metrics() {
    let env = TestEnv::new(&[]).await;
    env.load(&pool_toml("ops", "", &[("c1", &[(0, 90), (2, 10)])]))
        .await;
    let addr = format!("127.0.0.1:{}", free_port());
    let _worker = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_draw-worker"))
            .envs(env.env())
            .env("METRICS_ADDR", &addr)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Ready once it consumes.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if tokio::net::TcpStream::connect(&addr).await.is_ok()
            && http_get(&addr, "/readyz").await.0 == 200
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "worker never became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(http_get(&addr, "/healthz").await, (200, "ok".to_owned()));
    let client = env.client().await;
    let reply = client
        .call("draw", &draw("ops", 1, 3), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok");
    // The reply leaves before the worker has its confirms and acks, so the
    // counter may trail the reply by a moment.
    let acked = "prizepool_messages_total{worker=\"draw-worker\",queue=\"prizepool.draw\",outcome=\"acked\"} 1";
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let (status, metrics) = http_get(&addr, "/metrics").await;
        assert_eq!(status, 200);
        if metrics.contains(acked) || std::time::Instant::now() > deadline {
            break metrics;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(metrics.contains(acked), "{metrics}");
    assert!(
        metrics.contains("prizepool_prizes_drawn_total{worker=\"draw-worker\"} 3"),
        "{metrics}"
    );
}
