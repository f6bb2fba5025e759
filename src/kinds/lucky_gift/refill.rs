//! A lucky-gift pool's refill: stocking the batch after the one a draw
//! took the refill flag of (or found short). The refill worker's queue
//! carries the `refill` requests and hands them here; the worker seals and
//! publishes what comes back.
//!
//! A request names its trigger (the batch that asked), and the stocking
//! steps in Redis compare it with the pool's batch counter, so any number of
//! duplicate or concurrent requests for one trigger stock exactly one batch.
//!
//! # Races and ordering
//!
//! - **Duplicate and concurrent requests.** Draws send a refill request for
//!   every refill flag they take, again on every replay, and an urgent one
//!   when they find the pool short, so a batch is usually asked for more
//!   than once. One attempt claims the pool's stocking lease; the others
//!   find it `busy` and poll until the batch exists (then `done`: answered
//!   like the stocking itself) or the lease expires (then one of them takes
//!   over), giving up as a transient error after twice the lease.
//! - **Within one worker.** Requests for the same pool and trigger share one
//!   attempt and its token ([`Attempts`]), and wait for each other; the
//!   token is kept across a Redis failure, so the attempt's retry takes its
//!   own lease back at once instead of waiting for it to expire.
//! - **A worker killed mid-stock.** Its lease expires; the next attempt
//!   trims what it staged and stocks the batch from the same seed, so the
//!   commitment it may already have recorded still holds
//!   ([`super::stock_committed`]).
//! - **A worker killed after the commit, before publishing.** The
//!   redelivered request finds the batch `done` and publishes its
//!   `pool.refilled` again, commitment included, while the batch's seed is
//!   still secret; consumers key the event by pool and generation.
//! - **Postgres away.** The commitment is recorded before the batch is
//!   visible when Postgres answers in time, and skipped otherwise: stocking
//!   goes on from the config kept in Redis, and the event carries the
//!   commitment to Postgres later.
//! - **A refill racing draws.** Draws see the new batch all at once, when
//!   its commit step runs; until then they take what is left or answer
//!   short (see [`super`]).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use sqlx::PgPool;

use super::{
    composition, stock_committed, stored_config, CodeTable, Commitment, PoolConfig, Recorder,
    StockError, StockOutcome, DEFAULT_LEASE_MS,
};
use crate::{
    amqp::{HandleError, Outgoing},
    kinds::registry::{Life, LifeStep, Lifecycle},
    ledger::Unsealed,
    messages::{
        decode_payload, typed_json, Invalid, PoolRefilled, RefillRequest, RefillResult, Status,
    },
    redis_conn::RedisConn,
    scripts::{PoolKeys, Scripts},
};

/// The refill queue's lucky-gift message: `refill`. It needs no Postgres
/// (a commitment it cannot record goes to the outbox).
pub(super) const LIFECYCLE: &[Lifecycle] = &[Lifecycle {
    message: "refill",
    reply: "refill_result",
    postgres: false,
    handle: handle_refill,
}];

fn handle_refill<'a>(life: &'a Life<'a>, envelope: &'a serde_json::Value) -> LifeStep<'a> {
    Box::pin(step(life, envelope))
}

/// Stocks the batch after the request's trigger, unless it exists
/// ([`refill`]), its commitment recorded in Postgres (or the outbox in
/// Redis) before the batch is visible; then its reply and the sealed
/// `pool.refilled` events.
async fn step(life: &Life<'_>, envelope: &serde_json::Value) -> Result<Unsealed, HandleError> {
    let req: RefillRequest = decode_payload(envelope)?;
    let Some(attempts) = life.state::<Attempts>() else {
        return Err(HandleError::internal("a refill got another kind's state"));
    };
    let prefix = &life.config.redis_prefix;
    let at = Refill {
        db: life.db,
        redis: life.redis,
        scripts: life.scripts,
        prefix,
        chunk: life.config.refill_chunk,
        attempts,
    };
    let recorder = crate::audit::PgRecorder::new(life.db).with_outbox(life.redis.clone(), prefix);
    let refilled = refill(&at, &recorder, req).await?;
    let mut effects = Vec::with_capacity(refilled.events.len());
    for event in &refilled.events {
        effects.push(refilled_event(life, event).await?);
    }
    Ok(Unsealed {
        reply: Some(refilled.reply),
        effects,
        ..Unsealed::default()
    })
}

/// The `pool.refilled` event of `event`, sealed with the fleet's key so
/// the audit trail believes it whatever the pool's state is by the time
/// it reads it.
async fn refilled_event(life: &Life<'_>, event: &PoolRefilled) -> Result<Outgoing, HandleError> {
    let mut conn = life.redis.clone();
    let sealer = life.sealer.get(&mut conn, life.config).await?;
    let body =
        crate::audit::pool_refilled(&sealer, event).map_err(|e| HandleError::Internal(e.into()))?;
    Ok(Outgoing::event_raw("pool.refilled", body))
}

/// Most pool-and-trigger attempts a worker remembers; past it the memory
/// starts over (a forgotten attempt only waits for its own lease).
const MAX_ATTEMPTS: usize = 10_000;

/// A stocking attempt's token, held while the attempt runs.
type Token = Arc<tokio::sync::Mutex<String>>;

/// The stocking attempt (its token) of each pool and trigger a worker is
/// working on.
#[derive(Debug, Default)]
pub struct Attempts(Mutex<HashMap<(String, u64), Token>>);

impl Attempts {
    /// The attempt at stocking the batch after `trigger` of `pool`: one
    /// token, kept until the batch exists.
    fn token(&self, pool: &str, trigger: u64) -> Token {
        let mut attempts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if attempts.len() >= MAX_ATTEMPTS {
            attempts.clear();
        }
        attempts
            .entry((pool.to_owned(), trigger))
            .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(ulid::Ulid::new().to_string())))
            .clone()
    }

    /// Forgets the attempt at the batch after `trigger` of `pool`: it is over.
    fn end(&self, pool: &str, trigger: u64) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(pool.to_owned(), trigger));
    }
}

/// What a refill uses of the worker that runs it.
#[derive(Debug)]
pub struct Refill<'a> {
    pub db: &'a PgPool,
    pub redis: &'a RedisConn,
    pub scripts: &'a Scripts,
    /// `REDIS_PREFIX`.
    pub prefix: &'a str,
    /// Most prizes one stocking step writes (`REFILL_CHUNK`).
    pub chunk: usize,
    pub attempts: &'a Attempts,
}

/// What a refill answers: its `refill_result` reply and the `pool.refilled`
/// events to seal and publish before it.
#[derive(Debug)]
pub struct Refilled {
    pub reply: Vec<u8>,
    pub events: Vec<PoolRefilled>,
}

/// The config a pool's batches are stocked from: its version, its rules and
/// its code table.
struct Stocked {
    version: i64,
    pool: PoolConfig,
    table: CodeTable,
}

/// Stocks the batch after `req.trigger`, unless it exists, recording its
/// commitment through `recorder` before the batch is visible.
pub async fn refill<R: Recorder>(
    at: &Refill<'_>,
    recorder: &R,
    req: RefillRequest,
) -> Result<Refilled, HandleError> {
    let started = Instant::now();
    req.validate()?;
    let keys = PoolKeys::new(at.prefix, &req.pool);
    let stocked = stocked_config(at, &keys, &req.pool).await?;
    // Another attempt may hold the lease; wait for it to finish (then the
    // batch exists) or to die (then its lease expires and we take over).
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(2 * DEFAULT_LEASE_MS.unsigned_abs());
    // This worker's attempt at this trigger, under one token across
    // retries: after a Redis failure halfway, the retry takes its own
    // lease back at once. Requests for the same trigger in this worker
    // wait for each other (and then find the batch stocked).
    let attempt = at.attempts.token(&req.pool, req.trigger);
    let token = attempt.lock().await;
    loop {
        let (outcome, committed) = stock(at, recorder, &keys, &stocked, &req, &token).await;
        // The attempt is over unless it waits for another one or meets a
        // server that is away (then it tries again under its token).
        if !matches!(outcome, Ok(StockOutcome::Busy { .. }) | Err(_)) {
            at.attempts.end(&req.pool, req.trigger);
        }
        match outcome {
            Ok(StockOutcome::Stocked { generation, size }) => {
                tracing::info!(pool = %req.pool, generation, size, urgent = req.urgent, "batch stocked");
                metrics::counter!("prizepool_batches_stocked_total").increment(1);
                // From the refill request's arrival to the batch drawable.
                metrics::histogram!("prizepool_refill_seconds")
                    .record(started.elapsed().as_secs_f64());
                let event = PoolRefilled {
                    pool: req.pool.clone(),
                    generation,
                    size,
                    version: stocked.version,
                    urgent: req.urgent,
                    commitment: committed.as_ref().map(|c| c.commitment.clone()),
                    composition: committed.map(|c| c.composition),
                };
                return Ok(Refilled {
                    reply: refilled(&req.pool, generation),
                    events: vec![event],
                });
            }
            Ok(StockOutcome::AlreadyDone { generation }) => {
                return already_done(at, &keys, &stocked, &req, generation).await
            }
            Ok(StockOutcome::Busy { retry_in }) => {
                if tokio::time::Instant::now() > deadline {
                    return Err(anyhow::anyhow!(
                        "pool {} is still being stocked by another attempt",
                        req.pool
                    )
                    .into());
                }
                tokio::time::sleep(retry_in.min(Duration::from_millis(50))).await;
            }
            Ok(other) => return Err(not_stocked(&req, other)),
            Err(StockError::Redis(e)) => return Err(e.into()),
            Err(e) => return Err(anyhow::Error::from(e).into()),
        }
    }
}

/// The config pool `id` is stocked from. It comes from Redis, where `pool
/// load` writes it next to the pool's counters, so a Postgres outage does
/// not stop refills; pools loaded before the config was kept in Redis read
/// it from the registry. A sharded pool holds no prizes of its own (its
/// sub-pools do, each asking for its own batches): a refill naming it is
/// invalid.
async fn stocked_config(
    at: &Refill<'_>,
    keys: &PoolKeys,
    id: &str,
) -> Result<Stocked, HandleError> {
    let mut conn = at.redis.clone();
    let stored = stored_config(&mut conn, keys)
        .await
        .map_err(HandleError::classify)?;
    let (version, pool, table) = match stored {
        Some(stored) => stored,
        None => match latest(at.db, id).await? {
            Some((version, pool, table)) => (i64::from(version), pool, table),
            None => return Err(Invalid::new(format!("no lucky-gift pool named {id}")).into()),
        },
    };
    if pool.shards > 1 {
        return Err(Invalid::new(format!(
            "{id} is stocked as {} sub-pools; a refill names one of them",
            pool.shards
        ))
        .into());
    }
    Ok(Stocked {
        version,
        pool,
        table,
    })
}

/// The latest configuration of lucky-gift pool `pool` in the pool registry,
/// and its code table.
pub async fn latest(
    db: &PgPool,
    pool: &str,
) -> Result<Option<(i32, PoolConfig, CodeTable)>, sqlx::Error> {
    let row: Option<(i32, sqlx::types::Json<PoolConfig>, sqlx::types::Json<CodeTable>)> = sqlx::query_as(
        "SELECT version, config, codes FROM pool_versions WHERE pool_id = $1 ORDER BY version DESC LIMIT 1",
    )
    .bind(pool)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(v, c, t)| (v, c.0, t.0)))
}

/// One stocking step of the attempt holding `token`, and the commitment it
/// recorded (none when it stocked nothing).
async fn stock<R: Recorder>(
    at: &Refill<'_>,
    recorder: &R,
    keys: &PoolKeys,
    stocked: &Stocked,
    req: &RefillRequest,
    token: &str,
) -> (Result<StockOutcome, StockError>, Option<Commitment>) {
    let mut conn = at.redis.clone();
    let keeping = Keeping {
        inner: recorder,
        last: Mutex::new(None),
    };
    let outcome = stock_committed(
        &mut conn,
        keys,
        &stocked.pool,
        stocked.version,
        &stocked.table,
        req.trigger,
        at.chunk,
        DEFAULT_LEASE_MS,
        token,
        &keeping,
    )
    .await;
    let committed = keeping
        .last
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    (outcome, committed)
}

/// Passes commitments on and keeps the last one, for the `pool.refilled`
/// event of the batch.
struct Keeping<'r, R> {
    inner: &'r R,
    last: Mutex<Option<Commitment>>,
}

impl<R: Recorder> Recorder for Keeping<'_, R> {
    async fn record(&self, commitment: &Commitment) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(commitment.clone());
        self.inner.record(commitment).await;
    }
}

/// The answer to a request for a batch that exists: the attempt that
/// stocked it may have died before its `pool.refilled` left (a redelivery
/// lands here), so the commitment is told again while the batch is still
/// secret.
async fn already_done(
    at: &Refill<'_>,
    keys: &PoolKeys,
    stocked: &Stocked,
    req: &RefillRequest,
    generation: u64,
) -> Result<Refilled, HandleError> {
    tracing::debug!(pool = %req.pool, trigger = req.trigger, generation, "duplicate refill request");
    let events = commitment_again(at, keys, stocked, req.trigger + 1)
        .await?
        .into_iter()
        .collect();
    Ok(Refilled {
        reply: refilled(&req.pool, generation),
        events,
    })
}

/// The `pool.refilled` event of batch `generation` once more, with its
/// commitment, if its seed is still secret and it was stocked under the
/// version `stocked` holds. Consumers key it by pool and generation, so a
/// repeat records nothing twice.
async fn commitment_again(
    at: &Refill<'_>,
    keys: &PoolKeys,
    stocked: &Stocked,
    generation: u64,
) -> Result<Option<PoolRefilled>, HandleError> {
    let mut conn = at.redis.clone();
    let record: Option<String> = redis::cmd("HGET")
        .arg(keys.meta())
        .arg(format!("c:{generation}"))
        .query_async(&mut conn)
        .await?;
    let Some((stocked_under, seed)) = record.as_deref().and_then(|r| r.split_once('|')) else {
        return Ok(None);
    };
    let Some(seed) = crate::fairness::Seed::from_hex(seed) else {
        return Ok(None);
    };
    if stocked_under.parse::<i64>().ok() != Some(stocked.version) {
        return Ok(None);
    }
    Ok(Some(PoolRefilled {
        pool: stocked.pool.id.clone(),
        generation,
        size: stocked.pool.batch_size() as usize,
        version: stocked.version,
        urgent: false,
        commitment: Some(seed.commitment()),
        composition: Some(composition(&stocked.pool)),
    }))
}

/// Why a request for a batch that stocked nothing is invalid: its trigger
/// is past the pool, the batch is not due, or the pool is not in Redis.
fn not_stocked(req: &RefillRequest, outcome: StockOutcome) -> HandleError {
    let message = match outcome {
        StockOutcome::Ahead { generation } => format!(
            "trigger {} is past the last batch {generation} of pool {}",
            req.trigger, req.pool
        ),
        StockOutcome::NotDue { generation } => format!(
            "batch {generation} of pool {} is not due for a refill: no draw took its refill point and the pool is not short",
            req.pool
        ),
        StockOutcome::Unknown => format!("pool {} is not in Redis (load it again)", req.pool),
        other => {
            return HandleError::internal(format!(
                "stocking pool {} answered {other:?} where no batch was stocked",
                req.pool
            ))
        }
    };
    Invalid::new(message).into()
}

/// The `ok` reply to a refill: `pool` is at batch `generation`.
fn refilled(pool: &str, generation: u64) -> Vec<u8> {
    typed_json(
        "refill_result",
        &RefillResult {
            status: Status::Ok,
            pool: pool.to_owned(),
            generation,
            error: None,
        },
    )
}
