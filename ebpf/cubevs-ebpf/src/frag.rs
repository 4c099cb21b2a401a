//! Fragmented replies from the world (decision D27): the first fragment carries the ports and
//! is reverse-translated like any packet of its session; it also records `{src, dst, IP id,
//! proto}` → (sandbox interface, version, expiry) in `frag_sessions_v2`, and later fragments
//! (no L4 header) follow that entry: destination rewritten to 169.254.68.6 (IP checksum only)
//! and redirected to the same interface, where the guest reassembles. A later fragment that
//! arrives before its first fragment, or after the entry expired, is passed to the host stack
//! (lost for the guest). Two sandboxes' datagrams with the same key (the IP id is the server's
//! choice) make the entry ambiguous: their later fragments are dropped, never delivered to the
//! other sandbox (decision R16).
//!
//! The map never evicts: each sandbox records at most `limits::FRAG_PER_SANDBOX` first
//! fragments per window (`crate::budget`), and userspace deletes expired entries (decision
//! R12), so a flood of first fragments toward one sandbox can only stop its own later
//! fragments from being followed.

use aya_ebpf::{
    bindings::{BPF_ANY, TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_ktime_get_ns, generated::bpf_redirect},
    programs::TcContext,
};
use cubevs_common::{
    DatapathConfig, FRAG_TIMEOUT_NS, FragKey, FragTarget,
    budget::{FRAG_WINDOW_NS, KIND_FRAG},
    counter, limits,
};

use crate::{
    budget,
    maps::{FRAG_SESSIONS, IFINDEX_TO_MVMMETA, count, sandbox_in},
    packet::{IP_DST_OFF, Ipv4, set_ip, set_macs},
};

/// `FragTarget::ifindex` of an entry two sandboxes' first fragments claimed (no interface has
/// index 0).
const AMBIGUOUS: u32 = 0;

#[inline(always)]
fn key(ip: &Ipv4) -> FragKey {
    FragKey { src_ip: ip.src, dst_ip: ip.dst, ip_id: ip.id, proto: ip.proto, _pad: 0 }
}

/// Records where the first fragment `ip` of a datagram went, within the sandbox's budget
/// (over it, or with the map full: not recorded, counted). When an unexpired entry of another
/// sandbox (or version) holds the same key, the later fragments of the two datagrams cannot be
/// told apart: the entry becomes ambiguous ([`AMBIGUOUS`]) until the later expiry, and
/// [`later`] drops what follows it (decision R16).
#[inline(always)]
pub fn first(ip: &Ipv4, ifindex: u32, version: u32) {
    let k = key(ip);
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let expires_ns = now + FRAG_TIMEOUT_NS;
    // SAFETY: plain map lookup; the value is copied out.
    if let Some(old) = unsafe { FRAG_SESSIONS.get(&k) }.copied()
        && old.expires_ns > now
        && (old.ifindex != ifindex || old.version != version)
    {
        let t = FragTarget { ifindex: AMBIGUOUS, version: 0, expires_ns };
        let _ = FRAG_SESSIONS.insert(&k, &t, BPF_ANY as u64);
        count(counter::WORLD_FRAG_AMBIGUOUS);
        return;
    }
    if !budget::take(ifindex, KIND_FRAG, limits::FRAG_PER_SANDBOX, FRAG_WINDOW_NS)
        || FRAG_SESSIONS.insert(&k, &FragTarget { ifindex, version, expires_ns }, BPF_ANY as u64).is_err()
    {
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
    if t.ifindex == AMBIGUOUS {
        count(counter::WORLD_FRAG_AMBIGUOUS);
        return TC_ACT_SHOT;
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
