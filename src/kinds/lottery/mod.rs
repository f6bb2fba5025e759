//! Lottery activities (SPEC §5): a time window, per-user chances, prizes
//! with stock, and a pluggable draw strategy.
//!
//! A strategy is one module implementing [`Strategy`], registered by its
//! label in [`strategy`]. Redis layout of activity `id` (hash tag `{id}`):
//! `meta` (window, strategy, prizes), `stock`, `awarded`, `chances`,
//! `g:<grant_id>`, `r:<request_id>`, `pv:YYYYMMDD`, `uv:YYYYMMDD` (HyperLogLog).

pub mod config;
mod wheel;

use futures_util::future::BoxFuture;
use redis::aio::ConnectionLike;

use crate::redis_conn::RedisConn;
use sqlx::PgPool;

pub use config::{parse_file, ActivityConfig};

use crate::scripts::{PoolKeys, Scripts};

/// Kind label stored in `meta.kind` and in the pool registry.
pub const KIND: &str = "lottery";
/// PV and UV counters live eight days.
pub const STATS_TTL_S: u64 = 8 * 24 * 3600;
/// Grant ids are remembered this long.
pub const GRANT_TTL_S: u64 = 30 * 24 * 3600;

/// What a strategy needs for one draw.
#[derive(Debug)]
pub struct DrawContext<'a> {
    pub conn: &'a mut RedisConn,
    pub scripts: &'a Scripts,
    pub keys: &'a PoolKeys,
    pub request_id: &'a str,
    pub user: i64,
    pub result_ttl_s: u64,
}

/// The answer of one lottery draw step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LotteryStep {
    Won {
        prize: String,
        chances_left: u64,
        replayed: bool,
    },
    NotStarted,
    Ended,
    NoChances,
    SoldOut,
    Unknown,
}

impl LotteryStep {
    /// Reads the `{status, "<prize>|<chances left>"}` reply every strategy's script gives.
    pub fn from_reply(status: &str, text: &str) -> Self {
        match status {
            "ok" | "dup" => match text.rsplit_once('|') {
                Some((prize, left)) => Self::Won {
                    prize: prize.to_owned(),
                    chances_left: left.parse().unwrap_or(0),
                    replayed: status == "dup",
                },
                None => Self::Unknown,
            },
            "not_started" => Self::NotStarted,
            "ended" => Self::Ended,
            "no_chances" => Self::NoChances,
            "sold_out" => Self::SoldOut,
            _ => Self::Unknown,
        }
    }
}

/// A draw strategy: validates the activities that name it and performs a
/// draw as one atomic Redis step.
pub trait Strategy: Send + Sync + std::fmt::Debug {
    /// The label activities use in `strategy = "…"`.
    fn label(&self) -> &'static str;
    /// Refuses activities this strategy cannot run.
    fn validate(&self, activity: &ActivityConfig) -> Result<(), String>;
    /// The script call of one draw: window, chance, pick and stock in one
    /// step. The script answers `{status, "<prize>|<chances left>"}` (see
    /// [`LotteryStep::from_reply`]).
    fn invocation<'a>(
        &self,
        scripts: &'a Scripts,
        keys: &PoolKeys,
        request_id: &str,
        user: i64,
        result_ttl_s: u64,
    ) -> redis::ScriptInvocation<'a>;
    /// One draw.
    fn draw<'a>(
        &'a self,
        ctx: DrawContext<'a>,
    ) -> BoxFuture<'a, Result<LotteryStep, redis::RedisError>> {
        Box::pin(async move {
            let (status, text): (String, String) = self
                .invocation(
                    ctx.scripts,
                    ctx.keys,
                    ctx.request_id,
                    ctx.user,
                    ctx.result_ttl_s,
                )
                .invoke_async(ctx.conn)
                .await?;
            Ok(LotteryStep::from_reply(&status, &text))
        })
    }
}

static WHEEL: wheel::Wheel = wheel::Wheel;

/// Every registered strategy. A new one is a module and a line here.
fn registry() -> [&'static dyn Strategy; 1] {
    [&WHEEL]
}

/// The strategy registered under `label`.
pub fn strategy(label: &str) -> Option<&'static dyn Strategy> {
    registry().into_iter().find(|s| s.label() == label)
}

/// The registered labels.
pub fn labels() -> Vec<&'static str> {
    registry().iter().map(|s| s.label()).collect()
}

/// The wheel's pick, as `draw_wheel.lua` makes it: `r` modulo the total
/// weight, walked through the candidates in order. Returns the index of the
/// chosen candidate, or `None` when every weight is zero. The script is
/// tested against this model.
pub fn pick_weighted(weights: &[u64], r: u64) -> Option<usize> {
    let total: u64 = weights.iter().sum();
    if total == 0 {
        return None;
    }
    let mut r = r % total;
    for (i, w) in weights.iter().enumerate() {
        if r < *w {
            return Some(i);
        }
        r -= w;
    }
    None
}

/// Stores a new version of each activity in Postgres (all or nothing) and
/// writes its settings and initial stock to Redis.
pub async fn load<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    scripts: &Scripts,
    prefix: &str,
    activities: &[ActivityConfig],
) -> anyhow::Result<Vec<(String, i32)>> {
    let mut tx = db.begin().await?;
    let mut versions = Vec::new();
    for a in activities {
        sqlx::query("INSERT INTO pools (id, kind) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
            .bind(&a.id)
            .bind(KIND)
            .execute(&mut *tx)
            .await?;
        let (kind,): (String,) = sqlx::query_as("SELECT kind FROM pools WHERE id = $1 FOR UPDATE")
            .bind(&a.id)
            .fetch_one(&mut *tx)
            .await?;
        anyhow::ensure!(
            kind == KIND,
            "id {:?} already names a {kind}, not an activity",
            a.id
        );
        let previous: Option<(Option<String>,)> = sqlx::query_as(
            "SELECT config->>'strategy' FROM activity_versions WHERE activity_id = $1 ORDER BY version DESC LIMIT 1",
        )
        .bind(&a.id)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((Some(previous),)) = previous {
            // Draw workers resolve an activity's strategy once and keep it.
            anyhow::ensure!(
                previous == a.strategy,
                "activity {:?}: field `strategy`: cannot change from {previous:?} to {:?} on a loaded activity",
                a.id,
                a.strategy
            );
        }
        let (version,): (i32,) = sqlx::query_as(
            "SELECT coalesce(max(version), 0) + 1 FROM activity_versions WHERE activity_id = $1",
        )
        .bind(&a.id)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO activity_versions (activity_id, version, config) VALUES ($1, $2, $3)",
        )
        .bind(&a.id)
        .bind(version)
        .bind(sqlx::types::Json(a))
        .execute(&mut *tx)
        .await?;
        versions.push((a.id.clone(), version));
    }
    tx.commit().await?;
    for (a, (_, version)) in activities.iter().zip(&versions) {
        let keys = PoolKeys::new(prefix, &a.id);
        let prizes: Vec<String> = a
            .prizes
            .iter()
            .map(|p| format!("{}:{}", p.id, p.weight))
            .collect();
        let consolation = a
            .consolation
            .as_ref()
            .map(|c| format!("{}:{}", c.id, c.weight))
            .unwrap_or_default();
        let mut inv = scripts.configure_activity.key(keys.meta());
        inv.key(keys.stock())
            .arg(version)
            .arg(&a.strategy)
            .arg(a.starts_at.timestamp_millis())
            .arg(a.ends_at.timestamp_millis())
            .arg(prizes.join(","))
            .arg(consolation);
        for p in &a.prizes {
            inv.arg(&p.id).arg(p.stock);
        }
        let (status, detail): (String, String) = inv.invoke_async(redis).await?;
        anyhow::ensure!(
            status == "ok",
            "activity {} not written to Redis: {status} {detail}",
            a.id
        );
    }
    Ok(versions)
}

/// Adds `chances` for `user`, once per `grant_id`. Returns the chances the
/// user holds, or `None` when there is no such activity.
pub async fn grant<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    grant_id: &str,
    user: i64,
    chances: u32,
) -> Result<Option<i64>, redis::RedisError> {
    let (status, left): (String, i64) = scripts
        .grant_chances
        .key(keys.meta())
        .key(keys.chances())
        .key(keys.grant(grant_id))
        .arg(user)
        .arg(chances)
        .arg(GRANT_TTL_S)
        .invoke_async(conn)
        .await?;
    Ok((status != "unknown").then_some(left))
}

/// An activity's counters for one day.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub activity: String,
    pub day: String,
    pub pv: u64,
    pub uv: u64,
    /// (prize, awarded, stock left; `None` for the consolation prize)
    pub prizes: Vec<(String, u64, Option<u64>)>,
}

/// kind, prizes, consolation, PV, UV, awarded, stock.
type StatsReply = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<u64>,
    u64,
    std::collections::HashMap<String, u64>,
    std::collections::HashMap<String, u64>,
);

/// PV, UV and per-prize counts of `activity` on `day` (`YYYYMMDD`).
pub async fn stats<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    activity: &str,
    day: &str,
) -> Result<Option<Stats>, redis::RedisError> {
    let (kind, prizes, consolation, pv, uv, awarded, stock): StatsReply = redis::pipe()
        .cmd("HGET")
        .arg(keys.meta())
        .arg("kind")
        .cmd("HGET")
        .arg(keys.meta())
        .arg("prizes")
        .cmd("HGET")
        .arg(keys.meta())
        .arg("consolation")
        .cmd("GET")
        .arg(keys.pv(day))
        .cmd("PFCOUNT")
        .arg(keys.uv(day))
        .cmd("HGETALL")
        .arg(keys.awarded())
        .cmd("HGETALL")
        .arg(keys.stock())
        .query_async(conn)
        .await?;
    if kind.as_deref() != Some(KIND) {
        return Ok(None);
    }
    let mut rows = Vec::new();
    for entry in prizes
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
    {
        let id = entry.split(':').next().unwrap_or_default().to_owned();
        rows.push((
            id.clone(),
            awarded.get(&id).copied().unwrap_or(0),
            Some(stock.get(&id).copied().unwrap_or(0)),
        ));
    }
    if let Some(c) = consolation.filter(|c| !c.is_empty()) {
        let id = c.split(':').next().unwrap_or_default().to_owned();
        rows.push((id.clone(), awarded.get(&id).copied().unwrap_or(0), None));
    }
    Ok(Some(Stats {
        activity: activity.to_owned(),
        day: day.to_owned(),
        pv: pv.unwrap_or(0),
        uv,
        prizes: rows,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = r#"
[[activities]]
id = "spring-2027"
strategy = "wheel"
starts_at = "2027-01-20T00:00:00Z"
ends_at = "2027-02-05T00:00:00Z"
prizes = [ { id = "ipad", weight = 1, stock = 10 },
           { id = "coupon-5", weight = 100, stock = 10000 } ]
consolation = { id = "points-10", weight = 500 }
"#;

    #[test]
    fn spec_example_parses_and_bad_ones_name_the_field() {
        let a = parse_file(SPEC).unwrap();
        assert_eq!(a[0].prizes.len(), 2);
        let e = parse_file(&SPEC.replace("\"wheel\"", "\"slots\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("strategy") && e.contains("slots"), "{e}");
        let e = parse_file(&SPEC.replace("stock = 10 }", "stock = 0 }"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("prizes.ipad.stock"), "{e}");
        let e = parse_file(&SPEC.replace("2027-02-05", "2027-01-01"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ends_at"), "{e}");
        let e = parse_file(&SPEC.replace("consolation = { id = \"points-10\", weight = 500 }", ""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("consolation"), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn picks_follow_the_weights(weights in proptest::collection::vec(0u64..50, 1..10), r in proptest::prelude::any::<u64>()) {
            match pick_weighted(&weights, r) {
                None => proptest::prop_assert_eq!(weights.iter().sum::<u64>(), 0),
                Some(i) => {
                    // Never a zero-weight (sold-out) candidate.
                    proptest::prop_assert!(weights[i] > 0);
                    let total: u64 = weights.iter().sum();
                    let before: u64 = weights[..i].iter().sum();
                    proptest::prop_assert!(before <= r % total && r % total < before + weights[i]);
                }
            }
        }
    }

    #[test]
    fn the_wheel_is_registered() {
        assert_eq!(strategy("wheel").map(|s| s.label()), Some("wheel"));
        assert!(strategy("nope").is_none());
    }
}
