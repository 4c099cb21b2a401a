//! Attack (`BPF_PROG_TEST_RUN`, both world hooks): a host on the uplink's segment (or any
//! network that forwards spoofed sources) sends to a sandbox's host port from an address no
//! world host may have: the guest link's gateway 169.254.68.5 (what the guest takes for its
//! host: everything the node sends it comes from there), the guest's own 169.254.68.6, a
//! sandbox's mvm IP, the node's uplink or cube-dev address, or a source the kernel itself
//! calls martian (0/8, 127/8, multicast, 240/4, the limited broadcast). The host-port DNAT
//! redirects straight into the TAP, past the host's martian and reverse-path checks, so the
//! guest received a datagram "from its host" or from another sandbox.
//!
//! Property (decision R63): such frames are dropped (counted `drop_to_sandbox`) on `from_world`
//! and `xdp_world`, make no `portmap_sessions` entry and charge nothing to the sandbox; the
//! same frame from a world address is delivered.

use std::net::Ipv4Addr;

use cubenet_tests::{
    frames::udp,
    require_root,
    rig::{Rig, SB_IFINDEX, SB_IP},
    topology::{CUBE_DEV_IP, NODE_IP, WORLD_IP},
};
use cubevs::{
    PortMapping, Proto, SandboxEntry,
    testrun::{TC_ACT_REDIRECT, XDP_REDIRECT},
};
use cubevs_common::counter;

const HOST_PORT: u16 = 30999;
const GUEST_PORT: u16 = 9999;
const OTHER_SB_IP: [u8; 4] = [192, 168, 0, 4];

#[test]
fn host_ports_refuse_sources_no_world_host_may_have() {
    if !require_root("attack_world_source_testrun host_ports_refuse_sources_no_world_host_may_have") {
        return;
    }
    let r = Rig::new();
    r.add_sandbox(&SandboxEntry { ifindex: 101, ip: Ipv4Addr::from(OTHER_SB_IP), version: 3, id: "sb-other".into() });
    r.maps
        .ports
        .add(&PortMapping { proto: Proto::Udp, host_port: HOST_PORT, ifindex: SB_IFINDEX, guest_port: GUEST_PORT })
        .expect("host port");
    let spoofed: [(&str, [u8; 4]); 11] = [
        ("the guest's gateway", [169, 254, 68, 5]),
        ("the guest itself", [169, 254, 68, 6]),
        ("another sandbox's mvm IP", OTHER_SB_IP),
        ("its own mvm IP", SB_IP),
        ("the node's uplink address", NODE_IP),
        ("cube-dev's address", CUBE_DEV_IP),
        ("loopback", [127, 0, 0, 1]),
        ("0.0.0.0", [0, 0, 0, 0]),
        ("multicast", [224, 0, 0, 1]),
        ("240/4", [240, 0, 0, 1]),
        ("limited broadcast", [255; 4]),
    ];
    let frame = |src: [u8; 4]| udp(r.world_mac, r.up_mac, src, NODE_IP, 4000, HOST_PORT, b"spoof");
    let drops0 = r.counter(counter::WORLD_DROP_TO_SANDBOX);
    let mut n = 0;
    for (name, src) in spoofed {
        let tc = r.world(frame(src));
        assert_ne!(tc.verdict, TC_ACT_REDIRECT, "from_world delivered a frame from {name}");
        let xdp = r.xdp(frame(src));
        assert_ne!(xdp.verdict, XDP_REDIRECT, "xdp_world delivered a frame from {name}");
        n += 2;
    }
    assert_eq!(r.counter(counter::WORLD_DROP_TO_SANDBOX) - drops0, n, "every spoofed frame dropped and counted");
    let stats = r.maps.sandbox_stats.get(SB_IFINDEX).unwrap().unwrap();
    assert_eq!(stats.in_packets, 0, "a spoofed frame was charged to the sandbox as delivered");

    // Control: the same frame from a world address reaches the guest on both hooks.
    assert_eq!(r.world(frame(WORLD_IP)).verdict, TC_ACT_REDIRECT, "from_world control");
    assert_eq!(r.xdp(frame([203, 0, 113, 9])).verdict, XDP_REDIRECT, "xdp_world control");
}
