//! Pool configuration files (SPEC §3) and their validation.
//!
//! A file is checked completely before anything is stored: the first problem
//! found is reported with the pool, the combo and the field it concerns.

mod bounds;
mod validate;

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

pub use bounds::{check_table_bounds, max_reply_len, HELD_RUNS};
use validate::validate;

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
    pools: Vec<validate::RawPool>,
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
    /// The highest return to player the pool may be loaded with
    /// ([`super::economics`]); absent from stored configs without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rtp: Option<f64>,
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

    /// The combos in configuration order, each its (multiplier, count)
    /// pairs: what a batch's commitment and its shuffle read.
    pub fn composition(&self) -> Vec<crate::fairness::ComboStock> {
        self.combos
            .iter()
            .map(|c| crate::fairness::ComboStock {
                combo: c.id.clone(),
                stock: c.stock.clone(),
            })
            .collect()
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
        message: format!(
            "not a valid pool file: {}",
            crate::config::toml_error(text, &e)
        ),
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

#[cfg(test)]
mod tests {
    use super::bounds::{spanned_batches, SPANNED_BATCHES};
    use super::*;
    use crate::kinds::lucky_gift::CodeTable;

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

    /// A batch's `pool.refilled` event lists the pool's composition: a
    /// pool whose composition could not fit a message is refused, one
    /// that just fits is loaded, and its event's bound holds.
    #[test]
    fn the_batch_event_of_a_loaded_pool_fits_a_message() {
        let pool = |combos: usize, quotes: usize| {
            let mut text = String::from(
                "[[pools]]\nid = \"p\"\nkind = \"lucky_gift\"\nunit_price = 1\nmax_count = 1\n",
            );
            for c in 0..combos {
                // A combo id of `"`s, which double when the event is written.
                let id = format!("{c:04}{}", "\\\"".repeat(quotes));
                text.push_str(&format!(
                    "[[pools.combos]]\nid = \"{id}\"\nstock = {{ \"0\" = 1, \"1\" = 1 }}\n"
                ));
            }
            text
        };
        let e = parse_file(&pool(300, 120)).unwrap_err().to_string();
        assert!(
            e.contains("pool.refilled") && e.contains("300 combos"),
            "{e}"
        );
        let fits = parse_file(&pool(100, 120)).unwrap();
        let bound = super::bounds::max_refilled_len(&fits[0]);
        assert!(bound <= crate::messages::MAX_MESSAGE_BYTES, "{bound}");
        assert!(bound > 100 * 240, "{bound}");
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

    /// A new version is bounded over the prizes of every earlier version
    /// too: batches of those may still be in the pool, and a big draw
    /// crossing them holds their (more, longer) combo ids. A version that
    /// fits alone but not with its predecessor's prizes is refused, naming
    /// how many prizes fit; that many load, and the worst draw of them over
    /// both versions' prizes fits.
    #[test]
    fn a_new_version_is_bounded_over_the_earlier_versions_prizes() {
        let stock = r#"{ "0" = 10, "1" = 1, "2" = 1, "3" = 1, "4" = 1 }"#;
        let v1 = &parse_file(&big_pool(80, stock, 100, "")).expect("the first version loads")[0];
        let mut v2 = parse_file(
            "[[pools]]\nid = \"big\"\nkind = \"lucky_gift\"\nunit_price = 1\nmax_count = 10000\n\
             [[pools.combos]]\nid = \"c\"\nstock = { \"0\" = 10, \"1\" = 1 }\n",
        )
        .expect("the second version loads on its own")
        .remove(0);
        let table = CodeTable::extend(Some(&CodeTable::extend(None, v1)), &v2);
        // The draw the bound must cover: 10,000 prizes cycling through
        // every prize of both versions.
        let pairs: Vec<(&str, u64)> = table.pairs().collect();
        let worst =
            crate::messages::PrizeCodes::encode((0..10_000).map(|k| pairs[k % pairs.len()]));
        let worst_len = serde_json::to_vec(&worst).unwrap().len();
        assert!(
            worst_len > crate::messages::MAX_MESSAGE_BYTES,
            "{worst_len}"
        );
        let e = check_table_bounds(&v2, &table).unwrap_err();
        assert!(
            e.contains("earlier versions") && e.contains("at most"),
            "{e}"
        );
        let fits: u32 = e
            .rsplit("at most ")
            .next()
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert!(fits < 10_000);
        v2.max_count = fits;
        check_table_bounds(&v2, &table).unwrap();
        let worst =
            crate::messages::PrizeCodes::encode((0..fits as usize).map(|k| pairs[k % pairs.len()]));
        assert!(
            serde_json::to_vec(&worst).unwrap().len() + 1024 <= crate::messages::MAX_MESSAGE_BYTES
        );
    }

    proptest::proptest! {
        /// The load bound is sound: for any pool that loads, a reply to a
        /// draw of `max_count` prizes in the worst order (every prize unlike
        /// its neighbour, cycling through every distinct prize), with the
        /// longest ids and numbers and the fairness record of every batch
        /// it can span (each run covering the most positions a batch holds,
        /// held back or not, as a draw that meets the jackpot rule writes
        /// it), of as many runs of prizes taken from the parked ones as a
        /// draw may take, and a reveal for each, sealed as its event, takes
        /// no more than [`max_reply_len`], which is within 64 KiB.
        #[test]
        fn the_load_bound_covers_the_worst_reply(
            combos in proptest::collection::vec(
                (1usize..=64, proptest::collection::btree_map(0u64..=1_000_000, 1i64..400, 1..12)),
                1..12,
            ),
            max_count in 1u32..=10_000,
            jackpot in proptest::option::of(1u64..=1_000_000),
        ) {
            let mut text = format!(
                "[[pools]]\nid = \"{}\"\nkind = \"lucky_gift\"\nunit_price = 1\nmax_count = {max_count}\n",
                "p".repeat(crate::messages::MAX_ID_LEN)
            );
            if let Some(min) = jackpot {
                text.push_str(&format!(
                    "jackpot = {{ min_multiplier = {min}, daily_consumption_threshold = 1000 }}\n"
                ));
            }
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
            // A batch gives a draw at least its prizes below the rule (all
            // of them when the rule gates every prize: then only an open
            // draw wins).
            let below: u64 = config
                .combos
                .iter()
                .flat_map(|c| c.stock.iter())
                .filter(|(m, _)| !config.is_jackpot(*m))
                .map(|(_, n)| n)
                .sum();
            let per_batch = if below > 0 { below } else { config.batch_size() };
            let batches = (count.div_ceil(per_batch as usize) + 1).min(SPANNED_BATCHES);
            assert_eq!(batches, spanned_batches(&config, count));
            let big = 9_999_999_999u64;
            let run = crate::messages::PrizeRun {
                held_back: 49_999_999,
                ..crate::messages::PrizeRun::new(big, 49_999_999, 49_999_999)
            };
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
                positions: (0..batches + HELD_RUNS).map(|_| run).collect(),
                held_back_min_multiplier: Some(crate::kinds::lucky_gift::config::MAX_MULTIPLIER),
                revealed: (0..batches + HELD_RUNS)
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
