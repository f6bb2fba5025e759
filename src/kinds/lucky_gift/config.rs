//! Pool configuration files (SPEC §3) and their validation.
//!
//! A file is checked completely before anything is stored: the first problem
//! found is reported with the pool, the combo and the field it concerns.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

/// Largest batch a pool may define (prizes per batch).
pub const MAX_BATCH_SIZE: u64 = 50_000_000;

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

/// How a pool keeps its prizes in Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Storage {
    /// Every prize is a list element (two bytes each for small codes).
    List,
    /// Only non-zero prizes are stored, by index.
    Sparse,
}

impl Storage {
    /// The storage a pool's `meta.storage` names (`list` when absent).
    pub fn from_label(label: Option<&str>) -> Self {
        match label {
            Some("sparse") => Self::Sparse,
            _ => Self::List,
        }
    }
}

/// The jackpot rule: prizes of `min_multiplier` or more wait until the
/// pool's consumption today reaches `daily_consumption_threshold`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Jackpot {
    pub min_multiplier: u64,
    pub daily_consumption_threshold: i64,
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
}

impl PoolConfig {
    /// Prizes in one batch (every combo once).
    pub fn batch_size(&self) -> u64 {
        self.combos.iter().map(Combo::size).sum()
    }

    /// Whether a prize of this multiplier is subject to the jackpot rule.
    pub fn is_jackpot(&self, multiplier: u64) -> bool {
        self.jackpot
            .as_ref()
            .is_some_and(|j| multiplier >= j.min_multiplier)
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
    crate::messages::check_id("id", &raw.id).map_err(|e| at.err("id", e.message))?;
    if raw.kind != "lucky_gift" {
        return Err(at.err(
            "kind",
            format!(
                "unknown kind {:?} (pool files hold \"lucky_gift\" pools)",
                raw.kind
            ),
        ));
    }
    if raw.unit_price <= 0 {
        return Err(at.err(
            "unit_price",
            format!("must be positive, got {}", raw.unit_price),
        ));
    }
    let storage = match raw.storage.as_str() {
        "list" => Storage::List,
        "sparse" => Storage::Sparse,
        other => {
            return Err(at.err(
                "storage",
                format!("unknown storage {other:?} (expected \"list\" or \"sparse\")"),
            ))
        }
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
            if j.daily_consumption_threshold < 0 {
                return Err(at.err(
                    "jackpot.daily_consumption_threshold",
                    "must not be negative",
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
    let config = PoolConfig {
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
    Ok(config)
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
}
