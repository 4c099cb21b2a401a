//! Per-sandbox live-session budget (`cubevs_common::quota`, decisions Q1-Q3): `from_cube`
//! admits a new flow only while its sandbox version holds fewer than
//! `DatapathConfig::session_budget` live sessions (`session_opened - session_closed`), charges
//! each session it creates with an atomic add, and gives the charge back with an atomic
//! subtract when it deletes a charged session itself. Userspace never writes `session_opened`.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::bindings::BPF_NOEXIST;
use cubevs_common::QuotaKey;

use crate::maps::{SESSION_CLOSED, SESSION_OPENED};

/// Whether the sandbox version (`ifindex`, `version`) may open one more session under
/// `budget` (0 = no quota: always). Creates its zeroed `session_opened` entry on first use;
/// when that map is full the flow is refused (fail closed: the reaper collects the entries of
/// released versions).
#[inline(always)]
pub fn admit(ifindex: u32, version: u32, budget: u32) -> bool {
    if budget == 0 {
        return true;
    }
    let key = QuotaKey { ifindex, version };
    // SAFETY: plain map lookups; values are copied out.
    let opened = match unsafe { SESSION_OPENED.get(&key) } {
        Some(v) => *v,
        None => {
            let _ = SESSION_OPENED.insert(&key, &0, BPF_NOEXIST as u64);
            // SAFETY: as above.
            match unsafe { SESSION_OPENED.get(&key) } {
                Some(v) => *v,
                None => return false,
            }
        }
    };
    // SAFETY: as above.
    let closed = unsafe { SESSION_CLOSED.get(&key) }.copied().unwrap_or(0);
    // Signed: a userspace delete may be counted in `closed` a moment before the creating CPU's
    // add lands in `opened`.
    (opened.wrapping_sub(closed) as i64) < budget as i64
}

/// Adds `delta` (two's complement for a subtraction) to the sandbox version's `opened`
/// counter with one atomic instruction; nothing when it has no entry.
#[inline(always)]
fn add(ifindex: u32, version: u32, delta: u64) {
    let key = QuotaKey { ifindex, version };
    if let Some(p) = SESSION_OPENED.get_ptr_mut(&key) {
        // SAFETY: valid map value pointer, 8-byte aligned; BPF atomic add.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, delta) };
    }
}

/// Charges one session created by the datapath to (`ifindex`, `version`).
#[inline(always)]
pub fn charge(ifindex: u32, version: u32) {
    add(ifindex, version, 1);
}

/// Gives back the charge of one session the datapath itself deleted.
#[inline(always)]
pub fn refund(ifindex: u32, version: u32) {
    add(ifindex, version, u64::MAX);
}
