//! BPF_PROG_TEST_RUN tests of every datapath path (issue 3, acceptance 1): crafted frames in,
//! exact frames and verdicts out, and the map state after each step.
//!
//! Runs inside a harness node namespace so the FIB lookup of `from_cube` resolves the uplink
//! next hop (a permanent neighbour entry makes the MACs deterministic).

use std::net::Ipv4Addr;

use cubenet_tests::{
    ebpf_object,
    frames::{Tcp as T, icmp, tcp, udp},
    packet::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, SB_IP, VERSION},
    topology::{CUBE_DEV_IP, NODE_IP, WORLD_IP},
};
use cubevs::{
    Datapath, EgressPolicy, LoadOptions, PortMapping, Proto, SandboxEntry, prog,
    reaper::{self, Timeouts},
    testrun::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
};
use cubevs_common::{
    conntrack::{tcp as tcp_state, timeout, udp as udp_state},
    counter,
};

fn session(r: &Rig) -> cubevs::SessionView {
    let s = r.maps.sessions.list().unwrap();
    assert_eq!(s.len(), 1, "{s:?}");
    s[0].clone()
}

const GSPORT: u16 = 40000;
const SNAT_PORT: u16 = 30000;

/// Guest → world TCP segment and the world-side view of its SNATed form.
fn guest_tcp(t: T) -> Vec<u8> {
    tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, T { sport: GSPORT, dport: 80, win: 1000, ..t }, b"")
}

#[test]
fn tcp_snat_reverse_nat_and_conntrack() {
    if !require_root("tcp_snat_reverse_nat_and_conntrack") {
        return;
    }
    let r = Rig::new();
    let snat =
        |t: T, smac, dmac| tcp(smac, dmac, NODE_IP, WORLD_IP, T { sport: SNAT_PORT, dport: 80, win: 1000, ..t }, b"");
    let from_world =
        |t: T| tcp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, T { sport: 80, dport: SNAT_PORT, win: 1000, ..t }, b"");
    let to_guest =
        |t: T| tcp(GATEWAY_MAC, GUEST_MAC, WORLD_IP, GUEST_IP, T { sport: 80, dport: GSPORT, win: 1000, ..t }, b"");

    // New SYN: SNAT to the node address and the first SNAT port, next hop MACs from the FIB.
    let syn = T { seq: 100, syn: true, ..Default::default() };
    let out = r.cube(guest_tcp(syn));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, snat(syn, r.up_mac, r.world_mac));
    let s = session(&r);
    assert_eq!((s.state, s.snat_port, s.version, s.vm_ifindex), ("syn_sent", SNAT_PORT, VERSION, SB_IFINDEX));
    assert_eq!(r.maps.sessions.reverse_entries().unwrap().len(), 1);

    // SYN-ACK from world: reverse NAT to the guest.
    let synack = T { seq: 500, ack: Some(101), syn: true, ..Default::default() };
    let out = r.world(from_world(synack));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, to_guest(synack));
    assert_eq!(session(&r).state, "syn_recv");

    // Established: ACK and data follow the session.
    let ack = T { seq: 101, ack: Some(501), ..Default::default() };
    let out = r.cube(guest_tcp(ack));
    assert_eq!((out.verdict, out.data), (TC_ACT_REDIRECT, snat(ack, r.up_mac, r.world_mac)));
    assert_eq!(session(&r).state, "established");

    // Guest closes first: FIN_WAIT, active close; then CLOSE_WAIT, LAST_ACK, TIME_WAIT.
    let steps: [(bool, T, &str); 4] = [
        (true, T { seq: 101, ack: Some(501), fin: true, ..Default::default() }, "fin_wait"),
        (false, T { seq: 501, ack: Some(102), ..Default::default() }, "close_wait"),
        (false, T { seq: 501, ack: Some(102), fin: true, ..Default::default() }, "last_ack"),
        (true, T { seq: 102, ack: Some(502), ..Default::default() }, "time_wait"),
    ];
    for (from_guest, t, state) in steps {
        let out = if from_guest { r.cube(guest_tcp(t)) } else { r.world(from_world(t)) };
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "{state}");
        assert_eq!(session(&r).state, state);
    }
    assert!(session(&r).active_close);

    // The guest reuses the port: the session reopens in place on the same SNAT port.
    let again = T { seq: 7000, syn: true, ..Default::default() };
    let out = r.cube(guest_tcp(again));
    assert_eq!((out.verdict, out.data), (TC_ACT_REDIRECT, snat(again, r.up_mac, r.world_mac)));
    let s = session(&r);
    assert_eq!((s.state, s.snat_port, s.active_close), ("syn_sent", SNAT_PORT, false));
    // Walk it to TIME_WAIT again for the timeout check below.
    for (from_guest, t) in [
        (false, T { seq: 800, ack: Some(7001), syn: true, ..Default::default() }),
        (true, T { seq: 7001, ack: Some(801), ..Default::default() }),
        (true, T { seq: 7001, ack: Some(801), fin: true, ..Default::default() }),
        (false, T { seq: 801, ack: Some(7002), fin: true, ..Default::default() }),
        (true, T { seq: 7002, ack: Some(802), ..Default::default() }),
    ] {
        let out = if from_guest { r.cube(guest_tcp(t)) } else { r.world(from_world(t)) };
        assert_eq!(out.verdict, TC_ACT_REDIRECT);
    }
    let s = session(&r);
    assert_eq!((s.state, s.active_close), ("time_wait", true));

    // TIME_WAIT after an active close expires after 10 s, not 2 min; both directions go.
    let (k, s) = r.maps.sessions.entries().unwrap()[0];
    let t = Timeouts::default();
    assert_eq!(t.of(k.proto, &s), timeout::TCP_TIME_WAIT_ACTIVE);
    assert_eq!(
        reaper::sweep(&r.maps.sessions, &t, s.access_ns + timeout::TCP_TIME_WAIT_ACTIVE - 1).unwrap().removed,
        0
    );
    assert_eq!(
        reaper::sweep(&r.maps.sessions, &t, s.access_ns + timeout::TCP_TIME_WAIT_ACTIVE + 1).unwrap().removed,
        1
    );
    assert_eq!(r.maps.sessions.counts(), (0, 0));

    // A non-SYN segment without a session gets a RST back into the guest.
    let stray = T { seq: 900, ack: Some(42), ..Default::default() };
    let out = r.cube(guest_tcp(stray));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    let rst = tcp(
        GATEWAY_MAC,
        GUEST_MAC,
        WORLD_IP,
        GUEST_IP,
        T { sport: 80, dport: GSPORT, seq: 42, rst: true, ..Default::default() },
        b"",
    );
    assert_eq!(out.data, rst);
}

#[test]
fn timeouts_follow_the_state_table() {
    let t = Timeouts::default();
    let mk = |state, active_close| cubevs_common::NatSession {
        access_ns: 0,
        node_ifindex: 0,
        node_ip: 0,
        vm_ifindex: 0,
        vm_ip: 0,
        node_port: 0,
        vm_port: 0,
        state,
        active_close,
        packet_class: 0,
        l7_scheme: 0,
        close_dir: 0,
        _reserved: [0; 31],
    };
    const S: u64 = 1_000_000_000;
    for (p, st, ac, want) in [
        (6, tcp_state::SYN_SENT, 0, 60 * S),
        (6, tcp_state::ESTABLISHED, 0, 3 * 3600 * S),
        (6, tcp_state::FIN_WAIT, 0, 120 * S),
        (6, tcp_state::CLOSE_WAIT, 0, 60 * S),
        (6, tcp_state::LAST_ACK, 0, 30 * S),
        (6, tcp_state::TIME_WAIT, 0, 120 * S),
        (6, tcp_state::TIME_WAIT, 1, 10 * S),
        (6, tcp_state::CLOSE, 0, 10 * S),
        (17, udp_state::UNREPLIED, 0, 30 * S),
        (17, udp_state::REPLIED, 0, 180 * S),
        (1, udp_state::REPLIED, 0, 30 * S),
    ] {
        assert_eq!(t.of(p, &mk(st, ac)), want, "proto {p} state {st} active_close {ac}");
    }
}

#[test]
fn udp_and_icmp_sessions() {
    if !require_root("udp_and_icmp_sessions") {
        return;
    }
    let r = Rig::new();
    // UDP out and back.
    let out = r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, b"q"));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, udp(r.up_mac, r.world_mac, NODE_IP, WORLD_IP, SNAT_PORT, 53, b"q"));
    assert_eq!(session(&r).state, "unreplied");
    let out = r.world(udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 53, SNAT_PORT, b"a"));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, udp(GATEWAY_MAC, GUEST_MAC, WORLD_IP, GUEST_IP, 53, 5000, b"a"));
    assert_eq!(session(&r).state, "replied");
    r.maps.sessions.delete_of(SB_IFINDEX).unwrap();

    // ICMP echo: the id is translated like a port.
    let out = r.cube(icmp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, true, 0x1234, 1));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    let port = SNAT_PORT + 1; // the cursor moved on after the UDP session
    assert_eq!(out.data, icmp(r.up_mac, r.world_mac, NODE_IP, WORLD_IP, true, port, 1));
    let out = r.world(icmp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, false, port, 1));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, icmp(GATEWAY_MAC, GUEST_MAC, WORLD_IP, GUEST_IP, false, 0x1234, 1));
    assert_eq!((session(&r).proto, session(&r).state), ("icmp", "replied"));
    // Unrelated world traffic continues to the host stack unchanged.
    let stray = udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 53, 31999, b"x");
    let out = r.world(stray.clone());
    assert_eq!((out.verdict, out.data), (TC_ACT_OK, stray));
}

#[test]
fn host_port_dnat_and_mapped_replies() {
    if !require_root("host_port_dnat_and_mapped_replies") {
        return;
    }
    let r = Rig::new();
    for proto in [Proto::Tcp, Proto::Udp] {
        r.maps.ports.add(&PortMapping { proto, host_port: 20080, ifindex: SB_IFINDEX, guest_port: 8080 }).unwrap();
    }
    let client = [203, 0, 113, 9];
    let syn = T { sport: 5555, dport: 20080, seq: 1, syn: true, win: 500, ..Default::default() };
    let out = r.world(tcp(r.world_mac, r.up_mac, client, NODE_IP, syn, b""));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, tcp(GATEWAY_MAC, GUEST_MAC, client, GUEST_IP, T { dport: 8080, ..syn }, b""));
    let out = r.world(udp(r.world_mac, r.up_mac, client, NODE_IP, 5555, 20080, b"u"));
    assert_eq!(out.data, udp(GATEWAY_MAC, GUEST_MAC, client, GUEST_IP, 5555, 8080, b"u"));

    // The guest's SYN-ACK takes the fast path back out with the host port; no session.
    let synack = T { sport: 8080, dport: 5555, seq: 9, ack: Some(2), syn: true, win: 500, ..Default::default() };
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, client, synack, b""));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, tcp(r.up_mac, r.world_mac, NODE_IP, client, T { sport: 20080, ..synack }, b""));
    assert_eq!(r.maps.sessions.counts(), (0, 0));
    // A SYN from the mapped port is not a way out.
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, client, T { ack: None, ..synack }, b""));
    assert_eq!(out.verdict, TC_ACT_SHOT);
    assert!(r.maps.counters.get(counter::CUBE_DROP_PORTMAP_SYN).unwrap() >= 1);
}

#[test]
fn host_to_sandbox_and_gateway_path() {
    if !require_root("host_to_sandbox_and_gateway_path") {
        return;
    }
    let r = Rig::new();
    let any = [0x02, 0, 0, 0, 0, 1];
    // Host (cube-dev address) → sandbox mvm IP: DNAT to the guest, source becomes the gateway.
    let t = T { sport: 4444, dport: 8080, seq: 5, syn: true, win: 100, ..Default::default() };
    let out = r.run(prog::FROM_ENVOY, tcp(any, any, CUBE_DEV_IP, SB_IP, t, b""), 0);
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, tcp(GATEWAY_MAC, GUEST_MAC, GATEWAY_IP, GUEST_IP, t, b""));
    // From another host address the source is kept.
    let out = r.run(prog::FROM_ENVOY, tcp(any, any, NODE_IP, SB_IP, t, b""), 0);
    assert_eq!(out.data, tcp(GATEWAY_MAC, GUEST_MAC, NODE_IP, GUEST_IP, t, b""));
    // Unknown destination: dropped.
    let out = r.run(prog::FROM_ENVOY, tcp(any, any, CUBE_DEV_IP, [192, 168, 0, 99], t, b""), 0);
    assert_eq!(out.verdict, TC_ACT_SHOT);

    // Guest → gateway: ICMP and TCP non-SYN go to the host (DNAT to cube-dev), SYN is dropped.
    let out = r.cube(icmp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, GATEWAY_IP, true, 7, 1));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, icmp(GUEST_MAC, GATEWAY_MAC, SB_IP, CUBE_DEV_IP, true, 7, 1));
    let synack = T { sport: 8080, dport: 4444, seq: 1, ack: Some(6), syn: true, win: 100, ..Default::default() };
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, GATEWAY_IP, synack, b""));
    assert_eq!(out.data, tcp(GUEST_MAC, GATEWAY_MAC, SB_IP, CUBE_DEV_IP, synack, b""));
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, GATEWAY_IP, T { ack: None, ..synack }, b""));
    assert_eq!(out.verdict, TC_ACT_SHOT);
    let out = r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, GATEWAY_IP, 1, 53, b""));
    assert_eq!(out.verdict, TC_ACT_SHOT);
}

#[test]
fn policy_deny_rst_bytes_and_allow_override() {
    if !require_root("policy_deny_rst_bytes_and_allow_override") {
        return;
    }
    let r = Rig::new();
    let private = [10, 1, 2, 3];
    let syn = T { sport: GSPORT, dport: 80, seq: 1000, syn: true, win: 1000, ..Default::default() };
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, private, syn, b""));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    // RST|ACK from the original destination, ack = seq + 1, window 0, valid checksums.
    let rst = T { sport: 80, dport: GSPORT, seq: 0, ack: Some(1001), rst: true, ..Default::default() };
    assert_eq!(out.data, tcp(GATEWAY_MAC, GUEST_MAC, private, GUEST_IP, rst, b""));
    assert_eq!(r.maps.sessions.counts(), (0, 0));
    // Denied UDP and ICMP are dropped.
    assert_eq!(r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, private, 1, 53, b"")).verdict, TC_ACT_SHOT);
    assert_eq!(r.cube(icmp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, private, true, 1, 1)).verdict, TC_ACT_SHOT);

    // allow_out beats deny: the same SYN is SNATed.
    r.maps
        .policy
        .replace(SB_IFINDEX, &EgressPolicy { allow_out: vec!["10.1.0.0/16".into()], ..Default::default() })
        .unwrap();
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, private, syn, b""));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(&out.data[26..30], &NODE_IP, "source must be SNATed");
    // No internet: a public address is denied, the allowed range still works.
    r.maps
        .policy
        .replace(
            SB_IFINDEX,
            &EgressPolicy { allow_internet_access: false, allow_out: vec!["10.1.0.0/16".into()], ..Default::default() },
        )
        .unwrap();
    let out = r.cube(guest_tcp(T { seq: 7, syn: true, ..Default::default() }));
    assert_eq!(&out.data[..6], &GUEST_MAC, "RST back to the guest");
    assert!(r.maps.counters.get(counter::CUBE_DENY).unwrap() >= 4);
}

#[test]
fn drops_fragments_unknown_interfaces_and_stale_versions() {
    if !require_root("drops_fragments_unknown_interfaces_and_stale_versions") {
        return;
    }
    let r = Rig::new();
    let mut frag = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 1, 2, b"x");
    frag[20] |= 0x20; // MF
    frag[24..26].copy_from_slice(&[0, 0]);
    assert_eq!(r.cube(frag).verdict, TC_ACT_SHOT);
    assert_eq!(r.maps.counters.get(counter::CUBE_DROP_PROTO).unwrap(), 1);
    // An interface without a registered sandbox drops everything but ARP.
    let out = r.run(prog::FROM_CUBE, guest_tcp(T { syn: true, ..Default::default() }), 999);
    assert_eq!(out.verdict, TC_ACT_SHOT);
    assert_eq!(r.maps.counters.get(counter::CUBE_DROP_UNREGISTERED).unwrap(), 1);
    // Spoofed source.
    assert_eq!(r.cube(udp(GUEST_MAC, GATEWAY_MAC, [169, 254, 68, 9], WORLD_IP, 1, 2, b"")).verdict, TC_ACT_SHOT);

    // A session of version 7; the interface is reused by a new sandbox (version 8): the old
    // flow no longer matches, so an ACK of it is answered with a RST instead of being SNATed.
    assert_eq!(r.cube(guest_tcp(T { seq: 1, syn: true, ..Default::default() })).verdict, TC_ACT_REDIRECT);
    r.maps
        .sandboxes
        .register(&SandboxEntry {
            ifindex: SB_IFINDEX,
            ip: Ipv4Addr::from(SB_IP),
            version: VERSION + 1,
            id: "sb2".into(),
        })
        .unwrap();
    let out = r.cube(guest_tcp(T { seq: 2, ack: Some(9), ..Default::default() }));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(&out.data[..6], &GUEST_MAC, "expected a RST to the guest, not SNAT: {:02x?}", out.data);
    assert_eq!(r.maps.counters.get(counter::CUBE_NO_SESSION).unwrap(), 1);
}

#[test]
fn programs_stay_within_the_verifier_budget() {
    if !require_root("programs_stay_within_the_verifier_budget") {
        return;
    }
    let mut dp = Datapath::load(LoadOptions { object: ebpf_object(), ..LoadOptions::new() }).expect("load");
    for &name in prog::ALL {
        let info = dp.program(name).unwrap().info().expect("prog info");
        let insns = info.verified_instruction_count().expect("verified_insns");
        eprintln!("verified_insns {name}: {insns}");
        assert!(insns < 700_000, "{name}: {insns} verified instructions (> 70% of 1M)");
    }
}

/// Per-packet cost figures (ns/packet, BPF_PROG_TEST_RUN): `cargo xtask bench per-packet` is
/// the full report; this ignored test prints the headline numbers only.
#[test]
#[ignore]
fn report_per_packet_cost() {
    let r = Rig::new();
    r.cube(guest_tcp(T { seq: 1, syn: true, ..Default::default() }));
    let mut v =
        r.run_many(prog::FROM_CUBE, SB_IFINDEX, 2000, |_| guest_tcp(T { seq: 2, ack: Some(1), ..Default::default() }));
    v.sort_unstable();
    eprintln!("from_cube established TCP: p50 {} ns", v[1000]);
}
