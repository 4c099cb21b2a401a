//! `network-agent`: the per-node CubeNet daemon. See the README's network-agent section.

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::Parser;
use cubenet_sys::netns::Netns;
use cubevs_common::DatapathConfig;
use network_agent::{
    agent::Agent,
    config::Config,
    cubevs_dp::CubeVsDataplane,
    dataplane::{Dataplane, SnatIp},
    fdserver, grpc,
    host::{HostParams, NetnsHost},
    http,
    state::StateStore,
    uds_authority::NormalizeAuthority,
};
use tokio::net::UnixListener;
use tokio_stream::{StreamExt, wrappers::UnixListenerStream};

/// Command line: `--config PATH`; every other flag overrides the config key of the same name.
#[derive(Parser, Debug)]
#[command(name = "network-agent", version, about = "CubeNet node network agent")]
struct Args {
    /// TOML configuration file (all keys optional; see the README).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Overrides `grpc_listen`.
    #[arg(long)]
    grpc_listen: Option<String>,
    /// Overrides `tap_fd_listen`.
    #[arg(long)]
    tap_fd_listen: Option<PathBuf>,
    /// Overrides `health_listen`.
    #[arg(long)]
    health_listen: Option<String>,
    /// Overrides `dataplane_netns` ("" = the agent's own namespace).
    #[arg(long)]
    dataplane_netns: Option<String>,
    /// Overrides `eth_name`.
    #[arg(long)]
    eth_name: Option<String>,
    /// Overrides `cidr`.
    #[arg(long)]
    cidr: Option<String>,
    /// Overrides `mtu`.
    #[arg(long)]
    mtu: Option<u32>,
    /// Overrides `tap_init_num`.
    #[arg(long)]
    tap_init_num: Option<usize>,
    /// Overrides `bpffs_dir`.
    #[arg(long)]
    bpffs_dir: Option<PathBuf>,
    /// Overrides `bpf_object`.
    #[arg(long)]
    bpf_object: Option<String>,
    /// Overrides `state_dir`.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Overrides `host_port_range`.
    #[arg(long)]
    host_port_range: Option<String>,
    /// Check the configuration and exit.
    #[arg(long)]
    check_config: bool,
    /// Print the effective configuration (file + flags + defaults) as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

fn apply(mut c: Config, a: &Args) -> Config {
    macro_rules! o {
        ($($f:ident),*) => { $( if let Some(v) = &a.$f { c.$f = v.clone(); } )* };
    }
    o!(
        grpc_listen,
        tap_fd_listen,
        health_listen,
        dataplane_netns,
        eth_name,
        cidr,
        bpffs_dir,
        bpf_object,
        state_dir,
        host_port_range
    );
    if let Some(v) = a.mtu {
        c.mtu = v;
    }
    if let Some(v) = a.tap_init_num {
        c.tap_init_num = v;
    }
    c
}

/// Runs one startup step and logs its duration.
fn step<R>(name: &str, f: impl FnOnce() -> anyhow::Result<R>) -> anyhow::Result<R> {
    let t = Instant::now();
    let r = f().with_context(|| format!("startup step `{name}`"));
    match &r {
        Ok(_) => tracing::info!(step = name, ms = t.elapsed().as_secs_f64() * 1e3, "startup step done"),
        Err(e) => tracing::error!(step = name, "startup step failed: {e:#}"),
    }
    r
}

fn main() {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let raw = match &args.config {
        Some(p) => match Config::load(p) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("network-agent: {e}");
                std::process::exit(2);
            }
        },
        None => Config::default(),
    };
    let cfg = match apply(raw, &args).validate() {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("network-agent: {e}");
            std::process::exit(2);
        }
    };
    if args.print_config {
        match toml::to_string(&cfg.raw) {
            Ok(t) => print!("{t}"),
            Err(e) => {
                eprintln!("network-agent: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    if args.check_config {
        println!("configuration ok");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    if let Err(e) = rt.block_on(run(cfg)) {
        eprintln!("network-agent: {e:#}");
        std::process::exit(1);
    }
}

async fn run(cfg: Arc<network_agent::config::Validated>) -> anyhow::Result<()> {
    let raw = &cfg.raw;
    let t_all = Instant::now();
    tracing::info!(dataplane_netns = %raw.dataplane_netns, bpffs_dir = %raw.bpffs_dir.display(), "starting");

    // The dataplane namespace threads (netlink sockets opened there and kept).
    let host = step("enter dataplane netns", || {
        let ns = if raw.dataplane_netns.is_empty() { None } else { Some(Netns::open(&raw.dataplane_netns)?) };
        let params = HostParams { mtu: raw.mtu, mvm_mac: cfg.mvm_mac, cube_dev: raw.cube_dev_name.clone() };
        Ok(Arc::new(NetnsHost::new(ns.as_ref(), raw.warm_parallelism, params)?))
    })?;

    // 1. Datapath: load the programs; pinned links are adopted by the attaches below.
    let dp = step("load datapath", || {
        let dcfg = DatapathConfig {
            mvm_inner_ip: u32::from_ne_bytes(raw.mvm_inner_ip.octets()),
            mvm_gateway_ip: u32::from_ne_bytes(raw.mvm_gw_dest_ip.octets()),
            mvm_mac: cfg.mvm_mac,
            gateway_mac: cfg.gw_mac,
            _pad: [0; 4],
        };
        let obj = (!raw.bpf_object.is_empty()).then(|| PathBuf::from(&raw.bpf_object));
        let reaper = Duration::from_secs(raw.reaper_interval_secs);
        let limit = raw.policy_entries_per_sandbox;
        let attach = match raw.tc_attach.as_str() {
            "tcx" => cubevs::AttachMode::Tcx,
            "legacy" => cubevs::AttachMode::LegacyTc,
            _ => cubevs::AttachMode::Auto,
        };
        Ok(Arc::new(CubeVsDataplane::load(host.clone(), obj, dcfg, attach, raw.bpffs_dir.clone(), reaper, limit)?))
    })?;

    // 2. cube-dev.
    let gw = cfg.gateway_ip();
    step("cube-dev", || {
        host.ensure_cube_dev(cfg.gw_mac, gw, cfg.cidr)?;
        dp.attach_cube_dev(&raw.cube_dev_name, gw)?;
        Ok(())
    })?;

    // 3. Uplink, SNAT address, per-netns sysctls.
    step("uplink", || {
        let eth = if raw.eth_name.is_empty() {
            host.default_route_dev()?.context("no IPv4 default route in the dataplane netns; set eth_name")?
        } else {
            raw.eth_name.clone()
        };
        let (ifindex, ips) = host.link_ipv4(&eth).with_context(|| format!("uplink {eth}"))?;
        if ips.len() != 1 {
            bail!("uplink {eth} must carry exactly one IPv4 address, has {ips:?}");
        }
        dp.attach_uplink(&eth, ips[0])?;
        dp.set_snat_ips(&[SnatIp { ip: ips[0], ifindex }])?;
        if !raw.ip_local_port_range.is_empty() {
            host.netns_sysctl("ipv4/ip_local_port_range", &raw.ip_local_port_range)?;
        }
        tracing::info!(uplink = %eth, ip = %ips[0], "uplink found");
        Ok(())
    })?;

    // 4. State and recovery.
    let agent = step("recover", || {
        let store =
            StateStore::open(&raw.state_dir).with_context(|| format!("state dir {}", raw.state_dir.display()))?;
        let agent = Arc::new(Agent::new(cfg.clone(), host.clone(), dp.clone() as Arc<dyn Dataplane>, store));
        agent.metrics.register_datapath(dp.clone() as Arc<dyn Dataplane>)?;
        let s = agent.recover()?;
        tracing::info!(?s, "recovered");
        match dp.gc_link_pins() {
            Ok(gone) if !gone.is_empty() => tracing::info!(?gone, "removed link pins of vanished interfaces"),
            Ok(_) => {}
            Err(e) => tracing::warn!("link pin GC: {e}"),
        }
        Ok(agent)
    })?;

    // 5. Health first, then gRPC and the fd socket.
    let health = step("health listener", || {
        let l = std::net::TcpListener::bind(&raw.health_listen)
            .with_context(|| format!("bind health_listen {}", raw.health_listen))?;
        l.set_nonblocking(true)?;
        Ok(tokio::net::TcpListener::from_std(l)?)
    })?;
    let health_task = tokio::spawn(http::serve(health, agent.clone()));
    // CubeEgress push client (egress_sync.rs): before gRPC serves, so no Ensure skips it.
    if !raw.cube_egress_admin_url.is_empty() {
        let timeout = std::time::Duration::from_millis(raw.cube_egress_push_timeout_ms);
        let sync = network_agent::egress_sync::EgressSync::new(
            &raw.cube_egress_admin_url,
            timeout,
            tokio::runtime::Handle::current(),
            agent.metrics.clone(),
        )
        .map_err(anyhow::Error::msg)?;
        agent.set_egress_sync(sync.clone());
        tokio::spawn(sync.run(Arc::downgrade(&agent)));
    }

    // grpc.health.v1 ("" and the NetworkAgent service) follows readiness: SERVING only while
    // an Ensure can succeed now (`Agent::readiness`, also `/readyz`).
    let (reporter, health_svc) = tonic_health::server::health_reporter();
    let mut ready_rx = agent.watch_readiness();
    tokio::spawn(async move {
        type Named = cubenet_proto::v1::network_agent_server::NetworkAgentServer<grpc::Service>;
        loop {
            let ready = *ready_rx.borrow_and_update();
            let st = if ready { tonic_health::ServingStatus::Serving } else { tonic_health::ServingStatus::NotServing };
            reporter.set_service_status("", st).await;
            if ready {
                reporter.set_serving::<Named>().await;
            } else {
                reporter.set_not_serving::<Named>().await;
            }
            if ready_rx.changed().await.is_err() {
                break;
            }
        }
    });
    let router =
        tonic::transport::Server::builder().add_service(health_svc).add_service(grpc::Service::server(agent.clone()));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut stop = stop_rx.clone();
    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let grpc_task = match parse_endpoint(&raw.grpc_listen)? {
        Endpoint::Unix(p) => {
            let l = step("grpc listener", || {
                if let Some(d) = p.parent() {
                    std::fs::create_dir_all(d)?;
                }
                let _ = std::fs::remove_file(&p);
                UnixListener::bind(&p).with_context(|| format!("bind {}", p.display()))
            })?;
            // Standard clients send the socket path as `:authority`: normalise it (uds_authority.rs).
            let incoming = UnixListenerStream::new(l).map(|s| s.map(NormalizeAuthority::new));
            tokio::spawn(async move { router.serve_with_incoming_shutdown(incoming, shutdown).await })
        }
        Endpoint::Tcp(addr) => {
            let l = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("bind {addr}"))?;
            tokio::spawn(async move {
                router.serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(l), shutdown).await
            })
        }
    };
    let fd_listener = step("fd listener", || Ok(fdserver::bind(&raw.tap_fd_listen)?))?;
    let fd_agent = agent.clone();
    let fd_task = tokio::spawn(async move {
        loop {
            let stream = match fd_listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    // E.g. EMFILE: back off instead of spinning.
                    tracing::warn!("fd socket accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let a = fd_agent.clone();
            tokio::spawn(fdserver::handle_conn(stream, a));
        }
    });
    agent.set_started();
    tracing::info!(ms = t_all.elapsed().as_secs_f64() * 1e3, "serving; warming the TAP pool in the background");

    // 6. Pool warm-up and maintenance, off the async workers.
    let m_agent = agent.clone();
    let interval = Duration::from_secs(raw.maintenance_interval_secs);
    let target = raw.tap_init_num;
    let par = raw.warm_parallelism;
    tokio::spawn(async move {
        let a = m_agent.clone();
        let t = Instant::now();
        let made = tokio::task::spawn_blocking(move || a.warm(target, par)).await.unwrap_or(0);
        tracing::info!(created = made, target, ms = t.elapsed().as_secs_f64() * 1e3, "TAP pool warm");
        loop {
            let _ = tokio::time::timeout(interval, m_agent.kick.notified()).await;
            let a = m_agent.clone();
            let _ = tokio::task::spawn_blocking(move || a.maintain()).await;
        }
    });

    // SIGTERM / SIGINT: stop serving; the datapath, TAPs and pins stay in place.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping (datapath, TAPs and pins stay)"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping (datapath, TAPs and pins stay)"),
        r = health_task => bail!("health server stopped: {r:?}"),
    }
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), grpc_task).await;
    fd_task.abort();
    if let Endpoint::Unix(p) = parse_endpoint(&raw.grpc_listen)? {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_file(&raw.tap_fd_listen);
    Ok(())
}

enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

/// `unix://path`, `tcp://host:port` or `host:port` (`reference/upstream.md §1.1`).
fn parse_endpoint(s: &str) -> anyhow::Result<Endpoint> {
    if let Some(p) = s.strip_prefix("unix://") {
        return Ok(Endpoint::Unix(PathBuf::from(p)));
    }
    let hp = s.strip_prefix("tcp://").unwrap_or(s);
    if hp.rsplit_once(':').is_some_and(|(_, port)| port.parse::<u16>().is_ok()) {
        return Ok(Endpoint::Tcp(hp.to_string()));
    }
    bail!("config key `grpc_listen`: {s:?} is not unix://PATH, tcp://HOST:PORT or HOST:PORT")
}
