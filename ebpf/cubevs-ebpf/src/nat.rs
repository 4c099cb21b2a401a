//! SNAT port allocation and session creation (`reference/upstream.md §3.5`).
//!
//! The SNAT slot is `jhash_1word(sandbox ip, HASH_SEED) % 4`. Every attempt draws a port with
//! `bpf_get_prandom_u32` (an off-path host cannot guess live ports, and a guest resolver's
//! source-port randomisation survives SNAT), at most `MAX_TRIES` attempts (independent draws:
//! no clustering, unlike probing the following ports). A port is reserved by inserting the reverse (world-side) key with
//! `BPF_NOEXIST`. The egress session is then inserted with `BPF_NOEXIST`; if another CPU won
//! that race, the reserved reverse key is released and the winner's session is used.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
};
use cubevs_common::{
    IngressValue, NatSession, SessionKey, SnatIp, conntrack::CLASS_SNAT, counter, limits, quota::COUNTED, snat,
};

use crate::{
    maps::{EGRESS_SESSIONS, INGRESS_SESSIONS, SNAT_IPLIST, count},
    quota,
};

/// Bob Jenkins' `jhash_1word` as the kernel defines it.
#[inline(always)]
fn jhash_1word(a: u32, initval: u32) -> u32 {
    let init = 0xdead_beefu32.wrapping_add(4).wrapping_add(initval);
    let (mut a, mut b, mut c) = (init.wrapping_add(a), init, init);
    // __jhash_final
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(14));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(11));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(25));
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(16));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(4));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(14));
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(24));
    c
}

/// The SNAT address for a sandbox, `None` when no SNAT IP is configured.
#[inline(always)]
fn snat_slot(sandbox_ip: u32) -> Option<*mut SnatIp> {
    let slot = jhash_1word(sandbox_ip, snat::HASH_SEED) % limits::SNAT_IPS;
    let p = SNAT_IPLIST.get_ptr_mut(slot)?;
    // SAFETY: valid map value pointer.
    if unsafe { (*p).ip } == 0 {
        return None;
    }
    Some(p)
}

/// TCP sequence tracking of the segment that opens a session: `(td_end, td_maxwin)` of the
/// guest side (0, 0 for UDP/ICMP).
#[derive(Clone, Copy)]
pub struct FirstSeg {
    /// 1 for TCP (the fields below are valid), 0 otherwise. A flag rather than an `Option`:
    /// the `None` of an `Option` left an undefined register that LLVM spilled, which the
    /// verifier rejects (`R2 !read_ok`).
    pub seen: u8,
    /// `seq + len` of the first segment, host order.
    pub end: u32,
    /// Its raw window.
    pub win: u32,
}

/// Creates a session for the egress `key` (guest side, `src_ip` = sandbox IP) from
/// `vm_ifindex`. `state` is the initial conntrack state, `first` the TCP tracking of the
/// opening segment, `counted` [`COUNTED`] when the sandbox has a session budget: the session
/// is then charged to (`vm_ifindex`, `key.version`) once inserted. Returns the session
/// (another CPU's, uncharged by us, when it inserted the same key first), or `None` when no
/// SNAT IP is configured or no port could be reserved.
#[inline(always)]
pub fn create_session(
    key: &SessionKey,
    vm_ifindex: u32,
    state: u8,
    first: FirstSeg,
    counted: u8,
) -> Option<NatSession> {
    let slot = snat_slot(key.src_ip)?;
    // SAFETY: valid map value pointer.
    let (snat_ip, snat_ifindex) = unsafe { ((*slot).ip, (*slot).ifindex) };
    let rev_value = IngressValue { version: key.version, vm_ip: key.src_ip, vm_port: key.sport, _pad: [0; 3] };
    let mut i = 0;
    while i < snat::MAX_TRIES {
        // The bpfel target has no atomic read-modify-write in Rust's core; the counter is
        // statistics only, a lost increment costs nothing.
        // SAFETY: valid map value pointer.
        unsafe { (*slot).port_cursor = (*slot).port_cursor.wrapping_add(1) };
        // SAFETY: helper without arguments.
        let port = ((snat::PORT_MIN as u32 + unsafe { bpf_get_prandom_u32() } % snat::PORT_SPAN) as u16).to_be();
        i += 1;
        let rev = key.reverse(snat_ip, port);
        if INGRESS_SESSIONS.insert(&rev, &rev_value, BPF_NOEXIST as u64).is_err() {
            continue;
        }
        // `first.seen` 0: not TCP (no tracking yet).
        let (seen, end, win) = (first.seen, first.end, first.win);
        let session = NatSession {
            // SAFETY: helper without arguments.
            access_ns: unsafe { bpf_ktime_get_ns() },
            node_ifindex: snat_ifindex,
            node_ip: snat_ip,
            vm_ifindex,
            vm_ip: key.src_ip,
            node_port: port,
            vm_port: key.sport,
            state,
            active_close: 0,
            packet_class: CLASS_SNAT,
            l7_scheme: 0,
            close_dir: 0,
            td_seen: seen,
            _pad0: [0; 2],
            td_end: [end, 0],
            td_maxwin: [win, 0],
            quota: counted,
            node_quota: counted,
            _reserved: [0; 10],
        };
        if EGRESS_SESSIONS.insert(key, &session, BPF_NOEXIST as u64).is_err() {
            // Another CPU created the session of this 5-tuple between our lookup and insert:
            // give our port back and follow the winner's session.
            let _ = INGRESS_SESSIONS.remove(&rev);
            count(counter::CUBE_INSERT_RACE);
            // SAFETY: plain map lookup; the value is copied out.
            return unsafe { EGRESS_SESSIONS.get(key) }.copied();
        }
        if counted == COUNTED {
            quota::charge(vm_ifindex, key.version);
        }
        return Some(session);
    }
    None
}

/// Creates an L7 session for the egress TCP `key`: no SNAT. The flow keeps its addresses
/// (source = sandbox IP) and is steered to cube-dev (`cube_dev_ifindex`), so the "SNAT"
/// address and port are the sandbox's own and the reverse key reserved is the identity
/// {remote, sandbox ip, remote port, guest port} (what upstream reserves, §3.9); the reaper
/// deletes both like any session. `scheme` is `cubevs_common::l7::SCHEME_*`; `counted` as for
/// [`create_session`].
#[inline(always)]
pub fn create_l7_session(
    key: &SessionKey,
    vm_ifindex: u32,
    cube_dev_ifindex: u32,
    scheme: u8,
    first: FirstSeg,
    counted: u8,
) -> Option<NatSession> {
    let rev = key.reverse(key.src_ip, key.sport);
    let rev_value = IngressValue { version: key.version, vm_ip: key.src_ip, vm_port: key.sport, _pad: [0; 3] };
    if INGRESS_SESSIONS.insert(&rev, &rev_value, BPF_NOEXIST as u64).is_err() {
        return None;
    }
    let session = NatSession {
        // SAFETY: helper without arguments.
        access_ns: unsafe { bpf_ktime_get_ns() },
        node_ifindex: cube_dev_ifindex,
        node_ip: key.src_ip,
        vm_ifindex,
        vm_ip: key.src_ip,
        node_port: key.sport,
        vm_port: key.sport,
        state: cubevs_common::conntrack::tcp::SYN_SENT,
        active_close: 0,
        packet_class: cubevs_common::conntrack::CLASS_L7,
        l7_scheme: scheme,
        close_dir: 0,
        td_seen: first.seen,
        _pad0: [0; 2],
        td_end: [first.end, 0],
        td_maxwin: [first.win, 0],
        quota: counted,
        node_quota: counted,
        _reserved: [0; 10],
    };
    if EGRESS_SESSIONS.insert(key, &session, BPF_NOEXIST as u64).is_err() {
        let _ = INGRESS_SESSIONS.remove(&rev);
        return None;
    }
    if counted == COUNTED {
        quota::charge(vm_ifindex, key.version);
    }
    Some(session)
}

/// Deletes both directions of the session `key` → `s`; when this delete removed a charged
/// session (a concurrent userspace delete may have won), gives its budget charge back.
#[inline(always)]
pub fn delete_session(key: &SessionKey, s: &NatSession) {
    let _ = INGRESS_SESSIONS.remove(&key.reverse(s.node_ip, s.node_port));
    if EGRESS_SESSIONS.remove(key).is_ok() && s.quota == COUNTED {
        quota::refund(s.vm_ifindex, key.version, s.node_quota == COUNTED);
    }
}

/// Refreshes `access_ns` when it is more than 1 s old (keeps the cache line quiet).
#[inline(always)]
pub fn touch(s: *mut NatSession) {
    // SAFETY: helper without arguments; `s` is a valid map value pointer.
    unsafe {
        let now = bpf_ktime_get_ns();
        if now.wrapping_sub((*s).access_ns) > 1_000_000_000 {
            (*s).access_ns = now;
        }
    }
}
