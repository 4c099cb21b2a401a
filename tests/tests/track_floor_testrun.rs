//! The tracking floor (decision Q6) under `BPF_PROG_TEST_RUN`, exact verdicts and map state:
//! colluding attacker sandboxes, each within its own insert window (R11, R12), together try to
//! fill `dns_query_track_v2` (65,536 entries) and `frag_sessions_v2` (65,536 entries); a victim
//! sandbox must still get its floor tracked: its DNS answer learned, its later fragment
//! delivered. Each scenario also runs with the floor set to 0 (no node-wide check, as before
//! Q6), where the same flood fills the map and the victim loses (that run asserts the loss, so
//! the attack is shown to be real).

use std::net::Ipv4Addr;

use cubenet_tests::{
    dns,
    frames::{fragment, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, VERSION},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    EgressPolicy, MapLimits, QuotaUsage, SandboxEntry,
    policy::FqdnAllow,
    prog,
    quota::{floor_ceiling, floor_margin},
    testrun::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
    track_floor::{KIND_DNS_QUERY, KIND_FRAG},
};
use cubevs_common::{counter, limits, track};

const RESOLVER: [u8; 4] = WORLD_IP;
const NAME: &str = "api.example.com";
/// Attackers are ifindex 200.., the victim this one.
const VICTIM: u32 = 199;
const FLOOR: u32 = 4;
const ADDR: [u8; 4] = [203, 0, 113, 10];

fn entry(ifindex: u32, k: u32) -> SandboxEntry {
    SandboxEntry {
        ifindex,
        ip: Ipv4Addr::new(192, 168, 1 + (k / 250) as u8, 1 + (k % 250) as u8),
        version: 1,
        id: format!("sb{ifindex}"),
    }
}

/// Internet off, the resolver allowed, `api.example.com` allowed by name.
fn dns_policy() -> EgressPolicy {
    EgressPolicy {
        allow_internet_access: false,
        allow_out: vec![format!("{}/32", Ipv4Addr::from(RESOLVER))],
        allow_fqdn: vec![FqdnAllow { name: NAME.into(), ports: vec![] }],
        ..Default::default()
    }
}

fn register(r: &Rig, ifindex: u32, k: u32, policy: &EgressPolicy) {
    r.add_sandbox(&entry(ifindex, k));
    r.maps.policy.replace(ifindex, policy).expect("policy");
}

/// The rig with `attackers` more sandboxes and the victim, all registered with `policy`, and
/// both tracking floors at `floor`.
fn rig(floor: u32, attackers: u32, policy: &EgressPolicy) -> Rig {
    let r = Rig::with_limits(MapLimits { dns_query_floor: floor, frag_floor: floor, ..Default::default() });
    r.maps.policy.replace(SB_IFINDEX, policy).expect("policy of the rig sandbox");
    for k in 0..attackers {
        register(&r, 200 + k, k, policy);
    }
    register(&r, VICTIM, attackers, policy);
    r
}

/// Entries the datapath is to admit from `attempts` sends per attacker, one attacker after
/// the other, with `registered` sandboxes and `capacity` entries: the floor always, above it
/// while the node count is below the ceiling (and the map has room). Returns (entries,
/// ceiling).
fn expected(floor: u32, attackers: u32, attempts: u32, registered: u32, capacity: u32) -> (u32, u32) {
    let ceiling = if floor == 0 { u32::MAX } else { floor_ceiling(capacity, registered, floor, floor_margin()) };
    let mut n = 0u32;
    for _ in 0..attackers {
        let mut mine = 0;
        for _ in 0..attempts {
            if n < capacity && (mine < floor || n < ceiling) {
                mine += 1;
                n += 1;
            }
        }
    }
    (n, ceiling)
}

/// Charged entries of `dns_query_track_v2` (of `ifindex`, or all).
fn dns_charged(r: &Rig, ifindex: Option<u32>) -> i64 {
    r.maps.policy.dns_queries(ifindex).iter().filter(|(_, v)| v._pad == track::DNS_CHARGED).count() as i64
}

fn frag_charged(r: &Rig, ifindex: Option<u32>) -> i64 {
    r.maps.frags.list(ifindex).iter().filter(|e| e.charged).count() as i64
}

/// Attackers: enough that their windows (512 queries per 10 s each) exceed the map.
const DNS_ATTACKERS: u32 = limits::DNS_QUERIES / limits::DNS_QUERIES_PER_SANDBOX + 2;

/// The DNS scenario: every attacker sends its whole window of queries for the allowed name
/// (one guest port, 512 ids), then the victim asks and is answered. Returns whether the
/// victim learned the answer; asserts the exact node and per-sandbox counts on the way.
fn dns_scenario(floor: u32) -> bool {
    let policy = dns_policy();
    let r = rig(floor, DNS_ATTACKERS, &policy);
    let per = limits::DNS_QUERIES_PER_SANDBOX;
    let frames: std::sync::Arc<Vec<Vec<u8>>> = std::sync::Arc::new(
        (0..per)
            .map(|i| udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, RESOLVER, 50000, 53, &dns::query(i as u16, NAME)))
            .collect(),
    );
    for k in 0..DNS_ATTACKERS {
        let f = frames.clone();
        r.run_many(prog::FROM_CUBE, 200 + k, per as usize, move |i| f[i].clone());
    }
    // The rig sandbox, the attackers and the victim are registered.
    let registered = DNS_ATTACKERS + 2;
    let (n, ceiling) = expected(floor, DNS_ATTACKERS, per, registered, limits::DNS_QUERIES);
    let tracked = r.maps.policy.dns_queries(None).len() as u32;
    assert_eq!(tracked, n, "tracked flood queries");
    let over = r.maps.counters.get(counter::DNS_QUERY_OVER_BUDGET).unwrap();
    assert_eq!(over, u64::from(DNS_ATTACKERS * per - n), "every other flood query forwarded untracked");
    let st = r.maps.track.state(KIND_DNS_QUERY).unwrap();
    if floor > 0 {
        assert!(n >= ceiling, "the flood must reach the ceiling ({n} < {ceiling})");
        assert_eq!((st.floor, st.ceiling), (floor, ceiling));
        // Exact counts: the node's and each attacker's equal the charged entries in the map.
        assert_eq!(st.node.live(), i64::from(n));
        assert_eq!(dns_charged(&r, None), i64::from(n));
        for k in [0, DNS_ATTACKERS - 1] {
            let u = r.maps.track.usage(200 + k, 1, KIND_DNS_QUERY).unwrap().expect("charged");
            assert_eq!(u.live(), dns_charged(&r, Some(200 + k)), "attacker {k}");
        }
        // The last attackers came after the ceiling: each got exactly its floor.
        assert_eq!(dns_charged(&r, Some(200 + DNS_ATTACKERS - 1)), i64::from(floor));
    } else {
        assert_eq!(n, limits::DNS_QUERIES, "without a floor the flood fills the map");
    }

    // The victim's query, then its answer.
    let snat = r.dns_query(VICTIM, 40000, 0x0b01, RESOLVER, NAME);
    r.dns_respond(snat, 0x0b01, RESOLVER, NAME, ADDR);
    let ok = r.learned_ips(VICTIM) == [Ipv4Addr::from(ADDR)];
    if !ok {
        assert_eq!(r.maps.counters.get(counter::DNS_RESP_UNSOLICITED).unwrap(), 1, "victim's answer unsolicited");
        return false;
    }
    assert_eq!(r.maps.counters.get(counter::DNS_RESP_UNSOLICITED).unwrap(), 0);
    // The answer consumed the query and the datapath refunded it: no drift.
    let u = r.maps.track.usage(VICTIM, 1, KIND_DNS_QUERY).unwrap().expect("victim charged");
    assert_eq!(u, QuotaUsage { opened: 0, closed: 0 }, "tracked once, refunded by the answer");
    // Its whole floor is tracked while the node is at the ceiling, and one query more is not.
    let over0 = r.maps.counters.get(counter::DNS_QUERY_OVER_BUDGET).unwrap();
    for i in 0..floor as u16 {
        r.dns_query(VICTIM, 40001 + i, 0x0c00 + i, RESOLVER, NAME);
    }
    assert_eq!(dns_charged(&r, Some(VICTIM)), i64::from(floor), "the victim's floor");
    r.dns_query(VICTIM, 40100, 0x0d00, RESOLVER, NAME);
    assert_eq!(
        r.maps.counters.get(counter::DNS_QUERY_OVER_BUDGET).unwrap(),
        over0 + 1,
        "over the floor at the ceiling"
    );
    assert_eq!(dns_charged(&r, Some(VICTIM)), i64::from(floor));
    assert_eq!(r.maps.track.state(KIND_DNS_QUERY).unwrap().node.live(), dns_charged(&r, None));

    // A released attacker's queries are purged and subtracted; the reaper subtracts expired ones:
    // the node count returns to 0 exactly.
    r.maps.sandboxes.unregister(200).expect("unregister");
    // The released floor stays reserved (the safe side) until the next recount (F14: the next
    // registration of a new sandbox, or the reaper's sweep); then one fewer reserves one less.
    let st = r.maps.track.state(KIND_DNS_QUERY).unwrap();
    assert_eq!(st.ceiling, floor_ceiling(limits::DNS_QUERIES, registered, floor, floor_margin()));
    r.maps.sessions.refresh_floor().expect("recount");
    let st = r.maps.track.state(KIND_DNS_QUERY).unwrap();
    assert_eq!(st.ceiling, floor_ceiling(limits::DNS_QUERIES, registered - 1, floor, floor_margin()));
    assert_eq!(r.maps.track.usage(200, 1, KIND_DNS_QUERY).unwrap(), None, "its version's counts are removed");
    r.maps.policy.purge_learned(200).expect("purge");
    assert_eq!(r.maps.track.state(KIND_DNS_QUERY).unwrap().node.live(), dns_charged(&r, None), "after a purge");
    r.maps.policy.reap_dns(u64::MAX).expect("reap");
    assert!(r.maps.policy.dns_queries(None).is_empty());
    assert_eq!(r.maps.track.state(KIND_DNS_QUERY).unwrap().node.live(), 0, "node count back to 0");
    let u = r.maps.track.usage(200 + DNS_ATTACKERS - 1, 1, KIND_DNS_QUERY).unwrap().expect("charged");
    assert_eq!(u.live(), 0, "attacker count back to 0");
    true
}

#[test]
fn colluders_cannot_take_the_victims_tracked_queries() {
    if !require_root("track_floor_testrun colluders_cannot_take_the_victims_tracked_queries") {
        return;
    }
    assert!(dns_scenario(FLOOR), "the victim's answer must be learned despite the flood");
}

#[test]
fn without_the_floor_colluders_fill_the_query_map() {
    if !require_root("track_floor_testrun without_the_floor_colluders_fill_the_query_map") {
        return;
    }
    assert!(!dns_scenario(0), "floor 0: the flood fills the map, the victim's answer is unsolicited");
}

/// Attackers: enough that their windows (1,024 first fragments per 2 s each) exceed the map.
const FRAG_ATTACKERS: u32 = limits::FRAG_SESSIONS / limits::FRAG_PER_SANDBOX + 2;

/// The world server of attacker `k` (TEST-NET-3, one per 32 attackers: IP ids are per
/// sender, 32 × 1,024 of them each).
fn evil(k: u32) -> [u8; 4] {
    [203, 0, 113, 50 + (k / 32) as u8]
}

/// A UDP flow of the sandbox on `ifindex` to `dst`:`dport`; returns its SNAT port.
fn open(r: &Rig, ifindex: u32, dst: [u8; 4], dport: u16) -> u16 {
    let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, 5000, dport, b"q");
    assert_eq!(r.run(prog::FROM_CUBE, f, ifindex).verdict, TC_ACT_REDIRECT);
    let s = r.maps.sessions.list().unwrap();
    s.iter().find(|s| s.vm_ifindex == ifindex && s.remote_ip == Ipv4Addr::from(dst)).expect("session").snat_port
}

/// The fragment scenario: each attacker's server sends it 1,024 first fragments (distinct IP
/// ids), then the victim's server sends a fragmented reply. Returns whether the victim's later
/// fragment was delivered to it; asserts the exact counts on the way.
fn frag_scenario(floor: u32) -> bool {
    let open_policy = EgressPolicy { allow_internet_access: true, ..Default::default() };
    let r = rig(floor, FRAG_ATTACKERS, &open_policy);
    let per = limits::FRAG_PER_SANDBOX;
    let (wm, um) = (r.world_mac, r.up_mac);
    for k in 0..FRAG_ATTACKERS {
        let port = open(&r, 200 + k, evil(k), 9000);
        let base = (k % 32) * per;
        let src = evil(k);
        r.run_many(prog::FROM_WORLD, r.uplink_ifindex, per as usize, move |i| {
            fragment(&udp(wm, um, src, NODE_IP, 9000, port, &[0u8; 40]), (base + i as u32) as u16, 24).0
        });
    }
    let registered = FRAG_ATTACKERS + 2;
    let (n, ceiling) = expected(floor, FRAG_ATTACKERS, per, registered, limits::FRAG_SESSIONS);
    assert_eq!(r.maps.frags.list(None).len() as u32, n, "recorded flood fragments");
    let over = r.maps.counters.get(counter::WORLD_FRAG_OVER_BUDGET).unwrap();
    assert_eq!(over, u64::from(FRAG_ATTACKERS * per - n), "every other first fragment delivered unrecorded");
    let st = r.maps.track.state(KIND_FRAG).unwrap();
    if floor > 0 {
        assert!(n >= ceiling, "the flood must reach the ceiling ({n} < {ceiling})");
        assert_eq!((st.floor, st.ceiling), (floor, ceiling));
        assert_eq!(st.node.live(), i64::from(n));
        assert_eq!(frag_charged(&r, None), i64::from(n));
        let last = 200 + FRAG_ATTACKERS - 1;
        assert_eq!(frag_charged(&r, Some(last)), i64::from(floor), "a late attacker gets its floor");
        let u = r.maps.track.usage(last, 1, KIND_FRAG).unwrap().expect("charged");
        assert_eq!(u.live(), i64::from(floor));
    } else {
        assert_eq!(n, limits::FRAG_SESSIONS, "without a floor the flood fills the map");
    }

    // The victim's fragmented reply.
    let port = open(&r, VICTIM, WORLD_IP, 53);
    let answer: Vec<u8> = (0..40u8).collect();
    let (v1, v2) = fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, port, &answer), 0x4242, 24);
    assert_eq!(r.world(v1).verdict, TC_ACT_REDIRECT, "the victim's first fragment");
    let out = r.world(v2);
    if out.verdict != TC_ACT_REDIRECT {
        assert_eq!(out.verdict, TC_ACT_OK, "a later fragment without its entry goes to the host");
        return false;
    }
    assert_eq!(&out.data[30..34], &GUEST_IP, "to the guest address");
    // The victim holds its floor while the node is at the ceiling, and one entry more is not
    // recorded (its first fragment still delivered).
    for i in 1..floor as u16 {
        let (f, _) = fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, port, &answer), 0x4242 + i, 24);
        assert_eq!(r.world(f).verdict, TC_ACT_REDIRECT);
    }
    assert_eq!(frag_charged(&r, Some(VICTIM)), i64::from(floor), "the victim's floor");
    let over0 = r.maps.counters.get(counter::WORLD_FRAG_OVER_BUDGET).unwrap();
    let (f, _) = fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, port, &answer), 0x5000, 24);
    assert_eq!(r.world(f).verdict, TC_ACT_REDIRECT);
    assert_eq!(r.maps.counters.get(counter::WORLD_FRAG_OVER_BUDGET).unwrap(), over0 + 1);
    assert_eq!(r.maps.track.state(KIND_FRAG).unwrap().node.live(), frag_charged(&r, None), "no drift");

    // The reaper subtracts what it deletes: nothing before expiry, everything after.
    assert_eq!(r.maps.frags.reap(0).unwrap(), 0);
    r.maps.frags.reap(u64::MAX).expect("reap");
    assert!(r.maps.frags.list(None).is_empty());
    assert_eq!(r.maps.track.state(KIND_FRAG).unwrap().node.live(), 0, "node count back to 0");
    assert_eq!(r.maps.track.usage(VICTIM, 1, KIND_FRAG).unwrap().expect("charged").live(), 0);
    true
}

#[test]
fn colluders_cannot_take_the_victims_fragment_entries() {
    if !require_root("track_floor_testrun colluders_cannot_take_the_victims_fragment_entries") {
        return;
    }
    assert!(frag_scenario(FLOOR), "the victim's later fragment must be delivered despite the flood");
}

#[test]
fn without_the_floor_colluders_fill_the_fragment_map() {
    if !require_root("track_floor_testrun without_the_floor_colluders_fill_the_fragment_map") {
        return;
    }
    assert!(!frag_scenario(0), "floor 0: the flood fills the map, the victim's later fragment goes to the host");
}

/// Another sandbox's first fragment with a key an entry already holds does not take it over
/// (the owner, whose charge the reaper gives back, never changes) but marks it ambiguous
/// (R16); the owner renews it without a second charge.
#[test]
fn a_fragment_key_is_never_given_to_another_sandbox() {
    if !require_root("track_floor_testrun a_fragment_key_is_never_given_to_another_sandbox") {
        return;
    }
    let open_policy = EgressPolicy { allow_internet_access: true, ..Default::default() };
    let r = rig(FLOOR, 1, &open_policy);
    let (wm, um) = (r.world_mac, r.up_mac);
    let a_port = open(&r, SB_IFINDEX, WORLD_IP, 53);
    let b_port = open(&r, 200, WORLD_IP, 53);
    let (a1, _) = fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, a_port, &[1u8; 40]), 0x1234, 24);
    let (b1, b2) = fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, b_port, &[2u8; 40]), 0x1234, 24);
    assert_eq!(r.world(a1.clone()).verdict, TC_ACT_REDIRECT);
    assert_eq!(r.world(b1).verdict, TC_ACT_REDIRECT, "B's first fragment is delivered");
    let e = r.maps.frags.list(None);
    assert_eq!(e.len(), 1);
    assert_eq!((e[0].ifindex, e[0].version), (SB_IFINDEX, VERSION), "the entry stays A's");
    assert!(e[0].ambiguous, "B's first fragment marks it ambiguous (R16): {e:?}");
    assert_eq!(r.maps.counters.get(counter::WORLD_FRAG_OVER_BUDGET).unwrap(), 0, "B took no budget");
    assert_eq!(r.maps.counters.get(counter::WORLD_FRAG_AMBIGUOUS).unwrap(), 1);
    // B's later fragment is dropped, never delivered into A (R16).
    assert_eq!(r.world(b2).verdict, TC_ACT_SHOT);
    // A renews its own entry without a second charge.
    assert_eq!(r.world(a1).verdict, TC_ACT_REDIRECT);
    assert_eq!(r.maps.track.usage(SB_IFINDEX, VERSION, KIND_FRAG).unwrap().unwrap().live(), 1);
    assert_eq!(r.maps.track.usage(200, 1, KIND_FRAG).unwrap().map_or(0, |u| u.live()), 0, "nothing charged to B");
    assert_eq!(r.maps.track.state(KIND_FRAG).unwrap().node.live(), 1);
    r.maps.frags.reap(u64::MAX).unwrap();
    assert_eq!(r.maps.track.state(KIND_FRAG).unwrap().node.live(), 0);
    assert_eq!(r.maps.track.usage(SB_IFINDEX, VERSION, KIND_FRAG).unwrap().unwrap().live(), 0);
}

/// The datapath consuming queries (answers) and the reaper deleting them (here: every tracked
/// query, at the end of time) race on the same entries; each side counts only its own
/// successful deletes, so whatever the interleaving every tracked query is given back exactly
/// once: tracked = answered + reaped, and the node and sandbox counts end at 0.
#[test]
fn racing_answers_and_reaps_keep_the_count_exact() {
    if !require_root("track_floor_testrun racing_answers_and_reaps_keep_the_count_exact") {
        return;
    }
    // Six sandboxes, 500 queries each: inside every one's window (512 per 10 s).
    let r = rig(FLOOR, 5, &dns_policy());
    const N: u16 = 500;
    let sandboxes = [VICTIM, 200, 201, 202, 203, 204];
    let snat: Vec<u16> = sandboxes
        .iter()
        .map(|&sb| {
            let p = r.dns_query(sb, 40000, 0, RESOLVER, NAME);
            r.dns_respond(p, 0, RESOLVER, NAME, ADDR);
            p
        })
        .collect();
    let tracked0 = r.maps.counters.get(counter::DNS_QUERY_TRACKED).unwrap();
    let learned0 = r.maps.counters.get(counter::DNS_RESP_LEARNED).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reaper = {
        let (maps, stop) = (r.maps.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reaped = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                reaped += maps.policy.reap_dns(u64::MAX).expect("reap").queries as u64;
                // The policy lock is not fair: without a pause this loop would starve the
                // main thread's own reaps of it.
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            reaped
        })
    };
    // Besides the racing thread, every 5th round is reaped here between query and answer, so
    // both deleters certainly take part.
    let mut reaped_here = 0u64;
    for id in 1..=N {
        for &sb in &sandboxes {
            let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, RESOLVER, 40000, 53, &dns::query(id, NAME));
            assert_eq!(r.run(prog::FROM_CUBE, f, sb).verdict, TC_ACT_REDIRECT);
        }
        if id % 5 == 0 {
            reaped_here += r.maps.policy.reap_dns(u64::MAX).expect("reap").queries as u64;
        }
        for &port in &snat {
            r.dns_respond(port, id, RESOLVER, NAME, ADDR);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut reaped = reaper.join().expect("reaper thread");
    reaped += reaped_here + r.maps.policy.reap_dns(u64::MAX).expect("reap").queries as u64;
    let tracked = r.maps.counters.get(counter::DNS_QUERY_TRACKED).unwrap() - tracked0;
    // One A record per answer: each learned record is a query the datapath consumed.
    let answered = r.maps.counters.get(counter::DNS_RESP_LEARNED).unwrap() - learned0;
    eprintln!("[track_floor] {tracked} tracked: {answered} consumed by their answers, {reaped} reaped first");
    assert_eq!(tracked, u64::from(N) * 6, "every query tracked (each sandbox inside its window)");
    // Only the answer whose delete removed its query is learned (R21), so learned answers
    // and reaped queries partition the tracked ones.
    assert_eq!(tracked, answered + reaped, "each query deleted once, by one side");
    assert!(reaped_here > 0 && answered > 0, "both deleters took part");
    let st = r.maps.track.state(KIND_DNS_QUERY).unwrap();
    assert_eq!(st.node.live(), 0, "node count exact: {st:?}");
    assert_eq!(st.node.closed, reaped, "the library counted exactly its own deletes");
    assert_eq!(st.node.opened, reaped, "the datapath refunded exactly its own");
    for sb in sandboxes {
        let u = r.maps.track.usage(sb, 1, KIND_DNS_QUERY).unwrap().expect("charged");
        assert_eq!(u.live(), 0, "sandbox {sb} count exact: {u:?}");
    }
}

/// Bounds: a tracking floor is capped at what the map can reserve for every interface plus
/// one entry per CPU (7 for 65,536 entries and 8,192 sandboxes) and at the 8-bit field of
/// `TRACK_LIMITS`; the packed limits read back per map.
#[test]
fn tracking_floor_limits() {
    let l = MapLimits::default();
    assert_eq!(l.track_floor(l.dns_query_floor, limits::DNS_QUERIES, 4), 4);
    assert_eq!(l.track_floor(8, limits::DNS_QUERIES, 4), 7, "8 × 8,192 + 4 > 65,536");
    assert_eq!(l.track_floor(4, 4096, 4), 0, "a small map with 8,192 interfaces reserves nothing");
    let few = MapLimits { sandboxes: 1, ..Default::default() };
    assert_eq!(few.track_floor(1000, limits::FRAG_SESSIONS, 4), 255, "the TRACK_LIMITS field");
    use cubevs_common::floor::{track_half, track_unpack};
    let v = (u64::from(track_half(4, 65_000)) << 32) | u64::from(track_half(7, 1 << 30));
    assert_eq!(track_unpack(v, KIND_DNS_QUERY), (4, 65_000));
    assert_eq!(track_unpack(v, KIND_FRAG), (7, 0xFF_FFFF), "ceiling clamped to 24 bits");
}
