//! A red packet's life after its create arrives: stocked with its escrow
//! taken, closed at its own stored expiry with the rest refunded. The
//! refill worker's queue carries both messages (`redpacket.create`,
//! `redpacket.expire`) and hands them here; the races are explained in
//! [`super`].

use serde_json::Value;

use crate::{
    amqp::{HandleError, Outgoing},
    kinds::registry::{self, LifeStep, Lifecycle},
    ledger::Unsealed,
    messages::{decode_payload, with_type, ErrorCode, Invalid, RedPacketCreate, RedPacketExpire},
    redis_conn::RedisConn,
    scripts::{PoolKeys, Scripts},
};

use super::{
    arm_expiry, close, closed_event, create as create_packet, encode, fair, pending_expiry,
    record_closed, refund_entry, stored, Close, CreateError, ExpireReply, Expiry, RejectedReply,
    Stored, CLOSED_EVENT, CREATED_EVENT, EXPIRE_TYPE, RESULT_TYPE,
};

/// What the lifecycle steps use of the worker that runs them.
#[derive(Debug)]
pub struct Life<'a> {
    pub db: &'a sqlx::PgPool,
    pub redis: &'a RedisConn,
    pub scripts: &'a Scripts,
    /// `REDIS_PREFIX`.
    pub prefix: &'a str,
}

/// The refill queue's red-packet messages. Both need Postgres.
pub(super) const LIFECYCLE: &[Lifecycle] = &[
    Lifecycle {
        message: "redpacket.create",
        reply: RESULT_TYPE,
        postgres: true,
        handle: handle_create,
    },
    Lifecycle {
        message: EXPIRE_TYPE,
        reply: RESULT_TYPE,
        postgres: true,
        handle: handle_expire,
    },
];

fn handle_create<'a>(life: &'a registry::Life<'a>, envelope: &'a Value) -> LifeStep<'a> {
    Box::pin(async move { create(&Life::of(life), decode_payload(envelope)?).await })
}

fn handle_expire<'a>(life: &'a registry::Life<'a>, envelope: &'a Value) -> LifeStep<'a> {
    Box::pin(async move { expire(&Life::of(life), decode_payload(envelope)?).await })
}

impl<'a> Life<'a> {
    /// What the steps use of the refill worker's `life`.
    pub fn of(life: &'a registry::Life<'a>) -> Self {
        Self {
            db: life.db,
            redis: life.redis,
            scripts: life.scripts,
            prefix: &life.config.redis_prefix,
        }
    }
}

/// A reply or event of the red-packet kind as bytes.
fn body(value: &impl serde::Serialize) -> Result<Vec<u8>, HandleError> {
    encode(value).map_err(|e| HandleError::Internal(e.into()))
}

/// Milliseconds until `at` (0 when past).
fn remaining_ms(at: chrono::DateTime<chrono::Utc>) -> u64 {
    (at - chrono::Utc::now())
        .num_milliseconds()
        .max(0)
        .unsigned_abs()
}

/// Creates a red packet and schedules its expiry. Bad or conflicting
/// input (a reused `packet_id` with other content, an id of another
/// kind, a number out of bounds) is refused as invalid and moves nothing.
/// A create refused for funds is remembered: sent again, it is refused
/// again. The expiry it schedules becomes the packet's one pending
/// expiry (a create sent again replaces the one before).
pub async fn create(at: &Life<'_>, req: RedPacketCreate) -> Result<Unsealed, HandleError> {
    let mut conn = at.redis.clone();
    let created = match create_packet(at.db, &mut conn, at.prefix, &req).await {
        Ok(created) => created,
        Err(CreateError::Invalid(message)) => return Err(Invalid::new(message).into()),
        Err(e @ CreateError::InsufficientFunds { .. }) => {
            let reply =
                RejectedReply::new(&req.packet_id, ErrorCode::InsufficientFunds, e.to_string());
            return Ok(Unsealed {
                reply: Some(body(&reply)?),
                ..Unsealed::default()
            });
        }
        Err(CreateError::Internal(message)) => return Err(HandleError::internal(message)),
        Err(CreateError::Db(e)) => return Err(e.into()),
        Err(CreateError::Redis(e)) => return Err(e.into()),
    };
    let mut effects = Vec::new();
    if !created.closed {
        // This create's expiry message becomes the packet's one pending
        // expiry: one sent by an earlier copy of the create is dropped
        // when it comes.
        let keys = PoolKeys::new(at.prefix, &created.packet_id);
        let token = ulid::Ulid::new().to_string();
        let token = match arm_expiry(&mut conn, &keys, &token).await? {
            Expiry::Pending(token) => Some(Some(token)),
            // Closed in Redis, not yet in Postgres: an expiry (due, so
            // no token needed) records the close and sends the refund.
            Expiry::Closed | Expiry::Stale => Some(None),
            Expiry::Unknown => {
                // Stocked once and never again: its shares may have
                // been grabbed and paid. The escrow waits for an
                // operator (docs/design.md, Durability).
                tracing::error!(
                    packet = %created.packet_id,
                    "red packet is open in Postgres but missing from Redis; it is not stocked again: an operator must settle its escrow"
                );
                metrics::counter!("prizepool_red_packets_lost_total").increment(1);
                None
            }
        };
        if let Some(token) = token {
            let expire = RedPacketExpire {
                packet_id: created.packet_id.clone(),
                expires_at: Some(created.expires_at),
                token,
            };
            effects.push(Outgoing::delayed(
                remaining_ms(created.expires_at),
                &with_type(EXPIRE_TYPE, &expire),
            ));
        }
    }
    effects.push(Outgoing::event_raw(CREATED_EVENT, body(&created.event())?));
    Ok(Unsealed {
        effects,
        reply: Some(body(&created.reply())?),
        ..Unsealed::default()
    })
}

/// Closes a red packet whose own stored expiry has come and refunds
/// what is left. The message's `expires_at` is not trusted: a message
/// that comes early (forged or not) closes nothing and is answered with
/// the packet still open; it is delayed again to the stored expiry only
/// if it is the packet's one pending expiry (its `token`), otherwise it
/// is dropped, so forged expiries never multiply.
pub async fn expire(at: &Life<'_>, req: RedPacketExpire) -> Result<Unsealed, HandleError> {
    crate::messages::check_id("packet_id", &req.packet_id)?;
    if let Some(token) = &req.token {
        crate::messages::check_id("token", token)?;
    }
    let id = &req.packet_id;
    let Some(packet) = stored(at.db, id).await? else {
        return Err(Invalid::new(format!("no red packet named {id}")).into());
    };
    if let Some(refunded) = packet.refunded {
        // Closed and recorded: answer again, and send the refund again in
        // case the first send was lost (its entry id makes it once).
        return closed(id, &packet, refunded, false, None);
    }
    let keys = PoolKeys::new(at.prefix, id);
    let mut conn = at.redis.clone();
    let missing = || {
        HandleError::internal(format!(
            "red packet {id} is open in Postgres but missing from Redis"
        ))
    };
    // Early: delayed again if it is the pending expiry, else answered
    // and dropped. (Closed in Redis but not yet recorded: close below.)
    let mut early = if remaining_ms(packet.expires_at) > 0 {
        Some(packet.expires_at)
    } else {
        None
    };
    loop {
        if let Some(expires_at) = early {
            match pending_expiry(&mut conn, &keys, req.token.as_deref()).await? {
                Expiry::Pending(token) => return expire_later(id, expires_at, Some(token)),
                Expiry::Stale => {
                    tracing::debug!(packet = %id, "an expiry that is not the pending one came early; dropped");
                    return expire_later(id, expires_at, None);
                }
                Expiry::Closed => {}
                Expiry::Unknown => return Err(missing()),
            }
        }
        match close(&mut conn, &keys).await? {
            Close::Closed { refunded, .. } => {
                // Announced by whoever records the close, which the Redis
                // step's closer may not have lived to do.
                let first = record_closed(at.db, id, refunded).await?;
                // The close reveals the split the create committed to.
                let reveal = if first {
                    fair::reveal(at.db, id).await?
                } else {
                    None
                };
                return closed(id, &packet, refunded, first, reveal);
            }
            // Redis keeps its own copy of the expiry, which the grab
            // script obeys; closing follows the same clock.
            Close::Early { expires_at } if early.is_none() => early = Some(expires_at),
            Close::Early { .. } => {
                return Err(HandleError::internal(format!(
                    "red packet {id} is neither closed nor closable in Redis"
                )))
            }
            Close::Unknown => return Err(missing()),
        }
    }
}

/// The outcome of a closed packet: its answer, its refund entry
/// and, when this call closed it, its event.
fn closed(
    id: &str,
    packet: &Stored,
    refunded: i64,
    now: bool,
    reveal: Option<fair::Reveal>,
) -> Result<Unsealed, HandleError> {
    let mut effects = Vec::new();
    let mut ledger = Vec::new();
    if refunded > 0 {
        ledger.push(refund_entry(id, packet.sender, &packet.asset, refunded));
    }
    if now {
        tracing::info!(packet = %id, refunded, "red packet closed");
        let event = closed_event(id, refunded, reveal);
        effects.push(Outgoing::event_raw(CLOSED_EVENT, body(&event)?));
    }
    Ok(Unsealed {
        reply: Some(body(&ExpireReply::closed(id, refunded))?),
        effects,
        ledger,
        ..Unsealed::default()
    })
}
/// Answers that packet `id` stays open until `expires_at` and, if
/// `token` names its pending expiry, sends that expiry again, due
/// then.
fn expire_later(
    id: &str,
    expires_at: chrono::DateTime<chrono::Utc>,
    token: Option<String>,
) -> Result<Unsealed, HandleError> {
    let mut effects = Vec::new();
    if let Some(token) = token {
        let again = RedPacketExpire {
            packet_id: id.to_owned(),
            expires_at: Some(expires_at),
            token: Some(token),
        };
        effects.push(Outgoing::delayed(
            remaining_ms(expires_at),
            &with_type(EXPIRE_TYPE, &again),
        ));
    }
    Ok(Unsealed {
        reply: Some(body(&ExpireReply::open_until(id, expires_at))?),
        effects,
        ..Unsealed::default()
    })
}
