//! Lucky-gift multiplier pools (SPEC §3): configuration, prize codes, batch
//! stocking and the atomic draw.
//!
//! Redis layout of pool `id` (all under the hash tag `{id}`):
//!
//! | key    | type   | holds |
//! |--------|--------|-------|
//! | `meta` | hash   | settings (`unit_price`, jackpot rule, `codes`) and counters (`gen`, `visible`, `stocked`, `drawn`, stocking lease) |
//! | `q`    | list   | prize codes; the first `visible` are drawable, any tail behind them is a batch being stocked |
//! | `held` | list   | gated jackpots, first in line for the first draw that may win them |
//! | `spent:YYYYMMDD` | string | the day's consumption, for the jackpot rule |
//! | `rs`, `rs:<slice>:<size>:<i>` | hash | the answer store: every draw's answer (see [`crate::kinds::answer`], `lua/lib/answer.lua`); an award stored as `"<serial>\|<version>\|<trigger>\|<codes>"` (`lua/lib/award.lua`) |
//!
//! Conservation holds at every instant because each Lua step moves counters
//! together: `stocked = drawn + visible + len(held)`.

mod coalesce;
pub mod codes;
pub mod config;
mod draw;
mod stock;

use redis::aio::ConnectionLike;

pub use coalesce::{Coalescer, MAX_PER_CALL, MAX_PRIZES_PER_CALL};
pub use codes::{Batch, CodeTable};
pub use config::{parse_file, PoolConfig, Storage};
pub(crate) use draw::draw_call;
pub use draw::{
    draw, draw_many, draw_once, draw_script, stored_award, Decoder, DrawStep, Drawn, Pending,
};
pub use stock::{
    composition, stock_committed, stock_next, stock_next_as, Commitment, Recorder, StockError,
    StockOutcome, DEFAULT_LEASE_MS,
};

use crate::scripts::{PoolKeys, Scripts};

/// Kind label stored in a pool's `meta.kind`.
pub const KIND: &str = "lucky_gift";

/// Indices per bucket of a sparse pool's `sp` hash.
pub const SPARSE_BUCKET: u64 = 64;

/// The keys holding the prizes of a pool in `storage` (for memory
/// accounting): the prize list, or the sparse hash with its segments and
/// flags; and the gated jackpots waiting.
pub fn storage_keys(keys: &PoolKeys, storage: Storage) -> Vec<String> {
    match storage {
        Storage::List => vec![keys.queue(), keys.held()],
        Storage::Sparse => vec![keys.sparse(), keys.segments(), keys.flags(), keys.held()],
    }
}

/// Bytes of Redis memory (`MEMORY USAGE`, every element counted) the
/// prizes of the pool behind `keys` take in `storage`.
pub async fn storage_bytes<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    storage: Storage,
) -> Result<u64, redis::RedisError> {
    let mut pipe = redis::pipe();
    for key in storage_keys(keys, storage) {
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
    Ok(match (kind.as_deref(), storage.as_deref()) {
        (Some(KIND), Some("sparse")) => Some(Storage::Sparse),
        (Some(KIND), _) => Some(Storage::List),
        _ => None,
    })
}

/// The daily consumption counter lives two days.
pub const SPENT_TTL_S: u64 = 2 * 24 * 3600;

/// Writes a pool's settings to Redis (creating its counters if new).
pub async fn configure<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    config: &PoolConfig,
    version: i64,
    table: &CodeTable,
) -> anyhow::Result<()> {
    let jackpot_codes: Vec<String> = table
        .jackpot_codes(config)
        .iter()
        .map(u32::to_string)
        .collect();
    let mut inv = scripts.configure_pool.key(keys.meta());
    inv.arg(KIND)
        .arg(version)
        .arg("unit_price")
        .arg(config.unit_price)
        .arg("max_count")
        .arg(config.max_count)
        .arg("asset")
        .arg(&config.asset)
        .arg("storage")
        .arg(match config.storage {
            Storage::List => "list",
            Storage::Sparse => "sparse",
        })
        .arg("jackpot_codes")
        .arg(jackpot_codes.join(","))
        .arg("codes")
        .arg(serde_json::to_string(table)?)
        // The whole config, so refills stock from Redis alone and keep
        // going while Postgres is away.
        .arg("config")
        .arg(serde_json::to_string(config)?);
    match &config.jackpot {
        Some(j) => inv
            .arg("jackpot_threshold")
            .arg(j.daily_consumption_threshold),
        // An empty threshold reads as "no rule" in the draw script.
        None => inv.arg("jackpot_threshold").arg(""),
    };
    let reply: Vec<String> = inv.invoke_async(conn).await?;
    match reply.first().map(String::as_str) {
        Some("ok") => {
            // The new rule holds for the prizes parked under the old one too:
            // those that are no jackpot now go first (`lua/lib/jackpot.lua`).
            let freed: i64 = scripts
                .regate_held
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
    scripts: &Scripts,
    keys: &PoolKeys,
    pool: &str,
) -> Result<Option<PoolStatus>, redis::RedisError> {
    let (kind, version, generation, stocked, drawn, visible, held, spent): (
        Option<String>,
        i64,
        u64,
        u64,
        u64,
        u64,
        u64,
        i64,
    ) = scripts
        .pool_status
        .key(keys.meta())
        .key(keys.held())
        .key(keys.spent(&crate::scripts::utc_day()))
        .invoke_async(conn)
        .await?;
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
    let meta: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.meta())
        .query_async(conn)
        .await?;
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
