//! Attack: a guest that sends VLAN-tagged frames on its TAP tries to put traffic onto another
//! VLAN of the node's wire (VLAN hopping past the sandbox boundary).
//!
//! The kernel takes the outer 802.1Q / 802.1ad tag off a received frame (into `skb->vlan_tci`)
//! *before* tc ingress runs, so `from_cube` sees the inner EtherType. If it forwarded such a
//! frame, the redirect keeps the tag in the skb and the uplink transmits it tagged. The real
//! datapath runs on a real TAP (the guest writes raw frames as a VMM would); what leaves on the
//! world side of the uplink is captured with the tag the kernel reports (`PACKET_AUXDATA`).
//! Order, not time, decides: an untagged control datagram is sent after every tagged one, on
//! the same path, and the capture reads until the control arrives.

use std::time::Duration;

use cubenet_tests::{
    capture::{Capture, Captured},
    frames::udp,
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    tap_node::TapNode,
    topology::{WORLD_IF, WORLD_IP},
};
use cubevs_common::counter;
const DPORT: u16 = 7777;

/// `frame` with a VLAN tag (`tpid`, `tci`) inserted after the MAC addresses.
fn tagged(frame: &[u8], tags: &[(u16, u16)]) -> Vec<u8> {
    let mut f = frame[..12].to_vec();
    for (tpid, tci) in tags {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&tci.to_be_bytes());
    }
    f.extend_from_slice(&frame[12..]);
    f
}

fn has_payload(c: &Captured, marker: &[u8]) -> bool {
    c.data.windows(marker.len()).any(|w| w == marker)
}

#[test]
fn vlan_tagged_guest_frames_never_leave_the_node() {
    if !require_root("attack_vlan vlan_tagged_guest_frames_never_leave_the_node") {
        return;
    }
    let n = TapNode::new();
    let maps = n.dp().maps();

    // The capture on the world end of the uplink: what the node put on its wire.
    let cap = n.topo.world.run(|| Capture::open(cubenet_sys::ifindex(WORLD_IF).expect("wp0 ifindex")));
    let guest = &n.guest;
    guest.drain();

    // Each attack frame: a UDP datagram to the world (a flow the policy allows untagged),
    // tagged as the attacker likes; its own source port and marker.
    let attacks: [(&str, Vec<(u16, u16)>); 4] = [
        ("802.1Q vid 5", vec![(0x8100, 5)]),
        ("802.1Q vid 0 (priority tag)", vec![(0x8100, 0x6000)]),
        ("802.1ad vid 7", vec![(0x88a8, 7)]),
        ("QinQ 802.1ad 7 / 802.1Q 5", vec![(0x88a8, 7), (0x8100, 5)]),
    ];
    let drops0 = maps.counters.get(counter::CUBE_DROP_PROTO).unwrap();
    for (i, (_, tags)) in attacks.iter().enumerate() {
        let marker = format!("vlan-attack-{i}");
        let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 41000 + i as u16, DPORT, marker.as_bytes());
        guest.send(&tagged(&f, tags));
    }
    // The control: the same datagram untagged; it must leave (proves the capture sees the path).
    let control = b"vlan-control";
    guest.send(&udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 42000, DPORT, control));
    let seen = cap.read_until(Duration::from_secs(5), |c| has_payload(c, control));
    let ctrl = seen.iter().find(|c| has_payload(c, control)).expect("the untagged control datagram never left");
    assert_eq!(ctrl.vlan, None, "the control left tagged");

    let leaked: Vec<(&str, Option<(u16, u16)>)> = attacks
        .iter()
        .enumerate()
        .flat_map(|(i, (name, _))| {
            let marker = format!("vlan-attack-{i}");
            seen.iter().filter(move |c| has_payload(c, marker.as_bytes())).map(move |c| (*name, c.vlan))
        })
        .collect();
    assert!(leaked.is_empty(), "tagged guest frames left the node (attack, tag on the wire): {leaked:?}");
    // Nothing of the tagged frames became a session: only the control's flow exists.
    let sessions = maps.sessions.list().unwrap();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    assert_eq!(sessions[0].guest_port, 42000, "{sessions:?}");
    // Dropped and counted on this sandbox (the QinQ inner tag is a non-IPv4 EtherType too).
    let drops = maps.counters.get(counter::CUBE_DROP_PROTO).unwrap() - drops0;
    assert_eq!(drops, attacks.len() as u64, "drop_proto counted for every tagged frame");
}
