//! Egress policy: `ALLOW_OUT` beats `DENY_OUT` beats default allow, decided once per new flow
//! (`reference/upstream.md §3.5`). An expired longest `ALLOW_OUT` match does not fall back to
//! a shorter entry.

use aya_ebpf::{helpers::bpf_ktime_get_ns, maps::lpm_trie::Key};
use cubevs_common::{POLICY_PREFIX_BITS, PolicyLpmData};

use crate::maps::{ALLOW_OUT, DENY_OUT, POLICY_GEN};

/// True when the sandbox on `ifindex` may open a flow to `daddr` (NBO).
#[inline(always)]
pub fn allowed(ifindex: u32, daddr: u32) -> bool {
    // SAFETY: plain map lookup of a u32 value.
    let generation = unsafe { POLICY_GEN.get(&ifindex) }.copied().unwrap_or(0);
    let key = Key::new(POLICY_PREFIX_BITS + 32, PolicyLpmData { ifindex, generation, ip: daddr });
    if let Some(v) = ALLOW_OUT.get(&key) {
        // SAFETY: helper without arguments.
        if v.expires_ns == 0 || v.expires_ns > unsafe { bpf_ktime_get_ns() } {
            return true;
        }
    }
    DENY_OUT.get(&key).is_none()
}
