//! Reserved floor of `dns_learned` (decision R66, the scheme of Q4/Q6 applied to learned
//! entries): every registered sandbox version may always hold its floor of learned entries; a
//! version holding its floor or more makes another only while the node-wide count of charged
//! learned entries is below the ceiling userspace writes in `learned_floor`
//! (`cubevs_common::learned_floor::LIMITS`).
//!
//! Counts are `opened - closed` (Q2): `learned_opened` and the node's `OPENED` key are written
//! here only (atomic adds when a charged entry is made, a move between two versions' counts
//! when a previous version's charged entry is taken over), `learned_closed` and `CLOSED` by
//! userspace only (the DNS reaper and the policy purges).

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::bindings::BPF_NOEXIST;
use cubevs_common::{QuotaKey, floor, learned_floor};

use crate::maps::{LEARNED_CLOSED, LEARNED_FLOOR, LEARNED_OPENED};

/// The node's `OPENED` value pointer, its zeroed entry created when absent.
#[inline(always)]
fn node_opened() -> Option<*mut u64> {
    let k = learned_floor::OPENED;
    if let Some(p) = LEARNED_FLOOR.get_ptr_mut(&k) {
        return Some(p);
    }
    let _ = LEARNED_FLOOR.insert(&k, &0, BPF_NOEXIST as u64);
    LEARNED_FLOOR.get_ptr_mut(&k)
}

/// `true` when (`ifindex`, `version`) may make (or take over) one more learned entry: below
/// its floor, or the node-wide count below the ceiling. Without limits from userspace (an
/// older library), or floor 0, always `true` (no node-wide check). First creates the version's
/// `learned_opened` entry and the node's `OPENED` key on first use; when either cannot be made
/// the entry is refused (fail closed, as for sessions).
#[inline(always)]
pub fn admit(ifindex: u32, version: u32) -> bool {
    let key = QuotaKey { ifindex, version };
    let opened = match LEARNED_OPENED.get_ptr_mut(&key) {
        Some(p) => p,
        None => {
            let _ = LEARNED_OPENED.insert(&key, &0, BPF_NOEXIST as u64);
            match LEARNED_OPENED.get_ptr_mut(&key) {
                Some(p) => p,
                None => return false,
            }
        }
    };
    // The node entry must exist before an entry is marked as charged to it.
    let Some(node) = node_opened() else { return false };
    // SAFETY: plain map lookup; the value is copied out.
    let Some(limits) = (unsafe { LEARNED_FLOOR.get(&learned_floor::LIMITS) }).copied() else { return true };
    let (floor_n, ceiling) = floor::unpack(limits);
    if floor_n == 0 {
        return true;
    }
    // SAFETY: valid map value pointer, 8-byte aligned; plain read.
    let mine = unsafe { *opened };
    // SAFETY: plain map lookup; the value is copied out.
    let mine_closed = unsafe { LEARNED_CLOSED.get(&key) }.copied().unwrap_or(0);
    // Signed: a userspace delete may be counted a moment before the creating CPU's add lands.
    if (mine.wrapping_sub(mine_closed) as i64) < floor_n as i64 {
        return true;
    }
    // SAFETY: as above.
    let n = unsafe { *node };
    // SAFETY: plain map lookup; the value is copied out.
    let node_closed = unsafe { LEARNED_FLOOR.get(&learned_floor::CLOSED) }.copied().unwrap_or(0);
    (n.wrapping_sub(node_closed) as i64) < ceiling as i64
}

/// Adds `delta` (two's complement for a subtraction) to the count of (`ifindex`, `version`),
/// one atomic instruction; nothing where no entry exists.
#[inline(always)]
fn add_version(ifindex: u32, version: u32, delta: u64) {
    if let Some(p) = LEARNED_OPENED.get_ptr_mut(&QuotaKey { ifindex, version }) {
        // SAFETY: valid map value pointer, 8-byte aligned; BPF atomic add.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, delta) };
    }
}

/// Charges one learned entry the datapath made for (`ifindex`, `version`), to the version and
/// to the node.
#[inline(always)]
pub fn charge(ifindex: u32, version: u32) {
    add_version(ifindex, version, 1);
    if let Some(p) = LEARNED_FLOOR.get_ptr_mut(&learned_floor::OPENED) {
        // SAFETY: valid map value pointer, 8-byte aligned; BPF atomic add.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, 1) };
    }
}

/// Moves the charge of one charged entry of (`ifindex`, `from`) that the datapath took over to
/// (`ifindex`, `to`): the node still holds one charged entry, so its count is unchanged.
#[inline(always)]
pub fn moved(ifindex: u32, from: u32, to: u32) {
    add_version(ifindex, from, u64::MAX);
    add_version(ifindex, to, 1);
}
