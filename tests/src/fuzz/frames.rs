//! Structure-aware frame generation: a valid frame for a chosen flow, built with `etherparse`
//! (full checksums), then optionally broken by [`mutate`].

use etherparse::{
    IpHeaders, IpNumber, Ipv4Extensions, Ipv4Header, PacketBuilder, TcpHeader,
    icmpv4::{DestUnreachableHeader, TimeExceededCode},
};

use super::rng::Rng;
use crate::packet::{BROADCAST, arp_request};

/// IP protocol numbers the generator speaks.
pub mod proto {
    /// ICMP.
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
}

/// Ethernet + IPv4 + L4 addressing of one frame. Ports are host order; for ICMP echo `sport`
/// is the identifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    /// Ethernet source.
    pub smac: [u8; 6],
    /// Ethernet destination.
    pub dmac: [u8; 6],
    /// IPv4 source.
    pub src: [u8; 4],
    /// IPv4 destination.
    pub dst: [u8; 4],
    /// IP protocol ([`proto`]).
    pub proto: u8,
    /// Source port (ICMP echo: identifier).
    pub sport: u16,
    /// Destination port (ICMP: unused).
    pub dport: u16,
}

/// TCP flag bits (byte 13 of the header).
pub mod tcp_flags {
    /// FIN.
    pub const FIN: u8 = 0x01;
    /// SYN.
    pub const SYN: u8 = 0x02;
    /// RST.
    pub const RST: u8 = 0x04;
    /// PSH.
    pub const PSH: u8 = 0x08;
    /// ACK.
    pub const ACK: u8 = 0x10;
}

/// Flag sets a real stack sends, drawn more often than a random byte.
const COMMON_FLAGS: [u8; 8] = [0x02, 0x12, 0x10, 0x18, 0x11, 0x04, 0x14, 0x19];

fn ip_options(rng: &mut Rng) -> Vec<u8> {
    // NOP, end of list, record route (7), timestamp (68), router alert (148), or garbage.
    match rng.below(4) {
        0 => vec![1, 1, 1, 0],
        1 => {
            let mut o = vec![7, 11, 4];
            o.extend(rng.bytes(8));
            o.push(0);
            o
        }
        2 => vec![148, 4, 0, 0],
        _ => {
            let n = 4 * (1 + rng.below(10));
            rng.bytes(n)
        }
    }
}

fn tcp_options(rng: &mut Rng) -> Vec<u8> {
    let mut o = Vec::new();
    for _ in 0..rng.below(4) {
        match rng.below(6) {
            0 => o.extend([2, 4, 0x05, 0xb4]),                    // MSS 1460
            1 => o.extend([1, 3, 3, 7]),                          // NOP, window scale 7
            2 => o.extend([4, 2, 1, 1]),                          // SACK permitted, NOPs
            3 => o.extend([1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0]), // timestamps
            4 => o.extend([5, 10, 0, 0, 0, 1, 0, 0, 0, 2]),       // SACK block
            _ => {
                let n = 1 + rng.below(8);
                o.extend(rng.bytes(n))
            }
        }
    }
    o.truncate(40);
    while o.len() % 4 != 0 {
        o.push(0);
    }
    o
}

fn ipv4_header(rng: &mut Rng, f: &Flow, proto: u8) -> Ipv4Header {
    let mut h = Ipv4Header::new(0, 1 + rng.below(255) as u8, IpNumber(proto), f.src, f.dst).expect("ipv4 header");
    h.identification = rng.u16();
    h.dont_fragment = rng.chance(70);
    if rng.chance(10)
        && let Ok(o) = etherparse::Ipv4Options::try_from(&ip_options(rng)[..])
    {
        h.options = o;
    }
    h
}

fn payload(rng: &mut Rng) -> Vec<u8> {
    let n = match rng.below(10) {
        0..=4 => 0,
        5..=8 => rng.below(64),
        _ => rng.below(1400),
    };
    rng.bytes(n)
}

/// A valid Ethernet/IPv4 frame for `f` (all checksums right): TCP with random flags,
/// sequence numbers and options; UDP with a checksum or (sometimes) none; ICMP echo request
/// or reply (`icmp_reply`) with `f.sport` as identifier.
pub fn l4_frame(rng: &mut Rng, f: &Flow, icmp_reply: bool) -> Vec<u8> {
    let ip = ipv4_header(rng, f, f.proto);
    let b = PacketBuilder::ethernet2(f.smac, f.dmac).ip(IpHeaders::Ipv4(ip, Ipv4Extensions::default()));
    let data = payload(rng);
    let mut out = Vec::new();
    match f.proto {
        proto::TCP => {
            let mut h = TcpHeader::new(f.sport, f.dport, rng.u32(), rng.u16());
            let flags = if rng.chance(60) { *rng.pick(&COMMON_FLAGS) } else { rng.next_u64() as u8 };
            h.fin = flags & 0x01 != 0;
            h.syn = flags & 0x02 != 0;
            h.rst = flags & 0x04 != 0;
            h.psh = flags & 0x08 != 0;
            h.ack = flags & 0x10 != 0;
            h.urg = flags & 0x20 != 0;
            h.ece = flags & 0x40 != 0;
            h.cwr = flags & 0x80 != 0;
            h.ns = rng.chance(5);
            h.acknowledgment_number = rng.u32();
            if rng.chance(30) {
                let _ = h.set_options_raw(&tcp_options(rng));
            }
            b.tcp_header(h).write(&mut out, &data).expect("tcp frame");
        }
        proto::UDP => {
            b.udp(f.sport, f.dport).write(&mut out, &data).expect("udp frame");
            if rng.chance(10) {
                // No checksum (allowed for UDP over IPv4).
                let l4 = 14 + ihl(&out);
                out[l4 + 6] = 0;
                out[l4 + 7] = 0;
            }
        }
        _ => {
            let seq = rng.u16();
            let b = if icmp_reply { b.icmpv4_echo_reply(f.sport, seq) } else { b.icmpv4_echo_request(f.sport, seq) };
            b.write(&mut out, &data).expect("icmp frame");
        }
    }
    out
}

/// A valid ICMP error (fragmentation needed or TTL exceeded) from `f.src` to `f.dst`
/// embedding the IPv4 header and first 8 L4 bytes of `inner` (the packet that caused it).
pub fn icmp_error(rng: &mut Rng, f: &Flow, inner: &Flow) -> Vec<u8> {
    let mut embedded = l4_frame(rng, inner, false);
    embedded.drain(..14);
    let keep = ihl_ip(&embedded) + 8;
    embedded.truncate(keep.min(embedded.len()));
    let ip = ipv4_header(rng, f, proto::ICMP);
    let b = PacketBuilder::ethernet2(f.smac, f.dmac).ip(IpHeaders::Ipv4(ip, Ipv4Extensions::default()));
    let t = if rng.chance(50) {
        etherparse::Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::FragmentationNeeded {
            next_hop_mtu: 1280,
        })
    } else {
        etherparse::Icmpv4Type::TimeExceeded(TimeExceededCode::TtlExceededInTransit)
    };
    let mut out = Vec::new();
    b.icmpv4(t).write(&mut out, &embedded).expect("icmp error frame");
    out
}

/// An ARP request from `smac`/`sip` for `tip`, sometimes broken (reply opcode, wrong
/// hardware length, truncated).
pub fn arp(rng: &mut Rng, smac: [u8; 6], sip: [u8; 4], tip: [u8; 4]) -> Vec<u8> {
    let mut f = arp_request(smac, sip, tip);
    match rng.below(8) {
        0 => f[21] = 2,
        1 => f[18] = 5,
        2 => f.truncate(14 + rng.below(28)),
        3 => f[0..6].copy_from_slice(&BROADCAST),
        _ => {}
    }
    f
}

fn ihl_ip(ip: &[u8]) -> usize {
    ip.first().map_or(20, |b| ((b & 0x0f) as usize) * 4)
}

/// Header length of the IPv4 header after a 14-byte Ethernet header of `frame`.
pub fn ihl(frame: &[u8]) -> usize {
    ihl_ip(frame.get(14..).unwrap_or(&[]))
}

/// Breaks `frame` in 1–2 ways: bad IP or L4 checksum, truncation, trailing bytes, bad
/// total length, bad IHL, fragment bits/offset, another EtherType or IP version, TCP data
/// offset, random byte flips.
pub fn mutate(rng: &mut Rng, frame: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(2) {
        if frame.len() < 34 {
            break;
        }
        let l4 = 14 + ihl(frame);
        match rng.below(11) {
            0 => frame[24] ^= 1 + rng.below(255) as u8,
            1 => {
                let off = match frame[23] {
                    proto::TCP => 16,
                    proto::UDP => 6,
                    _ => 2,
                };
                if let Some(b) = frame.get_mut(l4 + off) {
                    *b ^= 1 + rng.below(255) as u8;
                }
            }
            2 => {
                let n = 14 + rng.below(frame.len() - 14);
                frame.truncate(n);
            }
            3 => {
                let n = 1 + rng.below(32);
                frame.extend(rng.bytes(n))
            }
            4 => {
                let v = rng.u16();
                frame[16..18].copy_from_slice(&v.to_be_bytes());
            }
            5 => frame[14] = 0x40 | rng.below(16) as u8,
            6 => {
                // More-fragments and/or an offset (first, middle or last fragment).
                let mf = if rng.chance(60) { 0x2000 } else { 0 };
                let off = if rng.chance(50) { 0 } else { 1 + rng.below(0x1fff) as u16 };
                let v = mf | off;
                frame[20..22].copy_from_slice(&v.to_be_bytes());
            }
            7 => {
                let r = rng.u16();
                let t: u16 = *rng.pick(&[0x8100, 0x86dd, 0x0806, 0x88cc, 0x0800, r]);
                frame[12..14].copy_from_slice(&t.to_be_bytes());
            }
            8 => frame[14] = (rng.below(16) as u8) << 4 | (frame[14] & 0x0f),
            9 => {
                if frame[23] == proto::TCP
                    && let Some(b) = frame.get_mut(l4 + 12)
                {
                    *b = (rng.below(16) as u8) << 4;
                }
            }
            _ => {
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(frame.len());
                    frame[i] ^= 1 << rng.below(8);
                }
            }
        }
    }
    fit_for_test_run(frame);
}

/// Pads `frame` with zero bytes to the shortest frame `BPF_PROG_TEST_RUN` accepts (kernel
/// 6.18, measured: EINVAL below an Ethernet header, below Ethernet + 20 bytes for EtherType
/// IPv4 and below Ethernet + 40 bytes for IPv6). Shorter IPv4 frames are therefore only
/// covered as "IPv4 header present, L4 cut off or total length lying".
pub fn fit_for_test_run(frame: &mut Vec<u8>) {
    let min = match frame.get(12..14) {
        Some([0x08, 0x00]) => 34,
        Some([0x86, 0xdd]) => 54,
        _ => 14,
    };
    if frame.len() < min {
        frame.resize(min, 0);
    }
}
