//! The settle worker: consumes `prizepool.settle` until SIGTERM or SIGINT.

use anyhow::Context;
use prizepool::{config::Config, ops::Health, shutdown, telemetry};

// A worker allocates small buffers for every message; mimalloc spends far
// less CPU on them than the system allocator (see docs/performance.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::init("settle-worker", "info");
    let config = Config::from_env().context("reading configuration")?;
    let shutdown = shutdown::signal();
    let health = Health::default();
    prizepool::start_ops(&config, &health, &shutdown).await;
    prizepool::settle::run(config, health, shutdown).await?;
    tracing::info!("stopped");
    Ok(())
}
