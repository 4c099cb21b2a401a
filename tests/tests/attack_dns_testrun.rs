//! Attack on the DNS learner (`BPF_PROG_TEST_RUN`, exact map state): sandbox A tries to keep
//! sandbox B from learning the answer to B's own query, by flooding `dns_query_track_v2` (one
//! map shared by every sandbox, 65,536 entries) with twice its size in queries for an allowed
//! name between B's query and B's response. Property: a sandbox's flood never changes what
//! another sandbox learns (decision R11: the map never evicts, each sandbox's inserts are
//! budgeted, so A's flood stops only A's own tracking).
//!
//! Second attack: a sandbox whose allowed name it controls (its own domain, or any name whose
//! records it can set) answers with always-denied addresses (cloud metadata 169.254.169.254,
//! the node's private network, loopback, the sandbox CIDR). Property: a DNS answer never
//! opens what the baseline always denies (decision R15); public answers are still learned.

use std::net::Ipv4Addr;

use cubenet_tests::{
    dns::{self, Owner, a},
    frames::{self, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    EgressPolicy, SandboxEntry,
    policy::FqdnAllow,
    prog,
    testrun::{TC_ACT_REDIRECT, TC_ACT_SHOT},
};
use cubevs_common::{counter, limits};

const RESOLVER: [u8; 4] = WORLD_IP;
const NAME: &str = "api.example.com";
const B_IFINDEX: u32 = 101;
const ADDR1: [u8; 4] = [203, 0, 113, 10];
const ADDR2: [u8; 4] = [203, 0, 113, 11];
const ADDR3: [u8; 4] = [203, 0, 113, 12];

/// Internet off, the resolver allowed, `api.example.com` allowed by name (both sandboxes).
fn policy() -> EgressPolicy {
    EgressPolicy {
        allow_internet_access: false,
        allow_out: vec![format!("{}/32", Ipv4Addr::from(RESOLVER))],
        allow_fqdn: vec![FqdnAllow { name: NAME.into(), ports: vec![] }],
        ..Default::default()
    }
}

#[test]
fn a_query_flood_never_evicts_another_sandboxs_tracked_query() {
    if !require_root("attack_dns_testrun a_query_flood_never_evicts_another_sandboxs_tracked_query") {
        return;
    }
    let r = Rig::new();
    r.maps.policy.replace(SB_IFINDEX, &policy()).expect("policy A");
    r.maps.sandbox_stats.reset(B_IFINDEX).expect("stats B");
    let b = SandboxEntry { ifindex: B_IFINDEX, ip: Ipv4Addr::new(192, 168, 0, 4), version: 3, id: "sb-b".into() };
    r.maps.sandboxes.register(&b).expect("register B");
    r.maps.policy.replace(B_IFINDEX, &policy()).expect("policy B");

    // Control: B's exchange without a flood is learned.
    let snat = r.dns_query(B_IFINDEX, 40000, 0x0b01, RESOLVER, NAME);
    r.dns_respond(snat, 0x0b01, RESOLVER, NAME, ADDR1);
    assert_eq!(r.learned_ips(B_IFINDEX), [Ipv4Addr::from(ADDR1)]);

    // B asks again; before the answer comes, A sends twice the map's size in queries for the
    // allowed name (every id of two source ports, one session each). The frames are built
    // beforehand: B's query is tracked for QUERY_TIMEOUT_NS (10 s), and building 131,072 DNS
    // frames inside the flood outlasted that on a loaded machine (B's answer then arrives after
    // its query expired, which says nothing about A's flood).
    let flood = 2 * limits::DNS_QUERIES as usize;
    let frames: std::sync::Arc<Vec<Vec<u8>>> = std::sync::Arc::new(
        (0..flood)
            .map(|i| {
                let (gport, id) = (50000 + (i >> 16) as u16, i as u16);
                udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, RESOLVER, gport, 53, &dns::query(id, NAME))
            })
            .collect(),
    );
    let snat = r.dns_query(B_IFINDEX, 40001, 0x0b02, RESOLVER, NAME);
    let asked = std::time::Instant::now();
    assert_eq!(r.maps.policy.dns_queries(Some(B_IFINDEX)).len(), 1, "B's query tracked");
    let tracked0 = r.maps.counters.get(counter::DNS_QUERY_TRACKED).unwrap();
    let fwd0 = r.maps.counters.get(counter::CUBE_NEW_SESSION).unwrap()
        + r.maps.counters.get(counter::CUBE_ESTABLISHED).unwrap();
    let f = frames.clone();
    r.run_many(prog::FROM_CUBE, SB_IFINDEX, flood, move |i| f[i].clone());
    let fwd = r.maps.counters.get(counter::CUBE_NEW_SESSION).unwrap()
        + r.maps.counters.get(counter::CUBE_ESTABLISHED).unwrap()
        - fwd0;
    assert_eq!(fwd, flood as u64, "every flood query was forwarded (the attack happened)");
    assert_eq!(r.maps.policy.dns_queries(Some(B_IFINDEX)).len(), 1, "B's query still tracked");

    // B's genuine answer must still be learned.
    let waited = asked.elapsed();
    assert!(
        waited < std::time::Duration::from_nanos(cubevs_common::dns::QUERY_TIMEOUT_NS),
        "the flood outlasted B's query window ({waited:?}): machine too loaded to judge the property"
    );
    r.dns_respond(snat, 0x0b02, RESOLVER, NAME, ADDR2);
    assert_eq!(r.maps.counters.get(counter::DNS_RESP_UNSOLICITED).unwrap(), 0, "B's answer taken as unsolicited");
    let mut l = r.learned_ips(B_IFINDEX);
    l.sort();
    assert_eq!(l, [Ipv4Addr::from(ADDR1), Ipv4Addr::from(ADDR2)], "B learns its answer despite A's flood");

    // After the flood B's next query is still tracked (A cannot fill the map) and learned.
    let snat = r.dns_query(B_IFINDEX, 40002, 0x0b03, RESOLVER, NAME);
    r.dns_respond(snat, 0x0b03, RESOLVER, NAME, ADDR3);
    let mut l = r.learned_ips(B_IFINDEX);
    l.sort();
    assert_eq!(l, [ADDR1, ADDR2, ADDR3].map(Ipv4Addr::from), "B learns a query sent after A's flood");

    // How: A's budget refused most of its flood (forwarded untracked) and A holds no more than
    // it was let track (R11).
    let tracked = r.maps.counters.get(counter::DNS_QUERY_TRACKED).unwrap() - tracked0 - 1;
    let over = r.maps.counters.get(counter::DNS_QUERY_OVER_BUDGET).unwrap();
    assert_eq!(tracked + over, flood as u64, "every flood query was tracked or refused by A's budget");
    assert!(over > 0, "A's budget refused part of the flood");
    let a_tracked = r.maps.policy.dns_queries(Some(SB_IFINDEX)).len();
    assert!(a_tracked as u64 <= tracked, "A holds only what it was let track: {a_tracked}");
}

#[test]
fn a_dns_answer_never_opens_an_always_denied_address() {
    if !require_root("attack_dns_testrun a_dns_answer_never_opens_an_always_denied_address") {
        return;
    }
    let r = Rig::new();
    r.maps.policy.replace(SB_IFINDEX, &policy()).expect("policy");
    // Every always-denied range (`cubevs::policy::BASELINE_DENY`), then a public control.
    let denied: [[u8; 4]; 6] =
        [[169, 254, 169, 254], [10, 0, 0, 5], [127, 0, 0, 1], [172, 16, 0, 1], [192, 168, 0, 4], [172, 31, 255, 254]];
    let answers: Vec<_> = denied.iter().copied().chain([ADDR1]).map(|ip| a(Owner::Question, ip, 600)).collect();
    let snat = r.dns_query(SB_IFINDEX, 40000, 0x0a01, RESOLVER, NAME);
    let msg = dns::response(0x0a01, NAME, &answers);
    let out = r.world(udp(r.world_mac, r.up_mac, RESOLVER, NODE_IP, 53, snat, &msg));
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "the answer itself is delivered to the guest");
    assert_eq!(r.learned_ips(SB_IFINDEX), [Ipv4Addr::from(ADDR1)], "only the public answer is learned");
    assert_eq!(r.maps.counters.get(counter::DNS_RESP_NOT_PUBLIC).unwrap(), denied.len() as u64);

    // The guest then dials them: every always-denied one is refused, the public one leaves.
    for (i, ip) in denied.iter().enumerate() {
        // Loopback is no flow's destination at all: dropped before the policy (R47).
        let reason = if ip[0] == 127 { counter::CUBE_DROP_PROTO } else { counter::CUBE_DENY };
        let deny0 = r.maps.counters.get(reason).unwrap();
        let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, *ip, 41000 + i as u16, 80, b"GET / HTTP/1.0\r\n\r\n");
        let v = r.run(prog::FROM_CUBE, f, SB_IFINDEX).verdict;
        assert_eq!(v, TC_ACT_SHOT, "{} reached through a DNS answer", Ipv4Addr::from(*ip));
        assert_eq!(r.maps.counters.get(reason).unwrap(), deny0 + 1, "{}", Ipv4Addr::from(*ip));
    }
    let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, ADDR1, 42000, 80, b"x");
    assert_eq!(r.run(prog::FROM_CUBE, f, SB_IFINDEX).verdict, TC_ACT_REDIRECT, "the learned public address");
    let to_denied = r.maps.sessions.list().unwrap().into_iter().filter(|s| denied.contains(&s.remote_ip.octets()));
    assert_eq!(to_denied.count(), 0, "no session to an always-denied address");
}

/// The node's always-denied list (`node_deny`, decision R30) against every way a sandbox is
/// allowed somewhere: a sandbox allowed `0.0.0.0/0` and `100.64.0.0/10` statically, and a name
/// whose answer it controls, answers 100.100.100.200 (Alibaba Cloud's metadata address).
/// Property: the answer is not learned (counted as `dns_not_public`), and neither the static
/// allows nor anything else lets a new flow reach it; with the list emptied in place the very
/// same answer is learned and the flows leave, so the list is what denied them.
#[test]
fn the_nodes_always_denied_list_beats_cidr_allows_and_dns_answers() {
    if !require_root("attack_dns_testrun the_nodes_always_denied_list_beats_cidr_allows_and_dns_answers") {
        return;
    }
    const METADATA: [u8; 4] = [100, 100, 100, 200];
    let r = Rig::new();
    r.maps.policy.replace(SB_IFINDEX, &policy()).expect("policy");
    let list = [cubevs::Cidr::new(Ipv4Addr::from(METADATA), 32), cubevs::Cidr::new(Ipv4Addr::new(203, 0, 113, 99), 32)];
    r.maps.node_deny.replace(&list).expect("node_deny");
    assert_eq!(r.maps.node_deny.list(), list.to_vec());

    // A DNS answer: the listed address is skipped, the public one learned.
    let not_public0 = r.maps.counters.get(counter::DNS_RESP_NOT_PUBLIC).unwrap();
    let snat = r.dns_query(SB_IFINDEX, 40000, 0x0b01, RESOLVER, NAME);
    let msg = dns::response(0x0b01, NAME, &[a(Owner::Question, METADATA, 600), a(Owner::Question, ADDR1, 600)]);
    let out = r.world(udp(r.world_mac, r.up_mac, RESOLVER, NODE_IP, 53, snat, &msg));
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "the answer itself is delivered to the guest");
    assert_eq!(r.learned_ips(SB_IFINDEX), [Ipv4Addr::from(ADDR1)], "only the public answer is learned");
    assert_eq!(r.maps.counters.get(counter::DNS_RESP_NOT_PUBLIC).unwrap(), not_public0 + 1);
    let dial = |sport: u16| {
        let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, METADATA, sport, 80, b"GET /latest/meta-data/");
        r.run(prog::FROM_CUBE, f, SB_IFINDEX).verdict
    };
    assert_eq!(dial(41000), TC_ACT_SHOT, "the metadata address through an unlearned answer");

    // Static allows of every width, L7 included: still denied.
    for allow in ["0.0.0.0/0", "100.64.0.0/10", "100.100.100.200/32"] {
        let p = EgressPolicy { allow_internet_access: true, allow_out: vec![allow.into()], ..policy() };
        r.maps.policy.replace(SB_IFINDEX, &p).expect("policy");
        let deny0 = r.maps.counters.get(counter::CUBE_DENY).unwrap();
        assert_eq!(dial(41001), TC_ACT_SHOT, "allow_out {allow} reached the always-denied address");
        assert_eq!(r.maps.counters.get(counter::CUBE_DENY).unwrap(), deny0 + 1, "{allow}");
        // TCP: refused like any denied SYN (the guest gets a RST), counted as a deny.
        let syn = frames::Tcp { sport: 41002, dport: 80, seq: 1, syn: true, win: 64240, ..Default::default() };
        r.run(prog::FROM_CUBE, frames::tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, METADATA, syn, &[]), SB_IFINDEX);
        assert_eq!(r.maps.counters.get(counter::CUBE_DENY).unwrap(), deny0 + 2, "TCP under allow_out {allow}");
        // A control address the same allow covers leaves.
        if allow != "100.100.100.200/32" {
            let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, [100, 100, 100, 201], 41003, 80, b"x");
            assert_eq!(r.run(prog::FROM_CUBE, f, SB_IFINDEX).verdict, TC_ACT_REDIRECT, "control under {allow}");
        }
    }
    let to_listed = r.maps.sessions.list().unwrap().into_iter().filter(|s| s.remote_ip.octets() == METADATA);
    assert_eq!(to_listed.count(), 0, "no session to the always-denied address");

    // The list emptied in place: the same allow opens it, the same answer is learned.
    r.maps.node_deny.replace(&[]).expect("node_deny");
    assert!(r.maps.node_deny.list().is_empty());
    assert_eq!(dial(41004), TC_ACT_REDIRECT, "without the list allow_out 100.100.100.200/32 applies");
    r.maps.policy.replace(SB_IFINDEX, &policy()).expect("policy");
    let snat = r.dns_query(SB_IFINDEX, 40001, 0x0b02, RESOLVER, NAME);
    let msg = dns::response(0x0b02, NAME, &[a(Owner::Question, METADATA, 600)]);
    r.world(udp(r.world_mac, r.up_mac, RESOLVER, NODE_IP, 53, snat, &msg));
    assert!(r.learned_ips(SB_IFINDEX).contains(&Ipv4Addr::from(METADATA)), "without the list it is learned");
    assert_eq!(dial(41005), TC_ACT_REDIRECT, "the learned address without the list");
}
