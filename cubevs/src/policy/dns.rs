//! DNS learning state in userspace: the FQDN patterns written per policy generation
//! (`dns_allow`), and the kernel-written maps `dns_learned` (learned addresses) and
//! `dns_query_track` (queries in flight), which userspace only lists, reaps and purges.
//!
//! Pattern keys: [`cubevs_common::dns::name_hash`] of the lower-case name (the suffix of a
//! `*.` pattern) with `subdomains` set for `*.`; values carry the pattern's ports (NBO, at
//! most [`cubevs_common::dns::MAX_PORTS`]; none = every port). The datapath side is
//! `ebpf/cubevs-ebpf/src/dns.rs`.

use std::net::Ipv4Addr;

use aya::maps::{HashMap, MapData};
use cubevs_common::{
    dns::{
        DnsAllowKey, DnsAllowName, DnsAllowValue, DnsQueryKey, DnsQueryValue, LearnedKey, LearnedValue, MAX_PORTS,
        name_hash,
    },
    map,
};

use super::FqdnPattern;
use crate::Error;

/// Names the policy's L7 rules match on (`match.host`, `match.sni`), normalised like FQDN
/// patterns (lower case, no trailing dot, `*.` kept): an FQDN pattern spelled the same is L7.
pub(crate) fn l7_names(rules: &[egress_policy::RuleSpec]) -> std::collections::HashSet<String> {
    rules
        .iter()
        .flat_map(|r| [r.matcher.host.as_deref(), r.matcher.sni.as_deref()])
        .flatten()
        .map(|n| n.trim().trim_end_matches('.').to_ascii_lowercase())
        .collect()
}

/// Whether `p` is named by an L7 rule (see [`l7_names`]).
pub(crate) fn is_l7(p: &FqdnPattern, l7: &std::collections::HashSet<String>) -> bool {
    let spelled = if p.subdomains { format!("*.{}", p.name) } else { p.name.clone() };
    l7.contains(&spelled)
}

/// The `dns_allow` entries of one pattern under (`ifindex`, `generation`); `l7` sets
/// [`cubevs_common::dns::FLAG_L7`] (its learned addresses are steered to CubeEgress).
pub(crate) fn pattern_entry(ifindex: u32, generation: u32, p: &FqdnPattern, l7: bool) -> (DnsAllowKey, DnsAllowValue) {
    let key = DnsAllowKey {
        ifindex,
        generation,
        name_hash: name_hash(&p.name),
        subdomains: p.subdomains as u8,
        _pad: [0; 7],
    };
    let mut ports = [0u16; MAX_PORTS];
    for (d, s) in ports.iter_mut().zip(&p.ports) {
        *d = s.to_be();
    }
    let flags = if l7 { cubevs_common::dns::FLAG_L7 } else { 0 };
    let tag = cubevs_common::dns::pattern_tag(key.name_hash, p.subdomains);
    let value = DnsAllowValue { port_count: p.ports.len().min(MAX_PORTS) as u8, flags, tag, ports };
    (key, value)
}

/// One learned entry as userspace reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct LearnedEntry {
    /// Sandbox interface.
    pub ifindex: u32,
    /// Learned address.
    pub ip: Ipv4Addr,
    /// Destination port (host order); 0 = every port.
    pub port: u16,
    /// Expiry, CLOCK_MONOTONIC ns.
    pub expires_ns: u64,
    /// Sandbox version that learned it.
    pub version: u32,
    /// Flows to it on 80/443 are steered to CubeEgress.
    pub l7: bool,
    /// [`cubevs_common::dns::pattern_tag`] of the pattern it was learned for (0 = unknown);
    /// [`crate::policy::FqdnPattern::tag`] maps it back.
    pub tag: u16,
}

/// What one [`DnsMaps::reap`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DnsReap {
    /// Expired learned entries deleted.
    pub learned: usize,
    /// Expired tracked queries deleted.
    pub queries: usize,
}

/// The kernel-written DNS maps.
pub(crate) struct DnsMaps {
    pub(crate) allow: HashMap<MapData, DnsAllowKey, DnsAllowValue>,
    /// Each pattern's name under its `dns_allow` key (decision R48); `None` with an object
    /// older than R48.
    pub(crate) names: Option<HashMap<MapData, DnsAllowKey, DnsAllowName>>,
    pub(crate) learned: HashMap<MapData, LearnedKey, LearnedValue>,
    pub(crate) queries: HashMap<MapData, DnsQueryKey, DnsQueryValue>,
    /// Where the charged queries this side deletes are counted (decision Q6).
    pub(crate) track: Option<std::sync::Arc<crate::track_floor::TrackFloor>>,
}

/// The owner of a tracked query whose charge a userspace delete gives back (`None`: made
/// uncharged, by an object older than the tracking floor).
fn charged(k: &DnsQueryKey, v: &DnsQueryValue) -> Option<cubevs_common::QuotaKey> {
    (v._pad == cubevs_common::track::DNS_CHARGED)
        .then_some(cubevs_common::QuotaKey { ifindex: k.ifindex, version: k.version })
}

/// The owner of a learned entry whose charge a userspace delete gives back (decision R66;
/// `None`: made uncharged, by an object older than the learned floor).
fn learned_charged(k: &LearnedKey, v: &LearnedValue) -> Option<cubevs_common::QuotaKey> {
    cubevs_common::learned_floor::is_charged(v.flags)
        .then_some(cubevs_common::QuotaKey { ifindex: k.ifindex, version: v.version })
}

/// Entries read per `BPF_MAP_LOOKUP_BATCH` when scanning `dns_learned` / `dns_query_track`.
const SCAN_BATCH: usize = 4096;

impl DnsMaps {
    /// Interfaces with any learned entry or tracked query (one batched scan of each map).
    pub(crate) fn ifindexes(&self) -> Result<std::collections::HashSet<u32>, Error> {
        let mut v: std::collections::HashSet<u32> =
            self.scan_learned(|_, _| true)?.into_iter().map(|(k, _)| k.ifindex).collect();
        v.extend(self.scan_queries(|_, _| true)?.into_iter().map(|(k, _)| k.ifindex));
        Ok(v)
    }

    /// Every (key, value) of `dns_learned` for which `keep` holds: one batched read per
    /// [`SCAN_BATCH`] entries. aya's iterator costs a syscall or two per entry, under the policy
    /// lock, on the Release path and every learned-feed poll: listing the keys of a map of
    /// 200,050 entries took 1.4 s, the whole batched purge 0.38 s (debug build, decision N11).
    fn scan_learned(
        &self,
        keep: impl FnMut(&LearnedKey, &LearnedValue) -> bool,
    ) -> Result<Vec<(LearnedKey, LearnedValue)>, Error> {
        scan(&self.learned, map::DNS_LEARNED, keep)
    }

    /// [`Self::scan_learned`] for `dns_query_track`.
    fn scan_queries(
        &self,
        keep: impl FnMut(&DnsQueryKey, &DnsQueryValue) -> bool,
    ) -> Result<Vec<(DnsQueryKey, DnsQueryValue)>, Error> {
        scan(&self.queries, map::DNS_QUERY_TRACK, keep)
    }

    /// Every learned entry (optionally of one interface), sorted. A failed read is logged and
    /// reads as empty (the callers list or feed; nothing is deleted from it).
    pub(crate) fn learned(&self, ifindex: Option<u32>) -> Vec<LearnedEntry> {
        let all = self.scan_learned(|k, _| ifindex.is_none_or(|i| i == k.ifindex)).unwrap_or_else(|e| {
            log::warn!("reading dns_learned: {e}");
            Vec::new()
        });
        let mut v: Vec<LearnedEntry> = all
            .into_iter()
            .map(|(k, v)| LearnedEntry {
                ifindex: k.ifindex,
                ip: Ipv4Addr::from(k.ip.to_ne_bytes()),
                port: u16::from_be(k.port),
                expires_ns: v.expires_ns,
                version: v.version,
                l7: v.flags & cubevs_common::dns::FLAG_L7 as u32 != 0,
                tag: v.tag(),
            })
            .collect();
        v.sort_by_key(|e| (e.ifindex, e.ip, e.port));
        v
    }

    /// Tracked queries (optionally of one interface). A failed read is logged and reads as empty.
    pub(crate) fn queries(&self, ifindex: Option<u32>) -> Vec<(DnsQueryKey, DnsQueryValue)> {
        self.scan_queries(|k, _| ifindex.is_none_or(|i| i == k.ifindex)).unwrap_or_else(|e| {
            log::warn!("reading dns_query_track: {e}");
            Vec::new()
        })
    }

    /// Deletes the learned entries and tracked queries of `ifindex` (one batched scan of each
    /// map: the kernel writes them, so there is no userspace index; batched deletes). Returns
    /// how many learned entries went.
    pub(crate) fn purge(&mut self, ifindex: u32) -> Result<usize, Error> {
        use aya::maps::IterableMap;
        use std::os::fd::AsFd;
        let (keys, vals): (Vec<LearnedKey>, Vec<LearnedValue>) =
            self.scan_learned(|k, _| k.ifindex == ifindex)?.into_iter().unzip();
        // Each charged entry this delete removed is refunded to the owner its scanned value
        // names (decision R66; the batch delete reports every key it removed).
        let mut learned_owners = Vec::new();
        crate::batch::delete_with(self.learned.map().fd().as_fd(), &keys, SCAN_BATCH, |i| {
            learned_owners.extend(learned_charged(&keys[i], &vals[i]));
        })
        .map_err(|source| Error::MapSyscall { map: map::DNS_LEARNED, op: "batch delete", source })?;
        if let Some(l) = self.track.as_ref().and_then(|t| t.learned()) {
            l.closed(&learned_owners)?;
        }
        let (q, v): (Vec<DnsQueryKey>, Vec<DnsQueryValue>) =
            self.scan_queries(|k, _| k.ifindex == ifindex)?.into_iter().unzip();
        let mut owners = Vec::new();
        crate::batch::delete_with(self.queries.map().fd().as_fd(), &q, SCAN_BATCH, |i| {
            owners.extend(charged(&q[i], &v[i]));
        })
        .map_err(|source| Error::MapSyscall { map: map::DNS_QUERY_TRACK, op: "batch delete", source })?;
        if let Some(t) = &self.track {
            t.closed(crate::track_floor::KIND_DNS_QUERY, &owners)?;
        }
        Ok(keys.len())
    }

    /// Deletes `k` from `dns_learned` and returns the value this delete removed (`None`:
    /// already gone), one `BPF_MAP_LOOKUP_AND_DELETE_ELEM`.
    fn take_learned(&self, k: &LearnedKey) -> Result<Option<LearnedValue>, Error> {
        use aya::maps::IterableMap;
        use std::os::fd::{AsFd, AsRawFd};
        let mut v = LearnedValue::default();
        // SAFETY: both are plain `#[repr(C)]` structs without padding (size-asserted in
        // `cubevs_common`); the kernel reads the key and writes exactly the value's size.
        let (kb, vb) = unsafe {
            (
                std::slice::from_raw_parts((k as *const LearnedKey).cast::<u8>(), size_of::<LearnedKey>()),
                std::slice::from_raw_parts_mut((&raw mut v).cast::<u8>(), size_of::<LearnedValue>()),
            )
        };
        let fd = self.learned.map().fd().as_fd().as_raw_fd();
        match crate::bpf_sys::map_lookup_and_delete(fd, kb, vb) {
            Ok(true) => Ok(Some(v)),
            Ok(false) => Ok(None),
            Err(source) => Err(Error::MapSyscall { map: map::DNS_LEARNED, op: "lookup and delete", source }),
        }
    }

    /// Puts back `v` under `k` (only where nothing is: `BPF_NOEXIST`); `true` when it is back
    /// (its charge, if any, stays with it), `false` when the datapath made an entry meanwhile.
    fn put_back_learned(&mut self, k: &LearnedKey, v: &LearnedValue) -> Result<bool, Error> {
        match self.learned.insert(k, v, crate::BPF_NOEXIST) {
            Ok(()) => Ok(true),
            Err(e) if crate::error::is_exists(&e) => Ok(false),
            Err(e) => Err(Error::map(map::DNS_LEARNED, "put back")(e)),
        }
    }

    /// Deletes learned entries and tracked queries that expired at `now_ns` (CLOCK_MONOTONIC).
    /// A learned entry is deleted only if it still holds the expired value (the datapath may
    /// renew it between our read and the delete; a renewal seen here is kept).
    pub(crate) fn reap(&mut self, now_ns: u64) -> Result<DnsReap, Error> {
        let mut r = DnsReap::default();
        let expired = self.scan_learned(|_, v| v.expires_ns <= now_ns)?;
        let mut learned_owners = Vec::new();
        for (k, v) in expired {
            // Re-read right before deleting: skip entries renewed meanwhile.
            match self.learned.get(&k, 0) {
                Ok(cur) if cur.expires_ns == v.expires_ns && cur.version == v.version => {}
                _ => continue,
            }
            // Delete and read as one operation: exactly what was removed is refunded
            // (decision R66). An entry renewed in the instant since the re-read is put back
            // unless the datapath made a new one meanwhile (then that one is charged and the
            // removed one refunded).
            let Some(gone) = self.take_learned(&k)? else { continue };
            if gone.expires_ns > now_ns && self.put_back_learned(&k, &gone)? {
                continue;
            }
            learned_owners.extend(learned_charged(&k, &gone));
            r.learned += 1;
        }
        if let Some(l) = self.track.as_ref().and_then(|t| t.learned()) {
            l.closed(&learned_owners)?;
        }
        let expired = self.scan_queries(|_, v| v.expires_ns <= now_ns)?;
        let mut owners = Vec::new();
        for (k, v) in expired {
            // The map never evicts (decision R11): a query re-sent with the same port and id
            // since our read is a new entry of its sandbox; keep it.
            match self.queries.get(&k, 0) {
                Ok(cur) if cur == v => {}
                _ => continue,
            }
            // Counted only when this delete removed it (the datapath may have consumed it).
            match self.queries.remove(&k) {
                Ok(()) => owners.extend(charged(&k, &v)),
                Err(e) if crate::error::is_not_found(&e) => continue,
                Err(e) => return Err(Error::map(map::DNS_QUERY_TRACK, "delete")(e)),
            }
            r.queries += 1;
        }
        if let Some(t) = &self.track {
            t.closed(crate::track_floor::KIND_DNS_QUERY, &owners)?;
        }
        Ok(r)
    }
}

/// Every (key, value) of the hash map `m` (named `name` in errors) for which `keep` holds, read
/// [`SCAN_BATCH`] entries per `BPF_MAP_LOOKUP_BATCH`.
fn scan<K: aya::Pod, V: aya::Pod>(
    m: &HashMap<MapData, K, V>,
    name: &'static str,
    mut keep: impl FnMut(&K, &V) -> bool,
) -> Result<Vec<(K, V)>, Error> {
    use aya::maps::IterableMap;
    use std::os::fd::AsFd;
    let mut out = Vec::new();
    crate::batch::for_each(m.map().fd().as_fd(), SCAN_BATCH, |k: &K, v: &V| {
        if keep(k, v) {
            out.push((*k, *v));
        }
    })
    .map_err(|source| Error::MapSyscall { map: name, op: "batch lookup", source })?;
    Ok(out)
}
