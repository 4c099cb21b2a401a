//! Reserved floor for the shared tracking maps `dns_query_track_v2` and `frag_sessions_v2`
//! (decision Q6, the Q4 scheme applied to tracked entries): every registered sandbox version
//! may always hold its floor of entries of a kind; a version holding its floor or more makes
//! another only while the node-wide count of charged entries of that kind is below the
//! ceiling userspace writes in `session_floor` (`cubevs_common::floor::TRACK_LIMITS`).
//!
//! Counts are `opened - closed` as for sessions (Q2): `track_opened` and the node's
//! `*_OPENED` keys are written here only (atomic adds when an entry is made, subtracts when
//! the datapath deletes a charged entry itself), `track_closed` and `*_CLOSED` by userspace
//! only (its reaper and purges).

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::bindings::BPF_NOEXIST;
use cubevs_common::{QuotaKey, TrackCount, budget::KIND_DNS_QUERY, floor};

use crate::maps::{SESSION_FLOOR, TRACK_CLOSED, TRACK_OPENED};

/// Pointer to the `kind` field of a [`TrackCount`].
#[inline(always)]
fn field(p: *mut TrackCount, kind: u32) -> *mut u64 {
    // SAFETY: `p` is a valid map value pointer; only the field address is computed.
    unsafe { if kind == KIND_DNS_QUERY { &raw mut (*p).dns_queries } else { &raw mut (*p).frags } }
}

/// The node key `k`'s value pointer, its zeroed entry created when absent.
#[inline(always)]
fn node_ptr(k: u32) -> Option<*mut u64> {
    if let Some(p) = SESSION_FLOOR.get_ptr_mut(&k) {
        return Some(p);
    }
    let _ = SESSION_FLOOR.insert(&k, &0, BPF_NOEXIST as u64);
    SESSION_FLOOR.get_ptr_mut(&k)
}

/// `true` when (`ifindex`, `version`) may make one more entry of `kind`
/// (`cubevs_common::budget::KIND_*`): below its floor, or the node-wide count below the
/// ceiling. Without limits from userspace (an older library), or floor 0, always `true`
/// (no node-wide check). First creates the
/// sandbox version's `track_opened` entry and the node's opened key on first use; when either
/// cannot be made the entry is refused (fail closed, as for sessions).
#[inline(always)]
pub fn admit(ifindex: u32, version: u32, kind: u32) -> bool {
    let key = QuotaKey { ifindex, version };
    let opened = match TRACK_OPENED.get_ptr_mut(&key) {
        Some(p) => p,
        None => {
            let _ = TRACK_OPENED.insert(&key, &TrackCount::default(), BPF_NOEXIST as u64);
            match TRACK_OPENED.get_ptr_mut(&key) {
                Some(p) => p,
                None => return false,
            }
        }
    };
    let (node_opened_key, node_closed_key) = floor::track_keys(kind);
    // The node entry must exist before an entry is marked as charged to it.
    let Some(node_opened) = node_ptr(node_opened_key) else { return false };
    // SAFETY: plain map lookup; the value is copied out.
    let Some(limits) = (unsafe { SESSION_FLOOR.get(&floor::TRACK_LIMITS) }).copied() else { return true };
    let (floor_n, ceiling) = floor::track_unpack(limits, kind);
    if floor_n == 0 {
        return true;
    }
    // SAFETY: valid map value pointers, 8-byte aligned fields; plain reads.
    let mine = unsafe { *field(opened, kind) };
    // SAFETY: plain map lookup; the value is copied out.
    let closed = unsafe { TRACK_CLOSED.get(&key) }.copied().unwrap_or_default();
    let mine_closed = if kind == KIND_DNS_QUERY { closed.dns_queries } else { closed.frags };
    // Signed: a userspace delete may be counted a moment before the creating CPU's add lands.
    if (mine.wrapping_sub(mine_closed) as i64) < floor_n as i64 {
        return true;
    }
    // SAFETY: as above.
    let node = unsafe { *node_opened };
    // SAFETY: plain map lookup; the value is copied out.
    let node_closed = unsafe { SESSION_FLOOR.get(&node_closed_key) }.copied().unwrap_or(0);
    (node.wrapping_sub(node_closed) as i64) < ceiling as i64
}

/// Adds `delta` (two's complement for a subtraction) to the `kind` counts of (`ifindex`,
/// `version`) and of the node, one atomic instruction each; nothing where no entry exists.
#[inline(always)]
fn add(ifindex: u32, version: u32, kind: u32, delta: u64) {
    let key = QuotaKey { ifindex, version };
    if let Some(p) = TRACK_OPENED.get_ptr_mut(&key) {
        // SAFETY: valid map value pointer, 8-byte aligned field; BPF atomic add.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(field(p, kind), delta) };
    }
    if let Some(p) = SESSION_FLOOR.get_ptr_mut(&floor::track_keys(kind).0) {
        // SAFETY: as above.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, delta) };
    }
}

/// Charges one entry of `kind` the datapath made for (`ifindex`, `version`).
#[inline(always)]
pub fn charge(ifindex: u32, version: u32, kind: u32) {
    add(ifindex, version, kind, 1);
}

/// Gives back the charge of one charged entry of `kind` the datapath itself deleted.
#[inline(always)]
pub fn refund(ifindex: u32, version: u32, kind: u32) {
    add(ifindex, version, kind, u64::MAX);
}
