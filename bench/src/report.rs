//! Results: a flat list of measurements, each beside its baseline, printed as a table, written
//! as JSON and rendered into `docs/benchmarks.md`.

use std::{fmt::Write as _, path::Path};

use serde::{Deserialize, Serialize};

/// One measured figure.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    /// Benchmark family (`per-packet`, `throughput`, `scale`).
    pub bench: String,
    /// What was measured.
    pub case: String,
    /// Median value.
    pub value: f64,
    /// Spread: (p10, p90) or (min, max) of the runs, same unit.
    pub spread: (f64, f64),
    /// Unit (`ns/pkt`, `Gbit/s`, `conn/s`, `ms`).
    pub unit: String,
    /// The baseline's label and median, measured in the same run.
    pub baseline: Option<(String, f64)>,
    /// Target from the issue, as text (`<= 150 ns/pkt`), if any.
    pub target: Option<String>,
}

impl Row {
    /// `value / baseline`.
    pub fn ratio(&self) -> Option<f64> {
        self.baseline.as_ref().filter(|b| b.1 != 0.0).map(|b| self.value / b.1)
    }
}

/// Median and (p10, p90) of `v` (sorted in place).
pub fn stats(v: &mut [f64]) -> (f64, (f64, f64)) {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), (at(0.1), at(0.9)))
}

/// Prints rows as an aligned table.
pub fn print_table(rows: &[Row]) {
    println!(
        "{:<12} {:<48} {:>12} {:>24} {:<10} {:>32} {:>8}",
        "bench", "case", "median", "spread (p10..p90)", "unit", "baseline", "ratio"
    );
    for r in rows {
        let base = r.baseline.as_ref().map(|(l, v)| format!("{l}: {v:.1}")).unwrap_or_default();
        let ratio = r.ratio().map(|x| format!("{x:.2}x")).unwrap_or_default();
        println!(
            "{:<12} {:<48} {:>12.1} {:>24} {:<10} {:>32} {:>8}",
            r.bench,
            r.case,
            r.value,
            format!("{:.1}..{:.1}", r.spread.0, r.spread.1),
            r.unit,
            base,
            ratio
        );
    }
}

/// When and how one benchmark family's rows in the accumulated report were measured.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Run {
    /// UTC date of the run.
    pub date: String,
    /// Command that produced it.
    pub command: String,
}

/// The report as read back from JSON (`--render`, and the accumulated `docs/benchmarks.json`).
#[derive(Deserialize)]
pub struct OwnedReport {
    /// UTC date of the newest run.
    pub date: String,
    /// Machine description.
    pub machine: String,
    /// Command of the newest run.
    pub command: String,
    /// Per benchmark family, the run its rows come from (absent in single-run files: every
    /// family is then from `date`/`command`).
    #[serde(default)]
    pub runs: std::collections::BTreeMap<String, Run>,
    /// Rows.
    pub rows: Vec<Row>,
}

impl OwnedReport {
    /// Merges a new run into this accumulated report: every family measured in `new` replaces
    /// that family's rows (in place of its first old row, else appended), other families keep
    /// their rows and their run. Benchmarks measured one family at a time thus still produce one
    /// complete `docs/benchmarks.md`, each family dated by its own run.
    pub fn merge(mut self, new: &Report<'_>) -> OwnedReport {
        for r in &self.rows {
            self.runs
                .entry(r.bench.clone())
                .or_insert_with(|| Run { date: self.date.clone(), command: self.command.clone() });
        }
        let fresh: std::collections::BTreeSet<&str> = new.rows.iter().map(|r| r.bench.as_str()).collect();
        let mut rows = Vec::with_capacity(self.rows.len() + new.rows.len());
        let mut placed = std::collections::BTreeSet::new();
        for r in self.rows {
            if !fresh.contains(r.bench.as_str()) {
                rows.push(r);
            } else if placed.insert(r.bench.clone()) {
                rows.extend(new.rows.iter().filter(|n| n.bench == r.bench).cloned());
            }
        }
        for n in new.rows {
            if !placed.contains(&n.bench) {
                rows.push(n.clone());
            }
        }
        for b in fresh {
            self.runs.insert(b.to_string(), Run { date: new.date.clone(), command: new.command.clone() });
        }
        OwnedReport {
            date: new.date.clone(),
            machine: new.machine.clone(),
            command: new.command.clone(),
            runs: self.runs,
            rows,
        }
    }
}

/// The whole report as written to JSON.
#[derive(Serialize)]
pub struct Report<'a> {
    /// UTC date of the (newest) run.
    pub date: String,
    /// Machine description (kernel, CPUs, memory).
    pub machine: String,
    /// Command that produced it.
    pub command: String,
    /// Per benchmark family, the run its rows come from (empty for a single run's file).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub runs: std::collections::BTreeMap<String, Run>,
    /// Rows.
    pub rows: &'a [Row],
}

/// Renders the report as the Markdown of `docs/benchmarks.md`.
pub fn markdown(r: &Report<'_>, notes: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Benchmarks\n");
    if r.runs.is_empty() {
        let _ = writeln!(s, "Generated by `{}` on {} — {}.\n", r.command, r.date, r.machine);
    } else {
        let _ = writeln!(
            s,
            "Accumulated from `cargo xtask bench` runs on {}; each family from its latest run:\n",
            r.machine
        );
        for (bench, run) in &r.runs {
            let _ = writeln!(s, "- {bench}: `{}` on {}", run.command, run.date);
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(
        s,
        "Every figure stands beside its baseline, measured in the same run. Medians; spread is p10..p90 of the runs."
    );
    let _ = writeln!(s, "Benchmarks never gate CI; a missed target is reported here with its size.\n");
    let _ = writeln!(s, "| bench | case | median | spread | unit | baseline | ratio | target |");
    let _ = writeln!(s, "|---|---|---:|---|---|---|---:|---|");
    for row in r.rows {
        let base = row.baseline.as_ref().map(|(l, v)| format!("{l}: {v:.1}")).unwrap_or_default();
        let ratio = row.ratio().map(|x| format!("{x:.2}×")).unwrap_or_default();
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} | {:.1}..{:.1} | {} | {} | {} | {} |",
            row.bench,
            row.case,
            row.value,
            row.spread.0,
            row.spread.1,
            row.unit,
            base,
            ratio,
            row.target.clone().unwrap_or_default()
        );
    }
    let _ = writeln!(s, "\n{notes}");
    s
}

/// Kernel release, CPU count and memory, for the report header.
pub fn machine() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_string();
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(|l| l.split_whitespace().nth(1).unwrap_or("0").parse::<u64>().unwrap_or(0)))
        .unwrap_or(0);
    format!("Linux {kernel}, {cpus} CPUs, {} GiB RAM", mem / 1024 / 1024)
}

/// Writes `text` to `path`, creating parent directories.
pub fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(path, text)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(bench: &str, case: &str, value: f64) -> Row {
        Row {
            bench: bench.into(),
            case: case.into(),
            value,
            spread: (value, value),
            unit: "ms".into(),
            baseline: None,
            target: None,
        }
    }

    #[test]
    fn a_run_replaces_its_families_and_keeps_the_others() {
        let old = OwnedReport {
            date: "d1".into(),
            machine: "m".into(),
            command: "cargo xtask bench a b".into(),
            runs: Default::default(),
            rows: vec![row("a", "x", 1.0), row("b", "y", 2.0), row("b", "z", 3.0)],
        };
        let new_rows = [row("b", "y", 20.0), row("c", "w", 5.0)];
        let new = Report {
            date: "d2".into(),
            machine: "m".into(),
            command: "cargo xtask bench b c".into(),
            runs: Default::default(),
            rows: &new_rows,
        };
        let m = old.merge(&new);
        let got: Vec<(&str, &str, f64)> = m.rows.iter().map(|r| (r.bench.as_str(), r.case.as_str(), r.value)).collect();
        assert_eq!(got, vec![("a", "x", 1.0), ("b", "y", 20.0), ("c", "w", 5.0)], "b's stale row z is gone");
        assert_eq!(m.runs["a"].date, "d1");
        assert_eq!(m.runs["b"].date, "d2");
        assert_eq!(m.runs["c"].command, "cargo xtask bench b c");
    }
}
