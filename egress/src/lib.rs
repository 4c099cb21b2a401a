//! CubeEgress: the transparent L7 egress gateway of a CubeSandbox node.
//!
//! Sandbox HTTP/HTTPS flows steered by the datapath arrive through TPROXY
//! (`scripts/cube-egress-net.sh`) on transparent listeners; each request is checked against its
//! sandbox's policy ([`policy`]), HTTPS is intercepted with leaves minted from the node CA
//! ([`certs`]), credentials are injected under gates, and every request and security event is
//! written to a JSON Lines audit log ([`audit`]). Policies are managed through the admin API
//! ([`admin`]) and loaded at start from the agent's dump ([`bootstrap`]), or taken with the
//! listening sockets from a predecessor in a swap ([`handoff`]). The original destination
//! must belong to the name a decision was made on ([`dest`], resolving with [`dns`]). No group of
//! sandboxes can take another's connections or audit queue: both are shared by a floor per
//! sandbox and a ceiling ([`floor`], [`conns`]). Behaviour follows
//! `reference/upstream.md §4` unless a decision in `docs/decisions.md` (E-entries) says otherwise.

pub mod accept_rate;
pub mod admin;
pub mod audit;
pub mod bootstrap;
pub mod certs;
pub mod config;
pub mod conns;
pub mod dest;
pub mod dns;
pub mod floor;
pub mod handoff;
pub mod handshakes;
pub mod metrics;
pub mod net;
/// The rule model lives in the shared `egress-policy` crate (the agent validates with it too).
pub use egress_policy as policy;
pub mod proxy;
pub mod sessions;
pub mod store;
pub mod tickets;
pub mod upstream;

use std::{
    net::Ipv4Addr,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use hyper_util::rt::TokioIo;
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
    /// Upstream TLS client configs (ALPN h2, http/1.1), one session store per sandbox (R84).
    pub upstream_tls: upstream::UpstreamTls,
    /// Upstream connect timeout.
    pub connect_timeout: Duration,
    /// Destination binding (resolver cache, learned addresses).
    pub dest: dest::Destinations,
    /// Set while (and after) the state is handed to a successor: admin changes get 503 (E18).
    pub admin_frozen: RwLock<bool>,
    /// `true` once the process drains; every open connection holds a receiver (E19).
    pub drain: watch::Sender<bool>,
    /// The sandbox CIDR (network, mask; host order): never dialled upstream (R17).
    sandbox_net: (Ipv4Addr, u32),
    /// The node's always-denied destinations (network, mask; host order): never dialled (R30).
    /// Replaced as a whole by a SIGHUP reload (R51); live connections watch it.
    always_denied: watch::Sender<Arc<Vec<(Ipv4Addr, u32)>>>,
    /// Uids besides root and ours whose loopback clients the admin API serves (R50).
    allowed_peer_uids: Vec<u32>,
    /// Live proxy connections per sandbox, bounded by budget (R18), floor and ceiling (R22).
    pub conns: Arc<conns::ConnBudget>,
    /// Client TLS handshakes in progress per sandbox, at most `handshakes_per_sandbox` (R90).
    pub handshakes: Arc<handshakes::HandshakeGate>,
    /// New proxy connections per sandbox and second, checked at accept (R102).
    pub accept_rate: accept_rate::AcceptRate,
    /// When the drain started (set once, just before `drain` turns `true`).
    pub drain_at: std::sync::OnceLock<std::time::Instant>,
    ids: AtomicU64,
}

impl App {
    /// Builds the shared state: loads the CA (errors: see [`Ca::load`]), opens the audit log,
    /// builds the upstream trust store.
    pub fn new(cfg: &Config) -> anyhow::Result<App> {
        let t0 = std::time::Instant::now();
        let ms = |from: std::time::Instant| from.elapsed().as_secs_f64() * 1e3;
        let metrics = Metrics::new();
        let ca = Arc::new(Ca::load(&cfg.ca_dir)?);
        let ca_ms = ms(t0);
        let t1 = std::time::Instant::now();
        let store = PolicyStore::default();
        let share = audit::QueueShare { floor: cfg.audit_floor_per_sandbox, members: store.members() };
        let audit = AuditLog::open(&cfg.audit_file, cfg.audit_queue_capacity, share, metrics.audit_dropped.clone())
            .with_context(|| format!("open audit {}", cfg.audit_file.display()))?;
        let audit_ms = ms(t1);
        // The descriptor limit in force after raising it bounds every sandbox's connections
        // together (R22) and, by default, each one's (R18).
        let nofile = conns::raise_nofile();
        let per_sandbox = match cfg.max_conns_per_sandbox {
            0 => conns::ConnBudget::auto(nofile),
            n => n,
        };
        let conns = conns::ConnBudget::new(
            conns::ConnBudget::capacity_for(nofile),
            cfg.conn_floor_per_sandbox,
            per_sandbox,
            store.members(),
        );
        tracing::info!(
            nofile,
            capacity = conns.pool().capacity(),
            floor = cfg.conn_floor_per_sandbox,
            per_sandbox,
            "connection budget"
        );
        let t2 = std::time::Instant::now();
        let mut tls = certs::upstream_client_config(cfg.upstream_extra_ca.as_deref())?;
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        tracing::info!(ca_ms, audit_ms, trust_store_ms = ms(t2), total_ms = ms(t0), "gateway state built");
        Ok(App {
            store,
            certs: CertCache::new(ca, cfg.cert_cache_size, cfg.mint_rate_per_sec, cfg.mint_burst, metrics.clone()),
            metrics,
            audit,
            upstream_tls: upstream::UpstreamTls::new(tls),
            connect_timeout: cfg.connect_timeout(),
            dest: dest::Destinations::new(cfg.dns_servers()?, Duration::from_millis(cfg.dns_timeout_ms)),
            admin_frozen: RwLock::new(false),
            drain: watch::channel(false).0,
            sandbox_net: config::network_of(&cfg.sandbox_cidr)?,
            always_denied: watch::channel(Arc::new(cfg.always_denied()?)).0,
            allowed_peer_uids: cfg.allowed_peer_uids.clone(),
            conns,
            handshakes: handshakes::HandshakeGate::new(cfg.handshakes_per_sandbox),
            accept_rate: accept_rate::AcceptRate::new(
                cfg.new_conns_per_sandbox_per_sec,
                cfg.new_conns_burst_per_sandbox,
            ),
            drain_at: std::sync::OnceLock::new(),
            ids: AtomicU64::new(
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_micros()
                    as u64,
            ),
        })
    }

    /// Why the gateway never dials `ip`, whatever a rule or a learned name says, as the audit
    /// `security.reason`: `destination_is_sandbox` for the sandbox CIDR (a sandbox or cube-dev
    /// address, decision R17), `destination_always_denied` for `always_denied_cidrs` (the
    /// node's list, cloud metadata and the like, R31); `None` when it may be dialled.
    pub fn never_dialled(&self, ip: Ipv4Addr) -> Option<&'static str> {
        let covers = |&(net, mask): &(Ipv4Addr, u32)| u32::from(ip) & mask == u32::from(net);
        if covers(&self.sandbox_net) {
            Some("destination_is_sandbox")
        } else if self.always_denied.borrow().iter().any(covers) {
            Some("destination_always_denied")
        } else {
            None
        }
    }

    /// Replaces the always-denied list in one step (R51): every check after this call sees
    /// the new list, and every live connection re-checks its original destination
    /// ([`App::until_denied`]).
    pub fn set_always_denied(&self, list: Vec<(Ipv4Addr, u32)>) {
        self.always_denied.send_replace(Arc::new(list));
    }

    /// A receiver of always-denied list replacements, subscribed now: give it to
    /// [`App::until_denied`] before the first check of a destination, so that no replacement
    /// between that check and the wait goes unseen.
    pub fn denied_changes(&self) -> watch::Receiver<Arc<Vec<(Ipv4Addr, u32)>>> {
        self.always_denied.subscribe()
    }

    /// Resolves once a list replaced after `rx` was subscribed ([`App::denied_changes`]) covers
    /// `ip` (never while none does). A connection to `ip` that awaits this closes when its
    /// destination becomes listed.
    pub async fn until_denied(&self, mut rx: watch::Receiver<Arc<Vec<(Ipv4Addr, u32)>>>, ip: Ipv4Addr) {
        loop {
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
            if self.never_dialled(ip) == Some("destination_always_denied") {
                return;
            }
        }
    }

    /// A process-unique id (connection ids in audit `request_id`s).
    pub fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether the connection `conn_id` should close after its current response: the drain
    /// started at least [`drain_offset`]`(conn_id)` ago (E21).
    pub fn close_due(&self, conn_id: u64) -> bool {
        *self.drain.borrow() && self.drain_at.get().is_some_and(|t| t.elapsed() >= drain_offset(conn_id))
    }

    /// Starts the drain (idempotent): records its start, then tells every connection.
    pub fn start_drain(&self) {
        let _ = self.drain_at.set(std::time::Instant::now());
        self.drain.send_replace(true);
    }
}

/// How long a connection may stay open after the drain started (or after it was accepted,
/// when later) before it is asked to shut down gracefully: HTTP/1 keep-alive connections that
/// send a request in that time get it answered with `Connection: close` (the client reconnects
/// — to the successor after a swap); those still idle then are closed; HTTP/2 gets GOAWAY
/// (E19). Bounded by `drain_timeout_secs`. Each connection adds its [`drain_offset`].
pub const DRAIN_IDLE_GRACE: Duration = Duration::from_secs(2);

/// Width of the window over which a drain spreads its connections' reconnects (E21): a
/// connection's responses carry `Connection: close` only from `drain start +
/// drain_offset(conn_id)` on, and its idle close / GOAWAY comes [`DRAIN_IDLE_GRACE`] later,
/// so N keep-alive clients reconnect to the successor at about N per this window instead of
/// all at once.
pub const DRAIN_SPREAD: Duration = Duration::from_secs(1);

/// Where in [`DRAIN_SPREAD`] the connection `conn_id` is asked to reconnect: a fraction in
/// `[0, 1)` of it from Fibonacci hashing of the id, so successive ids (the gateway's ids are
/// sequential) land far apart and N connections cover the window about evenly.
pub fn drain_offset(conn_id: u64) -> Duration {
    let frac = (conn_id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) as f64 / (1u64 << 53) as f64;
    DRAIN_SPREAD.mul_f64(frac)
}

/// Resolves [`DRAIN_IDLE_GRACE`] + `offset` after the drain started (never, while it has not).
pub(crate) async fn drain_started(drain: &mut watch::Receiver<bool>, offset: Duration) {
    if drain.wait_for(|d| *d).await.is_err() {
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(DRAIN_IDLE_GRACE + offset).await;
}

async fn serve_admin(app: Arc<App>, s: tokio::net::TcpStream, mut drain: watch::Receiver<bool>) {
    // Loopback is every local process: only root, our uid and `allowed_peer_uids` may read or
    // change policies and learned addresses (R43, R50). The client socket's owner, from this
    // namespace's socket table.
    let uids = app.allowed_peer_uids.clone();
    let trusted = match (s.peer_addr(), s.local_addr()) {
        (Ok(peer), Ok(local)) => tokio::task::spawn_blocking(move || {
            cubenet_sys::peer_uid::allowed_with(cubenet_sys::peer_uid::owner_here(peer, local), &uids)
        })
        .await
        .unwrap_or(false),
        _ => false,
    };
    let svc = hyper::service::service_fn(move |req| {
        let app = app.clone();
        async move { Ok::<_, std::convert::Infallible>(admin::handle(app, req, trusted).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc);
    tokio::pin!(conn);
    let _ = tokio::select! {
        r = conn.as_mut() => r,
        () = drain_started(&mut drain, Duration::ZERO) => {
            conn.as_mut().graceful_shutdown();
            conn.as_mut().await
        }
    };
}

async fn accept_loop(app: Arc<App>, l: TcpListener, scheme: Option<Scheme>, mut stop: watch::Receiver<bool>) {
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
        // Held by the connection task until it ends: the drain waits for every one of them.
        let drain = app.drain.subscribe();
        match scheme {
            Some(sc) => {
                // No sandbox, nor any group of them, may hold every descriptor of the process
                // (R18, R22).
                let peer = match s.peer_addr() {
                    Ok(std::net::SocketAddr::V4(p)) => *p.ip(),
                    _ => continue,
                };
                // Over its rate (R102): reset now, before a task, a read or any TLS work; the
                // zero linger leaves no TIME_WAIT behind.
                if !app.accept_rate.admit(peer) {
                    app.metrics.connections_refused.with_label_values(&["sandbox_rate"]).inc();
                    let _ = s.set_zero_linger();
                    continue;
                }
                let slot = match app.conns.admit(peer) {
                    Ok(slot) => slot,
                    Err(why) => {
                        app.metrics.connections_refused.with_label_values(&[why.as_str()]).inc();
                        tracing::debug!(sandbox = %peer, reason = why.as_str(), "connection refused at accept");
                        continue;
                    }
                };
                let app = app.clone();
                tokio::spawn(async move {
                    proxy::serve_conn(app, s, sc, drain).await;
                    drop(slot);
                })
            }
            None => tokio::spawn(serve_admin(app.clone(), s, drain)),
        };
    }
}

/// The listeners of this process: taken from a predecessor (with its state installed) or bound.
async fn listeners(
    app: &Arc<App>,
    cfg: &Config,
    phases: &mut Phases,
) -> anyhow::Result<(Listeners, Option<handoff::ReadySignal>)> {
    let taken = match cfg.takeover_socket.clone() {
        Some(p) => {
            let optional = cfg.takeover_optional;
            tokio::task::spawn_blocking(move || handoff::take(&p, optional)).await??
        }
        None => None,
    };
    let spawn_bootstrap = || {
        tokio::spawn(bootstrap::run(
            app.clone(),
            cfg.bootstrap_url.clone(),
            cfg.bootstrap_attempts,
            Duration::from_secs(cfg.bootstrap_retry_secs),
        ))
    };
    let Some(t) = taken else {
        spawn_bootstrap();
        let gw = cfg.gateway_ip()?;
        let l = Listeners {
            http: net::bind((gw, cfg.http_port).into(), true)?,
            https: net::bind((gw, cfg.https_port).into(), true)?,
            admin: net::bind(cfg.admin_addr, false)?,
        };
        return Ok((l, None));
    };
    phases.mark("take");
    let handoff::Taken { listeners, state, extras, ready } = t;
    match state {
        Some(st) => {
            let (policies, learned) = (st.policies.len(), st.learned.len());
            let leaves = st.leaf_names.clone();
            let status = st.install(app).context("install the predecessor's state")?;
            phases.mark("install");
            let got = extras.map(|x| x.install(app)).unwrap_or_default();
            phases.mark("extras");
            let minted = app.certs.premint(&leaves).await;
            phases.mark("premint");
            tracing::info!(
                policies,
                learned,
                ticket_keys = got.ticket_keys,
                leaves_taken = got.leaves,
                tls12_sessions = got.tls12_sessions,
                minted = minted.saturating_sub(got.leaves),
                predecessor_status = status.as_str(),
                "state taken over"
            );
            if status.serving() {
                app.store.set_status(status);
            } else {
                // The predecessor had no authoritative policies either: bootstrap as usual.
                spawn_bootstrap();
            }
        }
        None => {
            tracing::warn!("version-1 predecessor: no state handed over; bootstrapping (fail closed until ready)");
            spawn_bootstrap();
        }
    }
    Ok((listeners, Some(ready)))
}

/// Runs the gateway until SIGTERM/SIGINT (or a hand-over to a successor), then drains in-flight
/// requests for at most `drain_timeout_secs` and flushes the audit log.
///
/// With `takeover_socket`, the predecessor's listeners and state are installed and the
/// predecessor told READY before anything is accepted ([`handoff`]); an error before that
/// (bad state, handoff socket not bindable) exits without serving and leaves the predecessor
/// serving.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    run_reloadable(cfg, None).await
}

/// Reads the configuration again (the file, with the environment and flags over it).
pub type Loader = Box<dyn Fn() -> anyhow::Result<Config> + Send + Sync>;

/// [`run`], with SIGHUP re-reading the configuration through `load` (`None`: no file, a
/// SIGHUP is logged and ignored) and applying its `always_denied_cidrs` ([`reload`], R51).
pub async fn run_reloadable(cfg: Config, load: Option<Loader>) -> anyhow::Result<()> {
    let mut phases = Phases::new();
    // Installed first: SIGHUP's default action would end the gateway.
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    let app = Arc::new(App::new(&cfg)?);
    phases.mark("app");
    let (listeners, ready) = listeners(&app, &cfg, &mut phases).await?;
    let handoff = match &cfg.handoff_socket {
        Some(p) => {
            let l = net::handoff_listener(p)?;
            let ino = std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).ok();
            Some((tokio::net::UnixListener::from_std(l)?, p.clone(), ino))
        }
        None => None,
    };
    if let Some(r) = ready {
        r.send().context("tell the predecessor we are ready")?;
        phases.mark("ready");
        tracing::info!(socket = ?cfg.takeover_socket, "took over listeners and state from predecessor");
    }
    phases.log();
    tracing::info!(
        http = %listeners.http.local_addr()?, https = %listeners.https.local_addr()?,
        admin = %listeners.admin.local_addr()?, ca_expires_in_days = app.certs_ca_days(), "cube-egress listening"
    );
    let listeners = Arc::new(listeners);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    for (l, sc) in [
        (listeners.http.try_clone()?, Some(Scheme::Http)),
        (listeners.https.try_clone()?, Some(Scheme::Https)),
        (listeners.admin.try_clone()?, None),
    ] {
        let l = TcpListener::from_std(l)?;
        tasks.push(tokio::spawn(accept_loop(app.clone(), l, sc, stop_rx.clone())));
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let reason = loop {
        tokio::select! {
            _ = term.recv() => break "SIGTERM",
            _ = int.recv() => break "SIGINT",
            _ = hup.recv() => reload(&app, &cfg, load.as_deref()),
            r = async { match &handoff { Some((h, _, _)) => h.accept().await, None => std::future::pending().await } } => {
                match r.and_then(|(s, _)| s.into_std()) {
                    Ok(s) if !net::peer_allowed(&s) => {
                        let uid = net::peer_uid(&s).ok();
                        tracing::warn!(?uid, "handoff refused: peer is neither our uid nor root");
                        app.audit.security_event("handoff_peer_refused", "", serde_json::json!({"peer": {"uid": uid}}));
                    }
                    Ok(s) => match offer(&app, &listeners, s).await {
                        Ok(()) => break "handoff",
                        Err(e) => {
                            tracing::warn!(error = %format!("{e:#}"), "handoff failed; still serving");
                            app.audit.security_event(
                                "handoff_aborted", "", serde_json::json!({"handoff": {"error": format!("{e:#}")}}),
                            );
                        }
                    },
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
    if let Some((h, p, ino)) = handoff {
        drop(h);
        // A successor may already have placed its own socket at the same path: only ours goes.
        let now = std::fs::metadata(&p).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).ok();
        if now.is_some() && now == ino {
            let _ = std::fs::remove_file(&p);
        }
    }
    app.start_drain();
    match tokio::time::timeout(Duration::from_secs(cfg.drain_timeout_secs), app.drain.closed()).await {
        Ok(()) => tracing::info!("drained"),
        Err(_) => tracing::warn!("drain deadline reached; closing remaining connections"),
    }
    let a = app.clone();
    if !tokio::task::spawn_blocking(move || a.audit.flush(Duration::from_secs(5))).await.unwrap_or(false) {
        tracing::warn!("audit log not flushed in 5 s");
    }
    Ok(())
}

/// Keys whose value differs between `old` and `new`, `always_denied_cidrs` excluded (the
/// one key a reload applies), sorted.
pub fn restart_keys(old: &Config, new: &Config) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) =
        (serde_json::to_value(old), serde_json::to_value(new))
    else {
        return Vec::new();
    };
    let mut keys: Vec<String> = a
        .iter()
        .filter(|(k, v)| *k != "always_denied_cidrs" && b.get(*k) != Some(*v))
        .map(|(k, _)| k.clone())
        .collect();
    keys.sort();
    keys
}

/// One SIGHUP (R51): re-reads the configuration; a valid one's `always_denied_cidrs` replaces
/// the list at once (live connections to a newly listed address close, [`App::until_denied`]);
/// any other changed key is logged as needing a restart; an invalid one changes nothing.
pub fn reload(app: &App, running: &Config, load: Option<&(dyn Fn() -> anyhow::Result<Config> + Send + Sync)>) {
    let Some(load) = load else {
        tracing::warn!("SIGHUP: no --config file, nothing to reload");
        app.metrics.config_reloads.with_label_values(&["no_file"]).inc();
        return;
    };
    let new = match load().and_then(|c| Ok((c.always_denied()?, c))) {
        Ok(v) => v,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "SIGHUP: configuration invalid; always_denied_cidrs unchanged");
            app.metrics.config_reloads.with_label_values(&["invalid"]).inc();
            return;
        }
    };
    let (list, c) = new;
    for k in restart_keys(running, &c) {
        tracing::warn!(key = %k, "SIGHUP: config key changed, needs a restart (not applied)");
    }
    app.set_always_denied(list);
    tracing::info!(always_denied = ?c.always_denied_cidrs, "SIGHUP: always-denied list reloaded");
    app.metrics.config_reloads.with_label_values(&["applied"]).inc();
}

/// Offers listeners and a frozen snapshot of the state to a connected successor; unfreezes
/// when the successor does not take over.
async fn offer(app: &Arc<App>, l: &Arc<Listeners>, s: std::os::unix::net::UnixStream) -> anyhow::Result<()> {
    let state = {
        let mut frozen = app.admin_frozen.write().unwrap_or_else(|e| e.into_inner());
        *frozen = true;
        handoff::HandoffState::capture(app)
    };
    let (l, a) = (l.clone(), app.clone());
    let extras = move || handoff::HandoffExtras::capture(&a);
    let res =
        tokio::task::spawn_blocking(move || handoff::offer(&s, &l, &state, extras)).await.map_err(anyhow::Error::from);
    let res = res.and_then(|r| r);
    if res.is_err() {
        *app.admin_frozen.write().unwrap_or_else(|e| e.into_inner()) = false;
    }
    res
}

/// When this process started `main` (set by the binary; [`Phases`] counts from it).
pub static PROCESS_START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Start-up phases of one process, logged once as `startup phases` with a `phases` field
/// `<phase>=<ms> ...` (milliseconds each took, in order) and `total_ms` from [`PROCESS_START`]:
/// `main` (runtime and config), `app` (CA load, audit open, trust store), and for a successor
/// `take` (connect, receive listeners, state and extras), `install` (policies, learned
/// table), `extras` (ticket keys, leaves, TLS 1.2 sessions), `premint` (names not handed over), `ready`.
pub struct Phases {
    start: std::time::Instant,
    last: std::time::Instant,
    done: Vec<(&'static str, f64)>,
}

impl Phases {
    fn new() -> Phases {
        let now = std::time::Instant::now();
        let start = *PROCESS_START.get().unwrap_or(&now);
        let mut p = Phases { start, last: start, done: Vec::new() };
        if PROCESS_START.get().is_some() {
            p.mark("main");
        }
        p
    }

    fn mark(&mut self, phase: &'static str) {
        let now = std::time::Instant::now();
        self.done.push((phase, (now - self.last).as_secs_f64() * 1e3));
        self.last = now;
    }

    fn log(&self) {
        let phases: Vec<String> = self.done.iter().map(|(p, ms)| format!("{p}={ms:.1}")).collect();
        tracing::info!(
            phases = %phases.join(" "),
            total_ms = (self.last - self.start).as_secs_f64() * 1e3,
            "startup phases"
        );
    }
}

impl App {
    fn certs_ca_days(&self) -> i64 {
        self.certs.ca_expires_in_secs() / 86400
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequential connection ids (how the gateway numbers them) land all over the spread
    /// window, never beyond it: 16 successive ids from any start leave no hole wider than a
    /// quarter of the window (a uniform 1/16 would be 62.5 ms; Fibonacci hashing keeps every
    /// hole within a small factor of that).
    #[test]
    fn only_other_changed_keys_need_a_restart() {
        let old = Config::default();
        let mut new = Config { always_denied_cidrs: vec!["10.0.0.0/8".into()], ..Config::default() };
        assert!(restart_keys(&old, &new).is_empty(), "the list is applied, not a restart key");
        new.mint_burst = 1;
        new.listen_ip = Some(Ipv4Addr::new(10, 0, 0, 1));
        new.allowed_peer_uids = vec![1001];
        assert_eq!(restart_keys(&old, &new), ["allowed_peer_uids", "listen_ip", "mint_burst"]);
    }

    #[test]
    fn drain_offsets_cover_the_window() {
        for base in [0u64, 1, 1_733_000_000_000_000, u64::MAX - 20] {
            let mut v: Vec<Duration> = (0..16).map(|i| drain_offset(base.wrapping_add(i))).collect();
            assert!(v.iter().all(|d| *d < DRAIN_SPREAD), "{v:?}");
            v.sort();
            let holes = v.windows(2).map(|w| w[1] - w[0]).chain([v[0] + DRAIN_SPREAD - v[15]]);
            let widest = holes.max().unwrap();
            assert!(widest <= DRAIN_SPREAD / 4, "base {base}: widest hole {widest:?} in {v:?}");
        }
        assert_eq!(drain_offset(0), Duration::ZERO);
    }
}
