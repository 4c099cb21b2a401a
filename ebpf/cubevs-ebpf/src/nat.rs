//! SNAT port allocation and session creation (`reference/upstream.md §3.5`).
//!
//! The SNAT slot is `jhash_1word(sandbox ip, HASH_SEED) % 4`; a port is taken from the slot's
//! cursor and reserved by inserting the reverse (world-side) key with `BPF_NOEXIST`,
//! at most `MAX_TRIES` times. The egress session is then inserted with `BPF_NOEXIST`; if that
//! fails the reserved reverse key is released.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns};
use cubevs_common::{IngressValue, NatSession, SessionKey, SnatIp, conntrack::CLASS_SNAT, limits, snat};

use crate::maps::{EGRESS_SESSIONS, INGRESS_SESSIONS, SNAT_IPLIST};

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

/// Creates a session for the egress `key` (guest side, `src_ip` = sandbox IP) from
/// `vm_ifindex`. `state` is the initial conntrack state. Returns the session, or `None` when
/// no SNAT IP is configured or no port could be reserved.
#[inline(always)]
pub fn create_session(key: &SessionKey, vm_ifindex: u32, state: u8) -> Option<NatSession> {
    let slot = snat_slot(key.src_ip)?;
    // SAFETY: valid map value pointer.
    let (snat_ip, snat_ifindex) = unsafe { ((*slot).ip, (*slot).ifindex) };
    let rev_value = IngressValue { version: key.version, vm_ip: key.src_ip, vm_port: key.sport, _pad: [0; 3] };
    let mut i = 0;
    while i < snat::MAX_TRIES {
        i += 1;
        // The bpfel target has no atomic read-modify-write in Rust's core; a racing CPU may
        // read the same cursor, and the BPF_NOEXIST insert below then makes one of them retry.
        // SAFETY: valid map value pointer.
        let c = unsafe {
            let c = (*slot).port_cursor;
            (*slot).port_cursor = c.wrapping_add(1);
            c
        };
        let port = ((snat::PORT_MIN as u64 + c % snat::PORT_SPAN as u64) as u16).to_be();
        let rev = key.reverse(snat_ip, port);
        if INGRESS_SESSIONS.insert(&rev, &rev_value, BPF_NOEXIST as u64).is_err() {
            continue;
        }
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
            _reserved: [0; 31],
        };
        if EGRESS_SESSIONS.insert(key, &session, BPF_NOEXIST as u64).is_err() {
            let _ = INGRESS_SESSIONS.remove(&rev);
            return None;
        }
        return Some(session);
    }
    None
}

/// Deletes both directions of the session `key` → `s`.
#[inline(always)]
pub fn delete_session(key: &SessionKey, s: &NatSession) {
    let _ = INGRESS_SESSIONS.remove(&key.reverse(s.node_ip, s.node_port));
    let _ = EGRESS_SESSIONS.remove(key);
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
