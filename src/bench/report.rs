//! The bench report: JSON for machines, Markdown for people, an SVG plot of
//! throughput and latency against the number of draw workers.

use std::{fmt::Write as _, path::PathBuf};

use serde::Serialize;

use super::{ceilings::Rate, fleet::Load, stats::Percentiles, BenchArgs, BenchKind};
use crate::{config::Config, kinds::lucky_gift::Storage};

/// A plot panel: title, left offset, and the value plotted.
type Panel = (&'static str, f64, fn(&Run) -> f64);

#[derive(Debug, Default, Serialize)]
pub(super) struct Ceilings {
    /// The draw step as the workers call it.
    pub redis_draw: Rate,
    /// Bare EVALSHA of the draw script: the raw ceiling.
    pub redis_raw: Rate,
    pub redis_trivial: Rate,
    pub amqp: Rate,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct Memory {
    pub list_bytes_per_prize: f64,
    pub sparse_bytes_per_nonzero: f64,
    /// Bytes a sparse pool stocked with [`Memory::SPARSE_ZEROS`] zero prizes
    /// and nothing else takes: what zeros cost.
    pub sparse_bytes_for_zeros: u64,
    /// What remembering a request's answer for its idempotency window costs.
    pub results: Results,
}

/// Redis memory per remembered result: the claim of its id and its answer,
/// measured by `used_memory` around `results` requests claimed and answered
/// through the workers' own scripts.
#[derive(Debug, Default, Serialize)]
pub(super) struct Results {
    pub results: u64,
    pub claim_bytes: f64,
    pub answer_bytes: f64,
    pub total_bytes: f64,
    /// Bytes of each stored answer's body (the size of a count-1 lucky-gift
    /// award as stored, plus one).
    pub body_bytes: usize,
    /// `OBJECT ENCODING` of a claim bucket and of an answer bucket.
    pub encodings: [String; 2],
}

impl Memory {
    /// Zero prizes in the pool that measures what zeros cost.
    pub(super) const SPARSE_ZEROS: u64 = 1_000_000;
}

#[derive(Debug, Serialize)]
pub(super) struct Flatness {
    pub small_per_s: f64,
    pub big_per_s: f64,
    pub ratio: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct Stall {
    pub prizes: u64,
    pub seconds: f64,
    pub probe: Percentiles,
    pub latency_monitor_max_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
pub(super) struct ProcessCpu {
    pub name: String,
    pub pid: u32,
    pub cpu_s: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct Run {
    pub draw_workers: usize,
    pub max: Load,
    pub half: Load,
    pub amqp_at_half: Rate,
    pub settle_lag_ms: f64,
    pub ledger_matches: bool,
    pub cpu_per_draw_us: f64,
    pub load_generator_cpu_s: f64,
    pub processes: Vec<ProcessCpu>,
    /// CPU seconds of the local services (RabbitMQ, Redis, PostgreSQL)
    /// during the full-speed phase.
    pub services: Vec<ServiceCpu>,
    /// RabbitMQ CPU per draw, where it runs on this machine (like the
    /// ceiling's per-message figure, it depends on the rate).
    pub broker_cpu_per_draw_us: Option<f64>,
    pub cpu_budget: CpuBudget,
}

/// Where the machine's CPU went in the full-speed phase, per draw: with
/// every part on one machine, the draws/s its cores allow at that cost is
/// the most the fleet can reach there.
#[derive(Debug, Serialize)]
pub(super) struct CpuBudget {
    /// CPU microseconds per draw of each service and process, by name
    /// (the replicas of one program summed), in the order first seen.
    pub per_draw_us: Vec<CpuShare>,
    pub total_us: f64,
    /// Draws/s the machine's cores allow at `total_us` a draw.
    pub cores_allow_per_s: f64,
    /// Share of the cores' time the phase used.
    pub cores_busy: f64,
}

/// The cores this machine gives the bench and everything it measures.
pub(super) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

#[derive(Debug, Serialize)]
pub(super) struct CpuShare {
    pub name: String,
    pub us: f64,
}

impl CpuBudget {
    /// The budget of `draws` draws made in `phase_s` seconds on `cores`
    /// cores, from the CPU seconds each named part spent meanwhile.
    pub(super) fn new(
        cpu_s: impl IntoIterator<Item = (String, f64)>,
        draws: u64,
        phase_s: f64,
        cores: usize,
    ) -> Self {
        let mut per_draw_us: Vec<CpuShare> = Vec::new();
        let mut spent = 0.0;
        for (name, s) in cpu_s {
            spent += s;
            let us = s * 1e6 / draws.max(1) as f64;
            match per_draw_us.iter_mut().find(|c| c.name == name) {
                Some(c) => c.us += us,
                None => per_draw_us.push(CpuShare { name, us }),
            }
        }
        let total_us: f64 = per_draw_us.iter().map(|c| c.us).sum();
        let cores = cores.max(1) as f64;
        Self {
            per_draw_us,
            total_us,
            cores_allow_per_s: cores * 1e6 / total_us.max(f64::MIN_POSITIVE),
            cores_busy: spent / (cores * phase_s.max(f64::MIN_POSITIVE)),
        }
    }
}

#[derive(Debug, Serialize)]
pub(super) struct ServiceCpu {
    pub name: &'static str,
    pub cpu_s: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub started_at: String,
    pub command: String,
    pub kind: BenchKind,
    pub storage: Storage,
    pub count: u32,
    /// The worker settings that change the figures (`DRAW_EVENTS`,
    /// `SCHED_BATCH`), as the fleet's processes read them.
    pub draw_events: crate::config::DrawEvents,
    pub sched_batch: bool,
    pub cores: usize,
    pub ceilings: Ceilings,
    pub memory: Memory,
    pub flatness: Option<Flatness>,
    pub stall: Option<Stall>,
    pub runs: Vec<Run>,
}

impl Report {
    pub(super) fn new(args: &BenchArgs, storage: Storage, config: &Config) -> Self {
        Self {
            started_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            kind: args.kind,
            storage,
            count: args.count,
            draw_events: config.draw_events,
            sched_batch: config.sched_batch,
            cores: cores(),
            ceilings: Ceilings::default(),
            memory: Memory::default(),
            flatness: None,
            stall: None,
            runs: Vec::new(),
        }
    }

    fn best(&self) -> Option<&Run> {
        self.runs
            .iter()
            .max_by(|a, b| a.max.draws_per_s.total_cmp(&b.max.draws_per_s))
    }

    /// The report as a Markdown page.
    pub(super) fn markdown(&self) -> String {
        let mut md = String::new();
        let c = &self.ceilings;
        let _ = writeln!(
            md,
            "## prizepool bench, {} ({} cores)\n",
            self.started_at, self.cores
        );
        let _ = writeln!(
            md,
            "`{}` — kind {:?}, storage {:?}, {} prizes per lucky-gift draw; \
             DRAW_EVENTS={}, SCHED_BATCH={}\n",
            self.command, self.kind, self.storage, self.count, self.draw_events, self.sched_batch
        );
        let _ = writeln!(md, "### Ceilings (same run)\n");
        let _ = writeln!(
            md,
            "| ceiling | rate | p50 ms | p99 ms |\n|---|---|---|---|"
        );
        for (name, r) in [
            (
                "Redis: raw EVALSHA of the draw script, 64 in flight on one connection",
                &c.redis_raw,
            ),
            (
                "Redis: the draw step as workers call it (reply parsed)",
                &c.redis_draw,
            ),
            (
                "Redis: trivial script with the same keys (round-trip floor)",
                &c.redis_trivial,
            ),
            (
                "RabbitMQ: quorum queue, windowed confirms → consume → ack",
                &c.amqp,
            ),
        ] {
            let _ = writeln!(
                md,
                "| {name} | {:.0}/s | {:.2} | {:.2} |",
                r.per_s, r.latency.p50_ms, r.latency.p99_ms
            );
        }
        let _ = writeln!(md, "\n### Fleet\n");
        let _ = writeln!(
            md,
            "| draw workers | draws/s | prizes/s | p50 ms | p90 ms | p99 ms | max ms | rejected | settle lag ms | ledger | worker CPU µs/draw |\n|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for r in &self.runs {
            let l = &r.max;
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.0} | {} | {:.0} |",
                r.draw_workers,
                l.draws_per_s,
                l.prizes_per_s,
                l.latency.p50_ms,
                l.latency.p90_ms,
                l.latency.p99_ms,
                l.latency.max_ms,
                l.rejected + l.failed,
                r.settle_lag_ms,
                if r.ledger_matches {
                    "matches"
                } else {
                    "MISMATCH"
                },
                r.cpu_per_draw_us
            );
        }
        let _ = writeln!(md, "\nAt half the maximum rate (open loop):\n");
        let _ = writeln!(md, "| draw workers | rate/s | p50 ms | p99 ms | RabbitMQ p99 ms at that rate | ratio |\n|---|---|---|---|---|---|");
        for r in &self.runs {
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.1} | {:.1} | {:.2} | {:.1}× |",
                r.draw_workers,
                r.half.draws_per_s,
                r.half.latency.p50_ms,
                r.half.latency.p99_ms,
                r.amqp_at_half.latency.p99_ms,
                r.half.latency.p99_ms / r.amqp_at_half.latency.p99_ms.max(0.001)
            );
        }
        let _ = writeln!(
            md,
            "\nCPU seconds per process during the full-speed phase:\n"
        );
        for r in &self.runs {
            let procs: Vec<String> = r
                .processes
                .iter()
                .map(|p| format!("{} {:.2}", p.name, p.cpu_s))
                .collect();
            let services: Vec<String> = r
                .services
                .iter()
                .map(|p| format!("{} {:.2}", p.name, p.cpu_s))
                .collect();
            let _ = writeln!(
                md,
                "- {} draw workers: {}; load generator {:.2}; services: {}",
                r.draw_workers,
                procs.join(", "),
                r.load_generator_cpu_s,
                services.join(", ")
            );
        }
        if let Some(first) = self.runs.first() {
            let names: Vec<&str> = first
                .cpu_budget
                .per_draw_us
                .iter()
                .map(|c| c.name.as_str())
                .collect();
            let _ = writeln!(
                md,
                "\nCPU µs per draw in the full-speed phase, and the draws/s the {} cores allow at that cost:\n\n| draw workers | {} | total | draws/s the cores allow | cores busy |\n|---|{}---|---|---|",
                self.cores,
                names.join(" | "),
                "---|".repeat(names.len())
            );
            for r in &self.runs {
                let b = &r.cpu_budget;
                let shares: Vec<String> = names
                    .iter()
                    .map(|n| {
                        b.per_draw_us
                            .iter()
                            .find(|c| c.name == *n)
                            .map_or("—".to_owned(), |c| format!("{:.0}", c.us))
                    })
                    .collect();
                let _ = writeln!(
                    md,
                    "| {} | {} | {:.0} | {:.0} | {:.0} % |",
                    r.draw_workers,
                    shares.join(" | "),
                    b.total_us,
                    b.cores_allow_per_s,
                    b.cores_busy * 100.0
                );
            }
        }
        let _ = writeln!(md, "\n### Ratios\n");
        let _ = writeln!(md, "| measure | value | target |\n|---|---|---|");
        if let Some(best) = self.best() {
            let _ = writeln!(
                md,
                "| end-to-end draws/s ÷ RabbitMQ ceiling msg/s | {:.2} | ≥ 0.40 |",
                best.max.draws_per_s / c.amqp.per_s.max(1.0)
            );
            let _ = writeln!(
                md,
                "| p99 at half rate ÷ RabbitMQ p99 at that rate | {:.1} | ≤ 3 |",
                best.half.latency.p99_ms / best.amqp_at_half.latency.p99_ms.max(0.001)
            );
            let _ = writeln!(
                md,
                "| worker CPU per draw | {:.0} µs | reported |",
                best.cpu_per_draw_us
            );
        }
        let _ = writeln!(
            md,
            "| Lua draw step as workers call it ÷ its raw EVALSHA ceiling | {:.2} | ≥ 0.90 |",
            c.redis_draw.per_s / c.redis_raw.per_s.max(1.0)
        );
        let _ = writeln!(md, "| draw script ÷ trivial script (the draw's own work, informative) | {:.2} | reported |", c.redis_draw.per_s / c.redis_trivial.per_s.max(1.0));
        if let Some(f) = &self.flatness {
            let _ = writeln!(md, "| draws/s with 10M ÷ with 1k prizes stocked | {:.2} ({:.0} vs {:.0}) | 0.90–1.10 |", f.ratio, f.big_per_s, f.small_per_s);
        }
        if let Some(s) = &self.stall {
            let _ = writeln!(
                md,
                "| longest Redis stall while stocking {} prizes ({:.1} s) | probe {:.2} ms, LATENCY monitor {} | ≤ 2 ms |",
                s.prizes,
                s.seconds,
                s.probe.max_ms,
                s.latency_monitor_max_ms.map_or("no event ≥ 1 ms".to_owned(), |m| format!("{m} ms"))
            );
        }
        let _ = writeln!(
            md,
            "| list storage, bytes per stocked prize | {:.2} | ≤ 2.5 |",
            self.memory.list_bytes_per_prize
        );
        let _ = writeln!(
            md,
            "| sparse storage, bytes per non-zero prize | {:.1} | ≤ 64 |",
            self.memory.sparse_bytes_per_nonzero
        );
        let _ = writeln!(
            md,
            "| sparse storage, bytes for {} zero prizes and nothing else | {} | no entry per zero |",
            Memory::SPARSE_ZEROS,
            self.memory.sparse_bytes_for_zeros
        );
        let r = &self.memory.results;
        let _ = writeln!(
            md,
            "| remembered result (claim {:.1} + answer {:.1} with a {}-byte body), bytes, over {} results; buckets {} / {} | {:.1} | ≤ 64 |",
            r.claim_bytes, r.answer_bytes, r.body_bytes, r.results, r.encodings[0], r.encodings[1], r.total_bytes
        );
        md
    }

    /// Throughput and p99 latency against draw workers, as an SVG.
    fn svg(&self) -> String {
        let (w, h, pad) = (640.0, 300.0, 50.0);
        let xs: Vec<f64> = self.runs.iter().map(|r| r.draw_workers as f64).collect();
        let (xmin, xmax) = (
            xs.iter().copied().fold(f64::MAX, f64::min),
            xs.iter().copied().fold(0.0, f64::max),
        );
        let x = |v: f64| {
            pad + if xmax > xmin {
                (v - xmin) / (xmax - xmin) * (w / 2.0 - 2.0 * pad)
            } else {
                (w / 2.0 - 2.0 * pad) / 2.0
            }
        };
        let mut svg = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">"#
        );
        let panels: [Panel; 2] = [
            ("draws/s", 0.0, |r| r.max.draws_per_s),
            ("p99 publish→reply ms", w / 2.0, |r| r.max.latency.p99_ms),
        ];
        for (title, left, value) in panels {
            let ys: Vec<f64> = self.runs.iter().map(value).collect();
            let ymax = ys.iter().copied().fold(1e-9, f64::max) * 1.15;
            let y = |v: f64| h - pad - v / ymax * (h - 2.0 * pad);
            let _ = write!(
                svg,
                r#"<g transform="translate({left},0)"><text x="{pad}" y="20" font-size="13">{title} vs draw workers</text>"#
            );
            let _ = write!(
                svg,
                r#"<line x1="{pad}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{}" stroke="black"/>"#,
                h - pad,
                w / 2.0 - pad,
                h - pad,
                h - pad
            );
            let _ = write!(
                svg,
                r#"<text x="{}" y="{}">0</text><text x="4" y="{}">{:.0}</text>"#,
                pad - 12.0,
                h - pad + 4.0,
                pad + 4.0,
                ymax
            );
            let points: Vec<String> = xs
                .iter()
                .zip(&ys)
                .map(|(a, b)| format!("{:.1},{:.1}", x(*a), y(*b)))
                .collect();
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="steelblue" stroke-width="2" points="{}"/>"#,
                points.join(" ")
            );
            for (a, b) in xs.iter().zip(&ys) {
                let _ = write!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="steelblue"/><text x="{:.1}" y="{:.1}">{b:.0}</text>"#,
                    x(*a),
                    y(*b),
                    x(*a) + 5.0,
                    y(*b) - 5.0
                );
                let _ = write!(
                    svg,
                    r#"<text x="{:.1}" y="{}">{a}</text>"#,
                    x(*a) - 3.0,
                    h - pad + 15.0
                );
            }
            let _ = write!(svg, "</g>");
        }
        svg.push_str("</svg>\n");
        svg
    }

    /// Writes report.json, report.md and plot.svg to `out/<time>/` and `out/latest/`.
    pub(super) fn write(&self, out: &std::path::Path) -> anyhow::Result<PathBuf> {
        let stamp = self.started_at.replace(':', "");
        let dir = out.join(stamp);
        for d in [&dir, &out.join("latest")] {
            std::fs::create_dir_all(d)?;
            std::fs::write(d.join("report.json"), serde_json::to_string_pretty(self)?)?;
            std::fs::write(d.join("report.md"), self.markdown())?;
            std::fs::write(d.join("plot.svg"), self.svg())?;
        }
        Ok(dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_budget_sums_replicas_and_divides_the_cores_by_the_cost_of_a_draw() {
        let b = CpuBudget::new(
            [
                ("rabbitmq".to_owned(), 1.0),
                ("draw-worker".to_owned(), 0.25),
                ("draw-worker".to_owned(), 0.25),
                ("load generator".to_owned(), 0.5),
            ],
            10_000,
            2.0,
            2,
        );
        let shares: Vec<(&str, f64)> = b
            .per_draw_us
            .iter()
            .map(|c| (c.name.as_str(), c.us))
            .collect();
        assert_eq!(
            shares,
            [
                ("rabbitmq", 100.0),
                ("draw-worker", 50.0),
                ("load generator", 50.0)
            ]
        );
        assert_eq!(b.total_us, 200.0);
        // 2 cores = 2,000,000 µs of CPU a second, at 200 µs a draw.
        assert_eq!(b.cores_allow_per_s, 10_000.0);
        // 2 CPU-s spent out of 2 cores × 2 s.
        assert_eq!(b.cores_busy, 0.5);
    }
}
