//! Userspace side of the tracking floor (decision Q6): exact live counts of the entries of
//! `dns_query_track_v2` and `frag_sessions_v2` per sandbox version (`track_opened`, written by
//! the datapath only; `track_closed`, written here only) and per node (`session_floor` keys
//! `DNS_OPENED`/`FRAG_OPENED`, datapath only; `DNS_CLOSED`/`FRAG_CLOSED`, here only), and the
//! floors and ceilings the datapath checks (`TRACK_LIMITS`). It also carries the learned
//! floor of `dns_learned` (decision R66, [`crate::learned_floor`]), which follows the same
//! registrations.
//!
//! Every userspace delete of a charged entry (the DNS reaper and purges, the fragment reaper)
//! that removed it adds one to its owner's and the node's closed count (`TrackFloor::closed`).
//! Only entries the datapath marked as charged (`cubevs_common::track`) are counted, so entries
//! an older object made never underflow a count. The read-modify-write of the closed counts is
//! serialised in this process by a mutex and across processes (the old and the new agent of a
//! live upgrade) by an exclusive `flock` on the pinned maps' directory, taken before the
//! mutex everywhere.

use std::{collections::HashMap as StdHashMap, fs::File, sync::Mutex};

use aya::maps::{HashMap, MapData};
pub use cubevs_common::budget::{KIND_DNS_QUERY, KIND_FRAG};
use cubevs_common::{QuotaKey, TrackCount, floor, map};

use crate::{Error, error::ok_absent, lock::Flock, quota::dead_versions, quota::floor_ceiling};

/// The tracking floor's parameters for one map.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackLimits {
    /// Entries every registered sandbox version may always hold (0 = no node-wide check).
    pub floor: u32,
    /// `max_entries` of the map (as pinned).
    pub capacity: u32,
}

/// Live count of one kind, as read from the maps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackState {
    /// Node-wide charged entries: datapath's opened count less userspace's closed count.
    pub node: crate::QuotaUsage,
    /// The floor and ceiling the datapath checks (0, 0 when none is written).
    pub floor: u32,
    /// Node-wide live count at which a sandbox at or over its floor makes no more entries.
    pub ceiling: u32,
}

struct Inner {
    opened: HashMap<MapData, QuotaKey, TrackCount>,
    closed: HashMap<MapData, QuotaKey, TrackCount>,
    node: HashMap<MapData, u32, u64>,
}

/// `track_opened`, `track_closed` and the tracking keys of `session_floor`.
pub struct TrackFloor {
    inner: Mutex<Inner>,
    /// The pinned maps' directory, flocked around every closed-count update (`None`: unpinned).
    lock: Option<File>,
    dns: TrackLimits,
    frag: TrackLimits,
    margin: u32,
    /// The learned floor (decision R66), whose limits and per-version entries follow the same
    /// registrations.
    learned: Option<crate::learned_floor::LearnedFloor>,
}

fn field(c: &mut TrackCount, kind: u32) -> &mut u64 {
    if kind == KIND_DNS_QUERY { &mut c.dns_queries } else { &mut c.frags }
}

impl TrackFloor {
    /// `node` is a handle of `session_floor`; `lock` the maps directory (opened for this
    /// table alone: flocks of one open file do not exclude each other); `margin` the number of
    /// possible CPUs (each may pass the check before another's charge lands).
    pub(crate) fn new(
        opened: HashMap<MapData, QuotaKey, TrackCount>,
        closed: HashMap<MapData, QuotaKey, TrackCount>,
        node: HashMap<MapData, u32, u64>,
        lock: Option<File>,
        dns: TrackLimits,
        frag: TrackLimits,
        margin: u32,
    ) -> Self {
        Self { inner: Mutex::new(Inner { opened, closed, node }), lock, dns, frag, margin, learned: None }
    }

    /// Adds the learned floor (decision R66): refreshed, forgotten and collected with these.
    pub(crate) fn with_learned(mut self, learned: crate::learned_floor::LearnedFloor) -> Self {
        self.learned = Some(learned);
        self
    }

    /// The learned floor (decision R66), when loaded.
    pub fn learned(&self) -> Option<&crate::learned_floor::LearnedFloor> {
        self.learned.as_ref()
    }

    /// The floors in effect: (`dns_query_track_v2`, `frag_sessions_v2`).
    pub fn limits(&self) -> (TrackLimits, TrackLimits) {
        (self.dns, self.frag)
    }

    /// Rewrites `TRACK_LIMITS` for `registered` sandbox versions: per map, `floor` and
    /// `capacity - registered × floor - margin`. Returns (DNS ceiling, fragment ceiling).
    pub(crate) fn refresh(&self, registered: u32) -> Result<(u32, u32), Error> {
        let dns = floor_ceiling(self.dns.capacity, registered, self.dns.floor, self.margin);
        let frag = floor_ceiling(self.frag.capacity, registered, self.frag.floor, self.margin);
        let v = (u64::from(floor::track_half(self.dns.floor, dns)) << 32)
            | u64::from(floor::track_half(self.frag.floor, frag));
        let _flock = Flock::take(self.lock.as_ref(), map::TRACK_CLOSED)?;
        let mut g = self.inner.lock().expect("track lock");
        g.node.insert(floor::TRACK_LIMITS, v, 0).map_err(Error::map(map::SESSION_FLOOR, "update"))?;
        drop(g);
        drop(_flock);
        if let Some(l) = &self.learned {
            l.refresh(registered)?;
        }
        Ok((dns, frag))
    }

    /// The node-wide state of `kind` (`cubevs_common::budget::KIND_*`).
    pub fn state(&self, kind: u32) -> Result<TrackState, Error> {
        let g = self.inner.lock().expect("track lock");
        let get = |k: u32| -> Result<u64, Error> {
            Ok(ok_absent(g.node.get(&k, 0)).map_err(Error::map(map::SESSION_FLOOR, "lookup"))?.unwrap_or(0))
        };
        let (o, c) = floor::track_keys(kind);
        let (f, ceiling) =
            match ok_absent(g.node.get(&floor::TRACK_LIMITS, 0)).map_err(Error::map(map::SESSION_FLOOR, "lookup"))? {
                Some(v) => floor::track_unpack(v, kind),
                None => (0, 0),
            };
        Ok(TrackState { node: crate::QuotaUsage { opened: get(o)?, closed: get(c)? }, floor: f, ceiling })
    }

    /// Live charged entries of `kind` of (`ifindex`, `version`); `None` when the datapath has
    /// charged it nothing (no `track_opened` entry).
    pub fn usage(&self, ifindex: u32, version: u32, kind: u32) -> Result<Option<crate::QuotaUsage>, Error> {
        let g = self.inner.lock().expect("track lock");
        let key = QuotaKey { ifindex, version };
        let Some(mut o) = ok_absent(g.opened.get(&key, 0)).map_err(Error::map(map::TRACK_OPENED, "lookup"))? else {
            return Ok(None);
        };
        let mut c =
            ok_absent(g.closed.get(&key, 0)).map_err(Error::map(map::TRACK_CLOSED, "lookup"))?.unwrap_or_default();
        Ok(Some(crate::QuotaUsage { opened: *field(&mut o, kind), closed: *field(&mut c, kind) }))
    }

    /// Counts charged entries of `kind` this caller's deletes removed, one per owner in
    /// `owners`: in the node's closed key (when the datapath made its opened key) and in each
    /// owner's `track_closed` entry (skipped for a version the datapath has no entry for:
    /// released, nobody reads its count).
    pub(crate) fn closed(&self, kind: u32, owners: &[QuotaKey]) -> Result<(), Error> {
        if owners.is_empty() {
            return Ok(());
        }
        let mut by: StdHashMap<QuotaKey, u64> = StdHashMap::new();
        for k in owners {
            *by.entry(*k).or_default() += 1;
        }
        let _flock = Flock::take(self.lock.as_ref(), map::TRACK_CLOSED)?;
        let mut g = self.inner.lock().expect("track lock");
        let (ko, kc) = floor::track_keys(kind);
        if ok_absent(g.node.get(&ko, 0)).map_err(Error::map(map::SESSION_FLOOR, "lookup"))?.is_some() {
            let old = ok_absent(g.node.get(&kc, 0)).map_err(Error::map(map::SESSION_FLOOR, "lookup"))?.unwrap_or(0);
            g.node
                .insert(kc, old.wrapping_add(owners.len() as u64), 0)
                .map_err(Error::map(map::SESSION_FLOOR, "update"))?;
        }
        for (key, n) in by {
            if ok_absent(g.opened.get(&key, 0)).map_err(Error::map(map::TRACK_OPENED, "lookup"))?.is_none() {
                continue;
            }
            let mut c =
                ok_absent(g.closed.get(&key, 0)).map_err(Error::map(map::TRACK_CLOSED, "lookup"))?.unwrap_or_default();
            let f = field(&mut c, kind);
            *f = f.wrapping_add(n);
            g.closed.insert(key, c, 0).map_err(Error::map(map::TRACK_CLOSED, "update"))?;
        }
        Ok(())
    }

    /// Removes both entries of (`ifindex`, `version`) (absent is fine).
    pub(crate) fn forget(&self, ifindex: u32, version: u32) -> Result<(), Error> {
        let key = QuotaKey { ifindex, version };
        let _flock = Flock::take(self.lock.as_ref(), map::TRACK_CLOSED)?;
        let mut g = self.inner.lock().expect("track lock");
        ok_absent(g.closed.remove(&key)).map_err(Error::map(map::TRACK_CLOSED, "delete"))?;
        ok_absent(g.opened.remove(&key)).map_err(Error::map(map::TRACK_OPENED, "delete"))?;
        drop(g);
        drop(_flock);
        if let Some(l) = &self.learned {
            l.forget(ifindex, version)?;
        }
        Ok(())
    }

    /// Removes the entries of every version registered neither `before` nor `after` a scan
    /// (`{ifindex → version}`); returns how many versions were collected.
    pub(crate) fn collect(&self, before: &StdHashMap<u32, u32>, after: &StdHashMap<u32, u32>) -> Result<usize, Error> {
        let dead = {
            let g = self.inner.lock().expect("track lock");
            dead_versions((&g.opened, map::TRACK_OPENED), (&g.closed, map::TRACK_CLOSED), before, after)?
        };
        for k in &dead {
            self.forget(k.ifindex, k.version)?;
        }
        let n = dead.len();
        if let Some(l) = &self.learned {
            l.collect(before, after)?;
        }
        Ok(n)
    }
}
