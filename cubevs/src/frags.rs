//! Typed access to `frag_sessions_v2` (`cubevs_common::FragKey` → `cubevs_common::FragTarget`,
//! decision R12): the datapath records each fragmented world reply's first fragment there,
//! within a per-sandbox insert budget, and never evicts; expired entries are deleted here
//! ([`FragTable::reap`], run by [`crate::dns_reaper::DnsReaper`]'s tick).

use std::{net::Ipv4Addr, sync::Mutex};

use aya::maps::{HashMap, MapData};
use cubevs_common::{FragKey, FragTarget, map};

use crate::Error;

/// One recorded fragmented datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FragEntry {
    /// The world sender.
    pub src: Ipv4Addr,
    /// The node address it was sent to.
    pub dst: Ipv4Addr,
    /// IP identification (host order).
    pub ip_id: u16,
    /// IP protocol number.
    pub proto: u8,
    /// Sandbox interface the later fragments go to.
    pub ifindex: u32,
    /// Sandbox version of the session the first fragment matched (without the ambiguity bit).
    pub version: u32,
    /// Another sandbox's first fragment named this entry's key while it was live: its later
    /// fragments are dropped until it expires ([`cubevs_common::FRAG_AMBIGUOUS`], decision R16).
    pub ambiguous: bool,
    /// Expiry, CLOCK_MONOTONIC ns.
    pub expires_ns: u64,
    /// Charged to its sandbox version and the node (made by an object with the tracking
    /// floor, decision Q6).
    pub charged: bool,
}

/// `frag_sessions_v2`.
pub struct FragTable {
    inner: Mutex<HashMap<MapData, FragKey, FragTarget>>,
    /// Where the charged entries the reaper deletes are counted (decision Q6).
    track: Option<std::sync::Arc<crate::track_floor::TrackFloor>>,
}

impl FragTable {
    pub(crate) fn new(
        m: HashMap<MapData, FragKey, FragTarget>,
        track: Option<std::sync::Arc<crate::track_floor::TrackFloor>>,
    ) -> Self {
        Self { inner: Mutex::new(m), track }
    }

    /// Every recorded datagram (optionally of one interface).
    pub fn list(&self, ifindex: Option<u32>) -> Vec<FragEntry> {
        let m = self.inner.lock().expect("frag lock");
        m.iter()
            .filter_map(Result::ok)
            .filter(|(_, t)| ifindex.is_none_or(|i| i == t.ifindex))
            .map(|(k, t)| FragEntry {
                src: Ipv4Addr::from(k.src_ip.to_ne_bytes()),
                dst: Ipv4Addr::from(k.dst_ip.to_ne_bytes()),
                ip_id: u16::from_be(k.ip_id),
                proto: k.proto,
                ifindex: t.ifindex,
                version: t.version & !cubevs_common::FRAG_AMBIGUOUS,
                ambiguous: t.version & cubevs_common::FRAG_AMBIGUOUS != 0,
                expires_ns: t.expires_ns,
                charged: k._pad == cubevs_common::track::FRAG_CHARGED,
            })
            .collect()
    }

    /// Deletes the entries expired at `now_ns` (CLOCK_MONOTONIC); returns how many. An entry
    /// is re-read right before its delete and kept when the datapath rewrote it meanwhile (a
    /// new datagram with the same key). Each charged entry this delete removed is given back to
    /// its owner and the node (decision Q6; the datapath never deletes entries and never gives
    /// a key to another owner, so the owner read here is the one charged; an ambiguous entry's
    /// owner is its version without [`cubevs_common::FRAG_AMBIGUOUS`], R16). Errors: `Map` for a
    /// failed delete.
    pub fn reap(&self, now_ns: u64) -> Result<usize, Error> {
        let mut m = self.inner.lock().expect("frag lock");
        let expired: Vec<(FragKey, FragTarget)> =
            m.iter().filter_map(Result::ok).filter(|(_, t)| t.expires_ns <= now_ns).collect();
        let mut n = 0;
        let mut owners = Vec::new();
        for (k, t) in expired {
            match m.get(&k, 0) {
                Ok(cur) if cur == t => {}
                _ => continue,
            }
            match m.remove(&k) {
                Ok(()) if k._pad == cubevs_common::track::FRAG_CHARGED => owners.push(cubevs_common::QuotaKey {
                    ifindex: t.ifindex,
                    version: t.version & !cubevs_common::FRAG_AMBIGUOUS,
                }),
                Ok(()) => {}
                Err(e) if crate::error::is_not_found(&e) => continue,
                Err(e) => return Err(Error::map(map::FRAG_SESSIONS, "delete")(e)),
            }
            n += 1;
        }
        if let Some(t) = &self.track {
            t.closed(crate::track_floor::KIND_FRAG, &owners)?;
        }
        Ok(n)
    }
}
