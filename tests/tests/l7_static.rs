//! L7 for static-IP rules (decision N10, upstream §3.7 "static L7 IP"), under
//! `BPF_PROG_TEST_RUN` with exact frames and map state: an L7 rule whose `match.host` /
//! `match.sni` is an IPv4 literal makes new TCP flows to that address on the rule's ports
//! (default 80 and 443) go to cube-dev with the scheme's mark, source = the sandbox IP, in an
//! L7 session; other ports, protocols and addresses follow the CIDR policy (attacks); flows
//! already open keep their class across a policy change.

use std::net::Ipv4Addr;

use cubenet_tests::{
    frames::{Tcp as T, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{CUBE_DEV_IFINDEX, Rig, SB_IFINDEX, SB_IP},
    topology::NODE_IP,
};
use cubevs::{
    EgressPolicy,
    policy::Cidr,
    testrun::{TC_ACT_REDIRECT, TC_ACT_SHOT, TestRunOutput},
};
use cubevs_common::{
    conntrack::{CLASS_L7, CLASS_SNAT},
    counter, l7,
};

/// The static L7 address, and a neighbour no rule names (TEST-NET-3).
const L7IP: [u8; 4] = [203, 0, 113, 10];
const OTHER: [u8; 4] = [203, 0, 113, 11];

fn rule(m: serde_json::Value) -> egress_policy::RuleSpec {
    serde_json::from_value(serde_json::json!({"id": "r", "match": m, "action": {"allow": true}})).unwrap()
}

fn policy(internet: bool, allow_out: &[&str], rules: Vec<egress_policy::RuleSpec>) -> EgressPolicy {
    EgressPolicy {
        allow_internet_access: internet,
        allow_out: allow_out.iter().map(|s| s.to_string()).collect(),
        rules,
        ..Default::default()
    }
}

const SYN: T = T { sport: 0, dport: 0, seq: 1, ack: None, syn: true, fin: false, rst: false, win: 1000 };

fn syn(r: &Rig, sport: u16, dst: [u8; 4], dport: u16) -> TestRunOutput {
    r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, T { sport, dport, ..SYN }, b""))
}

/// The session of guest port `sport` (raw key and value).
fn session(r: &Rig, sport: u16) -> cubevs_common::NatSession {
    let e = r.maps.sessions.entries().unwrap();
    e.into_iter().find(|(k, _)| k.sport == sport.to_be()).expect("session").1
}

/// Asserts `out` is the SYN steered to cube-dev with `mark`: frame unchanged but the source
/// (the sandbox IP), an L7 session on cube-dev with `scheme`, no SNAT.
fn assert_steered(r: &Rig, out: &TestRunOutput, sport: u16, dport: u16, mark: u32, scheme: u8) {
    assert_steered_seq(r, out, sport, dport, mark, scheme, 1);
}

/// [`assert_steered`] for a SYN with sequence number `seq`.
fn assert_steered_seq(r: &Rig, out: &TestRunOutput, sport: u16, dport: u16, mark: u32, scheme: u8, seq: u32) {
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.mark, mark);
    assert_eq!(out.data, tcp(GUEST_MAC, GATEWAY_MAC, SB_IP, L7IP, T { sport, dport, seq, ..SYN }, b""));
    let s = session(r, sport);
    assert_eq!(
        (s.packet_class, s.l7_scheme, s.node_ifindex, s.node_ip, s.node_port),
        (CLASS_L7, scheme, CUBE_DEV_IFINDEX, u32::from_ne_bytes(SB_IP), sport.to_be()),
        "L7 session: cube-dev, identity, no SNAT"
    );
}

/// Asserts `out` left SNATed (node address as source), unmarked, in a SNAT session.
fn assert_snat(r: &Rig, out: &TestRunOutput, sport: u16) {
    assert_eq!((out.verdict, out.mark), (TC_ACT_REDIRECT, 0));
    assert_eq!(out.data[26..30], NODE_IP, "plain SNAT");
    assert_eq!(session(r, sport).packet_class, CLASS_SNAT);
}

/// Asserts a TCP SYN to `dst` was denied: a RST from `dst` back to the guest, unmarked, no
/// session.
fn assert_denied(r: &Rig, out: &TestRunOutput, sport: u16, dst: [u8; 4]) {
    assert_eq!((out.verdict, out.mark), (TC_ACT_REDIRECT, 0));
    assert_eq!((&out.data[26..30], &out.data[30..34]), (&dst[..], &GUEST_IP[..]), "RST back to the guest");
    assert!(out.data[47] & 0x04 != 0, "RST flag");
    assert!(r.maps.sessions.entries().unwrap().iter().all(|(k, _)| k.sport != sport.to_be()), "no session");
}

#[test]
fn static_l7_ip_is_steered_on_80_and_443_only() {
    if !require_root("static_l7_ip_is_steered_on_80_and_443_only") {
        return;
    }
    // Internet off: nothing but the rule's address on its ports may leave.
    let r = Rig::with_policy(&policy(false, &[], vec![rule(serde_json::json!({"host": "203.0.113.10"}))]));
    let d = r.maps.policy.dump(SB_IFINDEX).unwrap();
    assert_eq!(d.l7, vec![Cidr::new(Ipv4Addr::from(L7IP), 32)]);
    assert!(d.allow.is_empty(), "not a plain allow entry");

    assert_steered(&r, &syn(&r, 41000, L7IP, 443), 41000, 443, l7::MARK_HTTPS, l7::SCHEME_HTTPS);
    assert_steered(&r, &syn(&r, 41001, L7IP, 80), 41001, 80, l7::MARK_HTTP, l7::SCHEME_HTTP);
    assert_eq!(r.counter(counter::CUBE_L7_NEW), 2);

    // Attacks: another port, another protocol on 443, another address: the CIDR policy
    // (deny all) decides; nothing is steered.
    let denied = r.counter(counter::CUBE_DENY);
    assert_denied(&r, &syn(&r, 41002, L7IP, 8080), 41002, L7IP);
    assert_denied(&r, &syn(&r, 41003, OTHER, 443), 41003, OTHER);
    let u = r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, L7IP, 41004, 443, b"quic"));
    assert_eq!((u.verdict, u.mark), (TC_ACT_SHOT, 0), "UDP/443 to the L7 address is not an L7 flow");
    assert_eq!(r.counter(counter::CUBE_DENY), denied + 3);
    assert_eq!(r.counter(counter::CUBE_L7_NEW), 2);
}

#[test]
fn static_l7_ports_scheme_and_plain_allow() {
    if !require_root("static_l7_ports_scheme_and_plain_allow") {
        return;
    }
    // Internet on, SNI literal with `/32` and scheme https: 443 only; port 80 and other
    // addresses are plain SNAT as the (open) CIDR policy says.
    let r = Rig::with_policy(&policy(
        true,
        &[],
        vec![rule(serde_json::json!({"sni": "203.0.113.10/32", "scheme": "https"}))],
    ));
    assert_steered(&r, &syn(&r, 42000, L7IP, 443), 42000, 443, l7::MARK_HTTPS, l7::SCHEME_HTTPS);
    assert_snat(&r, &syn(&r, 42001, L7IP, 80), 42001);
    assert_snat(&r, &syn(&r, 42002, OTHER, 443), 42002);

    // Internet off, the /24 allowed by CIDR and the rule's address inside it: L7 on 80/443
    // beats the plain allow; the plain allow keeps every other port (L3_ALLOWED).
    let r =
        Rig::with_policy(&policy(false, &["203.0.113.0/24"], vec![rule(serde_json::json!({"host": "203.0.113.10"}))]));
    let d = r.maps.policy.dump(SB_IFINDEX).unwrap();
    assert_eq!((d.allow.len(), d.l7.len()), (1, 1));
    assert_steered(&r, &syn(&r, 42010, L7IP, 443), 42010, 443, l7::MARK_HTTPS, l7::SCHEME_HTTPS);
    assert_snat(&r, &syn(&r, 42011, L7IP, 22), 42011);
    assert_snat(&r, &syn(&r, 42012, OTHER, 443), 42012);
}

#[test]
fn open_flows_keep_their_class_across_policy_changes() {
    if !require_root("open_flows_keep_their_class_across_policy_changes") {
        return;
    }
    let plain = policy(true, &[], vec![]);
    let with_rule = policy(true, &[], vec![rule(serde_json::json!({"host": "203.0.113.10"}))]);
    let r = Rig::with_policy(&plain);
    assert_snat(&r, &syn(&r, 43000, L7IP, 443), 43000);
    r.maps.policy.replace(SB_IFINDEX, &with_rule).unwrap();
    // The SNAT flow opened before the rule stays SNAT; a new one is steered.
    let ack = T { sport: 43000, dport: 443, seq: 2, ack: Some(1), win: 1000, ..Default::default() };
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, L7IP, ack, b""));
    assert_eq!((out.verdict, out.mark), (TC_ACT_REDIRECT, 0));
    assert_eq!(out.data[26..30], NODE_IP);
    assert_steered(&r, &syn(&r, 43001, L7IP, 443), 43001, 443, l7::MARK_HTTPS, l7::SCHEME_HTTPS);
    // The rule goes: the L7 flow keeps going to CubeEgress; a new one is SNATed.
    r.maps.policy.replace(SB_IFINDEX, &plain).unwrap();
    let ack = T { sport: 43001, ..ack };
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, L7IP, ack, b""));
    assert_eq!((out.verdict, out.mark), (TC_ACT_REDIRECT, l7::MARK_HTTPS));
    assert_eq!(out.data[26..30], SB_IP);
    assert_eq!(r.maps.policy.dump(SB_IFINDEX).unwrap().l7, vec![]);
    assert_snat(&r, &syn(&r, 43002, L7IP, 443), 43002);
}

/// A guest that reuses the port of a finished connection opens a new one: when a policy change
/// moved the address between SNAT and L7 meanwhile, the old session goes and the SYN gets the
/// new class (it would otherwise bypass CubeEgress, or keep going to it).
#[test]
fn a_reopened_port_gets_the_new_class() {
    if !require_root("a_reopened_port_gets_the_new_class") {
        return;
    }
    use cubevs::prog;
    let plain = policy(true, &[], vec![]);
    let with_rule = policy(true, &[], vec![rule(serde_json::json!({"host": "203.0.113.10"}))]);
    let r = Rig::with_policy(&plain);
    let guest =
        |t: T| r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, L7IP, T { sport: 44000, dport: 443, win: 1000, ..t }, b""));
    let state = |r: &Rig| r.maps.sessions.list().unwrap().iter().find(|s| s.guest_port == 44000).unwrap().state;

    // An SNAT connection, established.
    let out = guest(T { seq: 1, syn: true, ..Default::default() });
    assert_snat(&r, &out, 44000);
    let snat_port = u16::from_be_bytes([out.data[34], out.data[35]]);
    let synack = T { sport: 443, dport: snat_port, seq: 900, ack: Some(2), syn: true, win: 1000, ..Default::default() };
    assert_eq!(r.world(tcp(r.world_mac, r.up_mac, L7IP, NODE_IP, synack, b"")).verdict, TC_ACT_REDIRECT);
    guest(T { seq: 2, ack: Some(901), ..Default::default() });
    assert_eq!(state(&r), "established");

    // The address becomes L7; the guest reuses its port: steered, L7 session.
    r.maps.policy.replace(SB_IFINDEX, &with_rule).unwrap();
    let out = guest(T { seq: 5000, syn: true, ..Default::default() });
    assert_steered_seq(&r, &out, 44000, 443, l7::MARK_HTTPS, l7::SCHEME_HTTPS, 5000);
    assert_eq!(r.counter(counter::CUBE_RECLASSIFIED), 1);
    assert_eq!(r.maps.sessions.entries().unwrap().len(), 1, "the SNAT session is gone");

    // Established through CubeEgress, then the rule goes; the port is reused again: SNAT.
    let synack = T { sport: 443, dport: 44000, seq: 900, ack: Some(5001), syn: true, win: 1000, ..Default::default() };
    let out = r.run(prog::FROM_ENVOY, tcp(r.world_mac, r.up_mac, L7IP, SB_IP, synack, b""), 0);
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    guest(T { seq: 5001, ack: Some(901), ..Default::default() });
    assert_eq!(state(&r), "established");
    r.maps.policy.replace(SB_IFINDEX, &plain).unwrap();
    let out = guest(T { seq: 9000, syn: true, ..Default::default() });
    assert_snat(&r, &out, 44000);
    assert_eq!(r.counter(counter::CUBE_RECLASSIFIED), 2);

    // Same class: the session is reused as before (D15: same SNAT port), nothing reclassified.
    let snat2 = u16::from_be_bytes([out.data[34], out.data[35]]);
    let synack = T { sport: 443, dport: snat2, seq: 900, ack: Some(9001), syn: true, win: 1000, ..Default::default() };
    r.world(tcp(r.world_mac, r.up_mac, L7IP, NODE_IP, synack, b""));
    guest(T { seq: 9001, ack: Some(901), ..Default::default() });
    let out = guest(T { seq: 20000, syn: true, ..Default::default() });
    assert_snat(&r, &out, 44000);
    assert_eq!(u16::from_be_bytes([out.data[34], out.data[35]]), snat2);
    assert_eq!(r.counter(counter::CUBE_RECLASSIFIED), 2);
}

/// Attack (R30): an L7 rule naming an address on the node's always-denied list (the static L7
/// entry would steer its 80/443 flows to CubeEgress, which would dial it), also with
/// `allow_out` covering it. Property: the SYNs are denied before any steering (a RST, no
/// session, nothing marked); with the list emptied in place the same SYN is steered.
#[test]
fn static_l7_ip_on_the_always_denied_list_is_never_steered() {
    if !require_root("static_l7_ip_on_the_always_denied_list_is_never_steered") {
        return;
    }
    let r =
        Rig::with_policy(&policy(true, &["203.0.113.0/24"], vec![rule(serde_json::json!({"host": "203.0.113.10"}))]));
    r.maps.node_deny.replace(&[Cidr::new(Ipv4Addr::from(L7IP), 32)]).expect("node_deny");
    let denied = r.counter(counter::CUBE_DENY);
    assert_denied(&r, &syn(&r, 42000, L7IP, 443), 42000, L7IP);
    assert_denied(&r, &syn(&r, 42001, L7IP, 80), 42001, L7IP);
    assert_eq!(r.counter(counter::CUBE_DENY), denied + 2);
    assert_eq!(r.counter(counter::CUBE_L7_NEW), 0, "nothing steered to CubeEgress");
    // The neighbour the same allow covers still leaves.
    assert_snat(&r, &syn(&r, 42002, OTHER, 443), 42002);

    r.maps.node_deny.replace(&[]).expect("node_deny");
    assert_steered(&r, &syn(&r, 42003, L7IP, 443), 42003, 443, l7::MARK_HTTPS, l7::SCHEME_HTTPS);
}
