//! Realised return to player against configured, while a pool runs
//! (`docs/operations.md`, "Realised against configured").
//!
//! Every draw step tallies the prizes it pays against the batch each came
//! from, in the pool's meta hash, and the draw that completes a batch (the
//! one that reveals its seed: none of its prizes is left in the pool or
//! parked in `held`) adds the batch's tally to its config version's totals
//! (`lua/lib/draw.lua`, `tally_draw` and `tally_reveals`). A whole batch
//! pays exactly its configured total whatever the order of its prizes
//! ([`super::economics`]), so over completed batches realised equals
//! configured exactly; a difference is a fault or tampering. The batches
//! still open (the running one, and older ones whose parked jackpots wait)
//! legitimately differ, and are shown apart.
//!
//! Meta fields (pool `id`, key `meta`):
//!
//! | field | holds |
//! |-------|-------|
//! | `mults` | the multiplier of each prize code, by code (`"<m0>,<m1>,..."`), written by every `pool load` |
//! | `rtpc:<v>` | config version v's batch: `"<prizes>\|<multiplier total>"`, written by its `pool load` |
//! | `tally` | `"<from>\|<g>\|<prizes>\|<paid>"`: batches from `from` on are tallied; batch g runs |
//! | `tp:<g>`, `tm:<g>` | prizes and multipliers paid of another open batch g |
//! | `rtp:<v>` | `"<batches>\|<prizes>\|<paid>"` over version v's completed batches |
//!
//! Redis is the source, not the audit trail: it is exact (the tally moves
//! in the draw's own atomic step, first answers only), it is there at once
//! (the audit consumer lags, and its lean rows keep a digest, not the
//! multipliers), and reading it costs two commands per pool.

use std::collections::BTreeMap;

use redis::aio::ConnectionLike;
use serde::Serialize;

use super::{economics, CodeTable, PoolConfig};
use crate::scripts::PoolKeys;

/// The meta fields `pool load` writes for the tally: `mults` (the
/// multiplier of each code of `table`, by code) and `rtpc:<version>` (the
/// prizes and multiplier total of `config`'s batch).
pub fn meta_fields(config: &PoolConfig, version: i64, table: &CodeTable) -> [(String, String); 2] {
    let mults: Vec<String> = table.pairs().map(|(_, m)| m.to_string()).collect();
    let batch = economics::analyze(config).batch;
    [
        ("mults".to_owned(), mults.join(",")),
        (
            format!("rtpc:{version}"),
            format!("{}|{}", batch.prizes, batch.multiplier_total),
        ),
    ]
}

/// One config version's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VersionFigures {
    /// The version's batch as configured: its prizes and what they pay
    /// (unknown for a version loaded before the tally was kept).
    pub configured: Option<Tally>,
    /// Completed batches of the version.
    pub batches: u64,
    /// What the completed batches paid.
    pub completed: Tally,
}

impl VersionFigures {
    /// The configured RTP (Σ multiplier × count ÷ Σ count).
    pub fn configured_rtp(&self) -> Option<f64> {
        self.configured.and_then(Tally::rtp)
    }

    /// Whether the completed batches paid exactly the configured RTP,
    /// compared as fractions (`None` when nothing is completed or the
    /// configuration is unknown).
    pub fn exact(&self) -> Option<bool> {
        let c = self.configured?;
        (self.completed.prizes > 0).then(|| {
            u128::from(self.completed.paid) * u128::from(c.prizes)
                == u128::from(c.paid) * u128::from(self.completed.prizes)
        })
    }
}

/// Prizes and the multipliers they paid.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    pub prizes: u64,
    /// Σ multiplier of the prizes, in `unit_price`s.
    pub paid: u64,
}

impl Tally {
    /// Paid per prize; `None` for no prize.
    pub fn rtp(self) -> Option<f64> {
        (self.prizes > 0).then(|| self.paid as f64 / self.prizes as f64)
    }

    fn add(&mut self, other: Tally) {
        self.prizes += other.prizes;
        self.paid += other.paid;
    }
}

/// A pool's realised RTP: per version over completed batches, and the
/// batches still open.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Realised {
    /// Whether the pool keeps a tally (loaded by a version that writes
    /// `mults`; every sub-pool of a sharded pool).
    pub tallied: bool,
    /// The first batch tallied (a pool that had drawn before its tally
    /// began starts with the batch after the one then running), the
    /// lowest over sub-pools.
    pub from_batch: Option<u64>,
    pub versions: BTreeMap<i64, VersionFigures>,
    /// Open batches with prizes paid, by batch (a sharded pool's sub-pools
    /// number their batches each on its own: their open batches add up).
    pub in_progress: BTreeMap<u64, Tally>,
}

impl Realised {
    /// Reads the tally fields of `fields` (a meta hash's, field → value).
    fn from_fields(fields: &BTreeMap<String, String>) -> Self {
        let mut out = Self {
            tallied: fields.contains_key("mults"),
            ..Self::default()
        };
        let numbers = |text: &str| -> Vec<u64> {
            text.split('|')
                .map(|n| n.parse().unwrap_or_default())
                .collect()
        };
        for (name, value) in fields {
            let n = numbers(value);
            if let Some(v) = name.strip_prefix("rtpc:").and_then(|v| v.parse().ok()) {
                if let [prizes, paid] = n[..] {
                    out.versions.entry(v).or_default().configured = Some(Tally { prizes, paid });
                }
            } else if let Some(v) = name.strip_prefix("rtp:").and_then(|v| v.parse().ok()) {
                if let [batches, prizes, paid] = n[..] {
                    let f = out.versions.entry(v).or_default();
                    f.batches += batches;
                    f.completed.add(Tally { prizes, paid });
                }
            } else if let Some(g) = name.strip_prefix("tp:").and_then(|g| g.parse().ok()) {
                out.in_progress.entry(g).or_default().prizes += n[0];
            } else if let Some(g) = name.strip_prefix("tm:").and_then(|g| g.parse().ok()) {
                out.in_progress.entry(g).or_default().paid += n[0];
            } else if name == "tally" {
                if let [from, g, prizes, paid] = n[..] {
                    out.from_batch = Some(from);
                    if prizes > 0 {
                        out.in_progress
                            .entry(g)
                            .or_default()
                            .add(Tally { prizes, paid });
                    }
                }
            }
        }
        out
    }

    /// Adds a sub-pool's figures (the configuration is the same in every
    /// sub-pool).
    fn merge(&mut self, other: Self) {
        self.tallied &= other.tallied;
        self.from_batch = match (self.from_batch, other.from_batch) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        for (v, f) in other.versions {
            let mine = self.versions.entry(v).or_default();
            mine.configured = mine.configured.or(f.configured);
            mine.batches += f.batches;
            mine.completed.add(f.completed);
        }
        for (g, t) in other.in_progress {
            self.in_progress.entry(g).or_default().add(t);
        }
    }

    /// The open batches together.
    pub fn in_progress_total(&self) -> Tally {
        let mut t = Tally::default();
        for open in self.in_progress.values() {
            t.add(*open);
        }
        t
    }
}

/// The tally of the pool behind `keys`: two commands (the meta hash's field
/// names, then the tally's fields), never its larger values (`codes`,
/// `config`).
async fn read_one<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
) -> Result<Realised, redis::RedisError> {
    let names: Vec<String> = redis::cmd("HKEYS")
        .arg(keys.meta())
        .query_async(conn)
        .await?;
    let wanted: Vec<String> = names
        .into_iter()
        .filter(|n| {
            n == "mults"
                || n == "tally"
                || ["rtpc:", "rtp:", "tp:", "tm:"]
                    .iter()
                    .any(|p| n.starts_with(p))
        })
        .collect();
    let mut fields = BTreeMap::new();
    // `mults` is only looked for: its value is not needed.
    let values_of: Vec<&String> = wanted.iter().filter(|n| *n != "mults").collect();
    if !values_of.is_empty() {
        let values: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(keys.meta())
            .arg(&values_of)
            .query_async(conn)
            .await?;
        for (name, value) in values_of.into_iter().zip(values) {
            if let Some(value) = value {
                fields.insert(name.clone(), value);
            }
        }
    }
    if wanted.iter().any(|n| n == "mults") {
        fields.insert("mults".to_owned(), String::new());
    }
    Ok(Realised::from_fields(&fields))
}

/// The realised RTP of lucky-gift pool `pool`, summed over its `shards`
/// sub-pools if it is sharded (`crate::pools::shards_of`).
pub async fn realised<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    pool: &str,
    shards: u32,
) -> Result<Realised, redis::RedisError> {
    if shards <= 1 {
        return read_one(conn, &PoolKeys::new(prefix, pool)).await;
    }
    let mut total: Option<Realised> = None;
    for shard in 0..shards {
        let id = super::config::sub_pool_id(pool, shard);
        let sub = read_one(conn, &PoolKeys::new(prefix, &id)).await?;
        match &mut total {
            Some(t) => t.merge(sub),
            None => total = Some(sub),
        }
    }
    Ok(total.unwrap_or_default())
}

/// Sets the gauges of `pool`'s realised figures, per version:
/// `prizepool_configured_rtp`, `prizepool_completed_batches`,
/// `prizepool_completed_prizes` and `prizepool_completed_paid_multiplier`.
pub fn export(pool: &str, realised: &Realised) {
    for (version, f) in &realised.versions {
        let labels = [("pool", pool.to_owned()), ("version", version.to_string())];
        if let Some(rtp) = f.configured_rtp() {
            metrics::gauge!("prizepool_configured_rtp", &labels).set(rtp);
        }
        metrics::gauge!("prizepool_completed_batches", &labels).set(f.batches as f64);
        metrics::gauge!("prizepool_completed_prizes", &labels).set(f.completed.prizes as f64);
        metrics::gauge!("prizepool_completed_paid_multiplier", &labels)
            .set(f.completed.paid as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_tally_fields_read_into_versions_and_open_batches() {
        let r = Realised::from_fields(&fields(&[
            ("mults", ""),
            ("rtpc:1", "10|9"),
            ("rtpc:2", "20|16"),
            ("rtp:1", "3|30|27"),
            ("tally", "1|5|4|2"),
            ("tp:3", "7"),
            ("tm:3", "5000"),
            ("codes", "[]"),
        ]));
        assert!(r.tallied);
        assert_eq!(r.from_batch, Some(1));
        let v1 = &r.versions[&1];
        assert_eq!(v1.batches, 3);
        assert_eq!(
            v1.completed,
            Tally {
                prizes: 30,
                paid: 27
            }
        );
        assert_eq!(v1.configured_rtp(), Some(0.9));
        assert_eq!(v1.exact(), Some(true));
        // Configured, nothing completed yet.
        assert_eq!(r.versions[&2].exact(), None);
        assert_eq!(
            r.in_progress
                .iter()
                .map(|(g, t)| (*g, *t))
                .collect::<Vec<_>>(),
            [
                (
                    3,
                    Tally {
                        prizes: 7,
                        paid: 5000
                    }
                ),
                (5, Tally { prizes: 4, paid: 2 })
            ]
        );
        assert_eq!(
            r.in_progress_total(),
            Tally {
                prizes: 11,
                paid: 5002
            }
        );
    }

    /// One multiplier unit off over many batches is a departure: the
    /// comparison is of fractions, not of rounded ratios.
    #[test]
    fn a_departure_of_one_unit_is_seen() {
        let mut f = VersionFigures {
            configured: Some(Tally {
                prizes: 31_454,
                paid: 29_880,
            }),
            batches: 1_000,
            completed: Tally {
                prizes: 31_454_000,
                paid: 29_880_000,
            },
        };
        assert_eq!(f.exact(), Some(true));
        f.completed.paid += 1;
        assert_eq!(f.exact(), Some(false));
    }

    #[test]
    fn sub_pools_add_up() {
        let mut a = Realised::from_fields(&fields(&[
            ("mults", ""),
            ("rtpc:1", "10|9"),
            ("rtp:1", "1|10|9"),
            ("tally", "2|2|3|1"),
        ]));
        let b = Realised::from_fields(&fields(&[
            ("mults", ""),
            ("rtpc:1", "10|9"),
            ("rtp:1", "2|20|18"),
            ("tally", "1|2|1|0"),
        ]));
        a.merge(b);
        assert!(a.tallied);
        assert_eq!(a.from_batch, Some(1));
        assert_eq!(a.versions[&1].batches, 3);
        assert_eq!(
            a.versions[&1].completed,
            Tally {
                prizes: 30,
                paid: 27
            }
        );
        assert_eq!(a.in_progress[&2], Tally { prizes: 4, paid: 1 });
        // A sub-pool without the tally makes the pool's incomplete.
        a.merge(Realised::default());
        assert!(!a.tallied);
    }
}
