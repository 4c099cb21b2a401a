//! `insert_budget` (LRU hash, [`BudgetKey`] → [`BudgetValue`], 16-byte values): the insert
//! windows the datapath keeps per sandbox for the shared non-evicting maps
//! ([`cubevs_common::budget`]; decisions R11, R12, R60, R64). The datapath alone writes them;
//! this side only reads, for operators (how much of a window a sandbox version has used).

use std::sync::Mutex;

use aya::maps::{HashMap, MapData};
use cubevs_common::{
    BudgetKey, BudgetValue,
    budget::{DNS_LEARNED_WINDOW_NS, DNS_WINDOW_NS, learned_kind, query_kind},
    limits::{DNS_LEARNED_PER_SANDBOX, DNS_QUERIES_PER_SANDBOX},
};

/// One sandbox version's use of one insert window, as the datapath would judge it at `now`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct BudgetUse {
    /// Inserts taken in the current window; 0 when none is open or the last one is over
    /// (the datapath restarts a finished window at its next insert). May exceed `cap` by one
    /// per CPU (concurrent inserts).
    pub used: u64,
    /// Inserts one window holds.
    pub cap: u64,
    /// Seconds until the current window ends and `used` starts again from 0 (0: no window open).
    pub resets_in_secs: u64,
}

/// Read-only typed access to `insert_budget`. `None` inside when the loaded object has no
/// such map (objects before R11): every read is then a zero [`BudgetUse`].
pub struct InsertBudgetTable {
    inner: Option<Mutex<HashMap<MapData, BudgetKey, BudgetValue>>>,
}

impl InsertBudgetTable {
    pub(crate) fn new(t: Option<HashMap<MapData, BudgetKey, BudgetValue>>) -> Self {
        Self { inner: t.map(Mutex::new) }
    }

    fn get(&self, ifindex: u32, kind: u32, cap: u32, window_ns: u64, now_ns: u64) -> BudgetUse {
        let mut u = BudgetUse { cap: u64::from(cap), ..Default::default() };
        let Some(m) = &self.inner else { return u };
        let v = m.lock().unwrap_or_else(|e| e.into_inner()).get(&BudgetKey { ifindex, kind }, 0).ok();
        if let Some(v) = v {
            let age = now_ns.wrapping_sub(v.start_ns);
            if age < window_ns {
                u.used = v.used;
                u.resets_in_secs = (window_ns - age).div_ceil(1_000_000_000);
            }
        }
        u
    }

    /// New `dns_learned` entries of sandbox `version` on `ifindex` in its day window
    /// ([`DNS_LEARNED_PER_SANDBOX`] a day, decision R60). `now_ns`: CLOCK_MONOTONIC.
    pub fn dns_learned(&self, ifindex: u32, version: u32, now_ns: u64) -> BudgetUse {
        self.get(ifindex, learned_kind(version), DNS_LEARNED_PER_SANDBOX, DNS_LEARNED_WINDOW_NS, now_ns)
    }

    /// Tracked DNS queries of sandbox `version` on `ifindex` in its 10 s window
    /// ([`DNS_QUERIES_PER_SANDBOX`], decisions R11, R64). `now_ns`: CLOCK_MONOTONIC.
    pub fn dns_queries(&self, ifindex: u32, version: u32, now_ns: u64) -> BudgetUse {
        self.get(ifindex, query_kind(version), DNS_QUERIES_PER_SANDBOX, DNS_WINDOW_NS, now_ns)
    }
}
