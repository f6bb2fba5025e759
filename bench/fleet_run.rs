//! One measured fleet run: the worker processes started, driven at full
//! speed and at half that rate, and their cost counted.

use std::{sync::Arc, time::Duration};

use prizepool::{
    amqp::rpc::RpcClient,
    client::{Client, ClientConfig},
};

use super::{
    args::BenchArgs,
    ceilings, fleet, report,
    services::{unique, Services},
    stats,
};

/// Runs the fleet with `workers` draw workers, each draw its own message
/// or, with `batch`, through the batching client.
pub(crate) async fn fleet_run(
    svc: &Services<'_>,
    args: &BenchArgs,
    workers: usize,
    batch: Option<usize>,
) -> anyhow::Result<report::Run> {
    let Services { config, db, .. } = svc;
    let id = unique("bench");
    let target = args.kind.fleet(svc, &args.load(), &id).await?;
    // The ids whose ledger credits the run's rewards must add up to.
    let pools: Vec<String> = target.pools.to_vec();
    let make = target.requests();
    let fleet = fleet::Fleet::start(config, workers).await?;
    let clients = Arc::new(drivers(svc, args, batch).await?);
    // Warm-up: connections, script cache, first refill.
    let warm = fleet::drive(
        &clients,
        make.clone(),
        Duration::from_secs(1),
        args.in_flight,
        None,
    )
    .await;
    let full = full_speed(svc, args, &fleet, &clients, make.clone()).await;
    let max = &full.load;
    // Settlement lag: from the last reply until the ledger holds every reward.
    // The pool is new: its ledger total is what warm-up and load won.
    let expected = warm.reward + max.reward;
    let (settled, settle_lag_ms) = settle_lag(db, &pools, expected).await?;

    let duration = Duration::from_secs(args.duration);
    let half_rate = max.draws_per_s / 2.0;
    let half = fleet::drive(
        &clients,
        make.clone(),
        duration,
        args.in_flight.max(4096),
        Some(half_rate),
    )
    .await;
    if let Ok(clients) = Arc::try_unwrap(clients) {
        clients.close().await;
    }
    fleet.stop();
    let amqp_at_half =
        ceilings::amqp_round_trip(config, 160, 512, duration, Some(half_rate)).await?;
    let mut run = full.into_run(args, workers, batch);
    run.ledger_matches = settled == expected;
    run.settle_lag_ms = settle_lag_ms;
    run.half = half;
    run.amqp_at_half = amqp_at_half;
    Ok(run)
}

/// The two connections the load goes through: RPC clients sending one
/// draw a message, or with `batch`, batching clients. Two either way, so
/// batching is the one difference.
async fn drivers(
    svc: &Services<'_>,
    args: &BenchArgs,
    batch: Option<usize>,
) -> anyhow::Result<fleet::Driver> {
    let config = svc.config;
    let Some(k) = batch else {
        return Ok(fleet::Driver::Single(vec![
            Arc::new(RpcClient::connect(config).await?),
            Arc::new(RpcClient::connect(config).await?),
        ]));
    };
    let mut clients = Vec::new();
    for _ in 0..2 {
        clients.push(
            Client::connect(
                ClientConfig::new(&config.amqp_url)
                    .connection_name("prizepool-bench")
                    .batch_size(k)
                    .linger(Duration::from_secs_f64(args.linger_ms.max(0.0) / 1000.0))
                    // Like the single draws: one attempt, a failure
                    // is counted, not retried.
                    .timeout(Duration::from_secs(30))
                    .retries(0)
                    .queue_capacity(args.in_flight.max(4096)),
            )
            .await?,
        );
    }
    Ok(fleet::Driver::Batching(clients))
}

/// Waits (up to a minute) until the ledger credits of `pools` reach
/// `expected`: what they reached, and the milliseconds it took.
async fn settle_lag(
    db: &sqlx::PgPool,
    pools: &[String],
    expected: i64,
) -> anyhow::Result<(i64, f64)> {
    let lag_started = std::time::Instant::now();
    let mut settled = prizepool::settle::credited(db, pools, "coin").await?;
    while settled < expected && lag_started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(5)).await;
        settled = prizepool::settle::credited(db, pools, "coin").await?;
    }
    Ok((settled, lag_started.elapsed().as_secs_f64() * 1000.0))
}

/// What the full-speed phase measured: the load, and what it cost.
struct FullSpeed {
    load: fleet::Load,
    phase_s: f64,
    /// Messages sent in the phase, when the drivers count them.
    messages: Option<u64>,
    processes: Vec<report::ProcessCpu>,
    services: Vec<report::ServiceCpu>,
    /// CPU time of the load generator (this process).
    own: Duration,
    redis_commands: Option<Vec<(String, u64)>>,
}

/// Drives the fleet at full speed (or at `--rate`) for `--duration`,
/// counting the CPU of every process and service and Redis's commands.
async fn full_speed(
    svc: &Services<'_>,
    args: &BenchArgs,
    fleet: &fleet::Fleet,
    clients: &Arc<fleet::Driver>,
    make: fleet::MakeRequest,
) -> FullSpeed {
    let mut redis = svc.redis.clone();
    // A server that refuses CONFIG (a managed one) leaves the count out.
    let counted = prizepool::redis_conn::reset_stats(&mut redis).await.is_ok();
    let cpu_before = fleet.cpu();
    let ports = stats::ServicePorts::of(svc.config);
    let services_before = stats::service_cpu(&ports);
    let own_before = stats::cpu_time(std::process::id()).unwrap_or_default();
    let duration = Duration::from_secs(args.duration);
    let rate = (args.rate > 0.0).then_some(args.rate);
    let messages_before = clients.messages();
    let phase = std::time::Instant::now();
    let load = fleet::drive(clients, make, duration, args.in_flight, rate).await;
    let phase_s = phase.elapsed().as_secs_f64();
    let messages = clients
        .messages()
        .zip(messages_before)
        .map(|(after, before)| after.saturating_sub(before));
    let cpu_after = fleet.cpu();
    let redis_commands = if counted {
        prizepool::redis_conn::command_calls(&mut redis).await.ok()
    } else {
        None
    };
    let services = stats::service_cpu_since(&ports, &services_before)
        .into_iter()
        .map(|(name, cpu_s)| report::ServiceCpu { name, cpu_s })
        .collect();
    let own = stats::cpu_time(std::process::id())
        .unwrap_or_default()
        .saturating_sub(own_before);
    let processes = cpu_before
        .iter()
        .zip(&cpu_after)
        .map(|((name, pid, b), (_, _, a))| report::ProcessCpu {
            name: name.clone(),
            pid: *pid,
            cpu_s: a.saturating_sub(*b).as_secs_f64(),
        })
        .collect();
    FullSpeed {
        load,
        phase_s,
        messages,
        processes,
        services,
        own,
        redis_commands,
    }
}

impl FullSpeed {
    /// The run's report from this phase; the settling, half-rate and
    /// RabbitMQ figures are filled in by the caller.
    fn into_run(self, args: &BenchArgs, workers: usize, batch: Option<usize>) -> report::Run {
        let Self {
            load: max,
            phase_s,
            messages,
            processes,
            services,
            own,
            redis_commands,
        } = self;
        let worker_cpu: f64 = processes.iter().map(|p| p.cpu_s).sum();
        let broker_cpu_per_draw_us = services
            .iter()
            .find(|s| s.name == "rabbitmq")
            .map(|s| s.cpu_s * 1e6 / max.ok.max(1) as f64);
        let cpu_budget = report::CpuBudget::new(
            services
                .iter()
                .map(|s| (s.name.to_owned(), s.cpu_s))
                .chain(processes.iter().map(|p| (p.name.clone(), p.cpu_s)))
                .chain([("load generator".to_owned(), own.as_secs_f64())]),
            max.ok,
            phase_s,
            report::cores(),
        );
        let sent = messages.unwrap_or(max.ok + max.rejected + max.failed);
        report::Run {
            batch,
            linger_ms: batch.map(|_| args.linger_ms),
            messages_per_s: sent as f64 / phase_s.max(f64::MIN_POSITIVE),
            draws_per_message: messages
                .map(|m| (max.ok + max.rejected + max.failed) as f64 / m.max(1) as f64),
            services,
            broker_cpu_per_draw_us,
            cpu_budget,
            redis_commands_per_draw: redis_commands
                .as_ref()
                .map(|c| c.iter().map(|(_, n)| *n).sum::<u64>() as f64 / max.ok.max(1) as f64),
            redis_commands: redis_commands.unwrap_or_default(),
            draw_workers: workers,
            cpu_per_draw_us: worker_cpu * 1e6 / max.ok.max(1) as f64,
            load_generator_cpu_s: own.as_secs_f64(),
            ledger_matches: false,
            settle_lag_ms: 0.0,
            max,
            half: fleet::Load::default(),
            amqp_at_half: ceilings::Rate::default(),
            processes,
        }
    }
}
