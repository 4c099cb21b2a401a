//! The service core. Synchronous and thread-safe; the gRPC, fd and HTTP front ends call it
//! through `spawn_blocking`. One file per job:
//!
//! - [`pool`]: the TAP pool state (Ready / Active / Cleaning);
//! - `service`: Ensure / Release / Reconcile / Get / List and the fd handoff lookup;
//! - `cleanup`: scrubbing a TAP for reuse and waiting until nobody else holds it;
//! - `locks`: the per-sandbox lock map;
//! - `recovery`: startup reconciliation of state files, TAPs and maps;
//! - `maintenance`: TAP creation, pool refill and trim, the maintenance pass;
//! - `transfer`: the pool as a live-upgrade hand-over sends it;
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
        atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering},
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
mod locks;
mod maintenance;
pub mod pool;
mod quiet;
mod recovery;
mod service;
mod transfer;

use locks::SandboxLocks;
pub use pool::TapState;
use pool::{Pool, PoolError, TapEntry, Transition};
pub use quiet::QUIET;
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
            DataplaneError::Exhausted(m) => AgentError::Exhausted(m),
            other => AgentError::Internal(other.to_string()),
        }
    }
}

/// One sandbox in [`Agent::fqdn_view`] (JSON field names as served).
#[derive(Clone, Debug, Serialize)]
pub struct FqdnView {
    /// Sandbox id.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Its `allow_fqdn` patterns as `NAME[:PORT,…]` (`*.` for subdomains; no ports = every
    /// port), the `cubenet-cli ensure --allow-fqdn` form.
    #[serde(rename = "allowFqdn")]
    pub allow_fqdn: Vec<String>,
    /// Unexpired learned addresses of the current version by the pattern (spelled as in the
    /// policy, `*.` for subdomains) they were learned for; a pattern with nothing learned is absent.
    pub learned: BTreeMap<String, Vec<Ipv4Addr>>,
    /// Unexpired learned (address, port) entries of the current version, named or not.
    #[serde(rename = "learnedEntries")]
    pub learned_entries: usize,
    /// Its tracked DNS queries in the current 10 s window (decision O20; over `cap`, queries
    /// are forwarded untracked and their answers not learned: `dns_query_over_budget`).
    #[serde(rename = "queryWindow")]
    pub query_window: cubevs::insert_budget::BudgetUse,
    /// Its new learned entries in the current day window (R60; over `cap`: `dns_learn_full`).
    #[serde(rename = "learnedDay")]
    pub learned_day: cubevs::insert_budget::BudgetUse,
    #[serde(skip)]
    patterns: Vec<cubevs::policy::FqdnPattern>,
    #[serde(skip)]
    tap_ifindex: u32,
    #[serde(skip)]
    version: u32,
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

/// Most `persist_metadata` entries one Ensure may store (decision O25).
pub const MAX_METADATA_ENTRIES: usize = 256;

/// Most bytes of `persist_metadata` keys and values together one Ensure may store (decision
/// O25): the map lives in the sandbox's state file (tmpfs by default) and in the agent's memory
/// for the sandbox's life, and comes back in every Ensure/Get/Reconcile response.
pub const MAX_METADATA_BYTES: usize = 64 * 1024;

/// Checks the caller's `persist_metadata` against [`MAX_METADATA_ENTRIES`] and
/// [`MAX_METADATA_BYTES`]; the error names the field, never a value.
pub fn check_metadata(meta: &BTreeMap<String, String>) -> Result<(), AgentError> {
    if meta.len() > MAX_METADATA_ENTRIES {
        return Err(invalid("persist_metadata", format!("{} entries, at most {MAX_METADATA_ENTRIES}", meta.len())));
    }
    let bytes: usize = meta.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_METADATA_BYTES {
        return Err(invalid(
            "persist_metadata",
            format!("{bytes} bytes of keys and values, at most {MAX_METADATA_BYTES}"),
        ));
    }
    Ok(())
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
    /// Scrubbed TAPs whose mvm IP's node sockets were aborted since their scrub (R72), so a
    /// TAP a VMM still holds is not dumped for again in every maintenance pass. A name leaves
    /// at its next scrub.
    sockets_aborted: std::collections::HashSet<String>,
}

/// The agent.
pub struct Agent {
    cfg: Arc<Validated>,
    host: Arc<dyn Host>,
    dp: Arc<dyn Dataplane>,
    store: StateStore,
    inner: Mutex<Inner>,
    locks: SandboxLocks,
    version: AtomicU32,
    /// Why the last TAP creation failed; `None` once one succeeds (readiness).
    refill_error: Mutex<Option<String>>,
    /// Ready TAPs (mirrors the pool count, read without the pool lock).
    ready_taps: AtomicUsize,
    /// Readiness as last computed; pushed on every change (gRPC health follows it).
    ready_tx: tokio::sync::watch::Sender<bool>,
    /// Metrics.
    pub metrics: Metrics,
    warmed: AtomicBool,
    started: AtomicBool,
    /// Wakes the maintenance loop (after Ensure: refill; after Release: trim).
    pub kick: tokio::sync::Notify,
    /// Ensure/Release calls in flight, for the upkeep's wait (F15).
    calls: quiet::CallTracker,
    /// CubeEgress push client, when `cube_egress_admin_url` is set ([`Agent::set_egress_sync`]).
    egress: std::sync::OnceLock<Arc<crate::egress_sync::EgressSync>>,
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
    /// Reads a file on a dataplane-namespace thread ([`Host::read_netns_file`]), e.g. that
    /// namespace's socket tables.
    pub fn read_dataplane_file(&self, path: &std::path::Path) -> std::io::Result<String> {
        self.host.read_netns_file(path)
    }

    /// Whether `ip` lies in the sandbox CIDR (`cidr`): a sandbox's own address, cube-dev's,
    /// or one the pool may hand out.
    pub fn in_sandbox_cidr(&self, ip: std::net::IpAddr) -> bool {
        let v4 = match ip {
            std::net::IpAddr::V4(v4) => Some(v4),
            std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped(),
        };
        v4.is_some_and(|v4| self.cfg.cidr.index_of(v4).is_some())
    }

    /// An agent with an empty pool. Call [`Agent::recover`] before serving.
    pub fn new(cfg: Arc<Validated>, host: Arc<dyn Host>, dp: Arc<dyn Dataplane>, store: StateStore) -> Self {
        // Read on a dataplane-netns thread: the sysctl is per namespace (issue 10 item 14).
        let reserved = host
            .read_netns_file(&cfg.raw.reserved_ports_file)
            .map(|s| crate::ports::parse_reserved(&s))
            .unwrap_or_default();
        let inner = Inner {
            pool: Pool::default(),
            sandboxes: HashMap::new(),
            ipam: Ipam::new(cfg.cidr),
            ports: PortAllocator::new(cfg.port_range.0, cfg.port_range.1, &reserved),
            sockets_aborted: std::collections::HashSet::new(),
        };
        Self {
            cfg,
            host,
            dp,
            store,
            inner: Mutex::new(inner),
            locks: SandboxLocks::default(),
            version: AtomicU32::new(1),
            refill_error: Mutex::new(None),
            ready_taps: AtomicUsize::new(0),
            ready_tx: tokio::sync::watch::Sender::new(false),
            metrics: Metrics::new(),
            warmed: AtomicBool::new(false),
            started: AtomicBool::new(false),
            kick: tokio::sync::Notify::new(),
            calls: quiet::CallTracker::default(),
            egress: std::sync::OnceLock::new(),
        }
    }

    /// Installs the CubeEgress push client (once; later calls are ignored).
    pub fn set_egress_sync(&self, s: Arc<crate::egress_sync::EgressSync>) {
        let _ = self.egress.set(s);
    }

    /// The CubeEgress client once installed (`None` before that or without
    /// `cube_egress_admin_url`).
    pub fn egress_sync(&self) -> Option<&Arc<crate::egress_sync::EgressSync>> {
        self.egress.get()
    }

    /// Whether `cube_egress_admin_url` names a gateway (not `""`).
    pub fn egress_configured(&self) -> bool {
        !self.cfg.raw.cube_egress_admin_url.is_empty()
    }

    /// Every live sandbox with L7 rules as its gateway policy `(sandbox IP, {policy_id, rules})`
    /// (what `GET /v1/policies/dump` serves and a gateway resync sends). Contains secrets.
    pub fn egress_policies(&self) -> Vec<(std::net::Ipv4Addr, egress_policy::PolicySpec)> {
        let inner = lock(&self.inner);
        let mut v: Vec<_> = inner
            .sandboxes
            .values()
            .filter_map(|r| crate::egress_sync::policy_spec(r.sandbox_ip, &r.policy.rules).map(|p| (r.sandbox_ip, p)))
            .collect();
        v.sort_by_key(|(ip, _)| *ip);
        v
    }

    /// The learned-address feed (decision N8): for every live sandbox with L7 rules and
    /// `allow_fqdn` patterns, the names its unexpired L7 learned entries belong to
    /// (`cubevs::policy::learned_names`, at most [`crate::egress_sync::MAX_FEED_ADDRS`] per
    /// name), keyed by sandbox IP. Entries are matched by (TAP ifindex, sandbox version), so a
    /// released sandbox's entries are never named for the TAP's next owner. Sandboxes with
    /// nothing learned are absent.
    pub fn learned_feed(&self) -> Vec<(std::net::Ipv4Addr, cubevs::policy::LearnedNames)> {
        {
            let inner = lock(&self.inner);
            if !inner.sandboxes.values().any(|r| !r.policy.rules.is_empty() && !r.policy.allow_fqdn.is_empty()) {
                return Vec::new();
            }
        }
        let entries = match self.dp.learned() {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("learned feed: reading dns_learned: {e}");
                return Vec::new();
            }
        };
        let now = cubevs::reaper::monotonic_ns();
        let mut by_if: HashMap<u32, Vec<cubevs::policy::LearnedEntry>> = HashMap::new();
        for e in entries {
            by_if.entry(e.ifindex).or_default().push(e);
        }
        let inner = lock(&self.inner);
        let mut v = Vec::new();
        for r in inner.sandboxes.values() {
            if r.policy.rules.is_empty() || r.tap_ifindex == 0 {
                continue;
            }
            let Some(es) = by_if.get(&r.tap_ifindex) else { continue };
            let patterns: Vec<cubevs::policy::FqdnPattern> =
                r.policy.allow_fqdn.iter().filter_map(|f| cubevs::policy::parse_fqdn(f, "allow_fqdn").ok()).collect();
            let names =
                cubevs::policy::learned_names(&patterns, r.version, es, now, true, crate::egress_sync::MAX_FEED_ADDRS);
            if !names.names.is_empty() {
                v.push((r.sandbox_ip, names));
            }
        }
        v.sort_by_key(|(ip, _)| *ip);
        v
    }

    /// Every live sandbox's `allow_fqdn` patterns and what its datapath learned for them
    /// (`GET /v1/dataplane/fqdn`, `cubenet-cli sandbox`; decision O18), and its DNS query and
    /// learning windows (O20): unexpired entries of the
    /// sandbox's current version on its TAP, named by the pattern they were learned for
    /// (`cubevs::policy::learned_names`, L7 or not), sorted by sandbox id. Walks `dns_learned`
    /// once (one lookup per entry) when any sandbox has patterns. Errors: the map read.
    pub fn fqdn_view(&self) -> Result<Vec<FqdnView>, DataplaneError> {
        let mut v: Vec<FqdnView> = {
            let inner = lock(&self.inner);
            inner
                .sandboxes
                .values()
                .map(|r| {
                    let patterns: Vec<cubevs::policy::FqdnPattern> = r
                        .policy
                        .allow_fqdn
                        .iter()
                        .filter_map(|f| cubevs::policy::parse_fqdn(f, "allow_fqdn").ok())
                        .collect();
                    let spelled = |p: &cubevs::policy::FqdnPattern| match p.ports.as_slice() {
                        [] => p.spelled(),
                        ports => format!(
                            "{}:{}",
                            p.spelled(),
                            ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",")
                        ),
                    };
                    FqdnView {
                        sandbox_id: r.sandbox_id.clone(),
                        allow_fqdn: patterns.iter().map(spelled).collect(),
                        learned: BTreeMap::new(),
                        learned_entries: 0,
                        query_window: Default::default(),
                        learned_day: Default::default(),
                        patterns,
                        tap_ifindex: r.tap_ifindex,
                        version: r.version,
                    }
                })
                .collect()
        };
        v.sort_by(|a, b| a.sandbox_id.cmp(&b.sandbox_id));
        for s in v.iter_mut().filter(|s| s.tap_ifindex != 0) {
            (s.query_window, s.learned_day) = self.dp.dns_budgets(s.tap_ifindex, s.version);
        }
        if v.iter().all(|s| s.patterns.is_empty()) {
            return Ok(v);
        }
        let entries = self.dp.learned()?;
        let now = cubevs::reaper::monotonic_ns();
        let mut by_if: HashMap<u32, Vec<cubevs::policy::LearnedEntry>> = HashMap::new();
        for e in entries {
            by_if.entry(e.ifindex).or_default().push(e);
        }
        for s in &mut v {
            let Some(es) = by_if.get(&s.tap_ifindex).filter(|_| s.tap_ifindex != 0) else { continue };
            s.learned_entries = es.iter().filter(|e| e.version == s.version && e.expires_ns > now).count();
            s.learned = cubevs::policy::learned_names(&s.patterns, s.version, es, now, false, usize::MAX).names;
        }
        Ok(v)
    }

    /// Sends `ip`'s L7 rules (none = DELETE) to the gateway: one attempt now, retries in the
    /// background. No-op without a push client. Blocks up to the push timeout.
    fn push_egress(&self, ip: std::net::Ipv4Addr, rules: Option<&[egress_policy::RuleSpec]>) {
        if let Some(s) = self.egress.get() {
            let spec = rules.and_then(|r| crate::egress_sync::policy_spec(ip, r));
            if spec.is_none() {
                s.forget_learned(ip);
            }
            s.set_blocking(ip, spec);
        }
    }

    /// Entries in the per-sandbox lock map (0 when no call is running).
    pub fn lock_entries(&self) -> usize {
        self.locks.len()
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
                self.metrics.pool.with_label_values(&[s.as_str()]).set(inner.pool.count(s) as i64);
            }
            self.ready_taps.store(inner.pool.count(TapState::Ready), Ordering::Relaxed);
            self.publish_readiness();
        }
        r
    }

    /// Counts by state.
    pub fn pool_counts(&self) -> BTreeMap<TapState, usize> {
        let inner = lock(&self.inner);
        TapState::ALL.into_iter().map(|s| (s, inner.pool.count(s))).collect()
    }

    /// Readiness: whether an Ensure can succeed now. `Err` says why not.
    ///
    /// Not ready until recovery is done, the servers are up and the pool first reached
    /// `tap_init_num`. After that: ready while a TAP is Ready; with none Ready, ready only if the
    /// pool can refill, i.e. the last TAP creation did not fail (an Ensure then creates its TAP
    /// on demand); else not ready, with the creation error, until a TAP is Ready again.
    pub fn readiness(&self) -> Result<(), String> {
        if !self.started.load(Ordering::Relaxed) {
            return Err("recovery not finished".into());
        }
        let ready = self.ready_taps.load(Ordering::Relaxed);
        let refill = lock(&self.refill_error).clone();
        if !self.warmed.load(Ordering::Relaxed) {
            let why = refill.map(|e| format!("; last TAP creation failed: {e}")).unwrap_or_default();
            return Err(format!("warming TAP pool: {ready}/{} ready{why}", self.cfg.raw.tap_init_num));
        }
        match refill {
            Some(e) if ready == 0 => Err(format!("no Ready TAP and the pool cannot refill: {e}")),
            _ => Ok(()),
        }
    }

    /// Readiness as a watch channel: `true` while [`Agent::readiness`] is `Ok`, updated the
    /// moment it changes.
    pub fn watch_readiness(&self) -> tokio::sync::watch::Receiver<bool> {
        self.ready_tx.subscribe()
    }

    /// Recomputes readiness and pushes it when it changed. Takes no pool lock (callers may
    /// hold it).
    fn publish_readiness(&self) {
        let ready = self.readiness().is_ok();
        self.ready_tx.send_if_modified(|v| std::mem::replace(v, ready) != ready);
    }

    /// Refreshes `cubenet_sessions_in_use` from the reaper's last sweep count (a cheap read of
    /// its statistics, never a walk of the session map). Called when `/metrics` is scraped; the
    /// datapath counters themselves are collected by [`crate::metrics::Metrics::register_datapath`].
    pub fn refresh_datapath_metrics(&self) {
        self.metrics.warmup_filters.set(self.dp.filters_pending() as i64);
        let Ok(c) = self.dp.counters() else { return };
        if let Some(s) = c.get("reaper_last_scanned") {
            self.metrics.sessions.set(*s as i64);
        }
        if let Some(s) = c.get("session_floor_live") {
            self.metrics.sessions_node.set(*s as i64);
        }
        if let Some(s) = c.get("session_floor_ceiling") {
            self.metrics.sessions_node_ceiling.set(*s as i64);
        }
        for (k, v) in &c {
            if let Some(m) = k.strip_prefix("track_floor_live:") {
                self.metrics.tracking_node.with_label_values(&[m]).set(*v as i64);
            } else if let Some(m) = k.strip_prefix("track_floor_ceiling:") {
                self.metrics.tracking_node_ceiling.with_label_values(&[m]).set(*v as i64);
            }
        }
    }

    /// Marks the cold start's pool warm-up as done without one: after a hand-over the pool is
    /// the previous agent's, which had warmed it (its offer waits for a running warm-up), so
    /// readiness follows the pool as on that agent (a Ready TAP, or a pool that can refill)
    /// instead of waiting for `tap_init_num` Ready TAPs a busy or full node may not get back
    /// (decision H13).
    pub fn adopt_warm_pool(&self) {
        self.warmed.store(true, Ordering::Relaxed);
        self.publish_readiness();
    }

    /// Marks startup complete (servers up).
    pub fn set_started(&self) {
        self.started.store(true, Ordering::Relaxed);
        self.publish_readiness();
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

    /// `sessions_per_sandbox`: live sessions one sandbox version may hold.
    pub fn session_budget(&self) -> u32 {
        self.cfg.raw.sessions_per_sandbox
    }

    /// Host ports held by sandboxes.
    pub fn host_ports_in_use(&self) -> usize {
        lock(&self.inner).ports.in_use()
    }
}

#[cfg(test)]
mod tests;
