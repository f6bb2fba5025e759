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
