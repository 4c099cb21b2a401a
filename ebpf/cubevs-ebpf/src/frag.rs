//! Fragmented replies from the world (decision D27): the first fragment carries the ports and
//! is reverse-translated like any packet of its session; it also records `{src, dst, IP id,
//! proto}` → (sandbox interface, version, expiry) in `frag_sessions_v2`, and later fragments
//! (no L4 header) follow that entry: destination rewritten to 169.254.68.6 (IP checksum only)
//! and redirected to the same interface, where the guest reassembles. A later fragment that
//! arrives before its first fragment, or after the entry expired, is passed to the host stack
//! (lost for the guest).
//!
//! The map never evicts: each sandbox records at most `limits::FRAG_PER_SANDBOX` first
//! fragments per window (`crate::budget`), and userspace deletes expired entries (decision
//! R12), so a flood of first fragments toward one sandbox can only stop its own later
//! fragments from being followed; however many sandboxes flood together, each registered one
//! keeps a floor of entries (`crate::track_floor`, decision Q6).

use aya_ebpf::{
    bindings::{BPF_EXIST, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_ktime_get_ns, generated::bpf_redirect},
    programs::TcContext,
};
use cubevs_common::{
    DatapathConfig, FRAG_TIMEOUT_NS, FragKey, FragTarget,
    budget::{FRAG_WINDOW_NS, KIND_FRAG},
    counter, limits, track,
};

use crate::{
    budget,
    maps::{FRAG_SESSIONS, IFINDEX_TO_MVMMETA, count, sandbox_in},
    packet::{IP_DST_OFF, Ipv4, set_ip, set_macs},
    track_floor,
};

/// The entry key of `ip`'s datagram; `_pad` marks the entries this object charges (decision
/// Q6), so it neither follows nor subtracts the uncharged entries of an older object.
#[inline(always)]
fn key(ip: &Ipv4) -> FragKey {
    FragKey { src_ip: ip.src, dst_ip: ip.dst, ip_id: ip.id, proto: ip.proto, _pad: track::FRAG_CHARGED }
}

/// Records where the first fragment `ip` of a datagram went, within the sandbox's budget and
/// floor (over them, with the map full, or with the key held by another sandbox version: not
/// recorded, counted). A new entry is charged to its sandbox version and the node; an entry
/// is never given to another owner (only userspace deletes entries, so the owner userspace
/// reads is the one it subtracts).
#[inline(always)]
pub fn first(ip: &Ipv4, ifindex: u32, version: u32) {
    // SAFETY: helper without arguments.
    let expires_ns = unsafe { bpf_ktime_get_ns() } + FRAG_TIMEOUT_NS;
    if !budget::take(ifindex, KIND_FRAG, limits::FRAG_PER_SANDBOX, FRAG_WINDOW_NS)
        || !track_floor::admit(ifindex, version, KIND_FRAG)
    {
        count(counter::WORLD_FRAG_OVER_BUDGET);
        return;
    }
    let k = key(ip);
    let t = FragTarget { ifindex, version, expires_ns };
    if FRAG_SESSIONS.insert(&k, &t, BPF_NOEXIST as u64).is_ok() {
        track_floor::charge(ifindex, version, KIND_FRAG);
        return;
    }
    // The same datagram key again: renewed only for its owner.
    // SAFETY: plain map lookup; fields copied out.
    let owner = unsafe { FRAG_SESSIONS.get(&k) }.map(|o| (o.ifindex, o.version));
    if owner != Some((ifindex, version)) || FRAG_SESSIONS.insert(&k, &t, BPF_EXIST as u64).is_err() {
        count(counter::WORLD_FRAG_OVER_BUDGET);
    }
}

/// Delivers a later fragment after its first fragment, or passes it (`TC_ACT_OK`).
#[inline(always)]
pub fn later(ctx: &TcContext, ip: &Ipv4, cfg: &DatapathConfig) -> i32 {
    // SAFETY: plain map lookup; the value is copied out.
    let Some(t) = (unsafe { FRAG_SESSIONS.get(&key(ip)) }).copied() else { return TC_ACT_OK };
    // An expired entry not yet reaped is a miss.
    // SAFETY: helper without arguments.
    if t.expires_ns <= unsafe { bpf_ktime_get_ns() } {
        return TC_ACT_OK;
    }
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
    sandbox_in(t.ifindex, ctx.len());
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(t.ifindex, 0) as i32 }
}
