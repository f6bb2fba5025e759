//! The verifier: recomputes a batch's order from its revealed seed and
//! checks it against the commitment and against every recorded draw.

use std::collections::HashSet;

use serde::Serialize;
use sqlx::{types::Json, PgPool};

use crate::{
    fairness::{lucky_gift_order, ComboStock, Seed},
    messages::{BatchPosition, Prize, PrizeCodes, PrizeRun},
};

/// The verdict on one pool: one entry per batch checked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub pool: String,
    /// Whether every batch checked holds (unrevealed batches do not count
    /// against it: they cannot be checked yet).
    pub ok: bool,
    pub batches: Vec<BatchVerdict>,
}

/// The verdict on one batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BatchVerdict {
    /// The pool whose batch this is: the pool verified, or for a sharded
    /// pool the sub-pool (`<pool>~<shard>`) that was stocked with it.
    pub pool: String,
    pub generation: u64,
    /// `ok`, `unrevealed` (the seed is still secret: nothing to check yet),
    /// or `mismatch` (see `first_mismatch`).
    pub status: &'static str,
    pub version: Option<i64>,
    pub commitment: Option<String>,
    pub seed: Option<String>,
    pub size: Option<u64>,
    /// Recorded draws that took prizes of this batch, checked in order.
    pub draws_checked: u64,
    pub prizes_checked: u64,
    /// Whether the recorded draws account for every position of the batch.
    pub complete: bool,
    pub first_mismatch: Option<Mismatch>,
}

/// The first thing that does not hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    pub reason: String,
    /// The draw it was found in, when it is about a draw.
    pub request_id: Option<String>,
    pub serial: Option<i64>,
    pub position: Option<u64>,
    /// (combo, multiplier) the seed puts at `position`; in JSON
    /// `{"combo","multiplier"}`.
    #[serde(serialize_with = "combo_prize")]
    pub expected: Option<(String, u64)>,
    /// (combo, multiplier) the draw was given; in JSON `{"combo","multiplier"}`.
    #[serde(serialize_with = "combo_prize")]
    pub found: Option<(String, u64)>,
}

/// A (combo, multiplier) pair as a JSON object with named fields.
fn combo_prize<S: serde::Serializer>(
    prize: &Option<(String, u64)>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Named<'a> {
        combo: &'a str,
        multiplier: u64,
    }
    prize
        .as_ref()
        .map(|(combo, multiplier)| Named {
            combo,
            multiplier: *multiplier,
        })
        .serialize(serializer)
}

impl Mismatch {
    fn about(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            request_id: None,
            serial: None,
            position: None,
            expected: None,
            found: None,
        }
    }
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.reason)?;
        if let (Some(id), Some(serial)) = (&self.request_id, self.serial) {
            write!(f, "; draw {id} (serial {serial})")?;
        }
        if let Some(p) = self.position {
            write!(f, " at position {p}")?;
        }
        if let Some((c, m)) = &self.expected {
            write!(f, ": the seed puts {c} x{m} there")?;
        }
        if let Some((c, m)) = &self.found {
            write!(f, ", the draw got {c} x{m}")?;
        }
        Ok(())
    }
}

/// `fair_draws.prizes`: the prizes as the draw was answered, a list or
/// the compact form of a big draw (`docs/protocol.md`, "Big draws").
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum RecordedPrizes {
    List(Vec<Prize>),
    Codes(PrizeCodes),
}

/// `fair_draws.held_back`: the positions a draw held back, one by one, or
/// the jackpot rule it named instead (its runs then cover every position it
/// read, and those whose prize reaches `min_multiplier` were held back).
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum RecordedHeldBack {
    List(Vec<BatchPosition>),
    Rule { min_multiplier: u64 },
}

/// A `fair_draws` row: serial, request id, then the lean form (generation,
/// position, count, prizes' digest) or the full form (prizes, runs,
/// parked jackpots), the other form NULL.
type DrawRow = (
    i64,
    String,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<Vec<u8>>,
    Option<Json<RecordedPrizes>>,
    Option<Json<Vec<PrizeRun>>>,
    Option<Json<RecordedHeldBack>>,
);

/// A recorded draw, either form, as the verifier walks it.
struct Draw {
    serial: i64,
    request_id: String,
    runs: Vec<PrizeRun>,
    held_back: Vec<BatchPosition>,
    /// For a draw that named the jackpot rule: the positions of its runs
    /// whose prize has at least this multiplier were held back.
    held_back_min: Option<u64>,
    prizes: Prizes,
}

/// What a recorded draw says it was given.
enum Prizes {
    /// The full form: each prize, in the order of the runs.
    Listed(Vec<Prize>),
    /// The lean form: SHA-256 of the prizes (`audit::prizes_sha256`).
    Digest(Vec<u8>),
}

impl Draw {
    /// The draw of `row`, or why it does not read.
    fn of(row: DrawRow) -> Result<Self, Box<Mismatch>> {
        let (serial, request_id, generation, position, count, digest, prizes, runs, held_back) =
            row;
        let broken = |reason: String| {
            Box::new(Mismatch {
                request_id: Some(request_id.clone()),
                serial: Some(serial),
                ..Mismatch::about(reason)
            })
        };
        let mut held_back_min = None;
        let (runs, held_back, prizes) = match (generation, position, count, digest, prizes, runs) {
            (Some(generation), Some(position), Some(count), Some(digest), None, None) => {
                let run = PrizeRun::new(
                    generation.unsigned_abs(),
                    position.unsigned_abs(),
                    count.unsigned_abs(),
                );
                (vec![run], Vec::new(), Prizes::Digest(digest))
            }
            (None, None, None, None, Some(Json(prizes)), Some(Json(runs))) => {
                let prizes = match prizes {
                    RecordedPrizes::List(prizes) => prizes,
                    RecordedPrizes::Codes(codes) => codes
                        .expand()
                        .map_err(|e| broken(format!("the draw's prizes do not read: {e}")))?,
                };
                let held_back = match held_back {
                    None => Vec::new(),
                    Some(Json(RecordedHeldBack::List(list))) => list,
                    Some(Json(RecordedHeldBack::Rule { min_multiplier })) => {
                        held_back_min = Some(min_multiplier);
                        Vec::new()
                    }
                };
                if runs.iter().any(|r| r.held_back > r.count)
                    || (held_back_min.is_none() && runs.iter().any(|r| r.held_back > 0))
                {
                    return Err(broken(
                        "the draw's runs hold back positions it does not account for".into(),
                    ));
                }
                (runs, held_back, Prizes::Listed(prizes))
            }
            _ => return Err(broken("the draw's record is in neither form".into())),
        };
        Ok(Self {
            serial,
            request_id,
            runs,
            held_back,
            held_back_min,
            prizes,
        })
    }
}

/// Verifies the batches of `pool` (all recorded ones, or `generation`).
pub async fn verify(
    db: &PgPool,
    pool: &str,
    generation: Option<u64>,
) -> Result<Verdict, sqlx::Error> {
    let generations: Vec<i64> = match generation {
        Some(g) => vec![g as i64],
        None => {
            sqlx::query_scalar(
                "SELECT generation FROM fair_batches WHERE pool = $1
                 UNION SELECT generation FROM fair_reveals WHERE pool = $1 ORDER BY 1",
            )
            .bind(pool)
            .fetch_all(db)
            .await?
        }
    };
    let mut batches = Vec::with_capacity(generations.len());
    for g in generations {
        batches.push(verify_batch(db, pool, g.unsigned_abs()).await?);
    }
    Ok(Verdict {
        pool: pool.to_owned(),
        ok: batches.iter().all(|b| b.status != "mismatch"),
        batches,
    })
}

/// Verifies every batch of `pool`: one verdict, or for a pool stocked as
/// several sub-pools (`shards`), one per sub-pool, whose batches they are.
pub async fn verify_pool(
    db: &PgPool,
    pool: &str,
    generation: Option<u64>,
) -> Result<Vec<Verdict>, sqlx::Error> {
    let shards: Option<i64> = sqlx::query_scalar(
        "SELECT COALESCE((config->>'shards')::bigint, 1) FROM pool_versions
         WHERE pool_id = $1 ORDER BY version DESC LIMIT 1",
    )
    .bind(pool)
    .fetch_optional(db)
    .await?;
    let shards = u32::try_from(shards.unwrap_or(1)).unwrap_or(1);
    if shards <= 1 {
        return Ok(vec![verify(db, pool, generation).await?]);
    }
    let mut verdicts = Vec::with_capacity(shards as usize);
    for shard in 0..shards {
        let sub = crate::kinds::lucky_gift::config::sub_pool_id(pool, shard);
        verdicts.push(verify(db, &sub, generation).await?);
    }
    Ok(verdicts)
}

/// The verdicts of [`verify_pool`] as one: the pool's, holding every
/// sub-pool's batches (each naming its sub-pool), so a plain pool and a
/// sharded one answer in one shape (`audit verify --json`).
pub fn merged(pool: &str, verdicts: Vec<Verdict>) -> Verdict {
    Verdict {
        pool: pool.to_owned(),
        ok: verdicts.iter().all(|v| v.ok),
        batches: verdicts.into_iter().flat_map(|v| v.batches).collect(),
    }
}

/// The rows of one batch: its recorded commitments (version, commitment,
/// size, composition), and its reveal (version, seed) if any.
type StoredBatch = (
    Vec<(i64, String, i64, Json<Vec<ComboStock>>)>,
    Option<(i64, String)>,
);

async fn verify_batch(db: &PgPool, pool: &str, g: u64) -> Result<BatchVerdict, sqlx::Error> {
    let (rows, reveal) = load_batch(db, pool, g).await?;
    let mut verdict = BatchVerdict {
        pool: pool.to_owned(),
        generation: g,
        status: "ok",
        version: rows.first().map(|r| r.0),
        commitment: rows.first().map(|r| r.1.clone()),
        seed: None,
        size: rows.first().map(|r| r.2.unsigned_abs()),
        draws_checked: 0,
        prizes_checked: 0,
        complete: false,
        first_mismatch: None,
    };
    // One seed per batch: a second commitment would let the operator pick.
    if rows.iter().any(|r| r.1 != rows[0].1) {
        return Ok(verdict.failed(Mismatch::about(
            "several commitments are recorded for this batch",
        )));
    }
    let Some(reveal) = reveal else {
        verdict.status = "unrevealed";
        return Ok(verdict);
    };
    let order = match batch_order(db, pool, g, rows, reveal, &mut verdict).await? {
        Ok(order) => order,
        Err(mismatch) => return Ok(verdict.failed(mismatch)),
    };
    let draws: Vec<DrawRow> = sqlx::query_as(
        "SELECT serial, request_id, generation, position, count, prizes_sha256,
                prizes, positions, held_back FROM fair_draws
         WHERE pool = $1 AND (generation = $3 OR positions @> $2 OR held_back @> $2)
         ORDER BY serial",
    )
    .bind(pool)
    .bind(Json(serde_json::json!([{ "generation": g }])))
    .bind(g as i64)
    .fetch_all(db)
    .await?;
    let mut walk = Walk {
        g,
        order: &order,
        drawn: HashSet::new(),
        parked: HashSet::new(),
    };
    for row in draws {
        verdict.draws_checked += 1;
        match Draw::of(row).and_then(|draw| walk.draw(&draw)) {
            Ok(prizes) => verdict.prizes_checked += prizes,
            Err(mismatch) => return Ok(verdict.failed(*mismatch)),
        }
    }
    verdict.complete = walk.drawn.len() == order.len();
    Ok(verdict)
}

impl BatchVerdict {
    fn failed(mut self, mismatch: Mismatch) -> Self {
        self.status = "mismatch";
        self.first_mismatch = Some(mismatch);
        self
    }
}

/// The commitments recorded for batch `g` of `pool` and its reveal.
async fn load_batch(db: &PgPool, pool: &str, g: u64) -> Result<StoredBatch, sqlx::Error> {
    let rows = sqlx::query_as(
        "SELECT version, commitment, size, composition FROM fair_batches
         WHERE pool = $1 AND generation = $2 ORDER BY version",
    )
    .bind(pool)
    .bind(g as i64)
    .fetch_all(db)
    .await?;
    let reveal = sqlx::query_as(
        "SELECT version, seed FROM fair_reveals WHERE pool = $1 AND generation = $2",
    )
    .bind(pool)
    .bind(g as i64)
    .fetch_optional(db)
    .await?;
    Ok((rows, reveal))
}

/// The order of a revealed batch, once its seed is checked against its
/// commitment (and against every other batch's, for reuse) and the order
/// has the committed size; the first thing that does not hold otherwise.
/// Fills in `verdict`'s seed, version, commitment and size.
async fn batch_order(
    db: &PgPool,
    pool: &str,
    g: u64,
    rows: Vec<(i64, String, i64, Json<Vec<ComboStock>>)>,
    (version, seed_hex): (i64, String),
    verdict: &mut BatchVerdict,
) -> Result<Result<Vec<(String, u64)>, Mismatch>, sqlx::Error> {
    verdict.seed = Some(seed_hex.clone());
    verdict.version = Some(version);
    let Some(seed) = Seed::from_hex(&seed_hex) else {
        return Ok(Err(Mismatch::about(
            "the revealed seed is not 64 hex digits",
        )));
    };
    let Some((_, commitment, size, Json(composition))) = rows.into_iter().find(|r| r.0 == version)
    else {
        return Ok(Err(Mismatch::about(format!(
            "no commitment is recorded for this batch under config version {version}"
        ))));
    };
    verdict.commitment = Some(commitment.clone());
    verdict.size = Some(size.unsigned_abs());
    if seed.commitment() != commitment {
        return Ok(Err(Mismatch::about(
            "SHA-256 of the revealed seed is not the commitment",
        )));
    }
    // A seed must never serve two batches: whoever knows one batch's order
    // would know the other's.
    let reused: Option<(String, i64)> = sqlx::query_as(
        "SELECT pool, generation FROM fair_batches WHERE commitment = $1 AND NOT (pool = $2 AND generation = $3)
         UNION SELECT pool, generation FROM fair_reveals WHERE seed = $4 AND NOT (pool = $2 AND generation = $3)
         LIMIT 1",
    )
    .bind(&commitment)
    .bind(pool)
    .bind(g as i64)
    .bind(&seed_hex)
    .fetch_optional(db)
    .await?;
    if let Some((other, other_g)) = reused {
        return Ok(Err(Mismatch::about(format!(
            "the seed is reused: batch {other_g} of pool {other} has the same commitment"
        ))));
    }
    let order = lucky_gift_order(&seed, pool, g, version, &composition);
    if order.len() as u64 != size.unsigned_abs() {
        return Ok(Err(Mismatch::about(format!(
            "the composition holds {} prizes, the commitment says {size}",
            order.len()
        ))));
    }
    Ok(Ok(order))
}

/// The walk of batch `g`'s recorded draws in serial order: the positions
/// drawn and parked so far.
struct Walk<'a> {
    g: u64,
    order: &'a [(String, u64)],
    drawn: HashSet<u64>,
    parked: HashSet<u64>,
}

impl Walk<'_> {
    /// Checks one draw against the batch's order and takes its positions;
    /// returns how many of its prizes came from this batch.
    fn draw(&mut self, draw: &Draw) -> Result<u64, Box<Mismatch>> {
        let order = self.order;
        let at = |position: u64, reason: &str, found: Option<(String, u64)>| {
            Box::new(Mismatch {
                reason: reason.to_owned(),
                request_id: Some(draw.request_id.clone()),
                serial: Some(draw.serial),
                position: Some(position),
                expected: order.get(position as usize).cloned(),
                found,
            })
        };
        let mut checked = 0;
        let mut k = 0usize;
        for run in &draw.runs {
            if run.generation != self.g {
                // Another batch's run: its prizes are its positions less
                // those it held back (checked with that batch).
                k += (run.count - run.held_back) as usize;
                continue;
            }
            let mut held = 0;
            for position in run.position..run.position + run.count {
                if let Some(min) = draw.held_back_min {
                    // Held back, not drawn: the prize there reaches the rule.
                    match self.order.get(position as usize) {
                        Some((_, multiplier)) if *multiplier >= min => {
                            held += 1;
                            self.park(draw, position)?;
                            continue;
                        }
                        _ => {}
                    }
                }
                let prize = match &draw.prizes {
                    Prizes::Listed(prizes) => prizes.get(k),
                    Prizes::Digest(_) => None,
                };
                k += 1;
                let found = match prize {
                    Some(Prize::Multiplier { multiplier, combo }) => {
                        Some((combo.clone(), *multiplier))
                    }
                    _ => None,
                };
                if position as usize >= self.order.len() {
                    return Err(at(position, "a position past the end of the batch", found));
                }
                if !self.drawn.insert(position) {
                    return Err(at(position, "a position drawn twice", found));
                }
                if matches!(draw.prizes, Prizes::Listed(_))
                    && found.as_ref() != self.order.get(position as usize)
                {
                    return Err(at(
                        position,
                        "the prize is not the one the seed puts there",
                        found,
                    ));
                }
                checked += 1;
            }
            if held != run.held_back {
                return Err(at(
                    run.position,
                    &format!(
                        "the run says {} of its positions were held back, the seed puts {held} jackpots there",
                        run.held_back
                    ),
                    None,
                ));
            }
        }
        match &draw.prizes {
            Prizes::Listed(prizes) if k != prizes.len() => {
                return Err(at(
                    0,
                    "the positions do not account for the draw's prizes",
                    None,
                ))
            }
            Prizes::Listed(_) => {}
            Prizes::Digest(digest) => self.digest(draw, digest)?,
        }
        self.held_back(draw)?;
        Ok(checked)
    }

    /// A lean draw: its one run's prizes in the batch order hash to the
    /// digest it was recorded with.
    fn digest(&self, draw: &Draw, digest: &[u8]) -> Result<(), Box<Mismatch>> {
        let Some(run) = draw.runs.first().filter(|run| run.generation == self.g) else {
            return Ok(());
        };
        let start = run.position as usize;
        // In range: `draw` took every position of the run.
        let Some(prizes) = self.order.get(start..start + run.count as usize) else {
            return Ok(());
        };
        let expected = prizes
            .iter()
            .map(|(combo, multiplier)| (combo.as_str(), *multiplier));
        if super::prizes_sha256(expected).as_slice() == digest {
            return Ok(());
        }
        // The digest tells that a prize differs, not which one.
        Err(Box::new(Mismatch {
            request_id: Some(draw.request_id.clone()),
            serial: Some(draw.serial),
            ..Mismatch::about(format!(
                "the draw's prizes are not the ones the seed puts at positions {} to {} \
                 (the SHA-256 of its prizes differs)",
                run.position,
                run.position + run.count - 1
            ))
        }))
    }

    /// The jackpots a draw parked were not drawn before, nor parked twice.
    fn held_back(&mut self, draw: &Draw) -> Result<(), Box<Mismatch>> {
        let g = self.g;
        for h in draw.held_back.iter().filter(|h| h.generation == g) {
            self.park(draw, h.position)?;
        }
        Ok(())
    }

    /// Takes `position` as parked by `draw`: it must be in the batch, not
    /// drawn before, nor parked before.
    fn park(&mut self, draw: &Draw, position: u64) -> Result<(), Box<Mismatch>> {
        if position as usize >= self.order.len()
            || self.drawn.contains(&position)
            || !self.parked.insert(position)
        {
            return Err(Box::new(Mismatch {
                request_id: Some(draw.request_id.clone()),
                serial: Some(draw.serial),
                position: Some(position),
                expected: self.order.get(position as usize).cloned(),
                ..Mismatch::about("a parked position that was taken already")
            }));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fairness::ComboStock;

    /// The batch of the documented vector (docs/fairness.md): seed 00…1f,
    /// pool `gift`, generation 7, version 3, combos c1 = [(0, 3), (10, 1)],
    /// c2 = [(0, 2), (50, 1)], c3 = [(5, 2)]; its order is c1 0, c1 0,
    /// c1 10, c1 0, c3 5, c3 5, c2 0, c2 50, c2 0.
    fn vector_order() -> Vec<(String, u64)> {
        let seed =
            Seed::from_hex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f")
                .unwrap();
        let combo = |id: &str, stock: &[(u64, u64)]| ComboStock {
            combo: id.into(),
            stock: stock.to_vec(),
        };
        lucky_gift_order(
            &seed,
            "gift",
            7,
            3,
            &[
                combo("c1", &[(0, 3), (10, 1)]),
                combo("c2", &[(0, 2), (50, 1)]),
                combo("c3", &[(5, 2)]),
            ],
        )
    }

    fn prizes(list: &[(&str, u64)]) -> Prizes {
        Prizes::Listed(
            list.iter()
                .map(|(combo, multiplier)| Prize::Multiplier {
                    multiplier: *multiplier,
                    combo: (*combo).into(),
                })
                .collect(),
        )
    }

    fn draw(serial: i64, runs: Vec<PrizeRun>, min: Option<u64>, list: &[(&str, u64)]) -> Draw {
        Draw {
            serial,
            request_id: format!("r{serial}"),
            runs,
            held_back: Vec::new(),
            held_back_min: min,
            prizes: prizes(list),
        }
    }

    /// The documented vector of a draw that holds jackpots back: under a
    /// rule of `min_multiplier = 10`, a gated draw of 6 prizes reads
    /// positions 0 to 6 and holds position 2 (c1 10) back; the next draw,
    /// open, takes position 2 from the parked ones, then positions 7 and 8.
    /// Readings that ignore the held-back count, or take the held-back
    /// positions to be the run's last ones, or use another minimum, fail.
    #[test]
    fn the_documented_held_back_vector_verifies_and_wrong_readings_fail() {
        let order = vector_order();
        let held = |g, p, n, h| PrizeRun {
            held_back: h,
            ..PrizeRun::new(g, p, n)
        };
        let gated = draw(
            6,
            vec![held(7, 0, 7, 1)],
            Some(10),
            &[
                ("c1", 0),
                ("c1", 0),
                ("c1", 0),
                ("c3", 5),
                ("c3", 5),
                ("c2", 0),
            ],
        );
        let open = draw(
            9,
            vec![PrizeRun::new(7, 2, 1), PrizeRun::new(7, 7, 2)],
            None,
            &[("c1", 10), ("c2", 50), ("c2", 0)],
        );
        let mut walk = Walk {
            g: 7,
            order: &order,
            drawn: HashSet::new(),
            parked: HashSet::new(),
        };
        assert_eq!(walk.draw(&gated).unwrap(), 6);
        assert_eq!(walk.parked, HashSet::from([2]));
        assert_eq!(walk.draw(&open).unwrap(), 3);
        assert_eq!(walk.drawn.len(), 9, "every position drawn once");

        let fresh = || Walk {
            g: 7,
            order: &order,
            drawn: HashSet::new(),
            parked: HashSet::new(),
        };
        // The run read as prizes one by one: position 2 is not c1 0.
        let as_prizes = draw(
            6,
            vec![PrizeRun::new(7, 0, 6)],
            None,
            &[
                ("c1", 0),
                ("c1", 0),
                ("c1", 0),
                ("c3", 5),
                ("c3", 5),
                ("c2", 0),
            ],
        );
        assert!(fresh().draw(&as_prizes).is_err());
        // Another held-back count, or another minimum, does not hold.
        for wrong in [
            draw(6, vec![held(7, 0, 7, 2)], Some(10), &[("c1", 0); 0]),
            draw(
                6,
                vec![held(7, 0, 7, 1)],
                Some(50),
                &[
                    ("c1", 0),
                    ("c1", 0),
                    ("c1", 0),
                    ("c3", 5),
                    ("c3", 5),
                    ("c2", 0),
                ],
            ),
            draw(
                6,
                vec![held(7, 0, 7, 1)],
                Some(5),
                &[
                    ("c1", 0),
                    ("c1", 0),
                    ("c1", 0),
                    ("c3", 5),
                    ("c3", 5),
                    ("c2", 0),
                ],
            ),
        ] {
            assert!(fresh().draw(&wrong).is_err());
        }
        // A position held back and then held back again is refused.
        let mut walk = fresh();
        walk.draw(&gated).unwrap();
        assert!(walk.draw(&gated).is_err());
    }
}
