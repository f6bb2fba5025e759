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

type DrawRow = (
    i64,
    String,
    Json<RecordedPrizes>,
    Json<Vec<PrizeRun>>,
    Json<Vec<BatchPosition>>,
);

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

async fn verify_batch(db: &PgPool, pool: &str, g: u64) -> Result<BatchVerdict, sqlx::Error> {
    let rows: Vec<(i64, String, i64, Json<Vec<ComboStock>>)> = sqlx::query_as(
        "SELECT version, commitment, size, composition FROM fair_batches
         WHERE pool = $1 AND generation = $2 ORDER BY version",
    )
    .bind(pool)
    .bind(g as i64)
    .fetch_all(db)
    .await?;
    let reveal: Option<(i64, String)> = sqlx::query_as(
        "SELECT version, seed FROM fair_reveals WHERE pool = $1 AND generation = $2",
    )
    .bind(pool)
    .bind(g as i64)
    .fetch_optional(db)
    .await?;
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
    let fail = |mut v: BatchVerdict, m: Mismatch| {
        v.status = "mismatch";
        v.first_mismatch = Some(m);
        Ok(v)
    };
    // One seed per batch: a second commitment would let the operator pick.
    if rows.iter().any(|r| r.1 != rows[0].1) {
        return fail(
            verdict,
            Mismatch::about("several commitments are recorded for this batch"),
        );
    }
    let Some((version, seed_hex)) = reveal else {
        verdict.status = "unrevealed";
        return Ok(verdict);
    };
    verdict.seed = Some(seed_hex.clone());
    verdict.version = Some(version);
    let Some(seed) = Seed::from_hex(&seed_hex) else {
        return fail(
            verdict,
            Mismatch::about("the revealed seed is not 64 hex digits"),
        );
    };
    let Some((_, commitment, size, Json(composition))) = rows.into_iter().find(|r| r.0 == version)
    else {
        return fail(
            verdict,
            Mismatch::about(format!(
                "no commitment is recorded for this batch under config version {version}"
            )),
        );
    };
    verdict.commitment = Some(commitment.clone());
    verdict.size = Some(size.unsigned_abs());
    if seed.commitment() != commitment {
        return fail(
            verdict,
            Mismatch::about("SHA-256 of the revealed seed is not the commitment"),
        );
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
        return fail(
            verdict,
            Mismatch::about(format!(
                "the seed is reused: batch {other_g} of pool {other} has the same commitment"
            )),
        );
    }
    let order = lucky_gift_order(&seed, pool, g, version, &composition);
    if order.len() as u64 != size.unsigned_abs() {
        return fail(
            verdict,
            Mismatch::about(format!(
                "the composition holds {} prizes, the commitment says {size}",
                order.len()
            )),
        );
    }
    let draws: Vec<DrawRow> = sqlx::query_as(
        "SELECT serial, request_id, prizes, positions, held_back FROM fair_draws
         WHERE pool = $1 AND (positions @> $2 OR held_back @> $2) ORDER BY serial",
    )
    .bind(pool)
    .bind(Json(serde_json::json!([{ "generation": g }])))
    .fetch_all(db)
    .await?;
    let mut drawn: HashSet<u64> = HashSet::new();
    let mut parked: HashSet<u64> = HashSet::new();
    for (serial, request_id, Json(recorded), Json(runs), Json(held_back)) in draws {
        verdict.draws_checked += 1;
        let prizes = match recorded {
            RecordedPrizes::List(prizes) => prizes,
            RecordedPrizes::Codes(codes) => match codes.expand() {
                Ok(prizes) => prizes,
                Err(e) => {
                    return fail(
                        verdict,
                        Mismatch {
                            request_id: Some(request_id),
                            serial: Some(serial),
                            ..Mismatch::about(format!("the draw's prizes do not read: {e}"))
                        },
                    )
                }
            },
        };
        let at = |position: u64, reason: &str, found: Option<(String, u64)>| Mismatch {
            reason: reason.to_owned(),
            request_id: Some(request_id.clone()),
            serial: Some(serial),
            position: Some(position),
            expected: order.get(position as usize).cloned(),
            found,
        };
        let mut k = 0usize;
        for run in &runs {
            for position in run.position..run.position + run.count {
                let prize = prizes.get(k);
                k += 1;
                if run.generation != g {
                    continue;
                }
                let found = match prize {
                    Some(Prize::Multiplier { multiplier, combo }) => {
                        Some((combo.clone(), *multiplier))
                    }
                    _ => None,
                };
                if position as usize >= order.len() {
                    return fail(
                        verdict,
                        at(position, "a position past the end of the batch", found),
                    );
                }
                if !drawn.insert(position) {
                    return fail(verdict, at(position, "a position drawn twice", found));
                }
                if found.as_ref() != order.get(position as usize) {
                    return fail(
                        verdict,
                        at(
                            position,
                            "the prize is not the one the seed puts there",
                            found,
                        ),
                    );
                }
                verdict.prizes_checked += 1;
            }
        }
        if k != prizes.len() {
            return fail(
                verdict,
                at(
                    0,
                    "the positions do not account for the draw's prizes",
                    None,
                ),
            );
        }
        for h in held_back.iter().filter(|h| h.generation == g) {
            if h.position as usize >= order.len()
                || drawn.contains(&h.position)
                || !parked.insert(h.position)
            {
                return fail(
                    verdict,
                    at(h.position, "a parked position that was taken already", None),
                );
            }
        }
    }
    verdict.complete = drawn.len() == order.len();
    Ok(verdict)
}
