//! Red packets (SPEC §4): escrowed totals split into random shares, grabbed
//! once per user, refunded at expiry.
//!
//! Redis layout of packet `id` (hash tag `{id}`): `meta` (sender, total,
//! expires_at, grabbed, refunded, closed, and `expiry`: the token of the one
//! pending expiry message), `shares` (list of `"<share>:<amount>"`),
//! `grabbed` (hash user → share) and `rs` (the answer store,
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

pub mod fair;
mod grab;
pub mod lifecycle;
pub mod split;

pub use grab::grab;
pub(crate) use grab::grab_call;

use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use serde::Serialize;
use sqlx::PgPool;

use crate::{
    messages::{EntryRef, RedPacketCreate, SettleRequest, Status},
    scripts::{PoolKeys, Scripts},
};

/// The red-packet replies and events, wire types of [`crate::messages`].
pub use crate::messages::{wire_time, ClosedEvent, CreatedReply, ExpireReply, RejectedReply};

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

/// A packet as created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Created {
    pub packet_id: String,
    pub count: i64,
    pub total: i64,
    pub expires_at: DateTime<Utc>,
    /// The packet's commitment to its split ([`fair`]); `None` for a packet
    /// created before packets committed.
    pub commitment: Option<String>,
    /// Postgres records the packet as closed (a create sent again late).
    pub closed: bool,
}

/// Why a packet was not created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The parameters are impossible, or the id is bound to something else
    /// (bad input).
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
    /// Stored state contradicts itself (Redis holds another kind under an
    /// id Postgres gave this packet): retrying cannot help.
    #[error("{0}")]
    Internal(String),
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
/// escrows the sender's balance and stores the shares and what was asked;
/// then the shares are stocked in Redis, and that they were is recorded. A
/// repeated request with the same content returns the packet as first
/// created (and stocks Redis if an earlier attempt stopped before it); one
/// with other content is refused. A request refused for funds is recorded
/// with what it asked, and its id answers the same refusal for good.
pub async fn create<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    scripts: &Scripts,
    prefix: &str,
    req: &RedPacketCreate,
) -> Result<Created, CreateError> {
    validate(req)?;
    let mut tx = db.begin().await?;
    // The primary key serialises concurrent creates of one id: a second
    // insert waits for the first transaction, then sees its row (and is
    // compared with it) or, if it rolled back, takes the id.
    let inserted =
        sqlx::query("INSERT INTO pools (id, kind) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
            .bind(&req.packet_id)
            .bind(KIND)
            .execute(&mut *tx)
            .await?
            .rows_affected();
    // Read under the id's lock: a refusal recorded by a create that held
    // it is seen by every later one.
    let refused: Option<RefusalRow> = sqlx::query_as(
        "SELECT sender, asset, total, share_count, min_asked, expires_in_s, balance FROM red_packet_refusals WHERE id = $1",
    )
    .bind(&req.packet_id)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(refused) = refused {
        tx.rollback().await?;
        return Err(Refused::from(refused).replay(req));
    }
    if inserted == 0 {
        tx.rollback().await?;
        return existing(db, redis, scripts, prefix, req).await;
    }
    // Postgres is the namespace of ids, but Redis is where the packet will
    // live: refuse before escrowing if the keys hold something already.
    let keys = PoolKeys::new(prefix, &req.packet_id);
    let kind: Option<String> = redis::cmd("HGET")
        .arg(keys.meta())
        .arg("kind")
        .query_async(redis)
        .await?;
    if let Some(kind) = kind {
        tx.rollback().await?;
        return Err(CreateError::Invalid(format!(
            "id {} already names a {kind} in Redis",
            req.packet_id
        )));
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
        // The first answer is the answer: remember the refusal with what
        // it asked, and give the id back to the namespace (nothing was
        // created), in one transaction that still holds the id.
        sqlx::query("DELETE FROM pools WHERE id = $1")
            .bind(&req.packet_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO red_packet_refusals (id, sender, asset, total, share_count, min_asked, expires_in_s, balance) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&req.packet_id)
        .bind(req.sender)
        .bind(&req.asset)
        .bind(req.total)
        .bind(req.count)
        .bind(req.min)
        .bind(req.expires_in_s)
        .bind(balance)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        return Err(CreateError::InsufficientFunds {
            sender: req.sender,
            asset: req.asset.clone(),
            balance,
            total: req.total,
        });
    }
    let shares = split::split(req.total, req.count, req.min, &mut rand::rng())
        .map_err(|e| CreateError::Invalid(e.to_string()))?;
    let expires_at = whole_second_from(Utc::now() + chrono::Duration::seconds(req.expires_in_s));
    // `validate` bounds `count` by MAX_SHARES, so it fits an INTEGER.
    let count = i32::try_from(req.count).map_err(|e| CreateError::Invalid(e.to_string()))?;
    let salt = fair::new_salt();
    let commitment = fair::commitment(&req.packet_id, &salt, &shares);
    sqlx::query(
        "INSERT INTO red_packets (id, sender, asset, total, share_count, min_share, expires_at, min_asked, expires_in_s, salt, commitment) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    )
    .bind(&req.packet_id)
    .bind(req.sender)
    .bind(&req.asset)
    .bind(req.total)
    .bind(count)
    .bind(split::floor(req.min))
    .bind(expires_at)
    .bind(req.min)
    .bind(req.expires_in_s)
    .bind(&salt)
    .bind(&commitment)
    .execute(&mut *tx)
    .await?;
    let numbers: Vec<i32> = (1..=count).collect();
    sqlx::query("INSERT INTO red_packet_shares (packet_id, share_no, amount) SELECT $1, * FROM unnest($2::int[], $3::bigint[])")
        .bind(&req.packet_id)
        .bind(&numbers)
        .bind(&shares)
        .execute(&mut *tx)
        .await?;
    let escrow = SettleRequest::fleet(
        format!("redpacket:{}:escrow", req.packet_id),
        req.sender,
        &req.asset,
        -req.total,
        "red_packet_escrow",
        ledger_ref(&req.packet_id),
    );
    crate::ledger::apply_in(&mut tx, std::slice::from_ref(&escrow)).await?;
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
    record_stocked(db, &req.packet_id).await?;
    Ok(Created {
        packet_id: req.packet_id.clone(),
        count: req.count,
        total: req.total,
        expires_at,
        commitment: Some(commitment),
        closed: false,
    })
}

/// The first whole second at or after `at`: packets expire on whole
/// seconds, the unit of the `expires_at` their create answers.
pub fn whole_second_from(at: DateTime<Utc>) -> DateTime<Utc> {
    let up = i64::from(at.timestamp_subsec_nanos() > 0);
    DateTime::from_timestamp(at.timestamp() + up, 0).unwrap_or(at)
}

/// Records that packet `packet_id` is stocked in Redis (once; a packet is
/// never stocked again after this).
async fn record_stocked(db: &PgPool, packet_id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE red_packets SET stocked_at = now() WHERE id = $1 AND stocked_at IS NULL")
        .bind(packet_id)
        .execute(db)
        .await?;
    Ok(())
}

/// A create refused for funds, as Postgres remembers it.
type RefusalRow = (i64, String, i64, i64, i64, i64, i64);

/// A create refused `insufficient_funds`: what it asked and the balance it
/// was refused on.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Refused {
    sender: i64,
    asset: String,
    total: i64,
    count: i64,
    min: i64,
    expires_in_s: i64,
    balance: i64,
}

impl From<RefusalRow> for Refused {
    fn from((sender, asset, total, count, min, expires_in_s, balance): RefusalRow) -> Self {
        Self {
            sender,
            asset,
            total,
            count,
            min,
            expires_in_s,
            balance,
        }
    }
}

impl Refused {
    /// The answer to `req` under the refused id: the same refusal for the
    /// same request, bad input for any other.
    fn replay(self, req: &RedPacketCreate) -> CreateError {
        let mut differences = Vec::new();
        for (field, same) in [
            ("sender", self.sender == req.sender),
            ("asset", self.asset == req.asset),
            ("total", self.total == req.total),
            ("count", self.count == req.count),
            ("min", self.min == req.min),
            ("expires_in_s", self.expires_in_s == req.expires_in_s),
        ] {
            if !same {
                differences.push(field);
            }
        }
        if differences.is_empty() {
            CreateError::InsufficientFunds {
                sender: self.sender,
                asset: self.asset,
                balance: self.balance,
                total: self.total,
            }
        } else {
            CreateError::Invalid(format!(
                "packet {} was refused for funds with another {}; a packet id stays bound to its first request",
                req.packet_id,
                differences.join(", ")
            ))
        }
    }
}

/// The `ref` of a packet's ledger entries.
pub fn ledger_ref(packet_id: &str) -> EntryRef {
    EntryRef::pool(packet_id)
}

/// The refund of what was left in a closed packet, as a ledger entry whose
/// id makes it apply once however often it is sent.
pub fn refund_entry(packet_id: &str, sender: i64, asset: &str, amount: i64) -> SettleRequest {
    SettleRequest::fleet(
        format!("redpacket:{packet_id}:refund"),
        sender,
        asset,
        amount,
        "red_packet_refund",
        ledger_ref(packet_id),
    )
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
        return Err(CreateError::Internal(format!(
            "packet {packet_id} is in Postgres but its Redis keys hold another kind"
        )));
    }
    Ok(())
}

/// A packet as Postgres keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub sender: i64,
    pub asset: String,
    pub total: i64,
    pub count: i64,
    /// The smallest share handed out (`max(min, 1)`).
    pub min_share: i64,
    /// `min` as the create asked it (`None` before this was recorded).
    pub min_asked: Option<i64>,
    /// `expires_in_s` as the create asked it (`None` before this was recorded).
    pub expires_in_s: Option<i64>,
    pub expires_at: DateTime<Utc>,
    /// What the close refunded, once it is recorded.
    pub refunded: Option<i64>,
    /// Whether the packet's first stocking in Redis is recorded.
    pub stocked: bool,
    /// The packet's commitment to its split, if it has one.
    pub commitment: Option<String>,
}

type StoredRow = (
    i64,
    String,
    i64,
    i32,
    i64,
    Option<i64>,
    Option<i64>,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    Option<i64>,
    bool,
    Option<String>,
);

/// Reads packet `packet_id` from Postgres.
pub async fn stored(db: &PgPool, packet_id: &str) -> Result<Option<Stored>, sqlx::Error> {
    let row: Option<StoredRow> = sqlx::query_as(
        "SELECT sender, asset, total, share_count, min_share, min_asked, expires_in_s, expires_at, closed_at, refunded, stocked_at IS NOT NULL, commitment FROM red_packets WHERE id = $1",
    )
    .bind(packet_id)
    .fetch_optional(db)
    .await?;
    Ok(row.map(
        |(
            sender,
            asset,
            total,
            count,
            min_share,
            min_asked,
            expires_in_s,
            expires_at,
            closed_at,
            refunded,
            stocked,
            commitment,
        )| {
            Stored {
                sender,
                asset,
                total,
                count: i64::from(count),
                min_share,
                min_asked,
                expires_in_s,
                expires_at,
                refunded: closed_at.and(refunded),
                stocked,
                commitment,
            }
        },
    ))
}

impl Stored {
    /// The fields of `req` that differ from what the packet's first create
    /// asked (empty when it asks the same).
    pub fn differences(&self, req: &RedPacketCreate) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.sender != req.sender {
            out.push("sender");
        }
        if self.asset != req.asset {
            out.push("asset");
        }
        if self.total != req.total {
            out.push("total");
        }
        if self.count != req.count {
            out.push("count");
        }
        let same_min = match self.min_asked {
            Some(min) => min == req.min,
            None => self.min_share == split::floor(req.min),
        };
        if !same_min {
            out.push("min");
        }
        if self.expires_in_s.is_some_and(|e| e != req.expires_in_s) {
            out.push("expires_in_s");
        }
        out
    }
}

/// A packet id that exists already: returns the packet as created if `req`
/// asks what its first create asked, stocking Redis if no stocking is
/// recorded yet (an earlier attempt stopped before it). A packet stocked
/// once is never stocked again: if Redis lost it, its shares may have been
/// grabbed and paid already.
async fn existing<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    scripts: &Scripts,
    prefix: &str,
    req: &RedPacketCreate,
) -> Result<Created, CreateError> {
    let packet_id = &req.packet_id;
    let Some(packet) = stored(db, packet_id).await? else {
        let kind: Option<(String,)> = sqlx::query_as("SELECT kind FROM pools WHERE id = $1")
            .bind(packet_id)
            .fetch_optional(db)
            .await?;
        let kind = kind.map_or_else(|| "pool".to_owned(), |(k,)| k);
        return Err(CreateError::Invalid(format!(
            "id {packet_id} already names a {kind}"
        )));
    };
    let differences = packet.differences(req);
    if !differences.is_empty() {
        return Err(CreateError::Invalid(format!(
            "packet {packet_id} was created with another {}; a packet id stays bound to its first request",
            differences.join(", ")
        )));
    }
    // A closed packet is never stocked again, even once its Redis keys have
    // expired: its shares were grabbed or refunded. Nor is one long past its
    // expiry whose close is not recorded yet (its keys may be gone), nor one
    // stocked before (Redis may have lost it after grabs were paid).
    let retention = chrono::Duration::seconds(i64::try_from(CLOSED_RETENTION_S).unwrap_or(0));
    if packet.refunded.is_none() && !packet.stocked && Utc::now() < packet.expires_at + retention {
        let shares: Vec<(i64,)> = sqlx::query_as(
            "SELECT amount FROM red_packet_shares WHERE packet_id = $1 ORDER BY share_no",
        )
        .bind(packet_id)
        .fetch_all(db)
        .await?;
        let shares: Vec<i64> = shares.into_iter().map(|(a,)| a).collect();
        stock(
            redis,
            scripts,
            prefix,
            packet_id,
            packet.sender,
            &packet.asset,
            packet.total,
            packet.expires_at,
            &shares,
        )
        .await?;
        record_stocked(db, packet_id).await?;
    }
    Ok(Created {
        packet_id: packet_id.clone(),
        count: packet.count,
        total: packet.total,
        expires_at: packet.expires_at,
        commitment: packet.commitment,
        closed: packet.refunded.is_some(),
    })
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
    scripts: &Scripts,
    keys: &PoolKeys,
    mode: &str,
    token: &str,
) -> Result<Expiry, redis::RedisError> {
    let (status, token): (String, String) = scripts
        .red_packet_expiry
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
    scripts: &Scripts,
    keys: &PoolKeys,
    token: &str,
) -> Result<Expiry, redis::RedisError> {
    expiry_step(redis, scripts, keys, "arm", token).await
}

/// Whether an expiry message that came early, carrying `token`, is the
/// packet's pending one and should be delayed again (a packet with none
/// pending takes it, under a fresh token if it carries none).
pub async fn pending_expiry<C: ConnectionLike + Send>(
    redis: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    token: Option<&str>,
) -> Result<Expiry, redis::RedisError> {
    expiry_step(redis, scripts, keys, "check", token.unwrap_or("")).await
}

/// A reply or event as the JSON bytes the wire carries.
pub fn encode(value: &impl Serialize) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(value)
}

impl Created {
    /// The `redpacket_result` of this packet.
    pub fn reply(&self) -> CreatedReply {
        CreatedReply {
            kind: RESULT_TYPE,
            packet_id: self.packet_id.clone(),
            status: Status::Ok,
            count: self.count,
            total: self.total,
            expires_at: wire_time(self.expires_at),
            commitment: self.commitment.clone(),
        }
    }

    /// The `redpacket.created` event of this packet.
    pub fn event(&self) -> CreatedReply {
        CreatedReply {
            kind: CREATED_EVENT,
            ..self.reply()
        }
    }
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

fn parse_share(text: &str) -> Option<(u32, i64)> {
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
    scripts: &Scripts,
    keys: &PoolKeys,
) -> Result<Close, redis::RedisError> {
    let (status, figure, _removed): (String, i64, i64) = scripts
        .close_red_packet
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::ErrorCode;

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
