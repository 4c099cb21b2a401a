//! The transparent HTTP/HTTPS proxy: accept (original destination = the accepted socket's local
//! address, sandbox = peer address), decide, intercept TLS, forward, audit.
//!
//! Per connection: HTTPS reads the ClientHello first and admits the SNI against the policy
//! before minting (anchors D.17); requests are then evaluated one by one (`reference/upstream.md
//! §4.3`); allowed ones go upstream over a per-connection hyper client (HTTP/1.1 or HTTP/2 by
//! ALPN, TLS verified, SNI = client SNI) to the original destination, with response bodies
//! streamed frame by frame.

use std::{
    convert::Infallible,
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::{
    client::legacy::{
        Client,
        connect::{HttpConnector, dns::Name},
    },
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
};
use serde_json::{Value, json};
use tokio::{net::TcpStream, sync::watch};

use crate::{
    App,
    audit::{redact_query, redacted_headers},
    certs::{CertName, MintError},
    dest::Unbound,
    floor::{Charge, Refusal},
    policy::{
        AuditLevel, Policy, RequestFacts, Scheme, SniAdmission, Verdict, normalize_request_host, normalize_request_path,
    },
};

/// Response body type of the proxy.
pub type ProxyBody = UnsyncBoxBody<Bytes, hyper::Error>;

/// How long an HTTP/1 client may take to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client may take to send its ClientHello (and, separately, to finish the handshake).
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Upstream time to response headers (upstream: read timeout 60 s).
const UPSTREAM_HEADERS_TIMEOUT: Duration = Duration::from_secs(60);

/// Headers never forwarded: hop-by-hop ones and the client-identifying ones upstream strips.
const STRIP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "x-forwarded-for",
    "x-real-ip",
    "forwarded",
];

/// Resolves every name to the original destination (our own: the only resolver we need is
/// "the address the sandbox dialled", which no DNS resolver crate models).
#[derive(Clone, Debug)]
struct FixedResolver(IpAddr);

impl tower_service::Service<Name> for FixedResolver {
    type Response = std::iter::Once<SocketAddr>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, _: Name) -> Self::Future {
        std::future::ready(Ok(std::iter::once(SocketAddr::new(self.0, 0))))
    }
}

type UpstreamClient = Client<hyper_rustls::HttpsConnector<HttpConnector<FixedResolver>>, CountingBody<Incoming>>;

/// TLS facts of an intercepted connection (for audit).
#[derive(Debug, Clone, Default)]
struct TlsInfo {
    version: Option<String>,
    cipher: Option<String>,
    client_alpn: Vec<String>,
}

/// Per-connection context.
struct Conn {
    sandbox: Ipv4Addr,
    dst: SocketAddrV4,
    scheme: Scheme,
    sni: Option<String>,
    tls: Option<TlsInfo>,
    client: UpstreamClient,
    conn_id: u64,
    reqs: AtomicU64,
    /// Requests of this connection now forwarded or being forwarded (R24).
    inflight: AtomicUsize,
}

/// Room for one forwarded request's upstream socket (decision R24). A connection's place in
/// the pool (R22) counts two descriptors: its own and one upstream socket, enough for its
/// first request in flight. Every further concurrent request (HTTP/2 streams; the upstream
/// client opens one socket per concurrent HTTP/1 request) takes a place of its own in the
/// sandbox's share; given back when the response body ends or is dropped.
struct UpstreamPlace {
    app: Arc<App>,
    ctx: Arc<Conn>,
    charge: Option<Charge>,
}

impl UpstreamPlace {
    /// Takes the place (none for the connection's only request in flight). Errors: the
    /// sandbox's share of the pool is used ([`Refusal`]).
    fn take(app: &Arc<App>, ctx: &Arc<Conn>) -> Result<UpstreamPlace, Refusal> {
        let charge = if ctx.inflight.fetch_add(1, Ordering::SeqCst) == 0 {
            None
        } else {
            match app.conns.pool().take(Some(ctx.sandbox)) {
                Ok(c) => Some(c),
                Err(why) => {
                    ctx.inflight.fetch_sub(1, Ordering::SeqCst);
                    return Err(why);
                }
            }
        };
        Ok(UpstreamPlace { app: app.clone(), ctx: ctx.clone(), charge })
    }
}

impl Drop for UpstreamPlace {
    fn drop(&mut self) {
        self.ctx.inflight.fetch_sub(1, Ordering::SeqCst);
        if let Some(c) = self.charge.take() {
            self.app.conns.pool().give_back(c);
        }
    }
}

fn new_client(app: &App, sandbox: Ipv4Addr, dst: IpAddr) -> UpstreamClient {
    let mut http = HttpConnector::new_with_resolver(FixedResolver(dst));
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(app.connect_timeout));
    // The sandbox's own TLS session store: it never resumes another sandbox's session (R84).
    let https = hyper_rustls::HttpsConnector::from((http, app.upstream_tls.for_sandbox(sandbox)));
    // One idle upstream socket per connection: the others close when their response ends, so a
    // connection's sockets are its requests in flight (R24) plus at most one.
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1)
        .build(https)
}

/// Splits an accepted socket into (sandbox IP, original destination); `None` for non-IPv4.
fn addrs(s: &TcpStream) -> Option<(Ipv4Addr, SocketAddrV4)> {
    match (s.peer_addr().ok()?, s.local_addr().ok()?) {
        (SocketAddr::V4(p), SocketAddr::V4(l)) => Some((*p.ip(), l)),
        _ => None,
    }
}

/// Serves one accepted connection of the `scheme` listener until it closes (or drains: see
/// [`crate::DRAIN_IDLE_GRACE`]). `drain` is held for the whole connection, TLS handshake
/// included, so the process waits for it before exiting. A reload that lists the original
/// destination (R51) closes the connection at once, in its TLS handshake as while it serves
/// (requests and upstream sockets in flight dropped with it, E27). A deleted policy of the
/// sandbox (its Release) resets it: the next sandbox on the address must not get its data
/// (R71).
pub async fn serve_conn(app: Arc<App>, stream: TcpStream, scheme: Scheme, drain: watch::Receiver<bool>) {
    let Some((sandbox, dst)) = addrs(&stream) else { return };
    let _ = stream.set_nodelay(true);
    let conn_id = app.next_id();
    // Subscribed before any check of `dst` runs: a reload after it is never missed.
    let (denied, changes) = (app.clone(), app.denied_changes());
    // The sandbox this connection serves: a Release (policy deleted) ends it (R71).
    let removals = app.store.removals();
    let inc = app.store.incarnation(sandbox);
    let sock = SocketId::of(&stream);
    let inner = serve_conn_inner(app, stream, scheme, sandbox, dst, conn_id, drain);
    tokio::pin!(inner);
    tokio::select! {
        () = &mut inner => {}
        () = denied.until_denied(changes, *dst.ip()) => {
            denied.metrics.connections_closed_always_denied.inc();
            tracing::info!(conn_id, dst = %dst.ip(), "connection closed: destination now always denied");
        }
        () = denied.store.until_removed(removals, inc) => {
            // `inner` still owns the socket here: reset it, so the kernel drops what it still
            // holds for the guest instead of retransmitting it to the address's next sandbox.
            sock.reset_on_close();
            denied.metrics.connections_closed_released.inc();
            tracing::info!(conn_id, sandbox = %sandbox, "connection reset: the sandbox's policy was deleted (Release)");
        }
    }
}

/// The accepted socket of a connection, by fd number and socket cookie, so that it is touched
/// only while that fd still is that socket.
struct SocketId {
    fd: std::os::fd::RawFd,
    cookie: Option<u64>,
}

impl SocketId {
    fn of(s: &TcpStream) -> SocketId {
        use std::os::fd::AsRawFd;
        let fd = s.as_raw_fd();
        SocketId { fd, cookie: socket_cookie(fd) }
    }

    /// Sets `SO_LINGER` 0 on the socket (if the fd still is it): its close sends a RST and
    /// discards unsent and unacknowledged data.
    fn reset_on_close(&self) {
        if self.cookie.is_none() || socket_cookie(self.fd) != self.cookie {
            return;
        }
        // SAFETY: the fd is open (its cookie was just read) and owned by the caller's future.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd) };
        if let Err(e) = socket2::SockRef::from(&fd).set_linger(Some(std::time::Duration::ZERO)) {
            tracing::warn!(error = %e, "SO_LINGER 0 on a released sandbox's connection");
        }
    }
}

/// `SO_COOKIE` (Linux 4.3+, `include/uapi/asm-generic/socket.h`): the socket's 64-bit id,
/// unique for the life of the kernel. `None` when `fd` is not a socket (or closed).
fn socket_cookie(fd: std::os::fd::RawFd) -> Option<u64> {
    const SO_COOKIE: libc::c_int = 57;
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `v` and `len` outlive the call and `len` is `v`'s size.
    let rc = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, SO_COOKIE, (&mut v as *mut u64).cast(), &mut len) };
    (rc == 0).then_some(v)
}

async fn serve_conn_inner(
    app: Arc<App>,
    stream: TcpStream,
    scheme: Scheme,
    sandbox: Ipv4Addr,
    dst: SocketAddrV4,
    conn_id: u64,
    drain: watch::Receiver<bool>,
) {
    match scheme {
        Scheme::Http => {
            let client = new_client(&app, sandbox, IpAddr::V4(*dst.ip()));
            let ctx = Arc::new(Conn {
                sandbox,
                dst,
                scheme,
                sni: None,
                tls: None,
                client,
                conn_id,
                reqs: AtomicU64::new(0),
                inflight: AtomicUsize::new(0),
            });
            serve_http(app, ctx, TokioIo::new(stream), drain).await;
        }
        Scheme::Https => serve_tls(app, stream, sandbox, dst, conn_id, drain).await,
    }
}

async fn serve_http<I>(app: Arc<App>, ctx: Arc<Conn>, io: I, mut drain: watch::Receiver<bool>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let conn_id = ctx.conn_id;
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (app, ctx) = (app.clone(), ctx.clone());
        async move {
            let http1 = req.version() < http::Version::HTTP_2;
            let mut resp = handle(app.clone(), ctx, req).await?;
            // Draining: answer this request, then close, so a keep-alive client reconnects
            // (to the successor after a swap) instead of racing our close on an idle socket;
            // each connection from its own point of the spread (E21).
            if http1 && app.close_due(conn_id) {
                resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            Ok::<_, Infallible>(resp)
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // A timer enables HTTP/1 header-read timeouts (slow clients) and HTTP/2 keep-alive.
    // Half-close: a client may shut its write side once the request is sent (busybox nc,
    // HTTP/1.0 tools) and still wait for the answer; without this hyper takes the EOF for a
    // gone client and drops the request in flight, with no response and no audit record.
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT).half_close(true);
    builder.http2().timer(TokioTimer::new());
    let conn = builder.serve_connection(io, svc).into_owned();
    tokio::pin!(conn);
    let res = tokio::select! {
        r = conn.as_mut() => r,
        () = crate::drain_started(&mut drain, crate::drain_offset(conn_id)) => {
            conn.as_mut().graceful_shutdown();
            conn.as_mut().await
        }
    };
    if let Err(e) = res {
        tracing::debug!(error = %e, "downstream connection ended with error");
    }
}

async fn serve_tls(
    app: Arc<App>,
    stream: TcpStream,
    sandbox: Ipv4Addr,
    dst: SocketAddrV4,
    conn_id: u64,
    drain: watch::Receiver<bool>,
) {
    let acceptor = tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), stream);
    let start = match tokio::time::timeout(HELLO_TIMEOUT, acceptor).await {
        Ok(Ok(s)) => s,
        _ => return,
    };
    let hello = start.client_hello();
    let sni = hello.server_name().map(|s| s.trim_end_matches('.').to_ascii_lowercase());
    let client_alpn: Vec<String> =
        hello.alpn().map(|it| it.map(|p| String::from_utf8_lossy(p).into_owned()).collect()).unwrap_or_default();
    let refuse = |reason: String| {
        app.metrics.handshakes_refused.inc();
        app.audit.write(json!({
            "event": "tls_handshake",
            "sandbox": {"src_ip": sandbox.to_string()},
            "conn": {"original_dst_ip": dst.ip().to_string(), "original_dst_port": dst.port()},
            "tls": {"sni": sni, "client_alpn": client_alpn},
            "security": {"reason": reason},
        }));
    };
    if let Some(reason) = app.never_dialled(*dst.ip()) {
        return refuse(reason.into());
    }
    let status = app.store.status();
    if !status.serving() {
        return refuse(format!("bootstrap_not_ready:{}", status.as_str()));
    }
    let Some(policy) = app.store.get(sandbox) else { return refuse("no_policy_for_sandbox".into()) };
    if policy.admit_sni(sni.as_deref(), *dst.ip(), dst.port()) == SniAdmission::Refuse {
        return refuse("sni_not_allowed".into());
    }
    // The costly part (mint, key exchange, signature) runs on the sandbox's turn: at most
    // `handshakes_per_sandbox` of its handshakes at a time, whatever it opens (R90). A turn
    // waited for longer than a handshake may take ends the connection. The turn ends with the
    // handshake, or after `TURN_HOLD` (a stalled client keeps no turn).
    let turn = match tokio::time::timeout(HELLO_TIMEOUT, app.handshakes.enter(sandbox)).await {
        Ok((turn, waited)) => {
            if waited {
                app.metrics.handshakes_waited.inc();
            }
            turn
        }
        Err(_) => {
            app.metrics.handshakes_waited.inc();
            tracing::debug!(%sandbox, "client TLS handshake: no turn in time");
            return;
        }
    };
    let name = match &sni {
        Some(s) => CertName::Dns(s.clone()),
        None => CertName::Ip(IpAddr::V4(*dst.ip())),
    };
    let cfg = match app.certs.server_config(sandbox, name).await {
        Ok(c) => c,
        Err(MintError::RateLimited) => return refuse("cert_mint_rate_limited".into()),
        Err(e) => return refuse(e.to_string()),
    };
    let handshake = tokio::time::timeout(HELLO_TIMEOUT, start.into_stream(cfg));
    tokio::pin!(handshake);
    let done = tokio::select! {
        r = &mut handshake => Some(r),
        () = tokio::time::sleep(crate::handshakes::TURN_HOLD) => None,
    };
    drop(turn);
    let done = match done {
        Some(r) => r,
        None => handshake.await,
    };
    let tls = match done {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::debug!(%sandbox, error = %e, "client TLS handshake failed");
            return;
        }
        Err(_) => return,
    };
    let (_, server) = tls.get_ref();
    let kind = match server.handshake_kind() {
        Some(rustls::HandshakeKind::Resumed) => "resumed",
        _ => "full",
    };
    app.metrics.tls_handshakes.with_label_values(&[kind]).inc();
    let info = TlsInfo {
        version: server.protocol_version().and_then(|v| v.as_str().map(str::to_string)),
        cipher: server.negotiated_cipher_suite().and_then(|c| c.suite().as_str().map(str::to_string)),
        client_alpn,
    };
    let client = new_client(&app, sandbox, IpAddr::V4(*dst.ip()));
    let ctx = Arc::new(Conn {
        sandbox,
        dst,
        scheme: Scheme::Https,
        sni,
        tls: Some(info),
        client,
        conn_id,
        reqs: AtomicU64::new(0),
        inflight: AtomicUsize::new(0),
    });
    serve_http(app, ctx, TokioIo::new(tls), drain).await;
}

fn plain(status: StatusCode, msg: &str) -> Response<ProxyBody> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Full::new(Bytes::from(format!("{msg}\n"))).map_err(|never| match never {}).boxed_unsync())
        .expect("static response")
}

/// Everything the audit record of one request needs, filled in as the request goes.
struct Record {
    rec: Value,
}

impl Record {
    fn set(&mut self, path: &[&str], v: Value) {
        let mut cur = &mut self.rec;
        for (i, k) in path.iter().enumerate() {
            if i + 1 == path.len() {
                cur[*k] = v;
                return;
            }
            cur = &mut cur[*k];
        }
    }
}

async fn handle(app: Arc<App>, ctx: Arc<Conn>, req: Request<Incoming>) -> Result<Response<ProxyBody>, Infallible> {
    let started = Instant::now();
    let n = ctx.reqs.fetch_add(1, Ordering::Relaxed);
    let ambiguous = ambiguous_host(&req);
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    let method = req.method().as_str().to_string();
    let path = req.uri().path().to_string();
    let tls = ctx.tls.clone().unwrap_or_default();
    let mut rec = Record {
        rec: json!({
            "event": "http_request",
            "request_id": format!("{:x}-{n}", ctx.conn_id),
            "sandbox": {"src_ip": ctx.sandbox.to_string(), "policy_id": null},
            "conn": {"original_dst_ip": ctx.dst.ip().to_string(), "original_dst_port": ctx.dst.port()},
            "tls": {"sni": ctx.sni, "cipher": tls.cipher, "version": tls.version, "client_alpn": tls.client_alpn},
            "http": {
                "method": method,
                "host": host,
                "path": redact_query(req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/")),
                "status": null, "req_bytes": 0, "resp_bytes": 0,
                "user_agent": req.headers().get(header::USER_AGENT).and_then(|v| v.to_str().ok()),
            },
            "policy": {"matched_rule": null, "decision": "unknown", "duration_us": 0},
            "credentials": {"injected": [], "secret_ids": []},
            "security": {"reason": null, "inject_dropped": false, "inject_skipped": []},
            "redacted_request_headers": redacted_headers(req.headers()),
        }),
    };
    if ambiguous {
        // Decided on one name, forwarded with another one beside it: refused before the policy
        // (RFC 9112 §3.2: 400), so neither the decision nor a credential follows it (R14).
        return Ok(refuse(&app, rec, StatusCode::BAD_REQUEST, "ambiguous_host", true, started).await);
    }
    if let Some(reason) = app.never_dialled(*ctx.dst.ip()) {
        // One sandbox never reaches another, not even through the gateway's upstream leg (R17),
        // and the node's always-denied list beats every allow rule (R31).
        return Ok(deny(&app, rec, reason, true, started).await);
    }
    // Rules see the path the server behind will resolve, not the raw one (R19).
    let Some(path) = normalize_request_path(&path) else {
        return Ok(refuse(&app, rec, StatusCode::BAD_REQUEST, "bad_path", true, started).await);
    };
    let status = app.store.status();
    if !status.serving() {
        return Ok(deny(&app, rec, &format!("bootstrap_not_ready:{}", status.as_str()), true, started).await);
    }
    let Some(policy) = app.store.get(ctx.sandbox) else {
        return Ok(deny(&app, rec, "no_policy_for_sandbox", true, started).await);
    };
    rec.set(&["sandbox", "policy_id"], json!(policy.spec.policy_id));
    let facts = RequestFacts {
        sni: ctx.sni.as_deref(),
        host: host.as_deref(),
        method: &method,
        path: &path,
        scheme: ctx.scheme,
        dst: *ctx.dst.ip(),
        port: ctx.dst.port(),
    };
    // HTTPS with a Host other than the SNI: the connection goes to the SNI's server whatever
    // the Host says, so a deny rule naming the SNI's host applies too (R20).
    if ctx.scheme == Scheme::Https
        && let Some(sni) = ctx.sni.as_deref()
        && host.as_deref().map(normalize_request_host) != Some(normalize_request_host(sni))
        && let Verdict::Deny(i) = policy.evaluate(&RequestFacts { host: Some(sni), ..facts })
    {
        rec.set(&["policy", "matched_rule"], json!(policy.rules[i].id));
        return Ok(deny(&app, rec, "rule_deny_sni", true, started).await);
    }
    let idx = match policy.evaluate(&facts) {
        Verdict::NoMatch => return Ok(deny(&app, rec, "no_rule_match", true, started).await),
        Verdict::Deny(i) => {
            rec.set(&["policy", "matched_rule"], json!(policy.rules[i].id));
            return Ok(deny(&app, rec, "rule_deny", false, started).await);
        }
        Verdict::Allow(i) => i,
    };
    rec.set(&["policy", "matched_rule"], json!(policy.rules[idx].id));
    // Plain HTTP: the sandbox chose both the destination and the Host the rule matched, so
    // the destination must belong to that Host (E14). HTTPS is bound by verifying the
    // upstream certificate against the SNI (and injection is checked in `forward`).
    let rule = &policy.rules[idx];
    if ctx.scheme == Scheme::Http
        && (rule.matches_on_host() || (!rule.inject.is_empty() && rule.inject_plain_http))
        && let Some(h) = host.as_deref()
        && let Err(e) = app.dest.check(ctx.sandbox, h, *ctx.dst.ip()).await
    {
        if let Unbound::ResolveFailed(err) = &e {
            rec.set(&["security", "error"], json!(err));
        }
        return Ok(deny(&app, rec, e.reason(), true, started).await);
    }
    rec.set(&["policy", "decision"], json!("allow"));
    app.metrics.requests.with_label_values(&["allow"]).inc();
    Ok(forward(app, ctx, req, &policy, idx, host, rec, started).await)
}

/// Answers 403 once the request's `http_request` record (after its `security_event` when
/// `security`) is written: a client never sees an answer whose record a crash could lose (E20).
/// When the record cannot be written the answer is still 403 (nothing was forwarded).
async fn deny(app: &App, rec: Record, reason: &str, security: bool, started: Instant) -> Response<ProxyBody> {
    refuse(app, rec, StatusCode::FORBIDDEN, reason, security, started).await
}

/// True when the request names more than one host: several `Host` field lines, or a target
/// authority (HTTP/1 absolute form, HTTP/2 `:authority`) other than the `Host` line (port,
/// case and a trailing dot ignored). RFC 9112 §3.2 makes several `Host` lines a 400; the
/// policy would decide on the first while a server or CDN that keeps the last one routes the
/// request, injected credential included, to another site (decision R14).
fn ambiguous_host<B>(req: &Request<B>) -> bool {
    let mut names = req.headers().get_all(header::HOST).iter().map(|v| match v.to_str() {
        Ok(v) => normalize_request_host(v),
        // Not text: never equal to a name, so it makes a second host.
        Err(_) => String::from("\u{0}"),
    });
    let first = names.next();
    if names.next().is_some() {
        return true;
    }
    match (first, req.uri().authority()) {
        (Some(h), Some(a)) => normalize_request_host(a.as_str()) != h,
        _ => false,
    }
}

/// [`deny`] with another status (400 for a request no policy can decide on).
async fn refuse(
    app: &App,
    mut rec: Record,
    status: StatusCode,
    reason: &str,
    security: bool,
    started: Instant,
) -> Response<ProxyBody> {
    app.metrics.requests.with_label_values(&["deny"]).inc();
    rec.set(&["policy", "decision"], json!("deny"));
    rec.set(&["http", "status"], json!(status.as_u16()));
    rec.set(&["security", "reason"], json!(reason));
    rec.set(&["policy", "duration_us"], json!(started.elapsed().as_micros() as u64));
    if security {
        let mut ev = rec.rec.clone();
        ev["event"] = json!("security_event");
        app.audit.write(ev);
    }
    if let Err(e) = app.audit.write_durable(rec.rec).await {
        app.metrics.audit_refused.with_label_values(&[e.reason()]).inc();
        tracing::warn!(error = %e, "deny record not written");
    }
    app.metrics.request_seconds.observe(started.elapsed().as_secs_f64());
    let what = if status == StatusCode::FORBIDDEN { "forbidden" } else { "refused" };
    plain(status, &format!("{what} by cube-egress: {reason}"))
}

/// Why an injection gate failed, or `None` when credentials may be injected. A `TRACE`
/// request (any case: some servers match methods case-insensitively) never gets them: its
/// response reflects the request's fields, so the sandbox would read the secret (RFC 9110
/// §9.3.8: a client must not send credentials in a TRACE request; decision R82).
fn inject_gate(
    method: &str,
    scheme: Scheme,
    sni: Option<&str>,
    host: Option<&str>,
    plain_http_ok: bool,
) -> Option<&'static str> {
    if method.eq_ignore_ascii_case("TRACE") {
        return Some("inject_trace_method");
    }
    match scheme {
        Scheme::Https => match (sni, host) {
            (Some(s), Some(h)) if normalize_request_host(s) == normalize_request_host(h) => None,
            (None, _) => Some("inject_missing_sni"),
            (_, None) => Some("inject_missing_host"),
            _ => Some("g4_host_sni_mismatch"),
        },
        Scheme::Http if !plain_http_ok => Some("inject_plain_http_not_allowed"),
        Scheme::Http if host.is_none() => Some("inject_missing_host"),
        Scheme::Http => None,
    }
}

#[allow(clippy::too_many_arguments)]
async fn forward(
    app: Arc<App>,
    ctx: Arc<Conn>,
    req: Request<Incoming>,
    policy: &Policy,
    idx: usize,
    host: Option<String>,
    mut rec: Record,
    started: Instant,
) -> Response<ProxyBody> {
    let rule = &policy.rules[idx];
    let (mut parts, body) = req.into_parts();
    strip(&mut parts.headers);
    for inj in &rule.inject {
        while parts.headers.remove(&inj.header).is_some() {}
    }
    if !rule.inject.is_empty() {
        let mut gate =
            inject_gate(parts.method.as_str(), ctx.scheme, ctx.sni.as_deref(), host.as_deref(), rule.inject_plain_http);
        // The credential only goes to an address of the name it is for (E14); plain HTTP was
        // checked before forwarding.
        if gate.is_none()
            && ctx.scheme == Scheme::Https
            && let Some(sni) = ctx.sni.as_deref()
            && let Err(e) = app.dest.check(ctx.sandbox, sni, *ctx.dst.ip()).await
        {
            gate = Some(match e {
                Unbound::NotAmongAnswers => "inject_destination_not_resolved",
                Unbound::ResolveFailed(_) => "inject_destination_resolve_failed",
            });
        }
        match gate {
            None => {
                for inj in &rule.inject {
                    parts.headers.insert(inj.header.clone(), inj.value.clone());
                    app.metrics.injections.inc();
                }
                rec.set(
                    &["credentials", "injected"],
                    json!(rule.inject.iter().map(|i| i.header.as_str()).collect::<Vec<_>>()),
                );
                rec.set(
                    &["credentials", "secret_ids"],
                    json!(rule.inject.iter().map(|i| &i.fingerprint).collect::<Vec<_>>()),
                );
            }
            Some(reason) => {
                app.metrics.injections_dropped.inc();
                rec.set(&["security", "reason"], json!(reason));
                rec.set(&["security", "inject_dropped"], json!(true));
                rec.set(
                    &["security", "inject_skipped"],
                    json!(rule.inject.iter().map(|i| i.header.as_str()).collect::<Vec<_>>()),
                );
                rec.set(
                    &["credentials", "secret_ids"],
                    json!(rule.inject.iter().map(|i| &i.fingerprint).collect::<Vec<_>>()),
                );
                let mut ev = rec.rec.clone();
                ev["event"] = json!("security_event");
                app.audit.write(ev);
            }
        }
    }
    if !parts.headers.contains_key(header::HOST)
        && let Some(h) = host.as_deref().and_then(|h| HeaderValue::from_str(h).ok())
    {
        parts.headers.insert(header::HOST, h);
    }
    let authority = match (ctx.scheme, &ctx.sni) {
        (Scheme::Https, Some(sni)) => format!("{sni}:{}", ctx.dst.port()),
        _ => ctx.dst.to_string(),
    };
    let pq = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/").to_string();
    parts.uri = match Uri::builder().scheme(ctx.scheme.as_str()).authority(authority).path_and_query(pq).build() {
        Ok(u) => u,
        Err(_) => return plain(StatusCode::BAD_REQUEST, "bad request target"),
    };
    parts.version = http::Version::HTTP_11;
    let audit_level = rule.audit;
    // Room for the upstream socket first: a refused request writes no start record (R24).
    let place = match UpstreamPlace::take(&app, &ctx) {
        Ok(p) => p,
        Err(why) => {
            let reason = format!("upstream_{}", why.as_str());
            app.metrics.connections_refused.with_label_values(&[reason.as_str()]).inc();
            tracing::debug!(sandbox = %ctx.sandbox, reason, "request refused: no room for its upstream socket");
            rec.set(&["http", "status"], json!(503));
            rec.set(&["security", "reason"], json!(reason));
            rec.set(&["policy", "duration_us"], json!(started.elapsed().as_micros() as u64));
            if audit_level != AuditLevel::None {
                app.audit.write(rec.rec);
            }
            return plain(StatusCode::SERVICE_UNAVAILABLE, "cube-egress: connection limit");
        }
    };
    // The world sees nothing whose record a crash could lose: `http_request_start` (everything
    // known before forwarding) is in the kernel before the request leaves; `http_request`
    // follows when the response ends (E20). No record, no request: fail closed.
    if audit_level != AuditLevel::None {
        let mut start = rec.rec.clone();
        start["event"] = json!("http_request_start");
        start["policy"]["duration_us"] = json!(started.elapsed().as_micros() as u64);
        if let Err(e) = app.audit.write_durable(start).await {
            app.metrics.audit_refused.with_label_values(&[e.reason()]).inc();
            tracing::warn!(sandbox = %ctx.sandbox, error = %e, "request refused: audit record not written");
            rec.set(&["http", "status"], json!(503));
            rec.set(&["security", "reason"], json!("audit_unavailable"));
            rec.set(&["security", "error"], json!(e.to_string()));
            rec.set(&["policy", "duration_us"], json!(started.elapsed().as_micros() as u64));
            app.audit.write(rec.rec);
            return plain(StatusCode::SERVICE_UNAVAILABLE, "cube-egress: audit log unavailable");
        }
    }
    let req_bytes = Arc::new(AtomicU64::new(0));
    let body = CountingBody { inner: body, count: req_bytes.clone(), done: None, _place: None };
    let up_start = Instant::now();
    let res =
        tokio::time::timeout(UPSTREAM_HEADERS_TIMEOUT, ctx.client.request(Request::from_parts(parts, body))).await;
    let fail = |mut rec: Record, status: StatusCode, kind: &str, err: String| {
        app.metrics.upstream_errors.with_label_values(&[kind]).inc();
        rec.set(&["http", "status"], json!(status.as_u16()));
        rec.set(&["policy", "duration_us"], json!(started.elapsed().as_micros() as u64));
        rec.set(&["security", "upstream_status"], json!(status.as_u16()));
        rec.set(&["security", "upstream_addr"], json!(ctx.dst.to_string()));
        let mut ev = rec.rec.clone();
        ev["event"] = json!("security_event");
        ev["security"]["reason"] = json!("upstream_unreachable_or_unverified");
        ev["security"]["error"] = json!(err);
        app.audit.write(ev);
        if audit_level != AuditLevel::None {
            app.audit.write(rec.rec);
        }
        app.metrics.request_seconds.observe(started.elapsed().as_secs_f64());
        plain(status, &format!("cube-egress: upstream {kind} error"))
    };
    let resp = match res {
        Err(_) => return fail(rec, StatusCode::GATEWAY_TIMEOUT, "timeout", "no response headers in time".into()),
        Ok(Err(e)) => {
            let msg = format!("{:?}", e);
            let kind =
                if msg.contains("InvalidCertificate") || msg.contains("certificate") || msg.contains("AlertReceived") {
                    "tls"
                } else if e.is_connect() {
                    "connect"
                } else {
                    "other"
                };
            tracing::info!(sandbox = %ctx.sandbox, dst = %ctx.dst, error = %msg, "upstream failed");
            return fail(rec, StatusCode::BAD_GATEWAY, kind, msg);
        }
        Ok(Ok(r)) => r,
    };
    app.metrics.upstream_seconds.observe(up_start.elapsed().as_secs_f64());
    app.metrics.request_seconds.observe(started.elapsed().as_secs_f64());
    let (mut parts, body) = resp.into_parts();
    strip(&mut parts.headers);
    rec.set(&["http", "status"], json!(parts.status.as_u16()));
    rec.set(&["policy", "duration_us"], json!(started.elapsed().as_micros() as u64));
    let done = (audit_level != AuditLevel::None).then(|| AuditOnDrop { app: app.clone(), rec: rec.rec, req_bytes });
    let body = CountingBody { inner: body, count: Arc::new(AtomicU64::new(0)), done, _place: Some(place) };
    Response::from_parts(parts, body.boxed_unsync())
}

fn strip(h: &mut HeaderMap) {
    // Headers named by `Connection` are hop-by-hop too.
    let named: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .filter(|s| !s.is_empty())
        .collect();
    for n in STRIP.iter().copied().chain(named.iter().map(String::as_str)) {
        while h.remove(n).is_some() {}
    }
}

/// Writes the request's audit record when the response body is finished or dropped.
struct AuditOnDrop {
    app: Arc<App>,
    rec: Value,
    req_bytes: Arc<AtomicU64>,
}

/// A body that counts data bytes as they stream through (no buffering).
struct CountingBody<B> {
    inner: B,
    count: Arc<AtomicU64>,
    done: Option<AuditOnDrop>,
    /// The response's upstream place, given back with the body (R24).
    _place: Option<UpstreamPlace>,
}

impl<B> Drop for CountingBody<B> {
    fn drop(&mut self) {
        if let Some(mut d) = self.done.take() {
            d.rec["http"]["resp_bytes"] = json!(self.count.load(Ordering::Relaxed));
            d.rec["http"]["req_bytes"] = json!(d.req_bytes.load(Ordering::Relaxed));
            d.app.audit.write(d.rec);
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for CountingBody<B> {
    type Data = Bytes;
    type Error = B::Error;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let p = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &p
            && let Some(d) = f.data_ref()
        {
            self.count.fetch_add(d.len() as u64, Ordering::Relaxed);
        }
        p
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gates() {
        assert_eq!(inject_gate("GET", Scheme::Https, Some("api.test"), Some("API.test:443"), false), None);
        assert_eq!(
            inject_gate("GET", Scheme::Https, Some("api.test"), Some("evil.test"), false),
            Some("g4_host_sni_mismatch")
        );
        assert_eq!(inject_gate("GET", Scheme::Https, None, Some("api.test"), false), Some("inject_missing_sni"));
        assert_eq!(
            inject_gate("GET", Scheme::Http, None, Some("api.test"), false),
            Some("inject_plain_http_not_allowed")
        );
        assert_eq!(inject_gate("POST", Scheme::Http, None, Some("api.test"), true), None);
        assert_eq!(inject_gate("GET", Scheme::Http, None, None, true), Some("inject_missing_host"));
        for m in ["TRACE", "trace", "Trace"] {
            assert_eq!(
                inject_gate(m, Scheme::Https, Some("api.test"), Some("api.test"), false),
                Some("inject_trace_method")
            );
        }
    }

    #[test]
    fn ambiguous_hosts() {
        let req = |target: &str, hosts: &[&[u8]]| {
            let mut b = Request::builder().uri(target);
            for h in hosts {
                b = b.header(header::HOST, HeaderValue::from_bytes(h).unwrap());
            }
            b.body(()).unwrap()
        };
        assert!(!ambiguous_host(&req("/", &[b"api.test"])));
        assert!(!ambiguous_host(&req("/", &[])));
        assert!(!ambiguous_host(&req("http://api.test/x", &[])));
        assert!(!ambiguous_host(&req("http://API.test:80/x", &[b"api.test."])));
        assert!(ambiguous_host(&req("/", &[b"api.test", b"evil.test"])));
        assert!(ambiguous_host(&req("/", &[b"api.test", b"api.test"])));
        assert!(ambiguous_host(&req("http://evil.test/x", &[b"api.test"])));
        assert!(ambiguous_host(&req("http://api.test/x", &[b"api.test\xff"])));
    }

    #[test]
    fn strips_hop_by_hop_and_forwarding_headers() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-custom"),
            ("x-custom", "1"),
            ("x-forwarded-for", "1.2.3.4"),
            ("x-real-ip", "1.2.3.4"),
            ("forwarded", "for=1.2.3.4"),
            ("accept", "*/*"),
        ] {
            h.append(k, HeaderValue::from_static(v));
        }
        strip(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("accept"));
    }
}
