//! Admin API (`reference/upstream.md §4.4`) and Prometheus `/metrics`, on a loopback listener.
//!
//! | method/path | result |
//! |---|---|
//! | `GET /admin/v1/health` | `{status, bootstrap_status, policy_count, version}` |
//! | `GET /admin/v1/dump` | `{policies:{ip:policy}}`, secrets redacted |
//! | `GET /admin/v1/policies` | `{ip:policy}`, redacted |
//! | `GET/PUT/PATCH/DELETE /admin/v1/policies/<ip>` | read (404 when absent) / replace / upsert one rule by id / delete |
//! | `GET/PUT/DELETE /admin/v1/learned/<ip>` | addresses the sandbox resolved (`{names:{name:[ip]}, ttl_secs}`), fed by the agent; read / replace / forget (E14) |
//! | `GET /metrics` | Prometheus text |
//!
//! Only a client whose socket is root's or this process's uid gets more than `/metrics` and
//! `/admin/v1/health` (403 `{"error":"root only"}`, R43: loopback is every local process).
//! Bodies are limited to 1 MiB; bad JSON or an invalid policy → 400 `{"error": "<field>: <reason>"}`;
//! wrong method → 405 with `Allow`; unknown path → 404 `{"error":"not found"}`; a change while
//! a swap hands the state to a successor → 503 with `Retry-After: 1` (E18).

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::{
    App,
    dest::LearnedSpec,
    policy::{Policy, RuleSpec, parse_sandbox_ip},
};

/// Largest accepted admin request body.
pub const MAX_BODY: usize = 1 << 20;

fn reply(status: StatusCode, v: Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(v.to_string())))
        .expect("static response")
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response<Full<Bytes>> {
    reply(status, json!({"error": msg.into()}))
}

fn not_allowed(allow: &str) -> Response<Full<Bytes>> {
    let mut r = error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
    r.headers_mut().insert(header::ALLOW, http::HeaderValue::from_str(allow).expect("static header"));
    r
}

async fn body(req: Request<Incoming>) -> Result<Bytes, Response<Full<Bytes>>> {
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(_) => Err(error(StatusCode::PAYLOAD_TOO_LARGE, format!("body larger than {MAX_BODY} bytes"))),
    }
}

/// Applies one admin change unless a swap has frozen the state (E18): from the moment the
/// state is captured for a successor, changes get 503 with `Retry-After: 1` and
/// `Connection: close`, so the retry reaches the successor (or this process again, unfrozen,
/// when the swap failed). The freeze lock is held across `f`, so no change can slip in between
/// a check and the snapshot.
fn mutate(app: &App, f: impl FnOnce() -> Response<Full<Bytes>>) -> Response<Full<Bytes>> {
    let frozen = app.admin_frozen.read().unwrap_or_else(|e| e.into_inner());
    if *frozen {
        let mut r = error(StatusCode::SERVICE_UNAVAILABLE, "gateway is handing over to a successor; retry");
        r.headers_mut().insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
        r.headers_mut().insert(header::CONNECTION, http::HeaderValue::from_static("close"));
        return r;
    }
    f()
}

/// Serves one admin request.
///
/// `trusted`: the client's socket belongs to root or our uid (R43). Anyone else gets only
/// `/metrics` and `/admin/v1/health`; every other path answers 403 `{"error":"root only"}`.
pub async fn handle(app: Arc<App>, req: Request<Incoming>, trusted: bool) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if !trusted && path != "/metrics" && path != "/admin/v1/health" {
        tracing::warn!(%method, path, "admin request from another user refused");
        return error(StatusCode::FORBIDDEN, "root only");
    }
    match path.as_str() {
        "/metrics" => match method {
            Method::GET => Response::builder()
                .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
                .body(Full::new(Bytes::from(render_metrics(&app))))
                .expect("static response"),
            _ => not_allowed("GET"),
        },
        "/admin/v1/health" => match method {
            Method::GET => reply(
                StatusCode::OK,
                json!({
                    "status": "ok",
                    "bootstrap_status": app.store.status().as_str(),
                    "policy_count": app.store.len(),
                    "version": env!("CARGO_PKG_VERSION"),
                    "commit": option_env!("CUBE_EGRESS_COMMIT").unwrap_or("unknown"),
                    "build_time": option_env!("CUBE_EGRESS_BUILD_TIME").unwrap_or("unknown"),
                }),
            ),
            _ => not_allowed("GET"),
        },
        "/admin/v1/dump" | "/admin/v1/policies" => match method {
            Method::GET => {
                let mut m = serde_json::Map::new();
                for (ip, p) in app.store.all() {
                    m.insert(ip.to_string(), serde_json::to_value(p.spec.redacted()).unwrap_or(Value::Null));
                }
                let v = if path.ends_with("dump") { json!({"policies": m}) } else { Value::Object(m) };
                reply(StatusCode::OK, v)
            }
            _ => not_allowed("GET"),
        },
        p if p.starts_with("/admin/v1/policies/") => {
            let seg = &p["/admin/v1/policies/".len()..];
            if seg.is_empty() || !seg.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
                return error(StatusCode::NOT_FOUND, "not found");
            }
            let ip = match parse_sandbox_ip(seg) {
                Ok(ip) => ip,
                Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
            };
            match method {
                Method::GET => match app.store.get(ip) {
                    Some(p) => reply(StatusCode::OK, serde_json::to_value(p.spec.redacted()).unwrap_or(Value::Null)),
                    None => error(StatusCode::NOT_FOUND, "policy not found"),
                },
                Method::PUT => {
                    let b = match body(req).await {
                        Ok(b) => b,
                        Err(r) => return r,
                    };
                    match Policy::from_json(&b) {
                        Ok(pol) => mutate(&app, || {
                            app.store.put(ip, pol);
                            tracing::info!(%ip, "policy replaced");
                            reply(StatusCode::OK, json!({"ok": true}))
                        }),
                        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
                    }
                }
                Method::PATCH => {
                    let b = match body(req).await {
                        Ok(b) => b,
                        Err(r) => return r,
                    };
                    let de = &mut serde_json::Deserializer::from_slice(&b);
                    let rule: RuleSpec = match serde_path_to_error::deserialize(de) {
                        Ok(r) => r,
                        Err(e) => {
                            let path = e.path().to_string();
                            let field = if path == "." || path == "?" { "body".to_string() } else { path };
                            return error(StatusCode::BAD_REQUEST, format!("{field}: {}", e.inner()));
                        }
                    };
                    mutate(&app, || match app.store.patch_rule(ip, rule) {
                        Ok(true) => reply(StatusCode::OK, json!({"ok": true})),
                        Ok(false) => error(StatusCode::NOT_FOUND, "policy not found"),
                        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
                    })
                }
                Method::DELETE => mutate(&app, || {
                    app.store.delete(ip);
                    // A reused sandbox IP must not inherit the old sandbox's learned names, nor
                    // what its requests left in the per-sandbox caches: resolver answers (R83),
                    // leaves (R81), upstream TLS sessions (R84).
                    app.dest.forget_sandbox(ip);
                    app.certs.forget_sandbox(ip);
                    app.upstream_tls.forget(ip);
                    reply(StatusCode::OK, json!({"ok": true}))
                }),
                _ => not_allowed("GET, PUT, PATCH, DELETE"),
            }
        }
        p if p.starts_with("/admin/v1/learned/") => {
            let seg = &p["/admin/v1/learned/".len()..];
            let ip = match parse_sandbox_ip(seg) {
                Ok(ip) => ip,
                Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
            };
            match method {
                Method::GET => match app.dest.learned(ip) {
                    Some(l) => reply(StatusCode::OK, serde_json::to_value(l).unwrap_or(Value::Null)),
                    None => error(StatusCode::NOT_FOUND, "nothing learned"),
                },
                Method::PUT => {
                    let b = match body(req).await {
                        Ok(b) => b,
                        Err(r) => return r,
                    };
                    let de = &mut serde_json::Deserializer::from_slice(&b);
                    let spec: LearnedSpec = match serde_path_to_error::deserialize(de) {
                        Ok(s) => s,
                        Err(e) => {
                            let path = e.path().to_string();
                            let field = if path == "." || path == "?" { "body".to_string() } else { path };
                            return error(StatusCode::BAD_REQUEST, format!("{field}: {}", e.inner()));
                        }
                    };
                    mutate(&app, || match app.dest.set_learned(ip, &spec) {
                        Ok(()) => reply(StatusCode::OK, json!({"ok": true})),
                        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
                    })
                }
                Method::DELETE => mutate(&app, || {
                    app.dest.clear_learned(ip);
                    reply(StatusCode::OK, json!({"ok": true}))
                }),
                _ => not_allowed("GET, PUT, DELETE"),
            }
        }
        _ => error(StatusCode::NOT_FOUND, "not found"),
    }
}

/// The metrics, with the pool gauges set from their pools first (R22).
fn render_metrics(app: &App) -> String {
    let m = &app.metrics;
    let (floor, shared) = app.conns.pool().totals();
    m.connections.with_label_values(&["floor"]).set(floor as i64);
    m.connections.with_label_values(&["shared"]).set(shared as i64);
    let (floor, shared) = app.audit.queued();
    m.audit_queued.with_label_values(&["floor"]).set(floor as i64);
    m.audit_queued.with_label_values(&["shared"]).set(shared as i64);
    m.render()
}
