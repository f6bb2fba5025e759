//! The rows of the audit trail: a batch's commitment, a revealed seed, and
//! each draw in the lean form (its one run of positions and a digest of
//! its prizes) or the full form (`docs/fairness.md`, "The audit trail").

use sqlx::{types::Json, PgPool};

use crate::{
    kinds::lucky_gift::Commitment,
    messages::{DrawResult, Reveal, Status},
};

/// Records a batch's commitment; a row already there is kept.
pub async fn record_batch(db: &PgPool, c: &Commitment) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO fair_batches (pool, generation, version, commitment, size, composition)
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
    )
    .bind(&c.pool)
    .bind(c.generation as i64)
    .bind(c.version)
    .bind(&c.commitment)
    .bind(c.size as i64)
    .bind(Json(&c.composition))
    .execute(db)
    .await?;
    Ok(())
}

/// Records a revealed seed; a reveal already there is kept.
pub async fn record_reveal(db: &PgPool, pool: &str, reveal: &Reveal) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO fair_reveals (pool, generation, version, seed)
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )
    .bind(pool)
    .bind(reveal.generation as i64)
    .bind(reveal.version)
    .bind(&reveal.seed)
    .execute(db)
    .await?;
    Ok(())
}

/// Records a lucky-gift draw (and the seeds it revealed). Results of other
/// kinds, refusals and draws stocked before batches were committed (no
/// positions) record nothing.
pub async fn record_draw(db: &PgPool, result: &DrawResult) -> Result<(), sqlx::Error> {
    record_draws(db, std::slice::from_ref(result)).await
}

/// Records several draws (a `draw.completed.batch`) in one statement, so a
/// group costs Postgres one round trip however many draws it holds; a
/// group with nothing to record costs none.
pub async fn record_draws(db: &PgPool, results: &[DrawResult]) -> Result<(), sqlx::Error> {
    record_draws_of(db, results.iter()).await
}

/// [`record_draws`] of the draws of several deliveries, in one statement.
pub(super) async fn record_draws_of<'a>(
    db: &PgPool,
    results: impl Iterator<Item = &'a DrawResult>,
) -> Result<(), sqlx::Error> {
    let mut rows = Rows::default();
    for result in results {
        rows.push(result);
    }
    if !rows.lottery.activities.is_empty() {
        let l = &rows.lottery;
        sqlx::query(
            "INSERT INTO fair_lottery_draws (activity, serial, request_id, user_id, period, value, weights, prize)
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[], $5::bigint[],
                                  $6::bigint[], $7::jsonb[], $8::text[])
             ON CONFLICT DO NOTHING",
        )
        .bind(&l.activities)
        .bind(&l.serials)
        .bind(&l.request_ids)
        .bind(&l.users)
        .bind(&l.periods)
        .bind(&l.values)
        .bind(&l.weights)
        .bind(&l.prizes)
        .execute(db)
        .await?;
    }
    if rows.reveal_pools.is_empty() && rows.pools.is_empty() {
        return Ok(());
    }
    sqlx::query(include_str!("record_draws.sql"))
        .bind(&rows.reveal_pools)
        .bind(&rows.reveal_generations)
        .bind(&rows.reveal_versions)
        .bind(&rows.seeds)
        .bind(&rows.pools)
        .bind(&rows.serials)
        .bind(&rows.request_ids)
        .bind(&rows.users)
        .bind(&rows.versions)
        .bind(&rows.generations)
        .bind(&rows.positions)
        .bind(&rows.counts)
        .bind(&rows.digests)
        .bind(&rows.prizes)
        .bind(&rows.runs)
        .bind(&rows.held_back)
        .execute(db)
        .await?;
    Ok(())
}

/// The rows of a group of draws, as the columns `record_draws.sql` binds:
/// each draw in the lean form (its one run and the digest of its prizes)
/// or the full form (prizes, runs and parked jackpots as JSON), the other
/// form's columns NULL.
#[derive(Default)]
struct Rows<'a> {
    reveal_pools: Vec<String>,
    reveal_generations: Vec<i64>,
    reveal_versions: Vec<i64>,
    seeds: Vec<&'a str>,
    pools: Vec<String>,
    serials: Vec<i64>,
    request_ids: Vec<&'a str>,
    users: Vec<i64>,
    versions: Vec<i64>,
    generations: Vec<Option<i64>>,
    positions: Vec<Option<i64>>,
    counts: Vec<Option<i64>>,
    digests: Vec<Option<Vec<u8>>>,
    prizes: Vec<Option<Json<PrizesRecord<'a>>>>,
    runs: Vec<Option<Json<&'a [crate::messages::PrizeRun]>>>,
    held_back: Vec<Option<Json<HeldBackRecord<'a>>>>,
    lottery: LotteryRows<'a>,
}

/// The `fair_lottery_draws` rows of a group: seeded lottery draws.
#[derive(Default)]
struct LotteryRows<'a> {
    activities: Vec<&'a str>,
    serials: Vec<i64>,
    request_ids: Vec<&'a str>,
    users: Vec<i64>,
    periods: Vec<i64>,
    values: Vec<i64>,
    weights: Vec<Json<&'a [crate::messages::PrizeWeight]>>,
    prizes: Vec<&'a str>,
}

/// What `fair_lottery_draws` keeps of a seeded lottery draw: activity,
/// user, serial, period, the pick and the prize; `None` for other results.
fn lottery_record(
    result: &DrawResult,
) -> Option<(&str, i64, i64, u64, &crate::messages::LotteryPick, &str)> {
    let (Status::Ok, Some(activity), Some(user), Some(serial), Some(pick)) = (
        result.status,
        result.pool.as_deref(),
        result.user_id,
        result.serial,
        result.pick.as_ref(),
    ) else {
        return None;
    };
    let period = pick.period?;
    let [crate::messages::Prize::Item { prize, .. }] = result.prizes.as_slice() else {
        return None;
    };
    Some((activity, user, serial, period, pick, prize.as_str()))
}

/// `fair_draws.held_back` of a full record: the positions held back, as
/// the reply listed them, or for a draw that named the jackpot rule
/// instead, `{"min_multiplier": M}` (its runs then cover every position it
/// read; the verifier tells them apart by the order's multipliers).
#[derive(serde::Serialize)]
#[serde(untagged)]
enum HeldBackRecord<'a> {
    List(&'a [crate::messages::BatchPosition]),
    Rule { min_multiplier: u64 },
}

impl<'a> Rows<'a> {
    /// Adds what `result` records: nothing unless it is a lucky-gift award.
    fn push(&mut self, result: &'a DrawResult) {
        if let Some((activity, user, serial, period, pick, prize)) = lottery_record(result) {
            let l = &mut self.lottery;
            l.activities.push(activity);
            l.serials.push(serial);
            l.request_ids.push(&result.request_id);
            l.users.push(user);
            l.periods.push(period as i64);
            l.values.push(pick.value as i64);
            l.weights.push(Json(&pick.weights));
            l.prizes.push(prize);
            return;
        }
        let Some((pool, user, serial, version)) = recordable(result) else {
            return;
        };
        // A sharded pool's batches are its sub-pools'.
        let pool = match result.shard {
            Some(shard) => crate::kinds::lucky_gift::config::sub_pool_id(pool, shard),
            None => pool.to_owned(),
        };
        for reveal in &result.revealed {
            self.reveal_pools.push(pool.clone());
            self.reveal_generations.push(reveal.generation as i64);
            self.reveal_versions.push(reveal.version);
            self.seeds.push(&reveal.seed);
        }
        if result.positions.is_empty() {
            return;
        }
        self.pools.push(pool);
        self.serials.push(serial);
        self.request_ids.push(&result.request_id);
        self.users.push(user);
        self.versions.push(version);
        match lean_form(result) {
            Some((run, digest)) => {
                self.generations.push(Some(run.generation as i64));
                self.positions.push(Some(run.position as i64));
                self.counts.push(Some(run.count as i64));
                self.digests.push(Some(digest.to_vec()));
                self.prizes.push(None);
                self.runs.push(None);
                self.held_back.push(None);
            }
            None => {
                self.generations.push(None);
                self.positions.push(None);
                self.counts.push(None);
                self.digests.push(None);
                self.prizes.push(Some(Json(match &result.prize_codes {
                    Some(codes) => PrizesRecord::Codes(codes),
                    None => PrizesRecord::List(&result.prizes),
                })));
                self.runs.push(Some(Json(&result.positions)));
                self.held_back
                    .push(Some(Json(match result.held_back_min_multiplier {
                        Some(min_multiplier) => HeldBackRecord::Rule { min_multiplier },
                        None => HeldBackRecord::List(&result.held_back),
                    })));
            }
        }
    }
}

/// The lean record of a draw (its one run and [`prizes_sha256`] of its
/// prizes) when it has one: a listed draw whose prizes came from one run
/// of one batch, with no jackpot parked. `None` for every other draw,
/// which is recorded in full.
pub(super) fn lean_form(result: &DrawResult) -> Option<(crate::messages::PrizeRun, [u8; 32])> {
    let [run] = result.positions.as_slice() else {
        return None;
    };
    if !result.held_back.is_empty()
        || result.held_back_min_multiplier.is_some()
        || run.held_back != 0
        || result.prize_codes.is_some()
        || run.count == 0
        || run.count != result.prizes.len() as u64
    {
        return None;
    }
    let mut prizes = Vec::with_capacity(result.prizes.len());
    for prize in &result.prizes {
        match prize {
            crate::messages::Prize::Multiplier { multiplier, combo } => {
                prizes.push((combo.as_str(), *multiplier))
            }
            _ => return None,
        }
    }
    Some((*run, prizes_sha256(prizes)))
}

/// `fair_draws.prizes_sha256`: SHA-256 of a draw's prizes, one line
/// `<combo> <multiplier>` LF each (the multiplier in decimal), in draw
/// order. Combo ids are printable ASCII without spaces, so the lines read
/// back one way only.
pub fn prizes_sha256<'a>(prizes: impl IntoIterator<Item = (&'a str, u64)>) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for (combo, multiplier) in prizes {
        hash.update(combo.as_bytes());
        hash.update(b" ");
        hash.update(multiplier.to_string().as_bytes());
        hash.update(b"\n");
    }
    hash.finalize().into()
}

/// A draw's prizes as the trail keeps them in the full form
/// (`fair_draws.prizes`): the form the draw was answered in, a list or,
/// for a big draw, the compact `prize_codes` object, so a draw of 10,000
/// prizes is one small value and not a row per prize. The verifier reads
/// both ([`verify`]).
#[derive(serde::Serialize)]
#[serde(untagged)]
enum PrizesRecord<'a> {
    List(&'a [crate::messages::Prize]),
    Codes(&'a crate::messages::PrizeCodes),
}

/// Whether `result` leaves anything in the trail: a draw or a seed.
pub(super) fn records_anything(result: &DrawResult) -> bool {
    lottery_record(result).is_some()
        || recordable(result).is_some()
            && !(result.positions.is_empty() && result.revealed.is_empty())
}

/// The pool, user, serial and config version of a draw the trail records
/// (a lucky-gift award); `None` for results of other kinds and refusals.
fn recordable(result: &DrawResult) -> Option<(&str, i64, i64, i64)> {
    match (
        result.status,
        result.pool.as_deref(),
        result.user_id,
        result.serial,
        result.version,
    ) {
        (Status::Ok, Some(pool), Some(user), Some(serial), Some(version)) => {
            Some((pool, user, serial, version))
        }
        _ => None,
    }
}
