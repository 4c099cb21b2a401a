//! Attack on FQDN allow (`BPF_PROG_TEST_RUN`, exact map state): the datapath matched a guest's
//! query against the sandbox's FQDN patterns by a 64-bit FNV-1a hash of the name alone. FNV is
//! not a keyed or collision-resistant hash: a lattice reduction over the per-byte XOR steps
//! (seconds in Python) gives a 16-byte label `L` such that `L.attacker.example` hashes exactly
//! like `github.com`. A sandbox allowed only `*.github.com` (internet off, a public resolver
//! allowed) asks that resolver for `www.L.attacker.example`, whose answer the attacker's own
//! name server sets to any address: the datapath tracked the query as a `*.github.com` name
//! and learned the answer, and the sandbox reached the attacker's address (decision R48).
//! Property: a name is allowed only when it *is* an allowed name (or a subdomain of one).

use std::net::Ipv4Addr;

use cubenet_tests::{
    dns::{self, Owner, a},
    frames::{Tcp as T, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    EgressPolicy,
    policy::FqdnAllow,
    testrun::{TC_ACT_OK, TC_ACT_REDIRECT},
};
use cubevs_common::counter;

const RESOLVER: [u8; 4] = WORLD_IP;
/// The attacker's server, and the genuine name's address (TEST-NET-3, denied by CIDR).
const EVIL: [u8; 4] = [203, 0, 113, 66];
const GITHUB: [u8; 4] = [203, 0, 113, 10];

/// FNV-1a 64 of `L.attacker.example` taken last byte first (the datapath's `name_hash`) equals
/// that of `github.com` (found with LLL; checked by [`fnv_suffix_hash`] below).
const COLLIDING_LABEL: [u8; 16] =
    [0xfc, 0x05, 0x0d, 0x04, 0x38, 0x00, 0x0f, 0x0e, 0x05, 0x02, 0x06, 0x1f, 0x03, 0x02, 0x1d, 0x0c];

/// `name_hash` of a name given as labels (leftmost first, raw bytes).
fn fnv_suffix_hash(labels: &[&[u8]]) -> u64 {
    let mut h = cubevs_common::dns::FNV_BASIS;
    for l in labels.iter().rev() {
        for &b in l.iter().rev() {
            h = (h ^ u64::from(b.to_ascii_lowercase())).wrapping_mul(0x0000_0100_0000_01b3);
        }
        h = (h ^ l.len() as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `msg` (built for `www.x.attacker.example`) with its `x` label replaced by the colliding one.
fn with_colliding_label(msg: Vec<u8>) -> Vec<u8> {
    // Header (12) + `03 www` (4): the `01 78` label sits at 16.
    assert_eq!(&msg[16..18], &[1, b'x']);
    let mut m = msg[..16].to_vec();
    m.push(COLLIDING_LABEL.len() as u8);
    m.extend_from_slice(&COLLIDING_LABEL);
    m.extend_from_slice(&msg[18..]);
    m
}

fn syn_allowed(r: &Rig, gport: u16, dst: [u8; 4]) -> bool {
    let syn = T { sport: gport, dport: 443, seq: 1, syn: true, win: 1000, ..Default::default() };
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, syn, b""));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    out.data[26..30] == NODE_IP
}

/// Sends `query` from `gport` to the resolver and its `response` back; returns the response's
/// verdict.
fn ask(r: &Rig, gport: u16, query: &[u8], response: &[u8]) -> u32 {
    let out = r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, RESOLVER, gport, 53, query));
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "query forwarded");
    let snat = r.maps.sessions.list().unwrap().into_iter().find(|s| s.guest_port == gport).expect("session").snat_port;
    r.world(udp(r.world_mac, r.up_mac, RESOLVER, NODE_IP, 53, snat, response)).verdict
}

#[test]
fn a_name_whose_hash_collides_with_an_allowed_pattern_is_not_allowed() {
    if !require_root("a_name_whose_hash_collides_with_an_allowed_pattern_is_not_allowed") {
        return;
    }
    assert_eq!(
        fnv_suffix_hash(&[&COLLIDING_LABEL, b"attacker", b"example"]),
        cubevs_common::dns::name_hash("github.com"),
        "the colliding label no longer collides"
    );
    let r = Rig::with_policy(&EgressPolicy {
        allow_internet_access: false,
        allow_out: vec![format!("{}/32", Ipv4Addr::from(RESOLVER))],
        allow_fqdn: vec![FqdnAllow { name: "*.github.com".into(), ports: vec![] }],
        ..Default::default()
    });
    let q = with_colliding_label(dns::query(0x4242, "www.x.attacker.example"));
    let resp = with_colliding_label(dns::response(0x4242, "www.x.attacker.example", &[a(Owner::Question, EVIL, 60)]));
    let not_allowed = r.counter(counter::DNS_QUERY_NOT_ALLOWED);
    assert_eq!(ask(&r, 5300, &q, &resp), TC_ACT_REDIRECT, "the response still reaches the guest");
    assert_eq!(r.counter(counter::DNS_QUERY_NOT_ALLOWED), not_allowed + 1, "the forged name was taken as allowed");
    let learned: Vec<Ipv4Addr> = r.maps.policy.learned(Some(SB_IFINDEX)).iter().map(|e| e.ip).collect();
    assert!(learned.is_empty(), "learned {learned:?} for a name no pattern allows");
    assert!(!syn_allowed(&r, 40000, EVIL), "the sandbox reached the attacker's address");

    // The genuine name is still learned and reached.
    let q = dns::query(0x4343, "api.github.com");
    let resp = dns::response(0x4343, "api.github.com", &[a(Owner::Question, GITHUB, 60)]);
    assert_ne!(ask(&r, 5301, &q, &resp), TC_ACT_OK);
    let learned: Vec<Ipv4Addr> = r.maps.policy.learned(Some(SB_IFINDEX)).iter().map(|e| e.ip).collect();
    assert_eq!(learned, vec![Ipv4Addr::from(GITHUB)]);
    assert!(syn_allowed(&r, 40001, GITHUB));
}
