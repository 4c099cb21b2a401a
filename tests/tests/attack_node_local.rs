//! Attack: a guest that controls its kernel writes raw frames to node-local destinations the
//! routing table answers itself (`0.0.0.0`, loopback, multicast, broadcast, an address of
//! another node interface), with the most permissive policy a caller can give it. The node
//! leaves IPv4 forwarding off (as the agent does), so every SNATed packet takes the
//! `bpf_redirect_neigh` fallback, which routes it. Property: nothing a guest sends is delivered
//! to the node's own sockets except through the node address (upstream's host service access),
//! and nothing broadcast or multicast leaves on the node's wire.

use std::{net::UdpSocket, time::Duration};

use cubenet_tests::{
    capture::Capture,
    frames::udp,
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root, servers,
    topology::{CUBE_DEV_IP, NODE_IP, WORLD_IF, WORLD_IP},
    veth_node::VethNode,
};
const PORT: u16 = 7000;
/// An address of another interface of the node (a second NIC, a dummy for a node service).
const OTHER_NODE_ADDR: [u8; 4] = [203, 0, 113, 77];

fn node() -> VethNode {
    let n = VethNode::new();
    // No `dummy` module everywhere: a veth pair inside the node namespace serves as well.
    n.topo.node.ip(&["link", "add", "svc0", "type", "veth", "peer", "name", "svc1"]);
    n.topo.node.ip(&["link", "set", "svc1", "up"]);
    n.topo.node.ip(&["addr", "add", "203.0.113.77/32", "dev", "svc0"]);
    n.topo.node.ip(&["link", "set", "svc0", "up"]);
    n
}

fn guest_frames_never_reach_node_sockets(forwarding: bool) {
    let n = node();
    if forwarding {
        let out = n.topo.node.exec("sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let listener = n.topo.node.run(|| {
        let u = UdpSocket::bind(("0.0.0.0", PORT)).expect("node bind");
        u.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        u
    });
    // (name, destination, may leave on the node's wire as a unicast frame to the router)
    let attempts: Vec<(&str, [u8; 4], bool)> = vec![
        ("0.0.0.0", [0, 0, 0, 0], false),
        ("0.1.2.3", [0, 1, 2, 3], false),
        ("loopback", [127, 0, 0, 1], false),
        ("another node address", OTHER_NODE_ADDR, true),
        ("cube-dev address", CUBE_DEV_IP, true),
        ("limited broadcast", [255, 255, 255, 255], false),
        ("uplink subnet broadcast", [198, 51, 100, 255], false),
        ("all-hosts multicast", [224, 0, 0, 1], false),
        ("RIP routers multicast", [224, 0, 0, 9], false),
        ("multicast", [239, 1, 2, 3], false),
        ("class E", [240, 0, 0, 1], true),
    ];
    let mut frames: Vec<Vec<u8>> = attempts
        .iter()
        .enumerate()
        .map(|(i, (_, dst, _))| {
            udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, *dst, 5000, PORT, format!("attack-{i}").as_bytes())
        })
        .collect();
    // The controls: the node address, upstream's host service access (delivered on purpose),
    // and a world host, whose datagram closes the capture of the node's wire.
    frames.push(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, NODE_IP, 5000, PORT, b"control"));
    frames.push(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, PORT, b"wire-control"));
    let wire = n.topo.world.run(|| Capture::open(cubenet_sys::ifindex(WORLD_IF).expect("world ifindex")));
    n.topo.guest_ns(&n.a).run(move || {
        let wire = Capture::open(cubenet_sys::ifindex("eth0").expect("guest eth0"));
        for f in &frames {
            wire.send(f);
        }
    });
    let got: Vec<String> =
        n.topo.node.run(move || servers::udp_recv_until(&listener, "control", "the control to the node"));
    eprintln!("node received: {got:?}");
    let reached: Vec<&str> = got
        .iter()
        .filter_map(|s| s.strip_prefix("attack-").and_then(|i| i.parse::<usize>().ok()))
        .map(|i| attempts[i].0)
        .collect();
    assert_eq!(reached, Vec::<&str>::new(), "the guest reached the node's own sockets");
    // Nothing broadcast, multicast or never valid off a host left on the node's wire: a
    // sandbox never speaks to the node's LAN or router as the node (DHCP, RIP, mDNS, SSDP).
    let seen = wire.read_until(Duration::from_secs(5), |c| c.data.ends_with(b"wire-control"));
    assert!(seen.last().is_some_and(|c| c.data.ends_with(b"wire-control")), "the world control never left");
    let left: Vec<&str> = attempts
        .iter()
        .enumerate()
        .filter(|(i, (_, _, unicast_ok))| {
            let marker = format!("attack-{i}");
            seen.iter().any(|c| c.data.ends_with(marker.as_bytes()) && (!unicast_ok || c.data[0] & 1 == 1))
        })
        .map(|(_, (name, _, _))| *name)
        .collect();
    assert_eq!(left, Vec::<&str>::new(), "left on the node's wire");
    // Every attempt left A's interface through the datapath (none was lost in a guest stack:
    // the frames were written raw), so the datapath, not the guest, decided.
    let a = n.dp().maps().sandbox_stats.get(n.a.node_ifindex).unwrap().unwrap();
    assert!(a.out_packets + a.drops.values().sum::<u64>() > attempts.len() as u64, "{a:?}");
    // Those no flow may have are dropped by the datapath itself, whatever the policy (R47).
    assert_eq!(a.drops["protocol"], 7, "{a:?}");
}

/// IPv4 forwarding off in the node namespace (the agent's default): every SNATed packet is
/// routed by `bpf_redirect_neigh`'s own route lookup, which accepts local routes.
#[test]
fn guest_frames_never_reach_node_sockets_with_forwarding_off() {
    if !require_root("attack_node_local guest_frames_never_reach_node_sockets_with_forwarding_off") {
        return;
    }
    guest_frames_never_reach_node_sockets(false);
}

/// IPv4 forwarding on (a Kubernetes node): `bpf_fib_lookup` decides.
#[test]
fn guest_frames_never_reach_node_sockets_with_forwarding_on() {
    if !require_root("attack_node_local guest_frames_never_reach_node_sockets_with_forwarding_on") {
        return;
    }
    guest_frames_never_reach_node_sockets(true);
}
