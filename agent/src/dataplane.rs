//! The one narrow interface between the agent and the CubeVS datapath.
//!
//! [`Dataplane`] mirrors the `cubevs` API the datapath issue provides (sandbox registry, SNAT
//! IPs, port maps, egress policy, sessions, counters, program attachment). The agent touches
//! the datapath only through it:
//!
//! - [`crate::cubevs_dp::CubeVsDataplane`] is the real implementation over `cubevs`: program
//!   attachment on the dataplane netns thread, maps through `cubevs::Maps` (pinned, adopted
//!   on restart), plus the session reaper.
//! - [`FakeDataplane`] is an in-memory implementation for unit tests of the service logic.

use std::{
    collections::{BTreeMap, HashMap},
    net::Ipv4Addr,
    sync::Mutex,
};

use serde::{Deserialize, Serialize};

/// Errors of datapath operations. `Invalid` names the offending field.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// A policy or mapping field is invalid (`field` is the request field name).
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// Field name as the gRPC request spells it (e.g. `cubevs_context.allow_out[1]`).
        field: String,
        /// Why.
        reason: String,
    },
    /// A host port is already mapped (no change was made).
    #[error("host port {proto}/{host_port} already mapped")]
    PortConflict {
        /// Protocol.
        proto: Proto,
        /// Host port.
        host_port: u16,
    },
    /// A datapath table is full (e.g. every interface slot of `policy_gen` holds a policy).
    #[error("{0}")]
    Exhausted(String),
    /// Anything else (kernel, pin, netns thread), with context.
    #[error("{0}")]
    Other(String),
}

/// One registered sandbox: the datapath keys everything by the TAP ifindex.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxEntry {
    /// TAP ifindex in the dataplane netns (host order).
    pub ifindex: u32,
    /// The sandbox's mvm IP (from the CIDR), e.g. 192.168.0.2.
    pub ip: Ipv4Addr,
    /// Per-sandbox version; sessions carry it so a reused TAP inherits no flow.
    pub version: u32,
    /// Sandbox id as given by cubelet.
    pub id: String,
}

/// Transport protocol of a port mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl std::fmt::Display for Proto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        })
    }
}

/// Host port → (TAP, guest port). Ports in host order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PortMapping {
    /// Protocol.
    pub proto: Proto,
    /// Port on the node's uplink address.
    pub host_port: u16,
    /// TAP ifindex of the sandbox.
    pub ifindex: u32,
    /// Port inside the guest.
    pub guest_port: u16,
}

/// One SNAT source address: the uplink address and its ifindex.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnatIp {
    /// Address.
    pub ip: Ipv4Addr,
    /// Interface carrying it.
    pub ifindex: u32,
}

/// Egress policy of one sandbox (`cubevs_context` of the gRPC API): cubevs's own type.
pub use cubevs::{EgressPolicy, PolicyDump, policy::NameBackfill};

/// One conntrack/SNAT session as the datapath reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    /// TAP ifindex of the owner.
    pub ifindex: u32,
    /// Protocol name (`tcp`, `udp`, `icmp`).
    pub proto: String,
    /// Sandbox-side `mvm_ip:port`.
    pub sandbox: String,
    /// Remote `ip:port`.
    pub remote: String,
    /// SNAT `ip:port`.
    pub snat: String,
    /// Sandbox version in the session key.
    pub version: u32,
    /// Conntrack state name.
    pub state: String,
}

/// Datapath counters by name (verdicts, drops).
pub type Counters = BTreeMap<String, u64>;

/// One sandbox's datapath counters: cubevs's own type (`out_*`, `in_*`, `drops` by reason).
pub use cubevs::SandboxCounters;

/// Everything the agent needs from the datapath. Implementations are thread-safe; every
/// method may block briefly (map syscalls, a hop to the netns thread) and must be called off
/// async worker threads (`spawn_blocking`).
pub trait Dataplane: Send + Sync {
    /// How many sandbox interfaces the datapath can hold (registrations and per-interface
    /// policy slots: `MapLimits::sandboxes`, 8,192 by default). The agent never creates more
    /// TAPs than this, so a full node refuses an Ensure instead of failing its policy write.
    fn max_interfaces(&self) -> usize;
    /// Attaches `from_cube` to the sandbox interface `ifname` in the dataplane netns (pinned,
    /// adopted when already attached). Returns its ifindex.
    fn attach_sandbox(&self, ifname: &str) -> Result<u32, DataplaneError>;
    /// Detaches `from_cube` from `ifname` and removes its pin.
    fn detach_sandbox(&self, ifname: &str) -> Result<(), DataplaneError>;
    /// Queues `ifname` for [`Dataplane::convert_next_filter`] when its `from_cube` runs from
    /// a warm-up filter without a tcx link (`tc_attach = "auto"`, decision F5; e.g. a TAP a
    /// previous agent left so). Returns whether it was queued. Default: nothing to do.
    fn defer_sandbox(&self, _ifname: &str) -> Result<bool, DataplaneError> {
        Ok(false)
    }
    /// Moves one sandbox interface from its warm-up filter to its pinned tcx link (the link
    /// first, then the filter goes: no instant without `from_cube`). Returns the interface,
    /// `None` when none is left. Default: none.
    fn convert_next_filter(&self) -> Result<Option<String>, DataplaneError> {
        Ok(None)
    }
    /// How many sandbox interfaces still run `from_cube` from a warm-up filter.
    fn filters_pending(&self) -> usize {
        0
    }
    /// Attaches the uplink programs (`from_world`) to `ifname` whose address is `ip`.
    fn attach_uplink(&self, ifname: &str, ip: Ipv4Addr) -> Result<(), DataplaneError>;
    /// Attaches `xdp_world` to the uplink `ifname` in `mode` (pinned, adopted when already
    /// attached in that mode), or detaches it for `off`. Returns how it is attached.
    fn attach_uplink_xdp(
        &self,
        ifname: &str,
        mode: cubevs::XdpMode,
    ) -> Result<Option<cubevs::XdpAttached>, DataplaneError>;
    /// Attaches the cube-dev program (`from_envoy`) to `ifname` whose address is `ip`.
    fn attach_cube_dev(&self, ifname: &str, ip: Ipv4Addr) -> Result<(), DataplaneError>;
    /// Registers (or overwrites) the sandbox behind `entry.ifindex`.
    fn register_sandbox(&self, entry: &SandboxEntry) -> Result<(), DataplaneError>;
    /// Removes the sandbox behind `ifindex`; absent is not an error.
    fn unregister_sandbox(&self, ifindex: u32) -> Result<(), DataplaneError>;
    /// The sandbox behind `ifindex`.
    fn sandbox(&self, ifindex: u32) -> Result<Option<SandboxEntry>, DataplaneError>;
    /// Every registered sandbox.
    fn sandboxes(&self) -> Result<Vec<SandboxEntry>, DataplaneError>;
    /// Replaces the SNAT address set.
    fn set_snat_ips(&self, ips: &[SnatIp]) -> Result<(), DataplaneError>;
    /// Adds one mapping; an existing mapping of that host port is a [`DataplaneError::PortConflict`].
    fn add_port_mapping(&self, m: &PortMapping) -> Result<(), DataplaneError>;
    /// Deletes one mapping; absent is not an error.
    fn delete_port_mapping(&self, m: &PortMapping) -> Result<(), DataplaneError>;
    /// Deletes every mapping pointing at `ifindex`.
    fn delete_port_mappings_of(&self, ifindex: u32) -> Result<(), DataplaneError>;
    /// Every mapping.
    fn port_mappings(&self) -> Result<Vec<PortMapping>, DataplaneError>;
    /// Validates then replaces the egress policy of `ifindex` (nothing changes on error; the
    /// error names the field, e.g. `allow_out[0]`).
    fn replace_policy(&self, ifindex: u32, policy: &EgressPolicy) -> Result<(), DataplaneError>;
    /// Installs the baseline deny-all policy of an unowned (Ready) TAP.
    fn install_default_deny(&self, ifindex: u32) -> Result<(), DataplaneError>;
    /// Removes every policy entry of `ifindex`.
    fn remove_policy(&self, ifindex: u32) -> Result<(), DataplaneError>;
    /// The policy currently installed for `ifindex` (`None`: no entry).
    fn policy(&self, ifindex: u32) -> Result<Option<PolicyDump>, DataplaneError>;
    /// Names the FQDN patterns of the installed policy of `ifindex` that a loader before R48
    /// left without a name, from `policy` (the sandbox's record), and seals the generation
    /// (`cubevs::PolicyTable::backfill_names`, decision R52).
    fn backfill_fqdn_names(&self, ifindex: u32, policy: &EgressPolicy) -> Result<NameBackfill, DataplaneError>;
    /// Live sessions.
    fn sessions(&self) -> Result<Vec<Session>, DataplaneError>;
    /// Deletes every session of `ifindex` (both directions). Returns how many.
    fn delete_sessions_of(&self, ifindex: u32) -> Result<usize, DataplaneError>;
    /// Datapath counters.
    fn counters(&self) -> Result<Counters, DataplaneError>;
    /// Per-sandbox counters of interface `ifindex` (packets and bytes each way, drops by
    /// reason; `cubevs_common::stats`), `None` when no sandbox is registered there. They
    /// start at zero when a different sandbox (id or version) registers on the interface.
    fn sandbox_counters(&self, ifindex: u32) -> Result<Option<SandboxCounters>, DataplaneError>;
    /// Per-sandbox counters of every interface that has them, by ifindex.
    fn all_sandbox_counters(&self) -> Result<BTreeMap<u32, SandboxCounters>, DataplaneError>;
    /// Live sessions charged to the sandbox version (`ifindex`, `version`) against
    /// `sessions_per_sandbox` (`session_opened − session_closed`, decision Q2; transiently
    /// negative while a charge is on its way). `None` when none was ever charged, or the
    /// datapath has no session budget maps.
    fn session_quota_live(&self, _ifindex: u32, _version: u32) -> Result<Option<i64>, DataplaneError> {
        Ok(None)
    }
    /// Every `dns_learned` entry (expired ones included until the DNS reaper deletes them).
    fn learned(&self) -> Result<Vec<cubevs::policy::LearnedEntry>, DataplaneError> {
        Ok(Vec::new())
    }
    /// Sandbox `version`'s DNS windows on `ifindex` now: (tracked queries of its 10 s window,
    /// new learned entries of its day window), read from `insert_budget` (decision O20).
    /// Without a datapath: zero use and zero caps.
    fn dns_budgets(
        &self,
        _ifindex: u32,
        _version: u32,
    ) -> (cubevs::insert_budget::BudgetUse, cubevs::insert_budget::BudgetUse) {
        Default::default()
    }
}

/// Prefix of the policy fields in the gRPC request.
pub const POLICY_FIELD_PREFIX: &str = "cubevs_context.";

/// A `cubevs` error as a [`DataplaneError`]: invalid policy fields are named as the gRPC
/// request spells them (`cubevs_context.allow_out[1]`), full tables are `Exhausted`.
pub fn from_cubevs(e: cubevs::Error) -> DataplaneError {
    match e {
        cubevs::Error::InvalidArgument { field, reason } => {
            let policy = ["allow_out", "deny_out", "allow_fqdn", "rules"].iter().any(|f| field.starts_with(f));
            DataplaneError::Invalid {
                field: if policy { format!("{POLICY_FIELD_PREFIX}{field}") } else { field },
                reason,
            }
        }
        e @ cubevs::Error::TooManyEntries { .. } => DataplaneError::Exhausted(e.to_string()),
        other => DataplaneError::Other(other.to_string()),
    }
}

/// Validates and expands a policy exactly as the datapath will (`cubevs::policy::compile`):
/// the strict CIDR grammar, and at most `limit` entries in each list. Errors name the field
/// (`cubevs_context.deny_out[0]`, `cubevs_context.allow_out` with the limit).
pub fn compile_policy(p: &EgressPolicy, limit: u32) -> Result<cubevs::policy::CompiledPolicy, DataplaneError> {
    cubevs::policy::compile(p, limit).map_err(from_cubevs)
}

/// In-memory tables with the semantics of the datapath maps. Backs [`FakeDataplane`] and the
/// unwired part of the real implementation.
#[derive(Debug, Default)]
pub struct MemTables {
    sandboxes: BTreeMap<u32, SandboxEntry>,
    ports: HashMap<(Proto, u16), PortMapping>,
    policies: BTreeMap<u32, (u32, cubevs::policy::CompiledPolicy)>,
    snat: Vec<SnatIp>,
    stats: BTreeMap<u32, SandboxCounters>,
    /// Per-sandbox entry limit (`cubevs::policy::DEFAULT_ENTRIES_PER_SANDBOX` when 0).
    pub policy_limit: u32,
}

impl MemTables {
    /// `register_sandbox`.
    pub fn register(&mut self, e: &SandboxEntry) {
        let same = self.sandboxes.get(&e.ifindex).is_some_and(|o| o.id == e.id && o.version == e.version);
        if !same || !self.stats.contains_key(&e.ifindex) {
            self.stats.insert(e.ifindex, zero_counters());
        }
        self.sandboxes.insert(e.ifindex, e.clone());
    }
    /// `unregister_sandbox`.
    pub fn unregister(&mut self, ifindex: u32) {
        self.sandboxes.remove(&ifindex);
        self.stats.remove(&ifindex);
    }
    /// `sandbox_counters` / `all_sandbox_counters`.
    pub fn stats(&self) -> &BTreeMap<u32, SandboxCounters> {
        &self.stats
    }
    /// What the programs do to a registered sandbox's counters (tests): `f` on its entry.
    pub fn count(&mut self, ifindex: u32, f: impl FnOnce(&mut SandboxCounters)) {
        if let Some(c) = self.stats.get_mut(&ifindex) {
            f(c);
        }
    }
    /// `sandbox`.
    pub fn sandbox(&self, ifindex: u32) -> Option<SandboxEntry> {
        self.sandboxes.get(&ifindex).cloned()
    }
    /// `sandboxes`.
    pub fn sandboxes(&self) -> Vec<SandboxEntry> {
        self.sandboxes.values().cloned().collect()
    }
    /// `set_snat_ips`.
    pub fn set_snat(&mut self, ips: &[SnatIp]) {
        self.snat = ips.to_vec();
    }
    /// The SNAT set.
    pub fn snat(&self) -> Vec<SnatIp> {
        self.snat.clone()
    }
    /// `add_port_mapping`.
    pub fn add_port(&mut self, m: &PortMapping) -> Result<(), DataplaneError> {
        let key = (m.proto, m.host_port);
        if self.ports.contains_key(&key) {
            return Err(DataplaneError::PortConflict { proto: m.proto, host_port: m.host_port });
        }
        self.ports.insert(key, *m);
        Ok(())
    }
    /// `delete_port_mapping`.
    pub fn delete_port(&mut self, m: &PortMapping) {
        if self.ports.get(&(m.proto, m.host_port)).is_some_and(|e| e.ifindex == m.ifindex) {
            self.ports.remove(&(m.proto, m.host_port));
        }
    }
    /// `delete_port_mappings_of`.
    pub fn delete_ports_of(&mut self, ifindex: u32) {
        self.ports.retain(|_, m| m.ifindex != ifindex);
    }
    /// `port_mappings`, sorted by protocol and host port.
    pub fn ports(&self) -> Vec<PortMapping> {
        let mut v: Vec<_> = self.ports.values().copied().collect();
        v.sort_by_key(|m| (m.proto, m.host_port));
        v
    }
    /// `replace_policy`: compiled by `cubevs` like the real one, under a new generation.
    pub fn replace_policy(&mut self, ifindex: u32, p: &EgressPolicy) -> Result<(), DataplaneError> {
        let limit =
            if self.policy_limit == 0 { cubevs::policy::DEFAULT_ENTRIES_PER_SANDBOX } else { self.policy_limit };
        let c = compile_policy(p, limit)?;
        let generation = self.policies.get(&ifindex).map_or(1, |(g, _)| g.wrapping_add(1));
        self.policies.insert(ifindex, (generation, c));
        Ok(())
    }
    /// `install_default_deny`: the baseline only, as `cubevs` installs it.
    pub fn default_deny(&mut self, ifindex: u32) -> Result<(), DataplaneError> {
        self.replace_policy(ifindex, &EgressPolicy::default())
    }
    /// `remove_policy`.
    pub fn remove_policy(&mut self, ifindex: u32) {
        self.policies.remove(&ifindex);
    }
    /// `policy`.
    pub fn policy(&self, ifindex: u32) -> Option<PolicyDump> {
        self.policies.get(&ifindex).map(|(g, c)| PolicyDump {
            generation: Some(*g),
            allow: c.allow.clone(),
            deny: c.deny.clone(),
            fqdn_patterns: c.fqdn.len(),
            l7: c.l7.iter().map(|(a, _)| *a).collect(),
        })
    }
}

/// In-memory [`Dataplane`] for unit tests: maps behave like the real ones, attachment only
/// records names (ifindexes from the [`FakeDataplane::resolver`], else a counter).
#[derive(Default)]
pub struct FakeDataplane {
    /// The tables.
    pub tables: Mutex<MemTables>,
    /// Attached sandbox interfaces by name → ifindex.
    pub attached: Mutex<BTreeMap<String, u32>>,
    /// Uplink and cube-dev attachments seen.
    pub infra: Mutex<Vec<(String, Ipv4Addr)>>,
    /// `attach_uplink_xdp` calls seen (interface, mode).
    pub xdp: Mutex<Vec<(String, cubevs::XdpMode)>>,
    /// When set, `register_sandbox` fails (to test rollback).
    pub fail_register: std::sync::atomic::AtomicBool,
    /// When set, `delete_port_mapping` and `delete_port_mappings_of` fail (to test cleanup retries).
    pub fail_delete_ports: std::sync::atomic::AtomicBool,
    /// When set, policy writes (`replace_policy`, `install_default_deny`) fail as they do when
    /// the policy tries are full; `remove_policy` still works.
    pub fail_policy: std::sync::atomic::AtomicBool,
    /// How many times `sessions()` was called (maintenance must not copy the session map).
    pub sessions_calls: std::sync::atomic::AtomicUsize,
    /// Resolves interface names to ifindexes (a fake host's table); unset: a counter.
    pub resolver: Mutex<Option<Resolver>>,
    /// [`Dataplane::max_interfaces`]; 0 = 8,192 (the real default).
    pub interface_limit: std::sync::atomic::AtomicUsize,
}

/// Name → ifindex lookup used by [`FakeDataplane`].
pub type Resolver = Box<dyn Fn(&str) -> Option<u32> + Send + Sync>;

impl std::fmt::Debug for FakeDataplane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeDataplane").field("tables", &self.tables).finish_non_exhaustive()
    }
}

impl Dataplane for FakeDataplane {
    fn max_interfaces(&self) -> usize {
        match self.interface_limit.load(std::sync::atomic::Ordering::Relaxed) {
            0 => cubevs_common::limits::SANDBOXES as usize,
            n => n,
        }
    }

    fn attach_sandbox(&self, ifname: &str) -> Result<u32, DataplaneError> {
        if let Some(r) = self.resolver.lock().unwrap().as_ref() {
            let idx = r(ifname).ok_or_else(|| DataplaneError::Other(format!("no interface {ifname}")))?;
            self.attached.lock().unwrap().insert(ifname.to_string(), idx);
            return Ok(idx);
        }
        let mut a = self.attached.lock().unwrap();
        let next = 100 + a.len() as u32;
        Ok(*a.entry(ifname.to_string()).or_insert(next))
    }
    fn detach_sandbox(&self, ifname: &str) -> Result<(), DataplaneError> {
        self.attached.lock().unwrap().remove(ifname);
        Ok(())
    }
    fn attach_uplink(&self, ifname: &str, ip: Ipv4Addr) -> Result<(), DataplaneError> {
        self.infra.lock().unwrap().push((ifname.to_string(), ip));
        Ok(())
    }
    fn attach_uplink_xdp(
        &self,
        ifname: &str,
        mode: cubevs::XdpMode,
    ) -> Result<Option<cubevs::XdpAttached>, DataplaneError> {
        self.xdp.lock().unwrap().push((ifname.to_string(), mode));
        Ok(match mode {
            cubevs::XdpMode::Off => None,
            cubevs::XdpMode::Generic => Some(cubevs::XdpAttached::Generic),
            cubevs::XdpMode::Native | cubevs::XdpMode::Auto => Some(cubevs::XdpAttached::Native),
        })
    }
    fn attach_cube_dev(&self, ifname: &str, ip: Ipv4Addr) -> Result<(), DataplaneError> {
        self.infra.lock().unwrap().push((ifname.to_string(), ip));
        Ok(())
    }
    fn register_sandbox(&self, entry: &SandboxEntry) -> Result<(), DataplaneError> {
        if self.fail_register.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(DataplaneError::Other("injected register failure".into()));
        }
        self.tables.lock().unwrap().register(entry);
        Ok(())
    }
    fn unregister_sandbox(&self, ifindex: u32) -> Result<(), DataplaneError> {
        self.tables.lock().unwrap().unregister(ifindex);
        Ok(())
    }
    fn sandbox(&self, ifindex: u32) -> Result<Option<SandboxEntry>, DataplaneError> {
        Ok(self.tables.lock().unwrap().sandbox(ifindex))
    }
    fn sandboxes(&self) -> Result<Vec<SandboxEntry>, DataplaneError> {
        Ok(self.tables.lock().unwrap().sandboxes())
    }
    fn set_snat_ips(&self, ips: &[SnatIp]) -> Result<(), DataplaneError> {
        self.tables.lock().unwrap().set_snat(ips);
        Ok(())
    }
    fn add_port_mapping(&self, m: &PortMapping) -> Result<(), DataplaneError> {
        self.tables.lock().unwrap().add_port(m)
    }
    fn delete_port_mapping(&self, m: &PortMapping) -> Result<(), DataplaneError> {
        if self.fail_delete_ports.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(DataplaneError::Other("injected delete failure".into()));
        }
        self.tables.lock().unwrap().delete_port(m);
        Ok(())
    }
    fn delete_port_mappings_of(&self, ifindex: u32) -> Result<(), DataplaneError> {
        if self.fail_delete_ports.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(DataplaneError::Other("injected delete failure".into()));
        }
        self.tables.lock().unwrap().delete_ports_of(ifindex);
        Ok(())
    }
    fn port_mappings(&self) -> Result<Vec<PortMapping>, DataplaneError> {
        Ok(self.tables.lock().unwrap().ports())
    }
    fn replace_policy(&self, ifindex: u32, policy: &EgressPolicy) -> Result<(), DataplaneError> {
        if self.fail_policy.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(DataplaneError::Other("injected policy failure: deny_out is full".into()));
        }
        self.tables.lock().unwrap().replace_policy(ifindex, policy)
    }
    fn install_default_deny(&self, ifindex: u32) -> Result<(), DataplaneError> {
        if self.fail_policy.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(DataplaneError::Other("injected policy failure: deny_out is full".into()));
        }
        self.tables.lock().unwrap().default_deny(ifindex)
    }
    fn remove_policy(&self, ifindex: u32) -> Result<(), DataplaneError> {
        self.tables.lock().unwrap().remove_policy(ifindex);
        Ok(())
    }
    fn policy(&self, ifindex: u32) -> Result<Option<PolicyDump>, DataplaneError> {
        Ok(self.tables.lock().unwrap().policy(ifindex))
    }
    fn backfill_fqdn_names(&self, _ifindex: u32, _policy: &EgressPolicy) -> Result<NameBackfill, DataplaneError> {
        // The fake keeps compiled policies, not DNS maps: no key without its name.
        Ok(NameBackfill::default())
    }
    fn sessions(&self) -> Result<Vec<Session>, DataplaneError> {
        self.sessions_calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Vec::new())
    }
    fn delete_sessions_of(&self, _ifindex: u32) -> Result<usize, DataplaneError> {
        Ok(0)
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        Ok(Counters::new())
    }
    fn sandbox_counters(&self, ifindex: u32) -> Result<Option<SandboxCounters>, DataplaneError> {
        Ok(self.tables.lock().unwrap().stats().get(&ifindex).cloned())
    }
    fn all_sandbox_counters(&self) -> Result<BTreeMap<u32, SandboxCounters>, DataplaneError> {
        Ok(self.tables.lock().unwrap().stats().clone())
    }
}

/// Zeroed counters with every drop reason present, as the real map reads after a reset.
fn zero_counters() -> SandboxCounters {
    SandboxCounters {
        drops: cubevs_common::stats::drop::NAMES.iter().map(|(_, n)| (n.to_string(), 0)).collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_errors_name_the_request_field() {
        assert!(
            compile_policy(&EgressPolicy { allow_out: vec!["10.0.0.0/8".into()], ..Default::default() }, 4).is_ok()
        );
        let p = EgressPolicy { deny_out: vec!["1.1.1.1/32".into(), "1.2.3.4/+8".into()], ..Default::default() };
        let e = compile_policy(&p, 4).unwrap_err();
        assert!(matches!(&e, DataplaneError::Invalid { field, .. } if field == "cubevs_context.deny_out[1]"), "{e}");
        let e = compile_policy(&p, 1).unwrap_err().to_string();
        assert!(e.contains("cubevs_context.deny_out") && e.contains("limit of 1"), "{e}");
    }

    #[test]
    fn fake_compiles_policy_like_the_datapath() {
        let mut t = MemTables::default();
        t.default_deny(7).unwrap();
        let d = t.policy(7).unwrap();
        assert_eq!(d.deny, cubevs::policy::BASELINE_DENY.to_vec(), "Ready TAPs carry the baseline only");
        assert!(d.allow.is_empty());
        let closed =
            EgressPolicy { allow_internet_access: false, deny_out: vec!["8.8.8.8".into()], ..Default::default() };
        t.replace_policy(7, &closed).unwrap();
        let d2 = t.policy(7).unwrap();
        assert!(d2.generation > d.generation);
        assert!(d2.deny.contains(&cidr("0.0.0.0/0")), "{d2:?}");
        assert!(!d2.deny.contains(&cidr("8.8.8.8")), "user deny ignored without internet");
        assert!(t.replace_policy(7, &EgressPolicy { allow_out: vec!["x".into()], ..Default::default() }).is_err());
        assert_eq!(t.policy(7).unwrap(), d2, "a refused replace changed nothing");
    }

    fn cidr(s: &str) -> cubevs::Cidr {
        cubevs::policy::parse_cidr(s, "t").unwrap()
    }

    #[test]
    fn port_conflict_changes_nothing() {
        let mut t = MemTables::default();
        let a = PortMapping { proto: Proto::Tcp, host_port: 20000, ifindex: 5, guest_port: 80 };
        t.add_port(&a).unwrap();
        let b = PortMapping { ifindex: 6, ..a };
        assert!(matches!(t.add_port(&b), Err(DataplaneError::PortConflict { .. })));
        assert_eq!(t.ports(), vec![a]);
        // Deleting with the wrong owner is a no-op.
        t.delete_port(&b);
        assert_eq!(t.ports(), vec![a]);
        t.delete_ports_of(5);
        assert!(t.ports().is_empty());
    }
}
