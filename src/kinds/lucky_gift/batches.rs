//! Stocking one batch, whatever the pool's storage: claim a lease, write the
//! batch in chunks out of the draws' sight, then make it drawable in one
//! O(1) step. This module runs the protocol; the pool's [`Storage`](super::Storage) does
//! the Redis side of each step (`storage/list.rs`, `storage/sparse.rs`).
//!
//! Every batch is committed (`docs/fairness.md`): its order is derived from a
//! fresh secret seed, chosen once per batch and kept in Redis next to it
//! (`lua/fair_seed.lua`), so a retry or a takeover shuffles exactly the
//! batch whose commitment may already be recorded. The commitment is handed
//! to a [`Recorder`] before the first prize is written, and the commit step
//! keeps the seed in the pool's meta until a draw reveals it.
//!
//! # Races and ordering
//!
//! - **Who stocks.** One lease per pool (`stock_token`, `stock_until` in
//!   meta), tied to the trigger through `gen`: batch `trigger + 1` is
//!   stocked once however many requests name the trigger. Of concurrent
//!   attempts one claims; the others find `busy` (and wait for the lease
//!   to end or expire), then `done`. A request for a batch nobody asked for
//!   (no draw took the current batch's refill flag nor found the pool
//!   short: `due` in meta) is `not_due`; one for a batch past the last is
//!   `ahead`.
//! - **A dead attempt.** An attempt that stops halfway leaves part of a
//!   batch staged. The next claim, once the lease has expired, removes it
//!   before anything else; an attempt that retries under its own token
//!   takes its lease back at once (two live attempts must never share a
//!   token). Every write step checks the token first, so an attempt that
//!   lost its lease (it stalled past its lease and another took over)
//!   writes nothing more and ends with [`StockError::LeaseLost`].
//! - **The seed.** `fair_seed.lua` keeps the first seed chosen for the
//!   batch (`fair_next` in meta) and hands it to every later attempt, and
//!   the commit refuses a batch shuffled from any other: a takeover
//!   re-derives exactly the order whose commitment the first attempt may
//!   already have recorded.
//! - **Draws meanwhile.** Draws never see a staged prize: the list's draws
//!   touch only its first `visible` elements, the sparse draws only indices
//!   below `max_index`, and the commit raises that bound in the same step
//!   that records the batch's start (`bstart:<g>`) and seed (`c:<g>`), so a
//!   draw sees the whole batch or none of it. A draw running between the
//!   claim and the commit takes prizes of the earlier batches, or answers
//!   `short` while they are gone.
//! - **Chunks.** Each write is a separate Lua call of a few thousand
//!   prizes, so stocking millions never keeps Redis busy for more than
//!   about a millisecond at a time; each renews the lease.

use crate::kinds::lucky_gift::scripts as lua;
use redis::aio::ConnectionLike;

use super::{
    codes::{Batch, CodeTable},
    stocking::{Attempt, Claimed, Filling, StockError, StockOutcome},
    storage::Conn,
    PoolConfig,
};
use crate::{
    fairness::{self, ComboStock, Seed},
    scripts::PoolKeys,
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
    config.composition()
}

/// The seed of batch `trigger + 1`: the one an earlier attempt chose, or a
/// fresh one. `None` when the lease is lost.
async fn batch_seed<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    token: &str,
) -> Result<Option<Seed>, StockError> {
    let fresh = Seed::fresh().map_err(|e| StockError::Entropy(e.to_string()))?;
    let (status, seed): (String, String) = lua::FAIR_SEED
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

/// Stocks the batch that follows batch `trigger` (0 stocks the first batch),
/// unless it exists or is being stocked, as a fresh attempt.
#[allow(clippy::too_many_arguments)]
pub async fn stock_next<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    config: &PoolConfig,
    table: &CodeTable,
    trigger: u64,
    chunk: usize,
    lease_ms: i64,
) -> Result<StockOutcome, StockError> {
    let token = ulid::Ulid::new().to_string();
    stock_next_as(conn, keys, config, table, trigger, chunk, lease_ms, &token).await
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
/// commitment to `recorder` before anything of it is written.
#[allow(clippy::too_many_arguments)]
pub async fn stock_committed<C: ConnectionLike + Send, R: Recorder>(
    conn: &mut C,
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
    let storage = config.storage.layout();
    let mut conn = Conn(conn);
    let at = Attempt {
        keys,
        trigger,
        token,
        chunk: chunk.max(1),
        lease_ms,
    };
    let start = match storage.claim(&mut conn, &at).await? {
        Claimed::At(start) => start,
        Claimed::Not(outcome) => return Ok(outcome),
    };
    // Shuffling happens after the claim so duplicate requests cost nothing.
    let Some(seed) = batch_seed(&mut conn, keys, token).await? else {
        return Err(StockError::LeaseLost);
    };
    let batch = committed_batch(config, table, version, trigger, &seed, recorder).await;
    storage
        .fill(
            &mut conn,
            &at,
            &Filling {
                batch: &batch,
                table,
                seed: &seed,
                version,
                start,
            },
        )
        .await
}
