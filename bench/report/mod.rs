//! The bench report: JSON for machines, Markdown for people, an SVG plot of
//! throughput and latency against the number of draw workers.

mod markdown;
mod svg;

use std::path::PathBuf;

use serde::Serialize;

use super::{args::BenchArgs, ceilings::Rate, fleet::Load, stats::Percentiles};
use prizepool::{config::Config, kinds::lucky_gift::Storage};

#[derive(Debug, Default, Serialize)]
pub(super) struct Ceilings {
    /// The draw step as the workers call it.
    pub(crate) redis_draw: Rate,
    /// Bare FCALL of the draw script: the raw ceiling.
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
    /// Redis commands per draw in the full-speed phase (`INFO
    /// commandstats`, scripts' inner calls included; refills and settling
    /// included), when the server allows `CONFIG RESETSTAT`.
    pub(crate) redis_commands_per_draw: Option<f64>,
    /// Calls per Redis command in that phase, most called first.
    pub(crate) redis_commands: Vec<(String, u64)>,
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
            redis_commands_per_draw: None,
            redis_commands: Vec::new(),
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
