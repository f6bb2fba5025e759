//! The bounds a pool's largest draw must keep: a reward exact in a double,
//! and a reply (with its sealed event) within the message size limit.

use super::{PoolConfig, REPLY_OVERHEAD_BYTES};
use crate::kinds::lucky_gift::CodeTable;

/// Refuses a pool whose largest draw could not be paid exactly or answered
/// within the wire limit: `max_count × highest multiplier × unit_price` must
/// stay below 2^53 (a money rule), and the largest reply the pool can give
/// must fit in [`crate::messages::MAX_MESSAGE_BYTES`] with its event's seal:
/// see [`max_reply_len`].
pub(super) fn check_draw_bounds(config: &PoolConfig) -> Result<(), (&'static str, String)> {
    let highest = config
        .combos
        .iter()
        .flat_map(|c| c.stock.iter().map(|(m, _)| *m))
        .max()
        .unwrap_or(0);
    let reward = u128::from(config.max_count) * u128::from(highest) * config.unit_price as u128;
    if reward >= crate::messages::MAX_EXACT as u128 {
        return Err((
            "max_count",
            format!(
                "the largest draw could pay {reward} ({} prizes × {highest} × unit_price {}), above 2^53; lower max_count, unit_price or the multipliers",
                config.max_count, config.unit_price
            ),
        ));
    }
    check_reply_bound(
        config,
        &entries_of(
            config
                .combos
                .iter()
                .flat_map(|c| c.stock.iter().map(|(m, _)| (c.id.as_str(), *m))),
        ),
    )
    .map_err(|message| ("max_count", message))
}

/// Refuses a new version of a pool whose largest reply could pass the
/// wire limit with the prizes of any version loaded before it: batches of
/// an earlier version (other or longer combo ids, more distinct prizes)
/// may still be in the pool when the new version takes over, and a big
/// draw can cross them. `table` is the pool's code table, which holds
/// every prize of every version ([`CodeTable::extend`]), so the bound
/// holds whatever is still in the pool.
pub fn check_table_bounds(config: &PoolConfig, table: &CodeTable) -> Result<(), String> {
    check_reply_bound(config, &entries_of(table.pairs())).map_err(|message| {
        format!("{message} (counting the prizes of the pool's earlier versions, which may still be in the pool)")
    })
}

/// The JSON lengths ([`prize_json_len`](crate::messages::prize_codes::prize_json_len))
/// of `pairs` (combo, multiplier).
fn entries_of<'a>(pairs: impl Iterator<Item = (&'a str, u64)>) -> Vec<usize> {
    pairs
        .map(|(combo, m)| crate::messages::prize_codes::prize_json_len(combo, m))
        .collect()
}

/// Refuses `config` when a reply to its largest draw, of prizes whose JSON
/// lengths are among `entries`, could pass the message limit, naming how
/// many prizes fit.
fn check_reply_bound(config: &PoolConfig, entries: &[usize]) -> Result<(), String> {
    let limit = crate::messages::MAX_MESSAGE_BYTES;
    // A pool that allows big draws also answers small ones, whose prizes
    // are listed one by one.
    let list_max = crate::messages::PRIZE_LIST_MAX as u32;
    let worst = |count: u32| {
        reply_len(config, entries, count).max(reply_len(config, entries, count.min(list_max)))
    };
    let reply = worst(config.max_count);
    if reply > limit {
        // The worst reply grows with the count, so the largest count that
        // fits is found by bisection.
        let (mut fits, mut over) = (0u32, config.max_count);
        while over - fits > 1 {
            let mid = fits + (over - fits) / 2;
            if worst(mid) <= limit {
                fits = mid;
            } else {
                over = mid;
            }
        }
        return Err(format!(
            "a reply to a draw of {} prizes could take {reply} bytes, above the {limit} byte message limit; at most {fits} prizes of this pool fit",
            config.max_count
        ));
    }
    Ok(())
}

/// Bytes of the fairness record per run of positions and revealed seed,
/// with generations of up to 10 digits, and positions, counts and
/// held-back counts of 8 (a batch holds at most
/// [`MAX_BATCH_SIZE`](super::MAX_BATCH_SIZE) prizes, and a run of a draw
/// that held jackpots back covers what it read, held back or not).
const RUN_JSON_BYTES: usize =
    r#"{"generation":,"position":,"count":,"held_back":},"#.len() + 10 + 8 + 8 + 8;
const REVEAL_JSON_BYTES: usize = r#"{"generation":,"version":,"seed":""},"#.len() + 10 + 10 + 64;
/// Batches whose fairness record the load bound makes room for. A draw
/// spans two batches when a batch holds at least `count` prizes; a pool of
/// smaller batches has only the batches stocked so far to draw from, one
/// more per refill request (a short draw waits for them a bounded time), so
/// a draw that spans more than this is a pool of tiny batches answering a
/// draw far bigger than them, and may answer past the bound.
pub(super) const SPANNED_BATCHES: usize = 8;

/// The batches a draw of `count` prizes of `config` can read, as the load
/// bound counts them: it starts anywhere in a batch, and each batch gives
/// it at least its prizes below the jackpot rule ([`drawable_per_batch`]);
/// at most [`SPANNED_BATCHES`].
pub(super) fn spanned_batches(config: &PoolConfig, count: usize) -> usize {
    (count.div_ceil(drawable_per_batch(config)) + 1).min(SPANNED_BATCHES)
}
/// Field names and brackets of `positions`, `held_back` and `revealed`,
/// and the rule a draw that held jackpots back names (a multiplier of at
/// most [`MAX_MULTIPLIER`](super::MAX_MULTIPLIER), 7 digits).
const FAIRNESS_FRAME_BYTES: usize =
    r#","positions":[],"held_back":[],"held_back_min_multiplier":,"revealed":[]"#.len() + 7;

/// The most bytes a reply (and its sealed `draw.completed` event) to a
/// draw of `count` prizes of `config` can take: the fixed fields
/// ([`REPLY_OVERHEAD_BYTES`]), the prizes (listed one by one up to
/// [`PRIZE_LIST_MAX`](crate::messages::PRIZE_LIST_MAX), else in the
/// compact form of [`crate::messages::prize_codes`]), and the fairness
/// record of the batches a draw of `count` can touch (at most
/// [`SPANNED_BATCHES`]): a run of positions and a revealed seed per batch.
///
/// A draw that holds jackpots back names the rule, not each position
/// (`docs/fairness.md`): its runs cover what it read, so its record grows
/// with the batches it reads, however many jackpots it meets. A batch then
/// gives the draw only its prizes below the rule, so the batches counted
/// are those `count` such prizes can span. Prizes a draw takes from the
/// parked ones are counted by [`HELD_RUNS`]: what it takes from `held` is
/// kept to that many runs.
pub fn max_reply_len(config: &PoolConfig, count: u32) -> usize {
    let entries = entries_of(
        config
            .combos
            .iter()
            .flat_map(|c| c.stock.iter().map(|(m, _)| (c.id.as_str(), *m))),
    );
    reply_len(config, &entries, count)
}

/// [`max_reply_len`] for prizes whose JSON lengths are among `entries`.
fn reply_len(config: &PoolConfig, entries: &[usize], count: u32) -> usize {
    use crate::messages::prize_codes;
    let count = count as usize;
    let prizes = if count <= crate::messages::PRIZE_LIST_MAX {
        prize_codes::max_list_len(count, entries.iter().copied().max().unwrap_or(0))
    } else {
        prize_codes::max_len(count, entries)
    };
    let batches = spanned_batches(config, count);
    let fairness = FAIRNESS_FRAME_BYTES
        + batches * (RUN_JSON_BYTES + REVEAL_JSON_BYTES)
        + HELD_RUNS * (RUN_JSON_BYTES + REVEAL_JSON_BYTES);
    REPLY_OVERHEAD_BYTES + prizes + fairness
}

/// Prizes of one batch of `config` a draw can win whatever the gate: those
/// below the jackpot rule (the whole batch when the rule gates all of
/// them, since a gated draw then wins nothing and only an open one draws).
fn drawable_per_batch(config: &PoolConfig) -> usize {
    let below: u64 = config
        .combos
        .iter()
        .flat_map(|c| c.stock.iter())
        .filter(|(m, _)| !config.is_jackpot(*m))
        .map(|(_, n)| n)
        .sum();
    let size = config.batch_size();
    (if below > 0 { below } else { size }).max(1) as usize
}

/// Runs of positions (each with its batch's reveal) the prizes a draw takes
/// from `held` may form: a draw stops taking parked prizes where one more
/// would start a run past this many (`lua/lib/jackpot.lua`).
pub const HELD_RUNS: usize = 32;

/// The most bytes a `pool.refilled` event of `config` (or of one of its
/// sub-pools) can take, sealed: every field at its widest and the
/// composition as it is. The loader refuses a pool past the message limit,
/// so the audit never refuses the commitment of one of its batches.
pub(crate) fn max_refilled_len(config: &PoolConfig) -> usize {
    let widest = crate::messages::PoolRefilled {
        pool: super::sub_pool_id(&config.id, super::MAX_SHARDS - 1),
        generation: u64::MAX,
        size: usize::MAX,
        version: i64::MAX,
        urgent: false,
        commitment: Some("0".repeat(64)),
        composition: Some(config.composition()),
    };
    let fields = serde_json::to_vec(&widest).map_or(usize::MAX, |b| b.len());
    fields + r#"{"type":"pool.refilled",,"seal":""}"#.len() + 64
}
