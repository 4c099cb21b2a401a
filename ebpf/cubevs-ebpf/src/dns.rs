//! DNS learning hooks (`reference/upstream.md §3.8`; parser in `cubevs_common::dns`).
//!
//! - [`on_query`] (from `from_cube`, UDP to port 53 that policy lets through): a standard
//!   IN A query whose name matches one of the sandbox's FQDN patterns (active policy
//!   generation) is tracked in `dns_query_track` under {ifindex, server, guest port, id,
//!   version} with the pattern's ports, for [`QUERY_TIMEOUT_NS`], within the sandbox's
//!   insert budget (`crate::budget`; `dns_query_track_v2` never evicts, decision R11) and the
//!   tracking floor (`crate::track_floor`, decision Q6: a new entry is charged to the sandbox
//!   version and the node, and the charge is given back when this side consumes it).
//! - [`on_response`] (from `from_world`, UDP from port 53 that matched a live session, after
//!   the reverse-NAT lookups): the tracked query with this server, guest port and id must
//!   exist, be unexpired and have the same question; then every IN A answer becomes
//!   `dns_learned` entries {ifindex, ip, port} (port 0 = any) expiring after
//!   clamp(TTL, floor, cap), except addresses in the always-denied ranges (counted
//!   `dns_not_public`, decision R15). The track entry is consumed. A new learned entry
//!   takes one of the sandbox version's `DNS_LEARNED_PER_SANDBOX` per day (decision R60;
//!   over it, counted `dns_learn_full`) and is charged to the learned floor (decision R66:
//!   above its floor, only while the node's charged learned entries are below the ceiling);
//!   renewing its own entry is free.
//!
//! Neither hook ever changes the packet's verdict: DNS itself is decided by the CIDR policy
//! before the query hook runs and the response follows its session. No tail calls: the
//! parser's loops run under `bpf_loop`, so the verifier checks each body once.

use core::intrinsics::{AtomicOrdering, atomic_cxchg};

use aya_ebpf::{
    bindings::{BPF_EXIST, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    cty::c_void,
    helpers::{
        bpf_ktime_get_ns,
        generated::{bpf_loop, bpf_skb_load_bytes},
    },
    macros::classifier,
    programs::TcContext,
};
use cubevs_common::{
    SessionKey,
    budget::{DNS_WINDOW_NS, KIND_DNS_QUERY, query_kind},
    counter,
    dns::{
        self, CB_MAGIC, DnsAllowKey, DnsAllowValue, DnsQueryKey, DnsQueryValue, LearnedKey, LearnedValue, Loop,
        MSG_WINDOW, QUERY_TIMEOUT_NS, Reject, Scratch, flags, slot,
    },
    learned_floor, limits, track,
};

use crate::{
    budget, learned_floor as learned_floor_counts,
    maps::{
        DNS_ALLOW, DNS_ALLOW_NAMES, DNS_LEARNED, DNS_PROGS, DNS_QUERY_TRACK, DNS_SCRATCH, EGRESS_SESSIONS,
        IFINDEX_TO_MVMMETA, INGRESS_SESSIONS, count,
    },
    packet::{self, Ipv4},
    policy, track_floor,
};

/// From a main program: tail-calls the DNS program in `target` unless this packet already
/// went through it (`skb->cb[0]` = [`CB_MAGIC`]). Returns only when the main program should
/// go on: the packet was already handled, or the tail call failed (counted; the packet goes
/// on unlearned, never dropped for it).
#[inline(always)]
pub fn enter(ctx: &TcContext, target: u32) {
    // SAFETY: `skb` is the context pointer the kernel passed in; cb is writable by TC programs.
    unsafe {
        if (*ctx.skb.skb).cb[0] == CB_MAGIC {
            return;
        }
        (*ctx.skb.skb).cb[0] = CB_MAGIC;
        DNS_PROGS.tail_call(ctx, target);
    }
    count(counter::DNS_TAIL_CALL_FAILED);
}

/// From a DNS program: tail-calls the main program in `target` back; on failure (counted)
/// returns `fallback`.
#[inline(always)]
fn back(ctx: &TcContext, target: u32, fallback: i32) -> i32 {
    // SAFETY: plain tail call; returns only on failure.
    unsafe { DNS_PROGS.tail_call(ctx, target) };
    count(counter::DNS_TAIL_BACK_FAILED);
    fallback
}

/// `dns_query`: tail-called by `from_cube` for UDP to port 53. Tracks the query when the
/// flow is allowed (the verdict `from_cube` reaches for a new flow) and the name matches,
/// then returns to `from_cube`, which forwards or denies it as for any UDP packet.
#[classifier]
pub fn dns_query(ctx: TcContext) -> i32 {
    query_side(&ctx);
    // A failed return could only leave the query unforwarded: the guest retries.
    back(&ctx, slot::FROM_CUBE, TC_ACT_SHOT)
}

#[inline(always)]
fn query_side(ctx: &TcContext) {
    // SAFETY: `skb` is the context pointer the kernel passed in.
    let ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    // SAFETY: plain map lookup; one field copied out.
    let Some(version) = (unsafe { IFINDEX_TO_MVMMETA.get(&ifindex) }).map(|m| m.version) else { return };
    let Some(ip) = packet::ipv4(ctx) else { return };
    let Some(l4) = packet::l4(ctx, &ip) else { return };
    if !policy::allowed_flow(ifindex, version, ip.dst, l4.dport, false) {
        return;
    }
    on_query(ctx, &ip, ifindex, version, l4.sport);
}

/// `dns_response`: tail-called by `from_world` for UDP from port 53. Learns from it when it
/// belongs to a live session of a registered sandbox, then returns to `from_world`, which
/// reverse-NATs it as for any UDP packet.
#[classifier]
pub fn dns_response(ctx: TcContext) -> i32 {
    response_side(&ctx);
    // A failed return passes the response to the host stack (what from_world does with
    // packets that are not its own): the guest's resolver times out and retries.
    back(&ctx, slot::FROM_WORLD, TC_ACT_OK)
}

#[inline(always)]
fn response_side(ctx: &TcContext) {
    let Some(ip) = packet::ipv4(ctx) else { return };
    let Some(l4) = packet::l4(ctx, &ip) else { return };
    let rkey = SessionKey {
        src_ip: ip.src,
        dst_ip: ip.dst,
        sport: l4.sport,
        dport: l4.dport,
        version: 0,
        proto: ip.proto,
        _pad: [0; 3],
    };
    // SAFETY: plain map lookups; values copied out.
    let Some(rv) = (unsafe { INGRESS_SESSIONS.get(&rkey) }).copied() else { return };
    let ekey = SessionKey {
        src_ip: rv.vm_ip,
        dst_ip: ip.src,
        sport: rv.vm_port,
        dport: l4.sport,
        version: rv.version,
        proto: ip.proto,
        _pad: [0; 3],
    };
    // SAFETY: as above.
    let Some(vm_ifindex) = (unsafe { EGRESS_SESSIONS.get(&ekey) }).map(|s| s.vm_ifindex) else { return };
    // The session must belong to the sandbox registered on its interface now.
    // SAFETY: as above.
    if unsafe { IFINDEX_TO_MVMMETA.get(&vm_ifindex) }.map(|m| (m.version, m.ip)) != Some((rv.version, rv.vm_ip)) {
        return;
    }
    on_response(ctx, &ip, vm_ifindex, rv.vm_port, rv.version);
}

/// The parser's loops as `bpf_loop` calls: the verifier checks each body once.
struct BpfLoop;

/// `bpf_loop` callback: runs the closure behind `ctx`; 0 continues, 1 stops.
unsafe extern "C" fn trampoline<F: FnMut(u32) -> bool>(index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `&mut F` `BpfLoop::run` passed, alive for the whole bpf_loop call.
    let body = unsafe { &mut *(ctx as *mut F) };
    if body(index as u32) { 0 } else { 1 }
}

impl Loop for BpfLoop {
    #[inline(always)]
    fn run<F: FnMut(u32) -> bool>(n: u32, mut body: F) {
        // SAFETY: the callback matches bpf_loop's `long (*)(u64, void *)`; the context is a
        // stack pointer valid for the call. A failed call (E2BIG, never for n ≤ 1<<23) runs
        // nothing: the parser then reports the name or message as malformed.
        unsafe {
            bpf_loop(n, trampoline::<F> as *mut c_void, &mut body as *mut F as *mut c_void, 0);
        }
    }
}

/// Copies the UDP payload of `ip` (up to [`MSG_WINDOW`] bytes) into the per-CPU scratch.
/// Returns the scratch and the copied length.
#[inline(always)]
fn load(ctx: &TcContext, ip: &Ipv4) -> Option<(*mut Scratch, usize)> {
    let s = DNS_SCRATCH.get_ptr_mut(0)?;
    let off = ip.l4_off + 8;
    let udp_payload = (ip.tot_len as usize).checked_sub(ip.ihl + 8)?;
    let in_skb = (ctx.len() as usize).checked_sub(off)?;
    let mut n = if udp_payload < in_skb { udp_payload } else { in_skb };
    if n > MSG_WINDOW {
        n = MSG_WINDOW;
    }
    if n == 0 {
        return None;
    }
    // SAFETY: `s` is a valid per-CPU map value of MSG_WINDOW + … bytes and 0 < n ≤ MSG_WINDOW.
    let r = unsafe { bpf_skb_load_bytes(ctx.skb.skb as *const _, off as u32, (*s).msg.as_mut_ptr().cast(), n as u32) };
    if r != 0 {
        return None;
    }
    Some((s, n))
}

/// Tracks a guest DNS query when its name is allowed (see the module docs). `server` is the
/// destination address (NBO), `guest_port` the guest's source port (NBO).
// A call of its own: its frame is not added to the caller's (the LLVM stack limit is per
// function) and the verifier checks it once per call site.
#[inline(never)]
pub fn on_query(ctx: &TcContext, ip: &Ipv4, ifindex: u32, version: u32, guest_port: u16) {
    let Some(generation) = policy::generation(ifindex) else {
        count(counter::DNS_QUERY_NO_POLICY);
        return;
    };
    let Some((s, len)) = load(ctx, ip) else {
        count(counter::DNS_QUERY_UNPARSED);
        return;
    };
    // SAFETY: valid per-CPU map value; nothing else on this CPU touches it meanwhile.
    let s = unsafe { &mut *s };
    let mut found: Option<DnsAllowValue> = None;
    // The matched pattern's key hash and flag, and the suffix's offset in the name.
    let mut matched = (0u64, 0u8, 0usize);
    let q = dns::parse_query::<BpfLoop>(s, len, |hash, subdomains, at| {
        let key = DnsAllowKey { ifindex, generation, name_hash: hash, subdomains: subdomains as u8, _pad: [0; 7] };
        // SAFETY: plain map lookup; the value is copied out.
        if let Some(v) = unsafe { DNS_ALLOW.get(&key) } {
            // Longer suffixes come later: the most specific pattern wins.
            found = Some(*v);
            matched = (hash, subdomains as u8, at);
        }
    });
    let q = match q {
        Ok(q) => q,
        Err(Reject::NotStandard | Reject::Malformed) => {
            count(counter::DNS_QUERY_UNPARSED);
            return;
        }
    };
    let Some(allow) = found else {
        count(counter::DNS_QUERY_NOT_ALLOWED);
        return;
    };
    // A 64-bit FNV hash is no proof of the name: a crafted name can hash like an allowed one.
    // The suffix must be the pattern's name byte for byte (decision R48). An entry without a
    // name matches nothing in a sealed generation (every name written or backfilled, R52),
    // and by its hash alone in an unsealed one (written by a loader before R52).
    let nkey = DnsAllowKey { ifindex, generation, name_hash: matched.0, subdomains: matched.1, _pad: [0; 7] };
    match DNS_ALLOW_NAMES.get_ptr(&nkey) {
        Some(name) => {
            // SAFETY: valid map value pointer, read for the comparison only.
            if !dns::suffix_is::<BpfLoop>(s, q.wire, matched.2, unsafe { &*name }) {
                count(counter::DNS_QUERY_NOT_ALLOWED);
                return;
            }
        }
        None => {
            if DNS_ALLOW_NAMES.get_ptr(&DnsAllowKey::seal(ifindex, generation)).is_some() {
                count(counter::DNS_QUERY_NOT_ALLOWED);
                return;
            }
        }
    }
    let key = DnsQueryKey { ifindex, server_ip: ip.dst, guest_port, id: q.id, version };
    let mut v = DnsQueryValue {
        // SAFETY: helper without arguments.
        expires_ns: unsafe { bpf_ktime_get_ns() } + QUERY_TIMEOUT_NS,
        name_hash: q.name_hash,
        allow,
        _pad: track::DNS_CHARGED,
    };
    // A sandbox version's inserts are budgeted (R11, per version since R64) and the map never evicts: another
    // sandbox's flood cannot remove this entry, and this sandbox's flood only stops its own.
    // Above its floor a sandbox tracks only while the node holds fewer than the ceiling (Q6).
    if !budget::take(ifindex, query_kind(version), limits::DNS_QUERIES_PER_SANDBOX, DNS_WINDOW_NS)
        || !track_floor::admit(ifindex, version, KIND_DNS_QUERY)
    {
        count(counter::DNS_QUERY_OVER_BUDGET);
        return;
    }
    // A new entry is charged; a retransmission (same key) rewrites its entry, keeping its
    // charge mark (an entry of an older object stays uncharged).
    let made = match DNS_QUERY_TRACK.insert(&key, &v, BPF_NOEXIST as u64) {
        Ok(()) => true,
        Err(_) => {
            // SAFETY: plain map lookup; one field copied out.
            match unsafe { DNS_QUERY_TRACK.get(&key) }.map(|old| old._pad) {
                Some(mark) => {
                    v._pad = mark;
                    if DNS_QUERY_TRACK.insert(&key, &v, BPF_EXIST as u64).is_err() {
                        count(counter::DNS_QUERY_OVER_BUDGET);
                        return;
                    }
                    false
                }
                None => {
                    count(counter::DNS_QUERY_OVER_BUDGET);
                    return;
                }
            }
        }
    };
    if made {
        track_floor::charge(ifindex, version, KIND_DNS_QUERY);
    }
    count(counter::DNS_QUERY_TRACKED);
}

/// Learns the answers of a response to a tracked query (see the module docs). `server` is
/// the response's source address (NBO); `vm_ifindex`, `guest_port` (NBO) and `version` come
/// from the session the response matched.
#[inline(never)]
pub fn on_response(ctx: &TcContext, ip: &Ipv4, vm_ifindex: u32, guest_port: u16, version: u32) {
    let Some((s, len)) = load(ctx, ip) else {
        count(counter::DNS_RESP_UNPARSED);
        return;
    };
    // SAFETY: valid per-CPU map value; nothing else on this CPU touches it meanwhile.
    let s = unsafe { &mut *s };
    let Ok(h) = dns::header(s, len) else {
        count(counter::DNS_RESP_UNPARSED);
        return;
    };
    let key = DnsQueryKey { ifindex: vm_ifindex, server_ip: ip.src, guest_port, id: h.id, version };
    // SAFETY: plain map lookup; the value is copied out.
    let Some(tracked) = (unsafe { DNS_QUERY_TRACK.get(&key) }).copied() else {
        count(counter::DNS_RESP_UNSOLICITED);
        return;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if tracked.expires_ns <= now {
        let _ = forget(&key, &tracked);
        count(counter::DNS_RESP_UNSOLICITED);
        return;
    }
    let (h, qhash, pos) = match dns::response_question::<BpfLoop>(s, len) {
        Ok(r) => r,
        Err(_) => {
            count(counter::DNS_RESP_MISMATCH);
            return;
        }
    };
    if qhash != tracked.name_hash {
        // Same id, another question: not the answer to our query. The query stays tracked.
        count(counter::DNS_RESP_MISMATCH);
        return;
    }
    // One response per query: only the response whose delete removed the query is learned
    // (a duplicate answer on another CPU, or a reaper delete in between, finds it gone; R21).
    if !forget(&key, &tracked) {
        count(counter::DNS_RESP_UNSOLICITED);
        return;
    }
    if h.flags & flags::RCODE != 0 {
        count(counter::DNS_RESP_RCODE);
        return;
    }
    if h.flags & flags::TC != 0 {
        count(counter::DNS_RESP_TRUNCATED);
    }
    let allow = tracked.allow;
    let w = dns::walk_answers::<BpfLoop>(s, len, pos, h.ancount, |addr, ttl| {
        // A name the sandbox controls must not open what the baseline denies (R15), nor the
        // node's extra always-denied list (R30).
        if dns::always_denied(addr) || policy::node_denied(addr) {
            count(counter::DNS_RESP_NOT_PUBLIC);
            return;
        }
        let value = LearnedValue {
            expires_ns: now + dns::learned_lifetime_ns(ttl),
            version,
            flags: allow.flags as u32 | (allow.tag as u32) << dns::TAG_SHIFT | learned_floor::CHARGED,
        };
        let n = allow.port_count as usize;
        if n == 0 {
            learn(vm_ifindex, addr, 0, &value);
            return;
        }
        // Unrolled (8): a bpf_loop inside the walk's callback would nest callbacks.
        let mut i = 0;
        while i < dns::MAX_PORTS {
            if i >= n {
                break;
            }
            learn(vm_ifindex, addr, allow.ports[i], &value);
            i += 1;
        }
    });
    if w.not_walked != 0 {
        count(counter::DNS_NOT_WALKED);
    }
}

/// Deletes the tracked query `key` (value `v` as read) and, when this delete removed it and
/// it was charged, gives its charge back (decision Q6). `true` when this delete removed it.
#[inline(always)]
fn forget(key: &DnsQueryKey, v: &DnsQueryValue) -> bool {
    let removed = DNS_QUERY_TRACK.remove(key).is_ok();
    if removed && v._pad == track::DNS_CHARGED {
        track_floor::refund(key.ifindex, key.version, KIND_DNS_QUERY);
    }
    removed
}

/// Learns (`ifindex`, `ip`, `port`) → `v`: renews the sandbox version's own entry in place
/// (never shortening it; its charge mark and owner stay), or makes a new one, or takes over
/// one a previous version of the interface left, within the version's daily budget (decision
/// R60: the map is shared and never evicts, so one sandbox must not fill it for every other)
/// and the learned floor (decision R66: colluding sandboxes must not fill it either). A new
/// or taken-over entry is charged to the version (and to the node when it was not yet).
/// `v.flags` carries the charge mark ([`learned_floor::CHARGED`]); a renewal keeps the
/// entry's own mark instead.
// A call of its own: its frame is not added to the answer walk's callback eight times over
// (the verifier's combined stack limit is 512 bytes; few values live across its calls).
#[inline(never)]
fn learn(ifindex: u32, ip: u32, port: u16, v: &LearnedValue) {
    let key = LearnedKey { ifindex, ip, port, _pad: 0 };
    if let Some(p) = DNS_LEARNED.get_ptr_mut(&key) {
        // SAFETY: valid map value pointer; fields read and written in place. A concurrent
        // delete or replacement of the element makes these writes land in the old element
        // (kept alive by RCU), never in another entry.
        unsafe {
            if (*p).version == v.version {
                // A renewal never shortens an entry: keep the later expiry.
                if (*p).expires_ns <= v.expires_ns {
                    (*p).expires_ns = v.expires_ns;
                    (*p).flags = (v.flags & !learned_floor::MARK_MASK) | ((*p).flags & learned_floor::MARK_MASK);
                }
                count(counter::DNS_RESP_LEARNED);
                return;
            }
            // Left by the interface's previous sandbox: a new entry of this version.
            if !take_new(ifindex, v.version) {
                return;
            }
            // Read after the call (fewer values live across it); the owner is then claimed
            // by an atomic compare-and-swap, so exactly one CPU moves the entry and its charge.
            let version = (*p).version;
            let old_flags = (*p).flags;
            let (_, won) = atomic_cxchg::<u32, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                &raw mut (*p).version,
                version,
                v.version,
            );
            if version == v.version {
                // Another CPU took it over for this version meanwhile: learned all the same.
                count(counter::DNS_RESP_LEARNED);
                return;
            }
            if !won {
                count(counter::DNS_LEARN_FULL);
                return;
            }
            (*p).expires_ns = v.expires_ns;
            (*p).flags = v.flags;
            if learned_floor::is_charged(old_flags) {
                learned_floor_counts::moved(ifindex, version, v.version);
            } else {
                learned_floor_counts::charge(ifindex, v.version);
            }
        }
        count(counter::DNS_RESP_LEARNED);
        return;
    }
    if !take_new(ifindex, v.version) {
        return;
    }
    // `v` carries the charge mark already. NOEXIST: an entry another CPU (or the reaper's
    // put-back) made meanwhile is not replaced, so every charged entry is charged once.
    if DNS_LEARNED.insert(&key, v, BPF_NOEXIST as u64).is_ok() {
        learned_floor_counts::charge(ifindex, v.version);
        count(counter::DNS_RESP_LEARNED);
    } else {
        count(counter::DNS_LEARN_FULL);
    }
}

/// Takes one new learned entry for (`ifindex`, `version`): its daily budget (R60) and the
/// learned floor (R66). `false` (counted `dns_learn_full`): the entry must not be made.
// A call of its own: its map keys and values are not added to the answer walk's callback
// (the verifier's combined stack limit is 512 bytes).
#[inline(never)]
fn take_new(ifindex: u32, version: u32) -> bool {
    if !budget::take(
        ifindex,
        cubevs_common::budget::learned_kind(version),
        limits::DNS_LEARNED_PER_SANDBOX,
        cubevs_common::budget::DNS_LEARNED_WINDOW_NS,
    ) || !learned_floor_counts::admit(ifindex, version)
    {
        count(counter::DNS_LEARN_FULL);
        return false;
    }
    true
}

/// What a learned entry of `ifindex` (sandbox `version`) says about a new flow to `daddr`
/// (NBO) on `dport` (NBO; 0 for ICMP), from an unexpired entry for that port or for every
/// port: 0 nothing, 1 allowed, 2 allowed and L7 (steer to CubeEgress).
#[inline(always)]
pub fn learned_class(ifindex: u32, version: u32, daddr: u32, dport: u16) -> u8 {
    let class = |port: u16| -> u8 {
        let key = LearnedKey { ifindex, ip: daddr, port, _pad: 0 };
        // SAFETY: plain map lookup; fields copied out. The clock is read only on a hit: most
        // new flows have no learned entry (decision V7).
        match unsafe { DNS_LEARNED.get(&key) } {
            // SAFETY: helper without arguments.
            Some(v) if v.version == version && v.expires_ns > unsafe { bpf_ktime_get_ns() } => {
                if v.flags & dns::FLAG_L7 as u32 != 0 { 2 } else { 1 }
            }
            _ => 0,
        }
    };
    let c = if dport != 0 { class(dport) } else { 0 };
    if c != 0 { c } else { class(0) }
}
