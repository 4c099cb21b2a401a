//! Per-sandbox counters (`sandbox_stats`, per-CPU hash: `u32` ifindex → per-CPU
//! [`cubevs_common::SandboxStats`]), summed over CPUs. Layout, directions and the drop reasons
//! are documented in `cubevs_common::stats`.
//!
//! The entries are ours: [`SandboxStatsTable::reset`] writes zeros when a sandbox takes an
//! interface, [`SandboxStatsTable::remove`] deletes them when it leaves; the programs only add
//! to an existing entry, so the map holds at most one entry per registered sandbox.

use std::{collections::BTreeMap, sync::Mutex};

use aya::maps::{MapData, PerCpuHashMap, PerCpuValues};
use cubevs_common::{
    SandboxStats, map,
    stats::{DROP_SLOTS, drop},
};

use crate::{Error, error::is_not_found};

/// One sandbox's counters summed over CPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SandboxCounters {
    /// Packets the guest sent that the datapath forwarded.
    pub out_packets: u64,
    /// Bytes of those packets (`skb->len`, L2 frame without FCS).
    pub out_bytes: u64,
    /// Packets delivered to the guest's interface.
    pub in_packets: u64,
    /// Bytes of those packets.
    pub in_bytes: u64,
    /// Drops by reason name (`cubevs_common::stats::drop::NAMES`), every reason present
    /// (zero included), sorted by name.
    pub drops: BTreeMap<String, u64>,
}

impl SandboxCounters {
    fn sum(per_cpu: &[SandboxStats]) -> Self {
        let mut drops = [0u64; DROP_SLOTS];
        let mut c = Self::default();
        for s in per_cpu {
            c.out_packets += s.out_packets;
            c.out_bytes += s.out_bytes;
            c.in_packets += s.in_packets;
            c.in_bytes += s.in_bytes;
            for (d, v) in drops.iter_mut().zip(s.drops) {
                *d += v;
            }
        }
        c.drops = drop::NAMES.iter().map(|&(slot, name)| (name.to_string(), drops[slot as usize])).collect();
        c
    }

    /// Sum of every drop reason.
    pub fn dropped(&self) -> u64 {
        self.drops.values().sum()
    }
}

/// Typed access to `sandbox_stats`.
pub struct SandboxStatsTable {
    inner: Mutex<PerCpuHashMap<MapData, u32, SandboxStats>>,
}

impl SandboxStatsTable {
    pub(crate) fn new(m: PerCpuHashMap<MapData, u32, SandboxStats>) -> Self {
        Self { inner: Mutex::new(m) }
    }

    /// Zeroes (creating it if needed) the entry of interface `ifindex`: counting starts now.
    /// Call before the sandbox is registered on the interface, so no packet of the previous
    /// owner is charged to the new one. Errors: `Map` (e.g. `E2BIG` when the map is full).
    pub fn reset(&self, ifindex: u32) -> Result<(), Error> {
        let n = aya::util::nr_cpus().map_err(|(what, source)| Error::MapSyscall {
            map: map::SANDBOX_STATS,
            op: what,
            source,
        })?;
        let zeros = PerCpuValues::try_from(vec![SandboxStats::default(); n]).map_err(|source| Error::MapSyscall {
            map: map::SANDBOX_STATS,
            op: "per-CPU values",
            source,
        })?;
        self.inner
            .lock()
            .expect("sandbox_stats lock")
            .insert(ifindex, zeros, 0)
            .map_err(Error::map(map::SANDBOX_STATS, "insert"))
    }

    /// Deletes the entry of `ifindex` (the programs stop counting for it); absent is fine.
    pub fn remove(&self, ifindex: u32) -> Result<(), Error> {
        match self.inner.lock().expect("sandbox_stats lock").remove(&ifindex) {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(Error::map(map::SANDBOX_STATS, "delete")(e)),
        }
    }

    /// The counters of `ifindex`, `None` when it has no entry.
    pub fn get(&self, ifindex: u32) -> Result<Option<SandboxCounters>, Error> {
        match self.inner.lock().expect("sandbox_stats lock").get(&ifindex, 0) {
            Ok(v) => Ok(Some(SandboxCounters::sum(&v))),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(Error::map(map::SANDBOX_STATS, "lookup")(e)),
        }
    }

    /// Every entry, by ifindex.
    pub fn list(&self) -> Result<BTreeMap<u32, SandboxCounters>, Error> {
        let g = self.inner.lock().expect("sandbox_stats lock");
        let mut out = BTreeMap::new();
        for r in g.iter() {
            match r {
                Ok((k, v)) => {
                    out.insert(k, SandboxCounters::sum(&v));
                }
                // An entry deleted between the key walk and its lookup.
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(Error::map(map::SANDBOX_STATS, "iterate")(e)),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_cpu_values_are_summed_and_every_reason_named() {
        let mut a = SandboxStats { out_packets: 2, out_bytes: 100, in_packets: 1, in_bytes: 60, ..Default::default() };
        a.drops[drop::POLICY as usize] = 3;
        let mut b = SandboxStats { out_packets: 5, out_bytes: 7, ..Default::default() };
        b.drops[drop::POLICY as usize] = 1;
        b.drops[drop::RST_WINDOW as usize] = 4;
        b.drops[drop::NODE_SESSIONS as usize] = 9; // the last slot (DROP_SLOTS - 1)
        let c = SandboxCounters::sum(&[a, b]);
        assert_eq!((c.out_packets, c.out_bytes, c.in_packets, c.in_bytes), (7, 107, 1, 60));
        assert_eq!((c.drops["policy"], c.drops["rst_window"], c.drops["spoof"]), (4, 4, 0));
        assert_eq!(c.drops.len(), drop::NAMES.len());
        assert_eq!(c.drops["node_sessions"], 9);
        assert_eq!(c.dropped(), 17);
    }
}
