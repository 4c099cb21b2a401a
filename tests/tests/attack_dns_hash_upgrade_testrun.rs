//! Attack on FQDN allow across an upgrade (`BPF_PROG_TEST_RUN`, pinned maps): R48 made the
//! datapath confirm an FQDN pattern's match by its name in `dns_allow_names`, but a pattern
//! written by a loader before R48 has no name there and kept the forgeable 64-bit FNV match
//! until its policy was written again. On a node upgraded in place (the new object and agent
//! adopt the pinned maps, the running sandboxes keep their policies) a long-lived sandbox
//! allowed `*.github.com` still learned the attacker's address for `www.L.attacker.example`
//! (the label of `attack_dns_hash_testrun`). Now the adopting agent names every such key from
//! its record and seals the generation (`PolicyTable::backfill_names`, decision R52): the
//! forged name is refused, the genuine names stay allowed throughout, and a key no recorded
//! pattern names matches nothing. Property: after the upgrade a name is allowed only when it
//! *is* an allowed name, as on a node that never ran the older loader.
//!
//! "A loader before R48" is played by the exact map state it leaves: the `dns_allow` keys of
//! the policy with nothing under them in `dns_allow_names` (an object before R48 has no such
//! map: the new object creates it empty, which is the same state).

use std::{net::Ipv4Addr, path::Path};

use aya::maps::{HashMap, Map, MapData};
use cubenet_tests::{
    bpffs::BpfFs,
    dns::{self, Owner, a},
    frames::{Tcp as T, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    EgressPolicy,
    policy::{FqdnAllow, NameBackfill},
    testrun::TC_ACT_REDIRECT,
};
use cubevs_common::{
    counter,
    dns::{DnsAllowKey, DnsAllowName, name_hash},
    map,
};

const RESOLVER: [u8; 4] = WORLD_IP;
/// The attacker's server, and the genuine names' addresses (TEST-NET-3, denied by CIDR).
const EVIL: [u8; 4] = [203, 0, 113, 66];
const GITHUB: [u8; 4] = [203, 0, 113, 10];
const GITHUB2: [u8; 4] = [203, 0, 113, 11];
const ORG: [u8; 4] = [203, 0, 113, 12];

/// 16-byte label with FNV-1a 64 (`name_hash`) of `L.attacker.example` = that of `github.com`
/// (the label of `attack_dns_hash_testrun`; checked in each test).
const COLLIDING_LABEL: [u8; 16] =
    [0xfc, 0x05, 0x0d, 0x04, 0x38, 0x00, 0x0f, 0x0e, 0x05, 0x02, 0x06, 0x1f, 0x03, 0x02, 0x1d, 0x0c];

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

fn assert_label_collides() {
    assert_eq!(
        fnv_suffix_hash(&[&COLLIDING_LABEL, b"attacker", b"example"]),
        name_hash("github.com"),
        "the colliding label no longer collides"
    );
}

/// `msg` (built for `www.x.attacker.example`) with its `x` label replaced by the colliding one.
fn with_colliding_label(msg: Vec<u8>) -> Vec<u8> {
    assert_eq!(&msg[16..18], &[1, b'x']);
    let mut m = msg[..16].to_vec();
    m.push(COLLIDING_LABEL.len() as u8);
    m.extend_from_slice(&COLLIDING_LABEL);
    m.extend_from_slice(&msg[18..]);
    m
}

/// Internet off, the resolver allowed by CIDR, `fqdn` allowed by name.
fn policy(fqdn: &[&str]) -> EgressPolicy {
    EgressPolicy {
        allow_internet_access: false,
        allow_out: vec![format!("{}/32", Ipv4Addr::from(RESOLVER))],
        allow_fqdn: fqdn.iter().map(|n| FqdnAllow { name: (*n).into(), ports: vec![] }).collect(),
        ..Default::default()
    }
}

/// The pinned `dns_allow_names`, opened as another process (the older loader, a test check).
fn names(pin_dir: &Path) -> HashMap<MapData, DnsAllowKey, DnsAllowName> {
    let data = MapData::from_pin(pin_dir.join("maps").join(map::DNS_ALLOW_NAMES)).expect("open dns_allow_names pin");
    HashMap::try_from(Map::HashMap(data)).expect("dns_allow_names is a hash map")
}

/// Leaves `dns_allow_names` as a loader before R48 does: nothing in it.
fn as_written_before_r48(pin_dir: &Path) {
    let mut m = names(pin_dir);
    let keys: Vec<DnsAllowKey> = m.keys().map(|k| k.expect("key")).collect();
    assert!(!keys.is_empty(), "this loader writes names: there is something to take away");
    for k in keys {
        m.remove(&k).expect("delete name");
    }
}

/// Keys of `dns_allow_names` of the rig sandbox: (name_hash, subdomains) with the name's
/// length, sorted.
fn names_of_sandbox(pin_dir: &Path) -> Vec<(u64, u8, u8)> {
    let m = names(pin_dir);
    let mut v: Vec<_> = m
        .iter()
        .map(|e| e.expect("entry"))
        .filter(|(k, _)| k.ifindex == SB_IFINDEX)
        .map(|(k, n)| (k.name_hash, k.subdomains, n.len))
        .collect();
    v.sort_unstable();
    v
}

fn syn_allowed(r: &Rig, gport: u16, dst: [u8; 4]) -> bool {
    let syn = T { sport: gport, dport: 443, seq: 1, syn: true, win: 1000, ..Default::default() };
    let out = r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, syn, b""));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    out.data[26..30] == NODE_IP
}

/// Sends `query` from `gport` to the resolver and its `response` back (asserting it reaches
/// the guest).
fn ask(r: &Rig, gport: u16, query: &[u8], response: &[u8]) {
    let out = r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, RESOLVER, gport, 53, query));
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "query forwarded");
    let snat = r.maps.sessions.list().unwrap().into_iter().find(|s| s.guest_port == gport).expect("session").snat_port;
    let out = r.world(udp(r.world_mac, r.up_mac, RESOLVER, NODE_IP, 53, snat, response));
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "response delivered");
}

/// A genuine query for `name` answered `addr`.
fn ask_genuine(r: &Rig, gport: u16, id: u16, name: &str, addr: [u8; 4]) {
    ask(r, gport, &dns::query(id, name), &dns::response(id, name, &[a(Owner::Question, addr, 600)]));
}

/// The forged query `www.L.attacker.example` answered [`EVIL`].
fn ask_forged(r: &Rig, gport: u16, id: u16) {
    let q = with_colliding_label(dns::query(id, "www.x.attacker.example"));
    let resp = with_colliding_label(dns::response(id, "www.x.attacker.example", &[a(Owner::Question, EVIL, 60)]));
    ask(r, gport, &q, &resp);
}

fn learned(r: &Rig) -> Vec<Ipv4Addr> {
    r.maps.policy.learned(Some(SB_IFINDEX)).iter().map(|e| e.ip).collect()
}

#[test]
fn a_pattern_written_before_r48_is_matched_by_name_after_the_upgrade() {
    if !require_root("a_pattern_written_before_r48_is_matched_by_name_after_the_upgrade") {
        return;
    }
    assert_label_collides();
    let bpffs = BpfFs::new();
    let pin_dir = bpffs.path().join("cubevs");
    let mut r = Rig::pinned(pin_dir.clone());
    // The sandbox's policy, as the older agent wrote it and recorded it.
    let record = policy(&["*.github.com"]);
    r.maps.policy.replace(SB_IFINDEX, &record).expect("policy");
    as_written_before_r48(&pin_dir);
    let before = r.maps.policy.dump(SB_IFINDEX).unwrap().generation;
    // The sandbox runs and uses its allowed names before the upgrade.
    ask_genuine(&r, 5300, 0x4300, "api.github.com", GITHUB);
    assert_eq!(learned(&r), vec![Ipv4Addr::from(GITHUB)]);

    // Upgrade: the new datapath adopts the pins, the new agent adopts the sandbox from its
    // record (what `converge` does at recovery).
    r.reload();
    let b = r.maps.policy.backfill_names(SB_IFINDEX, &record).expect("backfill");
    assert_eq!(b, NameBackfill { named: 1, unnamed: 0, sealed: true });
    assert_eq!(r.maps.policy.dump(SB_IFINDEX).unwrap().generation, before, "no new generation was written");
    assert_eq!(
        names_of_sandbox(&pin_dir),
        vec![(0, 0xff, 0), (name_hash("github.com"), 1, 11)],
        "the seal and `06 github 03 com` (11 bytes)"
    );
    // A second adoption (a restart) finds the seal and writes nothing.
    assert_eq!(
        r.maps.policy.backfill_names(SB_IFINDEX, &record).unwrap(),
        NameBackfill { sealed: true, ..Default::default() }
    );

    // What was allowed before stays allowed.
    assert_eq!(learned(&r), vec![Ipv4Addr::from(GITHUB)], "the learned address survived the upgrade");
    assert!(syn_allowed(&r, 40000, GITHUB));

    // The attack.
    let not_allowed = r.counter(counter::DNS_QUERY_NOT_ALLOWED);
    ask_forged(&r, 5301, 0x4242);
    assert_eq!(r.counter(counter::DNS_QUERY_NOT_ALLOWED), not_allowed + 1, "the forged name was taken as allowed");
    assert_eq!(learned(&r), vec![Ipv4Addr::from(GITHUB)], "learned an address for a name no pattern allows");
    assert!(!syn_allowed(&r, 40001, EVIL), "the sandbox reached the attacker's address");

    // Genuine names are still learned after the upgrade.
    ask_genuine(&r, 5302, 0x4301, "www.github.com", GITHUB2);
    assert_eq!(learned(&r), vec![Ipv4Addr::from(GITHUB), Ipv4Addr::from(GITHUB2)]);
    assert!(syn_allowed(&r, 40002, GITHUB2));

    // The seal goes with its generation.
    r.maps.policy.install_default_deny(SB_IFINDEX).expect("release");
    assert!(names_of_sandbox(&pin_dir).is_empty(), "names or seal left behind");
}

#[test]
fn a_key_the_record_does_not_name_matches_nothing_once_sealed() {
    if !require_root("a_key_the_record_does_not_name_matches_nothing_once_sealed") {
        return;
    }
    assert_label_collides();
    let bpffs = BpfFs::new();
    let pin_dir = bpffs.path().join("cubevs");
    let mut r = Rig::pinned(pin_dir.clone());
    // The maps hold `*.github.com` and `*.example.org` without names; the record the new
    // agent adopts from names only `*.example.org`: the `*.github.com` key cannot be named.
    r.maps.policy.replace(SB_IFINDEX, &policy(&["*.github.com", "*.example.org"])).expect("policy");
    as_written_before_r48(&pin_dir);
    r.reload();
    let b = r.maps.policy.backfill_names(SB_IFINDEX, &policy(&["*.example.org"])).expect("backfill");
    assert_eq!(b, NameBackfill { named: 1, unnamed: 1, sealed: true });

    // Neither the forged name nor the genuine one passes the unnamed key (fail closed).
    let not_allowed = r.counter(counter::DNS_QUERY_NOT_ALLOWED);
    ask_forged(&r, 5300, 0x4242);
    ask_genuine(&r, 5301, 0x4300, "api.github.com", GITHUB);
    assert_eq!(r.counter(counter::DNS_QUERY_NOT_ALLOWED), not_allowed + 2);
    assert_eq!(learned(&r), Vec::<Ipv4Addr>::new(), "an unnamed key of a sealed generation matched");
    assert!(!syn_allowed(&r, 40000, EVIL));
    // The named pattern works.
    ask_genuine(&r, 5302, 0x4301, "www.example.org", ORG);
    assert_eq!(learned(&r), vec![Ipv4Addr::from(ORG)]);
    assert!(syn_allowed(&r, 40001, ORG));
}

#[test]
fn a_name_lost_from_a_sealed_generation_fails_closed() {
    if !require_root("a_name_lost_from_a_sealed_generation_fails_closed") {
        return;
    }
    assert_label_collides();
    let bpffs = BpfFs::new();
    let pin_dir = bpffs.path().join("cubevs");
    let r = Rig::pinned(pin_dir.clone());
    r.maps.policy.replace(SB_IFINDEX, &policy(&["*.github.com"])).expect("policy");
    // This loader seals what it writes.
    let generation = r.maps.policy.dump(SB_IFINDEX).unwrap().generation.expect("generation");
    assert!(names(&pin_dir).get(&DnsAllowKey::seal(SB_IFINDEX, generation), 0).is_ok(), "a new generation is sealed");
    // Take the pattern's name away: the key is left with its hash only.
    let key = DnsAllowKey {
        ifindex: SB_IFINDEX,
        generation,
        name_hash: name_hash("github.com"),
        subdomains: 1,
        _pad: [0; 7],
    };
    names(&pin_dir).remove(&key).expect("delete name");
    let not_allowed = r.counter(counter::DNS_QUERY_NOT_ALLOWED);
    ask_forged(&r, 5300, 0x4242);
    assert_eq!(r.counter(counter::DNS_QUERY_NOT_ALLOWED), not_allowed + 1, "the forged name matched by hash");
    assert!(learned(&r).is_empty());
    assert!(!syn_allowed(&r, 40000, EVIL));
}

#[test]
fn an_older_agent_after_the_upgrade_keeps_its_names_allowed() {
    if !require_root("an_older_agent_after_the_upgrade_keeps_its_names_allowed") {
        return;
    }
    let bpffs = BpfFs::new();
    let pin_dir = bpffs.path().join("cubevs");
    let mut r = Rig::pinned(pin_dir.clone());
    let record = policy(&["*.github.com"]);
    r.maps.policy.replace(SB_IFINDEX, &record).expect("policy");
    as_written_before_r48(&pin_dir);
    r.reload();
    assert!(r.maps.policy.backfill_names(SB_IFINDEX, &record).expect("backfill").sealed);
    // Rollback to an agent before R48, which writes the sandbox a new policy: a new
    // generation, its keys without names and unsealed.
    r.maps.policy.replace(SB_IFINDEX, &policy(&["*.github.com", "*.example.org"])).expect("policy");
    as_written_before_r48(&pin_dir);
    r.reload();
    // Its names are allowed (today's behaviour of that loader: matched by hash).
    ask_genuine(&r, 5300, 0x4300, "api.github.com", GITHUB);
    ask_genuine(&r, 5301, 0x4301, "www.example.org", ORG);
    assert_eq!(learned(&r), vec![Ipv4Addr::from(GITHUB), Ipv4Addr::from(ORG)]);
    assert!(syn_allowed(&r, 40000, GITHUB) && syn_allowed(&r, 40001, ORG));
}
