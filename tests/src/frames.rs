//! Exact frames for datapath assertions: TCP with chosen flags/sequence numbers, UDP, ICMP
//! echo, all with full checksums computed by `etherparse`.

use etherparse::{PacketBuilder, TcpHeader};

/// TCP segment fields for [`tcp`]. Unset fields are zero / false; `ack: Some(n)` sets ACK.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tcp {
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgment number (sets the ACK flag).
    pub ack: Option<u32>,
    /// SYN flag.
    pub syn: bool,
    /// FIN flag.
    pub fin: bool,
    /// RST flag.
    pub rst: bool,
    /// Window.
    pub win: u16,
}

/// An Ethernet/IPv4 (TTL 64, DF) TCP frame.
pub fn tcp(smac: [u8; 6], dmac: [u8; 6], src: [u8; 4], dst: [u8; 4], t: Tcp, payload: &[u8]) -> Vec<u8> {
    let mut h = TcpHeader::new(t.sport, t.dport, t.seq, t.win);
    h.syn = t.syn;
    h.fin = t.fin;
    h.rst = t.rst;
    if let Some(a) = t.ack {
        h.ack = true;
        h.acknowledgment_number = a;
    }
    let mut out = Vec::new();
    PacketBuilder::ethernet2(smac, dmac).ipv4(src, dst, 64).tcp_header(h).write(&mut out, payload).expect("tcp frame");
    out
}

/// An Ethernet/IPv4 UDP frame.
pub fn udp(
    smac: [u8; 6],
    dmac: [u8; 6],
    src: [u8; 4],
    dst: [u8; 4],
    sport: u16,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = Vec::new();
    PacketBuilder::ethernet2(smac, dmac)
        .ipv4(src, dst, 64)
        .udp(sport, dport)
        .write(&mut out, payload)
        .expect("udp frame");
    out
}

/// An Ethernet/IPv4 ICMP echo request (`request`) or reply with an 8-byte payload.
pub fn icmp(smac: [u8; 6], dmac: [u8; 6], src: [u8; 4], dst: [u8; 4], request: bool, id: u16, seq: u16) -> Vec<u8> {
    let mut out = Vec::new();
    let b = PacketBuilder::ethernet2(smac, dmac).ipv4(src, dst, 64);
    if request { b.icmpv4_echo_request(id, seq) } else { b.icmpv4_echo_reply(id, seq) }
        .write(&mut out, b"abcdefgh")
        .expect("icmp frame");
    out
}

/// Rewrites the IPv4 header checksum of the Ethernet frame `f` (20-byte IP header at offset
/// 14) in place.
pub fn fix_ip_csum(f: &mut [u8]) {
    f[24] = 0;
    f[25] = 0;
    let mut sum = 0u32;
    for w in f[14..34].chunks(2) {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    f[24..26].copy_from_slice(&(!(sum as u16)).to_be_bytes());
}

/// Splits the Ethernet/IPv4 frame `f` (20-byte IP header) into a first fragment carrying
/// `first_len` bytes of the IP payload (a multiple of 8; MF set) and a last fragment with the
/// rest, both with IP id `id` and their header checksums fixed.
pub fn fragment(f: &[u8], id: u16, first_len: usize) -> (Vec<u8>, Vec<u8>) {
    let payload = &f[34..];
    let mk = |part: &[u8], off: usize, more: bool| {
        let mut g = f[..34].to_vec();
        g.extend_from_slice(part);
        g[16..18].copy_from_slice(&((20 + part.len()) as u16).to_be_bytes());
        g[18..20].copy_from_slice(&id.to_be_bytes());
        let fo = (off / 8) as u16 | if more { 0x2000 } else { 0 };
        g[20..22].copy_from_slice(&fo.to_be_bytes());
        fix_ip_csum(&mut g);
        g
    };
    (mk(&payload[..first_len], 0, true), mk(&payload[first_len..], first_len, false))
}
