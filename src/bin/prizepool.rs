//! The `prizepool` command line: pools, draws, balances, dead letters, the
//! demo and the benchmark.

use anyhow::Context;
use clap::{Parser, Subcommand};

// The benchmark is compiled into this binary alone, never into the library
// the workers link: it sees the library as any other user does.
#[path = "../../bench/mod.rs"]
mod bench;

// The benchmark's load generator allocates for every request and reply.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// prizepool: prize draws over RabbitMQ, Redis and Postgres.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Library(prizepool::cli::Command),
    /// Measure throughput, latency and cost against the machine's ceilings.
    Bench(bench::BenchArgs),
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Library(command) => prizepool::cli::run(command).await,
        Command::Bench(args) => {
            let config = prizepool::config::Config::from_env().context("reading configuration")?;
            bench::run(&config, args).await
        }
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let log_filter = match &cli.command {
        Command::Library(command) => command.default_log_filter(),
        Command::Bench(_) => "warn",
    };
    prizepool::telemetry::init("prizepool", log_filter);
    // The demo runs whole workers and wants a runtime thread per core; the
    // rest, the benchmark's load generator above all, spend less CPU on one.
    let runtime = if matches!(&cli.command, Command::Library(c) if c.runs_workers()) {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    let result = match runtime {
        Ok(runtime) => runtime.block_on(run(cli.command)),
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
