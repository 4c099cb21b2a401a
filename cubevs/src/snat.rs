//! SNAT addresses: `snat_iplist`, 4 slots filled round-robin from up to 4 addresses
//! (`reference/upstream.md §3.5`).

use std::{net::Ipv4Addr, sync::Mutex};

use aya::maps::{Array, MapData};
use cubevs_common::{SnatIp, limits, map};

use crate::Error;

/// One SNAT address and the ifindex its traffic leaves through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnatAddr {
    /// Address (usually the uplink's).
    pub ip: Ipv4Addr,
    /// Egress ifindex.
    pub ifindex: u32,
}

/// Typed access to `snat_iplist`.
pub struct SnatTable {
    inner: Mutex<Array<MapData, SnatIp>>,
}

impl SnatTable {
    pub(crate) fn new(a: Array<MapData, SnatIp>) -> Self {
        Self { inner: Mutex::new(a) }
    }

    /// Sets 1 to 4 SNAT addresses. Each sandbox hashes to one slot; slots repeat the
    /// addresses round-robin. A slot whose address and ifindex stay the same keeps its port
    /// cursor. Errors: `InvalidArgument` for 0 or more than 4 addresses, an unspecified IP or
    /// ifindex 0.
    pub fn set(&self, addrs: &[SnatAddr]) -> Result<(), Error> {
        let n = limits::SNAT_IPS as usize;
        if addrs.is_empty() || addrs.len() > n {
            return Err(Error::invalid("snat_ips", format!("need 1 to {n} addresses, got {}", addrs.len())));
        }
        for (i, a) in addrs.iter().enumerate() {
            if a.ip.is_unspecified() || a.ifindex == 0 {
                return Err(Error::invalid(format!("snat_ips[{i}]"), "address and ifindex must be set"));
            }
        }
        let mut arr = self.inner.lock().expect("snat lock");
        for slot in 0..limits::SNAT_IPS {
            let a = addrs[slot as usize % addrs.len()];
            let ip = u32::from_ne_bytes(a.ip.octets());
            let old = arr.get(&slot, 0).map_err(Error::map(map::SNAT_IPLIST, "lookup"))?;
            let cursor = if old.ip == ip && old.ifindex == a.ifindex { old.port_cursor } else { 0 };
            arr.set(slot, SnatIp { ifindex: a.ifindex, ip, port_cursor: cursor }, 0)
                .map_err(Error::map(map::SNAT_IPLIST, "update"))?;
        }
        Ok(())
    }

    /// The 4 slots (unused slots have IP 0.0.0.0).
    pub fn list(&self) -> Result<Vec<SnatIp>, Error> {
        let arr = self.inner.lock().expect("snat lock");
        (0..limits::SNAT_IPS).map(|i| arr.get(&i, 0).map_err(Error::map(map::SNAT_IPLIST, "lookup"))).collect()
    }
}
