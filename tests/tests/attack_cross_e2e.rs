//! Attack: a guest (real kernel stack, veth guest behind the real datapath, pinned and
//! attached with tcx) tries to reach another sandbox on the same node by every address it can
//! name, with the most permissive policy a caller can give it (`allow_out` 0.0.0.0/0, which
//! beats even the always-denied private ranges): the other sandbox's mvm IP, the broadcast
//! address of the sandbox CIDR, the limited broadcast, and the other sandbox's host port on the
//! node address (a hairpin through the uplink address). The victim listens on the mapped port
//! and must receive nothing but the world's control datagram, which is sent last on purpose:
//! once it arrives, everything sent before it has been delivered or dropped (order, not time).

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use cubenet_tests::{
    bpffs::BpfFs,
    ebpf_object,
    guest::VethGuest,
    require_root, servers,
    topology::{CUBE_DEV, CUBE_DEV_IP, NODE_IP, NODE_UPLINK, Topology},
};
use cubevs::{Datapath, EgressPolicy, LoadOptions, PortMapping, Proto, SandboxEntry, SnatAddr};
use cubevs_common::counter;

const A_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 3);
const B_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 4);
/// B's listening port inside the guest, and its host port on the node.
const B_PORT: u16 = 9999;
const B_HOST_PORT: u16 = 30999;

fn load_attach(topo: &Topology, bpffs: &BpfFs, guests: &[&VethGuest]) -> Datapath {
    let dp = Datapath::load(LoadOptions {
        object: ebpf_object(),
        pin_dir: Some(bpffs.path().join("cubevs")),
        ..LoadOptions::new()
    })
    .unwrap_or_else(|e| panic!("load datapath: {e}"));
    let ifs: Vec<String> = guests.iter().map(|g| g.node_if.clone()).collect();
    topo.node.run(move || {
        let mut dp = dp;
        dp.attach_uplink(NODE_UPLINK, Ipv4Addr::from(NODE_IP)).expect("attach uplink");
        dp.attach_cube_dev(CUBE_DEV, Ipv4Addr::from(CUBE_DEV_IP)).expect("attach cube-dev");
        for i in &ifs {
            dp.attach_sandbox(i).expect("attach guest");
        }
        dp
    })
}

/// Two registered veth guests A (policy: everything allowed, private ranges included) and B
/// (default policy, UDP host port `B_HOST_PORT` → `B_PORT`), B listening on `B_PORT`.
struct Node {
    topo: Topology,
    a: VethGuest,
    b: VethGuest,
    dp: Option<Datapath>,
    victim: Option<UdpSocket>,
    _bpffs: BpfFs,
}

impl Node {
    fn new() -> Self {
        let mut topo = Topology::new();
        topo.add_cube_dev();
        let a = topo.add_veth_guest(0);
        let b = topo.add_veth_guest(1);
        let bpffs = BpfFs::new();
        let dp = load_attach(&topo, &bpffs, &[&a, &b]);
        let maps = dp.maps();
        let uplink = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).unwrap());
        maps.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: uplink }]).expect("snat");
        for (g, ip, id) in [(&a, A_IP, "sb-a"), (&b, B_IP, "sb-b")] {
            maps.sandbox_stats.reset(g.node_ifindex).expect("stats");
            let e = SandboxEntry { ifindex: g.node_ifindex, ip, version: 1, id: id.into() };
            maps.sandboxes.register(&e).expect("reg");
        }
        let open = EgressPolicy { allow_out: vec!["0.0.0.0/0".into()], ..Default::default() };
        maps.policy.replace(a.node_ifindex, &open).expect("policy A");
        maps.policy.install_default_deny(b.node_ifindex).expect("policy B");
        maps.ports
            .add(&PortMapping {
                proto: Proto::Udp,
                host_port: B_HOST_PORT,
                ifindex: b.node_ifindex,
                guest_port: B_PORT,
            })
            .expect("B's host port");
        let victim = topo.guest_ns(&b).run(|| {
            let u = UdpSocket::bind(("0.0.0.0", B_PORT)).expect("B bind");
            u.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            u
        });
        for g in [&a, &b] {
            let _ = topo.guest_ns(g).exec("ping", &["-c", "1", "-W", "1", "169.254.68.5"]);
        }
        Self { topo, a, b, dp: Some(dp), victim: Some(victim), _bpffs: bpffs }
    }

    /// Sends the world's control datagram to B's host port, then returns everything B received
    /// up to and including it (panics if the control never arrives).
    fn victim_received(&mut self) -> Vec<String> {
        self.topo.world.run(|| {
            let u = UdpSocket::bind("0.0.0.0:0").unwrap();
            u.send_to(b"control", SocketAddr::from((NODE_IP, B_HOST_PORT))).unwrap();
        });
        let victim = self.victim.take().expect("read once");
        self.topo.guest_ns(&self.b).run(move || servers::udp_recv_until(&victim, "control", "the world's control to B"))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.dp.take();
    }
}

/// The attempts (by index in `names`) whose marker `attack-<i>` B received.
fn reached<'a>(got: &[String], names: &[&'a str]) -> Vec<&'a str> {
    got.iter()
        .filter_map(|s| s.strip_prefix("attack-").and_then(|i| i.parse::<usize>().ok()))
        .map(|i| names[i])
        .collect()
}

#[test]
fn a_guest_never_reaches_another_sandbox_even_when_its_policy_allows_everything() {
    if !require_root("attack_cross_e2e a_guest_never_reaches_another_sandbox_even_when_its_policy_allows_everything") {
        return;
    }
    let mut n = Node::new();
    let attempts: Vec<(&str, SocketAddr)> = vec![
        ("B's mvm IP", SocketAddr::from((B_IP, B_PORT))),
        ("cube-dev address", SocketAddr::from((CUBE_DEV_IP, B_PORT))),
        ("sandbox CIDR broadcast", SocketAddr::from(([192, 168, 63, 255], B_PORT))),
        ("limited broadcast", SocketAddr::from(([255, 255, 255, 255], B_PORT))),
        ("B's host port on the node address", SocketAddr::from((NODE_IP, B_HOST_PORT))),
        ("B's guest port on the node address", SocketAddr::from((NODE_IP, B_PORT))),
    ];
    let sends = attempts.clone();
    let errors: Vec<String> = n.topo.guest_ns(&n.a).run(move || {
        let u = UdpSocket::bind("0.0.0.0:0").expect("A bind");
        u.set_broadcast(true).expect("SO_BROADCAST");
        sends
            .iter()
            .enumerate()
            .filter_map(|(i, (name, to))| {
                u.send_to(format!("attack-{i}").as_bytes(), to).err().map(|e| format!("{name}: {e}"))
            })
            .collect()
    });
    // A send error would be the guest kernel's own refusal, not the datapath's: none expected.
    assert!(errors.is_empty(), "{errors:?}");
    let got = n.victim_received();
    let names: Vec<&str> = attempts.iter().map(|(n, _)| *n).collect();
    assert_eq!(reached(&got, &names), Vec::<&str>::new(), "A reached B");
    // Every attempt left A's interface through the datapath (none was lost in A's own stack).
    let a = n.dp.as_ref().unwrap().maps().sandbox_stats.get(n.a.node_ifindex).unwrap().unwrap();
    assert!(a.out_packets >= attempts.len() as u64, "{a:?}");
}

/// The sandbox CIDR routed back to the node from its LAN (a router that knows it, or any host
/// on the uplink's segment), with IPv4 forwarding on in the node namespace as on a Kubernetes
/// node: the world addresses B's mvm IP directly, and A's datagram to B's mvm IP, SNATed out
/// of the uplink, comes back through that router. B must receive only what its host port
/// carries.
#[test]
fn mvm_ips_are_unreachable_from_the_uplink() {
    if !require_root("attack_cross_e2e mvm_ips_are_unreachable_from_the_uplink") {
        return;
    }
    let mut n = Node::new();
    for ns in [&n.topo.node, &n.topo.world] {
        let out = ns.exec("sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    n.topo.world.ip(&["route", "add", "192.168.0.0/18", "via", "198.51.100.2"]);
    let names = ["world to B's mvm IP", "A to B's mvm IP via the world's router"];
    n.topo.world.run(|| {
        let u = UdpSocket::bind("0.0.0.0:0").unwrap();
        u.send_to(b"attack-0", SocketAddr::from((B_IP, B_PORT))).unwrap();
    });
    n.topo.guest_ns(&n.a).run(|| {
        let u = UdpSocket::bind("0.0.0.0:0").unwrap();
        u.send_to(b"attack-1", SocketAddr::from((B_IP, B_PORT))).unwrap();
    });
    let got = n.victim_received();
    assert_eq!(reached(&got, &names), Vec::<&str>::new(), "B reached from the uplink by its mvm IP");
    let maps = n.dp.as_ref().unwrap().maps();
    assert!(maps.counters.get(counter::WORLD_DROP_TO_SANDBOX).unwrap() >= 1, "dropped and counted by from_world");
}
