//! `cubenet-bench`: CubeNet benchmarks, each figure beside its baseline measured in the same
//! run. Prints a table, writes JSON, refreshes `docs/benchmarks.md` (merged with the other
//! families' latest rows kept in `docs/benchmarks.json`). Never fails on time.
//! Run through `cargo xtask bench [NAME] [--json FILE]` (builds the eBPF object first). Root.

mod agent;
mod agent_cpu;
mod agent_sessions;
mod cpu;
mod dns;
mod fairness;
mod gateway_swap;
mod l7;
mod per_packet;
mod plot;
mod report;
mod scale;
mod soak;
mod throughput;
mod upgrade;
mod upgrade_agent;
mod xdp;

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(about = "CubeNet benchmarks")]
struct Cli {
    /// Benchmarks to run: per-packet, throughput (crr: its connect-request-close rows alone), scale, agent, agent-sessions, agent-scale, upgrade,
    /// agent-pool (the warm-up and restart rows of `agent` only), agent-rate (the sustained
    /// Ensure row of `agent` only), agent-cpu (agent CPU per Ensure+fd and per Release at
    /// concurrency 50, beside `CUBENET_BASELINE_AGENT`, and the gRPC + fd floor of the same
    /// agent), soak (`--minutes`)
    /// (default: the first five; agent-sessions fills 1,000,000 sessions into the agent's maps,
    /// `CUBENET_BENCH_SESSIONS=n` for fewer; agent-scale registers 8,192 sandboxes (every pooled TAP holds a slot of the 8,192-entry sandbox maps), then fills 1,000,000 sessions, and takes minutes;
    /// gateway-swap: the `gateway swap` rows of the upgrade table, CubeEgress slot swap under HTTPS load;
    /// upgrade: datapath switch/rollback, agent upgrade/restart and gateway swap under load;
    /// xdp: the XDP fast path beside the TC reverse path, ns/pkt and world → guest throughput;
    /// l7: HTTPS req/s and p99 through guest → CubeVS → CubeEgress → world beside guest → SNAT → world;
    /// fairness: one sandbox's TCP stream alone and beside another sandbox's 8, bare and capped uplink).
    names: Vec<String>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Refresh this Markdown report (e.g. docs/benchmarks.md).
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Re-render `--markdown` from a JSON file written by an earlier run, measuring nothing.
    #[arg(long)]
    render: Option<PathBuf>,
    /// Repetitions of each throughput measurement.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Length of the `soak` benchmark in minutes (fractions allowed).
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
}

const ALL: &[&str] = &["per-packet", "throughput", "scale", "agent", "agent-sessions"];
// Not in ALL: `xdp` (per-packet and throughput with the XDP fast path on and off).

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(json) = &cli.render {
        let r: report::OwnedReport = serde_json::from_str(&std::fs::read_to_string(json)?)?;
        let rep = report::Report { date: r.date, machine: r.machine, command: r.command, runs: r.runs, rows: &r.rows };
        let out = cli.markdown.clone().unwrap_or_else(|| PathBuf::from("docs/benchmarks.md"));
        report::write(&out, &report::markdown(&rep, &notes(&r.rows)))?;
        eprintln!("wrote {}", out.display());
        return Ok(());
    }
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
            "throughput" => rows.extend(throughput::run(cli.rounds, true)),
            // The connect-request-close rows of `throughput` alone (same case names).
            "crr" => rows.extend(throughput::run(cli.rounds, false)),
            "scale" => rows.extend(scale::run()),
            "agent" => rows.extend(agent::run()),
            "agent-pool" => rows.extend(agent::run_pool()),
            "agent-cpu" => rows.extend(agent_cpu::run(20)),
            "agent-scale" => rows.extend(agent::run_scale(8092, 100)),
            "agent-rate" => {
                let base = std::env::var_os("CUBENET_BASELINE_AGENT").map(std::path::PathBuf::from);
                rows.extend(agent::run_rate(1000, base.as_deref()))
            }
            "soak" => rows.extend(soak::run(cli.minutes)),
            "agent-sessions" => {
                // CUBENET_BENCH_SESSIONS overrides the 1,000,000 sessions (quick checks).
                let n = std::env::var("CUBENET_BENCH_SESSIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
                rows.extend(agent_sessions::run(100, n))
            }
            "upgrade" => rows.extend(upgrade::run(cli.rounds)),
            "gateway-swap" => rows.extend(gateway_swap::run(cli.rounds)),
            "xdp" => rows.extend(xdp::run(cli.rounds)),
            "dns" => rows.extend(dns::run()),
            "fairness" => rows.extend(fairness::run(cli.rounds)),
            "l7" => rows.extend(l7::run()),
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
    let rep = report::Report { date, machine: report::machine(), command, runs: Default::default(), rows: &rows };
    if let Some(p) = &cli.json {
        report::write(p, &serde_json::to_string_pretty(&rep)?)?;
        eprintln!("wrote {}", p.display());
    }
    if let Some(p) = &cli.markdown {
        // The Markdown shows every family: this run's rows merged into the accumulated
        // `<markdown>.json` (docs/benchmarks.json), which is rewritten with them.
        let store = p.with_extension("json");
        let merged = match std::fs::read_to_string(&store) {
            Ok(t) => serde_json::from_str::<report::OwnedReport>(&t)?.merge(&rep),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => report::OwnedReport {
                date: String::new(),
                machine: String::new(),
                command: String::new(),
                runs: Default::default(),
                rows: Vec::new(),
            }
            .merge(&rep),
            Err(e) => return Err(e.into()),
        };
        let all = report::Report {
            date: merged.date,
            machine: merged.machine,
            command: merged.command,
            runs: merged.runs,
            rows: &merged.rows,
        };
        report::write(&store, &serde_json::to_string_pretty(&all)?)?;
        report::write(p, &report::markdown(&all, &notes(&merged.rows)))?;
        eprintln!("wrote {} and {}", p.display(), store.display());
    }
    Ok(())
}

/// [`NOTES`] followed by a section generated from the rows: the new-flow cost
/// ([`per_packet::new_flow_note`]) and the connection-rate target
/// ([`throughput::crr_target_note`]); each empty until a run of its family recorded its rows.
fn notes(rows: &[report::Row]) -> String {
    let newflow = per_packet::new_flow_note(rows).unwrap_or_default();
    let crr = throughput::crr_target_note(rows).map(|n| n + "\n").unwrap_or_default();
    if newflow.is_empty() && crr.is_empty() {
        return NOTES.to_string();
    }
    format!("{NOTES}\n## New flows and connection rate (generated from the rows)\n\n{newflow}{crr}")
}

const NOTES: &str = "## Method\n\n\
- per-packet: BPF_PROG_TEST_RUN, repeat=1, 5 rounds × 2000 runs per case (rewriting paths cannot be repeated in place); \
the kernel's per-run time, which includes the test-run harness's own overhead — the `baseline_pass` row (an empty TC \
program on the same frame) is that floor. `from_cube` runs inside a node namespace whose FIB resolves the uplink next \
hop (permanent neighbour, forwarding on).\n\
- dns: BPF_PROG_TEST_RUN like per-packet; a learned response needs a fresh tracked query, so that case alternates \
a query and its response and times the response alone (its figure includes the tail call into `dns_response` and \
back into `from_world`); baselines are the same-size plain UDP paths in the same run.\n\
- throughput: iperf3 (4 s, 1 s omitted) and a connect-request-close loop (4 client threads, 3 s) from a veth guest to \
a world namespace, through (a) CubeVS, (b) a Linux bridge + iptables MASQUERADE + nf_conntrack, (c) plain routing. Each \
path in its own topology, all up for the whole run; 3 rounds, each measuring the paths in turn, in alternating order \
(V9). In the connection loop the server closes first and the client closes after reading the server's FIN, so \
TIME_WAIT stays on the world side (V9); a fourth topology, `CubeVS, client closes first (before V9)`, runs the loop as \
it was before (the client closes once it has the reply) beside CubeVS in the same rounds. Around each loop the \
bench prints the packets per connection every device of the setup saw (`ip -s link`, V10); \
`CUBENET_BENCH_PERF_DIR=dir` records a `perf record -a -g` profile of exactly each loop (events enabled through \
perf's control FIFOs). `cargo xtask bench crr` runs the loops alone.\n\
- scale: sessions created by the datapath itself (BPF_PROG_TEST_RUN SYNs), then swept by the userspace reaper.\n\
- agent: the release network-agent started by scripts/start-network-agent.sh in its own namespace, dataplane in \
a harness node namespace; EnsureNetwork over gRPC (tonic client) + the TAP fd over the fd socket, timed together; \
warm pool = tap_init_num above the concurrency (each round starts once the pool is back to that many Ready TAPs), \
empty pool = tap_init_num 0 (every Ensure creates its TAP). Release rows stand beside the agent binary named by \
`CUBENET_BASELINE_AGENT` (here: main's build before decision F5) measured in the same run; so does the sustained \
rate (each agent twice, in the order this build, baseline, baseline, this build: the later position was faster \
whichever binary held it; 50 clients, each taking the next of 1,000 sandbox ids until none is left, on a warm pool of 1,008 TAPs all on \
their tcx link). 500 TAPs Ready: the default (F5: tc filter first) beside `tc_attach = \"tcx\"`, plus the time until \
the default has moved every TAP to its tcx link (`cubenet_tap_warmup_filters` = 0). Warm-up steps: the agent's \
`cubenet_tap_create_phase_seconds` after 500 creations, µs per TAP per worker (4 workers: the steps wait on each other \
in the kernel, so the sum is ~4× the wall time per TAP). Restart: 500 sandboxes ensured (tap_init_num 0), the agent \
SIGKILLed and started again, timed to /readyz with all 500 adopted Active. The machine is shared with other builds \
(load average 12–15 on 2 cores during earlier runs, 50–80 during the latest `agent` and `agent-scale` runs): \
repeated runs differ by ±30 % and more.\n\
- agent-cpu: the agent's own CPU time (`/proc/<pid>/stat` utime + stime, every thread, exited ones included, \
10 ms ticks) read around each burst of 50 concurrent Ensure+fd and of 50 concurrent Release on a warm pool of 58 \
TAPs, divided by the calls; it includes what the burst sets off in the agent meanwhile (pool refill, free checks). \
20 rounds per agent in two alternating halves (this build, `CUBENET_BASELINE_AGENT`, this build, baseline), each \
half on a fresh agent after one unmeasured round. The whole-run row divides the agent's CPU from the first to \
the last measured round (trim, free checks and this benchmark's polling of `/v1/network/taps` between the bursts \
included) by the pairs. Profile: docs/profile-ensure.md. The latency rows of this family come from the same rounds. \
The floor rows (F21, also in `agent` at concurrency 50): after the rounds, the same number of rounds of 50 clients \
shaped the same way whose calls do no work in the agent's core (EnsureNetwork with an `sctp` port mapping, refused \
with INVALID_ARGUMENT by the gRPC handler, then an fd request for a TAP the sandbox does not hold, errCode 1002), on \
the same agent: what gRPC, the fd socket and 50 clients cost on this machine alone. Then each of those clients, at \
once, a ReleaseNetwork whose `network_handle` is not its `sandbox_id` (INVALID_ARGUMENT in the handler): the Release \
rows' floor, gRPC alone. `agent-rate` adds the sustained rate's floor: the same 50 clients on this build's agents, \
each Ensure refused in the handler, and the agent's CPU per Ensure over each sustained run (utime + stime, beside \
the baseline's; F23).\n\
- agent-sessions: the same agent with 100 sandboxes; 50 are released with empty session maps (baseline), then \
1,000,000 ESTABLISHED sessions spread over the other 50 are written into the agent's pinned maps with \
BPF_MAP_UPDATE_BATCH, RSS is read after two reaper passes, and the 50 are released one at a time over gRPC.\n\
- xdp (`cargo xtask bench xdp`): BPF_PROG_TEST_RUN of `xdp_world` vs `from_world` on the same frames beside both \
empty programs; then iperf3 -R (world sends) to a veth guest through the throughput topology with XDP off / generic / \
native, the world side's TX checksum offload off (wire-like frames, which XDP needs: decision X3), plus one TC-path \
row with the veth offloads on (GSO super-frames: what the guest loses with XDP). UDP 64 B pkt/s is bounded by the one \
iperf3 sender. On this shared 2-core machine the throughput rows swing by 2x between runs (an earlier run had XDP \
generic 1.21x and native 1.53x of the TC path); the ns/pkt rows are stable. XDP stays off by default (X5).\n\
- egress (`cargo xtask bench egress`, not in this table): cube-egress vs mitmproxy with the same client, upstream \
and CA; it prints its own table (see the CubeEgress section of the README).\n\
- upgrade: `datapath switch` / `datapath rollback` (tcx link program replacement) while a veth guest runs a long TCP \
stream, ~1,000 new connections/s (connect, 1-byte echo, close) and a 1 ms ping to a world namespace; resets = \
ECONNRESET/EPIPE seen by guest or world, max gap = longest interval without a ping reply or stream bytes within \
+-0.5 s of the operation (the 1 ms ping interval is the floor). Baseline: the same figures over an equally long \
window of the same load just before the operation, with no operation. `agent upgrade` (a live hand-over to a copy \
of the release agent binary, until the old agent exited) and `agent restart` (kill -9 + restart until /readyz) run \
the same load from a kernel guest whose frames a relay thread carries to and from the TAP fd the agent handed out \
(the guest's namespace plays the microVM, the relay the VMM), so the relay's hop is in both windows. \
`gateway swap`: CubeEgress slot A hands its listeners and state to slot B (E18, E21) while 16 keep-alive and 4 \
connection-per-request HTTPS clients run from a sandbox namespace through the TPROXY path for 6 s, the swap at 2 s; \
resets / failed connects as seen by the clients, max gap = longest interval without a completed request while the \
load runs (answers after its end, when the clients have stopped sending, do not count), `swap window` = the same from \
B's spawn to A's exit. Baseline: the same load for 6 s on the same gateway with no swap, just before it (the swap \
window row: the same offsets of that load); 3 such pairs (`--rounds`), median of each. `gateway swap, baseline build`: \
the same pairs between gateways of `CUBENET_BASELINE_EGRESS` (here: main's build before E21), each round just before \
the same round of this build in the same run.\n";
