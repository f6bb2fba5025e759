//! The ledger entries the fleet's workers publish: sealed, serialised once,
//! and sent grouped with other deliveries' entries to the settle queue.

use redis::aio::ConnectionLike;

use super::FleetSealer;
use crate::{
    amqp::{self, Group, HandleError, Outcome, Outgoing},
    config::Config,
    messages::SettleRequest,
};

/// Ledger entries: `settle` messages, grouped as `settle.batch` on the
/// settle queue. A worker that books entries declares it among its groups
/// ([`amqp::Handler::groups`]).
pub const ENTRIES: Group = Group::work(amqp::SETTLE.routing_key, "settle.batch", "entries");

/// What a request caused, its ledger entries not yet sealed: a worker's
/// steps build it, and its handler seals it into the consume loop's
/// [`Outcome`] ([`Unsealed::seal`]) once the request is handled.
#[derive(Debug, Default)]
pub struct Unsealed {
    /// The reply's JSON body, serialised.
    pub reply: Option<Vec<u8>>,
    /// Messages published, each on its own, before the reply.
    pub effects: Vec<Outgoing>,
    /// Serialised bodies of other groups ([`Outcome::grouped`]).
    pub grouped: Vec<(&'static Group, Vec<u8>)>,
    /// Ledger entries owed, published through [`ENTRIES`] once sealed.
    pub ledger: Vec<SettleRequest>,
}

impl Unsealed {
    /// The outcome with its ledger entries sealed by `sealer` (loaded
    /// through `conn` on first use) and serialised once each.
    pub async fn seal<C: ConnectionLike + Send>(
        self,
        sealer: &FleetSealer,
        conn: &mut C,
        config: &Config,
    ) -> Result<Outcome, HandleError> {
        let Self {
            reply,
            effects,
            mut grouped,
            ledger,
        } = self;
        for entry in sealer.seal_all(conn, config, ledger).await? {
            let body = serde_json::to_vec(&entry).map_err(|e| HandleError::Internal(e.into()))?;
            grouped.push((&ENTRIES, body));
        }
        Ok(Outcome {
            reply,
            effects,
            grouped,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{EntryRef, SettleMessage};

    fn entry(id: &str) -> Vec<u8> {
        serde_json::to_vec(&SettleRequest::fleet(
            id,
            42,
            "coin",
            100,
            "lucky_gift",
            EntryRef::pool("p"),
        ))
        .unwrap()
    }

    fn decoded(body: &[u8]) -> Vec<String> {
        let value = crate::messages::decode_envelope(body).unwrap();
        match SettleMessage::decode(&value).unwrap() {
            SettleMessage::One(e) => vec![e.entry_id],
            SettleMessage::Batch(es) => es.into_iter().map(|e| e.unwrap().entry_id).collect(),
        }
    }

    #[test]
    fn a_lone_entry_is_a_settle_message_and_several_a_settle_batch() {
        let one = ENTRIES.single(entry("a"));
        assert_eq!(one.routing_key, amqp::SETTLE.routing_key);
        let value: serde_json::Value = serde_json::from_slice(&one.body).unwrap();
        assert_eq!(value["type"], "settle");
        assert_eq!(decoded(&one.body), ["a"]);
        let bodies: Vec<Vec<u8>> = ["a", "b", "c"].iter().map(|id| entry(id)).collect();
        let batch = ENTRIES.batch(&bodies);
        let value: serde_json::Value = serde_json::from_slice(&batch).unwrap();
        assert_eq!(value["type"], "settle.batch");
        assert_eq!(decoded(&batch), ["a", "b", "c"]);
    }
}
