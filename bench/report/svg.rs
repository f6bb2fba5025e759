//! The report's plots: throughput and p99 latency, as SVG.

use std::fmt::Write as _;

use super::{Report, Run};

/// A plot panel: title, left offset, and the value plotted.
type Panel = (&'static str, f64, fn(&Run) -> f64);

/// The points of a plot's line: (x, run).
type Points<'a> = Vec<(f64, &'a Run)>;

/// A line of a plot: its label and its points.
type Series<'a> = (String, Points<'a>);

/// Line colours, one per series.
const COLOURS: [&str; 6] = [
    "steelblue",
    "darkorange",
    "seagreen",
    "crimson",
    "purple",
    "saddlebrown",
];

/// Draws/s and p99 latency of `series` against `x_name`, as an SVG of two
/// panels, one polyline per series.
fn plot(series: &[Series<'_>], x_name: &str) -> String {
    let (w, h, pad) = (640.0, 300.0, 50.0);
    let xs = || series.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x));
    let (xmin, xmax) = (xs().fold(f64::MAX, f64::min), xs().fold(f64::MIN, f64::max));
    let x = |v: f64| {
        pad + if xmax > xmin {
            (v - xmin) / (xmax - xmin) * (w / 2.0 - 2.0 * pad)
        } else {
            (w / 2.0 - 2.0 * pad) / 2.0
        }
    };
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{}" font-family="sans-serif" font-size="11">"#,
        h + 16.0 * series.len() as f64
    );
    let panels: [Panel; 2] = [
        ("draws/s", 0.0, |r| r.max.draws_per_s),
        ("p99 draw latency ms", w / 2.0, |r| r.max.latency.p99_ms),
    ];
    for (title, left, value) in panels {
        let ymax = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(_, r)| value(r)))
            .fold(1e-9, f64::max)
            * 1.15;
        let y = |v: f64| h - pad - v / ymax * (h - 2.0 * pad);
        let _ = write!(
            svg,
            r#"<g transform="translate({left},0)"><text x="{pad}" y="20" font-size="13">{title} vs {x_name}</text>"#
        );
        let _ = write!(
            svg,
            r#"<line x1="{pad}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{}" stroke="black"/>"#,
            h - pad,
            w / 2.0 - pad,
            h - pad,
            h - pad
        );
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}">0</text><text x="4" y="{}">{:.0}</text>"#,
            pad - 12.0,
            h - pad + 4.0,
            pad + 4.0,
            ymax
        );
        for (n, (_, points)) in series.iter().enumerate() {
            let line = Line {
                colour: COLOURS[n % COLOURS.len()],
                x: &x,
                y: &y,
                value,
                baseline: h - pad,
            };
            line.draw(&mut svg, points);
        }
        let _ = write!(svg, "</g>");
    }
    for (n, (label, _)) in series.iter().enumerate() {
        let _ = write!(
            svg,
            r#"<text x="{pad}" y="{}" fill="{}">— {label}</text>"#,
            h + 12.0 + 16.0 * n as f64,
            COLOURS[n % COLOURS.len()]
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// One series in one panel: where its points go and how they look.
struct Line<'a> {
    colour: &'static str,
    /// Where a value of the x axis goes.
    x: &'a dyn Fn(f64) -> f64,
    /// Where a value of the panel's y axis goes.
    y: &'a dyn Fn(f64) -> f64,
    /// The panel's figure of a run.
    value: fn(&Run) -> f64,
    /// The y of the x axis, under which the x values are written.
    baseline: f64,
}

impl Line<'_> {
    /// Draws `points` as a polyline with a dot and its value at each point,
    /// and the point's x value under the axis.
    fn draw(&self, svg: &mut String, points: &Points<'_>) {
        let Self {
            colour,
            x,
            y,
            value,
            baseline,
        } = *self;
        let line: Vec<String> = points
            .iter()
            .map(|(a, r)| format!("{:.1},{:.1}", x(*a), y(value(r))))
            .collect();
        let _ = write!(
            svg,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            line.join(" ")
        );
        for (a, r) in points {
            let b = value(r);
            let _ = write!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"/><text x="{:.1}" y="{:.1}">{b:.0}</text>"#,
                x(*a),
                y(b),
                x(*a) + 5.0,
                y(b) - 5.0
            );
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{}">{a}</text>"#,
                x(*a) - 3.0,
                baseline + 15.0
            );
        }
    }
}

impl Report {
    /// Throughput and p99 latency against draw workers, as an SVG (one line
    /// per batch size when the run swept them).
    pub(super) fn svg(&self) -> String {
        let series = self.series(
            |r| r.batch,
            |b| match b {
                Some(k) => format!("batch {k}"),
                None => "single draws".into(),
            },
            |r| r.draw_workers as f64,
        );
        plot(&series, "draw workers")
    }

    /// Throughput and p99 latency against the batch size, one line per
    /// draw-worker count; `None` without a `--batch` sweep.
    pub(super) fn batch_svg(&self) -> Option<String> {
        let batched: Vec<&Run> = self.runs.iter().filter(|r| r.batch.is_some()).collect();
        if batched.len() < 2 {
            return None;
        }
        let series = self.series(
            |r| Some(r.draw_workers),
            |w| format!("{} draw workers", w.unwrap_or_default()),
            |r| r.batch.unwrap_or(1) as f64,
        );
        let series: Vec<Series<'_>> = series
            .into_iter()
            .map(|(label, points)| {
                (
                    label,
                    points
                        .into_iter()
                        .filter(|(_, r)| r.batch.is_some())
                        .collect(),
                )
            })
            .collect();
        Some(plot(&series, "draws per message (batch size)"))
    }

    /// The runs grouped by `key`, each group's points ordered by `x`.
    fn series(
        &self,
        key: fn(&Run) -> Option<usize>,
        label: fn(Option<usize>) -> String,
        x: fn(&Run) -> f64,
    ) -> Vec<Series<'_>> {
        let mut series: Vec<(Option<usize>, Points<'_>)> = Vec::new();
        for r in &self.runs {
            match series.iter_mut().find(|(k, _)| *k == key(r)) {
                Some((_, points)) => points.push((x(r), r)),
                None => series.push((key(r), vec![(x(r), r)])),
            }
        }
        series
            .into_iter()
            .map(|(k, mut points)| {
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                (label(k), points)
            })
            .collect()
    }
}
