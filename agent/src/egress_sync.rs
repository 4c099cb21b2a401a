//! Pushes each sandbox's L7 rules to the CubeEgress admin API (`reference/upstream.md §4.4`):
//! `PUT /admin/v1/policies/<sandboxIP>` on Ensure and Reconcile, `DELETE` on Release.
//!
//! - Each change bumps a per-IP generation and marks the IP dirty; the caller then makes one
//!   attempt at once (bounded by `cube_egress_push_timeout_ms`), so the gateway normally has the
//!   policy before Ensure returns. A push that fails transiently (connect error, timeout, 5xx)
//!   stays dirty and the background loop retries it with backoff (200 ms doubling to 5 s). A
//!   push completes an IP only if its generation is still current, so a slow stale push can
//!   never leave an old policy behind: the IP stays dirty and the current one is re-sent.
//! - A 4xx is permanent (the gateway refused the body): logged, not retried. The agent
//!   validates rules with the gateway's own validator (`egress_policy`) first, so this only
//!   happens across versions (decision L3: it does not fail Ensure).
//! - The loop polls `GET /admin/v1/health` every second; when the gateway comes back (first
//!   contact, or after being unreachable) it re-sends the full set (every live sandbox with
//!   rules), because a restarted gateway holds nothing until its bootstrap or this resync.
//!
//! Secrets: bodies are never logged; errors carry the status and the gateway's error text
//! (which names a field, never a value).

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use egress_policy::PolicySpec;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, body::Bytes};
use hyper_util::rt::TokioIo;

use crate::agent::Agent;

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

/// Outcome of one push.
#[derive(Debug, PartialEq, Eq)]
enum Push {
    Done,
    /// Retry later (connect error, timeout, 5xx).
    Transient(String),
    /// The gateway refused it (4xx): do not retry.
    Permanent(String),
}

#[derive(Debug, Default)]
struct Entry {
    /// Bumped by every change.
    generation: u64,
    /// `Some` = PUT this, `None` = DELETE.
    desired: Option<PolicySpec>,
    dirty: bool,
}

/// The push client and its pending work.
#[derive(Debug)]
pub struct EgressSync {
    authority: String,
    timeout: Duration,
    entries: Mutex<HashMap<Ipv4Addr, Entry>>,
    wake: tokio::sync::Notify,
    rt: tokio::runtime::Handle,
}

/// The gateway body of a sandbox: `{policy_id: "<ip>", rules}` (upstream's Cubelet sets
/// policy_id = sandbox IP). `None` when it has no rules (no L7 policy: DELETE).
pub fn policy_spec(ip: Ipv4Addr, rules: &[egress_policy::RuleSpec]) -> Option<PolicySpec> {
    (!rules.is_empty()).then(|| PolicySpec { policy_id: ip.to_string(), rules: rules.to_vec() })
}

impl EgressSync {
    /// A client of `admin_url` (validated by [`parse_admin_url`]); `rt` runs the pushes.
    pub fn new(admin_url: &str, timeout: Duration, rt: tokio::runtime::Handle) -> Result<Arc<Self>, String> {
        Ok(Arc::new(Self {
            authority: parse_admin_url(admin_url)?,
            timeout,
            entries: Mutex::new(HashMap::new()),
            wake: tokio::sync::Notify::new(),
            rt,
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Ipv4Addr, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the wanted state of `ip` (`None` = no policy) and makes one attempt now. Blocks
    /// up to the push timeout; call from a blocking thread, never a tokio worker. Failures
    /// are left to the background loop.
    pub fn set_blocking(&self, ip: Ipv4Addr, desired: Option<PolicySpec>) {
        let generation = {
            let mut m = self.lock();
            let e = m.entry(ip).or_default();
            e.generation += 1;
            e.desired = desired.clone();
            e.dirty = true;
            e.generation
        };
        let r = self.rt.block_on(self.push(ip, desired.as_ref()));
        self.complete(ip, generation, r);
    }

    /// Marks every sandbox of `all` dirty with its current policy (full resync).
    fn resync(&self, all: Vec<(Ipv4Addr, PolicySpec)>) {
        let mut m = self.lock();
        for (ip, spec) in all {
            let e = m.entry(ip).or_default();
            e.generation += 1;
            e.desired = Some(spec);
            e.dirty = true;
        }
    }

    fn complete(&self, ip: Ipv4Addr, generation: u64, r: Push) {
        let mut m = self.lock();
        let Some(e) = m.get_mut(&ip) else { return };
        if e.generation != generation {
            // Changed meanwhile: the current state still has to go out.
            self.wake.notify_one();
            return;
        }
        match r {
            Push::Done => {
                e.dirty = false;
                if e.desired.is_none() {
                    m.remove(&ip);
                }
            }
            Push::Permanent(why) => {
                tracing::error!(sandbox_ip = %ip, "cube-egress refused the policy (not retried): {why}");
                e.dirty = false;
            }
            Push::Transient(why) => {
                tracing::warn!(sandbox_ip = %ip, "cube-egress push failed, retrying in the background: {why}");
                self.wake.notify_one();
            }
        }
    }

    async fn request(&self, method: Method, path: &str, body: Vec<u8>) -> Result<(u16, Bytes), String> {
        let fut = async {
            let stream = tokio::net::TcpStream::connect(&self.authority).await.map_err(|e| e.to_string())?;
            let (mut tx, conn) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            let req = Request::builder()
                .method(method)
                .uri(path)
                .header("host", &self.authority)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| e.to_string())?;
            let resp = tx.send_request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
            Ok::<_, String>((status, body))
        };
        tokio::time::timeout(self.timeout, fut).await.map_err(|_| format!("timed out after {:?}", self.timeout))?
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
        match self.request(method.clone(), &path, body).await {
            Ok((s, _)) if (200..300).contains(&s) => Push::Done,
            Ok((s, b)) if (400..500).contains(&s) => {
                Push::Permanent(format!("{method} {path}: {s} {}", String::from_utf8_lossy(&b).trim()))
            }
            Ok((s, _)) => Push::Transient(format!("{method} {path}: {s}")),
            Err(e) => Push::Transient(format!("{method} {path}: {e}")),
        }
    }

    async fn healthy(&self) -> bool {
        matches!(self.request(Method::GET, "/admin/v1/health", Vec::new()).await, Ok((200, _)))
    }

    /// The background loop: health poll, full resync when the gateway (re)appears, retries of
    /// dirty IPs with backoff. Ends when the agent is dropped.
    pub async fn run(self: Arc<Self>, agent: Weak<Agent>) {
        let mut up = false;
        let mut backoff = Duration::from_millis(200);
        loop {
            let Some(a) = agent.upgrade() else { return };
            let now_up = self.healthy().await;
            if now_up && !up {
                tracing::info!(gateway = %self.authority, "cube-egress reachable: full policy resync");
                self.resync(a.egress_policies());
            }
            if up && !now_up {
                tracing::warn!(gateway = %self.authority, "cube-egress unreachable");
            }
            up = now_up;
            drop(a);
            let mut failed = false;
            if up {
                let work: Vec<(Ipv4Addr, u64, Option<PolicySpec>)> = self
                    .lock()
                    .iter()
                    .filter(|(_, e)| e.dirty)
                    .map(|(ip, e)| (*ip, e.generation, e.desired.clone()))
                    .collect();
                for (ip, generation, desired) in work {
                    let r = self.push(ip, desired.as_ref()).await;
                    failed |= matches!(r, Push::Transient(_));
                    self.complete(ip, generation, r);
                }
            }
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
                _ = self.wake.notified(), if !failed => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_url_is_strict() {
        assert_eq!(parse_admin_url("http://127.0.0.1:9091").unwrap(), "127.0.0.1:9091");
        assert_eq!(parse_admin_url("http://127.0.0.1:9091/").unwrap(), "127.0.0.1:9091");
        for bad in ["https://127.0.0.1:9091", "http://127.0.0.1", "http://127.0.0.1:9091/x", "127.0.0.1:9091", ""] {
            assert!(parse_admin_url(bad).is_err(), "{bad:?}");
        }
    }
}
