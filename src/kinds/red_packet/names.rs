//! The red-packet kind's names and limits, which its steps share.

/// Kind label stored in `meta.kind` and in the pool registry.
pub const KIND: &str = "red_packet";
/// Longest lifetime of a packet: 30 days.
pub const MAX_EXPIRES_IN_S: i64 = 30 * 24 * 3600;
/// How long a closed packet's Redis keys are kept: 7 days.
pub const CLOSED_RETENTION_S: u64 = 7 * 24 * 3600;
/// `type` of every red-packet reply.
pub const RESULT_TYPE: &str = crate::messages::REDPACKET_RESULT;
/// `type` (and routing key) of the event of a created packet.
pub const CREATED_EVENT: &str = crate::messages::REDPACKET_CREATED;
/// `type` (and routing key) of the event of a closed packet.
pub const CLOSED_EVENT: &str = crate::messages::REDPACKET_CLOSED;
/// `type` of the expiry message the refill worker sends itself.
pub const EXPIRE_TYPE: &str = "redpacket.expire";
