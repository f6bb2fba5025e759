//! What the dashboard and the alert rules query is what the workers export.
//! A fleet of worker binaries with their ops endpoints draws, refills,
//! settles and dead-letters; then every metric named in
//! `deploy/grafana/prizepool-dashboard.json`, `deploy/prometheus/alerts.yml`
//! and `deploy/k8s/alerts.yaml` must be in some worker's `/metrics`, and
//! the latencies must be histograms.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::BTreeSet, time::Duration};

use common::{
    draw, eventually, free_port, pool_toml, spawn_binary_with, wait_exit, KillOnDrop, TestEnv,
};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

/// Metric names a query text mentions.
fn queried(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (i, _) in text
        .match_indices("prizepool_")
        .chain(text.match_indices("process_"))
    {
        // Only whole names: not the tail of another word.
        if text[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        names.insert(name);
    }
    names
}

/// Metric names in a Prometheus exposition, and the `# TYPE` lines.
fn exported(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut names = BTreeSet::new();
    let mut types = BTreeSet::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            types.insert(t.to_owned());
        } else if !line.starts_with('#') && !line.is_empty() {
            names.insert(line.split(['{', ' ']).next().unwrap().to_owned());
        }
    }
    (names, types)
}

/// Every `prizepool_*` family in `text` has a `# HELP` line, and every
/// `prizepool_*` sample carries `worker="<kind>"`.
fn assert_described(text: &str, kind: &str) {
    let helped: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    let label = format!("worker=\"{kind}\"");
    let mut families = 0;
    for line in text.lines().filter(|l| l.starts_with("prizepool_")) {
        let name = line.split(['{', ' ']).next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| helped.contains(f)))
            .unwrap_or(name);
        assert!(helped.contains(family), "{kind}: no HELP for {family}");
        assert!(line.contains(&label), "{kind}: {line}");
        families += 1;
    }
    assert!(families > 5, "{kind} exported {families} prizepool series");
}

/// Every `prizepool_*` name the code uses has its HELP text in
/// `ops::METRIC_HELP`, and nothing there is stale.
#[test]
fn every_metric_the_code_names_has_help_text() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut used = BTreeSet::new();
    let mut dirs = vec![std::path::PathBuf::from(format!("{root}/src"))];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for (i, _) in text.match_indices("\"prizepool_") {
                    let name: String = text[i + 1..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    used.insert(name);
                }
            }
        }
    }
    let described: BTreeSet<String> = prizepool::ops::METRIC_HELP
        .iter()
        .map(|(n, _)| (*n).to_owned())
        .collect();
    assert_eq!(used, described);
}

/// The value of the series `name` (its name and labels, as exported) in
/// the exposition `metrics`.
pub(crate) fn series(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
}

pub(crate) async fn scrape(port: u16) -> String {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let got = async {
            let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            stream
                .write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
                .await?;
            let mut body = String::new();
            stream.read_to_string(&mut body).await?;
            Ok::<_, std::io::Error>(body)
        }
        .await;
        match got {
            Ok(body) if body.starts_with("HTTP/1.0 200") || body.starts_with("HTTP/1.1 200") => {
                return body
            }
            _ => assert!(
                tokio::time::Instant::now() < deadline,
                "no /metrics on {port}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_the_dashboard_and_the_alerts_query_is_exported() {
    let env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "obs",
        "refill_at = 0.5\nmax_count = 50",
        &[("a", &[(0, 30), (2, 10)])],
    ))
    .await;
    let mut workers = Vec::new();
    let mut ports = Vec::new();
    for (name, exe) in [
        ("draw-worker", env!("CARGO_BIN_EXE_draw-worker")),
        ("refill-worker", env!("CARGO_BIN_EXE_refill-worker")),
        ("settle-worker", env!("CARGO_BIN_EXE_settle-worker")),
    ] {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        workers.push(KillOnDrop(spawn_binary_with(
            &env,
            name,
            exe,
            &[("METRICS_ADDR", &addr)],
        )));
        ports.push(port);
    }
    let client = env.client().await;
    // Draws that drain batches (refills), a refusal, settlements, a dead letter.
    for user in 0..30 {
        let reply = client.call("draw", &draw("obs", user, 5), T).await.unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
    }
    let refused = client
        .call("draw", &draw("nowhere", 1, 1), T)
        .await
        .unwrap();
    assert_eq!(refused["error"]["code"], "unknown_pool");
    let topup = json!({"type": "settle", "entry_id": "obs-1", "account": 3, "asset": "coin",
                       "amount": 10, "reason": "topup"});
    assert_eq!(
        client.call("settle", &topup, T).await.unwrap()["status"],
        "ok"
    );
    let bad = client
        .call_raw("draw", b"{\"type\":\"draw\"}", T)
        .await
        .unwrap();
    assert_eq!(bad["error"]["code"], "invalid_request");
    let bad_settle = client
        .call_raw("settle", b"{\"type\":\"settle\"}", T)
        .await
        .unwrap();
    assert_eq!(bad_settle["error"]["code"], "invalid_request");
    // The refill worker reads queue depths every few seconds: scrape until
    // every queried series is there, or the deadline.
    let root = env!("CARGO_MANIFEST_DIR");
    let deadline = tokio::time::Instant::now() + T;
    let (names, types, missing) = loop {
        let mut names = BTreeSet::new();
        let mut types = BTreeSet::new();
        for port in &ports {
            let (n, t) = exported(&scrape(*port).await);
            names.extend(n);
            types.extend(t);
        }
        let mut missing = Vec::new();
        for file in [
            "deploy/grafana/prizepool-dashboard.json",
            "deploy/prometheus/alerts.yml",
            "deploy/k8s/alerts.yaml",
        ] {
            let text = std::fs::read_to_string(format!("{root}/{file}")).unwrap();
            let wanted = queried(&text);
            assert!(!wanted.is_empty(), "{file} queries nothing");
            missing.extend(
                wanted
                    .into_iter()
                    .filter(|n| !names.contains(n))
                    .map(|n| format!("{file}: {n}")),
            );
        }
        if missing.is_empty() || tokio::time::Instant::now() > deadline {
            break (names, types, missing);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}; exported: {names:?}"
    );
    // Per-pool counters: the 30 draws of 5 prizes on "obs", and what they
    // paid, which the ledger books for the pool.
    let draw_metrics = scrape(ports[0]).await;
    let value = |name: &str| -> f64 {
        series(&draw_metrics, name).unwrap_or_else(|| panic!("no {name} in\n{draw_metrics}"))
    };
    let labels = r#"{worker="draw-worker",pool="obs"}"#;
    assert_eq!(value(&format!("prizepool_pool_draws_total{labels}")), 30.0);
    assert_eq!(
        value(&format!("prizepool_pool_prizes_drawn_total{labels}")),
        150.0
    );
    let paid = value(r#"prizepool_pool_paid_total{worker="draw-worker",pool="obs",asset="coin"}"#);
    assert_eq!(env.wait_ledger("obs", paid as i64).await as f64, paid);
    // The settle queue is counted like the others: its deliveries by
    // outcome and their handling time, per queue (the top-up and the
    // draws' settle.batch messages acked; the bad settle dead-lettered).
    let settle_series = [
        (
            r#"prizepool_messages_total{worker="settle-worker",queue="prizepool.settle",outcome="acked"}"#,
            2.0,
        ),
        (
            r#"prizepool_messages_total{worker="settle-worker",queue="prizepool.settle",outcome="dead_lettered"}"#,
            1.0,
        ),
        (
            r#"prizepool_handle_seconds_count{worker="settle-worker",queue="prizepool.settle"}"#,
            3.0,
        ),
    ];
    eventually(T, || async {
        let settle_metrics = scrape(ports[2]).await;
        let counted = |name: &str| series(&settle_metrics, name).unwrap_or(0.0);
        match settle_series.iter().all(|(s, at_least)| counted(s) >= *at_least) {
            true => Ok(()),
            false => Err(format!(
                "the settle worker does not count its queue's deliveries: {settle_series:?} in\n{settle_metrics}"
            )),
        }
    })
    .await;
    // Each pool's stock and batches, read by the refill worker, agree with
    // the pool's own counters (read again each time: a refill may still run).
    let redis = env.redis.clone();
    eventually(T, || async {
        let mut redis = redis.clone();
        let pool = prizepool::pools::status(&mut redis, &env.config.redis_prefix, "obs")
            .await
            .unwrap()
            .unwrap()
            .total;
        let want = [
            (
                r#"prizepool_pool_stock{worker="refill-worker",pool="obs"}"#,
                pool.in_pool as f64,
            ),
            (
                r#"prizepool_pool_batches{worker="refill-worker",pool="obs"}"#,
                pool.generation as f64,
            ),
        ];
        let refill_metrics = scrape(ports[1]).await;
        match pool.generation >= 1
            && want
                .iter()
                .all(|(s, v)| series(&refill_metrics, s) == Some(*v))
        {
            true => Ok(()),
            false => Err(format!("no per-pool stock {want:?} in\n{refill_metrics}")),
        }
    })
    .await;
    // Every prizepool_* family a worker exports has HELP text, and every
    // series names the worker kind.
    for (port, kind) in ports
        .iter()
        .zip(["draw-worker", "refill-worker", "settle-worker"])
    {
        let text = scrape(*port).await;
        assert_described(&text, kind);
        // The process metrics the dashboard shows per worker kind name it too.
        let label = format!("worker=\"{kind}\"");
        for family in ["process_cpu_seconds_total", "process_resident_memory_bytes"] {
            let line = text
                .lines()
                .find(|l| l.starts_with(family))
                .unwrap_or_else(|| panic!("{kind}: no {family}"));
            assert!(line.contains(&label), "{kind}: {line}");
        }
    }
    for histogram in [
        "prizepool_handle_seconds",
        "prizepool_refill_seconds",
        "prizepool_settle_commit_seconds",
    ] {
        assert!(
            types.contains(&format!("{histogram} histogram")),
            "{histogram} is not a histogram: {types:?}"
        );
    }
    // Both rule files hold the same expressions.
    let exprs = |file: &str| -> Vec<String> {
        std::fs::read_to_string(format!("{root}/{file}"))
            .unwrap()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("expr: ").map(str::to_owned))
            .collect()
    };
    assert_eq!(
        exprs("deploy/prometheus/alerts.yml"),
        exprs("deploy/k8s/alerts.yaml")
    );
    for w in &workers {
        std::process::Command::new("kill")
            .args(["-TERM", &w.0.id().to_string()])
            .status()
            .unwrap();
    }
    for w in &mut workers {
        assert!(wait_exit(&mut w.0, T).await.success());
    }
}
