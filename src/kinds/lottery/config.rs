//! Activity configuration files (SPEC §5) and their validation.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::kinds::lucky_gift::config::ConfigError;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ActivityFile {
    #[serde(default)]
    activities: Vec<RawActivity>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawActivity {
    id: String,
    strategy: String,
    starts_at: String,
    ends_at: String,
    #[serde(default)]
    prizes: Vec<RawPrize>,
    consolation: Option<RawConsolation>,
    max_cost_per_chance: Option<f64>,
    seed_period_s: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPrize {
    id: String,
    weight: i64,
    stock: i64,
    value: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConsolation {
    id: String,
    weight: i64,
    value: Option<i64>,
}

/// A prize with finite stock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prize {
    pub id: String,
    pub weight: u32,
    pub stock: u64,
    /// What one of it costs the operator, in a unit of the operator's
    /// choosing (for `pool analyze` and `max_cost_per_chance`; the ledger
    /// pays the prize itself, as one unit of asset `item:<id>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<u64>,
}

/// The prize every draw can fall back on: unlimited stock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Consolation {
    pub id: String,
    pub weight: u32,
    /// What one of it costs the operator (see [`Prize::value`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<u64>,
}

/// A validated activity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActivityConfig {
    pub id: String,
    pub strategy: String,
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    pub prizes: Vec<Prize>,
    pub consolation: Option<Consolation>,
    /// The highest expected cost of one chance (while every prize is in
    /// stock) the activity may be loaded with; absent when not declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_per_chance: Option<f64>,
    /// The length of a seed period in seconds (`docs/fairness.md`,
    /// "Lotteries"): a `wheel` draw's value comes from the committed seed of
    /// the period it falls in, revealed when the period is over. Periods
    /// start at multiples of it since the Unix epoch; absent: a UTC day.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed_period_s: Option<u64>,
}

/// A seed period of a UTC day, unless an activity names another.
pub const DEFAULT_SEED_PERIOD_S: u64 = 86_400;

impl ActivityConfig {
    /// The length of the activity's seed periods, in seconds.
    pub fn seed_period(&self) -> u64 {
        self.seed_period_s.unwrap_or(DEFAULT_SEED_PERIOD_S)
    }
}

impl ActivityConfig {
    /// Each prize's (id, weight, declared value or 0), the consolation last.
    fn weighed(&self) -> impl Iterator<Item = (&str, f64, f64)> {
        self.prizes
            .iter()
            .map(|p| {
                (
                    p.id.as_str(),
                    f64::from(p.weight),
                    p.value.unwrap_or(0) as f64,
                )
            })
            .chain(self.consolation.iter().map(|c| {
                (
                    c.id.as_str(),
                    f64::from(c.weight),
                    c.value.unwrap_or(0) as f64,
                )
            }))
    }

    /// The expected cost of one chance while every prize is in stock: each
    /// prize's declared value (0 without one) by its odds.
    pub fn cost_per_chance(&self) -> f64 {
        let total: f64 = self.weighed().map(|(_, w, _)| w).sum();
        if total == 0.0 {
            return 0.0;
        }
        self.weighed().map(|(_, w, v)| w / total * v).sum()
    }
}

/// Refuses an activity whose expected cost per chance (every prize in
/// stock) is above its `max_cost_per_chance`, naming the prize that costs
/// most per chance.
fn check_max_cost(config: &ActivityConfig) -> Result<(), String> {
    let Some(max) = config.max_cost_per_chance else {
        return Ok(());
    };
    if !(max.is_finite() && max >= 0.0) {
        return Err(format!("must be a finite number of at least 0, got {max}"));
    }
    let cost = config.cost_per_chance();
    if cost <= max {
        return Ok(());
    }
    let total: f64 = config.weighed().map(|(_, w, _)| w).sum();
    let costliest = config
        .weighed()
        .map(|(id, w, v)| (id, w / total * v))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    Err(format!(
        "a chance costs {cost:.4} on average, above max_cost_per_chance {max}{}",
        costliest.map_or_else(String::new, |(id, c)| format!(
            "; prize {id:?} makes {c:.4} of it"
        ))
    ))
}

/// A prize is paid as one unit of asset `item:<prize id>`.
pub const ASSET_PREFIX: &str = "item:";

fn err(activity: &str, field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        pool: Some(activity.to_owned()),
        combo: None,
        field: Some(field.to_owned()),
        message: message.into(),
    }
}

/// Most prizes of one activity: with weights of at most 10^9 each, the
/// total weight stays below 2^40, which keeps the wheel's pick exact and its
/// rejection rate below 2^-12 (see `lua/draw_wheel.lua`).
pub const MAX_PRIZES: usize = 1000;
/// Most stock of one prize (exact in Lua, far below 2^53).
pub const MAX_STOCK: i64 = 1_000_000_000_000;

fn weight(activity: &str, field: &str, w: i64) -> Result<u32, ConfigError> {
    u32::try_from(w)
        .ok()
        .filter(|w| (1..=1_000_000_000).contains(w))
        .ok_or_else(|| {
            err(
                activity,
                field,
                format!("weight must be between 1 and 1000000000, got {w}"),
            )
        })
}

/// Parses and validates an activity file; the strategy named by each activity
/// must be registered and accept it.
pub fn parse_file(text: &str) -> Result<Vec<ActivityConfig>, ConfigError> {
    let file: ActivityFile = toml::from_str(text).map_err(|e| ConfigError {
        pool: None,
        combo: None,
        field: None,
        message: format!(
            "not a valid activity file: {}",
            crate::config::toml_error(text, &e)
        ),
    })?;
    if file.activities.is_empty() {
        return Err(ConfigError {
            pool: None,
            combo: None,
            field: None,
            message: "the file defines no [[activities]]".into(),
        });
    }
    let mut ids = HashSet::new();
    let mut out = Vec::new();
    for raw in file.activities {
        crate::messages::check_name("id", &raw.id).map_err(|e| err(&raw.id, "id", e.message))?;
        if !ids.insert(raw.id.clone()) {
            return Err(err(&raw.id, "id", "duplicate activity id"));
        }
        out.push(activity(raw)?);
    }
    Ok(out)
}

/// Checks one activity: its window, its prizes, its consolation, and that
/// its strategy is registered and accepts it.
fn activity(raw: RawActivity) -> Result<ActivityConfig, ConfigError> {
    let id = raw.id;
    let time = |field: &str, text: &str| {
        DateTime::parse_from_rfc3339(text)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|e| err(&id, field, format!("not an RFC 3339 time ({e})")))
    };
    let starts_at = time("starts_at", &raw.starts_at)?;
    let ends_at = time("ends_at", &raw.ends_at)?;
    if ends_at <= starts_at {
        return Err(err(&id, "ends_at", "must be after starts_at"));
    }
    if raw.prizes.len() > MAX_PRIZES {
        return Err(err(
            &id,
            "prizes",
            format!("at most {MAX_PRIZES} prizes, got {}", raw.prizes.len()),
        ));
    }
    let mut prize_ids = HashSet::new();
    let mut prizes = Vec::new();
    for p in raw.prizes {
        prizes.push(prize(&id, p, &mut prize_ids)?);
    }
    let consolation = match raw.consolation {
        None => None,
        Some(c) => {
            if c.id.contains([',', ':', '|']) || !prize_ids.insert(c.id.clone()) {
                return Err(err(
                    &id,
                    "consolation.id",
                    "must be a distinct prize id without ',', ':' or '|'",
                ));
            }
            Some(Consolation {
                weight: weight(&id, "consolation.weight", c.weight)?,
                value: value(&id, "consolation.value", c.value)?,
                id: c.id,
            })
        }
    };
    let config = ActivityConfig {
        id: id.clone(),
        strategy: raw.strategy,
        starts_at,
        ends_at,
        prizes,
        consolation,
        max_cost_per_chance: raw.max_cost_per_chance,
        seed_period_s: match raw.seed_period_s {
            None => None,
            // At most a day, so that a request id sent again after its
            // answer expired (kept at least a day) falls in another period,
            // with another seed: its value is never the one it had.
            Some(s @ 1..=86_400) => Some(s as u64),
            Some(s) => {
                return Err(err(
                    &id,
                    "seed_period_s",
                    format!("must be between 1 and 86400 seconds, got {s}"),
                ))
            }
        },
    };
    check_max_cost(&config).map_err(|m| err(&id, "max_cost_per_chance", m))?;
    let strategy = super::strategy(&config.strategy).ok_or_else(|| {
        err(
            &id,
            "strategy",
            format!(
                "unknown strategy {:?} (known: {})",
                config.strategy,
                super::labels().join(", ")
            ),
        )
    })?;
    strategy
        .validate(&config)
        .map_err(|m| err(&id, "strategy", m))?;
    let reply = max_reply_len(&config);
    if reply > crate::messages::MAX_MESSAGE_BYTES {
        return Err(err(
            &id,
            "prizes",
            format!(
                "a draw's reply lists every prize in stock with its weight and could take {reply} bytes, above the {} byte message limit; use fewer prizes or shorter prize ids",
                crate::messages::MAX_MESSAGE_BYTES
            ),
        ));
    }
    Ok(config)
}

/// The most bytes a reply to one draw of `config` (and its sealed
/// `draw.completed` event) can take: a fixed part (type, request id and
/// activity of at most 128 bytes each as JSON escapes them, status, user,
/// serial, the event's seal), the prize won three times over (the prize,
/// its asset, its entry), and the pick: every prize with its weight.
pub fn max_reply_len(config: &ActivityConfig) -> usize {
    const FIXED: usize = 1024 + 2 * 2 * crate::messages::MAX_ID_LEN;
    let written = |id: &str| serde_json::to_string(id).map_or(usize::MAX / 4, |s| s.len());
    let ids = || {
        config
            .prizes
            .iter()
            .map(|p| p.id.as_str())
            .chain(config.consolation.iter().map(|c| c.id.as_str()))
    };
    let candidate = r#"{"prize":,"weight":1000000000},"#.len();
    let pick: usize = ids().map(|id| written(id) + candidate).sum();
    let won = ids().map(written).max().unwrap_or(0);
    FIXED + 3 * won + pick
}

/// Checks one prize of activity `id`: an id that fits an asset name and is
/// not in `prize_ids` yet (it is added), a stock and a weight in range.
fn prize(id: &str, p: RawPrize, prize_ids: &mut HashSet<String>) -> Result<Prize, ConfigError> {
    let field = format!("prizes.{}", p.id);
    crate::messages::check_id("id", &p.id).map_err(|e| err(id, &field, e.message))?;
    if p.id.len() + ASSET_PREFIX.len() > crate::messages::MAX_ID_LEN {
        return Err(err(
            id,
            &field,
            format!(
                "prize ids may be {} bytes at most (the prize is paid as asset `{ASSET_PREFIX}<id>`)",
                crate::messages::MAX_ID_LEN - ASSET_PREFIX.len()
            ),
        ));
    }
    if p.id.contains([',', ':', '|']) {
        return Err(err(id, &field, "prize ids may not contain ',', ':' or '|'"));
    }
    if !prize_ids.insert(p.id.clone()) {
        return Err(err(id, &field, "duplicate prize id"));
    }
    if !(1..=MAX_STOCK).contains(&p.stock) {
        return Err(err(
            id,
            &format!("{field}.stock"),
            format!("stock must be between 1 and {MAX_STOCK}, got {}", p.stock),
        ));
    }
    Ok(Prize {
        weight: weight(id, &format!("{field}.weight"), p.weight)?,
        stock: p.stock.unsigned_abs(),
        value: value(id, &format!("{field}.value"), p.value)?,
        id: p.id,
    })
}

/// A prize's declared value: 0 to [`MAX_STOCK`].
fn value(activity: &str, field: &str, v: Option<i64>) -> Result<Option<u64>, ConfigError> {
    v.map(|v| {
        u64::try_from(v)
            .ok()
            .filter(|v| *v <= MAX_STOCK.unsigned_abs())
            .ok_or_else(|| {
                err(
                    activity,
                    field,
                    format!("value must be between 0 and {MAX_STOCK}, got {v}"),
                )
            })
    })
    .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn activity(prize: &str) -> String {
        format!(
            "[[activities]]\nid = \"act\"\nstrategy = \"wheel\"\nstarts_at = \"2026-01-01T00:00:00Z\"\nends_at = \"2027-01-01T00:00:00Z\"\nprizes = [ {{ id = \"{prize}\", weight = 1, stock = 5 }} ]\n"
        )
    }

    #[test]
    fn a_prize_id_leaves_room_for_its_asset_name() {
        let longest = "z".repeat(crate::messages::MAX_ID_LEN - ASSET_PREFIX.len());
        assert!(parse_file(&activity(&longest)).is_ok());
        let err = parse_file(&activity(&format!("{longest}z"))).unwrap_err();
        assert!(err.to_string().contains("123 bytes at most"), "{err}");
    }

    /// A reply lists every prize in stock: an activity of 1,000 prizes
    /// with 60-byte ids of `"` (doubled once written) is refused, one of
    /// 1,000 short ids loads, and the bound is above what such a reply
    /// really takes.
    #[test]
    fn a_draws_reply_fits_a_message() {
        let wheel = |n: usize, id: &dyn Fn(usize) -> String| {
            let prizes: Vec<String> = (0..n)
                .map(|i| format!("{{ id = \"{}\", weight = 1000000000, stock = 5 }}", id(i)))
                .collect();
            format!(
                "[[activities]]\nid = \"act\"\nstrategy = \"wheel\"\nstarts_at = \"2026-01-01T00:00:00Z\"\nends_at = \"2027-01-01T00:00:00Z\"\nprizes = [ {} ]\n",
                prizes.join(", ")
            )
        };
        let quoted = |i: usize| format!("{i:04}{}", "\\\"".repeat(56));
        let e = parse_file(&wheel(1000, &quoted)).unwrap_err().to_string();
        assert!(e.contains("message limit"), "{e}");
        let short = parse_file(&wheel(1000, &|i| format!("p{i}"))).unwrap();
        let bound = max_reply_len(&short[0]);
        assert!(bound <= crate::messages::MAX_MESSAGE_BYTES, "{bound}");
        let pick = crate::messages::LotteryPick {
            value: u64::MAX,
            weights: short[0]
                .prizes
                .iter()
                .map(|p| crate::messages::PrizeWeight {
                    prize: p.id.clone(),
                    weight: 1_000_000_000,
                })
                .collect(),
            period: Some(u64::MAX),
        };
        assert!(serde_json::to_vec(&pick).unwrap().len() < bound);
    }

    #[test]
    fn activity_names_have_no_entry_id_syntax() {
        let text = activity("x").replace("id = \"act\"", "id = \"a:b\"");
        assert!(parse_file(&text).is_err());
    }
}
