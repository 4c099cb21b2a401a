//! Per-sandbox datapath counters as Prometheus counters, read at scrape time:
//! `cubenet_sandbox_packets_total{sandbox,direction}`, `cubenet_sandbox_bytes_total{sandbox,
//! direction}` (`direction` = `out` (sent by the guest) | `in` (delivered to it)) and
//! `cubenet_sandbox_drops_total{sandbox,reason}` (`cubevs_common::stats::drop::NAMES`; a
//! reason appears once it is non-zero).
//!
//! Cardinality is bounded by the registered sandboxes: the series are built from the
//! datapath's registry at every scrape, so a sandbox's series exist from its Ensure and
//! disappear with its Release (nothing is kept in the registry between scrapes).

use std::{collections::HashMap, sync::Arc};

use prometheus::{
    IntCounterVec, Opts,
    core::{Collector, Desc},
    proto::MetricFamily,
};

use crate::dataplane::Dataplane;

/// The collector; register once per registry.
pub(super) struct SandboxCollector {
    dp: Arc<dyn Dataplane>,
    /// Templates: their descriptors are this collector's.
    templates: [IntCounterVec; 3],
}

impl SandboxCollector {
    pub(super) fn new(dp: Arc<dyn Dataplane>) -> Self {
        Self { dp, templates: Self::families() }
    }

    fn families() -> [IntCounterVec; 3] {
        let f = |name: &str, help: &str, label: &str| {
            IntCounterVec::new(Opts::new(name, help), &["sandbox", label]).expect("static metric")
        };
        [
            f(
                "cubenet_sandbox_packets_total",
                "Packets of one sandbox by direction (out = sent by the guest)",
                "direction",
            ),
            f(
                "cubenet_sandbox_bytes_total",
                "Bytes (L2) of one sandbox by direction (out = sent by the guest)",
                "direction",
            ),
            f("cubenet_sandbox_drops_total", "Dropped packets of one sandbox by reason", "reason"),
        ]
    }
}

impl Collector for SandboxCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.templates.iter().flat_map(|t| t.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let (Ok(sandboxes), Ok(counters)) = (self.dp.sandboxes(), self.dp.all_sandbox_counters()) else {
            return Vec::new();
        };
        let ids: HashMap<u32, String> = sandboxes.into_iter().map(|s| (s.ifindex, s.id)).collect();
        let [packets, bytes, drops] = Self::families();
        for (ifindex, c) in &counters {
            // Only registered sandboxes: the map may briefly hold an entry of a sandbox
            // being released.
            let Some(id) = ids.get(ifindex) else { continue };
            packets.with_label_values(&[id, "out"]).inc_by(c.out_packets);
            packets.with_label_values(&[id, "in"]).inc_by(c.in_packets);
            bytes.with_label_values(&[id, "out"]).inc_by(c.out_bytes);
            bytes.with_label_values(&[id, "in"]).inc_by(c.in_bytes);
            for (reason, n) in c.drops.iter().filter(|(_, n)| **n > 0) {
                drops.with_label_values(&[id, reason]).inc_by(*n);
            }
        }
        [packets, bytes, drops].iter().flat_map(|f| f.collect()).collect()
    }
}
