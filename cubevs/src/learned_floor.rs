//! Userspace side of the learned floor (decision R66): exact live counts of the charged
//! entries of `dns_learned` per sandbox version (`learned_opened`, written by the datapath
//! only; `learned_closed`, written here only) and per node (`learned_floor` keys `OPENED`,
//! datapath only; `CLOSED`, here only), and the floor and ceiling the datapath checks
//! (`LIMITS`).
//!
//! Every userspace delete of a charged learned entry (the DNS reaper's exact delete of
//! expired entries, the policy purges) that removed it adds one to its owner's and the node's
//! closed count ([`LearnedFloor::closed`]). Only entries the datapath marked as charged
//! (`cubevs_common::learned_floor::CHARGED` in `LearnedValue::flags`) are counted, so entries
//! an older object made never underflow a count. The read-modify-write of the closed counts is
//! serialised in this process by a mutex and across processes (the old and the new agent of a
//! live upgrade) by an exclusive `flock` on the pinned maps' directory, taken before the mutex.

use std::{collections::HashMap as StdHashMap, fs::File, sync::Mutex};

use aya::maps::{HashMap, MapData};
use cubevs_common::{QuotaKey, floor, learned_floor, map};

use crate::{Error, QuotaUsage, error::ok_absent, lock::Flock, quota::dead_versions, quota::floor_ceiling};

/// The learned floor's state, as read from `learned_floor`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnedState {
    /// Node-wide charged learned entries: datapath's opened count less userspace's closed count.
    pub node: QuotaUsage,
    /// The floor and ceiling the datapath checks (0, 0 when none is written).
    pub floor: u32,
    /// Node-wide live count at which a sandbox at or over its floor learns no new entry.
    pub ceiling: u32,
}

struct Inner {
    opened: HashMap<MapData, QuotaKey, u64>,
    closed: HashMap<MapData, QuotaKey, u64>,
    node: HashMap<MapData, u32, u64>,
}

/// `learned_opened`, `learned_closed` and `learned_floor`.
pub struct LearnedFloor {
    inner: Mutex<Inner>,
    /// The pinned maps' directory, flocked around every closed-count update (`None`: unpinned).
    lock: Option<File>,
    floor: u32,
    capacity: u32,
    margin: u32,
}

impl LearnedFloor {
    /// `lock` the maps directory (opened for this table alone: flocks of one open file do not
    /// exclude each other); `floor` the enforced floor (0 = no node-wide check); `capacity`
    /// the `max_entries` of `dns_learned` (as pinned); `margin` the number of possible CPUs.
    pub(crate) fn new(
        opened: HashMap<MapData, QuotaKey, u64>,
        closed: HashMap<MapData, QuotaKey, u64>,
        node: HashMap<MapData, u32, u64>,
        lock: Option<File>,
        floor: u32,
        capacity: u32,
        margin: u32,
    ) -> Self {
        Self { inner: Mutex::new(Inner { opened, closed, node }), lock, floor, capacity, margin }
    }

    /// The enforced floor and the map's capacity.
    pub fn limits(&self) -> (u32, u32) {
        (self.floor, self.capacity)
    }

    /// Rewrites `LIMITS` for `registered` sandbox versions: `floor` and
    /// `capacity - registered × floor - margin`. Returns the ceiling.
    pub(crate) fn refresh(&self, registered: u32) -> Result<u32, Error> {
        let ceiling = floor_ceiling(self.capacity, registered, self.floor, self.margin);
        let _flock = Flock::take(self.lock.as_ref(), map::LEARNED_CLOSED)?;
        let mut g = self.inner.lock().expect("learned floor lock");
        g.node
            .insert(learned_floor::LIMITS, floor::pack(self.floor, ceiling), 0)
            .map_err(Error::map(map::LEARNED_FLOOR, "update"))?;
        Ok(ceiling)
    }

    /// The node-wide state.
    pub fn state(&self) -> Result<LearnedState, Error> {
        let g = self.inner.lock().expect("learned floor lock");
        let get = |k: u32| -> Result<Option<u64>, Error> {
            ok_absent(g.node.get(&k, 0)).map_err(Error::map(map::LEARNED_FLOOR, "lookup"))
        };
        let (f, ceiling) = get(learned_floor::LIMITS)?.map(floor::unpack).unwrap_or((0, 0));
        Ok(LearnedState {
            node: QuotaUsage {
                opened: get(learned_floor::OPENED)?.unwrap_or(0),
                closed: get(learned_floor::CLOSED)?.unwrap_or(0),
            },
            floor: f,
            ceiling,
        })
    }

    /// Live charged learned entries of (`ifindex`, `version`); `None` when the datapath has
    /// charged it nothing (no `learned_opened` entry).
    pub fn usage(&self, ifindex: u32, version: u32) -> Result<Option<QuotaUsage>, Error> {
        let g = self.inner.lock().expect("learned floor lock");
        let key = QuotaKey { ifindex, version };
        let Some(opened) = ok_absent(g.opened.get(&key, 0)).map_err(Error::map(map::LEARNED_OPENED, "lookup"))? else {
            return Ok(None);
        };
        let closed = ok_absent(g.closed.get(&key, 0)).map_err(Error::map(map::LEARNED_CLOSED, "lookup"))?.unwrap_or(0);
        Ok(Some(QuotaUsage { opened, closed }))
    }

    /// Counts charged learned entries this caller's deletes removed, one per owner in
    /// `owners`: in the node's closed key (when the datapath made its opened key) and in each
    /// owner's `learned_closed` entry (skipped for a version the datapath has no entry for:
    /// released, nobody reads its count).
    pub(crate) fn closed(&self, owners: &[QuotaKey]) -> Result<(), Error> {
        if owners.is_empty() {
            return Ok(());
        }
        let mut by: StdHashMap<QuotaKey, u64> = StdHashMap::new();
        for k in owners {
            *by.entry(*k).or_default() += 1;
        }
        let _flock = Flock::take(self.lock.as_ref(), map::LEARNED_CLOSED)?;
        let mut g = self.inner.lock().expect("learned floor lock");
        let get = |m: &HashMap<MapData, u32, u64>, k: u32| {
            ok_absent(m.get(&k, 0)).map_err(Error::map(map::LEARNED_FLOOR, "lookup"))
        };
        if get(&g.node, learned_floor::OPENED)?.is_some() {
            let old = get(&g.node, learned_floor::CLOSED)?.unwrap_or(0);
            g.node
                .insert(learned_floor::CLOSED, old.wrapping_add(owners.len() as u64), 0)
                .map_err(Error::map(map::LEARNED_FLOOR, "update"))?;
        }
        for (key, n) in by {
            if ok_absent(g.opened.get(&key, 0)).map_err(Error::map(map::LEARNED_OPENED, "lookup"))?.is_none() {
                continue;
            }
            let old = ok_absent(g.closed.get(&key, 0)).map_err(Error::map(map::LEARNED_CLOSED, "lookup"))?.unwrap_or(0);
            g.closed.insert(key, old.wrapping_add(n), 0).map_err(Error::map(map::LEARNED_CLOSED, "update"))?;
        }
        Ok(())
    }

    /// Removes both entries of (`ifindex`, `version`) (absent is fine).
    pub(crate) fn forget(&self, ifindex: u32, version: u32) -> Result<(), Error> {
        let key = QuotaKey { ifindex, version };
        let _flock = Flock::take(self.lock.as_ref(), map::LEARNED_CLOSED)?;
        let mut g = self.inner.lock().expect("learned floor lock");
        ok_absent(g.closed.remove(&key)).map_err(Error::map(map::LEARNED_CLOSED, "delete"))?;
        ok_absent(g.opened.remove(&key)).map_err(Error::map(map::LEARNED_OPENED, "delete"))?;
        Ok(())
    }

    /// Removes the entries of every version registered neither `before` nor `after` a scan
    /// (`{ifindex → version}`); returns how many versions were collected.
    pub(crate) fn collect(&self, before: &StdHashMap<u32, u32>, after: &StdHashMap<u32, u32>) -> Result<usize, Error> {
        let dead = {
            let g = self.inner.lock().expect("learned floor lock");
            dead_versions((&g.opened, map::LEARNED_OPENED), (&g.closed, map::LEARNED_CLOSED), before, after)?
        };
        for k in &dead {
            self.forget(k.ifindex, k.version)?;
        }
        let n = dead.len();
        Ok(n)
    }
}
