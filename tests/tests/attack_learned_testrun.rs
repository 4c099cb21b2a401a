//! Attack on the learned-address map (`BPF_PROG_TEST_RUN`, exact map state): `dns_learned`
//! is one map shared by every sandbox (262,144 entries) that never evicts; when it is full no
//! sandbox learns an answer, so every sandbox's FQDN-allowed flows stay denied. Sandbox A, with
//! an 8-port pattern and a name server whose answers it sets (its own domain, or any name
//! that resolves to an address spelled in it), asks 512 names (its whole query budget for
//! 10 s) and gets 16 A records for each: 65,536 new entries per 10 s, each living at least
//! 300 s (the TTL floor), so alone it fills the map in about 40 s and keeps it full.
//!
//! The test stands the rest of the node in for those 40 s: the map is first filled from
//! userspace with other sandboxes' entries up to [`ROOM`] free places, more than A's daily
//! budget and less than one burst of A's. Property (decision R60): A's flood never keeps B
//! from learning the answer to B's own query; A's renewals of its own entries still work past
//! its budget, and A holds no more than its budget of new entries.

use std::net::Ipv4Addr;

use cubenet_tests::{
    dns::{self, Owner, a},
    frames::udp,
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, SB_IP, VERSION},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    EgressPolicy, MapLimits, SandboxEntry,
    policy::FqdnAllow,
    prog,
    quota::{floor_ceiling, floor_margin},
};
use cubevs_common::{
    counter,
    dns::{LearnedKey, LearnedValue, MAX_ANSWERS, MAX_PORTS},
    limits, map,
};

const RESOLVER: [u8; 4] = WORLD_IP;
const B_IFINDEX: u32 = 101;
/// Free places left in `dns_learned` after the other sandboxes' entries: 1.5 × A's budget.
const ROOM: u32 = limits::DNS_LEARNED_PER_SANDBOX * 3 / 2;
/// Queries of A's flood: its whole query budget for one window but one (kept for A's
/// renewal). The interface's next sandbox then asks within the same 10 s window: its query is
/// tracked only because the window is per sandbox version (R64), not per interface.
const QUERIES: usize = limits::DNS_QUERIES_PER_SANDBOX as usize - 1;
/// A's guest port for the flood (one session to the resolver).
const A_PORT: u16 = 50000;

fn policy(fqdn: FqdnAllow) -> EgressPolicy {
    EgressPolicy {
        allow_internet_access: false,
        allow_out: vec![format!("{}/32", Ipv4Addr::from(RESOLVER))],
        allow_fqdn: vec![fqdn],
        ..Default::default()
    }
}

/// The `j`-th address of A's `i`-th answer: distinct, public (198.18.0.0/15).
fn addr(i: usize, j: usize) -> [u8; 4] {
    let k = i * MAX_ANSWERS as usize + j;
    [198, 18 + (k >> 16) as u8, (k >> 8) as u8, k as u8]
}

fn name(i: usize) -> String {
    format!("n{i}.attacker.example.com")
}

/// A's query `i` (id `i`) and the resolver's answer with 16 A records (TTL one day).
fn flood(r: &Rig, queries: std::ops::Range<usize>, snat_port: Option<u16>) -> Option<u16> {
    flood_from(r, SB_IFINDEX, queries, snat_port)
}

/// [`flood`] from the sandbox on `ifindex`.
fn flood_from(r: &Rig, ifindex: u32, queries: std::ops::Range<usize>, snat_port: Option<u16>) -> Option<u16> {
    let qs = queries.clone();
    r.run_many(prog::FROM_CUBE, ifindex, qs.len(), move |n| {
        let i = qs.start + n;
        udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, RESOLVER, A_PORT, 53, &dns::query(i as u16, &name(i)))
    });
    let snat = snat_port.or_else(|| {
        r.maps
            .sessions
            .list()
            .unwrap()
            .iter()
            .find(|s| s.vm_ifindex == ifindex && s.guest_port == A_PORT)
            .map(|s| s.snat_port)
    })?;
    let (world_mac, up_mac) = (r.world_mac, r.up_mac);
    let qs = queries.clone();
    r.run_many(prog::FROM_WORLD, r.uplink_ifindex, qs.len(), move |n| {
        let i = qs.start + n;
        let answers: Vec<_> = (0..MAX_ANSWERS as usize).map(|j| a(Owner::Question, addr(i, j), 86_400)).collect();
        udp(world_mac, up_mac, RESOLVER, NODE_IP, 53, snat, &dns::response(i as u16, &name(i), &answers))
    });
    Some(snat)
}

#[test]
fn one_sandbox_never_fills_the_learned_map_for_another() {
    if !require_root("attack_learned_testrun one_sandbox_never_fills_the_learned_map_for_another") {
        return;
    }
    let r = Rig::new();
    let ports: Vec<u32> = (0..MAX_PORTS as u32).map(|p| 8000 + p).collect();
    r.maps
        .policy
        .replace(SB_IFINDEX, &policy(FqdnAllow { name: "*.attacker.example.com".into(), ports }))
        .expect("policy A");
    let b = SandboxEntry { ifindex: B_IFINDEX, ip: Ipv4Addr::new(192, 168, 0, 4), version: 3, id: "sb-b".into() };
    r.add_sandbox(&b);
    r.maps
        .policy
        .replace(B_IFINDEX, &policy(FqdnAllow { name: "api.example.com".into(), ports: vec![] }))
        .expect("policy B");

    // The rest of the node: other sandboxes' entries, all but ROOM places.
    let mut learned: aya::maps::HashMap<_, LearnedKey, LearnedValue> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(r.kernel_map(prog::FROM_CUBE, map::DNS_LEARNED)))
            .expect("dns_learned handle");
    let others = limits::DNS_LEARNED - ROOM;
    for k in 0..others {
        let key = LearnedKey { ifindex: 200 + k % 64, ip: (0x0b00_0000 + k).to_be(), port: 0, _pad: 0 };
        learned.insert(key, LearnedValue { expires_ns: u64::MAX, version: 1, flags: 0 }, 0).expect("prefill");
    }

    // Control: a query of A is learned, 16 answers × 8 ports.
    let learned0 = r.counter(counter::DNS_RESP_LEARNED);
    let snat = flood(&r, 0..1, None).expect("A's DNS session");
    assert_eq!(r.counter(counter::DNS_RESP_LEARNED) - learned0, (MAX_ANSWERS as usize * MAX_PORTS) as u64);

    // A's flood: the rest of its query budget, every answer new.
    flood(&r, 1..QUERIES, Some(snat));
    let a_entries = r.maps.policy.learned(Some(SB_IFINDEX)).len() as u32;
    let full = r.counter(counter::DNS_LEARN_FULL);
    assert!(full > 0, "A's flood was not refused at all: the attack did not happen");

    // B's genuine answer is learned.
    let bsnat = r.dns_query(B_IFINDEX, 40000, 0x0b01, RESOLVER, "api.example.com");
    r.dns_respond(bsnat, 0x0b01, RESOLVER, "api.example.com", [203, 0, 113, 10]);
    assert_eq!(
        r.learned_ips(B_IFINDEX),
        [Ipv4Addr::new(203, 0, 113, 10)],
        "B learned nothing: A ({a_entries} entries) filled the shared map"
    );

    // How: A stopped at its budget of new entries (R60), leaving room for everyone else.
    assert!(a_entries <= limits::DNS_LEARNED_PER_SANDBOX, "A holds {a_entries} entries");
    assert!(
        a_entries >= limits::DNS_LEARNED_PER_SANDBOX - MAX_PORTS as u32,
        "A's budget was not all usable: {a_entries}"
    );

    // A's renewals of its own entries are free: its first answer again, every entry renewed.
    let (learned1, full1) = (r.counter(counter::DNS_RESP_LEARNED), r.counter(counter::DNS_LEARN_FULL));
    flood(&r, 0..1, Some(snat));
    assert_eq!(r.counter(counter::DNS_RESP_LEARNED) - learned1, (MAX_ANSWERS as usize * MAX_PORTS) as u64);
    assert_eq!(r.counter(counter::DNS_LEARN_FULL), full1, "a renewal was refused");

    // A new sandbox on A's interface (a reused TAP, released as the agent does) starts with a
    // budget of its own.
    r.maps.policy.remove(SB_IFINDEX).expect("release A's policy");
    r.maps.sandboxes.unregister(SB_IFINDEX).expect("release A");
    let a2 = SandboxEntry { ifindex: SB_IFINDEX, ip: Ipv4Addr::new(192, 168, 0, 3), version: 8, id: "sb-a2".into() };
    r.add_sandbox(&a2);
    r.maps
        .policy
        .replace(SB_IFINDEX, &policy(FqdnAllow { name: "api.example.com".into(), ports: vec![] }))
        .expect("policy A2");
    let asnat = r.dns_query(SB_IFINDEX, 40001, 0x0a02, RESOLVER, "api.example.com");
    r.dns_respond(asnat, 0x0a02, RESOLVER, "api.example.com", [203, 0, 113, 11]);
    let a2_learned: Vec<_> = r.maps.policy.learned(Some(SB_IFINDEX)).into_iter().filter(|e| e.version == 8).collect();
    assert_eq!(
        a2_learned.len(),
        1,
        "the interface's next sandbox inherited A's used budget (learned or query window, R60/R64)"
    );
}

/// Colluding sandboxes on the node, each of which stays within its R60 budget of new learned
/// entries.
const COLLUDERS: u32 = limits::DNS_LEARNED / limits::DNS_LEARNED_PER_SANDBOX;
/// Queries of one colluder: 16 answers × 8 ports each, its whole daily budget of new entries.
const COLLUDER_QUERIES: usize = (limits::DNS_LEARNED_PER_SANDBOX / (MAX_ANSWERS * MAX_PORTS as u32)) as usize;

/// Entries the datapath is to admit from `attempts` new entries per colluder, one colluder
/// after the other, with `registered` sandboxes and `capacity` entries: the floor always, above
/// it while the node count is below the ceiling (and the map has room). Returns (entries,
/// ceiling, the last colluder's entries).
fn expected(floor: u32, colluders: u32, attempts: u32, registered: u32, capacity: u32) -> (u32, u32, u32) {
    let ceiling = if floor == 0 { u32::MAX } else { floor_ceiling(capacity, registered, floor, floor_margin()) };
    let (mut n, mut last) = (0u32, 0u32);
    for _ in 0..colluders {
        let mut mine = 0;
        for _ in 0..attempts {
            if n < capacity && (mine < floor || n < ceiling) {
                mine += 1;
                n += 1;
            }
        }
        last = mine;
    }
    (n, ceiling, last)
}

/// 32 sandboxes, each at its own R60 budget (8,192 new entries, 64 queries of 16 answers for
/// an 8-port pattern: within their query windows too), try to fill `dns_learned` together
/// with real answers; B, a small legitimate sandbox registered beside them, asks one name.
/// Returns whether B learned its answer; asserts the exact node and per-sandbox counts
/// (decision R66) on the way. (R60 allows one version two windows, so 16 would do over two
/// days.)
fn colluding_scenario(floor: u32) -> bool {
    let r = Rig::with_limits(MapLimits { dns_learned_floor: floor, ..Default::default() });
    let ports: Vec<u32> = (0..MAX_PORTS as u32).map(|p| 8000 + p).collect();
    let b = SandboxEntry { ifindex: B_IFINDEX, ip: Ipv4Addr::new(192, 168, 0, 4), version: 3, id: "sb-b".into() };
    r.add_sandbox(&b);
    r.maps
        .policy
        .replace(B_IFINDEX, &policy(FqdnAllow { name: "api.example.com".into(), ports: vec![] }))
        .expect("policy B");
    for c in 0..COLLUDERS {
        let e = SandboxEntry {
            ifindex: 300 + c,
            ip: Ipv4Addr::new(192, 168, 1, c as u8 + 1),
            version: 300 + c,
            id: format!("sb-c{c}"),
        };
        r.add_sandbox(&e);
        r.maps
            .policy
            .replace(e.ifindex, &policy(FqdnAllow { name: "*.attacker.example.com".into(), ports: ports.clone() }))
            .expect("colluder policy");
    }

    // Every colluder asks its own names (distinct answers), within its budgets.
    let (learned0, full0) = (r.counter(counter::DNS_RESP_LEARNED), r.counter(counter::DNS_LEARN_FULL));
    for c in 0..COLLUDERS as usize {
        let qs = c * COLLUDER_QUERIES..(c + 1) * COLLUDER_QUERIES;
        flood_from(&r, 300 + c as u32, qs, None).expect("colluder's DNS session");
    }
    let learned = r.counter(counter::DNS_RESP_LEARNED) - learned0;
    let refused = r.counter(counter::DNS_LEARN_FULL) - full0;
    // The rig sandbox, the colluders and B are registered.
    let registered = COLLUDERS + 2;
    let (n, ceiling, last) =
        expected(floor, COLLUDERS, limits::DNS_LEARNED_PER_SANDBOX, registered, limits::DNS_LEARNED);
    let held = r.maps.policy.learned(None).len() as u32;
    assert_eq!(held, n, "learned {learned}, refused {refused}");
    assert_eq!(learned, u64::from(n));
    assert_eq!(refused, u64::from(COLLUDERS * limits::DNS_LEARNED_PER_SANDBOX - n));
    // The attack happened: the colluders made entries up to the map's size, minus what the
    // floors keep back (with no floor: the whole map).
    assert!(
        held + registered * floor + floor_margin() >= limits::DNS_LEARNED,
        "the colluders made only {held} entries: the attack did not happen"
    );
    for c in 0..COLLUDERS {
        let n = r.maps.policy.learned(Some(300 + c)).len() as u32;
        assert!(n <= limits::DNS_LEARNED_PER_SANDBOX, "colluder {c} holds {n}: over its R60 budget");
    }
    let lf = r.maps.track.learned().expect("learned floor");
    let st = lf.state().expect("learned floor state");
    if floor > 0 {
        assert!(n >= ceiling, "the flood must reach the ceiling ({n} < {ceiling})");
        assert_eq!((st.floor, st.ceiling), (floor, ceiling));
        // Exact counts: the node's and each colluder's equal the charged entries in the map.
        assert_eq!(st.node.live(), i64::from(n));
        for c in [0, COLLUDERS - 1] {
            let u = lf.usage(300 + c, 300 + c).expect("usage").expect("charged");
            assert_eq!(u.live(), r.maps.policy.learned(Some(300 + c)).len() as i64, "colluder {c}");
        }
        // The last colluder reached the ceiling: it got what the floor scheme admits, no more.
        assert!(last < limits::DNS_LEARNED_PER_SANDBOX, "the ceiling stopped no colluder");
        assert_eq!(r.maps.policy.learned(Some(300 + COLLUDERS - 1)).len() as u32, last);
    } else {
        assert_eq!(n, limits::DNS_LEARNED, "without a floor the colluders fill the map");
    }

    // B's genuine answer.
    let bsnat = r.dns_query(B_IFINDEX, 40000, 0x0b01, RESOLVER, "api.example.com");
    r.dns_respond(bsnat, 0x0b01, RESOLVER, "api.example.com", [203, 0, 113, 10]);
    r.learned_ips(B_IFINDEX) == [Ipv4Addr::new(203, 0, 113, 10)]
}

/// The attack of [`colluding_scenario`] against the learned floor (decision R66): B learns its
/// answer. With the floor off (0, as before R66) the same colluders fill the map and B learns
/// nothing, so the attack is real.
#[test]
fn colluding_sandboxes_within_their_budgets_never_fill_the_learned_map_for_another() {
    if !require_root("attack_learned_testrun colluding_sandboxes_within_their_budgets_never_fill_the_learned_map") {
        return;
    }
    assert!(
        colluding_scenario(limits::DNS_LEARNED_FLOOR),
        "B learned nothing: {COLLUDERS} sandboxes within their budgets filled the shared map past the floor"
    );
    assert!(!colluding_scenario(0), "with the floor off the colluders must fill the map (B learns nothing)");
}

/// The learned counts (decision R66) stay exact through a learned entry's whole life: learned
/// (charged), expired and reaped (refunded), learned again, renewed (no second charge), taken
/// over by the interface's next sandbox version (the charge moves, the node count stays), and
/// purged at Release (refunded): every count back to 0. Entries an older object left
/// (uncharged) are reaped without being subtracted.
#[test]
fn learned_counts_stay_exact_across_learn_reap_relearn_and_purge() {
    if !require_root("attack_learned_testrun learned_counts_stay_exact_across_learn_reap_relearn_and_purge") {
        return;
    }
    let r = Rig::new();
    r.maps
        .policy
        .replace(SB_IFINDEX, &policy(FqdnAllow { name: "*.attacker.example.com".into(), ports: vec![] }))
        .expect("policy");
    let lf = r.maps.track.learned().expect("learned floor");
    let node = || lf.state().expect("state").node.live();
    let mine = |v: u32| lf.usage(SB_IFINDEX, v).expect("usage").map_or(0, |u| u.live());
    let charged = |ifindex: u32| r.maps.policy.learned(Some(ifindex)).len() as i64;
    // An entry an older object left (no charge mark) on another interface.
    let mut learned: aya::maps::HashMap<_, LearnedKey, LearnedValue> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(r.kernel_map(prog::FROM_CUBE, map::DNS_LEARNED)))
            .expect("dns_learned handle");
    let old = LearnedKey { ifindex: 250, ip: u32::from_ne_bytes([198, 51, 100, 77]), port: 0, _pad: 0 };
    learned.insert(old, LearnedValue { expires_ns: 1, version: 1, flags: 0 }, 0).expect("uncharged entry");

    // Learned: 16 answers, one port each.
    let snat = flood(&r, 0..1, None).expect("DNS session");
    let n = MAX_ANSWERS as i64;
    assert_eq!((charged(SB_IFINDEX), mine(VERSION), node()), (n, n, n), "after learning");
    // Renewed (same answers again): no second charge.
    flood(&r, 0..1, Some(snat));
    assert_eq!((charged(SB_IFINDEX), mine(VERSION), node()), (n, n, n), "after a renewal");

    // Expired and reaped (a reap as if the TTL had passed): refunded; the uncharged entry is
    // reaped without a refund.
    let later = cubevs::reaper::monotonic_ns() + 2 * 86_400 * 1_000_000_000;
    let reaped = r.maps.policy.reap_dns(later).expect("reap");
    assert_eq!(reaped.learned as i64, n + 1);
    assert_eq!((charged(SB_IFINDEX), mine(VERSION), node()), (0, 0, 0), "after the reap");

    // Learned again.
    flood(&r, 1..2, Some(snat));
    assert_eq!((charged(SB_IFINDEX), mine(VERSION), node()), (n, n, n), "after relearning");

    // The interface's next sandbox version (registered without a purge in between) learns one
    // of the same addresses: it takes the entry over, the charge moves (the previous version's
    // count went with its registration), the node count stays.
    let next = SandboxEntry { ifindex: SB_IFINDEX, ip: Ipv4Addr::from(SB_IP), version: VERSION + 1, id: "sb2".into() };
    r.maps.sandboxes.register(&next).expect("register the next version");
    let snat2 = r.dns_query(SB_IFINDEX, 40002, 0x77, RESOLVER, &name(1));
    r.dns_respond(snat2, 0x77, RESOLVER, &name(1), addr(1, 0));
    let by_next: Vec<_> =
        r.maps.policy.learned(Some(SB_IFINDEX)).into_iter().filter(|e| e.version == VERSION + 1).collect();
    assert_eq!(by_next.len(), 1, "the next version took the entry over");
    assert_eq!(by_next[0].ip, Ipv4Addr::from(addr(1, 0)));
    assert_eq!((charged(SB_IFINDEX), mine(VERSION + 1), node()), (n, 1, n), "after the takeover");

    // Purged at Release: refunded, every count back to 0.
    r.maps.policy.remove(SB_IFINDEX).expect("release policy");
    assert_eq!((charged(SB_IFINDEX), mine(VERSION + 1), node()), (0, 0, 0), "after the purge");
}

/// The learned counts (decision R66) stay exact while the DNS reaper deletes entries on another
/// thread as answers learn and renew them: the answers alternate a 300 s and a one-day TTL over
/// a rotating set of names, and the reaper deletes what a 300 s TTL left expired 1,000 s from
/// now (so a renewal may land between its read and its delete: R67 puts it back or refunds it).
/// After the race, the node and sandbox counts equal the charged entries in the map; after a
/// final reap of everything, both are 0.
#[test]
fn learned_counts_stay_exact_while_the_reaper_races_the_answers() {
    if !require_root("attack_learned_testrun learned_counts_stay_exact_while_the_reaper_races_the_answers") {
        return;
    }
    const ROUNDS: usize = 400;
    const NAMES: usize = 8;
    let r = Rig::new();
    r.maps
        .policy
        .replace(SB_IFINDEX, &policy(FqdnAllow { name: "*.attacker.example.com".into(), ports: vec![] }))
        .expect("policy");
    let lf = r.maps.track.learned().expect("learned floor");
    let snat = flood(&r, 0..1, None).expect("DNS session");
    let soon = cubevs::reaper::monotonic_ns() + 1_000 * 1_000_000_000;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reaper = {
        let (maps, stop) = (r.maps.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reaped = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                reaped += maps.policy.reap_dns(soon).expect("reap").learned as u64;
                // The policy lock is not fair: let the main thread's purges and reads in.
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            reaped
        })
    };
    let (world_mac, up_mac) = (r.world_mac, r.up_mac);
    // Besides the racing thread, every 10th round is reaped here, so the reaper certainly
    // deletes while entries are renewed.
    let mut reaped_here = 0u64;
    for round in 1..ROUNDS {
        if round % 10 == 0 {
            reaped_here += r.maps.policy.reap_dns(soon).expect("reap").learned as u64;
        }
        let i = round % NAMES;
        let q = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, RESOLVER, A_PORT, 53, &dns::query(round as u16, &name(i)));
        assert_eq!(r.run(prog::FROM_CUBE, q, SB_IFINDEX).verdict, cubevs::testrun::TC_ACT_REDIRECT);
        let ttl = if round % 2 == 0 { 300 } else { 86_400 };
        let answers: Vec<_> = (0..MAX_ANSWERS as usize).map(|j| a(Owner::Question, addr(i, j), ttl)).collect();
        let resp = dns::response(round as u16, &name(i), &answers);
        r.world(udp(world_mac, up_mac, RESOLVER, NODE_IP, 53, snat, &resp));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reaped = reaper.join().expect("reaper thread") + reaped_here;
    let held = r.maps.policy.learned(Some(SB_IFINDEX)).len() as i64;
    let st = lf.state().expect("state");
    eprintln!("[learned] {held} held after the race, {reaped} reaped during it, node {:?}", st.node);
    assert!(reaped_here > 0, "the reaper took part");
    assert_eq!(st.node.closed, reaped, "the library counted exactly its own deletes");
    assert_eq!(st.node.live(), held, "node count exact after the race");
    assert_eq!(lf.usage(SB_IFINDEX, VERSION).unwrap().expect("charged").live(), held, "sandbox count exact");
    let last = r.maps.policy.reap_dns(u64::MAX).expect("final reap").learned as i64;
    assert_eq!(last, held);
    assert_eq!(lf.state().unwrap().node.live(), 0);
    assert_eq!(lf.usage(SB_IFINDEX, VERSION).unwrap().expect("charged").live(), 0);
}

/// Bounds (decision R66): the learned floor is capped at what `dns_learned` can reserve for
/// every interface plus one entry per CPU (31 for 262,144 entries and 8,192 sandboxes); the
/// default reserves 65,536 entries, a quarter of the map.
#[test]
fn learned_floor_limits() {
    let l = MapLimits::default();
    assert_eq!(l.dns_learned_floor, 8);
    assert_eq!(l.learned_floor(limits::DNS_LEARNED, 4), 8);
    assert_eq!(l.learned_floor(limits::DNS_LEARNED, 1024), 8);
    let big = MapLimits { dns_learned_floor: 32, ..Default::default() };
    assert_eq!(big.learned_floor(limits::DNS_LEARNED, 4), 31, "32 × 8,192 + 4 > 262,144");
    assert_eq!(l.learned_floor(4096, 4), 0, "a small map with 8,192 interfaces reserves nothing");
    assert_eq!(floor_ceiling(limits::DNS_LEARNED, limits::SANDBOXES, 8, 4), 262_144 - 65_536 - 4);
}
