//! Red packets (SPEC §4): escrowed totals split into random shares, grabbed
//! once per user, refunded at expiry.
//!
//! Redis layout of packet `id` (hash tag `{id}`): `meta` (sender, total,
//! expires_at, grabbed, refunded, closed, `expiry`: the token of the one
//! pending expiry message, and `g:<user>`: the share each user holds, so a
//! grab reads and writes one hash), `shares` (list of `"<share>:<amount>"`),
//! `grabbed` (hash user → share, kept by packets stocked before the shares
//! moved into `meta`) and `rs` (the answer store,
//! [`crate::kinds::answer`]). Postgres keeps the packet, what its create
//! asked for, its shares and whether it was stocked in Redis, and the
//! creates refused for funds with what they asked; the
//! escrow, each grab and the refund are ledger entries, so at any moment
//! `escrowed = grabbed + refunded + still in the packet`.
//!
//! Nobody who publishes is trusted:
//! - a `packet_id` is bound to its first create: the same content again
//!   replays the first answer (a refusal for funds included, whatever the
//!   sender holds by then), other content (sender, total, count, min,
//!   expires_in_s, asset) or an id that names a lucky-gift pool or lottery
//!   activity is refused as bad input and moves nothing;
//! - a packet is stocked in Redis once: a create sent again never stocks it
//!   again once its first stocking is recorded, even if Redis lost it (then
//!   the escrow waits for an operator, see docs/design.md);
//! - every number is bounded ([`split`]: total ≤ 10^12, count ≤ 5,000,
//!   `min × count ≤ total`; `expires_in_s` ≤ [`MAX_EXPIRES_IN_S`]), so all
//!   arithmetic, Lua's included, is exact;
//! - a `redpacket.expire` closes a packet only at or after the packet's own
//!   stored expiry, whatever the message claims (the close step in Lua checks
//!   it again); an early one is answered `"closed": false` with the stored
//!   `expires_at`, and delayed again to it only if it is the packet's one
//!   pending expiry ([`pending_expiry`]); one for an unknown id is refused;
//! - the stored expiry is a whole second (the create's instant plus
//!   `expires_in_s`, rounded up), so the `expires_at` a create answers is
//!   exactly the instant from which grabs are refused.
//!
//! # Races and ordering
//!
//! - **Concurrent grabs.** A grab is one Lua step (`lua/grab_red_packet.lua`)
//!   that checks the packet is open, that the user holds no share, pops one
//!   share and records it, so a share goes to one user, a user gets at most
//!   one share, and the grabs past the last share are `sold_out`, whatever
//!   the number of workers grabbing at once.
//! - **A grab racing the close.** The close is one Lua step too: it removes
//!   the shares left and records their sum as refunded in the step that sets
//!   `closed`. A grab runs wholly before it (its share is grabbed, not
//!   refunded) or wholly after it (`pool_closed`): every share is grabbed or
//!   refunded, never both. The grab checks the packet's own `expires_at`
//!   itself, so a late expiry message lets nobody grab after the deadline.
//! - **Concurrent creates of one id.** The id's row in Postgres serialises
//!   them ([`create`]): one escrows, the others wait for its transaction and
//!   then compare themselves with what it asked.
//! - **A worker killed mid-create.** The escrow, the shares and the request
//!   are committed in Postgres before anything is stocked in Redis; stocking
//!   is idempotent (`lua/stock_red_packet.lua` stocks an id once) and is
//!   recorded afterwards, so the redelivered create stocks a packet its
//!   first attempt left unstocked, and never stocks one twice.
//! - **A retry of a grab, or a worker killed before publishing it.** The
//!   grab's answer is stored with its effect; the redelivery replays it and
//!   publishes the same ledger entry (one id per packet and user), which the
//!   ledger applies once.
//! - **A worker killed mid-close.** The Redis close comes first, then the
//!   Postgres record ([`record_closed`]); whoever records the close first
//!   announces it, so a redelivered expiry finds the packet closed in Redis,
//!   records it and sends the refund and the event the first attempt did
//!   not. The refund's entry id is the packet's, so it is paid once.
//!
//! Retention: closing a packet sets an expiry of [`CLOSED_RETENTION_S`]
//! (7 days) on its `meta` and `grabbed` keys (`shares` is deleted at close,
//! answers expire with their bucket of the answer store). After that a grab answers
//! `unknown_pool`; Postgres keeps the packet for good, so a replayed create
//! still answers as first created and stocks nothing again.

mod close;
mod create;
pub mod fair;
mod grab;
mod kind;
pub mod lifecycle;
mod names;
pub mod reasons;
pub mod scripts;
pub mod split;
mod stored;

pub use close::{
    arm_expiry, close, closed_event, ledger_ref, pending_expiry, record_closed, refund_entry,
    Close, Expiry,
};
pub use create::{create, validate, whole_second_from, CreateError, Created};
pub use grab::grab;
pub(crate) use grab::grab_call;
pub use kind::{RedPacket, RED_PACKET};
pub use stored::{stored, Stored};

use crate::kinds::red_packet::scripts as lua;
use close::parse_share;
#[cfg(test)]
use create::Refused;

use redis::aio::ConnectionLike;
use serde::Serialize;

use crate::scripts::PoolKeys;

/// The red-packet replies and events, wire types of [`crate::messages`].
pub use crate::messages::{wire_time, ClosedEvent, CreatedReply, ExpireReply, RejectedReply};

pub use names::{
    CLOSED_EVENT, CLOSED_RETENTION_S, CREATED_EVENT, EXPIRE_TYPE, KIND, MAX_EXPIRES_IN_S,
    RESULT_TYPE,
};

/// A reply or event as the JSON bytes the wire carries.
pub fn encode(value: &impl Serialize) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(value)
}

/// A packet's counters, for checks and operators.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PacketStatus {
    pub total: i64,
    pub grabbed: i64,
    pub grabbed_count: i64,
    pub refunded: i64,
    pub in_packet: i64,
    pub shares_left: usize,
    pub closed: bool,
}

/// Reads a packet's counters in one atomic snapshot (a Lua step, which a
/// Redis Cluster runs on the packet's node like any other).
pub async fn status<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
) -> Result<Option<PacketStatus>, redis::RedisError> {
    let reply: Vec<redis::Value> = lua::STATUS
        .key(keys.meta())
        .key(keys.shares())
        .invoke_async(conn)
        .await?;
    let mut it = reply.into_iter();
    // The next field of the reply, or `None` if it is missing, nil or not a `T`.
    fn field<T: redis::FromRedisValue>(it: &mut impl Iterator<Item = redis::Value>) -> Option<T> {
        it.next().and_then(|v| redis::from_redis_value(v).ok())
    }
    let kind: Option<String> = field(&mut it);
    let [total, grabbed, count, refunded] = [(); 4].map(|()| field::<i64>(&mut it).unwrap_or(0));
    let closed: Option<String> = field(&mut it);
    let shares: Vec<String> = it.filter_map(|v| redis::from_redis_value(v).ok()).collect();
    if kind.as_deref() != Some(KIND) {
        return Ok(None);
    }
    Ok(Some(PacketStatus {
        total,
        grabbed,
        grabbed_count: count,
        refunded,
        in_packet: shares
            .iter()
            .filter_map(|s| parse_share(s))
            .map(|(_, a)| a)
            .sum(),
        shares_left: shares.len(),
        closed: closed.as_deref() == Some("1"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{ErrorCode, RedPacketCreate};
    use chrono::{DateTime, Utc};

    fn request() -> RedPacketCreate {
        RedPacketCreate {
            packet_id: "rp-1".into(),
            sender: 7,
            total: 10_000,
            count: 10,
            min: 0,
            expires_in_s: 3600,
            asset: "coin".into(),
        }
    }

    fn stored_as(req: &RedPacketCreate) -> Stored {
        Stored {
            sender: req.sender,
            asset: req.asset.clone(),
            total: req.total,
            count: req.count,
            min_share: split::floor(req.min),
            min_asked: Some(req.min),
            expires_in_s: Some(req.expires_in_s),
            expires_at: Utc::now(),
            refunded: None,
            stocked: true,
            commitment: None,
        }
    }

    #[test]
    fn every_asked_field_binds_the_id() {
        let first = request();
        let stored = stored_as(&first);
        assert!(stored.differences(&first).is_empty());
        type Change = fn(&mut RedPacketCreate);
        let changes: [(&str, Change); 6] = [
            ("sender", |r| r.sender = 8),
            ("asset", |r| r.asset = "gem".into()),
            ("total", |r| r.total += 1),
            ("count", |r| r.count += 1),
            ("min", |r| r.min = 1),
            ("expires_in_s", |r| r.expires_in_s += 1),
        ];
        for (field, change) in changes {
            let mut other = first.clone();
            change(&mut other);
            assert_eq!(stored.differences(&other), vec![field]);
        }
        // A packet stored before `min` and `expires_in_s` were kept is
        // compared on what it has: the smallest share it hands out.
        let old = Stored {
            min_asked: None,
            expires_in_s: None,
            ..stored
        };
        let mut other = first.clone();
        other.min = 1;
        other.expires_in_s = 60;
        assert!(old.differences(&other).is_empty());
        other.min = 2;
        assert_eq!(old.differences(&other), vec!["min"]);
    }

    #[test]
    fn a_refusal_binds_its_id_to_what_it_asked() {
        let first = request();
        let refused = Refused {
            sender: first.sender,
            asset: first.asset.clone(),
            total: first.total,
            count: first.count,
            min: first.min,
            expires_in_s: first.expires_in_s,
            balance: 5,
        };
        let again = refused.clone().replay(&first);
        assert!(
            matches!(
                again,
                CreateError::InsufficientFunds {
                    balance: 5,
                    total: 10_000,
                    ..
                }
            ),
            "{again:?}"
        );
        for change in [
            |r: &mut RedPacketCreate| r.sender = 8,
            |r: &mut RedPacketCreate| r.asset = "gem".into(),
            |r: &mut RedPacketCreate| r.total -= 1,
            |r: &mut RedPacketCreate| r.count += 1,
            |r: &mut RedPacketCreate| r.min = 1,
            |r: &mut RedPacketCreate| r.expires_in_s += 1,
        ] {
            let mut other = first.clone();
            change(&mut other);
            let answer = refused.clone().replay(&other);
            assert!(matches!(answer, CreateError::Invalid(_)), "{answer:?}");
        }
    }

    #[test]
    fn expiries_are_whole_seconds_never_earlier() {
        let at = DateTime::from_timestamp(1_795_000_000, 1).unwrap_or_default();
        assert_eq!(
            whole_second_from(at),
            DateTime::from_timestamp(1_795_000_001, 0).unwrap_or_default()
        );
        let whole = DateTime::from_timestamp(1_795_000_000, 0).unwrap_or_default();
        assert_eq!(whole_second_from(whole), whole);
        assert_eq!(wire_time(whole_second_from(at)), "2026-11-18T11:06:41Z");
    }

    #[test]
    fn replies_keep_the_wire_shapes() {
        let created = Created {
            packet_id: "rp-1".into(),
            count: 10,
            total: 10_000,
            expires_at: DateTime::from_timestamp(1_795_000_000, 123_000_000).unwrap_or_default(),
            commitment: Some("ab".repeat(32)),
            closed: false,
        };
        let reply = serde_json::to_value(created.reply()).unwrap_or_default();
        assert_eq!(
            reply,
            serde_json::json!({"type": "redpacket_result", "packet_id": "rp-1", "status": "ok",
                               "count": 10, "total": 10_000, "expires_at": "2026-11-18T11:06:40Z",
                               "commitment": "ab".repeat(32)})
        );
        let event = serde_json::to_value(created.event()).unwrap_or_default();
        assert_eq!(event["type"], "redpacket.created");
        let rejected = RejectedReply::new("rp-1", ErrorCode::InsufficientFunds, "short".into());
        assert_eq!(
            serde_json::to_value(rejected).unwrap_or_default(),
            serde_json::json!({"type": "redpacket_result", "packet_id": "rp-1", "status": "rejected",
                               "error": {"code": "insufficient_funds", "message": "short"}})
        );
        assert_eq!(
            serde_json::to_value(ExpireReply::closed("rp-1", 5)).unwrap_or_default(),
            serde_json::json!({"type": "redpacket_result", "packet_id": "rp-1", "status": "ok",
                               "closed": true, "refunded": 5})
        );
        assert_eq!(
            serde_json::to_value(closed_event("rp-1", 5, None)).unwrap_or_default(),
            serde_json::json!({"type": "redpacket.closed", "packet_id": "rp-1", "refunded": 5})
        );
        let reveal = fair::Reveal {
            salt: "00".repeat(16),
            shares: vec![3, 2],
        };
        assert_eq!(
            serde_json::to_value(closed_event("rp-1", 0, Some(reveal))).unwrap_or_default(),
            serde_json::json!({"type": "redpacket.closed", "packet_id": "rp-1", "refunded": 0,
                               "salt": "00".repeat(16), "shares": [3, 2]})
        );
    }
}
