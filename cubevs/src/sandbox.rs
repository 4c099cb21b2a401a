//! Sandbox registry: `ifindex_to_mvmmeta` (ifindex → metadata) and `mvmip_to_ifindex`
//! (mvm IP → ifindex), kept consistent with each other. A sandbox version's live-session
//! budget entries (`crate::quota`) are created by the datapath on its first new flow and
//! removed here when the version is unregistered or replaced.

use std::{
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

use aya::maps::{HashMap, MapData};
use cubevs_common::{MvmMeta, map};

use crate::{Error, error::is_not_found, sessions::Sessions};

/// One registered sandbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxEntry {
    /// Sandbox interface ifindex (in the dataplane netns).
    pub ifindex: u32,
    /// The sandbox's mvm IP (what 169.254.68.6 is rewritten to).
    pub ip: Ipv4Addr,
    /// Version stamped into every session key of this sandbox; bump it whenever an
    /// interface is reused so old flows never match.
    pub version: u32,
    /// Sandbox id, at most 64 bytes.
    pub id: String,
}

/// Maximum sandbox id length stored in the metadata.
pub const MAX_ID_LEN: usize = 64;

impl SandboxEntry {
    fn meta(&self) -> MvmMeta {
        let mut uuid = [0u8; 64];
        uuid[..self.id.len()].copy_from_slice(self.id.as_bytes());
        MvmMeta {
            version: self.version,
            ip: u32::from_ne_bytes(self.ip.octets()),
            uuid,
            dns_policy_flags: 0,
            _reserved: [0; 55],
        }
    }

    fn from_meta(ifindex: u32, m: &MvmMeta) -> Self {
        let end = m.uuid.iter().position(|&b| b == 0).unwrap_or(m.uuid.len());
        Self {
            ifindex,
            ip: Ipv4Addr::from(m.ip.to_ne_bytes()),
            version: m.version,
            id: String::from_utf8_lossy(&m.uuid[..end]).into_owned(),
        }
    }
}

type MetaMap = HashMap<MapData, u32, MvmMeta>;
type IpMap = HashMap<MapData, u32, u32>;

/// Typed access to the two sandbox maps.
pub struct SandboxTable {
    inner: Mutex<(MetaMap, IpMap)>,
    /// The sessions, whose lock guards the budget maps (`crate::quota`).
    sessions: Arc<Sessions>,
}

impl SandboxTable {
    pub(crate) fn new(meta: MetaMap, by_ip: IpMap, sessions: Arc<Sessions>) -> Self {
        Self { inner: Mutex::new((meta, by_ip)), sessions }
    }

    /// Registers (or updates) the sandbox on `e.ifindex`. A different version replacing the
    /// registered one drops the old version's session-budget entries: its sessions are stale
    /// and the new version starts at 0. A sandbox new to the interface reserves its floor: the
    /// node-wide ceiling is recomputed (decision Q4).
    ///
    /// Errors: `InvalidArgument` for ifindex 0, an unspecified IP or an id over 64 bytes;
    /// `Conflict` when the IP already belongs to another interface. Nothing changes on error.
    pub fn register(&self, e: &SandboxEntry) -> Result<(), Error> {
        if e.ifindex == 0 {
            return Err(Error::invalid("ifindex", "must not be 0"));
        }
        if e.ip.is_unspecified() {
            return Err(Error::invalid("ip", "must not be 0.0.0.0"));
        }
        if e.id.len() > MAX_ID_LEN || e.id.contains('\0') {
            return Err(Error::invalid("id", format!("at most {MAX_ID_LEN} bytes without NUL")));
        }
        let ip = u32::from_ne_bytes(e.ip.octets());
        let mut g = self.inner.lock().expect("sandbox maps lock");
        let (meta, by_ip) = &mut *g;
        match by_ip.get(&ip, 0) {
            Ok(other) if other != e.ifindex => {
                return Err(Error::Conflict(format!("{} already belongs to ifindex {other}", e.ip)));
            }
            Ok(_) => {}
            Err(err) if is_not_found(&err) => {}
            Err(err) => return Err(Error::map(map::MVMIP_TO_IFINDEX, "lookup")(err)),
        }
        let old = meta.get(&e.ifindex, 0).ok();
        meta.insert(e.ifindex, e.meta(), 0).map_err(Error::map(map::IFINDEX_TO_MVMMETA, "insert"))?;
        if let Err(err) = by_ip.insert(ip, e.ifindex, 0) {
            // Roll back the metadata so the two maps stay consistent.
            let _ = match old {
                Some(o) => meta.insert(e.ifindex, o, 0),
                None => meta.remove(&e.ifindex),
            };
            return Err(Error::map(map::MVMIP_TO_IFINDEX, "insert")(err));
        }
        if let Some(o) = old
            && o.ip != ip
            && by_ip.get(&o.ip, 0).ok() == Some(e.ifindex)
        {
            let _ = by_ip.remove(&o.ip);
        }
        if let Some(o) = old
            && o.version != e.version
        {
            self.sessions.forget_quota(e.ifindex, o.version)?;
        }
        drop(g);
        if old.is_none() {
            // One more registered sandbox: its floor is reserved (decision Q4) before this
            // returns, by a recount shared with concurrent registrations and run outside the
            // sandbox maps' lock, so other registrations and unregisters go on meanwhile (F23).
            self.sessions.refresh_floor()?;
        }
        Ok(())
    }

    /// Removes the sandbox on `ifindex`; the IP entry is removed only if it still points at
    /// this interface; its version's session-budget entries go too, after the sandbox maps'
    /// lock is released (decision F24): a caller must not register the same (ifindex, version)
    /// again before this returns (the agent never reuses a version). Its floor stays reserved
    /// until the next recount (the next registration of a new sandbox, or the reaper's sweep,
    /// every `reaper_interval_secs`): a ceiling lower than needed only narrows the shared room
    /// for that long, and the Release path skips a scan of every registration (decision F14).
    /// Unknown ifindex: no-op.
    pub fn unregister(&self, ifindex: u32) -> Result<(), Error> {
        let mut g = self.inner.lock().expect("sandbox maps lock");
        let (meta, by_ip) = &mut *g;
        let m = match meta.get(&ifindex, 0) {
            Ok(m) => m,
            Err(e) if is_not_found(&e) => return Ok(()),
            Err(e) => return Err(Error::map(map::IFINDEX_TO_MVMMETA, "lookup")(e)),
        };
        match meta.remove(&ifindex) {
            Ok(()) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(Error::map(map::IFINDEX_TO_MVMMETA, "delete")(e)),
        }
        if by_ip.get(&m.ip, 0).ok() == Some(ifindex) {
            match by_ip.remove(&m.ip) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(Error::map(map::MVMIP_TO_IFINDEX, "delete")(e)),
            }
        }
        // The budget entries outside the sandbox maps' lock (decision F24): they are keyed by
        // this version, which no registration reuses (a new registration of the interface has
        // a new version and `old` = none), so nothing here races the maps this lock guards; it
        // only kept every other register/unregister waiting behind the budget maps' flocks.
        drop(g);
        self.sessions.forget_quota(ifindex, m.version)
    }

    /// The sandbox on `ifindex`, if registered.
    pub fn get(&self, ifindex: u32) -> Result<Option<SandboxEntry>, Error> {
        let g = self.inner.lock().expect("sandbox maps lock");
        match g.0.get(&ifindex, 0) {
            Ok(m) => Ok(Some(SandboxEntry::from_meta(ifindex, &m))),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(Error::map(map::IFINDEX_TO_MVMMETA, "lookup")(e)),
        }
    }

    /// The ifindex owning mvm IP `ip`, if any.
    pub fn ifindex_of(&self, ip: Ipv4Addr) -> Result<Option<u32>, Error> {
        let g = self.inner.lock().expect("sandbox maps lock");
        match g.1.get(&u32::from_ne_bytes(ip.octets()), 0) {
            Ok(i) => Ok(Some(i)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(Error::map(map::MVMIP_TO_IFINDEX, "lookup")(e)),
        }
    }

    /// Every registered sandbox, sorted by ifindex.
    pub fn list(&self) -> Result<Vec<SandboxEntry>, Error> {
        let g = self.inner.lock().expect("sandbox maps lock");
        let mut out = Vec::new();
        for r in g.0.iter() {
            let (k, m) = r.map_err(Error::map(map::IFINDEX_TO_MVMMETA, "iterate"))?;
            out.push(SandboxEntry::from_meta(k, &m));
        }
        out.sort_by_key(|e| e.ifindex);
        Ok(out)
    }
}
