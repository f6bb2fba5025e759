//! Runtime configuration, read once at start-up from the environment (and,
//! for the worker binaries, from command-line flags that override it).
//!
//! One typed description, [`Settings`], drives everything: parsing, range
//! checks, defaults and the `--help` text, which lists every variable with
//! its default and unit. Every setting has a default that points at the
//! local services, so a newcomer can run `prizepool demo` without exporting
//! anything. Errors name the variable that is malformed; an empty variable
//! counts as unset (except `METRICS_ADDR`, where empty turns the endpoint off).
//!
//! The typed description of the command line and environment lives in
//! `settings.rs`, the certificate files of TLS connections in `tls.rs`.

mod settings;
mod tls;

use std::{process::ExitCode, str::FromStr, time::Duration};

use settings::{command, parse, Failure};
pub use tls::TlsFiles;

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
/// Shortest `RESULT_TTL_S`: draw results are kept at least a day (SPEC §7).
pub const MIN_RESULT_TTL_S: u64 = 86_400;

/// Largest `REFILL_CHUNK`: one Lua step `unpack`s a chunk, and Lua's stack
/// refuses somewhat under 8,000 values; half of that leaves a margin.
pub const MAX_REFILL_CHUNK: u64 = 4_000;

/// Most draw shards (`DRAW_SHARDS`).
pub const MAX_DRAW_SHARDS: u16 = 16;

/// A setting that could not be used, or a command line that makes no sense.
#[derive(Debug, thiserror::Error)]
#[error("{}", self.message())]
pub struct ConfigError {
    /// The environment variable at fault; empty for a command-line problem.
    name: String,
    reason: String,
}

impl ConfigError {
    fn new(name: &str, reason: impl Into<String>) -> Self {
        Self {
            name: name.to_owned(),
            // A reason may quote the value, and a value may be a URL.
            reason: crate::db::redact_text(&reason.into()),
        }
    }

    /// The environment variable at fault, if the problem is one variable.
    pub fn variable(&self) -> Option<&str> {
        (!self.name.is_empty()).then_some(self.name.as_str())
    }

    fn message(&self) -> String {
        match self.variable() {
            Some(name) => format!("environment variable {name} is invalid: {}", self.reason),
            None => self.reason.clone(),
        }
    }
}

/// Settings shared by every binary.
#[derive(Clone, Debug)]
pub struct Config {
    /// `AMQP_URL`: the broker, including the vhost.
    pub amqp_url: String,
    /// `REDIS_URL`: the Redis server holding pool state.
    pub redis_url: String,
    /// `DATABASE_URL`: the Postgres ledger. When `TLS_CA_FILE` (or a client
    /// certificate) is set and the URL names none, it carries them as
    /// `sslrootcert` / `sslcert` / `sslkey`, with `sslmode=verify-full`.
    pub database_url: String,
    /// `REDIS_PREFIX`: first segment of every Redis key (`pp:{pool}:meta`).
    pub redis_prefix: String,
    /// `PREFETCH`: deliveries a consumer may hold unacknowledged.
    pub prefetch: u16,
    /// `CONCURRENCY`: deliveries a worker handles at once.
    pub concurrency: usize,
    /// `DELIVERY_LIMIT`: redeliveries before the broker dead-letters a message.
    pub delivery_limit: u32,
    /// `DRAW_SHARDS`: quorum queues the draw requests are spread over
    /// (`prizepool.draw`, `prizepool.draw.1`, …; the broker module declares them).
    pub draw_shards: u16,
    /// `SETTLE_BATCH_SIZE`: ledger entries written per transaction at most.
    pub settle_batch_size: usize,
    /// `SETTLE_BATCH_WAIT_MS`: how long a settle batch waits to fill up.
    pub settle_batch_wait: Duration,
    /// `REFILL_CHUNK`: prizes pushed to Redis per Lua call while stocking.
    pub refill_chunk: usize,
    /// `SHORT_POOL_WAIT_MS`: how long a draw waits for a refill before `pool_exhausted`.
    pub short_pool_wait: Duration,
    /// `MAX_BATCH`: most draws one `draw.batch` carries.
    pub max_batch: usize,
    /// `RESULT_TTL_S`: how long draw results are kept for idempotent replays.
    pub result_ttl: Duration,
    /// `TRANSIENT_RETRY_MS`: how long transient failures are retried quietly before each retry is logged as an error.
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
    /// endpoint off). Always a valid socket address when set.
    pub metrics_addr: Option<String>,
    /// `HEALTH_CHECK_INTERVAL_MS`: how often Redis and Postgres are pinged
    /// for `/readyz`.
    pub health_check_interval: Duration,
    /// `STALL_AFTER_MS`: how long a worker with deliveries in hand may
    /// answer none, while its servers answer its pings, before it reports
    /// itself stalled (see [`crate::ops::Health`]).
    pub stall_after: Duration,
    /// `TLS_CA_FILE`, `TLS_CERT_FILE`, `TLS_KEY_FILE`.
    pub tls: TlsFiles,
    /// `LEDGER_SEAL_KEY`: the key of the seals on the fleet's own ledger
    /// entries (see [`crate::ledger::Sealer`]); `None`: a key kept in Redis.
    pub ledger_seal_key: Option<SealKey>,
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`: where traces are exported with OTLP/HTTP
    /// ([`crate::telemetry::export_traces`]); `None`: off.
    pub otel_endpoint: Option<String>,
}

/// A secret that never shows in logs or `Debug` output.
#[derive(Clone)]
pub struct SealKey(pub String);

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(***)")
    }
}

impl Config {
    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the configuration through `lookup`; used by tests and by the CLI
    /// to start workers with overrides. The process environment is not read.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        parse(["prizepool".into()], lookup, "prizepool").map_err(|failure| match failure {
            Failure::Invalid(e) => e,
            Failure::Exit(e) => ConfigError::new("", e.to_string()),
        })
    }

    /// Reads a worker binary's command line and environment. `--help` and
    /// `--version` print to stdout and ask for exit code 0; an unknown
    /// argument or a bad value is logged (so `LOG_FORMAT=json` keeps every
    /// line JSON) and asks for exit code 2.
    pub fn from_args(service: &'static str, about: &'static str) -> Result<Self, ExitCode> {
        match parse(std::env::args_os(), |n| std::env::var(n).ok(), service) {
            Ok(config) => Ok(config),
            Err(Failure::Exit(e)) if !e.use_stderr() => {
                let text = if e.kind() == clap::error::ErrorKind::DisplayHelp {
                    command(service).about(about).render_long_help().to_string()
                } else {
                    e.to_string()
                };
                print!("{text}");
                Err(ExitCode::SUCCESS)
            }
            Err(Failure::Exit(e)) => {
                let message = e.render().to_string();
                let message = message.lines().next().unwrap_or_default();
                tracing::error!(
                    error = message.trim_start_matches("error: "),
                    "invalid command line; see --help"
                );
                Err(ExitCode::from(2))
            }
            Err(Failure::Invalid(e)) => {
                tracing::error!(variable = e.variable(), error = %e, "invalid configuration");
                Err(ExitCode::from(2))
            }
        }
    }

    /// The effective configuration for the start-up log line, every URL
    /// redacted.
    pub fn summary(&self) -> serde_json::Value {
        let redact = crate::db::redact;
        serde_json::json!({
            "amqp_url": redact(&self.amqp_url),
            "redis_url": redact(&self.redis_url),
            "database_url": redact(&self.database_url),
            "redis_prefix": self.redis_prefix,
            "prefetch": self.prefetch,
            "concurrency": self.concurrency,
            "delivery_limit": self.delivery_limit,
            "draw_shards": self.draw_shards,
            "settle_batch_size": self.settle_batch_size,
            "settle_batch_wait_ms": self.settle_batch_wait.as_millis() as u64,
            "refill_chunk": self.refill_chunk,
            "short_pool_wait_ms": self.short_pool_wait.as_millis() as u64,
            "max_batch": self.max_batch,
            "result_ttl_s": self.result_ttl.as_secs(),
            "transient_retry_ms": self.transient_retry.as_millis() as u64,
            "shutdown_grace_ms": self.shutdown_grace.as_millis() as u64,
            "draw_events": self.draw_events,
            "sched_batch": self.sched_batch,
            "metrics_addr": self.metrics_addr,
            "health_check_interval_ms": self.health_check_interval.as_millis() as u64,
            "stall_after_ms": self.stall_after.as_millis() as u64,
            "ledger_seal_key": if self.ledger_seal_key.is_some() { "set" } else { "unset: kept in Redis" },
            "tls": self.tls,
            "otel_exporter_otlp_endpoint": self.otel_endpoint.as_deref().map(redact),
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
        match s.trim().to_ascii_lowercase().as_str() {
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

/// A TOML error of a pool or activity file as one line that keeps where
/// it is: `line L, column C: message` (the toml crate's own rendering spans
/// several lines with a copy of the source).
pub fn toml_error(text: &str, error: &toml::de::Error) -> String {
    let Some(span) = error.span() else {
        return error.message().to_owned();
    };
    let before = &text.as_bytes()[..span.start.min(text.len())];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let column = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    format!("line {line}, column {column}: {}", error.message())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_toml_error_keeps_its_line_and_column() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct File {
            n: u32,
        }
        let text = "# a comment\n\nn = \"seven\"\n";
        let error = toml::from_str::<File>(text).unwrap_err();
        let message = toml_error(text, &error);
        assert!(message.starts_with("line 3, column 5: "), "{message}");
        let broken = "n = 1\n[oops\n";
        let error = toml::from_str::<File>(broken).unwrap_err();
        assert!(
            toml_error(broken, &error).starts_with("line 2, "),
            "{}",
            toml_error(broken, &error)
        );
    }

    use super::*;

    fn with(name: &'static str, value: &str) -> Result<Config, ConfigError> {
        Config::from_lookup(|n| (n == name).then(|| value.to_owned()))
    }

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
    fn trace_export_is_off_by_default_and_takes_only_an_http_url() {
        assert_eq!(Config::from_lookup(|_| None).unwrap().otel_endpoint, None);
        let endpoint = |v: &str| with("OTEL_EXPORTER_OTLP_ENDPOINT", v).map(|c| c.otel_endpoint);
        assert_eq!(endpoint("").unwrap(), None);
        assert_eq!(
            endpoint("http://collector:4318").unwrap().as_deref(),
            Some("http://collector:4318")
        );
        for bad in [
            "collector:4318",
            "grpc://collector:4317",
            "https://collector:4318",
            "not a url",
        ] {
            let err = endpoint(bad).unwrap_err().to_string();
            assert!(err.contains("OTEL_EXPORTER_OTLP_ENDPOINT"), "{bad}: {err}");
        }
    }

    #[test]
    fn draw_events_default_to_grouped_and_keep_the_old_boolean_spellings() {
        let events = |v: &str| with("DRAW_EVENTS", v).map(|c| c.draw_events);
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
        let err = with("PREFETCH", "lots").unwrap_err().to_string();
        assert!(err.contains("PREFETCH"), "{err}");
    }

    #[test]
    fn ranges_are_checked_at_start_and_name_the_variable() {
        for (name, bad, good) in [
            ("RESULT_TTL_S", "86399", "86400"),
            ("REFILL_CHUNK", "4001", "4000"),
            ("REFILL_CHUNK", "0", "1"),
            ("PREFETCH", "0", "1"),
            ("CONCURRENCY", "0", "1"),
            ("METRICS_ADDR", "localhost", "127.0.0.1:0"),
            ("METRICS_ADDR", "127.0.0.1:99999", "[::1]:9100"),
        ] {
            let err = with(name, bad).unwrap_err();
            assert_eq!(err.variable(), Some(name), "{err}");
            assert!(err.to_string().contains(name), "{err}");
            with(name, good).unwrap_or_else(|e| panic!("{name}={good}: {e}"));
        }
    }

    #[test]
    fn an_empty_variable_counts_as_unset() {
        let cfg = with("PREFETCH", "").unwrap();
        assert_eq!(cfg.prefetch, DEFAULT_PREFETCH);
        assert_eq!(with("REDIS_URL", "").unwrap().redis_url, DEFAULT_REDIS_URL);
    }

    #[test]
    fn an_insecure_redis_url_is_refused_without_echoing_its_password() {
        let err = with("REDIS_URL", "rediss://:hunter2@h:6380/#insecure").unwrap_err();
        assert_eq!(err.variable(), Some("REDIS_URL"));
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn tls_files_are_read_at_start_and_reach_the_postgres_url() {
        let err = with("TLS_CA_FILE", "/nonexistent/ca.pem").unwrap_err();
        assert_eq!(err.variable(), Some("TLS_CA_FILE"));
        let err = with("TLS_CERT_FILE", "/nonexistent/c.pem").unwrap_err();
        assert!(err.to_string().contains("TLS_KEY_FILE"), "{err}");

        let dir = std::env::temp_dir().join(format!("pp-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.pem");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let ca_text = ca.display().to_string();
        let cfg = with("TLS_CA_FILE", &ca_text).unwrap();
        let url = url::Url::parse(&cfg.database_url).unwrap();
        let q: Vec<(String, String)> = url.query_pairs().into_owned().collect();
        assert!(
            q.contains(&("sslrootcert".into(), ca_text.clone())),
            "{q:?}"
        );
        assert!(
            q.contains(&("sslmode".into(), "verify-full".into())),
            "{q:?}"
        );
        // A URL that says what it wants keeps it.
        let own = Config::from_lookup(|n| match n {
            "TLS_CA_FILE" => Some(ca_text.clone()),
            "DATABASE_URL" => Some("postgres://u@h/db?sslmode=require".into()),
            _ => None,
        })
        .unwrap();
        assert!(own.database_url.contains("sslmode=require"));
        assert!(!own.database_url.contains("verify-full"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
