//! One run of the bench from start to report: the order of its phases.

use std::time::Duration;

use anyhow::Context;
use prizepool::{amqp::rpc::RpcClient, config::Config, kinds::lucky_gift::Storage};

use super::{
    args::BenchArgs,
    ceilings::{self, Caller, Pass, Rate},
    fleet_run::fleet_run,
    kinds::Target,
    memory, pool_size, report,
    services::{borrow, pool_config, spec_combos, unique, Services},
};

/// Measures everything `args` asks for and writes the reports.
pub(crate) async fn measure(config: &Config, args: BenchArgs) -> anyhow::Result<()> {
    let storage = args.storage()?;
    let svc = Services::open(config).await?;
    let mut rep = report::Report::new(&args, storage, config);
    // The topology must exist before the first publish.
    RpcClient::connect(config).await?.close().await;
    // Flatness and the stall probe first, on a keyspace the ceiling passes
    // have not yet filled with result keys.
    if !args.quick {
        println!("pool-size flatness (1 thousand vs 10 million prizes)");
        rep.flatness = Some(pool_size::flatness(&svc).await?);
        println!("stocking stall (a 3-million-prize batch)");
        rep.stall = Some(pool_size::stall(&svc).await?);
    }

    println!("ceilings");
    let ceiling_pool = pool_config(
        &unique("bench-ceiling"),
        Storage::List,
        &borrow(&spec_combos(7)),
        1.0,
    );
    svc.load(&ceiling_pool).await?;
    let results = args
        .results
        .unwrap_or(if args.quick { 100_000 } else { 1_000_000 });
    memory::measure(&svc, &ceiling_pool.id, results, &mut rep.memory).await?;
    let trivial = Target::one_pool(ceiling_pool.id, args.count, |_| 0);
    redis_ceilings(&svc, &args, trivial, &mut rep.ceilings).await?;
    rep.ceilings.amqp = ceilings::amqp_round_trip(
        config,
        160,
        512,
        Duration::from_secs(args.duration.min(10)),
        None,
    )
    .await?;
    println!(
        "  rabbitmq: {:.0} msg/s, p99 {:.2} ms",
        rep.ceilings.amqp.per_s, rep.ceilings.amqp.latency.p99_ms
    );

    // No --batch: one run per worker count with single draws. With it, one
    // run per worker count and batch size, through the batching client.
    let batches: Vec<Option<usize>> = if args.batch.is_empty() {
        vec![None]
    } else {
        args.batch.iter().map(|&k| Some(k.max(1))).collect()
    };
    for &n in &args.workers {
        for &batch in &batches {
            match batch {
                Some(k) => println!("fleet with {n} draw workers, batches of up to {k} draws"),
                None => println!("fleet with {n} draw workers"),
            }
            let run = fleet_run(&svc, &args, n, batch).await?;
            println!(
                "  {:.0} draws/s, {:.0} prizes/s, p99 {:.1} ms; at half rate p99 {:.1} ms (rabbitmq {:.1} ms)",
                run.max.draws_per_s, run.max.prizes_per_s, run.max.latency.p99_ms, run.half.latency.p99_ms, run.amqp_at_half.latency.p99_ms
            );
            if let Some(per) = run.draws_per_message {
                println!("  {per:.1} draws per message");
            }
            rep.runs.push(run);
        }
    }
    let dir = rep.write(&args.out).context("writing the reports")?;
    println!("\n{}", rep.markdown());
    println!("reports written to {}", dir.display());
    Ok(())
}

/// The Redis ceilings of the run's kind: the trivial script on `trivial`'s
/// pool, then the draw step bare and as the workers call it, and, for a
/// kind whose draws coalesce, coalesced.
async fn redis_ceilings(
    svc: &Services<'_>,
    args: &BenchArgs,
    trivial: Target,
    ceilings: &mut report::Ceilings,
) -> anyhow::Result<()> {
    let config = svc.config;
    let pass = |target, caller| Pass {
        target,
        concurrency: 64,
        duration: Duration::from_millis(args.ceiling_pass_ms),
        caller,
    };
    ceilings.redis_trivial = ceilings::redis_draws(config, pass(trivial, Caller::Trivial)).await?;
    // Each drawing pass gets fresh pools big enough to last it (pools that
    // never run out serve every pass); the two callers alternate and each
    // keeps its best pass, so neither pays for the state the other left
    // behind.
    let mut endless: Option<Target> = None;
    for caller in [Caller::Raw, Caller::Wrapper, Caller::Raw, Caller::Wrapper] {
        let target = match &endless {
            Some(target) => target.clone(),
            None => args.kind.ceiling(svc, &args.load()).await?,
        };
        if target.endless {
            endless = Some(target.clone());
        }
        let rate = ceilings::redis_draws(config, pass(target, caller)).await?;
        let best = match caller {
            Caller::Raw => &mut ceilings.redis_raw,
            _ => &mut ceilings.redis_draw,
        };
        if rate.per_s > best.per_s {
            *best = rate;
        }
    }
    if args.kind.coalesces() {
        // The same step as the workers coalesce it, two passes on fresh
        // pools, the best kept like the others.
        let mut best = Rate::default();
        for _ in 0..2 {
            let target = args.kind.ceiling(svc, &args.load()).await?;
            let caller = Caller::Coalesced(report::COALESCED);
            let rate = ceilings::redis_draws(config, pass(target, caller)).await?;
            if rate.per_s > best.per_s {
                best = rate;
            }
        }
        println!(
            "  redis: the draw step coalesced, {} draws a call: {:.0} draws/s",
            report::COALESCED,
            best.per_s
        );
        ceilings.redis_coalesced = Some(best);
    }
    println!(
        "  redis: raw draw script {:.0}/s, as workers call it {:.0}/s, trivial script {:.0}/s",
        ceilings.redis_raw.per_s, ceilings.redis_draw.per_s, ceilings.redis_trivial.per_s
    );
    Ok(())
}
