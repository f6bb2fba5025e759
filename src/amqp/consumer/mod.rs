//! The consume loop every queue worker shares, in three parts a reader can
//! take one at a time:
//!
//! - **sessions** ([`session`]): connect, declare, consume; reconnect after a
//!   failure; on shutdown stop consuming, let in-flight deliveries finish
//!   within the grace period, make sure the broker has processed their acks,
//!   and close channels before the connection;
//! - **delivery** ([`delivery`]): decode the envelope, take a slot of its
//!   lane ([`lanes`]), call the worker's [`Handler`], and retry a transient
//!   failure briefly;
//! - **finishing** ([`finish`]): publish what the handler produced (effects,
//!   grouped bodies, then the reply) with confirms, dead-letter bad input
//!   and permanent failures with their reason and a `rejected` reply, hand
//!   a delivery whose dependency stays away back to the broker with a delay
//!   (`finish::hand_back`), and say how the delivery is settled (acks are
//!   coalesced, see [`super::acks`]).
//!
//! What a session's deliveries share (the grouping publishers, the reply
//! connection, the slots) is in [`shared`].
//!
//! The reply is published last, after everything it implies is confirmed, so
//! a request that fails half-way and comes back is still answered once.

use std::{future::Future, sync::Arc, time::Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use lapin::message::Delivery;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

mod delivery;
mod finish;
mod lanes;
mod lent;
mod session;
mod shared;

pub use finish::{publish_dead_letter, publish_dead_letter_as, publish_dead_letter_part};
pub use lent::release_slot;

use super::{
    acks::{Acks, Settle},
    grouped::Group,
    publish::{Outgoing, Publisher},
    reply::Replier,
    transient::HandleError,
    Route,
};
use crate::{config::Config, messages, ops::Health};

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

    /// The dependency a delivery needs beyond what every delivery of this
    /// worker needs (`"postgres"` for a red-packet create), or `None`.
    /// Deliveries of one lane hold at most half of the `CONCURRENCY` slots,
    /// so a lane whose dependency is away leaves the other half to the rest
    /// (see [`delivery`]).
    fn lane(&self, envelope: &Value) -> Option<&'static str> {
        let _ = envelope;
        None
    }

    /// Handles one decoded envelope. `publisher` is there for messages that
    /// must leave before the handler can finish (an urgent refill); all other
    /// messages belong in the returned [`Outcome`].
    fn handle(
        &self,
        envelope: &Value,
        publisher: &Publisher,
    ) -> impl Future<Output = Result<Outcome, HandleError>> + Send;

    /// The envelope of a delivery's body, which its span, its lane and
    /// [`Handler::handle_body`] read; an error dead-letters the delivery.
    /// By default the whole body as a JSON value
    /// ([`messages::decode_envelope`]). A handler that reads some bodies
    /// straight from their bytes in [`Handler::handle_body`] may return a
    /// shallow envelope for those (their `type` and the fields its span
    /// names), and must refuse exactly the bodies the default refuses.
    fn envelope(&self, body: &[u8]) -> Result<Value, messages::Invalid> {
        messages::decode_envelope(body)
    }

    /// Handles one delivery, its `body` as it came and its [`Handler::envelope`]:
    /// by default [`Handler::handle`] on the envelope.
    fn handle_body(
        &self,
        body: &[u8],
        envelope: &Value,
        publisher: &Publisher,
    ) -> impl Future<Output = Result<Outcome, HandleError>> + Send {
        let _ = body;
        self.handle(envelope, publisher)
    }
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
        session::session(config, handler, replier, health_ref, stop)
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

    /// Called when the queue has had nothing for the session for a while
    /// (no batch in hand, none arriving): the queue is drained.
    fn idle(&self) {}
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
    /// The queue consumed, for the per-queue metrics.
    queue: &'static str,
    /// When the batch's first delivery arrived.
    began: Instant,
}

impl Batch {
    /// Settles `delivery` (of this batch): handed to the session's acker,
    /// which coalesces the batch's acks into one `multiple` ack.
    ///
    /// Counts it like a [`Handler`]'s deliveries:
    /// `prizepool_messages_total{queue, outcome}` (`acked`, `requeued` or
    /// `rejected`; see [`Batch::dead_lettered`]) and
    /// `prizepool_handle_seconds{queue}`, from the arrival of the batch's
    /// first delivery to this settling.
    pub fn settle(&self, delivery: &Delivery, how: Settle) {
        let outcome = match how {
            Settle::Ack => "acked",
            Settle::Requeue => "requeued",
            Settle::Reject => "rejected",
        };
        self.settle_as(delivery, how, outcome);
    }

    /// Acks `delivery` once the handler's own dead letter of it is
    /// confirmed, counted as `dead_lettered` like a [`Handler`]'s.
    pub fn dead_lettered(&self, delivery: &Delivery) {
        self.settle_as(delivery, Settle::Ack, "dead_lettered");
    }

    fn settle_as(&self, delivery: &Delivery, how: Settle, outcome: &'static str) {
        metrics::counter!("prizepool_messages_total", "queue" => self.queue, "outcome" => outcome)
            .increment(1);
        metrics::histogram!("prizepool_handle_seconds", "queue" => self.queue)
            .record(self.began.elapsed().as_secs_f64());
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
        session::batch_session(config, handler, replier, health_ref, stop, empty)
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
