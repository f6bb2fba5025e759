//! The refill worker: a dispatcher for the refill queue. It hands each
//! message to the kind whose lifecycle step it is, by its `type`
//! ([`registry::lifecycle`]: every registered kind lists its messages and
//! their handlers), then seals and publishes what comes back, as the draw
//! worker does for draws. Today: `refill` stocks a lucky-gift pool's next
//! batch (`kinds/lucky_gift/refill.rs`, where its races are explained);
//! `redpacket.create` and `redpacket.expire` are a red packet's create and
//! expiry (`kinds/red_packet/lifecycle.rs`).
//!
//! It also keeps the depth gauges of every queue and the stock gauges of
//! every lucky-gift pool ([`stock`]), and drains the outbox of commitments
//! Postgres could not take.

mod stock;

use std::{any::Any, sync::Arc};

use crate::redis_conn::RedisConn;
use serde_json::Value;
use sqlx::PgPool;

use crate::{
    amqp::{self, Group, HandleError, Handler, Outcome, Publisher},
    config::Config,
    kinds::registry::{self, Life, KINDS},
    ledger::{self, Unsealed},
    messages::Invalid,
    scripts::Scripts,
};

/// Everything a refill needs.
#[derive(Debug)]
pub struct RefillWorker {
    config: Config,
    redis: RedisConn,
    db: PgPool,
    scripts: Scripts,
    /// Seals the refunds and events this worker sends.
    sealer: crate::ledger::FleetSealer,
    /// Each kind's state in this worker ([`registry::PrizeKind::open_life`]:
    /// lucky gift's stocking attempts), in the order of [`KINDS`].
    states: Vec<Box<dyn Any + Send + Sync>>,
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
            states: KINDS.iter().map(|k| k.open_life()).collect(),
        }
    }

    /// Runs the lifecycle step of the message `envelope` (its `type` names
    /// it) and answers what it owes, unsealed: what [`Handler::handle`]
    /// does before sealing and publishing, callable without a broker.
    pub async fn step(&self, envelope: &Value) -> Result<Unsealed, HandleError> {
        let message = envelope
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let Some((slot, lifecycle)) = registry::lifecycle(message) else {
            return Err(Invalid::new(format!("unknown type {message:?}")).into());
        };
        let Some(state) = self.states.get(slot) else {
            return Err(HandleError::internal("a kind outside the registry"));
        };
        let life = Life {
            config: &self.config,
            db: &self.db,
            redis: &self.redis,
            scripts: &self.scripts,
            sealer: &self.sealer,
            state: state.as_ref(),
        };
        (lifecycle.handle)(&life, envelope).await
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
        // The steps that need Postgres get a lane of their own.
        let message = envelope.get("type")?.as_str()?;
        let (_, lifecycle) = registry::lifecycle(message)?;
        lifecycle.postgres.then_some("postgres")
    }

    async fn handle(
        &self,
        envelope: &Value,
        _publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        let unsealed = self.step(envelope).await?;
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
    tokio::spawn(stock::watch(
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
