//! `prizepool pool analyze FILE`: what each pool of a pool file pays, from
//! the file alone ([`crate::kinds::lucky_gift::economics`]), as text, as
//! JSON (`--json`) or as a picture of the payout per combo (`--svg FILE`);
//! for an activity file what a chance costs and how the stock runs out
//! ([`crate::kinds::lottery::economics`]); with `--red-packet` the bounds
//! of a red packet's share.

use std::fmt::Write as _;

use anyhow::Context;

use crate::kinds::{
    lottery,
    lucky_gift::{
        self,
        economics::{analyze, Analysis, Figures},
        PoolConfig,
    },
};

/// What `pool analyze` was asked.
pub(super) struct Asked<'a> {
    pub(super) file: Option<&'a std::path::Path>,
    pub(super) json: bool,
    pub(super) svg: Option<&'a std::path::Path>,
    pub(super) draws_per_second: f64,
    /// `TOTAL,COUNT,MIN` of a red packet.
    pub(super) red_packet: Option<&'a str>,
}

/// Runs `pool analyze`.
pub(super) fn run(asked: &Asked<'_>) -> anyhow::Result<()> {
    if let Some(spec) = asked.red_packet {
        return red_packet(spec, asked.json);
    }
    let file = asked
        .file
        .context("name a pool or activity file, or give --red-packet TOTAL,COUNT,MIN")?;
    let (json, svg) = (asked.json, asked.svg);
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("{} is not a TOML file", file.display()))?;
    if table.contains_key("activities") {
        return activities(file, &text, asked.draws_per_second, json);
    }
    let configs = lucky_gift::parse_file(&text)
        .with_context(|| format!("{} is not a valid pool file", file.display()))?;
    let analyses: Vec<(Analysis, Vec<Analysis>)> =
        configs.iter().map(|c| (analyze(c), sub_pools(c))).collect();
    if let Some(path) = svg {
        let all: Vec<&Analysis> = analyses.iter().map(|(a, _)| a).collect();
        std::fs::write(path, picture(&all))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if json {
        let out: Vec<serde_json::Value> = analyses
            .iter()
            .map(|(a, subs)| {
                let mut v = serde_json::to_value(a).unwrap_or_default();
                v["sub_pools"] = serde_json::to_value(subs).unwrap_or_default();
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    for (a, subs) in &analyses {
        print!("{}", report(a, subs));
    }
    Ok(())
}

/// `--red-packet TOTAL,COUNT,MIN`.
fn red_packet(spec: &str, json: bool) -> anyhow::Result<()> {
    let numbers: Vec<i64> = spec
        .split(',')
        .map(|n| n.trim().parse::<i64>())
        .collect::<Result<_, _>>()
        .ok()
        .filter(|n: &Vec<i64>| n.len() == 2 || n.len() == 3)
        .with_context(|| format!("--red-packet {spec:?}: expected TOTAL,COUNT[,MIN]"))?;
    let min = numbers.get(2).copied().unwrap_or(0);
    let b = lottery::economics::share_bounds(numbers[0], numbers[1], min)
        .map_err(|e| anyhow::anyhow!("--red-packet {spec:?}: {e}"))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&b)?);
    } else {
        println!(
            "red packet of {} in {} shares of at least {}: every share is at least {}, {} on average, the first at most {}, any at most {} (the last, when every earlier share was the least)",
            grouped(i128::from(b.total)),
            b.count,
            b.min,
            grouped(i128::from(b.least)),
            grouped(i128::from(b.mean)),
            grouped(i128::from(b.first_at_most)),
            grouped(i128::from(b.at_most))
        );
    }
    Ok(())
}

/// An activity file's analyses.
fn activities(
    file: &std::path::Path,
    text: &str,
    draws_per_second: f64,
    json: bool,
) -> anyhow::Result<()> {
    let configs = lottery::parse_file(text)
        .with_context(|| format!("{} is not a valid activity file", file.display()))?;
    let analyses: Vec<lottery::economics::Analysis> = configs
        .iter()
        .map(|c| lottery::economics::analyze(c, draws_per_second))
        .collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&analyses)?);
        return Ok(());
    }
    for a in &analyses {
        print!("{}", activity_report(a));
    }
    Ok(())
}

/// The text report of one activity.
fn activity_report(a: &lottery::economics::Analysis) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "activity {} — a chance costs {:.4} on average while every prize is in stock{}; the finite stock is worth {}",
        a.activity,
        a.cost_per_chance,
        a.max_cost_per_chance
            .map_or_else(String::new, |m| format!(" (max_cost_per_chance {m})")),
        grouped(i128::try_from(a.stock_value).unwrap_or(i128::MAX))
    );
    if !a.without_value.is_empty() {
        let _ = writeln!(
            out,
            "  prizes without a declared value (counted as 0): {}",
            a.without_value.join(", ")
        );
    }
    for phase in &a.phases {
        let odds: Vec<String> = phase
            .odds
            .iter()
            .map(|o| format!("{} {}", o.prize, percent(o.probability)))
            .collect();
        let _ = writeln!(
            out,
            "  from draw {:.0} ({:.0} s at {} draws/s): {}; a chance costs {:.4}; {}",
            phase.from_draw,
            phase.from_second,
            a.draws_per_second,
            if odds.is_empty() {
                "nothing left".to_owned()
            } else {
                odds.join(", ")
            },
            phase.cost_per_chance,
            match &phase.ends_with {
                Some(p) => format!("until {p} runs out"),
                None if phase.odds.is_empty() => "draws answer sold_out".to_owned(),
                None => "for good".to_owned(),
            }
        );
    }
    out
}

/// The analyses of a sharded pool's sub-pools (none for a pool of one).
fn sub_pools(config: &PoolConfig) -> Vec<Analysis> {
    if config.shards <= 1 {
        return Vec::new();
    }
    config.sub_pools().iter().map(analyze).collect()
}

/// `n` with thousands separators.
fn grouped(n: i128) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

fn percent(x: f64) -> String {
    format!("{:.3} %", x * 100.0)
}

fn distribution(out: &mut String, f: &Figures, indent: &str) {
    let _ = writeln!(
        out,
        "{indent}{:>10}  {:>12}  {:>10}  {:>12}",
        "multiplier", "prizes", "chance", "payout share"
    );
    for s in &f.distribution {
        let _ = writeln!(
            out,
            "{indent}{:>10}  {:>12}  {:>10}  {:>12}",
            format!("{}×", s.multiplier),
            grouped(i128::from(s.count)),
            percent(s.probability),
            percent(s.payout_share)
        );
    }
}

/// The text report of one pool.
pub(super) fn report(a: &Analysis, subs: &[Analysis]) -> String {
    let mut out = String::new();
    let asset = &a.asset;
    let _ = writeln!(
        out,
        "pool {} — unit_price {} {asset}, max_count {}, a batch of {} prizes",
        a.pool,
        grouped(i128::from(a.unit_price)),
        a.max_count,
        grouped(i128::from(a.batch.prizes))
    );
    let _ = writeln!(
        out,
        "  return to player {:.6} per prize: {:.1} {asset} paid per 1,000 prizes of {} {asset}{}",
        a.batch.rtp,
        a.paid_per_thousand,
        grouped(i128::from(a.unit_price)),
        a.max_rtp
            .map_or_else(String::new, |m| format!(" (max_rtp {m})"))
    );
    let _ = writeln!(
        out,
        "  hit rate {}, standard deviation of one prize {:.3}×",
        percent(a.batch.hit_rate),
        a.batch.std_dev
    );
    distribution(&mut out, &a.batch, "    ");
    let _ = writeln!(out, "  per combo:");
    for (id, f) in &a.combos {
        let _ = writeln!(
            out,
            "    {id}: {} prizes, return {:.6}, hit rate {}",
            grouped(i128::from(f.prizes)),
            f.rtp,
            percent(f.hit_rate)
        );
    }
    let _ = writeln!(
        out,
        "  one draw ({asset}): {:>8}  {:>14}  {:>14}  {:>14}  {:>14}",
        "prizes", "mean", "std dev", "least", "most"
    );
    for d in &a.draws {
        let _ = writeln!(
            out,
            "                    {:>8}  {:>14.1}  {:>14.1}  {:>14}  {:>14}",
            d.count,
            d.mean_reward,
            d.std_dev_reward,
            grouped(d.min_reward),
            grouped(d.max_reward)
        );
    }
    let _ = writeln!(
        out,
        "  a whole batch pays exactly {} {asset}; one user can take at most {} {asset} of it (a draw of its {} highest prizes)",
        grouped(a.batch_total),
        grouped(a.batch_max_to_one_user),
        a.max_count.min(u32::try_from(a.batch.prizes).unwrap_or(u32::MAX))
    );
    if let Some(j) = &a.jackpot {
        let _ = writeln!(
            out,
            "  jackpot rule: {} prizes of {}× or more per batch ({} of the payout) wait until the day's consumption reaches {} {asset} ({} prizes drawn); about {:.2} are parked a day before then; return while gated {:.6}",
            grouped(i128::from(j.gated_prizes)),
            j.min_multiplier,
            percent(j.gated_payout_share),
            grouped(i128::from(j.daily_consumption_threshold)),
            grouped(i128::from(j.prizes_before_gate_opens)),
            j.expected_parked_per_day,
            j.rtp_while_gated
        );
    }
    for s in subs {
        let _ = writeln!(
            out,
            "  sub-pool {}: the same batch{}",
            s.pool,
            s.jackpot.as_ref().map_or_else(String::new, |j| format!(
                ", its gate opens at {} {asset} a day",
                grouped(i128::from(j.daily_consumption_threshold))
            ))
        );
    }
    out
}

/// An SVG picture: for each pool and combo, a bar per multiplier whose
/// height is its share of the combo's payout, labelled with the
/// multiplier and its count.
pub(super) fn picture(analyses: &[&Analysis]) -> String {
    const BAR: usize = 34;
    const GAP: usize = 10;
    const HEIGHT: f64 = 160.0;
    let rows: Vec<(String, &Figures)> = analyses
        .iter()
        .flat_map(|a| {
            a.combos
                .iter()
                .map(move |(id, f)| (format!("{} / {id} (return {:.4})", a.pool, f.rtp), f))
        })
        .collect();
    let widest = rows
        .iter()
        .map(|(_, f)| f.distribution.len())
        .max()
        .unwrap_or(1);
    let width = 60 + widest * (BAR + GAP);
    let row_height = HEIGHT as usize + 70;
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{}" font-family="sans-serif" font-size="11">"#,
        rows.len() * row_height + 10
    );
    svg.push_str("<title>payout share per multiplier, per combo</title>");
    for (r, (title, f)) in rows.iter().enumerate() {
        let top = r * row_height + 20;
        let base = top as f64 + 20.0 + HEIGHT;
        let _ = write!(
            svg,
            r#"<text x="10" y="{top}" font-weight="bold">{}</text>"#,
            escape(title)
        );
        let _ = write!(
            svg,
            r#"<line x1="40" y1="{base}" x2="{}" y2="{base}" stroke="black"/>"#,
            width - 10
        );
        for (i, s) in f.distribution.iter().enumerate() {
            let x = 50 + i * (BAR + GAP);
            let h = (s.payout_share * HEIGHT).max(0.5);
            let _ = write!(
                svg,
                r##"<rect x="{x}" y="{:.1}" width="{BAR}" height="{h:.1}" fill="#c0392b"><title>{}× : {} prizes, {:.2} % of the payout</title></rect>"##,
                base - h,
                s.multiplier,
                s.count,
                s.payout_share * 100.0
            );
            let _ = write!(
                svg,
                r#"<text x="{}" y="{:.1}" text-anchor="middle">{:.1}%</text>"#,
                x + BAR / 2,
                base - h - 3.0,
                s.payout_share * 100.0
            );
            let _ = write!(
                svg,
                r#"<text x="{}" y="{:.1}" text-anchor="middle">{}×</text><text x="{}" y="{:.1}" text-anchor="middle" fill="gray">{}</text>"#,
                x + BAR / 2,
                base + 14.0,
                s.multiplier,
                x + BAR / 2,
                base + 27.0,
                s.count
            );
        }
    }
    svg.push_str("</svg>\n");
    svg
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_grouped_by_thousands() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(-1_234_567), "-1,234,567");
    }

    #[test]
    fn the_example_pool_reports_and_draws() {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/pools.toml"))
                .unwrap();
        let configs = lucky_gift::parse_file(&text).unwrap();
        let a = analyze(&configs[0]);
        let report = report(&a, &sub_pools(&configs[0]));
        assert!(report.contains("return to player"), "{report}");
        assert!(report.contains("jackpot rule"), "{report}");
        let svg = picture(&[&a]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(
            svg.matches("<rect").count(),
            a.combos
                .iter()
                .map(|(_, f)| f.distribution.len())
                .sum::<usize>()
        );
    }
}
