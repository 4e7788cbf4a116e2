//! A line chart as a standalone SVG file: axes with ticks, one polyline with dots per series, a
//! legend. Small enough to write by hand; used for the recovery sweep's plot.

use std::fmt::Write as _;

/// One line of the chart.
pub(super) struct Series {
    pub label: String,
    pub color: &'static str,
    pub dashed: bool,
    /// (x, y) in the axes' units, in the order they are joined.
    pub points: Vec<(f64, f64)>,
}

/// What the chart shows.
pub(super) struct Chart<'a> {
    pub title: &'a str,
    pub subtitle: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    /// Ticks on the x axis (the x axis runs from 0 to the largest tick or point).
    pub x_ticks: &'a [f64],
    pub series: &'a [Series],
}

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 60.0;
const BOTTOM: f64 = 60.0;

/// A round step (1, 2 or 5 times a power of ten) that cuts `span` into at most about 6 parts.
fn tick_step(span: f64) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 1.0;
    }
    let raw = span / 6.0;
    let power = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * power)
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn number(v: f64) -> String {
    if v == v.round() {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The chart as an SVG document.
pub(super) fn svg(chart: &Chart<'_>) -> String {
    let points = chart.series.iter().flat_map(|s| s.points.iter());
    let x_max = points
        .clone()
        .map(|p| p.0)
        .chain(chart.x_ticks.iter().copied())
        .fold(0.0, f64::max)
        .max(1.0);
    let y_step = tick_step(points.clone().map(|p| p.1).fold(0.0, f64::max));
    let y_max = (points.map(|p| p.1).fold(0.0, f64::max) / y_step)
        .ceil()
        .max(1.0)
        * y_step;
    let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let px = |x: f64| LEFT + x / x_max * plot_w;
    let py = |y: f64| TOP + plot_h - y / y_max * plot_h;

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="24" font-size="15" font-weight="bold">{}</text>"#,
        escape(chart.title)
    );
    let _ = writeln!(
        out,
        r##"<text x="{LEFT}" y="42" fill="#555">{}</text>"##,
        escape(chart.subtitle)
    );
    // Grid and ticks.
    let mut y = 0.0;
    while y <= y_max + y_step / 2.0 {
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="#ddd"/><text x="{2:.1}" y="{3:.1}" text-anchor="end">{4}</text>"##,
            py(y),
            LEFT + plot_w,
            LEFT - 6.0,
            py(y) + 4.0,
            number(y)
        );
        y += y_step;
    }
    for &x in chart.x_ticks {
        let _ = writeln!(
            out,
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#000"/><text x="{0:.1}" y="{3:.1}" text-anchor="middle">{4}</text>"##,
            px(x),
            TOP + plot_h,
            TOP + plot_h + 5.0,
            TOP + plot_h + 18.0,
            number(x)
        );
    }
    // Axes and their labels.
    let _ = writeln!(
        out,
        r##"<path d="M{LEFT} {TOP} V{0:.1} H{1:.1}" fill="none" stroke="#000"/>"##,
        TOP + plot_h,
        LEFT + plot_w
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 18.0,
        escape(chart.x_label)
    );
    let _ = writeln!(
        out,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + plot_h / 2.0,
        escape(chart.y_label)
    );
    // Series and legend.
    for (n, s) in chart.series.iter().enumerate() {
        let dash = if s.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let path: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
            path.join(" "),
            s.color
        );
        for &(x, y) in &s.points {
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{}"><title>{}: {} at {}</title></circle>"#,
                px(x),
                py(y),
                s.color,
                escape(&s.label),
                number((y * 100.0).round() / 100.0),
                number(x)
            );
        }
        let ly = TOP + 10.0 + n as f64 * 20.0;
        let lx = LEFT + plot_w + 15.0;
        let _ = writeln!(
            out,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 24.0,
            s.color,
            lx + 30.0,
            ly + 4.0,
            escape(&s.label)
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_steps_are_round() {
        assert_eq!(tick_step(10.0), 2.0);
        assert_eq!(tick_step(3.0), 0.5);
        assert_eq!(tick_step(0.0), 1.0);
        assert_eq!(tick_step(600.0), 100.0);
    }

    #[test]
    fn draws_every_series() {
        let series = [
            Series {
                label: "a <1>".into(),
                color: "#1f77b4",
                dashed: false,
                points: vec![(64.0, 1.0), (128.0, 2.5)],
            },
            Series {
                label: "b".into(),
                color: "#d62728",
                dashed: true,
                points: vec![(64.0, 1.5)],
            },
        ];
        let text = svg(&Chart {
            title: "t",
            subtitle: "s",
            x_label: "x",
            y_label: "y",
            x_ticks: &[64.0, 128.0],
            series: &series,
        });
        assert!(text.starts_with("<svg") && text.ends_with("</svg>\n"));
        assert_eq!(text.matches("<polyline").count(), 2);
        assert_eq!(text.matches("<circle").count(), 3);
        assert!(text.contains("a &lt;1&gt;") && !text.contains("a <1>"));
    }
}
