//! Attack: a guest writes GSO frames whose `virtio_net_hdr` asks for tiny segments, or for a
//! GSO type its TAP never announced, to have the node's uplink cut one frame into thousands of
//! packets (decision R100). A VMM's rate limiter charges the frame as written (bytes, one op);
//! a TCP frame of 2,000 bytes with `gso_size` 1 left an uplink without TSO as 2,000 one-byte
//! segments (about 55 bytes on the wire per byte charged), and UDP "fragmentation offload"
//! (`VIRTIO_NET_HDR_GSO_UDP`, which the pool's TAPs never announce) left as IPv4 fragments of
//! 8 bytes, which `from_cube` otherwise never forwards: node CPU and the shared uplink spent on
//! one sandbox's behalf, far beyond what its VMM let through.
//!
//! The real datapath runs on a real TAP opened as the pool opens it (vnet header, TSO); the
//! uplink has TSO and GSO off, as a NIC without segmentation offload, so what the kernel sends
//! is what a wire would see. Order, not time, decides: a plain control datagram follows the
//! attack frames on the same path, and the capture on the world end reads until it arrives.

use std::time::Duration;

use cubenet_tests::{
    capture::{Capture, Captured},
    frames::{Tcp, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    tap_node::TapNode,
    topology::{NODE_IP, WORLD_IF, WORLD_IP},
};
use cubevs_common::counter;

/// `virtio_net_hdr` (12 bytes, little endian) with `VIRTIO_NET_HDR_F_NEEDS_CSUM`, checksum from
/// the L4 header (offset 34) with the field at `csum_offset`.
fn vnet(gso_type: u8, hdr_len: u16, gso_size: u16, csum_offset: u16) -> Vec<u8> {
    let mut h = vec![1, gso_type];
    for x in [hdr_len, gso_size, 34, csum_offset, 0] {
        h.extend_from_slice(&x.to_le_bytes());
    }
    h
}

const GSO_TCPV4: u8 = 1;
const GSO_UDP: u8 = 3;
const GSO_UDP_L4: u8 = 5;

/// A TCP SYN carrying `len` bytes to the world's `dport`, as one GSO frame of `gso_size`.
fn tcp_gso(dport: u16, gso_size: u16, len: usize) -> Vec<u8> {
    let t = Tcp { sport: dport + 1000, dport, seq: 1, syn: true, win: 1000, ..Tcp::default() };
    let mut b = vnet(GSO_TCPV4, 54, gso_size, 16);
    b.extend(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, t, &vec![b'x'; len]));
    b
}

/// A UDP datagram of `len` bytes to the world's `dport`, as one GSO frame of `gso_type`.
fn udp_gso(dport: u16, gso_type: u8, gso_size: u16, len: usize) -> Vec<u8> {
    let mut b = vnet(gso_type, 42, gso_size, 6);
    b.extend(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, dport + 1000, dport, &vec![b'x'; len]));
    b
}

/// The IPv4 packet of a captured frame sent by the node address: (protocol, is a fragment,
/// destination port of an unfragmented or first-fragment TCP/UDP packet, L4 payload length).
fn from_node(c: &Captured) -> Option<(u8, bool, Option<u16>, usize)> {
    let d = &c.data;
    if d.len() < 34 || d[12..14] != [0x08, 0x00] || d[26..30] != NODE_IP {
        return None;
    }
    let ihl = usize::from(d[14] & 0x0f) * 4;
    let frag = u16::from_be_bytes([d[20], d[21]]);
    let fragment = frag & 0x2000 != 0 || frag & 0x1fff != 0;
    let first = frag & 0x1fff == 0;
    let l4 = 14 + ihl;
    let dport = (first && d.len() >= l4 + 4).then(|| u16::from_be_bytes([d[l4 + 2], d[l4 + 3]]));
    let hlen = if d[23] == 6 && d.len() > l4 + 12 { usize::from(d[l4 + 12] >> 4) * 4 } else { 8 };
    let tot = usize::from(u16::from_be_bytes([d[16], d[17]]));
    Some((d[23], fragment, dport, tot.saturating_sub(ihl + hlen)))
}

#[test]
fn tiny_and_unannounced_gso_frames_never_leave_the_node() {
    if !require_root("attack_gso tiny_and_unannounced_gso_frames_never_leave_the_node") {
        return;
    }
    let n = TapNode::new();
    let maps = n.dp().maps();
    // A NIC without segmentation offload: the kernel segments GSO frames in software.
    n.uplink_offloads(&["tso", "off", "gso", "off"]);

    let cap = n.topo.world.run(|| Capture::open(cubenet_sys::ifindex(WORLD_IF).expect("wp0 ifindex")));
    let write = |buf: &[u8]| n.write(buf);
    // The neighbour of the world address is resolved before anything is counted.
    let warm = b"gso-warm";
    let mut b = vec![0u8; 12];
    b.extend(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 40000, 7000, warm));
    write(&b);
    let seen = cap.read_until(Duration::from_secs(5), |c| c.data.ends_with(warm));
    assert!(seen.iter().any(|c| c.data.ends_with(warm)), "the warm-up datagram never left");

    let drops0 = maps.counters.get(counter::CUBE_DROP_PROTO).unwrap();
    // Attacks (destination port → what): each one frame.
    let attacks: [(u16, &str, Vec<u8>); 4] = [
        (7001, "TCP gso_size 1", tcp_gso(7001, 1, 4000)),
        (7002, "TCP gso_size 47", tcp_gso(7002, 47, 4000)),
        (7003, "UDP fragmentation offload, 8-byte fragments", udp_gso(7003, GSO_UDP, 8, 2000)),
        (7004, "UDP segmentation offload, gso_size 1", udp_gso(7004, GSO_UDP_L4, 1, 100)),
    ];
    for (_, _, f) in &attacks {
        write(f);
    }
    // An honest TSO frame (the guest's MSS 1400) still leaves, cut as the guest asked.
    write(&tcp_gso(7005, 1400, 8000));
    let control = b"gso-control";
    let mut b = vec![0u8; 12];
    b.extend(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 40001, 7000, control));
    write(&b);
    // Before R100 the world's receive backlog overflowed with segments and the control was
    // lost: the leak is asserted first, on whatever arrived.
    let seen = cap.read_until(Duration::from_secs(5), |c| c.data.ends_with(control));

    let pkts: Vec<(u8, bool, Option<u16>, usize)> = seen.iter().filter_map(from_node).collect();
    let fragments = pkts.iter().filter(|p| p.1).count();
    let leaked: Vec<(&str, usize)> = attacks
        .iter()
        .map(|(port, name, _)| (*name, pkts.iter().filter(|p| p.2 == Some(*port)).count()))
        .filter(|(_, n)| *n > 0)
        .collect();
    assert!(
        leaked.is_empty() && fragments == 0,
        "GSO attack frames left the uplink (name, packets): {leaked:?}, IPv4 fragments: {fragments}"
    );
    assert!(seen.iter().any(|c| c.data.ends_with(control)), "the control datagram never left");
    let honest: Vec<usize> = pkts.iter().filter(|p| p.2 == Some(7005)).map(|p| p.3).collect();
    assert_eq!(honest.iter().sum::<usize>(), 8000, "the honest TSO frame's segments: {honest:?}");
    assert!(honest.iter().all(|&n| n <= 1400), "segments larger than the guest's gso_size: {honest:?}");
    let drops = maps.counters.get(counter::CUBE_DROP_PROTO).unwrap() - drops0;
    assert_eq!(drops, attacks.len() as u64, "drop_proto counted for every attack frame");
    let sessions = maps.sessions.list().unwrap();
    assert!(sessions.iter().all(|s| !(8001..=8004).contains(&s.guest_port)), "{sessions:?}");
}
