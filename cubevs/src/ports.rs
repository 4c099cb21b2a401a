//! Host-port mappings: `remote_port_mapping` (host port → sandbox port) and
//! `local_port_mapping` (sandbox port → host port), one pair of maps per protocol
//! (`reference/upstream.md §3.6`; upstream maps only TCP). Deleting a TCP mapping stamps
//! its host port in `host_port_released` (decision R74) before the mapping goes.

use std::sync::Mutex;

use aya::maps::{HashMap, MapData};
use cubevs_common::{MvmPort, map};

use crate::{
    Error,
    error::{is_exists, is_not_found},
};

/// Transport protocol of a mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Proto {
    /// Lower-case name (`tcp`, `udp`).
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// One mapping: `host_port` on the node address → `guest_port` of the sandbox on `ifindex`.
/// Ports are host order here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortMapping {
    /// Protocol.
    pub proto: Proto,
    /// Host port (1–65535).
    pub host_port: u16,
    /// Sandbox interface ifindex.
    pub ifindex: u32,
    /// Guest port (1–65535).
    pub guest_port: u16,
}

type Remote = HashMap<MapData, u16, MvmPort>;
type Local = HashMap<MapData, MvmPort, u16>;

struct Pair {
    remote: Remote,
    local: Local,
    remote_name: &'static str,
    local_name: &'static str,
}

type Released = HashMap<MapData, u16, u64>;

/// Typed access to the four port-mapping maps and `host_port_released` (`None` when the loaded
/// object has no such map: an object older than R74, which then keeps R73's limit).
pub struct PortMaps {
    inner: Mutex<[Pair; 2]>,
    released: Option<Mutex<Released>>,
}

fn target(m: &PortMapping) -> MvmPort {
    MvmPort { ifindex: m.ifindex, listen_port: m.guest_port.to_be(), _pad: 0 }
}

impl PortMaps {
    pub(crate) fn new(tcp: (Remote, Local), udp: (Remote, Local), released: Option<Released>) -> Self {
        Self {
            released: released.map(Mutex::new),
            inner: Mutex::new([
                Pair {
                    remote: tcp.0,
                    local: tcp.1,
                    remote_name: map::REMOTE_PORT_MAPPING,
                    local_name: map::LOCAL_PORT_MAPPING,
                },
                Pair {
                    remote: udp.0,
                    local: udp.1,
                    remote_name: map::REMOTE_PORT_MAPPING_UDP,
                    local_name: map::LOCAL_PORT_MAPPING_UDP,
                },
            ]),
        }
    }

    /// Whether the loaded object has `host_port_released` (objects older than R74 do not).
    pub fn tracks_releases(&self) -> bool {
        self.released.is_some()
    }

    /// Stamps TCP host port `hp` (NBO) as released now (CLOCK_MONOTONIC ns) in
    /// `host_port_released`, so the datapath drops its previous owner's unrecorded connections
    /// for D20's ESTABLISHED timeout (decision R74). No-op for UDP or without the map.
    fn stamp_release(&self, proto: Proto, hp: u16) -> Result<(), Error> {
        let (Proto::Tcp, Some(r)) = (proto, &self.released) else { return Ok(()) };
        let mut r = r.lock().unwrap_or_else(|e| e.into_inner());
        r.insert(hp, crate::reaper::monotonic_ns(), 0).map_err(Error::map(map::HOST_PORT_RELEASED, "update"))
    }

    /// When TCP host port `host_port` (host order) was last released (CLOCK_MONOTONIC ns), if
    /// the object tracks releases and it ever was (decision R74).
    pub fn released_at(&self, host_port: u16) -> Result<Option<u64>, Error> {
        let Some(r) = &self.released else { return Ok(None) };
        let r = r.lock().unwrap_or_else(|e| e.into_inner());
        match r.get(&host_port.to_be(), 0) {
            Ok(v) => Ok(Some(v)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(Error::map(map::HOST_PORT_RELEASED, "lookup")(e)),
        }
    }

    fn idx(p: Proto) -> usize {
        match p {
            Proto::Tcp => 0,
            Proto::Udp => 1,
        }
    }

    /// Adds `m`. The exact same mapping again is a no-op; a host port already mapped elsewhere,
    /// or a sandbox port already mapped to another host port, is a `Conflict`; zero ports or
    /// ifindex are `InvalidArgument`. Nothing changes on error.
    pub fn add(&self, m: &PortMapping) -> Result<(), Error> {
        if m.host_port == 0 {
            return Err(Error::invalid("host_port", "must be 1-65535"));
        }
        if m.guest_port == 0 {
            return Err(Error::invalid("guest_port", "must be 1-65535"));
        }
        if m.ifindex == 0 {
            return Err(Error::invalid("ifindex", "must not be 0"));
        }
        let mut g = self.inner.lock().expect("port maps lock");
        let p = &mut g[Self::idx(m.proto)];
        let (hp, t) = (m.host_port.to_be(), target(m));
        let existing_remote = match p.remote.get(&hp, 0) {
            Ok(v) => Some(v),
            Err(e) if is_not_found(&e) => None,
            Err(e) => return Err(Error::map(p.remote_name, "lookup")(e)),
        };
        let existing_local = match p.local.get(&t, 0) {
            Ok(v) => Some(v),
            Err(e) if is_not_found(&e) => None,
            Err(e) => return Err(Error::map(p.local_name, "lookup")(e)),
        };
        match (existing_remote, existing_local) {
            (Some(r), Some(l)) if r == t && l == hp => return Ok(()),
            (Some(r), _) if r != t => {
                return Err(Error::Conflict(format!(
                    "{} host port {} is mapped to ifindex {} port {}",
                    m.proto.as_str(),
                    m.host_port,
                    r.ifindex,
                    u16::from_be(r.listen_port)
                )));
            }
            (_, Some(l)) if l != hp => {
                return Err(Error::Conflict(format!(
                    "{} port {} of ifindex {} is mapped to host port {}",
                    m.proto.as_str(),
                    m.guest_port,
                    m.ifindex,
                    u16::from_be(l)
                )));
            }
            _ => {}
        }
        let inserted_remote = existing_remote.is_none();
        if inserted_remote {
            p.remote.insert(hp, t, crate::BPF_NOEXIST).map_err(|e| {
                if is_exists(&e) {
                    Error::Conflict(format!("{} host port {} was taken concurrently", m.proto.as_str(), m.host_port))
                } else {
                    Error::map(p.remote_name, "insert")(e)
                }
            })?;
        }
        if existing_local.is_none()
            && let Err(e) = p.local.insert(t, hp, crate::BPF_NOEXIST)
        {
            if inserted_remote {
                let _ = p.remote.remove(&hp);
            }
            return Err(Error::map(p.local_name, "insert")(e));
        }
        Ok(())
    }

    /// Deletes `m`; each side is removed only if it still points at the other. Absent: no-op.
    /// A TCP host port is stamped released (R74) before its mapping is removed, so no next owner
    /// can get it unstamped; a failed stamp is returned and the mapping is kept.
    pub fn delete(&self, m: &PortMapping) -> Result<(), Error> {
        let mut g = self.inner.lock().expect("port maps lock");
        let p = &mut g[Self::idx(m.proto)];
        let (hp, t) = (m.host_port.to_be(), target(m));
        if p.remote.get(&hp, 0).ok() == Some(t) {
            self.stamp_release(m.proto, hp)?;
            p.remote
                .remove(&hp)
                .or_else(|e| if is_not_found(&e) { Ok(()) } else { Err(e) })
                .map_err(Error::map(p.remote_name, "delete"))?;
        }
        if p.local.get(&t, 0).ok() == Some(hp) {
            p.local
                .remove(&t)
                .or_else(|e| if is_not_found(&e) { Ok(()) } else { Err(e) })
                .map_err(Error::map(p.local_name, "delete"))?;
        }
        Ok(())
    }

    /// Deletes every mapping of `ifindex` (both protocols, both directions); returns how many
    /// map entries were removed. Each TCP host port is stamped released (R74) before its
    /// mapping goes; a failed stamp keeps that mapping and is returned.
    pub fn delete_of(&self, ifindex: u32) -> Result<usize, Error> {
        let mut g = self.inner.lock().expect("port maps lock");
        let mut removed = 0;
        for (i, p) in g.iter_mut().enumerate() {
            let proto = if i == 0 { Proto::Tcp } else { Proto::Udp };
            // Collect first, then delete: deleting while iterating skips entries.
            let remote: Vec<u16> =
                p.remote.iter().filter_map(Result::ok).filter(|(_, v)| v.ifindex == ifindex).map(|(k, _)| k).collect();
            let local: Vec<MvmPort> = p.local.keys().filter_map(Result::ok).filter(|k| k.ifindex == ifindex).collect();
            for k in remote {
                self.stamp_release(proto, k)?;
                if p.remote.remove(&k).is_ok() {
                    removed += 1;
                }
            }
            for k in local {
                if p.local.remove(&k).is_ok() {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    /// Every mapping, sorted (from the host-port side).
    pub fn list(&self) -> Result<Vec<PortMapping>, Error> {
        let g = self.inner.lock().expect("port maps lock");
        let mut out = Vec::new();
        for (i, p) in g.iter().enumerate() {
            let proto = if i == 0 { Proto::Tcp } else { Proto::Udp };
            for r in p.remote.iter() {
                let (k, v) = r.map_err(Error::map(p.remote_name, "iterate"))?;
                out.push(PortMapping {
                    proto,
                    host_port: u16::from_be(k),
                    ifindex: v.ifindex,
                    guest_port: u16::from_be(v.listen_port),
                });
            }
        }
        out.sort();
        Ok(out)
    }

    /// Number of entries in each of the four maps: (tcp remote, tcp local, udp remote, udp local).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let g = self.inner.lock().expect("port maps lock");
        (g[0].remote.keys().count(), g[0].local.keys().count(), g[1].remote.keys().count(), g[1].local.keys().count())
    }
}
