//! The three workers' entry points, shared by their own binaries
//! (`draw-worker`, `refill-worker`, `settle-worker`) and by `prizepool`,
//! which runs a worker when it is invoked under that worker's name (the
//! release image ships `prizepool` alone, with the workers' names as links
//! to it).

use std::{ffi::OsStr, path::Path, process::ExitCode};

use prizepool::{
    config::Config,
    ops::{self, Dependency},
    telemetry,
};

/// A worker kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Worker {
    Draw,
    Refill,
    Settle,
}

impl Worker {
    /// The worker's name: its binary, its log `service` and its metrics'
    /// `worker` label.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Draw => "draw-worker",
            Self::Refill => "refill-worker",
            Self::Settle => "settle-worker",
        }
    }

    fn about(self) -> &'static str {
        match self {
            Self::Draw => "Consumes prizepool.draw: lucky-gift draws, red-packet grabs, lottery draws and chance grants.",
            Self::Refill => "Consumes prizepool.refill: stocks lucky-gift batches, creates and expires red packets.",
            Self::Settle => "Consumes prizepool.settle: applies ledger entries to Postgres in batches, idempotently.",
        }
    }

    /// The worker a program was invoked as: `argv[0]`'s file name, with or
    /// without a directory (`draw-worker`, `/usr/local/bin/draw-worker`).
    // Each worker's own binary runs its kind whatever its name: only
    // `prizepool` asks.
    #[allow(dead_code)]
    pub(crate) fn invoked_as(program: Option<&OsStr>) -> Option<Self> {
        let name = Path::new(program?).file_name()?;
        [Self::Draw, Self::Refill, Self::Settle]
            .into_iter()
            .find(|w| name == w.name())
    }

    /// Runs the worker from start to exit: parses its command line and
    /// environment (`--help` lists every setting), then consumes its queue
    /// until SIGTERM or SIGINT.
    pub(crate) fn main(self) -> ExitCode {
        // The draw and settle workers run on one thread: their work is short
        // and I/O bound, and waking other runtime threads cost more CPU than
        // it saved (docs/performance.md); they scale with replicas. The
        // refill worker, whose stocking shuffles whole batches, takes a
        // thread per core.
        let runtime = match self {
            Self::Draw | Self::Settle => tokio::runtime::Builder::new_current_thread(),
            Self::Refill => tokio::runtime::Builder::new_multi_thread(),
        }
        .enable_all()
        .build();
        match runtime {
            Ok(runtime) => runtime.block_on(self.run()),
            Err(error) => {
                eprintln!("error: starting the runtime: {error}");
                ExitCode::FAILURE
            }
        }
    }

    async fn run(self) -> ExitCode {
        let service = self.name();
        telemetry::init(service, telemetry::WORKER_LOG_FILTER);
        let config = match Config::from_args(service, self.about()) {
            Ok(config) => config,
            Err(exit) => return exit,
        };
        match self {
            Self::Draw => {
                // On the runtime's only thread, before any other thread starts.
                if config.sched_batch {
                    match ops::batch_scheduling() {
                        Ok(()) => tracing::info!("running under SCHED_BATCH"),
                        Err(error) => tracing::warn!(%error, "SCHED_BATCH not applied"),
                    }
                }
                let needs = [Dependency::Broker, Dependency::Redis];
                ops::run_worker(service, config, &needs, prizepool::draw::run).await
            }
            Self::Refill => {
                let needs = [Dependency::Broker, Dependency::Redis, Dependency::Postgres];
                ops::run_worker(service, config, &needs, prizepool::refill::run).await
            }
            Self::Settle => {
                let needs = [Dependency::Broker, Dependency::Postgres];
                ops::run_worker(service, config, &needs, prizepool::settle::run).await
            }
        }
    }
}
