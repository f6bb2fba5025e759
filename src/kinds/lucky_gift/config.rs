//! Pool configuration files (SPEC §3) and their validation.
//!
//! A file is checked completely before anything is stored: the first problem
//! found is reported with the pool, the combo and the field it concerns.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

pub use super::{jackpot::Jackpot, storage::name::Storage};

/// Largest batch a pool may define (prizes per batch).
pub const MAX_BATCH_SIZE: u64 = 50_000_000;
/// Highest `unit_price`: with at most 10,000 prizes a draw, a draw's cost
/// (`count × unit_price`) stays far below 2^53.
pub const MAX_UNIT_PRICE: i64 = 1_000_000_000;
/// Highest multiplier of a prize.
pub const MAX_MULTIPLIER: u64 = 1_000_000;
/// Highest jackpot threshold: the day's consumption counter saturates at
/// 2^52 (see `lua/lib/answer.lua`), so every threshold up to it is reachable.
pub const MAX_DAILY_THRESHOLD: i64 = 1 << 52;
/// Room a draw reply and its event need besides the prizes and the
/// fairness record: type, ids (at most 128 bytes each), status, user,
/// totals, asset, serial, version and the event's seal, generously.
const REPLY_OVERHEAD_BYTES: usize = 1024;
/// Most sub-pools a hot pool may be split into (`shards`).
pub const MAX_SHARDS: u32 = 64;
/// Separates a sharded pool's name from its sub-pool's number (`gift~3`).
/// Pool names never hold it ([`crate::messages::check_name`]), so a
/// sub-pool id can never be loaded, created or drawn as a pool of its own.
pub const SHARD_SEPARATOR: char = '~';

/// A configuration file: any number of `[[pools]]` tables.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolFile {
    #[serde(default)]
    pools: Vec<RawPool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPool {
    id: String,
    kind: String,
    unit_price: i64,
    #[serde(default = "default_storage")]
    storage: String,
    #[serde(default = "default_refill_at")]
    refill_at: f64,
    #[serde(default = "default_max_count")]
    max_count: i64,
    #[serde(default = "default_asset")]
    asset: String,
    #[serde(default = "default_shards")]
    shards: i64,
    jackpot: Option<RawJackpot>,
    #[serde(default)]
    combos: Vec<RawCombo>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJackpot {
    min_multiplier: i64,
    daily_consumption_threshold: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCombo {
    id: String,
    stock: BTreeMap<String, i64>,
}

fn default_storage() -> String {
    "list".into()
}
fn default_refill_at() -> f64 {
    0.5
}
fn default_max_count() -> i64 {
    1000
}
fn default_asset() -> String {
    "coin".into()
}
fn default_shards() -> i64 {
    1
}
fn is_one(n: &u32) -> bool {
    *n == 1
}

/// One combo: how many prizes of each multiplier it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Combo {
    pub id: String,
    /// (multiplier, count), multipliers ascending.
    pub stock: Vec<(u64, u64)>,
}

impl Combo {
    /// Prizes in this combo.
    pub fn size(&self) -> u64 {
        self.stock.iter().map(|(_, n)| n).sum()
    }
}

/// A validated lucky-gift pool configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolConfig {
    pub id: String,
    pub unit_price: i64,
    pub storage: Storage,
    pub refill_at: f64,
    pub max_count: u32,
    pub asset: String,
    pub jackpot: Option<Jackpot>,
    pub combos: Vec<Combo>,
    /// Sub-pools the pool is stocked as (1: the pool is its own). Absent
    /// from stored configs of unsharded pools, so those read as before.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub shards: u32,
}

fn one() -> u32 {
    1
}

impl PoolConfig {
    /// The pools that hold this pool's prizes: itself, or for `shards = K`
    /// the K sub-pools `<id>~0` … `<id>~K-1`, each with the same combos,
    /// price and storage, so every sub-pool is stocked with whole batches of
    /// the same config and the odds of a draw are those of the pool,
    /// whichever sub-pool it reaches. The jackpot rule counts each
    /// sub-pool's own consumption, so each sub-pool's threshold is the
    /// pool's divided by K (rounded up): with draws spread evenly, the
    /// gates open when the pool as a whole has taken its threshold.
    pub fn sub_pools(&self) -> Vec<PoolConfig> {
        if self.shards <= 1 {
            return vec![self.clone()];
        }
        let k = i64::from(self.shards);
        (0..self.shards)
            .map(|i| PoolConfig {
                id: sub_pool_id(&self.id, i),
                shards: 1,
                jackpot: self.jackpot.as_ref().map(|j| j.per_shard(k)),
                ..self.clone()
            })
            .collect()
    }

    /// Prizes in one batch (every combo once).
    pub fn batch_size(&self) -> u64 {
        self.combos.iter().map(Combo::size).sum()
    }

    /// Whether a prize of this multiplier is subject to the jackpot rule.
    pub fn is_jackpot(&self, multiplier: u64) -> bool {
        self.jackpot.as_ref().is_some_and(|j| j.gates(multiplier))
    }
}

/// The id of sub-pool `shard` of pool `pool`.
pub fn sub_pool_id(pool: &str, shard: u32) -> String {
    format!("{pool}{SHARD_SEPARATOR}{shard}")
}

/// The pool and shard a sub-pool id names (`gift~3` → `("gift", Some(3))`);
/// any other id is its own pool.
pub fn split_sub_pool(id: &str) -> (&str, Option<u32>) {
    match id.rsplit_once(SHARD_SEPARATOR) {
        Some((pool, shard)) => match shard.parse() {
            Ok(shard) => (pool, Some(shard)),
            Err(_) => (id, None),
        },
        None => (id, None),
    }
}

/// A problem in a configuration file, located as precisely as possible.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub pool: Option<String>,
    pub combo: Option<String>,
    pub field: Option<String>,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(pool) = &self.pool {
            parts.push(format!("pool {pool:?}"));
        }
        if let Some(combo) = &self.combo {
            parts.push(format!("combo {combo:?}"));
        }
        if let Some(field) = &self.field {
            parts.push(format!("field `{field}`"));
        }
        if parts.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", parts.join(", "), self.message)
        }
    }
}

struct At<'a> {
    pool: &'a str,
    combo: Option<&'a str>,
}

impl At<'_> {
    fn err(&self, field: &str, message: impl Into<String>) -> ConfigError {
        ConfigError {
            pool: Some(self.pool.to_owned()),
            combo: self.combo.map(str::to_owned),
            field: Some(field.to_owned()),
            message: message.into(),
        }
    }
}

/// Parses and validates a pool configuration file.
pub fn parse_file(text: &str) -> Result<Vec<PoolConfig>, ConfigError> {
    let file: PoolFile = toml::from_str(text).map_err(|e| ConfigError {
        pool: None,
        combo: None,
        field: None,
        message: format!("not a valid pool file: {}", e.message()),
    })?;
    if file.pools.is_empty() {
        return Err(ConfigError {
            pool: None,
            combo: None,
            field: None,
            message: "the file defines no [[pools]]".into(),
        });
    }
    let mut ids = HashSet::new();
    let mut pools = Vec::with_capacity(file.pools.len());
    for raw in file.pools {
        let at = At {
            pool: &raw.id,
            combo: None,
        };
        if !ids.insert(raw.id.clone()) {
            return Err(at.err("id", "duplicate pool id"));
        }
        pools.push(validate(raw)?);
    }
    Ok(pools)
}

fn validate(raw: RawPool) -> Result<PoolConfig, ConfigError> {
    let at = At {
        pool: &raw.id,
        combo: None,
    };
    crate::messages::check_name("id", &raw.id).map_err(|e| at.err("id", e.message))?;
    if raw.kind != "lucky_gift" {
        return Err(at.err(
            "kind",
            format!(
                "unknown kind {:?} (pool files hold \"lucky_gift\" pools)",
                raw.kind
            ),
        ));
    }
    if !(1..=MAX_UNIT_PRICE).contains(&raw.unit_price) {
        return Err(at.err(
            "unit_price",
            format!(
                "must be between 1 and {MAX_UNIT_PRICE}, got {}",
                raw.unit_price
            ),
        ));
    }
    let Some(storage) = Storage::from_name(&raw.storage) else {
        return Err(at.err(
            "storage",
            format!(
                "unknown storage {:?} (expected {})",
                raw.storage,
                Storage::names()
            ),
        ));
    };
    if !(raw.refill_at > 0.0 && raw.refill_at <= 1.0) {
        return Err(at.err(
            "refill_at",
            format!("must be in (0, 1], got {}", raw.refill_at),
        ));
    }
    if raw.max_count < 1 || raw.max_count > i64::from(crate::messages::MAX_DRAW_COUNT) {
        return Err(at.err(
            "max_count",
            format!(
                "must be between 1 and {}, got {}",
                crate::messages::MAX_DRAW_COUNT,
                raw.max_count
            ),
        ));
    }
    crate::messages::check_id("asset", &raw.asset).map_err(|e| at.err("asset", e.message))?;
    let jackpot = match raw.jackpot {
        None => None,
        Some(j) => {
            if j.min_multiplier <= 0 {
                return Err(at.err("jackpot.min_multiplier", "must be positive"));
            }
            if !(0..=MAX_DAILY_THRESHOLD).contains(&j.daily_consumption_threshold) {
                return Err(at.err(
                    "jackpot.daily_consumption_threshold",
                    format!(
                        "must be between 0 and {MAX_DAILY_THRESHOLD}, got {}",
                        j.daily_consumption_threshold
                    ),
                ));
            }
            Some(Jackpot {
                min_multiplier: j.min_multiplier.unsigned_abs(),
                daily_consumption_threshold: j.daily_consumption_threshold,
            })
        }
    };
    if raw.combos.is_empty() {
        return Err(at.err("combos", "a pool needs at least one combo"));
    }
    let mut combo_ids = HashSet::new();
    let mut combos = Vec::with_capacity(raw.combos.len());
    for combo in raw.combos {
        let at = At {
            pool: &raw.id,
            combo: Some(&combo.id),
        };
        crate::messages::check_id("id", &combo.id).map_err(|e| at.err("id", e.message))?;
        if !combo_ids.insert(combo.id.clone()) {
            return Err(at.err("id", "duplicate combo id"));
        }
        if combo.stock.is_empty() {
            return Err(at.err("stock", "a combo needs at least one prize"));
        }
        let mut stock = Vec::with_capacity(combo.stock.len());
        for (key, count) in &combo.stock {
            let field = format!("stock.\"{key}\"");
            let multiplier: u64 = key
                .parse()
                .map_err(|_| at.err(&field, "the key must be a non-negative integer multiplier"))?;
            if multiplier > MAX_MULTIPLIER {
                return Err(at.err(
                    &field,
                    format!("multipliers go up to {MAX_MULTIPLIER}, got {multiplier}"),
                ));
            }
            if *count <= 0 {
                return Err(at.err(&field, format!("stock must be positive, got {count}")));
            }
            stock.push((multiplier, count.unsigned_abs()));
        }
        stock.sort_unstable();
        if stock.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(at.err("stock", "the same multiplier is listed twice"));
        }
        combos.push(Combo {
            id: combo.id,
            stock,
        });
    }
    if !(1..=i64::from(MAX_SHARDS)).contains(&raw.shards) {
        return Err(at.err(
            "shards",
            format!("must be between 1 and {MAX_SHARDS}, got {}", raw.shards),
        ));
    }
    // Sub-pool ids travel in refill requests, which take ids up to the
    // usual length.
    if raw.shards > 1 && raw.id.len() + 3 > crate::messages::MAX_ID_LEN {
        return Err(at.err(
            "id",
            format!(
                "a sharded pool's id must leave room for its sub-pools' suffix: at most {} bytes",
                crate::messages::MAX_ID_LEN - 3
            ),
        ));
    }
    let config = PoolConfig {
        shards: u32::try_from(raw.shards).unwrap_or(1),
        id: raw.id,
        unit_price: raw.unit_price,
        storage,
        refill_at: raw.refill_at,
        max_count: u32::try_from(raw.max_count).unwrap_or(u32::MAX),
        asset: raw.asset,
        jackpot,
        combos,
    };
    let size = config.batch_size();
    if size > MAX_BATCH_SIZE {
        return Err(At {
            pool: &config.id,
            combo: None,
        }
        .err(
            "combos",
            format!("a batch of {size} prizes is above the limit of {MAX_BATCH_SIZE}"),
        ));
    }
    check_draw_bounds(&config).map_err(|(field, message)| {
        At {
            pool: &config.id,
            combo: None,
        }
        .err(field, message)
    })?;
    Ok(config)
}

/// Refuses a pool whose largest draw could not be paid exactly or answered
/// within the wire limit: `max_count × highest multiplier × unit_price` must
/// stay below 2^53 (a money rule), and the largest reply the pool can give
/// must fit in [`crate::messages::MAX_MESSAGE_BYTES`] with its event's seal:
/// see [`max_reply_len`].
fn check_draw_bounds(config: &PoolConfig) -> Result<(), (&'static str, String)> {
    let highest = config
        .combos
        .iter()
        .flat_map(|c| c.stock.iter().map(|(m, _)| *m))
        .max()
        .unwrap_or(0);
    let reward = u128::from(config.max_count) * u128::from(highest) * config.unit_price as u128;
    if reward >= crate::messages::MAX_EXACT as u128 {
        return Err((
            "max_count",
            format!(
                "the largest draw could pay {reward} ({} prizes × {highest} × unit_price {}), above 2^53; lower max_count, unit_price or the multipliers",
                config.max_count, config.unit_price
            ),
        ));
    }
    let limit = crate::messages::MAX_MESSAGE_BYTES;
    // A pool that allows big draws also answers small ones, whose prizes
    // are listed one by one.
    let list_max = crate::messages::PRIZE_LIST_MAX as u32;
    let worst =
        |count: u32| max_reply_len(config, count).max(max_reply_len(config, count.min(list_max)));
    let reply = worst(config.max_count);
    if reply > limit {
        // The worst reply grows with the count, so the largest count that
        // fits is found by bisection.
        let (mut fits, mut over) = (0u32, config.max_count);
        while over - fits > 1 {
            let mid = fits + (over - fits) / 2;
            if worst(mid) <= limit {
                fits = mid;
            } else {
                over = mid;
            }
        }
        return Err((
            "max_count",
            format!(
                "a reply to a draw of {} prizes could take {reply} bytes, above the {limit} byte message limit; at most {fits} prizes of this pool fit",
                config.max_count
            ),
        ));
    }
    Ok(())
}

/// Bytes of the fairness record per run of positions and revealed seed,
/// with generations of up to 10 digits and positions of 8
/// (a batch holds at most [`MAX_BATCH_SIZE`] prizes).
const RUN_JSON_BYTES: usize = r#"{"generation":,"position":,"count":},"#.len() + 10 + 8 + 5;
const REVEAL_JSON_BYTES: usize = r#"{"generation":,"version":,"seed":""},"#.len() + 10 + 10 + 64;
/// Batches whose fairness record the load bound makes room for. A draw
/// spans two batches when a batch holds at least `count` prizes; a pool of
/// smaller batches has only the batches stocked so far to draw from, one
/// more per refill request (a short draw waits for them a bounded time), so
/// a draw that spans more than this is a pool of tiny batches answering a
/// draw far bigger than them, and may answer past the bound.
const SPANNED_BATCHES: usize = 8;
/// Field names and brackets of `positions`, `held_back` and `revealed`.
const FAIRNESS_FRAME_BYTES: usize = r#","positions":[],"held_back":[],"revealed":[]"#.len();

/// The most bytes a reply (and its sealed `draw.completed` event) to a
/// draw of `count` prizes of `config` can take: the fixed fields
/// ([`REPLY_OVERHEAD_BYTES`]), the prizes (listed one by one up to
/// [`PRIZE_LIST_MAX`](crate::messages::PRIZE_LIST_MAX), else in the
/// compact form of [`crate::messages::prize_codes`]), and the fairness
/// record of the batches a draw of `count` can touch (at most
/// [`SPANNED_BATCHES`]): a run of positions and a revealed seed per batch.
/// Jackpots are not counted: a gated draw that parks jackpots, or a draw
/// that wins many parked ones at once, adds a position (and a run) per
/// jackpot beyond this, so a pool dense in jackpots can answer past it; a
/// bound that counted every jackpot a draw could meet would refuse such
/// pools at any useful `max_count`. The fairness record written compactly
/// is what would close this.
pub fn max_reply_len(config: &PoolConfig, count: u32) -> usize {
    use crate::messages::prize_codes;
    let count = count as usize;
    let entries: Vec<usize> = config
        .combos
        .iter()
        .flat_map(|c| {
            c.stock
                .iter()
                .map(|(m, _)| prize_codes::prize_json_len(&c.id, *m))
        })
        .collect();
    let prizes = if count <= crate::messages::PRIZE_LIST_MAX {
        prize_codes::max_list_len(count, entries.iter().copied().max().unwrap_or(0))
    } else {
        prize_codes::max_len(count, &entries)
    };
    let size = config.batch_size().max(1) as usize;
    let batches = (count.div_ceil(size) + 1).min(SPANNED_BATCHES);
    let fairness = FAIRNESS_FRAME_BYTES + batches * (RUN_JSON_BYTES + REVEAL_JSON_BYTES);
    REPLY_OVERHEAD_BYTES + prizes + fairness
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[[pools]]
id = "gift-1001"
kind = "lucky_gift"
unit_price = 100
storage = "list"
refill_at = 0.5
max_count = 1000
jackpot = { min_multiplier = 5000, daily_consumption_threshold = 5_000_000 }
[[pools.combos]]
id = "c1"
stock = { "0" = 29994, "10" = 293, "50" = 139, "500" = 27, "5000" = 1 }
"#;

    #[test]
    fn spec_example_parses() {
        let pools = parse_file(GOOD).unwrap();
        assert_eq!(pools.len(), 1);
        assert_eq!(pools[0].batch_size(), 29994 + 293 + 139 + 27 + 1);
        assert!(pools[0].is_jackpot(5000));
        assert!(!pools[0].is_jackpot(500));
    }

    fn error_of(text: &str) -> String {
        parse_file(text).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_pool_combo_and_field() {
        let e = error_of(&GOOD.replace("\"10\" = 293", "\"10\" = -3"));
        assert!(
            e.contains("gift-1001") && e.contains("\"c1\"") && e.contains("stock.\"10\""),
            "{e}"
        );
        let e = error_of(&GOOD.replace("\"10\" = 293", "\"10\" = 0"));
        assert!(e.contains("must be positive"), "{e}");
        let e = error_of(&GOOD.replace("storage = \"list\"", "storage = \"tape\""));
        assert!(e.contains("storage") && e.contains("tape"), "{e}");
        for bad in ["0.0", "1.5", "-0.2"] {
            let e = error_of(&GOOD.replace("refill_at = 0.5", &format!("refill_at = {bad}")));
            assert!(e.contains("refill_at"), "{e}");
        }
        let no_combos = GOOD.split("[[pools.combos]]").next().unwrap();
        assert!(error_of(no_combos).contains("combos"));
        let dup_combo = format!("{GOOD}\n[[pools.combos]]\nid = \"c1\"\nstock = {{ \"0\" = 1 }}\n");
        assert!(error_of(&dup_combo).contains("duplicate combo id"));
        let dup_pool = format!("{GOOD}\n{GOOD}");
        assert!(error_of(&dup_pool).contains("duplicate pool id"));
    }

    /// A pool file of one pool with `combos` combos of 64-byte ids, each
    /// `stock` (TOML inline table), and `max_count`.
    fn big_pool(combos: usize, stock: &str, max_count: u32, extra: &str) -> String {
        let mut text = format!(
            "[[pools]]\nid = \"big\"\nkind = \"lucky_gift\"\nunit_price = 1\nmax_count = {max_count}\n{extra}\n"
        );
        for i in 0..combos {
            text.push_str(&format!(
                "[[pools.combos]]\nid = \"{i:0>64}\"\nstock = {stock}\n"
            ));
        }
        text
    }

    /// Issue 25, point 4: pools of `max_count = 10000` with 64-byte combo
    /// ids load, and the bound they are held to is below the message limit.
    #[test]
    fn pools_of_ten_thousand_prizes_load() {
        let stock =
            r#"{ "0" = 9000, "1" = 600, "10" = 300, "100" = 90, "1000" = 9, "100000" = 1 }"#;
        for combos in [1, 2, 5, 16] {
            let text = big_pool(
                combos,
                stock,
                10_000,
                "jackpot = { min_multiplier = 100000, daily_consumption_threshold = 1000 }",
            );
            let pool = parse_file(&text).unwrap_or_else(|e| panic!("{combos} combos: {e}"));
            assert_eq!(pool[0].max_count, 10_000);
            let worst = max_reply_len(&pool[0], 10_000);
            assert!(
                worst <= crate::messages::MAX_MESSAGE_BYTES,
                "{combos}: {worst}"
            );
        }
        // Small batches: a draw of 10,000 spans many of them, and still fits.
        let text = big_pool(3, r#"{ "0" = 80, "5" = 15, "50" = 5 }"#, 10_000, "");
        parse_file(&text).unwrap();
        // A pool of one prize, too.
        parse_file(&big_pool(1, r#"{ "7" = 1 }"#, 10_000, "")).unwrap();
    }

    /// The money rule stays: a big draw that could pay 2^53 or more is
    /// refused, whatever its size on the wire.
    #[test]
    fn exactness_is_still_checked() {
        let text = big_pool(1, r#"{ "0" = 10, "1000000" = 1 }"#, 10_000, "")
            .replace("unit_price = 1", "unit_price = 1000000");
        assert!(
            error_of(&text).contains("above 2^53"),
            "{}",
            error_of(&text)
        );
    }

    /// A pool whose largest draw could not be answered in 64 KiB even in the
    /// compact form (thousands of distinct prizes with long combo ids) is
    /// refused, naming how many of its prizes fit.
    #[test]
    fn pools_whose_replies_cannot_fit_are_refused() {
        let stock: Vec<String> = (1..=60).map(|m| format!("\"{m}\" = 1")).collect();
        let text = big_pool(50, &format!("{{ {} }}", stock.join(", ")), 10_000, "");
        let e = error_of(&text);
        assert!(e.contains("message limit") && e.contains("at most"), "{e}");
        let fits: u32 = e
            .rsplit("at most ")
            .next()
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        let pool =
            parse_file(&text.replace("max_count = 10000", &format!("max_count = {fits}"))).unwrap();
        assert_eq!(pool[0].max_count, fits);
    }

    proptest::proptest! {
        /// The load bound is sound: for any pool that loads, a reply to a
        /// draw of `max_count` prizes in the worst order (every prize unlike
        /// its neighbour, cycling through every distinct prize), with the
        /// longest ids and numbers and the fairness record of every batch
        /// it can span, sealed as its event, takes no more than
        /// [`max_reply_len`], which is within 64 KiB.
        #[test]
        fn the_load_bound_covers_the_worst_reply(
            combos in proptest::collection::vec(
                (1usize..=64, proptest::collection::btree_map(0u64..=1_000_000, 1i64..400, 1..12)),
                1..12,
            ),
            max_count in 1u32..=10_000,
        ) {
            let mut text = format!(
                "[[pools]]\nid = \"{}\"\nkind = \"lucky_gift\"\nunit_price = 1\nmax_count = {max_count}\n",
                "p".repeat(crate::messages::MAX_ID_LEN)
            );
            for (n, (len, stock)) in combos.iter().enumerate() {
                let id = format!("{n}{}", "q".repeat(64)).chars().take(*len.max(&(n.to_string().len()))).collect::<String>();
                let items: Vec<String> = stock.iter().map(|(m, k)| format!("\"{m}\" = {k}")).collect();
                text.push_str(&format!("[[pools.combos]]\nid = \"{id}\"\nstock = {{ {} }}\n", items.join(", ")));
            }
            let Ok(mut pools) = parse_file(&text) else {
                // Refused (too big a reply, or unpayable): nothing to answer.
                return Ok(());
            };
            let config = pools.remove(0);
            let bound = max_reply_len(&config, config.max_count);
            proptest::prop_assert!(bound <= crate::messages::MAX_MESSAGE_BYTES);
            let pairs: Vec<(&str, u64)> = config
                .combos
                .iter()
                .flat_map(|c| c.stock.iter().map(move |(m, _)| (c.id.as_str(), *m)))
                .collect();
            let count = config.max_count as usize;
            let prizes: Vec<(&str, u64)> = (0..count).map(|k| pairs[k % pairs.len()]).collect();
            let batches = (count.div_ceil(config.batch_size() as usize) + 1).min(SPANNED_BATCHES);
            let big = 9_999_999_999u64;
            let result = crate::messages::DrawResult {
                request_id: "r".repeat(crate::messages::MAX_ID_LEN),
                status: crate::messages::Status::Ok,
                pool: Some(config.id.clone()),
                shard: Some(MAX_SHARDS - 1),
                user_id: Some(i64::MAX),
                total_multiplier: Some(big),
                reward: Some(crate::messages::MAX_EXACT - 1),
                asset: Some("a".repeat(crate::messages::MAX_ID_LEN)),
                serial: Some(big as i64),
                version: Some(big as i64),
                prize_codes: (count > crate::messages::PRIZE_LIST_MAX)
                    .then(|| crate::messages::PrizeCodes::encode(prizes.iter().copied())),
                prizes: if count > crate::messages::PRIZE_LIST_MAX {
                    Vec::new()
                } else {
                    prizes
                        .iter()
                        .map(|(c, m)| crate::messages::Prize::Multiplier { multiplier: *m, combo: (*c).to_owned() })
                        .collect()
                },
                positions: (0..batches)
                    .map(|_| crate::messages::PrizeRun { generation: big, position: 49_999_999, count: 10_000 })
                    .collect(),
                revealed: (0..batches)
                    .map(|_| crate::messages::Reveal { generation: big, version: big as i64, seed: "f".repeat(64) })
                    .collect(),
                ..crate::messages::DrawResult::default()
            };
            let fields = serde_json::to_vec(&result).unwrap();
            let event = crate::messages::retype("draw.completed", &fields).len()
                + r#","seal":""#.len()
                + 64;
            proptest::prop_assert!(event <= bound, "event {} > bound {}", event, bound);
        }
    }
}
