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
//! back. Events are checked before they are recorded ([`AuditWorker`]): a
//! draw record by the seal the draw worker put on it ([`draw_completed`]),
//! a commitment by the seal the refill worker put on it, or else against the
//! pool's state ([`commitments`]).

mod commitments;
pub mod incoming;
mod lottery;
mod recorder;
mod records;
mod verify;
mod writer;

use std::{sync::Arc, time::Duration};

use anyhow::Context;
use backon::Retryable;
use lapin::{
    options::{QueueBindOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable, LongString},
};
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub use commitments::{pool_refilled, CATCH_UP};
pub use lottery::{is_activity, verify_activity, LotteryMismatch, LotteryVerdict, PeriodVerdict};
pub(crate) use recorder::{database_away, keep_in_outbox, mark_database};
pub use recorder::{
    drain_outbox, keep_draining, sweep_outboxes, PgRecorder, OUTBOX, OUTBOX_INDEX, RECORD_WAIT,
};
pub use records::{prizes_sha256, record_batch, record_draw, record_draws, record_reveal};
pub use verify::{merged, verify, verify_pool, BatchVerdict, Mismatch, Verdict};

use incoming::Record;

use crate::{
    amqp::{self, Group, HandleError, Handler, Outcome, Publisher, Route},
    config::Config,
    kinds::lucky_gift::Commitment,
    ledger::{FleetSealer, Sealer},
    messages::{DrawResult, Invalid, PoolRefilled, Status},
    ops::Health,
};

/// The audit queue, bound to [`amqp::EVENTS`] for the events it records.
pub const ROUTE: Route = Route {
    queue: "prizepool.audit",
    routing_key: "draw.completed",
    dlq: "prizepool.audit.dlq",
};

/// `draw.completed` events (with `DRAW_EVENTS=grouped`), grouped as
/// `draw.completed.batch` under the same routing key on the events exchange.
/// The draw worker publishes them; the trail is their reader.
pub const DRAW_COMPLETED: Group = Group::event("draw.completed", "draw.completed.batch", "events");

/// Routing keys of the events the audit trail records.
pub const EVENTS: [&str; 2] = ["draw.completed", "pool.refilled"];

/// The `draw.completed` event of a draw result serialised as `fields`
/// (`serde_json::to_vec` of its `DrawResult`, the bytes its reply is made
/// of): `{"type":"draw.completed",<fields>,"seal":"<hex>"}`, the seal being
/// [`Sealer::seal_record`] of `fields`. The audit consumer records only
/// sealed draws. Without a key (Redis could not give it; logged) the event
/// goes unsealed: downstream consumers still hear of the draw, the audit
/// refuses it and counts the refusal.
pub fn draw_completed(sealer: &FleetSealer, config: &Config, fields: &[u8]) -> Vec<u8> {
    let mut event = crate::messages::retype(DRAW_COMPLETED.routing_key, fields);
    let Some(sealer) = sealer.ready(config) else {
        return event;
    };
    let seal = sealer.seal_record(fields);
    // `retype` always ends the object with its closing brace.
    if event.last() == Some(&b'}') {
        event.pop();
        event.extend_from_slice(br#","seal":""#);
        event.extend_from_slice(seal.as_bytes());
        event.extend_from_slice(br#""}"#);
    }
    event
}

/// How old the key may be when a record did not check with it, before it
/// is read again: a burst of forgeries costs Redis a read a second at most.
const SEAL_RECHECK: Duration = Duration::from_secs(1);

/// The audit consumer: records the events of [`EVENTS`], each checked
/// first (anyone who may publish on the events exchange could otherwise
/// write the trail): a draw record by the fleet's seal over its canonical
/// bytes ([`draw_completed`] seals it in the draw worker), a commitment
/// against the seed kept in Redis (or already revealed) and the
/// composition against the pool's stored config version. An event that
/// does not pass is dead-lettered with the reason, so nothing leaves the
/// trail unseen.
#[derive(Debug)]
pub struct AuditWorker {
    db: PgPool,
    redis: crate::redis_conn::RedisConn,
    prefix: String,
    /// The fleet's key, which seals every `draw.completed` record and every
    /// `pool.refilled`, read again as the fleet's key changes.
    sealer: FleetSealer,
    /// `LEDGER_SEAL_KEY`, when set.
    key: Option<String>,
    /// Writes the draws of concurrent deliveries together.
    writer: writer::DrawWriter,
}

impl AuditWorker {
    /// A consumer writing to `db`, checking commitments against the pools
    /// under `prefix` and draw records against `sealer`.
    pub fn new(
        db: PgPool,
        redis: crate::redis_conn::RedisConn,
        prefix: &str,
        sealer: Sealer,
    ) -> Self {
        Self {
            db,
            redis,
            prefix: prefix.to_owned(),
            sealer: FleetSealer::fixed(sealer),
            key: None,
            writer: writer::DrawWriter::default(),
        }
    }

    /// A consumer that checks records with the fleet's key as the workers
    /// hold it: `LEDGER_SEAL_KEY` (`key`), or the key kept in Redis under
    /// `prefix`, read again when it changes.
    pub fn of_fleet(
        db: PgPool,
        redis: crate::redis_conn::RedisConn,
        prefix: &str,
        key: Option<String>,
    ) -> Self {
        Self {
            db,
            redis,
            prefix: prefix.to_owned(),
            sealer: FleetSealer::default(),
            key,
            writer: writer::DrawWriter::default(),
        }
    }

    /// The fleet's sealer; read again from Redis first when `fresh` (a
    /// record did not check with the one held: the key may have changed).
    async fn sealer(&self, fresh: bool) -> Result<std::sync::Arc<Sealer>, HandleError> {
        let max_age = match fresh {
            true => SEAL_RECHECK,
            false => crate::ledger::KEY_REFRESH,
        };
        let mut conn = self.redis.clone();
        Ok(self
            .sealer
            .get_with(&mut conn, &self.prefix, self.key.as_deref(), max_age)
            .await?)
    }

    /// Refuses a `draw.completed` record unless it carries the fleet's seal
    /// over its canonical bytes: the `DrawResult` it deserialises to,
    /// serialised again, which are the bytes the draw worker sealed (the
    /// record's `type` and `seal` are not part of them, and a field the
    /// result does not know cannot reach the trail). Pure CPU: no Redis,
    /// however many records a group holds.
    fn check_draw(
        sealer: &Sealer,
        result: &DrawResult,
        seal: Option<&str>,
    ) -> Result<(), HandleError> {
        // Only what the trail records needs a seal; other results are skipped.
        let (Status::Ok, Some(pool), Some(_)) =
            (result.status, result.pool.as_deref(), result.serial)
        else {
            return Ok(());
        };
        crate::messages::check_id("pool", pool)?;
        crate::messages::check_id("request_id", &result.request_id)?;
        if result.user_id.is_none() {
            return Err(Invalid::new("a draw record without its user").into());
        }
        let Some(seal) = seal else {
            return Err(Invalid::new(format!(
                "draw {} of pool {pool} carries no seal: only the draw workers write the trail",
                result.request_id
            ))
            .into());
        };
        let canonical = serde_json::to_vec(result)
            .map_err(|e| HandleError::internal(format!("serialising a draw record: {e}")))?;
        if !sealer.check_record(&canonical, seal) {
            return Err(Invalid::new(format!(
                "draw {} of pool {pool} does not carry the fleet's seal over its content",
                result.request_id
            ))
            .into());
        }
        Ok(())
    }

    /// The draw records of `records` that read and carry the fleet's seal,
    /// checked with the key held and, for any whose seal fails, once more
    /// with the key read again (the fleet's key may have just changed). A
    /// lone record that fails is refused (dead-lettered); one bad record of
    /// a group is logged and counted and the others are recorded.
    async fn checked_draws(&self, records: Vec<Record>) -> Result<Vec<DrawResult>, HandleError> {
        let sealer = self.sealer(false).await?;
        let lone = records.len() == 1;
        let mut checked = Vec::with_capacity(records.len());
        let mut fresh = None;
        for record in records {
            let seal = record.seal.as_deref();
            let verdict = match &record.result {
                Err(invalid) => {
                    // As for a record whose seal fails: the key is read again
                    // first, so Redis being away makes it transient.
                    if fresh.is_none() {
                        fresh = Some(self.sealer(true).await?);
                    }
                    Err(HandleError::Invalid(invalid.clone()))
                }
                Ok(result) => match Self::check_draw(&sealer, result, seal) {
                    Err(HandleError::Invalid(_)) => {
                        if fresh.is_none() {
                            fresh = Some(self.sealer(true).await?);
                        }
                        Self::check_draw(fresh.as_deref().unwrap_or(&sealer), result, seal)
                    }
                    other => other,
                },
            };
            match verdict {
                Ok(()) => checked.extend(record.result.ok()),
                Err(HandleError::Invalid(invalid)) if !lone => {
                    metrics::counter!("prizepool_audit_refused_total").increment(1);
                    let request_id = record.request_id.as_deref();
                    tracing::error!(request.id = request_id.unwrap_or_default(), reason = %invalid, "draw record refused by the audit");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(checked)
    }

    /// Records one event.
    pub async fn record(&self, event: &Value) -> Result<(), HandleError> {
        let kind = event
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        match kind {
            "draw.completed" => {
                let result = self.checked_draws(vec![Record::of_value(event)]).await?;
                self.writer.record(&self.db, result).await?;
            }
            incoming::GROUP_TYPE => {
                let events = event
                    .get("events")
                    .and_then(Value::as_array)
                    .ok_or_else(|| Invalid::new("draw.completed.batch without events"))?;
                let records = events.iter().map(Record::of_value).collect();
                let checked = self.checked_draws(records).await?;
                self.writer.record(&self.db, checked).await?;
            }
            "pool.refilled" => {
                let raw = event;
                let event: PoolRefilled = serde_json::from_value(raw.clone()).map_err(|e| {
                    Invalid::new(format!("a pool.refilled that does not read: {e}"))
                })?;
                // The refill worker's seal vouches for the event whatever
                // state the pool is in by now; an unsealed one is checked
                // against that state.
                let mut sealed = commitments::is_sealed(&*self.sealer(false).await?, raw, &event);
                if !sealed && raw.get("seal").is_some() {
                    // Sealed with a key this consumer does not hold yet.
                    sealed = commitments::is_sealed(&*self.sealer(true).await?, raw, &event);
                }
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
                    crate::messages::check_id("pool", &c.pool)?;
                    if !sealed {
                        commitments::check_state(&self.db, &self.redis, &self.prefix, &c).await?;
                    }
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

    fn span_fields(&self) -> amqp::SpanFields {
        amqp::SpanFields {
            pool: &["pool"],
            user: &["user_id"],
        }
    }

    async fn handle(
        &self,
        envelope: &Value,
        _publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        self.record(envelope).await?;
        Ok(Outcome::default())
    }

    /// A `draw.completed.batch` gets a shallow envelope (its fields but
    /// `events`): its records are read from its bytes by
    /// [`Handler::handle_body`].
    fn envelope(&self, body: &[u8]) -> Result<Value, Invalid> {
        incoming::envelope(body)
    }

    /// Records a group read straight from `body` when all of it reads that
    /// way; anything else through its JSON value ([`AuditWorker::record`]).
    async fn handle_body(
        &self,
        body: &[u8],
        envelope: &Value,
        publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        if !incoming::is_shallow_group(envelope) {
            return self.handle(envelope, publisher).await;
        }
        match incoming::group_records(body) {
            Some(records) => {
                let checked = self.checked_draws(records).await?;
                self.writer.record(&self.db, checked).await?;
                Ok(Outcome::default())
            }
            None => {
                let envelope = crate::messages::decode_envelope(body)?;
                self.handle(&envelope, publisher).await
            }
        }
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

/// Declares the audit queue and its bindings (with the rest of the
/// topology), retrying while the broker is away; `false` if `shutdown`
/// came first, an error if the broker's queues contradict this worker's
/// settings ([`amqp::Misconfigured`]: retrying cannot help). The draw workers call it at start as well as the audit
/// consumer, so that no `draw.completed` event is published before the
/// queue that records it exists (the queue is durable: this matters on a
/// fleet's first start, whichever worker comes up first).
pub async fn declare_queue(config: &Config, shutdown: &CancellationToken) -> anyhow::Result<bool> {
    let declare_once = || async {
        let conn = amqp::connect(&config.amqp_url, "prizepool.audit.declare").await?;
        let channel = conn.create_channel().await?;
        amqp::declare_topology_for(&channel, config).await?;
        declare(&channel, config.delivery_limit).await?;
        conn.close(200, "declared".into()).await.ok();
        anyhow::Ok(())
    };
    let declared = declare_once
        .retry(crate::ops::startup_backoff())
        // Settings the broker contradicts never get better by waiting.
        .when(|e: &anyhow::Error| e.downcast_ref::<amqp::Misconfigured>().is_none())
        .notify(|e: &anyhow::Error, delay: Duration| {
            tracing::warn!(
                error = format!("{e:#}"),
                ?delay,
                "declaring the audit queue; retrying"
            );
        });
    tokio::select! {
        _ = shutdown.cancelled() => Ok(false),
        declared = declared => declared.map(|()| true),
    }
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
    if !declare_queue(&config, &shutdown).await? {
        return Ok(());
    }
    let redis = crate::redis_conn::connect(&config.redis_url).await?;
    let key = config.ledger_seal_key.as_ref().map(|k| k.0.clone());
    let worker = AuditWorker::of_fleet(db, redis, &config.redis_prefix, key);
    amqp::run(&config, Arc::new(worker), health, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::records::lean_form;
    use super::*;
    use crate::messages::{Prize, PrizeRun};

    fn prize(combo: &str, multiplier: u64) -> Prize {
        Prize::Multiplier {
            multiplier,
            combo: combo.to_owned(),
        }
    }

    #[test]
    fn the_prizes_digest_is_sha256_of_one_line_per_prize() {
        // As docs/fairness.md spells it: `<combo> <multiplier>` LF each.
        let digest = prizes_sha256([("a", 5), ("b", 0)]);
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "b6cf6c8d01c0f78673c8d48238b68d14cf0206fdf1c8affe52e1dea1150737e0"
        );
    }

    #[test]
    fn only_a_listed_draw_of_one_run_without_parked_jackpots_is_lean() {
        let run = PrizeRun::new;
        let draw = DrawResult {
            prizes: vec![prize("a", 5), prize("b", 0)],
            positions: vec![run(3, 10, 2)],
            ..DrawResult::default()
        };
        let (kept, digest) = lean_form(&draw).unwrap();
        assert_eq!(kept, run(3, 10, 2));
        assert_eq!(digest, prizes_sha256([("a", 5), ("b", 0)]));
        // Across a batch boundary, with a parked jackpot, or runs that do
        // not account for the prizes: the full form.
        let across = DrawResult {
            positions: vec![run(3, 10, 1), run(4, 0, 1)],
            ..draw.clone()
        };
        assert!(lean_form(&across).is_none());
        let parked = DrawResult {
            held_back: vec![crate::messages::BatchPosition {
                generation: 3,
                position: 12,
            }],
            ..draw.clone()
        };
        assert!(lean_form(&parked).is_none());
        let short = DrawResult {
            positions: vec![run(3, 10, 3)],
            ..draw
        };
        assert!(lean_form(&short).is_none());
    }
}
