//! The draw worker: consumes `prizepool.draw` until SIGTERM or SIGINT.
//! `draw-worker --help` lists every setting and its environment variable.

use std::process::ExitCode;

use prizepool::{
    config::Config,
    ops::{self, Dependency},
    telemetry,
};

// A worker allocates small buffers for every message; mimalloc spends far
// less CPU on them than the system allocator (see docs/performance.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SERVICE: &str = "draw-worker";
const ABOUT: &str =
    "Consumes prizepool.draw: lucky-gift draws, red-packet grabs, lottery draws and chance grants.";

// One thread: a draw is short and I/O bound, and waking other runtime threads
// cost more CPU than it saved (docs/performance.md). Scale with replicas.
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    telemetry::init(SERVICE, telemetry::WORKER_LOG_FILTER);
    let config = match Config::from_args(SERVICE, ABOUT) {
        Ok(config) => config,
        Err(exit) => return exit,
    };
    // On the runtime's only thread, before any other thread starts.
    if config.sched_batch {
        match ops::batch_scheduling() {
            Ok(()) => tracing::info!("running under SCHED_BATCH"),
            Err(error) => tracing::warn!(%error, "SCHED_BATCH not applied"),
        }
    }
    let needs = [Dependency::Broker, Dependency::Redis];
    ops::run_worker(SERVICE, config, &needs, prizepool::draw::run).await
}
