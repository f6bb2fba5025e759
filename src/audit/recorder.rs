//! A batch's commitment is on record before the batch is visible, with
//! Postgres or without it.
//!
//! The refill worker's [`PgRecorder`] writes each commitment to Postgres
//! (`fair_batches`) before its batch becomes visible. Stocking must not
//! wait for a Postgres that is away, so when Postgres does not take the
//! commitment within [`RECORD_WAIT`] the recorder keeps it in an outbox in
//! Redis instead ([`OUTBOX`], next to the pools and their seeds, and as
//! durable as they are), still before the batch is visible; the refill
//! worker writes the outbox to Postgres once Postgres is back
//! ([`keep_draining`]). The sealed `pool.refilled` event carries the
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
};

/// The suffix of the outbox's Redis key (`<prefix>:fair-outbox`): a hash of
/// `<pool>|<generation>` to the commitment's JSON.
pub const OUTBOX: &str = ":fair-outbox";

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
        let mut conn = redis.clone();
        let kept: Result<(), redis::RedisError> = redis::cmd("HSET")
            .arg(format!("{prefix}{OUTBOX}"))
            .arg(format!("{}|{}", c.pool, c.generation))
            .arg(json)
            .query_async(&mut conn)
            .await;
        match kept {
            Ok(()) => tracing::info!(
                pool = %c.pool, generation = c.generation,
                "commitment kept in the Redis outbox until Postgres is back"
            ),
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
        let options = self.db.connect_options();
        let database = format!(
            "{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or_default()
        );
        let away = |until: Option<std::time::Instant>| {
            let mut all = AWAY_UNTIL.lock().unwrap_or_else(|e| e.into_inner());
            let now = std::time::Instant::now();
            all.retain(|(d, t)| *d != database && *t > now);
            if let Some(until) = until {
                all.push((database.clone(), until));
            }
        };
        let skip = AWAY_UNTIL
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(d, until)| *d == database && std::time::Instant::now() < *until);
        if skip {
            tracing::debug!(pool = %c.pool, generation = c.generation, "Postgres was away a moment ago");
            return self.keep(c).await;
        }
        match tokio::time::timeout(RECORD_WAIT, record_batch(self.db, c)).await {
            Ok(Ok(())) => away(None),
            Ok(Err(e)) => {
                away(Some(std::time::Instant::now() + AWAY_FOR));
                tracing::warn!(
                    pool = %c.pool, generation = c.generation, error = %e,
                    "commitment not recorded in Postgres yet"
                );
                self.keep(c).await;
            }
            Err(_) => {
                away(Some(std::time::Instant::now() + AWAY_FOR));
                tracing::warn!(pool = %c.pool, generation = c.generation, "Postgres is slow");
                self.keep(c).await;
            }
        }
    }
}

/// Writes the commitments of the outbox under `prefix` to Postgres and
/// takes each out once it is there; the number written. A row already
/// there is kept (the event may have brought it first).
pub async fn drain_outbox(db: &PgPool, redis: &RedisConn, prefix: &str) -> anyhow::Result<usize> {
    let key = format!("{prefix}{OUTBOX}");
    let mut conn = redis.clone();
    let kept: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(&key)
        .query_async(&mut conn)
        .await?;
    let mut written = 0;
    for (field, json) in kept {
        match serde_json::from_str::<Commitment>(&json) {
            Ok(c) => {
                record_batch(db, &c).await?;
                written += 1;
            }
            Err(e) => {
                tracing::error!(%field, error = %e, "a commitment in the outbox that does not read; dropped")
            }
        }
        redis::cmd("HDEL")
            .arg(&key)
            .arg(&field)
            .query_async::<()>(&mut conn)
            .await?;
    }
    Ok(written)
}

/// Drains the outbox every [`DRAIN_EVERY`] until `shutdown` (the refill
/// worker runs it): a failure (Postgres still away) waits for the next
/// round.
pub async fn keep_draining(
    db: PgPool,
    redis: RedisConn,
    prefix: String,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(DRAIN_EVERY) => {}
        }
        if !has_kept(&redis, &prefix).await {
            continue;
        }
        match drain_outbox(&db, &redis, &prefix).await {
            Ok(n) if n > 0 => tracing::info!(commitments = n, "outbox written to Postgres"),
            Ok(_) => {}
            Err(e) => tracing::debug!(error = format!("{e:#}"), "outbox not drained yet"),
        }
    }
}

/// Whether the outbox holds anything (one `HLEN`).
async fn has_kept<C: ConnectionLike + Send + Clone>(redis: &C, prefix: &str) -> bool {
    let mut conn = redis.clone();
    redis::cmd("HLEN")
        .arg(format!("{prefix}{OUTBOX}"))
        .query_async::<u64>(&mut conn)
        .await
        .is_ok_and(|n| n > 0)
}
