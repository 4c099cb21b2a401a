//! Scale (issue 6 §5): reaper sweep time over 100k and 1M sessions (created by the datapath
//! itself through BPF_PROG_TEST_RUN), and an atomic policy replace of 1000 entries.

use std::{net::Ipv4Addr, time::Instant};

use cubenet_tests::{
    frames::{Tcp, tcp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    rig::{Rig, SB_IFINDEX},
};
use cubevs::{
    EgressPolicy, MapLimits, prog,
    reaper::{self, Timeouts},
};

use crate::report::{Row, stats};

fn fill(rig: &Rig, n: usize) {
    // Distinct 5-tuples: 10k guest ports per remote address (one SNAT IP has 35,536 ports per
    // remote address and port, drawn at random: at 28% use, 10 tries never run out).
    let done = rig.run_many(prog::FROM_CUBE, SB_IFINDEX, n, |i| {
        let r = (i / 10_000) as u32;
        let dst = Ipv4Addr::from(0x0b00_0000u32 + r).octets(); // 11.0.0.x: public, allowed
        tcp(
            GUEST_MAC,
            GATEWAY_MAC,
            GUEST_IP,
            dst,
            Tcp { sport: 1024 + (i % 10_000) as u16, dport: 443, seq: 1, syn: true, win: 1000, ..Default::default() },
            b"",
        )
    });
    assert_eq!(done.len(), n);
}

/// Runs the scale benchmark.
pub fn run() -> Vec<Row> {
    let mut rows = Vec::new();
    for n in [100_000usize, 1_000_000] {
        let rig = Rig::with_limits(MapLimits { sessions: 1 << 21, ..MapLimits::default() });
        let t = Instant::now();
        fill(&rig, n);
        let fill_s = t.elapsed().as_secs_f64();
        let (egress, ingress) = rig.maps.sessions.counts();
        assert!(egress >= n * 99 / 100 && egress == ingress, "filled {egress}/{ingress} of {n}");
        // Scan-only sweep: nothing expired (the common case every 5 s).
        let mut scan: Vec<f64> = (0..3)
            .map(|_| {
                reaper::sweep(&rig.maps.sessions, &Timeouts::default(), reaper::monotonic_ns())
                    .unwrap()
                    .took
                    .as_secs_f64()
                    * 1e3
            })
            .collect();
        let (scan_med, scan_spread) = stats(&mut scan);
        // Baseline: the same read done one key at a time (aya's get_next_key + lookup), which
        // is what the reaper did before batching.
        let t = Instant::now();
        let per_key = rig.maps.sessions.reverse_entries().unwrap().len();
        let per_key_ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(per_key, ingress);
        // Full sweep: everything expired, both directions deleted.
        let full = reaper::sweep(&rig.maps.sessions, &Timeouts::default(), u64::MAX / 2).unwrap();
        assert_eq!(rig.maps.sessions.counts(), (0, 0));
        rows.push(Row {
            bench: "scale".into(),
            case: format!("reaper sweep, {n} sessions, none expired"),
            value: scan_med,
            spread: scan_spread,
            unit: "ms".into(),
            baseline: Some((format!("per-key read (datapath filled in {fill_s:.1} s)"), per_key_ms)),
            target: None,
        });
        rows.push(Row {
            bench: "scale".into(),
            case: format!("reaper sweep, {n} sessions, all expired (2 deletes each)"),
            value: full.took.as_secs_f64() * 1e3,
            spread: (full.took.as_secs_f64() * 1e3, full.took.as_secs_f64() * 1e3),
            unit: "ms".into(),
            baseline: Some(("scan-only sweep".into(), scan_med)),
            target: None,
        });
    }
    let rig = Rig::new();
    let allow: Vec<String> = (0..1000u32).map(|i| Ipv4Addr::from(0x0b00_0000 + i * 256).to_string() + "/24").collect();
    let p = EgressPolicy { allow_out: allow, ..Default::default() };
    let mut v: Vec<f64> = (0..10)
        .map(|_| {
            let t = Instant::now();
            rig.maps.policy.replace(SB_IFINDEX, &p).unwrap();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let (med, spread) = stats(&mut v);
    let mut b: Vec<f64> = (0..10)
        .map(|_| {
            let t = Instant::now();
            rig.maps.policy.install_default_deny(SB_IFINDEX).unwrap();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    rows.push(Row {
        bench: "scale".into(),
        case: "policy replace, 1000 allow_out entries (+5 baseline)".into(),
        value: med,
        spread,
        unit: "ms".into(),
        baseline: Some(("replace with the 5 baseline entries only".into(), stats(&mut b).0)),
        target: None,
    });
    rows
}
