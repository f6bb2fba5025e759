//! `prizepool pool analyze` against what a pool really pays: whole batches
//! drawn over the wire pay exactly the analysed total, with the analysed
//! hit rate and distribution; `pool load` enforces `max_rtp` and asks for
//! `--accept-rtp-change` before a version that returns more.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::BTreeMap, time::Duration};

use common::{pool_toml, TestEnv};
use prizepool::kinds::lucky_gift::{self, economics};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

const COMBOS: &[(&str, &[(u64, u64)])] = &[
    ("c1", &[(0, 700), (1, 150), (5, 40), (50, 9), (500, 1)]),
    ("c2", &[(0, 80), (2, 15), (20, 5)]),
];

/// Two whole batches (2 × 1,000 prizes) drawn in draws of 1 to 100 prizes:
/// the prizes drawn are exactly twice the batch's distribution, so the
/// realised multiplier total, hit rate and RTP are the analysis's, and the
/// ledger holds the reward the analysis gives for two batches.
#[tokio::test]
async fn whole_batches_pay_exactly_what_the_analysis_says() {
    let mut env = TestEnv::new(&[]).await;
    let file = pool_toml("econ", "max_count = 100\nrefill_at = 0.5", COMBOS);
    let config = lucky_gift::parse_file(&file).unwrap().remove(0);
    let analysis = economics::analyze(&config);
    assert_eq!(analysis.batch.prizes, 1000);
    env.load(&file).await;
    env.start_fleet().await;
    let rpc = env.client().await;

    let mut drawn: BTreeMap<u64, u64> = BTreeMap::new();
    let mut rewarded = 0;
    let mut left = 2 * analysis.batch.prizes;
    let mut i = 0u32;
    while left > 0 {
        let count = u64::from(i % 100 + 1).min(left);
        i += 1;
        let reply: Value = rpc
            .call("draw", &common::draw("econ", i64::from(i), count as u32), T)
            .await
            .unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
        for prize in reply["prizes"].as_array().unwrap() {
            *drawn
                .entry(prize["multiplier"].as_u64().unwrap())
                .or_default() += 1;
        }
        rewarded += reply["reward"].as_i64().unwrap();
        left -= count;
    }
    let expected: BTreeMap<u64, u64> = analysis
        .batch
        .distribution
        .iter()
        .map(|s| (s.multiplier, 2 * s.count))
        .collect();
    assert_eq!(drawn, expected, "two batches, prize for prize");
    let total: u64 = drawn.iter().map(|(m, n)| m * n).sum();
    assert_eq!(total, 2 * analysis.batch.multiplier_total);
    let prizes: u64 = drawn.values().sum();
    let hits: u64 = drawn.iter().filter(|(m, _)| **m > 0).map(|(_, n)| n).sum();
    assert_eq!(hits as f64 / prizes as f64, analysis.batch.hit_rate);
    assert_eq!(total as f64 / prizes as f64, analysis.batch.rtp);
    assert_eq!(i128::from(rewarded), 2 * analysis.batch_total);
    assert_eq!(env.wait_ledger("econ", rewarded).await, rewarded);
    rpc.close().await;
    env.stop_workers().await;
}

/// `pool analyze` runs without any server and prints the figures; `pool
/// load` refuses a pool above its `max_rtp`, and a version that returns
/// more than the last one unless `--accept-rtp-change` is given.
#[tokio::test]
async fn pool_load_guards_the_return_to_player() {
    let env = TestEnv::new(&[]).await;
    let dir = common::tempdir("economics");
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let base = pool_toml("guarded", "max_count = 100", COMBOS);
    let first = write("first.toml", &base);
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_prizepool"))
        .args(["pool", "analyze", &first, "--json"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap())
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let figures: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rtp = figures[0]["batch"]["rtp"].as_f64().unwrap();
    assert_eq!(rtp, (150.0 + 200.0 + 450.0 + 500.0 + 30.0 + 100.0) / 1000.0);

    let loaded = env.cli(&["pool", "load", &first]).await;
    assert!(
        loaded.status.success(),
        "{}",
        String::from_utf8_lossy(&loaded.stderr)
    );
    // A misplaced zero: the 500× prize ten times over.
    let typo = base.replace("\"500\" = 1", "\"500\" = 10");
    let raised = write("raised.toml", &typo);
    let refused = env.cli(&["pool", "load", &raised]).await;
    assert!(!refused.status.success());
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("--accept-rtp-change"), "{why}");
    let accepted = env
        .cli(&["pool", "load", &raised, "--accept-rtp-change"])
        .await;
    assert!(
        accepted.status.success(),
        "{}",
        String::from_utf8_lossy(&accepted.stderr)
    );
    // Lower again: no flag needed.
    let back = env.cli(&["pool", "load", &first]).await;
    assert!(
        back.status.success(),
        "{}",
        String::from_utf8_lossy(&back.stderr)
    );
    // A declared bound refuses the file itself, naming the combo.
    let bounded = write(
        "bounded.toml",
        &typo.replace("max_count = 100", "max_count = 100\nmax_rtp = 1.5"),
    );
    let refused = env.cli(&["pool", "load", &bounded]).await;
    assert!(!refused.status.success());
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("max_rtp") && why.contains("\"c1\""), "{why}");
}

/// Draws `prizes` prizes from pool `pool` in draws of 1 to 100 (each a first
/// answer), adding each prize's multiplier to the batch it came from (the
/// reply's runs of positions name it, in the order of the prizes).
async fn draw_by_batch(
    rpc: &prizepool::amqp::rpc::RpcClient,
    pool: &str,
    prizes: u64,
    by_batch: &mut BTreeMap<u64, (u64, u64)>,
    replies: &mut Vec<(Value, Value)>,
) {
    let mut left = prizes;
    let mut i = replies.len() as u64;
    while left > 0 {
        let count = (i % 100 + 1).min(left);
        i += 1;
        let request = common::draw(pool, i as i64, count as u32);
        let reply: Value = rpc.call("draw", &request, T).await.unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
        let prizes = reply["prizes"].as_array().unwrap();
        let mut origins = Vec::new();
        for run in reply["positions"].as_array().unwrap() {
            for _ in 0..run["count"].as_u64().unwrap() {
                origins.push(run["generation"].as_u64().unwrap());
            }
        }
        assert_eq!(origins.len(), prizes.len(), "{reply}");
        for (prize, g) in prizes.iter().zip(origins) {
            let tally = by_batch.entry(g).or_default();
            tally.0 += 1;
            tally.1 += prize["multiplier"].as_u64().unwrap();
        }
        replies.push((request, reply));
        left -= count;
    }
}

/// Issue 39: realised against configured RTP while a pool runs. A fleet
/// with its ops endpoints draws two and a half batches: `prizepool status`
/// and the refill worker's gauges show two completed batches paying
/// exactly the configured RTP and the batch in progress with what its
/// prizes paid so far (checked prize by prize against the replies), the
/// draw worker counts every prize and multiplier paid once (a replay adds
/// nothing). Then one prize of the batch in progress is tampered with in
/// Redis (a 0x made a 500x): once that batch completes, status, the gauges
/// and the alert's expression all show the departure, of exactly 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_metrics_show_realised_against_configured_rtp() {
    use crate::observability::{scrape, series};
    let env = TestEnv::new(&[]).await;
    let file = pool_toml("rtp", "max_count = 100\nrefill_at = 0.5", COMBOS);
    let config = lucky_gift::parse_file(&file).unwrap().remove(0);
    let batch = economics::analyze(&config).batch;
    env.load(&file).await;
    let mut workers = Vec::new();
    let mut ports = Vec::new();
    for (name, exe) in [
        ("draw-worker", env!("CARGO_BIN_EXE_draw-worker")),
        ("refill-worker", env!("CARGO_BIN_EXE_refill-worker")),
        ("settle-worker", env!("CARGO_BIN_EXE_settle-worker")),
    ] {
        let port = common::free_port();
        let addr = format!("127.0.0.1:{port}");
        workers.push(common::KillOnDrop(common::spawn_binary_with(
            &env,
            name,
            exe,
            &[("METRICS_ADDR", &addr)],
        )));
        ports.push(port);
    }
    let rpc = env.client().await;
    let mut by_batch = BTreeMap::new();
    let mut replies = Vec::new();
    draw_by_batch(&rpc, "rtp", 2500, &mut by_batch, &mut replies).await;
    // Batches 1 and 2 whole, 500 prizes of batch 3.
    assert_eq!(
        by_batch.iter().map(|(g, t)| (*g, t.0)).collect::<Vec<_>>(),
        [(1, 1000), (2, 1000), (3, 500)]
    );
    for g in [1, 2] {
        assert_eq!(by_batch[&g].1, batch.multiplier_total, "batch {g}");
    }
    let open = by_batch[&3];
    // A replay pays nothing new and counts nothing.
    let (request, first) = &replies[0];
    let again: Value = rpc.call("draw", request, T).await.unwrap();
    assert_eq!(again["serial"], first["serial"]);
    let paid: u64 = replies
        .iter()
        .map(|(_, r)| r["total_multiplier"].as_u64().unwrap())
        .sum();
    assert_eq!(paid, 2 * batch.multiplier_total + open.1);

    // The draw worker's counters: every first answer once.
    let draws = scrape(ports[0]).await;
    let labels = r#"{worker="draw-worker",pool="rtp",version="1"}"#;
    assert_eq!(
        series(
            &draws,
            &format!("prizepool_version_prizes_drawn_total{labels}")
        ),
        Some(2500.0),
        "{draws}"
    );
    assert_eq!(
        series(&draws, &format!("prizepool_paid_multiplier_total{labels}")),
        Some(paid as f64),
        "{draws}"
    );

    // Status: two completed batches, exact; batch 3 in progress.
    let status = rtp_status(&env, "rtp").await;
    let v1 = &status["rtp"]["versions"][0];
    assert_eq!(v1["version"], 1, "{status}");
    assert_eq!(v1["configured_rtp"].as_f64(), Some(batch.rtp), "{status}");
    assert_eq!(v1["completed_batches"], 2, "{status}");
    assert_eq!(v1["completed_prizes"], 2000, "{status}");
    assert_eq!(v1["completed_paid"], 2 * batch.multiplier_total, "{status}");
    assert_eq!(v1["realised_rtp"].as_f64(), Some(batch.rtp), "{status}");
    assert_eq!(v1["exact"], true, "{status}");
    let in_progress = &status["rtp"]["in_progress"];
    assert_eq!(in_progress["batches"], serde_json::json!([3]), "{status}");
    assert_eq!(in_progress["prizes"], open.0, "{status}");
    assert_eq!(in_progress["paid"], open.1, "{status}");
    let text = env.cli(&["status"]).await;
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!(
            "rtp v1: configured {:.6}, realised {:.6} over 2 completed batches (2000 prizes paid {}) exact",
            batch.rtp,
            batch.rtp,
            2 * batch.multiplier_total
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "rtp in progress: batches [3]: 500 prizes paid {}",
            open.1
        )),
        "{text}"
    );
    wait_gauges(ports[1], 2, 2000, 2 * batch.multiplier_total, batch.rtp).await;

    // Tampering: a 0x prize still in batch 3 becomes a 500x.
    let mut redis = env.redis.clone();
    let keys = prizepool::scripts::PoolKeys::new(&env.config.redis_prefix, "rtp");
    let (table, _) = lucky_gift::load_codes(&mut redis, &keys)
        .await
        .unwrap()
        .unwrap();
    let (zero, jackpot) = (
        table.code_of("c1", 0).unwrap().to_string(),
        table.code_of("c1", 500).unwrap().to_string(),
    );
    let rest: Vec<String> = redis::cmd("LRANGE")
        .arg(keys.queue())
        .arg(0)
        .arg(499)
        .query_async(&mut redis)
        .await
        .unwrap();
    let at = rest.iter().position(|c| *c == zero).unwrap();
    let _: () = redis::cmd("LSET")
        .arg(keys.queue())
        .arg(at)
        .arg(&jackpot)
        .query_async(&mut redis)
        .await
        .unwrap();
    draw_by_batch(&rpc, "rtp", 600, &mut by_batch, &mut replies).await;
    assert_eq!(by_batch[&3].0, 1000);
    assert_eq!(by_batch[&3].1, batch.multiplier_total + 500);
    let status = rtp_status(&env, "rtp").await;
    let v1 = &status["rtp"]["versions"][0];
    assert_eq!(v1["completed_batches"], 3, "{status}");
    assert_eq!(v1["completed_paid"], 3 * batch.multiplier_total + 500);
    assert_eq!(v1["exact"], false, "{status}");
    assert_eq!(
        status["rtp"]["in_progress"]["batches"],
        serde_json::json!([4])
    );
    let problems = rtp_problems(&env).await;
    assert!(
        problems
            .iter()
            .any(|p| p["kind"] == "rtp_departs" && p["subject"] == "rtp"),
        "{problems:?}"
    );
    // The alert's expression on the refill worker's gauges: 500 off.
    wait_gauges(
        ports[1],
        3,
        3000,
        3 * batch.multiplier_total + 500,
        batch.rtp,
    )
    .await;
    let gauges = scrape(ports[1]).await;
    let g = |name: &str| {
        series(
            &gauges,
            &format!(r#"{name}{{worker="refill-worker",pool="rtp",version="1"}}"#),
        )
        .unwrap()
    };
    let off = (g("prizepool_completed_paid_multiplier")
        - g("prizepool_completed_prizes") * g("prizepool_configured_rtp"))
    .abs();
    assert!((off - 500.0).abs() < 1e-6, "{off}");
    rpc.close().await;
    drop(workers);
}

/// `prizepool status --json`'s view of pool `pool`.
async fn rtp_status(env: &TestEnv, pool: &str) -> Value {
    let out = env.cli(&["status", "--json"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    status["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pool"] == pool)
        .cloned()
        .unwrap_or_else(|| panic!("no pool {pool} in {status}"))
}

/// What `prizepool status --json` finds wrong.
async fn rtp_problems(env: &TestEnv) -> Vec<Value> {
    let out = env.cli(&["status", "--json"]).await;
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    status["problems"].as_array().unwrap().clone()
}

/// Waits until the refill worker on `port` exports these completed-batch
/// figures of pool "rtp", version 1 (it reads Redis every 5 s).
async fn wait_gauges(port: u16, batches: u64, prizes: u64, paid: u64, rtp: f64) {
    use crate::observability::{scrape, series};
    common::eventually(T, || async {
        let m = scrape(port).await;
        let g = |name: &str| {
            series(
                &m,
                &format!(r#"{name}{{worker="refill-worker",pool="rtp",version="1"}}"#),
            )
        };
        let want = [
            ("prizepool_completed_batches", batches as f64),
            ("prizepool_completed_prizes", prizes as f64),
            ("prizepool_completed_paid_multiplier", paid as f64),
            ("prizepool_configured_rtp", rtp),
        ];
        match want.iter().all(|(n, v)| g(n) == Some(*v)) {
            true => Ok(()),
            false => Err(format!("want {want:?} in\n{m}")),
        }
    })
    .await;
}
