//! The service core. Synchronous and thread-safe; the gRPC, fd and HTTP front ends call it
//! through `spawn_blocking`. One file per job:
//!
//! - [`pool`]: the TAP pool state (Ready / Active / Cleaning);
//! - `service`: Ensure / Release / Reconcile / Get / List and the fd handoff lookup;
//! - `cleanup`: scrubbing a TAP for reuse;
//! - `recovery`: startup reconciliation of state files, TAPs and maps;
//! - `maintenance`: TAP creation, pool refill and trim, the maintenance pass;
//! - this file: the types, the [`Agent`] and its read-only views.
//!
//! Locking: one per-sandbox mutex serialises Ensure/Release/Reconcile of an id (concurrent
//! Ensures of one id make one network, `reference/upstream.md §8.4`); a short global mutex
//! guards the pool, IPAM, host ports and the Active map. Kernel and datapath calls run without
//! the global mutex held.

use std::{
    collections::{BTreeMap, HashMap},
    net::Ipv4Addr,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
};

use serde::Serialize;

use crate::{
    config::{Validated, mac_string},
    dataplane::{Dataplane, DataplaneError, EgressPolicy, Proto},
    host::Host,
    ipam::Ipam,
    metrics::Metrics,
    ports::PortAllocator,
    state::{PortRecord, SandboxRecord, StateStore},
};

mod cleanup;
mod maintenance;
pub mod pool;
mod recovery;
mod service;

pub use pool::TapState;
use pool::{Pool, PoolError, TapEntry, Transition};
pub use recovery::RecoverySummary;

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
    pool: Pool,
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

impl Agent {
    /// An agent with an empty pool. Call [`Agent::recover`] before serving.
    pub fn new(cfg: Arc<Validated>, host: Arc<dyn Host>, dp: Arc<dyn Dataplane>, store: StateStore) -> Self {
        let reserved = std::fs::read_to_string(&cfg.raw.reserved_ports_file)
            .map(|s| crate::ports::parse_reserved(&s))
            .unwrap_or_default();
        let inner = Inner {
            pool: Pool::default(),
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

    /// Applies one pool transition (the only way a TAP changes state or owner) and refreshes
    /// the pool gauges.
    fn transit(&self, inner: &mut Inner, name: &str, t: Transition<'_>) -> Result<Option<TapEntry>, PoolError> {
        let r = inner.pool.transition(name, t);
        if r.is_ok() {
            for s in TapState::ALL {
                self.metrics.pool.with_label_values(&[&format!("{s:?}")]).set(inner.pool.count(s) as i64);
            }
        }
        r
    }

    /// Counts by state.
    pub fn pool_counts(&self) -> BTreeMap<TapState, usize> {
        let inner = lock(&self.inner);
        TapState::ALL.into_iter().map(|s| (s, inner.pool.count(s))).collect()
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

    // ---------------------------------------------------------------- listing

    /// Every TAP, sorted by state then name (`GET /v1/network/taps`).
    pub fn taps(&self) -> Vec<TapInfo> {
        let inner = lock(&self.inner);
        let mut v: Vec<_> = inner
            .pool
            .iter()
            .map(|t| {
                let owner = t.owner().unwrap_or_default().to_string();
                let rec = t.owner().and_then(|o| inner.sandboxes.get(o));
                let active = t.state() == TapState::Active;
                TapInfo {
                    sandbox_id: if active { owner.clone() } else { String::new() },
                    network_handle: if active { owner.clone() } else { String::new() },
                    tap_name: t.name.clone(),
                    tap_ifindex: t.ifindex,
                    sandbox_ip: t.ip.to_string(),
                    state: t.state(),
                    owner_sandbox_id: owner,
                    retry_count: t.retry_count(),
                    last_error: t.last_error().unwrap_or_default().to_string(),
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
}

#[cfg(test)]
mod tests;
