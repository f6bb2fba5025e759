//! Messages from concurrent deliveries, grouped into few broker messages.
//!
//! Some messages a delivery causes are small, many and alike (a ledger
//! entry per won draw, an event per draw), and each must be confirmed by the
//! broker before its delivery is acked. Publishing each as its own message
//! costs the broker a publish, a routing step and a confirm per delivery
//! (and, on a quorum queue, an enqueue, a delivery and an ack). Instead, a
//! worker's deliveries hand such bodies to the [`Grouper`] of their
//! [`Group`], which publishes whatever has gathered as one message (the
//! group's batch type) while earlier groups wait for their confirms, and
//! tells each delivery when its bodies are confirmed. Nothing waits on a
//! timer: under light load a group holds one body and goes out as a plain
//! message at once; under heavy load groups grow by themselves.
//!
//! This module knows bytes and routes only: which groups exist, and what
//! their bodies mean, is up to the workers that declare them
//! ([`super::Handler::groups`]).

use std::{collections::VecDeque, sync::Arc};

use futures_util::{stream::FuturesUnordered, StreamExt};
use tokio::{
    sync::{mpsc, oneshot},
    task::JoinHandle,
};
use tracing::Instrument;

use super::{publish::Outgoing, Publisher};

/// Groups published at once, at most, while earlier ones wait for their
/// confirms.
const GROUPS_IN_FLIGHT: usize = 2;

/// Bytes of bodies (each with its comma) a group's message holds at most.
/// With the batch's frame (`{"type":…,<field>:[…]}`, under 64 bytes for
/// every group) the message stays well within
/// [`MAX_MESSAGE_BYTES`](crate::messages::MAX_MESSAGE_BYTES).
const MAX_GROUP_BYTES: usize = 48 * 1024;

/// The largest body a group takes: one that goes out alone, as a plain
/// message, must fit the message limit itself.
pub const MAX_BODY_BYTES: usize = crate::messages::MAX_MESSAGE_BYTES;

/// Where a grouper's messages go, and how a group of several is wrapped:
/// `{"type":<batch_type>,<field>:[body,body,…]}`. A group is known by its
/// `batch_type`, which no other group of a worker shares.
#[derive(Clone, Copy, Debug)]
pub struct Group {
    pub routing_key: &'static str,
    pub batch_type: &'static str,
    pub field: &'static str,
    /// Builds the message for a group's body: a work message (unroutable is
    /// an error) or an event (may have no listener).
    message: fn(&str, Vec<u8>) -> Outgoing,
}

impl Group {
    /// Work messages for a queue bound under `routing_key` on
    /// [`super::EXCHANGE`]: a message nobody routes is an error.
    pub const fn work(
        routing_key: &'static str,
        batch_type: &'static str,
        field: &'static str,
    ) -> Self {
        Self {
            routing_key,
            batch_type,
            field,
            message: Outgoing::work_raw,
        }
    }

    /// Events under `routing_key` on [`super::EVENTS`], which may have no
    /// listener.
    pub const fn event(
        routing_key: &'static str,
        batch_type: &'static str,
        field: &'static str,
    ) -> Self {
        Self {
            routing_key,
            batch_type,
            field,
            message: Outgoing::event_raw,
        }
    }

    /// `body` as a message of its own, outside any group.
    pub fn single(&self, body: Vec<u8>) -> Outgoing {
        (self.message)(self.routing_key, body)
    }

    /// The message body of several serialised `bodies` taken together:
    /// `{"type":<batch_type>,<field>:[b1,b2,…]}`.
    pub fn batch<'a>(&self, bodies: impl IntoIterator<Item = &'a Vec<u8>>) -> Vec<u8> {
        let bodies: Vec<&Vec<u8>> = bodies.into_iter().collect();
        let bytes = bodies.iter().map(|b| b.len() + 1).sum();
        batch_body(self, bodies.into_iter(), bytes)
    }
}

type Confirmed = oneshot::Sender<Result<(), String>>;

/// Who waits for one delivery's bodies: told once every message that holds
/// one of them is confirmed (or one failed), when the last holder lets go.
/// A delivery's bodies may travel in several messages, and a message may
/// carry the bodies of several deliveries.
struct Waiter {
    done: Option<Confirmed>,
    /// The first failure of a message holding one of the bodies.
    failed: std::sync::Mutex<Option<String>>,
}

impl Waiter {
    fn new(done: Confirmed) -> Arc<Self> {
        Arc::new(Self {
            done: Some(done),
            failed: std::sync::Mutex::new(None),
        })
    }

    fn fail(&self, error: &str) {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| error.to_owned());
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let failed = self.failed.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = self.done.take() {
            let _ = done.send(failed.take().map_or(Ok(()), Err));
        }
    }
}

/// One delivery's serialised bodies not yet taken into a message, and who
/// waits for their confirm.
struct Pending {
    bodies: VecDeque<Vec<u8>>,
    waiter: Arc<Waiter>,
    /// The delivery's span: a group's message continues the trace of its
    /// first delivery (`telemetry`).
    span: tracing::Span,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("bodies", &self.bodies.len())
            .finish()
    }
}

/// One message of a group: its body, how many bodies it carries, the
/// deliveries waiting for it (each once) and the span it continues.
struct Taken {
    body: Vec<u8>,
    bodies: usize,
    waiters: Vec<Arc<Waiter>>,
    span: tracing::Span,
}

/// The handle deliveries share; cheap to clone.
#[derive(Debug, Clone)]
pub struct Grouper {
    tx: mpsc::UnboundedSender<Pending>,
}

impl Grouper {
    /// Starts the grouping task for `group` on `publisher`. It ends once
    /// every handle is dropped and what it holds is published.
    pub fn start(publisher: Publisher, group: Group) -> (Self, JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Self { tx },
            tokio::spawn(group_and_publish(publisher, group, rx)),
        )
    }

    /// Publishes `bodies` (serialised JSON objects, grouped with other
    /// deliveries' bodies, across as many messages as they need) and
    /// returns once the broker has confirmed every message holding one.
    /// A body that could not fit a message on its own is refused before
    /// anything is published: it is a producer's bug (every producer
    /// bounds its bodies), and the delivery fails instead of publishing a
    /// message its consumer would refuse.
    pub async fn publish(&self, bodies: Vec<Vec<u8>>) -> anyhow::Result<()> {
        if bodies.is_empty() {
            return Ok(());
        }
        if let Some(big) = bodies.iter().find(|b| b.len() > MAX_BODY_BYTES) {
            metrics::counter!("prizepool_oversized_bodies_total").increment(1);
            return Err(anyhow::anyhow!(
                "a grouped body of {} bytes cannot fit a message ({MAX_BODY_BYTES} at most)",
                big.len()
            ));
        }
        let (done, confirmed) = oneshot::channel();
        self.tx
            .send(Pending {
                bodies: bodies.into(),
                waiter: Waiter::new(done),
                span: tracing::Span::current(),
            })
            .map_err(|_| anyhow::anyhow!("the grouping publisher has stopped"))?;
        match confirmed.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(anyhow::anyhow!("publishing a group: {error}")),
            Err(_) => Err(anyhow::anyhow!("the grouping publisher has stopped")),
        }
    }
}

async fn group_and_publish(
    publisher: Publisher,
    group: Group,
    mut rx: mpsc::UnboundedReceiver<Pending>,
) {
    let mut waiting: VecDeque<Pending> = VecDeque::new();
    let mut in_flight = FuturesUnordered::new();
    let mut open = true;
    let mut received = Vec::with_capacity(256);
    loop {
        while in_flight.len() < GROUPS_IN_FLIGHT && !waiting.is_empty() {
            let taken = next_group(&group, &mut waiting);
            let publisher = publisher.clone();
            in_flight.push(async move {
                metrics::histogram!("prizepool_group_bodies", "type" => group.batch_type)
                    .record(taken.bodies as f64);
                let result = publisher
                    .publish(group.single(taken.body))
                    .instrument(taken.span)
                    .await;
                if let Err(error) = result {
                    let error = error.to_string();
                    for w in &taken.waiters {
                        w.fail(&error);
                    }
                }
                // Dropping the last holder of a waiter answers it.
                drop(taken.waiters);
            });
        }
        tokio::select! {
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
            n = rx.recv_many(&mut received, 1024), if open => {
                if n == 0 {
                    open = false;
                }
                waiting.extend(received.drain(..));
            }
            else => break,
        }
    }
}

/// Takes bodies from the front of `waiting`, in order, while they fit in
/// one message of at most [`MAX_GROUP_BYTES`] of bodies (the first body is
/// always taken: no body is larger than a message), and builds its body: a
/// lone body as it is, else the group's batch message. A delivery whose
/// bodies do not all fit stays at the front with the rest, which start the
/// next message: however many bodies one delivery has, no message grows
/// past the limit.
fn next_group(group: &Group, waiting: &mut VecDeque<Pending>) -> Taken {
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    let mut waiters: Vec<Arc<Waiter>> = Vec::new();
    let mut span = None;
    let mut bytes = 0;
    'fill: while let Some(front) = waiting.front_mut() {
        while let Some(next) = front.bodies.front() {
            if !bodies.is_empty() && bytes + next.len() + 1 > MAX_GROUP_BYTES {
                break 'fill;
            }
            bytes += next.len() + 1;
            bodies.extend(front.bodies.pop_front());
            span.get_or_insert_with(|| front.span.clone());
            if !waiters
                .last()
                .is_some_and(|w| Arc::ptr_eq(w, &front.waiter))
            {
                waiters.push(front.waiter.clone());
            }
        }
        waiting.pop_front();
    }
    let body = match bodies.len() {
        1 => bodies.pop().unwrap_or_default(),
        _ => batch_body(group, bodies.iter(), bytes),
    };
    Taken {
        body,
        bodies: bodies.len().max(1),
        waiters,
        span: span.unwrap_or_else(tracing::Span::none),
    }
}

/// `bodies` packed into as few messages of `group` as the limit allows, in
/// order, exactly as a grouper would send them if they came at once (a
/// lone body as it is, several as the group's batch). `None` when a body
/// could not fit any message.
pub fn pack(group: &Group, bodies: Vec<Vec<u8>>) -> Option<Vec<Vec<u8>>> {
    if bodies.iter().any(|b| b.len() > MAX_BODY_BYTES) {
        return None;
    }
    let mut waiting: VecDeque<Pending> = [Pending {
        bodies: bodies.into(),
        waiter: Waiter::new(oneshot::channel().0),
        span: tracing::Span::none(),
    }]
    .into();
    let mut messages = Vec::new();
    while !waiting.is_empty() {
        messages.push(next_group(group, &mut waiting).body);
    }
    Some(messages)
}

/// `{"type":<batch_type>,<field>:[b1,b2,…]}` from serialised bodies.
fn batch_body<'a>(
    group: &Group,
    bodies: impl Iterator<Item = &'a Vec<u8>>,
    bytes: usize,
) -> Vec<u8> {
    let mut body = Vec::with_capacity(bytes + 64);
    body.extend_from_slice(br#"{"type":""#);
    body.extend_from_slice(group.batch_type.as_bytes());
    body.extend_from_slice(br#"",""#);
    body.extend_from_slice(group.field.as_bytes());
    body.extend_from_slice(br#"":["#);
    for (i, b) in bodies.enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(b);
    }
    body.extend_from_slice(b"]}");
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Work messages `{"type":"thing","id":…}`, grouped as `thing.batch`.
    const THINGS: Group = Group::work("things", "thing.batch", "things");

    fn thing(id: &str) -> Vec<u8> {
        serde_json::to_vec(&json!({"type": "thing", "id": id, "size": 100})).unwrap()
    }

    /// A delivery's pending bodies, and the receiver told when they are
    /// confirmed.
    fn pending_with(bodies: Vec<Vec<u8>>) -> (Pending, oneshot::Receiver<Result<(), String>>) {
        let (done, confirmed) = oneshot::channel();
        let pending = Pending {
            bodies: bodies.into(),
            waiter: Waiter::new(done),
            span: tracing::Span::none(),
        };
        (pending, confirmed)
    }

    fn pending(ids: &[&str]) -> Pending {
        pending_with(ids.iter().map(|id| thing(id)).collect()).0
    }

    /// The ids in a group's body, whether a lone thing or a batch.
    fn decoded(body: &[u8]) -> Vec<String> {
        let value: serde_json::Value = serde_json::from_slice(body).unwrap();
        let id = |v: &serde_json::Value| v["id"].as_str().unwrap().to_owned();
        match value["type"].as_str() {
            Some("thing") => vec![id(&value)],
            Some("thing.batch") => value["things"].as_array().unwrap().iter().map(id).collect(),
            other => panic!("not a thing: {other:?}"),
        }
    }

    /// Every message `waiting` makes, in order.
    fn drain(group: &Group, mut waiting: VecDeque<Pending>) -> Vec<Taken> {
        let mut taken = Vec::new();
        while !waiting.is_empty() {
            taken.push(next_group(group, &mut waiting));
        }
        taken
    }

    #[test]
    fn a_single_body_goes_out_as_a_plain_message() {
        let mut waiting: VecDeque<Pending> = [pending(&["a"])].into();
        let taken = next_group(&THINGS, &mut waiting);
        assert_eq!(taken.waiters.len(), 1);
        assert_eq!(taken.body, thing("a"));
        assert_eq!(decoded(&taken.body), ["a"]);
    }

    /// Deliveries of 1 to 700 bodies (a `draw.batch` of many draws is one
    /// delivery), of every size up to the largest a group takes: every
    /// message fits the limit, and the bodies come out whole and in order.
    #[test]
    fn groups_keep_every_body_in_order_and_every_message_fits() {
        let mut ids = Vec::new();
        let mut waiting = VecDeque::new();
        let mut n = 0;
        for (i, bodies) in [1usize, 3, 700, 2, 250, 1, 1, 400].into_iter().enumerate() {
            let mut delivery = Vec::new();
            for _ in 0..bodies {
                // Ids of 8 to ~2,000 bytes of characters JSON escapes.
                let id = format!("{n:06}{}", "\"\\".repeat((n * 37 + i) % 1000));
                delivery.push(serde_json::to_vec(&json!({"type": "thing", "id": id})).unwrap());
                ids.push(id);
                n += 1;
            }
            waiting.push_back(pending_with(delivery).0);
        }
        // One body at the limit, alone.
        let id = "x".repeat(MAX_BODY_BYTES - r#"{"type":"thing","id":""}"#.len());
        let big = serde_json::to_vec(&json!({"type": "thing", "id": id})).unwrap();
        assert_eq!(big.len(), MAX_BODY_BYTES);
        waiting.push_back(pending_with(vec![thing("before"), big, thing("after")]).0);
        ids.extend(["before".to_owned(), id, "after".to_owned()]);
        let mut seen = Vec::new();
        let messages = drain(&THINGS, waiting);
        for taken in &messages {
            assert!(
                taken.body.len() <= crate::messages::MAX_MESSAGE_BYTES,
                "{} bytes",
                taken.body.len()
            );
            seen.extend(decoded(&taken.body));
        }
        assert_eq!(seen, ids);
        assert!(messages.len() > 20, "{} messages", messages.len());
    }

    /// A delivery whose bodies span several messages is told it is
    /// confirmed only once all of them are, and told of a failure of any.
    #[tokio::test]
    async fn a_delivery_split_across_messages_waits_for_all_of_them() {
        let many: Vec<Vec<u8>> = (0..3000).map(|i| thing(&format!("draw:{i:05}"))).collect();
        let (first, mut confirmed) = pending_with(many.clone());
        let (second, mut other) = pending_with(vec![thing("other")]);
        let mut messages = drain(&THINGS, [first, second].into());
        assert!(messages.len() >= 3, "{} messages", messages.len());
        // The second delivery shares the last message with the first.
        let last = messages.pop().unwrap();
        assert_eq!(last.waiters.len(), 2);
        for taken in messages {
            assert!(
                confirmed.try_recv().is_err(),
                "answered before its last message"
            );
            drop(taken.waiters);
        }
        assert!(confirmed.try_recv().is_err());
        // The last message is nacked: as the grouping task does, every
        // delivery it holds hears it.
        for w in &last.waiters {
            w.fail("nacked");
        }
        drop(last.waiters);
        assert_eq!(confirmed.await.unwrap(), Err("nacked".to_owned()));
        assert_eq!(other.try_recv().unwrap(), Err("nacked".to_owned()));
    }

    #[tokio::test]
    async fn a_body_too_big_for_any_message_is_refused_before_publishing() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let grouper = Grouper { tx };
        let big = vec![b' '; MAX_BODY_BYTES + 1];
        let error = grouper.publish(vec![thing("a"), big]).await.unwrap_err();
        assert!(error.to_string().contains("cannot fit"), "{error}");
        assert!(
            rx.try_recv().is_err(),
            "nothing was handed to the publisher"
        );
    }

    #[test]
    fn several_bodies_go_out_as_one_batch_that_keeps_each_body_whole() {
        let events: Vec<serde_json::Value> = (0..3)
            .map(|i| json!({"type": "thing.done", "request_id": format!("r{i}"), "reward": i}))
            .collect();
        let waiting: VecDeque<Pending> = events
            .iter()
            .map(|e| pending_with(vec![serde_json::to_vec(e).unwrap()]).0)
            .collect();
        let done = Group::event("thing.done", "thing.done.batch", "events");
        let mut messages = drain(&done, waiting);
        assert_eq!(messages.len(), 1);
        let taken = messages.pop().unwrap();
        assert_eq!(taken.waiters.len(), 3);
        assert_eq!(taken.bodies, 3);
        let value: serde_json::Value = serde_json::from_slice(&taken.body).unwrap();
        assert_eq!(value["type"], "thing.done.batch");
        assert_eq!(value["events"], serde_json::Value::Array(events.clone()));
        let bodies: Vec<Vec<u8>> = events
            .iter()
            .map(|e| serde_json::to_vec(e).unwrap())
            .collect();
        assert_eq!(done.batch(&bodies), taken.body);
    }
}
