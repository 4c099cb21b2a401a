//! Background reaping of the datapath's expiring, never-evicting maps: every interval, learned
//! addresses and tracked queries past their expiry are deleted ([`crate::PolicyTable::reap_dns`]),
//! and so are expired fragment entries ([`crate::FragTable::reap`], decision R12). Upstream runs
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
    /// `frag_sessions_v2` entries removed in total.
    pub frags_removed: AtomicU64,
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
    /// Reaps `maps.policy`'s DNS state and `maps.frags` every `interval` (upstream: 5 s).
    pub fn spawn(maps: Arc<Maps>, interval: Duration) -> Self {
        let stats = Arc::new(DnsReaperStats::default());
        let st = stats.clone();
        let thread = Periodic::spawn("cubevs-dns-reaper", interval, move || {
            let now = monotonic_ns();
            match maps.policy.reap_dns(now) {
                Ok(r) => {
                    st.learned_removed.fetch_add(r.learned as u64, Ordering::Relaxed);
                    st.queries_removed.fetch_add(r.queries as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    st.errors.fetch_add(1, Ordering::Relaxed);
                    log::warn!("dns reaper: {e}");
                }
            }
            match maps.frags.reap(now) {
                Ok(n) => {
                    st.frags_removed.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    st.errors.fetch_add(1, Ordering::Relaxed);
                    log::warn!("dns reaper (fragments): {e}");
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
