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

use super::{Agent, AgentError, TapEntry, TapState, Transition, internal, lock};
use crate::host::tap_name;

impl Agent {
    /// Creates one pooled TAP: address, TAP, `from_cube`, baseline deny. Returns its name.
    pub(super) fn create_tap(&self, owner: Option<&str>) -> Result<String, AgentError> {
        let ip = lock(&self.inner)
            .ipam
            .allocate()
            .ok_or_else(|| AgentError::Exhausted(format!("no free address in {}", self.cfg.cidr)))?;
        let name = tap_name(ip);
        let made = (|| -> Result<(u32, OwnedFd), AgentError> {
            let (ifindex, fd) = self.host.create_tap(ip).map_err(|e| {
                self.metrics.tap_create_failures.with_label_values(&["create"]).inc();
                internal(format!("create TAP {name}: {e}"))
            })?;
            let attached = self.dp.attach_sandbox(&name).inspect_err(|_| {
                self.metrics.tap_create_failures.with_label_values(&["attach"]).inc();
            })?;
            if attached != ifindex {
                return Err(internal(format!("{name}: ifindex changed during creation")));
            }
            // A replace: whatever a previous owner of this ifindex left is purged with it.
            self.dp.install_default_deny(ifindex)?;
            Ok((ifindex, fd))
        })();
        let made = made.and_then(|(ifindex, fd)| {
            let state = if owner.is_some() { TapState::Active } else { TapState::Ready };
            let e = TapEntry::new(name.clone(), ip, ifindex, Some(Arc::new(fd)), state, owner.map(str::to_string));
            self.transit(&mut lock(&self.inner), &name, Transition::Join(e)).map(drop).map_err(internal)
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
        let created = AtomicU32::new(0);
        let failures = AtomicU32::new(0);
        let reserved = Mutex::new(0usize);
        std::thread::scope(|s| {
            for _ in 0..parallelism.max(1) {
                s.spawn(|| {
                    loop {
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
        }
        created.load(Ordering::Relaxed) as usize
    }

    /// Deletes Ready TAPs above `target` (the pool returns to its configured size after a
    /// burst of on-demand TAPs).
    pub fn trim(&self, target: usize) -> usize {
        let victims: Vec<(String, Ipv4Addr, u32)> = {
            let mut inner = lock(&self.inner);
            let extra = inner.pool.count(TapState::Ready).saturating_sub(target);
            // Last in name order first, so the warm set stays stable.
            let names: Vec<String> = inner.pool.names(TapState::Ready).rev().take(extra).cloned().collect();
            let mut out = Vec::new();
            for n in names {
                if let Ok(Some(t)) = self.transit(&mut inner, &n, Transition::Retire) {
                    out.push((t.name, t.ip, t.ifindex));
                }
            }
            out
        };
        let n = victims.len();
        for (name, ip, ifindex) in victims {
            let _ = self.dp.remove_policy(ifindex);
            let _ = self.dp.detach_sandbox(&name);
            if let Err(e) = self.host.delete_tap(&name) {
                tracing::warn!("trim {name}: {e}");
            }
            lock(&self.inner).ipam.release(ip);
        }
        n
    }

    /// One maintenance pass: retry Cleaning TAPs (those held by a process are only retried
    /// once free), then trim the pool to `tap_init_num` Ready TAPs and refill it.
    pub fn maintain(&self) {
        let cleaning: Vec<String> = lock(&self.inner).pool.names(TapState::Cleaning).cloned().collect();
        if !cleaning.is_empty() {
            let held: std::collections::HashSet<String> = self
                .host
                .list_taps()
                .map(|l| l.into_iter().filter(|t| t.lower_up).map(|t| t.name).collect())
                .unwrap_or_default();
            for n in cleaning {
                let has_fd = lock(&self.inner).pool.get(&n).is_some_and(|t| t.fd.is_some());
                if !has_fd && held.contains(&n) {
                    continue;
                }
                self.cleanup_tap(&n);
            }
        }
        let target = self.cfg.raw.tap_init_num;
        self.trim(target);
        self.warm(target, self.cfg.raw.warm_parallelism);
        if let Ok(c) = self.dp.counters() {
            for (k, v) in &c {
                self.metrics.datapath.with_label_values(&[k.as_str()]).set(*v as i64);
            }
            if let Some(r) = c.get("reaper_runs") {
                self.metrics.reaper_runs.set(*r as i64);
            }
        }
        if let Ok(s) = self.dp.sessions() {
            self.metrics.sessions.set(s.len() as i64);
        }
    }
}
