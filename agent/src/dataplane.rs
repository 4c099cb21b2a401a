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

/// Egress policy of one sandbox (`cubevs_context` of the gRPC API, `reference/upstream.md
/// §1.1`): CIDRs (`a.b.c.d/n` or a bare address).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressPolicy {
    /// Public internet allowed (private ranges stay denied unless in `allow_out`).
    pub allow_internet_access: bool,
    /// Allowed destinations; beat `deny_out`.
    pub allow_out: Vec<String>,
    /// Denied destinations.
    pub deny_out: Vec<String>,
}

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

/// The policy installed for one interface, as the tries hold it (CIDR strings).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyDump {
    /// Allowed networks.
    pub allow: Vec<String>,
    /// Denied networks (the baseline deny included).
    pub deny: Vec<String>,
}

/// Datapath counters by name (verdicts, drops).
pub type Counters = BTreeMap<String, u64>;

/// Everything the agent needs from the datapath. Implementations are thread-safe; every
/// method may block briefly (map syscalls, a hop to the netns thread) and must be called off
/// async worker threads (`spawn_blocking`).
pub trait Dataplane: Send + Sync {
    /// Attaches `from_cube` to the sandbox interface `ifname` in the dataplane netns (pinned,
    /// adopted when already attached). Returns its ifindex.
    fn attach_sandbox(&self, ifname: &str) -> Result<u32, DataplaneError>;
    /// Detaches `from_cube` from `ifname` and removes its pin.
    fn detach_sandbox(&self, ifname: &str) -> Result<(), DataplaneError>;
    /// Attaches the uplink programs (`from_world`) to `ifname` whose address is `ip`.
    fn attach_uplink(&self, ifname: &str, ip: Ipv4Addr) -> Result<(), DataplaneError>;
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
    /// Live sessions.
    fn sessions(&self) -> Result<Vec<Session>, DataplaneError>;
    /// Deletes every session of `ifindex` (both directions). Returns how many.
    fn delete_sessions_of(&self, ifindex: u32) -> Result<usize, DataplaneError>;
    /// Datapath counters.
    fn counters(&self) -> Result<Counters, DataplaneError>;
}

/// Validates one `allow_out`/`deny_out` entry: an IPv4 CIDR `a.b.c.d/n` (n ≤ 32) or address.
pub fn validate_cidr(field: &str, s: &str) -> Result<(), DataplaneError> {
    let bad = |reason: &str| DataplaneError::Invalid { field: field.to_string(), reason: reason.to_string() };
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    addr.parse::<Ipv4Addr>().map_err(|_| bad(&format!("{s:?} is not an IPv4 address or CIDR")))?;
    if let Some(l) = len {
        let n: u8 = l.parse().map_err(|_| bad(&format!("{s:?} has a bad prefix length")))?;
        if n > 32 {
            return Err(bad(&format!("{s:?} has a prefix length above 32")));
        }
    }
    Ok(())
}

/// Validates a whole policy (the checks the datapath's `replace_policy` performs).
pub fn validate_policy(prefix: &str, p: &EgressPolicy) -> Result<(), DataplaneError> {
    for (i, c) in p.allow_out.iter().enumerate() {
        validate_cidr(&format!("{prefix}allow_out[{i}]"), c)?;
    }
    for (i, c) in p.deny_out.iter().enumerate() {
        validate_cidr(&format!("{prefix}deny_out[{i}]"), c)?;
    }
    Ok(())
}

/// In-memory tables with the semantics of the datapath maps. Backs [`FakeDataplane`] and the
/// unwired part of the real implementation.
#[derive(Debug, Default)]
pub struct MemTables {
    sandboxes: BTreeMap<u32, SandboxEntry>,
    ports: HashMap<(Proto, u16), PortMapping>,
    policies: BTreeMap<u32, EgressPolicy>,
    snat: Vec<SnatIp>,
}

impl MemTables {
    /// `register_sandbox`.
    pub fn register(&mut self, e: &SandboxEntry) {
        self.sandboxes.insert(e.ifindex, e.clone());
    }
    /// `unregister_sandbox`.
    pub fn unregister(&mut self, ifindex: u32) {
        self.sandboxes.remove(&ifindex);
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
    /// `replace_policy`.
    pub fn replace_policy(&mut self, ifindex: u32, p: &EgressPolicy) -> Result<(), DataplaneError> {
        validate_policy("", p)?;
        self.policies.insert(ifindex, p.clone());
        Ok(())
    }
    /// `install_default_deny`.
    pub fn default_deny(&mut self, ifindex: u32) {
        self.policies.insert(ifindex, EgressPolicy { allow_internet_access: false, ..Default::default() });
    }
    /// `remove_policy`.
    pub fn remove_policy(&mut self, ifindex: u32) {
        self.policies.remove(&ifindex);
    }
    /// `policy`, compiled the way the datapath does (baseline deny; no internet = deny all,
    /// user deny list ignored; the default deny is "deny all").
    pub fn policy(&self, ifindex: u32) -> Option<PolicyDump> {
        self.policies.get(&ifindex).map(|p| {
            let mut deny: Vec<String> =
                ["10.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16"]
                    .map(String::from)
                    .to_vec();
            if p.allow_internet_access {
                deny.extend(p.deny_out.iter().cloned());
            } else {
                deny.push("0.0.0.0/0".into());
            }
            PolicyDump { allow: p.allow_out.clone(), deny }
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
    /// When set, `register_sandbox` fails (to test rollback).
    pub fail_register: std::sync::atomic::AtomicBool,
    /// When set, `delete_port_mappings_of` fails (to test cleanup retries).
    pub fail_delete_ports: std::sync::atomic::AtomicBool,
    /// When set, policy writes (`replace_policy`, `install_default_deny`) fail as they do when
    /// the policy tries are full; `remove_policy` still works.
    pub fail_policy: std::sync::atomic::AtomicBool,
    /// How many times `sessions()` was called (maintenance must not copy the session map).
    pub sessions_calls: std::sync::atomic::AtomicUsize,
    /// Resolves interface names to ifindexes (a fake host's table); unset: a counter.
    pub resolver: Mutex<Option<Resolver>>,
}

/// Name → ifindex lookup used by [`FakeDataplane`].
pub type Resolver = Box<dyn Fn(&str) -> Option<u32> + Send + Sync>;

impl std::fmt::Debug for FakeDataplane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeDataplane").field("tables", &self.tables).finish_non_exhaustive()
    }
}

impl Dataplane for FakeDataplane {
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
        self.tables.lock().unwrap().default_deny(ifindex);
        Ok(())
    }
    fn remove_policy(&self, ifindex: u32) -> Result<(), DataplaneError> {
        self.tables.lock().unwrap().remove_policy(ifindex);
        Ok(())
    }
    fn policy(&self, ifindex: u32) -> Result<Option<PolicyDump>, DataplaneError> {
        Ok(self.tables.lock().unwrap().policy(ifindex))
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_validation_names_field() {
        assert!(validate_cidr("f", "10.0.0.0/8").is_ok());
        assert!(validate_cidr("f", "1.2.3.4").is_ok());
        let e = validate_cidr("allow_out[2]", "10.0.0.0/33").unwrap_err().to_string();
        assert!(e.contains("allow_out[2]"), "{e}");
        assert!(validate_cidr("f", "example.com").is_err());
        let p = EgressPolicy { deny_out: vec!["1.1.1.1/32".into(), "x".into()], ..Default::default() };
        let e = validate_policy("cubevs_context.", &p).unwrap_err().to_string();
        assert!(e.contains("cubevs_context.deny_out[1]"), "{e}");
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
