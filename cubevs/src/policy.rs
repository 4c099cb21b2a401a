//! Per-sandbox egress policy: the `allow_out` / `deny_out` LPM tries and `policy_gen`.
//!
//! - [`Cidr`] is the one strict IPv4 CIDR parser ([`cidr`]).
//! - [`EgressPolicy`], [`compile`], [`CompiledPolicy`] and [`BASELINE_DENY`] are the policy
//!   model: what a caller asks for, what it expands to, and the verdict ([`model`]).
//! - [`FqdnAllow`] / [`FqdnPattern`]: DNS-name allow entries, strictly parsed ([`fqdn`]).
//! - [`PolicyTable`] writes compiled policies into the kernel maps (this file), FQDN
//!   patterns included (`dns_allow`, same generation scheme), and owns the addresses the
//!   datapath learns from DNS answers ([`dns`]): listed, reaped when expired
//!   ([`PolicyTable::reap_dns`]), purged when the sandbox's FQDN patterns change or its
//!   policy is removed or reset to the default deny (Release).
//!
//! Entries are keyed `{ifindex, generation, address/len}`. A replace validates and expands
//! the whole policy first, writes it under a new generation (the active one + 1: never reused,
//! so a reader can never mistake a later policy for the one it started with), flips
//! `policy_gen` (one map update), then deletes the old generation. The datapath reads the
//! generation, looks the destination up, and reads the generation again: when it changed the
//! lookups are repeated, so a packet never decides on a generation being purged (a seqlock;
//! `ebpf/cubevs-ebpf/src/policy.rs`). An interface without a `policy_gen` entry denies every
//! new flow.
//!
//! Capacity: each sandbox may hold at most `entries_per_sandbox` entries in each list
//! ([`compile`]), and the tries are sized so that every interface `policy_gen` can hold keeps
//! two generations at that limit ([`PolicyLimits::trie_entries`]); LPM tries are always
//! `BPF_F_NO_PREALLOC`, so the size costs memory only when used. No sandbox can starve
//! another, and a replace by a smaller policy or a removal always has room.

pub mod cidr;
pub mod dns;
pub mod feed;
pub mod fqdn;
pub mod l7_static;
pub mod model;

use std::{
    collections::{BTreeMap, HashMap as StdHashMap, HashSet},
    sync::Mutex,
};

use aya::maps::{
    HashMap, MapData,
    lpm_trie::{Key, LpmTrie},
};
pub use cidr::Cidr;
use cubevs_common::{
    AllowValue, POLICY_PREFIX_BITS, PolicyLpmData, allow_flag,
    dns::{DnsAllowKey, DnsAllowName, DnsAllowValue},
    map,
};
pub use dns::{DnsReap, LearnedEntry};
pub use feed::{LearnedNames, learned_names};
pub use fqdn::{FqdnAllow, FqdnPattern, MAX_FQDN_PORTS, parse_fqdn};
pub use model::{
    BASELINE_DENY, CompiledPolicy, DEFAULT_ENTRIES_PER_SANDBOX, EXTRA_ENTRIES, EgressPolicy, MAX_FQDN_PER_SANDBOX,
    MAX_RULES_JSON_BYTES, compile, parse_cidr, validate_rules,
};

use crate::{Error, error::is_not_found};

/// How many policy entries the tables hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyLimits {
    /// Entries one sandbox may have in `allow_out`, and separately in `deny_out`, as requested
    /// (the baseline and `0.0.0.0/0` come on top, [`EXTRA_ENTRIES`]).
    pub entries_per_sandbox: u32,
    /// Interfaces with a policy at once (`policy_gen`'s `max_entries`).
    pub interfaces: u32,
}

impl PolicyLimits {
    /// `max_entries` each trie needs so that every interface can hold two generations at its
    /// limit: `interfaces × 2 × (entries_per_sandbox + EXTRA_ENTRIES)`. `None` on overflow.
    pub fn trie_entries(&self) -> Option<u32> {
        self.interfaces.checked_mul(2)?.checked_mul(self.entries_per_sandbox.checked_add(EXTRA_ENTRIES)?)
    }
}

/// What is installed for one interface.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PolicyDump {
    /// Active generation (`None`: no policy, the interface denies every new flow).
    pub generation: Option<u32>,
    /// Allowed networks of the active generation.
    pub allow: Vec<Cidr>,
    /// Denied networks of the active generation.
    pub deny: Vec<Cidr>,
    /// FQDN patterns of the active generation (as hashed keys: the names are not kept).
    pub fqdn_patterns: usize,
    /// Static L7 addresses of the active generation (IPv4 literals L7 rules name, N10).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub l7: Vec<Cidr>,
}

/// What [`PolicyTable::backfill_names`] did for one interface.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct NameBackfill {
    /// Names written under `dns_allow` keys of the active generation that had none (written
    /// by a loader before R48).
    pub named: usize,
    /// Keys of the active generation without a name that no pattern of the given policy
    /// hashes to: sealed out (they match nothing any more), left in `dns_allow` until the
    /// next replace purges the generation.
    pub unnamed: usize,
    /// The active generation is sealed (now or before): a key of it without a name matches
    /// nothing. `false` when there is nothing to seal (no FQDN pattern, no policy) or the
    /// object has no `dns_allow_names`.
    pub sealed: bool,
}

/// The entries of one (ifindex, generation), as written.
#[derive(Clone, Debug, Default)]
struct Written {
    allow: Vec<Cidr>,
    deny: Vec<Cidr>,
    /// Static L7 `/32` entries (some may also be in `allow`, merged into one map entry).
    l7: Vec<Cidr>,
    fqdn: Vec<(DnsAllowKey, DnsAllowValue)>,
}

impl Written {
    /// The FQDN entries without their generation, sorted (to compare two generations).
    fn fqdn_set(&self) -> Vec<(u64, u8, u8, u8, [u16; cubevs_common::dns::MAX_PORTS])> {
        let mut v: Vec<_> =
            self.fqdn.iter().map(|(k, v)| (k.name_hash, k.subdomains, v.flags, v.port_count, v.ports)).collect();
        v.sort_unstable();
        v
    }
}

struct Tries {
    allow: LpmTrie<MapData, PolicyLpmData, AllowValue>,
    deny: LpmTrie<MapData, PolicyLpmData, u32>,
    generation: HashMap<MapData, u32, u32>,
    /// What each interface holds in the tries, by generation. Built by one scan at load
    /// (adopted pins) and kept by every write, so a replace touches only its own interface's
    /// keys instead of walking both tries (thousands of syscalls with a full pool), and finds
    /// that interface's generations without walking the others' (nothing on the replace path
    /// scales with the number of sandboxes).
    index: StdHashMap<u32, BTreeMap<u32, Written>>,
    /// Interfaces with a `policy_gen` entry.
    interfaces: HashSet<u32>,
    /// Interfaces that may hold kernel-written DNS entries (learned addresses, tracked
    /// queries): every interface FQDN patterns were ever written for since its last purge,
    /// and those found with entries at load. The datapath tracks a query (and so learns) only
    /// for a pattern of the interface, so any other interface has none, and its removal needs
    /// no walk of the DNS maps (a walk costs their whole bucket array, not their entries).
    dns_state: HashSet<u32>,
    /// `dns_allow`, `dns_learned`, `dns_query_track`.
    dns: dns::DnsMaps,
}

/// Typed access to the policy maps.
pub struct PolicyTable {
    inner: Mutex<Tries>,
    limits: PolicyLimits,
}

fn key(ifindex: u32, generation: u32, c: Cidr) -> Key<PolicyLpmData> {
    Key::new(
        POLICY_PREFIX_BITS + c.len as u32,
        PolicyLpmData { ifindex, generation, ip: u32::from_ne_bytes(c.addr.octets()) },
    )
}

fn cidr_of(k: &Key<PolicyLpmData>) -> Cidr {
    let d = k.data();
    Cidr::new(std::net::Ipv4Addr::from(d.ip.to_ne_bytes()), (k.prefix_len() - POLICY_PREFIX_BITS) as u8)
}

pub(crate) fn absent_ok(r: Result<(), aya::maps::MapError>) -> Result<(), aya::maps::MapError> {
    match r {
        Err(e) if is_not_found(&e) => Ok(()),
        other => other,
    }
}

impl Tries {
    fn active(&self, ifindex: u32) -> Result<Option<u32>, Error> {
        match self.generation.get(&ifindex, 0) {
            Ok(g) => Ok(Some(g)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(Error::map(map::POLICY_GEN, "lookup")(e)),
        }
    }

    /// What (`ifindex`, `generation`) holds in the tries, if anything.
    fn written(&self, ifindex: u32, generation: u32) -> Option<&Written> {
        self.index.get(&ifindex)?.get(&generation)
    }

    /// The index entry of (`ifindex`, `generation`), created empty when absent.
    fn written_mut(&mut self, ifindex: u32, generation: u32) -> &mut Written {
        self.index.entry(ifindex).or_default().entry(generation).or_default()
    }

    /// Drops (`ifindex`, `generation`) from the index (and the interface once it has none).
    fn forget(&mut self, ifindex: u32, generation: u32) {
        if let Some(m) = self.index.get_mut(&ifindex) {
            m.remove(&generation);
            if m.is_empty() {
                self.index.remove(&ifindex);
            }
        }
    }

    /// Whether `ifindex` holds exactly one generation, `generation`, with the plain CIDR
    /// entries of `c` (no FQDN pattern, no L7 address, whose values a [`Written`] does not
    /// keep): a replace by `c` would write what is there already.
    fn holds_exactly(&self, ifindex: u32, generation: u32, c: &CompiledPolicy) -> bool {
        let Some(gens) = self.index.get(&ifindex) else { return false };
        let Some(w) = gens.get(&generation) else { return false };
        if gens.len() != 1 || !c.fqdn.is_empty() || !c.l7.is_empty() || !w.fqdn.is_empty() || !w.l7.is_empty() {
            return false;
        }
        let sorted = |v: &[Cidr]| {
            let mut v = v.to_vec();
            v.sort_unstable();
            v
        };
        sorted(&w.allow) == sorted(&c.allow) && sorted(&w.deny) == sorted(&c.deny)
    }

    /// Deletes every entry of `ifindex` whose generation `pick` selects.
    fn purge(&mut self, ifindex: u32, pick: impl Fn(u32) -> bool) -> Result<(), Error> {
        let gens: Vec<u32> =
            self.index.get(&ifindex).map(|m| m.keys().copied().filter(|g| pick(*g)).collect()).unwrap_or_default();
        for g in gens {
            let w = self.written(ifindex, g).cloned().unwrap_or_default();
            for c in w.allow.iter().chain(&w.l7) {
                absent_ok(self.allow.remove(&key(ifindex, g, *c))).map_err(Error::map(map::ALLOW_OUT, "delete"))?;
            }
            for c in &w.deny {
                absent_ok(self.deny.remove(&key(ifindex, g, *c))).map_err(Error::map(map::DENY_OUT, "delete"))?;
            }
            for (k, _) in &w.fqdn {
                absent_ok(self.dns.allow.remove(k)).map_err(Error::map(map::DNS_ALLOW, "delete"))?;
                if let Some(names) = self.dns.names.as_mut() {
                    absent_ok(names.remove(k)).map_err(Error::map(map::DNS_ALLOW_NAMES, "delete"))?;
                }
            }
            // The seal last: while keys of the generation remain, they stay sealed (R52).
            if let (Some(names), false) = (self.dns.names.as_mut(), w.fqdn.is_empty()) {
                absent_ok(names.remove(&DnsAllowKey::seal(ifindex, g)))
                    .map_err(Error::map(map::DNS_ALLOW_NAMES, "delete"))?;
            }
            self.forget(ifindex, g);
        }
        Ok(())
    }

    fn write(&mut self, ifindex: u32, generation: u32, c: &CompiledPolicy, l7: &HashSet<String>) -> Result<(), Error> {
        // Record before writing, so a failed write can still be purged.
        let fqdn: Vec<_> =
            c.fqdn.iter().map(|p| dns::pattern_entry(ifindex, generation, p, dns::is_l7(p, l7))).collect();
        if !fqdn.is_empty() {
            self.dns_state.insert(ifindex);
        }
        let w = self.written_mut(ifindex, generation);
        w.allow.extend_from_slice(&c.allow);
        w.deny.extend_from_slice(&c.deny);
        w.fqdn.extend_from_slice(&fqdn);
        w.l7.extend(c.l7.iter().map(|(a, _)| *a));
        for a in &c.allow {
            // An `allow_out` /32 that is also a static L7 address is one entry: the L7 flags
            // (with L3_ALLOWED) are written below, over this one.
            let v = AllowValue { expires_ns: 0, flags: 0, scheme: 0, key_prefixlen: a.len, _pad: [0; 5] };
            self.allow.insert(&key(ifindex, generation, *a), v, 0).map_err(Error::map(map::ALLOW_OUT, "insert"))?;
        }
        for (a, flags) in &c.l7 {
            let flags = if c.allow.binary_search(a).is_ok() { *flags | allow_flag::ALLOW_OUT_ENTRY } else { *flags };
            let v = AllowValue { expires_ns: 0, flags, scheme: 0, key_prefixlen: a.len, _pad: [0; 5] };
            self.allow.insert(&key(ifindex, generation, *a), v, 0).map_err(Error::map(map::ALLOW_OUT, "insert"))?;
        }
        for d in &c.deny {
            self.deny.insert(&key(ifindex, generation, *d), 1, 0).map_err(Error::map(map::DENY_OUT, "insert"))?;
        }
        // Sealed from the start: a key of this generation without a name matches nothing
        // (decision R52). A failed seal (only with `dns_allow_names` full, see
        // [`PolicyTable::backfill_names`]) leaves the generation unsealed, which changes no
        // verdict: every key below gets its name before it is written.
        if let (Some(names), false) = (self.dns.names.as_mut(), fqdn.is_empty())
            && let Err(e) = names.insert(DnsAllowKey::seal(ifindex, generation), DnsAllowName::EMPTY, 0)
        {
            log::warn!("ifindex {ifindex}: sealing FQDN generation {generation}: {e}");
        }
        for ((k, v), p) in fqdn.iter().zip(&c.fqdn) {
            // The name first: the datapath never sees a pattern without it (decision R48).
            if let (Some(names), Some(n)) = (self.dns.names.as_mut(), DnsAllowName::of(&p.name)) {
                names.insert(k, n, 0).map_err(Error::map(map::DNS_ALLOW_NAMES, "insert"))?;
            }
            self.dns.allow.insert(k, v, 0).map_err(Error::map(map::DNS_ALLOW, "insert"))?;
        }
        Ok(())
    }

    /// Rebuilds the index from the maps (one scan, at load).
    fn scan(&mut self) {
        fn at(index: &mut StdHashMap<u32, BTreeMap<u32, Written>>, ifindex: u32, generation: u32) -> &mut Written {
            index.entry(ifindex).or_default().entry(generation).or_default()
        }
        let mut index = StdHashMap::new();
        for (k, v) in self.allow.iter().filter_map(Result::ok) {
            let d = k.data();
            let w = at(&mut index, d.ifindex, d.generation);
            let l7 = v.flags & (allow_flag::L7_HTTP | allow_flag::L7_HTTPS) != 0;
            if l7 {
                w.l7.push(cidr_of(&k));
            }
            if !l7 || v.flags & allow_flag::ALLOW_OUT_ENTRY != 0 {
                w.allow.push(cidr_of(&k));
            }
        }
        for k in self.deny.keys().filter_map(Result::ok) {
            let d = k.data();
            at(&mut index, d.ifindex, d.generation).deny.push(cidr_of(&k));
        }
        for (k, v) in self.dns.allow.iter().filter_map(Result::ok) {
            at(&mut index, k.ifindex, k.generation).fqdn.push((k, v));
        }
        self.index = index;
        self.interfaces = self.generation.keys().filter_map(Result::ok).collect();
        // Whatever the datapath learned or tracks, whoever's patterns it came from.
        self.dns_state =
            self.index.iter().filter(|(_, g)| g.values().any(|w| !w.fqdn.is_empty())).map(|(i, _)| *i).collect();
        match self.dns.ifindexes() {
            Ok(found) => self.dns_state.extend(found),
            Err(e) => {
                // Unknown: every interface's removal purges its DNS state (the slow, safe side).
                log::warn!("listing the interfaces with DNS state: {e}; all are purged on removal");
                self.dns_state.extend(self.interfaces.iter().copied());
            }
        }
    }
}

impl PolicyTable {
    pub(crate) fn new(
        allow: LpmTrie<MapData, PolicyLpmData, AllowValue>,
        deny: LpmTrie<MapData, PolicyLpmData, u32>,
        generation: HashMap<MapData, u32, u32>,
        dns: dns::DnsMaps,
        limits: PolicyLimits,
    ) -> Self {
        let mut t = Tries {
            allow,
            deny,
            generation,
            index: Default::default(),
            interfaces: Default::default(),
            dns_state: Default::default(),
            dns,
        };
        t.scan();
        Self { inner: Mutex::new(t), limits }
    }

    /// The limits this table enforces.
    pub fn limits(&self) -> PolicyLimits {
        self.limits
    }

    /// Replaces the policy of `ifindex` with `p` atomically (see the module docs).
    ///
    /// Errors: [`Error::InvalidArgument`] naming the field (`allow_out[2]`, or `allow_out` /
    /// `deny_out` over the per-sandbox limit), [`Error::TooManyEntries`] on `policy_gen` when
    /// a new interface would exceed [`PolicyLimits::interfaces`], or a map error; in every
    /// case the previous policy stays in force unchanged.
    pub fn replace(&self, ifindex: u32, p: &EgressPolicy) -> Result<(), Error> {
        let compiled = compile(p, self.limits.entries_per_sandbox)?;
        let mut t = self.inner.lock().expect("policy lock");
        let active = t.active(ifindex)?;
        // The same plain entries again (an Ensure with the pooled TAP's baseline deny, a
        // Release of a sandbox that had it): nothing to write, nothing learned to purge.
        if let Some(g) = active
            && t.holds_exactly(ifindex, g, &compiled)
        {
            return Ok(());
        }
        if active.is_none() && t.interfaces.len() >= self.limits.interfaces as usize {
            return Err(Error::TooManyEntries {
                map: map::POLICY_GEN,
                got: t.interfaces.len() + 1,
                max: self.limits.interfaces as usize,
            });
        }
        // Leftovers of an interrupted replace (never read: not the active generation) go
        // first, so at most two generations of this interface exist at any time.
        t.purge(ifindex, |g| Some(g) != active)?;
        let new = active.map_or(1, |g| g.wrapping_add(1));
        if let Err(e) = t.write(ifindex, new, &compiled, &dns::l7_names(&p.rules)) {
            let _ = t.purge(ifindex, |g| g == new);
            return Err(e);
        }
        if let Err(e) = t.generation.insert(ifindex, new, 0) {
            let _ = t.purge(ifindex, |g| g == new);
            return Err(Error::map(map::POLICY_GEN, "update")(e));
        }
        t.interfaces.insert(ifindex);
        // Learned addresses belong to the patterns that allowed them: when the patterns
        // change (or go, as on Release's default deny) they go too. A guest that re-resolves
        // learns again under the new patterns.
        let old_fqdn = active.and_then(|g| t.written(ifindex, g)).map(Written::fqdn_set).unwrap_or_default();
        let new_fqdn = t.written(ifindex, new).map(Written::fqdn_set).unwrap_or_default();
        // Only then: the purge scans the kernel-written maps (no userspace index), and a
        // sandbox without patterns has nothing learned (its predecessor's went at Release).
        if old_fqdn != new_fqdn {
            match t.dns.purge(ifindex) {
                Ok(_) if new_fqdn.is_empty() => {
                    t.dns_state.remove(&ifindex);
                }
                Ok(_) => {}
                Err(e) => log::warn!("ifindex {ifindex}: purge of learned DNS entries: {e}"),
            }
        }
        if let Some(old) = active
            && let Err(e) = t.purge(ifindex, |g| g == old)
        {
            // The new policy is in force; the rest of the old one is purged by the next replace.
            log::warn!("ifindex {ifindex}: purge of policy generation {old}: {e}");
        }
        Ok(())
    }

    /// Gives every FQDN pattern of the active generation of `ifindex` its name and seals the
    /// generation (decision R52): what a loader before R48 wrote (keys without names, matched
    /// by their forgeable 64-bit hash alone) is matched by name from then on, without a new
    /// generation (learned addresses and tracked queries stay). `p` is the interface's policy
    /// as its owner recorded it (the agent's state record): each unnamed key gets the name of
    /// the pattern of `p` that hashes to it; a key no pattern of `p` hashes to cannot be named
    /// and is sealed out (it matches nothing; [`NameBackfill::unnamed`] counts it).
    ///
    /// Names go in before the seal, one by one: a legitimate name is allowed throughout. A
    /// generation already sealed costs one lookup. Without `dns_allow_names` (an object
    /// older than R48 loaded by this process) nothing is written.
    ///
    /// Capacity: `dns_allow_names` is sized like `dns_allow` (two generations of
    /// `min(entries_per_sandbox, 32)` patterns per interface); a seal is one more entry per
    /// generation with patterns, and only an interface being replaced holds two generations
    /// (replaces hold the table's lock), so `n` patterns + 1 seal per interface fit 2 × `n`
    /// for every `n` ≥ 1. A seal that does not fit is an error here (the generation stays
    /// unsealed, its named keys matched by name).
    ///
    /// Errors: [`Error::InvalidArgument`] when `p` does not compile (as [`Self::replace`], but
    /// without the per-sandbox entry limit), a map error.
    pub fn backfill_names(&self, ifindex: u32, p: &EgressPolicy) -> Result<NameBackfill, Error> {
        // Installed already: only its patterns are read, whatever the per-sandbox limit now.
        let compiled = compile(p, u32::MAX)?;
        let mut t = self.inner.lock().expect("policy lock");
        let Some(generation) = t.active(ifindex)? else { return Ok(NameBackfill::default()) };
        let keys: Vec<DnsAllowKey> =
            t.written(ifindex, generation).map(|w| w.fqdn.iter().map(|(k, _)| *k).collect()).unwrap_or_default();
        let Some(names) = t.dns.names.as_mut() else { return Ok(NameBackfill::default()) };
        if keys.is_empty() {
            return Ok(NameBackfill::default());
        }
        let seal = DnsAllowKey::seal(ifindex, generation);
        match names.get(&seal, 0) {
            Ok(_) => return Ok(NameBackfill { sealed: true, ..Default::default() }),
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(Error::map(map::DNS_ALLOW_NAMES, "lookup")(e)),
        }
        let mut r = NameBackfill::default();
        for k in keys {
            match names.get(&k, 0) {
                Ok(_) => continue,
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(Error::map(map::DNS_ALLOW_NAMES, "lookup")(e)),
            }
            let pattern = compiled.fqdn.iter().find(|q| {
                let (pk, _) = dns::pattern_entry(ifindex, generation, q, false);
                pk == k
            });
            match pattern.and_then(|q| DnsAllowName::of(&q.name)) {
                Some(n) => {
                    names.insert(k, n, 0).map_err(Error::map(map::DNS_ALLOW_NAMES, "insert"))?;
                    r.named += 1;
                }
                None => r.unnamed += 1,
            }
        }
        names.insert(seal, DnsAllowName::EMPTY, 0).map_err(Error::map(map::DNS_ALLOW_NAMES, "insert"))?;
        r.sealed = true;
        Ok(r)
    }

    /// Installs the baseline deny only (what a pooled, unassigned interface carries).
    pub fn install_default_deny(&self, ifindex: u32) -> Result<(), Error> {
        self.replace(ifindex, &EgressPolicy::default())
    }

    /// Removes the generation record of `ifindex` first (from then on the interface denies
    /// every new flow), then every entry. Only deletes: never short of capacity.
    pub fn remove(&self, ifindex: u32) -> Result<(), Error> {
        let mut t = self.inner.lock().expect("policy lock");
        absent_ok(t.generation.remove(&ifindex)).map_err(Error::map(map::POLICY_GEN, "delete"))?;
        t.interfaces.remove(&ifindex);
        t.purge(ifindex, |_| true)?;
        if t.dns_state.contains(&ifindex) {
            t.dns.purge(ifindex)?;
            t.dns_state.remove(&ifindex);
        }
        Ok(())
    }

    /// Addresses learned from DNS answers (of `ifindex`, or all), sorted by interface,
    /// address, port.
    pub fn learned(&self, ifindex: Option<u32>) -> Vec<LearnedEntry> {
        self.inner.lock().expect("policy lock").dns.learned(ifindex)
    }

    /// DNS queries being tracked (of `ifindex`, or all): raw keys and values.
    pub fn dns_queries(
        &self,
        ifindex: Option<u32>,
    ) -> Vec<(cubevs_common::dns::DnsQueryKey, cubevs_common::dns::DnsQueryValue)> {
        self.inner.lock().expect("policy lock").dns.queries(ifindex)
    }

    /// Deletes the learned entries and tracked queries of `ifindex` (Release does it through
    /// [`Self::install_default_deny`] / [`Self::remove`]). Returns the learned entries deleted.
    pub fn purge_learned(&self, ifindex: u32) -> Result<usize, Error> {
        let mut t = self.inner.lock().expect("policy lock");
        let n = t.dns.purge(ifindex)?;
        if !t.index.get(&ifindex).is_some_and(|g| g.values().any(|w| !w.fqdn.is_empty())) {
            t.dns_state.remove(&ifindex);
        }
        Ok(n)
    }

    /// Deletes learned entries and tracked queries expired at `now_ns` (CLOCK_MONOTONIC,
    /// [`crate::reaper::monotonic_ns`]); the session reaper calls it every tick.
    pub fn reap_dns(&self, now_ns: u64) -> Result<DnsReap, Error> {
        self.inner.lock().expect("policy lock").dns.reap(now_ns)
    }

    /// The active policy entries of `ifindex`.
    pub fn dump(&self, ifindex: u32) -> Result<PolicyDump, Error> {
        let t = self.inner.lock().expect("policy lock");
        let Some(generation) = t.active(ifindex)? else { return Ok(PolicyDump::default()) };
        let w = t.written(ifindex, generation).cloned().unwrap_or_default();
        let (mut allow, mut deny, mut l7) = (w.allow, w.deny, w.l7);
        allow.sort();
        deny.sort();
        l7.sort();
        Ok(PolicyDump { generation: Some(generation), allow, deny, fqdn_patterns: w.fqdn.len(), l7 })
    }

    /// Interfaces that have any policy entry or generation record (for garbage collection
    /// of vanished ifindexes).
    pub fn interfaces(&self) -> Vec<u32> {
        let t = self.inner.lock().expect("policy lock");
        let mut v: Vec<u32> = t.index.keys().copied().chain(t.interfaces.iter().copied()).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Total entries in (`allow_out`, `deny_out`), counted in the kernel maps.
    pub fn entry_counts(&self) -> (usize, usize) {
        let t = self.inner.lock().expect("policy lock");
        (t.allow.keys().count(), t.deny.keys().count())
    }
}
