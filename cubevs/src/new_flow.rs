//! `new_flow_rate` (LRU hash, [`QuotaKey`] → [`NewFlowBucket`]) and `new_flow_config` (array,
//! one [`NewFlowConfig`]): each sandbox version's bucket of new connections steered to
//! CubeEgress and the buckets' rate and burst (`cubevs_common::new_flow`, decision R91). The
//! datapath alone writes the buckets; this side writes the rate and burst at every load and
//! reads the buckets, for operators and tests (how many connections a sandbox version may
//! open back to back now).

use std::sync::Mutex;

use aya::maps::{Array, HashMap, MapData};
use cubevs_common::{NewFlowBucket, NewFlowConfig, QuotaKey, map, new_flow};

use crate::Error;

/// Typed access to `new_flow_rate` (read-only) and `new_flow_config`. `None` inside when the
/// loaded object has no such maps (objects before R91): nothing is bounded, every bucket reads
/// as unbounded.
pub struct NewFlowTable {
    buckets: Option<Mutex<HashMap<MapData, QuotaKey, NewFlowBucket>>>,
    config: Option<Mutex<Array<MapData, NewFlowConfig>>>,
}

impl NewFlowTable {
    pub(crate) fn new(
        buckets: Option<HashMap<MapData, QuotaKey, NewFlowBucket>>,
        config: Option<Array<MapData, NewFlowConfig>>,
    ) -> Self {
        Self { buckets: buckets.map(Mutex::new), config: config.map(Mutex::new) }
    }

    /// Writes the rate per second (0: no bound) and burst (0 counts as 1) every bucket follows
    /// from its next connection on. Nothing when the object has no `new_flow_config`.
    pub fn set_limits(&self, rate: u32, burst: u32) -> Result<(), Error> {
        let Some(c) = &self.config else { return Ok(()) };
        let v = NewFlowConfig { rate, burst: burst.max(1) };
        c.lock().unwrap_or_else(|e| e.into_inner()).set(0, v, 0).map_err(Error::map(map::NEW_FLOW_CONFIG, "update"))
    }

    /// The (rate per second, burst) the datapath enforces; rate 0: no bound.
    pub fn limits(&self) -> (u32, u32) {
        let Some(c) = &self.config else { return (0, 0) };
        let v = c.lock().unwrap_or_else(|e| e.into_inner()).get(&0, 0).unwrap_or_default();
        (v.rate, v.burst.max(1))
    }

    /// New connections to CubeEgress the sandbox `version` on `ifindex` may open back to back
    /// at `now_ns` (CLOCK_MONOTONIC): the burst when it has no bucket yet (a new version
    /// starts full), `u32::MAX` when there is no bound.
    pub fn available(&self, ifindex: u32, version: u32, now_ns: u64) -> u32 {
        let (rate, burst) = self.limits();
        let Some(m) = &self.buckets else { return u32::MAX };
        if rate == 0 {
            return u32::MAX;
        }
        let tat = m.lock().unwrap_or_else(|e| e.into_inner()).get(&QuotaKey { ifindex, version }, 0).ok();
        new_flow::available(tat.map(|b| b.tat_ns), now_ns, rate, burst)
    }
}
