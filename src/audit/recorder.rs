//! A batch's commitment is on record before the batch is visible, with
//! Postgres or without it.
//!
//! The refill worker's [`PgRecorder`] writes each commitment to Postgres
//! (`fair_batches`) before its batch becomes visible. Stocking must not
//! wait for a Postgres that is away, so when Postgres does not take the
//! commitment within [`RECORD_WAIT`] the recorder keeps it in an outbox in
//! Redis instead, still before the batch is visible: the pool's own
//! outbox ([`PoolKeys::fair_outbox`]), on the pool's slot next to its
//! batches and seeds and as durable as they are, so on Redis Cluster it is
//! reachable whenever the batch can be stocked at all. An index of the
//! pools whose outboxes hold something ([`OUTBOX_INDEX`]) tells the refill
//! worker where to look; it writes the outboxes to Postgres once Postgres
//! is back ([`keep_draining`]), and now and then looks through every
//! lucky-gift pool's outbox ([`sweep_outboxes`]), for a commitment whose
//! index entry could not be written (the index's node away at that
//! moment). The sealed `pool.refilled` event carries the
//! commitment too, but an event can be lost for good: a refill worker
//! killed after the batch became visible and before the event left, with
//! the batch used up (its seed revealed, so `commitment_again` has nothing
//! to tell) before the refill is delivered again. The outbox is not.

use std::time::Duration;

use redis::aio::ConnectionLike;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::record_batch;
use crate::{
    kinds::lucky_gift::{Commitment, Recorder},
    redis_conn::RedisConn,
    scripts::PoolKeys,
};

/// The suffix of the Redis key of the one outbox of earlier versions
/// (`<prefix>:fair-outbox`: a hash of `<pool>|<generation>` to the
/// commitment's JSON), drained as long as it holds anything.
pub const OUTBOX: &str = ":fair-outbox";

/// The suffix of the Redis key of the set of pools whose own outbox
/// ([`PoolKeys::fair_outbox`]) may hold commitments.
pub const OUTBOX_INDEX: &str = ":fair-outbox:pools";

/// Drain rounds between two sweeps of every pool's outbox (and one at the
/// start): about five minutes.
const SWEEP_EVERY: u32 = 150;

/// How long stocking waits for Postgres to take a commitment.
pub const RECORD_WAIT: Duration = Duration::from_millis(500);

/// After a commitment failed to reach Postgres, stocking stops trying for
/// this long: while Postgres is away each batch would otherwise wait
/// [`RECORD_WAIT`], and draws would meet a short pool. The outbox keeps
/// those commitments meanwhile.
const AWAY_FOR: Duration = Duration::from_secs(5);

/// How often the refill worker looks for commitments in the outbox.
const DRAIN_EVERY: Duration = Duration::from_secs(2);

/// Until when commitments skip each database (by host, port and name; see
/// [`AWAY_FOR`]).
static AWAY_UNTIL: std::sync::Mutex<Vec<(String, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

/// The refill worker's [`Recorder`]: writes each commitment to Postgres
/// before its batch becomes visible, or to the outbox in Redis when
/// Postgres is away, and keeps it for the `pool.refilled` event.
#[derive(Debug)]
pub struct PgRecorder<'a> {
    db: &'a PgPool,
    /// The Redis and key prefix of the outbox; without one (a `pool load`,
    /// which needs Postgres anyway) a commitment Postgres did not take
    /// reaches it through the `pool.refilled` event alone.
    outbox: Option<(RedisConn, String)>,
    last: std::sync::Mutex<Option<Commitment>>,
}

impl<'a> PgRecorder<'a> {
    /// A recorder writing to `db`.
    pub fn new(db: &'a PgPool) -> Self {
        Self {
            db,
            outbox: None,
            last: std::sync::Mutex::new(None),
        }
    }

    /// The recorder, keeping what Postgres does not take in the outbox of
    /// `redis` under `prefix`.
    pub fn with_outbox(mut self, redis: RedisConn, prefix: &str) -> Self {
        self.outbox = Some((redis, prefix.to_owned()));
        self
    }

    /// The last commitment recorded (for the `pool.refilled` event).
    pub fn take(&self) -> Option<Commitment> {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Puts `c` in the outbox, if this recorder has one.
    async fn keep(&self, c: &Commitment) {
        let Some((redis, prefix)) = &self.outbox else {
            return;
        };
        let json = match serde_json::to_string(c) {
            Ok(json) => json,
            Err(e) => {
                tracing::error!(pool = %c.pool, generation = c.generation, error = %e, "a commitment that does not serialise");
                return;
            }
        };
        match keep_in_outbox(redis, prefix, &c.pool, &c.generation.to_string(), &json).await {
            Ok(()) => {
                tracing::info!(
                    pool = %c.pool, generation = c.generation,
                    "commitment kept in the pool's Redis outbox until Postgres is back"
                );
            }
            // Stocking goes on through the same Redis: it fails and is tried
            // again (recording again) if Redis is away.
            Err(e) => tracing::warn!(
                pool = %c.pool, generation = c.generation, error = %e,
                "commitment not kept in the outbox; the pool.refilled event carries it"
            ),
        }
    }
}

impl Recorder for PgRecorder<'_> {
    async fn record(&self, c: &Commitment) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(c.clone());
        if database_away(self.db) {
            tracing::debug!(pool = %c.pool, generation = c.generation, "Postgres was away a moment ago");
            return self.keep(c).await;
        }
        match tokio::time::timeout(RECORD_WAIT, record_batch(self.db, c)).await {
            Ok(Ok(())) => mark_database(self.db, false),
            Ok(Err(e)) => {
                mark_database(self.db, true);
                tracing::warn!(
                    pool = %c.pool, generation = c.generation, error = %e,
                    "commitment not recorded in Postgres yet"
                );
                self.keep(c).await;
            }
            Err(_) => {
                mark_database(self.db, true);
                tracing::warn!(pool = %c.pool, generation = c.generation, "Postgres is slow");
                self.keep(c).await;
            }
        }
    }
}

/// The database's name in [`AWAY_UNTIL`]: host, port and database.
fn database_of(db: &PgPool) -> String {
    let options = db.connect_options();
    format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or_default()
    )
}

/// Whether commitments skip `db` now: it failed to take one less than
/// [`AWAY_FOR`] ago.
pub(crate) fn database_away(db: &PgPool) -> bool {
    let database = database_of(db);
    AWAY_UNTIL
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|(d, until)| *d == database && std::time::Instant::now() < *until)
}

/// Notes that `db` took a commitment (`away` false) or failed to (then
/// commitments skip it for [`AWAY_FOR`]).
pub(crate) fn mark_database(db: &PgPool, away: bool) {
    let database = database_of(db);
    let mut all = AWAY_UNTIL.lock().unwrap_or_else(|e| e.into_inner());
    let now = std::time::Instant::now();
    all.retain(|(d, t)| *d != database && *t > now);
    if away {
        all.push((database, now + AWAY_FOR));
    }
}

/// Keeps `json` under `field` in the outbox of `pool` (its own slot) and
/// names the pool in the index; an index that cannot be written is logged
/// (the sweep finds the outbox). The outbox's own write is the one that
/// counts: its error is returned.
pub(crate) async fn keep_in_outbox(
    redis: &RedisConn,
    prefix: &str,
    pool: &str,
    field: &str,
    json: &str,
) -> Result<(), redis::RedisError> {
    let mut conn = redis.clone();
    redis::cmd("HSET")
        .arg(PoolKeys::new(prefix, pool).fair_outbox())
        .arg(field)
        .arg(json)
        .query_async::<()>(&mut conn)
        .await?;
    let indexed: Result<(), redis::RedisError> = redis::cmd("SADD")
        .arg(format!("{prefix}{OUTBOX_INDEX}"))
        .arg(pool)
        .query_async(&mut conn)
        .await;
    if let Err(e) = indexed {
        tracing::warn!(
            %pool, %field, error = %e,
            "the outbox index is not reachable; the next sweep of the pools' outboxes finds the commitment"
        );
    }
    Ok(())
}

/// Writes the commitments kept under `prefix` to Postgres and takes each
/// out once it is there: those of the pools the index names, and those of
/// the outbox of earlier versions. Returns the number written. A row
/// already there is kept (the event may have brought it first).
pub async fn drain_outbox(db: &PgPool, redis: &RedisConn, prefix: &str) -> anyhow::Result<usize> {
    let mut conn = redis.clone();
    let index = format!("{prefix}{OUTBOX_INDEX}");
    let pools: Vec<String> = redis::cmd("SMEMBERS")
        .arg(&index)
        .query_async(&mut conn)
        .await?;
    let mut written = 0;
    for pool in pools {
        let outbox = PoolKeys::new(prefix, &pool).fair_outbox();
        written += drain_hash(db, redis, &outbox).await?;
        // Out of the index, then looked at again: a commitment kept
        // meanwhile put the pool back (its SADD follows its HSET), or is
        // seen here and the pool put back.
        redis::cmd("SREM")
            .arg(&index)
            .arg(&pool)
            .query_async::<()>(&mut conn)
            .await?;
        if hash_len(redis, &outbox).await? > 0 {
            redis::cmd("SADD")
                .arg(&index)
                .arg(&pool)
                .query_async::<()>(&mut conn)
                .await?;
        }
    }
    written += drain_hash(db, redis, &format!("{prefix}{OUTBOX}")).await?;
    Ok(written)
}

/// Writes the commitments in the outbox of every lucky-gift pool and
/// lottery activity Postgres knows (each sub-pool of a sharded pool) to
/// Postgres, index or not; the number written.
pub async fn sweep_outboxes(db: &PgPool, redis: &RedisConn, prefix: &str) -> anyhow::Result<usize> {
    let mut pools: Vec<(String, Option<i64>)> = sqlx::query_as(
        "SELECT DISTINCT v.pool_id, (v.config->>'shards')::bigint
           FROM pool_versions v JOIN pools p ON p.id = v.pool_id
          WHERE p.kind = $1",
    )
    .bind(crate::kinds::lucky_gift::KIND)
    .fetch_all(db)
    .await?;
    let activities: Vec<String> = sqlx::query_scalar("SELECT id FROM pools WHERE kind = $1")
        .bind(crate::kinds::lottery::KIND)
        .fetch_all(db)
        .await?;
    pools.extend(activities.into_iter().map(|a| (a, None)));
    let mut written = 0;
    for (pool, shards) in pools {
        let shards = u32::try_from(shards.unwrap_or(1)).map_or(1, |k| {
            k.clamp(1, crate::kinds::lucky_gift::config::MAX_SHARDS)
        });
        let ids = std::iter::once(pool.clone()).chain(
            (0..shards)
                .filter(|_| shards > 1)
                .map(|k| crate::kinds::lucky_gift::config::sub_pool_id(&pool, k)),
        );
        for id in ids {
            let outbox = PoolKeys::new(prefix, &id).fair_outbox();
            if hash_len(redis, &outbox).await? > 0 {
                written += drain_hash(db, redis, &outbox).await?;
            }
        }
    }
    Ok(written)
}

/// Writes the commitments of the outbox hash `key` to Postgres, taking
/// each out once it is there; the number written.
async fn drain_hash(db: &PgPool, redis: &RedisConn, key: &str) -> anyhow::Result<usize> {
    let mut conn = redis.clone();
    let kept: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(key)
        .query_async(&mut conn)
        .await?;
    let mut written = 0;
    for (field, json) in kept {
        // A lottery period's commitment (the activity's own outbox) or a
        // batch's: Some(recorded), or None when it does not read.
        let recorded = if field.starts_with(crate::kinds::lottery::seeds::OUTBOX_FIELD) {
            match serde_json::from_str::<crate::kinds::lottery::seeds::SeedCommitment>(&json) {
                Ok(c) => Some(crate::kinds::lottery::seeds::record_commitment(db, &c).await?),
                Err(e) => {
                    tracing::error!(%key, %field, error = %e, "a commitment in the outbox that does not read; dropped");
                    None
                }
            }
        } else {
            match serde_json::from_str::<Commitment>(&json) {
                Ok(c) => {
                    record_batch(db, &c).await?;
                    Some(true)
                }
                Err(e) => {
                    tracing::error!(%key, %field, error = %e, "a commitment in the outbox that does not read; dropped");
                    None
                }
            }
        };
        if recorded == Some(false) {
            tracing::error!(%key, %field, "another commitment is recorded for this period; the outbox's is dropped");
        }
        if recorded.is_some() {
            written += 1;
        }
        redis::cmd("HDEL")
            .arg(key)
            .arg(&field)
            .query_async::<()>(&mut conn)
            .await?;
    }
    Ok(written)
}

async fn hash_len(redis: &RedisConn, key: &str) -> Result<u64, redis::RedisError> {
    let mut conn = redis.clone();
    redis::cmd("HLEN").arg(key).query_async(&mut conn).await
}

/// Drains the outboxes every [`DRAIN_EVERY`] until `shutdown` (the refill
/// worker runs it), sweeping every pool's outbox at the start and every
/// [`SWEEP_EVERY`] rounds: a failure (Postgres still away) waits for the
/// next round.
pub async fn keep_draining(
    db: PgPool,
    redis: RedisConn,
    prefix: String,
    shutdown: CancellationToken,
) {
    let mut round = 0u32;
    loop {
        if round.is_multiple_of(SWEEP_EVERY) {
            // Lottery periods that ended with no draw after them (an
            // activity over) are revealed here.
            match crate::kinds::lottery::seeds::reveal_every_activity(&db, &redis, &prefix).await {
                Ok(n) if n > 0 => tracing::info!(seeds = n, "lottery seeds revealed"),
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = format!("{e:#}"), "lottery seeds not revealed yet")
                }
            }
        }
        let drained = if round.is_multiple_of(SWEEP_EVERY) {
            sweep_outboxes(&db, &redis, &prefix).await
        } else {
            Ok(0)
        };
        let drained = match drained {
            Ok(swept) if has_kept(&redis, &prefix).await => {
                drain_outbox(&db, &redis, &prefix).await.map(|n| n + swept)
            }
            other => other,
        };
        match drained {
            Ok(n) if n > 0 => tracing::info!(commitments = n, "outbox written to Postgres"),
            Ok(_) => {}
            Err(e) => tracing::debug!(error = format!("{e:#}"), "outbox not drained yet"),
        }
        round = round.wrapping_add(1);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(DRAIN_EVERY) => {}
        }
    }
}

/// Whether the index names a pool or the outbox of earlier versions holds
/// anything (one `SCARD`, one `HLEN`).
async fn has_kept<C: ConnectionLike + Send + Clone>(redis: &C, prefix: &str) -> bool {
    let mut conn = redis.clone();
    let indexed = redis::cmd("SCARD")
        .arg(format!("{prefix}{OUTBOX_INDEX}"))
        .query_async::<u64>(&mut conn)
        .await
        .is_ok_and(|n| n > 0);
    indexed
        || redis::cmd("HLEN")
            .arg(format!("{prefix}{OUTBOX}"))
            .query_async::<u64>(&mut conn)
            .await
            .is_ok_and(|n| n > 0)
}
