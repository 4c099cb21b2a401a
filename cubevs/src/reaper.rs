//! Session reaper: every interval, deletes both directions of sessions idle longer than
//! their state's timeout (`reference/upstream.md §3.5`; CLOCK_MONOTONIC ns, like
//! `bpf_ktime_get_ns`) and of sessions whose sandbox version is no longer registered on their
//! interface (released or reused TAPs, decision D19) in the same batched pass.
//!
//! Deletes of expired sessions are compare-and-delete (decision D23): a victim is re-read just
//! before it is deleted and kept when its value changed since the scan (a guest reopened it in
//! place, a packet advanced its state or refreshed it). The residual race is the time between
//! that re-read and the batched delete of its chunk ([`CONFIRM_CHUNK`] lookups, ~0.1 ms idle):
//! a packet landing on the session in that window can still lose it. Stale-version sessions
//! are deleted as read, without the re-read: no packet can change them any more (the datapath
//! drops their packets in both directions), unless the very same (interface, version) is
//! registered again between the scan and the delete.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use cubevs_common::{
    MvmMeta, NatSession, SessionKey,
    conntrack::{tcp, timeout, udp},
    map, proto,
};

use crate::{
    Error, batch,
    periodic::Periodic,
    sessions::{Sessions, delete_batch_locked},
};

/// Upstream's sweep interval: 5 s.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// Idle timeouts per state, in nanoseconds. [`Default`] is upstream's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// SYN_SENT, SYN_RECV, SYN_SENT2, CLOSE_WAIT.
    pub tcp_syn: u64,
    /// ESTABLISHED.
    pub tcp_established: u64,
    /// FIN_WAIT, and TIME_WAIT when the remote closed first.
    pub tcp_fin_wait: u64,
    /// TIME_WAIT when the guest closed first.
    pub tcp_time_wait_active: u64,
    /// LAST_ACK.
    pub tcp_last_ack: u64,
    /// CLOSE (and NONE).
    pub tcp_close: u64,
    /// UDP without reply.
    pub udp_unreplied: u64,
    /// UDP replied.
    pub udp_replied: u64,
    /// ICMP echo.
    pub icmp: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            tcp_syn: timeout::TCP_SYN,
            tcp_established: timeout::TCP_ESTABLISHED,
            tcp_fin_wait: timeout::TCP_FIN_WAIT,
            tcp_time_wait_active: timeout::TCP_TIME_WAIT_ACTIVE,
            tcp_last_ack: timeout::TCP_LAST_ACK,
            tcp_close: timeout::TCP_CLOSE,
            udp_unreplied: timeout::UDP_UNREPLIED,
            udp_replied: timeout::UDP_REPLIED,
            icmp: timeout::ICMP,
        }
    }
}

impl Timeouts {
    /// Every timeout set to `d` (tests).
    pub fn uniform(d: Duration) -> Self {
        let n = d.as_nanos() as u64;
        Self {
            tcp_syn: n,
            tcp_established: n,
            tcp_fin_wait: n,
            tcp_time_wait_active: n,
            tcp_last_ack: n,
            tcp_close: n,
            udp_unreplied: n,
            udp_replied: n,
            icmp: n,
        }
    }

    /// Timeout of a session of protocol `p`.
    pub fn of(&self, p: u8, s: &NatSession) -> u64 {
        match p {
            proto::TCP => match s.state {
                tcp::SYN_SENT | tcp::SYN_RECV | tcp::SYN_SENT2 | tcp::CLOSE_WAIT => self.tcp_syn,
                tcp::ESTABLISHED => self.tcp_established,
                tcp::FIN_WAIT => self.tcp_fin_wait,
                tcp::TIME_WAIT if s.active_close != 0 => self.tcp_time_wait_active,
                tcp::TIME_WAIT => self.tcp_fin_wait,
                tcp::LAST_ACK => self.tcp_last_ack,
                _ => self.tcp_close,
            },
            proto::UDP if s.state == udp::REPLIED => self.udp_replied,
            proto::UDP => self.udp_unreplied,
            _ => self.icmp,
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds (the clock of `bpf_ktime_get_ns`).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Outcome of one sweep.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Egress sessions examined.
    pub scanned: usize,
    /// Sessions removed (both directions each).
    pub removed: usize,
    /// Expired TCP sessions that were not CLOSE/TIME_WAIT (idle established flows).
    pub removed_open_tcp: usize,
    /// Victims whose sandbox version is no longer registered on their interface.
    pub stale: usize,
    /// Victims kept because their value changed between the scan and the delete.
    pub changed: usize,
    /// Wall time of the sweep.
    pub took: Duration,
}

/// Sessions a sweep decided to remove, as they were read.
#[derive(Clone, Debug, Default)]
pub struct Victims {
    /// (key, value as read) of each expired victim: removed by [`remove_unchanged`].
    pub entries: Vec<(SessionKey, NatSession)>,
    /// (key, value as read) of each stale-version victim: removed by [`remove_stale`].
    pub stale_entries: Vec<(SessionKey, NatSession)>,
    /// Egress sessions examined.
    pub scanned: usize,
    /// How many victims are stale-version (`stale_entries.len()`).
    pub stale: usize,
    /// Expired TCP sessions that were not CLOSE/TIME_WAIT.
    pub open_tcp: usize,
    /// Registrations `{ifindex → version}` read before the scan (`None` without access):
    /// [`sweep`] collects the budget entries of versions registered neither then nor after.
    pub registered: Option<std::collections::HashMap<u32, u32>>,
}

/// Entries read or deleted per batch syscall.
const BATCH: usize = 4096;
/// Victims re-read before each batched delete: bounds the compare-and-delete race window.
pub const CONFIRM_CHUNK: usize = 256;

/// Reads the registrations `{ifindex → version}` (one batched read), or `None` when the
/// sessions were built without access to them.
fn registrations(g: &crate::sessions::SessionMaps) -> Result<Option<std::collections::HashMap<u32, u32>>, Error> {
    use std::os::fd::AsFd;
    let Some(fd) = &g.registrations else { return Ok(None) };
    let mut m = std::collections::HashMap::new();
    batch::for_each(fd.as_fd(), 1024, |i: &u32, meta: &MvmMeta| {
        m.insert(*i, meta.version);
    })
    .map_err(|source| Error::MapSyscall { map: map::IFINDEX_TO_MVMMETA, op: "batch lookup", source })?;
    Ok(Some(m))
}

/// Scans the sessions (batched reads, keeping only candidates: memory is O(victims), not
/// O(sessions)): victims are sessions idle longer than their timeout at `now_ns`, and sessions
/// whose (interface, version) is registered neither before nor after the scan (so a sandbox
/// registered during the scan cannot make its new sessions look stale).
pub fn victims(sessions: &Sessions, t: &Timeouts, now_ns: u64) -> Result<Victims, Error> {
    use std::os::fd::AsFd;

    use aya::maps::IterableMap;

    let g = sessions.inner.lock().expect("sessions lock");
    let before = registrations(&g)?;
    let mut v = Victims::default();
    let mut maybe_stale = Vec::new();
    batch::for_each(g.egress.map().fd().as_fd(), BATCH, |k: &SessionKey, s: &NatSession| {
        v.scanned += 1;
        if before.as_ref().is_some_and(|r| r.get(&s.vm_ifindex) != Some(&k.version)) {
            maybe_stale.push((*k, *s));
        } else if now_ns > s.access_ns.saturating_add(t.of(k.proto, s)) {
            if k.proto == proto::TCP && !matches!(s.state, tcp::CLOSE | tcp::TIME_WAIT) {
                v.open_tcp += 1;
            }
            v.entries.push((*k, *s));
        }
    })
    .map_err(|source| Error::MapSyscall { map: map::EGRESS_SESSIONS, op: "batch lookup", source })?;
    let after = registrations(&g)?;
    drop(g);
    for (k, s) in maybe_stale {
        if after.as_ref().is_some_and(|r| r.get(&s.vm_ifindex) != Some(&k.version)) {
            v.stale_entries.push((k, s));
        } else if now_ns > s.access_ns.saturating_add(t.of(k.proto, &s)) {
            if k.proto == proto::TCP && !matches!(s.state, tcp::CLOSE | tcp::TIME_WAIT) {
                v.open_tcp += 1;
            }
            v.entries.push((k, s));
        }
    }
    v.stale = v.stale_entries.len();
    v.registered = before;
    Ok(v)
}

/// Deletes both directions (ingress first, as upstream) of every victim whose egress value
/// is still exactly the one read; returns (removed, changed). Victims are confirmed
/// [`CONFIRM_CHUNK`] at a time, each chunk deleted with batched syscalls right after.
pub fn remove_unchanged(sessions: &Sessions, victims: &[(SessionKey, NatSession)]) -> Result<(usize, usize), Error> {
    let mut g = sessions.inner.lock().expect("sessions lock");
    let (mut removed, mut changed) = (0, 0);
    let mut confirmed = Vec::with_capacity(CONFIRM_CHUNK);
    for chunk in victims.chunks(CONFIRM_CHUNK) {
        confirmed.clear();
        for (k, s) in chunk {
            match g.egress.get(k, 0) {
                Ok(now) if now == *s => confirmed.push((*k, *s)),
                // Gone already (another deleter) or changed since the scan: keep.
                Ok(_) => changed += 1,
                Err(e) if crate::error::is_not_found(&e) => {}
                Err(e) => return Err(Error::map(map::EGRESS_SESSIONS, "lookup")(e)),
            }
        }
        removed += delete_batch_locked(&mut g, &confirmed, BATCH)?;
    }
    Ok((removed, changed))
}

/// Deletes both directions of the stale-version `victims` with batched deletes, without
/// re-reading them (see the module docs); returns how many were removed.
pub fn remove_stale(sessions: &Sessions, victims: &[(SessionKey, NatSession)]) -> Result<usize, Error> {
    let mut g = sessions.inner.lock().expect("sessions lock");
    delete_batch_locked(&mut g, victims, BATCH)
}

/// One pass: [`victims`], then [`remove_stale`] and [`remove_unchanged`].
pub fn sweep(sessions: &Sessions, t: &Timeouts, now_ns: u64) -> Result<SweepStats, Error> {
    let start = Instant::now();
    let v = victims(sessions, t, now_ns)?;
    let stale_removed = remove_stale(sessions, &v.stale_entries)?;
    let (removed, changed) = remove_unchanged(sessions, &v.entries)?;
    let removed = removed + stale_removed;
    // Budget entries of released versions (decision Q3): collected once their version is
    // registered neither before the scan nor now.
    {
        let mut g = sessions.inner.lock().expect("sessions lock");
        let now_registered = registrations(&g)?;
        if let (Some(before), Some(after), Some(q)) = (&v.registered, &now_registered, &mut g.quota) {
            q.collect(before, after)?;
        }
    }
    // The floor's ceiling from the registrations now (decision Q4): also corrects a count
    // another process sharing the pins left behind.
    sessions.refresh_floor()?;
    Ok(SweepStats {
        scanned: v.scanned,
        removed,
        removed_open_tcp: v.open_tcp,
        stale: v.stale,
        changed,
        took: start.elapsed(),
    })
}

/// Counters of a running reaper.
#[derive(Debug, Default)]
pub struct ReaperStats {
    /// Sweeps done.
    pub runs: AtomicU64,
    /// Sessions removed in total.
    pub removed: AtomicU64,
    /// Sweeps that failed.
    pub errors: AtomicU64,
    /// Sessions seen by the last sweep.
    pub last_scanned: AtomicU64,
}

/// A background reaper thread; stopped on drop.
#[derive(Debug)]
pub struct Reaper {
    stats: Arc<ReaperStats>,
    _thread: Periodic,
}

impl Reaper {
    /// Sweeps `sessions` every `interval` (upstream: 5 s) with `timeouts`.
    pub fn spawn(sessions: Arc<Sessions>, interval: Duration, timeouts: Timeouts) -> Self {
        let stats = Arc::new(ReaperStats::default());
        let st = stats.clone();
        let thread = Periodic::spawn("cubevs-reaper", interval, move || {
            match sweep(&sessions, &timeouts, monotonic_ns()) {
                Ok(r) => {
                    st.removed.fetch_add(r.removed as u64, Ordering::Relaxed);
                    st.last_scanned.store(r.scanned as u64, Ordering::Relaxed);
                    if r.removed_open_tcp > 0 {
                        log::debug!("reaper removed {} idle open TCP sessions", r.removed_open_tcp);
                    }
                }
                Err(e) => {
                    st.errors.fetch_add(1, Ordering::Relaxed);
                    log::warn!("session reaper: {e}");
                }
            }
            st.runs.fetch_add(1, Ordering::Relaxed);
        });
        Self { stats, _thread: thread }
    }

    /// Live counters.
    pub fn stats(&self) -> &ReaperStats {
        &self.stats
    }
}
