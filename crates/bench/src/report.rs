//! The result format shared by every benchmark suite.
//!
//! `{"suite": "engine", "quick": bool, "rows": [ {name, value, unit, baseline, ratio, target, pass} ]}`.
//! `target` compares `ratio` when a baseline exists and `value` otherwise.

use serde::Serialize;
use std::io::Write;
use std::path::Path;

/// Comparison operator of a target.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub enum TargetOp {
    #[serde(rename = ">=")]
    AtLeast,
    #[serde(rename = "<=")]
    AtMost,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Target {
    pub op: TargetOp,
    pub value: f64,
}

impl Target {
    pub fn at_least(value: f64) -> Self {
        Target {
            op: TargetOp::AtLeast,
            value,
        }
    }
    pub fn at_most(value: f64) -> Self {
        Target {
            op: TargetOp::AtMost,
            value,
        }
    }
    pub fn holds(&self, measured: f64) -> bool {
        match self.op {
            TargetOp::AtLeast => measured >= self.value,
            TargetOp::AtMost => measured <= self.value,
        }
    }
}

/// One figure of a benchmark run.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub name: String,
    pub value: f64,
    pub unit: String,
    pub baseline: Option<f64>,
    pub ratio: Option<f64>,
    pub target: Option<Target>,
    pub pass: Option<bool>,
}

impl Row {
    /// A figure with nothing to compare against.
    pub fn plain(name: impl Into<String>, value: f64, unit: impl Into<String>) -> Self {
        Row {
            name: name.into(),
            value,
            unit: unit.into(),
            baseline: None,
            ratio: None,
            target: None,
            pass: None,
        }
    }

    /// A figure compared with a baseline measured in the same run; ratio = value / baseline.
    pub fn versus(
        name: impl Into<String>,
        value: f64,
        unit: impl Into<String>,
        baseline: f64,
    ) -> Self {
        let ratio = if baseline != 0.0 {
            Some(value / baseline)
        } else {
            None
        };
        Row {
            name: name.into(),
            value,
            unit: unit.into(),
            baseline: Some(baseline),
            ratio,
            target: None,
            pass: None,
        }
    }

    /// Attaches a target: it judges `ratio` when there is one, else `value`.
    pub fn with_target(mut self, target: Target) -> Self {
        let judged = self.ratio.unwrap_or(self.value);
        self.pass = Some(target.holds(judged));
        self.target = Some(target);
        self
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub suite: String,
    pub quick: bool,
    pub rows: Vec<Row>,
}

impl Report {
    pub fn new(suite: &str, quick: bool) -> Self {
        Report {
            suite: suite.to_string(),
            quick,
            rows: Vec::new(),
        }
    }

    /// Adds a row and prints it at once, so a long run shows progress.
    pub fn push(&mut self, row: Row) {
        if self.rows.is_empty() {
            println!("{}", header_line());
        }
        println!("{}", format_row(&row));
        let _ = std::io::stdout().flush();
        self.rows.push(row);
    }

    /// Prints the whole table again (the final summary) and writes JSON if asked. First measures
    /// how much CPU time the machine withholds from busy threads right now (one and two threads,
    /// half a second each): on a shared machine this explains a noisy run.
    pub fn finish(&mut self, json_path: Option<&Path>) -> anyhow::Result<()> {
        for threads in [1, 2] {
            self.push(Row::plain(
                format!(
                    "machine_cpu_lost_share_{threads}_thread{}",
                    if threads > 1 { "s" } else { "" }
                ),
                crate::util::cpu_lost_share(threads, 0.5),
                "x",
            ));
        }
        println!();
        println!(
            "== {} ({}) ==",
            self.suite,
            if self.quick { "quick" } else { "full" }
        );
        println!("{}", header_line());
        for row in &self.rows {
            println!("{}", format_row(row));
        }
        let failed = self.rows.iter().filter(|r| r.pass == Some(false)).count();
        let judged = self.rows.iter().filter(|r| r.pass.is_some()).count();
        println!("targets: {} of {} met", judged - failed, judged);
        if let Some(path) = json_path {
            let text = serde_json::to_string_pretty(self)?;
            std::fs::write(path, text)?;
            println!("wrote {}", path.display());
        }
        Ok(())
    }
}

fn header_line() -> String {
    format!(
        "{:<44} {:>14} {:<8} {:>14} {:>8} {:>10} {:>5}",
        "name", "value", "unit", "baseline", "ratio", "target", "pass"
    )
}

fn format_row(row: &Row) -> String {
    let baseline = row.baseline.map(fmt_num).unwrap_or_else(|| "-".into());
    let ratio = row
        .ratio
        .map(|r| format!("{r:.3}"))
        .unwrap_or_else(|| "-".into());
    let target = row
        .target
        .map(|t| {
            format!(
                "{}{}",
                if t.op == TargetOp::AtLeast {
                    ">="
                } else {
                    "<="
                },
                fmt_num(t.value)
            )
        })
        .unwrap_or_else(|| "-".into());
    let pass = match row.pass {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    };
    format!(
        "{:<44} {:>14} {:<8} {:>14} {:>8} {:>10} {:>5}",
        row.name,
        fmt_num(row.value),
        row.unit,
        baseline,
        ratio,
        target,
        pass
    )
}

fn fmt_num(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_judges_ratio_when_present() {
        let row = Row::versus("x", 80.0, "ops/s", 100.0).with_target(Target::at_least(0.75));
        assert_eq!(row.ratio, Some(0.8));
        assert_eq!(row.pass, Some(true));
        let row = Row::versus("x", 70.0, "ops/s", 100.0).with_target(Target::at_least(0.75));
        assert_eq!(row.pass, Some(false));
    }

    #[test]
    fn target_judges_value_without_baseline() {
        let row = Row::plain("bytes_per_object", 140.0, "B").with_target(Target::at_most(150.0));
        assert_eq!(row.pass, Some(true));
        let json = serde_json::to_string(&row).unwrap();
        assert!(json.contains("\"op\":\"<=\""), "{json}");
        assert!(json.contains("\"baseline\":null"), "{json}");
    }
}
