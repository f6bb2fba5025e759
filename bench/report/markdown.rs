//! The report as a Markdown page.

use std::fmt::Write as _;

use super::{Memory, Rate, Report, Run, COALESCED};

impl Report {
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
    pub(in crate::bench) fn markdown(&self) -> String {
        let mut md = String::new();
        self.header_markdown(&mut md);
        self.ceilings_markdown(&mut md);
        self.fleet_markdown(&mut md);
        self.half_rate_markdown(&mut md);
        self.cpu_seconds_markdown(&mut md);
        self.cpu_budget_markdown(&mut md);
        self.redis_commands_markdown(&mut md);
        self.batch_markdown(&mut md);
        self.ratios_markdown(&mut md);
        self.storage_ratios_markdown(&mut md);
        md
    }

    /// The title and the command the bench ran.
    fn header_markdown(&self, md: &mut String) {
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
    }

    /// The ceilings of Redis and RabbitMQ measured in the same run.
    fn ceilings_markdown(&self, md: &mut String) {
        let c = &self.ceilings;
        let _ = writeln!(md, "### Ceilings (same run)\n");
        let _ = writeln!(
            md,
            "| ceiling | rate | p50 ms | p99 ms |\n|---|---|---|---|"
        );
        for (name, r) in [
            (
                "Redis: raw FCALL of the draw script, 64 in flight on one connection",
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
    }

    /// The fleet runs at full speed.
    fn fleet_markdown(&self, md: &mut String) {
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
    }

    /// The fleet runs at half their maximum rate, against RabbitMQ at that rate.
    fn half_rate_markdown(&self, md: &mut String) {
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
    }

    /// CPU seconds per process in the full-speed phase.
    fn cpu_seconds_markdown(&self, md: &mut String) {
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
    }

    /// CPU per draw and the draws/s the cores allow at that cost.
    fn cpu_budget_markdown(&self, md: &mut String) {
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
    }

    /// Redis commands per draw, when they were counted.
    fn redis_commands_markdown(&self, md: &mut String) {
        if self
            .runs
            .iter()
            .any(|r| r.redis_commands_per_draw.is_some())
        {
            let _ = writeln!(
                md,
                "\nRedis commands per draw in the full-speed phase (`INFO commandstats`, scripts' inner calls, refills and settling included):\n\n| draw workers (draws per message) | commands per draw | most called (calls per draw) |\n|---|---|---|"
            );
            for r in &self.runs {
                let Some(per) = r.redis_commands_per_draw else {
                    continue;
                };
                let draws = r.max.ok.max(1) as f64;
                let top: Vec<String> = r
                    .redis_commands
                    .iter()
                    .take(8)
                    .map(|(name, n)| format!("{name} {:.2}", *n as f64 / draws))
                    .collect();
                let _ = writeln!(md, "| {} | {per:.2} | {} |", r.label(), top.join(", "));
            }
        }
    }

    /// The ratios of the fleet and the Lua step to their ceilings.
    fn ratios_markdown(&self, md: &mut String) {
        let c = &self.ceilings;
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
            "| Lua draw step as workers call it ÷ its raw FCALL ceiling | {:.2} | ≥ 0.90 |",
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
    }

    /// The rows of the ratios table on memory: the storages and the
    /// remembered results.
    fn storage_ratios_markdown(&self, md: &mut String) {
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
    }
}
