//! Splitting a red packet into random integer shares.
//!
//! The "double mean" rule: each share is drawn uniformly between `min` and
//! twice the mean of what remains (and never so high that the shares still
//! to come could not get `min` each). The last share takes the rest. So every
//! share is at least `min`, the shares sum exactly to the total, and none is
//! more than twice the mean of what remained when it was cut.

use rand::Rng;

/// Most shares one packet may have.
pub const MAX_SHARES: u32 = 5_000;
/// Largest packet total, in cents.
pub const MAX_TOTAL: i64 = 1_000_000_000_000;

/// Why a packet cannot be split.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("`count` must be between 1 and {MAX_SHARES}, got {0}")]
    Count(i64),
    #[error("`total` must be between 1 and {MAX_TOTAL}, got {0}")]
    Total(i64),
    #[error("`min` must not be negative, got {0}")]
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
    if min < 0 {
        return Err(SplitError::Min(min));
    }
    if total < count * floor(min) {
        return Err(SplitError::TooSmall { total, count, min });
    }
    Ok(())
}

/// Splits `total` into `count` shares, each at least `max(min, 1)`.
pub fn split(total: i64, count: i64, min: i64, rng: &mut impl Rng) -> Result<Vec<i64>, SplitError> {
    check(total, count, min)?;
    let min = floor(min);
    let mut shares = Vec::with_capacity(count as usize);
    let mut left = total;
    for k in (1..=count).rev() {
        if k == 1 {
            shares.push(left);
            break;
        }
        // Twice the mean of what remains, and room for `min` in each later share.
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
            prop_assert_eq!(shares.len() as i64, count);
            prop_assert_eq!(shares.iter().sum::<i64>(), total);
            let mut left = total;
            for (i, s) in shares.iter().enumerate() {
                prop_assert!(*s >= floor(min), "share {} = {} below min {}", i, s, min);
                let remaining = count - i as i64;
                // No share above twice the mean of what remained (integer cents).
                prop_assert!(*s * remaining <= 2 * left, "share {} = {} above twice the mean of {} over {}", i, s, left, remaining);
                left -= s;
            }
        }

        #[test]
        fn huge_totals_do_not_overflow(count in 1i64..100, seed in any::<u64>()) {
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let shares = split(MAX_TOTAL, count, 1, &mut rng).unwrap();
            prop_assert_eq!(shares.iter().sum::<i64>(), MAX_TOTAL);
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
    }
}
