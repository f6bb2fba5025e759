//! Stocking one batch: claim a lease, push the batch in chunks behind the
//! visible prizes, then make it visible in one O(1) step.
//!
//! Every batch is committed (`docs/fairness.md`): its order is derived from a
//! fresh secret seed, chosen once per batch and kept in Redis next to it
//! (`lua/fair_seed.lua`), so a retry or a takeover shuffles exactly the
//! batch whose commitment may already be recorded. The commitment is handed
//! to a [`Recorder`] before the first prize is pushed, and the commit step
//! keeps the seed in the pool's meta until a draw reveals it.
//!
//! Each chunk is a separate Lua call of a few thousand elements, so stocking
//! millions of prizes never keeps Redis busy for more than about a
//! millisecond at a time. Draws cannot see a half-stocked batch: they only
//! touch the first `visible` elements of the list.

use std::time::Duration;

use redis::aio::ConnectionLike;

use super::{Batch, CodeTable, PoolConfig};
use crate::{
    fairness::{self, ComboStock, Seed},
    scripts::{now_ms, PoolKeys, Scripts},
};

/// What a batch commits to before it becomes visible: published in
/// `pool.refilled` and recorded in Postgres (`fair_batches`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Commitment {
    pub pool: String,
    pub generation: u64,
    /// The config version whose composition the batch holds (part of the
    /// shuffle's context).
    pub version: i64,
    /// `SHA-256(seed)`, 64 lowercase hex digits.
    pub commitment: String,
    pub size: u64,
    /// The combos in configuration order, each its (multiplier, count)
    /// pairs in order: the input of the derivation.
    pub composition: Vec<ComboStock>,
}

/// Takes a batch's commitment before the batch becomes visible.
pub trait Recorder: Sync {
    /// Records `commitment`. Failures are the recorder's to handle (and to
    /// make up for later): stocking goes on, so draws are never blocked.
    fn record(&self, commitment: &Commitment) -> impl std::future::Future<Output = ()> + Send;
}

/// Records nothing: the commitment stays in Redis and reaches Postgres
/// through the reveal only (tests, the bench, the first batch of a load).
impl Recorder for () {
    async fn record(&self, _: &Commitment) {}
}

/// The composition of `config`, as the derivation reads it.
pub fn composition(config: &PoolConfig) -> Vec<ComboStock> {
    config
        .combos
        .iter()
        .map(|c| ComboStock {
            combo: c.id.clone(),
            stock: c.stock.clone(),
        })
        .collect()
}

/// The seed of batch `trigger + 1`: the one an earlier attempt chose, or a
/// fresh one. `None` when the lease is lost.
async fn batch_seed<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    token: &str,
) -> Result<Option<Seed>, StockError> {
    let fresh = Seed::fresh().map_err(|e| StockError::Entropy(e.to_string()))?;
    let (status, seed): (String, String) = scripts
        .fair_seed
        .key(keys.meta())
        .arg(token)
        .arg(fresh.to_hex())
        .invoke_async(conn)
        .await?;
    if status != "ok" {
        return Ok(None);
    }
    Seed::from_hex(&seed)
        .map(Some)
        .ok_or_else(|| StockError::Entropy(format!("a malformed pending seed in {}", keys.meta())))
}

/// Shuffles the batch after `trigger` from its seed and hands its
/// commitment to `recorder`.
#[allow(clippy::too_many_arguments)]
async fn committed_batch<R: Recorder>(
    config: &PoolConfig,
    table: &CodeTable,
    version: i64,
    trigger: u64,
    seed: &Seed,
    recorder: &R,
) -> Batch {
    let generation = trigger + 1;
    let context = fairness::lucky_gift_context(&config.id, generation, version);
    let batch = Batch::build_fair(config, table, &mut seed.stream(&context));
    recorder
        .record(&Commitment {
            pool: config.id.clone(),
            generation,
            version,
            commitment: seed.commitment(),
            size: batch.codes.len() as u64,
            composition: composition(config),
        })
        .await;
    batch
}

/// How long a stocking attempt may go quiet before another may take over.
pub const DEFAULT_LEASE_MS: i64 = 30_000;

/// What a stocking request achieved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StockOutcome {
    /// This call stocked batch `generation` of `size` prizes.
    Stocked { generation: u64, size: usize },
    /// The batch after the trigger existed already (a duplicate request).
    AlreadyDone { generation: u64 },
    /// Another live attempt is stocking it; ask again after `retry_in`.
    Busy { retry_in: Duration },
    /// The trigger names a batch that was never stocked: a bogus request.
    Ahead { generation: u64 },
    /// Batch `generation` is the current one, but no draw took its refill
    /// flag or found the pool short: nobody asked for its successor.
    NotDue { generation: u64 },
    /// No pool under these keys.
    Unknown,
}

/// A stocking step failed.
#[derive(Debug, thiserror::Error)]
pub enum StockError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("another attempt took over the stocking lease")]
    LeaseLost,
    #[error("the stocked tail holds {pushed} prizes, expected {expected}")]
    Mismatch { pushed: i64, expected: usize },
    #[error("no batch seed: {0}")]
    Entropy(String),
}

/// What a `begin` step answered when it did not hand us the lease.
fn unclaimed(status: &str, number: i64) -> Option<StockOutcome> {
    match status {
        "claimed" => None,
        "done" => Some(StockOutcome::AlreadyDone {
            generation: number.unsigned_abs(),
        }),
        "busy" => Some(StockOutcome::Busy {
            retry_in: Duration::from_millis(number.clamp(10, 1000) as u64),
        }),
        "ahead" => Some(StockOutcome::Ahead {
            generation: number.unsigned_abs(),
        }),
        "not_due" => Some(StockOutcome::NotDue {
            generation: number.unsigned_abs(),
        }),
        _ => Some(StockOutcome::Unknown),
    }
}

/// Stocks the batch that follows batch `trigger` (0 stocks the first batch),
/// unless it exists or is being stocked, as a fresh attempt.
#[allow(clippy::too_many_arguments)]
pub async fn stock_next<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    config: &PoolConfig,
    table: &CodeTable,
    trigger: u64,
    chunk: usize,
    lease_ms: i64,
) -> Result<StockOutcome, StockError> {
    let token = ulid::Ulid::new().to_string();
    stock_next_as(
        conn, scripts, keys, config, table, trigger, chunk, lease_ms, &token,
    )
    .await
}

/// [`stock_next`] as the attempt named `token`. An attempt that failed
/// halfway (its server went away) and tries again under the same token
/// takes its own lease back at once, trimming what it left, instead of
/// waiting for the lease to expire; two attempts running at once must never
/// share a token. The batch is committed under the config version stored
/// in Redis: for callers that stock the stored config.
#[allow(clippy::too_many_arguments)]
pub async fn stock_next_as<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    config: &PoolConfig,
    table: &CodeTable,
    trigger: u64,
    chunk: usize,
    lease_ms: i64,
    token: &str,
) -> Result<StockOutcome, StockError> {
    let version: Option<i64> = redis::cmd("HGET")
        .arg(keys.meta())
        .arg("version")
        .query_async(conn)
        .await?;
    stock_committed(
        conn,
        scripts,
        keys,
        config,
        version.unwrap_or(0),
        table,
        trigger,
        chunk,
        lease_ms,
        token,
        &(),
    )
    .await
}

/// Stocks the batch after `trigger` from `config` of `version`, as the
/// attempt named `token` (see [`stock_next_as`]), handing the batch's
/// commitment to `recorder` before anything of it is pushed.
#[allow(clippy::too_many_arguments)]
pub async fn stock_committed<C: ConnectionLike + Send, R: Recorder>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    config: &PoolConfig,
    version: i64,
    table: &CodeTable,
    trigger: u64,
    chunk: usize,
    lease_ms: i64,
    token: &str,
    recorder: &R,
) -> Result<StockOutcome, StockError> {
    if config.storage == super::Storage::Sparse {
        return stock_sparse(
            conn, scripts, keys, config, version, table, trigger, chunk, lease_ms, token, recorder,
        )
        .await;
    }
    let (status, number): (String, i64) = scripts
        .stock_begin
        .key(keys.meta())
        .key(keys.queue())
        .arg(trigger)
        .arg(token)
        .arg(now_ms())
        .arg(lease_ms)
        .invoke_async(conn)
        .await?;
    if let Some(outcome) = unclaimed(&status, number) {
        return Ok(outcome);
    }

    // A dead attempt may have left part of a batch behind the visible prizes.
    let mut stale = number;
    while stale > 0 {
        stale = scripts
            .stock_trim
            .key(keys.meta())
            .key(keys.queue())
            .arg(token)
            .arg(chunk)
            .invoke_async(conn)
            .await?;
        if stale < 0 {
            return Err(StockError::LeaseLost);
        }
    }

    // Shuffling happens after the claim so duplicate requests cost nothing.
    let Some(seed) = batch_seed(conn, scripts, keys, token).await? else {
        return Err(StockError::LeaseLost);
    };
    let batch = committed_batch(config, table, version, trigger, &seed, recorder).await;
    let size = batch.codes.len();
    let elements: Vec<String> = batch.elements(trigger + 1).collect();
    for piece in elements.chunks(chunk.max(1)) {
        let pushed: i64 = scripts
            .stock_push
            .key(keys.meta())
            .key(keys.queue())
            .arg(token)
            .arg(now_ms())
            .arg(lease_ms)
            .arg(piece)
            .invoke_async(conn)
            .await?;
        if pushed < 0 {
            return Err(StockError::LeaseLost);
        }
    }
    let (status, number): (String, i64) = scripts
        .stock_commit
        .key(keys.meta())
        .key(keys.queue())
        .arg(token)
        .arg(trigger)
        .arg(size)
        .arg(seed.to_hex())
        .arg(version)
        .invoke_async(conn)
        .await?;
    match status.as_str() {
        "ok" => {}
        "mismatch" => {
            return Err(StockError::Mismatch {
                pushed: number,
                expected: size,
            })
        }
        _ => return Err(StockError::LeaseLost),
    }
    Ok(StockOutcome::Stocked {
        generation: number.unsigned_abs(),
        size,
    })
}

/// Stocks the next batch of a sparse pool: only non-zero prizes are written,
/// in buckets of [`super::SPARSE_BUCKET`] indices, behind `max_index`.
#[allow(clippy::too_many_arguments)]
async fn stock_sparse<C: ConnectionLike + Send, R: Recorder>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    config: &PoolConfig,
    version: i64,
    table: &CodeTable,
    trigger: u64,
    chunk: usize,
    lease_ms: i64,
    token: &str,
    recorder: &R,
) -> Result<StockOutcome, StockError> {
    let step = |name: &'static str| {
        let mut inv = scripts.sparse_stock.prepare_invoke();
        inv.key(keys.meta())
            .key(keys.sparse())
            .key(keys.segments())
            .key(keys.flags())
            .arg(name);
        inv
    };
    let (status, number): (String, i64) = step("begin")
        .arg(token)
        .arg(trigger)
        .arg(now_ms())
        .arg(lease_ms)
        .invoke_async(conn)
        .await?;
    if let Some(outcome) = unclaimed(&status, number) {
        return Ok(outcome);
    }
    let start = number.unsigned_abs();
    // Clean up what a dead attempt may have staged, a few buckets per step.
    loop {
        let (status, left): (String, i64) = step("trim")
            .arg(token)
            .arg((chunk / 8).max(1))
            .arg(super::SPARSE_BUCKET)
            .invoke_async(conn)
            .await?;
        if status != "ok" {
            return Err(StockError::LeaseLost);
        }
        if left == 0 {
            break;
        }
    }
    let Some(seed) = batch_seed(conn, scripts, keys, token).await? else {
        return Err(StockError::LeaseLost);
    };
    let batch = committed_batch(config, table, version, trigger, &seed, recorder).await;
    let size = batch.codes.len();
    let zero: std::collections::HashSet<u32> = (0..table.len() as u32)
        .filter(|c| table.decode(*c).is_some_and(|(_, m)| m == 0))
        .collect();
    // (bucket, "<off>.<code>;...") in index order, flushed every `chunk` prizes.
    let mut pending: Vec<(u64, String)> = Vec::new();
    let mut in_chunk = 0usize;
    let mut nonzero = 0usize;
    for (i, &code) in batch.codes.iter().enumerate() {
        if zero.contains(&code) {
            continue;
        }
        let index = start + i as u64;
        let (bucket, off) = (index / super::SPARSE_BUCKET, index % super::SPARSE_BUCKET);
        match pending.last_mut() {
            Some((b, text)) if *b == bucket => text.push_str(&format!("{off}.{code};")),
            _ => pending.push((bucket, format!("{off}.{code};"))),
        }
        in_chunk += 1;
        nonzero += 1;
        if in_chunk >= chunk {
            push_sparse(
                conn,
                scripts,
                keys,
                token,
                lease_ms,
                std::mem::take(&mut pending),
            )
            .await?;
            in_chunk = 0;
        }
    }
    if !pending.is_empty() {
        push_sparse(conn, scripts, keys, token, lease_ms, pending).await?;
    }
    let segments: Vec<String> = batch
        .combos
        .iter()
        .map(|(combo, s, _)| {
            let zero = table.code_of(combo, 0).map_or(-1, i64::from);
            format!("{}:{zero}", start + *s as u64)
        })
        .collect();
    let (status, number): (String, i64) = step("commit")
        .arg(token)
        .arg(trigger)
        .arg(size)
        .arg(nonzero)
        .arg(start + batch.flag_at as u64)
        .arg(seed.to_hex())
        .arg(version)
        .arg(&segments)
        .invoke_async(conn)
        .await?;
    match status.as_str() {
        "ok" => Ok(StockOutcome::Stocked {
            generation: number.unsigned_abs(),
            size,
        }),
        "mismatch" => Err(StockError::Mismatch {
            pushed: number,
            expected: nonzero,
        }),
        _ => Err(StockError::LeaseLost),
    }
}

async fn push_sparse<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    token: &str,
    lease_ms: i64,
    buckets: Vec<(u64, String)>,
) -> Result<(), StockError> {
    let mut inv = scripts.sparse_stock.prepare_invoke();
    inv.key(keys.meta())
        .key(keys.sparse())
        .key(keys.segments())
        .key(keys.flags());
    inv.arg("push").arg(token).arg(now_ms()).arg(lease_ms);
    for (bucket, text) in &buckets {
        inv.arg(bucket).arg(text);
    }
    let (status, _): (String, i64) = inv.invoke_async(conn).await?;
    if status != "ok" {
        return Err(StockError::LeaseLost);
    }
    Ok(())
}
