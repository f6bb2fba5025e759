//! Runtime configuration, read once from the environment at start-up.
//!
//! Every setting has a default that points at the local services, so a
//! newcomer can run `prizepool demo` without exporting anything. Errors name
//! the variable that is missing or malformed.

use std::{str::FromStr, time::Duration};

/// Default broker address (the `/` vhost on the local RabbitMQ).
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default Redis address.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Default Postgres address.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/prizepool";
/// Default number of unacknowledged deliveries a worker holds.
pub const DEFAULT_PREFETCH: u16 = 256;

/// Where workers serve their ops endpoint unless told otherwise.
pub const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:9100";

/// An environment variable that could not be used.
#[derive(Debug, thiserror::Error)]
#[error("environment variable {name}={value:?} is invalid: {reason}")]
pub struct ConfigError {
    name: &'static str,
    value: String,
    reason: String,
}

/// Settings shared by every binary.
#[derive(Clone, Debug)]
pub struct Config {
    /// `AMQP_URL`: the broker, including the vhost.
    pub amqp_url: String,
    /// `REDIS_URL`: the Redis server holding pool state.
    pub redis_url: String,
    /// `DATABASE_URL`: the Postgres ledger.
    pub database_url: String,
    /// `REDIS_PREFIX`: first segment of every Redis key (`pp:{pool}:meta`).
    pub redis_prefix: String,
    /// `PREFETCH`: deliveries a consumer may hold unacknowledged.
    pub prefetch: u16,
    /// `CONCURRENCY`: deliveries a worker handles at once.
    pub concurrency: usize,
    /// `DELIVERY_LIMIT`: redeliveries before the broker dead-letters a message.
    pub delivery_limit: u32,
    /// `SETTLE_BATCH_SIZE`: ledger entries written per transaction at most.
    pub settle_batch_size: usize,
    /// `SETTLE_BATCH_WAIT_MS`: how long a settle batch waits to fill up.
    pub settle_batch_wait: Duration,
    /// `REFILL_CHUNK`: prizes pushed to Redis per Lua call while stocking.
    pub refill_chunk: usize,
    /// `SHORT_POOL_WAIT_MS`: how long a draw waits for a refill before `pool_exhausted`.
    pub short_pool_wait: Duration,
    /// `RESULT_TTL_S`: how long draw results are kept for idempotent replays.
    pub result_ttl: Duration,
    /// `TRANSIENT_RETRY_MS`: how long a delivery retries transient failures before requeue.
    pub transient_retry: Duration,
    /// `SHUTDOWN_GRACE_MS`: how long in-flight work may take after SIGTERM.
    pub shutdown_grace: Duration,
    /// `DRAW_EVENTS`: how `draw.completed` events leave (see [`DrawEvents`]).
    pub draw_events: DrawEvents,
    /// `SCHED_BATCH`: run the draw worker under Linux's `SCHED_BATCH` policy
    /// (see [`crate::ops::batch_scheduling`]); off by default.
    pub sched_batch: bool,
    /// `METRICS_ADDR`: where a worker serves `/metrics`, `/healthz` and
    /// `/readyz` (default [`DEFAULT_METRICS_ADDR`]; set it empty to turn the
    /// endpoint off).
    pub metrics_addr: Option<String>,
}

impl Config {
    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the configuration through `lookup`; used by tests and by the CLI
    /// to start workers with overrides.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let text = |name: &'static str, default: &str| {
            lookup(name)
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| default.to_owned())
        };
        let ms = |name: &'static str, default: u64| -> Result<Duration, ConfigError> {
            parse(&lookup, name, default).map(Duration::from_millis)
        };
        Ok(Self {
            amqp_url: text("AMQP_URL", DEFAULT_AMQP_URL),
            redis_url: text("REDIS_URL", DEFAULT_REDIS_URL),
            database_url: text("DATABASE_URL", DEFAULT_DATABASE_URL),
            redis_prefix: text("REDIS_PREFIX", "pp"),
            prefetch: parse(&lookup, "PREFETCH", DEFAULT_PREFETCH)?,
            concurrency: parse(&lookup, "CONCURRENCY", 128)?,
            delivery_limit: parse(&lookup, "DELIVERY_LIMIT", 20)?,
            settle_batch_size: parse(&lookup, "SETTLE_BATCH_SIZE", 500)?,
            settle_batch_wait: ms("SETTLE_BATCH_WAIT_MS", 20)?,
            refill_chunk: parse(&lookup, "REFILL_CHUNK", 2000)?,
            short_pool_wait: ms("SHORT_POOL_WAIT_MS", 3000)?,
            result_ttl: Duration::from_secs(parse(&lookup, "RESULT_TTL_S", 90_000)?),
            transient_retry: ms("TRANSIENT_RETRY_MS", 30_000)?,
            shutdown_grace: ms("SHUTDOWN_GRACE_MS", 10_000)?,
            draw_events: parse(&lookup, "DRAW_EVENTS", DrawEvents::Grouped)?,
            sched_batch: parse(&lookup, "SCHED_BATCH", false)?,
            metrics_addr: match lookup("METRICS_ADDR") {
                None => Some(DEFAULT_METRICS_ADDR.to_owned()),
                Some(v) if v.trim().is_empty() => None,
                Some(v) => Some(v),
            },
        })
    }
}

/// How a draw worker publishes its `draw.completed` events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DrawEvents {
    /// `grouped` (the default): the events of concurrent draws share one
    /// `draw.completed.batch` message; a lone event goes out as a plain
    /// `draw.completed`.
    Grouped,
    /// `each` (or `true`): one `draw.completed` message per draw, for
    /// consumers that cannot read batches. Costs the broker a publish per draw.
    Each,
    /// `off` (or `false`): no `draw.completed` events.
    Off,
}

impl FromStr for DrawEvents {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "grouped" => Ok(Self::Grouped),
            "each" | "true" => Ok(Self::Each),
            "off" | "false" => Ok(Self::Off),
            _ => Err("expected grouped, each or off".into()),
        }
    }
}

impl std::fmt::Display for DrawEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Grouped => "grouped",
            Self::Each => "each",
            Self::Off => "off",
        })
    }
}

fn parse<T>(
    lookup: &impl Fn(&str) -> Option<String>,
    name: &'static str,
    default: T,
) -> Result<T, ConfigError>
where
    T: FromStr,
    T::Err: std::fmt::Display,
{
    match lookup(name).filter(|v| !v.is_empty()) {
        None => Ok(default),
        Some(value) => value.trim().parse().map_err(|e: T::Err| ConfigError {
            name,
            reason: e.to_string(),
            value,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_point_at_local_services() {
        let cfg = Config::from_lookup(|_| None).unwrap();
        assert_eq!(cfg.amqp_url, DEFAULT_AMQP_URL);
        assert_eq!(cfg.prefetch, DEFAULT_PREFETCH);
        assert_eq!(cfg.metrics_addr.as_deref(), Some(DEFAULT_METRICS_ADDR));
        let off = Config::from_lookup(|n| (n == "METRICS_ADDR").then(String::new)).unwrap();
        assert!(off.metrics_addr.is_none());
    }

    #[test]
    fn draw_events_default_to_grouped_and_keep_the_old_boolean_spellings() {
        let events = |v: &str| {
            Config::from_lookup(|n| (n == "DRAW_EVENTS").then(|| v.to_owned()))
                .map(|c| c.draw_events)
        };
        assert_eq!(
            Config::from_lookup(|_| None).unwrap().draw_events,
            DrawEvents::Grouped
        );
        assert_eq!(events("each").unwrap(), DrawEvents::Each);
        assert_eq!(events("true").unwrap(), DrawEvents::Each);
        assert_eq!(events("Off").unwrap(), DrawEvents::Off);
        assert_eq!(events("false").unwrap(), DrawEvents::Off);
        let err = events("sometimes").unwrap_err().to_string();
        assert!(
            err.contains("DRAW_EVENTS") && err.contains("grouped"),
            "{err}"
        );
    }

    #[test]
    fn bad_number_names_the_variable() {
        let err = Config::from_lookup(|n| (n == "PREFETCH").then(|| "lots".to_owned()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("PREFETCH"), "{err}");
    }
}
