//! The `prizepool` command line: pools, draws, balances, dead letters, the
//! demo and the benchmark.

use clap::Parser;

// The benchmark's load generator allocates for every request and reply.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    prizepool::telemetry::init("prizepool", "warn");
    let cli = prizepool::cli::Cli::parse();
    let runtime = if cli.runs_workers() {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    let result = match runtime {
        Ok(runtime) => runtime.block_on(prizepool::cli::run(cli)),
        Err(error) => Err(anyhow::Error::new(error).context("starting the runtime")),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
