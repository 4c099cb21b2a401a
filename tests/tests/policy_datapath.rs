//! Egress policy in the datapath under `BPF_PROG_TEST_RUN` (issue 10, items 5 and 19): a
//! replace never lets a denied flow through, an interface without policy denies, and the
//! shared tries are shared fairly.

use std::{
    net::Ipv4Addr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use cubenet_tests::{
    ebpf_object,
    frames::udp,
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX},
};
use cubevs::{Datapath, EgressPolicy, LoadOptions, MapLimits, prog, testrun::TC_ACT_SHOT};
use cubevs_common::counter;

/// A public destination both policies of the replace loop deny.
const DENIED: [u8; 4] = [8, 8, 8, 8];

fn deny(list: &[&str]) -> EgressPolicy {
    EgressPolicy { deny_out: list.iter().map(|s| s.to_string()).collect(), ..Default::default() }
}

/// Item 5: packets to a denied destination run in a kernel loop (`BPF_PROG_TEST_RUN` with a
/// large repeat) while another thread replaces the sandbox's policy back and forth between
/// two policies that both deny it. Not one packet may be classified as allowed (no session,
/// no `new_session` count). Before the fix a packet that read the old generation just before
/// the replace flipped it found the old deny entry already purged and was allowed.
#[test]
fn policy_replace_never_lets_a_denied_flow_through() {
    if !require_root("policy_replace_never_lets_a_denied_flow_through") {
        return;
    }
    let r = Rig::new();
    // The deny entry of DENIED sorts first, so it is the first entry a purge deletes: the
    // smallest window there is between a generation flip and the loss of the deny entry.
    let a = deny(&["8.8.8.8"]);
    let b = deny(&["8.8.8.8", "9.9.9.9"]);
    r.maps.policy.replace(SB_IFINDEX, &a).unwrap();
    let frame = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, DENIED, 40000, 53, b"q");
    assert_eq!(r.cube(frame.clone()).verdict, TC_ACT_SHOT, "denied before the race");

    let stop = Arc::new(AtomicBool::new(false));
    let replaces = Arc::new(AtomicU64::new(0));
    let maps = r.maps.clone();
    let (st, n) = (stop.clone(), replaces.clone());
    let replacer = std::thread::spawn(move || {
        let mut i = 0u64;
        while !st.load(Ordering::Relaxed) {
            maps.policy.replace(SB_IFINDEX, if i.is_multiple_of(2) { &b } else { &a }).expect("replace");
            i += 1;
        }
        n.store(i, Ordering::Relaxed);
    });
    let t0 = Instant::now();
    let mut runs = 0u64;
    let mut allowed_at = None;
    while t0.elapsed() < Duration::from_secs(10) {
        // A denied UDP datagram is dropped unchanged, so every repetition classifies it again.
        let out = r.run_repeat(prog::FROM_CUBE, frame.clone(), SB_IFINDEX, 20_000);
        runs += 20_000;
        if out.verdict != TC_ACT_SHOT || r.maps.counters.get(counter::CUBE_NEW_SESSION).unwrap() > 0 {
            allowed_at = Some(runs);
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    replacer.join().unwrap();
    let replaced = replaces.load(Ordering::Relaxed);
    eprintln!("{runs} classifications during {replaced} replaces");
    assert!(replaced > 100, "the replace loop barely ran ({replaced})");
    assert_eq!(allowed_at, None, "a denied flow was allowed during a replace (after {runs} runs)");
    assert_eq!(r.maps.sessions.counts(), (0, 0), "a session to a denied destination exists");
    assert_eq!(r.maps.counters.get(counter::CUBE_NEW_SESSION).unwrap(), 0);
}

/// An interface whose policy was removed (or never installed) denies every new flow: the
/// datapath fails closed instead of treating "no policy" as "allow everything, even the
/// private ranges".
#[test]
fn interface_without_policy_denies_everything() {
    if !require_root("interface_without_policy_denies_everything") {
        return;
    }
    let r = Rig::new();
    let to = |dst: [u8; 4]| udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, 40001, 53, b"q");
    r.maps.policy.remove(SB_IFINDEX).unwrap();
    for dst in [[198, 51, 100, 1], [10, 0, 0, 1], [1, 1, 1, 1]] {
        assert_eq!(r.cube(to(dst)).verdict, TC_ACT_SHOT, "{:?} passed without a policy", Ipv4Addr::from(dst));
    }
    assert_eq!(r.maps.sessions.counts(), (0, 0));
    // Installing a policy again allows the public address.
    r.maps.policy.install_default_deny(SB_IFINDEX).unwrap();
    assert_ne!(r.cube(to([198, 51, 100, 1])).verdict, TC_ACT_SHOT);
    assert_eq!(r.cube(to([10, 0, 0, 1])).verdict, TC_ACT_SHOT, "baseline deny");
}

/// `n` distinct /32 entries starting at `base` (host order).
fn entries(base: u32, n: u32) -> Vec<String> {
    (0..n).map(|i| Ipv4Addr::from(base + i).to_string()).collect()
}

/// Item 19: with `sandboxes` interfaces and a per-sandbox limit, the tries hold two
/// generations of every interface at its limit. Three sandboxes at their limit leave room for
/// a fourth; each can replace at its limit; a list over the limit is refused naming the field
/// and the limit with the old policy intact; the bound on interfaces is `policy_gen`'s size
/// and refusing a new interface writes nothing; shrinking and removal always succeed.
#[test]
fn shared_policy_tries_are_shared_fairly() {
    if !require_root("shared_policy_tries_are_shared_fairly") {
        return;
    }
    let limits = MapLimits { sandboxes: 4, policy_entries_per_sandbox: 16, ..MapLimits::default() };
    assert_eq!(limits.policy_entries().unwrap(), 4 * 2 * (16 + 6));
    let dp = Datapath::load(LoadOptions { object: ebpf_object(), limits, ..LoadOptions::new() }).expect("load");
    let m = dp.maps();
    let full = |seed: u32| EgressPolicy {
        allow_internet_access: true,
        allow_out: entries(0x0b00_0000 + seed * 0x100, 16),
        deny_out: entries(0x0c00_0000 + seed * 0x100, 16),
        ..Default::default()
    };
    for ifx in 1..=3 {
        m.policy.replace(ifx, &full(ifx)).unwrap();
    }
    m.policy.replace(4, &full(4)).expect("a fourth sandbox at its limit");
    for round in 0..3 {
        for ifx in 1..=4 {
            m.policy.replace(ifx, &full(ifx + 10 * (round + 1))).expect("replace at the limit");
        }
    }
    assert_eq!(m.policy.entry_counts(), (4 * 16, 4 * (16 + 5)), "old generations purged");

    let before = m.policy.dump(1).unwrap();
    let over = EgressPolicy { deny_out: entries(0x0d00_0000, 17), ..Default::default() };
    let e = m.policy.replace(1, &over).unwrap_err();
    assert!(
        matches!(&e, cubevs::Error::InvalidArgument { field, reason } if field == "deny_out" && reason.contains("16")),
        "{e}"
    );
    assert_eq!(m.policy.dump(1).unwrap(), before, "a refused replace changed the policy");

    let counts = m.policy.entry_counts();
    let e = m.policy.replace(5, &EgressPolicy::default()).unwrap_err();
    assert!(matches!(e, cubevs::Error::TooManyEntries { map: "policy_gen", max: 4, .. }), "{e}");
    assert_eq!(m.policy.entry_counts(), counts, "a refused interface wrote entries");

    m.policy.install_default_deny(2).expect("shrinking");
    m.policy.remove(3).expect("removal");
    m.policy.replace(5, &full(5)).expect("a freed slot is usable");
    assert_eq!(m.policy.dump(3).unwrap().generation, None);
}

/// The default sizing (8,192 sandboxes × 2 generations × (1,024 + 6)) is 16,875,520 entries
/// per trie, which costs nothing until used: LPM tries are `BPF_F_NO_PREALLOC`, and the
/// kernel charges an empty trie no memory (`memlock` in the map's fdinfo).
#[test]
fn policy_trie_sizing_costs_no_memory_until_used() {
    if !require_root("policy_trie_sizing_costs_no_memory_until_used") {
        return;
    }
    let fs = cubenet_tests::bpffs::BpfFs::new();
    let pin = fs.path().join("cubevs");
    let dp = Datapath::load(LoadOptions { object: ebpf_object(), pin_dir: Some(pin.clone()), ..LoadOptions::new() })
        .expect("load");
    assert_eq!(MapLimits::default().policy_entries().unwrap(), 16_875_520);
    for name in ["allow_out", "deny_out"] {
        let path = pin.join("maps").join(name);
        let info = aya::maps::MapInfo::from_pin(&path).unwrap();
        assert_eq!(info.max_entries(), 16_875_520, "{name}");
        assert_ne!(info.map_flags() & 1, 0, "{name}: BPF_F_NO_PREALLOC");
        let data = aya::maps::MapData::from_pin(&path).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&std::os::fd::AsFd::as_fd(data.fd()));
        let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
        let memlock: u64 = fdinfo
            .lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .map(|v| v.trim().parse().unwrap())
            .expect("memlock in fdinfo");
        eprintln!("{name}: memlock {memlock} bytes while empty");
        assert!(memlock < 64 * 1024, "{name}: an empty trie is charged {memlock} bytes");
    }
    drop(dp);
}

/// Issue 15: a replace by the entries the interface already holds (an Ensure of a pooled TAP
/// with the baseline deny, the Release of such a sandbox) writes nothing: same generation,
/// same entries. Any difference, even an order-insensitive one of a single CIDR, is written
/// under a new generation and enforced; a reordered list of the same CIDRs is the same policy.
#[test]
fn identical_policy_replace_writes_nothing_and_a_different_one_is_enforced() {
    if !require_root("identical_policy_replace_writes_nothing_and_a_different_one_is_enforced") {
        return;
    }
    let r = Rig::new();
    r.maps.policy.install_default_deny(SB_IFINDEX).unwrap();
    let d0 = r.maps.policy.dump(SB_IFINDEX).unwrap();
    let counts0 = r.maps.policy.entry_counts();
    r.maps.policy.replace(SB_IFINDEX, &EgressPolicy::default()).unwrap();
    let d1 = r.maps.policy.dump(SB_IFINDEX).unwrap();
    assert_eq!(d1, d0, "the baseline again: same generation, same entries");
    assert_eq!(r.maps.policy.entry_counts(), counts0);

    // A new source port per probe: an allowed probe opens a session later probes would match.
    let probe = |sport: u16| r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, DENIED, sport, 53, b"q")).verdict;
    assert_ne!(probe(41000), TC_ACT_SHOT, "8.8.8.8 allowed under the baseline");
    let a = deny(&["8.8.8.8", "9.9.9.9"]);
    r.maps.policy.replace(SB_IFINDEX, &a).unwrap();
    let d2 = r.maps.policy.dump(SB_IFINDEX).unwrap();
    assert_ne!(d2.generation, d1.generation, "a different policy is a new generation");
    assert_eq!(probe(41001), TC_ACT_SHOT, "and is enforced");
    // The same CIDRs in another order: nothing written.
    r.maps.policy.replace(SB_IFINDEX, &deny(&["9.9.9.9", "8.8.8.8"])).unwrap();
    assert_eq!(r.maps.policy.dump(SB_IFINDEX).unwrap(), d2);
    // One CIDR less: written and enforced.
    r.maps.policy.replace(SB_IFINDEX, &deny(&["9.9.9.9"])).unwrap();
    let d3 = r.maps.policy.dump(SB_IFINDEX).unwrap();
    assert_ne!(d3.generation, d2.generation);
    assert_ne!(probe(41002), TC_ACT_SHOT, "8.8.8.8 allowed again");
    assert_eq!(r.maps.policy.entry_counts(), (counts0.0, counts0.1 + 1), "old generation purged");
}
