//! The node-wide reserved floor (decision Q4) under `BPF_PROG_TEST_RUN`, with session maps of
//! 64 entries: colluding sandboxes flood new flows until the node count is at its ceiling, and
//! a victim sandbox still opens its whole floor (exact verdicts, counters, per-sandbox drops and
//! `session_floor` state). Without the floor (main before Q4), the four attackers' budgets
//! (4 × 16) fill the 64-entry maps and every new flow of the victim is dropped (`drop_no_snat`).

use std::net::Ipv4Addr;

use cubenet_tests::{
    frames::udp,
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX},
    topology::WORLD_IP,
};
use cubevs::{
    EgressPolicy, FloorState, MapLimits, QuotaUsage, SandboxEntry, prog,
    quota::{floor_ceiling, floor_margin},
    reaper::{self, Timeouts},
    testrun::{TC_ACT_REDIRECT, TC_ACT_SHOT},
};
use cubevs_common::{counter, quota::COUNTED};

/// Session map capacity (both directions).
const CAP: u32 = 64;
/// Per-sandbox budget.
const BUDGET: u32 = 16;
/// Per-sandbox floor.
const FLOOR: u32 = 4;
/// Attackers besides the rig's sandbox A (`SB_IFINDEX`).
const ATTACKERS: [u32; 3] = [101, 102, 103];
/// The victim.
const VICTIM: u32 = 104;

fn register(r: &Rig, ifindex: u32, version: u32) {
    let ip = Ipv4Addr::new(192, 168, 0, (ifindex - 97) as u8);
    r.maps.sandboxes.register(&SandboxEntry { ifindex, ip, version, id: format!("sb{ifindex}") }).expect("register");
    r.maps.sandbox_stats.reset(ifindex).expect("stats");
    let open = EgressPolicy { allow_internet_access: true, ..Default::default() };
    r.maps.policy.replace(ifindex, &open).expect("policy");
}

/// A (rig sandbox), three more attackers and the victim, all with open policies.
fn rig() -> Rig {
    let limits = MapLimits {
        sessions: CAP,
        sandboxes: 8,
        sessions_per_sandbox: BUDGET,
        session_floor: FLOOR,
        ..Default::default()
    };
    assert_eq!(limits.session_floor(floor_margin()).unwrap(), FLOOR, "floor not capped by these sizes");
    let r = Rig::with_limits(limits);
    let open = EgressPolicy { allow_internet_access: true, ..Default::default() };
    r.maps.policy.replace(SB_IFINDEX, &open).expect("policy a");
    for i in ATTACKERS {
        register(&r, i, 1);
    }
    register(&r, VICTIM, 1);
    r
}

fn guest_udp(sport: u16) -> Vec<u8> {
    udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, sport, 53, b"q")
}

/// Sends `n` new UDP flows from `ifindex` (ports from `base`); returns how many were forwarded.
fn flood(r: &Rig, ifindex: u32, base: u16, n: u16) -> u32 {
    (0..n).filter(|i| r.run(prog::FROM_CUBE, guest_udp(base + i), ifindex).verdict == TC_ACT_REDIRECT).count() as u32
}

fn floor(r: &Rig) -> FloorState {
    r.maps.sessions.floor_state().expect("floor state").expect("floor map")
}

fn drops(r: &Rig, ifindex: u32, reason: &str) -> u64 {
    r.maps.sandbox_stats.get(ifindex).expect("stats").expect("entry").drops[reason]
}

fn live_of(r: &Rig, ifindex: u32) -> usize {
    r.maps.sessions.entries().unwrap().iter().filter(|(_, s)| s.vm_ifindex == ifindex).count()
}

/// Node-wide count = the node-charged sessions in the map (no drift).
fn assert_no_drift(r: &Rig) {
    let charged = r.maps.sessions.entries().unwrap().iter().filter(|(_, s)| s.node_quota == COUNTED).count();
    assert_eq!(floor(r).usage.live(), charged as i64, "node count = node-charged sessions in the map");
}

/// Four colluding sandboxes flood until the node count is at its ceiling; the victim still
/// opens exactly its floor, and one flow more is refused as `drop_node_sessions`. Once the
/// flood expires the shared room is free again, with no drift.
#[test]
fn colluders_cannot_take_the_victims_floor() {
    if !require_root("session_floor_testrun colluders_cannot_take_the_victims_floor") {
        return;
    }
    let r = rig();
    let margin = floor_margin();
    // Five registered sandboxes: ceiling = 64 - 5 × 4 - CPUs.
    let ceiling = floor_ceiling(CAP, 5, FLOOR, margin);
    assert_eq!(ceiling, CAP - 5 * FLOOR - margin);
    assert!(ceiling >= 2 * BUDGET, "the arithmetic below assumes A and B fit under the ceiling");
    assert_eq!(floor(&r), FloorState { usage: QuotaUsage::default(), floor: FLOOR, ceiling });

    // The flood: every attacker tries 20 new flows, one after the other.
    let attackers = [SB_IFINDEX, ATTACKERS[0], ATTACKERS[1], ATTACKERS[2]];
    let mut n = 0u32; // node-wide live sessions, as the datapath must count them
    let mut expect_node_drops = 0u64;
    for (k, &a) in attackers.iter().enumerate() {
        let got = flood(&r, a, 10_000, 20);
        // The floor always; above it while the node count is under the ceiling; never past
        // the budget.
        let mut mine = 0;
        let mut node_drops = 0;
        for _ in 0..20 {
            if mine < FLOOR || (mine < BUDGET && n < ceiling) {
                mine += 1;
                n += 1;
            } else if mine < BUDGET {
                node_drops += 1;
            }
        }
        assert_eq!(got, mine, "attacker {k} sessions");
        assert_eq!(live_of(&r, a), mine as usize);
        assert_eq!(drops(&r, a, "node_sessions"), node_drops, "attacker {k} node drops");
        assert_eq!(drops(&r, a, "session_quota"), u64::from(20 - mine - node_drops as u32));
        expect_node_drops += node_drops;
    }
    // The flood reached the ceiling: the attackers hold more than the ceiling only by floors.
    assert!(n >= ceiling, "the flood must reach the ceiling ({n} < {ceiling})");
    assert!(expect_node_drops > 0);
    assert_eq!(floor(&r).usage.live(), i64::from(n));
    assert_eq!(r.maps.counters.get(counter::CUBE_DROP_NODE_SESSIONS).unwrap(), expect_node_drops);
    assert_no_drift(&r);

    // The victim opens its whole floor, then one more is refused (node ceiling, not the map).
    assert_eq!(flood(&r, VICTIM, 20_000, FLOOR as u16), FLOOR, "victim's floor");
    assert_eq!(r.run(prog::FROM_CUBE, guest_udp(20_100), VICTIM).verdict, TC_ACT_SHOT);
    assert_eq!(drops(&r, VICTIM, "node_sessions"), 1);
    assert_eq!(drops(&r, VICTIM, "no_snat_port"), 0, "the map had room");
    assert_eq!(r.maps.counters.get(counter::CUBE_DROP_NO_SNAT).unwrap(), 0);
    assert_eq!(r.maps.sessions.counts().0 as u32, n + FLOOR);
    assert!(n + FLOOR < CAP);
    // The victim's established flows keep going.
    assert_eq!(r.run(prog::FROM_CUBE, guest_udp(20_000), VICTIM).verdict, TC_ACT_REDIRECT);
    assert_no_drift(&r);

    // The flood expires (UDP unreplied, 30 s): the node count returns to 0 exactly.
    let now = reaper::monotonic_ns() + 31_000_000_000;
    let swept = reaper::sweep(&r.maps.sessions, &Timeouts::default(), now).expect("sweep");
    assert_eq!(swept.removed as u32, n + FLOOR);
    let st = floor(&r);
    assert_eq!((st.usage.opened, st.usage.closed), (u64::from(n + FLOOR), u64::from(n + FLOOR)));
    assert_eq!(st.ceiling, ceiling, "the sweep recounts the same registrations");
    // The shared room is free again: the last attacker (refused above its floor before) now
    // gets its whole budget.
    let last = ATTACKERS[2];
    assert_eq!(flood(&r, last, 30_000, BUDGET as u16), BUDGET);
    assert_eq!(floor(&r).usage.live(), i64::from(BUDGET));
    assert_no_drift(&r);
}

/// The ceiling follows registrations: a new sandbox reserves its floor, a release frees it at
/// the next recount (F14);
/// a node over a lowered ceiling refuses sandboxes above their floor until it falls.
#[test]
fn ceiling_follows_registrations() {
    if !require_root("session_floor_testrun ceiling_follows_registrations") {
        return;
    }
    let r = rig();
    let margin = floor_margin();
    assert_eq!(floor(&r).ceiling, floor_ceiling(CAP, 5, FLOOR, margin));
    register(&r, 105, 1);
    assert_eq!(floor(&r).ceiling, floor_ceiling(CAP, 6, FLOOR, margin));
    // Re-registering the same interface (an update) reserves nothing more.
    register(&r, 105, 2);
    assert_eq!(floor(&r).ceiling, floor_ceiling(CAP, 6, FLOOR, margin));
    r.maps.sandboxes.unregister(105).unwrap();
    r.maps.sandboxes.unregister(VICTIM).unwrap();
    // A release keeps its floor reserved (the safe side) until the next recount (F14): the
    // reaper's sweep, or the next registration of a new sandbox.
    assert_eq!(floor(&r).ceiling, floor_ceiling(CAP, 6, FLOOR, margin));
    reaper::sweep(&r.maps.sessions, &Timeouts::default(), reaper::monotonic_ns()).unwrap();
    assert_eq!(floor(&r).ceiling, floor_ceiling(CAP, 4, FLOOR, margin));
    // Unknown interface: nothing changes.
    r.maps.sandboxes.unregister(999).unwrap();
    assert_eq!(floor(&r).ceiling, floor_ceiling(CAP, 4, FLOOR, margin));
    register(&r, 105, 3);
    r.maps.sandboxes.unregister(105).unwrap();
    register(&r, 106, 1);
    assert_eq!(floor(&r).ceiling, floor_ceiling(CAP, 5, FLOOR, margin), "a registration recounts");
    r.maps.sandboxes.unregister(106).unwrap();
    reaper::sweep(&r.maps.sessions, &Timeouts::default(), reaper::monotonic_ns()).unwrap();
    assert_eq!(floor(&r).ceiling, floor_ceiling(CAP, 4, FLOOR, margin));
    // A released sandbox's sessions still count in the node until deleted, and their delete
    // subtracts them (the version's own budget entries are gone already).
    register(&r, VICTIM, 5);
    assert_eq!(flood(&r, VICTIM, 1_000, 8), 8);
    r.maps.sandboxes.unregister(VICTIM).unwrap();
    assert_eq!(floor(&r).usage.live(), 8);
    let swept = reaper::sweep(&r.maps.sessions, &Timeouts::default(), reaper::monotonic_ns()).unwrap();
    assert_eq!(swept.stale, 8);
    assert_eq!(floor(&r).usage.live(), 0);
    assert_no_drift(&r);
}

/// A sandbox registered while the attackers hold the shared part: the ceiling drops by its
/// floor, the attackers above their floors get nothing more, and both the old victim and the
/// newcomer open their whole floors.
#[test]
fn registration_under_attack_lowers_the_ceiling() {
    if !require_root("session_floor_testrun registration_under_attack_lowers_the_ceiling") {
        return;
    }
    let r = rig();
    let margin = floor_margin();
    for (k, &a) in [SB_IFINDEX, ATTACKERS[0], ATTACKERS[1], ATTACKERS[2]].iter().enumerate() {
        flood(&r, a, 10_000 + 100 * k as u16, 20);
    }
    let n = floor(&r).usage.live();
    assert!(n >= i64::from(floor_ceiling(CAP, 5, FLOOR, margin)), "the flood reached the ceiling");
    register(&r, 105, 1);
    let ceiling = floor_ceiling(CAP, 6, FLOOR, margin);
    assert_eq!(floor(&r).ceiling, ceiling);
    // Every attacker is at its floor or above: none opens one more.
    let before = r.maps.counters.get(counter::CUBE_DROP_NODE_SESSIONS).unwrap();
    for &a in &ATTACKERS {
        assert_eq!(flood(&r, a, 40_000, 1), 0, "attacker {a} above its floor");
    }
    // 101 holds its whole budget (a quota drop); 102 and 103 are refused by the ceiling.
    assert_eq!(r.maps.counters.get(counter::CUBE_DROP_NODE_SESSIONS).unwrap() - before, 2);
    assert_eq!(drops(&r, ATTACKERS[0], "session_quota"), 5);
    // Both floors are still there.
    assert_eq!(flood(&r, VICTIM, 20_000, FLOOR as u16), FLOOR, "old victim's floor");
    assert_eq!(flood(&r, 105, 20_000, FLOOR as u16), FLOOR, "newcomer's floor");
    assert_eq!(r.maps.counters.get(counter::CUBE_DROP_NO_SNAT).unwrap(), 0);
    assert_eq!(floor(&r).usage.live(), n + 2 * i64::from(FLOOR));
    assert_no_drift(&r);
}

/// Sessions made by an object older than the floor (`node_quota` 0) are never subtracted from
/// the node count: deleting them cannot underflow it nor hand out room the ceiling does not
/// have. The kernel's own delete (reopen after a deny) gives the node charge back too.
#[test]
fn older_sessions_never_underflow_the_node_count() {
    if !require_root("session_floor_testrun older_sessions_never_underflow_the_node_count") {
        return;
    }
    let r = rig();
    // Sessions of A as a Q1-Q3 object left them: charged to the sandbox, not to the node.
    let old = r.uncharged_udp_sessions(6);
    assert_eq!(r.maps.sessions.insert_batch(&old).unwrap(), 6);
    assert_eq!(flood(&r, ATTACKERS[0], 10_000, 3), 3);
    assert_eq!(floor(&r).usage, QuotaUsage { opened: 3, closed: 0 });
    for (k, s) in &old {
        r.maps.sessions.delete(k, s).unwrap();
    }
    assert_eq!(floor(&r).usage, QuotaUsage { opened: 3, closed: 0 }, "uncharged deletes subtract nothing");
    // A delete of a charged session subtracts exactly once, even when repeated.
    let (k, s) = r.maps.sessions.entries().unwrap().into_iter().find(|(_, s)| s.vm_ifindex == ATTACKERS[0]).unwrap();
    r.maps.sessions.delete(&k, &s).unwrap();
    r.maps.sessions.delete(&k, &s).unwrap();
    assert_eq!(floor(&r).usage, QuotaUsage { opened: 3, closed: 1 });
    assert_no_drift(&r);
    r.maps.sessions.delete_of(ATTACKERS[0]).unwrap();
    assert_eq!(floor(&r).usage.live(), 0);
    assert_no_drift(&r);
}

/// Bounds: the floor is capped at the budget and at what the maps can reserve for every
/// interface; 0 turns it off.
#[test]
fn floor_limits() {
    assert_eq!(MapLimits::default().session_floor(4).unwrap(), 64);
    // 8,192 × 128 + 4 > 1,048,576: capped at 127.
    assert_eq!(MapLimits { session_floor: 128, ..Default::default() }.session_floor(4).unwrap(), 127);
    assert_eq!(
        MapLimits { session_floor: 100, sessions_per_sandbox: 10, ..Default::default() }.session_floor(4).unwrap(),
        10
    );
    // Small maps with the default interface count: no floor can be reserved.
    assert_eq!(MapLimits { sessions: 4096, ..Default::default() }.session_floor(4).unwrap(), 0);
    assert_eq!(MapLimits { session_floor: 0, ..Default::default() }.session_floor(4).unwrap(), 0);
}

/// Concurrent registrations share the floor's recounts (decision F23), and none returns
/// before its own floor is reserved: 8 threads register 128 new sandboxes at once, and after
/// each registration returns, `LIMITS` already counts at least every registration that has
/// returned (a recount that started before a registration's insert and covered it would
/// leave the ceiling one floor too high). Unregisters run beside them (F24: outside the
/// sandbox maps' lock) and are counted by the next recount.
#[test]
fn concurrent_registrations_each_reserve_their_floor_before_returning() {
    if !require_root("session_floor_testrun concurrent_registrations_each_reserve_their_floor_before_returning") {
        return;
    }
    const CAP: u32 = 4096;
    const SANDBOXES: u32 = 256;
    let limits = MapLimits {
        sessions: CAP,
        sandboxes: SANDBOXES,
        sessions_per_sandbox: BUDGET,
        session_floor: FLOOR,
        ..Default::default()
    };
    let margin = floor_margin();
    assert_eq!(limits.session_floor(margin).unwrap(), FLOOR, "floor not capped by these sizes");
    let r = Rig::with_limits(limits);
    let maps = &r.maps;
    let state = || maps.sessions.floor_state().expect("floor state").expect("floor map");
    // The rig's own sandbox is registered; 16 more that the threads release as they go.
    let base = (0..=u32::from(u8::MAX)).find(|&n| state().ceiling == floor_ceiling(CAP, n, FLOOR, margin));
    let base = base.expect("the ceiling counts the rig's registrations");
    let entry = |ifindex: u32| SandboxEntry {
        ifindex,
        ip: Ipv4Addr::new(10, 1, (ifindex >> 8) as u8, ifindex as u8),
        version: 1,
        id: format!("c{ifindex}"),
    };
    for i in 0..16 {
        maps.sandboxes.register(&entry(1000 + i)).expect("register");
    }
    let returned = std::sync::atomic::AtomicU32::new(0);
    std::thread::scope(|s| {
        for t in 0..8u32 {
            let (returned, state, entry) = (&returned, &state, &entry);
            s.spawn(move || {
                for k in 0..16u32 {
                    maps.sandboxes.register(&entry(2000 + t * 16 + k)).expect("register");
                    let done = returned.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    let ceiling = state().ceiling;
                    // At any recount at least `base + done` are registered: the 16 registered
                    // first cover the (at most 16) unregisters below.
                    let at_most = floor_ceiling(CAP, base + done, FLOOR, margin);
                    assert!(
                        ceiling <= at_most,
                        "registration {done} returned with the ceiling at {ceiling} (at most {at_most})"
                    );
                    if k % 8 == 0 {
                        maps.sandboxes.unregister(1000 + t * 2 + k / 8).expect("unregister");
                    }
                }
            });
        }
    });
    // Every registration new, the 16 first ones released: the next recount is exact.
    maps.sessions.refresh_floor().expect("recount");
    assert_eq!(state().ceiling, floor_ceiling(CAP, base + 128, FLOOR, margin));
    assert_eq!(maps.sandboxes.list().expect("list").len() as u32, base + 128);
}
