//! The settle worker: consumes `prizepool.settle` until SIGTERM or SIGINT.
//! `settle-worker --help` lists every setting and its environment variable.

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

const SERVICE: &str = "settle-worker";
const ABOUT: &str =
    "Consumes prizepool.settle: applies ledger entries to Postgres in batches, idempotently.";

#[tokio::main]
async fn main() -> ExitCode {
    telemetry::init(SERVICE, telemetry::WORKER_LOG_FILTER);
    let config = match Config::from_args(SERVICE, ABOUT) {
        Ok(config) => config,
        Err(exit) => return exit,
    };
    let needs = [Dependency::Broker, Dependency::Postgres];
    ops::run_worker(SERVICE, config, &needs, prizepool::settle::run).await
}
