//! Attack: a host on another VLAN of the node's wire (the uplink's switch port is a trunk, or
//! any host that can put 802.1Q-tagged frames on the segment) reaches a sandbox's host port and
//! answers for a sandbox's session. The node is not on that VLAN: without the datapath the
//! kernel marks such a frame `PACKET_OTHERHOST` and drops it. But the kernel takes the tag off
//! (into `skb->vlan_tci`) *before* tc ingress, so `from_world` saw a plain IPv4 frame and
//! DNATed or reverse-NATed it into the sandbox (the world-side twin of R9; decision R46).
//!
//! The datapath runs on the real uplink veth (tcx, and with `xdp_world` in generic mode on
//! top); the world writes raw frames on its end of the wire with the tag in-band. Order, not
//! time, decides: an untagged control datagram follows every tagged one on the same path and
//! the victim reads until it arrives.

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use cubenet_tests::{
    bpffs::BpfFs,
    capture::Capture,
    ebpf_object,
    frames::udp,
    guest::VethGuest,
    require_root, servers,
    topology::{CUBE_DEV, CUBE_DEV_IP, NODE_IP, NODE_UPLINK, Topology, WORLD_IF, WORLD_IP},
};
use cubevs::{Datapath, EgressPolicy, LoadOptions, PortMapping, Proto, SandboxEntry, SnatAddr, XdpMode};

const B_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 4);
/// B's host-port listener inside the guest, its host port, and the guest port of B's session.
const B_PORT: u16 = 9999;
const B_HOST_PORT: u16 = 30999;
const B_SESSION_PORT: u16 = 9998;
/// The world server B's session talks to.
const SERVER_PORT: u16 = 4000;

struct Node {
    topo: Topology,
    b: VethGuest,
    dp: Option<Datapath>,
    _bpffs: BpfFs,
}

impl Node {
    fn new(xdp: bool) -> Self {
        let mut topo = Topology::new();
        topo.add_cube_dev();
        let b = topo.add_veth_guest(1);
        let bpffs = BpfFs::new();
        let dp = Datapath::load(LoadOptions {
            object: ebpf_object(),
            pin_dir: Some(bpffs.path().join("cubevs")),
            ..LoadOptions::new()
        })
        .unwrap_or_else(|e| panic!("load datapath: {e}"));
        let node_if = b.node_if.clone();
        let dp = topo.node.run(move || {
            let mut dp = dp;
            dp.attach_uplink(NODE_UPLINK, Ipv4Addr::from(NODE_IP)).expect("attach uplink");
            if xdp {
                dp.attach_uplink_xdp(NODE_UPLINK, XdpMode::Generic).expect("attach xdp");
            }
            dp.attach_cube_dev(CUBE_DEV, Ipv4Addr::from(CUBE_DEV_IP)).expect("attach cube-dev");
            dp.attach_sandbox(&node_if).expect("attach guest");
            dp
        });
        let maps = dp.maps();
        let uplink = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).unwrap());
        maps.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: uplink }]).expect("snat");
        maps.sandbox_stats.reset(b.node_ifindex).expect("stats");
        let e = SandboxEntry { ifindex: b.node_ifindex, ip: B_IP, version: 1, id: "sb-b".into() };
        maps.sandboxes.register(&e).expect("reg");
        let policy = EgressPolicy { allow_out: vec![format!("{}/32", Ipv4Addr::from(WORLD_IP))], ..Default::default() };
        maps.policy.replace(b.node_ifindex, &policy).expect("policy B");
        maps.ports
            .add(&PortMapping {
                proto: Proto::Udp,
                host_port: B_HOST_PORT,
                ifindex: b.node_ifindex,
                guest_port: B_PORT,
            })
            .expect("B's host port");
        let _ = topo.guest_ns(&b).exec("ping", &["-c", "1", "-W", "1", "169.254.68.5"]);
        Self { topo, b, dp: Some(dp), _bpffs: bpffs }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.dp.take();
    }
}

/// `frame` with VLAN tags (`tpid`, `tci`) inserted after the MAC addresses, outermost first.
fn tagged(frame: &[u8], tags: &[(u16, u16)]) -> Vec<u8> {
    let mut f = frame[..12].to_vec();
    for (tpid, tci) in tags {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&tci.to_be_bytes());
    }
    f.extend_from_slice(&frame[12..]);
    f
}

/// Everything `sock` receives up to and including `control` (panics if it never arrives).
fn received_until_control(n: &Node, sock: UdpSocket) -> Vec<String> {
    n.topo.guest_ns(&n.b).run(move || servers::udp_recv_until(&sock, "control", "the untagged control"))
}

fn tagged_frames_from_another_vlan_never_reach_a_sandbox(xdp: bool) {
    let n = Node::new(xdp);
    let (world_mac, up_mac) = (n.topo.world_mac(), n.topo.node_uplink_mac());
    // B listens on its host port and opens a UDP session to the world server.
    let (victim, session) = n.topo.guest_ns(&n.b).run(|| {
        let v = UdpSocket::bind(("0.0.0.0", B_PORT)).expect("B bind");
        let s = UdpSocket::bind(("0.0.0.0", B_SESSION_PORT)).expect("B bind session");
        for u in [&v, &s] {
            u.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        }
        s.send_to(b"q", SocketAddr::from((WORLD_IP, SERVER_PORT))).expect("B's query");
        (v, s)
    });
    let snat_port =
        n.dp.as_ref()
            .unwrap()
            .maps()
            .sessions
            .list()
            .unwrap()
            .into_iter()
            .find(|s| s.proto == "udp" && s.guest_port == B_SESSION_PORT)
            .expect("B's session")
            .snat_port;
    let stranger = [203, 0, 113, 200];
    let host_port = |src: [u8; 4], p: &[u8]| udp(world_mac, up_mac, src, NODE_IP, 5555, B_HOST_PORT, p);
    let reply = |p: &[u8]| udp(world_mac, up_mac, WORLD_IP, NODE_IP, SERVER_PORT, snat_port, p);
    let cases: Vec<(&str, Vec<u8>, Vec<u8>)> = vec![
        (
            "host port from VLAN 200",
            tagged(&host_port(stranger, b"attack-hp-200"), &[(0x8100, 200)]),
            b"attack-hp-200".to_vec(),
        ),
        (
            "host port from VLAN 4094, PCP 7",
            tagged(&host_port(stranger, b"attack-hp-4094"), &[(0x8100, 0xe000 | 4094)]),
            b"attack-hp-4094".to_vec(),
        ),
        (
            "host port, 802.1ad outer tag",
            tagged(&host_port(stranger, b"attack-hp-qinq"), &[(0x88a8, 300), (0x8100, 200)]),
            b"attack-hp-qinq".to_vec(),
        ),
        ("session reply from VLAN 200", tagged(&reply(b"attack-re-200"), &[(0x8100, 200)]), b"attack-re-200".to_vec()),
    ];
    let mut frames: Vec<Vec<u8>> = cases.iter().map(|(_, f, _)| f.clone()).collect();
    // An 802.1p priority tag (VID 0) is untagged traffic to the kernel: it still reaches B.
    frames.push(tagged(&host_port(stranger, b"prio-0"), &[(0x8100, 0xa000)]));
    frames.push(host_port(stranger, b"control"));
    let maps = n.dp.as_ref().unwrap().maps();
    let session_state = || {
        maps.sessions.list().unwrap().into_iter().find(|s| s.guest_port == B_SESSION_PORT).expect("B's session").state
    };
    let in_before = maps.sandbox_stats.get(n.b.node_ifindex).unwrap().unwrap().in_packets;
    let send = |frames: Vec<Vec<u8>>| {
        n.topo.world.run(move || {
            let wire = Capture::open(cubenet_sys::ifindex(WORLD_IF).expect("world ifindex"));
            for f in &frames {
                wire.send(f);
            }
        })
    };
    // Every tagged frame, then the untagged control on the same wire: once the control is in,
    // the tagged frames were handled.
    send(frames);
    let mut got = received_until_control(&n, victim);
    // Nothing tagged with a VID was taken into the datapath: not delivered, not charged to B,
    // and the tagged "reply" did not mark B's session replied.
    let stats = maps.sandbox_stats.get(n.b.node_ifindex).unwrap().unwrap();
    assert_eq!(stats.in_packets - in_before, 2, "B was charged with tagged frames: {stats:?}");
    assert_eq!(session_state(), "unreplied", "a tagged frame from another VLAN answered B's session");
    send(vec![reply(b"control")]);
    got.extend(received_until_control(&n, session));
    assert_eq!(session_state(), "replied");
    let reached: Vec<&str> =
        cases.iter().filter(|(_, _, m)| got.iter().any(|g| g.as_bytes() == m.as_slice())).map(|(c, _, _)| *c).collect();
    assert_eq!(reached, Vec::<&str>::new(), "frames from a VLAN the node is not on reached the sandbox: {got:?}");
    assert!(got.iter().any(|g| g == "prio-0"), "a priority-tagged frame (VID 0) was lost: {got:?}");
}

#[test]
fn frames_from_another_vlan_never_reach_a_sandbox() {
    if !require_root("attack_world_vlan frames_from_another_vlan_never_reach_a_sandbox") {
        return;
    }
    tagged_frames_from_another_vlan_never_reach_a_sandbox(false);
}

#[test]
fn frames_from_another_vlan_never_reach_a_sandbox_with_xdp() {
    if !require_root("attack_world_vlan frames_from_another_vlan_never_reach_a_sandbox_with_xdp") {
        return;
    }
    tagged_frames_from_another_vlan_never_reach_a_sandbox(true);
}
