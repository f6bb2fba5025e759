//! A packet's expiry and close: the one pending expiry message, the Redis
//! close that ends grabs, the Postgres record of it, the refund and the
//! `redpacket.closed` event.

use crate::kinds::red_packet::scripts as lua;
use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use sqlx::PgPool;

use super::{fair, names::CLOSED_RETENTION_S};
use crate::messages::ClosedEvent;
use crate::{
    messages::{EntryRef, SettleRequest},
    scripts::PoolKeys,
};

/// The `ref` of a packet's ledger entries.
pub fn ledger_ref(packet_id: &str) -> EntryRef {
    EntryRef::pool(packet_id)
}

/// The refund of what was left in a closed packet, as a ledger entry whose
/// id makes it apply once however often it is sent.
pub fn refund_entry(packet_id: &str, sender: i64, asset: &str, amount: i64) -> SettleRequest {
    SettleRequest::fleet(
        format!("{}:{packet_id}:refund", super::reasons::ENTRY_IDS),
        sender,
        asset,
        amount,
        "red_packet_refund",
        ledger_ref(packet_id),
    )
}

/// Where a packet's expiry stands in Redis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// The expiry message with this token is the packet's pending one.
    Pending(String),
    /// Another expiry message is the pending one.
    Stale,
    /// The packet is closed in Redis.
    Closed,
    /// Redis holds no such packet.
    Unknown,
}

async fn expiry_step<C: ConnectionLike + Send>(
    redis: &mut C,
    keys: &PoolKeys,
    mode: &str,
    token: &str,
) -> Result<Expiry, redis::RedisError> {
    let (status, token): (String, String) = lua::EXPIRY
        .key(keys.meta())
        .arg(mode)
        .arg(token)
        .arg(ulid::Ulid::new().to_string())
        .invoke_async(redis)
        .await?;
    Ok(match status.as_str() {
        "pending" => Expiry::Pending(token),
        "stale" => Expiry::Stale,
        "closed" => Expiry::Closed,
        _ => Expiry::Unknown,
    })
}

/// Makes the expiry message about to be sent with `token` the packet's one
/// pending expiry (any earlier one is dropped when it comes). Answers
/// [`Expiry::Pending`] unless the packet is closed or missing in Redis.
pub async fn arm_expiry<C: ConnectionLike + Send>(
    redis: &mut C,
    keys: &PoolKeys,
    token: &str,
) -> Result<Expiry, redis::RedisError> {
    expiry_step(redis, keys, "arm", token).await
}

/// Whether an expiry message that came early, carrying `token`, is the
/// packet's pending one and should be delayed again (a packet with none
/// pending takes it, under a fresh token if it carries none).
pub async fn pending_expiry<C: ConnectionLike + Send>(
    redis: &mut C,
    keys: &PoolKeys,
    token: Option<&str>,
) -> Result<Expiry, redis::RedisError> {
    expiry_step(redis, keys, "check", token.unwrap_or("")).await
}

/// The `redpacket.closed` event of packet `packet_id`, which closed
/// refunding `refunded` and revealing the split `reveal` its create
/// committed to ([`fair`]).
pub fn closed_event(packet_id: &str, refunded: i64, reveal: Option<fair::Reveal>) -> ClosedEvent {
    let (salt, shares) = reveal.map(|r| (r.salt, r.shares)).unzip();
    ClosedEvent {
        salt,
        shares,
        ..ClosedEvent::new(packet_id, refunded)
    }
}

pub(super) fn parse_share(text: &str) -> Option<(u32, i64)> {
    let (share, amount) = text.split_once(':')?;
    Some((share.parse().ok()?, amount.parse().ok()?))
}

/// What a close step did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Close {
    /// Closed by this call (`now`) or an earlier one; `refunded` is what the
    /// close took out of the packet for the sender.
    Closed { refunded: i64, now: bool },
    /// Not due: the packet's own expiry is later.
    Early { expires_at: DateTime<Utc> },
    /// Redis holds no such packet.
    Unknown,
}

/// Closes the packet atomically in Redis if its own stored expiry has
/// passed, and sets the retention expiry on its keys. Record the refund in
/// Postgres with [`record_closed`] afterwards.
pub async fn close<C: ConnectionLike + Send>(
    redis: &mut C,
    keys: &PoolKeys,
) -> Result<Close, redis::RedisError> {
    let (status, figure, _removed): (String, i64, i64) = lua::CLOSE
        .key(keys.meta())
        .key(keys.shares())
        .key(keys.grabbed())
        .arg(crate::scripts::now_ms())
        .arg(CLOSED_RETENTION_S)
        .invoke_async(redis)
        .await?;
    Ok(match status.as_str() {
        "closed" | "already" => Close::Closed {
            refunded: figure,
            now: status == "closed",
        },
        "early" => match DateTime::from_timestamp_millis(figure) {
            Some(expires_at) => Close::Early { expires_at },
            None => {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Parse,
                    "packet expiry out of range",
                    figure.to_string(),
                )))
            }
        },
        _ => Close::Unknown,
    })
}

/// Records in Postgres that the packet closed, refunding `refunded`.
/// Returns whether this call recorded it (the first to do so announces the
/// close, so a crash between the Redis step and this one loses no event).
pub async fn record_closed(
    db: &PgPool,
    packet_id: &str,
    refunded: i64,
) -> Result<bool, sqlx::Error> {
    let recorded = sqlx::query(
        "UPDATE red_packets SET closed_at = now(), refunded = $2 WHERE id = $1 AND closed_at IS NULL",
    )
    .bind(packet_id)
    .bind(refunded)
    .execute(db)
    .await?
    .rows_affected();
    Ok(recorded == 1)
}
