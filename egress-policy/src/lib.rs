//! Per-sandbox L7 policy: the wire model, validation and the first-match evaluator.
//!
//! Behaviour follows `reference/upstream.md §4.3`: a policy is
//! `{policy_id, rules: [{id, match{sni, host, method[], path, scheme, port}, action{allow, audit, inject[]}}]}`,
//! keyed by the sandbox IP; the first matching rule wins and no match is a deny. This module is
//! pure logic (no I/O).

use std::{collections::HashMap, fmt, net::Ipv4Addr};

use serde::{Deserialize, Serialize};

/// Placeholder written instead of a secret wherever a policy is read back (admin API, dumps).
pub const REDACTED: &str = "***REDACTED***";
/// Longest accepted secret, in bytes (upstream.md §4.3).
pub const MAX_SECRET_BYTES: usize = 65536;
/// Most (port, scheme) tuples one rule may expand to (upstream.md §4.3).
pub const MAX_PORTS: usize = 8;
/// The placeholder in `inject[].format` replaced by the secret (first occurrence only).
pub const SECRET_PLACEHOLDER: &str = "${SECRET}";

/// A validation failure: `field` is the JSON path of the offending value (e.g.
/// `rules[1].match.host`), `reason` says what is wrong. Never contains a secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationError {
    /// JSON path of the offending field.
    pub field: String,
    /// Human-readable reason.
    pub reason: String,
}

impl ValidationError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { field: field.into(), reason: reason.into() }
    }
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for ValidationError {}

/// One port or a list of ports in `match.port`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Ports {
    /// A single port.
    One(u32),
    /// Several ports (at most [`MAX_PORTS`]).
    Many(Vec<u32>),
}

/// `match` of a rule as sent on the wire. Every present field must hold (AND).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatchSpec {
    /// TLS SNI: exact name or `*.suffix` (any-depth subdomain, not the apex), case-insensitive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sni: Option<String>,
    /// HTTP Host / `:authority` (port ignored), same pattern syntax as `sni`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Allowed methods (compared upper-case); empty or absent = any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<Vec<String>>,
    /// Request path: exact, or a prefix with one trailing `*`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// `http` or `https` (case and surrounding space ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    /// Original destination port(s), 1–65535; requires `scheme`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<Ports>,
}

/// One credential to inject as a request header. `Debug` shows the fingerprint, not the secret.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InjectSpec {
    /// Header name to set (client copies are removed first).
    pub header: String,
    /// The secret (1..=65536 bytes). Redacted on every read path.
    pub secret: String,
    /// Header value template; the first `${SECRET}` is replaced. Default `${SECRET}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
}

impl fmt::Debug for InjectSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InjectSpec")
            .field("header", &self.header)
            .field("secret", &fingerprint(&self.secret))
            .field("format", &self.format)
            .finish()
    }
}

/// `action` of a rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionSpec {
    /// Allow (forward) or deny (403, no upstream contact).
    pub allow: bool,
    /// Audit level: `full`, `metadata` (default) or `none` (`full` logs what `metadata` does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<String>,
    /// Credentials injected on allow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inject: Option<Vec<InjectSpec>>,
    /// CubeNet extension: permit injection over plain HTTP for this rule (default false:
    /// injection only over verified HTTPS with SNI == Host; anchors D.16).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inject_plain_http: bool,
}

/// A rule as sent on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    /// Unique (within the policy) non-empty rule id.
    pub id: String,
    /// Conditions; an empty match matches everything.
    #[serde(rename = "match", default)]
    pub matcher: MatchSpec,
    /// What to do on a match.
    pub action: ActionSpec,
}

/// A sandbox policy as sent on the wire (`PUT /admin/v1/policies/<ip>` body).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicySpec {
    /// Non-empty policy id (Cubelet uses the sandbox IP).
    pub policy_id: String,
    /// At least one rule; evaluated in order.
    pub rules: Vec<RuleSpec>,
}

impl PolicySpec {
    /// A copy with every secret replaced by [`REDACTED`].
    pub fn redacted(&self) -> PolicySpec {
        let mut p = self.clone();
        for r in &mut p.rules {
            for i in r.action.inject.iter_mut().flatten() {
                i.secret = REDACTED.to_string();
            }
        }
        p
    }
}

/// Request scheme as seen by the gateway (which listener accepted the connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    /// Plain HTTP (the 8080 listener).
    Http,
    /// TLS-intercepted HTTPS (the 8443 listener).
    Https,
}

impl Scheme {
    /// `http` / `https`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }
    fn default_port(self) -> u16 {
        match self {
            Scheme::Http => 80,
            Scheme::Https => 443,
        }
    }
}

/// Audit level of a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuditLevel {
    /// Log metadata (same as `Metadata` today: bodies are never logged).
    Full,
    /// Log metadata.
    Metadata,
    /// No `http_request` record (security events are still written).
    None,
}

/// A host/SNI pattern after normalisation.
#[derive(Debug, Clone, PartialEq, Eq)]
enum NamePattern {
    /// Exact lower-case name or IPv4 literal.
    Exact(String),
    /// `*.suffix`: stores `.suffix`; matches any-depth subdomains, not the apex.
    Wildcard(String),
}

impl NamePattern {
    fn matches(&self, name: &str) -> bool {
        match self {
            NamePattern::Exact(e) => e == name,
            NamePattern::Wildcard(suffix) => name.len() > suffix.len() && name.ends_with(suffix.as_str()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PathPattern {
    Exact(String),
    Prefix(String),
}

impl PathPattern {
    fn matches(&self, path: &str) -> bool {
        match self {
            PathPattern::Exact(p) => p == path,
            PathPattern::Prefix(p) => path.starts_with(p.as_str()),
        }
    }
}

/// Port/scheme condition of a rule after expansion.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PortCond {
    /// Allowed (port, scheme) tuples (allow rules; also deny rules with ports).
    Tuples(Vec<(u16, Scheme)>),
    /// Any port with this scheme (deny rule with scheme only).
    SchemeAnyPort(Scheme),
    /// Any port and scheme (deny rule without scheme/port).
    Any,
}

/// A validated credential: header name and the ready-to-send value.
#[derive(Clone, PartialEq, Eq)]
pub struct Injection {
    /// Lower-case header name.
    pub header: http::HeaderName,
    /// Final header value (format applied); sensitive.
    pub value: http::HeaderValue,
    /// `fp-` + hex of the first 4 bytes of SHA-256(secret) (upstream.md §4.3).
    pub fingerprint: String,
}

impl fmt::Debug for Injection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Injection").field("header", &self.header).field("secret", &self.fingerprint).finish()
    }
}

/// A validated rule, ready to evaluate.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Rule id.
    pub id: String,
    sni: Option<NamePattern>,
    host: Option<NamePattern>,
    methods: Vec<String>,
    path: Option<PathPattern>,
    ports: PortCond,
    /// Allow (true) or deny.
    pub allow: bool,
    /// Audit level.
    pub audit: AuditLevel,
    /// Credentials to inject on allow.
    pub inject: Vec<Injection>,
    /// Injection over plain HTTP permitted.
    pub inject_plain_http: bool,
}

impl Rule {
    /// Whether the rule has a `host` pattern (its decision depends on the Host header).
    pub fn matches_on_host(&self) -> bool {
        self.host.is_some()
    }
}

/// A validated policy: the normalised wire form (for reads) plus the compiled rules.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Normalised spec (secrets intact; redact before showing).
    pub spec: PolicySpec,
    /// Compiled rules, in order.
    pub rules: Vec<Rule>,
}

/// The facts of one request the evaluator looks at.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    /// Client TLS SNI (HTTPS only).
    pub sni: Option<&'a str>,
    /// Host header or `:authority` (may include a port; normalised here).
    pub host: Option<&'a str>,
    /// Request method.
    pub method: &'a str,
    /// Request path without the query.
    pub path: &'a str,
    /// Which listener accepted the connection.
    pub scheme: Scheme,
    /// Original destination address.
    pub dst: Ipv4Addr,
    /// Original destination port.
    pub port: u16,
}

/// Outcome of [`Policy::evaluate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Rule at this index matched and allows.
    Allow(usize),
    /// Rule at this index matched and denies.
    Deny(usize),
    /// No rule matched (`no_rule_match`).
    NoMatch,
}

/// Outcome of [`Policy::admit_sni`], the pre-handshake check (anchors D.17).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SniAdmission {
    /// Some allow rule may match requests on this connection: mint a certificate.
    Mint,
    /// Every request on this connection would be denied: refuse the handshake.
    Refuse,
}

/// Parses a sandbox IP path segment: plain dotted quad, no leading zeros (upstream.md §4.3).
pub fn parse_sandbox_ip(s: &str) -> Result<Ipv4Addr, ValidationError> {
    strict_ipv4(s).ok_or_else(|| ValidationError::new("ip", format!("invalid sandbox IP {s:?}")))
}

fn strict_ipv4(s: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = s.split('.').collect();
    if parts.len() != 4 {
        return None;
    }
    let mut o = [0u8; 4];
    for (i, p) in parts.iter().enumerate() {
        if p.is_empty() || p.len() > 3 || !p.bytes().all(|b| b.is_ascii_digit()) || (p.len() > 1 && p.starts_with('0'))
        {
            return None;
        }
        o[i] = p.parse().ok()?;
    }
    Some(Ipv4Addr::from(o))
}

/// The path rules are matched against, as upstream's `ngx.var.uri` (nginx `$uri`): every
/// `%XX` decoded, `.` and `..` segments resolved, repeated slashes merged; a trailing slash
/// kept. `None` when the path cannot be normalised (a bad `%` escape, decoded bytes that are
/// not UTF-8, a `..` above the root, or not starting with `/`): such a request is refused,
/// as nginx answers it 400. Matching the raw path instead let `/v1/../admin` pass an allow
/// rule for `/v1/*` and `/%61dmin` pass a deny rule for `/admin*`, while the server behind
/// resolves both to `/admin` (decision R19).
pub fn normalize_request_path(raw: &str) -> Option<String> {
    let b = raw.as_bytes();
    if b.first() != Some(&b'/') {
        return None;
    }
    let mut dec = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = |c: u8| (c as char).to_digit(16);
            let (h, l) = (hex(*b.get(i + 1)?)?, hex(*b.get(i + 2)?)?);
            dec.push((h * 16 + l) as u8);
            i += 3;
        } else {
            dec.push(b[i]);
            i += 1;
        }
    }
    let dec = String::from_utf8(dec).ok()?;
    let mut out: Vec<&str> = Vec::new();
    let segs: Vec<&str> = dec.split('/').collect();
    let last = segs.len() - 1;
    let mut trailing = false;
    for (n, seg) in segs.iter().enumerate() {
        match *seg {
            "" | "." => trailing = n == last && n > 0,
            ".." => {
                out.pop()?;
                trailing = n == last;
            }
            s => {
                out.push(s);
                trailing = false;
            }
        }
    }
    let mut p = String::with_capacity(dec.len());
    for s in &out {
        p.push('/');
        p.push_str(s);
    }
    if p.is_empty() || trailing {
        p.push('/');
    }
    Some(p)
}

/// Normalises a request-side host (Host header, `:authority` or SNI): lower-case, port and
/// trailing dot removed, IPv6 brackets kept.
pub fn normalize_request_host(h: &str) -> String {
    let h = h.trim();
    let without_port = if let Some(rest) = h.strip_prefix('[') {
        match rest.find(']') {
            Some(end) => &h[..end + 2],
            None => h,
        }
    } else {
        match h.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => h,
        }
    };
    without_port.trim_end_matches('.').to_ascii_lowercase()
}

fn parse_name_pattern(field: &str, raw: &str) -> Result<(NamePattern, String), ValidationError> {
    if raw.is_empty() {
        return Err(ValidationError::new(field, "must not be empty"));
    }
    if raw.chars().any(char::is_whitespace) {
        return Err(ValidationError::new(field, "must not contain whitespace"));
    }
    let mut s = raw.to_ascii_lowercase();
    while s.ends_with('.') {
        s.pop();
    }
    if let Some((addr, len)) = s.split_once('/') {
        if len != "32" {
            return Err(ValidationError::new(field, "subnets are not allowed (only /32)"));
        }
        let ip = strict_ipv4(addr).ok_or_else(|| ValidationError::new(field, "invalid IPv4 address"))?;
        return Ok((NamePattern::Exact(ip.to_string()), ip.to_string()));
    }
    if s.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        let ip = strict_ipv4(&s).ok_or_else(|| ValidationError::new(field, "invalid IPv4 address"))?;
        return Ok((NamePattern::Exact(ip.to_string()), ip.to_string()));
    }
    let (wild, name) = match s.strip_prefix("*.") {
        Some(rest) => (true, rest.to_string()),
        None => (false, s.clone()),
    };
    if name.is_empty()
        || name.split('.').any(|l| {
            l.is_empty()
                || l.len() > 63
                || l.starts_with('-')
                || !l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
    {
        return Err(ValidationError::new(field, "invalid host name (exact name or leading `*.` wildcard only)"));
    }
    Ok(if wild { (NamePattern::Wildcard(format!(".{name}")), s) } else { (NamePattern::Exact(name.clone()), name) })
}

fn parse_scheme(field: &str, raw: &str) -> Result<Scheme, ValidationError> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "http" => Ok(Scheme::Http),
        "https" => Ok(Scheme::Https),
        _ => Err(ValidationError::new(field, "must be \"http\" or \"https\"")),
    }
}

/// `fp-` + hex(sha256(secret)[0..4]): the only form of a secret that may be logged.
pub fn fingerprint(secret: &str) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(secret.as_bytes());
    format!("fp-{:02x}{:02x}{:02x}{:02x}", d[0], d[1], d[2], d[3])
}

fn compile_rule(i: usize, spec: &mut RuleSpec) -> Result<Rule, ValidationError> {
    let f = |name: &str| format!("rules[{i}].{name}");
    if spec.id.trim().is_empty() {
        return Err(ValidationError::new(f("id"), "must not be empty"));
    }
    let m = &mut spec.matcher;
    let sni = match &m.sni {
        Some(raw) => {
            let (p, norm) = parse_name_pattern(&f("match.sni"), raw)?;
            m.sni = Some(norm);
            Some(p)
        }
        None => None,
    };
    let host = match &m.host {
        Some(raw) => {
            let (p, norm) = parse_name_pattern(&f("match.host"), raw)?;
            m.host = Some(norm);
            Some(p)
        }
        None => None,
    };
    let mut methods = Vec::new();
    for (j, meth) in m.method.iter().flatten().enumerate() {
        let u = meth.trim().to_ascii_uppercase();
        if u.is_empty() || !u.bytes().all(|b| b.is_ascii_alphabetic() || b == b'-' || b == b'_') {
            return Err(ValidationError::new(f(&format!("match.method[{j}]")), "invalid HTTP method"));
        }
        methods.push(u);
    }
    if m.method.is_some() {
        m.method = Some(methods.clone());
    }
    let path = match &m.path {
        Some(p) => {
            if !p.starts_with('/') {
                return Err(ValidationError::new(f("match.path"), "must start with `/`"));
            }
            let star = p.matches('*').count();
            if star > 1 || (star == 1 && !p.ends_with('*')) {
                return Err(ValidationError::new(f("match.path"), "`*` is only allowed once, at the end"));
            }
            Some(match p.strip_suffix('*') {
                Some(prefix) => PathPattern::Prefix(prefix.to_string()),
                None => PathPattern::Exact(p.clone()),
            })
        }
        None => None,
    };
    let scheme = match &m.scheme {
        Some(s) => {
            let sc = parse_scheme(&f("match.scheme"), s)?;
            m.scheme = Some(sc.as_str().to_string());
            Some(sc)
        }
        None => None,
    };
    let ports: Vec<u32> = match &m.port {
        None => Vec::new(),
        Some(Ports::One(p)) => vec![*p],
        Some(Ports::Many(v)) => {
            if v.is_empty() {
                return Err(ValidationError::new(f("match.port"), "must not be an empty list"));
            }
            v.clone()
        }
    };
    if ports.len() > MAX_PORTS {
        return Err(ValidationError::new(f("match.port"), format!("at most {MAX_PORTS} ports")));
    }
    let mut ports16 = Vec::new();
    for p in &ports {
        if !(1..=65535).contains(p) {
            return Err(ValidationError::new(f("match.port"), "ports must be 1-65535"));
        }
        ports16.push(*p as u16);
    }
    if !ports16.is_empty() && scheme.is_none() {
        return Err(ValidationError::new(f("match.port"), "a port needs `match.scheme`"));
    }
    let allow = spec.action.allow;
    let port_cond = match (scheme, ports16.is_empty()) {
        (Some(sc), false) => PortCond::Tuples(ports16.iter().map(|p| (*p, sc)).collect()),
        (Some(sc), true) if allow => PortCond::Tuples(vec![(sc.default_port(), sc)]),
        (Some(sc), true) => PortCond::SchemeAnyPort(sc),
        (None, _) if allow => PortCond::Tuples(vec![(80, Scheme::Http), (443, Scheme::Https)]),
        (None, _) => PortCond::Any,
    };
    let audit = match spec.action.audit.as_deref().map(str::trim) {
        None | Some("metadata") => AuditLevel::Metadata,
        Some("full") => AuditLevel::Full,
        Some("none") => AuditLevel::None,
        Some(_) => return Err(ValidationError::new(f("action.audit"), "must be full, metadata or none")),
    };
    let mut inject = Vec::new();
    for (j, inj) in spec.action.inject.iter().flatten().enumerate() {
        let fi = |n: &str| f(&format!("action.inject[{j}].{n}"));
        if inj.header.trim().is_empty() {
            return Err(ValidationError::new(fi("header"), "must not be empty"));
        }
        let header = http::HeaderName::from_bytes(inj.header.trim().as_bytes())
            .map_err(|_| ValidationError::new(fi("header"), "invalid header name"))?;
        if inj.secret.is_empty() {
            return Err(ValidationError::new(fi("secret"), "must not be empty"));
        }
        if inj.secret.len() > MAX_SECRET_BYTES {
            return Err(ValidationError::new(fi("secret"), format!("longer than {MAX_SECRET_BYTES} bytes")));
        }
        let format = inj.format.as_deref().unwrap_or(SECRET_PLACEHOLDER);
        if !format.contains(SECRET_PLACEHOLDER) {
            return Err(ValidationError::new(fi("format"), "must contain ${SECRET}"));
        }
        let value = format.replacen(SECRET_PLACEHOLDER, &inj.secret, 1);
        let mut value = http::HeaderValue::from_str(&value)
            .map_err(|_| ValidationError::new(fi("secret"), "secret/format give an invalid header value"))?;
        value.set_sensitive(true);
        inject.push(Injection { header, value, fingerprint: fingerprint(&inj.secret) });
    }
    if !allow && !inject.is_empty() {
        return Err(ValidationError::new(f("action.inject"), "only allowed on allow rules"));
    }
    Ok(Rule {
        id: spec.id.clone(),
        sni,
        host,
        methods,
        path,
        ports: port_cond,
        allow,
        audit,
        inject,
        inject_plain_http: spec.action.inject_plain_http,
    })
}

impl Policy {
    /// Validates and compiles a wire policy (upstream.md §4.3 rules). Errors name the field.
    pub fn compile(mut spec: PolicySpec) -> Result<Policy, ValidationError> {
        if spec.policy_id.trim().is_empty() {
            return Err(ValidationError::new("policy_id", "must not be empty"));
        }
        if spec.rules.is_empty() {
            return Err(ValidationError::new("rules", "at least one rule is required"));
        }
        let mut ids = HashMap::new();
        let mut rules = Vec::with_capacity(spec.rules.len());
        for (i, r) in spec.rules.iter_mut().enumerate() {
            if let Some(prev) = ids.insert(r.id.clone(), i) {
                return Err(ValidationError::new(format!("rules[{i}].id"), format!("duplicate of rules[{prev}].id")));
            }
            rules.push(compile_rule(i, r)?);
        }
        // No scheme conflict: one (host identity, port) must not be both http and https.
        let mut seen: HashMap<(String, u16), Scheme> = HashMap::new();
        for (i, (r, s)) in rules.iter().zip(&spec.rules).enumerate() {
            let ident = s.matcher.host.clone().or_else(|| s.matcher.sni.clone()).unwrap_or_default();
            if let PortCond::Tuples(t) = &r.ports {
                for (port, sc) in t {
                    if let Some(prev) = seen.insert((ident.clone(), *port), *sc)
                        && prev != *sc
                    {
                        return Err(ValidationError::new(
                            format!("rules[{i}].match.scheme"),
                            format!("port {port} is both http and https for {ident:?}"),
                        ));
                    }
                }
            }
        }
        Ok(Policy { spec, rules })
    }

    /// Parses a JSON policy body; errors name the field (`rules[0].match: unknown field …`).
    pub fn from_json(body: &[u8]) -> Result<Policy, ValidationError> {
        let de = &mut serde_json::Deserializer::from_slice(body);
        let spec: PolicySpec = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            ValidationError::new(
                if path == "." || path == "?" { "body".to_string() } else { path },
                e.inner().to_string(),
            )
        })?;
        Policy::compile(spec)
    }

    fn rule_matches(r: &Rule, q: &RequestFacts<'_>, host: Option<&str>, sni: Option<&str>) -> bool {
        if let Some(p) = &r.sni {
            match sni {
                Some(s) if p.matches(s) => {}
                _ => return false,
            }
        }
        if let Some(p) = &r.host {
            match host {
                Some(h) if p.matches(h) => {}
                _ => return false,
            }
            // An HTTPS allow rule that names a host but no SNI also binds the connection's
            // name (SNI, else the destination IP) to that host: the upstream leg connects with
            // the client's SNI, so without this a host-only rule would admit any server
            // (decision E13).
            if q.scheme == Scheme::Https && r.allow && r.sni.is_none() && !p.matches(&connection_name(sni, q.dst)) {
                return false;
            }
        }
        if !r.methods.is_empty() && !r.methods.iter().any(|m| m.eq_ignore_ascii_case(q.method)) {
            return false;
        }
        if let Some(p) = &r.path
            && !p.matches(q.path)
        {
            return false;
        }
        match &r.ports {
            PortCond::Tuples(t) => t.contains(&(q.port, q.scheme)),
            PortCond::SchemeAnyPort(sc) => *sc == q.scheme,
            PortCond::Any => true,
        }
    }

    /// First-match evaluation of one request (upstream.md §4.3).
    pub fn evaluate(&self, q: &RequestFacts<'_>) -> Verdict {
        let host = q.host.map(normalize_request_host);
        let sni = q.sni.map(normalize_request_host);
        for (i, r) in self.rules.iter().enumerate() {
            if Self::rule_matches(r, q, host.as_deref(), sni.as_deref()) {
                return if r.allow { Verdict::Allow(i) } else { Verdict::Deny(i) };
            }
        }
        Verdict::NoMatch
    }

    /// Decides, from what the ClientHello and the socket tell (SNI, original destination and
    /// port, scheme HTTPS), whether a TLS connection may get a minted certificate:
    /// [`SniAdmission::Mint`] when some allow rule could still match a request on it,
    /// [`SniAdmission::Refuse`] when every request would be denied (anchors D.17). An allow
    /// rule's name pattern is its `sni`, else its `host` (decision E13); the connection's name
    /// is the SNI, else the destination IP (the name the leaf would be minted for). Rules
    /// without either pattern admit any name.
    pub fn admit_sni(&self, sni: Option<&str>, dst: Ipv4Addr, port: u16) -> SniAdmission {
        let sni = sni.map(normalize_request_host);
        let name = connection_name(sni.as_deref(), dst);
        for r in &self.rules {
            if let Some(p) = &r.sni {
                match sni.as_deref() {
                    Some(s) if p.matches(s) => {}
                    _ => continue,
                }
            } else if r.allow
                && let Some(p) = &r.host
                && !p.matches(&name)
            {
                continue;
            }
            let port_ok = match &r.ports {
                PortCond::Tuples(t) => t.contains(&(port, Scheme::Https)),
                PortCond::SchemeAnyPort(sc) => *sc == Scheme::Https,
                PortCond::Any => true,
            };
            if !port_ok {
                continue;
            }
            let unconditional = r.host.is_none() && r.methods.is_empty() && r.path.is_none();
            if r.allow {
                return SniAdmission::Mint;
            }
            if unconditional {
                return SniAdmission::Refuse;
            }
        }
        SniAdmission::Refuse
    }
}

/// The name a TLS connection is for: its (normalised) SNI, else the destination IP literal.
fn connection_name(sni: Option<&str>, dst: Ipv4Addr) -> String {
    sni.map(str::to_string).unwrap_or_else(|| dst.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_like_nginx_uri() {
        let n = |p: &str| normalize_request_path(p);
        for (raw, want) in [
            ("/", "/"),
            ("/v1/x", "/v1/x"),
            ("/v1/../admin", "/admin"),
            ("/%61dmin/x", "/admin/x"),
            ("//admin", "/admin"),
            ("/./admin/./x/", "/admin/x/"),
            ("/a/b/..", "/a/"),
            ("/a/..", "/"),
            ("/v1%2F..%2Fadmin", "/admin"),
            ("/caf%C3%A9", "/café"),
        ] {
            assert_eq!(n(raw).as_deref(), Some(want), "{raw}");
        }
        for bad in ["", "admin", "/..", "/a/../..", "/%", "/%4", "/%zz", "/%ff"] {
            assert_eq!(n(bad), None, "{bad}");
        }
    }

    fn pol(json: &str) -> Policy {
        Policy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"))
    }

    fn err(json: &str) -> ValidationError {
        Policy::from_json(json.as_bytes()).expect_err("must be rejected")
    }

    const DST: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 7);

    fn req<'a>(
        sni: Option<&'a str>,
        host: &'a str,
        method: &'a str,
        path: &'a str,
        scheme: Scheme,
        port: u16,
    ) -> RequestFacts<'a> {
        RequestFacts { sni, host: Some(host), method, path, scheme, dst: DST, port }
    }

    const BASIC: &str = r#"{"policy_id":"p","rules":[
        {"id":"deny-admin","match":{"host":"api.example.com","path":"/admin*"},"action":{"allow":false}},
        {"id":"api","match":{"sni":"*.example.com","method":["get","Post"],"path":"/v1/*"},
         "action":{"allow":true,"inject":[{"header":"Authorization","secret":"s3cr3t","format":"Bearer ${SECRET}"}]}},
        {"id":"exact","match":{"host":"Exact.Example.ORG.","path":"/ping"},"action":{"allow":true,"audit":"none"}}
    ]}"#;

    #[test]
    fn first_match_wins_and_no_match_denies() {
        let p = pol(BASIC);
        let https = Scheme::Https;
        assert_eq!(
            p.evaluate(&req(Some("api.example.com"), "api.example.com", "GET", "/admin/x", https, 443)),
            Verdict::Deny(0)
        );
        assert_eq!(
            p.evaluate(&req(Some("api.example.com"), "api.example.com", "GET", "/v1/chat", https, 443)),
            Verdict::Allow(1)
        );
        assert_eq!(
            p.evaluate(&req(Some("api.example.com"), "api.example.com", "post", "/v1/", https, 443)),
            Verdict::Allow(1)
        );
        assert_eq!(
            p.evaluate(&req(Some("api.example.com"), "api.example.com", "DELETE", "/v1/x", https, 443)),
            Verdict::NoMatch
        );
        assert_eq!(
            p.evaluate(&req(Some("api.example.com"), "api.example.com", "GET", "/v2/x", https, 443)),
            Verdict::NoMatch
        );
        // Host port is ignored, case-insensitive.
        assert_eq!(
            p.evaluate(&req(None, "EXACT.example.org:8080", "GET", "/ping", Scheme::Http, 80)),
            Verdict::Allow(2)
        );
        assert_eq!(p.evaluate(&req(None, "exact.example.org", "GET", "/ping/", Scheme::Http, 80)), Verdict::NoMatch);
    }

    #[test]
    fn wildcard_is_subdomain_only_any_depth() {
        let p = pol(BASIC);
        let q = |sni| req(Some(sni), "x", "GET", "/v1/a", Scheme::Https, 443);
        assert_eq!(p.evaluate(&q("a.b.example.com")), Verdict::Allow(1));
        assert_eq!(p.evaluate(&q("A.EXAMPLE.COM.")), Verdict::Allow(1));
        assert_eq!(p.evaluate(&q("example.com")), Verdict::NoMatch);
        assert_eq!(p.evaluate(&q("badexample.com")), Verdict::NoMatch);
        // No SNI never matches a rule that requires one.
        assert_eq!(p.evaluate(&req(None, "a.example.com", "GET", "/v1/a", Scheme::Https, 443)), Verdict::NoMatch);
    }

    #[test]
    fn ports_and_schemes() {
        let p = pol(r#"{"policy_id":"p","rules":[
            {"id":"deny-http","match":{"scheme":"http"},"action":{"allow":false}},
            {"id":"alt","match":{"host":"a.test","scheme":" HTTPS ","port":[8443,9443]},"action":{"allow":true}},
            {"id":"default","match":{"host":"b.test"},"action":{"allow":true}}
        ]}"#);
        let r = |h, sc, port| p.evaluate(&req((sc == Scheme::Https).then_some(h), h, "GET", "/", sc, port));
        assert_eq!(r("b.test", Scheme::Http, 8081), Verdict::Deny(0));
        assert_eq!(r("a.test", Scheme::Https, 9443), Verdict::Allow(1));
        assert_eq!(r("a.test", Scheme::Https, 443), Verdict::NoMatch);
        assert_eq!(r("b.test", Scheme::Https, 443), Verdict::Allow(2));
        assert_eq!(r("b.test", Scheme::Https, 8443), Verdict::NoMatch);
        assert_eq!(p.spec.rules[1].matcher.scheme.as_deref(), Some("https"));
    }

    #[test]
    fn deny_without_port_matches_any_port() {
        let p = pol(r#"{"policy_id":"p","rules":[{"id":"d","match":{"host":"x.test"},"action":{"allow":false}},
            {"id":"a","match":{},"action":{"allow":true}}]}"#);
        assert_eq!(p.evaluate(&req(None, "x.test", "GET", "/", Scheme::Https, 7777)), Verdict::Deny(0));
        assert_eq!(p.evaluate(&req(None, "y.test", "GET", "/", Scheme::Https, 443)), Verdict::Allow(1));
        assert_eq!(p.evaluate(&req(None, "y.test", "GET", "/", Scheme::Https, 7777)), Verdict::NoMatch);
    }

    #[test]
    fn sni_admission_before_minting() {
        let p = pol(BASIC);
        assert_eq!(p.admit_sni(Some("api.example.com"), DST, 443), SniAdmission::Mint);
        // The host-only rule (`exact`) admits its own name only (E13), not any SNI.
        assert_eq!(p.admit_sni(Some("exact.example.org"), DST, 443), SniAdmission::Mint);
        assert_eq!(p.admit_sni(Some("evil.test"), DST, 443), SniAdmission::Refuse);
        assert_eq!(p.admit_sni(Some("api.example.com"), DST, 8443), SniAdmission::Refuse);
        let strict = pol(r#"{"policy_id":"p","rules":[
            {"id":"block","match":{"sni":"blocked.example.com"},"action":{"allow":false}},
            {"id":"api","match":{"sni":"*.example.com"},"action":{"allow":true}}]}"#);
        assert_eq!(strict.admit_sni(Some("blocked.example.com"), DST, 443), SniAdmission::Refuse);
        assert_eq!(strict.admit_sni(Some("ok.example.com"), DST, 443), SniAdmission::Mint);
        assert_eq!(strict.admit_sni(Some("evil.test"), DST, 443), SniAdmission::Refuse);
        assert_eq!(strict.admit_sni(None, DST, 443), SniAdmission::Refuse);
        // A rule with neither sni nor host allows every name, as it allows every request.
        let open = pol(r#"{"policy_id":"p","rules":[{"id":"all","match":{"path":"/v1/*"},"action":{"allow":true}}]}"#);
        assert_eq!(open.admit_sni(Some("anything.test"), DST, 443), SniAdmission::Mint);
    }

    /// Attack: a host-only allow rule must not admit the random SNIs a sandbox picks (the
    /// gateway would mint a leaf for each and connect to the IP the sandbox chose).
    #[test]
    fn host_only_rule_admits_only_its_name() {
        let p = pol(
            r#"{"policy_id":"p","rules":[{"id":"web","match":{"host":"api.example.test"},"action":{"allow":true}}]}"#,
        );
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut minted = 0;
        for _ in 0..100 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let sni = format!("r{:x}.example.net", seed);
            if p.admit_sni(Some(&sni), DST, 443) == SniAdmission::Mint {
                minted += 1;
            }
        }
        assert_eq!(minted, 0, "random SNIs admitted by a host-only rule");
        assert_eq!(p.admit_sni(Some("API.example.test."), DST, 443), SniAdmission::Mint);
        // No SNI: the connection's name is the destination IP, which is not the host.
        assert_eq!(p.admit_sni(None, DST, 443), SniAdmission::Refuse);
        let by_ip =
            pol(r#"{"policy_id":"p","rules":[{"id":"ip","match":{"host":"203.0.113.7"},"action":{"allow":true}}]}"#);
        assert_eq!(by_ip.admit_sni(None, DST, 443), SniAdmission::Mint);
        // Domain fronting under a host-only rule: SNI of another admitted name, Host of this
        // rule's name — the rule does not match (the upstream leg would use the other SNI).
        let two = pol(r#"{"policy_id":"p","rules":[
            {"id":"web","match":{"host":"api.example.test"},"action":{"allow":true}},
            {"id":"cdn","match":{"sni":"cdn.example.test","path":"/static/*"},"action":{"allow":true}}]}"#);
        let q = req(Some("cdn.example.test"), "api.example.test", "GET", "/v1/x", Scheme::Https, 443);
        assert_eq!(two.evaluate(&q), Verdict::NoMatch);
        let q = req(Some("api.example.test"), "api.example.test", "GET", "/v1/x", Scheme::Https, 443);
        assert_eq!(two.evaluate(&q), Verdict::Allow(0));
        // Plain HTTP has no SNI to bind: the Host decides (the destination check is in the proxy).
        let q = req(None, "api.example.test", "GET", "/v1/x", Scheme::Http, 80);
        assert_eq!(two.evaluate(&q), Verdict::Allow(0));
    }

    #[test]
    fn injection_values_and_fingerprints() {
        let p = pol(BASIC);
        let inj = &p.rules[1].inject[0];
        assert_eq!(inj.header.as_str(), "authorization");
        assert_eq!(inj.value.to_str().unwrap(), "Bearer s3cr3t");
        assert!(inj.value.is_sensitive());
        assert_eq!(inj.fingerprint, fingerprint("s3cr3t"));
        assert!(inj.fingerprint.starts_with("fp-") && inj.fingerprint.len() == 11);
        assert!(!format!("{inj:?}").contains("s3cr3t"));
        assert!(!format!("{:?} {:?}", p.spec, p.rules).contains("s3cr3t"), "Debug output never shows a secret");
        let red = serde_json::to_string(&p.spec.redacted()).unwrap();
        assert!(!red.contains("s3cr3t") && red.contains(REDACTED));
    }

    #[test]
    fn normalisation_is_stored() {
        let p = pol(
            r#"{"policy_id":"p","rules":[{"id":"a","match":{"host":"10.0.0.1/32","sni":"*.Foo.COM."},"action":{"allow":true}}]}"#,
        );
        assert_eq!(p.spec.rules[0].matcher.host.as_deref(), Some("10.0.0.1"));
        assert_eq!(p.spec.rules[0].matcher.sni.as_deref(), Some("*.foo.com"));
    }

    #[test]
    fn validation_errors_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{"policy_id":"","rules":[{"id":"a","action":{"allow":true}}]}"#, "policy_id"),
            (r#"{"policy_id":"p","rules":[]}"#, "rules"),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","action":{"allow":true}},{"id":"a","action":{"allow":true}}]}"#,
                "rules[1].id",
            ),
            (r#"{"policy_id":"p","rules":[{"id":"","action":{"allow":true}}]}"#, "rules[0].id"),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"host":"a b"},"action":{"allow":true}}]}"#,
                "rules[0].match.host",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"host":"10.0.0.0/8"},"action":{"allow":true}}]}"#,
                "rules[0].match.host",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"sni":"10.0.0.256"},"action":{"allow":true}}]}"#,
                "rules[0].match.sni",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"sni":"010.0.0.1"},"action":{"allow":true}}]}"#,
                "rules[0].match.sni",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"sni":"a.*.com"},"action":{"allow":true}}]}"#,
                "rules[0].match.sni",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"path":"v1"},"action":{"allow":true}}]}"#,
                "rules[0].match.path",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"path":"/a*b"},"action":{"allow":true}}]}"#,
                "rules[0].match.path",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"scheme":"ftp"},"action":{"allow":true}}]}"#,
                "rules[0].match.scheme",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"port":443},"action":{"allow":true}}]}"#,
                "rules[0].match.port",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"scheme":"https","port":0},"action":{"allow":true}}]}"#,
                "rules[0].match.port",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"scheme":"https","port":[1,2,3,4,5,6,7,8,9]},"action":{"allow":true}}]}"#,
                "rules[0].match.port",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"method":["G T"]},"action":{"allow":true}}]}"#,
                "rules[0].match.method[0]",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","action":{"allow":true,"audit":"loud"}}]}"#,
                "rules[0].action.audit",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","action":{"allow":true,"inject":[{"header":"","secret":"x"}]}}]}"#,
                "rules[0].action.inject[0].header",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","action":{"allow":true,"inject":[{"header":"X","secret":""}]}}]}"#,
                "rules[0].action.inject[0].secret",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","action":{"allow":true,"inject":[{"header":"X","secret":"a\nb"}]}}]}"#,
                "rules[0].action.inject[0].secret",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","action":{"allow":true,"inject":[{"header":"X","secret":"s","format":"Bearer"}]}}]}"#,
                "rules[0].action.inject[0].format",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","action":{"allow":false,"inject":[{"header":"X","secret":"s"}]}}]}"#,
                "rules[0].action.inject",
            ),
            (
                r#"{"policy_id":"p","rules":[{"id":"a","match":{"hots":"x"},"action":{"allow":true}}]}"#,
                "rules[0].match",
            ),
            (r#"{"policy_id":"p","rules":[{"id":"a","action":{"allow":"yes"}}]}"#, "rules[0].action.allow"),
            (
                r#"{"policy_id":"p","rules":[
                {"id":"a","match":{"host":"x.test","scheme":"http","port":8000},"action":{"allow":true}},
                {"id":"b","match":{"host":"x.test","scheme":"https","port":8000},"action":{"allow":true}}]}"#,
                "rules[1].match.scheme",
            ),
            ("{not json", "body"),
        ];
        for (json, field) in cases {
            let e = err(json);
            assert!(e.field.starts_with(field), "{json}: expected field {field}, got {e}");
        }
        let big = "x".repeat(MAX_SECRET_BYTES + 1);
        let e = err(&format!(
            r#"{{"policy_id":"p","rules":[{{"id":"a","action":{{"allow":true,"inject":[{{"header":"X","secret":"{big}"}}]}}}}]}}"#
        ));
        assert_eq!(e.field, "rules[0].action.inject[0].secret");
        // Errors never echo a secret.
        let e = err(
            r#"{"policy_id":"p","rules":[{"id":"a","action":{"allow":true,"inject":[{"header":"X","secret":"top\nsecret"}]}}]}"#,
        );
        assert!(!e.to_string().contains("top"));
    }

    #[test]
    fn sandbox_ip_parsing() {
        assert_eq!(parse_sandbox_ip("192.168.0.2").unwrap(), Ipv4Addr::new(192, 168, 0, 2));
        for bad in ["192.168.0.02", "192.168.0", "1.2.3.4.5", "256.1.1.1", "a.b.c.d", "", "1..2.3"] {
            assert!(parse_sandbox_ip(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn request_host_normalisation() {
        assert_eq!(normalize_request_host("API.Example.com:443"), "api.example.com");
        assert_eq!(normalize_request_host("example.com."), "example.com");
        assert_eq!(normalize_request_host("[::1]:8080"), "[::1]");
        assert_eq!(normalize_request_host("10.0.0.1"), "10.0.0.1");
    }
}
