//! The `prizepool` command line: pools, draws, balances, dead letters, the
//! demo and the benchmark.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    prizepool::telemetry::init("prizepool", "warn");
    let cli = prizepool::cli::Cli::parse();
    match prizepool::cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
