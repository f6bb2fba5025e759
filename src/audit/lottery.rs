//! The lottery verifier (`docs/fairness.md`, "Lotteries"): recomputes every
//! recorded `wheel` draw of an activity from its period's revealed seed and
//! checks it against the period's commitment, the activity's configured
//! weights and its stock.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;
use sqlx::{types::Json, PgPool};

use crate::{
    fairness::{lottery_context, lottery_pick, lottery_values, Seed},
    kinds::lottery::ActivityConfig,
    messages::PrizeWeight,
};

/// Values a verifier derives per draw: the fleet gives up after 12
/// rejected ones (`kinds::lottery`), so a recorded value is among them.
const VALUES_CHECKED: usize = 12;

/// The verdict on one activity: one entry per seed period.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LotteryVerdict {
    pub pool: String,
    /// Always `lottery`: tells this shape from a pool's.
    pub kind: &'static str,
    /// Whether every period checked holds (unrevealed periods do not count
    /// against it: they cannot be checked yet).
    pub ok: bool,
    pub periods: Vec<PeriodVerdict>,
}

/// The verdict on one seed period.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeriodVerdict {
    /// The period's start, unix seconds.
    pub period: u64,
    pub period_s: Option<u64>,
    /// `ok`, `unrevealed` (the seed is still secret: nothing checked yet),
    /// or `mismatch` (see `first_mismatch`).
    pub status: &'static str,
    pub commitment: Option<String>,
    pub seed: Option<String>,
    /// Recorded draws of the period, checked in serial order.
    pub draws_checked: u64,
    pub first_mismatch: Option<LotteryMismatch>,
}

/// The first thing that does not hold in a period.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LotteryMismatch {
    /// What failed: `commitment` (no commitment recorded for the period, or
    /// the revealed seed is not the committed one), `weight` (a candidate's
    /// weight is no configured weight of that prize, or a prize is not one
    /// of the activity's), `stock` (a prize picked or offered after its
    /// stock ran out), `value` (not the value the seed gives the request),
    /// `prize` (the value does not land on the prize awarded).
    pub check: &'static str,
    pub reason: String,
    /// The draw it was found in, when it is about a draw.
    pub request_id: Option<String>,
    pub serial: Option<i64>,
    /// What the seed, the configuration or the stock say, and what the
    /// record says (as text).
    pub expected: Option<String>,
    pub found: Option<String>,
}

impl std::fmt::Display for LotteryMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.check, self.reason)?;
        if let (Some(id), Some(serial)) = (&self.request_id, self.serial) {
            write!(f, " (draw {id}, serial {serial})")?;
        }
        if let (Some(e), Some(x)) = (&self.expected, &self.found) {
            write!(f, ": expected {e}, found {x}")?;
        }
        Ok(())
    }
}

/// One recorded draw.
#[derive(sqlx::FromRow)]
struct DrawRow {
    serial: i64,
    request_id: String,
    period: i64,
    value: i64,
    weights: Json<Vec<PrizeWeight>>,
    prize: String,
}

/// Whether `activity` is a lottery activity this database knows.
pub async fn is_activity(db: &PgPool, activity: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pools WHERE id = $1 AND kind = $2)
             OR EXISTS (SELECT 1 FROM fair_lottery_seeds WHERE activity = $1)",
    )
    .bind(activity)
    .bind(crate::kinds::lottery::KIND)
    .fetch_one(db)
    .await
}

/// Verifies every recorded period and draw of `activity`.
pub async fn verify_activity(db: &PgPool, activity: &str) -> Result<LotteryVerdict, sqlx::Error> {
    let seeds: Vec<(i64, i64, String)> = sqlx::query_as(
        "SELECT period, period_s, commitment FROM fair_lottery_seeds WHERE activity = $1",
    )
    .bind(activity)
    .fetch_all(db)
    .await?;
    let reveals: Vec<(i64, String)> =
        sqlx::query_as("SELECT period, seed FROM fair_lottery_reveals WHERE activity = $1")
            .bind(activity)
            .fetch_all(db)
            .await?;
    let draws: Vec<DrawRow> = sqlx::query_as(
        "SELECT serial, request_id, period, value, weights, prize
           FROM fair_lottery_draws WHERE activity = $1 ORDER BY serial",
    )
    .bind(activity)
    .fetch_all(db)
    .await?;
    let configs: Vec<Json<ActivityConfig>> = sqlx::query_scalar(
        "SELECT config FROM activity_versions WHERE activity_id = $1 ORDER BY version",
    )
    .bind(activity)
    .fetch_all(db)
    .await?;
    let configs: Vec<ActivityConfig> = configs.into_iter().map(|Json(c)| c).collect();

    let mut periods: BTreeMap<u64, PeriodVerdict> = BTreeMap::new();
    let entry = |periods: &mut BTreeMap<u64, PeriodVerdict>, p: u64| {
        periods.entry(p).or_insert_with(|| PeriodVerdict {
            period: p,
            period_s: None,
            status: "ok",
            commitment: None,
            seed: None,
            draws_checked: 0,
            first_mismatch: None,
        });
    };
    for (p, len, commitment) in &seeds {
        entry(&mut periods, *p as u64);
        if let Some(v) = periods.get_mut(&(*p as u64)) {
            v.period_s = Some(*len as u64);
            v.commitment = Some(commitment.clone());
        }
    }
    for (p, seed) in &reveals {
        entry(&mut periods, *p as u64);
        if let Some(v) = periods.get_mut(&(*p as u64)) {
            v.seed = Some(seed.clone());
        }
    }
    for d in &draws {
        entry(&mut periods, d.period as u64);
    }
    // The seed of each period, once it checks against its commitment.
    let mut usable: HashMap<u64, Seed> = HashMap::new();
    for v in periods.values_mut() {
        let mismatch = |reason: String, expected: Option<String>, found: Option<String>| {
            Some(LotteryMismatch {
                check: "commitment",
                reason,
                request_id: None,
                serial: None,
                expected,
                found,
            })
        };
        match (&v.commitment, &v.seed) {
            (None, _) => {
                v.first_mismatch = mismatch(
                    "no commitment is recorded for the period".into(),
                    None,
                    None,
                )
            }
            (Some(_), None) => v.status = "unrevealed",
            (Some(commitment), Some(seed)) => match Seed::from_hex(seed) {
                Some(s) if s.commitment() == *commitment => {
                    usable.insert(v.period, s);
                }
                parsed => {
                    v.first_mismatch = mismatch(
                        "the revealed seed is not the one committed to (SHA-256 of the seed)"
                            .into(),
                        Some(commitment.clone()),
                        Some(parsed.map_or_else(
                            || "a seed that does not read".into(),
                            |s| s.commitment(),
                        )),
                    )
                }
            },
        }
    }
    check_draws(activity, &draws, &configs, &usable, &mut periods);
    let mut out: Vec<PeriodVerdict> = periods.into_values().collect();
    for v in &mut out {
        if v.first_mismatch.is_some() {
            v.status = "mismatch";
        }
    }
    Ok(LotteryVerdict {
        pool: activity.to_owned(),
        kind: crate::kinds::lottery::KIND,
        ok: out.iter().all(|v| v.first_mismatch.is_none()),
        periods: out,
    })
}

/// Walks the draws in serial order: the stock they leave, and for each
/// draw of a revealed period its weights, value and prize.
fn check_draws(
    activity: &str,
    draws: &[DrawRow],
    configs: &[ActivityConfig],
    seeds: &HashMap<u64, Seed>,
    periods: &mut BTreeMap<u64, PeriodVerdict>,
) {
    // Each prize's configured weights (any version) and its stock (set by
    // the first version listing it; a reload never refills it).
    let mut weights: HashMap<&str, HashSet<u64>> = HashMap::new();
    let mut left: HashMap<&str, u64> = HashMap::new();
    let mut unlimited: HashSet<&str> = HashSet::new();
    for c in configs {
        for p in &c.prizes {
            weights
                .entry(&p.id)
                .or_default()
                .insert(u64::from(p.weight));
            left.entry(&p.id).or_insert(p.stock);
        }
        if let Some(c) = &c.consolation {
            weights
                .entry(&c.id)
                .or_default()
                .insert(u64::from(c.weight));
            unlimited.insert(&c.id);
        }
    }
    for d in draws {
        let period = d.period as u64;
        let Some(verdict) = periods.get_mut(&period) else {
            continue;
        };
        let fail = |check: &'static str, reason: String, expected: String, found: String| {
            Some(LotteryMismatch {
                check,
                reason,
                request_id: Some(d.request_id.clone()),
                serial: Some(d.serial),
                expected: Some(expected),
                found: Some(found),
            })
        };
        let mut mismatch = None;
        for w in d.weights.iter() {
            let configured = weights.get(w.prize.as_str());
            if !configured.is_some_and(|ws| ws.contains(&w.weight)) {
                let expected = configured.map_or_else(
                    || "a prize of the activity".to_owned(),
                    |ws| format!("{:?}", ws.iter().collect::<Vec<_>>()),
                );
                mismatch = fail(
                    "weight",
                    format!(
                        "candidate {} has a weight no configuration gave it",
                        w.prize
                    ),
                    expected,
                    w.weight.to_string(),
                );
                break;
            }
            let stock = left.get(w.prize.as_str()).copied();
            if !unlimited.contains(w.prize.as_str()) && stock == Some(0) {
                mismatch = fail(
                    "stock",
                    format!("candidate {} was offered after its stock ran out", w.prize),
                    "0 left: not a candidate".into(),
                    format!("weight {}", w.weight),
                );
                break;
            }
        }
        if mismatch.is_none() {
            if let Some(seed) = seeds.get(&period) {
                mismatch = check_pick(activity, d, seed, &fail);
            }
        }
        // The award takes its stock whatever the verdict, so one bad draw
        // does not make every later one look wrong.
        if let Some(n) = left.get_mut(d.prize.as_str()) {
            if !unlimited.contains(d.prize.as_str()) {
                *n = n.saturating_sub(1);
            }
        }
        if seeds.contains_key(&period) {
            verdict.draws_checked += 1;
        }
        if verdict.first_mismatch.is_none() {
            verdict.first_mismatch = mismatch;
        }
    }
}

/// Checks one draw's value and prize against its period's seed.
fn check_pick(
    activity: &str,
    d: &DrawRow,
    seed: &Seed,
    fail: &dyn Fn(&'static str, String, String, String) -> Option<LotteryMismatch>,
) -> Option<LotteryMismatch> {
    let context = lottery_context(activity, d.period as u64, &d.request_id);
    let values = lottery_values(seed, &context, 0, VALUES_CHECKED);
    let ws: Vec<u64> = d.weights.iter().map(|w| w.weight).collect();
    let Some((value, index)) = lottery_pick(&values, &ws) else {
        return fail(
            "value",
            "the seed gives this request no usable value for these weights".into(),
            "none".into(),
            d.value.to_string(),
        );
    };
    if value != d.value as u64 {
        return fail(
            "value",
            "the value is not the one the period's seed gives the request".into(),
            value.to_string(),
            d.value.to_string(),
        );
    }
    let prize = &d.weights[index].prize;
    if *prize != d.prize {
        return fail(
            "prize",
            "the value lands on another prize".into(),
            prize.clone(),
            d.prize.clone(),
        );
    }
    None
}
