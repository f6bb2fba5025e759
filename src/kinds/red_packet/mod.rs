//! Red packets (SPEC §4): escrowed totals split into random shares, grabbed
//! once per user, refunded at expiry.
//!
//! Redis layout of packet `id` (hash tag `{id}`): `meta` (sender, total,
//! expires_at, grabbed, refunded, closed), `shares` (list of
//! `"<share>:<amount>"`), `grabbed` (hash user → share) and `r:<request_id>`.
//! Postgres keeps the packet and its shares; the escrow, each grab and the
//! refund are ledger entries, so at any moment
//! `escrowed = grabbed + refunded + still in the packet`.

mod grab;
pub mod split;

pub use grab::{grab, grab_call};

use anyhow::Context;
use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use serde_json::json;
use sqlx::PgPool;

use crate::{
    messages::{RedPacketCreate, SettleRequest},
    scripts::{PoolKeys, Scripts},
};

/// Kind label stored in `meta.kind` and in the pool registry.
pub const KIND: &str = "red_packet";
/// Longest lifetime of a packet.
pub const MAX_EXPIRES_IN_S: i64 = 30 * 24 * 3600;

/// A packet as created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Created {
    pub packet_id: String,
    pub count: i64,
    pub total: i64,
    pub expires_at: DateTime<Utc>,
}

/// Why a packet was not created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The parameters are impossible (bad input).
    #[error("{0}")]
    Invalid(String),
    /// The sender's balance cannot cover the total.
    #[error("account {sender} holds {balance} {asset}, the packet needs {total}")]
    InsufficientFunds {
        sender: i64,
        asset: String,
        balance: i64,
        total: i64,
    },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
}

/// Checks a create request's parameters.
pub fn validate(req: &RedPacketCreate) -> Result<(), CreateError> {
    crate::messages::check_id("packet_id", &req.packet_id)
        .map_err(|e| CreateError::Invalid(e.message))?;
    crate::messages::check_id("asset", &req.asset).map_err(|e| CreateError::Invalid(e.message))?;
    crate::messages::check_account("sender", req.sender)
        .map_err(|e| CreateError::Invalid(e.message))?;
    split::check(req.total, req.count, req.min).map_err(|e| CreateError::Invalid(e.to_string()))?;
    if !(1..=MAX_EXPIRES_IN_S).contains(&req.expires_in_s) {
        return Err(CreateError::Invalid(format!(
            "`expires_in_s` must be between 1 and {MAX_EXPIRES_IN_S}, got {}",
            req.expires_in_s
        )));
    }
    Ok(())
}

/// Creates a packet: one Postgres transaction registers the id, checks and
/// escrows the sender's balance and stores the shares; then the shares are
/// stocked in Redis. A repeated request returns the packet as first created
/// (and stocks Redis if an earlier attempt stopped before it).
pub async fn create<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    scripts: &Scripts,
    prefix: &str,
    req: &RedPacketCreate,
) -> Result<Created, CreateError> {
    validate(req)?;
    let mut tx = db.begin().await?;
    let inserted =
        sqlx::query("INSERT INTO pools (id, kind) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
            .bind(&req.packet_id)
            .bind(KIND)
            .execute(&mut *tx)
            .await?
            .rows_affected();
    if inserted == 0 {
        tx.rollback().await?;
        return existing(db, redis, scripts, prefix, &req.packet_id).await;
    }
    // Lock the sender's balance row so two packets cannot spend it twice.
    let balance: Option<(i64,)> =
        sqlx::query_as("SELECT balance FROM balances WHERE account = $1 AND asset = $2 FOR UPDATE")
            .bind(req.sender)
            .bind(&req.asset)
            .fetch_optional(&mut *tx)
            .await?;
    let balance = balance.map_or(0, |(b,)| b);
    if balance < req.total {
        tx.rollback().await?;
        return Err(CreateError::InsufficientFunds {
            sender: req.sender,
            asset: req.asset.clone(),
            balance,
            total: req.total,
        });
    }
    let shares = split::split(req.total, req.count, req.min, &mut rand::rng())
        .map_err(|e| CreateError::Invalid(e.to_string()))?;
    let expires_at = Utc::now() + chrono::Duration::seconds(req.expires_in_s);
    sqlx::query(
        "INSERT INTO red_packets (id, sender, asset, total, share_count, min_share, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(&req.packet_id)
    .bind(req.sender)
    .bind(&req.asset)
    .bind(req.total)
    .bind(req.count as i32)
    .bind(split::floor(req.min))
    .bind(expires_at)
    .execute(&mut *tx)
    .await?;
    let numbers: Vec<i32> = (1..=shares.len() as i32).collect();
    sqlx::query("INSERT INTO red_packet_shares (packet_id, share_no, amount) SELECT $1, * FROM unnest($2::int[], $3::bigint[])")
        .bind(&req.packet_id)
        .bind(&numbers)
        .bind(&shares)
        .execute(&mut *tx)
        .await?;
    let escrow = SettleRequest::new(
        format!("redpacket:{}:escrow", req.packet_id),
        req.sender,
        &req.asset,
        -req.total,
        "red_packet_escrow",
        json!({ "pool": req.packet_id }),
    );
    crate::settle::apply_in(&mut tx, std::slice::from_ref(&escrow)).await?;
    tx.commit().await?;
    stock(
        redis,
        scripts,
        prefix,
        &req.packet_id,
        req.sender,
        &req.asset,
        req.total,
        expires_at,
        &shares,
    )
    .await?;
    Ok(Created {
        packet_id: req.packet_id.clone(),
        count: req.count,
        total: req.total,
        expires_at,
    })
}

#[allow(clippy::too_many_arguments)]
async fn stock<C: ConnectionLike + Send>(
    redis: &mut C,
    scripts: &Scripts,
    prefix: &str,
    packet_id: &str,
    sender: i64,
    asset: &str,
    total: i64,
    expires_at: DateTime<Utc>,
    shares: &[i64],
) -> Result<(), CreateError> {
    let keys = PoolKeys::new(prefix, packet_id);
    let elements: Vec<String> = shares
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}:{a}", i + 1))
        .collect();
    let (status, _): (String, i64) = scripts
        .stock_red_packet
        .key(keys.meta())
        .key(keys.shares())
        .arg(sender)
        .arg(total)
        .arg(expires_at.timestamp_millis())
        .arg(asset)
        .arg(&elements)
        .invoke_async(redis)
        .await?;
    if status == "kind" {
        return Err(CreateError::Invalid(format!(
            "id {packet_id} already names another pool"
        )));
    }
    Ok(())
}

/// A packet that exists already: returns it as created, making sure Redis has it.
async fn existing<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    scripts: &Scripts,
    prefix: &str,
    packet_id: &str,
) -> Result<Created, CreateError> {
    let row: Option<(i64, String, i64, i32, DateTime<Utc>)> = sqlx::query_as(
        "SELECT sender, asset, total, share_count, expires_at FROM red_packets WHERE id = $1",
    )
    .bind(packet_id)
    .fetch_optional(db)
    .await?;
    let Some((sender, asset, total, count, expires_at)) = row else {
        return Err(CreateError::Invalid(format!(
            "id {packet_id} already names a pool or activity"
        )));
    };
    let shares: Vec<(i64,)> = sqlx::query_as(
        "SELECT amount FROM red_packet_shares WHERE packet_id = $1 ORDER BY share_no",
    )
    .bind(packet_id)
    .fetch_all(db)
    .await?;
    let shares: Vec<i64> = shares.into_iter().map(|(a,)| a).collect();
    stock(
        redis, scripts, prefix, packet_id, sender, &asset, total, expires_at, &shares,
    )
    .await?;
    Ok(Created {
        packet_id: packet_id.to_owned(),
        count: i64::from(count),
        total,
        expires_at,
    })
}

fn parse_share(text: &str) -> Option<(u32, i64)> {
    let (share, amount) = text.split_once(':')?;
    Some((share.parse().ok()?, amount.parse().ok()?))
}

/// What closing a packet did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Closed {
    pub sender: i64,
    pub asset: String,
    /// The amount refunded to the sender (by this close or an earlier one).
    pub refunded: i64,
    /// Whether this call closed it.
    pub now: bool,
}

/// Closes the packet atomically in Redis, then records it in Postgres.
pub async fn close<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    packet_id: &str,
) -> anyhow::Result<Option<Closed>> {
    let (status, refunded, _removed): (String, i64, i64) = scripts
        .close_red_packet
        .key(keys.meta())
        .key(keys.shares())
        .invoke_async(redis)
        .await?;
    if status == "unknown" {
        return Ok(None);
    }
    let (sender, asset): (i64, String) =
        sqlx::query_as("SELECT sender, asset FROM red_packets WHERE id = $1")
            .bind(packet_id)
            .fetch_one(db)
            .await
            .context("reading the packet")?;
    sqlx::query("UPDATE red_packets SET closed_at = coalesce(closed_at, now()), refunded = $2 WHERE id = $1")
        .bind(packet_id)
        .bind(refunded)
        .execute(db)
        .await?;
    Ok(Some(Closed {
        sender,
        asset,
        refunded,
        now: status == "closed",
    }))
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
    scripts: &Scripts,
    keys: &PoolKeys,
) -> Result<Option<PacketStatus>, redis::RedisError> {
    let reply: Vec<redis::Value> = scripts
        .red_packet_status
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
