//! The Redis connection every component shares: multiplexed, cheap to clone,
//! reconnecting by itself after a failure. `REDIS_URL` names one server, or a
//! Redis Cluster as a comma-separated list of nodes
//! (`redis://10.0.0.1:7000,redis://10.0.0.2:7000`). Every Lua step touches
//! the keys of one pool, which share a hash tag, so it runs on one node.

use anyhow::Context;
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
/// several nodes separated by commas.
pub async fn connect(url: &str) -> anyhow::Result<RedisConn> {
    let nodes: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .collect();
    if nodes.len() > 1 {
        let client =
            ClusterClient::new(nodes).with_context(|| format!("parsing REDIS_URL {url}"))?;
        let conn = client
            .get_async_connection()
            .await
            .with_context(|| format!("connecting to the Redis Cluster at {url}"))?;
        return Ok(RedisConn::Cluster(conn));
    }
    let client = redis::Client::open(url).with_context(|| format!("parsing REDIS_URL {url}"))?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(std::time::Duration::from_secs(5)))
        .set_response_timeout(Some(std::time::Duration::from_secs(5)))
        .set_max_delay(std::time::Duration::from_secs(2));
    ConnectionManager::new_with_config(client, config)
        .await
        .map(RedisConn::Single)
        .with_context(|| format!("connecting to Redis at {url}"))
}
