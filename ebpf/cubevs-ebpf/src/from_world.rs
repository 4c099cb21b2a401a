//! `from_world`: tcx ingress of the uplink (`reference/upstream.md §3.6`).
//!
//! Host-port DNAT (TCP and UDP) to `169.254.68.6:<guest port>` on the sandbox interface, only
//! for packets arriving on the registered uplink (decision D26), recording the connection in
//! `portmap_sessions` so the guest's replies may leave (D20); reverse NAT of sessions (TCP,
//! UDP, ICMP echo reply) with conntrack update, dropped when the session's sandbox version is
//! no longer the one registered on its interface (D19) or for an RST outside the tracked
//! window (D21); everything else continues into the host stack untouched. The DNAT and
//! reverse NAT code is shared with `xdp_world` ([`crate::world`]); ICMP errors and fragments
//! are handled here only.
//! What reaches a sandbox (DNAT, reverse NAT, ICMP errors, later fragments) is charged to it
//! as `in` (`sandbox_stats`), an RST outside the window as its `rst_window` drop; a stale
//! version's drops are never charged to the interface's current owner.
//! UDP from port 53 is offered to the DNS learning hook first (tail call, `crate::dns`).
//! Anything addressed to a registered sandbox's mvm IP is dropped first (decision R10); then a
//! frame that carried a VLAN tag with a non-zero VID is passed on untouched (decision R46).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::generated::bpf_redirect,
    macros::classifier,
    programs::TcContext,
};
use cubevs_common::{counter, ether, proto};

use crate::{
    config, dns, frag, icmp_err,
    maps::{MVMIP_TO_IFINDEX, count},
    packet::{self, ICMP_ECHO_REPLY},
    world::{self, Outcome},
};

#[inline(always)]
fn pass() -> i32 {
    count(counter::WORLD_PASS);
    TC_ACT_OK
}

#[classifier]
pub fn from_world(ctx: TcContext) -> i32 {
    packet::ensure_linear(&ctx, ether::HDR_LEN + 60 + 20);
    if packet::ethertype(&ctx) != Some(ether::P_IP) {
        return pass();
    }
    let Some(ip) = packet::ipv4(&ctx) else { return pass() };
    // A sandbox's mvm IP is node-local: from the uplink a sandbox is reached only through its
    // host ports. Passed on, the host would forward it to cube-dev and `from_envoy` would
    // deliver it into the sandbox (decision R10). Checked before fragments: a later fragment
    // to an mvm IP would be passed on too.
    if MVMIP_TO_IFINDEX.get_ptr(&ip.dst).is_some() {
        count(counter::WORLD_DROP_TO_SANDBOX);
        return TC_ACT_SHOT;
    }
    // A frame of a VLAN (non-zero VID) whose tag the kernel took off before tc: the uplink is
    // not on that VLAN, so the kernel drops it (`PACKET_OTHERHOST`) or hands it to a VLAN
    // device on top. Taken in here, a host on another VLAN of the wire would reach host ports
    // and answer sessions (decision R46, the world-side twin of R9). A priority tag (VID 0) is
    // untagged traffic to the kernel and stays ours.
    // SAFETY: `skb` is the context pointer the kernel passed in.
    let (vlan_present, vlan_tci) = unsafe { ((*ctx.skb.skb).vlan_present, (*ctx.skb.skb).vlan_tci) };
    if vlan_present != 0 && vlan_tci & 0x0fff != 0 {
        return pass();
    }
    let cfg = config::get();
    if ip.later_fragment {
        return frag::later(&ctx, &ip, &cfg);
    }
    let Some(l4) = packet::l4(&ctx, &ip) else { return pass() };
    if ip.proto == proto::UDP && l4.sport == cubevs_common::dns::SERVER_PORT.to_be() {
        // Tail call to `dns_response`, which comes back here; returns only if it already ran.
        dns::enter(&ctx, cubevs_common::dns::slot::RESPONSE);
    }

    // SAFETY: `skb` is the context pointer the kernel passed in.
    let ingress = unsafe { (*ctx.skb.skb).ingress_ifindex };
    match world::host_port(&ctx, &ip, &l4, &cfg, ingress) {
        Outcome::NotOurs => {}
        Outcome::WrongDevice => {
            count(counter::WORLD_PORTMAP_WRONG_DEV);
            return TC_ACT_OK;
        }
        Outcome::NoSession | Outcome::Failed => return pass(),
        Outcome::Drop => return TC_ACT_SHOT,
        // SAFETY: plain helper call.
        Outcome::Redirect { ifindex, .. } => return unsafe { bpf_redirect(ifindex, 0) } as i32,
    }

    if ip.proto == proto::ICMP && l4.icmp_type != ICMP_ECHO_REPLY {
        if l4.icmp_type == icmp_err::ICMP_DEST_UNREACH || l4.icmp_type == icmp_err::ICMP_TIME_EXCEEDED {
            let v = icmp_err::reverse(&ctx, &ip, &cfg);
            if v != TC_ACT_OK {
                return v;
            }
        }
        return pass();
    }
    match world::reverse(&ctx, &ip, &l4, &cfg) {
        Outcome::NotOurs | Outcome::Failed | Outcome::WrongDevice => pass(),
        Outcome::NoSession => {
            count(counter::WORLD_STALE);
            TC_ACT_OK
        }
        Outcome::Drop => TC_ACT_SHOT,
        Outcome::Redirect { ifindex, version } => {
            if ip.fragment {
                frag::first(&ip, ifindex, version);
            }
            // SAFETY: plain helper call.
            unsafe { bpf_redirect(ifindex, 0) as i32 }
        }
    }
}
