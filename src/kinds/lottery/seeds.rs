//! Committed seeds of lottery periods (`docs/fairness.md`, "Lotteries"):
//! the randomness of a `wheel` draw comes from a secret seed per activity
//! and period, whose SHA-256 is on record before any draw uses it, and
//! which is revealed when its period is over.
//!
//! The shape is a lucky-gift batch's ([`crate::audit::PgRecorder`]):
//!
//! 1. **Choose.** `lua/lottery_seed.lua` keeps a fresh seed from the OS
//!    CSPRNG as the period's *chosen* seed (`n:<period>` in the activity's
//!    seeds hash), or returns the one an earlier attempt chose: a
//!    commitment recorded by an attempt that died is the one committed.
//! 2. **Record.** The commitment goes to Postgres (`fair_lottery_seeds`),
//!    waiting at most [`crate::audit::RECORD_WAIT`]; while Postgres is away
//!    to the activity's outbox in Redis (its own slot, drained into
//!    Postgres by the refill worker, like a batch's). If neither takes it,
//!    nothing is committed and the draws wait.
//! 3. **Commit.** `lua/lottery_seed_commit.lua` makes the chosen seed the
//!    period's: only now can a draw use it (`lua/draw_wheel.lua` checks the
//!    committed seed's commitment against the one the values came from).
//! 4. **Reveal.** Once a period is over (plus [`REVEAL_GRACE_S`] for clock
//!    skew between workers), `lua/lottery_seed_retire.lua` takes its seed
//!    out of the draws' reach, the seed is written to Postgres
//!    (`fair_lottery_reveals`), and only then leaves Redis.
//!
//! The draw worker asks for steps 1 to 3 with a `lottery.seed` message on
//! the refill queue when a draw finds its period without a committed seed
//! (a short draw: it waits like a draw on a short pool); the refill worker
//! answers it, and reveals the periods that are over while at it, and
//! sweeps every activity for periods to reveal every few minutes
//! ([`reveal_every_activity`]). `activity load` commits the current
//! period's seed of an open activity itself
//! ([`super::commit_current_seeds`]).

use std::{
    collections::HashMap,
    sync::{LazyLock, Mutex},
};

use redis::aio::ConnectionLike;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use super::scripts as lua;
use crate::{amqp::HandleError, fairness::Seed, redis_conn::RedisConn, scripts::PoolKeys};

/// The message a short lottery draw sends to the refill queue.
pub const SEED_MESSAGE: &str = "lottery.seed";

/// The prefix of a lottery commitment's field in an activity's outbox
/// (`lottery:<period>`); a batch's field is its generation.
pub const OUTBOX_FIELD: &str = "lottery:";

/// A period is revealed this many seconds after it ends: a draw worker
/// whose clock runs behind by less still finds its period's seed.
pub const REVEAL_GRACE_S: u64 = 2;

/// Most activities whose seed a draw worker keeps in memory.
const MAX_CACHED: usize = 10_000;

/// A period's commitment as the trail and the outbox keep it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeedCommitment {
    pub activity: String,
    /// The period's start, unix seconds (a multiple of `period_s`).
    pub period: u64,
    pub period_s: u64,
    /// `SHA-256(seed)`, 64 lowercase hex digits.
    pub commitment: String,
}

/// The start of the period of length `len` seconds that `now_s` falls in.
pub fn period_of(now_s: u64, len: u64) -> u64 {
    now_s - now_s % len.max(1)
}

/// A period's committed seed, as a draw uses it.
#[derive(Clone, Copy, Debug)]
pub struct PeriodSeed {
    /// The period's start, unix seconds.
    pub period: u64,
    pub seed: Seed,
}

/// A seeds-hash value, `"<commitment>|<seed hex>"`, if it reads and the
/// seed is the commitment's.
fn parse_value(value: &str) -> Option<Seed> {
    let (commitment, seed) = value.split_once('|')?;
    Seed::from_hex(seed).filter(|s| s.commitment() == commitment)
}

/// What a draw worker knows of an activity: its period length (which
/// `activity load` never changes) and the last committed seed it used.
static KNOWN: LazyLock<Mutex<HashMap<String, Known>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// An activity's period length and the last committed seed a worker used.
type Known = (u64, Option<PeriodSeed>);

/// The committed seed of the period `now_ms` falls in, or `Err(period)`
/// when that period has none yet. One Redis read per activity and period
/// in each worker: a committed seed never changes.
pub(super) async fn current<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    now_ms: i64,
) -> Result<Result<PeriodSeed, u64>, HandleError> {
    let now_s = u64::try_from(now_ms / 1000).unwrap_or(0);
    let meta = keys.meta();
    let known = KNOWN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&meta)
        .copied();
    let len = match known {
        Some((len, seed)) => {
            if let Some(seed) = seed.filter(|s| s.period == period_of(now_s, len)) {
                return Ok(Ok(seed));
            }
            len
        }
        None => period_len(conn, keys).await?,
    };
    let period = period_of(now_s, len);
    let value: Option<String> = redis::cmd("HGET")
        .arg(keys.lottery_seeds())
        .arg(period)
        .query_async(conn)
        .await?;
    let seed = value
        .as_deref()
        .and_then(parse_value)
        .map(|seed| PeriodSeed { period, seed });
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    if known.len() >= MAX_CACHED {
        known.clear();
    }
    known.insert(meta, (len, seed));
    Ok(seed.ok_or(period))
}

/// Forgets the seed a worker keeps for `keys`' activity (the script found
/// it is not the period's committed one).
pub(super) fn forget(keys: &PoolKeys) {
    KNOWN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&keys.meta());
}

/// The activity's period length (`seed_period_s` in its meta hash; a day
/// for an activity loaded before periods had a length).
pub(super) async fn period_len<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
) -> Result<u64, HandleError> {
    let len: Option<u64> = redis::cmd("HGET")
        .arg(keys.meta())
        .arg("seed_period_s")
        .query_async(conn)
        .await?;
    Ok(len
        .filter(|l| *l > 0)
        .unwrap_or(super::config::DEFAULT_SEED_PERIOD_S))
}

/// Records a period's commitment; a row already there is kept. Whether
/// the row holds this commitment (`false`: another one was recorded for
/// the period first, and this one must never be used).
pub async fn record_commitment(db: &PgPool, c: &SeedCommitment) -> Result<bool, sqlx::Error> {
    let stored: String = sqlx::query_scalar(
        "WITH ins AS (
            INSERT INTO fair_lottery_seeds (activity, period, period_s, commitment)
            VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING RETURNING commitment)
         SELECT commitment FROM ins
         UNION ALL
         SELECT commitment FROM fair_lottery_seeds WHERE activity = $1 AND period = $2
         LIMIT 1",
    )
    .bind(&c.activity)
    .bind(c.period as i64)
    .bind(c.period_s as i64)
    .bind(&c.commitment)
    .fetch_one(db)
    .await?;
    Ok(stored == c.commitment)
}

/// Records a revealed seed; a reveal already there is kept.
pub async fn record_reveal(
    db: &PgPool,
    activity: &str,
    period: u64,
    seed: &Seed,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO fair_lottery_reveals (activity, period, seed) VALUES ($1, $2, $3)
         ON CONFLICT DO NOTHING",
    )
    .bind(activity)
    .bind(period as i64)
    .bind(seed.to_hex())
    .execute(db)
    .await?;
    Ok(())
}

/// What [`commit`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Committed {
    /// The period has a committed seed (now or before).
    Ready,
    /// The period is over: no seed is chosen for it any more.
    Retired,
    /// No lottery activity has this id.
    Unknown,
}

/// Commits a seed for `period` of `activity` (steps 1 to 3 of the module
/// docs). With `outbox`, a commitment Postgres does not take within
/// [`crate::audit::RECORD_WAIT`] is kept in the activity's outbox instead;
/// without one (`activity load`, which needs Postgres anyway) it is an
/// error. A commitment on record nowhere commits nothing: a transient
/// error.
#[allow(clippy::too_many_arguments)]
pub async fn commit<C: ConnectionLike + Send>(
    db: &PgPool,
    conn: &mut C,
    prefix: &str,
    activity: &str,
    period: u64,
    period_s: u64,
    outbox: Option<&RedisConn>,
) -> Result<Committed, HandleError> {
    let keys = PoolKeys::new(prefix, activity);
    let candidate = Seed::fresh()
        .map_err(|e| HandleError::internal(format!("the OS gave no random seed: {e}")))?;
    let (status, value): (String, String) = lua::LOTTERY_SEED
        .key(keys.meta())
        .key(keys.lottery_seeds())
        .arg(period)
        .arg(format!("{}|{}", candidate.commitment(), candidate.to_hex()))
        .invoke_async(conn)
        .await?;
    match status.as_str() {
        "committed" => return Ok(Committed::Ready),
        "retired" => return Ok(Committed::Retired),
        "unknown" => return Ok(Committed::Unknown),
        "chosen" => {}
        other => {
            return Err(HandleError::internal(format!(
                "unexpected lottery_seed answer {other:?}"
            )))
        }
    }
    let seed = parse_value(&value).ok_or_else(|| {
        HandleError::internal(format!(
            "the chosen seed of period {period} of {activity} does not read"
        ))
    })?;
    let c = SeedCommitment {
        activity: activity.to_owned(),
        period,
        period_s,
        commitment: seed.commitment(),
    };
    record_or_keep(db, outbox, prefix, &c).await?;
    let (status, _): (String, String) = lua::LOTTERY_SEED_COMMIT
        .key(keys.lottery_seeds())
        .key(keys.meta())
        .arg(period)
        .arg(&c.commitment)
        .invoke_async(conn)
        .await?;
    Ok(match status.as_str() {
        "ok" => Committed::Ready,
        // Retired between the choice and the commit: the period is over.
        _ => Committed::Retired,
    })
}

/// Puts `c` on record: Postgres, or while Postgres is away (and `outbox`)
/// the activity's outbox. An error when neither took it.
async fn record_or_keep(
    db: &PgPool,
    outbox: Option<&RedisConn>,
    prefix: &str,
    c: &SeedCommitment,
) -> Result<(), HandleError> {
    use crate::audit::{database_away, mark_database, RECORD_WAIT};
    let failed = if database_away(db) {
        "Postgres was away a moment ago".to_owned()
    } else {
        match tokio::time::timeout(RECORD_WAIT, record_commitment(db, c)).await {
            Ok(Ok(true)) => {
                mark_database(db, false);
                return Ok(());
            }
            Ok(Ok(false)) => {
                return Err(HandleError::internal(format!(
                    "another commitment is recorded for period {} of {}: its seed is not the one kept in Redis",
                    c.period, c.activity
                )))
            }
            Ok(Err(e)) => {
                mark_database(db, true);
                format!("{e}")
            }
            Err(_) => {
                mark_database(db, true);
                "Postgres is slow".to_owned()
            }
        }
    };
    tracing::warn!(activity = %c.activity, period = c.period, reason = %failed, "lottery commitment not recorded in Postgres yet");
    let Some(redis) = outbox else {
        return Err(HandleError::Transient(anyhow::anyhow!(
            "the commitment of period {} of {} is not recorded: {failed}",
            c.period,
            c.activity
        )));
    };
    let json = serde_json::to_string(c)
        .map_err(|e| HandleError::internal(format!("serialising a commitment: {e}")))?;
    let field = format!("{OUTBOX_FIELD}{}", c.period);
    crate::audit::keep_in_outbox(redis, prefix, &c.activity, &field, &json).await?;
    tracing::info!(activity = %c.activity, period = c.period, "lottery commitment kept in the activity's Redis outbox until Postgres is back");
    Ok(())
}

/// Reveals the seeds of `activity`'s periods that are over at `now_ms`
/// (step 4 of the module docs); the number revealed. An activity whose
/// window closed has its last period over too: no draw can use it.
pub async fn reveal_ended(
    db: &PgPool,
    redis: &RedisConn,
    prefix: &str,
    activity: &str,
    now_ms: i64,
) -> Result<usize, HandleError> {
    let keys = PoolKeys::new(prefix, activity);
    let mut conn = redis.clone();
    let (kind, len, ends_at): (Option<String>, Option<u64>, Option<i64>) = redis::cmd("HMGET")
        .arg(keys.meta())
        .arg("kind")
        .arg("seed_period_s")
        .arg("ends_at")
        .query_async(&mut conn)
        .await?;
    if kind.as_deref() != Some(super::KIND) {
        return Ok(0);
    }
    let len = len
        .filter(|l| *l > 0)
        .unwrap_or(super::config::DEFAULT_SEED_PERIOD_S);
    let grace_ms = (REVEAL_GRACE_S * 1000) as i64;
    let now_s = u64::try_from((now_ms - grace_ms) / 1000).unwrap_or(0);
    let mut open = period_of(now_s, len);
    if ends_at.is_some_and(|end| now_ms >= end + grace_ms) {
        open += len;
    }
    let _: (String, u64) = lua::LOTTERY_SEED_RETIRE
        .key(keys.lottery_seeds())
        .key(keys.meta())
        .arg(open)
        .invoke_async(&mut conn)
        .await?;
    let all: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.lottery_seeds())
        .query_async(&mut conn)
        .await?;
    let mut revealed = 0;
    for (field, value) in all {
        let Some(period) = field.strip_prefix("r:").and_then(|p| p.parse::<u64>().ok()) else {
            continue;
        };
        let Some(seed) = parse_value(&value) else {
            tracing::error!(%activity, period, "a retired seed that does not read; left in Redis");
            continue;
        };
        // In Postgres first: a seed leaves Redis only once it is revealed.
        record_reveal(db, activity, period, &seed).await?;
        redis::cmd("HDEL")
            .arg(keys.lottery_seeds())
            .arg(&field)
            .query_async::<()>(&mut conn)
            .await?;
        revealed += 1;
    }
    Ok(revealed)
}

/// [`reveal_ended`] for every lottery activity Postgres knows; the number
/// of seeds revealed.
pub async fn reveal_every_activity(
    db: &PgPool,
    redis: &RedisConn,
    prefix: &str,
) -> anyhow::Result<usize> {
    let activities: Vec<String> = sqlx::query_scalar("SELECT id FROM pools WHERE kind = $1")
        .bind(super::KIND)
        .fetch_all(db)
        .await?;
    let now = crate::scripts::now_ms();
    let mut revealed = 0;
    for activity in activities {
        revealed += reveal_ended(db, redis, prefix, &activity, now)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(revealed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_start_at_multiples_of_their_length() {
        assert_eq!(period_of(1_799_971_200 + 5, 86_400), 1_799_971_200);
        assert_eq!(period_of(59, 60), 0);
        assert_eq!(period_of(60, 60), 60);
        assert_eq!(period_of(7, 1), 7);
    }

    #[test]
    fn a_seed_value_reads_only_with_its_own_commitment() {
        let seed = Seed([3; 32]);
        let value = format!("{}|{}", seed.commitment(), seed.to_hex());
        assert_eq!(parse_value(&value), Some(seed));
        let other = Seed([4; 32]);
        assert_eq!(
            parse_value(&format!("{}|{}", other.commitment(), seed.to_hex())),
            None
        );
        assert_eq!(parse_value(&seed.to_hex()), None);
    }
}
