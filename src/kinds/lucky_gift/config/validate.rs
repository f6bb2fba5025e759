//! A pool file's `[[pools]]` table as written, and its validation into a
//! [`PoolConfig`]: the pool's own fields, its jackpot, its combos, its
//! shards, then the bounds of its batch and its largest draw.

use std::collections::{BTreeMap, HashSet};

use serde::Deserialize;

use super::{
    bounds::check_draw_bounds, At, Combo, ConfigError, Jackpot, PoolConfig, Storage,
    MAX_BATCH_SIZE, MAX_DAILY_THRESHOLD, MAX_MULTIPLIER, MAX_SHARDS, MAX_UNIT_PRICE,
};
use crate::messages::{check_id, check_name, MAX_DRAW_COUNT, MAX_ID_LEN};

/// A `[[pools]]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPool {
    pub(super) id: String,
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
    max_rtp: Option<f64>,
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
    pub(super) id: String,
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

/// Checks a pool table completely and builds its config; the first problem
/// found is reported with the pool, the combo and the field it concerns.
pub(super) fn validate(raw: RawPool) -> Result<PoolConfig, ConfigError> {
    let at = At {
        pool: &raw.id,
        combo: None,
    };
    let storage = check_fields(&raw, &at)?;
    let jackpot = raw.jackpot.as_ref().map(|j| jackpot(j, &at)).transpose()?;
    let combos = combos(&raw.id, &raw.combos)?;
    check_shards(&raw, &at)?;
    if let Some(max) = raw.max_rtp {
        if !(max.is_finite() && max >= 0.0) {
            return Err(at.err(
                "max_rtp",
                format!("must be a finite number of at least 0, got {max}"),
            ));
        }
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
        max_rtp: raw.max_rtp,
    };
    let at = At {
        pool: &config.id,
        combo: None,
    };
    let size = config.batch_size();
    if size > MAX_BATCH_SIZE {
        return Err(at.err(
            "combos",
            format!("a batch of {size} prizes is above the limit of {MAX_BATCH_SIZE}"),
        ));
    }
    check_draw_bounds(&config).map_err(|(field, message)| at.err(field, message))?;
    let refilled = super::bounds::max_refilled_len(&config);
    if refilled > crate::messages::MAX_MESSAGE_BYTES {
        return Err(at.err(
            "combos",
            format!(
                "the pool.refilled event of a batch could take {refilled} bytes (its composition lists {} combos and {} multipliers), above the {} byte message limit; use fewer combos, fewer multipliers or shorter combo ids",
                config.combos.len(),
                config.combos.iter().map(|c| c.stock.len()).sum::<usize>(),
                crate::messages::MAX_MESSAGE_BYTES
            ),
        ));
    }
    super::super::economics::check_max_rtp(&config)
        .map_err(|(field, message)| at.err(field, message))?;
    Ok(config)
}

/// Checks the pool's own fields (id, kind, price, storage, refill point,
/// draw size, asset) and names its storage.
fn check_fields(raw: &RawPool, at: &At<'_>) -> Result<Storage, ConfigError> {
    check_name("id", &raw.id).map_err(|e| at.err("id", e.message))?;
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
    if raw.max_count < 1 || raw.max_count > i64::from(MAX_DRAW_COUNT) {
        return Err(at.err(
            "max_count",
            format!(
                "must be between 1 and {MAX_DRAW_COUNT}, got {}",
                raw.max_count
            ),
        ));
    }
    check_id("asset", &raw.asset).map_err(|e| at.err("asset", e.message))?;
    Ok(storage)
}

/// The pool's jackpot gate: a positive multiplier and a threshold in range.
fn jackpot(j: &RawJackpot, at: &At<'_>) -> Result<Jackpot, ConfigError> {
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
    Ok(Jackpot {
        min_multiplier: j.min_multiplier.unsigned_abs(),
        daily_consumption_threshold: j.daily_consumption_threshold,
    })
}

/// The pool's combos: at least one, each id once.
fn combos(pool: &str, raw: &[RawCombo]) -> Result<Vec<Combo>, ConfigError> {
    if raw.is_empty() {
        return Err(At { pool, combo: None }.err("combos", "a pool needs at least one combo"));
    }
    let mut combo_ids = HashSet::new();
    let mut combos = Vec::with_capacity(raw.len());
    for combo in raw {
        let at = At {
            pool,
            combo: Some(&combo.id),
        };
        check_id("id", &combo.id).map_err(|e| at.err("id", e.message))?;
        if !combo_ids.insert(combo.id.clone()) {
            return Err(at.err("id", "duplicate combo id"));
        }
        combos.push(Combo {
            id: combo.id.clone(),
            stock: stock(&combo.stock, &at)?,
        });
    }
    Ok(combos)
}

/// A combo's stock as (multiplier, count) pairs in multiplier order: keys
/// that are multipliers in range, each once, with positive counts.
fn stock(raw: &BTreeMap<String, i64>, at: &At<'_>) -> Result<Vec<(u64, u64)>, ConfigError> {
    if raw.is_empty() {
        return Err(at.err("stock", "a combo needs at least one prize"));
    }
    let mut stock = Vec::with_capacity(raw.len());
    for (key, count) in raw {
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
    Ok(stock)
}

/// The pool's sub-pool count, and room in its id for their suffix.
fn check_shards(raw: &RawPool, at: &At<'_>) -> Result<(), ConfigError> {
    if !(1..=i64::from(MAX_SHARDS)).contains(&raw.shards) {
        return Err(at.err(
            "shards",
            format!("must be between 1 and {MAX_SHARDS}, got {}", raw.shards),
        ));
    }
    // Sub-pool ids travel in refill requests, which take ids up to the
    // usual length.
    if raw.shards > 1 && raw.id.len() + 3 > MAX_ID_LEN {
        return Err(at.err(
            "id",
            format!(
                "a sharded pool's id must leave room for its sub-pools' suffix: at most {} bytes",
                MAX_ID_LEN - 3
            ),
        ));
    }
    Ok(())
}
