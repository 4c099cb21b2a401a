//! Background reaping of DNS learning state: every interval, learned addresses and tracked
//! queries past their expiry are deleted ([`crate::PolicyTable::reap_dns`]). Upstream runs
//! this in the same 5 s tick as the session reaper (`reference/upstream.md §3.8`); a thread
//! of its own keeps the session reaper untouched.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::{Maps, periodic::Periodic, reaper::monotonic_ns};

/// Counters of a running DNS reaper.
#[derive(Debug, Default)]
pub struct DnsReaperStats {
    /// Ticks done.
    pub runs: AtomicU64,
    /// Learned entries removed in total.
    pub learned_removed: AtomicU64,
    /// Tracked queries removed in total.
    pub queries_removed: AtomicU64,
    /// Ticks that failed.
    pub errors: AtomicU64,
}

/// The DNS reaper thread; stopped on drop.
#[derive(Debug)]
pub struct DnsReaper {
    stats: Arc<DnsReaperStats>,
    _thread: Periodic,
}

impl DnsReaper {
    /// Reaps `maps.policy`'s DNS state every `interval` (upstream: 5 s).
    pub fn spawn(maps: Arc<Maps>, interval: Duration) -> Self {
        let stats = Arc::new(DnsReaperStats::default());
        let st = stats.clone();
        let thread = Periodic::spawn("cubevs-dns-reaper", interval, move || {
            match maps.policy.reap_dns(monotonic_ns()) {
                Ok(r) => {
                    st.learned_removed.fetch_add(r.learned as u64, Ordering::Relaxed);
                    st.queries_removed.fetch_add(r.queries as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    st.errors.fetch_add(1, Ordering::Relaxed);
                    log::warn!("dns reaper: {e}");
                }
            }
            st.runs.fetch_add(1, Ordering::Relaxed);
        });
        Self { stats, _thread: thread }
    }

    /// Live counters.
    pub fn stats(&self) -> &DnsReaperStats {
        &self.stats
    }
}
