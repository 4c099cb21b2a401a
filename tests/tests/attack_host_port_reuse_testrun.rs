//! Attack (`BPF_PROG_TEST_RUN`, exact verdicts and map state): a host port released with its
//! sandbox A and mapped again for sandbox B (an explicit `host_port`, or the allocator's
//! next-fit after a wrap), while a world client still holds a TCP connection to A through it.
//! The client's next segment is DNATed like any other (host-port DNAT has no per-connection
//! state for non-SYN segments, D20), so B's guest reads it; B's answer from the mapped port
//! finds the `portmap_sessions` entry the client's segment just stamped with B's version and
//! leaves as the node's host port: B takes over A's client.
//!
//! Property held: a world connection opened to one sandbox is never delivered to, or answered
//! by, another; the next owner on the same TAP by R73 (the `portmap_sessions` entry names the
//! previous version), on another TAP by R74 (`host_port_released`: no entry, and the port was
//! released less than D20's ESTABLISHED timeout ago). Both hooks (`from_world`, `xdp_world`)
//! give the same verdict. A new connection to the next owner (SYN first) works.

use aya::maps::{HashMap, Map};
use cubenet_tests::{
    frames::{Tcp as T, tcp, udp as udp_frame},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, SB_IP, VERSION},
    topology::NODE_IP,
};
use cubevs::{
    PortMapping, Proto, SandboxEntry,
    testrun::{TC_ACT_REDIRECT, TC_ACT_SHOT, XDP_DROP, XDP_REDIRECT},
};
use cubevs_common::{PortmapKey, PortmapSession, conntrack::timeout, counter, map, prog};

const HOST_PORT: u16 = 20080;
const GUEST_PORT: u16 = 8080;
const CLIENT: [u8; 4] = [203, 0, 113, 9];
const CLIENT_PORT: u16 = 5555;

/// The next owner on the same TAP (R73).
#[test]
fn a_world_connection_to_a_released_host_port_never_reaches_its_next_owner() {
    if !require_root("attack_host_port_reuse_testrun same_tap") {
        return;
    }
    reuse(SB_IFINDEX);
}

/// The next owner of the host port on another TAP (R74).
#[test]
fn a_world_connection_to_a_released_host_port_never_reaches_its_next_owner_on_another_tap() {
    if !require_root("attack_host_port_reuse_testrun another_tap") {
        return;
    }
    reuse(SB_IFINDEX + 1);
}

/// The same with A's mappings deleted as the agent's release without a record does
/// (`PortMaps::delete_of`, also A's UDP mapping of the same port number): the TCP port is
/// stamped; UDP keeps D20's behaviour (a datagram to B's UDP mapping of that port number goes
/// to B: every UDP datagram may open a flow).
#[test]
fn a_release_by_delete_of_stamps_the_tcp_host_port() {
    if !require_root("attack_host_port_reuse_testrun delete_of") {
        return;
    }
    let r = Rig::new();
    let udp = PortMapping { proto: Proto::Udp, host_port: HOST_PORT, ifindex: SB_IFINDEX, guest_port: 53 };
    r.maps.ports.add(&udp).unwrap();
    let before = cubevs::reaper::monotonic_ns();
    reuse_on(&r, B_IFINDEX, Release::DeleteOf);
    let at = r.maps.ports.released_at(HOST_PORT).unwrap().expect("stamped by delete_of");
    assert!(before <= at && at <= cubevs::reaper::monotonic_ns());
    assert!(r.maps.ports.tracks_releases());
    r.maps.ports.add(&PortMapping { ifindex: B_IFINDEX, ..udp }).unwrap();
    let out = r.world(udp_frame(r.world_mac, r.up_mac, CLIENT, NODE_IP, CLIENT_PORT, HOST_PORT, b"q"));
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "UDP to the reused port number");
}

/// How A's mappings are deleted.
#[derive(Clone, Copy)]
enum Release {
    /// `PortMaps::delete` of the one mapping (the agent's release with a record).
    Delete,
    /// `PortMaps::delete_of` A's interface (the agent's release without one, recovery).
    DeleteOf,
}

/// A on the rig's TAP with the host port and a live client connection; A released; B on
/// `b_ifindex` (with the rig's guest view) gets the host port.
fn reuse(b_ifindex: u32) {
    let r = Rig::new();
    reuse_on(&r, b_ifindex, Release::Delete);
}

/// B's ifindex on another TAP, and B's mvm IP there.
const B_IFINDEX: u32 = SB_IFINDEX + 1;
const B_IP: [u8; 4] = [192, 168, 0, 9];

/// [`reuse`] on `r`; returns the stale client's segment (TCP, to the host port).
fn reuse_on(r: &Rig, b_ifindex: u32, release: Release) -> T {
    let mapping = PortMapping { proto: Proto::Tcp, host_port: HOST_PORT, ifindex: SB_IFINDEX, guest_port: GUEST_PORT };
    r.maps.ports.add(&mapping).unwrap();
    // The client opens a connection to A and sends a request.
    let syn = T { sport: CLIENT_PORT, dport: HOST_PORT, seq: 1, syn: true, win: 500, ..Default::default() };
    assert_eq!(r.world(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, syn, b"")).verdict, TC_ACT_REDIRECT);
    let synack =
        T { sport: GUEST_PORT, dport: CLIENT_PORT, seq: 9, ack: Some(2), syn: true, win: 500, ..Default::default() };
    assert_eq!(r.cube(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, CLIENT, synack, b"")).verdict, TC_ACT_REDIRECT);
    let data = T { sport: CLIENT_PORT, dport: HOST_PORT, seq: 2, ack: Some(10), win: 500, ..Default::default() };
    assert_eq!(r.world(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, data, b"GET / A")).verdict, TC_ACT_REDIRECT);

    // A is released (unregistered, its mapping deleted); B gets the TAP and the same host port.
    r.maps.sandboxes.unregister(SB_IFINDEX).unwrap();
    match release {
        Release::Delete => r.maps.ports.delete(&mapping).unwrap(),
        Release::DeleteOf => assert!(r.maps.ports.delete_of(SB_IFINDEX).unwrap() >= 2),
    }
    let b_ip = if b_ifindex == SB_IFINDEX { SB_IP } else { B_IP };
    let b =
        SandboxEntry { ifindex: b_ifindex, ip: std::net::Ipv4Addr::from(b_ip), version: VERSION + 1, id: "b".into() };
    r.maps.sandboxes.register(&b).unwrap();
    r.maps.ports.add(&PortMapping { ifindex: b_ifindex, ..mapping }).unwrap();

    // The client, still talking to A, sends its next request with A's session cookie.
    let more = T { seq: 9, ..data };
    let stale0 = r.maps.counters.get(counter::WORLD_DROP_STALE_VERSION).unwrap();
    let out = r.world(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, more, b"Cookie: session=A-secret"));
    assert_eq!(out.verdict, TC_ACT_SHOT, "A's client's segment was delivered to B");
    assert_eq!(r.maps.counters.get(counter::WORLD_DROP_STALE_VERSION).unwrap() - stale0, 1);
    // The XDP hook gives the same verdict and count.
    let out = r.xdp(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, more, b"Cookie: session=A-secret"));
    assert_eq!(out.verdict, XDP_DROP, "xdp_world delivered A's client's segment to B");
    assert_eq!(r.maps.counters.get(counter::WORLD_DROP_STALE_VERSION).unwrap() - stale0, 2);
    // B answers as if it were A, from its own TAP.
    let reply = T { sport: GUEST_PORT, dport: CLIENT_PORT, seq: 10, ack: Some(33), win: 500, ..Default::default() };
    let out =
        r.run(prog::FROM_CUBE, tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, CLIENT, reply, b"HTTP/1.1 302 phish"), b_ifindex);
    assert_eq!(out.verdict, TC_ACT_SHOT, "B answered A's client as the node's host port");
    // Control: a new connection from the client to the port is B's to take.
    let syn2 = T { sport: CLIENT_PORT + 1, ..syn };
    assert_eq!(r.world(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, syn2, b"")).verdict, TC_ACT_REDIRECT);
    more
}

fn portmap_key(ifindex: u32, client_port: u16) -> PortmapKey {
    PortmapKey {
        ifindex,
        remote_ip: u32::from_ne_bytes(CLIENT),
        guest_port: GUEST_PORT.to_be(),
        remote_port: client_port.to_be(),
        proto: 6,
        _pad: [0; 3],
    }
}

/// A brand-new connection to the next owner on another TAP, SYN first, works in both hooks
/// and both directions; its segments after the handshake take the entry its SYN recorded.
/// The cost R74 documents: while the release is recent, a segment of B's own connection whose
/// `portmap_sessions` entry was evicted is dropped (counted) instead of re-recorded (D20); once
/// the release is older than the ESTABLISHED timeout, D20's re-recording is back.
#[test]
fn a_new_connection_to_the_next_owner_on_another_tap_works_from_its_syn() {
    if !require_root("attack_host_port_reuse_testrun new_connection") {
        return;
    }
    let r = Rig::new();
    reuse_on(&r, B_IFINDEX, Release::Delete);
    let released = r.maps.ports.released_at(HOST_PORT).unwrap().expect("the host port's release was stamped");
    assert!(released <= cubevs::reaper::monotonic_ns());
    let cport = CLIENT_PORT + 7;
    let syn = T { sport: cport, dport: HOST_PORT, seq: 100, syn: true, win: 500, ..Default::default() };
    assert_eq!(r.xdp(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, syn, b"")).verdict, XDP_REDIRECT);
    let synack =
        T { sport: GUEST_PORT, dport: cport, seq: 900, ack: Some(101), syn: true, win: 500, ..Default::default() };
    let out = r.run(prog::FROM_CUBE, tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, CLIENT, synack, b""), B_IFINDEX);
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "B's SYN-ACK to its own new client");
    let data = T { sport: cport, dport: HOST_PORT, seq: 101, ack: Some(901), win: 500, ..Default::default() };
    let stale0 = r.maps.counters.get(counter::WORLD_DROP_STALE_VERSION).unwrap();
    assert_eq!(r.world(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, data, b"GET / B")).verdict, TC_ACT_REDIRECT);
    assert_eq!(r.xdp(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, data, b"GET / B")).verdict, XDP_REDIRECT);
    let answer = T { sport: GUEST_PORT, dport: cport, seq: 901, ack: Some(108), win: 500, ..Default::default() };
    let out = r.run(prog::FROM_CUBE, tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, CLIENT, answer, b"200 B"), B_IFINDEX);
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "B's answer to its own client");
    assert_eq!(r.maps.counters.get(counter::WORLD_DROP_STALE_VERSION).unwrap(), stale0);

    // The entry is evicted (as LRU pressure would): inside the window the segment is dropped.
    let mut sessions: HashMap<_, PortmapKey, PortmapSession> =
        HashMap::try_from(Map::LruHashMap(r.kernel_map(prog::FROM_WORLD, map::PORTMAP_SESSIONS))).unwrap();
    let key = portmap_key(B_IFINDEX, cport);
    assert_eq!(sessions.get(&key, 0).unwrap().version, VERSION + 1);
    sessions.remove(&key).unwrap();
    let more = T { seq: 108, ..data };
    assert_eq!(r.world(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, more, b"x")).verdict, TC_ACT_SHOT);
    assert_eq!(r.maps.counters.get(counter::WORLD_DROP_STALE_VERSION).unwrap() - stale0, 1);
    assert!(sessions.get(&key, 0).is_err(), "a dropped segment records nothing");

    // A release older than the ESTABLISHED timeout: D20's re-recording again.
    let now = cubevs::reaper::monotonic_ns();
    let Some(old) = now.checked_sub(timeout::TCP_ESTABLISHED + 1_000_000_000) else {
        eprintln!("skipped the expired-release half: CLOCK_MONOTONIC is younger than the ESTABLISHED timeout");
        return;
    };
    let mut rel: HashMap<_, u16, u64> =
        HashMap::try_from(Map::HashMap(r.kernel_map(prog::FROM_WORLD, map::HOST_PORT_RELEASED))).unwrap();
    rel.insert(HOST_PORT.to_be(), old, 0).unwrap();
    assert_eq!(r.world(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, more, b"x")).verdict, TC_ACT_REDIRECT);
    assert_eq!(sessions.get(&key, 0).unwrap().version, VERSION + 1, "the evicted entry is re-recorded");
}
