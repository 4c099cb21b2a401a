//! `gateway swap` rows (issue 12): a CubeEgress swap (slot A hands its listeners and state to
//! slot B) under HTTPS load from a sandbox through the real TPROXY path
//! (`cubenet_tests::egress_swap`): 16 keep-alive clients and 4 connection-per-request clients
//! for 6 s, the swap at 2 s. Reported, never asserted (the test `egress_gateway_swap_under_load`
//! asserts).

use std::time::Duration;

use cubenet_tests::egress_swap::{SwapRig, wait_exit};

use crate::report::Row;

fn row(case: &str, value: f64, unit: &str, target: &str) -> Row {
    Row {
        bench: "upgrade".into(),
        case: format!("gateway swap: {case}"),
        value,
        spread: (value, value),
        unit: unit.into(),
        baseline: None,
        target: Some(target.into()),
    }
}

/// Runs one swap under load and returns the three rows (`resets`, `failed connects` — TCP
/// connects or TLS handshakes — and `max gap`, the longest interval without a completed
/// request, in ms).
pub fn run() -> Vec<Row> {
    let rig = SwapRig::new();
    let mut a = rig.spawn_gateway(&[]);
    rig.configure();
    let _warm = rig.start_load(1, 0, Duration::from_millis(300)).join().expect("warm-up");
    let t0 = std::time::Instant::now();
    let load = rig.start_load(16, 4, Duration::from_secs(6));
    std::thread::sleep(Duration::from_secs(2));
    let swap_at = t0.elapsed();
    let sock = rig.handoff_socket();
    let mut b = rig.spawn_gateway(&["--takeover-socket", sock.to_str().expect("utf-8 path")]);
    let exited = wait_exit(&mut a, Duration::from_secs(30));
    let r = load.join().expect("load");
    eprintln!(
        "gateway swap: {} ok, {} reconnects asked, {} failed requests, old slot exit {:?}, max gap {:?} at {:?} \
         (successor started at {:?}); first errors: {:?}",
        r.ok, r.closes, r.failed_requests, exited, r.max_gap, r.max_gap_at, swap_at, r.errors
    );
    drop(b.child().kill());
    vec![
        row("resets", r.resets as f64, "count", "0"),
        row("failed connects", r.failed_connects as f64, "count", "0"),
        row("max gap", r.max_gap.as_secs_f64() * 1e3, "ms", "<= 1 ms"),
    ]
}
