//! The alert rules fire when they should, and only then.
//!
//! promtool (installed by `scripts/alert-tools`) checks
//! `deploy/prometheus/alerts.yml` and runs its unit tests,
//! `deploy/prometheus/alerts_test.yml`: input series for a healthy fleet, a
//! growing dead-letter queue, a ledger stall, a worker kind that is down, a
//! worker that cannot be scraped, and so on, with the alerts expected at
//! given times, their labels and annotations included. The same tests run
//! against the rules of the PrometheusRule in `deploy/k8s/alerts.yaml`, so
//! both files fire the same alerts with the same text.
#![allow(clippy::unwrap_used)]

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const RULES: &str = "deploy/prometheus/alerts.yml";
const TESTS: &str = "deploy/prometheus/alerts_test.yml";

/// promtool's path, installed once for the whole test binary.
fn promtool() -> &'static Path {
    static PROMTOOL: OnceLock<PathBuf> = OnceLock::new();
    PROMTOOL.get_or_init(|| {
        let out = Command::new(format!("{ROOT}/scripts/alert-tools"))
            .output()
            .expect("scripts/alert-tools runs");
        assert!(
            out.status.success(),
            "scripts/alert-tools failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
}

/// Runs promtool with `args` in `dir` and returns its output; fails the test
/// with that output when promtool fails.
fn run_promtool(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(promtool())
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{report}");
    report
}

fn read(file: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/{file}")).unwrap()
}

/// The alert names a rule file defines, in order.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_rule_file_is_valid_and_passes_its_unit_tests() {
    let root = Path::new(ROOT);
    let checked = run_promtool(root, &["check", "rules", RULES]);
    let count = alert_names(&read(RULES)).len();
    assert!(
        checked.contains(&format!("SUCCESS: {count} rules found")),
        "{checked}"
    );
    let tested = run_promtool(root, &["test", "rules", TESTS]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// Each alert has a case where it fires and one where it does not. The test
/// file writes each expectation as `alertname: X` followed by
/// `exp_alerts: []` (none) or `exp_alerts:` and the alerts expected.
#[test]
fn every_alert_is_tested_firing_and_silent() {
    let tests = read(TESTS);
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    let mut firing = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for (i, line) in lines.iter().enumerate() {
        if let Some(name) = line.strip_prefix("alertname: ") {
            match lines.get(i + 1).copied() {
                Some("exp_alerts: []") => silent.insert(name.to_owned()),
                Some("exp_alerts:") => {
                    assert!(
                        lines[i + 2].starts_with("- exp_labels:"),
                        "{name}: {}",
                        lines[i + 2]
                    );
                    firing.insert(name.to_owned())
                }
                other => panic!("{name}: expected exp_alerts after alertname, found {other:?}"),
            };
        }
    }
    let alerts: BTreeSet<String> = alert_names(&read(RULES)).into_iter().collect();
    assert!(alerts.len() >= 8, "{alerts:?}");
    assert_eq!(firing, alerts, "alerts without a test that fires them");
    assert_eq!(
        silent, alerts,
        "alerts without a test where they stay silent"
    );
}

/// The PrometheusRule's `spec` is a rule file: its lines under `spec:`,
/// two spaces less indented. The unit tests then run against it.
#[test]
fn the_prometheus_rule_fires_the_same_alerts_with_the_same_text() {
    let object = read("deploy/k8s/alerts.yaml");
    assert!(object.contains("\nkind: PrometheusRule\n"), "{object}");
    let (_, spec) = object
        .split_once("\nspec:\n")
        .expect("the PrometheusRule has a spec");
    let rules: String = spec
        .lines()
        .map(|l| {
            assert!(l.is_empty() || l.starts_with("  "), "outside spec: {l}");
            format!("{}\n", l.strip_prefix("  ").unwrap_or(l))
        })
        .collect();
    assert_eq!(alert_names(&rules), alert_names(&read(RULES)));
    let dir = crate::common::tempdir("alerts");
    std::fs::write(dir.join("prometheus-rule.yml"), &rules).unwrap();
    let tests = read(TESTS).replacen(
        "rule_files:\n  - alerts.yml\n",
        "rule_files:\n  - prometheus-rule.yml\n",
        1,
    );
    assert!(tests.contains("prometheus-rule.yml"));
    std::fs::write(dir.join("alerts_test.yml"), tests).unwrap();
    run_promtool(&dir, &["check", "rules", "prometheus-rule.yml"]);
    let tested = run_promtool(&dir, &["test", "rules", "alerts_test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    std::fs::remove_dir_all(dir).unwrap();
}
