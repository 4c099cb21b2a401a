//! Agent CPU per Ensure+fd and per Release (issue 15): the release agent with a warm pool of
//! 58 TAPs serves rounds of 50 concurrent Ensure+fd, then 50 concurrent Release; its CPU time
//! (`/proc/<pid>/stat` utime + stime, all threads) is read around each burst and divided by the
//! calls. Beside the agent named by `CUBENET_BASELINE_AGENT` (e.g. main's build), measured the
//! same way in the same run. The bursts' CPU includes what they set off in the agent while they
//! run (the pool refill a taken TAP kicks, the free check a Release kicks), as in production.
//! A third row divides the agent's CPU over the whole measured run (between the bursts too:
//! the pool's trim, the free checks, the benchmark's own polling) by the Ensure/Release pairs.
//! Then the same number of rounds of the floor (`agent::floor_latency`: an Ensure refused in
//! the gRPC handler and an fd request answered 1002, no work in the agent's core) on the same
//! agent, whose CPU and latency rows show what gRPC, the fd socket and 50 clients cost alone,
//! and a Release refused in the handler (gRPC alone), the Release rows' floor.
//! The profile behind docs/profile-ensure.md was taken with `perf record -a` over such a run.

use std::path::{Path, PathBuf};

use cubenet_tests::agent::AgentUnderTest;

use crate::{
    agent::{Floor, Latency, agent_pid, create_latency_cpu, floor_latency, pct},
    report::Row,
};

/// Concurrent clients per burst.
const CONC: usize = 50;

/// Runs `rounds` measured rounds on this build's agent and, when set, on
/// `CUBENET_BASELINE_AGENT`: in two halves per agent, alternating, each on a fresh agent after
/// one unmeasured warm-up round.
pub fn run(rounds: usize) -> Vec<Row> {
    let baseline_bin = std::env::var_os("CUBENET_BASELINE_AGENT").map(PathBuf::from);
    let measure = |bin: Option<&Path>, tag: &str, rounds: usize| -> (Latency, Floor) {
        let mut a = AgentUnderTest::prepare(tag, CONC + 8, "");
        a.agent_bin = bin.map(Path::to_path_buf);
        a.start();
        let pid = agent_pid(&mut a);
        create_latency_cpu(&a, CONC, 1, true, 0);
        let c0 = crate::agent::cpu_s(pid);
        let mut l = create_latency_cpu(&a, CONC, rounds, true, pid);
        // Everything the agent did over the measured rounds, between the bursts included (the
        // pool's trim, free checks, the benchmark's polling of the pool's state).
        l.run_cpu_s = crate::agent::cpu_s(pid) - c0;
        (l, floor_latency(&a, CONC, rounds, pid))
    };
    // Alternating halves (this build, the baseline, this build, the baseline), so a change of
    // the shared machine's load during the run weighs on both.
    let half = rounds.div_ceil(2);
    let mut ours = Latency::default();
    let mut base: Option<Latency> = None;
    let mut our_floor = Floor::default();
    let mut base_floor: Option<Floor> = None;
    for rep in 0..2 {
        let (l, f) = measure(None, &format!("bench-cpu-{rep}"), half);
        ours.add(l);
        our_floor.add(f);
        if let Some(b) = baseline_bin.as_deref() {
            let (l, f) = measure(Some(b), &format!("bench-cpu-base-{rep}"), half);
            base.get_or_insert_with(Latency::default).add(l);
            base_floor.get_or_insert_with(Floor::default).add(f);
        }
    }
    let per_call_us = |cpu_s: f64, n: usize| if n == 0 { 0.0 } else { cpu_s * 1e6 / n as f64 };
    let n = ours.ensure_ms.len();
    let mut rows = Vec::new();
    let base_label = |what: &str| format!("main agent {what}");
    let e_us = per_call_us(ours.ensure_cpu_s, n);
    let r_us = per_call_us(ours.release_cpu_s, ours.release_ms.len());
    rows.push(Row {
        bench: "agent-cpu".into(),
        case: format!("agent CPU per Ensure+fd, concurrency {CONC}, warm pool ({n} calls)"),
        value: e_us,
        spread: (e_us, e_us),
        unit: "µs".into(),
        baseline: base
            .as_ref()
            .map(|b| (base_label("CPU per Ensure+fd"), per_call_us(b.ensure_cpu_s, b.ensure_ms.len()))),
        target: None,
    });
    rows.push(Row {
        bench: "agent-cpu".into(),
        case: format!("agent CPU per Release, concurrency {CONC} ({} calls)", ours.release_ms.len()),
        value: r_us,
        spread: (r_us, r_us),
        unit: "µs".into(),
        baseline: base
            .as_ref()
            .map(|b| (base_label("CPU per Release"), per_call_us(b.release_cpu_s, b.release_ms.len()))),
        target: None,
    });
    let run_us = per_call_us(ours.run_cpu_s, n);
    rows.push(Row {
        bench: "agent-cpu".into(),
        case: format!("agent CPU per Ensure+fd and Release pair, whole run ({n} pairs)"),
        value: run_us,
        spread: (run_us, run_us),
        unit: "µs".into(),
        baseline: base
            .as_ref()
            .map(|b| (base_label("CPU per pair, whole run"), per_call_us(b.run_cpu_s, b.ensure_ms.len()))),
        target: None,
    });
    for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
        let v = pct(&mut ours.ensure_ms, q);
        rows.push(Row {
            bench: "agent-cpu".into(),
            case: format!("Ensure+fd {name}, concurrency {CONC}, warm pool"),
            value: v,
            spread: (pct(&mut ours.ensure_ms, 0.1), pct(&mut ours.ensure_ms, 0.9)),
            unit: "ms".into(),
            baseline: base.as_mut().map(|b| (base_label(&format!("Ensure+fd {name}")), pct(&mut b.ensure_ms, q))),
            target: None,
        });
    }
    let f_us = per_call_us(our_floor.cpu_s, our_floor.ms.len());
    rows.push(Row {
        bench: "agent-cpu".into(),
        case: format!(
            "agent CPU per floor call (Ensure refused in the handler + fd 1002), concurrency {CONC} ({} calls)",
            our_floor.ms.len()
        ),
        value: f_us,
        spread: (f_us, f_us),
        unit: "µs".into(),
        baseline: Some(("agent CPU per Ensure+fd, same agent".into(), e_us)),
        target: None,
    });
    for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
        let v = pct(&mut our_floor.ms, q);
        rows.push(Row {
            bench: "agent-cpu".into(),
            case: format!("gRPC + fd floor {name}, concurrency {CONC} (no work in the agent's core)"),
            value: v,
            spread: (pct(&mut our_floor.ms, 0.1), pct(&mut our_floor.ms, 0.9)),
            unit: "ms".into(),
            baseline: base_floor.as_mut().map(|b| (base_label(&format!("floor {name}")), pct(&mut b.ms, q))),
            target: None,
        });
    }
    for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
        let v = pct(&mut ours.release_ms, q);
        rows.push(Row {
            bench: "agent-cpu".into(),
            case: format!("Release {name}, concurrency {CONC}"),
            value: v,
            spread: (pct(&mut ours.release_ms, 0.1), pct(&mut ours.release_ms, 0.9)),
            unit: "ms".into(),
            baseline: base.as_mut().map(|b| (base_label(&format!("Release {name}")), pct(&mut b.release_ms, q))),
            target: None,
        });
    }
    for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
        let v = pct(&mut our_floor.release_ms, q);
        rows.push(Row {
            bench: "agent-cpu".into(),
            case: format!("gRPC floor {name}, concurrency {CONC} (Release refused in the handler)"),
            value: v,
            spread: (pct(&mut our_floor.release_ms, 0.1), pct(&mut our_floor.release_ms, 0.9)),
            unit: "ms".into(),
            baseline: Some((format!("Release {name}, same agents"), pct(&mut ours.release_ms, q))),
            target: None,
        });
    }
    rows
}
