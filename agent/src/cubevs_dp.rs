//! The real [`Dataplane`] over `cubevs`: programs attached on the dataplane netns thread
//! (interface names resolve there), maps through the thread-safe `cubevs::Maps` (pinned
//! under `<bpffs_dir>/maps`, adopted on restart), and the session reaper thread.

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use cubevs::{Datapath, DatapathConfig, LoadOptions, Maps, dns_reaper::DnsReaper, reaper::Reaper};

use crate::{
    dataplane::{
        Counters, Dataplane, DataplaneError, EgressPolicy, NameBackfill, PolicyDump, PortMapping, Proto,
        SandboxCounters, SandboxEntry, Session, SnatIp, from_cubevs,
    },
    host::NetnsHost,
};

/// Datapath backed by `cubevs`.
pub struct CubeVsDataplane {
    host: Arc<NetnsHost>,
    datapath: Arc<Mutex<Datapath>>,
    maps: Arc<Maps>,
    reaper: Reaper,
    dns_reaper: DnsReaper,
    /// `MapLimits::sandboxes` the maps were loaded with.
    max_interfaces: usize,
}

impl std::fmt::Debug for CubeVsDataplane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CubeVsDataplane").finish_non_exhaustive()
    }
}

fn err(e: cubevs::Error) -> DataplaneError {
    from_cubevs(e)
}

fn other(e: impl std::fmt::Display) -> DataplaneError {
    DataplaneError::Other(e.to_string())
}

fn proto(p: Proto) -> cubevs::Proto {
    match p {
        Proto::Tcp => cubevs::Proto::Tcp,
        Proto::Udp => cubevs::Proto::Udp,
    }
}

fn mapping(m: &PortMapping) -> cubevs::PortMapping {
    cubevs::PortMapping { proto: proto(m.proto), host_port: m.host_port, ifindex: m.ifindex, guest_port: m.guest_port }
}

impl CubeVsDataplane {
    /// Loads the object (`object`, `None` = `cubevs::default_object_path()`) with `config`,
    /// attaching programs as `attach` says,
    /// creating or adopting the pinned maps under `bpffs_dir`; pinned links are adopted by
    /// later attaches. `limits` sizes the maps (e.g. each sandbox may hold
    /// `policy_entries_per_sandbox` entries per policy list, and `sessions_per_sandbox` live
    /// sessions). Starts the session reaper and the DNS reaper (every
    /// `reaper_interval`).
    pub fn load(
        host: Arc<NetnsHost>,
        object: Option<PathBuf>,
        config: DatapathConfig,
        attach: cubevs::AttachMode,
        bpffs_dir: PathBuf,
        reaper_interval: Duration,
        limits: cubevs::MapLimits,
    ) -> Result<Self, DataplaneError> {
        let mut opts = LoadOptions::new();
        opts.limits = limits;
        if let Some(o) = object {
            opts.object = o;
        }
        opts.config = config;
        opts.attach_mode = attach;
        opts.pin_dir = Some(bpffs_dir);
        let max_interfaces = opts.limits.sandboxes as usize;
        let dp = Datapath::load(opts).map_err(err)?;
        let maps = dp.maps();
        let reaper = Reaper::spawn(maps.sessions.clone(), reaper_interval, Default::default());
        let dns_reaper = DnsReaper::spawn(maps.clone(), reaper_interval);
        Ok(Self { host, datapath: Arc::new(Mutex::new(dp)), maps, reaper, dns_reaper, max_interfaces })
    }

    fn on_thread<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Datapath) -> Result<R, cubevs::Error> + Send + 'static,
    ) -> Result<R, DataplaneError> {
        let dp = self.datapath.clone();
        self.host.run_first(move || f(&mut dp.lock().unwrap_or_else(|e| e.into_inner()))).map_err(other)?.map_err(err)
    }

    /// Makes the pinned `node_deny` map hold exactly `list` (the node's `always_denied_cidrs`,
    /// decision R30), replacing in place what a previous run wrote, then deletes the sessions
    /// toward listed addresses: every sandbox, running or not, is denied these destinations
    /// from its next packet on. Returns how many sessions were deleted. Errors: more than
    /// `cubevs_common::limits::NODE_DENY` entries, a non-empty list with an object older than
    /// R30, map syscall errors.
    pub fn set_always_denied(&self, list: &[cubevs::Cidr]) -> Result<usize, DataplaneError> {
        self.maps.node_deny.replace(list).map_err(err)?;
        self.maps.sessions.delete_to(list).map_err(err)
    }

    /// Checks that [`CubeVsDataplane::set_always_denied`] can write `list` (not over
    /// `cubevs_common::limits::NODE_DENY` entries; a non-empty list needs an object with
    /// `node_deny`, R30) without writing anything: a successor checks this before a hand-over
    /// and writes the list only once it has taken over (H10). Errors as `set_always_denied`.
    pub fn check_always_denied(&self, list: &[cubevs::Cidr]) -> Result<(), DataplaneError> {
        self.maps.node_deny.check(list).map_err(err)
    }

    /// A running agent's change of the list (SIGHUP, decision R51): makes `node_deny` hold
    /// exactly `list` as [`CubeVsDataplane::set_always_denied`] does (new entries inserted before
    /// dropped ones are deleted), then deletes the sessions toward the entries that were not in
    /// the map before only; sessions that exist toward an entry listed before (paths without a
    /// policy check, such as TCP host-port replies) are not cut by a reload that keeps it.
    /// Returns how many sessions were deleted. Errors as `set_always_denied`.
    pub fn update_always_denied(&self, list: &[cubevs::Cidr]) -> Result<usize, DataplaneError> {
        let before: std::collections::BTreeSet<cubevs::Cidr> = self.maps.node_deny.list().into_iter().collect();
        self.maps.node_deny.replace(list).map_err(err)?;
        let added: Vec<cubevs::Cidr> = list.iter().filter(|c| !before.contains(c)).copied().collect();
        self.maps.sessions.delete_to(&added).map_err(err)
    }

    /// The slot this process's load activated (pinned tcx), `None` in legacy tc mode.
    pub fn slot(&self) -> Option<usize> {
        self.datapath.lock().unwrap_or_else(|e| e.into_inner()).slot()
    }

    /// Removes link pins of interfaces that no longer exist (deleted TAPs).
    pub fn gc_link_pins(&self) -> Result<Vec<String>, DataplaneError> {
        self.on_thread(|dp| dp.gc_link_pins())
    }
}

impl Dataplane for CubeVsDataplane {
    fn learned(&self) -> Result<Vec<cubevs::policy::LearnedEntry>, DataplaneError> {
        Ok(self.maps.policy.learned(None))
    }

    fn dns_budgets(
        &self,
        ifindex: u32,
        version: u32,
    ) -> (cubevs::insert_budget::BudgetUse, cubevs::insert_budget::BudgetUse) {
        let now = cubevs::reaper::monotonic_ns();
        (self.maps.budget.dns_queries(ifindex, version, now), self.maps.budget.dns_learned(ifindex, version, now))
    }

    fn max_interfaces(&self) -> usize {
        self.max_interfaces
    }

    fn attach_sandbox(&self, ifname: &str) -> Result<u32, DataplaneError> {
        let n = ifname.to_string();
        self.on_thread(move |dp| dp.attach_sandbox(&n))
    }
    fn detach_sandbox(&self, ifname: &str) -> Result<(), DataplaneError> {
        let n = ifname.to_string();
        self.on_thread(move |dp| dp.detach_sandbox(&n))
    }
    fn defer_sandbox(&self, ifname: &str) -> Result<bool, DataplaneError> {
        let n = ifname.to_string();
        self.on_thread(move |dp| dp.defer_sandbox(&n))
    }
    fn convert_next_filter(&self) -> Result<Option<String>, DataplaneError> {
        self.on_thread(|dp| dp.convert_next())
    }
    fn filters_pending(&self) -> usize {
        self.datapath.lock().unwrap_or_else(|e| e.into_inner()).filters_pending()
    }
    fn attach_uplink(&self, ifname: &str, ip: Ipv4Addr) -> Result<(), DataplaneError> {
        let n = ifname.to_string();
        self.on_thread(move |dp| dp.attach_uplink(&n, ip)).map(drop)
    }
    fn attach_uplink_xdp(
        &self,
        ifname: &str,
        mode: cubevs::XdpMode,
    ) -> Result<Option<cubevs::XdpAttached>, DataplaneError> {
        let n = ifname.to_string();
        self.on_thread(move |dp| dp.attach_uplink_xdp(&n, mode))
    }
    fn attach_cube_dev(&self, ifname: &str, ip: Ipv4Addr) -> Result<(), DataplaneError> {
        let n = ifname.to_string();
        self.on_thread(move |dp| dp.attach_cube_dev(&n, ip)).map(drop)
    }
    fn register_sandbox(&self, e: &SandboxEntry) -> Result<(), DataplaneError> {
        // A different sandbox (id or version) on this interface starts its counters at zero,
        // before it is registered, so none of the previous owner's packets is charged to it;
        // re-registering the same sandbox (recovery after a restart) keeps them.
        let same =
            self.maps.sandboxes.get(e.ifindex).map_err(err)?.is_some_and(|o| o.id == e.id && o.version == e.version);
        if !same || self.maps.sandbox_stats.get(e.ifindex).map_err(err)?.is_none() {
            self.maps.sandbox_stats.reset(e.ifindex).map_err(err)?;
        }
        self.maps
            .sandboxes
            .register(&cubevs::SandboxEntry { ifindex: e.ifindex, ip: e.ip, version: e.version, id: e.id.clone() })
            .map_err(err)
    }
    fn unregister_sandbox(&self, ifindex: u32) -> Result<(), DataplaneError> {
        self.maps.sandboxes.unregister(ifindex).map_err(err)?;
        self.maps.sandbox_stats.remove(ifindex).map_err(err)
    }
    fn sandbox(&self, ifindex: u32) -> Result<Option<SandboxEntry>, DataplaneError> {
        Ok(self.maps.sandboxes.get(ifindex).map_err(err)?.map(|e| SandboxEntry {
            ifindex: e.ifindex,
            ip: e.ip,
            version: e.version,
            id: e.id,
        }))
    }
    fn sandboxes(&self) -> Result<Vec<SandboxEntry>, DataplaneError> {
        Ok(self
            .maps
            .sandboxes
            .list()
            .map_err(err)?
            .into_iter()
            .map(|e| SandboxEntry { ifindex: e.ifindex, ip: e.ip, version: e.version, id: e.id })
            .collect())
    }
    fn set_snat_ips(&self, ips: &[SnatIp]) -> Result<(), DataplaneError> {
        let v: Vec<_> = ips.iter().map(|s| cubevs::SnatAddr { ip: s.ip, ifindex: s.ifindex }).collect();
        self.maps.snat.set(&v).map_err(err)
    }
    fn add_port_mapping(&self, m: &PortMapping) -> Result<(), DataplaneError> {
        match self.maps.ports.add(&mapping(m)) {
            Ok(()) => Ok(()),
            Err(cubevs::Error::Conflict(_)) => {
                Err(DataplaneError::PortConflict { proto: m.proto, host_port: m.host_port })
            }
            Err(e) => Err(err(e)),
        }
    }
    fn delete_port_mapping(&self, m: &PortMapping) -> Result<(), DataplaneError> {
        self.maps.ports.delete(&mapping(m)).map_err(err)
    }
    fn delete_port_mappings_of(&self, ifindex: u32) -> Result<(), DataplaneError> {
        self.maps.ports.delete_of(ifindex).map(drop).map_err(err)
    }
    fn port_mappings(&self) -> Result<Vec<PortMapping>, DataplaneError> {
        Ok(self
            .maps
            .ports
            .list()
            .map_err(err)?
            .into_iter()
            .map(|m| PortMapping {
                proto: match m.proto {
                    cubevs::Proto::Tcp => Proto::Tcp,
                    cubevs::Proto::Udp => Proto::Udp,
                },
                host_port: m.host_port,
                ifindex: m.ifindex,
                guest_port: m.guest_port,
            })
            .collect())
    }
    fn replace_policy(&self, ifindex: u32, p: &EgressPolicy) -> Result<(), DataplaneError> {
        self.maps.policy.replace(ifindex, p).map_err(err)
    }
    fn install_default_deny(&self, ifindex: u32) -> Result<(), DataplaneError> {
        self.maps.policy.install_default_deny(ifindex).map_err(err)
    }
    fn remove_policy(&self, ifindex: u32) -> Result<(), DataplaneError> {
        self.maps.policy.remove(ifindex).map_err(err)
    }
    fn policy(&self, ifindex: u32) -> Result<Option<PolicyDump>, DataplaneError> {
        let d = self.maps.policy.dump(ifindex).map_err(err)?;
        Ok(d.generation.is_some().then_some(d))
    }
    fn backfill_fqdn_names(&self, ifindex: u32, p: &EgressPolicy) -> Result<NameBackfill, DataplaneError> {
        self.maps.policy.backfill_names(ifindex, p).map_err(err)
    }
    fn sessions(&self) -> Result<Vec<Session>, DataplaneError> {
        Ok(self
            .maps
            .sessions
            .list()
            .map_err(err)?
            .into_iter()
            .map(|s| Session {
                ifindex: s.vm_ifindex,
                proto: s.proto.to_string(),
                sandbox: format!("{}:{}", s.sandbox_ip, s.guest_port),
                remote: format!("{}:{}", s.remote_ip, s.remote_port),
                snat: format!("{}:{}", s.snat_ip, s.snat_port),
                version: s.version,
                state: s.state.to_string(),
            })
            .collect())
    }
    fn delete_sessions_of(&self, ifindex: u32) -> Result<usize, DataplaneError> {
        self.maps.sessions.delete_of(ifindex).map_err(err)
    }
    fn sandbox_counters(&self, ifindex: u32) -> Result<Option<SandboxCounters>, DataplaneError> {
        self.maps.sandbox_stats.get(ifindex).map_err(err)
    }
    fn all_sandbox_counters(&self) -> Result<BTreeMap<u32, SandboxCounters>, DataplaneError> {
        self.maps.sandbox_stats.list().map_err(err)
    }
    fn session_quota_live(&self, ifindex: u32, version: u32) -> Result<Option<i64>, DataplaneError> {
        Ok(self.maps.sessions.quota_usage(ifindex, version).map_err(err)?.map(|u| u.live()))
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        let mut c: Counters = self
            .maps
            .counters
            .read()
            .map_err(err)?
            .into_iter()
            .map(|v| (format!("{}_{}", v.program, v.reason), v.packets))
            .collect();
        let st = self.reaper.stats();
        c.insert("reaper_runs".into(), st.runs.load(std::sync::atomic::Ordering::Relaxed));
        c.insert("reaper_removed".into(), st.removed.load(std::sync::atomic::Ordering::Relaxed));
        c.insert("reaper_last_scanned".into(), st.last_scanned.load(std::sync::atomic::Ordering::Relaxed));
        let d = self.dns_reaper.stats();
        c.insert("dns_reaper_learned_removed".into(), d.learned_removed.load(std::sync::atomic::Ordering::Relaxed));
        c.insert("dns_reaper_queries_removed".into(), d.queries_removed.load(std::sync::atomic::Ordering::Relaxed));
        c.insert("dns_reaper_frags_removed".into(), d.frags_removed.load(std::sync::atomic::Ordering::Relaxed));
        // Node-wide floor (decision Q4): gauges, not counters.
        if let Some(f) = self.maps.sessions.floor_state().map_err(err)? {
            c.insert("session_floor_live".into(), f.usage.live().max(0) as u64);
            c.insert("session_floor_ceiling".into(), u64::from(f.ceiling));
        }
        // Tracking floor (decision Q6): gauges per map.
        for (name, kind) in [
            ("dns_query_track", cubevs::track_floor::KIND_DNS_QUERY),
            ("frag_sessions", cubevs::track_floor::KIND_FRAG),
        ] {
            let t = self.maps.track.state(kind).map_err(err)?;
            c.insert(format!("track_floor_live:{name}"), t.node.live().max(0) as u64);
            c.insert(format!("track_floor_ceiling:{name}"), u64::from(t.ceiling));
        }
        Ok(c)
    }
}
