//! `prizepool bench --plan RATE[:SECONDS]`: what a peak needs, worked out
//! from the per-part costs a bench run measured (its `report.json`), with
//! every input printed so the arithmetic can be redone by hand
//! (`docs/capacity.md` explains each line).

use std::fmt::Write as _;

use anyhow::Context;
use serde_json::Value;

/// A peak: draws per second, for `seconds` (a steady day when `None`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Peak {
    pub(super) rate: f64,
    pub(super) seconds: Option<f64>,
}

impl std::str::FromStr for Peak {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (rate, seconds) = match text.split_once(':') {
            Some((r, s)) => (r, Some(s)),
            None => (text, None),
        };
        let rate: f64 = rate
            .parse()
            .map_err(|_| format!("{rate:?} is not draws/s"))?;
        let seconds = seconds
            .map(|s| {
                s.parse::<f64>()
                    .map_err(|_| format!("{s:?} is not seconds"))
            })
            .transpose()?;
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(rate) || seconds.is_some_and(|s| !positive(s)) {
            return Err("a peak is a positive rate and, optionally, positive seconds".into());
        }
        Ok(Self { rate, seconds })
    }
}

/// The machines the plan is made of.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    /// Cores of one node.
    pub(super) cores_per_node: f64,
    /// Share of a core a part may use at the peak (headroom for bursts).
    pub(super) utilisation: f64,
    /// Memory one Redis master may fill, in GB.
    pub(super) gb_per_redis_master: f64,
    /// How long answers are kept (`RESULT_TTL_S`).
    pub(super) result_ttl_s: f64,
}

/// Answers are kept between the TTL and a quarter more (`lua/lib/answer.lua`).
const RETENTION_FACTOR: f64 = 1.125;

fn number(report: &Value, path: &[&str]) -> anyhow::Result<f64> {
    let mut v = report;
    for p in path {
        v = &v[*p];
    }
    v.as_f64()
        .with_context(|| format!("the report has no number at {}", path.join(".")))
}

/// The figures of a bench report a plan reads.
struct Inputs {
    /// CPU µs per draw of each part, the load generator left out.
    per_draw: Vec<(String, f64)>,
    count: f64,
    queue_ceiling: f64,
    pool_ceiling: f64,
    result_bytes: f64,
    prize_bytes: f64,
}

impl Inputs {
    /// The inputs of `report`'s last fleet run and its ceilings.
    fn read(report: &Value) -> anyhow::Result<Self> {
        let run = report["runs"]
            .as_array()
            .and_then(|runs| runs.last())
            .context("the report has no fleet run")?;
        let per_draw: Vec<(String, f64)> = run["cpu_budget"]["per_draw_us"]
            .as_array()
            .context("the report has no CPU budget")?
            .iter()
            .filter_map(|p| Some((p["name"].as_str()?.to_owned(), p["us"].as_f64()?)))
            .filter(|(name, _)| name != "load generator")
            .collect();
        Ok(Self {
            per_draw,
            count: number(report, &["count"])?,
            queue_ceiling: number(report, &["ceilings", "amqp", "per_s"])?,
            pool_ceiling: number(report, &["ceilings", "redis_raw", "per_s"])?,
            result_bytes: number(report, &["memory", "results", "total_bytes"])?,
            prize_bytes: number(report, &["memory", "list_bytes_per_prize"])?,
        })
    }

    /// CPU µs per draw of part `name` (0 if the run did not measure it).
    fn us(&self, name: &str) -> f64 {
        self.per_draw
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0.0, |(_, us)| *us)
    }
}

/// The plan for `peak` on machines of `shape`, from `report`.
pub(super) fn plan(report: &Value, peak: Peak, shape: Shape) -> anyhow::Result<String> {
    let inputs = Inputs::read(report)?;
    let Inputs {
        count,
        queue_ceiling,
        pool_ceiling,
        result_bytes,
        prize_bytes,
        ..
    } = inputs;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## Plan: {:.0} draws/s {}\n",
        peak.rate,
        peak.seconds
            .map_or("steady".to_owned(), |s| format!("for {s:.0} s"))
    );
    let _ = writeln!(
        md,
        "Inputs (from the report): count {count:.0} prizes per draw; one quorum queue {queue_ceiling:.0} round trips/s; one pool's draw script {pool_ceiling:.0} calls/s; {result_bytes:.1} B per remembered result; {prize_bytes:.2} B per stocked prize; cores per node {}, utilisation {:.0} %, {} GB per Redis master, answers kept {:.0} s × {RETENTION_FACTOR}.\n",
        shape.cores_per_node,
        shape.utilisation * 100.0,
        shape.gb_per_redis_master,
        shape.result_ttl_s
    );
    cpu_table(&mut md, &inputs, peak, shape);
    let settle_per_s = needs_table(&mut md, &inputs, peak, shape);
    binds_first(&mut md, &inputs, shape, settle_per_s);
    Ok(md)
}

/// The CPU each part needs at the peak, and the nodes they make.
fn cpu_table(md: &mut String, inputs: &Inputs, peak: Peak, shape: Shape) {
    let per_draw = &inputs.per_draw;
    let _ = writeln!(
        md,
        "| part | CPU µs per draw | cores at the peak | instances |"
    );
    let _ = writeln!(md, "|---|---|---|---|");
    let mut total_cores = 0.0;
    for (name, us) in per_draw {
        let cores = peak.rate * us / 1e6 / shape.utilisation;
        total_cores += cores;
        let instances = match name.as_str() {
            // One process uses about one core at the measured cost.
            "draw-worker" | "settle-worker" | "refill-worker" => {
                format!("{:.0}", cores.ceil().max(1.0))
            }
            "redis" => format!("{:.0} masters (CPU)", cores.ceil().max(1.0)),
            "rabbitmq" => format!(
                "{:.0} nodes' worth",
                (cores / shape.cores_per_node).ceil().max(1.0)
            ),
            _ => String::new(),
        };
        let _ = writeln!(md, "| {name} | {us:.1} | {cores:.1} | {instances} |");
    }
    let nodes = (total_cores / shape.cores_per_node).ceil();
    let _ = writeln!(
        md,
        "| total | {:.1} | {total_cores:.1} | {nodes:.0} nodes of {} cores |\n",
        per_draw.iter().map(|(_, us)| us).sum::<f64>(),
        shape.cores_per_node
    );
}

/// The needs besides CPU: memory, queues, shards, the settle worker's
/// ceiling, ledger rows. Returns one settle worker's ceiling, entries/s.
fn needs_table(md: &mut String, inputs: &Inputs, peak: Peak, shape: Shape) -> f64 {
    let Inputs {
        queue_ceiling,
        pool_ceiling,
        result_bytes,
        prize_bytes,
        ..
    } = *inputs;
    // Memory of the remembered results: every answer of the window.
    let held_s = match peak.seconds {
        Some(s) => s.min(shape.result_ttl_s * RETENTION_FACTOR),
        None => shape.result_ttl_s * RETENTION_FACTOR,
    };
    let results = peak.rate * held_s;
    let result_gb = results * result_bytes / 1e9;
    let masters_for_memory = (result_gb / shape.gb_per_redis_master).ceil().max(1.0);
    let queues = (peak.rate / (queue_ceiling * shape.utilisation))
        .ceil()
        .max(1.0);
    let hot_pools = (peak.rate / (pool_ceiling * shape.utilisation))
        .ceil()
        .max(1.0);
    let settle_per_s = 1e6 / inputs.us("settle-worker").max(f64::MIN_POSITIVE);
    let ledger_rows = peak.rate * peak.seconds.unwrap_or(86_400.0);
    let _ = writeln!(md, "| need | figure | arithmetic |");
    let _ = writeln!(md, "|---|---|---|");
    let _ = writeln!(md, "| remembered results held | {results:.3e} | rate × min(duration, TTL × {RETENTION_FACTOR}) |");
    let _ = writeln!(
        md,
        "| their Redis memory | {result_gb:.1} GB | results × {result_bytes:.1} B |"
    );
    let _ = writeln!(
        md,
        "| Redis masters for that memory | {masters_for_memory:.0} | GB ÷ {} |",
        shape.gb_per_redis_master
    );
    let _ = writeln!(md, "| prizes stocked for one batch of every pool | {:.1} MB per million prizes | {prize_bytes:.2} B each |", prize_bytes);
    let _ = writeln!(md, "| draw queues | {queues:.0} | rate ÷ ({queue_ceiling:.0} × utilisation): one queue is bounded by its leader's core |");
    let _ = writeln!(md, "| pool shards if one pool takes it all | {hot_pools:.0} | rate ÷ ({pool_ceiling:.0} × utilisation): one pool is one Redis key's Lua step |");
    let _ = writeln!(
        md,
        "| one settle worker's ceiling | {settle_per_s:.0} entries/s | 10⁶ ÷ its µs per draw |"
    );
    let _ = writeln!(md, "| ledger rows | {ledger_rows:.3e} | rate × duration (a day when steady); partition by day |");
    settle_per_s
}

/// What binds first on one node of this shape: the smallest of the
/// single-instance ceilings and what the node's cores allow.
fn binds_first(md: &mut String, inputs: &Inputs, shape: Shape, settle_per_s: f64) {
    let per_draw = &inputs.per_draw;
    let (queue_ceiling, pool_ceiling) = (inputs.queue_ceiling, inputs.pool_ceiling);
    let node_allows = shape.cores_per_node * shape.utilisation * 1e6
        / per_draw
            .iter()
            .map(|(_, us)| us)
            .sum::<f64>()
            .max(f64::MIN_POSITIVE);
    let mut limits = [
        ("one node's cores", node_allows),
        ("one draw queue", queue_ceiling * shape.utilisation),
        ("one pool's Redis key", pool_ceiling * shape.utilisation),
        ("one settle worker", settle_per_s * shape.utilisation),
    ];
    limits.sort_by(|a, b| a.1.total_cmp(&b.1));
    let _ = writeln!(
        md,
        "\nBinds first: {} at {:.0} draws/s; then {} ({:.0}), {} ({:.0}), {} ({:.0}).",
        limits[0].0,
        limits[0].1,
        limits[1].0,
        limits[1].1,
        limits[2].0,
        limits[2].1,
        limits[3].0,
        limits[3].1
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn report() -> Value {
        json!({
            "count": 10,
            "ceilings": {"amqp": {"per_s": 10000.0}, "redis_raw": {"per_s": 20000.0}},
            "memory": {"list_bytes_per_prize": 2.0, "results": {"total_bytes": 60.0}},
            "runs": [{"cpu_budget": {"per_draw_us": [
                {"name": "rabbitmq", "us": 100.0},
                {"name": "redis", "us": 50.0},
                {"name": "draw-worker", "us": 50.0},
                {"name": "settle-worker", "us": 10.0},
                {"name": "load generator", "us": 40.0}
            ]}}]
        })
    }

    #[test]
    fn peaks_parse_and_refuse_nonsense() {
        assert_eq!(
            "50000".parse(),
            Ok(Peak {
                rate: 50_000.0,
                seconds: None
            })
        );
        assert_eq!(
            "1e6:600".parse(),
            Ok(Peak {
                rate: 1e6,
                seconds: Some(600.0)
            })
        );
        for bad in ["0", "-5", "x", "10:0", "10:y", "inf"] {
            assert!(bad.parse::<Peak>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_plan_is_the_arithmetic_of_its_inputs() {
        let shape = Shape {
            cores_per_node: 16.0,
            utilisation: 0.5,
            gb_per_redis_master: 10.0,
            result_ttl_s: 90_000.0,
        };
        let md = plan(
            &report(),
            Peak {
                rate: 50_000.0,
                seconds: None,
            },
            shape,
        )
        .unwrap();
        // 50,000 × 210 µs ÷ 0.5 = 21 cores: 2 nodes of 16; the load
        // generator is not part of the fleet.
        assert!(
            md.contains("| total | 210.0 | 21.0 | 2 nodes of 16 cores |"),
            "{md}"
        );
        // 50,000 × 90,000 × 1.125 results × 60 B = 303.75 GB: 31 masters.
        assert!(md.contains("| their Redis memory | 303.8 GB |"), "{md}");
        assert!(
            md.contains("| Redis masters for that memory | 31 |"),
            "{md}"
        );
        // 50,000 ÷ (10,000 × 0.5) = 10 queues; ÷ (20,000 × 0.5) = 5 shards.
        assert!(md.contains("| draw queues | 10 |"), "{md}");
        assert!(
            md.contains("| pool shards if one pool takes it all | 5 |"),
            "{md}"
        );
        // Node: 16 × 0.5 × 10⁶ ÷ 210 = 38,095/s; queue 5,000; pool 10,000;
        // settle 10⁵ × 0.5 = 50,000: one queue binds first.
        assert!(
            md.contains("Binds first: one draw queue at 5000 draws/s"),
            "{md}"
        );
        // Ten minutes of a million draws/s hold 6 × 10⁸ results.
        let md = plan(
            &report(),
            Peak {
                rate: 1e6,
                seconds: Some(600.0),
            },
            shape,
        )
        .unwrap();
        assert!(md.contains("| remembered results held | 6.000e8 |"), "{md}");
    }
}
