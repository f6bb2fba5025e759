//! The bench report: JSON for machines, Markdown for people, an SVG plot of
//! throughput and latency against the number of draw workers.

use std::{fmt::Write as _, path::PathBuf};

use serde::Serialize;

use super::{args::BenchArgs, ceilings::Rate, fleet::Load, stats::Percentiles};
use prizepool::{config::Config, kinds::lucky_gift::Storage};

/// A plot panel: title, left offset, and the value plotted.
type Panel = (&'static str, f64, fn(&Run) -> f64);

/// The points of a plot's line: (x, run).
type Points<'a> = Vec<(f64, &'a Run)>;

/// A line of a plot: its label and its points.
type Series<'a> = (String, Points<'a>);

/// Line colours, one per series.
const COLOURS: [&str; 6] = [
    "steelblue",
    "darkorange",
    "seagreen",
    "crimson",
    "purple",
    "saddlebrown",
];

/// Draws/s and p99 latency of `series` against `x_name`, as an SVG of two
/// panels, one polyline per series.
fn plot(series: &[Series<'_>], x_name: &str) -> String {
    let (w, h, pad) = (640.0, 300.0, 50.0);
    let xs = || series.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x));
    let (xmin, xmax) = (xs().fold(f64::MAX, f64::min), xs().fold(f64::MIN, f64::max));
    let x = |v: f64| {
        pad + if xmax > xmin {
            (v - xmin) / (xmax - xmin) * (w / 2.0 - 2.0 * pad)
        } else {
            (w / 2.0 - 2.0 * pad) / 2.0
        }
    };
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{}" font-family="sans-serif" font-size="11">"#,
        h + 16.0 * series.len() as f64
    );
    let panels: [Panel; 2] = [
        ("draws/s", 0.0, |r| r.max.draws_per_s),
        ("p99 draw latency ms", w / 2.0, |r| r.max.latency.p99_ms),
    ];
    for (title, left, value) in panels {
        let ymax = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(_, r)| value(r)))
            .fold(1e-9, f64::max)
            * 1.15;
        let y = |v: f64| h - pad - v / ymax * (h - 2.0 * pad);
        let _ = write!(
            svg,
            r#"<g transform="translate({left},0)"><text x="{pad}" y="20" font-size="13">{title} vs {x_name}</text>"#
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
        for (n, (_, points)) in series.iter().enumerate() {
            let colour = COLOURS[n % COLOURS.len()];
            let line: Vec<String> = points
                .iter()
                .map(|(a, r)| format!("{:.1},{:.1}", x(*a), y(value(r))))
                .collect();
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
                line.join(" ")
            );
            for (a, r) in points {
                let b = value(r);
                let _ = write!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"/><text x="{:.1}" y="{:.1}">{b:.0}</text>"#,
                    x(*a),
                    y(b),
                    x(*a) + 5.0,
                    y(b) - 5.0
                );
                let _ = write!(
                    svg,
                    r#"<text x="{:.1}" y="{}">{a}</text>"#,
                    x(*a) - 3.0,
                    h - pad + 15.0
                );
            }
        }
        let _ = write!(svg, "</g>");
    }
    for (n, (label, _)) in series.iter().enumerate() {
        let _ = write!(
            svg,
            r#"<text x="{pad}" y="{}" fill="{}">— {label}</text>"#,
            h + 12.0 + 16.0 * n as f64,
            COLOURS[n % COLOURS.len()]
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[derive(Debug, Default, Serialize)]
pub(super) struct Ceilings {
    /// The draw step as the workers call it.
    pub(crate) redis_draw: Rate,
    /// Bare EVALSHA of the draw script: the raw ceiling.
    pub(crate) redis_raw: Rate,
    pub(crate) redis_trivial: Rate,
    /// The lucky-gift draw step coalesced as the workers coalesce it,
    /// [`COALESCED`] draws per call (draws/s); lucky-gift runs only.
    pub(crate) redis_coalesced: Option<Rate>,
    pub(crate) amqp: Rate,
}

/// Draws per call of the coalesced ceiling.
pub(super) const COALESCED: usize = 10;

#[derive(Debug, Default, Serialize)]
pub(super) struct Memory {
    pub(crate) list_bytes_per_prize: f64,
    pub(crate) sparse_bytes_per_nonzero: f64,
    /// Bytes a sparse pool stocked with [`Memory::SPARSE_ZEROS`] zero prizes
    /// and nothing else takes: what zeros cost.
    pub(crate) sparse_bytes_for_zeros: u64,
    /// What remembering a request's answer for its idempotency window costs.
    pub(crate) results: Results,
}

/// Redis memory per remembered result: the claim of its id and its answer,
/// measured by `used_memory` around `results` requests claimed and answered
/// through the workers' own scripts.
#[derive(Debug, Default, Serialize)]
pub(super) struct Results {
    pub(crate) results: u64,
    pub(crate) claim_bytes: f64,
    pub(crate) answer_bytes: f64,
    pub(crate) total_bytes: f64,
    /// Bytes of each stored answer's body (the size of a count-1 lucky-gift
    /// award as stored, plus one).
    pub(crate) body_bytes: usize,
    /// `OBJECT ENCODING` of a claim bucket and of an answer bucket.
    pub(crate) encodings: [String; 2],
}

impl Memory {
    /// Zero prizes in the pool that measures what zeros cost.
    pub(super) const SPARSE_ZEROS: u64 = 1_000_000;
}

#[derive(Debug, Serialize)]
pub(super) struct Flatness {
    pub(crate) small_per_s: f64,
    pub(crate) big_per_s: f64,
    pub(crate) ratio: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct Stall {
    pub(crate) prizes: u64,
    pub(crate) seconds: f64,
    pub(crate) probe: Percentiles,
    pub(crate) latency_monitor_max_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
pub(super) struct ProcessCpu {
    pub(crate) name: String,
    pub(crate) pid: u32,
    pub(crate) cpu_s: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct Run {
    pub(crate) draw_workers: usize,
    /// Draws per message at most (`--batch`), through the batching client;
    /// `None`: one `draw` message per draw.
    pub(crate) batch: Option<usize>,
    /// The batching client's linger.
    pub(crate) linger_ms: Option<f64>,
    /// Messages published per second in the full-speed phase.
    pub(crate) messages_per_s: f64,
    /// Draws each message carried on average (batching client only).
    pub(crate) draws_per_message: Option<f64>,
    pub(crate) max: Load,
    pub(crate) half: Load,
    pub(crate) amqp_at_half: Rate,
    pub(crate) settle_lag_ms: f64,
    pub(crate) ledger_matches: bool,
    pub(crate) cpu_per_draw_us: f64,
    pub(crate) load_generator_cpu_s: f64,
    pub(crate) processes: Vec<ProcessCpu>,
    /// CPU seconds of the local services (RabbitMQ, Redis, PostgreSQL)
    /// during the full-speed phase.
    pub(crate) services: Vec<ServiceCpu>,
    /// RabbitMQ CPU per draw, where it runs on this machine (like the
    /// ceiling's per-message figure, it depends on the rate).
    pub(crate) broker_cpu_per_draw_us: Option<f64>,
    pub(crate) cpu_budget: CpuBudget,
}

impl Run {
    /// The run's row label: its draw workers, and its batch size if any.
    fn label(&self) -> String {
        match self.batch {
            Some(k) => format!("{} (batch {k})", self.draw_workers),
            None => self.draw_workers.to_string(),
        }
    }
}

/// Where the machine's CPU went in the full-speed phase, per draw: with
/// every part on one machine, the draws/s its cores allow at that cost is
/// the most the fleet can reach there.
#[derive(Debug, Serialize)]
pub(super) struct CpuBudget {
    /// CPU microseconds per draw of each service and process, by name
    /// (the replicas of one program summed), in the order first seen.
    pub(crate) per_draw_us: Vec<CpuShare>,
    pub(crate) total_us: f64,
    /// Draws/s the machine's cores allow at `total_us` a draw.
    pub(crate) cores_allow_per_s: f64,
    /// Share of the cores' time the phase used.
    pub(crate) cores_busy: f64,
}

/// The cores this machine gives the bench and everything it measures.
pub(super) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

#[derive(Debug, Serialize)]
pub(super) struct CpuShare {
    pub(crate) name: String,
    pub(crate) us: f64,
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
    pub(crate) name: &'static str,
    pub(crate) cpu_s: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(crate) started_at: String,
    pub(crate) command: String,
    pub(crate) kind: &'static str,
    pub(crate) storage: Storage,
    pub(crate) count: u32,
    /// The worker settings that change the figures (`DRAW_EVENTS`,
    /// `SCHED_BATCH`), as the fleet's processes read them.
    pub(crate) draw_events: prizepool::config::DrawEvents,
    pub(crate) sched_batch: bool,
    pub(crate) cores: usize,
    pub(crate) ceilings: Ceilings,
    pub(crate) memory: Memory,
    pub(crate) flatness: Option<Flatness>,
    pub(crate) stall: Option<Stall>,
    pub(crate) runs: Vec<Run>,
}

impl Report {
    pub(super) fn new(args: &BenchArgs, storage: Storage, config: &Config) -> Self {
        Self {
            started_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            kind: args.kind.label(),
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

    /// The batched run with the most draws/s.
    fn best_batched(&self) -> Option<&Run> {
        self.runs
            .iter()
            .filter(|r| r.batch.is_some())
            .max_by(|a, b| a.max.draws_per_s.total_cmp(&b.max.draws_per_s))
    }

    /// The batch-1 run (through the client, one draw per message) with the
    /// most draws/s, the baseline of a sweep.
    fn batch_one(&self) -> Option<&Run> {
        self.runs
            .iter()
            .filter(|r| r.batch == Some(1))
            .max_by(|a, b| a.max.draws_per_s.total_cmp(&b.max.draws_per_s))
    }

    /// The batch sweep: one row per batched run.
    fn batch_markdown(&self, md: &mut String) {
        let batched: Vec<&Run> = self.runs.iter().filter(|r| r.batch.is_some()).collect();
        if batched.is_empty() {
            return;
        }
        let linger = batched
            .first()
            .and_then(|r| r.linger_ms)
            .unwrap_or_default();
        let _ = writeln!(
            md,
            "\n### Batched draws (the library's client, linger {linger} ms)\n\n\
             Latency is one draw's, as its caller sees it through the client (linger included). \
             RabbitMQ's ceiling is {:.0} msg/s.\n\n\
             | batch | draw workers | draws/s | prizes/s | messages/s | draws per message | p50 ms | p99 ms | p99 ms at half rate | CPU µs/draw, all parts | draws/s ÷ RabbitMQ msg/s ceiling |\n\
             |---|---|---|---|---|---|---|---|---|---|---|",
            self.ceilings.amqp.per_s
        );
        for r in batched {
            let _ = writeln!(
                md,
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.2} |",
                r.batch.unwrap_or(1),
                r.draw_workers,
                r.max.draws_per_s,
                r.max.prizes_per_s,
                r.messages_per_s,
                r.draws_per_message.unwrap_or(1.0),
                r.max.latency.p50_ms,
                r.max.latency.p99_ms,
                r.half.latency.p99_ms,
                r.cpu_budget.total_us,
                r.max.draws_per_s / self.ceilings.amqp.per_s.max(1.0)
            );
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
            "`{}` — kind {}, storage {:?}, {} prizes per lucky-gift draw; \
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
                "Redis: the draw step coalesced, 10 draws a call (draws/s)",
                c.redis_coalesced.as_ref().unwrap_or(&Rate::default()),
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
            "| draw workers (draws per message) | draws/s | prizes/s | p50 ms | p90 ms | p99 ms | max ms | rejected | settle lag ms | ledger | worker CPU µs/draw |\n|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for r in &self.runs {
            let l = &r.max;
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.0} | {} | {:.0} |",
                r.label(),
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
        let _ = writeln!(md, "| draw workers (draws per message) | rate/s | p50 ms | p99 ms | RabbitMQ p99 ms at that rate | ratio |\n|---|---|---|---|---|---|");
        for r in &self.runs {
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.1} | {:.1} | {:.2} | {:.1}× |",
                r.label(),
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
                "- {}: {}; load generator {:.2}; services: {}",
                r.label(),
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
                "\nCPU µs per draw in the full-speed phase, and the draws/s the {} cores allow at that cost:\n\n| draw workers (draws per message) | {} | total | draws/s the cores allow | cores busy |\n|---|{}---|---|---|",
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
                    r.label(),
                    shares.join(" | "),
                    b.total_us,
                    b.cores_allow_per_s,
                    b.cores_busy * 100.0
                );
            }
        }
        self.batch_markdown(&mut md);
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
        if let (Some(batched), Some(one)) = (self.best_batched(), self.batch_one()) {
            let _ = writeln!(
                md,
                "| best batched draws/s (batch {}, {} workers) ÷ draws/s at batch 1 | {:.2} | reported |",
                batched.batch.unwrap_or(1),
                batched.draw_workers,
                batched.max.draws_per_s / one.max.draws_per_s.max(1.0)
            );
            let _ = writeln!(
                md,
                "| total CPU per draw, best batched ÷ batch 1 | {:.2} | reported |",
                batched.cpu_budget.total_us / one.cpu_budget.total_us.max(f64::MIN_POSITIVE)
            );
        }
        let _ = writeln!(
            md,
            "| Lua draw step as workers call it ÷ its raw EVALSHA ceiling | {:.2} | ≥ 0.90 |",
            c.redis_draw.per_s / c.redis_raw.per_s.max(1.0)
        );
        let _ = writeln!(md, "| draw script ÷ trivial script (the draw's own work, informative) | {:.2} | reported |", c.redis_draw.per_s / c.redis_trivial.per_s.max(1.0));
        if let Some(coalesced) = &c.redis_coalesced {
            let _ = writeln!(
                md,
                "| Lua draw step coalesced ({COALESCED} draws a call) ÷ one call per draw, draws/s | {:.2} ({:.0} vs {:.0}) | ≥ 2 |",
                coalesced.per_s / c.redis_draw.per_s.max(1.0),
                coalesced.per_s,
                c.redis_draw.per_s
            );
        }
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

    /// Throughput and p99 latency against draw workers, as an SVG (one line
    /// per batch size when the run swept them).
    fn svg(&self) -> String {
        let series = self.series(
            |r| r.batch,
            |b| match b {
                Some(k) => format!("batch {k}"),
                None => "single draws".into(),
            },
            |r| r.draw_workers as f64,
        );
        plot(&series, "draw workers")
    }

    /// Throughput and p99 latency against the batch size, one line per
    /// draw-worker count; `None` without a `--batch` sweep.
    fn batch_svg(&self) -> Option<String> {
        let batched: Vec<&Run> = self.runs.iter().filter(|r| r.batch.is_some()).collect();
        if batched.len() < 2 {
            return None;
        }
        let series = self.series(
            |r| Some(r.draw_workers),
            |w| format!("{} draw workers", w.unwrap_or_default()),
            |r| r.batch.unwrap_or(1) as f64,
        );
        let series: Vec<Series<'_>> = series
            .into_iter()
            .map(|(label, points)| {
                (
                    label,
                    points
                        .into_iter()
                        .filter(|(_, r)| r.batch.is_some())
                        .collect(),
                )
            })
            .collect();
        Some(plot(&series, "draws per message (batch size)"))
    }

    /// The runs grouped by `key`, each group's points ordered by `x`.
    fn series(
        &self,
        key: fn(&Run) -> Option<usize>,
        label: fn(Option<usize>) -> String,
        x: fn(&Run) -> f64,
    ) -> Vec<Series<'_>> {
        let mut series: Vec<(Option<usize>, Points<'_>)> = Vec::new();
        for r in &self.runs {
            match series.iter_mut().find(|(k, _)| *k == key(r)) {
                Some((_, points)) => points.push((x(r), r)),
                None => series.push((key(r), vec![(x(r), r)])),
            }
        }
        series
            .into_iter()
            .map(|(k, mut points)| {
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                (label(k), points)
            })
            .collect()
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
            if let Some(svg) = self.batch_svg() {
                std::fs::write(d.join("batch.svg"), svg)?;
            }
        }
        Ok(dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(workers: usize, batch: Option<usize>, draws_per_s: f64, p99_ms: f64) -> Run {
        Run {
            draw_workers: workers,
            batch,
            linger_ms: batch.map(|_| 2.0),
            messages_per_s: draws_per_s / batch.unwrap_or(1) as f64,
            draws_per_message: batch.map(|k| k as f64),
            max: Load {
                draws_per_s,
                prizes_per_s: draws_per_s * 10.0,
                ok: (draws_per_s * 10.0) as u64,
                latency: Percentiles {
                    p99_ms,
                    ..Percentiles::default()
                },
                ..Load::default()
            },
            half: Load::default(),
            amqp_at_half: Rate::default(),
            settle_lag_ms: 0.0,
            ledger_matches: true,
            cpu_per_draw_us: 100.0,
            load_generator_cpu_s: 1.0,
            processes: Vec::new(),
            services: Vec::new(),
            broker_cpu_per_draw_us: None,
            cpu_budget: CpuBudget::new(
                [("draw-worker".to_owned(), 1.0)],
                (draws_per_s * 10.0) as u64,
                10.0,
                2,
            ),
        }
    }

    fn report(runs: Vec<Run>) -> Report {
        Report {
            started_at: "2026-11-25T00:00:00Z".into(),
            command: "prizepool bench".into(),
            kind: "LuckyGift",
            storage: Storage::List,
            count: 10,
            draw_events: prizepool::config::DrawEvents::Grouped,
            sched_batch: false,
            cores: 2,
            ceilings: Ceilings {
                amqp: Rate {
                    per_s: 10_000.0,
                    ..Rate::default()
                },
                ..Ceilings::default()
            },
            memory: Memory::default(),
            flatness: None,
            stall: None,
            runs,
        }
    }

    #[test]
    fn a_batch_sweep_gets_its_table_its_ratios_and_its_plot() {
        let rep = report(vec![
            run(1, Some(1), 4_000.0, 20.0),
            run(1, Some(10), 12_000.0, 15.0),
            run(1, Some(50), 16_000.0, 30.0),
        ]);
        let md = rep.markdown();
        assert!(
            md.contains("### Batched draws (the library's client, linger 2 ms)"),
            "{md}"
        );
        assert!(
            md.contains("| 10 | 1 | 12000 | 120000 | 1200 | 10.0 |"),
            "{md}"
        );
        // 16,000 draws/s over a 10,000 msg/s ceiling: batching goes past it.
        assert!(md.contains("| 1.60 |"), "{md}");
        assert!(md.contains("÷ draws/s at batch 1 | 4.00 |"), "{md}");
        assert!(md.contains("| 1 (batch 50) |"), "{md}");
        let svg = rep.batch_svg().expect("a sweep has a batch plot");
        assert!(svg.contains("vs draws per message (batch size)"));
        assert_eq!(svg.matches("<polyline").count(), 2, "one line per panel");
        // Without a sweep, no batch section and no batch plot.
        let single = report(vec![
            run(1, None, 4_000.0, 20.0),
            run(2, None, 6_000.0, 20.0),
        ]);
        assert!(!single.markdown().contains("Batched draws"));
        assert!(single.batch_svg().is_none());
        assert_eq!(single.svg().matches("<polyline").count(), 2);
    }

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
