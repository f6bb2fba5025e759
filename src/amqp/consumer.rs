//! The consume loop every queue worker shares.
//!
//! It decodes the envelope, calls the worker's [`Handler`], publishes what the
//! handler produced (effects and reply) with confirms, and only then acks
//! (coalesced into `multiple` acks, see [`super::acks`]).
//! Bad input is dead-lettered with its reason in a header and answered with a
//! `rejected` reply; transient failures are retried with backoff and, if they
//! persist, the delivery is requeued (the queue's delivery limit bounds that).
//! A lost connection is re-established; on shutdown the loop stops consuming,
//! lets in-flight deliveries finish within the grace period, makes sure the
//! broker has processed their acks, and closes channels before the connection.

use std::{future::Future, sync::Arc, time::Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::StreamExt;
use lapin::{
    message::Delivery,
    options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
    BasicProperties,
};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{info_span, Instrument};

use super::{
    acks::{Acks, Settle},
    grouped::{self, Grouper},
    publish::{with_header, Outgoing, Publisher},
    Route, DLX, ERROR_CODE_HEADER, ERROR_HEADER,
};
use crate::{
    config::Config,
    messages::{self, ErrorCode, Invalid},
    ops::Health,
};

/// What a handled request produced: a reply for the requester (sent only when
/// it asked, via `reply_to`) and messages to publish before the ack.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The reply's JSON body, serialised (a draw's result is serialised once
    /// for its reply and its event).
    pub reply: Option<Vec<u8>>,
    pub effects: Vec<Outgoing>,
    /// Ledger entries, published grouped with other deliveries' entries
    /// (see [`super::grouped`]) and confirmed before the ack like the effects.
    pub ledger: Vec<crate::messages::SettleRequest>,
    /// Serialised `draw.completed` events, published grouped with other
    /// deliveries' events and confirmed before the ack.
    pub events: Vec<Vec<u8>>,
}

/// Why a request could not be handled.
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    /// Bad input: dead-letter it, never retry.
    #[error("invalid request: {0}")]
    Invalid(#[from] Invalid),
    /// A dependency failed: retry with backoff, then requeue.
    #[error("transient failure: {0:#}")]
    Transient(#[from] anyhow::Error),
    /// A failure that can never succeed however often it is retried (a
    /// stored value that does not parse, a script reply nobody expects, an
    /// overflow, a panic): dead-letter with the reason and answer `internal`
    /// at once.
    #[error("internal failure: {0:#}")]
    Internal(anyhow::Error),
}

impl HandleError {
    /// An internal (permanent) failure described by `message`.
    pub fn internal(message: impl std::fmt::Display) -> Self {
        Self::Internal(anyhow::anyhow!("{message}"))
    }
}

impl From<redis::RedisError> for HandleError {
    fn from(e: redis::RedisError) -> Self {
        Self::Transient(e.into())
    }
}

impl From<sqlx::Error> for HandleError {
    fn from(e: sqlx::Error) -> Self {
        Self::Transient(e.into())
    }
}

impl From<super::publish::PublishError> for HandleError {
    fn from(e: super::publish::PublishError) -> Self {
        Self::Transient(e.into())
    }
}

/// A queue worker's business logic.
pub trait Handler: Send + Sync + 'static {
    /// The queue this worker consumes.
    fn route(&self) -> Route;

    /// Handles one decoded envelope. `publisher` is there for messages that
    /// must leave before the handler can finish (an urgent refill); all other
    /// messages belong in the returned [`Outcome`].
    fn handle(
        &self,
        envelope: &Value,
        publisher: &Publisher,
    ) -> impl Future<Output = Result<Outcome, HandleError>> + Send;
}

/// Consumes `handler`'s queue until `shutdown` is cancelled, reconnecting
/// after failures. Returns once in-flight work is finished and acked.
pub async fn run<H: Handler>(
    config: &Config,
    handler: Arc<H>,
    health: Health,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut backoff = reconnect_backoff();
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        match session(config, &handler, &health, &shutdown).await {
            Ok(()) => return Ok(()),
            Err(error) => {
                health.set_ready(false);
                let delay = backoff.next().unwrap_or(std::time::Duration::from_secs(5));
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

fn reconnect_backoff() -> impl Iterator<Item = std::time::Duration> {
    ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(std::time::Duration::from_millis(100))
        .with_max_delay(std::time::Duration::from_secs(5))
        .without_max_times()
        .build()
}

async fn session<H: Handler>(
    config: &Config,
    handler: &Arc<H>,
    health: &Health,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let route = handler.route();
    let conn = super::connect(&config.amqp_url, route.queue).await?;
    let channel = conn.create_channel().await?;
    super::declare_topology(&channel, config.delivery_limit).await?;
    channel
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await?;
    let publisher = Publisher::new(conn.create_channel().await?).await?;
    let tag = format!("{}-{}", route.queue, ulid::Ulid::new());
    let mut consumer = channel
        .basic_consume(
            route.queue.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    health.set_ready(true);
    tracing::info!(queue = route.queue, "consuming");

    let tracker = TaskTracker::new();
    let (acks, acker) = Acks::start(channel.clone());
    let (ledger, ledger_task) = Grouper::start(publisher.clone(), grouped::LEDGER);
    let (events, events_task) = Grouper::start(publisher.clone(), grouped::DRAW_COMPLETED);
    let groupers = Groupers { ledger, events };
    let slots = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let result = loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            next = consumer.next() => next,
        };
        match next {
            Some(Ok(delivery)) => {
                let permit = tokio::select! {
                    _ = shutdown.cancelled() => break Ok(()),
                    permit = slots.clone().acquire_owned() => permit?,
                };
                let handler = handler.clone();
                let publisher = publisher.clone();
                let config = config.clone();
                let acks = acks.clone();
                let groupers = groupers.clone();
                tracker.spawn(async move {
                    let tag = delivery.delivery_tag;
                    let how = process(&config, &*handler, &publisher, &groupers, delivery).await;
                    acks.finish(tag, how);
                    drop(permit);
                });
            }
            Some(Err(e)) => break Err(anyhow::Error::from(e).context("consuming")),
            None => break Err(anyhow::anyhow!("the broker cancelled the consumer")),
        }
    };
    health.set_ready(false);

    // Stop new deliveries, then let the ones in hand finish.
    let _ = channel
        .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
        .await;
    tracker.close();
    if tokio::time::timeout(config.shutdown_grace, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            "in-flight deliveries did not finish within the grace period; they will be redelivered"
        );
    }
    // The acker and the groupers end once every handle is gone and what
    // they hold is out.
    drop(groupers);
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        futures_util::future::join(ledger_task, events_task),
    )
    .await;
    drop(acks);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), acker).await;
    // A synchronous round trip on the consuming channel: the broker handles a
    // channel's frames in order, so once qos-ok arrives every ack sent before
    // it has been processed (acks written just before a close can be lost).
    let _ = channel
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await;
    let _ = channel.close(200, "shutting down".into()).await;
    let _ = publisher.channel().close(200, "shutting down".into()).await;
    let _ = conn.close(200, "shutting down".into()).await;
    result
}

/// The grouping publishers a worker's deliveries share.
#[derive(Clone, Debug)]
struct Groupers {
    ledger: Grouper,
    events: Grouper,
}

/// Handles one delivery end to end and says how to settle it; never panics.
async fn process<H: Handler>(
    config: &Config,
    handler: &H,
    publisher: &Publisher,
    groupers: &Groupers,
    delivery: Delivery,
) -> Settle {
    let started = Instant::now();
    let route = handler.route();
    let envelope = messages::decode_envelope(&delivery.data);
    let request_id = envelope
        .as_ref()
        .ok()
        .and_then(messages::idempotency_id)
        .map(|(_, id)| id)
        .unwrap_or_default();
    let span = info_span!("delivery", queue = route.queue, request.id = %request_id);
    async move {
        let outcome = match envelope {
            Err(invalid) => Err(HandleError::Invalid(invalid)),
            Ok(value) => handle_with_retry(config, handler, publisher, value).await,
        };
        let (label, how) = match outcome {
            Ok(outcome) => finish(publisher, groupers, &delivery, outcome).await,
            Err(HandleError::Invalid(invalid)) => {
                dead_letter(
                    publisher,
                    &delivery,
                    route,
                    ErrorCode::InvalidRequest,
                    &invalid,
                )
                .await
            }
            Err(HandleError::Internal(error)) => {
                tracing::error!(
                    error = format!("{error:#}"),
                    "permanent failure; dead-lettering"
                );
                let reason = Invalid::new(format!("{error:#}"));
                dead_letter(publisher, &delivery, route, ErrorCode::Internal, &reason).await
            }
            Err(HandleError::Transient(error)) => {
                tracing::error!(
                    error = format!("{error:#}"),
                    "giving up for now; requeueing"
                );
                ("requeued", Settle::Requeue)
            }
        };
        metrics::counter!("prizepool_messages_total", "queue" => route.queue, "outcome" => label)
            .increment(1);
        metrics::histogram!("prizepool_handle_seconds", "queue" => route.queue)
            .record(started.elapsed().as_secs_f64());
        how
    }
    .instrument(span)
    .await
}

async fn handle_with_retry<H: Handler>(
    config: &Config,
    handler: &H,
    publisher: &Publisher,
    value: Value,
) -> Result<Outcome, HandleError> {
    let mut delays = ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(std::time::Duration::from_millis(50))
        .with_max_delay(std::time::Duration::from_secs(2))
        .with_total_delay(Some(config.transient_retry))
        .without_max_times()
        .build();
    loop {
        match handler.handle(&value, publisher).await {
            Err(HandleError::Transient(error)) => match delays.next() {
                Some(delay) => {
                    tracing::warn!(
                        error = format!("{error:#}"),
                        ?delay,
                        "transient failure; retrying"
                    );
                    metrics::counter!("prizepool_retries_total").increment(1);
                    tokio::time::sleep(delay).await;
                }
                None => return Err(HandleError::Transient(error)),
            },
            other => return other,
        }
    }
}

/// Publishes the outcome's effects and reply; the delivery may be acked once
/// they are confirmed.
async fn finish(
    publisher: &Publisher,
    groupers: &Groupers,
    delivery: &Delivery,
    outcome: Outcome,
) -> (&'static str, Settle) {
    // The reply first: the requester is waiting for it, while the effects
    // only have to be confirmed before the ack.
    let mut messages = Vec::with_capacity(outcome.effects.len() + 1);
    if let (Some(reply), Some(reply_to)) = (outcome.reply, delivery.properties.reply_to()) {
        messages.push(Outgoing::reply(
            reply_to.as_str(),
            delivery.properties.correlation_id().as_ref(),
            reply,
        ));
    }
    messages.extend(outcome.effects);
    let (published, settled, told) = tokio::join!(
        publisher.publish_all(messages),
        groupers.ledger.settle(&outcome.ledger),
        groupers.events.publish(outcome.events),
    );
    match published
        .map_err(anyhow::Error::from)
        .and(settled)
        .and(told)
    {
        Ok(()) => ("acked", Settle::Ack),
        Err(error) => {
            // Nothing is acked: the request is redelivered and, being
            // idempotent, replays its first result and republishes.
            tracing::error!(
                error = format!("{error:#}"),
                "publishing the outcome failed; requeueing"
            );
            ("requeued", Settle::Requeue)
        }
    }
}

/// Moves a bad message to its dead-letter queue with the reason in headers
/// and answers the requester; the original may then be acked.
async fn dead_letter(
    publisher: &Publisher,
    delivery: &Delivery,
    route: Route,
    code: ErrorCode,
    invalid: &Invalid,
) -> (&'static str, Settle) {
    tracing::warn!(reason = %invalid, %code, "dead-lettering");
    match publish_dead_letter_as(publisher, delivery, route, code, invalid).await {
        Ok(()) => ("dead_lettered", Settle::Ack),
        Err(error) => {
            // Let the broker dead-letter it natively instead (no reason header).
            tracing::error!(%error, "could not publish the dead letter; rejecting");
            ("rejected", Settle::Reject)
        }
    }
}

/// The copy of `delivery` that goes to its dead-letter queue: same body and
/// properties, plus the reason headers.
fn dead_letter_message(
    delivery: &Delivery,
    body: Vec<u8>,
    route: Route,
    code: ErrorCode,
    invalid: &Invalid,
) -> Outgoing {
    let properties: BasicProperties = with_header(
        with_header(
            delivery.properties.clone(),
            ERROR_CODE_HEADER,
            code.as_str(),
        ),
        ERROR_HEADER,
        &invalid.message,
    );
    Outgoing {
        exchange: DLX.into(),
        routing_key: route.queue.into(),
        body,
        properties,
        mandatory: true,
    }
}

/// Publishes `delivery` to its dead-letter queue with the reason headers and
/// waits for the confirm; the caller acks the original afterwards. Replies
/// `rejected` when the request asked for a reply.
pub async fn publish_dead_letter(
    publisher: &Publisher,
    delivery: &Delivery,
    route: Route,
    invalid: &Invalid,
) -> Result<(), super::publish::PublishError> {
    publish_dead_letter_as(
        publisher,
        delivery,
        route,
        ErrorCode::InvalidRequest,
        invalid,
    )
    .await
}

/// [`publish_dead_letter`] with the error `code` of the headers and reply
/// (`internal` for a permanent failure).
pub async fn publish_dead_letter_as(
    publisher: &Publisher,
    delivery: &Delivery,
    route: Route,
    code: ErrorCode,
    invalid: &Invalid,
) -> Result<(), super::publish::PublishError> {
    let mut messages = vec![dead_letter_message(
        delivery,
        delivery.data.clone(),
        route,
        code,
        invalid,
    )];
    if let Some(reply_to) = delivery.properties.reply_to() {
        let request = messages::decode_envelope(&delivery.data).ok();
        let reply = messages::rejected_reply(request.as_ref(), code, &invalid.message);
        messages.push(Outgoing::reply(
            reply_to.as_str(),
            delivery.properties.correlation_id().as_ref(),
            serde_json::to_vec(&reply).unwrap_or_default(),
        ));
    }
    publisher.publish_all(messages).await
}

/// Dead-letters one part of `delivery` (an entry of a batch) as a message of
/// its own, with `delivery`'s properties and the reason headers. No reply:
/// the rest of the delivery still succeeds.
pub async fn publish_dead_letter_part(
    publisher: &Publisher,
    delivery: &Delivery,
    body: Vec<u8>,
    route: Route,
    invalid: &Invalid,
) -> Result<(), super::publish::PublishError> {
    let mut message =
        dead_letter_message(delivery, body, route, ErrorCode::InvalidRequest, invalid);
    message.properties = message
        .properties
        .with_reply_to("".into())
        .with_correlation_id("".into());
    publisher.publish(message).await
}
