//! The real [`Dataplane`]: `cubevs` as of the datapath issue 2, driven on the dataplane netns
//! thread.
//!
//! Wired today: program loading (`cubevs::Datapath::load` with the guest constants written into
//! `CONFIG`, links pinned under `<bpffs_dir>/links` and adopted on restart) and
//! `attach_sandbox` / `detach_sandbox` of `from_cube` on the TAPs.
//!
//! **Not wired yet** ([`UNWIRED`]): the map API the datapath issue 3 adds to `cubevs`. Until the
//! lead merges it, those methods act on an in-process [`MemTables`] with the same semantics
//! (conflict and validation errors included), so the agent's logic runs end to end, but they
//! have no kernel effect and do not survive a restart. Each one is marked `UNWIRED(cubevs)`.

use std::{
    net::Ipv4Addr,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use cubevs::{Datapath, DatapathConfig, LoadOptions};

use crate::{
    dataplane::{
        Counters, Dataplane, DataplaneError, EgressPolicy, MemTables, PortMapping, SandboxEntry, Session, SnatIp,
    },
    host::NetnsHost,
};

/// The [`Dataplane`] methods that still need the cubevs map API (datapath issue 3). The lead
/// wires each to the method of the same name on the cubevs maps handle, and `attach_uplink` /
/// `attach_cube_dev` to the `Datapath` methods, then empties this list.
pub const UNWIRED: &[&str] = &[
    "attach_uplink",
    "attach_cube_dev",
    "register_sandbox",
    "unregister_sandbox",
    "sandbox",
    "sandboxes",
    "set_snat_ips",
    "add_port_mapping",
    "delete_port_mapping",
    "delete_port_mappings_of",
    "port_mappings",
    "replace_policy",
    "install_default_deny",
    "remove_policy",
    "policy",
    "sessions",
    "counters",
];

/// Datapath backed by `cubevs`.
pub struct CubeVsDataplane {
    host: Arc<NetnsHost>,
    datapath: Arc<Mutex<Datapath>>,
    /// UNWIRED(cubevs): stand-in for the pinned maps.
    tables: Mutex<MemTables>,
}

impl std::fmt::Debug for CubeVsDataplane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CubeVsDataplane").finish_non_exhaustive()
    }
}

fn other(e: impl std::fmt::Display) -> DataplaneError {
    DataplaneError::Other(e.to_string())
}

impl CubeVsDataplane {
    /// Loads the object (`object`, empty = `cubevs::default_object_path()`) with `config`,
    /// pins under `bpffs_dir`; existing pinned links are adopted by later attaches.
    pub fn load(
        host: Arc<NetnsHost>,
        object: Option<PathBuf>,
        config: DatapathConfig,
        bpffs_dir: PathBuf,
    ) -> Result<Self, DataplaneError> {
        let mut opts = LoadOptions::new();
        if let Some(o) = object {
            opts.object = o;
        }
        opts.config = config;
        opts.pin_dir = Some(bpffs_dir);
        let dp = Datapath::load(opts).map_err(other)?;
        Ok(Self { host, datapath: Arc::new(Mutex::new(dp)), tables: Mutex::new(MemTables::default()) })
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, MemTables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Dataplane for CubeVsDataplane {
    fn attach_sandbox(&self, ifname: &str) -> Result<u32, DataplaneError> {
        let dp = self.datapath.clone();
        let n = ifname.to_string();
        self.host
            .run_first(move || dp.lock().unwrap_or_else(|e| e.into_inner()).attach_sandbox(&n))
            .map_err(other)?
            .map_err(other)
    }
    fn detach_sandbox(&self, ifname: &str) -> Result<(), DataplaneError> {
        let dp = self.datapath.clone();
        let n = ifname.to_string();
        self.host
            .run_first(move || dp.lock().unwrap_or_else(|e| e.into_inner()).detach_sandbox(&n))
            .map_err(other)?
            .map_err(other)
    }
    fn attach_uplink(&self, ifname: &str, ip: Ipv4Addr) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs): Datapath::attach_uplink (from_world) arrives with issue 3.
        tracing::warn!(ifname, %ip, "attach_uplink: not wired to cubevs yet (no from_world program)");
        Ok(())
    }
    fn attach_cube_dev(&self, ifname: &str, ip: Ipv4Addr) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs): Datapath::attach_cube_dev (from_envoy) arrives with issue 3.
        tracing::warn!(ifname, %ip, "attach_cube_dev: not wired to cubevs yet (no from_envoy program)");
        Ok(())
    }
    fn register_sandbox(&self, entry: &SandboxEntry) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs)
        self.tables().register(entry);
        Ok(())
    }
    fn unregister_sandbox(&self, ifindex: u32) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs)
        self.tables().unregister(ifindex);
        Ok(())
    }
    fn sandbox(&self, ifindex: u32) -> Result<Option<SandboxEntry>, DataplaneError> {
        // UNWIRED(cubevs)
        Ok(self.tables().sandbox(ifindex))
    }
    fn sandboxes(&self) -> Result<Vec<SandboxEntry>, DataplaneError> {
        // UNWIRED(cubevs)
        Ok(self.tables().sandboxes())
    }
    fn set_snat_ips(&self, ips: &[SnatIp]) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs)
        self.tables().set_snat(ips);
        Ok(())
    }
    fn add_port_mapping(&self, m: &PortMapping) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs)
        self.tables().add_port(m)
    }
    fn delete_port_mapping(&self, m: &PortMapping) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs)
        self.tables().delete_port(m);
        Ok(())
    }
    fn delete_port_mappings_of(&self, ifindex: u32) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs)
        self.tables().delete_ports_of(ifindex);
        Ok(())
    }
    fn port_mappings(&self) -> Result<Vec<PortMapping>, DataplaneError> {
        // UNWIRED(cubevs)
        Ok(self.tables().ports())
    }
    fn replace_policy(&self, ifindex: u32, policy: &EgressPolicy) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs)
        self.tables().replace_policy(ifindex, policy)
    }
    fn install_default_deny(&self, ifindex: u32) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs)
        self.tables().default_deny(ifindex);
        Ok(())
    }
    fn remove_policy(&self, ifindex: u32) -> Result<(), DataplaneError> {
        // UNWIRED(cubevs)
        self.tables().remove_policy(ifindex);
        Ok(())
    }
    fn policy(&self, ifindex: u32) -> Result<Option<EgressPolicy>, DataplaneError> {
        // UNWIRED(cubevs)
        Ok(self.tables().policy(ifindex))
    }
    fn sessions(&self) -> Result<Vec<Session>, DataplaneError> {
        // UNWIRED(cubevs): no session maps before issue 3.
        Ok(Vec::new())
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        // UNWIRED(cubevs): no counters before issue 3.
        Ok(Counters::new())
    }
}
