//! Delivery: one message from its arrival to how it is settled.
//!
//! A delivery is decoded, takes a slot of its lane (see [`super::lanes::Lanes`]), and is
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

use std::{panic::AssertUnwindSafe, time::Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::FutureExt;
use lapin::message::Delivery;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{info_span, Instrument};

use super::{
    finish::{self, hand_back},
    lanes::Entered,
    shared::{Ended, Replied, Shared},
    HandleError, Handler, Outcome, Publisher, Settle,
};
use crate::messages::{self, Invalid};

/// How long a transient failure is retried before the delivery
/// is handed back.
pub(crate) const RETRY_BEFORE_HAND_BACK: std::time::Duration =
    std::time::Duration::from_millis(500);

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
    let envelope = shared.handler.envelope(&delivery.data);
    let span = delivery_span(&*shared.handler, &delivery, &envelope);
    async move {
        let (label, how, replied) = match envelope {
            Err(invalid) => finish::failed(shared, &delivery, HandleError::Invalid(invalid)).await,
            Ok(value) => handled(shared, &delivery, value, stop).await?,
        };
        metrics::counter!("prizepool_messages_total", "queue" => route.queue, "outcome" => label)
            .increment(1);
        if label != "handed_back" {
            shared.health.answered();
        }
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
        let held = super::lent::Held::new(slot);
        let result = held
            .clone()
            .scope(handle_caught(
                &*shared.handler,
                &delivery.data,
                &value,
                &shared.publisher,
            ))
            .await;
        lane.record(&result);
        drop((lane, held));
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
    body: &[u8],
    value: &Value,
    publisher: &Publisher,
) -> Result<Outcome, HandleError> {
    // Unwind safety: the handler shares nothing with this task that a
    // half-finished call could leave inconsistent for the next delivery
    // other than through Redis and Postgres, whose steps are atomic.
    match AssertUnwindSafe(handler.handle_body(body, value, publisher))
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
}
