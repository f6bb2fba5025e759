//! `prizepool bench` end to end, small, in a test's own vhost, prefix and
//! database: it must run every phase against the real services, write its
//! three reports, and find the ledger equal to the rewards it was told of.
//! Speed is never asserted here (the figures are the bench's output); what is
//! asserted holds on any machine: the run completed, nothing failed, money
//! adds up, and storage stays within its byte budget.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::TestEnv;
use serde_json::Value;
use std::time::{Duration, Instant};

/// `prizepool bench --quick --workers 1 --duration <duration>` in the
/// test's vhost, prefix and database, writing to a fresh folder (returned).
fn bench_command(env: &TestEnv, duration: &str) -> (tokio::process::Command, std::path::PathBuf) {
    let out = std::env::temp_dir().join(format!("pp-bench-{}", ulid::Ulid::new()));
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_prizepool"));
    command
        .kill_on_drop(true)
        .args(["bench", "--quick", "--workers", "1", "--duration", duration])
        // Every measure is taken, on less work than a real run does: these
        // tests check the bench, not the machine. The shortest ceiling pass
        // the bench allows stocks the smallest pools for its passes.
        .args(["--ceiling-pass-ms", "100", "--results", "2000"])
        .arg("--out")
        .arg(&out)
        .envs(env.env())
        .env("RUST_LOG", "warn");
    (command, out)
}

/// Runs `prizepool bench --quick --workers 1 --duration 1 --in-flight 64`
/// with `extra` arguments and returns the JSON report and the folder it was
/// written to.
async fn bench(
    env: &TestEnv,
    extra: &[&str],
    vars: &[(&str, &str)],
) -> (Value, std::path::PathBuf) {
    let (mut command, out) = bench_command(env, "1");
    let output = command
        .args(["--in-flight", "64"])
        .args(extra)
        .envs(vars.iter().copied())
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "bench failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_no_keys_left(env).await;
    let latest = out.join("latest");
    let report: Value =
        serde_json::from_slice(&std::fs::read(latest.join("report.json")).unwrap()).unwrap();
    (report, latest)
}

/// The run removed its Redis keys: nothing is left under the test's prefix
/// but the fleet's ledger seal key, which belongs to the fleet, not the run.
async fn assert_no_keys_left(env: &TestEnv) {
    let mut conn = env.redis.clone();
    let mut left: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*", env.config.redis_prefix))
        .query_async(&mut conn)
        .await
        .unwrap();
    let seal_key = format!("{}:ledger-seal-key", env.config.redis_prefix);
    left.retain(|k| *k != seal_key);
    assert!(
        left.is_empty(),
        "{} keys left, e.g. {:?}",
        left.len(),
        left.first()
    );
}

/// The checks every kind's run must pass.
fn check_run(report: &Value, latest: &std::path::Path) {
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{report:#}");
    let run = &runs[0];
    assert_eq!(run["draw_workers"], 1);
    for phase in ["max", "half"] {
        let load = &run[phase];
        assert!(load["ok"].as_u64().unwrap() > 0, "{phase}: {load}");
        assert_eq!(load["rejected"], 0, "{phase}: {load}");
        assert_eq!(load["failed"], 0, "{phase}: {load}");
        let p = &load["latency"];
        let (p50, p99, max) = (
            p["p50_ms"].as_f64().unwrap(),
            p["p99_ms"].as_f64().unwrap(),
            p["max_ms"].as_f64().unwrap(),
        );
        assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{phase}: {p}");
    }
    assert_eq!(run["ledger_matches"], true, "{run:#}");
    // Every process of the fleet was measured, and the draw worker worked.
    let processes = run["processes"].as_array().unwrap();
    let names: Vec<&str> = processes
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    for name in ["draw-worker", "refill-worker", "settle-worker"] {
        assert!(names.contains(&name), "{names:?}");
    }
    assert!(run["cpu_per_draw_us"].as_f64().unwrap() > 0.0);
    // The CPU budget names the fleet and the load generator, and adds up.
    let budget = &run["cpu_budget"];
    let shares = budget["per_draw_us"].as_array().unwrap();
    let named: Vec<&str> = shares.iter().map(|s| s["name"].as_str().unwrap()).collect();
    for name in ["draw-worker", "settle-worker", "load generator"] {
        assert!(named.contains(&name), "{named:?}");
    }
    let sum: f64 = shares.iter().map(|s| s["us"].as_f64().unwrap()).sum();
    let total = budget["total_us"].as_f64().unwrap();
    assert!(
        total > 0.0 && (sum - total).abs() < 1e-6 * total,
        "{budget}"
    );
    let cores = report["cores"].as_f64().unwrap();
    let allow = budget["cores_allow_per_s"].as_f64().unwrap();
    assert!(
        (allow * total - cores * 1e6).abs() < 1e-6 * cores * 1e6,
        "{budget}"
    );
    assert!(budget["cores_busy"].as_f64().unwrap() > 0.0, "{budget}");
    // The ceilings were measured in the same run.
    let c = &report["ceilings"];
    for ceiling in ["redis_draw", "redis_raw", "redis_trivial", "amqp"] {
        assert!(c[ceiling]["per_s"].as_f64().unwrap() > 0.0, "{c:#}");
    }
    assert!(run["amqp_at_half"]["per_s"].as_f64().unwrap() > 0.0);
    // Memory is a property of the layout, not of the machine's speed.
    let list = report["memory"]["list_bytes_per_prize"].as_f64().unwrap();
    assert!(list > 0.0 && list <= 2.5, "{list} bytes per prize");
    // Both storages are measured whichever the run draws from.
    let sparse = report["memory"]["sparse_bytes_per_nonzero"]
        .as_f64()
        .unwrap();
    assert!(
        sparse > 0.0 && sparse <= 64.0,
        "{sparse} bytes per non-zero prize"
    );
    // A million zero prizes take no entry: what is left is the pool's
    // fixed bookkeeping.
    let zeros = report["memory"]["sparse_bytes_for_zeros"].as_u64().unwrap();
    assert!(zeros < 1_000, "{zeros} bytes for a pool of zeros");

    let md = std::fs::read_to_string(latest.join("report.md")).unwrap();
    assert!(md.contains("### Ratios") && md.contains("| 1 |"), "{md}");
    let svg = std::fs::read_to_string(latest.join("plot.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
}

#[tokio::test]
async fn a_batch_sweep_drives_the_fleet_through_the_batching_client() {
    let env = TestEnv::new(&[]).await;
    let (report, latest) = bench(&env, &["--batch", "1,10", "--users", "300"], &[]).await;
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{report:#}");
    for (run, k) in runs.iter().zip([1, 10]) {
        assert_eq!(run["batch"], k);
        assert_eq!(run["linger_ms"], 2.0);
        for phase in ["max", "half"] {
            assert!(run[phase]["ok"].as_u64().unwrap() > 0, "{run:#}");
            assert_eq!(run[phase]["failed"], 0, "{run:#}");
            assert_eq!(run[phase]["rejected"], 0, "{run:#}");
        }
        // Every answer the client handed out was paid, once.
        assert_eq!(run["ledger_matches"], true, "{run:#}");
        assert!(run["messages_per_s"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(
        runs[0]["draws_per_message"], 1.0,
        "batch 1 sends draws alone"
    );
    let per = runs[1]["draws_per_message"].as_f64().unwrap();
    // 64 draws in flight over two clients: batches of up to 10 fill.
    assert!(per > 2.0 && per <= 10.0, "{per} draws per message");
    let md = std::fs::read_to_string(latest.join("report.md")).unwrap();
    assert!(
        md.contains("### Batched draws") && md.contains("| 1 (batch 10) |"),
        "{md}"
    );
    let svg = std::fs::read_to_string(latest.join("batch.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("batch size"));
}

#[tokio::test]
async fn bench_of_a_sparse_lucky_gift_pool_reports_every_measure() {
    let env = TestEnv::new(&[]).await;
    let (report, latest) = bench(&env, &["--storage", "sparse", "--users", "300"], &[]).await;
    check_run(&report, &latest);
    assert_eq!(report["kind"], "LuckyGift");
    assert_eq!(report["sched_batch"], false);
    let run = &report["runs"][0];
    // Ten prizes a draw.
    assert_eq!(
        run["max"]["prizes_per_s"].as_f64().unwrap().round(),
        (run["max"]["draws_per_s"].as_f64().unwrap() * 10.0).round()
    );
}

#[tokio::test]
async fn bench_of_red_packets_grabs_each_share_once_and_settles_every_grab() {
    let env = TestEnv::new(&[]).await;
    // 5,000 users: one packet holds 5,000 shares, so few packets are made.
    // The fleet inherits the environment: its draw worker runs under SCHED_BATCH.
    let (report, latest) = bench(
        &env,
        &["--kind", "red-packet", "--users", "5000"],
        &[("SCHED_BATCH", "true")],
    )
    .await;
    check_run(&report, &latest);
    assert_eq!(report["kind"], "RedPacket");
    assert_eq!(report["sched_batch"], true);
    assert_eq!(report["draw_events"], "grouped");
    let run = &report["runs"][0];
    // One share a grab; `rejected == 0` above means no user grabbed a packet twice.
    assert_eq!(
        run["max"]["prizes_per_s"].as_f64().unwrap(),
        run["max"]["draws_per_s"].as_f64().unwrap()
    );
    // No packet paid out more shares or more coins than it held, and the
    // ledger credited at least every grab of the full-speed phase (those of
    // the half-rate phase may still be on their way when the fleet stops).
    let packets: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT ref->>'pool', count(*), sum(amount)::bigint FROM ledger_entries \
         WHERE reason = 'red_packet' GROUP BY 1",
    )
    .fetch_all(&env.db)
    .await
    .unwrap();
    assert!(!packets.is_empty());
    for (packet, shares, coins) in &packets {
        assert!(
            *shares <= 5_000 && *coins <= 500_000,
            "{packet}: {shares} shares, {coins} coins"
        );
    }
    let credited: i64 = packets.iter().map(|p| p.1).sum();
    let max_ok = run["max"]["ok"].as_i64().unwrap();
    assert!(credited >= max_ok, "{credited} credits, {max_ok} grabs");
}

const QUEUES: [&str; 3] = [
    prizepool::amqp::DRAW.queue,
    prizepool::amqp::REFILL.queue,
    prizepool::amqp::SETTLE.queue,
];

/// Starts a long `prizepool bench` and returns once its whole fleet consumes.
async fn bench_with_its_fleet_running(env: &TestEnv) -> tokio::process::Child {
    // The queues exist before the bench declares them, for the polls below.
    env.client().await.close().await;
    let (mut command, _) = bench_command(env, "60");
    let mut bench = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let mut consuming = 0;
        for queue in QUEUES {
            consuming += usize::from(env.consumers(queue).await > 0);
        }
        if consuming == QUEUES.len() {
            return bench;
        }
        assert!(
            bench.try_wait().unwrap().is_none(),
            "the bench ended before its fleet started"
        );
        assert!(
            Instant::now() < deadline,
            "the fleet never started consuming"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until no worker consumes any work queue of the test's vhost.
async fn assert_fleet_gone(env: &TestEnv) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut left = Vec::new();
        for queue in QUEUES {
            let n = env.consumers(queue).await;
            if n > 0 {
                left.push((queue, n));
            }
        }
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "workers still consuming after the bench stopped: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// However the bench dies, its fleet goes with it: a worker left behind
/// would keep consuming the draw queue and skew the next run. Here it is
/// killed outright (SIGKILL, no chance to clean up) once its fleet consumes.
#[tokio::test]
async fn a_killed_bench_leaves_no_worker_behind() {
    let env = TestEnv::new(&[]).await;
    let mut bench = bench_with_its_fleet_running(&env).await;
    bench.kill().await.unwrap();
    assert_fleet_gone(&env).await;
}

/// Ctrl-C stops the run: the fleet stops, the run's Redis keys are removed,
/// and the bench says it was interrupted and fails.
#[tokio::test]
async fn an_interrupted_bench_stops_its_fleet_and_removes_its_keys() {
    let env = TestEnv::new(&[]).await;
    let bench = bench_with_its_fleet_running(&env).await;
    let pid = i32::try_from(bench.id().unwrap()).unwrap();
    // SAFETY: a plain system call on the pid of a child not yet reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let output = tokio::time::timeout(Duration::from_secs(60), bench.wait_with_output())
        .await
        .expect("the bench stops within a minute of Ctrl-C")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "{stdout}");
    assert!(stdout.contains("removed the run's"), "{stdout}");
    assert_fleet_gone(&env).await;
    assert_no_keys_left(&env).await;
}
