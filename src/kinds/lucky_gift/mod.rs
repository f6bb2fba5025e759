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
//! | `r:<request_id>` | string | a draw's result, for idempotent replays |
//!
//! Conservation holds at every instant because each Lua step moves counters
//! together: `stocked = drawn + visible + len(held)`.

pub mod codes;
pub mod config;
mod stock;

use redis::aio::ConnectionLike;

pub use codes::{Batch, CodeTable};
pub use config::{parse_file, PoolConfig, Storage};
pub use stock::{stock_next, StockError, StockOutcome, DEFAULT_LEASE_MS};

use crate::scripts::{PoolKeys, Scripts};

/// Kind label stored in a pool's `meta.kind`.
pub const KIND: &str = "lucky_gift";

/// The result of one draw step as stored in Redis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drawn {
    /// The batch whose refill flag this draw took, if any.
    pub trigger: Option<u64>,
    /// Unit price the draw was charged at.
    pub unit_price: i64,
    /// The pool's consumption today, this draw included.
    pub spent_today: i64,
    /// Prize codes in draw order.
    pub codes: Vec<u32>,
}

impl Drawn {
    fn parse(payload: &str) -> Result<Self, redis::RedisError> {
        let bad = || {
            redis::RedisError::from((
                redis::ErrorKind::Parse,
                "malformed draw payload",
                payload.to_owned(),
            ))
        };
        let mut parts = payload.splitn(4, '|');
        let trigger: i64 = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let unit_price = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let spent_today = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let codes = parts
            .next()
            .ok_or_else(bad)?
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            trigger: u64::try_from(trigger).ok(),
            unit_price,
            spent_today,
            codes,
        })
    }
}

/// What the draw step answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DrawStep {
    /// Prizes were drawn now.
    Drawn(Drawn),
    /// This request was drawn before; here is its first result.
    Replayed(Drawn),
    /// Fewer than `count` prizes are drawable; nothing was taken.
    Short { in_pool: u64, generation: u64 },
    /// `count` exceeds the pool's `max_count`.
    TooMany { max_count: u64 },
    /// No lucky-gift pool has this id.
    Unknown,
}

/// The draw script of `storage`.
pub fn draw_script(scripts: &Scripts, storage: Storage) -> &redis::Script {
    match storage {
        Storage::List => &scripts.draw_lucky_gift,
        Storage::Sparse => &scripts.draw_sparse,
    }
}

/// A call of `script` with the draw step's keys and arguments for `storage`,
/// in the order the draw scripts' contracts list them. `script` is the
/// storage's [`draw_script`], or any script that should see the same keys
/// (the bench's round-trip floor).
pub fn draw_call<'a>(
    script: &'a redis::Script,
    keys: &PoolKeys,
    storage: Storage,
    day: &str,
    request_id: &str,
    count: u32,
    result_ttl_s: u64,
) -> redis::ScriptInvocation<'a> {
    let mut call = script.prepare_invoke();
    call.key(keys.meta());
    match storage {
        Storage::List => call.key(keys.queue()),
        Storage::Sparse => call
            .key(keys.sparse())
            .key(keys.segments())
            .key(keys.flags()),
    };
    call.key(keys.held())
        .key(keys.spent(day))
        .key(keys.result(request_id))
        .arg(count)
        .arg(result_ttl_s)
        .arg(SPENT_TTL_S);
    if storage == Storage::Sparse {
        call.arg(SPARSE_BUCKET);
    }
    call
}

/// Draws `count` prizes for `request_id` from the pool behind `keys`, in one
/// atomic Lua step.
pub async fn draw<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    storage: Storage,
    request_id: &str,
    count: u32,
    result_ttl_s: u64,
) -> Result<DrawStep, redis::RedisError> {
    let day = crate::scripts::utc_day();
    let (status, text, number): (String, String, u64) = draw_call(
        draw_script(scripts, storage),
        keys,
        storage,
        &day,
        request_id,
        count,
        result_ttl_s,
    )
    .invoke_async(conn)
    .await?;
    Ok(match status.as_str() {
        "ok" => DrawStep::Drawn(Drawn::parse(&text)?),
        "dup" => DrawStep::Replayed(Drawn::parse(&text)?),
        "short" => DrawStep::Short {
            in_pool: text.parse().unwrap_or(0),
            generation: number,
        },
        "too_many" => DrawStep::TooMany {
            max_count: text.parse().unwrap_or(0),
        },
        _ => DrawStep::Unknown,
    })
}

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
        .arg(serde_json::to_string(table)?);
    match &config.jackpot {
        Some(j) => inv
            .arg("jackpot_threshold")
            .arg(j.daily_consumption_threshold),
        // An empty threshold reads as "no rule" in the draw script.
        None => inv.arg("jackpot_threshold").arg(""),
    };
    let reply: Vec<String> = inv.invoke_async(conn).await?;
    match reply.first().map(String::as_str) {
        Some("ok") => Ok(()),
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
