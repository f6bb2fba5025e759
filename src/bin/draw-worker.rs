//! The draw worker: consumes `prizepool.draw` until SIGTERM or SIGINT.
//! `draw-worker --help` lists every setting and its environment variable.

use std::process::ExitCode;

mod worker;

// A worker allocates small buffers for every message; mimalloc spends far
// less CPU on them than the system allocator (see docs/performance.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    worker::Worker::Draw.main()
}
