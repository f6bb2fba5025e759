//! The audit trail of provably fair lucky-gift batches (`docs/fairness.md`):
//! what each batch committed to, the seeds revealed, and every draw with
//! the positions of its prizes, kept in Postgres in append-only tables
//! (`migrations/20261125000002_fairness.sql`), and the verifier that
//! recomputes a batch from its revealed seed ([`verify`]).
//!
//! The trail is fed by the events the fleet publishes anyway: the audit
//! consumer (run inside the settle worker) reads `pool.refilled` (a batch's
//! commitment and composition) and `draw.completed` / `draw.completed.batch`
//! (each draw's prizes and positions, and the seeds a draw revealed) from
//! its own queue, `prizepool.audit`, bound to `prizepool.events`. Every
//! insert skips a row that is already there, so redeliveries and replays
//! record once. The refill worker also records each commitment itself,
//! before the batch is visible ([`PgRecorder`]); when Postgres is away it
//! goes on stocking, and the commitment reaches Postgres later through the
//! `pool.refilled` event, which the audit queue keeps until Postgres is
//! back. Events are checked against stored state before they are recorded
//! ([`AuditWorker`]).

mod verify;

use std::{sync::Arc, time::Duration};

use anyhow::Context;
use lapin::{
    options::{QueueBindOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable, LongString},
};
use serde_json::Value;
use sqlx::{types::Json, PgPool};
use tokio_util::sync::CancellationToken;

pub use verify::{verify, BatchVerdict, Mismatch, Verdict};

use crate::{
    amqp::{self, HandleError, Handler, Outcome, Publisher, Route},
    config::Config,
    kinds::lucky_gift::{Commitment, Recorder},
    messages::{DrawResult, Invalid, PoolRefilled, Reveal, Status},
    ops::Health,
};

/// The audit queue, bound to [`amqp::EVENTS`] for the events it records.
pub const ROUTE: Route = Route {
    queue: "prizepool.audit",
    routing_key: "draw.completed",
    dlq: "prizepool.audit.dlq",
};

/// Routing keys of the events the audit trail records.
pub const EVENTS: [&str; 2] = ["draw.completed", "pool.refilled"];

/// Records a batch's commitment; a row already there is kept.
pub async fn record_batch(db: &PgPool, c: &Commitment) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO fair_batches (pool, generation, version, commitment, size, composition)
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
    )
    .bind(&c.pool)
    .bind(c.generation as i64)
    .bind(c.version)
    .bind(&c.commitment)
    .bind(c.size as i64)
    .bind(Json(&c.composition))
    .execute(db)
    .await?;
    Ok(())
}

/// Records a revealed seed; a reveal already there is kept.
pub async fn record_reveal(db: &PgPool, pool: &str, reveal: &Reveal) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO fair_reveals (pool, generation, version, seed)
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )
    .bind(pool)
    .bind(reveal.generation as i64)
    .bind(reveal.version)
    .bind(&reveal.seed)
    .execute(db)
    .await?;
    Ok(())
}

/// Records a lucky-gift draw (and the seeds it revealed). Results of other
/// kinds, refusals and draws stocked before batches were committed (no
/// positions) record nothing.
pub async fn record_draw(db: &PgPool, result: &DrawResult) -> Result<(), sqlx::Error> {
    record_draws(db, std::slice::from_ref(result)).await
}

/// Records several draws in one transaction (a `draw.completed.batch`).
pub async fn record_draws(db: &PgPool, results: &[DrawResult]) -> Result<(), sqlx::Error> {
    let mut tx = db.begin().await?;
    for result in results {
        let (Status::Ok, Some(pool), Some(user), Some(serial), Some(version)) = (
            result.status,
            result.pool.as_deref(),
            result.user_id,
            result.serial,
            result.version,
        ) else {
            continue;
        };
        for reveal in &result.revealed {
            sqlx::query(
                "INSERT INTO fair_reveals (pool, generation, version, seed)
                 VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            )
            .bind(pool)
            .bind(reveal.generation as i64)
            .bind(reveal.version)
            .bind(&reveal.seed)
            .execute(&mut *tx)
            .await?;
        }
        if !result.positions.is_empty() {
            sqlx::query(
                "INSERT INTO fair_draws (pool, serial, request_id, user_id, version, prizes, positions, held_back)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
            )
            .bind(pool)
            .bind(serial)
            .bind(&result.request_id)
            .bind(user)
            .bind(version)
            .bind(Json(&result.prizes))
            .bind(Json(&result.positions))
            .bind(Json(&result.held_back))
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await
}

/// The refill worker's [`Recorder`]: writes each commitment to Postgres
/// before its batch becomes visible, and keeps it for the `pool.refilled`
/// event. A Postgres that is away (or slower than [`RECORD_WAIT`]) is
/// logged and skipped: stocking must go on, and the event brings the
/// commitment to Postgres later.
#[derive(Debug)]
pub struct PgRecorder<'a> {
    db: &'a PgPool,
    last: std::sync::Mutex<Option<Commitment>>,
}

/// How long stocking waits for Postgres to take a commitment.
pub const RECORD_WAIT: Duration = Duration::from_millis(500);

impl<'a> PgRecorder<'a> {
    /// A recorder writing to `db`.
    pub fn new(db: &'a PgPool) -> Self {
        Self {
            db,
            last: std::sync::Mutex::new(None),
        }
    }

    /// The last commitment recorded (for the `pool.refilled` event).
    pub fn take(&self) -> Option<Commitment> {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// After a commitment failed to reach Postgres, stocking stops trying for
/// this long: while Postgres is away each batch would otherwise wait
/// [`RECORD_WAIT`], and draws would meet a short pool. The events bring
/// those commitments to Postgres later.
const AWAY_FOR: Duration = Duration::from_secs(5);

/// Until when commitments skip each database (by host, port and name; see
/// [`AWAY_FOR`]).
static AWAY_UNTIL: std::sync::Mutex<Vec<(String, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

impl Recorder for PgRecorder<'_> {
    async fn record(&self, c: &Commitment) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(c.clone());
        let options = self.db.connect_options();
        let database = format!(
            "{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or_default()
        );
        let away = |until: Option<std::time::Instant>| {
            let mut all = AWAY_UNTIL.lock().unwrap_or_else(|e| e.into_inner());
            let now = std::time::Instant::now();
            all.retain(|(d, t)| *d != database && *t > now);
            if let Some(until) = until {
                all.push((database.clone(), until));
            }
        };
        let skip = AWAY_UNTIL
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(d, until)| *d == database && std::time::Instant::now() < *until);
        if skip {
            tracing::debug!(
                pool = %c.pool, generation = c.generation,
                "Postgres was away a moment ago; the pool.refilled event will bring the commitment"
            );
            return;
        }
        match tokio::time::timeout(RECORD_WAIT, record_batch(self.db, c)).await {
            Ok(Ok(())) => away(None),
            Ok(Err(e)) => {
                away(Some(std::time::Instant::now() + AWAY_FOR));
                tracing::warn!(
                    pool = %c.pool, generation = c.generation, error = %e,
                    "commitment not recorded in Postgres yet; the pool.refilled event will bring it"
                );
            }
            Err(_) => {
                away(Some(std::time::Instant::now() + AWAY_FOR));
                tracing::warn!(
                    pool = %c.pool, generation = c.generation,
                    "Postgres is slow; the commitment will be recorded from the pool.refilled event"
                );
            }
        }
    }
}

/// The audit consumer: records the events of [`EVENTS`], each checked
/// against stored state first (anyone who may publish on the events
/// exchange could otherwise write the trail): a draw against its stored
/// answer in Redis, a commitment against the seed kept in Redis (or already
/// revealed) and the composition against the pool's stored config version.
/// An event that does not match is dead-lettered with the reason; one
/// whose stored state is gone (an answer past `RESULT_TTL_S`) too, so
/// nothing leaves the trail unseen.
#[derive(Debug)]
pub struct AuditWorker {
    db: PgPool,
    redis: crate::redis_conn::RedisConn,
    scripts: crate::scripts::Scripts,
    prefix: String,
    /// `RESULT_TTL_S`: where the draw workers keep answers depends on it.
    result_ttl_s: u64,
}

impl AuditWorker {
    /// A consumer writing to `db`, checking against the pools under
    /// `prefix` whose answers are kept `result_ttl_s` seconds.
    pub fn new(
        db: PgPool,
        redis: crate::redis_conn::RedisConn,
        prefix: &str,
        result_ttl_s: u64,
    ) -> Self {
        Self {
            db,
            redis,
            scripts: crate::scripts::Scripts::new(),
            prefix: prefix.to_owned(),
            result_ttl_s,
        }
    }

    /// Refuses a draw record its stored answer does not vouch for.
    async fn check_draw(&self, result: &DrawResult) -> Result<(), HandleError> {
        let (Status::Ok, Some(pool), Some(_)) =
            (result.status, result.pool.as_deref(), result.serial)
        else {
            return Ok(());
        };
        crate::messages::check_id("pool", pool)?;
        crate::messages::check_id("request_id", &result.request_id)?;
        let keys = crate::scripts::PoolKeys::new(&self.prefix, pool);
        let mut conn = self.redis.clone();
        let (Some(user), Ok(count)) = (result.user_id, u32::try_from(result.prizes.len())) else {
            return Err(Invalid::new("a draw record without its user").into());
        };
        let Some(stored) = crate::kinds::lucky_gift::stored_award(
            &mut conn,
            &self.scripts,
            &self.prefix,
            &keys,
            pool,
            &result.request_id,
            user,
            count,
            self.result_ttl_s,
        )
        .await?
        else {
            return Err(Invalid::new(format!(
                "draw {} of pool {pool} has no stored answer to check its record against",
                result.request_id
            ))
            .into());
        };
        let same = Some(stored.serial) == result.serial
            && Some(stored.version) == result.version
            && stored.codes.len() == result.prizes.len()
            && stored.positions == result.positions
            && stored.held_back == result.held_back
            && stored.revealed == result.revealed;
        if !same {
            return Err(Invalid::new(format!(
                "draw {} of pool {pool} does not match its stored answer",
                result.request_id
            ))
            .into());
        }
        Ok(())
    }

    /// Refuses a commitment the pool's state does not vouch for.
    async fn check_batch(&self, c: &Commitment) -> Result<(), HandleError> {
        crate::messages::check_id("pool", &c.pool)?;
        let keys = crate::scripts::PoolKeys::new(&self.prefix, &c.pool);
        let mut conn = self.redis.clone();
        let kept: Option<String> = redis::cmd("HGET")
            .arg(keys.meta())
            .arg(format!("c:{}", c.generation))
            .query_async(&mut conn)
            .await?;
        let seed = match kept.as_deref().and_then(|k| k.split_once('|')) {
            Some((version, seed)) if version.parse::<i64>().ok() == Some(c.version) => {
                Some(seed.to_owned())
            }
            Some(_) => None,
            None => sqlx::query_scalar(
                "SELECT seed FROM fair_reveals WHERE pool = $1 AND generation = $2 AND version = $3",
            )
            .bind(&c.pool)
            .bind(c.generation as i64)
            .bind(c.version)
            .fetch_optional(&self.db)
            .await?,
        };
        let seed_ok = seed
            .as_deref()
            .and_then(crate::fairness::Seed::from_hex)
            .is_some_and(|s| s.commitment() == c.commitment);
        let config: Option<Json<crate::kinds::lucky_gift::PoolConfig>> = sqlx::query_scalar(
            "SELECT config FROM pool_versions WHERE pool_id = $1 AND version = $2",
        )
        .bind(&c.pool)
        .bind(c.version)
        .fetch_optional(&self.db)
        .await?;
        let composition_ok = config.is_some_and(|Json(config)| {
            crate::kinds::lucky_gift::composition(&config) == c.composition
                && config.batch_size() == c.size
        });
        if !(seed_ok && composition_ok) {
            return Err(Invalid::new(format!(
                "the commitment of batch {} of pool {} does not match the pool's state",
                c.generation, c.pool
            ))
            .into());
        }
        Ok(())
    }

    /// Records one event.
    pub async fn record(&self, event: &Value) -> Result<(), HandleError> {
        let kind = event
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        match kind {
            "draw.completed" => {
                let result: DrawResult = serde_json::from_value(event.clone()).map_err(|e| {
                    Invalid::new(format!("a draw.completed that does not read: {e}"))
                })?;
                self.check_draw(&result).await?;
                record_draw(&self.db, &result).await?;
            }
            "draw.completed.batch" => {
                let events = event
                    .get("events")
                    .and_then(Value::as_array)
                    .ok_or_else(|| Invalid::new("draw.completed.batch without events"))?;
                let mut checked = Vec::with_capacity(events.len());
                for e in events {
                    let result: DrawResult = serde_json::from_value(e.clone()).map_err(|e| {
                        Invalid::new(format!("a draw.completed that does not read: {e}"))
                    })?;
                    // One bad record must not keep the others of its group
                    // out of the trail: it is logged and counted, the rest
                    // recorded (a lone bad event is dead-lettered).
                    match self.check_draw(&result).await {
                        Ok(()) => checked.push(result),
                        Err(HandleError::Invalid(invalid)) => {
                            metrics::counter!("prizepool_audit_refused_total").increment(1);
                            tracing::error!(request.id = %result.request_id, reason = %invalid, "draw record refused by the audit");
                        }
                        Err(e) => return Err(e),
                    }
                }
                record_draws(&self.db, &checked).await?;
            }
            "pool.refilled" => {
                let event: PoolRefilled = serde_json::from_value(event.clone()).map_err(|e| {
                    Invalid::new(format!("a pool.refilled that does not read: {e}"))
                })?;
                if let (Some(commitment), Some(composition)) = (event.commitment, event.composition)
                {
                    let c = Commitment {
                        pool: event.pool,
                        generation: event.generation,
                        version: event.version,
                        commitment,
                        size: event.size as u64,
                        composition,
                    };
                    self.check_batch(&c).await?;
                    record_batch(&self.db, &c).await?;
                }
            }
            // Other facts on the bound keys are not the audit's business.
            _ => {}
        }
        Ok(())
    }
}

impl Handler for AuditWorker {
    fn route(&self) -> Route {
        ROUTE
    }

    async fn handle(
        &self,
        envelope: &Value,
        _publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        self.record(envelope).await?;
        Ok(Outcome::default())
    }
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}

/// Declares the audit queue (a quorum queue with the same dead-lettering as
/// the work queues) and binds it to the events it records. Idempotent.
pub async fn declare(channel: &lapin::Channel, delivery_limit: u32) -> anyhow::Result<()> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let mut quorum = FieldTable::default();
    quorum.insert("x-queue-type".into(), text("quorum"));
    channel
        .queue_declare(ROUTE.dlq.into(), durable, quorum.clone())
        .await
        .context("declaring the audit dead-letter queue")?;
    channel
        .queue_bind(
            ROUTE.dlq.into(),
            amqp::DLX.into(),
            ROUTE.queue.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut args = quorum;
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongLongInt(i64::from(delivery_limit)),
    );
    args.insert("x-dead-letter-exchange".into(), text(amqp::DLX));
    args.insert("x-dead-letter-routing-key".into(), text(ROUTE.queue));
    args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
    args.insert("x-overflow".into(), text("reject-publish"));
    channel
        .queue_declare(ROUTE.queue.into(), durable, args)
        .await
        .context("declaring the audit queue")?;
    for key in EVENTS {
        channel
            .queue_bind(
                ROUTE.queue.into(),
                amqp::EVENTS.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("binding the audit queue to {key}"))?;
    }
    Ok(())
}

/// Runs the audit consumer until `shutdown`: declares its queue (retrying
/// while the broker is away), then consumes it with the shared loop.
pub async fn run(
    config: Config,
    health: Health,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy(&config.database_url)?;
    let mut delay = Duration::from_millis(100);
    loop {
        let declared = async {
            let conn = amqp::connect(&config.amqp_url, "prizepool.audit.declare").await?;
            let channel = conn.create_channel().await?;
            amqp::declare_topology_for(&channel, &config).await?;
            declare(&channel, config.delivery_limit).await?;
            conn.close(200, "declared".into()).await.ok();
            anyhow::Ok(())
        };
        match declared.await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    ?delay,
                    "declaring the audit queue; retrying"
                );
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
    let redis = crate::redis_conn::connect(&config.redis_url).await?;
    let worker = AuditWorker::new(db, redis, &config.redis_prefix, config.result_ttl.as_secs());
    amqp::run(&config, Arc::new(worker), health, shutdown).await
}
