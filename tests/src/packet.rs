//! Frame builders and parsers for test guests, on top of `etherparse`.

use etherparse::{
    ArpEthIpv4Packet, ArpOperation, ArpPacket, EtherType, Ethernet2Header, NetSlice, PacketBuilder, SlicedPacket,
    TransportSlice,
};

pub use cubevs_common::guest::{GATEWAY_IP, GATEWAY_MAC, INNER_IP as GUEST_IP, MAC as GUEST_MAC};

/// Broadcast MAC.
pub const BROADCAST: [u8; 6] = [0xff; 6];

/// An Ethernet/IPv4 ARP request from `sender` asking for `target_ip` (to broadcast).
pub fn arp_request(sender_mac: [u8; 6], sender_ip: [u8; 4], target_ip: [u8; 4]) -> Vec<u8> {
    let arp = ArpEthIpv4Packet {
        operation: ArpOperation::REQUEST,
        sender_mac,
        sender_ipv4: sender_ip,
        target_mac: [0; 6],
        target_ipv4: target_ip,
    };
    let mut out = Vec::new();
    PacketBuilder::ethernet2(sender_mac, BROADCAST)
        .arp(ArpPacket::from(arp))
        .write(&mut out)
        .expect("write ARP request");
    out
}

/// The exact ARP reply a proxy answering with `proxy_mac` must produce for
/// [`arp_request`]`(sender_mac, sender_ip, target_ip)`.
pub fn arp_reply(proxy_mac: [u8; 6], target_ip: [u8; 4], sender_mac: [u8; 6], sender_ip: [u8; 4]) -> Vec<u8> {
    let arp = ArpEthIpv4Packet {
        operation: ArpOperation::REPLY,
        sender_mac: proxy_mac,
        sender_ipv4: target_ip,
        target_mac: sender_mac,
        target_ipv4: sender_ip,
    };
    let mut out = Vec::new();
    PacketBuilder::ethernet2(proxy_mac, sender_mac).arp(ArpPacket::from(arp)).write(&mut out).expect("write ARP reply");
    out
}

/// Parses an Ethernet/IPv4 ARP frame: (Ethernet header, ARP payload).
pub fn parse_arp(frame: &[u8]) -> Option<(Ethernet2Header, ArpEthIpv4Packet)> {
    let (eth, rest) = Ethernet2Header::from_slice(frame).ok()?;
    if eth.ether_type != EtherType::ARP {
        return None;
    }
    let arp = ArpPacket::from_slice(rest).ok()?.try_eth_ipv4().ok()?;
    Some((eth, arp))
}

/// An ICMP echo request from the guest (guest MAC/IP) to `dst` via the gateway MAC, with
/// the 8-byte payload of [`crate::frames::icmp`].
pub fn icmp_echo_request(dst: [u8; 4], id: u16, seq: u16) -> Vec<u8> {
    crate::frames::icmp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, true, id, seq)
}

/// A UDP datagram from the guest (guest MAC/IP, `sport`) to `dst:dport` via the gateway MAC.
pub fn udp(dst: [u8; 4], sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    crate::frames::udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, sport, dport, payload)
}

/// Summary of an IPv4 frame for assertions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv4Summary {
    /// Ethernet source and destination.
    pub eth_src: [u8; 6],
    /// Ethernet destination.
    pub eth_dst: [u8; 6],
    /// IPv4 source.
    pub src: [u8; 4],
    /// IPv4 destination.
    pub dst: [u8; 4],
    /// What the transport layer is.
    pub transport: Transport,
}

/// Transport summary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// ICMP echo reply (id, seq).
    EchoReply(u16, u16),
    /// ICMP echo request (id, seq).
    EchoRequest(u16, u16),
    /// UDP (sport, dport, payload).
    Udp(u16, u16, Vec<u8>),
    /// TCP (sport, dport, syn, ack, rst, fin).
    Tcp { sport: u16, dport: u16, syn: bool, ack: bool, rst: bool, fin: bool },
    /// Anything else.
    Other,
}

/// Parses an Ethernet/IPv4 frame into an [`Ipv4Summary`].
pub fn parse_ipv4(frame: &[u8]) -> Option<Ipv4Summary> {
    let p = SlicedPacket::from_ethernet(frame).ok()?;
    let eth = match p.link? {
        etherparse::LinkSlice::Ethernet2(e) => e,
        _ => return None,
    };
    let ip = match p.net? {
        NetSlice::Ipv4(ip) => ip,
        _ => return None,
    };
    let transport = match p.transport {
        Some(TransportSlice::Icmpv4(icmp)) => match icmp.icmp_type() {
            etherparse::Icmpv4Type::EchoReply(h) => Transport::EchoReply(h.id, h.seq),
            etherparse::Icmpv4Type::EchoRequest(h) => Transport::EchoRequest(h.id, h.seq),
            _ => Transport::Other,
        },
        Some(TransportSlice::Udp(u)) => Transport::Udp(u.source_port(), u.destination_port(), u.payload().to_vec()),
        Some(TransportSlice::Tcp(t)) => Transport::Tcp {
            sport: t.source_port(),
            dport: t.destination_port(),
            syn: t.syn(),
            ack: t.ack(),
            rst: t.rst(),
            fin: t.fin(),
        },
        _ => Transport::Other,
    };
    Some(Ipv4Summary {
        eth_src: eth.source(),
        eth_dst: eth.destination(),
        src: ip.header().source(),
        dst: ip.header().destination(),
        transport,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arp_request_round_trips() {
        let f = arp_request(GUEST_MAC, GUEST_IP, GATEWAY_IP);
        assert_eq!(f.len(), 42);
        let (eth, arp) = parse_arp(&f).unwrap();
        assert_eq!(eth.destination, BROADCAST);
        assert_eq!(arp.operation, ArpOperation::REQUEST);
        assert_eq!(arp.target_ipv4, GATEWAY_IP);
    }

    #[test]
    fn udp_parses() {
        let f = udp([198, 51, 100, 1], 4000, 53, b"hi");
        let s = parse_ipv4(&f).unwrap();
        assert_eq!(s.transport, Transport::Udp(4000, 53, b"hi".to_vec()));
        assert_eq!(s.src, GUEST_IP);
    }
}
