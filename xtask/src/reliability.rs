//! `cargo xtask reliability [--long] [--seed N] [--json PATH]`: runs every
//! `tests/tests/reliability_*.rs` (root), collects the `RELIABILITY {json}` line each case
//! prints, prints a table (case, inputs, violations, time) and writes the reports as JSON.
//! Short mode: 20,000 fuzz frames per program; long mode: 1,000,000.

use std::{path::PathBuf, process::Command, time::Instant};

use anyhow::{Context, Result, bail};

/// Fuzz frames per program in the short (CI) and long modes.
const SHORT_FRAMES: u64 = 20_000;
const LONG_FRAMES: u64 = 1_000_000;

/// Runs the suite; fails when a case reports a violation or a test fails.
pub fn run(root: PathBuf, long: bool, seed: Option<u64>, json: Option<PathBuf>) -> Result<()> {
    let mut tests: Vec<String> = std::fs::read_dir(root.join("tests/tests"))
        .context("list tests/tests")?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| {
            n.strip_prefix("reliability_").and_then(|s| s.strip_suffix(".rs")).map(|s| format!("reliability_{s}"))
        })
        .collect();
    tests.sort();
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&root).args(["test", "--quiet", "-p", "cubenet-tests"]);
    for t in &tests {
        cmd.args(["--test", t]);
    }
    cmd.args(["--", "--nocapture", "--test-threads", "2"]);
    cmd.env("CUBENET_FUZZ_FRAMES", (if long { LONG_FRAMES } else { SHORT_FRAMES }).to_string());
    cmd.env("CUBENET_RELIABILITY_LONG", if long { "1" } else { "0" });
    if let Some(s) = seed {
        cmd.env("CUBENET_FUZZ_SEED", s.to_string());
    }
    let start = Instant::now();
    let out = cmd.output().with_context(|| format!("spawn {cmd:?}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let reports: Vec<serde_json::Value> = stdout
        .lines()
        // The harness may print `test name ... ` or progress dots before a test's own line.
        .filter_map(|l| l.find("RELIABILITY {").map(|i| &l[i + "RELIABILITY ".len()..]))
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .context("parse RELIABILITY line")?;
    println!("{:<28} {:>10} {:>11} {:>9}  violations by invariant", "case", "inputs", "violations", "time");
    let mut total = 0;
    for r in &reports {
        let v: u64 = r["violations"].as_object().map_or(0, |m| m.values().filter_map(|x| x.as_u64()).sum());
        total += v;
        println!(
            "{:<28} {:>10} {:>11} {:>8.1}s  {}",
            r["case"].as_str().unwrap_or("?"),
            r["inputs"].as_u64().unwrap_or(0),
            v,
            r["secs"].as_f64().unwrap_or(0.0),
            r["violations"]
        );
    }
    println!("{} cases, {total} violations, wall time {:.1} s", reports.len(), start.elapsed().as_secs_f64());
    let path = json
        .unwrap_or_else(|| root.join("target").join(if long { "reliability-long.json" } else { "reliability.json" }));
    let doc = serde_json::json!({ "long": long, "seed": seed, "cases": reports });
    std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("write {}", path.display()))?;
    println!("JSON: {}", path.display());
    if !out.status.success() || total > 0 {
        eprintln!(
            "{}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .filter(|l| l.contains("SKIPPED") || l.contains("panicked") || l.contains("test result"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        bail!("reliability suite: {total} violations, tests {}", out.status);
    }
    Ok(())
}
