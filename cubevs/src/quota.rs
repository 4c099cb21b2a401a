//! Userspace side of the per-sandbox live-session budget (`cubevs_common::quota`, decisions
//! Q1-Q3): `session_opened` (written by the datapath only: created on a sandbox version's
//! first new flow, atomically added to on every charged session and subtracted from when the
//! datapath deletes one) and `session_closed` (written here only).
//!
//! Every userspace session delete goes through [`crate::Sessions`], whose lock serialises the
//! read-modify-write of `session_closed`: after a delete, [`QuotaMaps::closed_locked`] adds
//! one per charged session ([`NatSession::quota`] = `COUNTED`) that this delete removed (a
//! session another deleter already removed is not counted twice). A session made without a
//! charge (by an object older than the quota, with budget 0, or restored by userspace) is never
//! subtracted, so switching the quota in under live sessions cannot underflow a counter.
//!
//! Entries of a sandbox version are removed when it is unregistered or replaced
//! ([`crate::SandboxTable`]) and, for any the datapath re-created from an in-flight packet,
//! by the reaper's sweep once the version is no longer registered ([`QuotaMaps::collect`]).
//! Two processes may delete sessions of the same pinned maps at once (the old and the new agent
//! of a live upgrade both run a reaper until the old one exits): the read-modify-write of
//! `session_closed` is then also serialised across processes by an exclusive `flock(2)` on the
//! pinned maps' directory (`<pin_dir>/maps`; bpffs directories can be flocked, and the
//! datapath updater lock is on `<pin_dir>` itself, so the two never wait for each other).
//!
//! The node-wide reserved floor (`cubevs_common::floor`, decision Q4) lives beside them in
//! `session_floor`: the same deletes add the sessions charged to the node
//! ([`NatSession::node_quota`] = `COUNTED`) to its `CLOSED` key, whatever their version's
//! state (a released version's sessions still fill the map until deleted), and
//! [`QuotaMaps::refresh_floor`] rewrites its `LIMITS` key from the registrations counted
//! in the map itself (so two processes sharing the pins never leave a stale count), on every
//! registration of a sandbox new to its interface ([`crate::SandboxTable`]), at load and on
//! every reaper sweep. An unregister does not recount: the released floor stays reserved
//! until the next of these (a lower ceiling is the safe side; decision F14).

use std::{collections::HashMap as StdHashMap, fs::File};

use aya::maps::{HashMap, MapData};
use cubevs_common::{MvmMeta, NatSession, QuotaKey, SessionKey, floor, map, quota::COUNTED};

use crate::{Error, error::ok_absent, lock::Flock};

/// Budget use of one sandbox version.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaUsage {
    /// Sessions the datapath charged, less those it deleted itself (`session_opened`).
    pub opened: u64,
    /// Charged sessions userspace deleted (`session_closed`).
    pub closed: u64,
}

impl QuotaUsage {
    /// Live charged sessions, `opened - closed`; transiently negative while a just-created
    /// session's charge is still on its way (see `cubevs_common::quota`).
    pub fn live(&self) -> i64 {
        self.opened.wrapping_sub(self.closed) as i64
    }
}

/// The two quota maps (behind the sessions lock).
pub(crate) struct QuotaMaps {
    pub(crate) opened: HashMap<MapData, QuotaKey, u64>,
    pub(crate) closed: HashMap<MapData, QuotaKey, u64>,
    /// The pinned maps' directory, flocked around every `session_closed` update (`None` for
    /// unpinned maps: private to this process).
    pub(crate) lock: Option<File>,
    /// `session_floor` and how its limits are computed (`None`: no floor).
    pub(crate) floor: Option<FloorMap>,
    /// The tracking floor (decision Q6): its limits follow the same registration count, its
    /// per-version entries are removed with the session budget's.
    pub(crate) track: Option<std::sync::Arc<crate::track_floor::TrackFloor>>,
}

/// Registrations read per batched syscall by [`QuotaMaps::refresh_floor`]'s count (decision
/// F19): the count needs no values, but the batch API returns them, and its buffers are
/// zero-filled per call: 128 × (4 + 128) bytes instead of the 132 KB of 1,024 entries, on every
/// registration of a new sandbox. The kernel's bucket walk is the same whatever the chunk (more
/// syscalls only beyond 128 registrations).
const COUNT_CHUNK: usize = 128;

/// The node-wide floor's map and parameters ([`QuotaMaps::refresh_floor`]).
pub(crate) struct FloorMap {
    pub(crate) map: HashMap<MapData, u32, u64>,
    /// Live sessions every registered sandbox version may always open (0 = no node check).
    pub(crate) floor: u32,
    /// `max_entries` of `egress_sessions` (as pinned).
    pub(crate) capacity: u32,
    /// Room kept for concurrent check-then-charge on other CPUs: the number of possible CPUs.
    pub(crate) margin: u32,
}

/// The margin [`Datapath::load`](crate::Datapath::load) keeps below the ceiling: one session per
/// possible CPU (`/sys/devices/system/cpu/possible`), since each CPU may pass the check before
/// another's charge lands.
pub fn floor_margin() -> u32 {
    crate::slots::possible_cpus() as u32
}

/// The node-wide ceiling for `registered` sandboxes: `capacity - registered × floor -
/// margin`, 0 when the reserve exceeds the capacity (then only floors are admitted).
pub fn floor_ceiling(capacity: u32, registered: u32, floor: u32, margin: u32) -> u32 {
    let reserved = u64::from(registered) * u64::from(floor) + u64::from(margin);
    u64::from(capacity).saturating_sub(reserved) as u32
}

/// State of the node-wide floor (decision Q4), as read from `session_floor`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FloorState {
    /// Charged sessions on the node: `OPENED` (datapath) and `CLOSED` (userspace); `live()` is
    /// the node-wide count the ceiling bounds.
    pub usage: QuotaUsage,
    /// Sessions every registered sandbox version may always hold (0: no node check).
    pub floor: u32,
    /// Node-wide live count at which a sandbox at or over its floor is refused.
    pub ceiling: u32,
}

impl QuotaMaps {
    /// Usage of `key`, `None` when the datapath has not charged it (no `session_opened` entry).
    pub(crate) fn usage(&self, key: &QuotaKey) -> Result<Option<QuotaUsage>, Error> {
        let Some(opened) = ok_absent(self.opened.get(key, 0)).map_err(Error::map(map::SESSION_OPENED, "lookup"))?
        else {
            return Ok(None);
        };
        let closed = ok_absent(self.closed.get(key, 0)).map_err(Error::map(map::SESSION_CLOSED, "lookup"))?;
        Ok(Some(QuotaUsage { opened, closed: closed.unwrap_or(0) }))
    }

    /// The node-wide floor's counts and limits; `None` without a floor map.
    pub(crate) fn floor_state(&self) -> Result<Option<FloorState>, Error> {
        let Some(f) = &self.floor else { return Ok(None) };
        let get = |k: u32| -> Result<u64, Error> {
            Ok(ok_absent(f.map.get(&k, 0)).map_err(Error::map(map::SESSION_FLOOR, "lookup"))?.unwrap_or(0))
        };
        let (floor, ceiling) = floor::unpack(get(floor::LIMITS)?);
        Ok(Some(FloorState {
            usage: QuotaUsage { opened: get(floor::OPENED)?, closed: get(floor::CLOSED)? },
            floor,
            ceiling,
        }))
    }

    /// Rewrites the floor's `LIMITS` from the registrations counted in `ifindex_to_mvmmeta`
    /// (`registrations`, read under the maps-directory flock so two processes' writes are
    /// ordered after their counts); returns the ceiling written.
    pub(crate) fn refresh_floor(&mut self, registrations: Option<&std::os::fd::OwnedFd>) -> Result<Option<u32>, Error> {
        use std::os::fd::AsFd;
        let (Some(f), Some(fd)) = (&mut self.floor, registrations) else { return Ok(None) };
        let flock = Flock::take(self.lock.as_ref(), map::SESSION_CLOSED)?;
        let mut n = 0u32;
        crate::batch::for_each(fd.as_fd(), COUNT_CHUNK, |_: &u32, _: &MvmMeta| n += 1)
            .map_err(|source| Error::MapSyscall { map: map::IFINDEX_TO_MVMMETA, op: "batch lookup", source })?;
        let ceiling = floor_ceiling(f.capacity, n, f.floor, f.margin);
        f.map
            .insert(floor::LIMITS, floor::pack(f.floor, ceiling), 0)
            .map_err(Error::map(map::SESSION_FLOOR, "update"))?;
        // The tracking floor takes its own flock (another open file of the same directory).
        drop(flock);
        if let Some(t) = &self.track {
            t.refresh(n)?;
        }
        Ok(Some(ceiling))
    }

    /// Every charged sandbox version.
    pub(crate) fn list(&self) -> Result<Vec<(QuotaKey, QuotaUsage)>, Error> {
        let mut out = Vec::new();
        for k in self.opened.keys() {
            let k = k.map_err(Error::map(map::SESSION_OPENED, "iterate"))?;
            if let Some(u) = self.usage(&k)? {
                out.push((k, u));
            }
        }
        Ok(out)
    }

    /// Counts the charged sessions among `deleted` (sessions this caller's delete removed) in
    /// `session_closed`. A version without a `session_opened` entry (released, or never
    /// charged) is skipped: nobody reads its budget any more.
    pub(crate) fn closed_locked<'a>(
        &mut self,
        deleted: impl IntoIterator<Item = (&'a SessionKey, &'a NatSession)>,
    ) -> Result<(), Error> {
        let mut by: StdHashMap<QuotaKey, u64> = StdHashMap::new();
        let mut node = 0u64;
        for (k, s) in deleted {
            if s.quota == COUNTED {
                *by.entry(QuotaKey { ifindex: s.vm_ifindex, version: k.version }).or_default() += 1;
            }
            if s.node_quota == COUNTED {
                node += 1;
            }
        }
        if by.is_empty() && node == 0 {
            return Ok(());
        }
        let _flock = Flock::take(self.lock.as_ref(), map::SESSION_CLOSED)?;
        if let (Some(f), true) = (&mut self.floor, node > 0) {
            // The datapath creates `OPENED` before it marks any session as charged to it.
            let get = |k: u32| ok_absent(f.map.get(&k, 0)).map_err(Error::map(map::SESSION_FLOOR, "lookup"));
            if get(floor::OPENED)?.is_some() {
                let old = get(floor::CLOSED)?.unwrap_or(0);
                f.map
                    .insert(floor::CLOSED, old.wrapping_add(node), 0)
                    .map_err(Error::map(map::SESSION_FLOOR, "update"))?;
            }
        }
        for (key, n) in by {
            if ok_absent(self.opened.get(&key, 0)).map_err(Error::map(map::SESSION_OPENED, "lookup"))?.is_none() {
                continue;
            }
            let old =
                ok_absent(self.closed.get(&key, 0)).map_err(Error::map(map::SESSION_CLOSED, "lookup"))?.unwrap_or(0);
            self.closed.insert(key, old.wrapping_add(n), 0).map_err(Error::map(map::SESSION_CLOSED, "update"))?;
        }
        Ok(())
    }

    /// Removes both entries of `key` (absent is fine).
    pub(crate) fn forget(&mut self, key: &QuotaKey) -> Result<(), Error> {
        {
            let _flock = Flock::take(self.lock.as_ref(), map::SESSION_CLOSED)?;
            ok_absent(self.closed.remove(key)).map_err(Error::map(map::SESSION_CLOSED, "delete"))?;
            ok_absent(self.opened.remove(key)).map_err(Error::map(map::SESSION_OPENED, "delete"))?;
        }
        if let Some(t) = &self.track {
            t.forget(key.ifindex, key.version)?;
        }
        Ok(())
    }

    /// Removes the entries of every version `alive` says is registered neither `before` nor
    /// `after` (registrations `{ifindex → version}` read around the scan); returns how many
    /// versions were collected.
    pub(crate) fn collect(
        &mut self,
        before: &StdHashMap<u32, u32>,
        after: &StdHashMap<u32, u32>,
    ) -> Result<usize, Error> {
        let dead =
            dead_versions((&self.opened, map::SESSION_OPENED), (&self.closed, map::SESSION_CLOSED), before, after)?;
        for k in &dead {
            self.forget(k)?;
        }
        let n = dead.len();
        if let Some(t) = &self.track {
            t.collect(before, after)?;
        }
        Ok(n)
    }
}

/// The sandbox versions keyed in an opened/closed pair of count maps (each with its map name,
/// for errors) that are registered neither `before` nor `after` a scan (`{ifindex →
/// version}`), each once: what `collect` of the session, tracking and learned floors removes.
/// O(entries) (a set, not a list search: up to 8,192 versions per map).
pub(crate) fn dead_versions<V: aya::Pod>(
    opened: (&HashMap<MapData, QuotaKey, V>, &'static str),
    closed: (&HashMap<MapData, QuotaKey, V>, &'static str),
    before: &StdHashMap<u32, u32>,
    after: &StdHashMap<u32, u32>,
) -> Result<Vec<QuotaKey>, Error> {
    let mut seen = std::collections::HashSet::new();
    for (m, name) in [opened, closed] {
        for k in m.keys() {
            seen.insert(k.map_err(Error::map(name, "iterate"))?);
        }
    }
    let live = |k: &QuotaKey| before.get(&k.ifindex) == Some(&k.version) || after.get(&k.ifindex) == Some(&k.version);
    Ok(seen.into_iter().filter(|k| !live(k)).collect())
}

#[cfg(test)]
mod tests {
    use super::{QuotaUsage, floor_ceiling};

    #[test]
    fn ceiling_arithmetic() {
        // Defaults: 8,192 sandboxes x 64 + 4 CPUs leave 524,284 of 1,048,576 shared.
        assert_eq!(floor_ceiling(1 << 20, 8192, 64, 4), 524_284);
        assert_eq!(floor_ceiling(64, 5, 4, 2), 42);
        // A reserve above the capacity closes the shared part instead of wrapping.
        assert_eq!(floor_ceiling(64, 100, 4, 2), 0);
        assert_eq!(floor_ceiling(u32::MAX, u32::MAX, u32::MAX, 0), 0);
    }

    #[test]
    fn live_is_signed() {
        assert_eq!(QuotaUsage { opened: 5, closed: 2 }.live(), 3);
        // A delete counted before the creating CPU's add landed: briefly -1, never u64::MAX.
        assert_eq!(QuotaUsage { opened: 4, closed: 5 }.live(), -1);
    }
}
