//! Per-sandbox egress policy: the `allow_out` / `deny_out` LPM tries and `policy_gen`.
//!
//! Entries are keyed `{ifindex, generation, address/len}`. A replace validates and expands the
//! whole policy first, writes it under the *other* generation, flips `policy_gen` (one atomic
//! map update), then deletes the old generation: the datapath never sees a half-written policy,
//! and a failed write leaves the old one in force. Semantics follow
//! `reference/upstream.md §3.7`: allow beats deny beats default-allow; the baseline
//! (private, loopback, link-local) is always denied; `allow_internet_access = false` denies
//! `0.0.0.0/0` and ignores the user deny list.

use std::{net::Ipv4Addr, sync::Mutex};

use aya::maps::{
    HashMap, MapData,
    lpm_trie::{Key, LpmTrie},
};
use cubevs_common::{AllowValue, POLICY_PREFIX_BITS, PolicyLpmData, limits, map};

use crate::{Error, error::is_not_found};

/// Always-denied destinations of every sandbox.
pub const BASELINE_DENY: [&str; 5] = ["10.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16"];

/// What a caller asks for (cubelet's `CubeVSContext`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EgressPolicy {
    /// `false` denies every destination not in `allow_out`. Upstream default: `true`.
    pub allow_internet_access: bool,
    /// IPv4 addresses or CIDRs always allowed (beats every deny).
    pub allow_out: Vec<String>,
    /// IPv4 addresses or CIDRs denied (ignored when `allow_internet_access` is false).
    pub deny_out: Vec<String>,
}

impl Default for EgressPolicy {
    fn default() -> Self {
        Self { allow_internet_access: true, allow_out: Vec::new(), deny_out: Vec::new() }
    }
}

/// An IPv4 network in canonical form (host bits cleared).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    /// Network address.
    pub addr: Ipv4Addr,
    /// Prefix length 0–32.
    pub len: u8,
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// Parses `a.b.c.d` or `a.b.c.d/n` strictly (four decimal octets without leading zeros,
/// `n` 0–32); host bits are cleared. `field` names the input in the error.
pub fn parse_cidr(s: &str, field: &str) -> Result<Cidr, Error> {
    let t = s.trim();
    let (a, l) = match t.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (t, None),
    };
    if a.contains(':') {
        return Err(Error::invalid(field, format!("{s:?}: IPv6 is not supported")));
    }
    let octets: Vec<&str> = a.split('.').collect();
    let bad = || Error::invalid(field, format!("{s:?} is not an IPv4 address or CIDR"));
    if octets.len() != 4 || octets.iter().any(|o| o.is_empty() || o.len() > 3 || (o.len() > 1 && o.starts_with('0'))) {
        return Err(bad());
    }
    let mut b = [0u8; 4];
    for (d, o) in b.iter_mut().zip(&octets) {
        *d = o.parse().map_err(|_| bad())?;
    }
    let len: u8 = match l {
        None => 32,
        Some(l) => match l.parse::<u8>() {
            Ok(n) if n <= 32 && !l.starts_with('+') => n,
            _ => return Err(Error::invalid(field, format!("{s:?}: prefix length must be 0-32"))),
        },
    };
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ok(Cidr { addr: Ipv4Addr::from(u32::from_be_bytes(b) & mask), len })
}

/// The entries a policy expands to, validated against the per-sandbox limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompiledPolicy {
    /// `allow_out` entries.
    pub allow: Vec<Cidr>,
    /// `deny_out` entries (baseline included).
    pub deny: Vec<Cidr>,
}

/// Validates and expands `p`. Errors name the field (`allow_out[3]`) or the limit.
pub fn compile(p: &EgressPolicy) -> Result<CompiledPolicy, Error> {
    let max = limits::POLICY_ENTRIES_PER_SANDBOX as usize;
    let mut allow = Vec::with_capacity(p.allow_out.len());
    for (i, s) in p.allow_out.iter().enumerate() {
        allow.push(parse_cidr(s, &format!("allow_out[{i}]"))?);
    }
    let mut deny: Vec<Cidr> = BASELINE_DENY.iter().map(|s| parse_cidr(s, "baseline")).collect::<Result<_, _>>()?;
    if p.allow_internet_access {
        for (i, s) in p.deny_out.iter().enumerate() {
            deny.push(parse_cidr(s, &format!("deny_out[{i}]"))?);
        }
    } else {
        deny.push(Cidr { addr: Ipv4Addr::UNSPECIFIED, len: 0 });
    }
    allow.sort();
    allow.dedup();
    deny.sort();
    deny.dedup();
    if allow.len() > max {
        return Err(Error::TooManyEntries { map: map::ALLOW_OUT, got: allow.len(), max });
    }
    if deny.len() > max {
        return Err(Error::TooManyEntries { map: map::DENY_OUT, got: deny.len(), max });
    }
    Ok(CompiledPolicy { allow, deny })
}

/// What is installed for one interface.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyDump {
    /// Active generation.
    pub generation: u32,
    /// Allowed networks of the active generation.
    pub allow: Vec<Cidr>,
    /// Denied networks of the active generation.
    pub deny: Vec<Cidr>,
}

/// The entries of one (ifindex, generation), as written.
#[derive(Clone, Debug, Default)]
struct Written {
    allow: Vec<Cidr>,
    deny: Vec<Cidr>,
}

struct Tries {
    allow: LpmTrie<MapData, PolicyLpmData, AllowValue>,
    deny: LpmTrie<MapData, PolicyLpmData, u32>,
    generation: HashMap<MapData, u32, u32>,
    /// What each (ifindex, generation) holds in the tries. Built by one scan at load (adopted
    /// pins) and kept by every write, so a replace touches only its own interface's keys
    /// instead of walking both tries (thousands of syscalls with a full pool).
    index: std::collections::HashMap<(u32, u32), Written>,
}

/// Typed access to the policy maps.
pub struct PolicyTable {
    inner: Mutex<Tries>,
}

fn key(ifindex: u32, generation: u32, c: Cidr) -> Key<PolicyLpmData> {
    Key::new(
        POLICY_PREFIX_BITS + c.len as u32,
        PolicyLpmData { ifindex, generation, ip: u32::from_ne_bytes(c.addr.octets()) },
    )
}

fn cidr_of(k: &Key<PolicyLpmData>) -> Cidr {
    let d = k.data();
    Cidr { addr: Ipv4Addr::from(d.ip.to_ne_bytes()), len: (k.prefix_len() - POLICY_PREFIX_BITS) as u8 }
}

impl Tries {
    fn active(&self, ifindex: u32) -> Result<u32, Error> {
        match self.generation.get(&ifindex, 0) {
            Ok(g) => Ok(g),
            Err(e) if is_not_found(&e) => Ok(0),
            Err(e) => Err(Error::map(map::POLICY_GEN, "lookup")(e)),
        }
    }

    /// Deletes every entry of `ifindex` whose generation matches `gen` (or any, if `None`).
    fn purge(&mut self, ifindex: u32, generation: Option<u32>) -> Result<(), Error> {
        let gens: Vec<u32> = self
            .index
            .keys()
            .filter(|(i, g)| *i == ifindex && generation.is_none_or(|want| *g == want))
            .map(|(_, g)| *g)
            .collect();
        let ok = |r: Result<(), aya::maps::MapError>| match r {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(e),
        };
        for g in gens {
            let w = self.index.get(&(ifindex, g)).cloned().unwrap_or_default();
            for c in &w.allow {
                ok(self.allow.remove(&key(ifindex, g, *c))).map_err(Error::map(map::ALLOW_OUT, "delete"))?;
            }
            for c in &w.deny {
                ok(self.deny.remove(&key(ifindex, g, *c))).map_err(Error::map(map::DENY_OUT, "delete"))?;
            }
            self.index.remove(&(ifindex, g));
        }
        Ok(())
    }

    fn write(&mut self, ifindex: u32, generation: u32, c: &CompiledPolicy) -> Result<(), Error> {
        // Record before writing, so a failed write can still be purged.
        let w = self.index.entry((ifindex, generation)).or_default();
        w.allow.extend_from_slice(&c.allow);
        w.deny.extend_from_slice(&c.deny);
        for a in &c.allow {
            let v = AllowValue { expires_ns: 0, flags: 0, scheme: 0, key_prefixlen: a.len, _pad: [0; 5] };
            self.allow.insert(&key(ifindex, generation, *a), v, 0).map_err(Error::map(map::ALLOW_OUT, "insert"))?;
        }
        for d in &c.deny {
            self.deny.insert(&key(ifindex, generation, *d), 1, 0).map_err(Error::map(map::DENY_OUT, "insert"))?;
        }
        Ok(())
    }

    /// Rebuilds the index from the tries (one scan, at load).
    fn scan(&mut self) {
        self.index.clear();
        for k in self.allow.keys().filter_map(Result::ok) {
            let d = k.data();
            self.index.entry((d.ifindex, d.generation)).or_default().allow.push(cidr_of(&k));
        }
        for k in self.deny.keys().filter_map(Result::ok) {
            let d = k.data();
            self.index.entry((d.ifindex, d.generation)).or_default().deny.push(cidr_of(&k));
        }
    }
}

impl PolicyTable {
    pub(crate) fn new(
        allow: LpmTrie<MapData, PolicyLpmData, AllowValue>,
        deny: LpmTrie<MapData, PolicyLpmData, u32>,
        generation: HashMap<MapData, u32, u32>,
    ) -> Self {
        let mut t = Tries { allow, deny, generation, index: Default::default() };
        t.scan();
        Self { inner: Mutex::new(t) }
    }

    /// Replaces the policy of `ifindex` with `p` atomically (see the module docs).
    /// Errors: `InvalidArgument` naming the field, `TooManyEntries` naming the limit, or a
    /// map error; in every case the previous policy stays in force unchanged.
    pub fn replace(&self, ifindex: u32, p: &EgressPolicy) -> Result<(), Error> {
        let compiled = compile(p)?;
        let mut t = self.inner.lock().expect("policy lock");
        let old = t.active(ifindex)?;
        let new = old ^ 1;
        t.purge(ifindex, Some(new))?;
        if let Err(e) = t.write(ifindex, new, &compiled) {
            let _ = t.purge(ifindex, Some(new));
            return Err(e);
        }
        if let Err(e) = t.generation.insert(ifindex, new, 0) {
            let _ = t.purge(ifindex, Some(new));
            return Err(Error::map(map::POLICY_GEN, "update")(e));
        }
        t.purge(ifindex, Some(old))
    }

    /// Installs the baseline deny only (what a pooled, unassigned interface carries).
    pub fn install_default_deny(&self, ifindex: u32) -> Result<(), Error> {
        self.replace(ifindex, &EgressPolicy::default())
    }

    /// Removes every entry of `ifindex` and its generation record.
    pub fn remove(&self, ifindex: u32) -> Result<(), Error> {
        let mut t = self.inner.lock().expect("policy lock");
        t.purge(ifindex, None)?;
        match t.generation.remove(&ifindex) {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(Error::map(map::POLICY_GEN, "delete")(e)),
        }
    }

    /// The active policy entries of `ifindex`.
    pub fn dump(&self, ifindex: u32) -> Result<PolicyDump, Error> {
        let t = self.inner.lock().expect("policy lock");
        let generation = t.active(ifindex)?;
        let w = t.index.get(&(ifindex, generation)).cloned().unwrap_or_default();
        let (mut allow, mut deny) = (w.allow, w.deny);
        allow.sort();
        deny.sort();
        Ok(PolicyDump { generation, allow, deny })
    }

    /// Interfaces that have any policy entry (for garbage collection of vanished ifindexes).
    pub fn interfaces(&self) -> Vec<u32> {
        let t = self.inner.lock().expect("policy lock");
        let mut v: Vec<u32> = t.index.keys().map(|(i, _)| *i).collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_canonicalises() {
        assert_eq!(parse_cidr("10.1.2.3/8", "f").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(parse_cidr("1.2.3.4", "f").unwrap().to_string(), "1.2.3.4/32");
        assert_eq!(parse_cidr("0.0.0.0/0", "f").unwrap().len, 0);
    }

    #[test]
    fn rejects_bad_input_naming_the_field() {
        for bad in [
            "",
            "1.2.3",
            "1.2.3.4.5",
            "01.2.3.4",
            "256.1.1.1",
            "1.2.3.4/33",
            "1.2.3.4/-1",
            "::1",
            "example.com",
            "1.2.3.4/+8",
        ] {
            let e = parse_cidr(bad, "allow_out[7]").unwrap_err().to_string();
            assert!(e.contains("allow_out[7]"), "{bad}: {e}");
        }
    }

    #[test]
    fn compile_applies_upstream_rules() {
        let p = EgressPolicy {
            allow_internet_access: false,
            allow_out: vec!["10.1.0.0/16".into()],
            deny_out: vec!["8.8.8.8".into()],
        };
        let c = compile(&p).unwrap();
        assert_eq!(c.allow, vec![parse_cidr("10.1.0.0/16", "").unwrap()]);
        assert!(c.deny.contains(&parse_cidr("0.0.0.0/0", "").unwrap()));
        assert!(!c.deny.contains(&parse_cidr("8.8.8.8", "").unwrap()), "user deny ignored without internet");
        assert_eq!(c.deny.len(), 6);
        let d = compile(&EgressPolicy { deny_out: vec!["8.8.8.8".into(), "8.8.8.8/32".into()], ..Default::default() })
            .unwrap();
        assert_eq!(d.deny.len(), 6, "deduplicated");
    }

    #[test]
    fn compile_enforces_limits() {
        let many: Vec<String> = (0..8193u32).map(|i| Ipv4Addr::from(0x0b00_0000 + i).to_string()).collect();
        let e = compile(&EgressPolicy { allow_out: many, ..Default::default() }).unwrap_err();
        assert!(matches!(e, Error::TooManyEntries { map: "allow_out", got: 8193, max: 8192 }), "{e}");
    }
}
