//! Destination binding: does the original destination (the IP the sandbox dialled) belong to
//! the name the policy decision was made on (plain-HTTP Host; SNI for credential injection)?
//!
//! A name belongs to an address when it is that IPv4 literal, when the agent told us the
//! sandbox learned it ([`Destinations::set_learned`], admin `PUT /admin/v1/learned/<ip>`), or
//! when the gateway's own resolver ([`crate::dns`]) answered it. Resolver answers are kept per
//! sandbox and name as a union with a TTL floor ([`TTL_FLOOR`]), so round-robin answers that
//! rotate between the sandbox's lookup and ours still match (E14), and what one sandbox's
//! requests made the gateway resolve never answers another's (R83).

use std::{
    collections::{BTreeMap, HashMap},
    net::{Ipv4Addr, SocketAddr},
    sync::{Mutex, RwLock},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::{
    certs::RateLimiter,
    policy::{ValidationError, normalize_request_host, parse_sandbox_ip},
};

/// Resolver answers are kept at least this long (a TTL of 0 would expire before the sandbox
/// connects).
pub const TTL_FLOOR: Duration = Duration::from_secs(60);
/// Resolver answers are kept at most this long.
pub const TTL_CAP: Duration = Duration::from_secs(24 * 3600);
/// A name is not asked again sooner than this after a lookup (a miss answers from the cache).
pub const MIN_REQUERY: Duration = Duration::from_secs(2);
/// Most (sandbox, name) entries in the resolver cache (expired ones are evicted first, then
/// one of the inserting sandbox's own).
pub const MAX_CACHED_NAMES: usize = 10_000;
/// DNS lookups one sandbox may cause per second (burst [`LOOKUP_BURST`]).
pub const LOOKUP_RATE: f64 = 20.0;
/// Burst of DNS lookups per sandbox.
pub const LOOKUP_BURST: u32 = 50;
/// Most learned names per sandbox.
pub const MAX_LEARNED_NAMES: usize = 1024;
/// Most learned addresses per name.
pub const MAX_LEARNED_ADDRS: usize = 32;
/// Default / largest `ttl_secs` of learned addresses.
pub const LEARNED_TTL_DEFAULT: u64 = 3600;
/// Largest accepted `ttl_secs`.
pub const LEARNED_TTL_MAX: u64 = 86_400;

/// How a destination was found to belong to a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// The name is the destination's IPv4 literal.
    Literal,
    /// Learned for this sandbox (agent hook).
    Learned,
    /// Among the gateway resolver's answers.
    Resolved,
}

/// Why a destination does not belong to a name (audit `security.reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unbound {
    /// The resolver answered, and the destination is not among the answers.
    NotAmongAnswers,
    /// No answer could be obtained (timeout, SERVFAIL, no server, lookup budget spent).
    ResolveFailed(String),
}

impl Unbound {
    /// `destination_not_resolved` or `destination_resolve_failed`.
    pub fn reason(&self) -> &'static str {
        match self {
            Unbound::NotAmongAnswers => "destination_not_resolved",
            Unbound::ResolveFailed(_) => "destination_resolve_failed",
        }
    }
}

/// `PUT /admin/v1/learned/<ip>` body: names the sandbox resolved, with their addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnedSpec {
    /// Name → IPv4 addresses (at most [`MAX_LEARNED_NAMES`] names × [`MAX_LEARNED_ADDRS`]).
    /// A name is a host name or `*.<suffix>` ([`normalize_learned_name`]): the addresses then
    /// belong to every subdomain of the suffix, not to the suffix itself.
    pub names: BTreeMap<String, Vec<String>>,
    /// Lifetime of these entries in seconds, 1–86400 (default 3600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
}

/// One learned address of one sandbox with its remaining lifetime (state hand-over, E18).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnedAddr {
    /// The sandbox (mvm IP) that learned it.
    pub sandbox: Ipv4Addr,
    /// Normalised DNS name.
    pub name: String,
    /// The address the name resolved to for that sandbox.
    pub addr: Ipv4Addr,
    /// Remaining lifetime, milliseconds.
    pub ttl_ms: u64,
}

type AddrSet = HashMap<Ipv4Addr, Instant>;

struct Resolved {
    addrs: AddrSet,
    queried: Instant,
}

/// The destination checker: resolver cache plus per-sandbox learned addresses.
pub struct Destinations {
    servers: Vec<SocketAddr>,
    timeout: Duration,
    /// Resolver answers per (sandbox, name): a sandbox never sees what another one's requests
    /// made the gateway resolve (R83).
    resolved: Mutex<HashMap<(Ipv4Addr, String), Resolved>>,
    learned: RwLock<HashMap<Ipv4Addr, HashMap<String, AddrSet>>>,
    lookups: RateLimiter,
}

impl std::fmt::Debug for Destinations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Destinations").field("servers", &self.servers).finish_non_exhaustive()
    }
}

/// A lower-case DNS name without trailing dot, or `None` when it is not a host name.
pub fn normalize_dns_name(raw: &str) -> Option<String> {
    let n = raw.trim().trim_end_matches('.').to_ascii_lowercase();
    let ok = !n.is_empty()
        && n.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    ok.then_some(n)
}

/// A learned name: a host name ([`normalize_dns_name`]) or a wildcard `*.<host name>` that
/// stands for every subdomain of the suffix at any depth, not the suffix itself (the agent's
/// `allow_fqdn` patterns, decision N8). `None` for anything else (a `*` elsewhere, `*.` alone).
pub fn normalize_learned_name(raw: &str) -> Option<String> {
    let t = raw.trim();
    match t.strip_prefix("*.") {
        Some(rest) => normalize_dns_name(rest).map(|n| format!("*.{n}")),
        None => normalize_dns_name(t),
    }
}

/// The wildcard learned names that cover `name` (normalised): `*.b.c` and `*.c` for `a.b.c`.
fn wildcards_of(name: &str) -> impl Iterator<Item = String> + '_ {
    name.match_indices('.').map(move |(i, _)| format!("*.{}", &name[i + 1..]))
}

impl Destinations {
    /// A checker asking `servers` (each at most `timeout` per lookup).
    pub fn new(servers: Vec<SocketAddr>, timeout: Duration) -> Destinations {
        Self::with_lookup_budget(servers, timeout, LOOKUP_RATE, LOOKUP_BURST)
    }

    /// [`Self::new`] with another per-sandbox lookup budget (`rate` per second, `burst`).
    pub(crate) fn with_lookup_budget(
        servers: Vec<SocketAddr>,
        timeout: Duration,
        rate: f64,
        burst: u32,
    ) -> Destinations {
        Destinations {
            servers,
            timeout,
            resolved: Mutex::new(HashMap::new()),
            learned: RwLock::new(HashMap::new()),
            lookups: RateLimiter::new(rate, burst),
        }
    }

    /// The configured DNS servers.
    pub fn servers(&self) -> &[SocketAddr] {
        &self.servers
    }

    /// Whether `dst` belongs to `name` (a Host header or SNI; port and case ignored) for
    /// `sandbox`. May ask the DNS servers (charged to `sandbox`'s lookup budget).
    pub async fn check(&self, sandbox: Ipv4Addr, name: &str, dst: Ipv4Addr) -> Result<Binding, Unbound> {
        let name = normalize_request_host(name);
        if let Ok(ip) = name.parse::<Ipv4Addr>() {
            return if ip == dst { Ok(Binding::Literal) } else { Err(Unbound::NotAmongAnswers) };
        }
        let Some(name) = normalize_dns_name(&name) else { return Err(Unbound::NotAmongAnswers) };
        let now = Instant::now();
        let live = |set: Option<&AddrSet>| set.and_then(|s| s.get(&dst)).is_some_and(|exp| *exp > now);
        {
            let g = self.learned.read().expect("learned lock");
            if let Some(m) = g.get(&sandbox)
                && (live(m.get(&name)) || wildcards_of(&name).any(|w| live(m.get(&w))))
            {
                return Ok(Binding::Learned);
            }
        }
        let key = (sandbox, name);
        {
            let cache = self.resolved.lock().expect("dns cache lock");
            if let Some(r) = cache.get(&key) {
                if live(Some(&r.addrs)) {
                    return Ok(Binding::Resolved);
                }
                if r.queried.elapsed() < MIN_REQUERY {
                    return Err(Unbound::NotAmongAnswers);
                }
            }
        }
        if !self.lookups.take(sandbox) {
            return Err(Unbound::ResolveFailed("DNS lookup budget of the sandbox spent".into()));
        }
        let answers = crate::dns::resolve_a(&self.servers, &key.1, self.timeout)
            .await
            .map_err(|e| Unbound::ResolveFailed(format!("{e:#}")))?;
        let now = Instant::now();
        let mut cache = self.resolved.lock().expect("dns cache lock");
        if !cache.contains_key(&key) && cache.len() >= MAX_CACHED_NAMES {
            cache.retain(|_, r| r.addrs.values().any(|exp| *exp > now));
            // Still full: the sandbox gives up one of its own entries, else any (R62's order).
            let victim = cache.keys().find(|k| k.0 == sandbox).or_else(|| cache.keys().next()).cloned();
            if cache.len() >= MAX_CACHED_NAMES
                && let Some(k) = victim
            {
                cache.remove(&k);
            }
        }
        let entry = cache.entry(key).or_insert_with(|| Resolved { addrs: HashMap::new(), queried: now });
        entry.queried = now;
        entry.addrs.retain(|_, exp| *exp > now);
        for (ip, ttl) in answers {
            let keep = Duration::from_secs(u64::from(ttl)).clamp(TTL_FLOOR, TTL_CAP);
            let exp = entry.addrs.entry(ip).or_insert(now);
            *exp = (*exp).max(now + keep);
        }
        if entry.addrs.contains_key(&dst) { Ok(Binding::Resolved) } else { Err(Unbound::NotAmongAnswers) }
    }

    /// Replaces the learned addresses of `sandbox`. Errors name the field (`names.<name>[i]`).
    pub fn set_learned(&self, sandbox: Ipv4Addr, spec: &LearnedSpec) -> Result<(), ValidationError> {
        let err = |f: String, r: &str| ValidationError { field: f, reason: r.to_string() };
        let ttl = spec.ttl_secs.unwrap_or(LEARNED_TTL_DEFAULT);
        if !(1..=LEARNED_TTL_MAX).contains(&ttl) {
            return Err(err("ttl_secs".into(), "must be 1-86400"));
        }
        if spec.names.len() > MAX_LEARNED_NAMES {
            return Err(err("names".into(), "more than 1024 names"));
        }
        let exp = Instant::now() + Duration::from_secs(ttl);
        let mut m: HashMap<String, AddrSet> = HashMap::new();
        for (raw, addrs) in &spec.names {
            let name = normalize_learned_name(raw)
                .ok_or_else(|| err(format!("names.{raw}"), "invalid host name or *. pattern"))?;
            if addrs.is_empty() || addrs.len() > MAX_LEARNED_ADDRS {
                return Err(err(format!("names.{raw}"), "needs 1-32 addresses"));
            }
            let set = m.entry(name).or_default();
            for (i, a) in addrs.iter().enumerate() {
                let ip = parse_sandbox_ip(a).map_err(|_| err(format!("names.{raw}[{i}]"), "invalid IPv4 address"))?;
                set.insert(ip, exp);
            }
        }
        self.learned.write().expect("learned lock").insert(sandbox, m);
        Ok(())
    }

    /// The live learned addresses of `sandbox` (`None` when nothing was set).
    pub fn learned(&self, sandbox: Ipv4Addr) -> Option<LearnedSpec> {
        let now = Instant::now();
        let g = self.learned.read().expect("learned lock");
        let m = g.get(&sandbox)?;
        let mut names = BTreeMap::new();
        for (n, set) in m {
            let mut v: Vec<Ipv4Addr> = set.iter().filter(|(_, e)| **e > now).map(|(ip, _)| *ip).collect();
            v.sort();
            if !v.is_empty() {
                names.insert(n.clone(), v.iter().map(Ipv4Addr::to_string).collect());
            }
        }
        Some(LearnedSpec { names, ttl_secs: None })
    }

    /// Every live learned address of every sandbox with its remaining lifetime (hand-over to a
    /// successor, E18), sorted by sandbox, name, address.
    pub fn export_learned(&self) -> Vec<LearnedAddr> {
        let now = Instant::now();
        let g = self.learned.read().expect("learned lock");
        let mut v = Vec::new();
        for (sb, m) in g.iter() {
            for (name, set) in m {
                for (ip, e) in set.iter().filter(|(_, e)| **e > now) {
                    let ttl_ms = e.duration_since(now).as_millis() as u64;
                    v.push(LearnedAddr { sandbox: *sb, name: name.clone(), addr: *ip, ttl_ms });
                }
            }
        }
        v.sort_by(|a, b| (a.sandbox, &a.name, a.addr).cmp(&(b.sandbox, &b.name, b.addr)));
        v
    }

    /// Replaces the whole learned table with `entries` (from [`Self::export_learned`] of a
    /// predecessor). Errors: an invalid name, a lifetime over [`LEARNED_TTL_MAX`], or more than
    /// [`MAX_LEARNED_NAMES`] names / [`MAX_LEARNED_ADDRS`] addresses for one sandbox; nothing
    /// changes then.
    pub fn import_learned(&self, entries: &[LearnedAddr]) -> Result<(), ValidationError> {
        let err = |f: String, r: &str| ValidationError { field: f, reason: r.to_string() };
        let now = Instant::now();
        let mut table: HashMap<Ipv4Addr, HashMap<String, AddrSet>> = HashMap::new();
        for (i, e) in entries.iter().enumerate() {
            let name = normalize_learned_name(&e.name)
                .ok_or_else(|| err(format!("learned[{i}].name"), "invalid host name or *. pattern"))?;
            if e.ttl_ms > LEARNED_TTL_MAX * 1000 {
                return Err(err(format!("learned[{i}].ttl_ms"), "longer than 86400 s"));
            }
            let names = table.entry(e.sandbox).or_default();
            if !names.contains_key(&name) && names.len() >= MAX_LEARNED_NAMES {
                return Err(err(format!("learned[{i}]"), "more than 1024 names for one sandbox"));
            }
            let set = names.entry(name).or_default();
            if set.len() >= MAX_LEARNED_ADDRS {
                return Err(err(format!("learned[{i}]"), "more than 32 addresses for one name"));
            }
            set.insert(e.addr, now + Duration::from_millis(e.ttl_ms));
        }
        *self.learned.write().expect("learned lock") = table;
        Ok(())
    }

    /// Forgets everything kept for `sandbox`: its learned names, its resolver answers (its
    /// policy was deleted, R83: the next sandbox on the address must not learn what it resolved)
    /// and its spent lookup budget (R86).
    pub fn forget_sandbox(&self, sandbox: Ipv4Addr) {
        self.clear_learned(sandbox);
        self.resolved.lock().expect("dns cache lock").retain(|k, _| k.0 != sandbox);
        self.lookups.forget(sandbox);
    }

    /// Forgets the learned addresses of `sandbox` (policy deleted, sandbox released).
    pub fn clear_learned(&self, sandbox: Ipv4Addr) {
        self.learned.write().expect("learned lock").remove(&sandbox);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const SB: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
    const DST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

    #[tokio::test]
    async fn literal_learned_and_unresolvable() {
        // No DNS server: only literals and learned names can bind.
        let d = Destinations::new(vec![], Duration::from_millis(100));
        assert_eq!(d.check(SB, "198.51.100.1:80", DST).await, Ok(Binding::Literal));
        assert_eq!(d.check(SB, "198.51.100.9", DST).await, Err(Unbound::NotAmongAnswers));
        assert!(matches!(d.check(SB, "api.example.test", DST).await, Err(Unbound::ResolveFailed(_))));
        let spec: LearnedSpec =
            serde_json::from_str(r#"{"names":{"API.example.test.":["198.51.100.1"]},"ttl_secs":60}"#).unwrap();
        d.set_learned(SB, &spec).unwrap();
        assert_eq!(d.check(SB, "api.example.test:8080", DST).await, Ok(Binding::Learned));
        // Learned for one sandbox only.
        assert!(d.check(Ipv4Addr::new(192, 168, 0, 3), "api.example.test", DST).await.is_err());
        assert_eq!(d.learned(SB).unwrap().names["api.example.test"], vec!["198.51.100.1".to_string()]);
        d.clear_learned(SB);
        assert!(d.check(SB, "api.example.test", DST).await.is_err());
        for (bad, field) in [
            (r#"{"names":{"a b":["1.2.3.4"]}}"#, "names.a b"),
            (r#"{"names":{"a.test":["1.2.3.04"]}}"#, "names.a.test[0]"),
            (r#"{"names":{"a.test":[]}}"#, "names.a.test"),
            (r#"{"names":{},"ttl_secs":0}"#, "ttl_secs"),
            (r#"{"names":{"*":["1.2.3.4"]}}"#, "names.*"),
            (r#"{"names":{"a.*.test":["1.2.3.4"]}}"#, "names.a.*.test"),
            (r#"{"names":{"**.test":["1.2.3.4"]}}"#, "names.**.test"),
            (r#"{"names":{"*.":["1.2.3.4"]}}"#, "names.*."),
        ] {
            let spec: LearnedSpec = serde_json::from_str(bad).unwrap();
            assert_eq!(d.set_learned(SB, &spec).unwrap_err().field, field, "{bad}");
        }
    }

    /// A DNS server on loopback answering every `A` query with 198.51.100.1 (TTL 300); returns
    /// its address and the number of queries it got.
    async fn dns_server() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        use simple_dns::{CLASS, Packet, ResourceRecord, rdata::RData};
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = count.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1500];
            while let Ok((n, from)) = sock.recv_from(&mut buf).await {
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Ok(q) = Packet::parse(&buf[..n]) else { continue };
                let Some(question) = q.questions.first().cloned() else { continue };
                let mut reply = q.into_reply();
                let a = simple_dns::rdata::A { address: u32::from(DST) };
                reply.answers.push(ResourceRecord::new(question.qname.clone(), CLASS::IN, 300, RData::A(a)));
                let _ = sock.send_to(&reply.build_bytes_vec().unwrap(), from).await;
            }
        });
        (addr, count)
    }

    /// Attack (R83): the resolver cache was shared by name, so sandbox B learned whether
    /// another sandbox had made the gateway resolve a name (within the answer's TTL, 60 s to
    /// 24 h): with its lookup budget spent, B's request for a name nobody resolved was refused
    /// `destination_resolve_failed` (no lookup) while one someone else resolved was answered
    /// from the cache, `destination_not_resolved` (the 403 body names the reason). Now each
    /// sandbox has its own answers: both probes answer alike, and B's own lookup is its own.
    #[tokio::test]
    async fn a_sandbox_learns_nothing_from_another_sandboxs_lookups() {
        let (server, queries) = dns_server().await;
        let (a, b) = (SB, Ipv4Addr::new(192, 168, 0, 3));
        let other = Ipv4Addr::new(198, 51, 100, 9);
        // One lookup per sandbox, no refill within the test.
        let d = Destinations::with_lookup_budget(vec![server], Duration::from_secs(2), 0.001, 1);
        assert_eq!(d.check(a, "visited.test", DST).await, Ok(Binding::Resolved));
        assert_eq!(d.check(b, "own.test", DST).await, Ok(Binding::Resolved), "B spends its one lookup");
        let visited = d.check(b, "visited.test", other).await;
        let unvisited = d.check(b, "unvisited.test", other).await;
        assert!(matches!(unvisited, Err(Unbound::ResolveFailed(_))), "{unvisited:?}");
        assert!(
            matches!(visited, Err(Unbound::ResolveFailed(_))),
            "a name another sandbox resolved answers differently from one nobody resolved: {visited:?}"
        );
        assert_eq!(queries.load(std::sync::atomic::Ordering::SeqCst), 2);
        // A's answers still serve A (no new query).
        assert_eq!(d.check(a, "visited.test", DST).await, Ok(Binding::Resolved));
        assert_eq!(queries.load(std::sync::atomic::Ordering::SeqCst), 2);
        // A's policy deleted (Release): the address's next sandbox finds none of A's answers.
        d.forget_sandbox(a);
        // R86: and with a full lookup budget, not the one A spent.
        assert_eq!(d.check(a, "visited.test", DST).await, Ok(Binding::Resolved));
        assert_eq!(queries.load(std::sync::atomic::Ordering::SeqCst), 3, "a new lookup, not A's answer");
    }

    /// A `*.` learned name binds the suffix's subdomains at any depth, never the suffix itself
    /// or a name that merely ends with the same letters, and only for its sandbox.
    #[tokio::test]
    async fn wildcard_learned_names() {
        let d = Destinations::new(vec![], Duration::from_millis(100));
        let spec: LearnedSpec =
            serde_json::from_str(r#"{"names":{"*.CDN.example.test.":["198.51.100.1"]},"ttl_secs":60}"#).unwrap();
        d.set_learned(SB, &spec).unwrap();
        assert_eq!(d.learned(SB).unwrap().names["*.cdn.example.test"], vec!["198.51.100.1".to_string()]);
        assert_eq!(d.check(SB, "a.cdn.example.test", DST).await, Ok(Binding::Learned));
        assert_eq!(d.check(SB, "x.y.cdn.example.test:443", DST).await, Ok(Binding::Learned));
        for miss in ["cdn.example.test", "evilcdn.example.test", "a.cdn.example.test.evil"] {
            assert!(d.check(SB, miss, DST).await.is_err(), "{miss}");
        }
        assert!(d.check(SB, "a.cdn.example.test", Ipv4Addr::new(198, 51, 100, 2)).await.is_err(), "other address");
        assert!(d.check(Ipv4Addr::new(192, 168, 0, 3), "a.cdn.example.test", DST).await.is_err(), "other sandbox");
        // Hand-over keeps the pattern.
        let e = d.export_learned();
        assert_eq!(e[0].name, "*.cdn.example.test");
        let d2 = Destinations::new(vec![], Duration::from_millis(100));
        d2.import_learned(&e).unwrap();
        assert_eq!(d2.check(SB, "a.cdn.example.test", DST).await, Ok(Binding::Learned));
    }
}
