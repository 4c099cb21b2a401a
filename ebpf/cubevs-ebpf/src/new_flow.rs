//! Per-sandbox bucket of new connections steered to CubeEgress (`cubevs_common::new_flow`,
//! decision R91): `from_cube` takes one token for each SYN that would make the node's TCP
//! stack complete a handshake for the gateway (a new L7 flow, or a finished L7 session's port
//! reused) and drops the SYN when the sandbox version's bucket is empty. The bucket state in
//! `new_flow_rate` is written here only.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns};
use cubevs_common::{NewFlowBucket, QuotaKey, new_flow};

use crate::maps::{NEW_FLOW_CONFIG, NEW_FLOW_RATE};

/// Takes one new connection from the bucket of the sandbox version (`ifindex`, `version`) at
/// the rate and depth of `new_flow_config` (rate 0 or no entry: no bound, always `true`). `false`: the bucket
/// is empty, the caller drops the SYN. A missing entry is a full bucket (created here); when
/// it cannot be created the SYN is admitted (the LRU map evicts, so this does not happen).
/// The update is a plain store: CPUs racing on one sandbox's last token may each take it.
#[inline(always)]
pub fn take(ifindex: u32, version: u32) -> bool {
    let Some(cfg) = NEW_FLOW_CONFIG.get(0).copied() else { return true };
    let rate = cfg.rate;
    if rate == 0 {
        return true;
    }
    let burst = if cfg.burst == 0 { 1 } else { cfg.burst };
    let key = QuotaKey { ifindex, version };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    match NEW_FLOW_RATE.get_ptr_mut(&key) {
        Some(p) => {
            // SAFETY: valid map value pointer, 8-byte aligned.
            let tat = unsafe { (*p).tat_ns };
            match new_flow::admit(Some(tat), now, rate, burst) {
                Some(next) => {
                    // SAFETY: as above.
                    unsafe { (*p).tat_ns = next };
                    true
                }
                None => false,
            }
        }
        None => {
            let Some(next) = new_flow::admit(None, now, rate, burst) else { return false };
            let _ = NEW_FLOW_RATE.insert(&key, &NewFlowBucket { tat_ns: next }, BPF_NOEXIST as u64);
            true
        }
    }
}
