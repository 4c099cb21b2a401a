//! The per-sandbox live-session budget (decisions Q1-Q3) under `BPF_PROG_TEST_RUN`: exact
//! verdicts, counters and `session_opened` / `session_closed` state after each step. Each test
//! attacks the isolation property: a sandbox at its budget must not get one more session, and
//! must not cost any other sandbox (or the next owner of its interface) a single new flow.

use std::{net::Ipv4Addr, time::Duration};

use cubenet_tests::{
    frames::{Tcp as T, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, SB_IP, VERSION},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    EgressPolicy, MapLimits, QuotaUsage, SandboxEntry, prog,
    reaper::{self, Timeouts},
    testrun::{TC_ACT_REDIRECT, TC_ACT_SHOT},
};
use cubevs_common::{counter, quota::COUNTED};

/// Budget of the rig sandboxes in these tests.
const BUDGET: u32 = 8;
const B_IFINDEX: u32 = 101;
const B_VERSION: u32 = 3;

fn rig() -> Rig {
    let r = Rig::with_limits(MapLimits { sessions_per_sandbox: BUDGET, ..Default::default() });
    r.maps
        .sandboxes
        .register(&SandboxEntry {
            ifindex: B_IFINDEX,
            ip: Ipv4Addr::new(192, 168, 0, 4),
            version: B_VERSION,
            id: "b".into(),
        })
        .expect("register b");
    r.maps.sandbox_stats.reset(B_IFINDEX).expect("stats b");
    let open = EgressPolicy { allow_internet_access: true, ..Default::default() };
    r.maps.policy.replace(B_IFINDEX, &open).expect("policy b");
    r.maps.policy.replace(SB_IFINDEX, &open).expect("policy a");
    r
}

fn guest_udp(sport: u16) -> Vec<u8> {
    udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, sport, 53, b"q")
}

fn guest_syn(sport: u16, seq: u32) -> Vec<u8> {
    tcp(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP,
        WORLD_IP,
        T { sport, dport: 80, seq, syn: true, win: 1000, ..T::default() },
        b"",
    )
}

fn usage(r: &Rig, ifindex: u32, version: u32) -> Option<QuotaUsage> {
    r.maps.sessions.quota_usage(ifindex, version).expect("quota usage")
}

fn quota_drops(r: &Rig) -> u64 {
    r.maps.counters.get(counter::CUBE_DROP_SESSION_QUOTA).expect("counter")
}

fn sandbox_quota_drops(r: &Rig, ifindex: u32) -> u64 {
    r.maps.sandbox_stats.get(ifindex).expect("stats").expect("entry").drops["session_quota"]
}

/// A at its budget: new UDP and TCP flows dropped and counted (globally and on A only), no
/// session made; A's existing flows and B's new flows pass; once the reaper expired A's flows
/// A opens again.
#[test]
fn budget_drops_only_the_sandbox_at_it() {
    if !require_root("session_quota_testrun budget_drops_only_the_sandbox_at_it") {
        return;
    }
    let r = rig();
    assert_eq!(usage(&r, SB_IFINDEX, VERSION), None, "no entry before A's first flow");
    for i in 0..BUDGET as u16 {
        assert_eq!(r.cube(guest_udp(10_000 + i)).verdict, TC_ACT_REDIRECT, "flow {i} within the budget");
    }
    assert_eq!(usage(&r, SB_IFINDEX, VERSION), Some(QuotaUsage { opened: BUDGET as u64, closed: 0 }));
    assert!(r.maps.sessions.entries().unwrap().iter().all(|(_, s)| s.quota == COUNTED));

    // Over the budget: a new UDP flow and a TCP SYN are dropped (no RST, no session).
    let out = r.cube(guest_udp(20_000));
    assert_eq!(out.verdict, TC_ACT_SHOT);
    let out = r.cube(guest_syn(20_001, 1));
    assert_eq!(out.verdict, TC_ACT_SHOT);
    assert_eq!(quota_drops(&r), 2);
    assert_eq!(sandbox_quota_drops(&r, SB_IFINDEX), 2);
    assert_eq!(sandbox_quota_drops(&r, B_IFINDEX), 0);
    assert_eq!(r.maps.sessions.counts(), (BUDGET as usize, BUDGET as usize));
    assert_eq!(usage(&r, SB_IFINDEX, VERSION), Some(QuotaUsage { opened: BUDGET as u64, closed: 0 }));

    // A's existing flows are unaffected; B's new flows pass and are charged to B only.
    assert_eq!(r.cube(guest_udp(10_000)).verdict, TC_ACT_REDIRECT, "A's established flow");
    for i in 0..BUDGET as u16 {
        assert_eq!(r.run(prog::FROM_CUBE, guest_udp(7000 + i), B_IFINDEX).verdict, TC_ACT_REDIRECT, "B flow {i}");
    }
    assert_eq!(usage(&r, B_IFINDEX, B_VERSION), Some(QuotaUsage { opened: BUDGET as u64, closed: 0 }));
    assert_eq!(quota_drops(&r), 2);

    // The reaper expires the unreplied flows (30 s): every charge comes back, A opens again.
    let now = reaper::monotonic_ns() + Duration::from_secs(31).as_nanos() as u64;
    let swept = reaper::sweep(&r.maps.sessions, &Timeouts::default(), now).expect("sweep");
    assert_eq!(swept.removed, 2 * BUDGET as usize);
    assert_eq!(usage(&r, SB_IFINDEX, VERSION), Some(QuotaUsage { opened: BUDGET as u64, closed: BUDGET as u64 }));
    assert_eq!(usage(&r, B_IFINDEX, B_VERSION).unwrap().live(), 0);
    for i in 0..BUDGET as u16 {
        assert_eq!(r.cube(guest_udp(30_000 + i)).verdict, TC_ACT_REDIRECT, "A flow {i} after the sweep");
    }
    assert_eq!(r.cube(guest_udp(40_000)).verdict, TC_ACT_SHOT, "the budget holds again");
    assert_eq!(usage(&r, SB_IFINDEX, VERSION).unwrap().live(), BUDGET as i64);

    // A userspace delete of one session (e.g. a flush) gives exactly one charge back.
    let (k, s) = r.maps.sessions.entries().unwrap().into_iter().find(|(_, s)| s.vm_ifindex == SB_IFINDEX).unwrap();
    r.maps.sessions.delete(&k, &s).unwrap();
    r.maps.sessions.delete(&k, &s).unwrap();
    assert_eq!(usage(&r, SB_IFINDEX, VERSION).unwrap().live(), BUDGET as i64 - 1, "a second delete of it is no-op");
    assert_eq!(r.cube(guest_udp(40_001)).verdict, TC_ACT_REDIRECT);
    // delete_of (the agent's release path) gives back all of A's charges, none of B's.
    r.maps.sessions.delete_of(SB_IFINDEX).unwrap();
    assert_eq!(usage(&r, SB_IFINDEX, VERSION).unwrap().live(), 0);
}

/// A released interface re-registered with a new version starts at 0 while the old version's
/// sessions (at the budget) still wait for the reaper; the old version's entries are gone and
/// purging its stale sessions charges nothing to the new owner.
#[test]
fn new_version_starts_at_zero() {
    if !require_root("session_quota_testrun new_version_starts_at_zero") {
        return;
    }
    let r = rig();
    for i in 0..BUDGET as u16 {
        assert_eq!(r.cube(guest_udp(10_000 + i)).verdict, TC_ACT_REDIRECT);
    }
    assert_eq!(r.cube(guest_udp(20_000)).verdict, TC_ACT_SHOT);
    // Release, then the next sandbox on the same TAP (new version, same address).
    r.maps.sandboxes.unregister(SB_IFINDEX).unwrap();
    assert_eq!(usage(&r, SB_IFINDEX, VERSION), None, "released version's entries removed");
    let next = SandboxEntry { ifindex: SB_IFINDEX, ip: Ipv4Addr::from(SB_IP), version: VERSION + 1, id: "next".into() };
    r.maps.sandboxes.register(&next).unwrap();
    assert_eq!(r.maps.sessions.counts().0, BUDGET as usize, "old sessions not purged yet");
    for i in 0..BUDGET as u16 {
        assert_eq!(r.cube(guest_udp(10_000 + i)).verdict, TC_ACT_REDIRECT, "new owner's flow {i}");
    }
    assert_eq!(r.cube(guest_udp(20_000)).verdict, TC_ACT_SHOT, "new owner at its own budget");
    assert_eq!(usage(&r, SB_IFINDEX, VERSION + 1), Some(QuotaUsage { opened: BUDGET as u64, closed: 0 }));
    // The reaper purges the old version's sessions: nothing is given back to the new owner.
    let swept = reaper::sweep(&r.maps.sessions, &Timeouts::default(), reaper::monotonic_ns()).unwrap();
    assert_eq!(swept.stale, BUDGET as usize);
    assert_eq!(usage(&r, SB_IFINDEX, VERSION + 1), Some(QuotaUsage { opened: BUDGET as u64, closed: 0 }));
    assert_eq!(usage(&r, SB_IFINDEX, VERSION), None);
    // Re-registering a different version directly (no unregister) also drops the old entries.
    let third = SandboxEntry { version: VERSION + 2, ..next };
    r.maps.sandboxes.register(&third).unwrap();
    assert_eq!(usage(&r, SB_IFINDEX, VERSION + 1), None);
    assert!(r.maps.sessions.quota_list().unwrap().iter().all(|&(i, v, _)| i != SB_IFINDEX || v == VERSION + 2));
}

/// The kernel's own delete (a guest reopening a finished port after policy denied its
/// destination) gives the charge back with an atomic subtract.
#[test]
fn kernel_delete_refunds() {
    if !require_root("session_quota_testrun kernel_delete_refunds") {
        return;
    }
    let r = rig();
    let sport = 40_000;
    assert_eq!(r.cube(guest_syn(sport, 100)).verdict, TC_ACT_REDIRECT);
    let port = r.maps.sessions.list().unwrap()[0].snat_port;
    let world = |t: T| tcp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, T { sport: 80, dport: port, win: 1000, ..t }, b"");
    let synack = T { seq: 500, ack: Some(101), syn: true, ..T::default() };
    assert_eq!(r.world(world(synack)).verdict, TC_ACT_REDIRECT);
    let ack = T { sport, dport: 80, seq: 101, ack: Some(501), win: 1000, ..T::default() };
    assert_eq!(r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, ack, b"")).verdict, TC_ACT_REDIRECT);
    assert_eq!(r.maps.sessions.list().unwrap()[0].state, "established");
    assert_eq!(usage(&r, SB_IFINDEX, VERSION), Some(QuotaUsage { opened: 1, closed: 0 }));
    // Policy now denies the world; the guest reuses the port: the datapath deletes the session.
    r.maps.policy.replace(SB_IFINDEX, &EgressPolicy { allow_internet_access: false, ..Default::default() }).unwrap();
    let out = r.cube(guest_syn(sport, 9000));
    assert_eq!(&out.data[..6], &GUEST_MAC, "RST back to the guest");
    assert_eq!(r.maps.sessions.counts(), (0, 0));
    assert_eq!(usage(&r, SB_IFINDEX, VERSION), Some(QuotaUsage { opened: 0, closed: 0 }));
}

/// Sessions that exist when the quota is switched in (made by an object without it: `quota`
/// 0) are never subtracted, so deleting them cannot underflow the budget or hand a sandbox
/// more room than it has.
#[test]
fn uncounted_sessions_are_not_subtracted() {
    if !require_root("session_quota_testrun uncounted_sessions_are_not_subtracted") {
        return;
    }
    let r = rig();
    // An older object's sessions of A (restored the way a pre-quota datapath left them).
    let old = r.uncharged_udp_sessions(4);
    assert_eq!(r.maps.sessions.insert_batch(&old).unwrap(), 4);
    // The new object charges only what it creates: A still gets its whole budget.
    for i in 0..BUDGET as u16 {
        assert_eq!(r.cube(guest_udp(10_000 + i)).verdict, TC_ACT_REDIRECT);
    }
    assert_eq!(r.cube(guest_udp(20_000)).verdict, TC_ACT_SHOT);
    // Deleting the uncounted sessions gives nothing back (no underflow, no extra room).
    for (k, s) in &old {
        r.maps.sessions.delete(k, s).unwrap();
    }
    assert_eq!(usage(&r, SB_IFINDEX, VERSION), Some(QuotaUsage { opened: BUDGET as u64, closed: 0 }));
    assert_eq!(r.cube(guest_udp(20_001)).verdict, TC_ACT_SHOT);
}

/// The budget is capped at half of the session maps (one sandbox never holds more); 0 turns
/// it off; session maps too small to halve are refused.
#[test]
fn budget_limits() {
    let l = MapLimits { sessions: 1024, sessions_per_sandbox: 100_000, ..Default::default() };
    assert_eq!(l.session_budget().unwrap(), 512);
    assert_eq!(MapLimits::default().session_budget().unwrap(), 16_384);
    assert!(MapLimits::default().session_budget().unwrap() < cubevs_common::snat::PORT_SPAN / 2);
    assert_eq!(MapLimits { sessions_per_sandbox: 0, ..Default::default() }.session_budget().unwrap(), 0);
    let e = MapLimits { sessions: 1, ..Default::default() }.session_budget().unwrap_err().to_string();
    assert!(e.contains("limits.sessions"), "{e}");
}
