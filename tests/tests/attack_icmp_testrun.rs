//! Attack on ICMP through SNAT (`BPF_PROG_TEST_RUN`, exact verdicts, frames and per-sandbox
//! counters). Sandboxes A and B ping the same world host with the same echo id and sequence
//! (every Linux guest starts its ids alike); the host, or anyone on the path, answers and errs
//! for one of them. Properties users rely on that had no test: the two flows get different
//! SNAT ids on the wire (the world cannot tell they share an id, nor answer one for the
//! other); an echo reply and an ICMP error about one flow reach that sandbox only, translated
//! back to its own id; a reply at any other id reaches nobody.

use std::net::Ipv4Addr;

use cubenet_tests::{
    frames::{fix_ip_csum, icmp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    SandboxEntry,
    testrun::{TC_ACT_OK, TC_ACT_REDIRECT},
};

const B_IFINDEX: u32 = SB_IFINDEX + 1;
const ID: u16 = 0x0001;

fn csum(b: &[u8]) -> [u8; 2] {
    let mut sum: u32 = 0;
    for c in b.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    (!(sum as u16)).to_be_bytes()
}

/// A time-exceeded error from `router` to the node embedding `inner` (IP header + 8 bytes).
fn time_exceeded(r: &Rig, router: [u8; 4], inner: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&r.up_mac);
    f.extend_from_slice(&r.world_mac);
    f.extend_from_slice(&[0x08, 0x00, 0x45, 0xc0]);
    f.extend_from_slice(&((20 + 8 + inner.len()) as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 0, 64, 1, 0, 0]);
    f.extend_from_slice(&router);
    f.extend_from_slice(&NODE_IP);
    fix_ip_csum(&mut f);
    let mut m = vec![11, 0, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(inner);
    let c = csum(&m);
    m[2..4].copy_from_slice(&c);
    f.extend_from_slice(&m);
    f
}

fn delivered(r: &Rig, ifindex: u32) -> u64 {
    r.maps.sandbox_stats.get(ifindex).unwrap().unwrap().in_packets
}

#[test]
fn same_echo_ids_of_two_sandboxes_never_cross() {
    if !require_root("same_echo_ids_of_two_sandboxes_never_cross") {
        return;
    }
    let r = Rig::new();
    r.add_sandbox(&SandboxEntry { ifindex: B_IFINDEX, ip: Ipv4Addr::new(192, 168, 0, 4), version: 1, id: "b".into() });
    let ping = icmp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, true, ID, 1);
    let out_a = r.cube(ping.clone());
    let out_b = r.run(cubevs::prog::FROM_CUBE, ping.clone(), B_IFINDEX);
    assert_eq!((out_a.verdict, out_b.verdict), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
    let id_on_wire = |out: &[u8]| u16::from_be_bytes([out[38], out[39]]);
    let (id_a, id_b) = (id_on_wire(&out_a.data), id_on_wire(&out_b.data));
    assert_ne!(id_a, id_b, "two sandboxes' pings share an id on the wire");
    let sessions = r.maps.sessions.list().unwrap();
    assert_eq!(sessions.len(), 2, "{sessions:?}");
    for s in &sessions {
        let want = if s.vm_ifindex == SB_IFINDEX { id_a } else { id_b };
        assert_eq!((s.proto, s.guest_port, s.snat_port), ("icmp", ID, want), "{s:?}");
    }

    // The world answers B's ping: B gets it, with its own id back; A gets nothing.
    let got = r.world(icmp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, false, id_b, 1));
    assert_eq!(got.verdict, TC_ACT_REDIRECT);
    assert_eq!(got.data, icmp(GATEWAY_MAC, GUEST_MAC, WORLD_IP, GUEST_IP, false, ID, 1));
    assert_eq!((delivered(&r, SB_IFINDEX), delivered(&r, B_IFINDEX)), (0, 1));

    // A router's time-exceeded about A's ping (as it left the node): A only, translated back.
    let router = [198, 51, 100, 254];
    let got = r.world(time_exceeded(&r, router, &out_a.data[14..42]));
    assert_eq!(got.verdict, TC_ACT_REDIRECT);
    assert_eq!(&got.data[42 + 24..42 + 26], &ID.to_be_bytes(), "A's own id in the embedded echo");
    assert_eq!((delivered(&r, SB_IFINDEX), delivered(&r, B_IFINDEX)), (1, 1));

    // Replies at the guests' own id, and at ids next to the live ones, reach nobody.
    for id in [ID, id_a.wrapping_add(1), id_b.wrapping_sub(1)] {
        if id == id_a || id == id_b {
            continue;
        }
        let f = icmp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, false, id, 1);
        let got = r.world(f.clone());
        assert_eq!((got.verdict, got.data), (TC_ACT_OK, f), "id {id:#x} was taken for a session");
    }
    assert_eq!((delivered(&r, SB_IFINDEX), delivered(&r, B_IFINDEX)), (1, 1));
}
