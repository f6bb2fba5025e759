//! The jackpot rule: prizes of `min_multiplier` or more are held back until
//! the pool's consumption today reaches `daily_consumption_threshold`.
//!
//! This module is the rule's Rust side: what it gates, how a sharded pool
//! splits it, and the two meta fields it writes for the draw scripts.
//! `lua/lib/jackpot.lua` applies it, once for every storage: a draw adds
//! `count × unit_price` to the day's counter (`spent:YYYYMMDD`, saturating
//! at 2^52) and the gate is open when the total, this draw included,
//! reaches the threshold. While it is closed, a jackpot the draw meets is
//! parked at the tail of `held` and the next prize takes its place; once
//! it opens, the prizes in `held` are first in line, as many as form 32
//! runs of positions a draw (so that its fairness record stays within its
//! bound, `config::HELD_RUNS`); the others start the next draw. A parked
//! prize stays in the pool: conservation (`stocked = drawn + in pool`)
//! counts it. A draw that parks jackpots names the rule in its record,
//! not each jackpot (`docs/fairness.md`), so it reads `jackpot_min` too.
//!
//! # Races and ordering
//!
//! - **Concurrent draws.** The counter is read, the gate decided and the
//!   counter raised inside the one Lua step of each draw, and Redis runs
//!   the steps of one pool one after another: exactly one draw crosses the
//!   threshold, and it is the first to see the gate open. A short or
//!   refused draw writes no consumption.
//! - **Retries.** A retried request replays its stored answer before the
//!   gate is looked at, so its consumption counts once.
//! - **The day boundary.** The day is the worker's UTC day when it builds
//!   the call ([`crate::scripts::utc_day`]); a draw racing midnight counts
//!   toward the day its worker read. Counters live two days
//!   ([`super::SPENT_TTL_S`]).
//! - **A reload.** `pool load` rewrites the fields below in one step, then
//!   `lua/regate_held.lua` moves the parked prizes that are no jackpot
//!   under the new rule to the head of `held`, in another. A draw between
//!   the two already applies the new rule to what it reads and takes the
//!   freed prizes already at the head of `held`; those still behind a
//!   gated jackpot wait for the second step, which follows at once.
//! - **Sharded pools.** Each sub-pool counts its own consumption against
//!   its share of the threshold ([`Jackpot::per_shard`]).

use serde::{Deserialize, Serialize};

use super::{CodeTable, PoolConfig};

/// The jackpot rule of a pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Jackpot {
    pub min_multiplier: u64,
    pub daily_consumption_threshold: i64,
}

impl Jackpot {
    /// Whether a prize of this multiplier is a jackpot.
    pub fn gates(&self, multiplier: u64) -> bool {
        multiplier >= self.min_multiplier
    }

    /// The rule of one of `k` sub-pools: the same jackpots, the threshold
    /// divided by `k` (rounded up), so that with draws spread evenly the
    /// gates open when the pool as a whole has taken its threshold.
    pub fn per_shard(&self, k: i64) -> Self {
        Self {
            min_multiplier: self.min_multiplier,
            daily_consumption_threshold: (self.daily_consumption_threshold + k - 1) / k,
        }
    }
}

/// The meta fields the draw scripts read the rule of `config` from:
/// `jackpot_codes` (the codes of `table` it gates, comma-separated),
/// `jackpot_threshold` (empty for no rule, which keeps the gate open) and
/// `jackpot_min` (the rule's `min_multiplier`, empty for no rule), which a
/// draw that holds jackpots back names in its fairness record instead of
/// each position it held back (`docs/fairness.md`). The three are written
/// in one step, so a draw reads them consistent.
pub fn meta_fields(config: &PoolConfig, table: &CodeTable) -> [(&'static str, String); 3] {
    let codes: Vec<String> = table
        .jackpot_codes(config)
        .iter()
        .map(u32::to_string)
        .collect();
    let threshold = config
        .jackpot
        .as_ref()
        .map_or(String::new(), |r| r.daily_consumption_threshold.to_string());
    let min = config
        .jackpot
        .as_ref()
        .map_or(String::new(), |r| r.min_multiplier.to_string());
    [
        ("jackpot_codes", codes.join(",")),
        ("jackpot_threshold", threshold),
        ("jackpot_min", min),
    ]
}
