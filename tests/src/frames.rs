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
