//! The refill worker: a dispatcher for the refill queue. It hands each
//! message to the kind whose life step it is, then seals and publishes what
//! comes back, as the draw worker does for draws:
//!
//! - `refill`: stock a lucky-gift pool's next batch
//!   ([`lucky_gift::refill`], where its races are explained);
//! - `redpacket.create`, `redpacket.expire`: a red packet's create and
//!   expiry ([`red_packet::lifecycle`]).
//!
//! It also keeps the depth gauges of every queue and drains the outbox of
//! commitments Postgres could not take.

use std::sync::Arc;

use crate::redis_conn::RedisConn;
use serde_json::Value;
use sqlx::PgPool;

use crate::{
    amqp::{self, Group, HandleError, Handler, Outcome, Outgoing, Publisher},
    config::Config,
    kinds::{lucky_gift, red_packet},
    ledger::{self, Unsealed},
    messages::{
        decode_typed, PoolRefilled, RedPacketCreate, RedPacketExpire, RefillQueueMessage,
        RefillRequest,
    },
    scripts::Scripts,
};

/// Everything a refill needs.
#[derive(Debug)]
pub struct RefillWorker {
    config: Config,
    redis: RedisConn,
    db: PgPool,
    scripts: Scripts,
    /// Seals the refunds this worker sends to the ledger.
    sealer: crate::ledger::FleetSealer,
    /// The lucky-gift stocking attempts this worker is working on.
    attempts: lucky_gift::refill::Attempts,
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
            attempts: lucky_gift::refill::Attempts::default(),
        }
    }

    /// Stocks the batch after `req.trigger`, unless it exists
    /// ([`lucky_gift::refill::refill`]), its commitment recorded in
    /// Postgres (or the outbox in Redis) before the batch is visible.
    pub async fn refill(&self, req: RefillRequest) -> Result<Unsealed, HandleError> {
        let at = lucky_gift::refill::Refill {
            db: &self.db,
            redis: &self.redis,
            scripts: &self.scripts,
            prefix: &self.config.redis_prefix,
            chunk: self.config.refill_chunk,
            attempts: &self.attempts,
        };
        let recorder = crate::audit::PgRecorder::new(&self.db)
            .with_outbox(self.redis.clone(), &self.config.redis_prefix);
        let refilled = lucky_gift::refill::refill(&at, &recorder, req).await?;
        let mut effects = Vec::with_capacity(refilled.events.len());
        for event in &refilled.events {
            effects.push(self.refilled_event(event).await?);
        }
        Ok(Unsealed {
            reply: Some(refilled.reply),
            effects,
            ..Unsealed::default()
        })
    }

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
