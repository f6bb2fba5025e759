//! The command line and environment of every binary as clap reads them
//! ([`Settings`]), and their validation into a [`Config`].

use std::{ffi::OsString, net::SocketAddr, path::PathBuf, time::Duration};

use clap::{error::ContextKind, CommandFactory, FromArgMatches};

use super::{
    tls::with_postgres_tls, Config, ConfigError, DrawEvents, SealKey, TlsFiles, DEFAULT_AMQP_URL,
    DEFAULT_DATABASE_URL, DEFAULT_METRICS_ADDR, DEFAULT_PREFETCH, DEFAULT_REDIS_URL,
    MAX_DRAW_SHARDS, MAX_REFILL_CHUNK, MIN_RESULT_TTL_S,
};

/// Logging is set up before the command line is read, from the environment
/// alone.
const LOGGING_HELP: &str = "Logging (environment only):
      RUST_LOG    log filter in tracing's EnvFilter syntax [default: info]
      LOG_FORMAT  text, or json for one JSON object per line [default: text]

Every option may be given as its environment variable instead; a flag wins.";

/// The command line and environment of every binary, as clap reads them.
/// [`Config`] is the validated result the rest of the crate uses.
#[derive(Debug, clap::Parser)]
#[command(version, args_override_self = true, after_help = LOGGING_HELP)]
struct Settings {
    /// RabbitMQ broker URL including the vhost; `amqps://` for TLS. Several
    /// nodes of one cluster as a comma-separated list of URLs: each
    /// (re)connection picks a live one in random order.
    #[arg(long, env = "AMQP_URL", value_name = "URL[,URL...]", default_value = DEFAULT_AMQP_URL)]
    amqp_url: String,
    /// Redis URL (`redis://`, `rediss://` for TLS), or a comma-separated
    /// list of nodes for a Redis Cluster.
    #[arg(long, env = "REDIS_URL", value_name = "URL", default_value = DEFAULT_REDIS_URL, value_parser = redis_url)]
    redis_url: String,
    /// Postgres URL of the ledger; `sslmode=verify-full` for TLS.
    #[arg(long, env = "DATABASE_URL", value_name = "URL", default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
    /// First segment of every Redis key (`pp:{pool}:meta`).
    #[arg(long, env = "REDIS_PREFIX", value_name = "TEXT", default_value = "pp")]
    redis_prefix: String,
    /// Deliveries a consumer may hold unacknowledged (count, ≥ 1).
    #[arg(long, env = "PREFETCH", value_name = "COUNT", default_value_t = DEFAULT_PREFETCH,
          value_parser = clap::value_parser!(u16).range(1..))]
    prefetch: u16,
    /// Deliveries a worker handles at once (count, ≥ 1).
    #[arg(long, env = "CONCURRENCY", value_name = "COUNT", default_value_t = 128,
          value_parser = clap::value_parser!(u64).range(1..=65_535))]
    concurrency: u64,
    /// Deliveries of one message before the broker dead-letters it (count, ≥ 1).
    #[arg(long, env = "DELIVERY_LIMIT", value_name = "COUNT", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..))]
    delivery_limit: u32,
    /// Quorum queues the draw requests are spread over (count, 1–16; 1 is
    /// the single `prizepool.draw`).
    #[arg(long, env = "DRAW_SHARDS", value_name = "COUNT", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=MAX_DRAW_SHARDS as i64))]
    draw_shards: u16,
    /// Ledger entries written per transaction at most (count, ≥ 1).
    #[arg(long, env = "SETTLE_BATCH_SIZE", value_name = "COUNT", default_value_t = 500,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    settle_batch_size: u64,
    /// How long a settle batch waits to fill up (milliseconds).
    #[arg(
        long,
        env = "SETTLE_BATCH_WAIT_MS",
        value_name = "MS",
        default_value_t = 20
    )]
    settle_batch_wait_ms: u64,
    /// Prizes pushed to Redis per Lua step while stocking (count, 1..=4000).
    #[arg(long, env = "REFILL_CHUNK", value_name = "COUNT", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(1..=MAX_REFILL_CHUNK))]
    refill_chunk: u64,
    /// How long a draw waits for a refill before `pool_exhausted` (milliseconds).
    #[arg(
        long,
        env = "SHORT_POOL_WAIT_MS",
        value_name = "MS",
        default_value_t = 3000
    )]
    short_pool_wait_ms: u64,
    /// Most draws one `draw.batch` message may carry (1..=1000; the message
    /// is held to 64 KiB as well).
    #[arg(long, env = "MAX_BATCH", value_name = "COUNT", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=1000))]
    max_batch: u64,
    /// How long results are kept for idempotent replays (seconds, ≥ 86400).
    #[arg(long, env = "RESULT_TTL_S", value_name = "SECONDS", default_value_t = 90_000,
          value_parser = clap::value_parser!(u64).range(MIN_RESULT_TTL_S..))]
    result_ttl_s: u64,
    /// How long a message may fail for a transient cause (a server away) before each hand-back to its retry queue is logged as an error instead of a warning; the message is retried until the server is back (milliseconds).
    #[arg(
        long,
        env = "TRANSIENT_RETRY_MS",
        value_name = "MS",
        default_value_t = 30_000
    )]
    transient_retry_ms: u64,
    /// How long in-flight work may take after SIGTERM (milliseconds).
    #[arg(
        long,
        env = "SHUTDOWN_GRACE_MS",
        value_name = "MS",
        default_value_t = 10_000
    )]
    shutdown_grace_ms: u64,
    /// How `draw.completed` events leave: grouped, each or off.
    #[arg(long, env = "DRAW_EVENTS", value_name = "MODE", default_value_t = DrawEvents::Grouped)]
    draw_events: DrawEvents,
    /// Run the draw worker under Linux's SCHED_BATCH policy (true/false).
    #[arg(long, env = "SCHED_BATCH", value_name = "BOOL", default_value_t = false,
          action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    sched_batch: bool,
    /// Address (ip:port) of `/metrics`, `/healthz`, `/readyz`; empty turns it off.
    #[arg(long, env = "METRICS_ADDR", value_name = "ADDR", default_value = DEFAULT_METRICS_ADDR,
          value_parser = metrics_addr)]
    metrics_addr: String,
    /// How often a worker pings Redis and Postgres for `/readyz` (milliseconds, ≥ 100).
    #[arg(long, env = "HEALTH_CHECK_INTERVAL_MS", value_name = "MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(100..))]
    health_check_interval_ms: u64,
    /// How long a worker with deliveries in hand may answer none while Redis
    /// and Postgres answer its pings before `/healthz` and `/readyz` report
    /// it stalled (milliseconds, ≥ 1000).
    #[arg(long, env = "STALL_AFTER_MS", value_name = "MS", default_value_t = 60_000,
          value_parser = clap::value_parser!(u64).range(1000..))]
    stall_after_ms: u64,
    /// Secret that seals the ledger entries the fleet publishes itself (the
    /// same for every worker); unset: a random key kept in Redis under
    /// `<REDIS_PREFIX>:ledger-seal-key`.
    #[arg(long, env = "LEDGER_SEAL_KEY", value_name = "TEXT")]
    ledger_seal_key: Option<String>,
    /// PEM file of the CA(s) that sign the servers' certificates (RabbitMQ,
    /// Redis, Postgres); unset: the system's roots.
    #[arg(long, env = "TLS_CA_FILE", value_name = "PATH")]
    tls_ca_file: Option<PathBuf>,
    /// PEM client certificate presented to TLS servers (with TLS_KEY_FILE).
    #[arg(
        long,
        env = "TLS_CERT_FILE",
        value_name = "PATH",
        requires = "tls_key_file"
    )]
    tls_cert_file: Option<PathBuf>,
    /// PEM private key of TLS_CERT_FILE.
    #[arg(
        long,
        env = "TLS_KEY_FILE",
        value_name = "PATH",
        requires = "tls_cert_file"
    )]
    tls_key_file: Option<PathBuf>,
    /// OTLP/HTTP collector that receives traces (base URL, e.g.
    /// `http://otel-collector:4318`; spans go to `<URL>/v1/traces`; http://
    /// only); unset: no trace export. The W3C trace context travels in AMQP
    /// headers.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL", value_parser = otlp_endpoint)]
    otel_exporter_otlp_endpoint: Option<String>,
}

fn otlp_endpoint(value: &str) -> Result<String, String> {
    let parsed = url::Url::parse(value.trim()).map_err(|e| format!("not a URL: {e}"))?;
    // The exporter is built without a TLS stack: traces go to a collector
    // next to the worker (a sidecar or the node's agent), which forwards
    // them. An https:// URL is refused rather than sent in plaintext.
    match parsed.scheme() {
        "http" => Ok(value.trim().to_owned()),
        other => Err(format!(
            "{other}:// is not supported (OTLP/HTTP to a nearby collector: http://host:4318)"
        )),
    }
}

fn redis_url(value: &str) -> Result<String, String> {
    // Without `tls-rustls-insecure` the client refuses it anyway; saying so
    // here names the variable before anything connects.
    if value.contains("#insecure") {
        return Err("#insecure (no certificate checks) is not supported".into());
    }
    Ok(value.to_owned())
}

fn metrics_addr(value: &str) -> Result<String, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(String::new());
    }
    value
        .parse::<SocketAddr>()
        .map(|_| value.to_owned())
        .map_err(|e| format!("{e} (expected ip:port, or empty to turn it off)"))
}

pub(super) enum Failure {
    /// Help, version, or a malformed command line: clap's own report.
    Exit(clap::Error),
    Invalid(ConfigError),
}

/// The command as `--help` shows it: every flag with its variable and
/// default. Values from the environment are never shown (they may hold
/// passwords).
pub(super) fn command(service: &'static str) -> clap::Command {
    Settings::command()
        .name(service)
        .mut_args(|a| a.hide_env_values(true))
}

/// Parses `args` with the environment read through `lookup`: each set
/// variable becomes its flag, placed before the real arguments so that a
/// flag on the command line wins. Clap's own environment reading is turned
/// off, so `lookup` is the only source and empty values can mean "unset".
pub(super) fn parse(
    args: impl IntoIterator<Item = OsString>,
    lookup: impl Fn(&str) -> Option<String>,
    service: &'static str,
) -> Result<Config, Failure> {
    let display = command(service);
    let mut args = args.into_iter();
    let mut argv: Vec<OsString> = vec![args.next().unwrap_or_else(|| service.into())];
    for arg in display.get_arguments() {
        let (Some(env), Some(long)) = (arg.get_env().and_then(|e| e.to_str()), arg.get_long())
        else {
            continue;
        };
        match lookup(env) {
            Some(value) if !value.is_empty() || env == "METRICS_ADDR" => {
                argv.push(format!("--{long}={value}").into());
            }
            _ => {}
        }
    }
    argv.extend(args);
    let parsing = display.clone().mut_args(|a| a.env(None));
    let matches = parsing
        .try_get_matches_from(argv)
        .map_err(|e| match e.kind() {
            clap::error::ErrorKind::InvalidValue
            | clap::error::ErrorKind::ValueValidation
            | clap::error::ErrorKind::ArgumentConflict
            | clap::error::ErrorKind::MissingRequiredArgument => {
                Failure::Invalid(variable_error(&display, &e))
            }
            _ => Failure::Exit(e),
        })?;
    let settings = Settings::from_arg_matches(&matches).map_err(Failure::Exit)?;
    settings.validate().map_err(Failure::Invalid)
}

/// Turns clap's report on one flag into an error naming its variable.
fn variable_error(cmd: &clap::Command, e: &clap::Error) -> ConfigError {
    let arg_text = match e.get(ContextKind::InvalidArg) {
        Some(clap::error::ContextValue::String(s)) => s.clone(),
        Some(clap::error::ContextValue::Strings(s)) => s.join(", "),
        _ => String::new(),
    };
    let name = cmd
        .get_arguments()
        .find(|a| {
            a.get_long().is_some_and(|l| {
                arg_text.starts_with(&format!("--{l} ")) || arg_text == format!("--{l}")
            })
        })
        .and_then(|a| a.get_env())
        .and_then(|e| e.to_str())
        .unwrap_or_default()
        .to_owned();
    let rendered = e.render().to_string();
    let reason = rendered
        .lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ")
        .to_owned();
    ConfigError::new(&name, reason)
}

impl Settings {
    fn validate(self) -> Result<Config, ConfigError> {
        let tls = TlsFiles {
            ca_file: self.tls_ca_file,
            cert_file: self.tls_cert_file,
            key_file: self.tls_key_file,
        };
        // Read the files now: a missing CA is a start-up error, not a
        // connection failure discovered later.
        tls.ca_pem()
            .map_err(|e| ConfigError::new("TLS_CA_FILE", format!("{e:#}")))?;
        tls.identity_pem()
            .map_err(|e| ConfigError::new("TLS_CERT_FILE", format!("{e:#}")))?;
        let database_url = with_postgres_tls(&self.database_url, &tls)?;
        let usize_of = |name: &str, v: u64| {
            usize::try_from(v).map_err(|e| ConfigError::new(name, e.to_string()))
        };
        Ok(Config {
            amqp_url: self.amqp_url,
            redis_url: self.redis_url,
            database_url,
            redis_prefix: self.redis_prefix,
            prefetch: self.prefetch,
            concurrency: usize_of("CONCURRENCY", self.concurrency)?,
            delivery_limit: self.delivery_limit,
            draw_shards: self.draw_shards,
            settle_batch_size: usize_of("SETTLE_BATCH_SIZE", self.settle_batch_size)?,
            settle_batch_wait: Duration::from_millis(self.settle_batch_wait_ms),
            refill_chunk: usize_of("REFILL_CHUNK", self.refill_chunk)?,
            short_pool_wait: Duration::from_millis(self.short_pool_wait_ms),
            max_batch: usize_of("MAX_BATCH", self.max_batch)?,
            result_ttl: Duration::from_secs(self.result_ttl_s),
            transient_retry: Duration::from_millis(self.transient_retry_ms),
            shutdown_grace: Duration::from_millis(self.shutdown_grace_ms),
            draw_events: self.draw_events,
            sched_batch: self.sched_batch,
            metrics_addr: (!self.metrics_addr.is_empty()).then_some(self.metrics_addr),
            health_check_interval: Duration::from_millis(self.health_check_interval_ms),
            stall_after: Duration::from_millis(self.stall_after_ms),
            tls,
            ledger_seal_key: self.ledger_seal_key.filter(|k| !k.is_empty()).map(SealKey),
            otel_endpoint: self.otel_exporter_otlp_endpoint,
        })
    }
}
