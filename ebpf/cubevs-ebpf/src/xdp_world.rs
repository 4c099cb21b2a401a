//! `xdp_world`: XDP on the uplink, the fast path of the hot reverse direction (issue 15,
//! decisions X1–X3). Replies of established SNAT sessions (TCP, UDP) and host-port DNAT
//! (TCP, UDP) are rewritten by the code `from_world` uses ([`crate::world`]: same maps, same
//! session updates, same stale-version / RST-window / uplink-only checks) and redirected
//! straight into the sandbox TAP (`bpf_redirect`, delivered by the TAP's `ndo_xdp_xmit`).
//!
//! Everything else returns `XDP_PASS` with the frame and the maps untouched, so `from_world`
//! (tcx ingress, which runs next) handles it exactly as without XDP: non-IPv4, fragments
//! (first fragments must fill `frag_sessions_v2` on the TC path), ICMP (echo replies and errors),
//! frames without a mapping or session, host-port frames from another device, and sessions
//! whose egress half is gone. Drops are the TC path's drops, the first of them `from_world`'s:
//! anything addressed to a registered sandbox's mvm IP is dropped before any lookup (R10, R45:
//! an L7 session's reverse key names the mvm IP, and only that check keeps the world out of it).

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    helpers::generated::bpf_redirect,
    macros::xdp,
    programs::XdpContext,
};
use cubevs_common::{counter, ether, proto};

use crate::{
    config,
    maps::{MVMIP_TO_IFINDEX, count},
    packet,
    world::{self, Outcome},
};

#[xdp]
pub fn xdp_world(ctx: XdpContext) -> u32 {
    if packet::ethertype(&ctx) != Some(ether::P_IP) {
        return XDP_PASS;
    }
    let Some(ip) = packet::ipv4(&ctx) else { return XDP_PASS };
    // As `from_world` does first (decision R10): a sandbox's mvm IP is never reached from the
    // uplink. Without it an L7 session's reverse key {server, mvm IP, server port, guest port}
    // took a world frame that names the mvm IP straight into the guest (decision R45).
    if MVMIP_TO_IFINDEX.get_ptr(&ip.dst).is_some() {
        count(counter::WORLD_DROP_TO_SANDBOX);
        return XDP_DROP;
    }
    if ip.fragment || (ip.proto != proto::TCP && ip.proto != proto::UDP) {
        return XDP_PASS;
    }
    let Some(l4) = packet::l4(&ctx, &ip) else { return XDP_PASS };
    if ip.proto == proto::UDP && l4.sport == cubevs_common::dns::SERVER_PORT.to_be() {
        // DNS answers go to `from_world`, whose learning hook must see them (decision N1).
        return XDP_PASS;
    }
    let cfg = config::get();
    // SAFETY: `ctx.ctx` is the context pointer the kernel passed in.
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    let out = match world::host_port(&ctx, &ip, &l4, &cfg, ingress) {
        Outcome::NotOurs => world::reverse(&ctx, &ip, &l4, &cfg),
        o => o,
    };
    match out {
        Outcome::NotOurs | Outcome::WrongDevice | Outcome::NoSession => XDP_PASS,
        // A failed rewrite after the session was updated: passing would track the segment a
        // second time on the TC path. Bounds were checked by the parser, so this never
        // happens in practice.
        Outcome::Drop | Outcome::Failed => XDP_DROP,
        Outcome::Redirect { ifindex, .. } => {
            count(counter::XDP_REDIRECT);
            // SAFETY: plain helper call.
            unsafe { bpf_redirect(ifindex, 0) as u32 }
        }
    }
}
