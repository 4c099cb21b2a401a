//! Fragmented replies from the world (decision D27): the first fragment carries the ports and
//! is reverse-translated like any packet of its session; it also records `{src, dst, IP id,
//! proto}` → (sandbox interface, version) in the LRU map `frag_sessions`, and later fragments
//! (no L4 header) follow that entry: destination rewritten to 169.254.68.6 (IP checksum only)
//! and redirected to the same interface, where the guest reassembles. A later fragment that
//! arrives before its first fragment is passed to the host stack (lost for the guest).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::generated::bpf_redirect,
    programs::TcContext,
};
use cubevs_common::{DatapathConfig, FragKey, FragTarget, counter};

use crate::{
    maps::{FRAG_SESSIONS, IFINDEX_TO_MVMMETA, count},
    packet::{IP_DST_OFF, Ipv4, set_ip, set_macs},
};

#[inline(always)]
fn key(ip: &Ipv4) -> FragKey {
    FragKey { src_ip: ip.src, dst_ip: ip.dst, ip_id: ip.id, proto: ip.proto, _pad: 0 }
}

/// Records where the first fragment `ip` of a datagram went.
#[inline(always)]
pub fn first(ip: &Ipv4, ifindex: u32, version: u32) {
    let _ = FRAG_SESSIONS.insert(&key(ip), &FragTarget { ifindex, version }, 0);
}

/// Delivers a later fragment after its first fragment, or passes it (`TC_ACT_OK`).
#[inline(always)]
pub fn later(ctx: &TcContext, ip: &Ipv4, cfg: &DatapathConfig) -> i32 {
    // SAFETY: plain map lookup; the value is copied out.
    let Some(t) = (unsafe { FRAG_SESSIONS.get(&key(ip)) }).copied() else { return TC_ACT_OK };
    // SAFETY: plain map lookup; one field copied out.
    if unsafe { IFINDEX_TO_MVMMETA.get(&t.ifindex) }.map(|m| m.version) != Some(t.version) {
        count(counter::WORLD_DROP_STALE_VERSION);
        return TC_ACT_SHOT;
    }
    // No L4 header here: only the IP checksum changes.
    let mut l3 = *ip;
    l3.proto = 0;
    if set_ip(ctx, &l3, IP_DST_OFF, ip.dst, cfg.mvm_inner_ip).is_err()
        || set_macs(ctx, &cfg.mvm_mac, &cfg.gateway_mac).is_err()
    {
        return TC_ACT_SHOT;
    }
    count(counter::WORLD_FRAGMENT);
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(t.ifindex, 0) as i32 }
}
