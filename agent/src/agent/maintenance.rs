//! Pool refill and upkeep: TAP creation (warm-up and on demand), trimming surplus Ready TAPs,
//! and the maintenance pass.

use std::{
    net::Ipv4Addr,
    os::fd::OwnedFd,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
};

use std::time::{Duration, Instant};

use super::{Agent, AgentError, TapEntry, TapState, Transition, internal, lock};
use crate::host::{NewTap, tap_name};

/// Released TAPs an Ensure tries to reclaim before creating a TAP on demand.
pub(super) const RECLAIM_TRIES: usize = 2;
/// Longest an Ensure with no address left waits for a TAP the refill is creating (A38).
pub(super) const REFILL_WAIT: Duration = Duration::from_secs(2);
/// How often that wait looks at the pool.
const REFILL_POLL: Duration = Duration::from_millis(5);

impl Agent {
    /// Creates one pooled TAP: address, TAP, `from_cube`, baseline deny. Returns its name.
    /// The outcome is remembered for [`Agent::readiness`] (can the pool refill?).
    pub(super) fn create_tap(&self, owner: Option<&str>) -> Result<String, AgentError> {
        let r = self.create_tap_inner(owner);
        *lock(&self.refill_error) = r.as_ref().err().map(ToString::to_string);
        self.publish_readiness();
        r
    }

    fn create_tap_inner(&self, owner: Option<&str>) -> Result<String, AgentError> {
        let ip = {
            let mut inner = lock(&self.inner);
            // Every allocated address is a TAP (pooled or being created): the datapath's
            // interface capacity bounds them, checked in the same critical section as the
            // allocation so concurrent creations cannot overshoot it.
            let max = self.dp.max_interfaces();
            if inner.ipam.in_use() >= max {
                return Err(AgentError::Exhausted(format!(
                    "the datapath holds at most {max} sandbox interfaces and all are in use"
                )));
            }
            inner
                .ipam
                .allocate()
                .ok_or_else(|| AgentError::Exhausted(format!("no free address in {}", self.cfg.cidr)))?
        };
        let name = tap_name(ip);
        let phase = |p: &str, d: Duration| {
            self.metrics.tap_create_phase_seconds.with_label_values(&[p]).observe(d.as_secs_f64())
        };
        // The host cleans up a creation that fails (and never touches an interface it did
        // not make); after it succeeded, the TAP is ours to delete on a later failure.
        let NewTap { ifindex, fd, phases } = match self.host.create_tap(ip) {
            Ok(x) => x,
            Err(e) => {
                self.metrics.tap_create_failures.with_label_values(&["create"]).inc();
                lock(&self.inner).ipam.release(ip);
                return Err(internal(format!("create TAP {name}: {e}")));
            }
        };
        for (p, d) in phases {
            phase(p, d);
        }
        let made = (|| -> Result<(u32, OwnedFd), AgentError> {
            let t = Instant::now();
            let attached = self.dp.attach_sandbox(&name).inspect_err(|_| {
                self.metrics.tap_create_failures.with_label_values(&["attach"]).inc();
            })?;
            phase("attach", t.elapsed());
            if attached != ifindex {
                return Err(internal(format!("{name}: ifindex changed during creation")));
            }
            // A replace: whatever a previous owner of this ifindex left is purged with it.
            let t = Instant::now();
            self.baseline_policy(&name, ifindex).map_err(internal)?;
            phase("policy", t.elapsed());
            Ok((ifindex, fd))
        })();
        let made = made.and_then(|(ifindex, fd)| {
            let t = Instant::now();
            let state = if owner.is_some() { TapState::Active } else { TapState::Ready };
            let e = TapEntry::new(name.clone(), ip, ifindex, Some(Arc::new(fd)), state, owner.map(str::to_string));
            let r = self.transit(&mut lock(&self.inner), &name, Transition::Join(e)).map(drop).map_err(internal);
            phase("pool", t.elapsed());
            r
        });
        match made {
            Ok(()) => Ok(name),
            Err(e) => {
                let _ = self.dp.detach_sandbox(&name);
                let _ = self.host.delete_tap(&name);
                lock(&self.inner).ipam.release(ip);
                Err(e)
            }
        }
    }

    /// Creates Ready TAPs until `target` are Ready, `parallelism` at a time. Returns how many
    /// were created; stops early after repeated failures.
    pub fn warm(&self, target: usize, parallelism: usize) -> usize {
        // A full pool (every maintenance pass a call kicks, mostly) spawns no worker threads.
        if self.pool_counts()[&TapState::Ready] >= target {
            self.warmed.store(true, Ordering::Relaxed);
            self.publish_readiness();
            return 0;
        }
        let created = AtomicU32::new(0);
        let failures = AtomicU32::new(0);
        let reserved = Mutex::new(0usize);
        std::thread::scope(|s| {
            for _ in 0..parallelism.max(1) {
                s.spawn(|| {
                    loop {
                        // A refill above the low watermark yields to calls in flight (F15).
                        if self.upkeep_should_yield() {
                            return;
                        }
                        {
                            let ready = self.pool_counts()[&TapState::Ready];
                            let mut r = lock(&reserved);
                            if ready + *r >= target || failures.load(Ordering::Relaxed) >= 5 {
                                return;
                            }
                            *r += 1;
                        }
                        let res = self.create_tap(None);
                        *lock(&reserved) -= 1;
                        match res {
                            Ok(_) => {
                                created.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                failures.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!("warming the pool: {e}");
                            }
                        }
                    }
                });
            }
        });
        if self.pool_counts()[&TapState::Ready] >= target {
            self.warmed.store(true, Ordering::Relaxed);
            self.publish_readiness();
        }
        created.load(Ordering::Relaxed) as usize
    }

    /// Deletes Ready TAPs above `target` (the pool returns to its configured size after a
    /// burst of on-demand TAPs). Each surplus TAP is retired first (Cleaning, `retiring`: never
    /// handed out again, still listed) and leaves the pool only once it is gone from the node,
    /// so the pool lists every TAP the agent owns there; one whose deletion failed stays
    /// retiring and is retried by the next pass. Returns how many TAPs were deleted.
    pub fn trim(&self, target: usize) -> usize {
        let victims: Vec<(String, Ipv4Addr, u32)> = {
            let mut inner = lock(&self.inner);
            let extra = inner.pool.count(TapState::Ready).saturating_sub(target);
            // Last in name order first, so the warm set stays stable.
            let names: Vec<String> = inner.pool.names(TapState::Ready).rev().take(extra).cloned().collect();
            for n in names {
                let _ = self.transit(&mut inner, &n, Transition::Retire);
            }
            let retiring =
                inner.pool.names(TapState::Cleaning).filter_map(|n| inner.pool.get(n)).filter(|t| t.retiring());
            retiring.map(|t| (t.name.clone(), t.ip, t.ifindex)).collect()
        };
        let mut n = 0;
        for (name, ip, ifindex) in victims {
            let _ = self.dp.remove_policy(ifindex);
            let _ = self.dp.detach_sandbox(&name);
            if let Err(e) = self.host.delete_tap(&name) {
                tracing::warn!("trim {name} (stays retiring, retried next pass): {e}");
                continue;
            }
            let mut inner = lock(&self.inner);
            let _ = self.transit(&mut inner, &name, Transition::Remove);
            inner.ipam.release(ip);
            n += 1;
        }
        n
    }

    /// One maintenance pass, costing only the work there is: retry the Cleaning TAPs (for a
    /// TAP another process holds, that is one reopen attempt), then trim the pool to
    /// `tap_init_num` Ready TAPs and refill it. It walks no session or link table; datapath
    /// metrics are read when `/metrics` is scraped ([`Agent::refresh_datapath_metrics`]).
    pub fn maintain(&self) {
        self.maintain_pass(true);
    }

    /// [`Agent::maintain`], trimming the surplus only when `trim`. The maintenance loop trims
    /// only in a pass no call woke (the node idle for `maintenance_interval_secs`): under a
    /// stream of Ensure/Release bursts the TAPs a burst of Releases hands back are the next
    /// burst's pool, instead of being deleted and created again each time (decision F10).
    pub fn maintain_pass(&self, trim: bool) {
        self.finish_cleanups();
        let target = self.cfg.raw.tap_init_num;
        if trim {
            self.trim(target);
        }
        self.warm(target, self.cfg.raw.warm_parallelism);
    }

    /// Gives the first Ready TAP to sandbox `id` (Ready → Active). `None` when none is Ready.
    pub(super) fn acquire_ready(&self, id: &str) -> Result<Option<String>, AgentError> {
        let mut inner = lock(&self.inner);
        let name = inner.pool.first_ready().map(str::to_string);
        if let Some(n) = &name {
            self.transit(&mut inner, n, Transition::Acquire(id)).map_err(internal)?;
        }
        Ok(name)
    }

    /// With no Ready TAP and no address left to create one: while TAPs are being created
    /// (addresses allocated that no pool entry holds yet: the refill's creations in flight),
    /// waits up to [`REFILL_WAIT`] for one to join the pool Ready and gives it to `id` (A38).
    /// `None` when nothing is being created or nothing came in time: the caller's
    /// RESOURCE_EXHAUSTED stands.
    pub(super) fn await_refill(&self, id: &str) -> Result<Option<String>, AgentError> {
        let end = Instant::now() + REFILL_WAIT;
        loop {
            if let Some(n) = self.acquire_ready(id)? {
                return Ok(Some(n));
            }
            let in_flight = {
                let inner = lock(&self.inner);
                inner.ipam.in_use().saturating_sub(inner.pool.iter().count())
            };
            if in_flight == 0 || Instant::now() >= end {
                return Ok(None);
            }
            std::thread::sleep(REFILL_POLL);
        }
    }

    /// With no Ready TAP: runs the free check (one reopen of the queue) of up to
    /// [`RECLAIM_TRIES`] released TAPs (Cleaning, scrubbed, waiting for the maintenance pass)
    /// and gives the first that went Ready to `id`. A TAP a VMM still holds stays Cleaning,
    /// exactly as in the maintenance pass. This keeps an Ensure/Release storm from creating a
    /// new TAP per Ensure while the released ones wait for the pass (T2). `None` when none
    /// could be reclaimed.
    pub(super) fn reclaim_released(&self, id: &str) -> Result<Option<String>, AgentError> {
        let candidates: Vec<(String, std::net::Ipv4Addr)> = {
            let mut inner = lock(&self.inner);
            let listed: Vec<(String, std::net::Ipv4Addr)> = inner
                .pool
                .names(TapState::Cleaning)
                // Scrubbed: ownerless, never retiring or hands-off (the pool's invariants).
                .filter_map(|n| inner.pool.get(n).filter(|t| t.scrubbed() && !t.scrubbing()).map(|t| (n.clone(), t.ip)))
                .take(RECLAIM_TRIES)
                .collect();
            // Claimed here (scrubbing), in the section that chose them: concurrent Ensures
            // choose the next ones instead of failing on the same two and creating TAPs (T3).
            listed.into_iter().filter(|(n, _)| self.transit(&mut inner, n, Transition::BeginScrub).is_ok()).collect()
        };
        // One sock_diag dump for all of them (R72), not one per TAP.
        self.abort_node_sockets(&candidates);
        let mut got = None;
        for (n, _) in candidates {
            // Every claimed TAP is finished (Ready, or Cleaning for the next pass), even after
            // one went to `id`.
            if self.cleanup_claimed_sockets_aborted(&n) && got.is_none() {
                let mut inner = lock(&self.inner);
                // This one, unless another Ensure's `acquire_ready` took it meanwhile.
                let ready = inner.pool.get(&n).is_some_and(|t| t.state() == TapState::Ready);
                if ready && self.transit(&mut inner, &n, Transition::Acquire(id)).is_ok() {
                    got = Some(n);
                }
            }
        }
        match got {
            Some(n) => Ok(Some(n)),
            // Any Ready TAP will do (another Ensure may have reclaimed one).
            None => self.acquire_ready(id),
        }
    }

    /// Moves up to `max` TAPs from their warm-up filter to their tcx link (F5), each ~one
    /// RCU grace period under RTNL. Returns whether any is left. Runs between maintenance
    /// passes on the same task, so a trim never races a conversion of the TAP it deletes.
    pub fn convert_filters(&self, max: usize) -> bool {
        for i in 0..max {
            // At least one per turn, so a steady stream of calls cannot stall the conversions.
            if i > 0 && self.calls.busy() {
                break;
            }
            match self.dp.convert_next_filter() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => tracing::warn!("moving a TAP from its warm-up filter to tcx: {e}"),
            }
        }
        self.dp.filters_pending() > 0
    }

    /// Retries every Cleaning TAP no cleanup is running on: the scrub where it failed, and
    /// the free check (one reopen) of TAPs a Release scrubbed. Returns how many went Ready.
    pub fn finish_cleanups(&self) -> usize {
        // (name, mvm IP, scrubbed when listed).
        let cleaning: Vec<(String, std::net::Ipv4Addr, bool)> = {
            let inner = lock(&self.inner);
            inner
                .pool
                .names(TapState::Cleaning)
                .filter_map(|n| {
                    inner
                        .pool
                        .get(n)
                        .filter(|t| !t.scrubbing() && !t.retiring())
                        .map(|t| (n.clone(), t.ip, t.scrubbed()))
                })
                .collect()
        };
        // The node's sockets to every scrubbed one's address in one sock_diag dump (R72); a TAP
        // whose scrub is still to be done aborts its own after it.
        let scrubbed: Vec<(String, std::net::Ipv4Addr)> =
            cleaning.iter().filter(|(_, _, s)| *s).map(|(n, ip, _)| (n.clone(), *ip)).collect();
        self.abort_node_sockets(&scrubbed);
        // Stops early for a call in flight while the pool is above its low watermark (F15);
        // the call's kick brings the loop back for the rest.
        cleaning
            .into_iter()
            .take_while(|_| !self.upkeep_should_yield())
            .filter(
                |(n, _, scrubbed)| {
                    if *scrubbed { self.cleanup_tap_sockets_aborted(n) } else { self.cleanup_tap(n) }
                },
            )
            .count()
    }
}
