//! Attack (decision R101): a guest's `virtio_net_hdr` checksum offload request
//! (`VIRTIO_NET_HDR_F_NEEDS_CSUM` with `csum_start`/`csum_offset`) points into the IPv4 header,
//! so the uplink, computing the "checksum" where it was told when the packet leaves, writes a
//! 16-bit value of the guest's choosing over the destination (or source) address *after*
//! `from_cube` decided the policy and SNATed the packet. The kernel's `virtio_net_hdr_to_skb`
//! only requires `csum_start` ≥ 20 from the frame start; `from_cube` cannot see the offsets
//! (`__sk_buff` has no such fields), so it reads them from the `sk_buff` at offsets userspace
//! took from the kernel's BTF and drops a request for anything but the TCP/UDP checksum. The
//! value is the folded complement of the sum from `csum_start` to the end, so one probe datagram of a flow tells an accomplice the sum and
//! the next one, with two payload bytes adjusted, lands exactly where the guest aims; the guest
//! also writes the IPv4 header checksum the final header needs (nobody checks it on the way).
//!
//! The uplink here has TX checksum offload off (the kernel's `skb_checksum_help` writes at
//! `csum_start + csum_offset`), as on a NIC whose driver falls back to it for offsets it does
//! not know (e.g. ixgbe, i40e) or a virtio-net NIC whose host honours the offsets.
//!
//! Both tests fail without R101's check (the attack's datagrams leave with a rewritten header,
//! the request aimed at the source port leaves with another port than the SNATed one).

use std::{net::Ipv4Addr, time::Duration};

use cubenet_tests::{
    capture::{Capture, Captured},
    frames::{Tcp, fix_ip_csum, tcp, udp},
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
    // Probe: what lands on the destination with no adjustment tells the sum (dropped since R101:
    // then the aimed datagram goes out unadjusted, and must be dropped as well).
    let probe = send(b"csum-probe", frame(0, b"csum-probe", real_hi));
    assert!(probe.len() <= 1, "the probe left twice");
    let adjust = probe.first().map_or(0, |p| {
        let written = u16::from_be_bytes([p.data[30], p.data[31]]);
        // Aim: the written value is ~(S + adjust), S the sum from the destination on; the probe
        // gave S for its own marker, and the aimed datagram's S differs by its marker's words.
        let s_aimed = add1(add1(!written, !words(b"csum-probe")), words(b"csum-aimed"));
        add1(!AIM, !s_aimed)
    });
    let aimed = send(b"csum-aimed", frame(adjust, b"csum-aimed", AIM));
    let mut bad = wrong(&probe);
    bad.extend(wrong(&aimed));
    assert!(bad.is_empty(), "guest datagrams left with an IPv4 header the datapath never wrote: {bad:?}");
    assert!(probe.is_empty() && aimed.is_empty(), "a checksum request aimed at the IPv4 header left the node");
}

/// The `virtio_net_hdr` of a frame asking for its checksum at `start` + `offset` (no GSO).
fn needs_csum(start: u16, offset: u16) -> Vec<u8> {
    let mut h = vec![1u8, 0, 0, 0, 0, 0];
    h.extend_from_slice(&start.to_le_bytes());
    h.extend_from_slice(&offset.to_le_bytes());
    h.extend_from_slice(&[0, 0]);
    h
}

/// `f`'s L4 checksum field replaced by the folded pseudo-header sum, as a Linux guest leaves
/// it for the device to finish (`~csum_tcpudp_magic(…, 0)`).
fn partial(mut f: Vec<u8>, field: usize) -> Vec<u8> {
    let l4_len = (f.len() - 34) as u16;
    let mut s = words(&f[26..34]);
    s = add1(s, u16::from(f[23]));
    s = add1(s, l4_len);
    f[34 + field..36 + field].copy_from_slice(&s.to_be_bytes());
    f
}

/// Whether the TCP/UDP checksum of the captured IPv4 frame `d` verifies.
fn l4_valid(d: &[u8]) -> bool {
    let l4 = &d[34..];
    let s = add1(add1(add1(words(&d[26..34]), u16::from(d[23])), l4.len() as u16), words(l4));
    s == 0xffff
}

/// What a Linux guest sends with checksum offload passes and leaves with a valid checksum
/// (UDP: `csum_offset` 6, TCP SYN: 16, both from the L4 header); a request pointing inside the
/// L4 header but not at its checksum (here: the UDP source port, which the uplink would
/// overwrite after the SNAT chose it) is dropped.
#[test]
fn honest_checksum_offload_passes_and_a_misaimed_one_is_dropped() {
    if !require_root("attack_csum_offload honest_checksum_offload_passes_and_a_misaimed_one_is_dropped") {
        return;
    }
    let n = TapNode::new();
    n.uplink_offloads(&["tx", "off"]);
    let cap = n.topo.world.run(|| Capture::open(cubenet_sys::ifindex(WORLD_IF).expect("wp0 ifindex")));

    let mut b = needs_csum(34, 6);
    b.extend(partial(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, SPORT + 1, DPORT, b"csum-honest-udp"), 6));
    n.write(&b);
    let seen = cap.read_until(Duration::from_secs(5), |c| c.data.windows(15).any(|w| w == b"csum-honest-udp"));
    let got = carrying(&seen, b"csum-honest-udp");
    assert_eq!(got.len(), 1, "the honest UDP datagram never left");
    assert_eq!(got[0].data[26..30], NODE_IP, "not SNATed");
    assert!(l4_valid(&got[0].data), "the UDP checksum the uplink wrote does not verify: {:02x?}", got[0].data);

    const SEQ: u32 = 0x5eed_c5c5;
    let syn = Tcp { sport: SPORT + 2, dport: DPORT + 1, seq: SEQ, syn: true, win: 64240, ..Default::default() };
    let mut b = needs_csum(34, 16);
    b.extend(partial(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, syn, &[]), 16));
    n.write(&b);
    let is_syn = |c: &Captured| c.data.len() >= 54 && c.data[23] == 6 && c.data[38..42] == SEQ.to_be_bytes();
    let seen = cap.read_until(Duration::from_secs(5), is_syn);
    let got: Vec<_> = seen.iter().filter(|c| is_syn(c)).collect();
    assert_eq!(got.len(), 1, "the honest TCP SYN never left");
    assert_eq!(got[0].data[26..30], NODE_IP, "not SNATed");
    assert!(l4_valid(&got[0].data), "the TCP checksum the uplink wrote does not verify: {:02x?}", got[0].data);

    let mut b = needs_csum(34, 0);
    b.extend(partial(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, SPORT + 3, DPORT, b"csum-misaimed"), 6));
    n.write(&b);
    let seen = cap.read_until(Duration::from_millis(1500), |c| c.data.windows(13).any(|w| w == b"csum-misaimed"));
    let left: Vec<String> = carrying(&seen, b"csum-misaimed")
        .iter()
        .map(|c| format!("source port {}", u16::from_be_bytes([c.data[34], c.data[35]])))
        .collect();
    assert!(left.is_empty(), "a checksum request aimed at the UDP source port left the node: {left:?}");
}
