//! Delivery: one message from its arrival to how it is settled.
//!
//! A delivery is decoded, takes a slot of its lane (see [`Lanes`]), and is
//! handed to the worker's [`Handler`]; what the handler produced is
//! published and answered by [`super::finish`].
//!
//! # Transient failures hold no slot for long
//!
//! A transient failure (a server away: see [`HandleError`]) is retried
//! with backoff for at most [`RETRY_BEFORE_HAND_BACK`], holding its slot only while
//! an attempt runs (see [`handled`]). If it persists,
//! the delivery is handed back: a copy, the same body and properties, goes
//! to the queue's retry queue (`<queue>.retry`, [`crate::amqp::retry_queue`]),
//! waits there [`crate::amqp::RETRY_DELAY`] and returns to the queue; the
//! original is acked once the broker confirmed the copy. The slot is free
//! for other work meanwhile, so one dependency that is away does not take
//! every slot of the worker. A copy is a new message to the queue: its
//! retries do not count towards the queue's delivery limit, so a long outage
//! dead-letters nothing. Handlers are idempotent (by request id, claim or
//! trigger), so a copy handled after its original made some of its steps
//! replays them; it is answered once, by whoever finishes it.
//!
//! Every handler is idempotent, so the worst a worker killed between the
//! copy's confirm and the original's ack does is handle the request twice
//! (answering it twice, the same answer); a graceful stop does not: a
//! delivery is handed back only while the session still answers (see
//! `Groupers::closed`), and requeued otherwise.

use std::{
    collections::HashMap,
    panic::AssertUnwindSafe,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Instant,
};

use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::FutureExt;
use lapin::{
    message::Delivery,
    types::{AMQPValue, FieldTable},
};
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{info_span, Instrument};

use super::{
    finish,
    session::{Replied, Shared},
    HandleError, Handler, Outcome, Outgoing, Publisher, Route, Settle,
};
use crate::{
    amqp::{FAILING_SINCE_HEADER, RETRIES_HEADER},
    messages::{self, Invalid},
};

/// How long a transient failure is retried before the delivery
/// is handed back.
pub(crate) const RETRY_BEFORE_HAND_BACK: std::time::Duration =
    std::time::Duration::from_millis(500);

/// What a delivery ended as: the label of its outcome metric, how it is
/// settled, and the guard held from its reply until its ack is handed on.
pub(super) type Ended = (&'static str, Settle, Replied);

/// [`process`], with a panic of its own (a bug: a handler's panic is caught
/// inside) turned into a rejection, so the broker dead-letters the delivery
/// rather than it staying unsettled. None when `stop` came before the
/// delivery had a slot: it is left unsettled, for the broker to redeliver.
pub(super) async fn process_caught<H: Handler>(
    shared: &Shared<H>,
    delivery: Delivery,
    stop: &CancellationToken,
) -> Option<(Settle, Replied)> {
    AssertUnwindSafe(process(shared, delivery, stop))
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| {
            tracing::error!(
                panic = panic_message(&*panic),
                "handling a delivery panicked; rejecting it"
            );
            Some((Settle::Reject, None))
        })
}

/// Handles one delivery end to end and says how to settle it.
async fn process<H: Handler>(
    shared: &Shared<H>,
    delivery: Delivery,
    stop: &CancellationToken,
) -> Option<(Settle, Replied)> {
    let started = Instant::now();
    let route = shared.handler.route();
    let envelope = messages::decode_envelope(&delivery.data);
    let span = delivery_span(&*shared.handler, &delivery, &envelope);
    async move {
        let (label, how, replied) = match envelope {
            Err(invalid) => finish::failed(shared, &delivery, HandleError::Invalid(invalid)).await,
            Ok(value) => handled(shared, &delivery, value, stop).await?,
        };
        metrics::counter!("prizepool_messages_total", "queue" => route.queue, "outcome" => label)
            .increment(1);
        metrics::histogram!("prizepool_handle_seconds", "queue" => route.queue)
            .record(started.elapsed().as_secs_f64());
        Some((how, replied))
    }
    .instrument(span)
    .await
}

/// The span of a delivery's log lines: its queue, request id, pool and user.
fn delivery_span<H: Handler>(
    handler: &H,
    delivery: &Delivery,
    envelope: &Result<Value, Invalid>,
) -> tracing::Span {
    let request_id = match envelope {
        Ok(value) => messages::idempotency_id(value),
        Err(_) => messages::request_ids(&delivery.data)
            .as_ref()
            .and_then(messages::idempotency_id),
    }
    .map(|(_, id)| id)
    .unwrap_or_default();
    let (pool, user) = match envelope {
        Ok(value) => (
            envelope_field(value, handler.span_fields().pool),
            envelope_field(value, handler.span_fields().user),
        ),
        Err(_) => (String::new(), String::new()),
    };
    let span = info_span!("delivery", queue = handler.route().queue, request.id = %request_id, pool = %pool, user = %user);
    crate::telemetry::continue_trace(&span, delivery.properties.headers().as_ref());
    span
}

/// A decoded delivery: handled in a slot of its lane and of the worker,
/// then finished, dead-lettered or handed back. A slot of the lane comes
/// first, so a delivery waiting for its lane holds none of the worker's.
///
/// A transient failure is tried again with backoff while [`RETRY_BEFORE_HAND_BACK`]
/// is not over (an attempt that waits for a server may take longer on its
/// own: then it is the only one), and handed back after. The slots are held
/// for each attempt, not across the backoff between attempts: with one
/// Redis Cluster master down, a third of the draws fail fast and wait to
/// try again, and waiting in their slots they would take every slot from
/// the draws that need only the masters that are up.
async fn handled<H: Handler>(
    shared: &Shared<H>,
    delivery: &Delivery,
    value: Value,
    stop: &CancellationToken,
) -> Option<Ended> {
    let started = Instant::now();
    let mut delays = ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(std::time::Duration::from_millis(50))
        .with_max_delay(std::time::Duration::from_millis(400))
        .without_max_times()
        .build();
    let mut first = true;
    loop {
        let lane = tokio::select! {
            // A delivery that began its attempts sees them through.
            _ = stop.cancelled(), if first => return None,
            entered = shared.lanes.enter(shared.handler.lane(&value)) => match entered {
                Entered::In(lane) => lane,
                Entered::Failing(name) => {
                    let why = format!("every slot of lane {name} is taken and its dependency is failing");
                    return Some(hand_back(shared, delivery, &why).await);
                }
            },
        };
        let slot = tokio::select! {
            _ = stop.cancelled(), if first => return None,
            slot = shared.slots.clone().acquire_owned() => slot.ok()?,
        };
        first = false;
        let result = handle_caught(&*shared.handler, &value, &shared.publisher).await;
        lane.record(&result);
        drop((lane, slot));
        let error = match result {
            Ok(outcome) => return Some(finish::succeeded(shared, delivery, outcome).await),
            Err(HandleError::Transient(error)) => error,
            Err(other) => return Some(finish::failed(shared, delivery, other).await),
        };
        let delay = delays
            .next()
            .unwrap_or(std::time::Duration::from_millis(400));
        if started.elapsed() + delay >= RETRY_BEFORE_HAND_BACK {
            return Some(hand_back(shared, delivery, &format!("{error:#}")).await);
        }
        tracing::warn!(
            error = format!("{error:#}"),
            ?delay,
            "transient failure; retrying"
        );
        metrics::counter!("prizepool_retries_total").increment(1);
        tokio::time::sleep(delay).await;
    }
}

/// Hands `delivery` back to the broker: a copy goes to its queue's retry
/// queue, and the original is acked once the copy is confirmed. Requeued
/// instead when the session no longer answers (the ack might be lost in
/// the close, and the copy would be a second request) or the copy could
/// not be published.
pub(super) async fn hand_back<H: Handler>(
    shared: &Shared<H>,
    delivery: &Delivery,
    why: &str,
) -> Ended {
    let route = shared.handler.route();
    let (retries, since) = handed_back(delivery);
    let failing = std::time::Duration::from_millis(unix_ms().saturating_sub(since));
    if failing < shared.config.transient_retry {
        tracing::warn!(
            error = why,
            retries,
            "a dependency is failing; handing the delivery back"
        );
    } else {
        tracing::error!(
            error = why,
            retries,
            ?failing,
            "a dependency is still failing; handing the delivery back"
        );
    }
    let gate = shared.groupers.closed.clone().read_owned().await;
    if *gate {
        return ("requeued", Settle::Requeue, None);
    }
    let copy = retry_message(delivery, route, retries + 1, since);
    match shared.publisher.publish(copy).await {
        Ok(()) => {
            metrics::counter!("prizepool_handed_back_total", "queue" => route.queue).increment(1);
            ("handed_back", Settle::Ack, Some(gate))
        }
        Err(error) => {
            tracing::error!(%error, "could not hand the delivery back; requeueing");
            ("requeued", Settle::Requeue, None)
        }
    }
}

/// How many times `delivery` was handed back before, and since when (unix
/// milliseconds) it has been failing: now for a first failure.
fn handed_back(delivery: &Delivery) -> (i64, u64) {
    let headers = delivery.properties.headers().as_ref();
    let number = |name: &str| match headers?.inner().get(name)? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        _ => None,
    };
    let retries = number(RETRIES_HEADER).unwrap_or(0).max(0);
    let since = number(FAILING_SINCE_HEADER)
        .and_then(|ms| u64::try_from(ms).ok())
        .unwrap_or_else(unix_ms);
    (retries, since)
}

/// The copy of `delivery` handed back through `route`'s retry queue: the
/// same body and properties, with the retry headers, and without an
/// `expiration` (an expired request would be dead-lettered; its answer is
/// stored for its requester whenever it comes).
fn retry_message(delivery: &Delivery, route: Route, retries: i64, since: u64) -> Outgoing {
    let properties = crate::amqp::publish::without_expiration(&delivery.properties);
    let mut headers: FieldTable = properties.headers().clone().unwrap_or_default();
    headers.insert(RETRIES_HEADER.into(), AMQPValue::LongLongInt(retries));
    headers.insert(
        FAILING_SINCE_HEADER.into(),
        AMQPValue::LongLongInt(i64::try_from(since).unwrap_or(i64::MAX)),
    );
    Outgoing {
        exchange: String::new(),
        routing_key: crate::amqp::retry_queue(route),
        body: delivery.data.clone(),
        properties: properties.with_headers(headers),
        mandatory: true,
    }
}

/// Now, in unix milliseconds.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How often a delivery waiting for a slot of its lane checks whether the
/// lane is failing.
const LANE_CHECK: std::time::Duration = std::time::Duration::from_millis(250);

/// The slots of each lane ([`Handler::lane`]): a lane holds at most half of
/// the worker's `CONCURRENCY` slots. While every slot of a lane is taken
/// and its last attempt failed transiently, a delivery of that lane is
/// handed back at once instead of waiting for one.
#[derive(Debug)]
pub(super) struct Lanes {
    share: usize,
    lanes: std::sync::Mutex<HashMap<&'static str, Arc<Lane>>>,
}

#[derive(Debug)]
struct Lane {
    slots: Arc<Semaphore>,
    /// Whether the lane's last attempt ended in a transient failure.
    failing: AtomicBool,
}

/// A delivery's way into its lane.
pub(super) enum Entered {
    /// In: a slot of the lane held (none for a delivery of no lane).
    In(InLane),
    /// The lane is full and failing: hand the delivery back.
    Failing(&'static str),
}

/// A slot of a lane, held while the handler runs.
pub(super) struct InLane(Option<(Arc<Lane>, OwnedSemaphorePermit)>);

impl InLane {
    /// Records how the lane's latest attempt ended.
    fn record(&self, result: &Result<Outcome, HandleError>) {
        if let Some((lane, _)) = &self.0 {
            let failing = matches!(result, Err(HandleError::Transient(_)));
            lane.failing.store(failing, Ordering::Relaxed);
        }
    }
}

impl Lanes {
    /// Lanes sharing a worker's `concurrency` slots.
    pub(super) fn new(concurrency: usize) -> Self {
        Self {
            share: (concurrency / 2).max(1),
            lanes: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Takes a slot of lane `name`: at once when one is free, after a wait
    /// while the lane works, never while it is full and failing.
    async fn enter(&self, name: Option<&'static str>) -> Entered {
        let Some(name) = name else {
            return Entered::In(InLane(None));
        };
        let lane = self
            .lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name)
            .or_insert_with(|| {
                Arc::new(Lane {
                    slots: Arc::new(Semaphore::new(self.share)),
                    failing: AtomicBool::new(false),
                })
            })
            .clone();
        // A lane that turns failing while a delivery waits for it hands
        // that delivery back too: checked every LANE_CHECK.
        let permit = loop {
            match lane.slots.clone().try_acquire_owned() {
                Ok(permit) => break permit,
                Err(_) if lane.failing.load(Ordering::Relaxed) => return Entered::Failing(name),
                Err(_) => {}
            }
            match tokio::time::timeout(LANE_CHECK, lane.slots.clone().acquire_owned()).await {
                Ok(Ok(permit)) => break permit,
                // The semaphore is never closed.
                Ok(Err(_)) => return Entered::In(InLane(None)),
                Err(_) => continue,
            }
        };
        Entered::In(InLane(Some((lane, permit))))
    }
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
        Ok(result) => crate::amqp::transient::settled(result),
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
    #[test]
    fn a_panic_message_is_kept() {
        let caught = std::panic::catch_unwind(|| panic!("boom {}", 7)).unwrap_err();
        assert_eq!(panic_message(&*caught), "boom 7");
        let caught = std::panic::catch_unwind(|| panic!("static")).unwrap_err();
        assert_eq!(panic_message(&*caught), "static");
    }

    #[tokio::test]
    async fn a_full_lane_hands_back_only_while_it_fails() {
        let lanes = Lanes::new(2);
        let Entered::In(held) = lanes.enter(Some("postgres")).await else {
            panic!("a free lane is entered");
        };
        // No lane: never limited.
        assert!(matches!(lanes.enter(None).await, Entered::In(_)));
        held.record(&Err(HandleError::Transient(anyhow::anyhow!("away"))));
        assert!(matches!(
            lanes.enter(Some("postgres")).await,
            Entered::Failing("postgres")
        ));
        // Another lane has slots of its own.
        assert!(matches!(lanes.enter(Some("other")).await, Entered::In(_)));
        held.record(&Ok(Outcome::default()));
        let waiting = tokio::spawn(async move {
            let lanes = lanes;
            matches!(lanes.enter(Some("postgres")).await, Entered::In(_))
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !waiting.is_finished(),
            "a working lane that is full is waited for"
        );
        drop(held);
        assert!(waiting.await.unwrap());
    }
}
