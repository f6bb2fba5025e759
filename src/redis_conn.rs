//! The Redis connection every component shares: multiplexed, cheap to clone,
//! reconnecting by itself after a failure. `REDIS_URL` names one server, or a
//! Redis Cluster as a comma-separated list of nodes
//! (`redis://10.0.0.1:7000,redis://10.0.0.2:7000`). Every Lua step touches
//! the keys of one pool, which share a hash tag, so it runs on one node.

use anyhow::Context;

use crate::config::TlsFiles;
use redis::{
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    Cmd, Pipeline, RedisFuture, Value,
};

/// A connection to one Redis server or to a Redis Cluster.
#[derive(Clone)]
pub enum RedisConn {
    /// One server, through a reconnecting manager.
    Single(ConnectionManager),
    /// A cluster; the client follows MOVED/ASK and reconnects by itself.
    Cluster(ClusterConnection),
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
            .response_timeout(std::time::Duration::from_secs(5))
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
        let conn = client
            .get_async_connection()
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
