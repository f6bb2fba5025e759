//! The Redis connection every component shares: multiplexed, cheap to clone,
//! reconnecting by itself after a failure. `REDIS_URL` names one server, or a
//! Redis Cluster as a comma-separated list of nodes
//! (`redis://10.0.0.1:7000,redis://10.0.0.2:7000`). Every Lua step touches
//! the keys of one pool, which share a hash tag, so it runs on one node.
//!
//! A cluster connection that stops answering while the cluster answers is
//! replaced (see [`ClusterConn`]).

use std::{
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex, RwLock,
    },
    time::Duration,
};

use anyhow::Context;
use futures_util::FutureExt;

use crate::config::TlsFiles;
use redis::{
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    Cmd, Pipeline, RedisFuture, RedisResult, Value,
};

/// A connection to one Redis server or to a Redis Cluster.
#[derive(Clone)]
pub enum RedisConn {
    /// One server, through a reconnecting manager.
    Single(ConnectionManager),
    /// A cluster; the client follows MOVED/ASK and reconnects by itself,
    /// and the connection is replaced if it stops answering.
    Cluster(ClusterConn),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "RedisConn::Single",
            Self::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// How long a cluster call may wait for its answer, retries included.
const CLUSTER_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a cluster connection with calls in flight may go without
/// answering any before it is probed with a `PING` (see [`ClusterConn`]).
const SILENT_FOR: Duration = Duration::from_millis(500);

/// How long the probe's `PING`, through the connection, may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// How often the connection is checked for silence.
const CHECK_EVERY: Duration = Duration::from_millis(100);

/// The least time between two replacements of a cluster connection.
const RENEW_AT_MOST_EVERY: Duration = Duration::from_secs(1);

/// A Redis Cluster connection that replaces itself when it stops answering.
///
/// redis-rs's cluster connection runs every call through one task, which
/// also refreshes the slot map after a node fails; while it refreshes it
/// sends no call. Under load, a refresh begun during a failover can wait
/// for ever (`beginning slot refresh` logged, `slot refresh complete`
/// never: every network step of a refresh has a timeout, its wait for the
/// lock on the client's map of connections has none), and from then on
/// every call times out, while every node answers.
///
/// So a task beside the connection watches it: when calls are in flight
/// and none has been answered (with a result or an error) for
/// [`SILENT_FOR`], it sends a `PING` through the connection. A connection
/// that does not answer that within [`PROBE_TIMEOUT`] is replaced: a new
/// one is opened to the configured nodes, and once it answers a `PING`
/// (the cluster is up) later calls go through it. The calls still waiting
/// on the old one fail at once (a transient error: the worker tries them
/// again, through the new one), and the old one ends. A cluster that is itself away
/// is not hidden: the new connection fails and the old one is kept. At
/// most one replacement runs at a time, one every [`RENEW_AT_MOST_EVERY`]
/// at most. Each replacement logs a warning and counts
/// `prizepool_redis_connections_replaced_total`.
#[derive(Clone)]
pub struct ClusterConn {
    shared: Arc<Renewable>,
}

impl std::fmt::Debug for ClusterConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterConn")
            .field("in_flight", &self.shared.in_flight.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

struct Renewable {
    client: ClusterClient,
    current: RwLock<ClusterConnection>,
    /// Calls in flight on this connection (whichever its current one).
    in_flight: AtomicUsize,
    /// Milliseconds since `born` of the last answer, or of the last call
    /// sent while none was in flight.
    heard_at: AtomicU64,
    born: tokio::time::Instant,
    /// When the last replacement began; `None` while one runs.
    last_renewal: Mutex<Option<tokio::time::Instant>>,
    /// Bumped at each replacement: the calls still waiting on the old
    /// connection fail at once rather than at their timeout.
    replaced: tokio::sync::watch::Sender<u64>,
}

impl Renewable {
    fn now(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn heard(&self) {
        self.heard_at.store(self.now(), Ordering::Relaxed);
    }

    /// How long calls have been in flight without an answer, if any are.
    fn silent_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let since = self.heard_at.load(Ordering::Relaxed);
        Some(Duration::from_millis(self.now().saturating_sub(since)))
    }

    fn current(&self) -> ClusterConnection {
        // A poisoned lock still holds a usable connection.
        match self.current.read() {
            Ok(conn) => conn.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

/// One call in flight, counted until it ends or is dropped.
struct Call<'a> {
    shared: &'a Renewable,
}

impl<'a> Call<'a> {
    fn begin(shared: &'a Renewable) -> Self {
        if shared.in_flight.fetch_add(1, Ordering::Relaxed) == 0 {
            shared.heard();
        }
        Self { shared }
    }

    /// Records a call's result: anything but a timeout is an answer.
    fn ended<T>(self, result: &RedisResult<T>) {
        if !result.as_ref().is_err_and(redis::RedisError::is_timeout) {
            self.shared.heard();
        }
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ClusterConn {
    /// Opens the first connection of `client` and starts its watch.
    async fn open(client: ClusterClient) -> RedisResult<Self> {
        let conn = client.get_async_connection().await?;
        let shared = Arc::new(Renewable {
            client,
            current: RwLock::new(conn),
            in_flight: AtomicUsize::new(0),
            heard_at: AtomicU64::new(0),
            born: tokio::time::Instant::now(),
            last_renewal: Mutex::new(Some(tokio::time::Instant::now())),
            replaced: tokio::sync::watch::Sender::new(0),
        });
        tokio::spawn(watch(Arc::downgrade(&shared)));
        Ok(Self { shared })
    }
}

/// Checks the connection every [`CHECK_EVERY`] until it is dropped.
async fn watch(shared: std::sync::Weak<Renewable>) {
    let mut timer = tokio::time::interval(CHECK_EVERY);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        timer.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let Some(silence) = shared.silent_for() else {
            continue;
        };
        if silence < SILENT_FOR {
            continue;
        }
        let mut conn = shared.current();
        let probe = tokio::time::timeout(
            PROBE_TIMEOUT,
            redis::cmd("PING").query_async::<String>(&mut conn),
        )
        .await;
        match probe {
            // It answers (a PING error is an answer too): calls are slow,
            // or wait for a node that is away, not for the client.
            Ok(_) => shared.heard(),
            Err(_) => renew(&shared, silence).await,
        }
    }
}

/// Replaces the connection, unless a replacement began less than
/// [`RENEW_AT_MOST_EVERY`] ago.
async fn renew(shared: &Renewable, silence: Duration) {
    {
        let Ok(mut last) = shared.last_renewal.lock() else {
            return;
        };
        match *last {
            Some(at) if at.elapsed() >= RENEW_AT_MOST_EVERY => *last = None,
            _ => return,
        }
    }
    tracing::warn!(
        ?silence,
        in_flight = shared.in_flight.load(Ordering::Relaxed),
        "the Redis Cluster connection answers nothing, not even a PING; opening a new one"
    );
    let fresh = tokio::time::timeout(CLUSTER_RESPONSE_TIMEOUT, async {
        let mut conn = shared.client.get_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await?;
        RedisResult::Ok(conn)
    })
    .await;
    match fresh {
        Ok(Ok(conn)) => {
            match shared.current.write() {
                Ok(mut current) => *current = conn,
                Err(poisoned) => *poisoned.into_inner() = conn,
            }
            shared.heard();
            shared.replaced.send_modify(|n| *n += 1);
            metrics::counter!("prizepool_redis_connections_replaced_total").increment(1);
            tracing::warn!("the Redis Cluster connection was replaced by a new one that answers");
        }
        Ok(Err(error)) => tracing::warn!(
            error = crate::db::redact_text(&error.to_string()),
            "a new Redis Cluster connection failed; keeping the silent one"
        ),
        Err(_) => tracing::warn!(
            "a new Redis Cluster connection did not answer in time; keeping the silent one"
        ),
    }
    if let Ok(mut last) = shared.last_renewal.lock() {
        *last = Some(tokio::time::Instant::now());
    }
}

impl ClusterConn {
    /// Runs `call` on the current connection, counted as in flight; it
    /// fails at once if the connection is replaced meanwhile (the call may
    /// or may not have run, as after a timeout: every step is idempotent).
    async fn call<'a, T>(
        &'a self,
        call: impl FnOnce(ClusterConnection) -> RedisFuture<'a, T>,
    ) -> RedisResult<T> {
        let mut replaced = self.shared.replaced.subscribe();
        let counted = Call::begin(&self.shared);
        let result = tokio::select! {
            result = call(self.shared.current()) => result,
            _ = replaced.changed() => Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the Redis Cluster connection stopped answering and was replaced",
            ))),
        };
        counted.ended(&result);
        result
    }
}

impl ConnectionLike for ClusterConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        async move {
            self.call(move |mut conn| async move { conn.req_packed_command(cmd).await }.boxed())
                .await
        }
        .boxed()
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        async move {
            self.call(move |mut conn| {
                async move { conn.req_packed_commands(pipeline, offset, count).await }.boxed()
            })
            .await
        }
        .boxed()
    }

    fn get_db(&self) -> i64 {
        0
    }
}

/// Opens a connection to `url`: one server, or a cluster when `url` lists
/// several nodes separated by commas. `rediss://` nodes use TLS with the
/// configured files ([`TlsFiles::current`]).
pub async fn connect(url: &str) -> anyhow::Result<RedisConn> {
    connect_with(url, &TlsFiles::current()).await
}

/// [`connect`] with explicit TLS files. A `rediss://` URL always means TLS
/// with certificate and host name checks: redis-rs is built without its
/// `insecure` mode, and a plain `redis://` node in a TLS cluster is refused.
pub async fn connect_with(url: &str, tls: &TlsFiles) -> anyhow::Result<RedisConn> {
    let shown = crate::db::redact(url);
    let nodes: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect();
    let secure = nodes.iter().filter(|n| n.starts_with("rediss://")).count();
    if secure != 0 && secure != nodes.len() {
        anyhow::bail!("REDIS_URL {shown} mixes rediss:// and plain nodes");
    }
    let certificates = || tls.redis().context("loading the TLS files for Redis");
    if nodes.len() > 1 {
        // The client's own retries are few and short: a call to a node that
        // is down fails within tens of milliseconds, so the worker's retry
        // in its slot and its hand-back (`amqp::consumer::delivery`) decide
        // what waits for the failover, not a client that would hold the
        // call (and a worker slot) for its whole response timeout. Three
        // retries still follow a MOVED and an ASK of a slot being moved.
        let mut builder = ClusterClient::builder(nodes)
            .connection_timeout(std::time::Duration::from_secs(5))
            .response_timeout(CLUSTER_RESPONSE_TIMEOUT)
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(100);
        if secure != 0 {
            builder = builder.certs(certificates()?);
        }
        // The parse error may quote a node's URL: report it redacted.
        let client = builder
            .build()
            .map_err(|e| anyhow::anyhow!(crate::db::redact_text(&e.to_string())))
            .with_context(|| format!("parsing REDIS_URL {shown}"))?;
        let conn = ClusterConn::open(client)
            .await
            .map_err(|e| anyhow::anyhow!(crate::db::redact_text(&e.to_string())))
            .with_context(|| format!("connecting to the Redis Cluster at {shown}"))?;
        return Ok(RedisConn::Cluster(conn));
    }
    let client = if secure != 0 {
        redis::Client::build_with_tls(url, certificates()?)
    } else {
        redis::Client::open(url)
    }
    .map_err(|e| anyhow::anyhow!(crate::db::redact_text(&e.to_string())))
    .with_context(|| format!("parsing REDIS_URL {shown}"))?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(std::time::Duration::from_secs(5)))
        .set_response_timeout(Some(std::time::Duration::from_secs(5)))
        .set_max_delay(std::time::Duration::from_secs(2));
    ConnectionManager::new_with_config(client, config)
        .await
        .map(RedisConn::Single)
        .map_err(|e| anyhow::anyhow!(crate::db::redact_text(&e.to_string())))
        .with_context(|| format!("connecting to Redis at {shown}"))
}

/// How a Redis server keeps its writes, as far as it tells (`CONFIG GET`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Persistence {
    /// `appendonly yes` with `appendfsync always`: a Lua step's writes reach
    /// the disk before its reply, so a crash loses nothing answered.
    Durable,
    /// Anything else: what a crash can lose (see `docs/design.md`, Durability).
    Lossy(String),
    /// The server does not say (`CONFIG` disabled, a managed service).
    Unknown(String),
}

/// Reads the persistence settings of the server behind `conn` (on a
/// cluster, of the node the client picks).
pub async fn persistence(conn: &mut RedisConn) -> Persistence {
    let reply: Result<Vec<String>, _> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("append*")
        .query_async(conn)
        .await;
    let fields = match reply {
        Ok(fields) => fields,
        Err(e) => return Persistence::Unknown(crate::db::redact_text(&e.to_string())),
    };
    let get = |name: &str| {
        fields
            .chunks(2)
            .find(|kv| kv.first().map(String::as_str) == Some(name))
            .and_then(|kv| kv.get(1).cloned())
            .unwrap_or_default()
    };
    let (appendonly, fsync) = (get("appendonly"), get("appendfsync"));
    if appendonly == "yes" && fsync == "always" {
        Persistence::Durable
    } else {
        Persistence::Lossy(format!(
            "appendonly {appendonly}, appendfsync {fsync}: a crash can lose answered draws (zero loss needs appendonly yes and appendfsync always)"
        ))
    }
}

/// Calls per command since the server's last `CONFIG RESETSTAT` (`INFO
/// commandstats`), most called first; the `INFO` and `CONFIG RESETSTAT` that
/// measure them are left out. On a Redis Cluster, the node the connection
/// reports on.
pub async fn command_calls<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
) -> redis::RedisResult<Vec<(String, u64)>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let mut out: Vec<(String, u64)> = info
        .lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .filter(|(name, _)| name != "info" && name != "config|resetstat")
        .collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(out)
}

/// Resets the server's statistics (`CONFIG RESETSTAT`), so
/// [`command_calls`] counts from here.
pub async fn reset_stats<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
) -> redis::RedisResult<()> {
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(conn)
        .await
}

/// The server's `used_memory` (`INFO memory`), in bytes.
pub async fn used_memory<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
) -> anyhow::Result<u64> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("INFO memory has no used_memory"))
}
