//! What a lottery activity costs, from its file alone (`prizepool pool
//! analyze`, SPEC §5a): each prize's odds, the expected cost of a chance
//! from the prizes' declared values, and how the stock runs out at a given
//! draw rate, with the odds after each prize is gone.
//!
//! A `wheel` draw picks among the prizes still in stock in proportion to
//! their weights (the consolation, unlimited, always among them), so a
//! prize's odds are its weight over the weights in stock, and they change
//! only when a prize runs out. The run-out schedule follows the expected
//! draws: at `rate` draws a second a prize of odds `p` and stock `s` lasts
//! `s ÷ (p × rate)` seconds while the odds hold.

use serde::Serialize;

use super::config::ActivityConfig;

/// One prize's odds and expected cost share, while a set of prizes is in
/// stock.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Odds {
    pub prize: String,
    pub probability: f64,
}

/// A stretch of the activity during which the same prizes are in stock.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Phase {
    /// Expected draws (and seconds at the analysis's rate) from the start
    /// to the beginning of this stretch.
    pub from_draw: f64,
    pub from_second: f64,
    pub odds: Vec<Odds>,
    /// Expected cost of one chance in this stretch (prizes without a value
    /// count as 0).
    pub cost_per_chance: f64,
    /// The prize whose stock ends this stretch (none for the last one:
    /// the consolation goes on, or nothing is left and draws answer
    /// `sold_out`).
    pub ends_with: Option<String>,
}

/// An activity's economics.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Analysis {
    pub activity: String,
    pub draws_per_second: f64,
    /// The expected cost of one chance while every prize is in stock.
    pub cost_per_chance: f64,
    pub max_cost_per_chance: Option<f64>,
    /// Prizes that declare no value (counted as 0 in the costs).
    pub without_value: Vec<String>,
    /// The total value of every finite prize's stock.
    pub stock_value: u128,
    pub phases: Vec<Phase>,
}

/// The prizes in stock: (id, weight, stock left or `None` for the
/// consolation, value).
type InStock<'a> = Vec<(&'a str, f64, Option<f64>, f64)>;

fn cost_and_odds(in_stock: &InStock<'_>) -> (f64, Vec<Odds>) {
    let total: f64 = in_stock.iter().map(|p| p.1).sum();
    if total == 0.0 {
        return (0.0, Vec::new());
    }
    let odds = in_stock
        .iter()
        .map(|p| Odds {
            prize: p.0.to_owned(),
            probability: p.1 / total,
        })
        .collect();
    (in_stock.iter().map(|p| p.1 / total * p.3).sum(), odds)
}

/// The analysis of `config` at `draws_per_second` draws a second.
pub fn analyze(config: &ActivityConfig, draws_per_second: f64) -> Analysis {
    let rate = if draws_per_second > 0.0 {
        draws_per_second
    } else {
        1.0
    };
    let mut in_stock: InStock<'_> = config
        .prizes
        .iter()
        .map(|p| {
            (
                p.id.as_str(),
                f64::from(p.weight),
                Some(p.stock as f64),
                p.value.unwrap_or(0) as f64,
            )
        })
        .chain(config.consolation.iter().map(|c| {
            (
                c.id.as_str(),
                f64::from(c.weight),
                None,
                c.value.unwrap_or(0) as f64,
            )
        }))
        .collect();
    let cost_per_chance = config.cost_per_chance();
    let mut phases = Vec::new();
    let mut drawn = 0.0;
    loop {
        let (cost, odds) = cost_and_odds(&in_stock);
        let total: f64 = in_stock.iter().map(|p| p.1).sum();
        // The finite prize that runs out first, and after how many draws.
        let next = in_stock
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.2.map(|left| (i, left * total / p.1)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let from_draw = drawn;
        match next {
            Some((i, draws)) if total > 0.0 => {
                for p in &mut in_stock {
                    if let Some(left) = &mut p.2 {
                        *left -= draws * p.1 / total;
                    }
                }
                phases.push(Phase {
                    from_draw,
                    from_second: from_draw / rate,
                    odds,
                    cost_per_chance: cost,
                    ends_with: Some(in_stock[i].0.to_owned()),
                });
                drawn += draws;
                in_stock.remove(i);
            }
            _ => {
                phases.push(Phase {
                    from_draw,
                    from_second: from_draw / rate,
                    odds,
                    cost_per_chance: cost,
                    ends_with: None,
                });
                break;
            }
        }
    }
    Analysis {
        activity: config.id.clone(),
        draws_per_second: rate,
        cost_per_chance,
        max_cost_per_chance: config.max_cost_per_chance,
        without_value: config
            .prizes
            .iter()
            .filter(|p| p.value.is_none())
            .map(|p| p.id.clone())
            .chain(
                config
                    .consolation
                    .iter()
                    .filter(|c| c.value.is_none())
                    .map(|c| c.id.clone()),
            )
            .collect(),
        stock_value: config
            .prizes
            .iter()
            .map(|p| u128::from(p.stock) * u128::from(p.value.unwrap_or(0)))
            .sum(),
        phases,
    }
}

/// The bounds of one share of a red packet of `total` split into `count`
/// shares of at least `min` by the double-mean rule
/// ([`crate::kinds::red_packet`]'s split).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShareBounds {
    pub total: i64,
    pub count: i64,
    pub min: i64,
    /// Every share is at least this (`min`, and never 0).
    pub least: i64,
    /// The mean share.
    pub mean: i64,
    /// The first share is at most twice the mean.
    pub first_at_most: i64,
    /// The most any share can be: the last one, when every earlier share
    /// was the least.
    pub at_most: i64,
}

/// The bounds of a share of a red packet, or why it cannot be split.
pub fn share_bounds(total: i64, count: i64, min: i64) -> Result<ShareBounds, String> {
    use crate::kinds::red_packet::split;
    split::check(total, count, min).map_err(|e| e.to_string())?;
    let least = split::floor(min);
    let rest = (count - 1) * least;
    Ok(ShareBounds {
        total,
        count,
        min,
        least,
        mean: total / count,
        first_at_most: if count == 1 {
            total
        } else {
            (2 * total / count).min(total - rest)
        },
        at_most: total - rest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn activity(extra: &str, prizes: &str) -> ActivityConfig {
        let text = format!(
            "[[activities]]\nid = \"act\"\nstrategy = \"wheel\"\nstarts_at = \"2026-01-01T00:00:00Z\"\nends_at = \"2027-01-01T00:00:00Z\"\n{extra}\nprizes = [ {prizes} ]\nconsolation = {{ id = \"points\", weight = 8, value = 1 }}\n"
        );
        super::super::config::parse_file(&text).unwrap().remove(0)
    }

    const PRIZES: &str = r#"{ id = "ipad", weight = 1, stock = 10, value = 3000 }, { id = "coupon", weight = 1, stock = 100, value = 5 }"#;

    #[test]
    fn odds_and_costs_follow_the_weights_in_stock() {
        let a = analyze(&activity("", PRIZES), 10.0);
        // 1 + 1 + 8: the ipad's odds are 1/10 while it lasts.
        assert_eq!(a.cost_per_chance, 0.1 * 3000.0 + 0.1 * 5.0 + 0.8 * 1.0);
        assert_eq!(a.stock_value, 10 * 3000 + 100 * 5);
        // The ipad runs out first, after 10 ÷ 0.1 = 100 draws (10 s).
        assert_eq!(a.phases[0].ends_with.as_deref(), Some("ipad"));
        assert_eq!(a.phases[1].from_draw, 100.0);
        assert_eq!(a.phases[1].from_second, 10.0);
        // Then the coupon (90 left) at 1/9: 810 more draws.
        assert_eq!(a.phases[1].odds[0].probability, 1.0 / 9.0);
        assert_eq!(a.phases[1].ends_with.as_deref(), Some("coupon"));
        assert!((a.phases[2].from_draw - 910.0).abs() < 1e-9);
        // The consolation alone is left.
        assert_eq!(a.phases[2].odds.len(), 1);
        assert_eq!(a.phases[2].cost_per_chance, 1.0);
        assert_eq!(a.phases[2].ends_with, None);
    }

    #[test]
    fn max_cost_per_chance_refuses_a_costly_wheel() {
        let text = |max: &str| {
            format!(
                "[[activities]]\nid = \"act\"\nstrategy = \"wheel\"\nstarts_at = \"2026-01-01T00:00:00Z\"\nends_at = \"2027-01-01T00:00:00Z\"\nmax_cost_per_chance = {max}\nprizes = [ {PRIZES} ]\n"
            )
        };
        assert!(super::super::config::parse_file(&text("1600")).is_ok());
        let e = super::super::config::parse_file(&text("100"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("max_cost_per_chance") && e.contains("\"ipad\""),
            "{e}"
        );
    }

    #[test]
    fn share_bounds_are_those_of_the_split() {
        let b = share_bounds(10_000, 10, 1).unwrap();
        assert_eq!(
            (b.least, b.mean, b.first_at_most, b.at_most),
            (1, 1000, 2000, 9991)
        );
        assert_eq!(share_bounds(100, 1, 0).unwrap().at_most, 100);
        assert!(share_bounds(5, 10, 1).is_err());
    }
}
