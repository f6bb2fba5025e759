//! The Redis connection every component shares: multiplexed, cheap to clone,
//! reconnecting by itself after a failure.

use anyhow::Context;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

/// Opens a managed connection to `url`.
pub async fn connect(url: &str) -> anyhow::Result<ConnectionManager> {
    let client = redis::Client::open(url).with_context(|| format!("parsing REDIS_URL {url}"))?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(std::time::Duration::from_secs(5)))
        .set_response_timeout(Some(std::time::Duration::from_secs(5)))
        .set_max_delay(std::time::Duration::from_secs(2));
    ConnectionManager::new_with_config(client, config)
        .await
        .with_context(|| format!("connecting to Redis at {url}"))
}
