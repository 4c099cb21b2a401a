//! `xdp_world` against `from_world` under `BPF_PROG_TEST_RUN` (issue 15, XDP fast path): the
//! same frame on the same map state gives the same output bytes, the same session state and
//! the same counters on both hooks, or `XDP_PASS` with the frame and the maps untouched for
//! what only the TC path handles.
//!
//! Each world frame runs through `xdp_world` first; the sessions are then restored to the
//! snapshot taken before, and the same frame runs through `from_world`.

use std::net::Ipv4Addr;

use cubenet_tests::{
    frames::{Tcp as T, fix_ip_csum, icmp, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, SB_IP, VERSION},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    CounterValue, PortMapping, Proto, SandboxEntry,
    testrun::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, TestRunOutput, XDP_DROP, XDP_PASS, XDP_REDIRECT},
};
use cubevs_common::{NatSession, SessionKey, counter};

const GSPORT: u16 = 40000;

/// What one hook did: verdict, frame, sessions (access time zeroed) and counters.
#[derive(Debug, PartialEq)]
struct Effect {
    verdict: &'static str,
    data: Vec<u8>,
    sessions: Vec<(SessionKey, NatSession)>,
    counters: Vec<CounterValue>,
}

fn sessions(r: &Rig) -> Vec<(SessionKey, NatSession)> {
    let mut v = r.maps.sessions.entries().unwrap();
    for (_, s) in &mut v {
        s.access_ns = 0;
    }
    v.sort_by_key(|(k, _)| (k.proto, k.sport, k.dport, k.src_ip, k.dst_ip));
    v
}

fn effect(r: &Rig, before: &[CounterValue], out: TestRunOutput, xdp: bool) -> Effect {
    let verdict = match (xdp, out.verdict) {
        (true, XDP_REDIRECT) | (false, TC_ACT_REDIRECT) => "redirect",
        (true, XDP_DROP) | (false, TC_ACT_SHOT) => "drop",
        (true, XDP_PASS) | (false, TC_ACT_OK) => "pass",
        (_, v) => panic!("unexpected verdict {v} (xdp: {xdp})"),
    };
    let after = r.maps.counters.read().unwrap();
    let counters = after
        .iter()
        .zip(before)
        .filter(|(a, b)| a.packets != b.packets)
        .map(|(a, b)| CounterValue { packets: a.packets - b.packets, ..a.clone() })
        .collect();
    Effect { verdict, data: out.data, sessions: sessions(r), counters }
}

/// How `xdp_world` must treat a frame relative to `from_world`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// Same verdict (redirect or drop), bytes, sessions and counters as `from_world`.
    Same(&'static str),
    /// `XDP_PASS` with frame, sessions and counters untouched; `from_world` then decides.
    Pass,
}

/// Runs `frame` through `xdp_world` then (sessions restored) `from_world`, both as received
/// on `ingress`, checks `expect` and returns the TC path's effect (the state it leaves).
fn both(r: &Rig, case: &str, frame: Vec<u8>, ingress: u32, expect: Expect) -> Effect {
    eprintln!("case: {case}");
    let snap = r.maps.sessions.entries().unwrap();
    let c0 = r.maps.counters.read().unwrap();
    let s0 = sessions(r);
    let x = r.xdp_on(frame.clone(), ingress);
    let mut x = effect(r, &c0, x, true);
    // The XDP path counts its redirects once more under its own name.
    let redirects = x.counters.iter().filter(|c| c.program == "xdp_world").map(|c| c.packets).sum::<u64>();
    x.counters.retain(|c| c.program != "xdp_world");
    assert_eq!(redirects, u64::from(x.verdict == "redirect"), "{case}: xdp_world/redirect counter");
    // Restore the sessions (values overwrite in place) before the TC run.
    r.maps.sessions.insert_batch(&snap).unwrap();
    assert_eq!(sessions(r), s0, "{case}: restore");
    let c1 = r.maps.counters.read().unwrap();
    let t = r.run(cubevs::prog::FROM_WORLD, frame.clone(), ingress);
    let t = effect(r, &c1, t, false);
    match expect {
        Expect::Same(v) => {
            assert_eq!(t.verdict, v, "{case}: from_world verdict");
            assert_eq!(x, t, "{case}: xdp_world differs from from_world");
        }
        Expect::Pass => {
            assert_eq!(x.verdict, "pass", "{case}");
            assert_eq!(x.data, frame, "{case}: XDP_PASS must leave the frame untouched");
            assert_eq!(x.sessions, s0, "{case}: XDP_PASS must leave the sessions untouched");
            assert!(x.counters.is_empty(), "{case}: XDP_PASS counted {:?}", x.counters);
        }
    }
    t
}

fn guest_tcp(t: T) -> Vec<u8> {
    tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, T { sport: GSPORT, dport: 80, win: 1000, ..t }, b"")
}

fn snat_port(r: &Rig, proto: &str) -> u16 {
    r.maps.sessions.list().unwrap().iter().find(|s| s.proto == proto).expect("session").snat_port
}

#[test]
fn xdp_world_matches_from_world_byte_for_byte() {
    if !require_root("xdp_world_matches_from_world_byte_for_byte") {
        return;
    }
    let r = Rig::new();
    let up = r.uplink_ifindex;

    // TCP: a guest connection, then every reply kind from the world.
    assert_eq!(r.cube(guest_tcp(T { seq: 100, syn: true, ..Default::default() })).verdict, TC_ACT_REDIRECT);
    let port = snat_port(&r, "tcp");
    let world =
        |t: T, p: &[u8]| tcp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, T { sport: 80, dport: port, win: 1000, ..t }, p);
    let e = both(
        &r,
        "tcp syn-ack",
        world(T { seq: 500, ack: Some(101), syn: true, ..Default::default() }, b""),
        up,
        Expect::Same("redirect"),
    );
    assert_eq!(
        e.data,
        tcp(
            GATEWAY_MAC,
            GUEST_MAC,
            WORLD_IP,
            GUEST_IP,
            T { sport: 80, dport: GSPORT, seq: 500, ack: Some(101), syn: true, win: 1000, ..Default::default() },
            b""
        )
    );
    assert_eq!(r.maps.sessions.list().unwrap()[0].state, "syn_recv");
    assert_eq!(r.cube(guest_tcp(T { seq: 101, ack: Some(501), ..Default::default() })).verdict, TC_ACT_REDIRECT);
    both(
        &r,
        "tcp data",
        world(T { seq: 501, ack: Some(101), ..Default::default() }, b"hello world"),
        up,
        Expect::Same("redirect"),
    );
    // An RST far outside the window: dropped by both, session untouched.
    both(
        &r,
        "tcp rst outside window",
        world(T { seq: 9_000_000, rst: true, ..Default::default() }, b""),
        up,
        Expect::Same("drop"),
    );
    both(
        &r,
        "tcp fin",
        world(T { seq: 512, ack: Some(101), fin: true, ..Default::default() }, b""),
        up,
        Expect::Same("redirect"),
    );
    assert_eq!(r.maps.sessions.list().unwrap()[0].state, "fin_wait");
    both(
        &r,
        "tcp rst in window",
        world(T { seq: 513, rst: true, ..Default::default() }, b""),
        up,
        Expect::Same("redirect"),
    );
    assert_eq!(r.maps.sessions.list().unwrap()[0].state, "close");

    // UDP: a guest query and its reply (zero and non-zero checksums).
    assert_eq!(r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 4000, b"q")).verdict, TC_ACT_REDIRECT);
    let uport = snat_port(&r, "udp");
    let reply = udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 4000, uport, b"answer");
    let e = both(&r, "udp reply", reply.clone(), up, Expect::Same("redirect"));
    assert_eq!(e.data, udp(GATEWAY_MAC, GUEST_MAC, WORLD_IP, GUEST_IP, 4000, 5000, b"answer"));
    // DNS answers (UDP from port 53) are left to `from_world`, whose learning hook must see
    // them, even for a tracked session.
    assert_eq!(r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5001, 53, b"q")).verdict, TC_ACT_REDIRECT);
    let dport = r
        .maps
        .sessions
        .list()
        .unwrap()
        .into_iter()
        .find(|s| s.proto == "udp" && s.guest_port == 5001)
        .expect("the DNS query's session")
        .snat_port;
    both(&r, "dns answer", udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 53, dport, b"dns"), up, Expect::Pass);
    let mut zero = reply.clone();
    zero[40..42].copy_from_slice(&[0, 0]);
    let e = both(&r, "udp reply, zero checksum", zero, up, Expect::Same("redirect"));
    assert_eq!(&e.data[40..42], &[0, 0], "a zero UDP checksum stays zero");

    // Host-port DNAT, TCP and UDP, from the uplink; from another device XDP passes.
    for proto in [Proto::Tcp, Proto::Udp] {
        r.maps.ports.add(&PortMapping { proto, host_port: 20080, ifindex: SB_IFINDEX, guest_port: 8080 }).unwrap();
    }
    let client = [203, 0, 113, 9];
    let syn = T { sport: 5555, dport: 20080, seq: 1, syn: true, win: 500, ..Default::default() };
    let e =
        both(&r, "host-port tcp", tcp(r.world_mac, r.up_mac, client, NODE_IP, syn, b""), up, Expect::Same("redirect"));
    assert_eq!(e.data, tcp(GATEWAY_MAC, GUEST_MAC, client, GUEST_IP, T { dport: 8080, ..syn }, b""));
    let e = both(
        &r,
        "host-port udp",
        udp(r.world_mac, r.up_mac, client, NODE_IP, 5555, 20080, b"u"),
        up,
        Expect::Same("redirect"),
    );
    assert_eq!(e.data, udp(GATEWAY_MAC, GUEST_MAC, client, GUEST_IP, 5555, 8080, b"u"));
    // Loopback (ifindex 1) exists in the node netns: a "host-port frame from another device".
    let e = both(
        &r,
        "host-port from another device",
        tcp(r.world_mac, r.up_mac, client, NODE_IP, syn, b""),
        1,
        Expect::Pass,
    );
    assert_eq!(e.verdict, "pass");
    assert_eq!(e.counters.iter().map(|c| c.reason).collect::<Vec<_>>(), ["portmap_wrong_dev"]);

    // Only the TC path handles these: XDP passes them untouched.
    let mut first = reply.clone();
    first[20] |= 0x20; // MF
    fix_ip_csum(&mut first);
    both(&r, "first fragment", first.clone(), up, Expect::Pass);
    let mut later = first.clone();
    later[20] = 0;
    later[21] = 3; // offset 24 bytes
    fix_ip_csum(&mut later);
    both(&r, "later fragment", later, up, Expect::Pass);
    both(&r, "icmp echo reply", icmp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, false, 77, 1), up, Expect::Pass);
    both(&r, "udp to an unused port", udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 53, 1234, b"x"), up, Expect::Pass);
    both(
        &r,
        "tcp from a stranger",
        tcp(r.world_mac, r.up_mac, client, NODE_IP, T { dport: port, ..syn }, b""),
        up,
        Expect::Pass,
    );
    let mut arp = vec![0xff; 6];
    arp.extend_from_slice(&r.world_mac);
    arp.extend_from_slice(&[0x08, 0x06]);
    arp.extend_from_slice(&[0; 28]);
    both(&r, "arp", arp, up, Expect::Pass);
    // Truncated headers (the TC test run refuses frames this short, so XDP only).
    let data = tcp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, T { sport: 80, dport: port, ..Default::default() }, b"");
    for cut in [30, 44] {
        let short = data[..cut].to_vec();
        let out = r.xdp(short.clone());
        assert_eq!((out.verdict, out.data), (XDP_PASS, short), "truncated to {cut} bytes");
    }
}

#[test]
fn stale_version_replies_never_reach_the_next_owner_via_xdp() {
    if !require_root("stale_version_replies_never_reach_the_next_owner_via_xdp") {
        return;
    }
    let r = Rig::new();
    let up = r.uplink_ifindex;
    // The old sandbox (version 7) has a TCP and a UDP flow.
    assert_eq!(r.cube(guest_tcp(T { seq: 100, syn: true, ..Default::default() })).verdict, TC_ACT_REDIRECT);
    assert_eq!(r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 4000, b"q")).verdict, TC_ACT_REDIRECT);
    let (tport, uport) = (snat_port(&r, "tcp"), snat_port(&r, "udp"));
    // Its TAP now belongs to the next sandbox, same IP, version 8.
    r.maps
        .sandboxes
        .register(&SandboxEntry {
            ifindex: SB_IFINDEX,
            ip: Ipv4Addr::from(SB_IP),
            version: VERSION + 1,
            id: "next".into(),
        })
        .unwrap();
    let attack = [
        ("udp", udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 4000, uport, b"a")),
        (
            "syn-ack",
            tcp(
                r.world_mac,
                r.up_mac,
                WORLD_IP,
                NODE_IP,
                T { sport: 80, dport: tport, seq: 500, ack: Some(101), syn: true, win: 1000, ..Default::default() },
                b"",
            ),
        ),
        (
            "data",
            tcp(
                r.world_mac,
                r.up_mac,
                WORLD_IP,
                NODE_IP,
                T { sport: 80, dport: tport, seq: 501, ack: Some(101), win: 1000, ..Default::default() },
                b"x",
            ),
        ),
        (
            "rst",
            tcp(
                r.world_mac,
                r.up_mac,
                WORLD_IP,
                NODE_IP,
                T { sport: 80, dport: tport, seq: 501, rst: true, ..Default::default() },
                b"",
            ),
        ),
    ];
    for (case, f) in &attack {
        let e = both(&r, case, f.clone(), up, Expect::Same("drop"));
        assert_eq!(
            e.counters.iter().map(|c| (c.reason, c.packets)).collect::<Vec<_>>(),
            [("drop_stale_version", 1)],
            "{case}"
        );
    }
    // Released and not reused yet: still never delivered.
    r.maps.sandboxes.unregister(SB_IFINDEX).unwrap();
    for (case, f) in &attack {
        let out = r.xdp(f.clone());
        assert_eq!(out.verdict, XDP_DROP, "{case} after release");
    }
    assert_eq!(r.maps.counters.get(counter::WORLD_DROP_STALE_VERSION).unwrap(), 2 * 4 + 4);
}

/// Attack (decision R45): a sandbox's mvm IP is node-local, `from_world` drops every frame the
/// uplink receives for one (R10). An L7 flow keeps the sandbox's own address, so its reserved
/// reverse key is {server, mvm IP, server port, guest port}: a world host that names the mvm IP
/// (a router that knows the sandbox CIDR, any host on the uplink's segment) and guesses the
/// guest port matched that key on the XDP path, which skipped the R10 check, and its forged
/// SYN-ACK, data and RST reached the guest and moved the L7 session's state. Both hooks must
/// drop every frame to an mvm IP alike: same verdict, same counter, no session touched.
#[test]
fn frames_to_a_sandbox_address_never_take_the_xdp_path() {
    if !require_root("frames_to_a_sandbox_address_never_take_the_xdp_path") {
        return;
    }
    let server = [203, 0, 113, 10];
    let rule: egress_policy::RuleSpec = serde_json::from_value(
        serde_json::json!({"id": "r", "match": {"host": "203.0.113.10"}, "action": {"allow": true}}),
    )
    .unwrap();
    let r = Rig::with_policy(&cubevs::EgressPolicy { rules: vec![rule], ..Default::default() });
    let up = r.uplink_ifindex;
    // The guest opens an L7 flow (steered to cube-dev, no SNAT: the session keeps SB_IP).
    let syn = T { sport: GSPORT, dport: 443, seq: 100, syn: true, win: 1000, ..Default::default() };
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, server, syn, b""));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(r.counter(counter::CUBE_L7_NEW), 1, "an L7 session");
    let state = |r: &Rig| r.maps.sessions.list().unwrap()[0].state;
    assert_eq!(state(&r), "syn_sent");
    let to_sb = |t: T, p: &[u8]| tcp(r.world_mac, r.up_mac, server, SB_IP, T { sport: 443, dport: GSPORT, ..t }, p);
    let attacks = [
        ("forged syn-ack", to_sb(T { seq: 500, ack: Some(101), syn: true, win: 1000, ..Default::default() }, b"")),
        ("forged data", to_sb(T { seq: 501, ack: Some(101), win: 1000, ..Default::default() }, b"<script>")),
        ("forged rst", to_sb(T { seq: 501, rst: true, ..Default::default() }, b"")),
        ("udp to the mvm ip", udp(r.world_mac, r.up_mac, WORLD_IP, SB_IP, 4000, 8080, b"x")),
    ];
    for (case, f) in attacks {
        let e = both(&r, case, f, up, Expect::Same("drop"));
        assert_eq!(
            e.counters.iter().map(|c| (c.reason, c.packets)).collect::<Vec<_>>(),
            [("drop_to_sandbox", 1)],
            "{case}"
        );
        assert_eq!(state(&r), "syn_sent", "{case}: the L7 session's state moved");
    }
    // XDP alone (no TC run after it): nothing is redirected, the session never moves.
    let out = r.xdp(to_sb(T { seq: 500, ack: Some(101), syn: true, win: 1000, ..Default::default() }, b""));
    assert_eq!(out.verdict, XDP_DROP);
    assert_eq!(state(&r), "syn_sent");
    assert_eq!(r.maps.counters.get(counter::XDP_REDIRECT).unwrap(), 0, "xdp_world redirected a frame");
}

/// Crafted world frames for live sessions: IP options, a total length past the frame, link-layer
/// padding, a wrong IP header checksum, a TCP data offset below 5. Whatever `from_world` decides
/// (redirect for what a guest's own stack then judges, pass for what names no flow), `xdp_world`
/// must decide the same, byte for byte, or pass the frame untouched.
#[test]
fn crafted_world_frames_get_the_same_verdict_on_both_hooks() {
    if !require_root("crafted_world_frames_get_the_same_verdict_on_both_hooks") {
        return;
    }
    let r = Rig::new();
    let up = r.uplink_ifindex;
    assert_eq!(r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 4000, b"q")).verdict, TC_ACT_REDIRECT);
    assert_eq!(r.cube(guest_tcp(T { seq: 100, syn: true, ..Default::default() })).verdict, TC_ACT_REDIRECT);
    let (uport, tport) = (snat_port(&r, "udp"), snat_port(&r, "tcp"));
    let reply = udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 4000, uport, b"answer");
    // IP options (NOP NOP NOP EOL): header length 24; the L4 checksum does not cover them.
    let mut options = reply[..34].to_vec();
    options.extend_from_slice(&[1, 1, 1, 0]);
    options.extend_from_slice(&reply[34..]);
    options[14] = 0x46;
    let tot = u16::from_be_bytes([options[16], options[17]]) + 4;
    options[16..18].copy_from_slice(&tot.to_be_bytes());
    fix_ip_csum(&mut options);
    let mut long = reply.clone();
    let tot = u16::from_be_bytes([long[16], long[17]]) + 100;
    long[16..18].copy_from_slice(&tot.to_be_bytes());
    fix_ip_csum(&mut long);
    let mut padded = reply.clone();
    padded.extend_from_slice(&[0xee; 10]);
    let mut bad_csum = reply.clone();
    bad_csum[24] ^= 0xff;
    let mut doff = tcp(
        r.world_mac,
        r.up_mac,
        WORLD_IP,
        NODE_IP,
        T { sport: 80, dport: tport, seq: 500, ack: Some(101), syn: true, win: 1000, ..Default::default() },
        b"",
    );
    doff[46] = 0x40;
    let cases = [
        ("udp reply with ip options", options),
        ("udp reply, total length past the frame", long),
        ("udp reply with link-layer padding", padded),
        ("udp reply, wrong ip checksum", bad_csum),
        ("tcp syn-ack, data offset 4", doff),
    ];
    for (case, f) in cases {
        // What the TC path alone does decides the expectation; both hooks must then agree.
        let snap = r.maps.sessions.entries().unwrap();
        let tc = r.run(cubevs::prog::FROM_WORLD, f.clone(), up).verdict;
        r.maps.sessions.insert_batch(&snap).unwrap();
        let expect = match tc {
            TC_ACT_REDIRECT => Expect::Same("redirect"),
            TC_ACT_SHOT => Expect::Same("drop"),
            _ => Expect::Pass,
        };
        eprintln!("{case}: from_world {tc}");
        both(&r, case, f, up, expect);
    }
}

#[test]
fn xdp_world_stays_within_the_verifier_budget() {
    if !require_root("xdp_world_stays_within_the_verifier_budget") {
        return;
    }
    let mut dp = cubevs::Datapath::load(cubevs::LoadOptions {
        object: cubenet_tests::ebpf_object(),
        ..cubevs::LoadOptions::new()
    })
    .expect("load");
    let info = dp.xdp_program().unwrap().info().expect("prog info");
    let insns = info.verified_instruction_count().expect("verified_insns");
    eprintln!("verified_insns xdp_world: {insns}");
    assert!(insns < 700_000, "xdp_world: {insns} verified instructions (> 70% of 1M)");
}
