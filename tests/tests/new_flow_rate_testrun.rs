//! The per-sandbox bucket of new connections to CubeEgress (decision R91) under
//! `BPF_PROG_TEST_RUN`, with exact verdicts, counters and bucket state: SYNs that would open a
//! connection through the gateway beyond the bucket are dropped (no session, counted) and the
//! bucket refills at its rate; other sandboxes, other classes of flow, established flows and
//! the gateway's replies never take a token or get dropped by it; a port reused for a new
//! connection takes one (attack: the churning client's ports come round again); the next
//! sandbox version on the interface starts with a full bucket (attack); the bucket survives a
//! reload from the pins (agent restart, slot switch).

use std::{net::Ipv4Addr, time::Duration};

use cubenet_tests::{
    bpffs::BpfFs,
    frames::{Tcp as T, tcp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, SB_IP, VERSION},
};
use cubevs::{
    EgressPolicy, MapLimits, SandboxEntry, prog,
    reaper::monotonic_ns,
    testrun::{TC_ACT_REDIRECT, TC_ACT_SHOT, TestRunOutput},
};
use cubevs_common::{counter, l7};

/// The static L7 address (steered to CubeEgress on 80/443), and one the policy allows plainly.
const L7IP: [u8; 4] = [203, 0, 113, 10];
const PLAIN: [u8; 4] = [203, 0, 113, 11];
const B_IFINDEX: u32 = 101;
const B_VERSION: u32 = 3;
const B_IP: [u8; 4] = [192, 168, 0, 4];

fn policy() -> EgressPolicy {
    let rule: egress_policy::RuleSpec = serde_json::from_value(serde_json::json!(
        {"id": "r", "match": {"host": "203.0.113.10"}, "action": {"allow": true}}
    ))
    .unwrap();
    EgressPolicy { allow_internet_access: true, rules: vec![rule], ..Default::default() }
}

/// A rig whose sandboxes A (the rig's) and B have the L7 policy, at `rate` / `burst`.
fn rig(rate: u32, burst: u32) -> Rig {
    let r = Rig::with_limits(MapLimits { l7_connect_rate: rate, l7_connect_burst: burst, ..MapLimits::default() });
    add_b(&r);
    r.maps.policy.replace(SB_IFINDEX, &policy()).expect("policy a");
    r
}

fn add_b(r: &Rig) {
    r.add_sandbox(&SandboxEntry { ifindex: B_IFINDEX, ip: Ipv4Addr::from(B_IP), version: B_VERSION, id: "b".into() });
    r.maps.policy.replace(B_IFINDEX, &policy()).expect("policy b");
}

fn seg(r: &Rig, ifindex: u32, dst: [u8; 4], t: T) -> TestRunOutput {
    r.run(prog::FROM_CUBE, tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, T { win: 1000, ..t }, b""), ifindex)
}

fn syn(r: &Rig, ifindex: u32, sport: u16) -> TestRunOutput {
    seg(r, ifindex, L7IP, T { sport, dport: 443, seq: 1, syn: true, ..T::default() })
}

fn steered(out: &TestRunOutput) -> bool {
    out.verdict == TC_ACT_REDIRECT && out.mark == l7::MARK_HTTPS
}

fn has_session(r: &Rig, sport: u16) -> bool {
    r.maps.sessions.entries().unwrap().iter().any(|(k, _)| k.sport == sport.to_be())
}

fn available(r: &Rig, ifindex: u32, version: u32) -> u32 {
    r.maps.new_flow.available(ifindex, version, monotonic_ns())
}

/// Burst 4 at 2 a second: four SYNs steered, the fifth dropped without a session and
/// counted; B's SYNs and A's plain SNAT flows pass meanwhile; 750 ms later exactly one more
/// (the second comes 1 s after the bucket emptied: 250 ms for a loaded machine's delays).
#[test]
fn bucket_drops_beyond_burst_and_refills_at_the_rate() {
    if !require_root("new_flow_rate_testrun bucket_drops_beyond_burst_and_refills_at_the_rate") {
        return;
    }
    let r = rig(2, 4);
    assert_eq!(r.maps.new_flow.limits(), (2, 4));
    assert_eq!(available(&r, SB_IFINDEX, VERSION), 4, "a sandbox starts with a full bucket");
    for p in 0..4 {
        assert!(steered(&syn(&r, SB_IFINDEX, 40_000 + p)), "SYN {p} within the burst");
    }
    assert_eq!(available(&r, SB_IFINDEX, VERSION), 0);
    let out = syn(&r, SB_IFINDEX, 40_004);
    assert_eq!((out.verdict, out.mark), (TC_ACT_SHOT, 0), "beyond the burst: dropped, no RST");
    assert!(!has_session(&r, 40_004), "no session for a dropped SYN");
    assert_eq!(r.counter(counter::CUBE_DROP_NEW_FLOW_RATE), 1);
    assert_eq!(r.counter(counter::CUBE_L7_NEW), 4);

    // Another sandbox's bucket is its own; A's plain flows are not bounded by it.
    for p in 0..4 {
        assert!(steered(&syn(&r, B_IFINDEX, 50_000 + p)), "B's SYN {p}");
    }
    let plain = seg(&r, SB_IFINDEX, PLAIN, T { sport: 40_100, dport: 443, seq: 1, syn: true, ..T::default() });
    assert_eq!((plain.verdict, plain.mark), (TC_ACT_REDIRECT, 0), "an SNAT flow of A passes");
    assert_eq!(r.counter(counter::CUBE_DROP_NEW_FLOW_RATE), 1);

    // The refill: one token per 500 ms.
    std::thread::sleep(Duration::from_millis(750));
    assert_eq!(available(&r, SB_IFINDEX, VERSION), 1);
    assert!(steered(&syn(&r, SB_IFINDEX, 40_005)), "refilled one");
    assert_eq!(syn(&r, SB_IFINDEX, 40_006).verdict, TC_ACT_SHOT, "only one");
    assert_eq!(r.counter(counter::CUBE_DROP_NEW_FLOW_RATE), 2);
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(available(&r, SB_IFINDEX, VERSION), 4, "full again, never beyond the burst");
}

/// A's bucket is empty (burst 1, one a second); its open connection's segments both ways, a
/// retransmitted SYN of a connection in progress and the gateway's replies all pass, and none
/// of them takes a token (B's bucket stays full too).
#[test]
fn established_flows_and_replies_never_take_a_token() {
    if !require_root("new_flow_rate_testrun established_flows_and_replies_never_take_a_token") {
        return;
    }
    let r = rig(1, 1);
    assert!(steered(&syn(&r, SB_IFINDEX, 41_000)));
    assert_eq!(available(&r, SB_IFINDEX, VERSION), 0);
    // A retransmission of the same SYN: its session exists (SYN_SENT), no new connection.
    assert!(steered(&syn(&r, SB_IFINDEX, 41_000)), "a retransmitted SYN follows its session");
    let synack = T { sport: 443, dport: 41_000, seq: 900, ack: Some(2), syn: true, win: 1000, ..T::default() };
    let out = r.run(prog::FROM_ENVOY, tcp(r.world_mac, r.up_mac, L7IP, SB_IP, synack, b""), 0);
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "the gateway's SYN-ACK reaches the guest");
    for i in 0..50u32 {
        let out = r.run(
            prog::FROM_CUBE,
            tcp(
                GUEST_MAC,
                GATEWAY_MAC,
                GUEST_IP,
                L7IP,
                T { sport: 41_000, dport: 443, seq: 2 + 10 * i, ack: Some(901), win: 1000, ..T::default() },
                b"0123456789",
            ),
            SB_IFINDEX,
        );
        assert!(steered(&out), "segment {i} of the open connection");
        let reply = T { sport: 443, dport: 41_000, seq: 901, ack: Some(12 + 10 * i), win: 1000, ..T::default() };
        let out = r.run(prog::FROM_ENVOY, tcp(r.world_mac, r.up_mac, L7IP, SB_IP, reply, b""), 0);
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "reply {i}");
    }
    assert_eq!(r.counter(counter::CUBE_DROP_NEW_FLOW_RATE), 0);
    assert_eq!(available(&r, B_IFINDEX, B_VERSION), 1);
    // The bucket is still empty, for new connections only.
    assert_eq!(syn(&r, SB_IFINDEX, 41_001).verdict, TC_ACT_SHOT);
    assert_eq!(r.counter(counter::CUBE_DROP_NEW_FLOW_RATE), 1);
}

/// Attack: a client churning connections comes round to its own ports again while their L7
/// sessions (finished) are still kept; the SYN reusing one opens a new connection through
/// the gateway and must take a token like a new flow (else churn over a few thousand ports
/// bypasses the bucket).
#[test]
fn a_reused_port_takes_a_token() {
    if !require_root("new_flow_rate_testrun a_reused_port_takes_a_token") {
        return;
    }
    let r = rig(1, 2);
    assert!(steered(&syn(&r, SB_IFINDEX, 42_000)));
    // The guest resets it: the session is finished but kept for a while.
    let out = seg(&r, SB_IFINDEX, L7IP, T { sport: 42_000, dport: 443, seq: 2, rst: true, ..T::default() });
    assert!(steered(&out), "the RST follows its session");
    assert!(has_session(&r, 42_000));
    assert!(steered(&syn(&r, SB_IFINDEX, 42_001)), "the second token");
    assert_eq!(available(&r, SB_IFINDEX, VERSION), 0);
    let out = seg(&r, SB_IFINDEX, L7IP, T { sport: 42_000, dport: 443, seq: 7_000, syn: true, ..T::default() });
    assert_eq!((out.verdict, out.mark), (TC_ACT_SHOT, 0), "a reused port's new connection, beyond the bucket");
    assert_eq!(r.counter(counter::CUBE_DROP_NEW_FLOW_RATE), 1);
}

/// Attack: A empties its bucket and is released; the interface is registered again for the
/// next sandbox (a new version, as the agent does on Ensure). The next sandbox must not
/// inherit the empty bucket: its whole burst passes at once.
#[test]
fn a_new_version_on_the_interface_starts_full() {
    if !require_root("new_flow_rate_testrun a_new_version_on_the_interface_starts_full") {
        return;
    }
    let r = rig(1, 5);
    for p in 0..5 {
        assert!(steered(&syn(&r, SB_IFINDEX, 43_000 + p)));
    }
    assert_eq!(syn(&r, SB_IFINDEX, 43_005).verdict, TC_ACT_SHOT);
    r.maps.sessions.delete_of(SB_IFINDEX).unwrap();
    r.maps.sandboxes.unregister(SB_IFINDEX).unwrap();
    let next = VERSION + 1;
    r.add_sandbox(&SandboxEntry { ifindex: SB_IFINDEX, ip: Ipv4Addr::from(SB_IP), version: next, id: "next".into() });
    r.maps.policy.replace(SB_IFINDEX, &policy()).expect("policy");
    assert_eq!(available(&r, SB_IFINDEX, next), 5, "the next sandbox's bucket is full");
    for p in 0..5 {
        assert!(steered(&syn(&r, SB_IFINDEX, 44_000 + p)), "the next sandbox's SYN {p}");
    }
    assert_eq!(r.counter(counter::CUBE_DROP_NEW_FLOW_RATE), 1, "only the old sandbox's drop");
}

/// The bucket is pinned state: a sandbox that emptied it is still bounded after the datapath
/// is loaded again from the pins (agent restart or hand-over; a slot switch adopts the same
/// pins). One a second, burst 50.
#[test]
fn the_bucket_survives_a_reload() {
    if !require_root("new_flow_rate_testrun the_bucket_survives_a_reload") {
        return;
    }
    let bpffs = BpfFs::new();
    let limits = MapLimits { l7_connect_rate: 1, l7_connect_burst: 50, ..MapLimits::default() };
    let mut r = Rig::pinned_with_limits(bpffs.path().join("cubevs"), limits);
    r.maps.policy.replace(SB_IFINDEX, &policy()).expect("policy");
    let steered_before = (0..60u16).filter(|p| steered(&syn(&r, SB_IFINDEX, 10_000 + p))).count();
    assert_eq!(steered_before, 50, "the burst");
    let t0 = std::time::Instant::now();
    r.reload();
    assert_eq!(r.maps.new_flow.limits(), (1, 50));
    // At most the refill of the time the reload took (one a second), never a fresh bucket.
    let refill = t0.elapsed().as_secs() as u32 + 1;
    let left = available(&r, SB_IFINDEX, VERSION);
    assert!(left <= refill, "after the reload the bucket is still empty but its refill: {left} of 50");
    let steered_after = (0..20u16).filter(|p| steered(&syn(&r, SB_IFINDEX, 20_000 + p))).count();
    assert!(steered_after as u32 <= refill, "the reloaded datapath bounds the sandbox: {steered_after} of 20 passed");
}
