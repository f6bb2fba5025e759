//! The settle worker: consumes `prizepool.settle` until SIGTERM or SIGINT.
//! `settle-worker --help` lists every setting and its environment variable.

use std::process::ExitCode;

mod worker;

// A worker allocates small buffers for every message; mimalloc spends far
// less CPU on them than the system allocator (see docs/performance.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    worker::Worker::Settle.main()
}
