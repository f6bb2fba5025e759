//! The settle worker: a [`BatchHandler`] on the shared consume loop
//! ([`amqp::run_batches`]). Unlike the other workers it handles deliveries
//! in batches: one transaction per batch, the batch's acks (one `multiple`
//! ack, coalesced by the loop's acker) after the commit.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use lapin::{message::Delivery, types::AMQPValue};
use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{
    amqp::{
        self, publish_dead_letter, publish_dead_letter_part, Batch, BatchHandler, BatchLimits,
        Outgoing, Publisher, Settle,
    },
    config::Config,
    ledger::{self, Verdict},
    messages::{
        decode_envelope, rejected_reply, typed_json, BadEntry, ErrorCode, Invalid, SettleMessage,
        SettleRefusal, SettleRequest, SettleResult,
    },
    ops::Health,
};

/// Runs a settle worker until `shutdown`, reconnecting after failures.
pub(super) async fn run(
    config: Config,
    health: Health,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // Lazy: the worker starts (and keeps its deliveries unacked) while
    // Postgres is down, and connects once it is back.
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy(&config.database_url)?;
    // Exported from the start, so an idle worker shows no lag rather than
    // no series; the first stamped batch sets the real figure.
    metrics::gauge!("prizepool_settle_lag_seconds").set(0.0);
    let worker = SettleWorker {
        db,
        sealer: ledger::FleetSealer::default(),
        redis: OnceCell::new(),
        config: config.clone(),
    };
    amqp::run_batches(&config, std::sync::Arc::new(worker), health, shutdown).await
}

/// The settle worker's state across broker sessions.
#[derive(Debug)]
struct SettleWorker {
    db: PgPool,
    /// The seal key of the fleet, to tell its own entries from forgeries:
    /// read again from Redis every few seconds, with the fleet's earlier
    /// keys, so one seal key holds for the whole fleet even after Redis
    /// lost it (`ledger::FleetSealer`).
    sealer: ledger::FleetSealer,
    /// Where the key is kept, connected on first use.
    redis: OnceCell<crate::redis_conn::RedisConn>,
    config: Config,
}

impl SettleWorker {
    async fn sealer(&self) -> anyhow::Result<std::sync::Arc<ledger::Sealer>> {
        let redis = self
            .redis
            .get_or_try_init(|| crate::redis_conn::connect(&self.config.redis_url))
            .await?;
        let mut redis = redis.clone();
        Ok(self.sealer.get(&mut redis, &self.config).await?)
    }
}

impl BatchHandler for SettleWorker {
    fn route(&self) -> amqp::Route {
        amqp::SETTLE
    }

    fn limits(&self) -> BatchLimits {
        BatchLimits {
            size: self.config.settle_batch_size,
            wait: self.config.settle_batch_wait,
            prefetch: self
                .config
                .prefetch
                .max(u16::try_from(self.config.settle_batch_size * 2).unwrap_or(u16::MAX)),
        }
    }

    async fn handle_batch(&self, batch: Batch) -> anyhow::Result<()> {
        // While the batch waits for the ledger (Postgres away, a slow
        // commit, the seal key unreadable), its lag keeps growing on the
        // gauge, so a stalled ledger shows instead of freezing the last
        // figure.
        let _lag = super::lag::keep_lag(&batch.deliveries, batch.empty_since);
        let sealer = self.sealer().await?;
        // One span per batch, in the trace of its first entry (linked to the others').
        let span = tracing::info_span!("settle.batch", entries = batch.deliveries.len());
        crate::telemetry::follow_traces(
            &span,
            batch
                .deliveries
                .iter()
                .map(|d| d.properties.headers().as_ref()),
        );
        settle_batch(&self.db, &sealer, &batch)
            .instrument(span)
            .await
    }

    fn idle(&self) {
        super::lag::caught_up();
    }
}

/// A ledger entry and the delivery (index in the batch) it came in.
struct Owned {
    entry: SettleRequest,
    at: usize,
}

/// What a delivery of the batch is, for its reply.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A `settle`: the reply names its entry.
    One,
    /// A `settle.batch`: the reply counts the entries that landed and lists
    /// the refused ones; a bad or refused entry is dead-lettered on its own.
    Batch,
    /// Dead-lettered whole, and answered then.
    Answered,
}

/// What became of one entry.
enum Fate {
    /// The ledger's verdict.
    Judged(Verdict),
    /// Postgres refused the entry itself, alone in its transaction: it can
    /// never be booked.
    Failed(String),
}

impl Fate {
    fn landed(&self) -> bool {
        matches!(self, Self::Judged(v) if v.landed())
    }

    /// The `outcome` and `reason` labels of the entries counter.
    fn labels(&self) -> (&'static str, &'static str) {
        match self {
            Self::Judged(Verdict::Applied) => ("applied", "none"),
            Self::Judged(Verdict::Duplicate) => ("duplicate", "none"),
            Self::Judged(v) => ("refused", v.label()),
            Self::Failed(_) => ("refused", "internal"),
        }
    }

    /// The error code and reason of a refusal.
    fn refusal(&self, entry: &SettleRequest) -> Option<(ErrorCode, String)> {
        match self {
            Self::Judged(v) => v.code().map(|code| (code, v.describe(entry))),
            Self::Failed(why) => Some((ErrorCode::Internal, why.clone())),
        }
    }
}

/// Applies one batch of deliveries: dead-letters, answers and acks each bad
/// message on its own at once, commits the good entries (with retries while
/// Postgres is unreachable), dead-letters the bad entries of `settle.batch`
/// messages, answers refusals (a dead letter for bad input and for what can
/// never be booked, a `rejected` reply when asked), replies when asked, then
/// acks the rest of the batch with one `multiple` ack.
///
/// A bad message is acked as soon as its dead letter and its reply are
/// confirmed, not with the batch: a batch that never books (a stop while
/// Postgres is away) goes back to the queue without it, so it is
/// dead-lettered and answered once.
async fn settle_batch(db: &PgPool, sealer: &ledger::Sealer, whole: &Batch) -> anyhow::Result<()> {
    let mut read = read_batch(sealer, whole).await?;
    metrics::histogram!("prizepool_settle_batch_entries").record(read.owned.len() as f64);

    let fates = book(db, &read.owned, &whole.shutdown).await?;
    for (at, body, invalid) in &read.bad_bodies {
        dead_letter_entry(&whole.publisher, &whole.deliveries[*at], body, invalid).await?;
    }
    count(&fates);

    // Dead letters and replies, all confirmed before the ack (replies on
    // their own connection, `amqp::Replier`).
    let (out, mut replies) = refusals(&whole.deliveries, &mut read, &fates)?;
    replies.extend(ok_replies(&whole.deliveries, &mut read, &fates));
    if !out.is_empty() {
        whole.publisher.publish_all(out).await?;
    }
    if whole.replier.send(replies).await == amqp::Sent::GivenUp {
        // The entries are booked: a requester still waiting sends them again
        // and is answered from the ledger.
        tracing::warn!("settle replies could not be delivered; their requesters are gone");
    }
    // Every delivery of the batch is settled now; the loop's acker sends
    // one `multiple` ack for the run (those acked on their own are no
    // longer outstanding and are skipped).
    for ((d, acked), dead) in whole.deliveries.iter().zip(&read.acked).zip(&read.dead) {
        match (acked, dead) {
            (true, _) => {}
            (false, true) => whole.dead_lettered(d),
            (false, false) => whole.settle(d, Settle::Ack),
        }
    }
    Ok(())
}

/// A batch as read: its entries, what each delivery is, and what was bad.
struct Read {
    /// The entries to book, each with its delivery.
    owned: Vec<Owned>,
    /// What each delivery is, by index in the batch.
    kinds: Vec<Kind>,
    /// The refusals each delivery's reply lists so far (a `settle.batch`
    /// entry that does not decode), by index in the batch.
    refused_in: Vec<Vec<SettleRefusal>>,
    /// The dead letters of those entries, sent once the batch is booked (so
    /// a batch that goes back to the queue unbooked has sent none of them).
    bad_bodies: Vec<(usize, Value, Invalid)>,
    /// Deliveries acked on their own already.
    acked: Vec<bool>,
    /// `settle` deliveries dead-lettered whole (an entry that can never be
    /// booked): acked with the batch, counted as `dead_lettered`.
    dead: Vec<bool>,
}

/// Decodes and checks every delivery of `whole`: a message that is bad as
/// a whole is dead-lettered, answered and acked at once; a bad entry of a
/// `settle.batch` is set aside for its dead letter and its batch's reply.
async fn read_batch(sealer: &ledger::Sealer, whole: &Batch) -> anyhow::Result<Read> {
    let batch = &whole.deliveries;
    let mut read = Read {
        owned: Vec::with_capacity(batch.len()),
        kinds: Vec::with_capacity(batch.len()),
        refused_in: vec![Vec::new(); batch.len()],
        bad_bodies: Vec::new(),
        acked: vec![false; batch.len()],
        dead: vec![false; batch.len()],
    };
    for (at, delivery) in batch.iter().enumerate() {
        // The worker runs on one thread: a batch of large messages lets its
        // other tasks (the audit consumer, the health endpoint) in now and
        // then.
        if at % 64 == 63 {
            tokio::task::yield_now().await;
        }
        match decode(sealer, &delivery.data) {
            Ok(SettleMessage::One(entry)) => {
                read.kinds.push(Kind::One);
                read.owned.push(Owned { entry, at });
            }
            Ok(SettleMessage::Batch(entries)) => {
                read.kinds.push(Kind::Batch);
                for entry in entries {
                    match entry {
                        Ok(entry) => read.owned.push(Owned { entry, at }),
                        Err(bad) => read.set_aside(at, bad),
                    }
                }
            }
            Err(invalid) => {
                tracing::warn!(reason = %invalid, "bad settle message; dead-lettering");
                read.kinds.push(Kind::Answered);
                let (publisher, replier) = (&whole.publisher, &whole.replier);
                publish_dead_letter(publisher, replier, delivery, amqp::SETTLE, &invalid).await?;
                // Dead-lettered and answered, both confirmed: done with it,
                // whatever becomes of the rest of the batch.
                whole.dead_lettered(delivery);
                read.acked[at] = true;
            }
        }
    }
    Ok(read)
}

impl Read {
    /// Sets aside a `settle.batch` entry of delivery `at` that is bad: it is
    /// dead-lettered once the batch is booked, and named in the reply.
    fn set_aside(&mut self, at: usize, bad: BadEntry) {
        tracing::warn!(reason = %bad.invalid, "bad entry in a settle batch; dead-lettering it");
        metrics::counter!("prizepool_settle_entries_total", "outcome" => "refused", "reason" => "invalid")
            .increment(1);
        let id = bad
            .body
            .get("entry_id")
            .and_then(Value::as_str)
            .filter(|id| id.len() <= crate::messages::MAX_ENTRY_ID_LEN)
            .map(str::to_owned);
        self.refused_in[at].push(SettleRefusal {
            entry_id: id,
            code: ErrorCode::InvalidRequest,
            message: Some(bad.invalid.message.clone()),
        });
        self.bad_bodies.push((at, bad.body, bad.invalid));
    }
}

/// Decodes one delivery's body and checks the seal of each entry: a bad
/// message as a whole is an error; a `settle.batch` keeps its bad entries
/// in place, each as its [`BadEntry`].
fn decode(sealer: &ledger::Sealer, data: &[u8]) -> Result<SettleMessage, Invalid> {
    let message = SettleMessage::from_body(data)?;
    match message {
        SettleMessage::One(entry) => sealer.check(&entry).map(|()| SettleMessage::One(entry)),
        SettleMessage::Batch(entries) => Ok(SettleMessage::Batch(
            entries
                .into_iter()
                .map(|entry| {
                    let entry = entry?;
                    match sealer.check(&entry) {
                        Ok(()) => Ok(entry),
                        Err(invalid) => Err(BadEntry {
                            body: serde_json::to_value(&entry).unwrap_or_default(),
                            invalid,
                        }),
                    }
                })
                .collect(),
        )),
    }
}

/// Counts the fates of a batch's entries.
fn count(fates: &[Fate]) {
    for fate in fates {
        let (outcome, reason) = fate.labels();
        metrics::counter!("prizepool_settle_entries_total", "outcome" => outcome, "reason" => reason)
            .increment(1);
    }
    let applied = fates
        .iter()
        .filter(|f| matches!(f, Fate::Judged(Verdict::Applied)))
        .count();
    metrics::counter!("prizepool_ledger_entries_total").increment(applied as u64);
}

/// The dead letters and `rejected` replies of the refused entries; the
/// refusals of `settle.batch` entries go to their batch's reply
/// (`read.refused_in`).
fn refusals(
    batch: &[Delivery],
    read: &mut Read,
    fates: &[Fate],
) -> anyhow::Result<(Vec<Outgoing>, Vec<Outgoing>)> {
    let (mut out, mut replies) = (Vec::new(), Vec::new());
    for (o, fate) in read.owned.iter().zip(fates) {
        let Some((code, why)) = fate.refusal(&o.entry) else {
            continue;
        };
        let delivery = &batch[o.at];
        tracing::warn!(entry = %o.entry.entry_id, %code, reason = %why, "settle entry refused");
        // Bad input and what can never be booked go to the dead-letter
        // queue; a short balance is an answer, not a fault.
        let dead = code != ErrorCode::InsufficientFunds;
        match read.kinds[o.at] {
            Kind::Batch => {
                if dead {
                    let body = amqp::part_body(serde_json::to_vec(&o.entry)?);
                    out.push(dead_letter_copy(delivery, body, code, &why, false));
                }
                read.refused_in[o.at].push(SettleRefusal {
                    entry_id: Some(o.entry.entry_id.clone()),
                    code,
                    message: Some(why),
                });
            }
            Kind::One => {
                if dead {
                    let body = delivery.data.clone();
                    out.push(dead_letter_copy(delivery, body, code, &why, true));
                    read.dead[o.at] = true;
                }
                if let Some(to) = delivery.properties.reply_to() {
                    let request = decode_envelope(&delivery.data).ok();
                    let reply = rejected_reply(request.as_ref(), code, &why);
                    replies.push(Outgoing::reply(
                        to.as_str(),
                        delivery.properties.correlation_id().as_ref(),
                        serde_json::to_vec(&reply)?,
                    ));
                }
            }
            Kind::Answered => {}
        }
    }
    Ok((out, replies))
}

/// The `ok` replies: one per delivery that asked and was not answered.
fn ok_replies(batch: &[Delivery], read: &mut Read, fates: &[Fate]) -> Vec<Outgoing> {
    // Per delivery: how many of its entries landed, and the first of them
    // (one pass over the entries, however many deliveries ask).
    let mut landed = vec![0usize; batch.len()];
    let mut first: Vec<Option<usize>> = vec![None; batch.len()];
    for (i, (o, f)) in read.owned.iter().zip(fates).enumerate() {
        if f.landed() {
            landed[o.at] += 1;
            first[o.at].get_or_insert(i);
        }
    }
    let mut replies = Vec::new();
    for (at, d) in batch.iter().enumerate() {
        let Some(to) = d.properties.reply_to().as_ref() else {
            continue;
        };
        let body = match read.kinds[at] {
            Kind::Answered => continue,
            Kind::One => {
                let Some(o) = first[at].map(|i| &read.owned[i]) else {
                    continue;
                };
                SettleResult {
                    entry_id: Some(o.entry.entry_id.clone()),
                    ..SettleResult::default()
                }
            }
            Kind::Batch => {
                let mut body = SettleResult {
                    entries: Some(landed[at]),
                    refused: std::mem::take(&mut read.refused_in[at]),
                    ..SettleResult::default()
                };
                fit_refusals(&mut body);
                body
            }
        };
        replies.push(Outgoing::reply(
            to.as_str(),
            d.properties.correlation_id().as_ref(),
            typed_json("settle_result", &body),
        ));
    }
    replies
}

/// How long a batch waits between attempts while Postgres is unreachable.
fn outage_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .without_max_times()
}

/// Books `owned` in one transaction and returns each entry's fate. While
/// Postgres is unreachable the batch waits and retries with backoff; when
/// Postgres refuses the batch's data (an error that will never go away),
/// the entries are booked one by one so that only the culprits fail.
async fn book(
    db: &PgPool,
    owned: &[Owned],
    shutdown: &CancellationToken,
) -> anyhow::Result<Vec<Fate>> {
    let entries: Vec<&SettleRequest> = owned.iter().map(|o| &o.entry).collect();
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    match until_reachable(db, &entries, shutdown).await? {
        Ok(verdicts) => return Ok(verdicts.into_iter().map(Fate::Judged).collect()),
        Err(error) => {
            tracing::warn!(%error, "batch refused by Postgres; booking its entries one by one");
        }
    }
    let mut fates = Vec::with_capacity(entries.len());
    for entry in entries {
        fates.push(match until_reachable(db, &[entry], shutdown).await? {
            Ok(mut verdicts) => verdicts
                .pop()
                .map(Fate::Judged)
                .ok_or_else(|| anyhow::anyhow!("a settle entry was not booked"))?,
            Err(error) => Fate::Failed(format!("refused by the ledger: {error}")),
        });
    }
    Ok(fates)
}

/// Applies `entries` in one transaction, retrying with backoff while
/// Postgres is unreachable: their verdicts, or the error with which
/// Postgres refused them for good ([`ledger::is_permanent`]). Fails only
/// when `shutdown` comes while Postgres is unreachable (unacked deliveries
/// go back to the queue when the channel closes); an attempt under way is
/// never cut short, so a stop lets a batch that is being written finish.
async fn until_reachable(
    db: &PgPool,
    entries: &[&SettleRequest],
    shutdown: &CancellationToken,
) -> anyhow::Result<Result<Vec<Verdict>, sqlx::Error>> {
    let attempt = || async {
        let started = std::time::Instant::now();
        let result = ledger::apply_each(db, entries).await;
        metrics::histogram!("prizepool_settle_commit_seconds")
            .record(started.elapsed().as_secs_f64());
        result
    };
    let stop = shutdown.clone();
    // The wait between attempts ends early on a stop.
    let sleep = move |delay: Duration| {
        let stop = stop.clone();
        async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(delay) => {}
            }
        }
    };
    let booked = attempt
        .retry(outage_backoff())
        .sleep(sleep)
        .when(|error| !ledger::is_permanent(error) && !shutdown.is_cancelled())
        .notify(|error, delay| {
            tracing::warn!(%error, ?delay, "ledger unreachable; keeping the batch and retrying");
        })
        .await;
    match booked {
        Err(error) if !ledger::is_permanent(&error) => {
            anyhow::bail!("shutdown while the ledger is unreachable: {error}")
        }
        booked => Ok(booked),
    }
}

/// Dead-letters one entry of a `settle.batch` that does not decode, as a
/// `settle` message of its own.
async fn dead_letter_entry(
    publisher: &Publisher,
    delivery: &Delivery,
    entry: &impl serde::Serialize,
    invalid: &Invalid,
) -> anyhow::Result<()> {
    let body = amqp::part_body(serde_json::to_vec(entry)?);
    publish_dead_letter_part(publisher, delivery, body, amqp::SETTLE, invalid).await?;
    Ok(())
}

/// A copy of `delivery` with `body` for the settle dead-letter queue, with
/// the error code and reason headers. A part of a batch drops the reply
/// properties: replaying it must not answer the batch's requester.
fn dead_letter_copy(
    delivery: &Delivery,
    body: Vec<u8>,
    code: ErrorCode,
    reason: &str,
    whole: bool,
) -> Outgoing {
    let mut headers = delivery.properties.headers().clone().unwrap_or_default();
    headers.insert(
        amqp::ERROR_CODE_HEADER.into(),
        AMQPValue::LongString(code.as_str().into()),
    );
    headers.insert(
        amqp::ERROR_HEADER.into(),
        AMQPValue::LongString(reason.into()),
    );
    let mut properties = delivery.properties.clone().with_headers(headers);
    if !whole {
        properties = properties
            .with_reply_to("".into())
            .with_correlation_id("".into());
    }
    Outgoing {
        exchange: amqp::DLX.into(),
        routing_key: amqp::SETTLE.queue.into(),
        body,
        properties,
        mandatory: true,
    }
}

/// Keeps a batch's reply within the wire limit, shortening its refusals
/// step by step until it fits: first each keeps its entry id and code
/// only; then its code only (a refusal can be longer than the entry it
/// answers: `{}` is refused as `{"code":"invalid_request"}`); then the
/// refusals that fit are kept in order and the last one says how many
/// more there were, by code.
fn fit_refusals(body: &mut SettleResult) {
    // The reply's `"type":"settle_result",` and room for the summary.
    const ROOM: usize = crate::messages::MAX_MESSAGE_BYTES - 512;
    let size = |body: &SettleResult| serde_json::to_vec(body).map_or(usize::MAX, |b| b.len());
    if size(body) <= ROOM {
        return;
    }
    for r in &mut body.refused {
        r.message = None;
    }
    if size(body) <= ROOM {
        return;
    }
    for r in &mut body.refused {
        r.entry_id = None;
    }
    if size(body) <= ROOM {
        return;
    }
    let mut bytes = size(&SettleResult {
        refused: Vec::new(),
        ..body.clone()
    });
    let kept = body
        .refused
        .iter()
        .take_while(|r| {
            bytes += serde_json::to_vec(r).map_or(usize::MAX, |b| b.len()) + 1;
            bytes <= ROOM
        })
        .count();
    let rest = body.refused.split_off(kept);
    let mut by_code = std::collections::BTreeMap::<&str, usize>::new();
    for r in &rest {
        *by_code.entry(r.code.as_str()).or_default() += 1;
    }
    let counts: Vec<String> = by_code.iter().map(|(c, n)| format!("{n} {c}")).collect();
    body.refused.push(SettleRefusal {
        entry_id: None,
        code: rest.first().map_or(ErrorCode::InvalidRequest, |r| r.code),
        message: Some(format!(
            "{} more entries refused ({}), not listed: the reply is held to {} bytes",
            rest.len(),
            counts.join(", "),
            crate::messages::MAX_MESSAGE_BYTES
        )),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(body: &SettleResult) -> usize {
        typed_json("settle_result", body).len()
    }

    /// Refusals of every shape a batch within 64 KiB can hold: long ids
    /// with long messages, short ids longer than their entries, and
    /// thousands of `{}`: each reply fits, and the refusals it drops are
    /// counted in its last one.
    #[test]
    fn a_batch_reply_always_fits() {
        let refusal = |id: Option<String>, message: usize| SettleRefusal {
            entry_id: id,
            code: ErrorCode::InvalidRequest,
            message: Some("m".repeat(message)),
        };
        let cases: Vec<Vec<SettleRefusal>> = vec![
            (0..300)
                .map(|i| refusal(Some(format!("{i:0>300}")), 1000))
                .collect(),
            (0..1000)
                .map(|i| refusal(Some(format!("{i:0>49}")), 40))
                .collect(),
            (0..21_000).map(|_| refusal(None, 30)).collect(),
        ];
        for refused in cases {
            let n = refused.len();
            let mut body = SettleResult {
                entries: Some(0),
                refused,
                ..SettleResult::default()
            };
            fit_refusals(&mut body);
            assert!(
                size(&body) <= crate::messages::MAX_MESSAGE_BYTES,
                "{}",
                size(&body)
            );
            let listed = body.refused.len();
            if listed < n {
                let last = body.refused.last().unwrap();
                let message = last.message.as_deref().unwrap();
                assert!(
                    message.starts_with(&format!("{} more entries refused", n - (listed - 1))),
                    "{message}"
                );
            }
        }
        // A reply that fits is left as it is.
        let small = SettleResult {
            entries: Some(1),
            refused: vec![refusal(Some("a".into()), 10)],
            ..SettleResult::default()
        };
        let mut kept = small.clone();
        fit_refusals(&mut kept);
        assert_eq!(kept, small);
    }
}
