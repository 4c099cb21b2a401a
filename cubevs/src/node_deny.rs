//! The node's extra always-denied destinations (`node_deny`, decision R30): CIDRs every
//! sandbox is denied before any allow (`allow_out`, a learned FQDN address, a static L7
//! entry), and that the DNS learner never learns. The agent writes its `always_denied_cidrs`
//! here at every start and on SIGHUP (R51); the list is replaced in place, so a restart or a
//! reload with a changed list changes what every running sandbox may reach.

use std::{collections::BTreeSet, net::Ipv4Addr, sync::Mutex};

use aya::maps::{LpmTrie, MapData, lpm_trie::Key};
use cubevs_common::{limits, map};

use crate::{Error, policy::Cidr};

/// Typed access to `node_deny`: LPM trie, key `{prefixlen: u32, addr: u32 NBO}`, value `u8` 1.
/// `None` inside when the loaded object has no such map (an object older than R30): then
/// [`NodeDenyTable::replace`] refuses a non-empty list.
pub struct NodeDenyTable {
    inner: Option<Mutex<LpmTrie<MapData, u32, u8>>>,
}

fn nbo(c: &Cidr) -> u32 {
    u32::from_ne_bytes(Ipv4Addr::from(c.first()).octets())
}

impl NodeDenyTable {
    pub(crate) fn new(t: Option<LpmTrie<MapData, u32, u8>>) -> Self {
        Self { inner: t.map(Mutex::new) }
    }

    /// Whether the loaded object has the map (objects older than R30 do not).
    pub fn supported(&self) -> bool {
        self.inner.is_some()
    }

    /// Makes the map hold exactly `list` (host bits cleared, duplicates merged): the new
    /// entries are inserted first, then the entries not in `list` are deleted, so an entry in
    /// both the old and the new list is never absent. Errors: [`Error::InvalidArgument`]
    /// (field `always_denied_cidrs`) for more than [`limits::NODE_DENY`] entries, or a
    /// non-empty list when the object lacks the map; map syscall errors otherwise.
    pub fn replace(&self, list: &[Cidr]) -> Result<(), Error> {
        self.check(list)?;
        let want: BTreeSet<(u8, u32)> = list.iter().map(|c| (c.len, nbo(c))).collect();
        let Some(inner) = &self.inner else { return Ok(()) };
        let mut t = inner.lock().unwrap_or_else(|e| e.into_inner());
        for &(len, addr) in &want {
            t.insert(&Key::new(len as u32, addr), 1, 0).map_err(Error::map(map::NODE_DENY, "update"))?;
        }
        let have: Vec<Key<u32>> = t.keys().filter_map(Result::ok).collect();
        for k in have {
            if !want.contains(&(k.prefix_len() as u8, k.data())) {
                match t.remove(&k) {
                    Ok(()) => {}
                    Err(e) if crate::error::is_not_found(&e) => {}
                    Err(e) => return Err(Error::map(map::NODE_DENY, "delete")(e)),
                }
            }
        }
        Ok(())
    }

    /// Whether [`NodeDenyTable::replace`] would accept `list`, without writing: the same
    /// [`Error::InvalidArgument`] errors (field `always_denied_cidrs`) for more than
    /// [`limits::NODE_DENY`] distinct entries or a non-empty list without the map.
    pub fn check(&self, list: &[Cidr]) -> Result<(), Error> {
        let want: BTreeSet<(u8, u32)> = list.iter().map(|c| (c.len, nbo(c))).collect();
        if want.len() > limits::NODE_DENY as usize {
            return Err(Error::invalid(
                "always_denied_cidrs",
                format!("{} entries exceed the limit of {}", want.len(), limits::NODE_DENY),
            ));
        }
        if self.inner.is_none() && !want.is_empty() {
            return Err(Error::invalid(
                "always_denied_cidrs",
                "the loaded eBPF object has no node_deny map (older than decision R30)",
            ));
        }
        Ok(())
    }

    /// The entries the map holds now, sorted (empty without the map).
    pub fn list(&self) -> Vec<Cidr> {
        let Some(inner) = &self.inner else { return Vec::new() };
        let t = inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<Cidr> = t
            .keys()
            .filter_map(Result::ok)
            .map(|k| Cidr::new(Ipv4Addr::from(k.data().to_ne_bytes()), k.prefix_len() as u8))
            .collect();
        v.sort();
        v
    }
}
