//! Egress policy: `ALLOW_OUT` beats `DENY_OUT` beats default allow, decided once per new flow
//! (`reference/upstream.md §3.5`). An expired longest `ALLOW_OUT` match does not fall back to
//! a shorter entry.
//!
//! Consistency with a concurrent replace (userspace writes generation g+1, flips `POLICY_GEN`,
//! then deletes generation g): the generation is read before and after the lookups, and a
//! verdict counts only when both reads agree, i.e. the lookups ran entirely against one
//! complete generation (a seqlock read side). Generations only grow, so equal reads cannot be
//! two different policies. After [`ATTEMPTS`] changed reads, or without a generation at all,
//! the flow is denied: never fail open. The two reads and the lookups are separate helper
//! calls and loads the compiler cannot merge or reorder (`read_volatile`); x86-64 keeps loads
//! in order.
//!
//! Addresses learned from DNS answers ([`crate::dns`]) rank with `ALLOW_OUT`: a new flow
//! that no static allow entry covers is allowed by an unexpired learned entry for its
//! (address, port) or (address, any port) before `DENY_OUT` is consulted ([`allowed_flow`]).
//!
//! The node's extra always-denied list (`NODE_DENY`, decision R30) comes before all of it: an
//! address it covers is denied whatever the sandbox's tries or learned entries say.

use aya_ebpf::{helpers::bpf_ktime_get_ns, maps::lpm_trie::Key};
use cubevs_common::{POLICY_PREFIX_BITS, PolicyLpmData, allow_flag, counter};

use crate::{
    dns,
    maps::{ALLOW_OUT, DENY_OUT, NODE_DENY, POLICY_GEN, count},
};

/// Lookups against a generation that changed underneath are retried this many times.
const ATTEMPTS: usize = 3;

/// The active policy generation of `ifindex`, `None` when it has no policy.
#[inline(always)]
pub fn generation(ifindex: u32) -> Option<u32> {
    let p = POLICY_GEN.get_ptr(&ifindex)?;
    // SAFETY: a valid map value pointer from the lookup helper; read once, not cached.
    Some(unsafe { core::ptr::read_volatile(p) })
}

/// What the tries of one generation say about an address (plain integers: an
/// `Option<enum>` here once compiled to a spill of an undefined register, which the verifier
/// rejects).
mod v {
    /// No generation, or it kept changing: deny.
    pub const NONE: u8 = 0;
    /// An unexpired `ALLOW_OUT` entry covers it.
    pub const ALLOW: u8 = 1;
    /// No allow entry, a `DENY_OUT` entry covers it.
    pub const DENY: u8 = 2;
    /// Neither: default allow.
    pub const OPEN: u8 = 3;
    /// A static L7 entry steers this (TCP, port) to CubeEgress.
    pub const L7: u8 = 4;
    /// The node's always-denied list covers it: deny, before any allow or learned entry.
    pub const NODE: u8 = 5;
}

/// True when the node's extra always-denied list (`NODE_DENY`, decision R30) covers `daddr`
/// (NBO). An empty or absent list covers nothing.
#[inline(always)]
pub fn node_denied(daddr: u32) -> bool {
    NODE_DENY.get(&Key::new(32, daddr)).is_some()
}

/// The verdict of generation `generation` of `ifindex` for `daddr` (NBO); `scheme` is the
/// [`cubevs_common::l7`] scheme of a new TCP flow's port (0: not TCP or not 80/443). A static
/// L7 entry (N10) steers its schemes, and is plain allow for the rest only with `L3_ALLOWED`;
/// otherwise the rest falls through to `deny_out` as if the entry were absent.
#[inline(always)]
fn classify(ifindex: u32, generation: u32, daddr: u32, scheme: u8) -> u8 {
    let key = Key::new(POLICY_PREFIX_BITS + 32, PolicyLpmData { ifindex, generation, ip: daddr });
    if let Some(e) = ALLOW_OUT.get(&key) {
        // SAFETY: helper without arguments.
        if e.expires_ns == 0 || e.expires_ns > unsafe { bpf_ktime_get_ns() } {
            let flags = e.flags;
            let l7 = flags & (allow_flag::L7_HTTP | allow_flag::L7_HTTPS);
            if l7 == 0 || flags & allow_flag::L3_ALLOWED != 0 {
                if l7 & allow_flag::of_scheme(scheme) != 0 {
                    return v::L7;
                }
                return v::ALLOW;
            }
            if l7 & allow_flag::of_scheme(scheme) != 0 {
                return v::L7;
            }
        }
    }
    if DENY_OUT.get(&key).is_none() { v::OPEN } else { v::DENY }
}

/// The verdict of the active generation ([`v`]).
#[inline(always)]
fn verdict(ifindex: u32, daddr: u32, scheme: u8) -> u8 {
    if node_denied(daddr) {
        return v::NODE;
    }
    let Some(mut seen) = generation(ifindex) else { return v::NONE };
    for _ in 0..ATTEMPTS {
        let verdict = classify(ifindex, seen, daddr, scheme);
        match generation(ifindex) {
            Some(now) if now == seen => return verdict,
            Some(now) => seen = now,
            None => return v::NONE,
        }
    }
    v::NONE
}

/// True when the sandbox on `ifindex` may open a flow to `daddr` (NBO), static entries only.
#[inline(always)]
pub fn allowed(ifindex: u32, daddr: u32) -> bool {
    let r = verdict(ifindex, daddr, 0);
    r == v::ALLOW || r == v::OPEN
}

/// True when the sandbox on `ifindex` (at `version`) may open a new flow to `daddr`:`dport`
/// (NBO; `dport` 0 for ICMP; `tcp` for TCP): static allow, else a learned address, else not
/// denied.
#[inline(always)]
pub fn allowed_flow(ifindex: u32, version: u32, daddr: u32, dport: u16, tcp: bool) -> bool {
    flow_class(ifindex, version, daddr, dport, tcp) != FLOW_DENY
}

/// [`flow_class`]: denied.
pub const FLOW_DENY: u8 = 0;
/// [`flow_class`]: allowed, plain SNAT.
pub const FLOW_SNAT: u8 = 1;
/// [`flow_class`]: allowed by a learned L7 address: steer to CubeEgress (80/443).
pub const FLOW_L7: u8 = 2;

/// The class of a new flow from `ifindex` (at `version`) to `daddr`:`dport` (NBO; `tcp` for
/// TCP): a static L7 entry steering this TCP port is L7 (N10); a static allow is plain SNAT;
/// else a learned address decides (plain or L7); else not denied = SNAT.
#[inline(always)]
pub fn flow_class(ifindex: u32, version: u32, daddr: u32, dport: u16, tcp: bool) -> u8 {
    let scheme = if tcp { cubevs_common::l7::scheme_of(dport) } else { 0 };
    let r = verdict(ifindex, daddr, scheme);
    if r == v::NONE || r == v::NODE {
        return FLOW_DENY;
    }
    if r == v::L7 {
        return FLOW_L7;
    }
    if r == v::ALLOW {
        return FLOW_SNAT;
    }
    let learned = dns::learned_class(ifindex, version, daddr, dport);
    if learned != 0 {
        count(counter::DNS_LEARNED_FLOW);
        return if learned == 2 { FLOW_L7 } else { FLOW_SNAT };
    }
    if r == v::OPEN { FLOW_SNAT } else { FLOW_DENY }
}
