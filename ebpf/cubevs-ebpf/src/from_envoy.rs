//! `from_envoy`: tcx egress of cube-dev — host → sandbox (`reference/upstream.md §3.6`).
//!
//! The destination mvm IP is DNATed to 169.254.68.6 and, when the host sent from cube-dev's
//! own address, the source becomes the guest gateway 169.254.68.5 (so the guest answers its
//! gateway, which `from_cube` maps back). Unknown destinations are dropped, and so is every
//! packet the host forwarded from an interface (decision R61): only the host's own sockets
//! (the agent, CubeEgress, the kernel's own ICMP and RSTs) reach a sandbox through cube-dev, so
//! a pod, a container or a second NIC's neighbour routed through the node never reaches a
//! sandbox by its mvm IP. Delivered packets
//! are charged to the sandbox as `in` (`sandbox_stats`). Replies of L7
//! sessions (CubeEgress answering with the original destination as source) advance the
//! session's conntrack state first.

use aya_ebpf::{bindings::TC_ACT_SHOT, helpers::generated::bpf_redirect, macros::classifier, programs::TcContext};
use cubevs_common::{
    SessionKey,
    conntrack::{CLASS_L7, Dir},
    counter, ether, proto,
};

use crate::{
    config,
    maps::{EGRESS_SESSIONS, IFINDEX_TO_MVMMETA, MVMIP_TO_IFINDEX, count, node, sandbox_in},
    nat,
    packet::{self, IP_DST_OFF, IP_SRC_OFF, Ipv4, set_ip, set_macs},
    track,
};

/// A CubeEgress reply (source = the flow's original destination, IP_TRANSPARENT) of an L7
/// session of the sandbox on `ifindex`: advances the session's reply-side conntrack state and
/// refreshes it, so steered flows age like SNAT ones.
#[inline(always)]
fn l7_reply(ctx: &TcContext, ip: &Ipv4, ifindex: u32) {
    if ip.proto != proto::TCP || ip.later_fragment {
        return;
    }
    let Some(l4) = packet::l4(ctx, ip) else { return };
    // SAFETY: plain map lookup; one field copied out.
    let Some(version) = (unsafe { IFINDEX_TO_MVMMETA.get(&ifindex) }).map(|m| m.version) else { return };
    let key = SessionKey {
        src_ip: ip.dst,
        dst_ip: ip.src,
        sport: l4.dport,
        dport: l4.sport,
        version,
        proto: proto::TCP,
        _pad: [0; 3],
    };
    let Some(s) = EGRESS_SESSIONS.get_ptr_mut(&key) else { return };
    // SAFETY: valid map value pointer.
    if unsafe { (*s).packet_class } != CLASS_L7 {
        return;
    }
    let _ = track::tcp_segment(s, Dir::Reply, ip, &l4, false);
    nat::touch(s);
    count(counter::ENVOY_L7_REPLY);
}

#[classifier]
pub fn from_envoy(ctx: TcContext) -> i32 {
    packet::ensure_linear(&ctx, ether::HDR_LEN + 60 + 20);
    // `skb_iif` is 0 for what a host socket sent and the receiving interface for what the node
    // forwards: a pod on the node, a container bridge, a second NIC or a tunnel routed to the
    // sandbox CIDR (the agent routes it through cube-dev) reached every sandbox's ports,
    // whatever its policy and without a host port (R61; R10 closed the uplink only).
    // SAFETY: `skb` is the context pointer the kernel passed in.
    if unsafe { (*ctx.skb.skb).ingress_ifindex } != 0 {
        count(counter::ENVOY_DROP_UNKNOWN);
        return TC_ACT_SHOT;
    }
    if packet::ethertype(&ctx) != Some(ether::P_IP) {
        return TC_ACT_SHOT;
    }
    let Some(mut ip) = packet::ipv4(&ctx) else { return TC_ACT_SHOT };
    // SAFETY: plain map lookup; the value is copied out.
    let Some(ifindex) = (unsafe { MVMIP_TO_IFINDEX.get(&ip.dst) }).copied() else {
        count(counter::ENVOY_DROP_UNKNOWN);
        return TC_ACT_SHOT;
    };
    if ip.later_fragment {
        // No L4 header in a later fragment; only the IP checksum changes. A first fragment
        // carries the L4 header and its checksum covers the whole datagram: it is updated
        // incrementally like any other packet.
        ip.proto = 0;
    }
    let cfg = config::get();
    let node = node();
    if ip.src != node.cube_dev_ip {
        l7_reply(&ctx, &ip, ifindex);
    }
    if set_ip(&ctx, &ip, IP_DST_OFF, ip.dst, cfg.mvm_inner_ip).is_err() {
        return TC_ACT_SHOT;
    }
    if ip.src == node.cube_dev_ip && set_ip(&ctx, &ip, IP_SRC_OFF, ip.src, cfg.mvm_gateway_ip).is_err() {
        return TC_ACT_SHOT;
    }
    if set_macs(&ctx, &cfg.mvm_mac, &cfg.gateway_mac).is_err() {
        return TC_ACT_SHOT;
    }
    count(counter::ENVOY_TO_SANDBOX);
    sandbox_in(ifindex, ctx.len());
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}
