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

/// The local servers the bench measures: the TCP port each listens on, from
/// the configured URLs. A server on another host (or a URL that names no
/// port the bench can find) is left out.
#[derive(Clone, Debug, Default)]
pub(crate) struct ServicePorts {
    ports: Vec<(&'static str, u16)>,
}

impl ServicePorts {
    /// The ports of `config`'s RabbitMQ, Redis and Postgres when they are on
    /// this host.
    pub(crate) fn of(config: &prizepool::config::Config) -> Self {
        let local = |url: &str, default: u16| -> Option<u16> {
            let url = url::Url::parse(url).ok()?;
            let host = url.host_str().unwrap_or("localhost");
            matches!(host, "127.0.0.1" | "localhost" | "::1" | "[::1]")
                .then(|| url.port().unwrap_or(default))
        };
        let ports = [
            ("rabbitmq", local(&config.amqp_url, 5672)),
            ("redis", local(&config.redis_url, 6379)),
            ("postgres", local(&config.database_url, 5432)),
        ]
        .into_iter()
        .filter_map(|(name, port)| Some((name, port?)))
        .collect();
        Self { ports }
    }
}

/// CPU time used so far by the servers the bench talks to, summed by
/// service (`rabbitmq`, `redis`, `postgres`). A server is the process that
/// listens on its configured port and, for Postgres, the backends and
/// helpers it forked; other servers of the same program on this machine (a
/// test's private Redis, say) are not counted.
pub(super) fn service_cpu(ports: &ServicePorts) -> Vec<(&'static str, Duration)> {
    let listeners = listening_pids(ports);
    let parents = parent_pids();
    let mut totals: Vec<(&'static str, Duration)> = Vec::new();
    for (name, pid) in listeners {
        let mut used = cpu_time(pid).unwrap_or_default();
        if name == "postgres" {
            used += parents
                .iter()
                .filter(|(_, ppid)| *ppid == pid)
                .filter_map(|(child, _)| cpu_time(*child))
                .sum::<Duration>();
        }
        totals.push((name, used));
    }
    totals.sort_by_key(|(name, _)| *name);
    totals
}

/// The process listening on each port of `ports` (IPv4 or IPv6), found
/// through the socket's inode in `/proc/net/tcp*` and `/proc/<pid>/fd`.
fn listening_pids(ports: &ServicePorts) -> Vec<(&'static str, u32)> {
    // Socket inodes in state LISTEN (0A), by local port.
    let mut inodes: Vec<(&'static str, u64)> = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            let port = local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            let Some(&(name, _)) = ports.ports.iter().find(|(_, p)| Some(*p) == port) else {
                continue;
            };
            if *state == "0A" {
                if let Ok(inode) = inode.parse() {
                    inodes.push((name, inode));
                }
            }
        }
    }
    let mut found: Vec<(&'static str, u32)> = Vec::new();
    for pid in pids() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let target = target.to_string_lossy();
            let Some(inode) = target
                .strip_prefix("socket:[")
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok())
            else {
                continue;
            };
            if let Some(&(name, _)) = inodes.iter().find(|(_, i)| *i == inode) {
                if !found.contains(&(name, pid)) {
                    found.push((name, pid));
                }
            }
        }
    }
    found
}

/// Every process id in `/proc`.
fn pids() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
}

/// Each process with its parent, from `/proc/<pid>/stat`.
fn parent_pids() -> Vec<(u32, u32)> {
    pids()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let rest = &stat[stat.rfind(')')? + 2..];
            let ppid = rest.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect()
}

/// CPU seconds each service used between two [`service_cpu`] readings.
pub(super) fn service_cpu_since(
    ports: &ServicePorts,
    before: &[(&'static str, Duration)],
) -> Vec<(&'static str, f64)> {
    service_cpu(ports)
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
