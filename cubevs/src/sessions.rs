//! Conntrack/NAT sessions: `egress_sessions` (guest side) and `ingress_sessions` (world side).

use std::{
    net::Ipv4Addr,
    os::fd::OwnedFd,
    sync::{Condvar, Mutex, MutexGuard},
};

use aya::maps::{HashMap, MapData};
use cubevs_common::{IngressValue, NatSession, SessionKey, conntrack, map, proto};

use crate::{
    Error,
    error::is_not_found,
    quota::{FloorState, QuotaMaps, QuotaUsage},
};

/// A session as dumps show it: addresses and ports host order, state by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionView {
    /// `tcp`, `udp` or `icmp`.
    pub proto: &'static str,
    /// Sandbox mvm IP.
    pub sandbox_ip: Ipv4Addr,
    /// Guest port (ICMP: echo id).
    pub guest_port: u16,
    /// Remote address.
    pub remote_ip: Ipv4Addr,
    /// Remote port (ICMP: 0).
    pub remote_port: u16,
    /// SNAT address.
    pub snat_ip: Ipv4Addr,
    /// SNAT port (ICMP: echo id on the wire).
    pub snat_port: u16,
    /// Sandbox version of the session key.
    pub version: u32,
    /// Sandbox interface.
    pub vm_ifindex: u32,
    /// Conntrack state name (`established`, `replied`, …).
    pub state: &'static str,
    /// Guest closed first.
    pub active_close: bool,
    /// Last use (CLOCK_MONOTONIC ns).
    pub access_ns: u64,
}

/// Name of an IP protocol number.
pub fn proto_name(p: u8) -> &'static str {
    match p {
        proto::TCP => "tcp",
        proto::UDP => "udp",
        proto::ICMP => "icmp",
        _ => "other",
    }
}

/// Conntrack state name of `s` for `proto`.
pub fn state_name(p: u8, s: u8) -> &'static str {
    if p == proto::TCP { conntrack::tcp::name(s) } else { conntrack::udp::name(s) }
}

impl SessionView {
    /// Builds the view of egress entry `k` → `s`.
    pub fn new(k: &SessionKey, s: &NatSession) -> Self {
        let ip = |v: u32| Ipv4Addr::from(v.to_ne_bytes());
        Self {
            proto: proto_name(k.proto),
            sandbox_ip: ip(k.src_ip),
            guest_port: u16::from_be(k.sport),
            remote_ip: ip(k.dst_ip),
            remote_port: u16::from_be(k.dport),
            snat_ip: ip(s.node_ip),
            snat_port: u16::from_be(s.node_port),
            version: k.version,
            vm_ifindex: s.vm_ifindex,
            state: state_name(k.proto, s.state),
            active_close: s.active_close != 0,
            access_ns: s.access_ns,
        }
    }
}

/// The session maps and a registrations fd, behind [`Sessions`]' lock.
pub(crate) struct SessionMaps {
    pub(crate) egress: HashMap<MapData, SessionKey, NatSession>,
    pub(crate) ingress: HashMap<MapData, SessionKey, IngressValue>,
    /// A second fd of `ifindex_to_mvmmeta`: the reaper reads the registrations once per pass
    /// to purge sessions of released or reused interfaces (decision D19).
    pub(crate) registrations: Option<OwnedFd>,
    /// `session_opened` + `session_closed` (`crate::quota`): every delete below counts the
    /// charged sessions it removed, under this lock.
    pub(crate) quota: Option<QuotaMaps>,
}

impl SessionMaps {
    /// Counts the charged sessions among `deleted` (removed by the caller) in `session_closed`.
    pub(crate) fn closed<'a>(
        &mut self,
        deleted: impl IntoIterator<Item = (&'a SessionKey, &'a NatSession)>,
    ) -> Result<(), Error> {
        match &mut self.quota {
            Some(q) => q.closed_locked(deleted),
            None => Ok(()),
        }
    }
}

/// Typed access to the two session maps.
pub struct Sessions {
    pub(crate) inner: Mutex<SessionMaps>,
    /// Coalesces concurrent floor recounts ([`Sessions::refresh_floor`], decision F23).
    recounts: Mutex<Recounts>,
    /// Signalled when a recount ends (waiters check whether it covered them).
    recounted: Condvar,
}

/// Bookkeeping of [`Sessions::refresh_floor`]'s shared recounts: requests are numbered in the
/// order they arrive; a recount covers every request numbered before it started.
#[derive(Debug, Default)]
struct Recounts {
    /// Requests so far (the last request's number).
    requested: u64,
    /// Every request up to this number is covered by a recount that has completed.
    covered: u64,
    /// A recount is running.
    running: bool,
    /// The ceiling the last completed recount wrote.
    ceiling: Option<u32>,
}

/// Ends a running recount even if it panics, so waiters never wait for a recount that stopped.
struct RecountRun<'a>(&'a Sessions);

impl Drop for RecountRun<'_> {
    fn drop(&mut self) {
        self.0.recounts().running = false;
        self.0.recounted.notify_all();
    }
}

impl Sessions {
    pub(crate) fn new(
        egress: HashMap<MapData, SessionKey, NatSession>,
        ingress: HashMap<MapData, SessionKey, IngressValue>,
        registrations: Option<OwnedFd>,
        quota: Option<QuotaMaps>,
    ) -> Self {
        Self {
            inner: Mutex::new(SessionMaps { egress, ingress, registrations, quota }),
            recounts: Mutex::new(Recounts::default()),
            recounted: Condvar::new(),
        }
    }

    fn recounts(&self) -> MutexGuard<'_, Recounts> {
        self.recounts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Live-session budget use of the sandbox version (`ifindex`, `version`), `None` when the
    /// datapath has not charged it a session (or it was released).
    pub fn quota_usage(&self, ifindex: u32, version: u32) -> Result<Option<QuotaUsage>, Error> {
        let g = self.inner.lock().expect("sessions lock");
        match &g.quota {
            Some(q) => q.usage(&cubevs_common::QuotaKey { ifindex, version }),
            None => Ok(None),
        }
    }

    /// The node-wide floor's counts and limits (decision Q4); `None` without the floor map.
    pub fn floor_state(&self) -> Result<Option<FloorState>, Error> {
        let g = self.inner.lock().expect("sessions lock");
        match &g.quota {
            Some(q) => q.floor_state(),
            None => Ok(None),
        }
    }

    /// Rewrites the floor's ceiling from the registrations now in the sandbox map (decision
    /// Q4); returns it (`None` without a floor map). Called on every registration of a sandbox
    /// new to its interface, at load and by the reaper (an unregister leaves the count to the
    /// next of these: decision F14).
    ///
    /// When it returns `Ok`, a recount that *started after this call began* has completed and
    /// written `LIMITS`, so every registration made before the call is counted. Concurrent
    /// callers share recounts (decision F23): while one runs, the callers that arrive wait and
    /// the first of them then runs one recount for all of them (each recount walks the whole
    /// sandbox map, so one per caller made a burst of registrations O(n²) and serialized them).
    /// On an error the caller that ran the recount gets it; the callers it would have covered
    /// run their own.
    pub fn refresh_floor(&self) -> Result<Option<u32>, Error> {
        let mut r = self.recounts();
        r.requested += 1;
        let ticket = r.requested;
        loop {
            if r.covered >= ticket {
                return Ok(r.ceiling);
            }
            if !r.running {
                r.running = true;
                // Every request numbered so far was made before this recount starts.
                let cover = r.requested;
                drop(r);
                let run = RecountRun(self);
                let res = self.recount_floor();
                if let Ok(c) = res {
                    let mut r = self.recounts();
                    r.covered = r.covered.max(cover);
                    r.ceiling = c;
                }
                drop(run);
                return res;
            }
            r = self.recounted.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// One recount of the floor's registrations (the work behind [`Sessions::refresh_floor`]).
    fn recount_floor(&self) -> Result<Option<u32>, Error> {
        let mut g = self.inner.lock().expect("sessions lock");
        let SessionMaps { registrations, quota, .. } = &mut *g;
        match quota {
            Some(q) => q.refresh_floor(registrations.as_ref()),
            None => Ok(None),
        }
    }

    /// Budget use of every charged sandbox version, as (ifindex, version, usage).
    pub fn quota_list(&self) -> Result<Vec<(u32, u32, QuotaUsage)>, Error> {
        let g = self.inner.lock().expect("sessions lock");
        match &g.quota {
            Some(q) => Ok(q.list()?.into_iter().map(|(k, u)| (k.ifindex, k.version, u)).collect()),
            None => Ok(Vec::new()),
        }
    }

    /// Removes the budget entries of the sandbox version (`ifindex`, `version`) (release, or
    /// a new version registered on the interface): its stale sessions are no longer charged
    /// to anyone.
    pub(crate) fn forget_quota(&self, ifindex: u32, version: u32) -> Result<(), Error> {
        let mut g = self.inner.lock().expect("sessions lock");
        match &mut g.quota {
            Some(q) => q.forget(&cubevs_common::QuotaKey { ifindex, version }),
            None => Ok(()),
        }
    }

    /// Every egress session with its entry (batched reads).
    pub fn entries(&self) -> Result<Vec<(SessionKey, NatSession)>, Error> {
        use std::os::fd::AsFd;

        use aya::maps::IterableMap;
        let g = self.inner.lock().expect("sessions lock");
        crate::batch::lookup_all(g.egress.map().fd().as_fd(), 4096).map_err(|source| Error::MapSyscall {
            map: map::EGRESS_SESSIONS,
            op: "batch lookup",
            source,
        })
    }

    /// Every egress session as a [`SessionView`].
    pub fn list(&self) -> Result<Vec<SessionView>, Error> {
        Ok(self.entries()?.iter().map(|(k, s)| SessionView::new(k, s)).collect())
    }

    /// Every ingress (reverse NAT) entry.
    pub fn reverse_entries(&self) -> Result<Vec<(SessionKey, IngressValue)>, Error> {
        let g = self.inner.lock().expect("sessions lock");
        g.ingress.iter().map(|r| r.map_err(Error::map(map::INGRESS_SESSIONS, "iterate"))).collect()
    }

    /// Entries in (`egress_sessions`, `ingress_sessions`) (batched reads).
    pub fn counts(&self) -> (usize, usize) {
        use std::os::fd::AsFd;

        use aya::maps::IterableMap;
        let g = self.inner.lock().expect("sessions lock");
        // Counted chunk by chunk: memory is one chunk, not a copy of the maps.
        let (mut ne, mut ni) = (0usize, 0usize);
        let e = crate::batch::for_each(g.egress.map().fd().as_fd(), 4096, |_: &SessionKey, _: &NatSession| ne += 1)
            .map(|()| ne);
        let i = crate::batch::for_each(g.ingress.map().fd().as_fd(), 4096, |_: &SessionKey, _: &IngressValue| ni += 1)
            .map(|()| ni);
        (e.unwrap_or_else(|_| g.egress.keys().count()), i.unwrap_or_else(|_| g.ingress.keys().count()))
    }

    /// Deletes both directions of the session `k` → `s` (ingress first, as upstream).
    pub fn delete(&self, k: &SessionKey, s: &NatSession) -> Result<(), Error> {
        let mut g = self.inner.lock().expect("sessions lock");
        delete_locked(&mut g, k, s)
    }

    /// Inserts (or overwrites) the egress sessions `entries` and their reverse entries with
    /// batched updates (4096 per syscall); returns how many sessions were written. For restores
    /// and benchmarks that need maps full of sessions quickly.
    ///
    /// Errors: [`Error::MapSyscall`] (e.g. `E2BIG` once `max_entries` is reached; the entries
    /// written before stay).
    pub fn insert_batch(&self, entries: &[(SessionKey, NatSession)]) -> Result<usize, Error> {
        use std::os::fd::AsFd;

        use aya::maps::IterableMap;
        let g = self.inner.lock().expect("sessions lock");
        let rev_keys: Vec<SessionKey> = entries.iter().map(|(k, s)| k.reverse(s.node_ip, s.node_port)).collect();
        let rev_values: Vec<IngressValue> = entries
            .iter()
            .map(|(k, _)| IngressValue { version: k.version, vm_ip: k.src_ip, vm_port: k.sport, _pad: [0; 3] })
            .collect();
        crate::batch::update(g.ingress.map().fd().as_fd(), &rev_keys, &rev_values, 4096)
            .map_err(|source| Error::MapSyscall { map: map::INGRESS_SESSIONS, op: "batch update", source })?;
        let keys: Vec<SessionKey> = entries.iter().map(|(k, _)| *k).collect();
        let values: Vec<NatSession> = entries.iter().map(|(_, s)| *s).collect();
        crate::batch::update(g.egress.map().fd().as_fd(), &keys, &values, 4096).map_err(|source| Error::MapSyscall {
            map: map::EGRESS_SESSIONS,
            op: "batch update",
            source,
        })
    }

    /// Deletes every session of the sandbox interface `ifindex` (one batched read of the egress
    /// map, batched deletes); returns how many. Release does not need it: unregistering makes
    /// the sessions dead in both directions and the reaper purges them (decision D19).
    pub fn delete_of(&self, ifindex: u32) -> Result<usize, Error> {
        use std::os::fd::AsFd;

        use aya::maps::IterableMap;
        let mut g = self.inner.lock().expect("sessions lock");
        let all: Vec<(SessionKey, NatSession)> = crate::batch::lookup_all(g.egress.map().fd().as_fd(), 4096)
            .map_err(|source| Error::MapSyscall { map: map::EGRESS_SESSIONS, op: "batch lookup", source })?;
        let victims: Vec<_> = all.into_iter().filter(|(_, s)| s.vm_ifindex == ifindex).collect();
        delete_batch_locked(&mut g, &victims, 4096)
    }
}

impl Sessions {
    /// Deletes every session whose remote address (the guest's original destination) lies in
    /// one of `list` (both directions, batched); returns how many. The agent calls it after
    /// writing the node's always-denied list (decision R30), so a flow opened while an address
    /// was not listed does not outlive the restart that lists it.
    pub fn delete_to(&self, list: &[crate::policy::Cidr]) -> Result<usize, Error> {
        use std::os::fd::AsFd;

        use aya::maps::IterableMap;
        if list.is_empty() {
            return Ok(0);
        }
        let covered = |ip: u32| {
            let host = u32::from_be(ip);
            list.iter().any(|c| host & c.mask() == c.first())
        };
        let mut g = self.inner.lock().expect("sessions lock");
        // Streamed: only the victims are kept (a full table is 1M sessions, ~60 MB as a Vec).
        let mut victims: Vec<(SessionKey, NatSession)> = Vec::new();
        crate::batch::for_each(g.egress.map().fd().as_fd(), 4096, |k: &SessionKey, v: &NatSession| {
            if covered(k.dst_ip) {
                victims.push((*k, *v));
            }
        })
        .map_err(|source| Error::MapSyscall { map: map::EGRESS_SESSIONS, op: "batch lookup", source })?;
        delete_batch_locked(&mut g, &victims, 4096)
    }
}

pub(crate) fn delete_locked(g: &mut SessionMaps, k: &SessionKey, s: &NatSession) -> Result<(), Error> {
    let ok = |r: Result<(), aya::maps::MapError>| match r {
        Ok(()) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e),
    };
    ok(g.ingress.remove(&k.reverse(s.node_ip, s.node_port))).map_err(Error::map(map::INGRESS_SESSIONS, "delete"))?;
    match g.egress.remove(k) {
        Ok(()) => g.closed([(k, s)]),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(Error::map(map::EGRESS_SESSIONS, "delete")(e)),
    }
}

/// Deletes both directions of every session of `victims` (key, value as read) with batched
/// deletes of `chunk` keys, ingress first, and counts the charged ones this delete removed in
/// `session_closed`; returns how many egress entries were removed.
pub(crate) fn delete_batch_locked(
    g: &mut SessionMaps,
    victims: &[(SessionKey, NatSession)],
    chunk: usize,
) -> Result<usize, Error> {
    use std::os::fd::AsFd;

    use aya::maps::IterableMap;
    let rev: Vec<SessionKey> = victims.iter().map(|(k, s)| k.reverse(s.node_ip, s.node_port)).collect();
    let keys: Vec<SessionKey> = victims.iter().map(|(k, _)| *k).collect();
    crate::batch::delete(g.ingress.map().fd().as_fd(), &rev, chunk).map_err(|source| Error::MapSyscall {
        map: map::INGRESS_SESSIONS,
        op: "batch delete",
        source,
    })?;
    let mut removed = Vec::with_capacity(victims.len());
    crate::batch::delete_with(g.egress.map().fd().as_fd(), &keys, chunk, |i| removed.push(i))
        .map_err(|source| Error::MapSyscall { map: map::EGRESS_SESSIONS, op: "batch delete", source })?;
    g.closed(removed.iter().map(|&i| (&victims[i].0, &victims[i].1)))?;
    Ok(removed.len())
}
