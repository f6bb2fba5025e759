//! How a batch's commitment reaches the audit trail and why it is believed.
//!
//! The refill worker seals each `pool.refilled` event it publishes with the
//! fleet's key ([`pool_refilled`]), like the draw worker seals its draw
//! records, so the audit consumer believes a genuine event by its seal
//! alone: no Redis or Postgres state is asked, and no ordering between the
//! event and that state matters (a batch used up and revealed before its
//! event is read, a Postgres outage, a sharded pool's sub-pool, a restart).
//!
//! An event without a valid seal (from a fleet older than batch seals, or
//! under a key the audit does not hold) is checked against the pool's state
//! instead ([`check_state`]): a commitment already recorded, the seed kept
//! in Redis or already revealed, and the composition of the config version
//! (of the parent pool, for a sub-pool). State that has not caught up yet
//! (the batch exists but its seed was revealed by a draw whose record is
//! not in the trail yet) is waited for, for [`CATCH_UP`]; only what the
//! state contradicts, or never vouches for, is refused.

use std::time::Duration;

use backon::{ConstantBuilder, Retryable};
use serde_json::Value;
use sqlx::{types::Json, PgPool};

use crate::{
    amqp::HandleError,
    kinds::lucky_gift::{config::split_sub_pool, Commitment, PoolConfig},
    ledger::Sealer,
    messages::{Invalid, PoolRefilled},
    redis_conn::RedisConn,
    scripts::PoolKeys,
};

/// How long an unsealed commitment waits for the pool's state to vouch for
/// it before it is refused.
pub const CATCH_UP: Duration = Duration::from_secs(30);

/// The `pool.refilled` event of `event`:
/// `{"type":"pool.refilled",<fields>,"seal":"<hex>"}`, the seal being
/// [`Sealer::seal_batch`] of `fields` (`serde_json::to_vec` of `event`).
pub fn pool_refilled(sealer: &Sealer, event: &PoolRefilled) -> Result<Vec<u8>, serde_json::Error> {
    let fields = serde_json::to_vec(event)?;
    let mut out = crate::messages::retype("pool.refilled", &fields);
    // `retype` always ends the object with its closing brace.
    if out.last() == Some(&b'}') {
        out.pop();
        out.extend_from_slice(br#","seal":""#);
        out.extend_from_slice(sealer.seal_batch(&fields).as_bytes());
        out.extend_from_slice(br#""}"#);
    }
    Ok(out)
}

/// Whether `raw` (the event as received) carries `sealer`'s seal over
/// `event`'s canonical bytes.
pub(super) fn is_sealed(sealer: &Sealer, raw: &Value, event: &PoolRefilled) -> bool {
    let Some(seal) = raw.get("seal").and_then(Value::as_str) else {
        return false;
    };
    serde_json::to_vec(event).is_ok_and(|bytes| sealer.check_batch(&bytes, seal))
}

/// What the pool's state says of a commitment.
#[derive(Debug)]
enum Said {
    Vouched,
    Contradicted(String),
    /// The batch exists but its seed is neither kept nor recorded yet.
    NotYet,
}

/// Checks an unsealed commitment against the pool's state, waiting up to
/// [`CATCH_UP`] for state that has not caught up; a commitment the state
/// contradicts or never vouches for is refused (bad input).
pub(super) async fn check_state(
    db: &PgPool,
    redis: &RedisConn,
    prefix: &str,
    c: &Commitment,
) -> Result<(), HandleError> {
    crate::messages::check_id("pool", &c.pool)?;
    let said = (|| async {
        match state_says(db, redis, prefix, c).await {
            Ok(Said::NotYet) => Err(None),
            Ok(said) => Ok(said),
            Err(e) => Err(Some(e)),
        }
    })
    .retry(
        ConstantBuilder::default()
            .with_delay(Duration::from_millis(500))
            .with_max_times((CATCH_UP.as_millis() / 500) as usize),
    )
    // A server that is away is the consume loop's to retry.
    .when(Option::is_none)
    .await;
    let refused = |why: String| {
        Err(Invalid::new(format!(
            "the commitment of batch {} of pool {} does not match the pool's state: {why}",
            c.generation, c.pool
        ))
        .into())
    };
    match said {
        Ok(Said::Vouched) => Ok(()),
        Ok(Said::Contradicted(why)) => refused(why),
        Ok(Said::NotYet) | Err(None) => refused(format!(
            "its seed is neither kept in Redis nor revealed after {CATCH_UP:?}"
        )),
        Err(Some(e)) => Err(e),
    }
}

/// One look at the state: the trail, the seed in Redis or revealed, the
/// composition of the config version.
async fn state_says(
    db: &PgPool,
    redis: &RedisConn,
    prefix: &str,
    c: &Commitment,
) -> Result<Said, HandleError> {
    let recorded: Option<String> = sqlx::query_scalar(
        "SELECT commitment FROM fair_batches WHERE pool = $1 AND generation = $2",
    )
    .bind(&c.pool)
    .bind(c.generation as i64)
    .fetch_optional(db)
    .await?;
    if let Some(recorded) = recorded {
        // Recorded by the refill worker itself before the batch was visible.
        return Ok(match recorded == c.commitment {
            true => Said::Vouched,
            false => Said::Contradicted("another commitment is recorded".into()),
        });
    }
    let seed = match seed_of(db, redis, prefix, c).await? {
        Ok(seed) => seed,
        Err(said) => return Ok(said),
    };
    if crate::fairness::Seed::from_hex(&seed).is_none_or(|s| s.commitment() != c.commitment) {
        return Ok(Said::Contradicted("the seed is another one".into()));
    }
    // Sub-pools are stocked from their parent's config versions.
    let (parent, _) = split_sub_pool(&c.pool);
    let config: Option<Json<PoolConfig>> =
        sqlx::query_scalar("SELECT config FROM pool_versions WHERE pool_id = $1 AND version = $2")
            .bind(parent)
            .bind(c.version)
            .fetch_optional(db)
            .await?;
    let composed = config.is_some_and(|Json(config)| {
        crate::kinds::lucky_gift::composition(&config) == c.composition
            && config.batch_size() == c.size
    });
    Ok(match composed {
        true => Said::Vouched,
        false => Said::Contradicted("the composition is not the config version's".into()),
    })
}

/// The seed of the commitment's batch: kept in Redis until its reveal, then
/// in the trail; `Err` with the verdict when there is none to compare.
async fn seed_of(
    db: &PgPool,
    redis: &RedisConn,
    prefix: &str,
    c: &Commitment,
) -> Result<Result<String, Said>, HandleError> {
    let keys = PoolKeys::new(prefix, &c.pool);
    let mut conn = redis.clone();
    let (kept, gen): (Option<String>, Option<u64>) = redis::cmd("HMGET")
        .arg(keys.meta())
        .arg(format!("c:{}", c.generation))
        .arg("gen")
        .query_async(&mut conn)
        .await?;
    if let Some((version, seed)) = kept.as_deref().and_then(|k| k.split_once('|')) {
        return Ok(match version.parse::<i64>().ok() == Some(c.version) {
            true => Ok(seed.to_owned()),
            false => Err(Said::Contradicted("the batch has another version".into())),
        });
    }
    let revealed: Option<String> = sqlx::query_scalar(
        "SELECT seed FROM fair_reveals WHERE pool = $1 AND generation = $2 AND version = $3",
    )
    .bind(&c.pool)
    .bind(c.generation as i64)
    .bind(c.version)
    .fetch_optional(db)
    .await?;
    Ok(match (revealed, gen) {
        (Some(seed), _) => Ok(seed),
        // Stocked, and revealed by a draw whose record is still on its way.
        (None, Some(gen)) if gen >= c.generation => Err(Said::NotYet),
        _ => Err(Said::Contradicted("no such batch was stocked".into())),
    })
}
