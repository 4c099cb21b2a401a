//! `cubenet-bench`: CubeNet benchmarks, each figure beside its baseline measured in the same
//! run. Prints a table, writes JSON, refreshes `docs/benchmarks.md`. Never fails on time.
//! Run through `cargo xtask bench [NAME] [--json FILE]` (builds the eBPF object first). Root.

mod agent;
mod per_packet;
mod report;
mod scale;
mod throughput;

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(about = "CubeNet benchmarks")]
struct Cli {
    /// Benchmarks to run: per-packet, throughput, scale, agent, agent-scale (default: the first
    /// four; agent-scale registers 8,000 sandboxes — every pooled TAP holds a slot of the 8,192-entry sandbox maps — and takes minutes).
    names: Vec<String>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Refresh this Markdown report (e.g. docs/benchmarks.md).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Repetitions of each throughput measurement.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

const ALL: &[&str] = &["per-packet", "throughput", "scale", "agent"];

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!("benchmarks create network namespaces and load eBPF: run as root");
    }
    let names: Vec<String> =
        if cli.names.is_empty() { ALL.iter().map(|s| s.to_string()).collect() } else { cli.names.clone() };
    let mut rows = Vec::new();
    for n in &names {
        eprintln!("== {n}");
        match n.as_str() {
            "per-packet" => rows.extend(per_packet::run()),
            "throughput" => rows.extend(throughput::run(cli.rounds)),
            "scale" => rows.extend(scale::run()),
            "agent" => rows.extend(agent::run()),
            "agent-scale" => rows.extend(agent::run_scale(8000, 100)),
            other => anyhow::bail!("unknown benchmark {other:?} (known: {})", ALL.join(", ")),
        }
    }
    report::print_table(&rows);
    let command = format!("cargo xtask bench {}", names.join(" "));
    let date = String::from_utf8_lossy(
        &std::process::Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]).output()?.stdout,
    )
    .trim()
    .to_string();
    let rep = report::Report { date, machine: report::machine(), command, rows: &rows };
    if let Some(p) = &cli.json {
        report::write(p, &serde_json::to_string_pretty(&rep)?)?;
        eprintln!("wrote {}", p.display());
    }
    if let Some(p) = &cli.markdown {
        report::write(p, &report::markdown(&rep, NOTES))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

const NOTES: &str = "## Method\n\n\
- per-packet: BPF_PROG_TEST_RUN, repeat=1, 5 rounds × 2000 runs per case (rewriting paths cannot be repeated in place); \
the kernel's per-run time, which includes the test-run harness's own overhead — the `baseline_pass` row (an empty TC \
program on the same frame) is that floor. `from_cube` runs inside a node namespace whose FIB resolves the uplink next \
hop (permanent neighbour, forwarding on).\n\
- throughput: iperf3 (4 s, 1 s omitted) and a connect-request-close loop (4 client threads, 3 s) from a veth guest to \
a world namespace, through (a) CubeVS, (b) a Linux bridge + iptables MASQUERADE + nf_conntrack, (c) plain routing. Each \
path in a fresh topology, 3 rounds.\n\
- scale: sessions created by the datapath itself (BPF_PROG_TEST_RUN SYNs), then swept by the userspace reaper.\n\
- agent: the release network-agent started by scripts/start-network-agent.sh in its own namespace, dataplane in \
a harness node namespace; EnsureNetwork over gRPC (tonic client) + the TAP fd over the fd socket, timed together; \
warm pool = tap_init_num above the concurrency, empty pool = tap_init_num 0 (every Ensure creates its TAP).\n";
