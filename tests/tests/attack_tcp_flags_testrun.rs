//! Attack (`BPF_PROG_TEST_RUN`, exact verdicts and map state): a guest that controls its
//! kernel opens flows with odd TCP flag sets and tunnels, with an allow-everything policy.
//! Property: only a segment whose SYN is its only control flag among SYN/ACK/FIN/RST opens a
//! session (and leaves, SNATed, payload untouched: a SYN may carry data, RFC 793 and TCP Fast
//! Open); SYN+FIN, SYN+RST, a segment without flags, FIN or RST alone, and the "Christmas
//! tree" never make state and never leave: the guest gets a RST addressed to itself at most.
//! IP-in-IP, 6in4, GRE, SCTP and UDP-Lite never leave, whatever they carry inside.

use cubenet_tests::{
    frames::{Tcp as T, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX},
    topology::WORLD_IP,
};
use cubevs::{
    EgressPolicy,
    testrun::{TC_ACT_REDIRECT, TC_ACT_SHOT},
};

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;
const URG: u8 = 0x20;
const ECE: u8 = 0x40;
const CWR: u8 = 0x80;
/// Offset of the TCP flags byte in an Ethernet/IPv4(20)/TCP frame.
const FLAGS_AT: usize = 14 + 20 + 13;

fn open_rig() -> Rig {
    Rig::with_policy(&EgressPolicy { allow_out: vec!["0.0.0.0/0".into()], ..Default::default() })
}

/// A TCP segment from the guest to the world with exactly `flags` (checksum not recomputed:
/// the datapath never verifies it).
fn segment(sport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let t = T { sport, dport: 80, seq: 1000, win: 1000, ..Default::default() };
    let mut f = tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, t, payload);
    f[FLAGS_AT] = flags;
    f
}

#[test]
fn odd_tcp_flags_never_open_a_flow() {
    if !require_root("attack_tcp_flags_testrun odd_tcp_flags_never_open_a_flow") {
        return;
    }
    let r = open_rig();
    let odd: [(&str, u8); 8] = [
        ("SYN+FIN", SYN | FIN),
        ("SYN+RST", SYN | RST),
        ("SYN+FIN+RST+ACK", SYN | FIN | RST | ACK),
        ("no flags", 0),
        ("FIN alone", FIN),
        ("RST alone", RST),
        ("Christmas tree (FIN+PSH+URG)", FIN | PSH | URG),
        ("SYN+ACK (a reply nobody asked for)", SYN | ACK),
    ];
    for (i, (name, flags)) in odd.iter().enumerate() {
        let out = r.cube(segment(41000 + i as u16, *flags, b"odd"));
        match out.verdict {
            TC_ACT_SHOT => {}
            TC_ACT_REDIRECT => {
                // Only the datapath's RST back to the guest, never the segment toward the world.
                assert_eq!(out.data[30..34], GUEST_IP, "{name}: left toward {:?}", &out.data[30..34]);
                assert_eq!(out.data[FLAGS_AT] & RST, RST, "{name}: redirected, but not as a RST");
            }
            v => panic!("{name}: verdict {v}"),
        }
        assert!(r.maps.sessions.list().unwrap().is_empty(), "{name}: made a session");
    }
    let stats = r.maps.sandbox_stats.get(SB_IFINDEX).unwrap().unwrap();
    assert_eq!(stats.out_packets, 0, "{stats:?}");

    // Controls: a SYN with data, a SYN with ECN setup bits, and with PSH+URG, each open one
    // session and leave SNATed with their bytes.
    let payload = b"GET / HTTP/1.1\r\n\r\n";
    let good: [(&str, u8, &[u8]); 3] =
        [("SYN with data", SYN, payload), ("SYN+ECE+CWR", SYN | ECE | CWR, b""), ("SYN+PSH+URG", SYN | PSH | URG, b"")];
    for (i, (name, flags, data)) in good.iter().enumerate() {
        let out = r.cube(segment(42000 + i as u16, *flags, data));
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "{name}");
        assert_eq!(out.data[30..34], WORLD_IP, "{name}: toward the world");
        assert_eq!(out.data[FLAGS_AT], *flags, "{name}: flags kept");
        assert!(out.data.ends_with(data), "{name}: payload kept");
        assert_eq!(r.maps.sessions.list().unwrap().len(), i + 1, "{name}: one session");
    }
}

#[test]
fn tunnels_and_other_transports_never_leave() {
    if !require_root("attack_tcp_flags_testrun tunnels_and_other_transports_never_leave") {
        return;
    }
    let r = open_rig();
    // An inner IPv4 UDP packet toward a world host, as a tunnel would carry it.
    let inner = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, b"inner")[14..].to_vec();
    let carrier = |proto: u8| {
        let mut f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, b"")[..34].to_vec();
        f.extend_from_slice(&inner);
        f[16..18].copy_from_slice(&((20 + inner.len()) as u16).to_be_bytes());
        f[23] = proto;
        cubenet_tests::frames::fix_ip_csum(&mut f);
        f
    };
    let cases: [(&str, u8); 6] =
        [("IP-in-IP", 4), ("6in4", 41), ("GRE", 47), ("ESP", 50), ("SCTP", 132), ("UDP-Lite", 136)];
    for (name, proto) in cases {
        let out = r.cube(carrier(proto));
        assert_eq!(out.verdict, TC_ACT_SHOT, "{name}: not dropped");
    }
    assert!(r.maps.sessions.list().unwrap().is_empty());
    let stats = r.maps.sandbox_stats.get(SB_IFINDEX).unwrap().unwrap();
    assert_eq!((stats.drops["protocol"], stats.out_packets), (cases.len() as u64, 0), "{stats:?}");
    // Control: the inner packet itself, sent plainly, leaves.
    let plain = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, b"inner");
    assert_eq!(r.cube(plain).verdict, TC_ACT_REDIRECT, "the rig lets the plain packet out");
}
