//! Node addresses the programs read (`node_config`): cube-dev and uplink.

use std::{net::Ipv4Addr, sync::Mutex};

use aya::maps::{Array, MapData};
use cubevs_common::{NodeConfig, map};

use crate::Error;

/// Typed access to `node_config`.
pub struct NodeTable {
    inner: Mutex<Array<MapData, NodeConfig>>,
}

impl NodeTable {
    pub(crate) fn new(a: Array<MapData, NodeConfig>) -> Self {
        Self { inner: Mutex::new(a) }
    }

    fn update(&self, f: impl FnOnce(&mut NodeConfig)) -> Result<(), Error> {
        let mut a = self.inner.lock().expect("node config lock");
        let mut c = a.get(&0, 0).map_err(Error::map(map::NODE_CONFIG, "lookup"))?;
        f(&mut c);
        a.set(0, c, 0).map_err(Error::map(map::NODE_CONFIG, "update"))
    }

    /// Records cube-dev's ifindex and address.
    pub fn set_cube_dev(&self, ifindex: u32, ip: Ipv4Addr) -> Result<(), Error> {
        self.update(|c| {
            c.cube_dev_ifindex = ifindex;
            c.cube_dev_ip = u32::from_ne_bytes(ip.octets());
        })
    }

    /// Records the uplink's ifindex and address.
    pub fn set_uplink(&self, ifindex: u32, ip: Ipv4Addr) -> Result<(), Error> {
        self.update(|c| {
            c.uplink_ifindex = ifindex;
            c.uplink_ip = u32::from_ne_bytes(ip.octets());
        })
    }

    /// The current node configuration.
    pub fn get(&self) -> Result<NodeConfig, Error> {
        self.inner.lock().expect("node config lock").get(&0, 0).map_err(Error::map(map::NODE_CONFIG, "lookup"))
    }
}
