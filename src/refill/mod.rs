//! The refill worker: stocks the next batch of a lucky-gift pool when a draw
//! took the batch's refill flag or found the pool short.
//!
//! A request names its trigger (the batch that asked), and the stocking
//! steps in Redis compare it with the pool's batch counter, so any number of
//! duplicate or concurrent requests for one trigger stock exactly one batch.

use std::{sync::Arc, time::Duration};

use crate::redis_conn::RedisConn;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::{
    amqp::{self, HandleError, Handler, Outcome, Outgoing, Publisher},
    config::Config,
    kinds::{
        lucky_gift::{self, StockError, StockOutcome},
        red_packet::{self, CreateError},
    },
    messages::{
        decode_typed, with_type, ErrorCode, Invalid, RedPacketCreate, RedPacketExpire,
        RefillQueueMessage, RefillRequest, SettleRequest,
    },
    scripts::{PoolKeys, Scripts},
};

/// Everything a refill needs.
#[derive(Debug)]
pub struct RefillWorker {
    config: Config,
    redis: RedisConn,
    db: PgPool,
    scripts: Scripts,
}

impl RefillWorker {
    /// Builds the worker from its connections.
    pub fn new(config: Config, redis: RedisConn, db: PgPool) -> Self {
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
        let keys = PoolKeys::new(&self.config.redis_prefix, &req.pool);
        let mut conn = self.redis.clone();
        // The config comes from Redis, where `pool load` writes it next to
        // the pool's counters: a Postgres outage does not stop refills.
        let stored = lucky_gift::stored_config(&mut conn, &keys)
            .await
            .map_err(|e| HandleError::internal(format!("{e:#}")))?;
        let (version, pool, table) = match stored {
            Some((version, pool, table)) => (version, pool, table),
            // Pools loaded before the config was kept in Redis.
            None => match crate::pools::latest(&self.db, &req.pool).await? {
                Some((version, pool, table)) => (i64::from(version), pool, table),
                None => {
                    return Err(
                        Invalid::new(format!("no lucky-gift pool named {}", req.pool)).into(),
                    )
                }
            },
        };
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
                            json!({"type": "refill_result", "status": "ok", "pool": req.pool, "generation": generation}).to_string().into_bytes(),
                        ),
                        effects: vec![Outgoing::event("pool.refilled", &event)],
                        ..Outcome::default()
                    });
                }
                Ok(StockOutcome::AlreadyDone { generation }) => {
                    tracing::debug!(pool = %req.pool, trigger = req.trigger, generation, "duplicate refill request");
                    return Ok(Outcome {
                        reply: Some(
                            json!({"type": "refill_result", "status": "ok", "pool": req.pool, "generation": generation}).to_string().into_bytes(),
                        ),
                        effects: Vec::new(),
                        ..Outcome::default()
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
                Ok(StockOutcome::NotDue { generation }) => {
                    return Err(Invalid::new(format!(
                        "batch {generation} of pool {} is not due for a refill: no draw took its refill point and the pool is not short",
                        req.pool
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

impl RefillWorker {
    /// Creates a red packet and schedules its expiry.
    pub async fn create_red_packet(&self, req: RedPacketCreate) -> Result<Outcome, HandleError> {
        let mut conn = self.redis.clone();
        let rejected = |code: ErrorCode, message: String| {
            Ok(Outcome {
                reply: Some(json!({
                    "type": "redpacket_result", "packet_id": req.packet_id, "status": "rejected",
                    "error": { "code": code, "message": message },
                }).to_string().into_bytes()),
                effects: Vec::new(),
                ..Outcome::default()
            })
        };
        let created = match red_packet::create(
            &self.db,
            &mut conn,
            &self.scripts,
            &self.config.redis_prefix,
            &req,
        )
        .await
        {
            Ok(created) => created,
            Err(CreateError::Invalid(message)) => return Err(Invalid::new(message).into()),
            Err(e @ CreateError::InsufficientFunds { .. }) => {
                return rejected(ErrorCode::InsufficientFunds, e.to_string())
            }
            Err(CreateError::Db(e)) => return Err(e.into()),
            Err(CreateError::Redis(e)) => return Err(e.into()),
        };
        let expire = RedPacketExpire {
            packet_id: created.packet_id.clone(),
            expires_at: Some(created.expires_at),
        };
        let reply = json!({
            "type": "redpacket_result", "packet_id": created.packet_id, "status": "ok",
            "count": created.count, "total": created.total,
            "expires_at": created.expires_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        });
        let mut event = reply.clone();
        event["type"] = "redpacket.created".into();
        Ok(Outcome {
            effects: vec![
                // A repeated create schedules the expiry again: closing is idempotent.
                Outgoing::delayed(
                    remaining_ms(created.expires_at),
                    &with_type("redpacket.expire", &expire),
                ),
                Outgoing::event("redpacket.created", &event),
            ],
            reply: Some(reply.to_string().into_bytes()),
            ..Outcome::default()
        })
    }

    /// Closes a red packet whose time has come and refunds what is left;
    /// an early message is delayed again.
    pub async fn expire_red_packet(&self, req: RedPacketExpire) -> Result<Outcome, HandleError> {
        crate::messages::check_id("packet_id", &req.packet_id)?;
        let expires_at = match req.expires_at {
            Some(t) => Some(t),
            None => sqlx::query_as::<_, (chrono::DateTime<chrono::Utc>,)>(
                "SELECT expires_at FROM red_packets WHERE id = $1",
            )
            .bind(&req.packet_id)
            .fetch_optional(&self.db)
            .await?
            .map(|(t,)| t),
        };
        let Some(expires_at) = expires_at else {
            return Err(Invalid::new(format!("no red packet named {}", req.packet_id)).into());
        };
        let wait = remaining_ms(expires_at);
        if wait > 0 {
            let again = RedPacketExpire {
                packet_id: req.packet_id.clone(),
                expires_at: Some(expires_at),
            };
            return Ok(Outcome {
                reply: None,
                effects: vec![Outgoing::delayed(
                    wait,
                    &with_type("redpacket.expire", &again),
                )],
                ..Outcome::default()
            });
        }
        let keys = PoolKeys::new(&self.config.redis_prefix, &req.packet_id);
        let mut conn = self.redis.clone();
        let Some(closed) =
            red_packet::close(&self.db, &mut conn, &self.scripts, &keys, &req.packet_id)
                .await
                .map_err(HandleError::Transient)?
        else {
            return Err(Invalid::new(format!("no red packet named {}", req.packet_id)).into());
        };
        let mut effects = Vec::new();
        let mut ledger = Vec::new();
        if closed.refunded > 0 {
            // Sent again on every replay; the ledger applies it once.
            let refund = SettleRequest::new(
                format!("redpacket:{}:refund", req.packet_id),
                closed.sender,
                &closed.asset,
                closed.refunded,
                "red_packet_refund",
                json!({ "pool": req.packet_id }),
            );
            ledger.push(refund);
        }
        let body = json!({"type": "redpacket.closed", "packet_id": req.packet_id, "refunded": closed.refunded});
        if closed.now {
            tracing::info!(packet = %req.packet_id, refunded = closed.refunded, "red packet closed");
            effects.push(Outgoing::event("redpacket.closed", &body));
        }
        Ok(Outcome {
            reply: Some(
                json!({"type": "redpacket_result", "packet_id": req.packet_id, "status": "ok", "closed": true, "refunded": closed.refunded}).to_string().into_bytes(),
            ),
            effects,
            ledger,
            events: Vec::new(),
        })
    }
}

/// Milliseconds until `at` (0 when past).
fn remaining_ms(at: chrono::DateTime<chrono::Utc>) -> u64 {
    (at - chrono::Utc::now())
        .num_milliseconds()
        .max(0)
        .unsigned_abs()
}

impl Handler for RefillWorker {
    fn route(&self) -> amqp::Route {
        amqp::REFILL
    }

    async fn handle(
        &self,
        envelope: &Value,
        _publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        match decode_typed::<RefillQueueMessage>(envelope)? {
            RefillQueueMessage::Refill(req) => self.refill(req).await,
            RefillQueueMessage::RedPacketCreate(req) => self.create_red_packet(req).await,
            RefillQueueMessage::RedPacketExpire(req) => self.expire_red_packet(req).await,
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
