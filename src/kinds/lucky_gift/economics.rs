//! What a lucky-gift pool pays, from its configuration alone: return to
//! player, hit rate, the spread of a draw's reward, the most one batch can
//! pay, and what the jackpot rule holds back (`prizepool pool analyze`,
//! SPEC §5a). Every figure is exact arithmetic on the batch: a batch holds
//! every combo once, and a draw takes prizes from it without replacement,
//! so a whole batch pays exactly its configured total, whatever order its
//! prizes come in.
//!
//! Return to player (RTP) is Σ multiplier × count ÷ Σ count: the prizes'
//! multipliers per prize drawn, a multiple of `unit_price`. An RTP of 0.95
//! pays 950 × `unit_price` per 1,000 prizes drawn.

use serde::Serialize;

use super::PoolConfig;

/// One multiplier's share of a combo or batch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Share {
    pub multiplier: u64,
    pub count: u64,
    /// `count` ÷ the prizes of the combo or batch.
    pub probability: f64,
    /// `multiplier × count` ÷ the multipliers' total: the part of the
    /// payout this multiplier makes.
    pub payout_share: f64,
}

/// The figures of a set of prizes (a combo, or a whole batch).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Figures {
    pub prizes: u64,
    /// Σ multiplier × count: what the prizes pay, in `unit_price`s.
    pub multiplier_total: u64,
    pub rtp: f64,
    /// Share of prizes with a non-zero multiplier.
    pub hit_rate: f64,
    /// Standard deviation of one prize's multiplier.
    pub std_dev: f64,
    pub distribution: Vec<Share>,
}

/// The spread of one draw of `count` prizes from a fresh batch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DrawSpread {
    pub count: u32,
    /// Expected reward, in the pool's asset.
    pub mean_reward: f64,
    /// Standard deviation of the reward, in the pool's asset (prizes drawn
    /// without replacement from one batch).
    pub std_dev_reward: f64,
    /// The most and least one draw of `count` prizes can pay, in the
    /// pool's asset: the `count` highest and lowest prizes of a batch.
    pub max_reward: i128,
    pub min_reward: i128,
}

/// What the jackpot rule holds back.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JackpotEffect {
    pub min_multiplier: u64,
    pub daily_consumption_threshold: i64,
    /// Jackpots in a batch, and the part of the batch's payout they make.
    pub gated_prizes: u64,
    pub gated_multiplier_total: u64,
    pub gated_payout_share: f64,
    /// Prizes drawn in a day before the gate opens (the threshold over
    /// `unit_price`, rounded up).
    pub prizes_before_gate_opens: u64,
    /// Jackpots such draws meet and park, on average (their share of the
    /// batch times the prizes drawn before the gate opens).
    pub expected_parked_per_day: f64,
    /// RTP while the gate is closed: what the prizes that are no jackpot
    /// pay per prize.
    pub rtp_while_gated: f64,
}

/// A pool's economics.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Analysis {
    pub pool: String,
    pub asset: String,
    pub unit_price: i64,
    pub max_count: u32,
    pub batch: Figures,
    pub combos: Vec<(String, Figures)>,
    /// What 1,000 prizes of `unit_price` pay back on average, in the
    /// pool's asset.
    pub paid_per_thousand: f64,
    /// The most one batch can pay to one user (a draw of `max_count` of
    /// its highest prizes, or all of it when it is smaller), and to all
    /// users together (its whole payout), in the pool's asset.
    pub batch_max_to_one_user: i128,
    pub batch_total: i128,
    pub draws: Vec<DrawSpread>,
    pub jackpot: Option<JackpotEffect>,
    /// `max_rtp` as configured.
    pub max_rtp: Option<f64>,
}

/// The figures of prizes `stock` ((multiplier, count) pairs).
pub fn figures<'a>(stock: impl IntoIterator<Item = &'a (u64, u64)> + Clone) -> Figures {
    let mut by_multiplier = std::collections::BTreeMap::<u64, u64>::new();
    for (m, n) in stock {
        *by_multiplier.entry(*m).or_default() += n;
    }
    let prizes: u64 = by_multiplier.values().sum();
    let total: u64 = by_multiplier.iter().map(|(m, n)| m * n).sum();
    let n = prizes.max(1) as f64;
    let rtp = total as f64 / n;
    let hits: u64 = by_multiplier
        .iter()
        .filter(|(m, _)| **m > 0)
        .map(|(_, c)| c)
        .sum();
    let variance = by_multiplier
        .iter()
        .map(|(m, c)| *c as f64 * (*m as f64 - rtp).powi(2))
        .sum::<f64>()
        / n;
    Figures {
        prizes,
        multiplier_total: total,
        rtp,
        hit_rate: hits as f64 / n,
        std_dev: variance.sqrt(),
        distribution: by_multiplier
            .iter()
            .map(|(m, c)| Share {
                multiplier: *m,
                count: *c,
                probability: *c as f64 / n,
                payout_share: if total == 0 {
                    0.0
                } else {
                    (m * c) as f64 / total as f64
                },
            })
            .collect(),
    }
}

/// The sum of the `count` highest (or lowest) multipliers of `figures`.
fn extreme_sum(figures: &Figures, count: u64, highest: bool) -> u128 {
    let mut left = count;
    let mut sum = 0u128;
    let mut shares: Vec<&Share> = figures.distribution.iter().collect();
    if highest {
        shares.reverse();
    }
    for s in shares {
        let take = s.count.min(left);
        sum += u128::from(take) * u128::from(s.multiplier);
        left -= take;
        if left == 0 {
            break;
        }
    }
    sum
}

/// The analysis of one pool (a sub-pool of a sharded pool is analysed as
/// the pool it is: the same batch, its own share of the threshold).
pub fn analyze(config: &PoolConfig) -> Analysis {
    let all: Vec<(u64, u64)> = config
        .combos
        .iter()
        .flat_map(|c| c.stock.iter().copied())
        .collect();
    let batch = figures(&all);
    let price = config.unit_price as f64;
    let n = batch.prizes;
    let spread = |count: u32| {
        let c = u64::from(count).min(n);
        // Sampling without replacement: Var = c σ² (N − c) / (N − 1).
        let correction = if n > 1 {
            (n - c) as f64 / (n - 1) as f64
        } else {
            0.0
        };
        let variance = c as f64 * batch.std_dev.powi(2) * correction;
        DrawSpread {
            count,
            mean_reward: c as f64 * batch.rtp * price,
            std_dev_reward: variance.sqrt() * price,
            max_reward: extreme_sum(&batch, c, true) as i128 * i128::from(config.unit_price),
            min_reward: extreme_sum(&batch, c, false) as i128 * i128::from(config.unit_price),
        }
    };
    let mut counts = vec![1, 10, 100, config.max_count];
    counts.retain(|c| *c <= config.max_count);
    counts.dedup();
    let jackpot = config.jackpot.as_ref().map(|j| {
        let gated: Vec<(u64, u64)> = all.iter().copied().filter(|(m, _)| j.gates(*m)).collect();
        let gated_prizes: u64 = gated.iter().map(|(_, c)| c).sum();
        let gated_total: u64 = gated.iter().map(|(m, c)| m * c).sum();
        let before = u64::try_from(
            (j.daily_consumption_threshold + config.unit_price - 1) / config.unit_price,
        )
        .unwrap_or(0);
        let open_prizes = n - gated_prizes;
        JackpotEffect {
            min_multiplier: j.min_multiplier,
            daily_consumption_threshold: j.daily_consumption_threshold,
            gated_prizes,
            gated_multiplier_total: gated_total,
            gated_payout_share: if batch.multiplier_total == 0 {
                0.0
            } else {
                gated_total as f64 / batch.multiplier_total as f64
            },
            prizes_before_gate_opens: before,
            expected_parked_per_day: before as f64 * gated_prizes as f64 / n.max(1) as f64,
            rtp_while_gated: (batch.multiplier_total - gated_total) as f64
                / open_prizes.max(1) as f64,
        }
    });
    Analysis {
        pool: config.id.clone(),
        asset: config.asset.clone(),
        unit_price: config.unit_price,
        max_count: config.max_count,
        paid_per_thousand: batch.rtp * price * 1000.0,
        batch_max_to_one_user: extreme_sum(&batch, u64::from(config.max_count).min(n), true)
            as i128
            * i128::from(config.unit_price),
        batch_total: i128::from(config.unit_price) * batch.multiplier_total as i128,
        draws: counts.into_iter().map(spread).collect(),
        combos: config
            .combos
            .iter()
            .map(|c| (c.id.clone(), figures(&c.stock)))
            .collect(),
        batch,
        jackpot,
        max_rtp: config.max_rtp,
    }
}

/// Refuses a pool whose RTP is above its `max_rtp`, naming the combo that
/// pays most per prize and the figures.
pub(super) fn check_max_rtp(config: &PoolConfig) -> Result<(), (&'static str, String)> {
    let Some(max) = config.max_rtp else {
        return Ok(());
    };
    let analysis = analyze(config);
    if analysis.batch.rtp <= max {
        return Ok(());
    }
    let (combo, worst) = analysis
        .combos
        .iter()
        .max_by(|a, b| a.1.rtp.total_cmp(&b.1.rtp))
        .map(|(id, f)| (id.as_str(), f))
        .unwrap_or(("", &analysis.batch));
    let top = worst
        .distribution
        .iter()
        .max_by(|a, b| a.payout_share.total_cmp(&b.payout_share));
    Err((
        "max_rtp",
        format!(
            "the pool returns {:.4} per prize, above its max_rtp {max}; combo {combo:?} returns {:.4}{}",
            analysis.batch.rtp,
            worst.rtp,
            top.map_or_else(String::new, |s| format!(
                " ({} prizes of {}× make {:.1} % of its payout)",
                s.count,
                s.multiplier,
                s.payout_share * 100.0
            ))
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(text: &str) -> PoolConfig {
        super::super::parse_file(text).unwrap().remove(0)
    }

    const SPEC: &str = r#"
[[pools]]
id = "gift-1001"
kind = "lucky_gift"
unit_price = 100
max_count = 1000
jackpot = { min_multiplier = 5000, daily_consumption_threshold = 5_000_000 }
[[pools.combos]]
id = "c1"
stock = { "0" = 29994, "10" = 293, "50" = 139, "500" = 27, "5000" = 1 }
[[pools.combos]]
id = "c2"
stock = { "0" = 950, "2" = 50 }
"#;

    #[test]
    fn the_figures_are_the_batchs_arithmetic() {
        let a = analyze(&pool(SPEC));
        let total = 10 * 293 + 50 * 139 + 500 * 27 + 5000 + 2 * 50;
        let prizes = 29994 + 293 + 139 + 27 + 1 + 950 + 50;
        assert_eq!(a.batch.prizes, prizes);
        assert_eq!(a.batch.multiplier_total, total);
        assert_eq!(a.batch.rtp, total as f64 / prizes as f64);
        assert_eq!(a.batch_total, i128::from(total) * 100);
        assert_eq!(
            a.batch.hit_rate,
            (293 + 139 + 27 + 1 + 50) as f64 / prizes as f64
        );
        assert_eq!(a.combos[1].1.rtp, 0.1);
        // The most one user can take: a draw of 1,000 prizes, the highest
        // (the 510 that pay, then zeros).
        let top = 5000 + 27 * 500 + 139 * 50 + 293 * 10 + 50 * 2;
        assert_eq!(a.batch_max_to_one_user, i128::from(top) * 100);
        assert_eq!(
            a.draws.iter().map(|d| d.count).collect::<Vec<_>>(),
            [1, 10, 100, 1000]
        );
        assert_eq!(a.draws[0].max_reward, 500_000);
        assert_eq!(a.draws[0].min_reward, 0);
        let j = a.jackpot.unwrap();
        assert_eq!((j.gated_prizes, j.gated_multiplier_total), (1, 5000));
        assert_eq!(j.prizes_before_gate_opens, 50_000);
        assert_eq!(
            j.rtp_while_gated,
            (total - 5000) as f64 / (prizes - 1) as f64
        );
    }

    /// The spread of a draw of the whole batch is nil: it pays the batch's
    /// total whatever the order.
    #[test]
    fn a_draw_of_the_whole_batch_has_no_spread() {
        let p = pool(
            &SPEC
                .replace("max_count = 1000", "max_count = 10000")
                .replace(
                "stock = { \"0\" = 29994, \"10\" = 293, \"50\" = 139, \"500\" = 27, \"5000\" = 1 }",
                "stock = { \"0\" = 9000 }",
            ),
        );
        let a = analyze(&p);
        let whole = a.draws.last().unwrap();
        assert_eq!(whole.count, 10_000);
        assert_eq!(whole.std_dev_reward, 0.0);
        assert_eq!(whole.max_reward, whole.min_reward);
        assert_eq!(whole.max_reward, a.batch_total);
    }

    #[test]
    fn max_rtp_refuses_a_misplaced_zero_and_names_the_combo() {
        let ok = SPEC.replace("jackpot =", "max_rtp = 0.95\njackpot =");
        assert!(super::super::parse_file(&ok).is_ok());
        let typo = ok.replace("\"5000\" = 1 }", "\"5000\" = 10 }");
        let e = super::super::parse_file(&typo).unwrap_err().to_string();
        assert!(
            e.contains("max_rtp") && e.contains("\"c1\"") && e.contains("5000"),
            "{e}"
        );
        for bad in ["-0.1", "nan", "inf"] {
            let e = super::super::parse_file(
                &ok.replace("max_rtp = 0.95", &format!("max_rtp = {bad}")),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("max_rtp"), "{e}");
        }
    }
}
