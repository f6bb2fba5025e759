//! Lucky-gift multiplier pools (SPEC §3): configuration ([`config`]),
//! prize codes ([`codes`]), batch stocking ([`batches`]), the jackpot rule
//! ([`jackpot`]), the atomic draw ([`draw`], [`Coalescer`]) and the two
//! storages a pool may keep its prizes in ([`Storage`]: `storage/list.rs`,
//! `storage/sparse.rs`, each with the layout of its own keys).
//!
//! Redis keys every storage shares (pool `id`, all under the hash tag `{id}`):
//!
//! | key    | type   | holds |
//! |--------|--------|-------|
//! | `meta` | hash   | settings (`unit_price`, `storage`, jackpot rule, `codes`, `config`, `v<version>`) and counters (`gen`, `stocked`, `drawn`, `due`, `spent` (the day's consumption, `"<day>:<amount>"`), `held_n`, the storage's own, stocking lease, fairness record with cached batch starts `hs`/`ns`, the realised-RTP tally `mults`/`tally`/`rtp:<v>`, see [`rtp`]), and the answer store's epochs (`ep`, binary): a draw reads them in one `HMGET` and writes in one `HSET` |
//! | `held` | list   | gated jackpots, first in line for the first draw that may win them |
//! | `spent:YYYYMMDD` | string | the day's consumption as an earlier version kept it, read on a day's first draw only |
//! | `rs:e<epoch>:<i>`, `rs:x:<digest>` | hash, string | the answer store: every draw's answer as a record named by 16 bytes of SHA-256 (see [`crate::kinds::answer`], `lua/lib/answer.lua`); an award stored as `"<serial>\|<version>\|<trigger>\|<codes>"`, codes as runs (`lua/lib/award.lua`) |
//!
//! Conservation holds at every instant because each Lua step moves counters
//! together: `stocked = drawn + drawable + len(held)`, where the storage
//! counts what is drawable (`visible`, or `max_index − cur`).
//!
//! # Races and ordering
//!
//! - **Concurrent draws of one pool.** Each draw is one Lua step that
//!   replays, refuses, answers short or takes all its prizes, and Redis
//!   runs one step at a time: draws of a pool are applied one after
//!   another and never see each other half done. A worker coalesces the
//!   draws of a pool it has in flight into one call ([`Coalescer`]); the
//!   call applies them in queue order, each exactly as its own call would.
//!   Draws of two workers interleave call by call, in whatever order their
//!   calls reach Redis.
//! - **A refill racing a draw.** A batch is written out of the draws' sight
//!   and made drawable in one step ([`batches`]), so a draw sees all of it
//!   or none. A draw that finds too few prizes answers `short`, moves
//!   nothing and marks the current batch `due`; the draw worker then asks
//!   for an urgent refill and steps again. Only a batch marked `due` (by a
//!   short draw or by the draw that took its refill flag) gets a successor,
//!   so a forged or stale refill request stocks nothing.
//! - **A retry of the same request.** The step stores its answer with its
//!   effect, atomically; a retry (a redelivery, a client resend) replays
//!   the stored answer and moves nothing. The replay carries the same
//!   serial, so its ledger entry has the same id and the ledger applies it
//!   once, and the same refill trigger, which the refill worker stocks once.
//! - **A worker killed between the Lua step and the publish.** The step's
//!   effect and answer are in Redis; the request was not acked, so the
//!   broker redelivers it, and the replay publishes the reply, the ledger
//!   entry, the refill request and the event the first attempt never sent.
//!   The answer is kept for the request's result TTL: a request redelivered
//!   after that draws anew (and is paid under a new entry id).
//! - **A sharded pool.** Each sub-pool is a pool of its own in Redis, and a
//!   user's draws always reach the same sub-pool
//!   ([`crate::kinds::Kinds::route`]), so a retry meets its stored answer.
//!
//! Stocking and the jackpot rule have races of their own, explained in
//! [`batches`] and [`jackpot`].

mod batches;
mod coalesce;
pub mod codes;
pub mod config;
mod draw;
pub mod economics;
pub mod jackpot;
mod kind;
pub mod reasons;
pub mod refill;
pub mod rtp;
pub mod scripts;
mod stocking;
mod storage;
mod stored;

use crate::kinds::lucky_gift::scripts as lua;
use redis::aio::ConnectionLike;

pub use batches::{
    composition, stock_committed, stock_next, stock_next_as, Commitment, Recorder, DEFAULT_LEASE_MS,
};
pub use coalesce::{Coalescer, MAX_PER_CALL, MAX_PRIZES_PER_CALL};
pub use codes::{Batch, CodeTable};
pub use config::{parse_file, PoolConfig};
pub(crate) use draw::draw_call;
pub use draw::{draw, draw_many, draw_once, draw_script, Decoder, DrawStep, Pending};
pub use kind::{LuckyGift, LUCKY_GIFT};
pub use stocking::{StockError, StockOutcome};
pub use storage::Storage;
pub use stored::{stored_award, Drawn};

use crate::scripts::PoolKeys;

/// Kind label stored in a pool's `meta.kind`.
pub use reasons::KIND;

/// Indices per bucket of a sparse pool's `sp` hash.
pub const SPARSE_BUCKET: u64 = 64;

/// The keys holding the prizes of a pool in `storage` (for memory
/// accounting), the gated jackpots waiting included.
pub fn storage_keys(keys: &PoolKeys, storage: Storage) -> Vec<String> {
    storage.prize_keys(keys)
}

/// Bytes of Redis memory (`MEMORY USAGE`, every element counted) the
/// prizes of the pool behind `keys` take in `storage`.
pub async fn storage_bytes<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    storage: Storage,
) -> Result<u64, redis::RedisError> {
    let mut pipe = redis::pipe();
    for key in storage.prize_keys(keys) {
        pipe.cmd("MEMORY")
            .arg("USAGE")
            .arg(key)
            .arg("SAMPLES")
            .arg(0);
    }
    let bytes: Vec<Option<u64>> = pipe.query_async(conn).await?;
    Ok(bytes.into_iter().flatten().sum())
}

/// The storage of pool `keys`, or `None` if it is not a lucky-gift pool.
pub async fn storage_of<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
) -> Result<Option<Storage>, redis::RedisError> {
    let (kind, storage): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(keys.meta())
        .arg("kind")
        .arg("storage")
        .query_async(conn)
        .await?;
    Ok((kind.as_deref() == Some(KIND)).then(|| Storage::from_label(storage.as_deref())))
}

/// The daily consumption counter lives two days.
pub const SPENT_TTL_S: u64 = 2 * 24 * 3600;

/// Writes a pool's settings to Redis (creating its counters if new).
pub async fn configure<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    config: &PoolConfig,
    version: i64,
    table: &CodeTable,
) -> anyhow::Result<()> {
    let mut inv = lua::CONFIGURE_POOL.key(keys.meta());
    inv.arg(KIND)
        .arg(version)
        .arg("unit_price")
        .arg(config.unit_price)
        .arg("max_count")
        .arg(config.max_count)
        .arg("asset")
        .arg(&config.asset)
        .arg("storage")
        .arg(config.storage.label())
        .arg("codes")
        .arg(serde_json::to_string(table)?)
        // The whole config, so refills stock from Redis alone and keep
        // going while Postgres is away.
        .arg("config")
        .arg(serde_json::to_string(config)?);
    for (field, value) in jackpot::meta_fields(config, table) {
        inv.arg(field).arg(value);
    }
    for (field, value) in rtp::meta_fields(config, version, table) {
        inv.arg(field).arg(value);
    }
    let reply: Vec<String> = inv.invoke_async(conn).await?;
    match reply.first().map(String::as_str) {
        Some("ok") => {
            // The new rule holds for the prizes parked under the old one too:
            // those that are no jackpot now go first (`lua/lib/jackpot.lua`).
            let freed: i64 = lua::REGATE_HELD
                .key(keys.meta())
                .key(keys.held())
                .invoke_async(conn)
                .await?;
            if freed > 0 {
                tracing::info!(pool = %config.id, freed, "parked prizes freed by the new jackpot rule");
            }
            Ok(())
        }
        Some("kind") => anyhow::bail!(
            "id {:?} already belongs to a {} pool",
            config.id,
            reply.get(1).map(String::as_str).unwrap_or("?")
        ),
        Some("stale") => anyhow::bail!(
            "pool {:?} already has config version {} in Redis",
            config.id,
            reply.get(1).map(String::as_str).unwrap_or("?")
        ),
        _ => anyhow::bail!("unexpected reply from configure_pool: {reply:?}"),
    }
}

/// Counters of a pool, as `prizepool pool status` shows them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PoolStatus {
    pub pool: String,
    pub kind: String,
    pub version: i64,
    pub generation: u64,
    pub stocked: u64,
    pub drawn: u64,
    pub in_pool: u64,
    pub held_jackpots: u64,
    pub spent_today: i64,
}

/// Reads a consistent snapshot of a pool's counters; `None` if it does not exist.
pub async fn status<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    pool: &str,
) -> Result<Option<PoolStatus>, redis::RedisError> {
    // Every storage's counting fields, read in the same step, so the
    // snapshot needs no round trip to learn the storage first.
    let mut fields: Vec<&str> = Vec::new();
    for storage in Storage::ALL {
        for field in storage.layout().drawable_fields() {
            if !fields.contains(field) {
                fields.push(field);
            }
        }
    }
    let (kind, version, generation, stocked, drawn, held, spent, storage, values): (
        Option<String>,
        i64,
        u64,
        u64,
        u64,
        u64,
        i64,
        String,
        Vec<i64>,
    ) = lua::POOL_STATUS
        .key(keys.meta())
        .key(keys.held())
        .key(keys.spent(&crate::scripts::utc_day()))
        .arg(&fields)
        .invoke_async(conn)
        .await?;
    let field = |name: &str| {
        fields
            .iter()
            .position(|f| *f == name)
            .and_then(|i| values.get(i).copied())
            .unwrap_or(0)
    };
    let visible = Storage::from_label(Some(&storage))
        .layout()
        .drawable(&field);
    Ok(kind.map(|kind| PoolStatus {
        pool: pool.to_owned(),
        kind,
        version,
        generation,
        stocked,
        drawn,
        in_pool: visible + held,
        held_jackpots: held,
        spent_today: spent,
    }))
}

/// Where a pool's committed batches stand (`docs/fairness.md`), as `pool
/// status` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct FairState {
    /// The batch the next prize comes from (0 before the first committed batch).
    pub drawing: u64,
    /// Batches whose seed is still secret: (generation, config version,
    /// commitment), oldest first.
    pub committed: Vec<(u64, i64, String)>,
    /// The last batch revealed: (generation, config version, seed).
    pub last_revealed: Option<(u64, i64, String)>,
}

/// Reads a pool's [`FairState`] from its meta hash.
pub async fn fair_state<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
) -> Result<FairState, redis::RedisError> {
    // Read as bytes: the answer store's epochs (`ep`) are binary.
    let meta: std::collections::HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(keys.meta())
        .query_async(conn)
        .await?;
    let meta: std::collections::HashMap<String, String> = meta
        .into_iter()
        .filter(|(field, _)| field != "ep")
        .map(|(field, value)| (field, String::from_utf8_lossy(&value).into_owned()))
        .collect();
    let record = |text: &str| -> Option<(i64, crate::fairness::Seed)> {
        let (version, seed) = text.split_once('|')?;
        Some((
            version.parse().ok()?,
            crate::fairness::Seed::from_hex(seed)?,
        ))
    };
    let mut state = FairState {
        drawing: meta.get("hgen").and_then(|g| g.parse().ok()).unwrap_or(0),
        ..FairState::default()
    };
    for (field, value) in &meta {
        if let Some(g) = field.strip_prefix("c:").and_then(|g| g.parse::<u64>().ok()) {
            if let Some((version, seed)) = record(value) {
                state.committed.push((g, version, seed.commitment()));
            }
        }
    }
    state.committed.sort();
    state.last_revealed = meta.get("revealed").and_then(|r| {
        let (g, rest) = r.split_once('|')?;
        let (version, seed) = record(rest)?;
        Some((g.parse().ok()?, version, seed.to_hex()))
    });
    // The batch being drawn may be the first committed one if the pointer
    // has not moved yet.
    if state.drawing == 0 {
        state.drawing = state.committed.first().map_or(0, |c| c.0);
    }
    Ok(state)
}

/// The config a pool was last loaded with, its version and its code table,
/// as stored in Redis by [`configure`]; `None` if the pool is unknown there.
pub async fn stored_config<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
) -> anyhow::Result<Option<(i64, PoolConfig, CodeTable)>> {
    let (kind, version, config, codes): (
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<String>,
    ) = redis::cmd("HMGET")
        .arg(keys.meta())
        .arg("kind")
        .arg("version")
        .arg("config")
        .arg("codes")
        .query_async(conn)
        .await?;
    match (kind.as_deref(), version, config, codes) {
        (Some(KIND), Some(version), Some(config), Some(codes)) => Ok(Some((
            version,
            serde_json::from_str(&config)?,
            serde_json::from_str(&codes)?,
        ))),
        _ => Ok(None),
    }
}

/// Reads the code table stored with the pool.
pub async fn load_codes<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
) -> anyhow::Result<Option<(CodeTable, String)>> {
    let (codes, asset): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(keys.meta())
        .arg("codes")
        .arg("asset")
        .query_async(conn)
        .await?;
    match codes {
        None => Ok(None),
        Some(text) => Ok(Some((
            serde_json::from_str(&text)?,
            asset.unwrap_or_else(|| "coin".into()),
        ))),
    }
}
