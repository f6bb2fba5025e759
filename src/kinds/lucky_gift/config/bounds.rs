//! The bounds a pool's largest draw must keep: a reward exact in a double,
//! and a reply (with its sealed event) within the message size limit.

use super::{PoolConfig, REPLY_OVERHEAD_BYTES};

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
    let limit = crate::messages::MAX_MESSAGE_BYTES;
    // A pool that allows big draws also answers small ones, whose prizes
    // are listed one by one.
    let list_max = crate::messages::PRIZE_LIST_MAX as u32;
    let worst =
        |count: u32| max_reply_len(config, count).max(max_reply_len(config, count.min(list_max)));
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
        return Err((
            "max_count",
            format!(
                "a reply to a draw of {} prizes could take {reply} bytes, above the {limit} byte message limit; at most {fits} prizes of this pool fit",
                config.max_count
            ),
        ));
    }
    Ok(())
}

/// Bytes of the fairness record per run of positions and revealed seed,
/// with generations of up to 10 digits and positions of 8
/// (a batch holds at most [`MAX_BATCH_SIZE`](super::MAX_BATCH_SIZE) prizes).
const RUN_JSON_BYTES: usize = r#"{"generation":,"position":,"count":},"#.len() + 10 + 8 + 5;
const REVEAL_JSON_BYTES: usize = r#"{"generation":,"version":,"seed":""},"#.len() + 10 + 10 + 64;
/// Batches whose fairness record the load bound makes room for. A draw
/// spans two batches when a batch holds at least `count` prizes; a pool of
/// smaller batches has only the batches stocked so far to draw from, one
/// more per refill request (a short draw waits for them a bounded time), so
/// a draw that spans more than this is a pool of tiny batches answering a
/// draw far bigger than them, and may answer past the bound.
pub(super) const SPANNED_BATCHES: usize = 8;
/// Field names and brackets of `positions`, `held_back` and `revealed`.
const FAIRNESS_FRAME_BYTES: usize = r#","positions":[],"held_back":[],"revealed":[]"#.len();

/// The most bytes a reply (and its sealed `draw.completed` event) to a
/// draw of `count` prizes of `config` can take: the fixed fields
/// ([`REPLY_OVERHEAD_BYTES`]), the prizes (listed one by one up to
/// [`PRIZE_LIST_MAX`](crate::messages::PRIZE_LIST_MAX), else in the
/// compact form of [`crate::messages::prize_codes`]), and the fairness
/// record of the batches a draw of `count` can touch (at most
/// [`SPANNED_BATCHES`]): a run of positions and a revealed seed per batch.
/// Jackpots are not counted: a gated draw that parks jackpots, or a draw
/// that wins many parked ones at once, adds a position (and a run) per
/// jackpot beyond this, so a pool dense in jackpots can answer past it; a
/// bound that counted every jackpot a draw could meet would refuse such
/// pools at any useful `max_count`. The fairness record written compactly
/// is what would close this.
pub fn max_reply_len(config: &PoolConfig, count: u32) -> usize {
    use crate::messages::prize_codes;
    let count = count as usize;
    let entries: Vec<usize> = config
        .combos
        .iter()
        .flat_map(|c| {
            c.stock
                .iter()
                .map(|(m, _)| prize_codes::prize_json_len(&c.id, *m))
        })
        .collect();
    let prizes = if count <= crate::messages::PRIZE_LIST_MAX {
        prize_codes::max_list_len(count, entries.iter().copied().max().unwrap_or(0))
    } else {
        prize_codes::max_len(count, &entries)
    };
    let size = config.batch_size().max(1) as usize;
    let batches = (count.div_ceil(size) + 1).min(SPANNED_BATCHES);
    let fairness = FAIRNESS_FRAME_BYTES + batches * (RUN_JSON_BYTES + REVEAL_JSON_BYTES);
    REPLY_OVERHEAD_BYTES + prizes + fairness
}
