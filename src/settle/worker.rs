//! The settle worker's consume loop. Unlike the other workers it handles
//! deliveries in batches: one transaction per batch, one `multiple` ack after
//! the commit.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::StreamExt;
use lapin::{
    message::Delivery,
    options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::{
    amqp::{self, publish_dead_letter, publish_dead_letter_part, Outgoing, Publisher},
    config::Config,
    messages::{decode_envelope, Invalid, SettleMessage, SettleRequest},
    ops::Health,
};

/// Runs a settle worker until `shutdown`, reconnecting after failures.
pub async fn run(
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
    let mut backoff = ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .without_max_times()
        .build();
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        match session(&config, &db, &health, &shutdown).await {
            Ok(()) => return Ok(()),
            Err(error) => {
                health.set_ready(false);
                let delay = backoff.next().unwrap_or(Duration::from_secs(5));
                tracing::warn!(
                    error = format!("{error:#}"),
                    ?delay,
                    "broker session ended; reconnecting"
                );
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

async fn session(
    config: &Config,
    db: &PgPool,
    health: &Health,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let conn = amqp::connect(&config.amqp_url, "settle-worker").await?;
    let channel = conn.create_channel().await?;
    amqp::declare_topology(&channel, config.delivery_limit).await?;
    let prefetch = config
        .prefetch
        .max(u16::try_from(config.settle_batch_size * 2).unwrap_or(u16::MAX));
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let publisher = Publisher::new(conn.create_channel().await?).await?;
    let tag = format!("settle-{}", ulid::Ulid::new());
    let mut consumer = channel
        .basic_consume(
            amqp::SETTLE.queue.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    health.set_ready(true);
    tracing::info!(queue = amqp::SETTLE.queue, "consuming");

    let result: anyhow::Result<()> = loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            next = consumer.next() => next,
        };
        let mut batch = match first {
            Some(Ok(d)) => vec![d],
            Some(Err(e)) => break Err(e.into()),
            None => break Err(anyhow::anyhow!("the broker cancelled the consumer")),
        };
        let deadline = tokio::time::Instant::now() + config.settle_batch_wait;
        let mut failed = None;
        while batch.len() < config.settle_batch_size {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => break,
                next = consumer.next() => match next {
                    Some(Ok(d)) => batch.push(d),
                    Some(Err(e)) => { failed = Some(anyhow::Error::from(e)); break }
                    None => { failed = Some(anyhow::anyhow!("the broker cancelled the consumer")); break }
                },
            }
        }
        if let Err(e) = settle_batch(db, &publisher, batch, shutdown).await {
            break Err(e);
        }
        if let Some(e) = failed {
            break Err(e);
        }
    };
    health.set_ready(false);
    let _ = channel
        .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
        .await;
    // Make sure the broker processed our acks before the channel closes.
    let _ = channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await;
    let _ = channel.close(200, "shutting down".into()).await;
    let _ = publisher.channel().close(200, "shutting down".into()).await;
    let _ = conn.close(200, "shutting down".into()).await;
    result
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
    /// A `settle.batch`: the reply counts the entries that landed; a bad or
    /// refused entry is dead-lettered on its own.
    Batch,
    /// Dead-lettered whole, and answered then.
    Answered,
}

/// Applies one batch of deliveries: dead-letters bad messages and bad
/// entries, commits the good entries (with retries while Postgres is
/// unreachable), replies when asked, then acks the whole batch with one
/// `multiple` ack.
async fn settle_batch(
    db: &PgPool,
    publisher: &Publisher,
    batch: Vec<Delivery>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let mut owned = Vec::with_capacity(batch.len());
    let mut kinds = Vec::with_capacity(batch.len());
    for (at, delivery) in batch.iter().enumerate() {
        match decode_envelope(&delivery.data).and_then(|v| SettleMessage::decode(&v)) {
            Ok(SettleMessage::One(entry)) => {
                kinds.push(Kind::One);
                owned.push(Owned { entry, at });
            }
            Ok(SettleMessage::Batch(entries)) => {
                kinds.push(Kind::Batch);
                for entry in entries {
                    match entry {
                        Ok(entry) => owned.push(Owned { entry, at }),
                        Err(bad) => {
                            tracing::warn!(reason = %bad.invalid, "bad entry in a settle batch; dead-lettering it");
                            dead_letter_entry(publisher, delivery, &bad.body, &bad.invalid).await?;
                        }
                    }
                }
            }
            Err(invalid) => {
                tracing::warn!(reason = %invalid, "bad settle message; dead-lettering");
                kinds.push(Kind::Answered);
                publish_dead_letter(publisher, delivery, amqp::SETTLE, &invalid).await?;
            }
        }
    }

    let mut delays = ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .without_max_times()
        .build();
    // Entries applied so far (the replies are built from them).
    let mut landed = Vec::with_capacity(owned.len());
    while !owned.is_empty() {
        match super::apply(db, owned.iter().map(|o| &o.entry)).await {
            Ok(applied) => {
                metrics::counter!("prizepool_ledger_entries_total")
                    .increment(applied.inserted.unsigned_abs());
                landed.append(&mut owned);
            }
            Err(error) if refuses_data(&error) => {
                // The data itself is refused (not an outage): find the culprits
                // one by one so the rest of the batch still lands.
                tracing::warn!(%error, "batch refused by Postgres; applying entries one by one");
                let mut keep = Vec::new();
                for o in owned.drain(..) {
                    match super::apply(db, [&o.entry]).await {
                        Ok(_) => landed.push(o),
                        Err(e) if refuses_data(&e) => {
                            let invalid = Invalid::new(format!("refused by the ledger: {e}"));
                            let delivery = &batch[o.at];
                            if kinds[o.at] == Kind::Batch {
                                dead_letter_entry(publisher, delivery, &o.entry, &invalid).await?;
                            } else {
                                publish_dead_letter(publisher, delivery, amqp::SETTLE, &invalid)
                                    .await?;
                                kinds[o.at] = Kind::Answered;
                            }
                        }
                        Err(_) => keep.push(o),
                    }
                }
                owned = keep;
            }
            Err(error) => {
                let delay = delays.next().unwrap_or(Duration::from_secs(5));
                tracing::warn!(%error, ?delay, "ledger unreachable; keeping the batch and retrying");
                tokio::select! {
                    // Unacked deliveries go back to the queue when the channel closes.
                    _ = shutdown.cancelled() => anyhow::bail!("shutdown while the ledger is unreachable"),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }

    // One reply per delivery that asked and was not answered already.
    let replies: Vec<Outgoing> = batch
        .iter()
        .enumerate()
        .filter_map(|(at, d)| {
            let to = d.properties.reply_to().as_ref()?;
            let body = match kinds[at] {
                Kind::Answered => return None,
                Kind::One => {
                    let entry = &landed.iter().find(|o| o.at == at)?.entry;
                    json!({"type": "settle_result", "entry_id": entry.entry_id, "status": "ok"})
                }
                Kind::Batch => {
                    let n = landed.iter().filter(|o| o.at == at).count();
                    json!({"type": "settle_result", "status": "ok", "entries": n})
                }
            };
            Some(Outgoing::reply(
                to.as_str(),
                d.properties.correlation_id().as_ref(),
                serde_json::to_vec(&body).unwrap_or_default(),
            ))
        })
        .collect();
    if !replies.is_empty() {
        publisher.publish_all(replies).await?;
    }
    if let Some(last) = batch.iter().max_by_key(|d| d.delivery_tag) {
        last.acker.ack(BasicAckOptions { multiple: true }).await?;
    }
    Ok(())
}

/// Dead-letters one entry of a `settle.batch` as a `settle` message of its own.
async fn dead_letter_entry(
    publisher: &Publisher,
    delivery: &Delivery,
    entry: &impl serde::Serialize,
    invalid: &Invalid,
) -> anyhow::Result<()> {
    let body = serde_json::to_vec(entry)?;
    publish_dead_letter_part(publisher, delivery, body, amqp::SETTLE, invalid).await?;
    Ok(())
}

/// Whether Postgres refused the entries themselves (SQLSTATE class 22, data
/// exception, or 23, integrity violation). Everything else, including the
/// errors a server shutting down or refusing connections reports (57P01,
/// 55000, class 08), is an outage: keep the batch and retry.
fn refuses_data(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(e) => e
            .code()
            .is_some_and(|c| c.starts_with("22") || c.starts_with("23")),
        _ => false,
    }
}
