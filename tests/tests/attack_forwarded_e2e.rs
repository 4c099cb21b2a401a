//! Attack: a neighbour of the node that is not the uplink reaches a sandbox by its mvm IP. A
//! Kubernetes node forwards (IPv4 forwarding on) and has other interfaces than the uplink: the
//! pods' veths or bridge, a container bridge, a second NIC, a tunnel. The agent routes the
//! sandbox CIDR through cube-dev, so a pod on the node whose default route is the node sends to
//! a sandbox's mvm IP, the node forwards it to cube-dev and `from_envoy` delivered it into the
//! guest: every pod on the node reached every sandbox's ports, with no host port and whatever
//! the sandbox's policy (R10 closed this for the uplink only).
//!
//! Property (decision R61): only what the host itself sends (its own sockets: the agent,
//! CubeEgress's replies, the kernel's ICMP) reaches a sandbox through cube-dev; anything the
//! node forwards from another interface is dropped. Real kernels: a veth guest B behind the
//! pinned, attached datapath, a "pod" namespace behind a veth with the node as its router.
//! B listens on its mapped port; the world's control datagram to B's host port is sent last,
//! so once it arrives everything sent before it has been delivered or dropped (order, not time).

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use cubenet_tests::{require_root, servers, topology::NODE_IP, veth_node::VethNode};
use cubevs::{PortMapping, Proto};
use cubevs_common::counter;

const B_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 4);
const B_PORT: u16 = 9999;
const B_HOST_PORT: u16 = 30999;

#[test]
fn nothing_the_node_forwards_reaches_a_sandbox_by_its_mvm_ip() {
    if !require_root("attack_forwarded_e2e nothing_the_node_forwards_reaches_a_sandbox_by_its_mvm_ip") {
        return;
    }
    let n = VethNode::with(B_IP, "sb-b", None);
    let (topo, b, maps) = (&n.topo, &n.a, n.dp().maps());
    maps.ports
        .add(&PortMapping { proto: Proto::Udp, host_port: B_HOST_PORT, ifindex: b.node_ifindex, guest_port: B_PORT })
        .expect("B's host port");
    let victim = topo.guest_ns(b).run(|| {
        let u = UdpSocket::bind(("0.0.0.0", B_PORT)).expect("B bind");
        u.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        u
    });
    // The guest's neighbour entry for its gateway, so its first answer is not held on ARP.
    let _ = topo.guest_ns(b).exec("ping", &["-c", "1", "-W", "1", "169.254.68.5"]);

    // A pod on the node: its own namespace, a veth to the node, the node as its default route.
    let pod = cubenet_tests::netns::TestNetns::new("pod");
    topo.node.ip(&["link", "add", "pod0", "type", "veth", "peer", "name", "eth0", "netns", pod.name()]);
    topo.node.ip(&["addr", "add", "10.244.0.1/24", "dev", "pod0"]);
    topo.node.ip(&["link", "set", "pod0", "up"]);
    pod.ip(&["addr", "add", "10.244.0.5/24", "dev", "eth0"]);
    pod.ip(&["link", "set", "eth0", "up"]);
    pod.ip(&["route", "add", "default", "via", "10.244.0.1"]);
    let out = topo.node.exec("sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    pod.run(|| {
        let u = UdpSocket::bind("0.0.0.0:0").unwrap();
        u.send_to(b"attack-pod", SocketAddr::from((B_IP, B_PORT))).unwrap();
    });
    // Control: the node itself (a socket of the host, as the agent's or CubeEgress's) still
    // reaches B through cube-dev.
    topo.node.run(|| {
        let u = UdpSocket::bind("0.0.0.0:0").unwrap();
        u.send_to(b"node", SocketAddr::from((B_IP, B_PORT))).unwrap();
    });
    topo.world.run(|| {
        let u = UdpSocket::bind("0.0.0.0:0").unwrap();
        u.send_to(b"control", SocketAddr::from((NODE_IP, B_HOST_PORT))).unwrap();
    });
    let got: Vec<String> =
        topo.guest_ns(b).run(move || servers::udp_recv_until(&victim, "control", "the world's control to B"));
    assert!(got.iter().any(|s| s == "node"), "the node's own datagram never reached B: {got:?}");
    assert!(!got.iter().any(|s| s == "attack-pod"), "a pod on the node reached B by its mvm IP: {got:?}");
    let dropped = maps.counters.get(counter::ENVOY_DROP_UNKNOWN).unwrap();
    assert!(dropped >= 1, "the forwarded datagram was not dropped by from_envoy (counted drop_unknown)");
    drop(pod);
}
