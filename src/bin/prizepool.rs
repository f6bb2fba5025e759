//! The `prizepool` command line: pools, draws, balances, dead letters, the
//! demo and the benchmark. Invoked as `draw-worker`, `refill-worker` or
//! `settle-worker` (a link to it under that name), it is that worker: the
//! release image ships this one binary for all four.

use anyhow::Context;
use clap::{Parser, Subcommand};

// The benchmark is compiled into this binary alone, never into the library
// the workers link: it sees the library as any other user does.
#[path = "../../bench/mod.rs"]
mod bench;
#[path = "worker/healthcheck.rs"]
mod healthcheck;
mod worker;

// The benchmark's load generator allocates for every request and reply, and
// a worker small buffers for every message.
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
    /// Ask the worker in this container whether it is ready (its ops
    /// endpoint's /readyz): exit 0 if it answers 200, else 1.
    Healthcheck(healthcheck::HealthcheckArgs),
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Library(command) => prizepool::cli::run(command).await,
        Command::Bench(args) => {
            let config = prizepool::config::Config::from_env().context("reading configuration")?;
            bench::run(&config, args).await
        }
        Command::Healthcheck(args) => healthcheck::run(&args),
    }
}

fn main() -> std::process::ExitCode {
    if let Some(worker) = worker::Worker::invoked_as(std::env::args_os().next().as_deref()) {
        return worker.main();
    }
    let cli = Cli::parse();
    let log_filter = match &cli.command {
        Command::Library(command) => command.default_log_filter(),
        Command::Bench(_) | Command::Healthcheck(_) => "warn",
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
