//! Attack: a guest that controls its kernel sends ICMP errors to its gateway (169.254.68.5),
//! which `from_cube` hands to the node's own stack through cube-dev. The errors quote packets
//! the node never sent to the guest: an ICMP echo reply from a node address to a world host, or
//! to another sandbox's mvm IP. Linux's `icmp_err` applies "fragmentation needed" about a
//! quoted echo reply with no socket to match (`ipv4_update_pmtu`), so before decision R70 one
//! sandbox set the node's path MTU towards any destination to 552 for ten minutes, renewable:
//! CubeEgress's upstream connections for every sandbox and the node's own traffic to another
//! sandbox shrank to 512-byte segments. Property: the only ICMP a guest sends its gateway is
//! an echo request or reply; nothing a guest writes changes the node's routing state.

use std::time::Duration;

use cubenet_tests::{
    capture::Capture,
    frames::icmp,
    packet::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    topology::{CUBE_DEV_IP, NODE_IP, WORLD_IP, dotted},
    veth_node::VethNode,
};
use etherparse::PacketBuilder;
/// Another sandbox's mvm IP (routed through cube-dev like every sandbox address).
const B_IP: [u8; 4] = [192, 168, 0, 4];
/// The smallest path MTU Linux accepts (`net.ipv4.route.min_pmtu`).
const FORGED_MTU: u16 = 552;
const ICMP_DEST_UNREACH: u8 = 3;
const CODE_FRAG_NEEDED: u8 = 4;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_REDIRECT: u8 = 5;

/// The IP header and first 8 bytes of an ICMP echo reply `src → dst` (what the node's kernel
/// sends unasked, so Linux takes an error about it without a socket to match), as an error
/// quotes it.
fn quoted_echo(src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
    let mut out = Vec::new();
    PacketBuilder::ipv4(src, dst, 64).icmpv4_echo_reply(0x4242, 1).write(&mut out, &[0u8; 32]).expect("quoted");
    out.truncate(28);
    out
}

/// An Ethernet/IPv4 ICMP error (`ty`, `code`, bytes 4..8 of the ICMP header = `rest`) from
/// the guest to its gateway, quoting `quoted`.
fn icmp_error_to_gateway(ty: u8, code: u8, rest: [u8; 4], quoted: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    PacketBuilder::ethernet2(GUEST_MAC, GATEWAY_MAC)
        .ipv4(GUEST_IP, GATEWAY_IP, 64)
        .icmpv4_raw(ty, code, rest)
        .write(&mut out, quoted)
        .expect("icmp error");
    out
}

/// The node's route to `dst` as `ip route get` prints it (cached exceptions included).
fn route_get(n: &VethNode, dst: [u8; 4]) -> String {
    n.topo.node.ip(&["-4", "route", "get", &dotted(dst)])
}

#[test]
fn a_guest_never_sets_the_nodes_path_mtu_through_its_gateway() {
    if !require_root("attack_gateway_icmp a_guest_never_sets_the_nodes_path_mtu_through_its_gateway") {
        return;
    }
    let n = VethNode::new();
    let targets = [("a world host", WORLD_IP), ("another sandbox", B_IP)];
    for (name, dst) in targets {
        let before = route_get(&n, dst);
        assert!(!before.contains(" mtu "), "{name}: route already has an MTU: {before}");
    }
    let mtu = FORGED_MTU.to_be_bytes();
    let mut frames = Vec::new();
    for (_, dst) in targets {
        for src in [CUBE_DEV_IP, NODE_IP] {
            let q = quoted_echo(src, dst);
            frames.push(icmp_error_to_gateway(ICMP_DEST_UNREACH, CODE_FRAG_NEEDED, [0, 0, mtu[0], mtu[1]], &q));
            frames.push(icmp_error_to_gateway(ICMP_TIME_EXCEEDED, 0, [0; 4], &q));
            frames.push(icmp_error_to_gateway(ICMP_REDIRECT, 1, GUEST_IP, &q));
        }
    }
    let errors = frames.len();
    // The control: an echo request to the gateway, which the node answers after it has taken
    // every frame before it off the same queue.
    frames.push(icmp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, GATEWAY_IP, true, 0x7777, 1));
    let replies = n.topo.guest_ns(&n.a).run(move || {
        let wire = Capture::open(cubenet_sys::ifindex("eth0").expect("guest eth0"));
        for f in &frames {
            wire.send(f);
        }
        let is_reply = |d: &[u8]| d.len() >= 42 && d[23] == 1 && d[34] == 0 && d[38..40] == 0x7777u16.to_be_bytes();
        wire.read_until(Duration::from_secs(5), |c| is_reply(&c.data)).into_iter().filter(|c| is_reply(&c.data)).count()
    });
    assert_eq!(replies, 1, "the control echo through the gateway was not answered");
    let changed: Vec<String> = targets
        .iter()
        .map(|(name, dst)| (name, route_get(&n, *dst)))
        .filter(|(_, r)| r.contains(" mtu ") || r.contains(" via "))
        .map(|(name, r)| format!("{name}: {r}"))
        .collect();
    assert_eq!(changed, Vec::<String>::new(), "a guest's ICMP error changed the node's routes");
    // Every error was the datapath's drop, not the node kernel's choice; the echo went through.
    let a = n.dp().maps().sandbox_stats.get(n.a.node_ifindex).unwrap().unwrap();
    assert_eq!(a.drops["gateway"], errors as u64, "{a:?}");
    assert_eq!(a.out_packets, 1, "{a:?}");
}
