//! Creating a packet: the request checked, the split drawn and committed,
//! the escrow taken and the shares stocked, once per `packet_id` (a create
//! sent again answers as first created; one refused for funds is refused
//! again).

use crate::kinds::red_packet::scripts as lua;
use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use sqlx::PgPool;

use super::{
    close::ledger_ref,
    fair,
    names::{CLOSED_RETENTION_S, CREATED_EVENT, KIND, MAX_EXPIRES_IN_S, RESULT_TYPE},
    split,
    stored::stored,
};
use crate::messages::{wire_time, CreatedReply};
use crate::{
    messages::{RedPacketCreate, SettleRequest, Status},
    scripts::PoolKeys,
};

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
    prefix: &str,
    req: &RedPacketCreate,
) -> Result<Created, CreateError> {
    validate(req)?;
    let mut tx = db.begin().await?;
    // The primary key serialises concurrent creates of one id: a second
    // insert waits for the first transaction, then sees its row (and is
    // compared with it) or, if it rolled back, takes the id.
    let inserted = claim_id(&mut tx, &req.packet_id).await?;
    // Read under the id's lock: a refusal recorded by a create that held
    // it is seen by every later one.
    let refused = recorded_refusal(&mut tx, &req.packet_id).await?;
    if let Some(refused) = refused {
        tx.rollback().await?;
        return Err(Refused::from(refused).replay(req));
    }
    if !inserted {
        tx.rollback().await?;
        return existing(db, redis, prefix, req).await;
    }
    // Postgres is the namespace of ids, but Redis is where the packet will
    // live: refuse before escrowing if the keys hold something already.
    if let Some(kind) = kind_in_redis(redis, prefix, &req.packet_id).await? {
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
        remember_refusal(tx, req, balance).await?;
        return Err(CreateError::InsufficientFunds {
            sender: req.sender,
            asset: req.asset.clone(),
            balance,
            total: req.total,
        });
    }
    let Escrowed {
        shares,
        expires_at,
        commitment,
    } = escrow(&mut tx, req).await?;
    tx.commit().await?;
    stock(
        redis,
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

/// The kind the pool keys of `id` hold in Redis, if any.
async fn kind_in_redis<C: ConnectionLike + Send>(
    redis: &mut C,
    prefix: &str,
    id: &str,
) -> Result<Option<String>, redis::RedisError> {
    redis::cmd("HGET")
        .arg(PoolKeys::new(prefix, id).meta())
        .arg("kind")
        .query_async(redis)
        .await
}

/// Inserts `id` into the namespace of ids as a red packet: whether it was
/// free (else it names a packet already, or another kind's pool).
async fn claim_id(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: &str,
) -> Result<bool, sqlx::Error> {
    let inserted =
        sqlx::query("INSERT INTO pools (id, kind) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
            .bind(id)
            .bind(KIND)
            .execute(&mut **tx)
            .await?
            .rows_affected();
    Ok(inserted > 0)
}

/// The refusal for funds recorded for packet `id`, if its first create
/// was refused.
async fn recorded_refusal(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: &str,
) -> Result<Option<RefusalRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT sender, asset, total, share_count, min_asked, expires_in_s, balance FROM red_packet_refusals WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&mut **tx)
    .await
}

/// The first answer to a create refused for funds is the answer: the
/// refusal is remembered with what it asked, and the id given back to the
/// namespace (nothing was created), in `tx`, which still holds the id.
async fn remember_refusal(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    req: &RedPacketCreate,
    balance: i64,
) -> Result<(), CreateError> {
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
    Ok(())
}

/// A packet's split, stored and escrowed.
struct Escrowed {
    shares: Vec<i64>,
    expires_at: DateTime<Utc>,
    commitment: String,
}

/// Draws the packet's split and commits to it, stores the packet and its
/// shares, and takes the escrow from the sender, all in `tx`.
async fn escrow(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    req: &RedPacketCreate,
) -> Result<Escrowed, CreateError> {
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
    .execute(&mut **tx)
    .await?;
    let numbers: Vec<i32> = (1..=count).collect();
    sqlx::query("INSERT INTO red_packet_shares (packet_id, share_no, amount) SELECT $1, * FROM unnest($2::int[], $3::bigint[])")
        .bind(&req.packet_id)
        .bind(&numbers)
        .bind(&shares)
        .execute(&mut **tx)
        .await?;
    let escrow = SettleRequest::fleet(
        format!("{}:{}:escrow", super::reasons::ENTRY_IDS, req.packet_id),
        req.sender,
        &req.asset,
        -req.total,
        "red_packet_escrow",
        ledger_ref(&req.packet_id),
    );
    crate::ledger::apply_in(tx, std::slice::from_ref(&escrow)).await?;
    Ok(Escrowed {
        shares,
        expires_at,
        commitment,
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
pub(super) struct Refused {
    pub(super) sender: i64,
    pub(super) asset: String,
    pub(super) total: i64,
    pub(super) count: i64,
    pub(super) min: i64,
    pub(super) expires_in_s: i64,
    pub(super) balance: i64,
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
    pub(super) fn replay(self, req: &RedPacketCreate) -> CreateError {
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

#[allow(clippy::too_many_arguments)]
async fn stock<C: ConnectionLike + Send>(
    redis: &mut C,
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
    let (status, _): (String, i64) = lua::STOCK
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

/// A packet id that exists already: returns the packet as created if `req`
/// asks what its first create asked, stocking Redis if no stocking is
/// recorded yet (an earlier attempt stopped before it). A packet stocked
/// once is never stocked again: if Redis lost it, its shares may have been
/// grabbed and paid already.
async fn existing<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
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
