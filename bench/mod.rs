//! `prizepool bench`: the fleet's throughput, latency and cost, measured
//! against the machine's own ceilings in the same run.
//!
//! Ceilings: the draw step of the run's kind and storage in a tight
//! multiplexed Redis loop, called through the library's seam
//! ([`prizepool::kinds::Kinds`]) as the draw worker calls it, bare, and
//! coalesced (and a trivial script on the same pool, to price the script
//! itself), and a raw RabbitMQ round trip (publish with windowed confirms →
//! consume → ack) through a quorum queue. Then, for each draw-worker count,
//! the fleet runs as separate processes: a closed loop at full speed, then
//! an open loop at half that rate. Results go to `results/<time>/` and
//! `results/latest/` as JSON, Markdown and an SVG plot.
//!
//! | module | what lives there |
//! |--------|------------------|
//! | `args` | the command line |
//! | `measure` | one run from start to report: the order of the phases |
//! | `kinds` | what each prize kind needs set up to be drawn from, and who draws |
//! | `services` | the services a run talks to, its pools, and their cleanup |
//! | `ceilings` | the Redis and RabbitMQ ceilings |
//! | `fleet`, `fleet_run` | the worker processes, the load generator, one measured fleet run |
//! | `memory`, `pool_size` | bytes per prize and per remembered result; pool-size flatness and the stocking stall |
//! | `stats`, `report`, `plan` | latencies and CPU time; the reports; capacity plans from a report |
//!
//! It is compiled into the `prizepool` binary alone and sees the library
//! as any other user does.

mod args;
mod ceilings;
mod fleet;
mod fleet_run;
mod kinds;
mod measure;
mod memory;
mod plan;
mod pool_size;
mod report;
mod services;
mod stats;

use anyhow::Context;
use prizepool::config::Config;

pub(crate) use args::BenchArgs;

/// Runs the benchmark and writes its reports.
pub(crate) async fn run(config: &Config, args: BenchArgs) -> anyhow::Result<()> {
    if let Some(peak) = args.plan {
        let text = std::fs::read_to_string(&args.plan_from)
            .with_context(|| format!("reading {}", args.plan_from.display()))?;
        let report: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", args.plan_from.display()))?;
        let shape = plan::Shape {
            cores_per_node: args.node_cores,
            utilisation: args.utilisation,
            gb_per_redis_master: args.redis_master_gb,
            result_ttl_s: config.result_ttl.as_secs_f64(),
        };
        println!("{}", plan::plan(&report, peak, shape)?);
        return Ok(());
    }
    // The run's keys, its workers' included, live under a prefix of its own,
    // so the cleanup finds them all and removes nothing else.
    let config = &Config {
        redis_prefix: format!("{}-bench-{}", config.redis_prefix, services::run_id()),
        ..config.clone()
    };
    // Ctrl-C or SIGTERM stops the fleet (dropped with `measure`) and still
    // removes what the run created.
    let interrupted = prizepool::shutdown::signal();
    let result = tokio::select! {
        result = measure::measure(config, args) => result,
        _ = interrupted.cancelled() => Err(anyhow::anyhow!("interrupted; no report written")),
    };
    match services::remove_run_keys(config).await {
        Ok(Some(n)) => println!("removed the run's {n} Redis keys"),
        Ok(None) => println!(
            "on a Redis Cluster the run's keys stay: delete the keys matching {} on each node",
            services::run_keys(config).join(" and ")
        ),
        Err(error) => eprintln!("could not remove the run's Redis keys: {error:#}"),
    }
    result
}
