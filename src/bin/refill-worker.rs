//! The refill worker: consumes `prizepool.refill` until SIGTERM or SIGINT.

use anyhow::Context;
use prizepool::{config::Config, ops::Health, shutdown, telemetry};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::init("refill-worker", "info");
    let config = Config::from_env().context("reading configuration")?;
    let shutdown = shutdown::signal();
    let health = Health::default();
    prizepool::start_ops(&config, &health, &shutdown).await;
    prizepool::refill::run(config, health, shutdown).await?;
    tracing::info!("stopped");
    Ok(())
}
