//! Attack (`BPF_PROG_TEST_RUN`, exact verdicts, frames and map state): a guest that controls
//! its kernel sends frames that claim to be someone else (another sandbox's mvm IP, the node,
//! cube-dev, the gateway; any MAC), frames of other protocols (IPv6, ARP replies and
//! gratuitous ARP claiming another sandbox's address) and broken IPv4 headers. Nothing spoofed
//! leaves or creates state; MACs carry no identity (the output's MACs are always the FIB's).

use cubenet_tests::{
    frames::{Tcp as T, icmp, tcp, udp},
    packet::{self, GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, SB_IP},
    topology::{CUBE_DEV_IP, NODE_IP, WORLD_IP},
};
use cubevs::testrun::{TC_ACT_REDIRECT, TC_ACT_SHOT};
use cubevs_common::counter;

/// Another sandbox's mvm IP (same CIDR as the rig's).
const OTHER_SB_IP: [u8; 4] = [192, 168, 0, 4];

fn drops_total(r: &Rig) -> u64 {
    r.maps.sandbox_stats.get(SB_IFINDEX).unwrap().unwrap().drops.values().sum()
}

/// Every frame a guest may try from a source address: UDP, TCP SYN and ACK, ICMP echo, to the
/// world, the gateway and the node address.
fn frames_from(src: [u8; 4]) -> Vec<(String, Vec<u8>)> {
    let syn = T { sport: 40000, dport: 80, seq: 1, syn: true, win: 1000, ..Default::default() };
    let ack = T { sport: 40000, dport: 80, seq: 1, ack: Some(1), win: 1000, ..Default::default() };
    let mut v = Vec::new();
    for (dname, dst) in [("world", WORLD_IP), ("gateway", GATEWAY_IP), ("node", NODE_IP)] {
        v.push((format!("udp to {dname}"), udp(GUEST_MAC, GATEWAY_MAC, src, dst, 40000, 53, b"q")));
        v.push((format!("syn to {dname}"), tcp(GUEST_MAC, GATEWAY_MAC, src, dst, syn, b"")));
        v.push((format!("ack to {dname}"), tcp(GUEST_MAC, GATEWAY_MAC, src, dst, ack, b"")));
        v.push((format!("echo to {dname}"), icmp(GUEST_MAC, GATEWAY_MAC, src, dst, true, 7, 1)));
    }
    v
}

#[test]
fn spoofed_sources_never_leave_and_never_make_state() {
    if !require_root("attack_spoof_testrun spoofed_sources_never_leave_and_never_make_state") {
        return;
    }
    let r = Rig::new();
    let sources: [(&str, [u8; 4]); 9] = [
        ("another sandbox's mvm IP", OTHER_SB_IP),
        ("its own mvm IP", SB_IP),
        ("the node address", NODE_IP),
        ("cube-dev's address", CUBE_DEV_IP),
        ("the gateway", GATEWAY_IP),
        ("the /30's other host", [169, 254, 68, 7]),
        ("0.0.0.0", [0, 0, 0, 0]),
        ("255.255.255.255", [255; 4]),
        ("a world address", WORLD_IP),
    ];
    let spoof0 = r.maps.counters.get(counter::CUBE_DROP_SPOOF).unwrap();
    let mut n = 0;
    for (sname, src) in sources {
        for (fname, f) in frames_from(src) {
            let out = r.cube(f);
            assert_eq!(out.verdict, TC_ACT_SHOT, "src {sname}, {fname}: not dropped");
            n += 1;
        }
    }
    assert_eq!(r.maps.counters.get(counter::CUBE_DROP_SPOOF).unwrap() - spoof0, n, "every spoof counted");
    let stats = r.maps.sandbox_stats.get(SB_IFINDEX).unwrap().unwrap();
    assert_eq!((stats.drops["spoof"], stats.out_packets), (n, 0), "charged to the sandbox, nothing out");
    assert!(r.maps.sessions.list().unwrap().is_empty(), "a spoofed frame made a session");
    assert!(r.maps.policy.dns_queries(None).is_empty(), "a spoofed query was tracked");

    // Control: the same frames from the guest address do leave (gateway, node and world).
    let left = frames_from(GUEST_IP).into_iter().filter(|(_, f)| r.cube(f.clone()).verdict == TC_ACT_REDIRECT).count();
    assert!(left > 0, "the control frames never left: the rig itself is broken");
}

#[test]
fn guest_macs_carry_no_identity() {
    if !require_root("attack_spoof_testrun guest_macs_carry_no_identity") {
        return;
    }
    let r = Rig::new();
    let f = |smac, dmac| udp(smac, dmac, GUEST_IP, WORLD_IP, 40000, 9000, b"payload");
    let first = r.cube(f(GUEST_MAC, GATEWAY_MAC));
    assert_eq!(first.verdict, TC_ACT_REDIRECT);
    assert_eq!((&first.data[0..6], &first.data[6..12]), (&r.world_mac[..], &r.up_mac[..]), "FIB MACs");
    // Another guest's MAC (all guests share one; here a foreign one), broadcast and multicast
    // sources, the gateway's own MAC as source, and destinations other than the gateway: the
    // same flow leaves byte for byte as before, with the FIB's MACs.
    let macs: [([u8; 6], [u8; 6]); 6] = [
        ([0x02, 0, 0, 0, 0, 0x42], GATEWAY_MAC),
        ([0xff; 6], GATEWAY_MAC),
        ([0x01, 0x00, 0x5e, 0, 0, 1], GATEWAY_MAC),
        (GATEWAY_MAC, GATEWAY_MAC),
        (GUEST_MAC, [0xff; 6]),
        (GUEST_MAC, [0x02, 0, 0, 0, 0, 0x43]),
    ];
    for (smac, dmac) in macs {
        let out = r.cube(f(smac, dmac));
        assert_eq!((out.verdict, &out.data), (TC_ACT_REDIRECT, &first.data), "smac {smac:x?} dmac {dmac:x?}");
    }
    assert_eq!(r.maps.sessions.list().unwrap().len(), 1, "one flow, one session");
}

#[test]
fn other_protocols_arp_poisoning_and_broken_headers_are_dropped() {
    if !require_root("attack_spoof_testrun other_protocols_arp_poisoning_and_broken_headers_are_dropped") {
        return;
    }
    let r = Rig::new();
    let good = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 40000, 9000, b"payload");
    let with = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut f = good.clone();
        edit(&mut f);
        f
    };
    let mut ipv6 = Vec::new();
    etherparse::PacketBuilder::ethernet2(GUEST_MAC, GATEWAY_MAC)
        .ipv6(
            [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            64,
        )
        .udp(40000, 9000)
        .write(&mut ipv6, b"v6")
        .unwrap();
    // An ARP reply telling "192.168.0.4 (another sandbox) is at my MAC", unicast to the
    // gateway and broadcast (gratuitous).
    let mut arp_reply = packet::arp_reply(GUEST_MAC, OTHER_SB_IP, GATEWAY_MAC, GATEWAY_IP);
    arp_reply[0..6].copy_from_slice(&GATEWAY_MAC);
    let mut garp_reply = arp_reply.clone();
    garp_reply[0..6].copy_from_slice(&[0xff; 6]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("IPv6", ipv6),
        ("ARP reply claiming another sandbox's IP", arp_reply),
        ("gratuitous ARP reply (broadcast)", garp_reply),
        ("IHL 4", with(&|f| f[14] = 0x44)),
        ("IHL 0", with(&|f| f[14] = 0x40)),
        ("IPv6 version in an IPv4 EtherType", with(&|f| f[14] = 0x65)),
        ("IHL 15 beyond the frame", with(&|f| f[14] = 0x4f)),
        ("first fragment (MF)", with(&|f| f[20] = 0x20)),
        ("later fragment (offset 8)", with(&|f| f[21] = 0x01)),
        ("IP protocol GRE", with(&|f| f[23] = 47)),
        ("ICMP echo reply (not a request)", icmp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, false, 1, 1)),
    ];
    for (name, f) in &cases {
        let out = r.cube(f.clone());
        assert_eq!(out.verdict, TC_ACT_SHOT, "{name}: not dropped");
    }
    assert!(r.maps.sessions.list().unwrap().is_empty(), "a dropped frame made a session");
    // Every IPv4/IPv6 case is charged to the sandbox (ARP is not counted), nothing sent.
    let stats = r.maps.sandbox_stats.get(SB_IFINDEX).unwrap().unwrap();
    assert_eq!((drops_total(&r), stats.out_packets), (cases.len() as u64 - 2, 0), "{stats:?}");

    // A gratuitous ARP *request* for another sandbox's IP is answered back to the requester
    // only (the proxy's reply, redirected to the interface it came from): nobody learns it.
    let garp = packet::arp_request(GUEST_MAC, OTHER_SB_IP, OTHER_SB_IP);
    let out = r.cube(garp);
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    assert_eq!(out.data, packet::arp_reply(GATEWAY_MAC, OTHER_SB_IP, GUEST_MAC, OTHER_SB_IP));
}
