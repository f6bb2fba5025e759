//! The red-packet messages: `redpacket.create`, `redpacket.expire`, their
//! `redpacket_result` replies and the `redpacket.created` and
//! `redpacket.closed` events.

use serde::{Deserialize, Serialize};

use super::{ErrorBody, ErrorCode, Status};

/// `{"type":"redpacket.create", ...}`: escrow `total` from `sender` and split
/// it into `count` shares of at least `min`, grabbable for `expires_in_s`.
/// Idempotent by `packet_id`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedPacketCreate {
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[!-z|~]+$"))]
    pub packet_id: String,
    #[schemars(range(min = 0))]
    pub sender: i64,
    #[schemars(range(min = 1, max = 1_000_000_000_000i64))]
    pub total: i64,
    #[schemars(range(min = 1, max = 5_000))]
    pub count: i64,
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub min: i64,
    #[schemars(range(min = 1, max = 2_592_000))]
    pub expires_in_s: i64,
    #[serde(default = "default_asset")]
    pub asset: String,
}

fn default_asset() -> String {
    "coin".into()
}

/// `{"type":"redpacket.expire", ...}`: close the packet if its time has come
/// (sent by the refill worker to itself through the delay queues).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedPacketExpire {
    pub packet_id: String,
    /// When the packet expires (informative: the packet's stored expiry
    /// decides).
    #[serde(default)]
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Which expiry message this is: an early one is delayed again only if
    /// its packet names it as its one pending expiry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}
/// `type` of every red-packet reply.
pub const REDPACKET_RESULT: &str = "redpacket_result";
/// `type` (and routing key) of the event of a created red packet.
pub const REDPACKET_CREATED: &str = "redpacket.created";
/// `type` (and routing key) of the event of a closed red packet.
pub const REDPACKET_CLOSED: &str = "redpacket.closed";

/// A time as the wire carries it: RFC 3339, whole seconds, `Z`.
pub fn wire_time(at: chrono::DateTime<chrono::Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// `{"type":"redpacket_result", ...}`: the answer to a `redpacket.create`,
/// and with `type` `redpacket.created` its event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct CreatedReply {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub packet_id: String,
    pub status: Status,
    pub count: i64,
    pub total: i64,
    pub expires_at: String,
    /// SHA-256 of the packet's split and salt, fixed before the first grab
    /// (`docs/fairness.md`); absent for a packet created before packets
    /// committed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commitment: Option<String>,
}

/// A refused red-packet request's `redpacket_result`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct RejectedReply {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub packet_id: String,
    pub status: Status,
    pub error: ErrorBody,
}

impl RejectedReply {
    /// A refusal of packet `packet_id` with `code`.
    pub fn new(packet_id: &str, code: ErrorCode, message: String) -> Self {
        Self {
            kind: REDPACKET_RESULT,
            packet_id: packet_id.to_owned(),
            status: Status::Rejected,
            error: ErrorBody { code, message },
        }
    }
}

/// The `redpacket_result` answer to a `redpacket.expire`: closed with its
/// refund, or still open until its stored `expires_at`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct ExpireReply {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub packet_id: String,
    pub status: Status,
    pub closed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refunded: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
}

impl ExpireReply {
    /// The packet is closed and `refunded` went back to the sender.
    pub fn closed(packet_id: &str, refunded: i64) -> Self {
        Self {
            kind: REDPACKET_RESULT,
            packet_id: packet_id.to_owned(),
            status: Status::Ok,
            closed: true,
            refunded: Some(refunded),
            expires_at: None,
        }
    }

    /// The packet stays open until `expires_at`.
    pub fn open_until(packet_id: &str, expires_at: chrono::DateTime<chrono::Utc>) -> Self {
        Self {
            kind: REDPACKET_RESULT,
            packet_id: packet_id.to_owned(),
            status: Status::Ok,
            closed: false,
            refunded: None,
            expires_at: Some(wire_time(expires_at)),
        }
    }
}

/// `{"type":"redpacket.closed", ...}` (event): a packet closed, its rest
/// refunded, its split revealed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct ClosedEvent {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub packet_id: String,
    pub refunded: i64,
    /// The revealed salt of the packet's commitment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub salt: Option<String>,
    /// The revealed split, in share order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shares: Option<Vec<i64>>,
}

impl ClosedEvent {
    /// Packet `packet_id` closed, refunding `refunded`, revealing nothing.
    pub fn new(packet_id: &str, refunded: i64) -> Self {
        Self {
            kind: REDPACKET_CLOSED,
            packet_id: packet_id.to_owned(),
            refunded,
            salt: None,
            shares: None,
        }
    }
}
