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
    let _ = writeln!(s, "{}", targets(r.rows, CAUSES));
    s
}

/// What a target text asks: `<= X unit`, `>= X unit`, `>= Nx <baseline>` (ratio to the row's
/// baseline) or a bare number (at most that count).
#[derive(Debug, PartialEq)]
enum Goal {
    AtMost(f64, String),
    AtLeast(f64, String),
    RatioAtLeast(f64),
}

fn parse_goal(t: &str) -> Option<Goal> {
    let t = t.trim();
    let num = |s: &str| s.replace(',', "").parse::<f64>().ok();
    if let Some(n) = num(t) {
        return Some(Goal::AtMost(n, String::new()));
    }
    let (op, rest) = if let Some(r) = t.strip_prefix("<=") {
        ("<=", r.trim())
    } else if let Some(r) = t.strip_prefix(">=") {
        (">=", r.trim())
    } else {
        return None;
    };
    let (n, unit) = rest.split_once(' ').unwrap_or((rest, ""));
    if let Some(x) = n.strip_suffix('x').and_then(num)
        && op == ">="
    {
        return Some(Goal::RatioAtLeast(x));
    }
    let n = num(n)?;
    Some(if op == "<=" { Goal::AtMost(n, unit.to_string()) } else { Goal::AtLeast(n, unit.to_string()) })
}

/// `value` (in `unit`) in the target's unit: MiB for MB targets, else unchanged.
fn in_unit(value: f64, unit: &str, target_unit: &str) -> f64 {
    match (unit, target_unit) {
        ("MiB", "MB") => value * 1.048_576,
        _ => value,
    }
}

/// Whether `row` meets its target (`None`: no target, or one this code cannot read).
fn met(row: &Row) -> Option<bool> {
    Some(match parse_goal(row.target.as_deref()?)? {
        Goal::AtMost(n, u) => in_unit(row.value, &row.unit, &u) <= n,
        Goal::AtLeast(n, u) => in_unit(row.value, &row.unit, &u) >= n,
        Goal::RatioAtLeast(x) => row.ratio()? >= x,
    })
}

/// Known causes of misses, by case prefix: shown under a missed target (kept with the code
/// whose figures they explain, so a run that meets the target drops them).
pub const CAUSES: &[(&str, &str)] = &[
    (
        "from_cube established",
        "about 240 ns is `bpf_fib_lookup` (the next hop must come from the kernel FIB, never a configured gateway \
MAC), the rest is two hash lookups (sandbox metadata, session), array lookups and two `bpf_l4_csum_replace` calls; \
the test-run floor itself is the `baseline_pass` row",
    ),
    (
        "Ensure+fd p99, concurrency 50",
        "one Ensure+fd takes ~0.8 ms end to end alone; 50 arriving at once on 2 shared cores (client, gRPC, state \
file, maps, fd handoff, and the pool refill the taken TAPs kick) queue behind each other: the agent's own CPU per \
Ensure+fd is in the `agent-cpu` rows, its breakdown in docs/profile-ensure.md",
    ),
    (
        "Ensure sustained rate",
        "the 2 cores are shared by the 50 clients, gRPC, the state file, the map writes and the pool refill (each \
taken TAP is replaced by a new one: a tcx attach waits for an RCU grace period under RTNL)",
    ),
    (
        "Release p99, concurrency 50",
        "the scrub of each Release (unregister, baseline policy, state file) plus the free check it kicks run on the \
same 2 shared cores as the 50 clients; see the `agent-cpu` rows",
    ),
    (
        "500 TAPs Ready",
        "a tcx attach waits for an RCU grace period under RTNL (~16 ms per TAP, serialised node-wide; F4)",
    ),
    (
        "CubeVS: TCP",
        "single-stream TCP is near the veth ceiling (plain routing) on both paths, so the headroom over \
bridge+iptables is small",
    ),
    (
        "datapath switch: max gap",
        "the 1 ms ping interval is the floor of this figure; compare with the no-operation baseline of the same row",
    ),
    (
        "datapath rollback: max gap",
        "the 1 ms ping interval is the floor of this figure; compare with the no-operation baseline of the same row",
    ),
    ("agent upgrade: max gap", "the 1 ms ping interval is the floor; the relay thread's hop is in both windows"),
    ("agent restart: max gap", "the 1 ms ping interval is the floor; the relay thread's hop is in both windows"),
    (
        "gateway swap: max gap",
        "on this shared 2-core machine the load stalls for tens of ms now and then with or without a swap (the \
no-swap loads' max gaps vary that much between rounds); the run's log places each round's longest gap, and the \
swap window row is the swap's own figure",
    ),
    (
        "gateway swap, baseline build: max gap",
        "on this shared 2-core machine the load stalls for tens of ms now and then with or without a swap; the swap \
window row is the swap's own figure",
    ),
];

/// The "Targets and misses" section: one line per row with a target, met or missed from its
/// measured value (and its baseline for ratio targets), with the known cause of a miss.
pub fn targets(rows: &[Row], causes: &[(&str, &str)]) -> String {
    let mut s = String::from("## Targets and misses (generated from the rows above)\n\n");
    for r in rows.iter().filter(|r| r.target.is_some()) {
        let t = r.target.as_deref().unwrap_or_default();
        let base = r.baseline.as_ref().map(|(l, v)| format!(" ({l}: {v:.1})")).unwrap_or_default();
        let verdict = match met(r) {
            Some(true) => "met".to_string(),
            Some(false) => "**missed**".to_string(),
            None => "not evaluated (unreadable target)".to_string(),
        };
        let _ =
            write!(s, "- {} · {}: target {t}, measured {:.1} {}{base}: {verdict}", r.bench, r.case, r.value, r.unit);
        if met(r) == Some(false)
            && let Some((_, cause)) = causes.iter().find(|(p, _)| r.case.starts_with(p))
        {
            let _ = write!(s, ". Cause: {cause}");
        }
        let _ = writeln!(s, ".");
    }
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
    fn targets_are_judged_from_the_rows() {
        let mut ms = row("agent", "Ensure+fd p99, concurrency 50, warm pool", 3.0);
        ms.target = Some("<= 2 ms".into());
        let mut rate = row("agent", "Ensure sustained rate, 50 clients", 5100.0);
        rate.unit = "Ensure/s".into();
        rate.target = Some(">= 5,000 Ensure/s".into());
        let mut rss = row("agent", "agent RSS", 48.0);
        rss.unit = "MiB".into();
        rss.target = Some("<= 50 MB".into());
        let mut tp = row("throughput", "CubeVS: TCP 1 stream", 12.0);
        tp.baseline = Some(("bridge+iptables".into(), 11.0));
        tp.target = Some(">= 1.2x bridge+iptables".into());
        let mut zero = row("upgrade", "resets", 1.0);
        zero.target = Some("0".into());
        assert_eq!(met(&ms), Some(false));
        assert_eq!(met(&rate), Some(true));
        assert_eq!(met(&rss), Some(false), "48 MiB is 50.3 MB");
        assert_eq!(met(&tp), Some(false), "1.09x < 1.2x");
        assert_eq!(met(&zero), Some(false));
        let text = targets(&[ms, rate, row("agent", "no target", 1.0)], &[("Ensure+fd p99", "queueing")]);
        assert!(text.contains("Ensure+fd p99, concurrency 50, warm pool: target <= 2 ms, measured 3.0 ms: **missed**. Cause: queueing."), "{text}");
        assert!(text.contains("measured 5100.0 Ensure/s: met."), "{text}");
        assert!(!text.contains("no target"), "{text}");
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
