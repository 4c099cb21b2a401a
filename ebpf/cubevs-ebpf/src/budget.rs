//! Per-sandbox insert budgets of the shared non-evicting maps (`cubevs_common::budget`,
//! decisions R11, R12): a sandbox may insert `cap` entries of a kind per window. The window
//! state in `insert_budget` is written here only.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns};
use cubevs_common::{BudgetKey, BudgetValue};

use crate::maps::INSERT_BUDGET;

/// Takes one insert of `kind` for the sandbox on `ifindex` from its window of `window_ns`
/// (CLOCK_MONOTONIC ns) holding `cap` inserts. `false`: the window's budget is used up (or the
/// window entry cannot be made), the caller must not insert.
#[inline(always)]
pub fn take(ifindex: u32, kind: u32, cap: u32, window_ns: u64) -> bool {
    let key = BudgetKey { ifindex, kind };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let p = match INSERT_BUDGET.get_ptr_mut(&key) {
        Some(p) => p,
        None => {
            let _ = INSERT_BUDGET.insert(&key, &BudgetValue { start_ns: now, used: 0 }, BPF_NOEXIST as u64);
            match INSERT_BUDGET.get_ptr_mut(&key) {
                Some(p) => p,
                None => return false,
            }
        }
    };
    // SAFETY: valid map value pointer, 8-byte aligned fields. The restart of a finished window
    // is a plain store: two CPUs restarting together lose at most each other's one insert.
    unsafe {
        if now.wrapping_sub((*p).start_ns) >= window_ns {
            (*p).start_ns = now;
            (*p).used = 0;
        }
        if (*p).used >= cap as u64 {
            return false;
        }
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*p).used, 1);
    }
    true
}
