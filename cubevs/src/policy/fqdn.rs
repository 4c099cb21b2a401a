//! FQDN allow entries: names whose DNS answers a sandbox may reach (`reference/upstream.md
//! §3.7`, `dns_allow`). Parsed here strictly; the DNS-learning datapath consumes
//! [`FqdnPattern`]s.
//!
//! Accepted: an exact name (`api.example.com`) or a leading `*.` wildcard (`*.example.com`:
//! any-depth subdomains, not the apex), case-insensitive, one trailing dot ignored. Rejected:
//! blank, whitespace, IP literals (they belong in `allow_out`), middle wildcards, empty or
//! over-long labels (> 63 bytes), names over 253 bytes, bytes outside `[a-z0-9-_]`.

use crate::Error;

/// Most ports one FQDN entry may name (upstream: ≤ 8 tuples per host, §3.7).
pub const MAX_FQDN_PORTS: usize = 8;

/// One FQDN allow entry as a caller sends it. With the `serde` feature it (de)serialises as
/// `{name, ports}` (`ports` omitted when empty).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct FqdnAllow {
    /// `api.example.com` or `*.example.com`.
    pub name: String,
    /// Destination ports (1–65535, host order); empty = every port.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub ports: Vec<u32>,
}

/// A validated entry: lower-case name without a trailing dot or the `*.` prefix.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FqdnPattern {
    /// Lower-case name (the suffix for a wildcard).
    pub name: String,
    /// True for `*.name`: subdomains of `name` only, not `name` itself.
    pub subdomains: bool,
    /// Sorted, deduplicated ports; empty = every port.
    pub ports: Vec<u16>,
}

impl FqdnPattern {
    /// Whether a queried name (any case, optional trailing dot) is covered.
    pub fn matches(&self, qname: &str) -> bool {
        let q = qname.trim_end_matches('.').to_ascii_lowercase();
        if self.subdomains {
            q.len() > self.name.len() + 1
                && q.ends_with(self.name.as_str())
                && q.as_bytes()[q.len() - self.name.len() - 1] == b'.'
        } else {
            q == self.name
        }
    }
}

/// Validates `e`; `field` is its path (`allow_fqdn[2]`), errors name `.name` or `.ports[i]`.
pub fn parse_fqdn(e: &FqdnAllow, field: &str) -> Result<FqdnPattern, Error> {
    let nf = format!("{field}.name");
    let raw = e.name.as_str();
    if raw.is_empty() {
        return Err(Error::invalid(nf, "must not be empty"));
    }
    if raw.chars().any(|c| c.is_whitespace()) {
        return Err(Error::invalid(nf, "must not contain whitespace"));
    }
    let lower = raw.to_ascii_lowercase();
    let s = lower.strip_suffix('.').unwrap_or(&lower);
    let (subdomains, name) = match s.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    if name.len() > 253 {
        return Err(Error::invalid(nf, "longer than 253 bytes"));
    }
    if name.contains('*') {
        return Err(Error::invalid(nf, "only a leading `*.` wildcard is allowed"));
    }
    if name.bytes().all(|b| b.is_ascii_digit() || b == b'.') || name.contains('/') {
        return Err(Error::invalid(nf, "IP addresses and CIDRs belong in allow_out"));
    }
    let bad_label = |l: &str| {
        l.is_empty()
            || l.len() > 63
            || l.starts_with('-')
            || l.ends_with('-')
            || !l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if name.split('.').any(bad_label) {
        return Err(Error::invalid(nf, "invalid DNS name (labels of 1-63 bytes of [a-z0-9-_])"));
    }
    if e.ports.len() > MAX_FQDN_PORTS {
        return Err(Error::invalid(format!("{field}.ports"), format!("more than {MAX_FQDN_PORTS} ports")));
    }
    let mut ports = Vec::with_capacity(e.ports.len());
    for (i, &p) in e.ports.iter().enumerate() {
        match u16::try_from(p) {
            Ok(p) if p != 0 => ports.push(p),
            _ => return Err(Error::invalid(format!("{field}.ports[{i}]"), format!("{p} is not a port (1-65535)"))),
        }
    }
    ports.sort_unstable();
    ports.dedup();
    Ok(FqdnPattern { name: name.to_string(), subdomains, ports })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str, ports: &[u32]) -> Result<FqdnPattern, Error> {
        parse_fqdn(&FqdnAllow { name: name.into(), ports: ports.to_vec() }, "allow_fqdn[0]")
    }

    fn field(e: Error) -> String {
        match e {
            Error::InvalidArgument { field, .. } => field,
            e => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn accepts_exact_and_wildcard() {
        let e = p("API.Example.com.", &[443, 80, 443]).unwrap();
        assert_eq!(e, FqdnPattern { name: "api.example.com".into(), subdomains: false, ports: vec![80, 443] });
        assert!(e.matches("api.example.COM.") && !e.matches("x.api.example.com"));
        let w = p("*.example.com", &[]).unwrap();
        assert!(
            w.subdomains && w.matches("a.b.example.com") && !w.matches("example.com") && !w.matches("badexample.com")
        );
    }

    #[test]
    fn rejects_bad_names_and_ports_naming_the_field() {
        for bad in ["", " a.com", "a..com", "a.*.com", "*", "*.", "1.2.3.4", "10.0.0.0/8", "-a.com", "a_b.c%m"] {
            assert_eq!(field(p(bad, &[]).unwrap_err()), "allow_fqdn[0].name", "{bad:?}");
        }
        assert_eq!(field(p(&format!("{}.com", "a".repeat(64)), &[]).unwrap_err()), "allow_fqdn[0].name");
        assert_eq!(field(p("a.com", &[443, 0]).unwrap_err()), "allow_fqdn[0].ports[1]");
        assert_eq!(field(p("a.com", &[65536]).unwrap_err()), "allow_fqdn[0].ports[0]");
        assert_eq!(field(p("a.com", &[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap_err()), "allow_fqdn[0].ports");
    }
}
