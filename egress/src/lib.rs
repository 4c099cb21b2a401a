//! CubeEgress: the transparent L7 egress gateway of a CubeSandbox node.
//!
//! Sandbox HTTP/HTTPS flows steered by the datapath arrive through TPROXY
//! (`scripts/cube-egress-net.sh`) on transparent listeners; each request is checked against its
//! sandbox's policy ([`policy`]), HTTPS is intercepted with leaves minted from the node CA
//! ([`certs`]), credentials are injected under gates, and every request and security event is
//! written to a JSON Lines audit log ([`audit`]). Policies are managed through the admin API
//! ([`admin`]) and loaded at start from the agent's dump ([`bootstrap`]). The original destination
//! must belong to the name a decision was made on ([`dest`], resolving with [`dns`]). Behaviour follows
//! `reference/upstream.md §4` unless a decision in `docs/decisions.md` (E-entries) says otherwise.

pub mod admin;
pub mod audit;
pub mod bootstrap;
pub mod certs;
pub mod config;
pub mod dest;
pub mod dns;
pub mod metrics;
pub mod net;
pub mod policy;
pub mod proxy;
pub mod store;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use hyper_util::{rt::TokioIo, server::graceful::GracefulShutdown};
use tokio::{net::TcpListener, sync::watch};

use crate::{
    audit::AuditLog,
    certs::{Ca, CertCache},
    config::Config,
    metrics::Metrics,
    net::Listeners,
    policy::Scheme,
    store::PolicyStore,
};

/// Shared state of one gateway process.
pub struct App {
    /// Policies and bootstrap status.
    pub store: PolicyStore,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Audit log.
    pub audit: AuditLog,
    /// Leaf cache / minting.
    pub certs: CertCache,
    /// Upstream TLS client config (ALPN h2, http/1.1).
    pub upstream_tls: Arc<rustls::ClientConfig>,
    /// Upstream connect timeout.
    pub connect_timeout: Duration,
    /// Destination binding (resolver cache, learned addresses).
    pub dest: dest::Destinations,
    ids: AtomicU64,
}

impl App {
    /// Builds the shared state: loads the CA (errors: see [`Ca::load`]), opens the audit log,
    /// builds the upstream trust store.
    pub fn new(cfg: &Config) -> anyhow::Result<App> {
        let metrics = Metrics::new();
        let ca = Arc::new(Ca::load(&cfg.ca_dir)?);
        let audit = AuditLog::open(&cfg.audit_file, cfg.audit_queue_capacity, metrics.audit_dropped.clone())
            .with_context(|| format!("open audit {}", cfg.audit_file.display()))?;
        let mut tls = certs::upstream_client_config(cfg.upstream_extra_ca.as_deref())?;
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(App {
            store: PolicyStore::default(),
            certs: CertCache::new(ca, cfg.cert_cache_size, cfg.mint_rate_per_sec, cfg.mint_burst, metrics.clone()),
            metrics,
            audit,
            upstream_tls: Arc::new(tls),
            connect_timeout: cfg.connect_timeout(),
            dest: dest::Destinations::new(cfg.dns_servers()?, Duration::from_millis(cfg.dns_timeout_ms)),
            ids: AtomicU64::new(
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_micros()
                    as u64,
            ),
        })
    }

    /// A process-unique id (connection ids in audit `request_id`s).
    pub fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }
}

async fn accept_loop(
    app: Arc<App>,
    l: TcpListener,
    scheme: Option<Scheme>,
    graceful: Arc<GracefulShutdown>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let (s, _) = tokio::select! {
            _ = stop.changed() => return,
            r = l.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let app = app.clone();
        let watcher = graceful.watcher();
        match scheme {
            Some(sc) => {
                tokio::spawn(proxy::serve_conn(app, s, sc, watcher));
            }
            None => {
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let app = app.clone();
                        async move { Ok::<_, std::convert::Infallible>(admin::handle(app, req).await) }
                    });
                    let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc);
                    let _ = watcher.watch(conn).await;
                });
            }
        }
    }
}

/// How long a successor (`takeover_socket`) waits for its bootstrap before taking the listeners.
pub const TAKEOVER_BOOTSTRAP_WAIT: Duration = Duration::from_secs(30);

/// Runs the gateway until SIGTERM/SIGINT (or a handoff to a successor), then drains in-flight
/// requests for at most `drain_timeout_secs`.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    let app = Arc::new(App::new(&cfg)?);
    let gw = cfg.gateway_ip()?;
    tokio::spawn(bootstrap::run(
        app.clone(),
        cfg.bootstrap_url.clone(),
        cfg.bootstrap_attempts,
        Duration::from_secs(cfg.bootstrap_retry_secs),
    ));
    let listeners = match &cfg.takeover_socket {
        Some(p) => {
            // Load policies before taking traffic from the predecessor, so the takeover does
            // not turn into a window of fail-closed 403s (bounded wait).
            let deadline = tokio::time::Instant::now() + TAKEOVER_BOOTSTRAP_WAIT;
            while !app.store.status().serving() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let l = net::take_listeners(p)?;
            tracing::info!(socket = %p.display(), "took over listeners from predecessor");
            l
        }
        None => Listeners {
            http: net::bind((gw, cfg.http_port).into(), true)?,
            https: net::bind((gw, cfg.https_port).into(), true)?,
            admin: net::bind(cfg.admin_addr, false)?,
        },
    };
    tracing::info!(
        http = %listeners.http.local_addr()?, https = %listeners.https.local_addr()?,
        admin = %listeners.admin.local_addr()?, ca_expires_in_days = app.certs_ca_days(), "cube-egress listening"
    );
    let graceful = Arc::new(GracefulShutdown::new());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    for (l, sc) in [
        (listeners.http.try_clone()?, Some(Scheme::Http)),
        (listeners.https.try_clone()?, Some(Scheme::Https)),
        (listeners.admin.try_clone()?, None),
    ] {
        let l = TcpListener::from_std(l)?;
        tasks.push(tokio::spawn(accept_loop(app.clone(), l, sc, graceful.clone(), stop_rx.clone())));
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let handoff = match &cfg.handoff_socket {
        Some(p) => Some(tokio::net::UnixListener::from_std(net::handoff_listener(p)?)?),
        None => None,
    };
    let reason = loop {
        tokio::select! {
            _ = term.recv() => break "SIGTERM",
            _ = int.recv() => break "SIGINT",
            r = async { match &handoff { Some(h) => h.accept().await, None => std::future::pending().await } } => {
                match r.and_then(|(s, _)| s.into_std()) {
                    Ok(s) if !net::peer_allowed(&s) => {
                        let uid = net::peer_uid(&s).ok();
                        tracing::warn!(?uid, "handoff refused: peer is neither our uid nor root");
                        app.audit.security_event("handoff_peer_refused", "", serde_json::json!({"peer": {"uid": uid}}));
                    }
                    Ok(s) => {
                        let _ = s.set_nonblocking(false);
                        match net::send_listeners(&s, &listeners) {
                            Ok(()) => break "handoff",
                            Err(e) => tracing::warn!(error = %e, "handoff failed; still serving"),
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "handoff accept failed"),
                }
            }
        }
    };
    tracing::info!(reason, "stopping: no new connections, draining");
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    drop(listeners);
    if let Some(p) = &cfg.handoff_socket {
        let _ = std::fs::remove_file(p);
    }
    let graceful = Arc::try_unwrap(graceful).map_err(|_| anyhow::anyhow!("graceful handle still shared"))?;
    match tokio::time::timeout(Duration::from_secs(cfg.drain_timeout_secs), graceful.shutdown()).await {
        Ok(()) => tracing::info!("drained"),
        Err(_) => tracing::warn!("drain deadline reached; closing remaining connections"),
    }
    Ok(())
}

impl App {
    fn certs_ca_days(&self) -> i64 {
        self.certs.ca_expires_in_secs() / 86400
    }
}
