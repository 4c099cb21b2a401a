//! Per-sandbox live-session budget (`cubevs_common::quota`, decisions Q1-Q3): `from_cube`
//! admits a new flow only while its sandbox version holds fewer than
//! `DatapathConfig::session_budget` live sessions (`session_opened - session_closed`), charges
//! each session it creates with an atomic add (on the value the admission read, V7), and gives the charge back with an atomic
//! subtract when it deletes a charged session itself. Userspace never writes `session_opened`.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::bindings::BPF_NOEXIST;
use cubevs_common::{QuotaKey, quota::COUNTED};

use crate::maps::{SESSION_CLOSED, SESSION_OPENED};

/// A new flow's admission under its sandbox version's budget: where the session's charge
/// goes. The `session_opened` value found by [`admit`] is charged through the same pointer
/// (decision V7: one lookup of that map per new flow, not two); null when the datapath runs
/// without a budget.
#[derive(Clone, Copy)]
pub struct Admitted(*mut u64);

impl Admitted {
    /// [`COUNTED`] when the session must be charged (the sandbox has a budget), else 0: the
    /// session's `quota` field.
    #[inline(always)]
    pub fn counted(&self) -> u8 {
        if self.0.is_null() { 0 } else { COUNTED }
    }

    /// Charges one session created by the datapath (nothing without a budget), with one
    /// atomic add on the `session_opened` value [`admit`] read.
    #[inline(always)]
    pub fn charge(&self) {
        if !self.0.is_null() {
            // SAFETY: a valid map value pointer from the lookup in `admit`, 8-byte aligned;
            // BPF atomic add.
            unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(self.0, 1) };
        }
    }
}

/// Whether the sandbox version (`ifindex`, `version`) may open one more session under
/// `budget` (0 = no quota: always, with a null [`Admitted`]): `Some` with where to charge
/// it, `None` when it holds its whole budget. Creates its zeroed `session_opened` entry on
/// first use; when that map is full the flow is refused (fail closed: the reaper collects
/// the entries of released versions).
#[inline(always)]
pub fn admit(ifindex: u32, version: u32, budget: u32) -> Option<Admitted> {
    if budget == 0 {
        return Some(Admitted(core::ptr::null_mut()));
    }
    let key = QuotaKey { ifindex, version };
    let p = match SESSION_OPENED.get_ptr_mut(&key) {
        Some(p) => p,
        None => {
            let _ = SESSION_OPENED.insert(&key, &0, BPF_NOEXIST as u64);
            SESSION_OPENED.get_ptr_mut(&key)?
        }
    };
    // SAFETY: valid map value pointer; read once.
    let opened = unsafe { core::ptr::read_volatile(p) };
    // SAFETY: plain map lookup; the value is copied out.
    let closed = unsafe { SESSION_CLOSED.get(&key) }.copied().unwrap_or(0);
    // Signed: a userspace delete may be counted in `closed` a moment before the creating CPU's
    // add lands in `opened`.
    if (opened.wrapping_sub(closed) as i64) < budget as i64 { Some(Admitted(p)) } else { None }
}

/// Gives back the charge of one session the datapath itself deleted: one atomic subtract on
/// the sandbox version's `opened` counter; nothing when it has no entry.
#[inline(always)]
pub fn refund(ifindex: u32, version: u32) {
    let key = QuotaKey { ifindex, version };
    if let Some(p) = SESSION_OPENED.get_ptr_mut(&key) {
        // SAFETY: valid map value pointer, 8-byte aligned; BPF atomic add of -1.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, u64::MAX) };
    }
}
