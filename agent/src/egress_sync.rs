//! Pushes each sandbox's L7 rules to the CubeEgress admin API (`reference/upstream.md §4.4`):
//! `PUT /admin/v1/policies/<sandboxIP>` on Ensure and Reconcile, `DELETE` on Release.
//!
//! - Each change bumps a per-IP generation and marks the IP dirty. While the gateway is
//!   believed up, the caller then makes one attempt at once (bounded by
//!   `cube_egress_push_timeout_ms`), so the gateway normally has the policy before Ensure
//!   returns; while it is down the call returns at once and the background loop sends it. A
//!   push that fails transiently (connect error, timeout, 5xx) stays dirty and the loop
//!   retries it with backoff (200 ms doubling to 5 s). A push completes an IP only if its
//!   generation is still current, so a slow stale push can never leave an old policy behind:
//!   the IP stays dirty and the current one is re-sent.
//! - A 4xx is permanent (the gateway refused the body): logged, not retried. The agent
//!   validates rules with the gateway's own validator (`egress_policy`) first, so this only
//!   happens across versions (decision L3: it does not fail Ensure).
//! - The loop polls `GET /admin/v1/health` every second. When the gateway comes back (first
//!   contact, after being unreachable) or its `policy_count` cannot match what the agent knows
//!   (fewer than acknowledged: a restart between two polls; more than acknowledged plus owed:
//!   a policy the agent does not want) it runs a full sync: every live sandbox with rules is
//!   re-sent, and every policy the gateway holds for an address without one (left by a
//!   sandbox released while the agent was down) is deleted, so a reused address never
//!   inherits another sandbox's rules or credentials.
//! - A sandbox without rules that the agent never pushed needs no request (nothing to delete),
//!   except before the first full sync, when the gateway's contents are unknown.
//!
//! - The learned-address feed (decision N8): every poll the loop reads what the datapath
//!   learned for each sandbox with rules ([`Agent::learned_feed`]) and sends
//!   `PUT /admin/v1/learned/<sandboxIP>` `{names: {pattern: [ip]}, ttl_secs}` when the names
//!   or addresses changed or an expiry moved later, `DELETE` when nothing is left, the sandbox
//!   was released or lost its rules ([`EgressSync::forget_learned`]). Same per-address
//!   sequencing, generations, retries and full sync as the policies.
//!
//! - Connections are made from sockets created in `dataplane_netns` when it is set
//!   ([`crate::dataplane_sockets`], decision L9): the gateway's admin address is the
//!   dataplane namespace's, not the agent's.
//!
//! Secrets: bodies are never logged; errors carry the method, path, status and the gateway's
//! error text (which names a field, never a value).

use std::{
    collections::{BTreeMap, HashMap},
    net::Ipv4Addr,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use egress_policy::PolicySpec;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, body::Bytes};
use hyper_util::rt::TokioIo;

use crate::{agent::Agent, metrics::Metrics};

/// Parses the admin base URL: `http://host:port` (no path, query or TLS). Returns the
/// `host:port` authority.
pub fn parse_admin_url(url: &str) -> Result<String, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("{url:?}: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("{url:?}: only http:// is supported"));
    }
    let auth = uri.authority().ok_or_else(|| format!("{url:?}: no host"))?;
    if auth.port_u16().is_none() {
        return Err(format!("{url:?}: a port is required"));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(format!("{url:?}: no path or query allowed"));
    }
    Ok(auth.as_str().to_string())
}

/// `text` (a gateway error, logged) with every secret of `spec` replaced by `***`: the
/// gateway's errors name fields, but a parser's message may quote a value.
fn scrub(text: &str, spec: Option<&PolicySpec>) -> String {
    let mut out = text.to_string();
    for r in spec.map(|s| s.rules.as_slice()).unwrap_or_default() {
        for i in r.action.inject.iter().flatten().filter(|i| !i.secret.is_empty()) {
            out = out.replace(&i.secret, "***");
        }
    }
    out
}

/// Outcome of one push.
#[derive(Debug, PartialEq, Eq)]
enum Push {
    Done,
    /// Retry later (connect error, timeout, 5xx).
    Transient(String),
    /// The gateway refused it (4xx): do not retry.
    Permanent(String),
}

impl Push {
    /// The `result` label of the push counters: `ok`, `retry` or `refused`.
    fn label(&self) -> &'static str {
        match self {
            Push::Done => "ok",
            Push::Transient(_) => "retry",
            Push::Permanent(_) => "refused",
        }
    }

    /// Classifies the gateway's answer to `method path`: 2xx (or 404 to a DELETE: deleting
    /// what is not there is done) is done, another 4xx permanent (with the gateway's error
    /// text, scrubbed of the secrets of `spec`), anything else transient.
    fn of(method: &Method, path: &str, answer: Result<(u16, Bytes), String>, spec: Option<&PolicySpec>) -> Push {
        match answer {
            Ok((s, _)) if (200..300).contains(&s) => Push::Done,
            Ok((404, _)) if method == Method::DELETE => Push::Done,
            Ok((s, b)) if (400..500).contains(&s) => {
                let text = scrub(String::from_utf8_lossy(&b).trim(), spec);
                Push::Permanent(format!("{method} {path}: {s} {text}"))
            }
            Ok((s, _)) => Push::Transient(format!("{method} {path}: {s}")),
            Err(e) => Push::Transient(format!("{method} {path}: {e}")),
        }
    }
}

/// What a push carries: a sandbox's policy or its learned-address feed. Picks the counter
/// and the words of the logs.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Policy,
    Learned,
}

impl Kind {
    /// `cubenet_egress_push_total` or `cubenet_egress_learned_push_total`.
    fn counter(self, m: &Metrics) -> &prometheus::IntCounterVec {
        match self {
            Kind::Policy => &m.egress_push,
            Kind::Learned => &m.egress_learned_push,
        }
    }

    /// What is pushed, for logs.
    fn what(self) -> &'static str {
        match self {
            Kind::Policy => "policy",
            Kind::Learned => "learned feed",
        }
    }
}

/// Wanted gateway state of one sandbox address (`T`: a [`PolicySpec`] or a [`Fed`]).
#[derive(Debug)]
struct Slot<T> {
    /// Bumped by every change.
    generation: u64,
    /// `Some` = PUT this, `None` = DELETE.
    desired: Option<T>,
    dirty: bool,
    /// The gateway acknowledged the current `Some` state (a 2xx for this generation). Read
    /// for policies only (`count_mismatch`).
    acked: bool,
    /// A request for this address is on the wire: nobody else sends one (requests for one
    /// address are strictly sequential, so the gateway applies them in generation order).
    in_flight: bool,
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self { generation: 0, desired: None, dirty: false, acked: false, in_flight: false }
    }
}

impl<T> Slot<T> {
    /// Records a change: `desired` is owed to the gateway (a new generation).
    fn want(&mut self, desired: Option<T>) {
        self.generation += 1;
        self.desired = desired;
        self.dirty = true;
        self.acked = false;
    }
}

/// Claims `ip` of `m` for one request: its generation and wanted state, unless it is clean
/// or already in flight.
fn begin_in<T: Clone>(m: &mut HashMap<Ipv4Addr, Slot<T>>, ip: Ipv4Addr) -> Option<(u64, Option<T>)> {
    let e = m.get_mut(&ip).filter(|e| e.dirty && !e.in_flight)?;
    e.in_flight = true;
    Some((e.generation, e.desired.clone()))
}

/// `m` locked; a poisoned lock is taken as it is (every update leaves a consistent entry).
fn guard<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Policy state of one sandbox address.
type Entry = Slot<PolicySpec>;

/// Most addresses fed per name: the gateway's `MAX_LEARNED_ADDRS` (the ones expiring last
/// are kept). A sandbox has at most `cubevs::policy::MAX_FQDN_PER_SANDBOX` (32) names, far
/// under the gateway's `MAX_LEARNED_NAMES` (1024).
pub const MAX_FEED_ADDRS: usize = 32;

/// What one sandbox address is fed: pattern → addresses, and the latest expiry (ns).
type Fed = (BTreeMap<String, Vec<Ipv4Addr>>, u64);

/// Learned-feed state of one sandbox address (`desired`: names and latest expiry).
type FeedEntry = Slot<Fed>;

/// `PUT /admin/v1/learned/<ip>` body (the gateway's `LearnedSpec`).
#[derive(Debug, serde::Serialize)]
struct LearnedBody<'a> {
    names: BTreeMap<&'a str, Vec<String>>,
    ttl_secs: u64,
}

/// Largest CubeEgress `/metrics` body the agent relays (1 MiB; the gateway's is a few KiB:
/// its metrics carry no per-sandbox labels). O26.
pub const MAX_METRICS_BODY: usize = 1 << 20;

/// Why [`EgressSync::send`] got no response.
#[derive(Debug)]
enum SendError {
    /// No connection to the admin address.
    Connect(String),
    /// Connected, but the HTTP exchange failed.
    Http(String),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(e) | SendError::Http(e) => f.write_str(e),
        }
    }
}

/// A failed relay of the gateway's `/metrics` ([`EgressSync::fetch_metrics`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeError {
    /// The status the agent answers: 503 (gateway unreachable or silent), 502 (it answered
    /// something the agent does not relay).
    pub status: u16,
    /// `reason` label of `cubenet_egress_scrape_errors_total` ([`crate::metrics::SCRAPE_ERRORS`]).
    pub reason: &'static str,
    /// One line for the scraper and the log.
    pub detail: String,
}

impl ScrapeError {
    fn new(status: u16, reason: &'static str, detail: String) -> Self {
        Self { status, reason, detail: detail.replace('\n', " ") }
    }
}

/// The push client and its pending work.
#[derive(Debug)]
pub struct EgressSync {
    authority: String,
    /// Where connections are made (the dataplane namespace, or the agent's own).
    sockets: crate::dataplane_sockets::DataplaneSockets,
    timeout: Duration,
    /// Wanted gateway state per sandbox IP. Lock order: this lock, then the agent's state.
    entries: Mutex<HashMap<Ipv4Addr, Entry>>,
    /// Learned-feed state per sandbox IP. Lock order: this lock, then the agent's state.
    feed: Mutex<HashMap<Ipv4Addr, FeedEntry>>,
    /// The last health poll succeeded (callers skip the immediate attempt when false).
    up: AtomicBool,
    /// A full sync has completed since start (before that, deletes are never skipped).
    synced: AtomicBool,
    wake: tokio::sync::Notify,
    rt: tokio::runtime::Handle,
    metrics: Metrics,
}

/// The gateway body of a sandbox: `{policy_id: "<ip>", rules}` (upstream's Cubelet sets
/// policy_id = sandbox IP). `None` when it has no rules (no L7 policy: DELETE).
pub fn policy_spec(ip: Ipv4Addr, rules: &[egress_policy::RuleSpec]) -> Option<PolicySpec> {
    (!rules.is_empty()).then(|| PolicySpec { policy_id: ip.to_string(), rules: rules.to_vec() })
}

impl EgressSync {
    /// A client of `admin_url` (validated by [`parse_admin_url`]); `rt` runs the pushes;
    /// `metrics` gets `cubenet_egress_{push_total,pending,up}`.
    pub fn new(
        admin_url: &str,
        timeout: Duration,
        rt: tokio::runtime::Handle,
        metrics: Metrics,
    ) -> Result<Arc<Self>, String> {
        Self::new_in(admin_url, timeout, rt, metrics, crate::dataplane_sockets::DataplaneSockets::local())
    }

    /// [`Self::new`] connecting from sockets made by `sockets` (in `dataplane_netns`).
    pub fn new_in(
        admin_url: &str,
        timeout: Duration,
        rt: tokio::runtime::Handle,
        metrics: Metrics,
        sockets: crate::dataplane_sockets::DataplaneSockets,
    ) -> Result<Arc<Self>, String> {
        Ok(Arc::new(Self {
            authority: parse_admin_url(admin_url)?,
            sockets,
            timeout,
            entries: Mutex::new(HashMap::new()),
            feed: Mutex::new(HashMap::new()),
            up: AtomicBool::new(false),
            synced: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
            rt,
            metrics,
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Ipv4Addr, Entry>> {
        guard(&self.entries)
    }

    fn feed_lock(&self) -> std::sync::MutexGuard<'_, HashMap<Ipv4Addr, FeedEntry>> {
        guard(&self.feed)
    }

    /// One request per dirty address of `table` (a [`Kind`]'s) not already in flight, made by
    /// `send` from the address and its wanted state; true when one failed transiently.
    async fn push_table<T: Clone, F: Future<Output = Push>>(
        &self,
        kind: Kind,
        table: &Mutex<HashMap<Ipv4Addr, Slot<T>>>,
        send: impl Fn(Ipv4Addr, Option<T>) -> F,
    ) -> bool {
        let mut failed = false;
        let work: Vec<Ipv4Addr> = guard(table).iter().filter(|(_, e)| e.dirty).map(|(ip, _)| *ip).collect();
        for ip in work {
            let Some((generation, desired)) = begin_in(&mut guard(table), ip) else { continue };
            let r = send(ip, desired).await;
            failed |= matches!(r, Push::Transient(_));
            self.complete(kind, &mut guard(table), ip, generation, r);
        }
        failed
    }

    /// Stops feeding `ip` (Release, rules removed): a DELETE of its learned names is owed
    /// unless nothing was ever fed. Does not block.
    pub fn forget_learned(&self, ip: Ipv4Addr) {
        let mut f = self.feed_lock();
        if let Some(e) = f.get_mut(&ip)
            && e.desired.is_some()
        {
            e.want(None);
            self.wake.notify_one();
        }
    }

    /// Compares what the datapath learned now (`wanted`, from [`Agent::learned_feed`]) with
    /// what was fed and marks the differences: new or changed names/addresses, or an expiry
    /// more than a second later (a renewal), are PUT; addresses with nothing left DELETEd.
    fn mark_feed(&self, f: &mut HashMap<Ipv4Addr, FeedEntry>, wanted: Vec<(Ipv4Addr, cubevs::policy::LearnedNames)>) {
        let mut seen = std::collections::HashSet::new();
        for (ip, n) in wanted {
            seen.insert(ip);
            let e = f.entry(ip).or_default();
            let changed = match &e.desired {
                Some((names, exp)) => *names != n.names || n.expires_ns > exp.saturating_add(1_000_000_000),
                None => true,
            };
            if changed {
                e.want(Some((n.names, n.expires_ns)));
            }
        }
        for (ip, e) in f.iter_mut() {
            if !seen.contains(ip) && e.desired.is_some() {
                e.want(None);
            }
        }
    }

    /// Reads the datapath's learned entries and marks what changed (a blocking thread: it
    /// walks `dns_learned`). Holds the feed lock while reading the agent's state, so a
    /// [`Self::forget_learned`] is never overwritten by an older snapshot.
    async fn refresh_feed(self: &Arc<Self>, agent: &Arc<Agent>) {
        let (me, a) = (self.clone(), agent.clone());
        let _ = tokio::task::spawn_blocking(move || {
            let mut f = me.feed_lock();
            let wanted = a.learned_feed();
            me.mark_feed(&mut f, wanted);
        })
        .await;
    }

    /// Full sync of the feed: every address fed (or owed a DELETE) is sent again.
    fn mark_feed_full_sync(&self) {
        for e in self.feed_lock().values_mut() {
            e.generation += 1;
            e.dirty = true;
        }
    }

    async fn push_learned(&self, ip: Ipv4Addr, desired: Option<&Fed>) -> Push {
        let path = format!("/admin/v1/learned/{ip}");
        let (method, body) = match desired {
            Some((names, expires_ns)) => {
                let left = expires_ns.saturating_sub(cubevs::reaper::monotonic_ns());
                let body = LearnedBody {
                    names: names
                        .iter()
                        .map(|(n, ips)| (n.as_str(), ips.iter().map(Ipv4Addr::to_string).collect()))
                        .collect(),
                    ttl_secs: left.div_ceil(1_000_000_000).clamp(1, 86_400),
                };
                match serde_json::to_vec(&body) {
                    Ok(b) => (Method::PUT, b),
                    Err(e) => return Push::Permanent(format!("encode: {e}")),
                }
            }
            None => (Method::DELETE, Vec::new()),
        };
        Push::of(&method, &path, self.request(method.clone(), &path, body).await, None)
    }

    /// One feed request per dirty address not already in flight; true when one failed
    /// transiently.
    async fn push_feed_dirty(&self) -> bool {
        self.push_table(Kind::Learned, &self.feed, |ip, d| async move { self.push_learned(ip, d.as_ref()).await }).await
    }

    /// Addresses whose gateway copy is not (yet) what the agent wants.
    pub fn pending(&self) -> usize {
        self.lock().values().filter(|e| e.dirty).count()
    }

    /// Records the wanted state of `ip` (`None` = no policy) and, while the gateway is up,
    /// makes one attempt now. Blocks up to the push timeout; call from a blocking thread,
    /// never a tokio worker. Failures are left to the background loop.
    pub fn set_blocking(&self, ip: Ipv4Addr, desired: Option<PolicySpec>) {
        {
            let mut m = self.lock();
            if desired.is_none() && !m.contains_key(&ip) && self.synced.load(Ordering::Acquire) {
                // Never pushed and the gateway was cleaned by a full sync: nothing to delete.
                return;
            }
            m.entry(ip).or_default().want(desired);
        }
        if !self.up.load(Ordering::Acquire) {
            // Down (or not contacted yet): the loop sends it on the gateway's return.
            self.wake.notify_one();
            return;
        }
        // Another request for this address in flight: its completion sees the new
        // generation and the loop sends this one.
        let claimed = begin_in(&mut self.lock(), ip);
        if let Some((generation, desired)) = claimed {
            let r = self.rt.block_on(self.push(ip, desired.as_ref()));
            self.complete(Kind::Policy, &mut self.lock(), ip, generation, r);
        }
    }

    /// Full sync: every sandbox of the agent with rules is marked for a PUT, every address
    /// the gateway holds (`on_gateway`) without one for a DELETE. The agent's state is read
    /// under this client's lock, so a Release or Ensure running meanwhile records its own
    /// change after this one (generation order) and is never overwritten by the snapshot.
    fn mark_full_sync(&self, agent: &Agent, on_gateway: &[Ipv4Addr]) -> usize {
        let mut m = self.lock();
        let want: HashMap<Ipv4Addr, PolicySpec> = agent.egress_policies().into_iter().collect();
        let n = want.len();
        for ip in on_gateway.iter().filter(|ip| !want.contains_key(ip)) {
            m.entry(*ip).or_default().want(None);
        }
        for (ip, spec) in want {
            m.entry(ip).or_default().want(Some(spec));
        }
        n
    }

    /// Ends the request for `ip` of `m` (a [`Kind`] table, locked by the caller) started at
    /// `generation`: counts it, and marks the address clean unless it changed meanwhile or the
    /// push failed transiently (then the loop is woken to send it again). A completed DELETE
    /// forgets the address.
    fn complete<T>(&self, kind: Kind, m: &mut HashMap<Ipv4Addr, Slot<T>>, ip: Ipv4Addr, generation: u64, r: Push) {
        kind.counter(&self.metrics).with_label_values(&[r.label()]).inc();
        let Some(e) = m.get_mut(&ip) else { return };
        e.in_flight = false;
        if e.generation != generation {
            // Changed meanwhile: the current state still has to go out.
            self.wake.notify_one();
            return;
        }
        match r {
            Push::Done => {
                e.dirty = false;
                e.acked = e.desired.is_some();
                if e.desired.is_none() {
                    m.remove(&ip);
                }
            }
            Push::Permanent(why) => {
                tracing::error!(sandbox_ip = %ip, "cube-egress refused the {} (not retried): {why}", kind.what());
                e.dirty = false;
            }
            Push::Transient(why) => {
                tracing::warn!(sandbox_ip = %ip, "cube-egress {} push failed, retrying in the background: {why}", kind.what());
                self.wake.notify_one();
            }
        }
    }

    /// Sends one request to the gateway on a fresh connection from the dataplane namespace
    /// and returns its response head (the body still to read). Not bounded in time: callers
    /// wrap it and the body's read in one `self.timeout`.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Vec<u8>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, SendError> {
        let stream = self.sockets.connect(&self.authority).await.map_err(|e| SendError::Connect(e.to_string()))?;
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| SendError::Http(e.to_string()))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.authority)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| SendError::Http(e.to_string()))?;
        tx.send_request(req).await.map_err(|e| SendError::Http(e.to_string()))
    }

    async fn request(&self, method: Method, path: &str, body: Vec<u8>) -> Result<(u16, Bytes), String> {
        let fut = async {
            let resp = self.send(method, path, body).await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
            Ok::<_, String>((status, body))
        };
        tokio::time::timeout(self.timeout, fut).await.map_err(|_| format!("timed out after {:?}", self.timeout))?
    }

    /// The gateway's Prometheus text (`GET /metrics` on its admin address), for the agent's
    /// `GET /metrics/cube-egress` (O26): its content type and body. Bounded: the whole
    /// exchange by `cube_egress_push_timeout_ms`, the body by [`MAX_METRICS_BODY`] (a
    /// larger one is refused as soon as its length is known or its read passes the limit,
    /// so the agent never holds more than the limit and one read buffer).
    pub async fn fetch_metrics(&self) -> Result<(Option<String>, Bytes), ScrapeError> {
        let fut = async {
            let resp = self.send(Method::GET, "/metrics", Vec::new()).await.map_err(|e| match e {
                SendError::Connect(e) => ScrapeError::new(503, "unreachable", format!("connect: {e}")),
                SendError::Http(e) => ScrapeError::new(502, "unreachable", e),
            })?;
            if resp.status() != hyper::StatusCode::OK {
                return Err(ScrapeError::new(502, "status", format!("answered {}", resp.status())));
            }
            let too_large = || ScrapeError::new(502, "too_large", format!("body over {MAX_METRICS_BODY} bytes"));
            if hyper::body::Body::size_hint(resp.body()).lower() > MAX_METRICS_BODY as u64 {
                return Err(too_large());
            }
            let ctype = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_string);
            let body =
                http_body_util::Limited::new(resp.into_body(), MAX_METRICS_BODY).collect().await.map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        too_large()
                    } else {
                        ScrapeError::new(502, "unreachable", format!("body: {e}"))
                    }
                })?;
            Ok((ctype, body.to_bytes()))
        };
        tokio::time::timeout(self.timeout, fut).await.map_err(|_| {
            ScrapeError::new(503, "timeout", format!("no answer within {} ms", self.timeout.as_millis()))
        })?
    }

    async fn push(&self, ip: Ipv4Addr, desired: Option<&PolicySpec>) -> Push {
        let path = format!("/admin/v1/policies/{ip}");
        let (method, body) = match desired {
            Some(spec) => match serde_json::to_vec(spec) {
                Ok(b) => (Method::PUT, b),
                Err(e) => return Push::Permanent(format!("encode: {e}")),
            },
            None => (Method::DELETE, Vec::new()),
        };
        Push::of(&method, &path, self.request(method.clone(), &path, body).await, desired)
    }

    /// The gateway's `policy_count` when its health endpoint answers 200.
    async fn health(&self) -> Option<u64> {
        match self.request(Method::GET, "/admin/v1/health", Vec::new()).await {
            Ok((200, b)) => serde_json::from_slice::<serde_json::Value>(&b).ok()?["policy_count"].as_u64(),
            _ => None,
        }
    }

    /// The addresses the gateway holds a policy for (`GET /admin/v1/policies`, redacted).
    async fn gateway_addresses(&self) -> Result<Vec<Ipv4Addr>, String> {
        let (s, b) = self.request(Method::GET, "/admin/v1/policies", Vec::new()).await?;
        if s != 200 {
            return Err(format!("GET /admin/v1/policies: {s}"));
        }
        let v: serde_json::Value = serde_json::from_slice(&b).map_err(|e| format!("GET /admin/v1/policies: {e}"))?;
        let map = v.as_object().ok_or("GET /admin/v1/policies: not an object")?;
        Ok(map.keys().filter_map(|k| k.parse().ok()).collect())
    }

    /// One request per dirty address not already in flight; true when one failed transiently.
    async fn push_dirty(&self) -> bool {
        self.push_table(Kind::Policy, &self.entries, |ip, d| async move { self.push(ip, d.as_ref()).await }).await
    }

    /// Whether the gateway's `policy_count` proves its contents differ from what the agent
    /// knows: fewer than acknowledged (it lost some: a restart between two polls), or more
    /// than acknowledged plus every address with a request owed (it holds one the agent does
    /// not want: e.g. a PUT that timed out here and was applied after a newer DELETE).
    fn count_mismatch(&self, count: u64) -> bool {
        let m = self.lock();
        let acked = m.values().filter(|e| e.acked).count() as u64;
        let owed = m.values().filter(|e| e.dirty).count() as u64;
        count < acked || count > acked + owed
    }

    /// The background loop: health poll, full sync when the gateway (re)appears, retries of
    /// dirty IPs with backoff. Ends when the agent is dropped.
    pub async fn run(self: Arc<Self>, agent: Weak<Agent>) {
        let mut backoff = Duration::from_millis(200);
        loop {
            let Some(a) = agent.upgrade() else { return };
            let was_up = self.up.load(Ordering::Acquire);
            let mut up = false;
            if let Some(count) = self.health().await {
                let mismatch = self.count_mismatch(count);
                if !was_up || mismatch {
                    match self.gateway_addresses().await {
                        Ok(held) => {
                            let n = self.mark_full_sync(&a, &held);
                            self.mark_feed_full_sync();
                            tracing::info!(gateway = %self.authority, sandboxes = n, gateway_held = held.len(), mismatch, "cube-egress reachable: full policy sync");
                            up = true;
                        }
                        Err(e) => tracing::warn!(gateway = %self.authority, "cube-egress full sync: {e}"),
                    }
                } else {
                    up = true;
                }
            }
            if was_up && !up {
                tracing::warn!(gateway = %self.authority, "cube-egress unreachable");
            }
            drop(a);
            let mut failed = false;
            if up {
                failed = self.push_dirty().await;
                if !failed {
                    self.synced.store(true, Ordering::Release);
                }
            }
            if up {
                // After the policies: the feed of a new sandbox lands after its rules.
                if let Some(a) = agent.upgrade() {
                    self.refresh_feed(&a).await;
                }
                failed |= self.push_feed_dirty().await;
            }
            // Published after the sync's pushes: a caller that sees `up` pushes on top of them.
            self.up.store(up, Ordering::Release);
            self.metrics.egress_up.set(i64::from(up));
            self.metrics.egress_pending.set(self.pending() as i64);
            let pause = if failed || (!up && self.lock().values().any(|e| e.dirty)) {
                let p = backoff;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                p
            } else {
                backoff = Duration::from_millis(200);
                Duration::from_secs(1)
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.wake.notified(), if up && !failed => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    /// A fake admin API: records each PUT/DELETE when its handler finishes; a PUT whose body
    /// contains `slow` takes 400 ms first, one containing `refuse` gets a 400 (not recorded).
    async fn fake_gateway() -> (String, Arc<Mutex<Vec<(String, String)>>>) {
        let applied: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let log = applied.clone();
        tokio::spawn(async move {
            loop {
                let (s, _) = l.accept().await.unwrap();
                let log = log.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let log = log.clone();
                        async move {
                            let m = req.method().to_string();
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let b = String::from_utf8_lossy(&body).into_owned();
                            if b.contains("slow") {
                                tokio::time::sleep(Duration::from_millis(400)).await;
                            }
                            if b.contains("refuse") {
                                let mut r = hyper::Response::new(Full::new(Bytes::from_static(b"{\"error\":\"x\"}")));
                                *r.status_mut() = hyper::StatusCode::BAD_REQUEST;
                                return Ok::<_, Infallible>(r);
                            }
                            log.lock().unwrap().push((m, b));
                            Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(b"{}"))))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
                });
            }
        });
        (url, applied)
    }

    fn spec(id: &str) -> PolicySpec {
        serde_json::from_value(serde_json::json!({"policy_id": "p", "rules": [{"id": id, "action": {"allow": true}}]}))
            .unwrap()
    }

    /// A change made while a request for the same address is on the wire is sent after it,
    /// never beside it: the gateway ends with the newest state (here: deleted), even though
    /// the older request is the slower one.
    #[test]
    fn requests_for_one_address_are_sequential() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (url, applied) = rt.block_on(fake_gateway());
        let sync = EgressSync::new(&url, Duration::from_secs(5), rt.handle().clone(), Metrics::new()).unwrap();
        sync.up.store(true, Ordering::Release);
        let ip: Ipv4Addr = "192.168.0.2".parse().unwrap();
        let s2 = sync.clone();
        let slow = std::thread::spawn(move || s2.set_blocking(ip, Some(spec("slow"))));
        // The PUT is claimed (in flight) before it is sent: from then on the delete must wait.
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while !sync.lock().get(&ip).is_some_and(|e| e.in_flight) {
            assert!(std::time::Instant::now() < end, "the PUT never started");
            std::thread::sleep(Duration::from_millis(1));
        }
        sync.set_blocking(ip, None);
        // The gateway records the slow PUT 400 ms after it arrived: nothing yet means the
        // delete neither waited for it nor went beside it.
        assert!(applied.lock().unwrap().is_empty(), "waited for the request in flight");
        slow.join().unwrap();
        assert_eq!(sync.pending(), 1, "the delete is still owed");
        assert!(!rt.block_on(sync.push_dirty()));
        let log = applied.lock().unwrap().clone();
        let methods: Vec<&str> = log.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(methods, ["PUT", "DELETE"], "{log:?}");
        assert_eq!(sync.pending(), 0);
        assert!(sync.lock().is_empty(), "a completed delete forgets the address");
    }

    #[test]
    fn gateway_errors_are_scrubbed_of_secrets() {
        let spec: PolicySpec = serde_json::from_value(serde_json::json!({"policy_id": "p", "rules": [{"id": "r",
            "action": {"allow": true, "inject": [{"header": "X-K", "secret": "hunter2-secret"}]}}]}))
        .unwrap();
        let t = scrub(r#"{"error":"rules[0]: invalid value \"hunter2-secret\""}"#, Some(&spec));
        assert!(!t.contains("hunter2") && t.contains("rules[0]"), "{t}");
        assert_eq!(scrub("plain", None), "plain");
    }

    /// A refused policy is not retried and does not count as held by the gateway (no full
    /// sync every poll); the counts that do prove a difference are recognised.
    #[test]
    fn refused_is_final_and_counts_are_exact() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let (url, applied) = rt.block_on(fake_gateway());
        let sync = EgressSync::new(&url, Duration::from_secs(5), rt.handle().clone(), Metrics::new()).unwrap();
        sync.up.store(true, Ordering::Release);
        sync.set_blocking("192.168.0.5".parse().unwrap(), Some(spec("refuse")));
        assert_eq!(sync.metrics.egress_push.with_label_values(&["refused"]).get(), 1);
        assert_eq!(sync.pending(), 0, "not retried");
        assert!(!sync.count_mismatch(0));
        sync.set_blocking("192.168.0.6".parse().unwrap(), Some(spec("ok")));
        assert_eq!(applied.lock().unwrap().len(), 1);
        assert!(!sync.count_mismatch(1));
        assert!(sync.count_mismatch(0), "the gateway lost one");
        assert!(sync.count_mismatch(2), "the gateway holds one the agent does not want");
        sync.up.store(false, Ordering::Release);
        sync.set_blocking("192.168.0.7".parse().unwrap(), Some(spec("owed")));
        assert!(!sync.count_mismatch(2), "an owed push may already have landed");
        assert!(sync.count_mismatch(3));
    }

    /// Without a full sync yet, a delete for an unknown address is still sent (the gateway
    /// may hold one from before a restart); after it, it is skipped.
    #[test]
    fn deletes_are_skipped_only_after_a_full_sync() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let (url, applied) = rt.block_on(fake_gateway());
        let sync = EgressSync::new(&url, Duration::from_secs(5), rt.handle().clone(), Metrics::new()).unwrap();
        sync.up.store(true, Ordering::Release);
        sync.set_blocking("192.168.0.3".parse().unwrap(), None);
        sync.synced.store(true, Ordering::Release);
        sync.set_blocking("192.168.0.4".parse().unwrap(), None);
        assert_eq!(applied.lock().unwrap().len(), 1);
        assert_eq!(sync.metrics.egress_push.with_label_values(&["ok"]).get(), 1);
    }

    fn names(v: &[(&str, [u8; 4])], expires_ns: u64) -> cubevs::policy::LearnedNames {
        let mut n = cubevs::policy::LearnedNames { expires_ns, ..Default::default() };
        for (name, ip) in v {
            n.names.entry(name.to_string()).or_default().push(Ipv4Addr::from(*ip));
        }
        n
    }

    /// The feed sends a change once (not every poll), a later expiry again, a vanished
    /// sandbox as DELETE; `forget_learned` owes a DELETE that a full sync does not undo.
    #[test]
    fn feed_sends_changes_once_and_deletes_what_is_gone() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let (url, applied) = rt.block_on(fake_gateway());
        let sync = EgressSync::new(&url, Duration::from_secs(5), rt.handle().clone(), Metrics::new()).unwrap();
        let (a, b): (Ipv4Addr, Ipv4Addr) = ("192.168.0.2".parse().unwrap(), "192.168.0.3".parse().unwrap());
        let far = cubevs::reaper::monotonic_ns() + 600_000_000_000;
        let mark = |w: Vec<(Ipv4Addr, cubevs::policy::LearnedNames)>| {
            let mut f = sync.feed_lock();
            sync.mark_feed(&mut f, w);
        };
        mark(vec![(a, names(&[("*.cdn.example", [203, 0, 113, 20])], far))]);
        assert!(!rt.block_on(sync.push_feed_dirty()));
        let log = applied.lock().unwrap().clone();
        assert_eq!(log.len(), 1);
        let body: serde_json::Value = serde_json::from_str(&log[0].1).unwrap();
        assert_eq!(log[0].0, "PUT");
        assert_eq!(body["names"], serde_json::json!({"*.cdn.example": ["203.0.113.20"]}));
        let ttl = body["ttl_secs"].as_u64().unwrap();
        assert!((599..=600).contains(&ttl), "{ttl}");
        // Same names, same expiry: nothing to send.
        mark(vec![(a, names(&[("*.cdn.example", [203, 0, 113, 20])], far))]);
        assert!(!rt.block_on(sync.push_feed_dirty()));
        assert_eq!(applied.lock().unwrap().len(), 1);
        // Renewed: sent again. Then A vanishes and B appears.
        mark(vec![(a, names(&[("*.cdn.example", [203, 0, 113, 20])], far + 5_000_000_000))]);
        rt.block_on(sync.push_feed_dirty());
        mark(vec![(b, names(&[("api.example.com", [203, 0, 113, 10])], far))]);
        rt.block_on(sync.push_feed_dirty());
        let mut methods: Vec<String> = applied.lock().unwrap().iter().map(|(m, _)| m.clone()).collect();
        // A's DELETE and B's PUT go in either order (different addresses).
        methods[2..].sort();
        assert_eq!(methods, ["PUT", "PUT", "DELETE", "PUT"]);
        assert!(!sync.feed_lock().contains_key(&a), "a completed delete forgets the address");
        // Release of B: a DELETE is owed; a full sync re-sends it, never B's names.
        sync.forget_learned(b);
        sync.mark_feed_full_sync();
        rt.block_on(sync.push_feed_dirty());
        let log = applied.lock().unwrap().clone();
        assert_eq!(log.last().unwrap().0, "DELETE");
        assert!(sync.feed_lock().is_empty());
        assert_eq!(sync.metrics.egress_learned_push.with_label_values(&["ok"]).get(), 5);
    }

    #[test]
    fn admin_url_is_strict() {
        assert_eq!(parse_admin_url("http://127.0.0.1:9091").unwrap(), "127.0.0.1:9091");
        assert_eq!(parse_admin_url("http://127.0.0.1:9091/").unwrap(), "127.0.0.1:9091");
        for bad in ["https://127.0.0.1:9091", "http://127.0.0.1", "http://127.0.0.1:9091/x", "127.0.0.1:9091", ""] {
            assert!(parse_admin_url(bad).is_err(), "{bad:?}");
        }
    }
}
