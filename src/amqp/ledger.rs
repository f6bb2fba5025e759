//! Ledger entries from concurrent deliveries, grouped into few messages.
//!
//! Every draw that wins something owes the ledger one entry, and the entry
//! must be confirmed by the broker before the draw is acked. Publishing each
//! entry as its own message costs the broker a quorum-queue enqueue, a
//! delivery and an ack per draw. Instead, a worker's deliveries hand their
//! entries to one [`LedgerPublisher`], which publishes whatever has gathered
//! as one `settle.batch` message while earlier groups wait for their
//! confirms, and tells each delivery when its entries are confirmed. Nothing
//! waits on a timer: under light load a group holds one entry and goes out as
//! a plain `settle` message at once; under heavy load groups grow by
//! themselves.

use std::collections::VecDeque;

use futures_util::{stream::FuturesUnordered, StreamExt};
use tokio::{
    sync::{mpsc, oneshot},
    task::JoinHandle,
};

use super::{publish::Outgoing, Publisher, SETTLE};
use crate::messages::SettleRequest;

/// Groups of entries published at once, at most, while earlier ones wait for
/// their confirms.
const GROUPS_IN_FLIGHT: usize = 2;

/// Body size a group stays under (messages are capped at 64 KiB).
const MAX_GROUP_BYTES: usize = 48 * 1024;

type Confirmed = oneshot::Sender<Result<(), String>>;

/// One delivery's entries, serialised, and who waits for their confirm.
struct Pending {
    entries: Vec<Vec<u8>>,
    done: Confirmed,
}

/// The handle deliveries share; cheap to clone.
#[derive(Debug, Clone)]
pub struct LedgerPublisher {
    tx: mpsc::UnboundedSender<Pending>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("entries", &self.entries.len())
            .finish()
    }
}

impl LedgerPublisher {
    /// Starts the grouping task on `publisher`. It ends once every handle is
    /// dropped and what it holds is published.
    pub fn start(publisher: Publisher) -> (Self, JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx }, tokio::spawn(group_and_publish(publisher, rx)))
    }

    /// Publishes `entries` (in one group with other deliveries' entries) and
    /// returns once the broker has confirmed them.
    pub async fn settle(&self, entries: &[SettleRequest]) -> anyhow::Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let entries = entries
            .iter()
            .map(serde_json::to_vec)
            .collect::<Result<Vec<_>, _>>()?;
        let (done, confirmed) = oneshot::channel();
        self.tx
            .send(Pending { entries, done })
            .map_err(|_| anyhow::anyhow!("the ledger publisher has stopped"))?;
        match confirmed.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(anyhow::anyhow!("publishing ledger entries: {error}")),
            Err(_) => Err(anyhow::anyhow!("the ledger publisher has stopped")),
        }
    }
}

async fn group_and_publish(publisher: Publisher, mut rx: mpsc::UnboundedReceiver<Pending>) {
    let mut waiting: VecDeque<Pending> = VecDeque::new();
    let mut in_flight = FuturesUnordered::new();
    let mut open = true;
    let mut received = Vec::with_capacity(256);
    loop {
        while in_flight.len() < GROUPS_IN_FLIGHT && !waiting.is_empty() {
            let (body, waiters) = next_group(&mut waiting);
            let publisher = publisher.clone();
            in_flight.push(async move {
                metrics::histogram!("prizepool_ledger_group_entries").record(
                    waiters
                        .iter()
                        .map(|w: &Pending| w.entries.len())
                        .sum::<usize>() as f64,
                );
                let result = publisher
                    .publish(Outgoing::work_raw(SETTLE.routing_key, body))
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

/// Takes deliveries from the front of `waiting` while their entries fit in
/// one message, and builds its body: a plain `settle` message for a single
/// entry, else `{"type":"settle.batch","entries":[…]}`.
fn next_group(waiting: &mut VecDeque<Pending>) -> (Vec<u8>, Vec<Pending>) {
    let mut group = Vec::new();
    let mut bytes = 0;
    while let Some(next) = waiting.front() {
        let size: usize = next.entries.iter().map(|e| e.len() + 1).sum();
        if !group.is_empty() && bytes + size > MAX_GROUP_BYTES {
            break;
        }
        bytes += size;
        group.extend(waiting.pop_front());
    }
    let mut entries = group.iter().flat_map(|p| p.entries.iter());
    let body = match (entries.next(), entries.next()) {
        (Some(only), None) => only.clone(),
        _ => batch_body(group.iter().flat_map(|p| p.entries.iter()), bytes),
    };
    (body, group)
}

/// `{"type":"settle.batch","entries":[e1,e2,…]}` from serialised entries.
fn batch_body<'a>(entries: impl Iterator<Item = &'a Vec<u8>>, bytes: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(bytes + 40);
    body.extend_from_slice(br#"{"type":"settle.batch","entries":["#);
    for (i, e) in entries.enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(e);
    }
    body.extend_from_slice(b"]}");
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{SettleMessage, SettleRequest};
    use serde_json::json;

    fn pending(ids: &[&str]) -> (Pending, oneshot::Receiver<Result<(), String>>) {
        let (done, rx) = oneshot::channel();
        let entries = ids
            .iter()
            .map(|id| {
                serde_json::to_vec(&SettleRequest::new(
                    *id,
                    42,
                    "coin",
                    100,
                    "lucky_gift",
                    json!({"pool": "p"}),
                ))
                .unwrap()
            })
            .collect();
        (Pending { entries, done }, rx)
    }

    fn decoded(body: &[u8]) -> Vec<String> {
        let value = crate::messages::decode_envelope(body).unwrap();
        match SettleMessage::decode(&value).unwrap() {
            SettleMessage::One(e) => vec![e.entry_id],
            SettleMessage::Batch(es) => es.into_iter().map(|e| e.unwrap().entry_id).collect(),
        }
    }

    #[test]
    fn a_single_entry_goes_out_as_a_plain_settle_message() {
        let mut waiting: VecDeque<Pending> = [pending(&["a"]).0].into();
        let (body, group) = next_group(&mut waiting);
        assert_eq!(group.len(), 1);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["type"], "settle");
        assert_eq!(decoded(&body), ["a"]);
    }

    #[test]
    fn groups_keep_every_entry_in_order_and_stay_under_the_size_cap() {
        let ids: Vec<String> = (0..2000).map(|i| format!("draw:{i:05}")).collect();
        let mut waiting: VecDeque<Pending> = ids
            .chunks(3)
            .map(|c| pending(&c.iter().map(String::as_str).collect::<Vec<_>>()).0)
            .collect();
        let mut seen = Vec::new();
        let mut groups = 0;
        while !waiting.is_empty() {
            let (body, group) = next_group(&mut waiting);
            assert!(!group.is_empty());
            assert!(body.len() <= MAX_GROUP_BYTES + 64, "{} bytes", body.len());
            seen.extend(decoded(&body));
            groups += 1;
        }
        assert_eq!(seen, ids);
        assert!(groups > 1, "2,000 entries cannot fit one message");
    }
}
