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

use std::collections::VecDeque;

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

/// Body size a group stays under (messages are capped at 64 KiB).
const MAX_GROUP_BYTES: usize = 48 * 1024;

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

/// One delivery's serialised bodies, and who waits for their confirm.
struct Pending {
    bodies: Vec<Vec<u8>>,
    done: Confirmed,
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

    /// Publishes `bodies` (serialised JSON objects, in one group with other
    /// deliveries' bodies) and returns once the broker has confirmed them.
    pub async fn publish(&self, bodies: Vec<Vec<u8>>) -> anyhow::Result<()> {
        if bodies.is_empty() {
            return Ok(());
        }
        let (done, confirmed) = oneshot::channel();
        self.tx
            .send(Pending {
                bodies,
                done,
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
            let (body, waiters) = next_group(&group, &mut waiting);
            let publisher = publisher.clone();
            let span = waiters
                .first()
                .map_or_else(tracing::Span::none, |w| w.span.clone());
            in_flight.push(async move {
                metrics::histogram!("prizepool_group_bodies", "type" => group.batch_type).record(
                    waiters
                        .iter()
                        .map(|w: &Pending| w.bodies.len())
                        .sum::<usize>() as f64,
                );
                let result = publisher
                    .publish(group.single(body))
                    .instrument(span)
                    .await
                    .map_err(|e| e.to_string());
                for w in waiters {
                    let _ = w.done.send(result.clone());
                }
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

/// Takes deliveries from the front of `waiting` while their bodies fit in
/// one message, and builds its body: a lone body as it is, else the group's
/// batch message.
fn next_group(group: &Group, waiting: &mut VecDeque<Pending>) -> (Vec<u8>, Vec<Pending>) {
    let mut taken = Vec::new();
    let mut bytes = 0;
    while let Some(next) = waiting.front() {
        let size: usize = next.bodies.iter().map(|e| e.len() + 1).sum();
        if !taken.is_empty() && bytes + size > MAX_GROUP_BYTES {
            break;
        }
        bytes += size;
        taken.extend(waiting.pop_front());
    }
    let mut bodies = taken.iter().flat_map(|p| p.bodies.iter());
    let body = match (bodies.next(), bodies.next()) {
        (Some(only), None) => only.clone(),
        _ => batch_body(group, taken.iter().flat_map(|p| p.bodies.iter()), bytes),
    };
    (body, taken)
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

    fn pending(ids: &[&str]) -> Pending {
        Pending {
            bodies: ids.iter().map(|id| thing(id)).collect(),
            done: oneshot::channel().0,
            span: tracing::Span::none(),
        }
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

    #[test]
    fn a_single_body_goes_out_as_a_plain_message() {
        let mut waiting: VecDeque<Pending> = [pending(&["a"])].into();
        let (body, group) = next_group(&THINGS, &mut waiting);
        assert_eq!(group.len(), 1);
        assert_eq!(body, thing("a"));
        assert_eq!(decoded(&body), ["a"]);
    }

    #[test]
    fn groups_keep_every_body_in_order_and_stay_under_the_size_cap() {
        let ids: Vec<String> = (0..2000).map(|i| format!("draw:{i:05}")).collect();
        let mut waiting: VecDeque<Pending> = ids
            .chunks(3)
            .map(|c| pending(&c.iter().map(String::as_str).collect::<Vec<_>>()))
            .collect();
        let mut seen = Vec::new();
        let mut groups = 0;
        while !waiting.is_empty() {
            let (body, group) = next_group(&THINGS, &mut waiting);
            assert!(!group.is_empty());
            assert!(body.len() <= MAX_GROUP_BYTES + 64, "{} bytes", body.len());
            seen.extend(decoded(&body));
            groups += 1;
        }
        assert_eq!(seen, ids);
        assert!(groups > 1, "2,000 bodies cannot fit one message");
    }

    #[test]
    fn several_bodies_go_out_as_one_batch_that_keeps_each_body_whole() {
        let events: Vec<serde_json::Value> = (0..3)
            .map(|i| json!({"type": "thing.done", "request_id": format!("r{i}"), "reward": i}))
            .collect();
        let mut waiting: VecDeque<Pending> = events
            .iter()
            .map(|e| Pending {
                bodies: vec![serde_json::to_vec(e).unwrap()],
                done: oneshot::channel().0,
                span: tracing::Span::none(),
            })
            .collect();
        let done = Group::event("thing.done", "thing.done.batch", "events");
        let (body, group) = next_group(&done, &mut waiting);
        assert_eq!(group.len(), 3);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["type"], "thing.done.batch");
        assert_eq!(value["events"], serde_json::Value::Array(events));
        let bodies: Vec<Vec<u8>> = group.into_iter().flat_map(|p| p.bodies).collect();
        assert_eq!(done.batch(&bodies), body);
    }
}
