//! HTTP on `health_listen`: `/healthz` (alive), `/readyz` (whether an Ensure can succeed now,
//! see [`Agent::readiness`]; 503 with the reason), `/metrics` (Prometheus; datapath figures
//! are read at scrape time), `/metrics/cube-egress` (CubeEgress's own `/metrics`, relayed at
//! scrape time: [`egress_metrics`], O26), and, to loopback clients only, `GET /v1/network/taps` (upstream
//! shape, `reference/upstream.md §1.2`) plus the CLI dumps `GET /v1/dataplane/{sessions,
//! sandboxes,portmaps,policies,counters}` (`counters`: every registered sandbox with its
//! packets/bytes each way and drops by reason) and `GET /v1/policies/dump` (CubeEgress
//! bootstrap, with secrets: [`crate::policy_dump`]; with `dataplane_netns` also on
//! `egress_dump_listen` in that namespace, [`Routes::DumpOnly`]). Other methods get 405 with `Allow: GET`; non-loopback clients of the
//! `/v1/` paths get 403; a peer inside the sandbox `cidr` gets 403 on every path (R41); a loopback
//! client whose socket is not root's or the agent's uid gets 403 on the `/v1/` paths (R42).

use std::{collections::BTreeMap, convert::Infallible, net::SocketAddr, sync::Arc};

use http_body_util::Full;
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Incoming},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;

use crate::agent::Agent;

fn text(code: StatusCode, body: impl Into<Bytes>, ctype: &str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(code)
        .header("content-type", ctype)
        .body(Full::new(body.into()))
        .expect("static response")
}

fn json(v: &impl serde::Serialize) -> Response<Full<Bytes>> {
    match serde_json::to_vec(v) {
        Ok(b) => text(StatusCode::OK, b, "application/json"),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "text/plain"),
    }
}

/// Whether a peer may read the `/v1/` paths: 127.0.0.0/8, `::1`, or `::ffff:127.x.y.z` (an IPv4
/// loopback client of a dual-stack `[::]` listener). Everything else is refused.
pub fn is_loopback_peer(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => v4.is_loopback(),
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(v6.is_loopback(), |v4| v4.is_loopback()),
    }
}

/// What a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routes {
    /// `health_listen`: everything above.
    All,
    /// `egress_dump_listen` in the dataplane namespace: only `GET /v1/policies/dump` (to
    /// loopback peers); every other path is 404.
    DumpOnly,
}

/// A request handler run on the blocking pool.
type Job = Box<dyn FnOnce(&Agent) -> Response<Full<Bytes>> + Send>;

async fn route(
    agent: Arc<Agent>,
    routes: Routes,
    peer: SocketAddr,
    local: SocketAddr,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    if routes == Routes::DumpOnly && path != "/v1/policies/dump" {
        return text(StatusCode::NOT_FOUND, "not found\n", "text/plain");
    }
    // A sandbox never reads the agent (R41): a guest reaches the node address through the
    // datapath with its own address as the source, and `/metrics` names every other sandbox.
    if agent.in_sandbox_cidr(peer.ip()) {
        tracing::warn!(%peer, path, "health listener: sandbox client refused");
        return text(StatusCode::FORBIDDEN, "not for sandboxes\n", "text/plain");
    }
    if req.method() != Method::GET {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n", "text/plain");
        r.headers_mut().insert("allow", hyper::header::HeaderValue::from_static("GET"));
        return r;
    }
    if path.starts_with("/v1/") && !is_loopback_peer(peer.ip()) {
        return text(StatusCode::FORBIDDEN, "loopback only\n", "text/plain");
    }
    if path.starts_with("/v1/") {
        // Loopback is every local process: the dumps (secrets in `/v1/policies/dump`) go to
        // root and our uid only, found in the listener's namespace's socket table (R42).
        let a = agent.clone();
        let uid = tokio::task::spawn_blocking(move || match routes {
            Routes::DumpOnly => cubenet_sys::peer_uid::owner(peer, local, |p| a.read_dataplane_file(p)),
            Routes::All => cubenet_sys::peer_uid::owner_here(peer, local),
        })
        .await
        .ok()
        .flatten();
        if !cubenet_sys::peer_uid::allowed(uid) {
            tracing::warn!(%peer, ?uid, path, "health listener: /v1/ client of another user refused");
            return text(StatusCode::FORBIDDEN, "root only\n", "text/plain");
        }
    }
    let a = agent.clone();
    let blocking = |f: Job| async move {
        tokio::task::spawn_blocking(move || f(&a))
            .await
            .unwrap_or_else(|e| text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "text/plain"))
    };
    match path.as_str() {
        "/healthz" => text(StatusCode::OK, "ok", "text/plain"),
        "/readyz" => match agent.readiness() {
            Ok(()) => text(StatusCode::OK, "ready", "text/plain"),
            Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, e, "text/plain"),
        },
        "/metrics" => {
            blocking(Box::new(|a: &Agent| {
                a.refresh_datapath_metrics();
                text(StatusCode::OK, a.metrics.render(), "text/plain; version=0.0.4")
            }))
            .await
        }
        "/metrics/cube-egress" => egress_metrics(&agent).await,
        "/v1/network/taps" => {
            blocking(Box::new(|a: &Agent| {
                let taps = a.taps();
                let mut counts: BTreeMap<String, usize> =
                    ["Ready", "Active", "Cleaning"].iter().map(|s| (s.to_string(), 0)).collect();
                for t in &taps {
                    *counts.entry(format!("{:?}", t.state)).or_default() += 1;
                }
                // Serialized straight from the structs: a `serde_json::Value` tree of 8,192
                // TAPs is ~10x the JSON and its peak stays in the allocator (F6).
                #[derive(serde::Serialize)]
                struct Body<'a> {
                    taps: &'a [crate::agent::TapInfo],
                    #[serde(rename = "stateCounts")]
                    state_counts: BTreeMap<String, usize>,
                }
                json(&Body { taps: &taps, state_counts: counts })
            }))
            .await
        }
        "/v1/policies/dump" => blocking(Box::new(|a: &Agent| json(&crate::policy_dump::dump(a)))).await,
        "/v1/dataplane/sessions" => {
            blocking(Box::new(|a: &Agent| match a.dataplane().sessions() {
                Ok(s) => json(&serde_json::json!({"sessions": s})),
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "text/plain"),
            }))
            .await
        }
        "/v1/dataplane/sandboxes" => {
            blocking(Box::new(|a: &Agent| match a.dataplane().sandboxes() {
                Ok(s) => json(&serde_json::json!({"sandboxes": s})),
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "text/plain"),
            }))
            .await
        }
        "/v1/dataplane/counters" => {
            blocking(Box::new(|a: &Agent| {
                let dp = a.dataplane();
                match dp.sandboxes().and_then(|s| Ok((s, dp.all_sandbox_counters()?))) {
                    Ok((sandboxes, counters)) => {
                        let out: Vec<_> = sandboxes
                            .iter()
                            .map(|s| {
                                let c = counters.get(&s.ifindex).cloned().unwrap_or_default();
                                // Best effort: a failed lookup shows no live count, not a 500.
                                let live = dp.session_quota_live(s.ifindex, s.version).ok().flatten();
                                serde_json::json!({
                                    "sandboxID": s.id, "ifindex": s.ifindex, "ip": s.ip, "version": s.version,
                                    "out": {"packets": c.out_packets, "bytes": c.out_bytes},
                                    "in": {"packets": c.in_packets, "bytes": c.in_bytes},
                                    "drops": c.drops,
                                    "sessions": {"live": live.unwrap_or(0).max(0), "budget": a.session_budget()},
                                })
                            })
                            .collect();
                        json(&serde_json::json!({"sandboxes": out}))
                    }
                    Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "text/plain"),
                }
            }))
            .await
        }
        "/v1/dataplane/fqdn" => {
            blocking(Box::new(|a: &Agent| match a.fqdn_view() {
                Ok(s) => json(&serde_json::json!({"sandboxes": s})),
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "text/plain"),
            }))
            .await
        }
        "/v1/dataplane/portmaps" => {
            blocking(Box::new(|a: &Agent| match a.dataplane().port_mappings() {
                Ok(p) => json(&serde_json::json!({"portMappings": p})),
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "text/plain"),
            }))
            .await
        }
        "/v1/dataplane/policies" => {
            blocking(Box::new(|a: &Agent| {
                let mut out = Vec::new();
                for t in a.taps() {
                    match a.dataplane().policy(t.tap_ifindex) {
                        Ok(p) => out.push(serde_json::json!({
                            "tapName": t.tap_name, "tapIfIndex": t.tap_ifindex,
                            "sandboxID": t.sandbox_id, "policy": p,
                        })),
                        Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "text/plain"),
                    }
                }
                json(&serde_json::json!({"policies": out}))
            }))
            .await
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n", "text/plain"),
    }
}

/// `GET /metrics/cube-egress` (O26): CubeEgress's own `/metrics`, fetched from
/// `cube_egress_admin_url` at scrape time through the dataplane-namespace client, bounded in
/// time and size ([`crate::egress_sync::EgressSync::fetch_metrics`]). A failure answers at
/// once with 503 (unreachable, timed out) or 502 (another status, an oversize body) and a
/// one-line reason, and counts in `cubenet_egress_scrape_errors_total{reason}`; the agent's
/// `/metrics` never waits for the gateway. 404 without `cube_egress_admin_url`.
async fn egress_metrics(agent: &Agent) -> Response<Full<Bytes>> {
    let Some(sync) = agent.egress_sync() else {
        return if agent.egress_configured() {
            text(StatusCode::SERVICE_UNAVAILABLE, "cube-egress client not started yet\n", "text/plain")
        } else {
            text(StatusCode::NOT_FOUND, "no CubeEgress: cube_egress_admin_url is empty\n", "text/plain")
        };
    };
    match sync.fetch_metrics().await {
        Ok((ctype, body)) => text(StatusCode::OK, body, ctype.as_deref().unwrap_or("text/plain; version=0.0.4")),
        Err(e) => {
            agent.metrics.egress_scrape_errors.with_label_values(&[e.reason]).inc();
            tracing::warn!(reason = e.reason, "cube-egress /metrics relay failed: {}", e.detail);
            let code = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_GATEWAY);
            text(code, format!("cube-egress /metrics: {}\n", e.detail), "text/plain")
        }
    }
}

/// Serves everything on an already bound listener forever.
pub async fn serve(listener: tokio::net::TcpListener, agent: Arc<Agent>) -> std::io::Result<()> {
    serve_routes(listener, agent, Routes::All).await
}

/// Serves `routes` on an already bound listener forever.
pub async fn serve_routes(listener: tokio::net::TcpListener, agent: Arc<Agent>, routes: Routes) -> std::io::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await?;
        let Ok(local) = stream.local_addr() else { continue };
        let agent = agent.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let agent = agent.clone();
                async move { Ok::<_, Infallible>(route(agent, routes, peer, local, req).await) }
            });
            let conn = http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                tracing::debug!("http client {peer}: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::is_loopback_peer;

    #[test]
    fn loopback_peers() {
        for ok in ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"] {
            assert!(is_loopback_peer(ok.parse().unwrap()), "{ok}");
        }
        for bad in ["10.0.0.1", "192.168.0.2", "0.0.0.0", "::", "::ffff:10.0.0.1", "fe80::1", "::127.0.0.1"] {
            assert!(!is_loopback_peer(bad.parse().unwrap()), "{bad}");
        }
    }
}
