//! `from_envoy`: tcx egress of cube-dev — host → sandbox (`reference/upstream.md §3.6`).
//!
//! The destination mvm IP is DNATed to 169.254.68.6 and, when the host sent from cube-dev's
//! own address, the source becomes the guest gateway 169.254.68.5 (so the guest answers its
//! gateway, which `from_cube` maps back). Unknown destinations are dropped.

use aya_ebpf::{bindings::TC_ACT_SHOT, helpers::generated::bpf_redirect, macros::classifier, programs::TcContext};
use cubevs_common::{counter, ether};

use crate::{
    config,
    maps::{MVMIP_TO_IFINDEX, count, node},
    packet::{self, IP_DST_OFF, IP_SRC_OFF, set_ip, set_macs},
};

#[classifier]
pub fn from_envoy(ctx: TcContext) -> i32 {
    packet::ensure_linear(&ctx, ether::HDR_LEN + 60 + 20);
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
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}
