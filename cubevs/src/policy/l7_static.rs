//! L7 rules whose `match.host` / `match.sni` is an IPv4 literal (decision N10; upstream
//! `reference/upstream.md §3.7`: "Static L7 IP → one /48 entry per tuple"): the address gets a
//! `/32` `allow_out` entry with [`allow_flag`] bits, so new TCP flows to it on 80 / 443 are
//! steered to CubeEgress instead of SNATed. Our trie key has no port, so the ports are flags
//! of the one `/32` entry; what the policy says about the address's other ports is folded in
//! as [`allow_flag::L3_ALLOWED`] (an `allow_out` entry covers it).

use std::{collections::BTreeMap, net::Ipv4Addr};

use cubevs_common::{allow_flag, l7};
use egress_policy::{Ports, RuleSpec};

use super::Cidr;

/// The IPv4 literal a rule's host/SNI names (`203.0.113.5`, `203.0.113.5/32`, trailing dot or
/// case ignored), `None` for a name.
fn literal(raw: &str) -> Option<Ipv4Addr> {
    let t = raw.trim().trim_end_matches('.');
    let t = t.strip_suffix("/32").unwrap_or(t);
    t.parse().ok()
}

/// The [`allow_flag`] scheme bits a rule steers: its ports among 80 / 443 (a port without a
/// scheme is what the gateway's validator refuses; then nothing), the scheme's default port
/// for a scheme alone, both when neither is given. Other ports cannot be steered (the gateway
/// listens for these two marks only).
fn scheme_bits(r: &RuleSpec) -> u8 {
    let of_port = |p: u32| match p {
        80 => allow_flag::L7_HTTP,
        443 => allow_flag::L7_HTTPS,
        _ => 0,
    };
    match (&r.matcher.port, r.matcher.scheme.as_deref().map(|s| s.trim().to_ascii_lowercase())) {
        (Some(Ports::One(p)), _) => of_port(*p),
        (Some(Ports::Many(ps)), _) => ps.iter().fold(0, |a, p| a | of_port(*p)),
        (None, Some(s)) if s == "http" => allow_flag::L7_HTTP,
        (None, Some(s)) if s == "https" => allow_flag::L7_HTTPS,
        (None, None) => allow_flag::L7_HTTP | allow_flag::L7_HTTPS,
        (None, Some(_)) => 0,
    }
}

/// The static L7 entries of a policy: `(address/32, flags)` sorted by address, for every IPv4
/// literal an L7 rule names on 80 and/or 443; `L3_ALLOWED` when an `allow` entry covers the
/// address (the plain allow keeps its other ports).
pub(crate) fn static_l7(rules: &[RuleSpec], allow: &[Cidr]) -> Vec<(Cidr, u8)> {
    let mut m: BTreeMap<Ipv4Addr, u8> = BTreeMap::new();
    for r in rules {
        let bits = scheme_bits(r);
        if bits == 0 {
            continue;
        }
        for ip in [r.matcher.host.as_deref(), r.matcher.sni.as_deref()].into_iter().flatten().filter_map(literal) {
            *m.entry(ip).or_default() |= bits;
        }
    }
    m.into_iter()
        .map(|(ip, bits)| {
            let l3 = if allow.iter().any(|c| c.contains(ip)) { allow_flag::L3_ALLOWED } else { 0 };
            (Cidr::new(ip, 32), bits | l3)
        })
        .collect()
}

/// The scheme ([`l7::SCHEME_HTTP`] / [`l7::SCHEME_HTTPS`]) flags of `flags`, for reports.
pub fn steered_ports(flags: u8) -> Vec<u16> {
    let mut v = Vec::new();
    if flags & allow_flag::of_scheme(l7::SCHEME_HTTP) != 0 {
        v.push(80);
    }
    if flags & allow_flag::of_scheme(l7::SCHEME_HTTPS) != 0 {
        v.push(443);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(v: serde_json::Value) -> RuleSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn literals_ports_and_l3() {
        let rules = [
            rule(serde_json::json!({"id": "a", "match": {"host": "203.0.113.5"}, "action": {"allow": true}})),
            rule(
                serde_json::json!({"id": "b", "match": {"sni": "203.0.113.6/32", "scheme": "https"}, "action": {"allow": true}}),
            ),
            rule(
                serde_json::json!({"id": "c", "match": {"host": "203.0.113.7", "scheme": "http", "port": [80, 8080]}, "action": {"allow": true}}),
            ),
            rule(
                serde_json::json!({"id": "d", "match": {"host": "203.0.113.8", "scheme": "https", "port": 8443}, "action": {"allow": true}}),
            ),
            rule(serde_json::json!({"id": "e", "match": {"host": "api.example.com"}, "action": {"allow": true}})),
        ];
        let allow = [Cidr::new(Ipv4Addr::new(203, 0, 113, 4), 31)];
        let got = static_l7(&rules, &allow);
        let c = |d| Cidr::new(Ipv4Addr::new(203, 0, 113, d), 32);
        use allow_flag::*;
        assert_eq!(
            got,
            vec![(c(5), L7_HTTP | L7_HTTPS | L3_ALLOWED), (c(6), L7_HTTPS), (c(7), L7_HTTP)],
            "8443 cannot be steered; a name is not a literal"
        );
        assert_eq!(steered_ports(L7_HTTP | L7_HTTPS | L3_ALLOWED), vec![80, 443]);
    }
}
