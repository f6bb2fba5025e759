//! Splitting a red packet into random integer shares.
//!
//! The "double mean" rule: each share is drawn uniformly between `min` and
//! twice the mean of what remains (and never so high that the shares still
//! to come could not get `min` each). The last share takes the rest. So every
//! share is at least `min`, the shares sum exactly to the total, and none is
//! more than twice the mean of what remained when it was cut.
//!
//! Bounds keep every figure exact wherever it travels: a total is at most
//! [`MAX_TOTAL`] (below 2^53, so the Lua scripts' float arithmetic sums shares
//! exactly), a packet has at most [`MAX_SHARES`] shares (stocked in one Lua
//! step, well inside Lua's `unpack` limit of about 8,000 values) and
//! `count × min` may not exceed the total, so no product below overflows.

use rand::Rng;

/// Most shares one packet may have.
pub const MAX_SHARES: u32 = 5_000;
/// Largest packet total, in the smallest unit of the packet's asset: 10^12,
/// far below 2^53 (≈ 9.007 × 10^15), so sums of shares stay exact in Lua.
pub const MAX_TOTAL: i64 = 1_000_000_000_000;

/// Why a packet cannot be split.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("`count` must be between 1 and {MAX_SHARES}, got {0}")]
    Count(i64),
    #[error("`total` must be between 1 and {MAX_TOTAL}, got {0}")]
    Total(i64),
    #[error("`min` must be between 0 and {MAX_TOTAL}, got {0}")]
    Min(i64),
    #[error("`total` {total} cannot give {count} shares of at least {min}")]
    TooSmall { total: i64, count: i64, min: i64 },
}

/// The smallest share actually handed out: `min`, but never zero.
pub fn floor(min: i64) -> i64 {
    min.max(1)
}

/// Checks that `total` can be split into `count` shares of at least `min`.
pub fn check(total: i64, count: i64, min: i64) -> Result<(), SplitError> {
    if !(1..=i64::from(MAX_SHARES)).contains(&count) {
        return Err(SplitError::Count(count));
    }
    if !(1..=MAX_TOTAL).contains(&total) {
        return Err(SplitError::Total(total));
    }
    if !(0..=MAX_TOTAL).contains(&min) {
        return Err(SplitError::Min(min));
    }
    // Both factors are bounded above, so this cannot overflow; checked anyway
    // so that a change of bounds fails as bad input, never as a panic.
    match count.checked_mul(floor(min)) {
        Some(needed) if needed <= total => Ok(()),
        _ => Err(SplitError::TooSmall { total, count, min }),
    }
}

/// Splits `total` into `count` shares, each at least `max(min, 1)`.
pub fn split(total: i64, count: i64, min: i64, rng: &mut impl Rng) -> Result<Vec<i64>, SplitError> {
    check(total, count, min)?;
    let min = floor(min);
    // `check` bounds `count` by MAX_SHARES, so the capacity is small.
    let mut shares = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    let mut left = total;
    for k in (1..=count).rev() {
        if k == 1 {
            shares.push(left);
            break;
        }
        // Twice the mean of what remains, and room for `min` in each later
        // share. `left >= k * min` holds on entry (by `check`, then by the
        // cap), so `cap >= min` and the range is never empty; `2 * left` is
        // at most 2 × MAX_TOTAL.
        let cap = (2 * left / k).min(left - (k - 1) * min);
        let share = rng.random_range(min..=cap);
        shares.push(share);
        left -= share;
    }
    Ok(shares)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Checks every promise of a split of (`total`, `count`, `min`).
    fn assert_fair(shares: &[i64], total: i64, count: i64, min: i64) -> Result<(), TestCaseError> {
        prop_assert_eq!(shares.len() as i64, count);
        prop_assert_eq!(
            shares.iter().map(|s| i128::from(*s)).sum::<i128>(),
            i128::from(total)
        );
        let mut left = i128::from(total);
        for (i, s) in shares.iter().enumerate() {
            prop_assert!(*s >= floor(min), "share {} = {} below min {}", i, s, min);
            let remaining = i128::from(count) - i as i128;
            // No share above twice the mean of what remained (whole units).
            prop_assert!(
                i128::from(*s) * remaining <= 2 * left,
                "share {} = {} above twice the mean of {} over {}",
                i,
                s,
                left,
                remaining
            );
            left -= i128::from(*s);
        }
        Ok(())
    }

    /// Numbers an attacker would try: the edges of every bound and of i64.
    fn extreme() -> impl Strategy<Value = i64> {
        prop_oneof![
            Just(i64::MIN),
            Just(-1i64),
            Just(0i64),
            Just(1i64),
            Just(2i64),
            Just(i64::from(MAX_SHARES)),
            Just(i64::from(MAX_SHARES) + 1),
            Just(MAX_TOTAL / i64::from(MAX_SHARES)),
            Just(MAX_TOTAL - 1),
            Just(MAX_TOTAL),
            Just(MAX_TOTAL + 1),
            Just((1i64 << 53) - 1),
            Just(i64::MAX / 2),
            Just(i64::MAX),
            any::<i64>(),
            0..=MAX_TOTAL,
            1..=i64::from(MAX_SHARES),
        ]
    }

    proptest! {
        #[test]
        fn shares_sum_to_the_total_and_respect_the_bounds(
            count in 1i64..=MAX_SHARES as i64,
            min in 0i64..1_000,
            extra in 0i64..10_000_000,
            seed in any::<u64>(),
        ) {
            let total = count * floor(min) + extra;
            prop_assume!(total <= MAX_TOTAL);
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let shares = split(total, count, min, &mut rng).unwrap();
            assert_fair(&shares, total, count, min)?;
        }

        #[test]
        fn huge_totals_do_not_overflow(count in 1i64..100, seed in any::<u64>()) {
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let shares = split(MAX_TOTAL, count, 1, &mut rng).unwrap();
            prop_assert_eq!(shares.iter().sum::<i64>(), MAX_TOTAL);
        }

        /// Any three numbers: a fair split or a refusal, never a panic.
        #[test]
        fn extreme_parameters_never_panic(
            total in extreme(),
            count in extreme(),
            min in extreme(),
            seed in any::<u64>(),
        ) {
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            match split(total, count, min, &mut rng) {
                Ok(shares) => {
                    prop_assert!(check(total, count, min).is_ok());
                    assert_fair(&shares, total, count, min)?;
                }
                Err(e) => prop_assert_eq!(check(total, count, min), Err(e)),
            }
        }

        /// The tightest splits allowed: `min` as large as the total permits,
        /// up to the largest total and count.
        #[test]
        fn the_largest_min_allowed_splits_fairly(
            total in prop_oneof![Just(MAX_TOTAL), 1..=MAX_TOTAL],
            count in prop_oneof![Just(i64::from(MAX_SHARES)), 1..=i64::from(MAX_SHARES)],
            slack in 0i64..3,
            seed in any::<u64>(),
        ) {
            prop_assume!(total >= count);
            let min = total / count - slack.min(total / count);
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let shares = split(total, count, min, &mut rng).unwrap();
            assert_fair(&shares, total, count, min)?;
            // One more than the largest `min` cannot be split (refused as too
            // small a total, or as a `min` above its own bound).
            let refused = split(total, count, total / count + 1, &mut rng).is_err();
            prop_assert!(refused, "min {} accepted", total / count + 1);
        }
    }

    #[test]
    fn impossible_parameters_are_refused() {
        let mut rng = rand::rng();
        assert_eq!(split(100, 0, 1, &mut rng), Err(SplitError::Count(0)));
        assert_eq!(split(100, 5001, 0, &mut rng), Err(SplitError::Count(5001)));
        assert!(matches!(
            split(9, 10, 1, &mut rng),
            Err(SplitError::TooSmall { .. })
        ));
        assert_eq!(split(-5, 1, 1, &mut rng), Err(SplitError::Total(-5)));
        assert_eq!(split(100, 2, -1, &mut rng), Err(SplitError::Min(-1)));
        assert_eq!(split(10, 10, 1, &mut rng).unwrap(), vec![1; 10]);
        // Extreme `min`: refused, not an overflow.
        assert_eq!(
            split(10_000, 10, i64::MAX, &mut rng),
            Err(SplitError::Min(i64::MAX))
        );
        assert!(matches!(
            split(10_000, 5_000, MAX_TOTAL, &mut rng),
            Err(SplitError::TooSmall { .. })
        ));
        assert_eq!(
            split(MAX_TOTAL + 1, 1, 1, &mut rng),
            Err(SplitError::Total(MAX_TOTAL + 1))
        );
    }
}
