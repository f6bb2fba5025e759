//! Per-pool stock as metrics: `prizepool_pool_stock{pool}` (prizes in the
//! pool now, every sub-pool of a sharded pool together) and
//! `prizepool_pool_batches{pool}` (batches stocked so far), for every
//! lucky-gift pool in the registry, read every few seconds by the refill
//! worker like the queue depths ([`crate::amqp::depth`]), so a pool's stock
//! is on the dashboard beside its draws and payouts. With them, each pool's
//! realised RTP over completed batches against its configured RTP, per
//! config version ([`crate::kinds::lucky_gift::rtp::export`]).

use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::redis_conn::RedisConn;

/// How often the stock is read.
const EVERY: Duration = Duration::from_secs(5);

/// Reads every lucky-gift pool's stock every [`EVERY`] until `shutdown`. A
/// failure (Redis or Postgres away) costs one reading.
pub(super) async fn watch(
    db: PgPool,
    mut redis: RedisConn,
    prefix: String,
    shutdown: CancellationToken,
) {
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            _ = every.tick() => {}
        }
        if let Err(error) = read(&db, &mut redis, &prefix).await {
            tracing::debug!(error = format!("{error:#}"), "pool stock not read");
        }
    }
}

async fn read(db: &PgPool, redis: &mut RedisConn, prefix: &str) -> anyhow::Result<()> {
    let pools: Vec<String> = sqlx::query_scalar("SELECT id FROM pools WHERE kind = $1 ORDER BY id")
        .bind(crate::kinds::lucky_gift::KIND)
        .fetch_all(db)
        .await
        .context("listing the pools")?;
    for pool in pools {
        let Some(status) = crate::pools::status(redis, prefix, &pool)
            .await
            .with_context(|| format!("reading pool {pool}"))?
        else {
            continue;
        };
        metrics::gauge!("prizepool_pool_stock", "pool" => pool.clone())
            .set(status.total.in_pool as f64);
        metrics::gauge!("prizepool_pool_batches", "pool" => pool.clone())
            .set(status.total.generation as f64);
        let shards = crate::pools::shards_of(redis, prefix, &pool)
            .await
            .with_context(|| format!("reading the shards of pool {pool}"))?;
        let realised = crate::kinds::lucky_gift::rtp::realised(redis, prefix, &pool, shards)
            .await
            .with_context(|| format!("reading the realised RTP of pool {pool}"))?;
        crate::kinds::lucky_gift::rtp::export(&pool, &realised);
    }
    Ok(())
}
