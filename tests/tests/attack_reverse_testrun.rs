//! Attack on the reverse path and on another sandbox's identity (`BPF_PROG_TEST_RUN`, exact
//! verdicts, frames and map state). Sandbox B has a UDP and a TCP session to the world and a
//! host port a world client is connected to. Sandbox A (the rig's sandbox) sends what would be
//! B's replies if the datapath took them for world traffic: to the node address at B's SNAT
//! ports, at B's host port, and from B's guest port to B's client (to leave as B's host port).
//! Property: nothing reaches B or changes B's state, and nothing leaves as B.

use std::net::Ipv4Addr;

use cubenet_tests::{
    frames::{Tcp as T, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IP},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{PortMapping, Proto, SandboxEntry, prog, testrun::TC_ACT_REDIRECT};

const B_IFINDEX: u32 = 101;
const B_HOST_PORT: u16 = 20080;
const B_GUEST_PORT: u16 = 8080;
const CLIENT: [u8; 4] = [203, 0, 113, 9];

#[test]
fn a_never_answers_for_b_nor_reaches_b_through_the_node_address() {
    if !require_root("attack_reverse_testrun a_never_answers_for_b_nor_reaches_b_through_the_node_address") {
        return;
    }
    let r = Rig::new();
    r.add_sandbox(&SandboxEntry {
        ifindex: B_IFINDEX,
        ip: Ipv4Addr::new(192, 168, 0, 4),
        version: 3,
        id: "sb-b".into(),
    });
    let from_b = |f: Vec<u8>| r.run(prog::FROM_CUBE, f, B_IFINDEX);

    // B's state: a UDP and a TCP session to the world, a world client on B's host port.
    assert_eq!(from_b(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, b"q")).verdict, TC_ACT_REDIRECT);
    let syn = T { sport: 5001, dport: 80, seq: 1, syn: true, win: 1000, ..Default::default() };
    assert_eq!(from_b(tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, syn, b"")).verdict, TC_ACT_REDIRECT);
    let b_sessions = r.maps.sessions.list().unwrap();
    let port_of = |proto: &str| b_sessions.iter().find(|s| s.proto == proto).expect("B session").snat_port;
    let (b_udp, b_tcp) = (port_of("udp"), port_of("tcp"));
    r.maps
        .ports
        .add(&PortMapping { proto: Proto::Tcp, host_port: B_HOST_PORT, ifindex: B_IFINDEX, guest_port: B_GUEST_PORT })
        .unwrap();
    let csyn = T { sport: 5555, dport: B_HOST_PORT, seq: 1, syn: true, win: 500, ..Default::default() };
    assert_eq!(r.world(tcp(r.world_mac, r.up_mac, CLIENT, NODE_IP, csyn, b"")).verdict, TC_ACT_REDIRECT);
    let b_in0 = r.maps.sandbox_stats.get(B_IFINDEX).unwrap().unwrap().in_packets;

    // A's attempts.
    let ack = |sport, dport| T { sport, dport, seq: 7, ack: Some(2), win: 1000, ..Default::default() };
    let rst = |sport, dport| T { sport, dport, seq: 7, rst: true, ..Default::default() };
    let synack =
        T { sport: B_GUEST_PORT, dport: 5555, seq: 9, ack: Some(2), syn: true, win: 500, ..Default::default() };
    let attempts: Vec<(&str, Vec<u8>)> = vec![
        ("UDP to B's SNAT port", udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, NODE_IP, 53, b_udp, b"evil answer")),
        ("TCP ACK to B's SNAT port", tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, NODE_IP, ack(80, b_tcp), b"x")),
        ("TCP RST to B's SNAT port", tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, NODE_IP, rst(80, b_tcp), b"")),
        ("TCP ACK to B's host port", tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, NODE_IP, ack(5555, B_HOST_PORT), b"x")),
        ("UDP to B's host port", udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, NODE_IP, 5555, B_HOST_PORT, b"x")),
        ("SYN-ACK from B's guest port to B's client", tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, CLIENT, synack, b"")),
        (
            "ACK from B's guest port to B's client",
            tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, CLIENT, ack(B_GUEST_PORT, 5555), b"x"),
        ),
    ];
    let mut to_host = Vec::new();
    for (name, f) in attempts {
        let out = r.cube(f);
        if out.verdict != TC_ACT_REDIRECT {
            continue; // dropped
        }
        let (src, dst) = (&out.data[26..30], &out.data[30..34]);
        let (sport, dport) =
            (u16::from_be_bytes([out.data[34], out.data[35]]), u16::from_be_bytes([out.data[36], out.data[37]]));
        // Into a sandbox means destination 169.254.68.6: only A's own RST may come back so.
        if dst == GUEST_IP {
            assert_eq!(out.data[47] & 0x04, 0x04, "{name}: something other than A's own RST went to a guest");
            continue;
        }
        // Otherwise it went to the host (from A's mvm IP, ports untouched) or to the world
        // SNATed on a port of A's own session, never on B's ports.
        assert!(
            (src == SB_IP && dst == NODE_IP && dport != B_GUEST_PORT)
                || (src == NODE_IP && sport != B_HOST_PORT && sport != b_udp && sport != b_tcp),
            "{name}: left as {src:?}:{sport} -> {dst:?}:{dport}"
        );
        if dst == NODE_IP {
            to_host.push(name);
        }
    }
    // Traffic to the node address goes to the host (policy allows the node here), as itself.
    assert_eq!(to_host.len(), 5, "{to_host:?}");
    // B saw nothing and its sessions did not move (state and last access included).
    assert_eq!(r.maps.sandbox_stats.get(B_IFINDEX).unwrap().unwrap().in_packets, b_in0, "B received A's frames");
    let b_now: Vec<_> = r.maps.sessions.list().unwrap().into_iter().filter(|s| s.vm_ifindex == B_IFINDEX).collect();
    assert_eq!(b_now, b_sessions, "B's sessions changed");
}
