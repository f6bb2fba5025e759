//! The refill worker: stocks the next batch of a lucky-gift pool when a draw
//! took the batch's refill flag or found the pool short.
//!
//! A request names its trigger (the batch that asked), and the stocking
//! steps in Redis compare it with the pool's batch counter, so any number of
//! duplicate or concurrent requests for one trigger stock exactly one batch.
//! Red-packet creates and expiries travel on the same queue; the worker
//! hands them to the red-packet kind ([`crate::kinds::red_packet::lifecycle`]).
//!
//! # Races and ordering
//!
//! - **Duplicate and concurrent requests.** Draws send a refill request for
//!   every refill flag they take, again on every replay, and an urgent one
//!   when they find the pool short, so a batch is usually asked for more
//!   than once. One attempt claims the pool's stocking lease; the others
//!   find it `busy` and poll until the batch exists (then `done`: answered
//!   like the stocking itself) or the lease expires (then one of them takes
//!   over), giving up as a transient error after twice the lease.
//! - **Within one worker.** Requests for the same pool and trigger share one
//!   attempt and its token, and wait for each other; the token is kept
//!   across a Redis failure, so the attempt's retry takes its own lease
//!   back at once instead of waiting for it to expire.
//! - **A worker killed mid-stock.** Its lease expires; the next attempt
//!   trims what it staged and stocks the batch from the same seed, so the
//!   commitment it may already have recorded still holds
//!   ([`lucky_gift::stock_committed`]).
//! - **A worker killed after the commit, before publishing.** The
//!   redelivered request finds the batch `done` and publishes its
//!   `pool.refilled` again, commitment included, while the batch's seed is
//!   still secret; consumers key the event by pool and generation.
//! - **Postgres away.** The commitment is recorded before the batch is
//!   visible when Postgres answers in time, and skipped otherwise: stocking
//!   goes on from the config kept in Redis, and the event carries the
//!   commitment to Postgres later.
//! - **A refill racing draws.** Draws see the new batch all at once, when
//!   its commit step runs; until then they take what is left or answer
//!   short (see [`crate::kinds::lucky_gift`]).

use std::{collections::HashMap, sync::Arc, time::Duration};

use crate::redis_conn::RedisConn;
use serde_json::Value;
use sqlx::PgPool;

use crate::{
    amqp::{self, Group, HandleError, Handler, Outcome, Outgoing, Publisher},
    config::Config,
    kinds::{
        lucky_gift::{self, StockError, StockOutcome},
        red_packet,
    },
    ledger::{self, Unsealed},
    messages::{
        decode_typed, typed_json, Invalid, PoolRefilled, RedPacketCreate, RedPacketExpire,
        RefillQueueMessage, RefillRequest, RefillResult, Status,
    },
    scripts::{PoolKeys, Scripts},
};

/// A stocking attempt's token, held while the attempt runs.
type Attempt = Arc<tokio::sync::Mutex<String>>;

/// Everything a refill needs.
#[derive(Debug)]
pub struct RefillWorker {
    config: Config,
    redis: RedisConn,
    db: PgPool,
    scripts: Scripts,
    /// Seals the refunds this worker sends to the ledger.
    sealer: crate::ledger::FleetSealer,
    /// The stocking attempt (its token) of each pool and trigger this
    /// worker is working on.
    attempts: std::sync::Mutex<HashMap<(String, u64), Attempt>>,
}

impl RefillWorker {
    /// Builds the worker from its connections.
    pub fn new(config: Config, redis: RedisConn, db: PgPool) -> Self {
        Self {
            config,
            redis,
            db,
            scripts: Scripts::new(),
            sealer: crate::ledger::FleetSealer::default(),
            attempts: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The attempt of this worker at stocking the batch after `trigger` of
    /// `pool`: one token, kept until the batch exists.
    fn attempt(&self, pool: &str, trigger: u64) -> Attempt {
        let mut attempts = self.attempts.lock().unwrap_or_else(|e| e.into_inner());
        if attempts.len() >= 10_000 {
            attempts.clear();
        }
        attempts
            .entry((pool.to_owned(), trigger))
            .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(ulid::Ulid::new().to_string())))
            .clone()
    }

    /// Stocks the batch after `req.trigger`, unless it exists.
    pub async fn refill(&self, req: RefillRequest) -> Result<Unsealed, HandleError> {
        let started = std::time::Instant::now();
        req.validate()?;
        let keys = PoolKeys::new(&self.config.redis_prefix, &req.pool);
        let mut conn = self.redis.clone();
        // The config comes from Redis, where `pool load` writes it next to
        // the pool's counters: a Postgres outage does not stop refills.
        let stored = lucky_gift::stored_config(&mut conn, &keys)
            .await
            .map_err(HandleError::classify)?;
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
        // A sharded pool holds no prizes of its own: its sub-pools do, and
        // each asks for its own batches.
        if pool.shards > 1 {
            return Err(Invalid::new(format!(
                "{} is stocked as {} sub-pools; a refill names one of them",
                req.pool, pool.shards
            ))
            .into());
        }
        // Another attempt may hold the lease; wait for it to finish (then the
        // batch exists) or to die (then its lease expires and we take over).
        let deadline = tokio::time::Instant::now()
            + Duration::from_millis(2 * lucky_gift::DEFAULT_LEASE_MS.unsigned_abs());
        // This worker's attempt at this trigger, under one token across
        // retries: after a Redis failure halfway, the retry takes its own
        // lease back at once. Requests for the same trigger in this worker
        // wait for each other (and then find the batch stocked).
        let attempt = self.attempt(&req.pool, req.trigger);
        let token = attempt.lock().await;
        loop {
            // The batch's commitment goes to Postgres before the batch is
            // visible, and into the `pool.refilled` event.
            let recorder = crate::audit::PgRecorder::new(&self.db)
                .with_outbox(self.redis.clone(), &self.config.redis_prefix);
            let outcome = lucky_gift::stock_committed(
                &mut conn,
                &self.scripts,
                &keys,
                &pool,
                version,
                &table,
                req.trigger,
                self.config.refill_chunk,
                lucky_gift::DEFAULT_LEASE_MS,
                &token,
                &recorder,
            )
            .await;
            let committed = recorder.take();
            // The attempt is over unless it waits for another one or meets
            // a server that is away (then it tries again under its token).
            if !matches!(outcome, Ok(StockOutcome::Busy { .. }) | Err(_)) {
                self.attempts
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&(req.pool.clone(), req.trigger));
            }
            match outcome {
                Ok(StockOutcome::Stocked { generation, size }) => {
                    tracing::info!(pool = %req.pool, generation, size, urgent = req.urgent, "batch stocked");
                    metrics::counter!("prizepool_batches_stocked_total").increment(1);
                    // From the refill request's arrival to the batch drawable.
                    metrics::histogram!("prizepool_refill_seconds")
                        .record(started.elapsed().as_secs_f64());
                    let event = PoolRefilled {
                        pool: req.pool.clone(),
                        generation,
                        size,
                        version,
                        urgent: req.urgent,
                        commitment: committed.as_ref().map(|c| c.commitment.clone()),
                        composition: committed.map(|c| c.composition),
                    };
                    return Ok(Unsealed {
                        reply: Some(refilled(&req.pool, generation)),
                        effects: vec![self.refilled_event(&event).await?],
                        ..Unsealed::default()
                    });
                }
                Ok(StockOutcome::AlreadyDone { generation }) => {
                    tracing::debug!(pool = %req.pool, trigger = req.trigger, generation, "duplicate refill request");
                    // The attempt that stocked the batch may have died before
                    // its `pool.refilled` left (a redelivery lands here): tell
                    // the commitment again while the batch is still secret.
                    let mut effects = Vec::new();
                    if let Some(event) = self
                        .commitment_again(&keys, &pool, version, req.trigger + 1)
                        .await?
                    {
                        effects.push(self.refilled_event(&event).await?);
                    }
                    return Ok(Unsealed {
                        reply: Some(refilled(&req.pool, generation)),
                        effects,
                        ..Unsealed::default()
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
    /// The `pool.refilled` event of `event`, sealed with the fleet's key so
    /// the audit trail believes it whatever the pool's state is by the time
    /// it reads it.
    async fn refilled_event(&self, event: &PoolRefilled) -> Result<Outgoing, HandleError> {
        let mut conn = self.redis.clone();
        let sealer = self.sealer.get(&mut conn, &self.config).await?;
        let body = crate::audit::pool_refilled(&sealer, event)
            .map_err(|e| HandleError::Internal(e.into()))?;
        Ok(Outgoing::event_raw("pool.refilled", body))
    }

    /// The `pool.refilled` event of batch `generation` once more, with its
    /// commitment, if its seed is still secret and it was stocked under
    /// `version` (whose composition `pool` holds). Consumers key it by pool
    /// and generation, so a repeat records nothing twice.
    async fn commitment_again(
        &self,
        keys: &PoolKeys,
        pool: &lucky_gift::PoolConfig,
        version: i64,
        generation: u64,
    ) -> Result<Option<PoolRefilled>, HandleError> {
        let mut conn = self.redis.clone();
        let record: Option<String> = redis::cmd("HGET")
            .arg(keys.meta())
            .arg(format!("c:{generation}"))
            .query_async(&mut conn)
            .await?;
        let Some((stocked_under, seed)) = record.as_deref().and_then(|r| r.split_once('|')) else {
            return Ok(None);
        };
        let Some(seed) = crate::fairness::Seed::from_hex(seed) else {
            return Ok(None);
        };
        if stocked_under.parse::<i64>().ok() != Some(version) {
            return Ok(None);
        }
        Ok(Some(PoolRefilled {
            pool: pool.id.clone(),
            generation,
            size: pool.batch_size() as usize,
            version,
            urgent: false,
            commitment: Some(seed.commitment()),
            composition: Some(lucky_gift::composition(pool)),
        }))
    }

    /// Creates a red packet and schedules its expiry
    /// ([`red_packet::lifecycle::create`]).
    pub async fn create_red_packet(&self, req: RedPacketCreate) -> Result<Unsealed, HandleError> {
        red_packet::lifecycle::create(&self.life(), req).await
    }

    /// Closes a red packet whose stored expiry has come and refunds what is
    /// left ([`red_packet::lifecycle::expire`]).
    pub async fn expire_red_packet(&self, req: RedPacketExpire) -> Result<Unsealed, HandleError> {
        red_packet::lifecycle::expire(&self.life(), req).await
    }

    /// What a red packet's lifecycle steps use of this worker.
    fn life(&self) -> red_packet::lifecycle::Life<'_> {
        red_packet::lifecycle::Life {
            db: &self.db,
            redis: &self.redis,
            scripts: &self.scripts,
            prefix: &self.config.redis_prefix,
        }
    }
}

/// The `ok` reply to a refill: `pool` is at batch `generation`.
fn refilled(pool: &str, generation: u64) -> Vec<u8> {
    typed_json(
        "refill_result",
        &RefillResult {
            status: Status::Ok,
            pool: pool.to_owned(),
            generation,
        },
    )
}

impl Handler for RefillWorker {
    fn route(&self) -> amqp::Route {
        amqp::REFILL
    }

    fn span_fields(&self) -> amqp::SpanFields {
        amqp::SpanFields {
            pool: &["pool", "packet_id"],
            user: &["sender"],
        }
    }

    fn groups(&self) -> &'static [Group] {
        &[ledger::ENTRIES]
    }

    fn lane(&self, envelope: &Value) -> Option<&'static str> {
        // Red-packet creates and expiries need Postgres; refills do not.
        let kind = envelope.get("type")?.as_str()?;
        kind.starts_with("redpacket.").then_some("postgres")
    }

    async fn handle(
        &self,
        envelope: &Value,
        _publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        let unsealed = match decode_typed::<RefillQueueMessage>(envelope)? {
            RefillQueueMessage::Refill(req) => self.refill(req).await,
            RefillQueueMessage::RedPacketCreate(req) => self.create_red_packet(req).await,
            RefillQueueMessage::RedPacketExpire(req) => self.expire_red_packet(req).await,
        }?;
        let mut conn = self.redis.clone();
        unsealed.seal(&self.sealer, &mut conn, &self.config).await
    }
}

/// The queues whose depths the refill worker reports: every work queue and
/// its dead letters, every draw shard, and the audit trail's queue.
pub fn watched_queues(draw_shards: u16) -> Vec<String> {
    let routes = amqp::ROUTES.into_iter().chain([crate::audit::ROUTE]);
    let mut queues: Vec<String> = routes
        .flat_map(|r| [r.queue.to_owned(), r.dlq.to_owned()])
        .collect();
    queues.extend((1..draw_shards).map(amqp::draw_shard));
    queues
}

/// Runs a refill worker until `shutdown`.
pub async fn run(
    config: Config,
    health: crate::ops::Health,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let redis = crate::redis_conn::connect(&config.redis_url).await?;
    let db = crate::db::connect(&config.database_url).await?;
    // Commitments Postgres could not take while it was away reach it from
    // the outbox in Redis once it is back.
    tokio::spawn(crate::audit::keep_draining(
        db.clone(),
        redis.clone(),
        config.redis_prefix.clone(),
        shutdown.clone(),
    ));
    let worker = Arc::new(RefillWorker::new(config.clone(), redis, db));
    tokio::spawn(amqp::depth::watch(
        config.amqp_url.clone(),
        watched_queues(config.draw_shards),
        shutdown.clone(),
    ));
    amqp::run(&config, worker, health, shutdown).await
}

#[cfg(test)]
mod tests {
    #[test]
    fn depths_are_watched_on_every_queue_a_draw_can_wait_in() {
        let one = super::watched_queues(1);
        for queue in [
            "prizepool.draw",
            "prizepool.draw.dlq",
            "prizepool.refill",
            "prizepool.refill.dlq",
            "prizepool.settle",
            "prizepool.settle.dlq",
            "prizepool.audit",
            "prizepool.audit.dlq",
        ] {
            assert!(one.iter().any(|q| q == queue), "{queue} in {one:?}");
        }
        assert!(!one.iter().any(|q| q == "prizepool.draw.1"));
        let three = super::watched_queues(3);
        assert_eq!(three.len(), one.len() + 2);
        for shard in ["prizepool.draw.1", "prizepool.draw.2"] {
            assert!(three.iter().any(|q| q == shard), "{shard} in {three:?}");
        }
    }
}
