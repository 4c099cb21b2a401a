//! FQDN allow entries: names whose DNS answers a sandbox may reach (`reference/upstream.md
//! §3.7`, `dns_allow`). Parsed here strictly; the DNS-learning datapath consumes
//! [`FqdnPattern`]s.
//!
//! Accepted: an exact name (`api.example.com`) or a leading `*.` wildcard (`*.example.com`:
//! any-depth subdomains, not the apex), case-insensitive, one trailing dot ignored. Rejected:
//! blank, whitespace, IP literals and CIDRs (they belong in `allow_out`), a wildcard anywhere
//! but as the whole leftmost label, empty or over-long labels (> 63 bytes), names over 253
//! bytes (the name a wildcard matches is at least two bytes longer, so its suffix may have at
//! most 251), labels with bytes outside `[a-z0-9-_]` or starting/ending with `-`, an
//! all-numeric last label (no TLD is numeric; `1.2.3.4` is an address).
//!
//! Internationalised names: only the ASCII (A-label, `xn--…`) form is accepted, as it appears
//! on the wire in DNS queries; a Unicode name is refused with a hint to send its punycode form
//! (decision L2: no IDNA mapping tables in the agent, and no two spellings of one name).

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
    /// The tag the datapath records in the entries learned for this pattern
    /// ([`cubevs_common::dns::pattern_tag`] of its `dns_allow` key).
    pub fn tag(&self) -> u16 {
        cubevs_common::dns::pattern_tag(cubevs_common::dns::name_hash(&self.name), self.subdomains)
    }

    /// The pattern as written in a policy: `name` or `*.name`.
    pub fn spelled(&self) -> String {
        if self.subdomains { format!("*.{}", self.name) } else { self.name.clone() }
    }

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
    if !raw.is_ascii() {
        return Err(Error::invalid(nf, "non-ASCII name: send its punycode (xn--) form"));
    }
    let lower = raw.to_ascii_lowercase();
    let s = lower.strip_suffix('.').unwrap_or(&lower);
    let (subdomains, name) = match s.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let max = if subdomains { 251 } else { 253 };
    if name.len() > max {
        return Err(Error::invalid(
            nf,
            format!("longer than {max} bytes{}", if subdomains { " after `*.`" } else { "" }),
        ));
    }
    if name.contains('*') {
        return Err(Error::invalid(nf, "only a leading `*.` wildcard is allowed"));
    }
    let last = name.rsplit('.').next().unwrap_or("");
    if (!last.is_empty() && last.bytes().all(|b| b.is_ascii_digit())) || name.contains('/') || name.contains(':') {
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

    /// `n` bytes of name: 63-byte labels joined by dots, the last one shortened.
    fn name_of_len(n: usize) -> String {
        let mut s = String::new();
        while s.len() < n {
            if !s.is_empty() {
                s.push('.');
            }
            let take = (n - s.len()).min(63);
            s.push_str(&"a".repeat(take));
        }
        assert_eq!(s.len(), n);
        s
    }

    #[test]
    fn length_limits_are_exact() {
        let label63 = format!("{}.com", "b".repeat(63));
        assert_eq!(p(&label63, &[]).unwrap().name, label63);
        assert_eq!(field(p(&format!("{}.com", "b".repeat(64)), &[]).unwrap_err()), "allow_fqdn[0].name");
        let n253 = name_of_len(253);
        assert!(n253.ends_with('a'), "{n253}");
        assert_eq!(p(&n253, &[]).unwrap().name.len(), 253);
        assert_eq!(p(&format!("{n253}."), &[]).unwrap().name.len(), 253, "a trailing dot is not counted");
        assert_eq!(field(p(&name_of_len(254), &[]).unwrap_err()), "allow_fqdn[0].name");
        // `*.` + 251: the shortest matching name (`x.` + 251) is 253 bytes.
        let w = p(&format!("*.{}", name_of_len(251)), &[]).unwrap();
        assert!(w.matches(&format!("x.{}", name_of_len(251))));
        assert_eq!(field(p(&format!("*.{}", name_of_len(252)), &[]).unwrap_err()), "allow_fqdn[0].name");
    }

    #[test]
    fn label_characters_and_wildcard_position() {
        for ok in ["a-b.example.com", "_dmarc.example.com", "xn--bcher-kva.example", "9gag.com", "a.b.c.d.e", "x"] {
            assert!(p(ok, &[]).is_ok(), "{ok:?}");
        }
        for bad in [
            "a-.com",
            "a.-b.com",
            "a!.com",
            "a b.com",
            "a\tb.com",
            "b\u{fc}cher.de",
            "bücher.de",
            "*a.example.com",
            "**.example.com",
            "*.*.example.com",
            "example.*",
            "x.*",
            "example.com.*",
            ".example.com",
            "example.com..",
            "example.123",
            "[::1]",
            "::1",
            "a.com:443",
        ] {
            assert_eq!(field(p(bad, &[]).unwrap_err()), "allow_fqdn[0].name", "{bad:?}");
        }
        let e = p("bücher.de", &[]).unwrap_err().to_string();
        assert!(e.contains("punycode"), "{e}");
    }

    #[test]
    fn port_bounds() {
        assert_eq!(p("a.com", &[1, 65535]).unwrap().ports, vec![1, 65535]);
        assert_eq!(
            p("a.com", &[8, 7, 6, 5, 4, 3, 2, 1]).unwrap().ports,
            vec![1, 2, 3, 4, 5, 6, 7, 8],
            "8 ports: the maximum"
        );
        assert_eq!(field(p("a.com", &[u32::MAX]).unwrap_err()), "allow_fqdn[0].ports[0]");
        assert_eq!(field(p("a.com", &[80, 80, 80, 80, 80, 80, 80, 80, 80]).unwrap_err()), "allow_fqdn[0].ports");
    }
}
