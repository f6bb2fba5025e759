//! The refill worker: stocks the next batch of a lucky-gift pool when a draw
//! took the batch's refill flag or found the pool short.
//!
//! A request names its trigger (the batch that asked), and the stocking
//! steps in Redis compare it with the pool's batch counter, so any number of
//! duplicate or concurrent requests for one trigger stock exactly one batch.

use std::{sync::Arc, time::Duration};

use redis::aio::ConnectionManager;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::{
    amqp::{self, HandleError, Handler, Outcome, Outgoing, Publisher},
    config::Config,
    kinds::lucky_gift::{self, StockError, StockOutcome},
    messages::{decode_typed, Invalid, RefillQueueMessage, RefillRequest},
    scripts::{PoolKeys, Scripts},
};

/// Everything a refill needs.
#[derive(Debug)]
pub struct RefillWorker {
    config: Config,
    redis: ConnectionManager,
    db: PgPool,
    scripts: Scripts,
}

impl RefillWorker {
    /// Builds the worker from its connections.
    pub fn new(config: Config, redis: ConnectionManager, db: PgPool) -> Self {
        Self {
            config,
            redis,
            db,
            scripts: Scripts::new(),
        }
    }

    /// Stocks the batch after `req.trigger`, unless it exists.
    pub async fn refill(&self, req: RefillRequest) -> Result<Outcome, HandleError> {
        req.validate()?;
        let Some((version, pool, table)) = crate::pools::latest(&self.db, &req.pool).await? else {
            return Err(Invalid::new(format!("no lucky-gift pool named {}", req.pool)).into());
        };
        let keys = PoolKeys::new(&self.config.redis_prefix, &req.pool);
        let mut conn = self.redis.clone();
        // Another attempt may hold the lease; wait for it to finish (then the
        // batch exists) or to die (then its lease expires and we take over).
        let deadline = tokio::time::Instant::now()
            + Duration::from_millis(2 * lucky_gift::DEFAULT_LEASE_MS.unsigned_abs());
        loop {
            let outcome = lucky_gift::stock_next(
                &mut conn,
                &self.scripts,
                &keys,
                &pool,
                &table,
                req.trigger,
                self.config.refill_chunk,
                lucky_gift::DEFAULT_LEASE_MS,
            )
            .await;
            match outcome {
                Ok(StockOutcome::Stocked { generation, size }) => {
                    tracing::info!(pool = %req.pool, generation, size, urgent = req.urgent, "batch stocked");
                    metrics::counter!("prizepool_batches_stocked_total").increment(1);
                    let event = json!({
                        "type": "pool.refilled", "pool": req.pool, "generation": generation,
                        "size": size, "version": version, "urgent": req.urgent,
                    });
                    return Ok(Outcome {
                        reply: Some(
                            json!({"type": "refill_result", "status": "ok", "pool": req.pool, "generation": generation}),
                        ),
                        effects: vec![Outgoing::event("pool.refilled", &event)],
                    });
                }
                Ok(StockOutcome::AlreadyDone { generation }) => {
                    tracing::debug!(pool = %req.pool, trigger = req.trigger, generation, "duplicate refill request");
                    return Ok(Outcome {
                        reply: Some(
                            json!({"type": "refill_result", "status": "ok", "pool": req.pool, "generation": generation}),
                        ),
                        effects: Vec::new(),
                    });
                }
                Ok(StockOutcome::Busy { retry_in }) => {
                    if tokio::time::Instant::now() > deadline {
                        return Err(anyhow::anyhow!(
                            "pool {} is still being stocked by another attempt",
                            req.pool
                        )
                        .into());
                    }
                    tokio::time::sleep(retry_in.min(Duration::from_millis(50))).await;
                }
                Ok(StockOutcome::Ahead { generation }) => {
                    return Err(Invalid::new(format!(
                        "trigger {} is past the last batch {generation} of pool {}",
                        req.trigger, req.pool
                    ))
                    .into())
                }
                Ok(StockOutcome::Unknown) => {
                    return Err(Invalid::new(format!(
                        "pool {} is not in Redis (load it again)",
                        req.pool
                    ))
                    .into())
                }
                Err(StockError::Redis(e)) => return Err(e.into()),
                Err(e) => return Err(anyhow::Error::from(e).into()),
            }
        }
    }
}

impl Handler for RefillWorker {
    fn route(&self) -> amqp::Route {
        amqp::REFILL
    }

    async fn handle(
        &self,
        envelope: Value,
        _publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        match decode_typed::<RefillQueueMessage>(envelope)? {
            RefillQueueMessage::Refill(req) => self.refill(req).await,
        }
    }
}

/// Runs a refill worker until `shutdown`.
pub async fn run(
    config: Config,
    health: crate::ops::Health,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let redis = crate::redis_conn::connect(&config.redis_url).await?;
    let db = crate::db::connect(&config.database_url).await?;
    let worker = Arc::new(RefillWorker::new(config.clone(), redis, db));
    amqp::run(&config, worker, health, shutdown).await
}
