//! `gateway swap` rows (issue 12, family `gateway-swap` so that running it alone keeps the other
//! upgrade rows): a CubeEgress swap (slot A hands its listeners and state to
//! slot B) under HTTPS load from a sandbox through the real TPROXY path
//! (`cubenet_tests::egress_swap`): 16 keep-alive clients and 4 connection-per-request clients
//! for 6 s, the swap at 2 s. Baseline: the same load for the same time on the same gateway with
//! no swap, measured just before each swap in the same run; `--rounds` such pairs (median,
//! p10..p90). Reported, never asserted (the test `egress_gateway_swap_under_load` asserts).
//!
//! `CUBENET_BASELINE_EGRESS=<cube-egress binary>` (e.g. main's build) adds the rows of the same
//! pairs between gateways of that binary, each round of it just before the same round of this
//! build (idle hand-overs switch between the two), so a change to the swap is shown
//! before/after on the same machine load.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use cubenet_tests::egress_swap::{LoadReport, SwapRig, egress_bin, wait_exit};

use crate::report::Row;

/// Keep-alive and connection-per-request clients, load length and when the swap starts.
const KEEPALIVE: usize = 16;
const FRESH: usize = 4;
const LOAD: Duration = Duration::from_secs(6);
const SWAP_AT: Duration = Duration::from_secs(2);

fn row(label: &str, case: &str, value: f64, base: f64, unit: &str, target: Option<&str>) -> Row {
    Row {
        // Its own family (dated by its own run), shown with the upgrade rows' note.
        bench: "gateway-swap".into(),
        case: format!("{label}: {case}"),
        value,
        spread: (value, value),
        unit: unit.into(),
        baseline: Some(("same load, no operation".into(), base)),
        target: target.map(str::to_string),
    }
}

/// The gateway serving now: its process and the name of its log.
struct Slot {
    child: cubenet_tests::netns::ChildGuard,
    name: String,
}

/// One measured swap: the load report, when the successor was spawned, the predecessor's and
/// successor's log names.
struct Swapped {
    load: LoadReport,
    spawned: Instant,
    /// When the predecessor was seen gone (polled every 20 ms).
    gone: Instant,
    exited: Option<std::process::ExitStatus>,
    pred: String,
    succ: String,
}

/// Hands over from `cur` to a fresh gateway of `bin` (named `name`), under load when `load`
/// (swap [`SWAP_AT`] into a [`LOAD`]-long run), else idle.
fn swap(rig: &SwapRig, cur: &mut Slot, bin: &Path, name: &str, load: bool) -> Swapped {
    let running = load.then(|| rig.start_load(KEEPALIVE, FRESH, LOAD));
    if running.is_some() {
        std::thread::sleep(SWAP_AT);
    }
    let sock = rig.handoff_socket();
    let spawned = Instant::now();
    let next = rig.spawn_gateway_logged(bin, name, &["--takeover-socket", sock.to_str().expect("utf-8 path")]);
    let exited = wait_exit(&mut cur.child, Duration::from_secs(30));
    let gone = Instant::now();
    let report = running.map(|h| h.join().expect("load")).unwrap_or_default();
    let old = std::mem::replace(cur, Slot { child: next, name: name.to_string() });
    Swapped { load: report, spawned, gone, exited, pred: old.name, succ: name.to_string() }
}

/// The swap's timeline for the log: the gateways' own events, where the longest gap was and
/// what the clients did around it.
fn explain(rig: &SwapRig, label: &str, s: &Swapped, idle: &LoadReport) {
    let r = &s.load;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut lines = vec![format!("{:>9.1} ms  successor spawned", r.instant_ms(s.spawned))];
    for (who, name) in [("A", &s.pred), ("B", &s.succ)] {
        for (t, msg) in rig.gateway_events(name) {
            let at = r.offset_ms(t);
            if at > ms(SWAP_AT) - 100.0 {
                lines.push(format!("{at:>9.1} ms  {who}: {msg}"));
            }
        }
    }
    lines.sort_by(|a, b| {
        let v = |l: &str| l.split_whitespace().next().and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
        v(a).total_cmp(&v(b))
    });
    let (gap, at) = (r.max_gap, r.max_gap_at);
    let (wf, wt) = window(s);
    let (wgap, wat) = r.max_gap_in(wf, wt);
    let (from, to) = (at, at + gap);
    let near = |v: &[Duration]| v.iter().filter(|d| **d + Duration::from_millis(50) >= from && **d <= to).count();
    let connects: Vec<_> = r.connects.iter().filter(|(a, b)| *b >= from && *a <= to).collect();
    let slowest = r.connects.iter().map(|(a, b)| *b - *a).max().unwrap_or_default();
    let closes = (r.close_at.first().copied().unwrap_or_default(), r.close_at.last().copied().unwrap_or_default());
    let after = |l: &LoadReport| {
        let c = l.connects.iter().filter(|(a, _)| *a >= wf).count();
        (c, l.full_handshakes.iter().filter(|t| **t >= wf).count())
    };
    let ((rc, rf), (ic, if_)) = (after(r), after(idle));
    eprintln!(
        "{label}: connects from the successor's spawn on: {rc}, {rf} full TLS handshakes, each client's first \
         connect {:.2} ms (median; no-swap load, same offsets: {ic} connects, {if_} full, first connect {:.2} ms)",
        first_connect(r, wf),
        first_connect(idle, wf)
    );
    let log = std::fs::read_to_string(rig.dir.join(format!("{}.log", s.succ))).unwrap_or_default();
    for l in log.lines().filter(|l| {
        ["gateway state built", "state taken over", "startup phases"].iter().any(|m| l.contains(&format!("\"{m}\"")))
    }) {
        eprintln!("{label}: successor {l}");
    }
    eprintln!(
        "{label}: {} ok ({} reconnects asked, between {:.1} and {:.1} ms), {} failed requests, {} failed connects, \
         old slot exit {:?}; first errors: {:?}\n  timeline (ms from the load's start):\n  {}\n  \
         longest gap {:.1} ms from {:.1} ms: {} connects overlap it (slowest connect of the run {:.1} ms), \
         {} Connection: close answers within 50 ms before or in it; \
         swap window {:.1}..{:.1} ms: longest gap {:.1} ms from {:.1} ms (no-swap load, same window: {:.1} ms); \
         no-swap baseline: max gap {:.1} ms, p99 {:.2} ms, p99.9 {:.2} ms of the intervals between completions",
        r.ok,
        r.closes,
        ms(closes.0),
        ms(closes.1),
        r.failed_requests,
        r.failed_connects,
        s.exited,
        r.errors,
        lines.join("\n  "),
        ms(gap),
        ms(at),
        connects.len(),
        ms(slowest),
        near(&r.close_at),
        ms(wf),
        ms(wt),
        ms(wgap),
        ms(wat),
        ms(idle.max_gap_in(wf, wt).0),
        ms(idle.max_gap),
        ms(idle.gap_quantile(0.99)),
        ms(idle.gap_quantile(0.999)),
    );
}

/// The swap window, as offsets from the load's start: from the successor's spawn to the
/// predecessor's exit, cut at the load's end.
fn window(s: &Swapped) -> (Duration, Duration) {
    let at = |ms: f64| Duration::from_secs_f64(ms.max(0.0) / 1e3).min(LOAD);
    (at(s.load.instant_ms(s.spawned)), at(s.load.instant_ms(s.gone)))
}

/// Figures per round (see [`CASES`]).
const FIGURES: usize = 6;

/// The figures of one round: `resets`, `failed connects` (TCP connects or TLS handshakes),
/// `max gap` (the longest interval without a completed request while the load ran, ms),
/// `max gap, swap window` (the same from the successor's spawn to the predecessor's exit) and
/// `full handshakes after swap` (connects from the successor's spawn to the load's end whose
/// TLS handshake did not resume a session: each client has its own rustls default session
/// store),
/// and `first connect after swap` (the median over the clients of each one's first connect
/// from the successor's spawn on: TCP connect + TLS handshake + HTTP/1 handshake, ms, what a
/// client waits before its first request reaches the successor), each as (swap, the same figure of the no-swap load; for the window,
/// the handshakes and the connects: the same offsets of that load).
fn figures(s: &Swapped, idle: &LoadReport) -> [(f64, f64); FIGURES] {
    let (r, ms) = (&s.load, |d: Duration| d.as_secs_f64() * 1e3);
    let (from, to) = window(s);
    let full = |l: &LoadReport| l.full_handshakes.iter().filter(|t| **t >= from).count() as f64;
    [
        (r.resets as f64, idle.resets as f64),
        (r.failed_connects as f64, idle.failed_connects as f64),
        (ms(r.max_gap), ms(idle.max_gap)),
        (ms(r.max_gap_in(from, to).0), ms(idle.max_gap_in(from, to).0)),
        (full(r), full(idle)),
        (first_connect(r, from), first_connect(idle, from)),
    ]
}

/// The median over the clients of each one's first connect time (ms) that began at `from` or
/// later (0 when none did).
fn first_connect(l: &LoadReport, from: Duration) -> f64 {
    let mut v: Vec<f64> = l
        .worker_connects
        .iter()
        .filter_map(|w| w.iter().find(|(a, _)| *a >= from))
        .map(|(a, b)| (*b - *a).as_secs_f64() * 1e3)
        .collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Row cases of [`figures`], in order: (case, unit, target).
const CASES: [(&str, &str, Option<&str>); FIGURES] = [
    ("resets", "count", Some("0")),
    ("failed connects", "count", Some("0")),
    ("max gap", "ms", Some("<= 1 ms")),
    ("max gap, swap window", "ms", None),
    ("full handshakes after swap", "count", None),
    ("first connect after swap", "ms", None),
];

/// The rows of `label` from its rounds' figures: median and p10..p90 of the swaps beside the
/// median of the no-swap loads.
fn rows(label: &str, rounds: &[[(f64, f64); FIGURES]]) -> Vec<Row> {
    CASES
        .iter()
        .enumerate()
        .map(|(i, (case, unit, target))| {
            let mut v: Vec<f64> = rounds.iter().map(|r| r[i].0).collect();
            let mut b: Vec<f64> = rounds.iter().map(|r| r[i].1).collect();
            let (value, spread) = crate::report::stats(&mut v);
            let (base, _) = crate::report::stats(&mut b);
            Row { spread, ..row(label, case, value, base, unit, *target) }
        })
        .collect()
}

/// One round on `bin`: the no-swap load on the serving gateway, then a swap to a fresh gateway
/// of `bin` under the same load.
fn round(rig: &SwapRig, cur: &mut Slot, bin: &Path, label: &str, n: &mut u32) -> [(f64, f64); FIGURES] {
    let idle = rig.start_load(KEEPALIVE, FRESH, LOAD).join().expect("no-swap load");
    *n += 1;
    let s = swap(rig, cur, bin, &format!("g{n}"), true);
    explain(rig, label, &s, &idle);
    figures(&s, &idle)
}

/// Runs `rounds` rounds (no-swap load, then a swap under the same load) on this build, each
/// after the same round on `CUBENET_BASELINE_EGRESS` when set, and returns the rows.
pub fn run(rounds: usize) -> Vec<Row> {
    let before: Option<PathBuf> = std::env::var_os("CUBENET_BASELINE_EGRESS").map(PathBuf::from);
    let this = egress_bin();
    let rig = SwapRig::new();
    let first = before.clone().unwrap_or_else(|| this.clone());
    let mut cur = Slot { child: rig.spawn_gateway_logged(&first, "g0", &[]), name: "g0".into() };
    rig.configure();
    let warm = rig.start_load(1, 0, Duration::from_millis(300)).join().expect("warm-up");
    eprintln!("gateway swap: warm-up {} ok", warm.ok);
    let (mut old, mut new, mut n) = (Vec::new(), Vec::new(), 0u32);
    for _ in 0..rounds.max(1) {
        if let Some(b) = &before {
            // Idle hand-over to the baseline build (not measured), then its round.
            if cur.name != "g0" {
                n += 1;
                swap(&rig, &mut cur, b, &format!("g{n}"), false);
            }
            old.push(round(&rig, &mut cur, b, "gateway swap, baseline build", &mut n));
            n += 1;
            swap(&rig, &mut cur, &this, &format!("g{n}"), false);
        }
        new.push(round(&rig, &mut cur, &this, "gateway swap", &mut n));
    }
    // Rows of this build first: the table's `gateway swap` rows are this build's.
    let mut out = rows("gateway swap", &new);
    if !old.is_empty() {
        out.extend(rows("gateway swap, baseline build", &old));
    }
    drop(cur.child.child().kill());
    out
}
