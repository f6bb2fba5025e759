//! The draw worker: consumes `prizepool.draw` until SIGTERM or SIGINT.

use anyhow::Context;
use prizepool::{config::Config, ops::Health, shutdown, telemetry};

// A worker allocates small buffers for every message; mimalloc spends far
// less CPU on them than the system allocator (see docs/performance.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// One thread: a draw is short and I/O bound, and waking other runtime threads
// cost more CPU than it saved (docs/performance.md). Scale with replicas.
#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    telemetry::init("draw-worker", "info");
    let config = Config::from_env().context("reading configuration")?;
    // On the runtime's only thread, before any other thread starts.
    if config.sched_batch {
        match prizepool::ops::batch_scheduling() {
            Ok(()) => tracing::info!("running under SCHED_BATCH"),
            Err(error) => tracing::warn!(%error, "SCHED_BATCH not applied"),
        }
    }
    let shutdown = shutdown::signal();
    let health = Health::default();
    prizepool::start_ops(&config, &health, &shutdown).await;
    prizepool::draw::run(config, health, shutdown).await?;
    tracing::info!("stopped");
    Ok(())
}
