//! The learned-address feed (decision N8): which names a sandbox's learned addresses belong
//! to, for CubeEgress's destination check (E14, `PUT /admin/v1/learned/<sandboxIP>`).
//!
//! The datapath records the matched pattern's [`FqdnPattern::tag`] in each learned entry
//! (`LearnedValue::flags` bits 16–31). A tag is 16 bits of the pattern's hash, so it names an
//! entry only when exactly one of the sandbox's current patterns has it: an entry whose tag
//! is 0 (learned by a program before N8), unknown (its pattern was replaced) or shared by two
//! patterns is left out, so an address is never fed under a name it was not learned for.

use std::{collections::BTreeMap, net::Ipv4Addr};

use super::{FqdnPattern, LearnedEntry};

/// The names of one sandbox's learned addresses, as the gateway's learned spec wants them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LearnedNames {
    /// Pattern as written (`api.example.com`, `*.example.com`) → addresses, sorted, at most
    /// `max_addrs` per name (the ones expiring last).
    pub names: BTreeMap<String, Vec<Ipv4Addr>>,
    /// Latest expiry of the kept entries, CLOCK_MONOTONIC ns (0 when `names` is empty).
    pub expires_ns: u64,
}

/// Names the live learned entries of one sandbox: `entries` of its interface (other
/// interfaces' entries are the caller's bug and are not filtered here beyond `version`),
/// `version` its registered sandbox version (entries of a previous owner are skipped),
/// `patterns` its compiled `allow_fqdn`. Only entries with the L7 flag when `l7_only`
/// (their flows are the ones CubeEgress sees). Unexpired at `now_ns`.
pub fn learned_names(
    patterns: &[FqdnPattern],
    version: u32,
    entries: &[LearnedEntry],
    now_ns: u64,
    l7_only: bool,
    max_addrs: usize,
) -> LearnedNames {
    let mut by_name: BTreeMap<String, BTreeMap<Ipv4Addr, u64>> = BTreeMap::new();
    for e in entries {
        if e.version != version || e.expires_ns <= now_ns || e.tag == 0 || (l7_only && !e.l7) {
            continue;
        }
        let mut it = patterns.iter().filter(|p| p.tag() == e.tag);
        let (Some(p), None) = (it.next(), it.next()) else { continue };
        let exp = by_name.entry(p.spelled()).or_default().entry(e.ip).or_default();
        *exp = (*exp).max(e.expires_ns);
    }
    let mut out = LearnedNames::default();
    for (name, addrs) in by_name {
        let mut v: Vec<(Ipv4Addr, u64)> = addrs.into_iter().collect();
        // Keep the ones expiring last, then list them by address.
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v.truncate(max_addrs);
        out.expires_ns = v.iter().map(|x| x.1).fold(out.expires_ns, u64::max);
        let mut ips: Vec<Ipv4Addr> = v.into_iter().map(|x| x.0).collect();
        ips.sort();
        if !ips.is_empty() {
            out.names.insert(name, ips);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pat(name: &str, subdomains: bool) -> FqdnPattern {
        FqdnPattern { name: name.into(), subdomains, ports: vec![] }
    }

    fn entry(ip: [u8; 4], tag: u16, version: u32, expires_ns: u64, l7: bool) -> LearnedEntry {
        LearnedEntry { ifindex: 7, ip: Ipv4Addr::from(ip), port: 443, expires_ns, version, l7, tag }
    }

    #[test]
    fn names_only_what_one_pattern_tags() {
        let api = pat("api.example.com", false);
        let cdn = pat("cdn.example", true);
        assert_ne!(api.tag(), cdn.tag());
        assert_ne!(pat("cdn.example", false).tag(), cdn.tag(), "the *. flag is part of the tag");
        let ps = [api.clone(), cdn.clone()];
        let es = [
            entry([1, 1, 1, 1], api.tag(), 5, 100, true),
            entry([1, 1, 1, 2], cdn.tag(), 5, 300, true),
            // Same address on two ports: one address, the later expiry.
            LearnedEntry { port: 80, ..entry([1, 1, 1, 2], cdn.tag(), 5, 400, true) },
            entry([1, 1, 1, 3], 0, 5, 100, true), // no tag (old program)
            entry([1, 1, 1, 4], pat("x.test", false).tag(), 5, 100, true), // unknown pattern
            entry([1, 1, 1, 5], api.tag(), 4, 100, true), // previous owner
            entry([1, 1, 1, 6], api.tag(), 5, 10, true), // expired
            entry([1, 1, 1, 7], api.tag(), 5, 100, false), // not L7
        ];
        let f = learned_names(&ps, 5, &es, 10, true, 32);
        let want: BTreeMap<String, Vec<Ipv4Addr>> = [
            ("api.example.com".to_string(), vec![Ipv4Addr::new(1, 1, 1, 1)]),
            ("*.cdn.example".to_string(), vec![Ipv4Addr::new(1, 1, 1, 2)]),
        ]
        .into();
        assert_eq!(f.names, want);
        assert_eq!(f.expires_ns, 400);
        assert!(
            learned_names(&ps, 5, &es, 10, false, 32).names["api.example.com"].contains(&Ipv4Addr::new(1, 1, 1, 7))
        );
        // Two patterns sharing the entry's tag: ambiguous, left out.
        let twin = FqdnPattern { ports: vec![8443], ..api.clone() };
        assert!(learned_names(&[api, twin], 5, &es[..1], 10, true, 32).names.is_empty());
    }

    #[test]
    fn keeps_the_addresses_expiring_last() {
        let api = pat("api.example.com", false);
        let es: Vec<LearnedEntry> =
            (1..=5u8).map(|i| entry([9, 9, 9, i], api.tag(), 1, 100 + u64::from(i), true)).collect();
        let f = learned_names(std::slice::from_ref(&api), 1, &es, 0, true, 2);
        assert_eq!(f.names["api.example.com"], vec![Ipv4Addr::new(9, 9, 9, 4), Ipv4Addr::new(9, 9, 9, 5)]);
        assert_eq!(f.expires_ns, 105);
    }
}
