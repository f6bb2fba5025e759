//! What the size of a lucky-gift pool costs: the draw step with a thousand
//! prizes stocked against ten million, and how long Redis stalls while a
//! three-million-prize batch is stocked.

use std::sync::Arc;

use anyhow::Context;
use prizepool::{
    kinds::{
        self,
        lucky_gift::{self, StockOutcome, Storage},
        Ask, Kinds,
    },
    scripts::PoolKeys,
};

use super::{
    report,
    services::{pool_config, unique, Services},
    stats::Latencies,
};

/// Draw-step cost with 1 thousand vs 10 million prizes stocked.
pub(crate) async fn flatness(svc: &Services<'_>) -> anyhow::Result<report::Flatness> {
    let Services { config, redis, .. } = svc;
    let small = pool_config(
        &unique("bench-small"),
        Storage::List,
        &[("c1", &[(0, 990), (10, 10)])],
        1.0,
    );
    let big = pool_config(
        &unique("bench-big"),
        Storage::List,
        &[("c1", &[(0, 9_900_000), (10, 100_000)])],
        1.0,
    );
    svc.load(&small).await?;
    svc.load(&big).await?;
    let sk = PoolKeys::new(&config.redis_prefix, &small.id);
    // 16 draws at a time, each task with a dispatch of its own, so no
    // task's draws join another's call.
    let dispatch: Vec<Arc<Kinds>> = (0..16)
        .map(|_| Arc::new(Kinds::new(redis.clone(), &config.redis_prefix)))
        .collect();
    let table = lucky_gift::CodeTable::extend(None, &small);
    let mut small_rates = Vec::new();
    let mut big_rates = Vec::new();
    // Many short alternating passes, compared by their medians: one pass
    // takes about 30 ms, so a single preemption on a busy machine can move
    // it by a tenth (with 9 rounds, one full run read 1.13).
    for _ in 0..25 {
        // 960 single-prize draws each, 16 at a time; the small pool is restocked per round.
        small_rates.push(fixed_draws(&dispatch, &small.id, 960).await?);
        big_rates.push(fixed_draws(&dispatch, &big.id, 960).await?);
        let mut conn = redis.clone();
        let gen = lucky_gift::status(&mut conn, &sk, &small.id)
            .await?
            .map_or(0, |s| s.generation);
        lucky_gift::stock_next(&mut conn, &sk, &small, &table, gen, 4000, 30_000).await?;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (s, b) = (median(&mut small_rates), median(&mut big_rates));
    println!("  {s:.0} draws/s with 1k prizes, {b:.0} draws/s with 10M prizes");
    Ok(report::Flatness {
        small_per_s: s,
        big_per_s: b,
        ratio: b / s,
    })
}

/// `n` single-prize draws from pool `pool`, spread over `dispatch` (one
/// task each), each through the seam as the draw worker draws it: draws
/// per second.
async fn fixed_draws(dispatch: &[Arc<Kinds>], pool: &str, n: usize) -> anyhow::Result<f64> {
    let first = dispatch.first().context("no dispatch to draw with")?;
    let kind = first
        .resolve(pool)
        .await?
        .with_context(|| format!("no pool {pool}"))?;
    let per_task = n / dispatch.len();
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for dispatch in dispatch {
        let (dispatch, pool) = (dispatch.clone(), pool.to_owned());
        tasks.push(tokio::spawn(async move {
            let fingerprint = kinds::fingerprint("bench", &[]);
            for _ in 0..per_task {
                let id = ulid::Ulid::new().to_string();
                let token = kinds::Tokens::new("bench", "rq", &id, fingerprint, 120);
                let ask = Ask {
                    request_id: &id,
                    pool: &pool,
                    user: 0,
                    count: 1,
                    token: &token.answer,
                    result_ttl_s: 120,
                };
                dispatch.draw(kind, &ask).await?;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok((per_task * dispatch.len()) as f64 / started.elapsed().as_secs_f64())
}

/// Longest time Redis stopped answering while a 3-million-prize batch was stocked.
pub(crate) async fn stall(svc: &Services<'_>) -> anyhow::Result<report::Stall> {
    let Services { config, redis, .. } = svc;
    let pool = pool_config(
        &unique("bench-stall"),
        Storage::List,
        &[("c1", &[(0, 2_970_000), (10, 30_000)])],
        1.0,
    );
    svc.load(&pool).await?;
    let keys = PoolKeys::new(&config.redis_prefix, &pool.id);
    let table = lucky_gift::CodeTable::extend(None, &pool);
    // A probe on its own connection, so it waits only for Redis itself.
    let client = redis::Client::open(config.redis_url.as_str())?;
    let probe = client.get_connection()?;
    let mut admin = client.get_multiplexed_async_connection().await?;
    watch_latency(&mut admin).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = ping_until(probe, stop.clone());
    // Batch 2 is due as if a draw had taken batch 1's refill point (the
    // refill worker stocks only due batches).
    let mut conn = redis.clone();
    let _: () = redis::cmd("HSET")
        .arg(keys.meta())
        .arg("due")
        .arg(1)
        .query_async(&mut conn)
        .await?;
    let started = std::time::Instant::now();
    let outcome = lucky_gift::stock_next(
        &mut conn,
        &keys,
        &pool,
        &table,
        1,
        config.refill_chunk,
        60_000,
    )
    .await?;
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut lat = prober
        .join()
        .map_err(|_| anyhow::anyhow!("the probe thread panicked"))?;
    anyhow::ensure!(
        matches!(
            outcome,
            StockOutcome::Stocked {
                size: 3_000_000,
                ..
            }
        ),
        "unexpected stocking outcome {outcome:?}"
    );
    let monitor_max_ms = latency_seen(&mut admin).await;
    let probe = lat.percentiles();
    println!("  stocked 3,000,000 prizes in {took:.2?}; probe PING max {:.2} ms, p99 {:.2} ms; LATENCY monitor max {monitor_max_ms:?} ms", probe.max_ms, probe.p99_ms);
    Ok(report::Stall {
        prizes: 3_000_000,
        seconds: took.as_secs_f64(),
        probe,
        latency_monitor_max_ms: monitor_max_ms,
    })
}

/// Turns on Redis's latency monitor for every event of 1 ms or more,
/// forgetting earlier ones. A server that refuses it (a managed one) leaves
/// the monitor's figure out of the report.
async fn watch_latency(admin: &mut redis::aio::MultiplexedConnection) {
    let _: redis::RedisResult<()> = redis::cmd("CONFIG")
        .arg("SET")
        .arg("latency-monitor-threshold")
        .arg(1)
        .query_async(admin)
        .await;
    let _: redis::RedisResult<()> = redis::cmd("LATENCY").arg("RESET").query_async(admin).await;
}

/// The longest event the latency monitor saw, in ms, and the monitor
/// turned off again.
async fn latency_seen(admin: &mut redis::aio::MultiplexedConnection) -> Option<i64> {
    let latest: redis::RedisResult<Vec<(String, i64, i64, i64)>> =
        redis::cmd("LATENCY").arg("LATEST").query_async(admin).await;
    let _: redis::RedisResult<()> = redis::cmd("CONFIG")
        .arg("SET")
        .arg("latency-monitor-threshold")
        .arg(0)
        .query_async(admin)
        .await;
    latest.ok().and_then(|rows| rows.iter().map(|r| r.3).max())
}

/// PINGs Redis on `probe` back to back until `stop`, on an OS thread of
/// its own with a blocking connection: the probe must not wait for this
/// process's async tasks (the stocker keeps them busy). The thread returns
/// every PING's latency.
fn ping_until(
    mut probe: redis::Connection,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Latencies> {
    std::thread::spawn(move || {
        let mut lat = Latencies::default();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let t = std::time::Instant::now();
            let _: redis::RedisResult<String> = redis::cmd("PING").query(&mut probe);
            lat.record(t.elapsed());
        }
        lat
    })
}
