//! The consume loop every queue worker shares.
//!
//! It decodes the envelope, calls the worker's [`Handler`], publishes what the
//! handler produced (effects and reply) with confirms, and only then acks
//! (coalesced into `multiple` acks, see [`super::acks`]).
//! Bad input is dead-lettered with its reason in a header and answered with a
//! `rejected` reply; so is a permanent failure (`internal`), a handler's
//! panic included. Transient failures are retried with backoff and, if they
//! persist, the delivery is requeued (the queue's delivery limit bounds that).
//! The reply is published last, after everything it implies is confirmed, so
//! a request that fails half-way and comes back is still answered once.
//! A lost connection is re-established; on shutdown the loop stops consuming,
//! lets in-flight deliveries finish within the grace period, makes sure the
//! broker has processed their acks, and closes channels before the connection.

use std::{future::Future, panic::AssertUnwindSafe, sync::Arc, time::Instant};

use anyhow::Context;
use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::{FutureExt, StreamExt};
use lapin::{
    message::Delivery,
    options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
    BasicProperties,
};
use serde_json::Value;
use tokio::sync::{OwnedRwLockReadGuard, RwLock, Semaphore};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{info_span, Instrument};

use super::{
    acks::{Acks, Settle},
    grouped::{Group, Grouper},
    publish::{with_header, without_expiration, Outgoing, Publisher},
    reply::{Replier, Sent},
    transient::HandleError,
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
    /// The reply's JSON body, serialised (a body is serialised once, however
    /// many messages carry it).
    pub reply: Option<Vec<u8>>,
    /// Messages published, each on its own, before the reply.
    pub effects: Vec<Outgoing>,
    /// Serialised bodies published grouped with other deliveries' bodies of
    /// the same group (see [`super::grouped`]) and confirmed before the
    /// reply like the effects. Each group must be one the handler declares
    /// ([`Handler::groups`]).
    pub grouped: Vec<(&'static Group, Vec<u8>)>,
}

impl Outcome {
    /// Adds `body` (a serialised JSON object) to the messages of `group`.
    pub fn group(&mut self, group: &'static Group, body: Vec<u8>) {
        self.grouped.push((group, body));
    }

    /// The first group of the outcome that is not among `declared`.
    fn undeclared(&self, declared: &[Group]) -> Option<&'static str> {
        self.grouped
            .iter()
            .map(|(group, _)| group.batch_type)
            .find(|name| !declared.iter().any(|d| d.batch_type == *name))
    }
}

/// Which envelope fields name a delivery's pool and user in its span
/// ([`Handler::span_fields`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct SpanFields {
    pub pool: &'static [&'static str],
    pub user: &'static [&'static str],
}

/// A queue worker's business logic.
pub trait Handler: Send + Sync + 'static {
    /// The queue this worker consumes.
    fn route(&self) -> Route;

    /// The groups this worker's outcomes publish through
    /// ([`Outcome::grouped`]): the session starts one grouping publisher
    /// per group, shared by all its deliveries.
    fn groups(&self) -> &'static [Group] {
        &[]
    }

    /// The envelope fields a delivery's span and log lines name as its
    /// `pool` and `user` (the first of each list the envelope has).
    fn span_fields(&self) -> SpanFields {
        SpanFields::default()
    }

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
    let replier = Replier::new(&config.amqp_url, handler.route().queue);
    let (handler, replier, health_ref, stop) = (&handler, &replier, &health, &shutdown);
    reconnecting(&health, &shutdown, move || {
        session(config, handler, replier, health_ref, stop)
    })
    .await
}

/// A queue worker that handles its deliveries in batches: the settle worker
/// writes a batch of ledger entries in one Postgres transaction.
///
/// The shared loop gathers up to [`BatchLimits::size`] deliveries, waiting
/// at most [`BatchLimits::wait`] for a batch to fill, and hands them over
/// together; one batch is handled at a time. Session, reconnection, qos,
/// coalesced acks, watchdog and graceful stop are the same as for a
/// [`Handler`].
pub trait BatchHandler: Send + Sync + 'static {
    /// The queue this worker consumes.
    fn route(&self) -> Route;

    /// How deliveries are gathered into batches.
    fn limits(&self) -> BatchLimits;

    /// Handles one batch. Every delivery is settled through
    /// [`Batch::settle`] once what it caused is committed and confirmed; an
    /// error ends the session, and the broker redelivers every delivery not
    /// settled by then.
    fn handle_batch(&self, batch: Batch) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// How a [`BatchHandler`]'s deliveries are gathered.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    /// Most deliveries in one batch.
    pub size: usize,
    /// How long a batch that has its first delivery waits for more.
    pub wait: std::time::Duration,
    /// The consuming channel's prefetch (at least two batches, so the next
    /// one is on its way while one is written).
    pub prefetch: u16,
}

/// One batch of deliveries, and what the session lends to answer them.
#[derive(Debug)]
pub struct Batch {
    pub deliveries: Vec<Delivery>,
    /// The session's confirming channel (dead letters).
    pub publisher: Publisher,
    /// The worker's reply connection.
    pub replier: Replier,
    /// Cancelled when the worker is asked to stop.
    pub shutdown: CancellationToken,
    /// Unix seconds: the worker's start or, later, the last time the loop
    /// found the queue empty. Nothing delivered since can have waited
    /// longer than since then (the settle worker's lag gauge).
    pub empty_since: u64,
    acks: Acks,
}

impl Batch {
    /// Settles `delivery` (of this batch): handed to the session's acker,
    /// which coalesces the batch's acks into one `multiple` ack.
    pub fn settle(&self, delivery: &Delivery, how: Settle) {
        self.acks.finish(delivery.delivery_tag, how);
    }
}

/// Consumes `handler`'s queue in batches until `shutdown` is cancelled,
/// reconnecting after failures, like [`run`].
pub async fn run_batches<B: BatchHandler>(
    config: &Config,
    handler: Arc<B>,
    health: Health,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let replier = Replier::new(&config.amqp_url, handler.route().queue);
    // Across sessions: a new session does not make the queue empty.
    let empty_since = std::sync::atomic::AtomicU64::new(unix_now());
    let (handler, replier, health_ref, stop, empty) =
        (&handler, &replier, &health, &shutdown, &empty_since);
    reconnecting(&health, &shutdown, move || {
        batch_session(config, handler, replier, health_ref, stop, empty)
    })
    .await
}

/// Runs `session` again after every failure, with backoff, until one ends
/// cleanly (a shutdown) or the broker contradicts the configuration.
async fn reconnecting<F, Fut>(
    health: &Health,
    shutdown: &CancellationToken,
    mut session: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let mut backoff = reconnect_backoff();
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        let began = Instant::now();
        match session().await {
            Ok(()) => return Ok(()),
            Err(error) if error.downcast_ref::<super::Misconfigured>().is_some() => {
                return Err(error);
            }
            Err(error) => {
                health.set_ready(false);
                // A session that ran a while ended by a new outage: start
                // the backoff again, so the worker is back soon after the
                // broker (draws wait for refills only SHORT_POOL_WAIT_MS).
                if began.elapsed() > RECONNECT_RESET {
                    backoff = reconnect_backoff();
                }
                let delay = backoff.next().unwrap_or(RECONNECT_MAX);
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

/// How long connecting, declaring the topology and starting to consume may
/// take together.
const SETUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// How often a session checks that its connection and channels still stand.
const WATCHDOG: std::time::Duration = std::time::Duration::from_secs(1);

/// The longest wait between two reconnection attempts.
const RECONNECT_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// A session that lasted this long resets the reconnection backoff.
const RECONNECT_RESET: std::time::Duration = std::time::Duration::from_secs(10);

fn reconnect_backoff() -> impl Iterator<Item = std::time::Duration> {
    ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(std::time::Duration::from_millis(100))
        .with_max_delay(RECONNECT_MAX)
        .without_max_times()
        .build()
}

/// How long the loop must wait for a delivery before it takes the queue
/// for empty (a delivery already on its way arrives well within this).
const IDLE: std::time::Duration = std::time::Duration::from_millis(250);

/// Now, in unix seconds.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A session's links to the broker: the connection, the consuming channel
/// and its consumer, the confirming channel, and the acker.
struct Link {
    conn: lapin::Connection,
    channel: lapin::Channel,
    publisher: Publisher,
    /// Every consumer of the session (a draw worker consumes each draw
    /// shard), merged; each ends with a `None` item, which ends the session.
    consumer: futures_util::stream::SelectAll<Consumed>,
    tags: Vec<String>,
    prefetch: u16,
    acks: Acks,
    acker: tokio::task::JoinHandle<()>,
    watchdog: tokio::time::Interval,
}

/// One consumer's items, `None` last (when the broker cancelled it or its
/// channel closed).
type Consumed = std::pin::Pin<
    Box<dyn futures_util::Stream<Item = Option<lapin::Result<Delivery>>> + Send + Sync>,
>;

/// What the consumer gave, or why the session ends. Short-lived, one at a
/// time: boxing the delivery would cost an allocation per message.
#[allow(clippy::large_enum_variant)]
enum Next {
    Delivery(Delivery),
    /// The worker is asked to stop.
    Stop,
    /// A link to the broker is gone: end the session and reconnect.
    Lost(anyhow::Error),
}

impl Link {
    /// Connects, declares the topology, sets the prefetch and starts
    /// consuming `route`'s queue.
    ///
    /// Bounded: a node that is starting or stopping may take the connection
    /// and then never answer a declare or a consume (a quorum queue whose
    /// leader is being elected), which would hold the worker for good.
    async fn open(config: &Config, route: Route, prefetch: u16) -> anyhow::Result<Self> {
        let (conn, channel, publisher, consumer, tags) =
            tokio::time::timeout(SETUP_TIMEOUT, async {
                let conn = super::connect(&config.amqp_url, route.queue).await?;
                let channel = conn.create_channel().await?;
                super::declare_topology_for(&channel, config).await?;
                channel
                    .basic_qos(prefetch, BasicQosOptions::default())
                    .await?;
                let publisher = Publisher::new(conn.create_channel().await?).await?;
                let queues = super::consumed_queues(&conn, route, config.draw_shards).await?;
                // All on the one channel: delivery tags are the channel's, so
                // the acker's coalescing spans every queue consumed.
                let mut consumer = futures_util::stream::SelectAll::new();
                let mut tags = Vec::new();
                for queue in &queues {
                    let tag = format!("{queue}-{}", ulid::Ulid::new());
                    let stream = channel
                        .basic_consume(
                            queue.as_str().into(),
                            tag.as_str().into(),
                            BasicConsumeOptions::default(),
                            FieldTable::default(),
                        )
                        .await
                        .with_context(|| format!("consuming {queue}"))?;
                    let stream: Consumed = Box::pin(
                        stream
                            .map(Some)
                            .chain(futures_util::stream::once(std::future::ready(None))),
                    );
                    consumer.push(stream);
                    tags.push(tag);
                }
                anyhow::Ok((conn, channel, publisher, consumer, tags))
            })
            .await
            .map_err(|_| {
                anyhow::anyhow!("the broker did not set up the session within {SETUP_TIMEOUT:?}")
            })??;
        let (acks, acker) = Acks::start(channel.clone());
        Ok(Self {
            conn,
            channel,
            publisher,
            consumer,
            tags,
            prefetch,
            acks,
            acker,
            watchdog: tokio::time::interval(WATCHDOG),
        })
    }

    /// The next delivery, unless the worker is asked to stop or a link to
    /// the broker is gone first. Every way a link can fail ends the wait:
    /// the consumer's stream ends or errs (the broker cancelled the
    /// consumer: a quorum queue that lost its leader, a deleted queue; the
    /// channel or connection closed), the publishing channel failed or lost
    /// a confirm, the acker could not send a frame, or the watchdog finds a
    /// channel or the connection closed without the stream saying so.
    async fn next(&mut self, shutdown: &CancellationToken) -> Next {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Next::Stop,
                next = self.consumer.next() => return match next {
                    Some(Some(Ok(delivery))) => Next::Delivery(delivery),
                    Some(Some(Err(e))) => Next::Lost(anyhow::Error::from(e).context("consuming")),
                    Some(None) | None => {
                        Next::Lost(anyhow::anyhow!("the broker cancelled a consumer"))
                    }
                },
                () = self.publisher.broken() => return Next::Lost(anyhow::anyhow!(
                    "the publishing channel failed or lost a confirm"
                )),
                () = self.acks.failed() => return Next::Lost(anyhow::anyhow!(
                    "the broker did not take an ack"
                )),
                _ = self.watchdog.tick() => {
                    if let Some(lost) = self.lost() {
                        return Next::Lost(anyhow::anyhow!("{lost}"));
                    }
                }
            }
        }
    }

    /// What of the links is gone, if anything.
    fn lost(&self) -> Option<&'static str> {
        if !self.conn.status().connected() {
            Some("the connection to the broker was lost")
        } else if !self.channel.status().connected() {
            Some("the broker closed the consuming channel")
        } else if self.publisher.is_broken() {
            Some("the publishing channel failed or lost a confirm")
        } else {
            None
        }
    }

    /// Resolves once a link is gone (for waits other than [`Self::next`]).
    async fn lost_any(&mut self) -> anyhow::Error {
        loop {
            tokio::select! {
                () = self.publisher.broken() => return anyhow::anyhow!(
                    "the publishing channel failed or lost a confirm"
                ),
                () = self.acks.failed() => return anyhow::anyhow!("the broker did not take an ack"),
                _ = self.watchdog.tick() => {
                    if let Some(lost) = self.lost() {
                        return anyhow::anyhow!("{lost}");
                    }
                }
            }
        }
    }

    /// Stops new deliveries, then lets the ones in hand (`tracker`'s tasks)
    /// finish within `grace`; those that do not are redelivered.
    async fn drain(&self, tracker: &TaskTracker, grace: std::time::Duration) {
        self.cancel().await;
        tracker.close();
        if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
            tracing::warn!(
                "deliveries in hand did not finish within the grace period; they will be redelivered"
            );
        }
    }

    /// Stops new deliveries.
    async fn cancel(&self) {
        for tag in &self.tags {
            let _ = super::bounded(
                "cancelling the consumer",
                self.channel
                    .basic_cancel(tag.as_str().into(), BasicCancelOptions::default()),
            )
            .await;
        }
    }

    /// Sends the last acks, makes sure the broker processed them, and closes
    /// the channels, then the connection.
    async fn close(self) {
        let Self {
            conn,
            channel,
            publisher,
            prefetch,
            acks,
            acker,
            ..
        } = self;
        // Every ack handed on so far (those of every answered delivery: see
        // `Groupers::closed`) goes out before the flush below, however
        // long it takes a busy machine to get there: a lost ack is a
        // redelivery answered twice. Deliveries still running past the
        // grace period hold the acker open; they answer nothing.
        let sent = acks.barrier();
        drop(acks);
        if tokio::time::timeout(ACKS_SENT, sent).await.is_err() {
            tracing::warn!("the last acks were not sent in time; their deliveries come back");
        }
        // The acker ends once every handle is gone and its frames are out.
        let _ = tokio::time::timeout(std::time::Duration::from_millis(100), acker).await;
        // A synchronous round trip on the consuming channel: the broker
        // handles a channel's frames in order, so once qos-ok arrives every
        // ack sent before it has been processed (acks written just before a
        // close can be lost).
        let _ = super::bounded(
            "flushing the acks",
            channel.basic_qos(prefetch, BasicQosOptions::default()),
        )
        .await;
        // Each bounded: a connection that is already gone must not hold the
        // worker's reconnect.
        let _ = super::bounded(
            "closing the channel",
            channel.close(200, "shutting down".into()),
        )
        .await;
        let _ = super::bounded(
            "closing the publishing channel",
            publisher.channel().close(200, "shutting down".into()),
        )
        .await;
        let _ = super::bounded(
            "closing the connection",
            conn.close(200, "shutting down".into()),
        )
        .await;
    }
}

async fn session<H: Handler>(
    config: &Config,
    handler: &Arc<H>,
    replier: &Replier,
    health: &Health,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let route = handler.route();
    let mut link = Link::open(config, route, config.prefetch).await?;
    health.set_ready(true);
    tracing::info!(queue = route.queue, "consuming");

    let tracker = TaskTracker::new();
    let (grouped, grouping): (Vec<_>, Vec<_>) = handler
        .groups()
        .iter()
        .map(|&group| {
            let (grouper, task) = Grouper::start(link.publisher.clone(), group);
            ((group, grouper), task)
        })
        .unzip();
    let groupers = Groupers {
        grouped: grouped.into(),
        replier: replier.clone(),
        closed: Arc::new(RwLock::new(false)),
    };
    let slots = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let result = loop {
        let delivery = match link.next(shutdown).await {
            Next::Delivery(delivery) => delivery,
            Next::Stop => break Ok(()),
            Next::Lost(error) => break Err(error),
        };
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            permit = slots.clone().acquire_owned() => permit?,
        };
        let handler = handler.clone();
        let publisher = link.publisher.clone();
        let config = config.clone();
        let acks = link.acks.clone();
        let groupers = groupers.clone();
        tracker.spawn(async move {
            let tag = delivery.delivery_tag;
            // `process` does not panic (a handler's panic is caught inside
            // it); should a bug make it, the broker dead-letters the
            // delivery rather than it staying unsettled.
            let (how, replied) =
                AssertUnwindSafe(process(&config, &*handler, &publisher, &groupers, delivery))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|panic| {
                        tracing::error!(
                            panic = panic_message(&*panic),
                            "handling a delivery panicked; rejecting it"
                        );
                        (Settle::Reject, None)
                    });
            // The ack of a delivery that was answered is handed on before
            // the session may close (see `Groupers::closed`).
            acks.finish(tag, how);
            drop(replied);
            drop(permit);
        });
    };
    health.set_ready(false);

    link.drain(&tracker, config.shutdown_grace).await;
    // From here no delivery is answered: one still in hand is redelivered
    // and answered then. Waiting for the write lock waits for those that
    // were answered to hand their acks on, so the flush below sends them.
    *groupers.closed.write().await = true;
    // The groupers end once every handle is gone and what they hold is out.
    drop(groupers);
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        futures_util::future::join_all(grouping),
    )
    .await;
    link.close().await;
    result
}

async fn batch_session<B: BatchHandler>(
    config: &Config,
    handler: &Arc<B>,
    replier: &Replier,
    health: &Health,
    shutdown: &CancellationToken,
    empty_since: &std::sync::atomic::AtomicU64,
) -> anyhow::Result<()> {
    use std::sync::atomic::Ordering;
    let route = handler.route();
    let limits = handler.limits();
    let mut link = Link::open(config, route, limits.prefetch).await?;
    health.set_ready(true);
    tracing::info!(queue = route.queue, "consuming");

    let tracker = TaskTracker::new();
    let result = loop {
        // The first delivery of a batch. A wait that lasts means the queue
        // was empty when it began.
        let waiting_since = unix_now();
        let started = Instant::now();
        let first = match link.next(shutdown).await {
            Next::Delivery(delivery) => delivery,
            Next::Stop => break Ok(()),
            Next::Lost(error) => break Err(error),
        };
        if started.elapsed() >= IDLE {
            empty_since.fetch_max(waiting_since, Ordering::Relaxed);
        }
        let mut deliveries = vec![first];
        let deadline = tokio::time::Instant::now() + limits.wait;
        let mut end = None;
        while deliveries.len() < limits.size {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => break,
                next = link.next(shutdown) => match next {
                    Next::Delivery(delivery) => deliveries.push(delivery),
                    // The batch in hand is still handled.
                    Next::Stop => { end = Some(Ok(())); break }
                    Next::Lost(error) => { end = Some(Err(error)); break }
                },
            }
        }
        let batch = Batch {
            deliveries,
            publisher: link.publisher.clone(),
            replier: replier.clone(),
            shutdown: shutdown.clone(),
            empty_since: empty_since.load(Ordering::Relaxed),
            acks: link.acks.clone(),
        };
        let handler = handler.clone();
        let mut handling = tracker.spawn(async move { handler.handle_batch(batch).await });
        // One batch at a time; a link lost meanwhile ends the session at
        // once (the batch's own acks would go nowhere).
        let handled = tokio::select! {
            handled = &mut handling => handled,
            error = link.lost_any() => break Err(error),
        };
        match handled {
            Ok(Ok(())) => {}
            Ok(Err(error)) => break Err(error),
            Err(join) => break Err(anyhow::anyhow!("the batch handler failed: {join}")),
        }
        if let Some(end) = end {
            break end;
        }
    };
    health.set_ready(false);

    link.drain(&tracker, config.shutdown_grace).await;
    link.close().await;
    result
}

/// The grouping publishers and the reply connection a worker's deliveries
/// share.
#[derive(Clone, Debug)]
struct Groupers {
    /// One grouping publisher per group the handler declares.
    grouped: Arc<[(Group, Grouper)]>,
    replier: Replier,
    /// Set once the session stops answering. A delivery holds a read guard
    /// from its reply until its ack is handed on: a reply whose ack could
    /// be lost in the close would be sent again by the redelivery, two
    /// answers to one request.
    closed: Arc<RwLock<bool>>,
}

/// Held from a delivery's reply until its ack is handed on.
type Replied = Option<OwnedRwLockReadGuard<bool>>;

/// How long a closing session waits for its last acks to be sent (each
/// frame is bounded on its own, `super::BROKER_OP_TIMEOUT`).
const ACKS_SENT: std::time::Duration = std::time::Duration::from_secs(10);

/// Handles one delivery end to end and says how to settle it; never panics.
async fn process<H: Handler>(
    config: &Config,
    handler: &H,
    publisher: &Publisher,
    groupers: &Groupers,
    delivery: Delivery,
) -> (Settle, Replied) {
    let started = Instant::now();
    let route = handler.route();
    let envelope = messages::decode_envelope(&delivery.data);
    let request_id = match &envelope {
        Ok(value) => messages::idempotency_id(value),
        Err(_) => messages::request_ids(&delivery.data)
            .as_ref()
            .and_then(messages::idempotency_id),
    }
    .map(|(_, id)| id)
    .unwrap_or_default();
    let (pool, user) = match &envelope {
        Ok(value) => (
            envelope_field(value, handler.span_fields().pool),
            envelope_field(value, handler.span_fields().user),
        ),
        Err(_) => (String::new(), String::new()),
    };
    let span = info_span!("delivery", queue = route.queue, request.id = %request_id, pool = %pool, user = %user);
    crate::telemetry::continue_trace(&span, delivery.properties.headers().as_ref());
    async move {
        let outcome = match envelope {
            Err(invalid) => Err(HandleError::Invalid(invalid)),
            Ok(value) => handle_with_retry(config, handler, publisher, value).await,
        };
        let mut replied = None;
        let (label, how) = match outcome {
            Ok(outcome) => {
                if let Some(group) = outcome.undeclared(handler.groups()) {
                    // A bug of the handler, the same on every redelivery.
                    let reason = Invalid::new(format!(
                        "the handler produced a {group} body but declares no such group"
                    ));
                    tracing::error!(%reason, "permanent failure; dead-lettering");
                    dead_letter(
                        publisher,
                        &groupers.replier,
                        &delivery,
                        route,
                        ErrorCode::Internal,
                        &reason,
                    )
                    .await
                } else {
                    let (label, how, guard) = finish(publisher, groupers, &delivery, outcome).await;
                    replied = guard;
                    (label, how)
                }
            }
            Err(HandleError::Invalid(invalid)) => {
                dead_letter(
                    publisher,
                    &groupers.replier,
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
                dead_letter(
                    publisher,
                    &groupers.replier,
                    &delivery,
                    route,
                    ErrorCode::Internal,
                    &reason,
                )
                .await
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
        (how, replied)
    }
    .instrument(span)
    .await
}

/// The first of `names` the envelope has, as text (ids and numbers alike),
/// for the delivery's log lines.
fn envelope_field(value: &Value, names: &[&str]) -> String {
    names
        .iter()
        .find_map(|name| match value.get(*name)? {
            Value::String(text) => Some(text.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        })
        .unwrap_or_default()
}

async fn handle_with_retry<H: Handler>(
    config: &Config,
    handler: &H,
    publisher: &Publisher,
    value: Value,
) -> Result<Outcome, HandleError> {
    // A transient failure is a server that is away: the delivery is kept and
    // tried again, with backoff, for as long as it takes. Requeueing it
    // instead would count towards the queue's delivery limit, and a long
    // outage would then dead-letter work whose effect may already have
    // happened in Redis (a drawn prize, a closed packet) unpaid. Past
    // `TRANSIENT_RETRY_MS` the failure is logged as an error on every try.
    let started = std::time::Instant::now();
    let mut delays = ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(std::time::Duration::from_millis(50))
        .with_max_delay(std::time::Duration::from_secs(5))
        .without_max_times()
        .build();
    loop {
        match handle_caught(handler, &value, publisher).await {
            Err(HandleError::Transient(error)) => {
                let delay = delays.next().unwrap_or(std::time::Duration::from_secs(5));
                if started.elapsed() < config.transient_retry {
                    tracing::warn!(
                        error = format!("{error:#}"),
                        ?delay,
                        "transient failure; retrying"
                    );
                } else {
                    tracing::error!(
                        error = format!("{error:#}"),
                        ?delay,
                        waited = ?started.elapsed(),
                        "a dependency is still failing; keeping the delivery and retrying"
                    );
                }
                metrics::counter!("prizepool_retries_total").increment(1);
                tokio::time::sleep(delay).await;
            }
            other => return other,
        }
    }
}

/// Calls the handler, turning a panic into an internal failure: a message
/// that makes the handler panic is dead-lettered and answered like any other
/// permanent failure, instead of ending the delivery's task with the
/// delivery never settled (which would hold its prefetch slot until the
/// connection closes, and then redeliver the poison to the next worker).
async fn handle_caught<H: Handler>(
    handler: &H,
    value: &Value,
    publisher: &Publisher,
) -> Result<Outcome, HandleError> {
    // Unwind safety: the handler shares nothing with this task that a
    // half-finished call could leave inconsistent for the next delivery
    // other than through Redis and Postgres, whose steps are atomic.
    match AssertUnwindSafe(handler.handle(value, publisher))
        .catch_unwind()
        .await
    {
        // A lost connection is retried wherever it was classified.
        Ok(result) => super::transient::settled(result),
        Err(panic) => {
            metrics::counter!("prizepool_handler_panics_total").increment(1);
            Err(HandleError::Internal(anyhow::anyhow!(
                "the handler panicked: {}",
                panic_message(&*panic)
            )))
        }
    }
}

/// The text a panic was raised with (`panic!("…")`), when it has one.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&'static str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a non-text panic payload")
}

/// Publishes the outcome: first its effects and grouped bodies, and only
/// once the broker has confirmed them all, the reply. The delivery may
/// be acked once the reply is confirmed too.
///
/// The order makes the reply the last thing a request causes: if anything
/// before it fails, nothing was answered, the delivery is requeued and its
/// redelivery (being idempotent) republishes the same outcome and answers
/// once. A reply sent alongside effects that then failed would be sent again
/// by that redelivery: two replies to one request.
async fn finish(
    publisher: &Publisher,
    groupers: &Groupers,
    delivery: &Delivery,
    outcome: Outcome,
) -> (&'static str, Settle, Replied) {
    // Each body to its group's publisher (every group is declared: see
    // `process`), moved, not copied.
    let mut bodies: Vec<Vec<Vec<u8>>> = groupers.grouped.iter().map(|_| Vec::new()).collect();
    for (group, body) in outcome.grouped {
        if let Some(i) = groupers
            .grouped
            .iter()
            .position(|(declared, _)| declared.batch_type == group.batch_type)
        {
            bodies[i].push(body);
        }
    }
    let grouped = futures_util::future::join_all(
        groupers
            .grouped
            .iter()
            .zip(bodies)
            .filter(|(_, bodies)| !bodies.is_empty())
            .map(|((_, grouper), bodies)| grouper.publish(bodies)),
    );
    let (published, grouped) = tokio::join!(publisher.publish_all(outcome.effects), grouped);
    let result = published
        .map_err(anyhow::Error::from)
        .and_then(|()| grouped.into_iter().collect::<anyhow::Result<()>>());
    if let Err(error) = result {
        // Nothing is acked: the request is redelivered and, being
        // idempotent, replays its first result and republishes.
        tracing::error!(
            error = format!("{error:#}"),
            "publishing the outcome failed; requeueing"
        );
        return ("requeued", Settle::Requeue, None);
    }
    let (Some(reply), Some(reply_to)) = (outcome.reply, delivery.properties.reply_to()) else {
        return ("acked", Settle::Ack, None);
    };
    let gate = groupers.closed.clone().read_owned().await;
    if *gate {
        // The session is closing and this ack might not reach the broker:
        // the redelivery answers instead.
        return ("requeued", Settle::Requeue, None);
    }
    let reply = Outgoing::reply(
        reply_to.as_str(),
        delivery.properties.correlation_id().as_ref(),
        reply,
    );
    if groupers.replier.send(vec![reply]).await == Sent::GivenUp {
        // Everything the request caused is confirmed and its answer is
        // stored: a requester still waiting sends the same id again and gets
        // it replayed.
        tracing::warn!("the reply could not be delivered; its requester is gone");
    }
    ("acked", Settle::Ack, Some(gate))
}

/// Moves a bad message to its dead-letter queue with the reason in headers
/// and answers the requester, in that order; the original may then be acked.
async fn dead_letter(
    publisher: &Publisher,
    replier: &Replier,
    delivery: &Delivery,
    route: Route,
    code: ErrorCode,
    invalid: &Invalid,
) -> (&'static str, Settle) {
    tracing::warn!(reason = %invalid, %code, "dead-lettering");
    let copy = dead_letter_message(delivery, delivery.data.clone(), route, code, invalid);
    let (label, how) = match publisher.publish(copy).await {
        Ok(()) => ("dead_lettered", Settle::Ack),
        Err(error) => {
            // Let the broker dead-letter it natively instead (no reason header).
            tracing::error!(%error, "could not publish the dead letter; rejecting");
            ("rejected", Settle::Reject)
        }
    };
    // Either way the request is never delivered again (acked, or moved to
    // the DLQ by the broker), so this is its one answer.
    let Some(reply) = rejected_reply_message(delivery, code, invalid) else {
        return (label, how);
    };
    if replier.send(vec![reply]).await == Sent::GivenUp {
        // Requeueing would dead-letter a second copy and fail the same way.
        tracing::warn!("the rejected reply could not be delivered; its requester is gone");
    }
    (label, how)
}

/// The `rejected` reply to `delivery`, when it asked for one.
fn rejected_reply_message(
    delivery: &Delivery,
    code: ErrorCode,
    invalid: &Invalid,
) -> Option<Outgoing> {
    let reply_to = delivery.properties.reply_to().as_ref()?;
    let reply = messages::rejected_reply_to(&delivery.data, code, &invalid.message);
    Some(Outgoing::reply(
        reply_to.as_str(),
        delivery.properties.correlation_id().as_ref(),
        serde_json::to_vec(&reply).unwrap_or_default(),
    ))
}

/// The copy of `delivery` that goes to its dead-letter queue: same body and
/// properties, plus the reason headers, but no `expiration`: a dead letter
/// stays until someone looks at it, whatever TTL its publisher gave it.
fn dead_letter_message(
    delivery: &Delivery,
    body: Vec<u8>,
    route: Route,
    code: ErrorCode,
    invalid: &Invalid,
) -> Outgoing {
    let properties: BasicProperties = super::publish::with_dead_letter_time(with_header(
        with_header(
            without_expiration(&delivery.properties),
            ERROR_CODE_HEADER,
            code.as_str(),
        ),
        ERROR_HEADER,
        &invalid.message,
    ));
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
    replier: &Replier,
    delivery: &Delivery,
    route: Route,
    invalid: &Invalid,
) -> Result<(), super::publish::PublishError> {
    publish_dead_letter_as(
        publisher,
        replier,
        delivery,
        route,
        ErrorCode::InvalidRequest,
        invalid,
    )
    .await
}

/// [`publish_dead_letter`] with the error `code` of the headers and reply
/// (`internal` for a permanent failure).
///
/// The dead letter is confirmed before the reply is published, so a request
/// is never answered while its dead letter may still be lost; the reply
/// carries the request's id whenever the body had a usable one.
pub async fn publish_dead_letter_as(
    publisher: &Publisher,
    replier: &Replier,
    delivery: &Delivery,
    route: Route,
    code: ErrorCode,
    invalid: &Invalid,
) -> Result<(), super::publish::PublishError> {
    publisher
        .publish(dead_letter_message(
            delivery,
            delivery.data.clone(),
            route,
            code,
            invalid,
        ))
        .await?;
    if let Some(reply) = rejected_reply_message(delivery, code, invalid) {
        if replier.send(vec![reply]).await == Sent::GivenUp {
            tracing::warn!("the rejected reply could not be delivered; its requester is gone");
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_lines_name_the_pool_and_user_of_every_request_kind() {
        let draw = serde_json::json!({"type": "draw", "pool": "gift-1", "user_id": 42});
        assert_eq!(
            envelope_field(&draw, &["pool", "activity", "packet_id"]),
            "gift-1"
        );
        assert_eq!(envelope_field(&draw, &["user_id", "sender"]), "42");
        let create =
            serde_json::json!({"type": "redpacket.create", "packet_id": "rp-9", "sender": 7});
        assert_eq!(
            envelope_field(&create, &["pool", "activity", "packet_id"]),
            "rp-9"
        );
        assert_eq!(envelope_field(&create, &["user_id", "sender"]), "7");
        let odd = serde_json::json!({"pool": {"nested": 1}});
        assert_eq!(envelope_field(&odd, &["pool"]), "");
    }
    use std::{borrow::Cow, io};

    fn transient(e: impl Into<HandleError>) -> bool {
        match e.into() {
            HandleError::Transient(_) => true,
            HandleError::Internal(_) => false,
            HandleError::Invalid(i) => panic!("a server error is never bad input: {i}"),
        }
    }

    fn io_error(kind: io::ErrorKind) -> redis::RedisError {
        io::Error::new(kind, "test").into()
    }

    #[test]
    fn redis_connection_and_cluster_errors_are_transient() {
        for kind in [
            io::ErrorKind::ConnectionRefused,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::TimedOut,
            io::ErrorKind::UnexpectedEof,
            io::ErrorKind::Other,
        ] {
            assert!(transient(io_error(kind)), "{kind:?}");
        }
        for kind in [
            redis::ServerErrorKind::Moved,
            redis::ServerErrorKind::Ask,
            redis::ServerErrorKind::TryAgain,
            redis::ServerErrorKind::ClusterDown,
            redis::ServerErrorKind::MasterDown,
            redis::ServerErrorKind::BusyLoading,
            redis::ServerErrorKind::ReadOnly,
        ] {
            let e = redis::RedisError::from((redis::ErrorKind::Server(kind), "test"));
            assert!(transient(e), "{kind:?}");
        }
        assert!(transient(redis::RedisError::from((
            redis::ErrorKind::ClusterConnectionNotFound,
            "test"
        ))));
        for code in ["BUSY", "LOADING", "OOM", "MISCONF"] {
            let e = redis::make_extension_error(code.into(), Some("test".into()));
            assert!(transient(e), "{code}");
        }
    }

    #[test]
    fn redis_script_type_and_parse_errors_are_internal() {
        for kind in [
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            redis::ErrorKind::Server(redis::ServerErrorKind::ExecAbort),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript),
            redis::ErrorKind::Server(redis::ServerErrorKind::CrossSlot),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm),
            redis::ErrorKind::UnexpectedReturnType,
            redis::ErrorKind::Parse,
            redis::ErrorKind::Client,
            redis::ErrorKind::InvalidClientConfig,
        ] {
            let e = redis::RedisError::from((kind, "test"));
            assert!(!transient(e), "{kind:?}");
        }
        // A script's `redis.error_reply("…")` with a code of its own.
        let e = redis::make_extension_error("BADPOOL".into(), Some("corrupt".into()));
        assert!(!transient(e));
    }

    /// A Postgres error with only a SQLSTATE, as the driver would report it.
    #[derive(Debug)]
    struct Sqlstate(&'static str);

    impl std::fmt::Display for Sqlstate {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for Sqlstate {}

    impl sqlx::error::DatabaseError for Sqlstate {
        fn message(&self) -> &str {
            "test"
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn database(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Sqlstate(code)))
    }

    #[test]
    fn sqlx_connection_pool_and_passing_server_states_are_transient() {
        for e in [
            sqlx::Error::Io(io::Error::new(io::ErrorKind::ConnectionReset, "test")),
            sqlx::Error::Tls("handshake".into()),
            sqlx::Error::Protocol("unexpected message".into()),
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::WorkerCrashed,
        ] {
            let text = e.to_string();
            assert!(transient(e), "{text}");
        }
        for code in [
            "08000", "08003", "08006", "08001", "08004", "40001", "40P01", "53000", "53100",
            "53200", "53300", "57P01", "57P02", "57P03", "57014", "55P03", "25006",
        ] {
            assert!(transient(database(code)), "{code}");
        }
    }

    #[test]
    fn sqlx_statement_and_decoding_errors_are_internal() {
        for e in [
            sqlx::Error::RowNotFound,
            sqlx::Error::ColumnNotFound("x".into()),
            sqlx::Error::Decode("bad".into()),
            sqlx::Error::Configuration("bad".into()),
        ] {
            let text = e.to_string();
            assert!(!transient(e), "{text}");
        }
        for code in [
            "23505", "23503", "22012", "22003", "42P01", "42703", "P0001", "XX000", "40002",
        ] {
            assert!(!transient(database(code)), "{code}");
        }
    }

    #[test]
    fn a_panic_message_is_kept() {
        let caught = std::panic::catch_unwind(|| panic!("boom {}", 7)).unwrap_err();
        assert_eq!(panic_message(&*caught), "boom 7");
        let caught = std::panic::catch_unwind(|| panic!("static")).unwrap_err();
        assert_eq!(panic_message(&*caught), "static");
    }
}
