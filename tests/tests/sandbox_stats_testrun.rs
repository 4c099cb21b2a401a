//! Per-sandbox counters under `BPF_PROG_TEST_RUN` with exact bytes: what each program charges
//! to the `sandbox_stats` entry of the rig's sandbox (out, in, drops by reason), that nothing
//! is charged to an interface without an entry (no entry is ever created by a program), and
//! that a reset zeroes every CPU's share. The end-to-end view (agent, CLI, `/metrics`, a
//! reused TAP) is `sandbox_counters.rs`.

use cubenet_tests::{
    frames::{Tcp, tcp, udp},
    packet::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{SandboxCounters, prog};

const TC_ACT_SHOT: u32 = 2;

fn stats(rig: &Rig) -> SandboxCounters {
    rig.maps.sandbox_stats.get(SB_IFINDEX).unwrap().expect("the rig sandbox has an entry")
}

#[test]
fn programs_charge_exact_bytes_and_reasons_to_the_sandbox() {
    if !require_root("programs_charge_exact_bytes_and_reasons_to_the_sandbox") {
        return;
    }
    let rig = Rig::new();
    assert_eq!(stats(&rig).out_packets + stats(&rig).dropped(), 0);

    // Out: a new UDP flow to world, forwarded (SNAT + FIB redirect).
    let q = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, b"query");
    let v = rig.cube(q.clone());
    assert_ne!(v.verdict, TC_ACT_SHOT);
    let s = stats(&rig);
    assert_eq!((s.out_packets, s.out_bytes), (1, q.len() as u64), "{s:?}");

    // In: the world's answer to that flow, reverse-NATed to the sandbox.
    let snat_port = rig.maps.sessions.list().unwrap().iter().find(|s| s.proto == "udp").unwrap().snat_port;
    let a = udp(rig.world_mac, rig.up_mac, WORLD_IP, NODE_IP, 53, snat_port, b"answer!");
    assert_ne!(rig.world(a.clone()).verdict, TC_ACT_SHOT);
    let s = stats(&rig);
    assert_eq!((s.in_packets, s.in_bytes), (1, a.len() as u64), "{s:?}");

    // Drops by reason: a spoofed source, a TCP SYN to the gateway, TCP without a session.
    let spoof = udp(GUEST_MAC, GATEWAY_MAC, [169, 254, 68, 99], WORLD_IP, 5001, 53, b"x");
    assert_eq!(rig.cube(spoof).verdict, TC_ACT_SHOT);
    let syn = Tcp { sport: 4000, dport: 22, seq: 1, syn: true, win: 100, ..Default::default() };
    assert_eq!(rig.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, GATEWAY_IP, syn, b"")).verdict, TC_ACT_SHOT);
    let stray = Tcp { sport: 4001, dport: 80, seq: 1, ack: Some(1), win: 100, ..Default::default() };
    rig.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, stray, b""));
    let s = stats(&rig);
    assert_eq!((s.drops["spoof"], s.drops["gateway"], s.drops["no_session"]), (1, 1, 1), "{s:?}");
    assert_eq!(s.dropped(), 3, "{s:?}");
    assert_eq!((s.out_packets, s.in_packets), (1, 1), "drops are not traffic: {s:?}");

    // Another interface (no entry): dropped as unregistered, nothing created or charged.
    let before = stats(&rig);
    assert_eq!(rig.run(prog::FROM_CUBE, q, 4242).verdict, TC_ACT_SHOT);
    assert_eq!(rig.maps.sandbox_stats.list().unwrap().keys().copied().collect::<Vec<_>>(), vec![SB_IFINDEX]);
    assert_eq!(stats(&rig), before);

    // A reset (a different sandbox registering) zeroes it.
    rig.maps.sandbox_stats.reset(SB_IFINDEX).unwrap();
    let z = stats(&rig);
    assert_eq!((z.out_packets, z.out_bytes, z.in_packets, z.in_bytes, z.dropped()), (0, 0, 0, 0, 0));
    assert_eq!(z.drops.len(), cubevs_common::stats::drop::NAMES.len());
}
