//! `cargo xtask bench xdp` (issue 15, XDP fast path): the reverse path with `xdp_world`
//! beside `from_world` in one run.
//!
//! - ns/pkt (BPF_PROG_TEST_RUN, repeat=1, 5 × 2000 runs): a TCP reply of an established SNAT
//!   session and a host-port SYN, through `from_world` (TC) and `xdp_world` (XDP), beside each
//!   hook's empty program (`baseline_pass`, `baseline_xdp_pass`).
//! - world → guest through the veth uplink of the throughput topology, XDP off (TC path only)
//!   vs generic vs native, same run: iperf3 -R TCP (1 stream; what the guest loses with the
//!   offloads XDP cannot keep) and UDP 64-byte datagrams (packets/s received by the guest).
//!   The world side sends with TX checksum offload off (wire-like frames, decision X3) in
//!   every case but one extra TC-path row with the veth's offloads on (GSO super-frames: what
//!   the guest loses with XDP); the guest's eth0 has GRO on (a veth needs it to receive XDP
//!   redirects natively). The UDP rate is bounded by the single iperf3 sender.

use std::{thread, time::Duration};

use cubenet_tests::{
    frames::{Tcp, tcp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    rig::{Rig, SB_IFINDEX},
    topology::{NODE_IP, NODE_UPLINK, WORLD_IF, WORLD_IP},
};
use cubevs::{PortMapping, Proto, XdpMode, prog};
use cubevs_common::counter;

use crate::{
    report::{Row, stats},
    throughput::{self, Path, Setup},
};

const RUNS: usize = 2000;
const ROUNDS: usize = 5;

fn row(case: String, (value, spread): (f64, (f64, f64)), unit: &str, baseline: Option<(String, f64)>) -> Row {
    Row { bench: "xdp".into(), case, value, spread, unit: unit.into(), baseline, target: None }
}

fn per_packet() -> Vec<Row> {
    let rig = Rig::new();
    let up = rig.uplink_ifindex;
    let (wm, um) = (rig.world_mac, rig.up_mac);
    rig.cube(tcp(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP,
        WORLD_IP,
        Tcp { sport: 40000, dport: 80, seq: 1, syn: true, win: 1000, ..Default::default() },
        b"",
    ));
    let port = rig.maps.sessions.list().unwrap()[0].snat_port;
    rig.maps
        .ports
        .add(&PortMapping { proto: Proto::Tcp, host_port: 20080, ifindex: SB_IFINDEX, guest_port: 8080 })
        .unwrap();
    // The SYN-ACK moves the session to SYN_RECV; the measured replies are then plain ACKs.
    rig.world(tcp(
        wm,
        um,
        WORLD_IP,
        NODE_IP,
        Tcp { sport: 80, dport: port, seq: 500, ack: Some(2), syn: true, win: 1000, ..Default::default() },
        b"",
    ));
    let reply = move |_| {
        tcp(
            wm,
            um,
            WORLD_IP,
            NODE_IP,
            Tcp { sport: 80, dport: port, seq: 501, ack: Some(2), win: 1000, ..Default::default() },
            b"",
        )
    };
    let hostport = move |i: usize| {
        let t =
            Tcp { sport: 1024 + (i % 50000) as u16, dport: 20080, seq: 1, syn: true, win: 500, ..Default::default() };
        tcp(wm, um, [203, 0, 113, 9], NODE_IP, t, b"")
    };
    let tc = |program: &'static str, f: &(dyn Fn(usize) -> Vec<u8> + Sync)| {
        let mut all = Vec::new();
        for round in 0..ROUNDS {
            let frames: Vec<Vec<u8>> = (0..RUNS).map(|i| f(round * RUNS + i)).collect();
            all.extend(rig.run_many(program, up, RUNS, move |i| frames[i].clone()).into_iter().map(|x| x as f64));
        }
        stats(&mut all)
    };
    let xdp = |program: &'static str, f: &(dyn Fn(usize) -> Vec<u8> + Sync)| {
        let mut all = Vec::new();
        for round in 0..ROUNDS {
            let frames: Vec<Vec<u8>> = (0..RUNS).map(|i| f(round * RUNS + i)).collect();
            all.extend(rig.xdp_many(program, up, RUNS, move |i| frames[i].clone()).into_iter().map(|x| x as f64));
        }
        stats(&mut all)
    };
    let tc_floor = tc(prog::BASELINE_PASS, &reply);
    let xdp_floor = xdp(prog::BASELINE_XDP_PASS, &reply);
    let before = rig.maps.counters.get(counter::XDP_REDIRECT).unwrap();
    let tc_reply = tc(prog::FROM_WORLD, &reply);
    let xdp_reply = xdp(prog::XDP_WORLD, &reply);
    let tc_hp = tc(prog::FROM_WORLD, &hostport);
    let xdp_hp = xdp(prog::XDP_WORLD, &hostport);
    let redirected = rig.maps.counters.get(counter::XDP_REDIRECT).unwrap() - before;
    assert_eq!(redirected, (2 * ROUNDS * RUNS) as u64, "every measured xdp_world run must redirect");
    let ns = "ns/pkt";
    vec![
        row("empty TC program (baseline_pass)".into(), tc_floor, ns, None),
        row(
            "empty XDP program (baseline_xdp_pass)".into(),
            xdp_floor,
            ns,
            Some(("empty TC program".into(), tc_floor.0)),
        ),
        row(
            "from_world (TC): established TCP reply".into(),
            tc_reply,
            ns,
            Some(("empty TC program".into(), tc_floor.0)),
        ),
        row("xdp_world: established TCP reply".into(), xdp_reply, ns, Some(("from_world (TC)".into(), tc_reply.0))),
        row("from_world (TC): host-port SYN".into(), tc_hp, ns, Some(("empty TC program".into(), tc_floor.0))),
        row("xdp_world: host-port SYN".into(), xdp_hp, ns, Some(("from_world (TC)".into(), tc_hp.0))),
    ]
}

fn setup(mode: XdpMode, world_tx_offload: bool) -> Setup {
    let mut s = throughput::setup(Path::Cubevs);
    if !world_tx_offload {
        let out = s.topo.world.exec("ethtool", &["-K", WORLD_IF, "tx", "off"]);
        assert!(out.status.success(), "ethtool: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = s.guest().exec("ethtool", &["-K", "eth0", "gro", "on"]);
    assert!(out.status.success(), "ethtool: {}", String::from_utf8_lossy(&out.stderr));
    let mut dp = s._dp.take().expect("cubevs setup");
    let dp = s.topo.node.run(move || {
        dp.attach_uplink_xdp(NODE_UPLINK, mode).expect("attach xdp");
        dp
    });
    s._dp = Some(dp);
    s
}

/// iperf3 world → guest (`-R`): TCP Gbit/s, or UDP 64-byte datagrams received per second.
fn iperf_reverse(s: &Setup, udp: bool, secs: u32) -> f64 {
    let mut server = s.topo.world.spawn("iperf3", &["-s", "-1", "-B", "198.51.100.1", "-p", "5202"]);
    thread::sleep(Duration::from_millis(300));
    let t = secs.to_string();
    let mut args = vec!["-c", "198.51.100.1", "-p", "5202", "-R", "-t", &t, "-O", "1", "-J"];
    if udp {
        args.extend(["-u", "-b", "0", "-l", "64"]);
    }
    let out = s.guest().exec("iperf3", &args);
    let _ = server.child().wait();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("iperf3 output: {e}: {}", String::from_utf8_lossy(&out.stdout)));
    if udp {
        let sum = &json["end"]["sum"];
        let (p, lost, sec) = (sum["packets"].as_f64(), sum["lost_packets"].as_f64(), sum["seconds"].as_f64());
        match (p, lost, sec) {
            (Some(p), Some(l), Some(t)) if t > 0.0 => (p - l) / t,
            _ => panic!("iperf3 UDP result: {json}"),
        }
    } else {
        json["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or_else(|| panic!("iperf3 result: {json}")) / 1e9
    }
}

fn throughput(rounds: usize) -> Vec<Row> {
    // (mode, world TX checksum offload): the first row is the TC path as the throughput
    // benchmark runs it (veth offloads on: GSO super-frames, CHECKSUM_PARTIAL), which XDP
    // cannot take (decision X3); the others are wire-like frames.
    let modes = [(XdpMode::Off, true), (XdpMode::Off, false), (XdpMode::Generic, false), (XdpMode::Native, false)];
    let mut res = Vec::new();
    for &(m, offload) in &modes {
        let s = setup(m, offload);
        let (mut tcp, mut pps) = (Vec::new(), Vec::new());
        let c0 = s._dp.as_ref().unwrap().maps().counters.get(counter::XDP_REDIRECT).unwrap();
        for _ in 0..rounds {
            tcp.push(iperf_reverse(&s, false, 4));
            pps.push(iperf_reverse(&s, true, 4));
        }
        let c = s._dp.as_ref().unwrap().maps().counters.get(counter::XDP_REDIRECT).unwrap() - c0;
        eprintln!("  xdp_mode {m} (world tx offload {offload}): {c} frames redirected by xdp_world");
        res.push((m, offload, stats(&mut tcp), stats(&mut pps)));
    }
    let label = |m: XdpMode, offload: bool| match (m, offload) {
        (XdpMode::Off, true) => "XDP off, world TX offload on".to_string(),
        (XdpMode::Off, false) => "XDP off (TC path)".to_string(),
        (m, _) => format!("XDP {m}"),
    };
    let mut rows = Vec::new();
    for (i, (m, offload, t, p)) in res.iter().enumerate() {
        // Each XDP row beside the TC path on the same frames and, for TCP, a second row beside
        // the TC path with offloads (what the guest loses).
        let base = |j: usize, v: f64| if i <= 1 && j == 1 { None } else { Some((label(res[j].0, res[j].1), v)) };
        rows.push(row(
            format!("world → guest TCP 1 stream, {}", label(*m, *offload)),
            *t,
            "Gbit/s",
            base(1, res[1].2.0),
        ));
        if *m != XdpMode::Off {
            rows.push(row(
                format!("world → guest TCP 1 stream, {} vs offloads", label(*m, *offload)),
                *t,
                "Gbit/s",
                base(0, res[0].2.0),
            ));
        }
        rows.push(row(format!("world → guest UDP 64 B, {}", label(*m, *offload)), *p, "pkt/s", base(1, res[1].3.0)));
    }
    rows
}

/// Runs the XDP benchmark: per-packet cost, then `rounds` of each throughput measurement.
pub fn run(rounds: usize) -> Vec<Row> {
    let mut rows = per_packet();
    rows.extend(throughput(rounds));
    rows
}
