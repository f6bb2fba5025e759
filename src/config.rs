//! Runtime configuration, read once at start-up from the environment (and,
//! for the worker binaries, from command-line flags that override it).
//!
//! One typed description, [`Settings`], drives everything: parsing, range
//! checks, defaults and the `--help` text, which lists every variable with
//! its default and unit. Every setting has a default that points at the
//! local services, so a newcomer can run `prizepool demo` without exporting
//! anything. Errors name the variable that is malformed; an empty variable
//! counts as unset (except `METRICS_ADDR`, where empty turns the endpoint off).

use std::{
    ffi::OsString,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::ExitCode,
    str::FromStr,
    time::Duration,
};

use clap::{error::ContextKind, CommandFactory, FromArgMatches};

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
    /// How long transient failures are retried quietly before each retry is logged as an error; the delivery is kept until the server is back (milliseconds).
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

/// Certificate files for TLS connections to RabbitMQ, Redis and Postgres.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TlsFiles {
    /// `TLS_CA_FILE`: PEM bundle of trusted CAs; `None`: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// `TLS_CERT_FILE`: PEM client certificate (chain).
    pub cert_file: Option<PathBuf>,
    /// `TLS_KEY_FILE`: PEM private key of the client certificate.
    pub key_file: Option<PathBuf>,
}

impl TlsFiles {
    /// Reads `TLS_CA_FILE`, `TLS_CERT_FILE` and `TLS_KEY_FILE` from the
    /// process environment (empty counts as unset). Connections made from
    /// library code use this; [`Config::tls`] holds the same, checked.
    pub fn from_env() -> Self {
        let path = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        Self {
            ca_file: path("TLS_CA_FILE"),
            cert_file: path("TLS_CERT_FILE"),
            key_file: path("TLS_KEY_FILE"),
        }
    }

    /// The CA bundle's PEM text, if one is configured.
    pub fn ca_pem(&self) -> anyhow::Result<Option<Vec<u8>>> {
        self.ca_file.as_deref().map(read_pem).transpose()
    }

    /// The client certificate and key as PEM, if configured.
    pub fn identity_pem(&self) -> anyhow::Result<Option<(Vec<u8>, Vec<u8>)>> {
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Ok(Some((read_pem(cert)?, read_pem(key)?))),
            (None, None) => Ok(None),
            _ => anyhow::bail!("TLS_CERT_FILE and TLS_KEY_FILE go together"),
        }
    }
}

/// The TLS files a worker binary configured; library code that connects
/// without a [`Config`] at hand reads them through [`TlsFiles::current`].
static INSTALLED_TLS: std::sync::OnceLock<TlsFiles> = std::sync::OnceLock::new();

impl TlsFiles {
    /// Makes these the files every later connection uses (first call wins).
    pub fn install(&self) {
        let _ = INSTALLED_TLS.set(self.clone());
    }

    /// The installed files, or else those the environment names.
    pub fn current() -> Self {
        INSTALLED_TLS.get().cloned().unwrap_or_else(Self::from_env)
    }

    /// The files in lapin's form. The CA bundle is trusted besides the
    /// system's roots; the client key may be PKCS#8, PKCS#1 or SEC1 PEM.
    pub fn amqp(&self) -> anyhow::Result<lapin::tcp::OwnedTLSConfig> {
        let cert_chain = self
            .ca_pem()?
            .map(|pem| {
                String::from_utf8(pem).map_err(|_| anyhow::anyhow!("TLS_CA_FILE is not text"))
            })
            .transpose()?;
        let identity = self
            .identity_pem()?
            .map(|(pem, key)| lapin::tcp::OwnedIdentity::PKCS8 { pem, key });
        Ok(lapin::tcp::OwnedTLSConfig {
            identity,
            cert_chain,
        })
    }

    /// The files in redis-rs's form. A CA bundle replaces the system's roots.
    pub fn redis(&self) -> anyhow::Result<redis::TlsCertificates> {
        Ok(redis::TlsCertificates {
            client_tls: self.identity_pem()?.map(|(client_cert, client_key)| {
                redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                }
            }),
            root_cert: self.ca_pem()?,
        })
    }
}

fn read_pem(path: &Path) -> anyhow::Result<Vec<u8>> {
    let bytes =
        std::fs::read(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        anyhow::bail!("{} holds no PEM block", path.display());
    }
    Ok(bytes)
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
            "ledger_seal_key": if self.ledger_seal_key.is_some() { "set" } else { "unset: kept in Redis" },
            "tls": self.tls,
            "otel_exporter_otlp_endpoint": self.otel_endpoint.as_deref().map(redact),
        })
    }
}

enum Failure {
    /// Help, version, or a malformed command line: clap's own report.
    Exit(clap::Error),
    Invalid(ConfigError),
}

/// The command as `--help` shows it: every flag with its variable and
/// default. Values from the environment are never shown (they may hold
/// passwords).
fn command(service: &'static str) -> clap::Command {
    Settings::command()
        .name(service)
        .mut_args(|a| a.hide_env_values(true))
}

/// Parses `args` with the environment read through `lookup`: each set
/// variable becomes its flag, placed before the real arguments so that a
/// flag on the command line wins. Clap's own environment reading is turned
/// off, so `lookup` is the only source and empty values can mean "unset".
fn parse(
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
            tls,
            ledger_seal_key: self.ledger_seal_key.filter(|k| !k.is_empty()).map(SealKey),
            otel_endpoint: self.otel_exporter_otlp_endpoint,
        })
    }
}

/// Carries the TLS files into a Postgres URL that names none of its own, so
/// every connection made from `database_url` (pools opened lazily
/// included) verifies the server the same way.
fn with_postgres_tls(url: &str, tls: &TlsFiles) -> Result<String, ConfigError> {
    if tls == &TlsFiles::default() {
        return Ok(url.to_owned());
    }
    let mut parsed = url::Url::parse(url)
        .map_err(|e| ConfigError::new("DATABASE_URL", format!("not a URL: {e}")))?;
    let present: Vec<String> = parsed.query_pairs().map(|(k, _)| k.into_owned()).collect();
    let has = |key: &str| present.iter().any(|k| k == key);
    let mut add: Vec<(&str, String)> = Vec::new();
    if let Some(ca) = &tls.ca_file {
        if !has("sslrootcert") {
            add.push(("sslrootcert", ca.display().to_string()));
        }
        if !has("sslmode") {
            add.push(("sslmode", "verify-full".into()));
        }
    }
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        if !has("sslcert") {
            add.push(("sslcert", cert.display().to_string()));
            add.push(("sslkey", key.display().to_string()));
        }
    }
    if !add.is_empty() {
        let mut pairs = parsed.query_pairs_mut();
        for (k, v) in add {
            pairs.append_pair(k, &v);
        }
    }
    Ok(parsed.to_string())
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

#[cfg(test)]
mod tests {
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
