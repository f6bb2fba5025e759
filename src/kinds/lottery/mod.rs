//! Lottery activities (SPEC §5): a time window, per-user chances, prizes
//! with stock, and a pluggable draw strategy.
//!
//! A strategy is one module implementing [`Strategy`], registered by its
//! label in [`strategy`]. Redis layout of activity `id` (hash tag `{id}`):
//! `meta` (window, strategy, prizes, and the counters a draw changes: each
//! prize's stock left and awards, each user's chances, the award serial and
//! today's visits, so a draw reads and writes one hash; see
//! `lua/lib/lottery.lua`), `g:<grant_id>`, `rs` (the answer store,
//! [`crate::kinds::answer`]), `pv:YYYYMMDD` (a past day's visits),
//! `uv:YYYYMMDD` (HyperLogLog), and for an activity loaded before the
//! counters moved into `meta`, `stock`, `awarded` and `chances` (moved into
//! `meta` by the activity's next load or draw, and a user's chances by the
//! user's next draw or grant).
//!
//! # Races and ordering
//!
//! - **Concurrent draws.** A draw is one Lua step: window, the user's
//!   chance, the pick, the prize's stock and the answer together. Redis runs
//!   the steps of one activity one after another, so a chance is spent once
//!   and a prize is never awarded beyond its stock, whatever the number of
//!   workers drawing at once; a prize whose stock ran out between two draws
//!   is simply no longer picked.
//! - **A grant racing a draw.** A grant is one step too and only adds: a
//!   draw sees the chances before or after it, never half of it. Grants are
//!   idempotent by grant id (`g:<grant_id>` keeps the first answer).
//! - **A retry of the same request, or a worker killed before publishing.**
//!   The step stores its answer with its effect; the redelivery replays it,
//!   with the same serial, so the ledger entry has the same id and is paid
//!   once. A refusal (`no_chances`, `ended`, …) is stored too and stays the
//!   answer.
//! - **A pick with no usable value.** The step answers `retry` and changes
//!   nothing (not even the visit counters); [`draw`] asks again with the
//!   next values of the same derivation.
//! - **A period without a committed seed.** A `wheel` draw's values come
//!   from its period's committed seed ([`seeds`]); a step that finds none,
//!   or another one than the values came from, answers `short` and changes
//!   nothing, and the draw waits for the refill worker to commit one, as a
//!   draw on a short pool waits for a batch.
//! - **A reload.** `activity load` rewrites the window and the weights in
//!   one step and never touches the stock of a prize already stocked, so a
//!   draw sees the old settings or the new ones, and "never beyond stock"
//!   holds across versions.

pub mod config;
mod counters;
pub mod economics;
mod kind;
mod ladder;
mod lifecycle;
pub mod reasons;
pub mod scripts;
pub mod seeds;
mod wheel;

use crate::kinds::lottery::scripts as lua;
use redis::aio::ConnectionLike;
use sqlx::PgPool;

pub use config::{parse_file, ActivityConfig};
pub use counters::{chances_left, stats, Stats};
pub use kind::{labels, strategy, Lottery, LOTTERY};

use crate::{
    amqp::HandleError,
    kinds::{Ask, Award, ScriptReply, Step},
    messages::{
        DrawResult, EntryRef, Invalid, LotteryPick, Prize, PrizeWeight, SettleRequest, Status,
    },
    scripts::PoolKeys,
};

/// Kind label stored in `meta.kind` and in the pool registry.
pub use reasons::KIND;
/// PV and UV counters live eight days.
pub const STATS_TTL_S: u64 = 8 * 24 * 3600;
/// Grant ids are remembered this long.
pub const GRANT_TTL_S: u64 = 30 * 24 * 3600;

/// A draw strategy: validates the activities that name it and performs a
/// draw as one atomic Redis step.
///
/// The step's script follows `lua/lib/answer.lua` (it is prepended): it
/// replays a request's stored answer, refuses with `not_started`, `ended`,
/// `no_chances`, `sold_out` or `unknown_pool` (stored), or awards and
/// answers `{"ok", "<prize>|<chances left>", 0}`; `{"retry", "", 0}` asks
/// for the next values and means nothing changed; a seeded strategy's
/// `{"short", "0", <period>}` means the period has no committed seed (or
/// another one than `pick` names) and nothing changed.
pub trait Strategy: Send + Sync + std::fmt::Debug {
    /// The label activities use in `strategy = "…"`.
    fn label(&self) -> &'static str;
    /// Refuses activities this strategy cannot run.
    fn validate(&self, activity: &ActivityConfig) -> Result<(), String>;
    /// Whether the strategy's picks are random: then its values come from
    /// the period's committed seed ([`seeds`]). A deterministic strategy
    /// (the ladder) needs none.
    fn seeded(&self) -> bool {
        false
    }
    /// The script call of one draw: window, chance, pick and stock in one
    /// step, with `pick`'s clock, values and seed.
    fn invocation(
        &self,
        keys: &PoolKeys,
        ask: &Ask<'_>,
        pick: &Pick,
    ) -> crate::scripts::ScriptInvocation<'static>;
}

/// What a draw step's pick gets: the clock the step reads the window and
/// the period with, the values (comma-separated, see
/// [`crate::fairness::lottery_values`]) and the period and commitment of
/// the seed they came from.
#[derive(Clone, Debug)]
pub struct Pick {
    pub now_ms: i64,
    pub values: String,
    pub period: u64,
    pub commitment: String,
}

impl Pick {
    /// A pick without a seed: a deterministic strategy's, or a seeded one's
    /// that is to find no committed seed (`short`).
    pub fn unseeded(now_ms: i64) -> Self {
        Self {
            now_ms,
            values: "0".to_owned(),
            period: 0,
            commitment: String::new(),
        }
    }

    /// Values `try_ * VALUES_PER_TRY ..` of the draw of `ask` under `seed`.
    fn seeded(now_ms: i64, seed: &seeds::PeriodSeed, ask: &Ask<'_>, try_: usize) -> Self {
        let context = crate::fairness::lottery_context(ask.pool, seed.period, ask.request_id);
        let values = crate::fairness::lottery_values(
            &seed.seed,
            &context,
            try_ * VALUES_PER_TRY,
            VALUES_PER_TRY,
        );
        Self {
            now_ms,
            values: values
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
            period: seed.period,
            commitment: seed.seed.commitment(),
        }
    }
}

/// Values a step gets at once; the script uses the first it accepts.
const VALUES_PER_TRY: usize = 4;

/// How many steps a draw tries, each with the next [`VALUES_PER_TRY`]
/// values, before giving up; a value is rejected with a probability below
/// 2^-12 (total weight below 2^40), so all 12 with one below 2^-144.
const PICK_TRIES: usize = 3;

/// One lottery draw through `strategy`, as the seam asks it.
///
/// Ledger entry ids: `lottery:<activity>:<request_id>:<serial>`
/// ([`crate::kinds::answer::entry_id`]), the serial counting the activity's
/// awards (stored with the answer): a replay pays under the same id, a
/// request id sent again after its answer expired, on this activity or
/// another, is a new draw paid under a new one.
pub(crate) async fn draw<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    strategy: &'static dyn Strategy,
    ask: &Ask<'_>,
) -> Result<Step, HandleError> {
    if ask.count != 1 {
        return Err(Invalid::new(format!(
            "a lottery draw spends one chance; `count` must be 1, got {}",
            ask.count
        ))
        .into());
    }
    let now_ms = crate::scripts::now_ms();
    let seed = match strategy.seeded() {
        true => Some(seeds::current(conn, keys, now_ms).await?),
        false => None,
    };
    for try_ in 0..PICK_TRIES {
        let pick = match &seed {
            None => Pick::unseeded(now_ms),
            Some(Ok(seed)) => Pick::seeded(now_ms, seed, ask, try_),
            // No committed seed known: the step still replays a stored
            // answer, refuses, or answers `short`.
            Some(Err(period)) => Pick {
                period: *period,
                ..Pick::unseeded(now_ms)
            },
        };
        let (status, text, number): (String, String, u64) = strategy
            .invocation(keys, ask, &pick)
            .invoke_async(conn)
            .await?;
        let (body, replayed) =
            match ScriptReply::read(&status, text, number, "request_id", ask.request_id)? {
                ScriptReply::Awarded(body) => (body, false),
                ScriptReply::Replayed(body) => (body, true),
                ScriptReply::Refused(refusal) => return Ok(Step::Refused(refusal)),
                ScriptReply::Retry => continue,
                ScriptReply::Short { generation, .. } => {
                    // The period's committed seed is not the one this worker
                    // knew (or there is none yet): ask for it afresh.
                    seeds::forget(keys);
                    return Ok(Step::Short {
                        in_pool: 0,
                        generation,
                    });
                }
                other => {
                    return Err(HandleError::internal(format!(
                        "unexpected lottery answer {other:?}"
                    )))
                }
            };
        return award(ask, &body, replayed).map(|a| Step::Awarded(Box::new(a)));
    }
    Err(HandleError::internal(
        "the lottery pick rejected every random value",
    ))
}

/// The pick record `"<value>;<prize>:<weight>,...[;<period>]"` of a stored
/// answer (answers stored before picks were seeded name no period).
fn pick_record(text: &str) -> Option<LotteryPick> {
    let (value, rest) = text.split_once(';')?;
    let (weights, period) = match rest.split_once(';') {
        Some((weights, period)) => (weights, Some(period.parse().ok()?)),
        None => (rest, None),
    };
    let weights = weights
        .split(',')
        .map(|w| {
            let (prize, weight) = w.rsplit_once(':')?;
            Some(PrizeWeight {
                prize: prize.to_owned(),
                weight: weight.parse().ok()?,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(LotteryPick {
        value: value.parse().ok()?,
        weights,
        period,
    })
}

/// The award of a stored `"<serial>[~<pick record>]|<prize>|<chances left>"`
/// body.
fn award(ask: &Ask<'_>, body: &str, replayed: bool) -> Result<Award, HandleError> {
    let malformed = || HandleError::internal(format!("malformed lottery answer {body:?}"));
    let (serial, prize, left) = body
        .split_once('|')
        .and_then(|(serial, rest)| {
            let (prize, left) = rest.rsplit_once('|')?;
            Some((serial, prize, left.parse::<u64>().ok()?))
        })
        .filter(|(_, p, _)| !p.is_empty())
        .ok_or_else(malformed)?;
    let (serial, pick) = match serial.split_once('~') {
        Some((serial, record)) => (serial, Some(pick_record(record).ok_or_else(malformed)?)),
        None => (serial, None),
    };
    let serial: u64 = serial.parse().map_err(|_| malformed())?;
    if pick.as_ref().is_some_and(|p| p.prize() != Some(prize)) {
        return Err(HandleError::internal(format!(
            "lottery answer {body:?} awards another prize than its pick"
        )));
    }
    let asset = format!("{}{prize}", config::ASSET_PREFIX);
    let entry = SettleRequest::fleet(
        crate::kinds::answer::entry_id(reasons::ENTRY_IDS, ask.pool, ask.request_id, serial),
        ask.user,
        asset.as_str(),
        1,
        "lottery",
        EntryRef::prize(ask.pool, ask.request_id),
    );
    Ok(Award {
        result: DrawResult {
            request_id: ask.request_id.to_owned(),
            status: Status::Ok,
            pool: Some(ask.pool.to_owned()),
            user_id: Some(ask.user),
            prizes: vec![Prize::Item {
                prize: prize.to_owned(),
                asset,
                amount: 1,
            }],
            chances_left: Some(left),
            serial: Some(i64::try_from(serial).map_err(|_| malformed())?),
            pick,
            ..DrawResult::default()
        },
        entry: Some(entry),
        refill: None,
        replayed,
        prizes_drawn: u64::from(!replayed),
    })
}

/// The wheel's pick, as `draw_wheel.lua` makes it: the first of `random`
/// below the largest multiple of the total weight that fits in 2^52, modulo
/// the total, walked through the candidates in order. Returns the index of
/// the chosen candidate, or `None` when every weight is zero or every value
/// was rejected. The script is tested against this model.
pub fn pick_weighted(weights: &[u64], random: &[u64]) -> Option<usize> {
    let total: u64 = weights.iter().sum();
    if total == 0 {
        return None;
    }
    let span = 1u64 << 52;
    let limit = span - span % total;
    let mut r = random.iter().find(|r| **r < limit)? % total;
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
    prefix: &str,
    activities: &[ActivityConfig],
) -> anyhow::Result<Vec<(String, i32)>> {
    let mut tx = db.begin().await?;
    let mut versions = Vec::new();
    for a in activities {
        let version = store_version(&mut tx, a).await?;
        versions.push((a.id.clone(), version));
    }
    tx.commit().await?;
    for (a, (_, version)) in activities.iter().zip(&versions) {
        configure(redis, prefix, a, *version).await?;
    }
    commit_current_seeds(db, redis, prefix, activities).await?;
    Ok(versions)
}

/// Commits the seed of the current period of each open activity whose
/// strategy is seeded (`activity load` does, so the first draws do not
/// wait for the refill worker); Postgres must take the commitments.
pub async fn commit_current_seeds<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    prefix: &str,
    activities: &[ActivityConfig],
) -> anyhow::Result<()> {
    let now = chrono::Utc::now();
    for a in activities {
        let seeded = strategy(&a.strategy).is_some_and(|s| s.seeded());
        if !seeded || now < a.starts_at || now >= a.ends_at {
            continue;
        }
        let len = a.seed_period();
        let period = seeds::period_of(u64::try_from(now.timestamp()).unwrap_or(0), len);
        seeds::commit(db, redis, prefix, &a.id, period, len, None)
            .await
            .map_err(|e| {
                anyhow::anyhow!("committing the seed of period {period} of {}: {e}", a.id)
            })?;
    }
    Ok(())
}

/// Records activity `a` as a new version in Postgres: its id stays an
/// activity's and its strategy stays the one it was loaded with.
async fn store_version(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    a: &ActivityConfig,
) -> anyhow::Result<i32> {
    sqlx::query("INSERT INTO pools (id, kind) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
        .bind(&a.id)
        .bind(KIND)
        .execute(&mut **tx)
        .await?;
    let (kind,): (String,) = sqlx::query_as("SELECT kind FROM pools WHERE id = $1 FOR UPDATE")
        .bind(&a.id)
        .fetch_one(&mut **tx)
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
    .fetch_optional(&mut **tx)
    .await?;
    let previous_period: Option<(Option<i64>,)> = sqlx::query_as(
        "SELECT (config->>'seed_period_s')::bigint FROM activity_versions WHERE activity_id = $1 ORDER BY version DESC LIMIT 1",
    )
    .bind(&a.id)
    .fetch_optional(&mut **tx)
    .await?;
    if let Some((before,)) = previous_period {
        // Periods are numbered by their start: another length would make
        // the periods of the seeds committed so far overlap new ones.
        let before = before.map_or(config::DEFAULT_SEED_PERIOD_S, |s| s as u64);
        anyhow::ensure!(
            before == a.seed_period(),
            "activity {:?}: field `seed_period_s`: cannot change from {before} to {} on a loaded activity",
            a.id,
            a.seed_period()
        );
    }
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
    .fetch_one(&mut **tx)
    .await?;
    sqlx::query("INSERT INTO activity_versions (activity_id, version, config) VALUES ($1, $2, $3)")
        .bind(&a.id)
        .bind(version)
        .bind(sqlx::types::Json(a))
        .execute(&mut **tx)
        .await?;
    Ok(version)
}

/// Writes version `version` of activity `a` to Redis
/// (`lua/configure_activity.lua`): its settings, and the stock of each
/// prize it lists for the first time.
async fn configure<C: ConnectionLike + Send>(
    redis: &mut C,
    prefix: &str,
    a: &ActivityConfig,
    version: i32,
) -> anyhow::Result<()> {
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
    let mut inv = lua::CONFIGURE_ACTIVITY.key(keys.meta());
    inv.key(keys.stock())
        .key(keys.awarded())
        .arg(version)
        .arg(&a.strategy)
        .arg(a.starts_at.timestamp_millis())
        .arg(a.ends_at.timestamp_millis())
        .arg(prizes.join(","))
        .arg(consolation)
        .arg(a.seed_period());
    for p in &a.prizes {
        inv.arg(&p.id).arg(p.stock);
    }
    let (status, detail): (String, String) = inv.invoke_async(redis).await?;
    anyhow::ensure!(
        status == "ok",
        "activity {} not written to Redis: {status} {detail}",
        a.id
    );
    Ok(())
}

/// What a grant did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granted {
    /// The chances were added now or by an earlier copy of the grant; the
    /// user holds this many.
    Ok(i64),
    /// No activity has this id.
    Unknown,
    /// The grant id was first used for another grant.
    Reused,
}

/// Adds `chances` for `user` in `activity`, once per `grant_id`; the id is
/// bound to what it first granted.
pub async fn grant<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    activity: &str,
    grant_id: &str,
    user: i64,
    chances: u32,
) -> Result<Granted, HandleError> {
    let fingerprint = crate::kinds::fingerprint("grant", &[&activity, &user, &chances]);
    let (status, left): (String, i64) = lua::GRANT_CHANCES
        .key(keys.meta())
        .key(keys.chances())
        .key(keys.grant(grant_id))
        .arg(user)
        .arg(chances)
        .arg(GRANT_TTL_S)
        .arg(fingerprint.hex())
        .invoke_async(conn)
        .await?;
    Ok(match status.as_str() {
        "ok" | "dup" => Granted::Ok(left),
        "unknown" => Granted::Unknown,
        "reused" => Granted::Reused,
        other => {
            return Err(HandleError::internal(format!(
                "unexpected grant answer {other:?}"
            )))
        }
    })
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
        // A wheel without consolation is allowed (a draw after every prize
        // is gone answers sold_out); one with neither prizes nor consolation is not.
        let bare = SPEC.replace("consolation = { id = \"points-10\", weight = 500 }", "");
        assert!(parse_file(&bare).unwrap()[0].consolation.is_none());
        let empty = format!(
            "{}prizes = []\n",
            bare.lines()
                .filter(|l| !l.starts_with("prizes") && !l.starts_with("  "))
                .map(|l| format!("{l}\n"))
                .collect::<String>()
        );
        let e = parse_file(&empty).unwrap_err().to_string();
        assert!(e.contains("at least one prize"), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn picks_follow_the_weights(weights in proptest::collection::vec(0u64..1_000_000_000, 1..10), r in 0u64..(1 << 52)) {
            let total: u64 = weights.iter().sum();
            let limit = (1u64 << 52) - (1u64 << 52) % total.max(1);
            match pick_weighted(&weights, &[r]) {
                None => proptest::prop_assert!(total == 0 || r >= limit),
                Some(i) => {
                    // Never a zero-weight (sold-out) candidate.
                    proptest::prop_assert!(weights[i] > 0);
                    let before: u64 = weights[..i].iter().sum();
                    proptest::prop_assert!(r < limit);
                    proptest::prop_assert!(before <= r % total && r % total < before + weights[i]);
                }
            }
        }

        #[test]
        fn the_accepted_range_holds_every_residue_equally_often(total in 1u64..(1 << 40)) {
            // Values are uniform in [0, 2^52); those below `limit` are used,
            // and `limit` is a whole number of `total`s: no modulo bias.
            let span = 1u64 << 52;
            let limit = span - span % total;
            proptest::prop_assert_eq!(limit % total, 0);
            proptest::prop_assert!(span - limit < total);
            // The top value of the accepted range is the last residue.
            proptest::prop_assert_eq!(pick_weighted(&[total], &[limit - 1]), Some(0));
            if limit < span {
                proptest::prop_assert_eq!(pick_weighted(&[total], &[limit]), None);
            }
        }
    }

    #[test]
    fn the_wheel_is_registered() {
        assert_eq!(strategy("wheel").map(|s| s.label()), Some("wheel"));
        assert!(strategy("nope").is_none());
    }
}
