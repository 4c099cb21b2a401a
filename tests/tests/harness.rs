//! Self-tests of the namespace harness: the topology routes, the servers answer, the TAP
//! guest's userspace TCP stack talks to a kernel TCP server, and everything is removed on
//! drop, also when the test panics.

use std::{
    io::{Read, Write},
    net::{TcpStream, UdpSocket},
    time::Duration,
};

use cubenet_sys::tap::{TapOptions, VNET_HDR_LEN};
use cubenet_tests::{
    guest::TapGuest,
    netns::{TestNetns, leftover_namespaces},
    require_root, servers, smol,
    topology::{NODE_IP, Topology, WORLD_IP},
};

#[test]
fn node_reaches_world_servers_over_the_uplink() {
    if !require_root("node_reaches_world_servers_over_the_uplink") {
        return;
    }
    let topo = Topology::new();
    let http = servers::http(&topo.world, WORLD_IP, 8080);
    let udp = servers::udp_echo(&topo.world, WORLD_IP, 5353);
    let (body, echoed) = topo.node.run(move || {
        let mut s = TcpStream::connect(("198.51.100.1", 8080)).expect("connect world");
        s.write_all(b"GET / HTTP/1.1\r\nHost: w\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        let u = UdpSocket::bind("0.0.0.0:0").unwrap();
        u.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        u.send_to(b"ping", ("198.51.100.1", 5353)).unwrap();
        let mut buf = [0u8; 256];
        let n = u.recv(&mut buf).expect("udp echo reply");
        (body, String::from_utf8_lossy(&buf[..n]).into_owned())
    });
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    assert!(body.contains("you are 198.51.100.2:"), "{body}");
    assert!(echoed.starts_with("198.51.100.2:") && echoed.ends_with("|ping"), "{echoed}");
    assert_eq!(http.peers()[0].ip(), std::net::IpAddr::from(NODE_IP));
    assert_eq!(udp.peers().len(), 1);
    // The machine's own namespace has none of these addresses.
    let own = std::process::Command::new("ip").args(["-4", "-o", "addr"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&own.stdout).contains("198.51.100."));
}

#[test]
fn tap_guest_speaks_tcp_with_smoltcp() {
    if !require_root("tap_guest_speaks_tcp_with_smoltcp") {
        return;
    }
    let topo = Topology::new();
    // Without any datapath: the node kernel itself plays the gateway on the TAP.
    let (tap, _) = topo.add_tap("tapk", TapOptions { offload: 0, ..TapOptions::POOL });
    topo.node.ip(&["addr", "add", "169.254.68.5/30", "dev", "tapk"]);
    let _srv = servers::http(&topo.node, [169, 254, 68, 5], 8080);
    let guest = TapGuest::new(tap.into_fd(), VNET_HDR_LEN);
    let out = smol::tcp_exchange(
        &guest,
        [169, 254, 68, 5],
        8080,
        40000,
        b"GET / HTTP/1.1\r\nHost: g\r\n\r\n",
        Duration::from_secs(5),
    );
    let text = String::from_utf8_lossy(&out.received);
    assert!(out.connected, "{out:?}");
    assert!(text.contains("you are 169.254.68.6:40000"), "{text}");
}

#[test]
fn namespaces_are_removed_on_panic() {
    if !require_root("namespaces_are_removed_on_panic") {
        return;
    }
    let names = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let n2 = names.clone();
    let r = std::panic::catch_unwind(move || {
        let mut topo = Topology::new();
        let g = topo.add_veth_guest(3);
        n2.lock().unwrap().extend([topo.node.name().to_string(), topo.world.name().to_string(), g.ns_name.clone()]);
        panic!("test failure inside a topology");
    });
    assert!(r.is_err());
    let left = leftover_namespaces();
    for n in names.lock().unwrap().iter() {
        assert!(!left.contains(n), "{n} survived a panic");
    }
    // A lone namespace too.
    let name = TestNetns::new("solo").name().to_string();
    assert!(!leftover_namespaces().contains(&name));
}
