//! Per-CPU verdict and drop counters (`counters`), summed across CPUs.

use aya::maps::{MapData, PerCpuArray};
use cubevs_common::{counter, map};

use crate::Error;

/// One counter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CounterValue {
    /// Program the counter belongs to (`from_cube`, `from_world`, `from_envoy`).
    pub program: &'static str,
    /// Verdict or drop reason, e.g. `drop_unregistered`.
    pub reason: &'static str,
    /// Packets, summed over CPUs, since the map was created.
    pub packets: u64,
}

/// Typed access to `counters`.
pub struct Counters {
    inner: PerCpuArray<MapData, u64>,
}

impl Counters {
    pub(crate) fn new(a: PerCpuArray<MapData, u64>) -> Self {
        Self { inner: a }
    }

    /// Every named counter.
    pub fn read(&self) -> Result<Vec<CounterValue>, Error> {
        counter::NAMES
            .iter()
            .map(|&(idx, program, reason)| {
                let v = self.inner.get(&idx, 0).map_err(Error::map(map::COUNTERS, "lookup"))?;
                Ok(CounterValue { program, reason, packets: v.iter().sum() })
            })
            .collect()
    }

    /// The value of one counter (`cubevs_common::counter::*`).
    pub fn get(&self, idx: u32) -> Result<u64, Error> {
        Ok(self.inner.get(&idx, 0).map_err(Error::map(map::COUNTERS, "lookup"))?.iter().sum())
    }
}

#[cfg(test)]
mod tests {
    use cubevs_common::{counter, limits};

    /// Every counter has its own slot inside the map (two names on one slot would add up).
    #[test]
    fn counter_slots_are_unique_and_in_range() {
        let mut seen = std::collections::HashSet::new();
        for (idx, program, reason) in counter::NAMES {
            assert!(*idx < limits::COUNTERS, "{program}/{reason}: slot {idx} beyond the map");
            assert!(seen.insert(*idx), "{program}/{reason}: slot {idx} used twice");
        }
    }
}
