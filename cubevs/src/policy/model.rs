//! The policy model: what a caller asks for ([`EgressPolicy`], cubelet's `CubeVSContext`),
//! what it expands to ([`CompiledPolicy`]), and the datapath's verdict computed in userspace
//! (used to tell whether a replace tightens a policy, and by test doubles).
//!
//! Semantics (`reference/upstream.md §3.5`, `§3.7`): `allow_out` beats `deny_out` beats
//! default allow; [`BASELINE_DENY`] is always denied; `allow_internet_access = false` denies
//! `0.0.0.0/0` and ignores the user deny list (its entries are still validated).

use std::{collections::HashSet, net::Ipv4Addr};

use super::{
    cidr::Cidr,
    fqdn::{FqdnAllow, FqdnPattern, parse_fqdn},
};
use crate::Error;

/// Always-denied destinations of every sandbox: private, loopback and link-local ranges.
/// The one baseline list (the agent's Ready TAPs carry exactly this).
pub const BASELINE_DENY: [Cidr; 5] = [
    Cidr::new(Ipv4Addr::new(10, 0, 0, 0), 8),
    Cidr::new(Ipv4Addr::new(127, 0, 0, 0), 8),
    Cidr::new(Ipv4Addr::new(169, 254, 0, 0), 16),
    Cidr::new(Ipv4Addr::new(172, 16, 0, 0), 12),
    Cidr::new(Ipv4Addr::new(192, 168, 0, 0), 16),
];

/// Trie entries one sandbox may hold per generation beyond its user entries: the baseline
/// and `0.0.0.0/0`.
pub const EXTRA_ENTRIES: u32 = BASELINE_DENY.len() as u32 + 1;

/// Default per-sandbox limit of `allow_out` and of `deny_out` entries (each list).
pub const DEFAULT_ENTRIES_PER_SANDBOX: u32 = 1024;

/// What a caller asks for (cubelet's `CubeVSContext`). With the `serde` feature it
/// (de)serialises as `{allow_internet_access, allow_out, deny_out, allow_fqdn?, rules?}`
/// (the last two omitted when empty and defaulted when absent: older JSON loads unchanged).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct EgressPolicy {
    /// `false` denies every destination not in `allow_out`. Upstream default: `true`.
    pub allow_internet_access: bool,
    /// IPv4 addresses or CIDRs always allowed (beats every deny).
    pub allow_out: Vec<String>,
    /// IPv4 addresses or CIDRs denied (ignored when `allow_internet_access` is false, but
    /// validated all the same).
    pub deny_out: Vec<String>,
    /// DNS names allowed by DNS learning (exact or `*.` subdomains, optional ports).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub allow_fqdn: Vec<FqdnAllow>,
    /// CubeEgress L7 rules (upstream rule model), pushed to the gateway; secrets inside.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Vec::is_empty"))]
    pub rules: Vec<egress_policy::RuleSpec>,
}

impl Default for EgressPolicy {
    fn default() -> Self {
        Self {
            allow_internet_access: true,
            allow_out: Vec::new(),
            deny_out: Vec::new(),
            allow_fqdn: Vec::new(),
            rules: Vec::new(),
        }
    }
}

/// Largest JSON body of one sandbox's gateway policy, in bytes: CubeEgress's admin API refuses
/// larger request bodies (`egress/src/admin.rs`, `MAX_BODY`), so a bigger policy could never
/// reach the gateway.
pub const MAX_RULES_JSON_BYTES: usize = 1 << 20;

/// Validates L7 rules with the gateway's own validator (`egress_policy::Policy::compile`),
/// so what the agent accepts the gateway accepts. Errors name the field (`rules[2].match.path`;
/// `rules` when the policy's JSON exceeds [`MAX_RULES_JSON_BYTES`]). Reasons never quote a
/// secret. An empty list is valid (no L7 policy).
pub fn validate_rules(rules: &[egress_policy::RuleSpec]) -> Result<(), Error> {
    if rules.is_empty() {
        return Ok(());
    }
    // The policy id the agent sends is the sandbox IP (at most 15 bytes).
    let spec = egress_policy::PolicySpec { policy_id: "255.255.255.255".into(), rules: rules.to_vec() };
    let size = serde_json::to_vec(&spec).map(|v| v.len()).map_err(|e| Error::invalid("rules", e.to_string()))?;
    if size > MAX_RULES_JSON_BYTES {
        return Err(Error::invalid(
            "rules",
            format!("{size} bytes of JSON exceed the gateway's limit of {MAX_RULES_JSON_BYTES}"),
        ));
    }
    egress_policy::Policy::compile(spec).map(|_| ()).map_err(|e| Error::invalid(e.field, e.reason))
}

/// Parses one policy entry (see [`Cidr::parse`]) and clears its host bits, as upstream's
/// `net.ParseCIDR` does (`10.1.2.3/8` is `10.0.0.0/8`). `field` names the input in the error.
pub fn parse_cidr(s: &str, field: &str) -> Result<Cidr, Error> {
    Cidr::parse(s).map(|c| c.network()).map_err(|reason| Error::invalid(field, reason))
}

/// The entries a policy expands to, sorted and deduplicated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompiledPolicy {
    /// `allow_out` entries.
    pub allow: Vec<Cidr>,
    /// `deny_out` entries (baseline included).
    pub deny: Vec<Cidr>,
    /// Validated FQDN allow entries, sorted and deduplicated (input of DNS learning).
    pub fqdn: Vec<FqdnPattern>,
    /// Static L7 entries (N10): `(address/32, cubevs_common::allow_flag bits)` for every IPv4
    /// literal an L7 rule names on 80 / 443, sorted by address.
    pub l7: Vec<(Cidr, u8)>,
}

/// Most FQDN allow entries one sandbox may hold (`allow_fqdn`), whatever
/// `policy_entries_per_sandbox` says: `dns_allow` holds `sandboxes × 2 × this` entries.
pub const MAX_FQDN_PER_SANDBOX: u32 = 32;

/// Validates and expands `p`. `limit` is the per-sandbox maximum of each list as given
/// (before deduplication). Errors are [`Error::InvalidArgument`] naming the field:
/// `allow_out[3]` for a bad entry, `allow_out` / `deny_out` / `rules` for a list over
/// `limit` (`allow_fqdn`: over `min(limit, MAX_FQDN_PER_SANDBOX)`), `allow_fqdn[1].name`, `rules[2].match.path`.
pub fn compile(p: &EgressPolicy, limit: u32) -> Result<CompiledPolicy, Error> {
    let lens = [
        ("allow_out", p.allow_out.len()),
        ("deny_out", p.deny_out.len()),
        ("allow_fqdn", p.allow_fqdn.len()),
        ("rules", p.rules.len()),
    ];
    for (name, len) in lens {
        // FQDN patterns have a smaller cap: `dns_allow` is a hash map, whose bucket array the
        // kernel allocates in full at creation (sized for every sandbox at this cap).
        let limit = if name == "allow_fqdn" { limit.min(MAX_FQDN_PER_SANDBOX) } else { limit };
        if len > limit as usize {
            return Err(Error::invalid(name, format!("{len} entries exceed the limit of {limit} per sandbox")));
        }
    }
    let mut allow = Vec::with_capacity(p.allow_out.len());
    for (i, s) in p.allow_out.iter().enumerate() {
        allow.push(parse_cidr(s, &format!("allow_out[{i}]"))?);
    }
    let mut user_deny = Vec::with_capacity(p.deny_out.len());
    for (i, s) in p.deny_out.iter().enumerate() {
        user_deny.push(parse_cidr(s, &format!("deny_out[{i}]"))?);
    }
    let mut fqdn = Vec::with_capacity(p.allow_fqdn.len());
    for (i, e) in p.allow_fqdn.iter().enumerate() {
        fqdn.push(parse_fqdn(e, &format!("allow_fqdn[{i}]"))?);
    }
    validate_rules(&p.rules)?;
    let mut deny = BASELINE_DENY.to_vec();
    if p.allow_internet_access {
        deny.extend(user_deny);
    } else {
        deny.push(Cidr::new(Ipv4Addr::UNSPECIFIED, 0));
    }
    allow.sort();
    allow.dedup();
    deny.sort();
    deny.dedup();
    fqdn.sort();
    fqdn.dedup();
    // Static L7 addresses share the allow trie: each one not already an `allow_out` /32 is
    // one more entry there.
    let l7 = super::l7_static::static_l7(&p.rules, &allow);
    let extra = l7.iter().filter(|(c, _)| allow.binary_search(c).is_err()).count();
    if allow.len() + extra > limit as usize {
        return Err(Error::invalid(
            "rules",
            format!(
                "{} allow_out entries plus {extra} IPv4-literal L7 rule hosts exceed the limit of {limit} per sandbox",
                allow.len()
            ),
        ));
    }
    Ok(CompiledPolicy { allow, deny, fqdn, l7 })
}

/// Membership by longest-prefix candidates: 33 hash lookups per address.
struct PrefixSet(HashSet<(u32, u8)>);

impl PrefixSet {
    fn new(list: &[Cidr]) -> Self {
        Self(list.iter().map(|c| (c.first(), c.len)).collect())
    }

    fn covers(&self, ip: u32) -> bool {
        (0..=32u8).any(|len| {
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            self.0.contains(&(ip & mask, len))
        })
    }
}

/// The datapath's verdict: allowed when an allow entry covers `ip` or no deny entry does.
fn verdict(allow: &PrefixSet, deny: &PrefixSet, ip: u32) -> bool {
    allow.covers(ip) || !deny.covers(ip)
}

impl CompiledPolicy {
    /// The datapath's verdict for a new flow to `ip`: allowed when an allow entry covers it
    /// or no deny entry does.
    pub fn allows(&self, ip: Ipv4Addr) -> bool {
        verdict(&PrefixSet::new(&self.allow), &PrefixSet::new(&self.deny), u32::from(ip))
    }

    /// The lowest address `old` allows and `self` denies, if any: `Some` means replacing
    /// `old` by `self` tightens the policy. Exact over the whole IPv4 space: the verdict can
    /// only change at the first address of an entry or just past its last, so only those
    /// boundaries are evaluated (O(entries) lookups).
    pub fn tightens(&self, old: &CompiledPolicy) -> Option<Ipv4Addr> {
        let mut points: Vec<u32> = vec![0];
        for c in self.allow.iter().chain(&self.deny).chain(&old.allow).chain(&old.deny) {
            points.push(c.first());
            if let Some(next) = c.last().checked_add(1) {
                points.push(next);
            }
        }
        points.sort_unstable();
        points.dedup();
        let (na, nd) = (PrefixSet::new(&self.allow), PrefixSet::new(&self.deny));
        let (oa, od) = (PrefixSet::new(&old.allow), PrefixSet::new(&old.deny));
        points.into_iter().find(|&ip| verdict(&oa, &od, ip) && !verdict(&na, &nd, ip)).map(Ipv4Addr::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> Cidr {
        parse_cidr(s, "t").unwrap()
    }

    fn pol(internet: bool, allow: &[&str], deny: &[&str]) -> EgressPolicy {
        EgressPolicy {
            allow_internet_access: internet,
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn compile_applies_upstream_rules() {
        let p = compile(&pol(false, &["10.1.0.0/16"], &["8.8.8.8"]), 16).unwrap();
        assert_eq!(p.allow, vec![c("10.1.0.0/16")]);
        assert!(p.deny.contains(&c("0.0.0.0/0")));
        assert!(!p.deny.contains(&c("8.8.8.8")), "user deny ignored without internet");
        assert_eq!(p.deny.len(), 6);
        let d = compile(&pol(true, &[], &["8.8.8.8", "8.8.8.8/32", "10.9.9.9/8"]), 16).unwrap();
        assert_eq!(d.deny.len(), 6, "deduplicated and canonicalised: {:?}", d.deny);
        assert_eq!(compile(&EgressPolicy::default(), 1).unwrap().deny, BASELINE_DENY.to_vec());
    }

    #[test]
    fn baseline_is_the_datapaths_always_denied_list() {
        // The DNS learner refuses answers in `cubevs_common::dns::ALWAYS_DENIED` (R15): it must
        // be exactly the baseline the tries carry.
        let dp: Vec<Cidr> = cubevs_common::dns::ALWAYS_DENIED
            .iter()
            .map(|&(net, len)| Cidr::new(Ipv4Addr::from(net), len as u8))
            .collect();
        assert_eq!(dp, BASELINE_DENY.to_vec());
    }

    #[test]
    fn compile_names_fields_and_limits() {
        let e = compile(&pol(true, &["1.1.1.1", "1.2.3.4/+8"], &[]), 16).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument { field, .. } if field == "allow_out[1]"), "{e}");
        // Validated even though allow_internet_access=false ignores the list.
        let e = compile(&pol(false, &[], &["1.2.3.4/+8"]), 16).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument { field, .. } if field == "deny_out[0]"), "{e}");
        let many: Vec<String> = (0..17u32).map(|i| Ipv4Addr::from(0x0b00_0000 + i).to_string()).collect();
        let e = compile(&EgressPolicy { deny_out: many.clone(), ..Default::default() }, 16).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument { field, reason } if field == "deny_out" && reason.contains("16")));
        let e = compile(&EgressPolicy { allow_out: many, ..Default::default() }, 16).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument { field, .. } if field == "allow_out"), "{e}");
    }

    #[test]
    fn fqdn_entries_have_their_own_smaller_cap() {
        let many = |n: usize| EgressPolicy {
            allow_fqdn: (0..n).map(|i| FqdnAllow { name: format!("h{i}.example.com"), ports: vec![] }).collect(),
            ..Default::default()
        };
        compile(&many(MAX_FQDN_PER_SANDBOX as usize), 1024).unwrap();
        let e = compile(&many(MAX_FQDN_PER_SANDBOX as usize + 1), 1024).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument { field, .. } if field == "allow_fqdn"), "{e}");
        assert!(e.to_string().contains("limit of 32"), "{e}");
    }

    #[test]
    fn compile_validates_fqdn_and_rules() {
        let rule = |path: &str| -> egress_policy::RuleSpec {
            serde_json::from_value(serde_json::json!({
                "id": "r", "match": {"host": "api.example.com", "path": path}, "action": {"allow": true}
            }))
            .unwrap()
        };
        let ok = EgressPolicy {
            allow_fqdn: vec![
                FqdnAllow { name: "*.example.com".into(), ports: vec![] },
                FqdnAllow { name: "*.EXAMPLE.com.".into(), ports: vec![] },
            ],
            rules: vec![rule("/v1/*")],
            ..Default::default()
        };
        assert_eq!(compile(&ok, 16).unwrap().fqdn.len(), 1, "deduplicated");
        let bad = EgressPolicy {
            allow_fqdn: vec![ok.allow_fqdn[0].clone(), FqdnAllow { name: "a.*.com".into(), ports: vec![] }],
            ..Default::default()
        };
        let e = compile(&bad, 16).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument { field, .. } if field == "allow_fqdn[1].name"), "{e}");
        let mut r2 = rule("/a");
        r2.id = "r2".into();
        r2.matcher.path = Some("/a*b*".into());
        let e = compile(&EgressPolicy { rules: vec![rule("/a"), r2], ..Default::default() }, 16).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument { field, .. } if field == "rules[1].match.path"), "{e}");
        // Over the gateway's body limit: 17 rules with a 64 KiB secret each.
        let big: Vec<egress_policy::RuleSpec> = (0..17)
            .map(|i| {
                serde_json::from_value(serde_json::json!({"id": format!("r{i}"), "match": {"host": "a.example.com"},
                    "action": {"allow": true, "inject": [{"header": "X-K", "secret": "s".repeat(65536)}]}}))
                .unwrap()
            })
            .collect();
        compile(&EgressPolicy { rules: big[..15].to_vec(), ..Default::default() }, 16).expect("under 1 MiB");
        let e = compile(&EgressPolicy { rules: big.clone(), ..Default::default() }, 32).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument { field, .. } if field == "rules"), "{e}");
        assert!(!e.to_string().contains("sss"), "the reason never quotes a secret: {e}");
        let e = compile(&EgressPolicy { rules: big, ..Default::default() }, 16).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { field, reason } if field == "rules" && reason.contains("limit of 16"))
        );
    }

    /// State written before the FQDN/L7 fields loads unchanged and is written back unchanged.
    #[cfg(feature = "serde")]
    #[test]
    fn older_json_loads_and_round_trips() {
        let old = r#"{"allow_internet_access":false,"allow_out":["1.1.1.1/32"],"deny_out":[]}"#;
        let p: EgressPolicy = serde_json::from_str(old).unwrap();
        assert!(p.allow_fqdn.is_empty() && p.rules.is_empty());
        assert_eq!(serde_json::to_string(&p).unwrap(), old);
    }

    #[test]
    fn verdicts_follow_precedence() {
        let p = compile(&pol(true, &["10.1.0.0/16"], &["8.8.0.0/16"]), 16).unwrap();
        assert!(p.allows(Ipv4Addr::new(1, 1, 1, 1)));
        assert!(!p.allows(Ipv4Addr::new(8, 8, 8, 8)));
        assert!(!p.allows(Ipv4Addr::new(10, 2, 0, 1)), "baseline");
        assert!(p.allows(Ipv4Addr::new(10, 1, 0, 1)), "allow beats baseline");
        let closed = compile(&pol(false, &["203.0.113.0/24"], &[]), 16).unwrap();
        assert!(!closed.allows(Ipv4Addr::new(1, 1, 1, 1)));
        assert!(closed.allows(Ipv4Addr::new(203, 0, 113, 9)));
    }

    #[test]
    fn tightening_is_exact() {
        let open = compile(&pol(true, &[], &[]), 16).unwrap();
        let same = compile(&pol(true, &[], &[]), 16).unwrap();
        assert_eq!(same.tightens(&open), None);
        let deny = compile(&pol(true, &[], &["198.51.100.1/32"]), 16).unwrap();
        assert_eq!(deny.tightens(&open), Some(Ipv4Addr::new(198, 51, 100, 1)));
        assert_eq!(open.tightens(&deny), None, "loosening");
        // Denying what stays allowed by an allow entry is not a tightening.
        let a = compile(&pol(true, &["198.51.100.0/24"], &[]), 16).unwrap();
        let b = compile(&pol(true, &["198.51.100.0/24"], &["198.51.100.0/25"]), 16).unwrap();
        assert_eq!(b.tightens(&a), None);
        // Narrowing an allow-list.
        let wide = compile(&pol(false, &["203.0.113.0/24"], &[]), 16).unwrap();
        let narrow = compile(&pol(false, &["203.0.113.0/25"], &[]), 16).unwrap();
        assert_eq!(narrow.tightens(&wide), Some(Ipv4Addr::new(203, 0, 113, 128)));
        assert_eq!(wide.tightens(&narrow), None);
        // Dropping an allow of a private range, and switching the internet off.
        let private = compile(&pol(true, &["10.1.0.0/16"], &[]), 16).unwrap();
        assert_eq!(open.tightens(&private), Some(Ipv4Addr::new(10, 1, 0, 0)));
        assert_eq!(wide.tightens(&open), Some(Ipv4Addr::new(0, 0, 0, 0)));
        // The last address of the space.
        let top = compile(&pol(true, &[], &["255.255.255.255"]), 16).unwrap();
        assert_eq!(top.tightens(&open), Some(Ipv4Addr::BROADCAST));
    }
}
