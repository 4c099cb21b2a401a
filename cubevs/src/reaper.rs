//! Session reaper: every interval, deletes both directions of sessions idle longer than
//! their state's timeout (`reference/upstream.md §3.5`; CLOCK_MONOTONIC ns, like
//! `bpf_ktime_get_ns`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use cubevs_common::{
    NatSession, SessionKey,
    conntrack::{tcp, timeout, udp},
    map, proto,
};

use crate::{Error, batch, sessions::Sessions};

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
    /// Wall time of the sweep.
    pub took: Duration,
}

/// Entries read or deleted per batch syscall.
const BATCH: usize = 4096;

/// Deletes every session idle longer than its timeout at `now_ns`: ingress entries first,
/// then egress (`reference/upstream.md §3.5`). Reads and deletes in batches of 4096.
pub fn sweep(sessions: &Sessions, t: &Timeouts, now_ns: u64) -> Result<SweepStats, Error> {
    use std::os::fd::AsFd;

    use aya::maps::IterableMap;

    let start = Instant::now();
    let g = sessions.inner.lock().expect("sessions lock");
    let egress_fd = g.egress.map().fd().as_fd();
    let ingress_fd = g.ingress.map().fd().as_fd();
    let all: Vec<(SessionKey, NatSession)> = batch::lookup_all(egress_fd, BATCH)
        .map_err(|source| Error::MapSyscall { map: map::EGRESS_SESSIONS, op: "batch lookup", source })?;
    let mut stats = SweepStats { scanned: all.len(), ..Default::default() };
    let mut egress_keys = Vec::new();
    let mut ingress_keys = Vec::new();
    for (k, s) in &all {
        if now_ns > s.access_ns.saturating_add(t.of(k.proto, s)) {
            if k.proto == proto::TCP && !matches!(s.state, tcp::CLOSE | tcp::TIME_WAIT) {
                stats.removed_open_tcp += 1;
            }
            ingress_keys.push(k.reverse(s.node_ip, s.node_port));
            egress_keys.push(*k);
        }
    }
    batch::delete(ingress_fd, &ingress_keys, BATCH).map_err(|source| Error::MapSyscall {
        map: map::INGRESS_SESSIONS,
        op: "batch delete",
        source,
    })?;
    stats.removed = batch::delete(egress_fd, &egress_keys, BATCH).map_err(|source| Error::MapSyscall {
        map: map::EGRESS_SESSIONS,
        op: "batch delete",
        source,
    })?;
    stats.took = start.elapsed();
    Ok(stats)
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
    stop: Arc<AtomicBool>,
    stats: Arc<ReaperStats>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Reaper {
    /// Sweeps `sessions` every `interval` (upstream: 5 s) with `timeouts`.
    pub fn spawn(sessions: Arc<Sessions>, interval: Duration, timeouts: Timeouts) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ReaperStats::default());
        let (s, st) = (stop.clone(), stats.clone());
        let thread = thread::Builder::new()
            .name("cubevs-reaper".into())
            .spawn(move || {
                let mut next = Instant::now() + interval;
                while !s.load(Ordering::Relaxed) {
                    if Instant::now() < next {
                        thread::sleep(Duration::from_millis(20).min(interval));
                        continue;
                    }
                    next = Instant::now() + interval;
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
                }
            })
            .expect("spawn reaper thread");
        Self { stop, stats, thread: Some(thread) }
    }

    /// Live counters.
    pub fn stats(&self) -> &ReaperStats {
        &self.stats
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
