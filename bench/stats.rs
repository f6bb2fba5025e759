//! Small measurement helpers: latency percentiles, process CPU time, rates.

use std::time::Duration;

/// Latency samples in microseconds.
#[derive(Clone, Debug, Default)]
pub(crate) struct Latencies {
    micros: Vec<u64>,
}

/// Percentiles of a latency sample, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub(crate) struct Percentiles {
    pub(crate) p50_ms: f64,
    pub(crate) p90_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
    pub(crate) samples: usize,
}

impl Latencies {
    /// Records one sample.
    pub(crate) fn record(&mut self, d: Duration) {
        self.micros
            .push(d.as_micros().min(u128::from(u64::MAX)) as u64);
    }

    /// Adds another sample set.
    pub(crate) fn extend(&mut self, other: Latencies) {
        self.micros.extend(other.micros);
    }

    /// Number of samples.
    pub(crate) fn len(&self) -> usize {
        self.micros.len()
    }

    /// p50, p90, p99 and max.
    pub(crate) fn percentiles(&mut self) -> Percentiles {
        if self.micros.is_empty() {
            return Percentiles::default();
        }
        self.micros.sort_unstable();
        let at = |q: f64| {
            let i =
                ((self.micros.len() as f64 * q).ceil() as usize).clamp(1, self.micros.len()) - 1;
            self.micros[i] as f64 / 1000.0
        };
        Percentiles {
            p50_ms: at(0.50),
            p90_ms: at(0.90),
            p99_ms: at(0.99),
            max_ms: *self.micros.last().unwrap_or(&0) as f64 / 1000.0,
            samples: self.micros.len(),
        }
    }
}

/// CPU time (user + system) a process has used so far, from `/proc`.
pub(super) fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // SAFETY-free: sysconf is not exposed by std; Linux uses 100 ticks/s on every supported arch.
    Some(Duration::from_millis((utime + stime) * 10))
}

/// CPU time used so far by the local service processes, summed by service
/// (`rabbitmq`, `redis`, `postgres`). A service running on another host does
/// not appear.
pub(super) fn service_cpu() -> Vec<(&'static str, Duration)> {
    let mut totals: Vec<(&'static str, Duration)> = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return totals;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
            continue;
        };
        let service = match comm.trim() {
            "beam.smp" => "rabbitmq",
            "redis-server" => "redis",
            "postgres" => "postgres",
            _ => continue,
        };
        let used = cpu_time(pid).unwrap_or_default();
        match totals.iter_mut().find(|(name, _)| *name == service) {
            Some((_, total)) => *total += used,
            None => totals.push((service, used)),
        }
    }
    totals.sort_by_key(|(name, _)| *name);
    totals
}

/// CPU seconds each service used between two [`service_cpu`] readings.
pub(super) fn service_cpu_since(before: &[(&'static str, Duration)]) -> Vec<(&'static str, f64)> {
    service_cpu()
        .into_iter()
        .map(|(name, now)| {
            let was = before
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(Duration::ZERO, |(_, d)| *d);
            (name, now.saturating_sub(was).as_secs_f64())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_sample() {
        let mut l = Latencies::default();
        for ms in 1..=100 {
            l.record(Duration::from_millis(ms));
        }
        let p = l.percentiles();
        assert_eq!(
            (p.p50_ms, p.p90_ms, p.p99_ms, p.max_ms),
            (50.0, 90.0, 99.0, 100.0)
        );
    }

    #[test]
    fn own_cpu_time_is_readable() {
        assert!(cpu_time(std::process::id()).is_some());
    }
}
