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
//! fragments from being followed; however many sandboxes flood together, each registered one
//! keeps a floor of entries (`crate::track_floor`, decision Q6).

use aya_ebpf::{
    bindings::{BPF_EXIST, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_ktime_get_ns, generated::bpf_redirect},
    programs::TcContext,
};
use cubevs_common::{
    DatapathConfig, FRAG_AMBIGUOUS, FRAG_TIMEOUT_NS, FragKey, FragTarget,
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
/// floor (over them, or with the map full: not recorded, counted). A new entry is charged to
/// its sandbox version and the node; an entry is never given to another owner (only userspace
/// deletes entries, so the owner userspace reads is the one it subtracts). When an unexpired
/// entry of another sandbox (or version) holds the same key, the later fragments of the two
/// datagrams cannot be told apart: the entry is marked [`FRAG_AMBIGUOUS`] until it expires,
/// keeping its owner, expiry and charge, and [`later`] drops what follows it (decision R16);
/// its owner repeating the datagram keeps the mark. Later fragments of the other datagram that
/// arrive after the entry expired go to the host, like any without an entry.
#[inline(always)]
pub fn first(ip: &Ipv4, ifindex: u32, version: u32) {
    let k = key(ip);
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let expires_ns = now + FRAG_TIMEOUT_NS;
    // SAFETY: plain map lookup; the value is copied out.
    if let Some(old) = unsafe { FRAG_SESSIONS.get(&k) }.copied()
        && old.expires_ns > now
        && (old.ifindex != ifindex || old.version & !FRAG_AMBIGUOUS != version)
    {
        // The expiry stays the owner's: another sandbox can spoil a live datagram of the same
        // server and IP id, never keep the owner's entry (and its charge) alive.
        let t = FragTarget { version: old.version | FRAG_AMBIGUOUS, ..old };
        let _ = FRAG_SESSIONS.insert(&k, &t, BPF_EXIST as u64);
        count(counter::WORLD_FRAG_AMBIGUOUS);
        return;
    }
    if !budget::take(ifindex, KIND_FRAG, limits::FRAG_PER_SANDBOX, FRAG_WINDOW_NS)
        || !track_floor::admit(ifindex, version, KIND_FRAG)
    {
        count(counter::WORLD_FRAG_OVER_BUDGET);
        return;
    }
    let t = FragTarget { ifindex, version, expires_ns };
    if FRAG_SESSIONS.insert(&k, &t, BPF_NOEXIST as u64).is_ok() {
        track_floor::charge(ifindex, version, KIND_FRAG);
        return;
    }
    // The same datagram key again: renewed only for its owner, an ambiguity mark kept.
    // SAFETY: plain map lookup; fields copied out.
    let Some(old) = unsafe { FRAG_SESSIONS.get(&k) }.copied() else {
        count(counter::WORLD_FRAG_OVER_BUDGET);
        return;
    };
    if old.ifindex != ifindex || old.version & !FRAG_AMBIGUOUS != version {
        count(counter::WORLD_FRAG_OVER_BUDGET);
        return;
    }
    let t = FragTarget { version: old.version, ..t };
    if FRAG_SESSIONS.insert(&k, &t, BPF_EXIST as u64).is_err() {
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
    if t.version & FRAG_AMBIGUOUS != 0 {
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
