//! The service core: TAP pool (Ready / Active / Cleaning), Ensure / Release / Reconcile /
//! Get / List, fd handoff lookups, recovery and maintenance. Synchronous and thread-safe; the
//! gRPC, fd and HTTP front ends call it through `spawn_blocking`.
//!
//! Locking: one per-sandbox mutex serialises Ensure/Release/Reconcile of an id (concurrent
//! Ensures of one id make one network, `reference/upstream.md §8.4`); a short global mutex
//! guards the pool, IPAM, host ports and the Active map. Kernel and datapath calls run without
//! the global mutex held.

use std::{
    collections::{BTreeMap, HashMap},
    net::Ipv4Addr,
    os::fd::{AsFd, OwnedFd},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Instant,
};

use serde::Serialize;

use crate::{
    config::{Validated, mac_string},
    dataplane::{Dataplane, DataplaneError, EgressPolicy, PortMapping, Proto, SandboxEntry, validate_policy},
    host::{Host, LiveTap, tap_name},
    ipam::Ipam,
    metrics::Metrics,
    ports::{PortAllocator, PortError},
    state::{Phase, PortRecord, SandboxRecord, StateStore, validate_sandbox_id},
};

/// Errors of the service, mapped to gRPC codes by the front end.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A request field is invalid (`INVALID_ARGUMENT`).
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// Field name as in the gRPC request.
        field: String,
        /// Why.
        reason: String,
    },
    /// Unknown sandbox (`NOT_FOUND`).
    #[error("network {0:?} not found")]
    NotFound(String),
    /// Out of TAPs, addresses or ports (`RESOURCE_EXHAUSTED`).
    #[error("{0}")]
    Exhausted(String),
    /// The sandbox's previous network is still being cleaned (`UNAVAILABLE`; retry).
    #[error("{0}")]
    Busy(String),
    /// Anything else (`INTERNAL`).
    #[error("{0}")]
    Internal(String),
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> AgentError {
    AgentError::Invalid { field: field.into(), reason: reason.into() }
}

fn internal(e: impl std::fmt::Display) -> AgentError {
    AgentError::Internal(e.to_string())
}

impl From<DataplaneError> for AgentError {
    fn from(e: DataplaneError) -> Self {
        match e {
            DataplaneError::Invalid { field, reason } => AgentError::Invalid { field, reason },
            other => AgentError::Internal(other.to_string()),
        }
    }
}

/// Pool state of a TAP (`reference/upstream.md §2.4`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum TapState {
    /// Unowned, baseline deny installed, no sandbox state.
    Ready,
    /// Owned by a sandbox.
    Active,
    /// Being scrubbed for reuse; failures stay here and the maintenance loop retries.
    Cleaning,
}

#[derive(Debug)]
struct TapEntry {
    name: String,
    ip: Ipv4Addr,
    ifindex: u32,
    state: TapState,
    owner: Option<String>,
    /// The agent's queue fd (None for an adopted Active TAP until first needed).
    fd: Option<Arc<OwnedFd>>,
    retry_count: u32,
    last_error: Option<String>,
    /// A cleanup of this TAP is running (only one at a time: a second one could capture the
    /// next owner and delete its state).
    scrubbing: bool,
}

/// One TAP as listed by `GET /v1/network/taps` (upstream field names, §1.2).
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TapInfo {
    /// Owner sandbox id ("" when Ready).
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Network handle (= sandbox id).
    pub network_handle: String,
    /// TAP name.
    pub tap_name: String,
    /// ifindex.
    #[serde(rename = "tapIfIndex")]
    pub tap_ifindex: u32,
    /// mvm IP.
    #[serde(rename = "sandboxIP")]
    pub sandbox_ip: String,
    /// `Ready` / `Active` / `Cleaning`.
    pub state: TapState,
    /// Owner while Active/Cleaning.
    #[serde(rename = "ownerSandboxID")]
    pub owner_sandbox_id: String,
    /// Cleanup retries.
    pub retry_count: u32,
    /// Last cleanup error.
    pub last_error: String,
    /// Port mappings of the owner.
    pub port_mappings: Vec<PortRecord>,
}

/// A requested port mapping (before host-port assignment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortRequest {
    /// Protocol.
    pub proto: Proto,
    /// Guest port, 1–65535.
    pub container_port: u16,
    /// 0 = assign.
    pub host_port: u16,
    /// Echoed host IP.
    pub host_ip: String,
}

/// Validates and normalises raw mapping fields (`protocol` "" / "tcp" / "udp", ports as u32)
/// of `port_mappings[i]`.
pub fn parse_port_request(
    i: usize,
    protocol: &str,
    container: u32,
    host: u32,
    host_ip: &str,
) -> Result<PortRequest, AgentError> {
    let f = |n: &str| format!("port_mappings[{i}].{n}");
    let proto = match protocol.to_ascii_lowercase().as_str() {
        "" | "tcp" => Proto::Tcp,
        "udp" => Proto::Udp,
        other => return Err(invalid(f("protocol"), format!("{other:?} is not tcp or udp"))),
    };
    if container == 0 || container > 65535 {
        return Err(invalid(f("container_port"), format!("{container} is outside 1..65535")));
    }
    if host > 65535 {
        return Err(invalid(f("host_port"), format!("{host} is above 65535")));
    }
    if !host_ip.is_empty() && host_ip.parse::<Ipv4Addr>().is_err() {
        return Err(invalid(f("host_ip"), format!("{host_ip:?} is not an IPv4 address")));
    }
    Ok(PortRequest { proto, container_port: container as u16, host_port: host as u16, host_ip: host_ip.to_string() })
}

/// A validated Ensure request.
#[derive(Clone, Debug, Default)]
pub struct EnsureRequest {
    /// Sandbox id.
    pub sandbox_id: String,
    /// Mappings.
    pub ports: Vec<PortRequest>,
    /// `cubevs_context`; `None` = allow internet, no lists.
    pub policy: Option<EgressPolicy>,
    /// Caller's persist_metadata.
    pub persist_metadata: BTreeMap<String, String>,
}

/// The guest-facing description of a sandbox network (`reference/upstream.md §2.1`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NetworkView {
    /// The record.
    pub record: SandboxRecord,
    /// Guest MAC.
    pub mac: String,
    /// `169.254.68.6/30`.
    pub ip_cidr: String,
    /// Guest gateway.
    pub gateway: Ipv4Addr,
    /// Gateway MAC.
    pub gateway_mac: String,
    /// MTU.
    pub mtu: u32,
}

#[derive(Debug)]
struct Inner {
    taps: BTreeMap<String, TapEntry>,
    sandboxes: HashMap<String, SandboxRecord>,
    ipam: Ipam,
    ports: PortAllocator,
}

/// The agent.
pub struct Agent {
    cfg: Arc<Validated>,
    host: Arc<dyn Host>,
    dp: Arc<dyn Dataplane>,
    store: StateStore,
    inner: Mutex<Inner>,
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    version: AtomicU32,
    /// Metrics.
    pub metrics: Metrics,
    warmed: AtomicBool,
    started: AtomicBool,
    /// Wakes the maintenance loop (after Ensure: refill; after Release: trim).
    pub kick: tokio::sync::Notify,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Reads queued frames off a TAP fd without blocking (at most 1024), so a reused TAP starts
/// empty. Uses `poll(…, 0)` so the shared file status flags are not changed.
fn drain(fd: &OwnedFd) -> usize {
    let mut buf = vec![0u8; 65536 + 12];
    let mut n = 0;
    while n < 1024 {
        let mut pfd = [nix::poll::PollFd::new(fd.as_fd(), nix::poll::PollFlags::POLLIN)];
        match nix::poll::poll(&mut pfd, nix::poll::PollTimeout::ZERO) {
            Ok(1) => {}
            _ => break,
        }
        if nix::unistd::read(fd, &mut buf).is_err() {
            break;
        }
        n += 1;
    }
    n
}

impl Agent {
    /// An agent with an empty pool. Call [`Agent::recover`] before serving.
    pub fn new(cfg: Arc<Validated>, host: Arc<dyn Host>, dp: Arc<dyn Dataplane>, store: StateStore) -> Self {
        let reserved = std::fs::read_to_string(&cfg.raw.reserved_ports_file)
            .map(|s| crate::ports::parse_reserved(&s))
            .unwrap_or_default();
        let inner = Inner {
            taps: BTreeMap::new(),
            sandboxes: HashMap::new(),
            ipam: Ipam::new(cfg.cidr),
            ports: PortAllocator::new(cfg.port_range.0, cfg.port_range.1, &reserved),
        };
        Self {
            cfg,
            host,
            dp,
            store,
            inner: Mutex::new(inner),
            locks: Mutex::new(HashMap::new()),
            version: AtomicU32::new(1),
            metrics: Metrics::new(),
            warmed: AtomicBool::new(false),
            started: AtomicBool::new(false),
            kick: tokio::sync::Notify::new(),
        }
    }

    fn sandbox_lock(&self, id: &str) -> Arc<Mutex<()>> {
        lock(&self.locks).entry(id.to_string()).or_default().clone()
    }

    fn forget_lock(&self, id: &str) {
        let mut l = lock(&self.locks);
        if l.get(id).is_some_and(|a| Arc::strong_count(a) == 1) {
            l.remove(id);
        }
    }

    fn next_version(&self) -> u32 {
        self.version.fetch_add(1, Ordering::Relaxed)
    }

    /// Builds the guest view of a record.
    pub fn view(&self, rec: &SandboxRecord) -> NetworkView {
        let raw = &self.cfg.raw;
        NetworkView {
            record: rec.clone(),
            mac: mac_string(self.cfg.mvm_mac),
            ip_cidr: format!("{}/{}", raw.mvm_inner_ip, raw.mvm_mask),
            gateway: raw.mvm_gw_dest_ip,
            gateway_mac: mac_string(self.cfg.gw_mac),
            mtu: raw.mtu,
        }
    }

    fn update_pool_gauges(&self, inner: &Inner) {
        let mut c = [0i64; 3];
        for t in inner.taps.values() {
            c[t.state as usize] += 1;
        }
        self.metrics.pool.with_label_values(&["Ready"]).set(c[0]);
        self.metrics.pool.with_label_values(&["Active"]).set(c[1]);
        self.metrics.pool.with_label_values(&["Cleaning"]).set(c[2]);
    }

    /// Counts by state.
    pub fn pool_counts(&self) -> BTreeMap<TapState, usize> {
        let inner = lock(&self.inner);
        let mut m = BTreeMap::from([(TapState::Ready, 0), (TapState::Active, 0), (TapState::Cleaning, 0)]);
        for t in inner.taps.values() {
            *m.entry(t.state).or_default() += 1;
        }
        m
    }

    /// Readiness: recovered, warmed once and the pool at its target. `Err` says why not.
    pub fn readiness(&self) -> Result<(), String> {
        if !self.started.load(Ordering::Relaxed) {
            return Err("recovery not finished".into());
        }
        if !self.warmed.load(Ordering::Relaxed) {
            let ready = self.pool_counts()[&TapState::Ready];
            return Err(format!("warming TAP pool: {ready}/{} ready", self.cfg.raw.tap_init_num));
        }
        Ok(())
    }

    /// Marks startup complete (servers up).
    pub fn set_started(&self) {
        self.started.store(true, Ordering::Relaxed);
    }

    // ---------------------------------------------------------------- TAP creation

    /// Creates one pooled TAP: address, TAP, `from_cube`, baseline deny. Returns its name.
    fn create_tap(&self, owner: Option<&str>) -> Result<String, AgentError> {
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
        match made {
            Ok((ifindex, fd)) => {
                let mut inner = lock(&self.inner);
                inner.taps.insert(
                    name.clone(),
                    TapEntry {
                        name: name.clone(),
                        ip,
                        ifindex,
                        state: if owner.is_some() { TapState::Active } else { TapState::Ready },
                        owner: owner.map(str::to_string),
                        fd: Some(Arc::new(fd)),
                        retry_count: 0,
                        last_error: None,
                        scrubbing: false,
                    },
                );
                self.update_pool_gauges(&inner);
                Ok(name)
            }
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
            let ready: Vec<_> =
                inner.taps.values().filter(|t| t.state == TapState::Ready).map(|t| t.name.clone()).collect();
            let extra = ready.len().saturating_sub(target);
            // Newest (highest address) first, so the warm set stays stable.
            let mut out = Vec::new();
            for n in ready.into_iter().rev().take(extra) {
                let t = inner.taps.remove(&n).expect("listed");
                out.push((t.name, t.ip, t.ifindex));
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
        self.update_pool_gauges(&lock(&self.inner));
        n
    }

    // ---------------------------------------------------------------- Ensure

    /// EnsureNetwork: idempotent per sandbox id; on failure nothing is left behind.
    pub fn ensure(&self, req: EnsureRequest) -> Result<NetworkView, AgentError> {
        let t0 = Instant::now();
        let r = self.ensure_inner(req);
        self.kick.notify_one();
        self.metrics.ensure_seconds.observe(t0.elapsed().as_secs_f64());
        self.metrics.ensure.with_label_values(&[if r.is_ok() { "ok" } else { "error" }]).inc();
        r
    }

    fn ensure_inner(&self, req: EnsureRequest) -> Result<NetworkView, AgentError> {
        validate_sandbox_id(&req.sandbox_id).map_err(|r| invalid("sandbox_id", r))?;
        let mut seen = std::collections::HashSet::new();
        for (i, p) in req.ports.iter().enumerate() {
            if p.host_port != 0 && !seen.insert((p.proto, p.host_port)) {
                return Err(invalid(
                    format!("port_mappings[{i}].host_port"),
                    format!("{} requested twice", p.host_port),
                ));
            }
            if p.host_port != 0 && (p.host_port < self.cfg.port_range.0 || p.host_port > self.cfg.port_range.1) {
                return Err(invalid(
                    format!("port_mappings[{i}].host_port"),
                    format!("{} is outside host_port_range {}", p.host_port, self.cfg.raw.host_port_range),
                ));
            }
        }
        let policy = req.policy.clone().unwrap_or(EgressPolicy { allow_internet_access: true, ..Default::default() });
        validate_policy("cubevs_context.", &policy)?;

        let id = req.sandbox_id.clone();
        let guard = self.sandbox_lock(&id);
        let _g = lock(&guard);
        {
            let inner = lock(&self.inner);
            if let Some(rec) = inner.sandboxes.get(&id) {
                return Ok(self.view(rec));
            }
            if let Some(t) = inner.taps.values().find(|t| t.owner.as_deref() == Some(id.as_str())) {
                return Err(AgentError::Busy(format!(
                    "the previous network of {id:?} ({}) is still being cleaned; retry later",
                    t.name
                )));
            }
        }

        // 1. A TAP: first Ready one, else on demand.
        let picked = {
            let mut inner = lock(&self.inner);
            let name = inner.taps.values().find(|t| t.state == TapState::Ready).map(|t| t.name.clone());
            if let Some(n) = &name {
                let t = inner.taps.get_mut(n).expect("found");
                t.state = TapState::Active;
                t.owner = Some(id.clone());
                self.update_pool_gauges(&inner);
            }
            name
        };
        let name = match picked {
            Some(n) => n,
            None => self.create_tap(Some(&id))?,
        };
        let (ip, ifindex) = {
            let inner = lock(&self.inner);
            let t = &inner.taps[&name];
            (t.ip, t.ifindex)
        };

        // 2. Host ports.
        let mut records = Vec::new();
        {
            let mut inner = lock(&self.inner);
            for (i, p) in req.ports.iter().enumerate() {
                match inner.ports.claim(&id, p.host_port) {
                    Ok(hp) => records.push(PortRecord {
                        proto: p.proto,
                        container_port: p.container_port,
                        host_port: hp,
                        host_ip: p.host_ip.clone(),
                    }),
                    Err(e) => {
                        inner.ports.release_owner(&id);
                        drop(inner);
                        self.return_unprogrammed(&name);
                        return Err(match e {
                            PortError::Exhausted(..) => AgentError::Exhausted(e.to_string()),
                            _ => invalid(format!("port_mappings[{i}].host_port"), e.to_string()),
                        });
                    }
                }
            }
        }

        // 3. Intent, then datapath, then commit.
        let mut meta = req.persist_metadata.clone();
        meta.insert("sandbox_ip".into(), ip.to_string());
        meta.insert("host_tap_name".into(), name.clone());
        meta.insert("mvm_inner_ip".into(), self.cfg.raw.mvm_inner_ip.to_string());
        meta.insert("gateway_ip".into(), self.cfg.gateway_ip().to_string());
        let rec = SandboxRecord {
            sandbox_id: id.clone(),
            tap_name: name.clone(),
            tap_ifindex: ifindex,
            sandbox_ip: ip,
            version: self.next_version(),
            port_mappings: records,
            policy,
            persist_metadata: meta,
        };
        if let Err(e) = self.store.write(&rec, Phase::Creating) {
            lock(&self.inner).ports.release_owner(&id);
            self.return_unprogrammed(&name);
            return Err(internal(format!("write state of {id}: {e}")));
        }
        let programmed = (|| -> Result<(), AgentError> {
            for p in &rec.port_mappings {
                self.dp.add_port_mapping(&PortMapping {
                    proto: p.proto,
                    host_port: p.host_port,
                    ifindex,
                    guest_port: p.container_port,
                })?;
            }
            self.dp.replace_policy(ifindex, &rec.policy)?;
            self.dp.register_sandbox(&SandboxEntry { ifindex, ip, version: rec.version, id: id.clone() })?;
            self.store.advance(&id, Phase::Creating, Phase::Success).map_err(|e| internal(format!("commit {id}: {e}")))
        })();
        if let Err(e) = programmed {
            tracing::warn!(sandbox = %id, "ensure failed, rolling back: {e}");
            if let Some(t) = lock(&self.inner).taps.get_mut(&name) {
                t.state = TapState::Cleaning;
            }
            self.cleanup_tap(&name);
            return Err(e);
        }
        lock(&self.inner).sandboxes.insert(id.clone(), rec.clone());
        Ok(self.view(&rec))
    }

    /// Puts a TAP that was taken for `owner` but never programmed back to Ready.
    fn return_unprogrammed(&self, name: &str) {
        let mut inner = lock(&self.inner);
        if let Some(t) = inner.taps.get_mut(name) {
            t.state = TapState::Ready;
            t.owner = None;
        }
        self.update_pool_gauges(&inner);
    }

    // ---------------------------------------------------------------- Release / cleanup

    /// ReleaseNetwork: idempotent (unknown ids report released). The TAP goes through
    /// Cleaning back to Ready; a failed cleanup stays Cleaning for the maintenance loop.
    pub fn release(&self, sandbox_id: &str) -> Result<bool, AgentError> {
        let t0 = Instant::now();
        let r = self.release_inner(sandbox_id);
        self.kick.notify_one();
        self.metrics.release_seconds.observe(t0.elapsed().as_secs_f64());
        self.metrics.release.with_label_values(&[if r.is_ok() { "ok" } else { "error" }]).inc();
        r
    }

    fn release_inner(&self, id: &str) -> Result<bool, AgentError> {
        validate_sandbox_id(id).map_err(|r| invalid("sandbox_id", r))?;
        let guard = self.sandbox_lock(id);
        let _g = lock(&guard);
        let rec = lock(&self.inner).sandboxes.remove(id);
        let Some(rec) = rec else {
            // Durable leftovers only (e.g. an earlier failure): clean the state.
            let _ = self.store.remove(id);
            drop(_g);
            self.forget_lock(id);
            return Ok(true);
        };
        self.store.write(&rec, Phase::Deleting).map_err(|e| internal(format!("mark {id} deleting: {e}")))?;
        {
            let mut inner = lock(&self.inner);
            if let Some(t) = inner.taps.get_mut(&rec.tap_name) {
                t.state = TapState::Cleaning;
            }
            self.update_pool_gauges(&inner);
        }
        self.cleanup_tap(&rec.tap_name);
        drop(_g);
        self.forget_lock(id);
        Ok(true)
    }

    /// Scrubs a TAP for reuse (`reference/upstream.md §2.4` order): drain queued frames,
    /// remove port maps, sandbox entry (verified gone) and policy, make sure the agent holds a
    /// usable fd (never reopening one a VMM still holds), install the baseline deny, delete the
    /// owner's state, free its ports, mark Ready. On error the TAP stays Cleaning with the
    /// error recorded. Returns whether it reached Ready.
    ///
    /// Only a TAP in Cleaning is scrubbed, and only by one caller at a time: a maintenance pass
    /// racing a Release must not scrub the TAP again after it went Ready and was handed to the
    /// next sandbox.
    pub fn cleanup_tap(&self, name: &str) -> bool {
        let (ifindex, owner, fd) = {
            let mut inner = lock(&self.inner);
            let Some(t) = inner.taps.get_mut(name) else { return false };
            if t.state != TapState::Cleaning || t.scrubbing {
                return false;
            }
            t.scrubbing = true;
            let r = (t.ifindex, t.owner.clone(), t.fd.clone());
            self.update_pool_gauges(&inner);
            r
        };
        let res = (|| -> Result<(), String> {
            let fd = match fd {
                Some(fd) => fd,
                None => {
                    let fd = Arc::new(
                        self.host
                            .reopen_tap(name)
                            .map_err(|e| format!("reopen {name}: {e} (a process still holds it; left untouched)"))?,
                    );
                    if let Some(t) = lock(&self.inner).taps.get_mut(name) {
                        t.fd = Some(fd.clone());
                    }
                    fd
                }
            };
            drain(&fd);
            // Unregister first: from then on the datapath drops the old sandbox's packets in
            // both directions and its sessions are dead; the reaper purges them in its next
            // batched pass (decision D19), so Release costs O(1) in sessions.
            self.dp.unregister_sandbox(ifindex).map_err(|e| e.to_string())?;
            self.dp.delete_port_mappings_of(ifindex).map_err(|e| e.to_string())?;
            if self.dp.sandbox(ifindex).map_err(|e| e.to_string())?.is_some() {
                return Err(format!("{name}: sandbox entry still present after unregister"));
            }
            if self.dp.port_mappings().map_err(|e| e.to_string())?.iter().any(|m| m.ifindex == ifindex) {
                return Err(format!("{name}: port mappings still present after delete"));
            }
            // One atomic replace by the baseline deny (no window without policy).
            self.dp.install_default_deny(ifindex).map_err(|e| e.to_string())?;
            if let Some(o) = &owner {
                self.store.remove(o).map_err(|e| format!("remove state of {o}: {e}"))?;
            }
            Ok(())
        })();
        let mut inner = lock(&self.inner);
        if let Some(t) = inner.taps.get_mut(name) {
            t.scrubbing = false;
        }
        match res {
            Ok(()) => {
                if let Some(o) = &owner {
                    inner.ports.release_owner(o);
                    inner.sandboxes.remove(o);
                }
                if let Some(t) = inner.taps.get_mut(name) {
                    t.state = TapState::Ready;
                    t.owner = None;
                    t.retry_count = 0;
                    t.last_error = None;
                }
                self.update_pool_gauges(&inner);
                true
            }
            Err(e) => {
                tracing::warn!("cleanup of {name} failed (stays Cleaning): {e}");
                if let Some(t) = inner.taps.get_mut(name) {
                    t.retry_count += 1;
                    t.last_error = Some(e);
                }
                false
            }
        }
    }

    // ---------------------------------------------------------------- Get / List / Reconcile

    /// GetNetwork.
    pub fn get(&self, sandbox_id: &str) -> Result<NetworkView, AgentError> {
        validate_sandbox_id(sandbox_id).map_err(|r| invalid("sandbox_id", r))?;
        lock(&self.inner)
            .sandboxes
            .get(sandbox_id)
            .map(|r| self.view(r))
            .ok_or_else(|| AgentError::NotFound(sandbox_id.to_string()))
    }

    /// ListNetworks, sorted by sandbox id.
    pub fn list(&self) -> Vec<SandboxRecord> {
        let mut v: Vec<_> = lock(&self.inner).sandboxes.values().cloned().collect();
        v.sort_by(|a, b| a.sandbox_id.cmp(&b.sandbox_id));
        v
    }

    /// ReconcileNetwork: re-asserts attachment, registration, port maps and (when given) the
    /// policy of a live sandbox.
    pub fn reconcile(&self, sandbox_id: &str, policy: Option<EgressPolicy>) -> Result<NetworkView, AgentError> {
        validate_sandbox_id(sandbox_id).map_err(|r| invalid("sandbox_id", r))?;
        if let Some(p) = &policy {
            validate_policy("cubevs_context.", p)?;
        }
        let guard = self.sandbox_lock(sandbox_id);
        let _g = lock(&guard);
        let mut rec = lock(&self.inner)
            .sandboxes
            .get(sandbox_id)
            .cloned()
            .ok_or_else(|| AgentError::NotFound(sandbox_id.to_string()))?;
        if let Some(p) = policy {
            self.dp.replace_policy(rec.tap_ifindex, &p)?;
            rec.policy = p;
            self.store.write(&rec, Phase::Success).map_err(internal)?;
        }
        self.converge(&rec)?;
        lock(&self.inner).sandboxes.insert(sandbox_id.to_string(), rec.clone());
        Ok(self.view(&rec))
    }

    /// Makes the datapath match a committed record without disturbing what already matches.
    fn converge(&self, rec: &SandboxRecord) -> Result<(), AgentError> {
        let ifindex = self.dp.attach_sandbox(&rec.tap_name)?;
        if ifindex != rec.tap_ifindex {
            return Err(internal(format!("{}: ifindex {} != recorded {}", rec.tap_name, ifindex, rec.tap_ifindex)));
        }
        let want = SandboxEntry { ifindex, ip: rec.sandbox_ip, version: rec.version, id: rec.sandbox_id.clone() };
        match self.dp.sandbox(ifindex)? {
            Some(e) if e == want => {}
            Some(e) if e.id != rec.sandbox_id => {
                return Err(internal(format!(
                    "{}: datapath registers sandbox {:?}, state says {:?}",
                    rec.tap_name, e.id, rec.sandbox_id
                )));
            }
            _ => {
                self.dp.replace_policy(ifindex, &rec.policy)?;
                self.dp.register_sandbox(&want)?;
            }
        }
        let mut have: Vec<_> = self.dp.port_mappings()?.into_iter().filter(|m| m.ifindex == ifindex).collect();
        let mut wanted: Vec<_> = rec
            .port_mappings
            .iter()
            .map(|p| PortMapping { proto: p.proto, host_port: p.host_port, ifindex, guest_port: p.container_port })
            .collect();
        have.sort_by_key(|m| (m.proto, m.host_port));
        wanted.sort_by_key(|m| (m.proto, m.host_port));
        if have != wanted {
            self.dp.delete_port_mappings_of(ifindex)?;
            for m in &wanted {
                self.dp.add_port_mapping(m)?;
            }
        }
        if self.dp.policy(ifindex)?.is_none() {
            self.dp.replace_policy(ifindex, &rec.policy)?;
        }
        Ok(())
    }

    // ---------------------------------------------------------------- fd handoff

    /// A duplicate of the queue fd of `tap_name` for `sandbox_id` (`reference/upstream.md
    /// §1.3`): only an Active TAP owned by a committed sandbox. `Ok(None)` = no such TAP or
    /// not this sandbox's (errCode 1002); `Err` = anything else (errCode -1). An empty name
    /// means "the sandbox's TAP".
    pub fn tap_fd(&self, tap_name: &str, sandbox_id: &str) -> Result<Option<OwnedFd>, String> {
        let (name, fd) = {
            let inner = lock(&self.inner);
            let Some(rec) = inner.sandboxes.get(sandbox_id) else { return Ok(None) };
            if !tap_name.is_empty() && rec.tap_name != tap_name {
                return Ok(None);
            }
            let Some(t) = inner.taps.get(&rec.tap_name) else { return Ok(None) };
            if t.state != TapState::Active || t.owner.as_deref() != Some(sandbox_id) {
                return Ok(None);
            }
            (t.name.clone(), t.fd.clone())
        };
        let fd = match fd {
            Some(fd) => fd,
            None => {
                // Adopted after a restart: open lazily; EBUSY means a VMM holds it (no reopen).
                let fd = Arc::new(self.host.reopen_tap(&name).map_err(|e| format!("open {name}: {e}"))?);
                if let Some(t) = lock(&self.inner).taps.get_mut(&name) {
                    t.fd = Some(fd.clone());
                }
                fd
            }
        };
        fd.try_clone().map(Some).map_err(|e| format!("dup fd of {name}: {e}"))
    }

    // ---------------------------------------------------------------- listing

    /// Every TAP, sorted by state then name (`GET /v1/network/taps`).
    pub fn taps(&self) -> Vec<TapInfo> {
        let inner = lock(&self.inner);
        let mut v: Vec<_> = inner
            .taps
            .values()
            .map(|t| {
                let owner = t.owner.clone().unwrap_or_default();
                let rec = t.owner.as_ref().and_then(|o| inner.sandboxes.get(o));
                TapInfo {
                    sandbox_id: if t.state == TapState::Active { owner.clone() } else { String::new() },
                    network_handle: if t.state == TapState::Active { owner.clone() } else { String::new() },
                    tap_name: t.name.clone(),
                    tap_ifindex: t.ifindex,
                    sandbox_ip: t.ip.to_string(),
                    state: t.state,
                    owner_sandbox_id: owner,
                    retry_count: t.retry_count,
                    last_error: t.last_error.clone().unwrap_or_default(),
                    port_mappings: rec.map(|r| r.port_mappings.clone()).unwrap_or_default(),
                }
            })
            .collect();
        v.sort_by(|a, b| (a.state, &a.tap_name).cmp(&(b.state, &b.tap_name)));
        v
    }

    /// The datapath handle (CLI dumps).
    pub fn dataplane(&self) -> &Arc<dyn Dataplane> {
        &self.dp
    }

    /// Host ports held by sandboxes.
    pub fn host_ports_in_use(&self) -> usize {
        lock(&self.inner).ports.in_use()
    }

    // ---------------------------------------------------------------- recovery

    /// Reconciles state files × live TAPs × datapath maps at startup.
    ///
    /// - `success` record + live TAP: adopted Active; the TAP is never reopened, and the
    ///   datapath is only touched where it disagrees with the record.
    /// - `creating` / `deleting` record + live TAP: cleaned back to Ready.
    /// - live TAP without record: cleaned to Ready unless some process holds it (`LOWER_UP`),
    ///   in which case it stays Cleaning, untouched, until it is released.
    /// - record without TAP: its map entries and state are removed.
    ///
    /// Refuses (error) on unreadable state files and on conflicting identities (two records
    /// claiming one TAP or address, a record whose TAP name and address disagree, or a TAP
    /// whose ifindex or datapath registration names another sandbox).
    pub fn recover(&self) -> Result<RecoverySummary, AgentError> {
        let (records, bad) =
            self.store.scan().map_err(|e| internal(format!("scan {}: {e}", self.store.dir().display())))?;
        if !bad.is_empty() {
            let list: Vec<_> = bad.iter().map(|(p, m)| format!("{}: {m}", p.display())).collect();
            return Err(internal(format!("unreadable state files, refusing to start: {}", list.join("; "))));
        }
        let live = self.host.list_taps().map_err(|e| internal(format!("list TAPs: {e}")))?;
        let live_by_name: HashMap<&str, &LiveTap> = live.iter().map(|t| (t.name.as_str(), t)).collect();

        // Identity checks.
        let mut by_tap: HashMap<&str, &SandboxRecord> = HashMap::new();
        let mut by_ip: HashMap<Ipv4Addr, &SandboxRecord> = HashMap::new();
        for (_, r) in &records {
            if tap_name(r.sandbox_ip) != r.tap_name {
                return Err(internal(format!(
                    "conflicting identity: state of {:?} names TAP {} but address {}; refusing to start",
                    r.sandbox_id, r.tap_name, r.sandbox_ip
                )));
            }
            if let Some(o) = by_tap.insert(&r.tap_name, r) {
                return Err(internal(format!(
                    "conflicting identity: sandboxes {:?} and {:?} both claim TAP {}; refusing to start",
                    o.sandbox_id, r.sandbox_id, r.tap_name
                )));
            }
            if let Some(o) = by_ip.insert(r.sandbox_ip, r) {
                return Err(internal(format!(
                    "conflicting identity: sandboxes {:?} and {:?} both claim {}; refusing to start",
                    o.sandbox_id, r.sandbox_id, r.sandbox_ip
                )));
            }
            if let Some(t) = live_by_name.get(r.tap_name.as_str())
                && t.ifindex != r.tap_ifindex
            {
                return Err(internal(format!(
                    "conflicting identity: {} has ifindex {} but the state of {:?} records {}; refusing to start",
                    r.tap_name, t.ifindex, r.sandbox_id, r.tap_ifindex
                )));
            }
            if let Some(t) = live_by_name.get(r.tap_name.as_str())
                && let Some(e) = self.dp.sandbox(t.ifindex)?
                && e.id != r.sandbox_id
            {
                return Err(internal(format!(
                    "conflicting identity: the datapath registers {:?} on {} but the state says {:?}; refusing to start",
                    e.id, r.tap_name, r.sandbox_id
                )));
            }
        }
        let max_version = records
            .iter()
            .map(|(_, r)| r.version)
            .chain(self.dp.sandboxes()?.iter().map(|e| e.version))
            .chain(self.dp.sessions()?.iter().map(|x| x.version))
            .max()
            .unwrap_or(0);
        // Versions only grow, also across restarts where records were deleted: mix in time.
        let seed = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs()
            as u32)
            .max(max_version.saturating_add(1));
        self.version.store(seed, Ordering::Relaxed);

        let mut summary = RecoverySummary::default();
        let mut to_clean = Vec::new();
        for t in &live {
            if self.cfg.cidr.index_of(t.ip).is_none() {
                tracing::warn!("{} is outside {}; left alone", t.name, self.cfg.cidr);
                summary.foreign += 1;
                continue;
            }
            let rec = records.iter().find(|(_, r)| r.tap_name == t.name);
            let mut inner = lock(&self.inner);
            inner.ipam.assign(t.ip);
            let mut entry = TapEntry {
                name: t.name.clone(),
                ip: t.ip,
                ifindex: t.ifindex,
                state: TapState::Cleaning,
                owner: None,
                fd: None,
                retry_count: 0,
                last_error: None,
                scrubbing: false,
            };
            match rec {
                Some((Phase::Success, r)) => {
                    entry.state = TapState::Active;
                    entry.owner = Some(r.sandbox_id.clone());
                    for p in &r.port_mappings {
                        inner.ports.reclaim(&r.sandbox_id, p.host_port);
                    }
                    inner.sandboxes.insert(r.sandbox_id.clone(), r.clone());
                    inner.taps.insert(t.name.clone(), entry);
                    drop(inner);
                    self.converge(r)?;
                    summary.adopted += 1;
                }
                Some((_, r)) => {
                    entry.owner = Some(r.sandbox_id.clone());
                    inner.taps.insert(t.name.clone(), entry);
                    to_clean.push(t.name.clone());
                }
                None if t.lower_up => {
                    entry.last_error = Some("held by another process and no state: left untouched".into());
                    inner.taps.insert(t.name.clone(), entry);
                    summary.held += 1;
                }
                None => {
                    inner.taps.insert(t.name.clone(), entry);
                    to_clean.push(t.name.clone());
                }
            }
        }
        for name in to_clean {
            // Orphans and pool TAPs of the previous run: re-attach (adopts the pinned link).
            if let Err(e) = self.dp.attach_sandbox(&name) {
                tracing::warn!("re-attach {name}: {e}");
            }
            if self.cleanup_tap(&name) {
                summary.cleaned += 1;
            }
        }
        for (_, r) in &records {
            if !live_by_name.contains_key(r.tap_name.as_str()) {
                let _ = self.dp.delete_port_mappings_of(r.tap_ifindex);
                if self.dp.sandbox(r.tap_ifindex)?.is_some_and(|e| e.id == r.sandbox_id) {
                    self.dp.unregister_sandbox(r.tap_ifindex)?;
                }
                self.store.remove(&r.sandbox_id).map_err(internal)?;
                summary.stale_records += 1;
            }
        }
        self.update_pool_gauges(&lock(&self.inner));
        Ok(summary)
    }

    /// One maintenance pass: retry Cleaning TAPs (those held by a process are only retried
    /// once free), then trim the pool to `tap_init_num` Ready TAPs and refill it.
    pub fn maintain(&self) {
        let cleaning: Vec<String> =
            lock(&self.inner).taps.values().filter(|t| t.state == TapState::Cleaning).map(|t| t.name.clone()).collect();
        if !cleaning.is_empty() {
            let held: std::collections::HashSet<String> = self
                .host
                .list_taps()
                .map(|l| l.into_iter().filter(|t| t.lower_up).map(|t| t.name).collect())
                .unwrap_or_default();
            for n in cleaning {
                let has_fd = lock(&self.inner).taps.get(&n).is_some_and(|t| t.fd.is_some());
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

/// What recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RecoverySummary {
    /// Active sandboxes adopted.
    pub adopted: usize,
    /// TAPs scrubbed back to Ready.
    pub cleaned: usize,
    /// TAPs held by an unknown process, left untouched.
    pub held: usize,
    /// Records without TAP removed.
    pub stale_records: usize,
    /// TAPs outside the CIDR, ignored.
    pub foreign: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::Config, dataplane::FakeDataplane, host::FakeHost};

    struct Fixture {
        agent: Agent,
        dp: Arc<FakeDataplane>,
        host: Arc<FakeHost>,
        dir: std::path::PathBuf,
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn fixture(tag: &str) -> Fixture {
        let dir = std::env::temp_dir().join(format!("cubenet-agent-unit-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = Config {
            cidr: "10.9.0.0/24".into(),
            tap_init_num: 2,
            state_dir: dir.clone(),
            reserved_ports_file: "/nonexistent".into(),
            ..Config::default()
        };
        let cfg = Arc::new(cfg.validate().unwrap());
        let dp = Arc::new(FakeDataplane::default());
        let host = Arc::new(FakeHost::default());
        let h = host.clone();
        *dp.resolver.lock().unwrap() = Some(Box::new(move |n| h.taps.lock().unwrap().get(n).map(|t| t.ifindex)));
        let store = StateStore::open(&dir).unwrap();
        let agent = Agent::new(cfg, host.clone(), dp.clone(), store);
        Fixture { agent, dp, host, dir }
    }

    fn req(id: &str) -> EnsureRequest {
        EnsureRequest {
            sandbox_id: id.into(),
            ports: vec![parse_port_request(0, "", 80, 0, "").unwrap()],
            policy: Some(EgressPolicy {
                allow_internet_access: false,
                allow_out: vec!["1.1.1.1/32".into()],
                deny_out: vec![],
            }),
            persist_metadata: BTreeMap::new(),
        }
    }

    #[test]
    fn ensure_release_reuse() {
        let f = fixture("reuse");
        f.agent.recover().unwrap();
        assert_eq!(f.agent.warm(2, 2), 2);
        assert!(f.agent.readiness().is_err(), "not started yet");
        f.agent.set_started();
        f.agent.readiness().unwrap();

        let v = f.agent.ensure(req("sb-1")).unwrap();
        let r = &v.record;
        assert_eq!(r.tap_name, "z10.9.0.2");
        assert_eq!(r.port_mappings[0].host_port, 20000);
        assert_eq!(r.persist_metadata["sandbox_ip"], "10.9.0.2");
        assert_eq!(r.persist_metadata["gateway_ip"], "10.9.0.1");
        assert_eq!(v.ip_cidr, "169.254.68.6/30");
        // Idempotent.
        assert_eq!(f.agent.ensure(req("sb-1")).unwrap(), v);
        assert_eq!(f.dp.sandbox(r.tap_ifindex).unwrap().unwrap().id, "sb-1");
        assert_eq!(f.dp.port_mappings().unwrap().len(), 1);
        assert!(f.agent.tap_fd(&r.tap_name, "sb-1").unwrap().is_some());
        assert!(f.agent.tap_fd(&r.tap_name, "other").unwrap().is_none());
        assert!(f.agent.tap_fd("z10.9.0.3", "sb-1").unwrap().is_none());

        // A stray cleanup (e.g. a maintenance pass that raced a Release) never scrubs an
        // Active TAP or touches its owner's state.
        assert!(!f.agent.cleanup_tap(&r.tap_name));
        assert_eq!(f.agent.store.count(), 1);
        assert_eq!(f.agent.pool_counts()[&TapState::Active], 1);
        assert!(f.agent.release("sb-1").unwrap());
        assert!(f.agent.release("sb-1").unwrap(), "release is idempotent");
        assert!(f.dp.sandbox(r.tap_ifindex).unwrap().is_none());
        assert!(f.dp.port_mappings().unwrap().is_empty());
        let p = f.dp.policy(r.tap_ifindex).unwrap().unwrap();
        assert!(p.allow.is_empty() && p.deny.contains(&"0.0.0.0/0".to_string()), "baseline deny back: {p:?}");
        assert_eq!(f.agent.store.count(), 0);
        assert_eq!(f.agent.host_ports_in_use(), 0);
        assert!(matches!(f.agent.get("sb-1"), Err(AgentError::NotFound(_))));

        // Reuse: same TAP, new version, none of the old policy.
        let v2 = f.agent.ensure(EnsureRequest { sandbox_id: "sb-2".into(), ..Default::default() }).unwrap();
        assert_eq!(v2.record.tap_name, r.tap_name);
        assert!(v2.record.version > r.version);
        let p = f.dp.policy(r.tap_ifindex).unwrap().unwrap();
        assert!(p.allow.is_empty() && !p.deny.contains(&"0.0.0.0/0".to_string()), "{p:?}");
    }

    #[test]
    fn failed_ensure_leaves_nothing() {
        let f = fixture("rollback");
        f.agent.recover().unwrap();
        f.agent.warm(1, 1);
        f.dp.fail_register.store(true, Ordering::Relaxed);
        assert!(f.agent.ensure(req("sb-x")).is_err());
        assert_eq!(f.agent.store.count(), 0);
        assert!(f.dp.port_mappings().unwrap().is_empty());
        assert_eq!(f.agent.host_ports_in_use(), 0);
        assert_eq!(f.agent.pool_counts()[&TapState::Ready], 1);
        assert!(f.agent.list().is_empty());
    }

    #[test]
    fn failed_cleanup_stays_cleaning_and_is_retried() {
        let f = fixture("retry");
        f.agent.recover().unwrap();
        f.agent.warm(1, 1);
        let v = f.agent.ensure(req("sb-r")).unwrap();
        f.dp.fail_delete_ports.store(true, Ordering::Relaxed);
        assert!(f.agent.release("sb-r").unwrap());
        assert_eq!(f.agent.pool_counts()[&TapState::Cleaning], 1);
        let t = f.agent.taps().into_iter().find(|t| t.tap_name == v.record.tap_name).unwrap();
        assert_eq!((t.retry_count, t.last_error.contains("injected")), (1, true), "{t:?}");
        assert_eq!(f.agent.store.count(), 1, "the deleting record stays until cleanup succeeds");
        // The same id cannot be ensured while its old network is still being cleaned.
        assert!(matches!(f.agent.ensure(req("sb-r")), Err(AgentError::Busy(_))));
        f.dp.fail_delete_ports.store(false, Ordering::Relaxed);
        f.agent.maintain();
        assert_eq!(f.agent.pool_counts()[&TapState::Cleaning], 0);
        assert_eq!(f.agent.store.count(), 0);
        assert_eq!(f.agent.host_ports_in_use(), 0);
        assert!(f.dp.port_mappings().unwrap().is_empty());
        f.agent.ensure(req("sb-r")).unwrap();
    }

    #[test]
    fn invalid_fields_are_named() {
        let f = fixture("invalid");
        let e = f.agent.ensure(EnsureRequest { sandbox_id: "a/b".into(), ..Default::default() }).unwrap_err();
        assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "sandbox_id"), "{e}");
        let mut r = req("ok");
        r.policy = Some(EgressPolicy { allow_out: vec!["nope".into()], ..Default::default() });
        let e = f.agent.ensure(r).unwrap_err();
        assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "cubevs_context.allow_out[0]"), "{e}");
        let e = parse_port_request(3, "sctp", 80, 0, "").unwrap_err();
        assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "port_mappings[3].protocol"), "{e}");
        let e = parse_port_request(0, "tcp", 0, 0, "").unwrap_err();
        assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "port_mappings[0].container_port"), "{e}");
        let mut r = req("ok2");
        r.ports = vec![parse_port_request(0, "tcp", 80, 80, "").unwrap()];
        let e = f.agent.ensure(r).unwrap_err();
        assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "port_mappings[0].host_port"), "{e}");
    }

    #[test]
    fn recovery_adopts_and_cleans() {
        let f = fixture("recover");
        f.agent.recover().unwrap();
        f.agent.warm(2, 1);
        let v = f.agent.ensure(req("sb-1")).unwrap();
        // A second agent over the same host, datapath and state directory.
        let store = StateStore::open(&f.dir).unwrap();
        let cfg = f.agent.cfg.clone();
        let a2 = Agent::new(cfg, f.host.clone(), f.dp.clone(), store);
        let s = a2.recover().unwrap();
        assert_eq!(s.adopted, 1);
        assert_eq!(s.cleaned, 1);
        assert_eq!(a2.get("sb-1").unwrap(), v);
        assert_eq!(a2.pool_counts()[&TapState::Active], 1);
        assert_eq!(a2.host_ports_in_use(), 1);
        // A conflicting record makes recovery refuse.
        let mut bad = v.record.clone();
        bad.sandbox_id = "sb-evil".into();
        a2.store.write(&bad, Phase::Success).unwrap();
        let a3 = Agent::new(f.agent.cfg.clone(), f.host.clone(), f.dp.clone(), StateStore::open(&f.dir).unwrap());
        let e = a3.recover().unwrap_err().to_string();
        assert!(e.contains("conflicting identity"), "{e}");
    }
}
