//! `new_flow_rate` (LRU hash, [`QuotaKey`] → [`NewFlowBucket`]): each sandbox version's bucket
//! of new connections steered to CubeEgress (`cubevs_common::new_flow`, decision R91). The
//! datapath alone writes it; this side reads it, for operators and tests (how many
//! connections a sandbox version may open back to back now).

use std::sync::Mutex;

use aya::maps::{HashMap, MapData};
use cubevs_common::{NewFlowBucket, QuotaKey, new_flow};

/// Read-only typed access to `new_flow_rate`, with the rate and burst the programs were
/// loaded with. `None` inside when the loaded object has no such map (objects before R91):
/// every bucket then reads as unbounded.
pub struct NewFlowTable {
    inner: Option<Mutex<HashMap<MapData, QuotaKey, NewFlowBucket>>>,
    rate: u32,
    burst: u32,
}

impl NewFlowTable {
    pub(crate) fn new(t: Option<HashMap<MapData, QuotaKey, NewFlowBucket>>, rate: u32, burst: u32) -> Self {
        Self { inner: t.map(Mutex::new), rate, burst: burst.max(1) }
    }

    /// The (rate per second, burst) the datapath enforces; rate 0: no bound.
    pub fn limits(&self) -> (u32, u32) {
        (self.rate, self.burst)
    }

    /// New connections to CubeEgress the sandbox `version` on `ifindex` may open back to back
    /// at `now_ns` (CLOCK_MONOTONIC): the burst when it has no bucket yet (a new version
    /// starts full), `u32::MAX` when there is no bound.
    pub fn available(&self, ifindex: u32, version: u32, now_ns: u64) -> u32 {
        let Some(m) = &self.inner else { return u32::MAX };
        if self.rate == 0 {
            return u32::MAX;
        }
        let tat = m.lock().unwrap_or_else(|e| e.into_inner()).get(&QuotaKey { ifindex, version }, 0).ok();
        new_flow::available(tat.map(|b| b.tat_ns), now_ns, self.rate, self.burst)
    }
}
