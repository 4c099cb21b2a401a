//! `network-agent`: the per-node CubeNet daemon. See the README's network-agent section.

use std::{
    collections::HashMap,
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
    config::{AfterHandover, Config},
    cubevs_dp::CubeVsDataplane,
    dataplane::{Dataplane, SnatIp},
    fdserver, grpc,
    handover::{self, Entry, MutationGate},
    host::{HostParams, NetnsHost},
    http,
    listeners::{self, Acceptors, Endpoint, GrpcListener, InFlight, Listeners, parse_endpoint, until_stopped},
    state::StateStore,
    uds_authority::NormalizeAuthority,
};
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
    /// Overrides `handover_socket`.
    #[arg(long)]
    handover_socket: Option<PathBuf>,
    /// Check the configuration and exit.
    #[arg(long)]
    check_config: bool,
    /// Print the effective configuration (file + flags + defaults) as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

/// TAPs moved from their warm-up filter to tcx per maintenance turn (~16 ms each), so a
/// Release's maintenance pass waits at most ~0.15 s behind a turn.
const FILTERS_PER_TURN: usize = 8;

/// Holds back a maintenance step while Ensure/Release calls are in flight or ended less than
/// [`network_agent::agent::QUIET`] ago (decision F15), for at most `max`. With `pool_matters`
/// a pool below its low watermark ends the wait at once.
async fn yield_to_calls(agent: &Agent, pool_matters: bool, max: Duration) {
    let deadline = tokio::time::Instant::now() + max;
    while let Some(wait) = agent.upkeep_wait(pool_matters) {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return;
        }
        // A call that takes the pool below the watermark kicks: re-check then.
        let _ = tokio::time::timeout(wait.min(deadline - now), agent.kick.notified()).await;
    }
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
        host_port_range,
        handover_socket
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

/// Log setup: filter from `RUST_LOG` (default `info`), to stderr. `NETWORK_AGENT_LOG_FORMAT=json`
/// writes one JSON object per line (`timestamp`, `level`, `target`, the event's fields flattened
/// — e.g. `sandbox_id` on the Ensure, Release and TAP fd events — and the current span's fields under `span`), for log collectors on
/// Kubernetes; `text` (the default) is the human format, coloured only when stderr is a terminal. An
/// unknown value exits with status 2.
fn init_logging() {
    let filter = || tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    match std::env::var("NETWORK_AGENT_LOG_FORMAT").as_deref() {
        Ok("json") => tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .init(),
        Ok("text") | Ok("") | Err(_) => {
            // Colour only on a terminal: a log file or a collector must get plain
            // `key=value` text that grep finds (decision O2).
            tracing_subscriber::fmt()
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_env_filter(filter())
                .with_writer(std::io::stderr)
                .init()
        }
        Ok(other) => {
            eprintln!("network-agent: NETWORK_AGENT_LOG_FORMAT: unknown format {other:?} (json or text)");
            std::process::exit(2);
        }
    }
}

/// glibc malloc arenas the agent may use (F6). Set before any thread exists.
const MALLOC_ARENAS: libc::c_int = 2;

fn main() {
    // glibc gives each thread that allocates concurrently its own arena (up to 8 per core)
    // and keeps each arena's peak: a few concurrent large responses on blocking threads
    // left tens of MiB resident with 8,192 TAPs. Two arenas bound that on a 2-core node.
    // SAFETY: mallopt only tunes the allocator; called before any other thread starts.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS) };
    let args = Args::parse();
    init_logging();
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
    // SIGHUP re-reads the same file with the same flags over it (reload.rs, decision R51).
    let load: Option<Loader> = args
        .config
        .clone()
        .map(|p| Box::new(move || Config::load(&p).map(|c| apply(c, &args)).map_err(|e| e.to_string())) as Loader);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    if let Err(e) = rt.block_on(run(cfg, load)) {
        eprintln!("network-agent: {e:#}");
        if let Some(hint) = privilege_hint(&e) {
            eprintln!("network-agent: {hint}");
        }
        std::process::exit(1);
    }
}

/// `bpffs_dir` (or, while it does not exist yet, its nearest existing parent) must be on a bpf
/// filesystem; else pinning fails deep in the loader with `map … requested pinning. pinning
/// failed`, naming neither the key nor the fix (decision O14).
fn check_bpffs(dir: &std::path::Path) -> anyhow::Result<()> {
    let mut at = dir;
    while !at.exists() {
        match at.parent() {
            Some(p) => at = p,
            None => break,
        }
    }
    let st = nix::sys::statfs::statfs(at)
        .with_context(|| format!("bpffs_dir {}: statfs {}", dir.display(), at.display()))?;
    if st.filesystem_type() != nix::sys::statfs::BPF_FS_MAGIC {
        bail!(
            "bpffs_dir {} is not on a bpf filesystem ({} is not bpffs): mount one there (`mount -t bpf bpf \
             /sys/fs/bpf`) or set bpffs_dir inside one; scripts/start-network-agent.sh mounts /sys/fs/bpf \
             when it is missing",
            dir.display(),
            at.display()
        );
    }
    Ok(())
}

/// Refuses a start whose `cidr` does not contain the address of every sandbox recorded in
/// `state_dir` (decision H12): such a sandbox would be left alone by recovery — neither
/// adopted nor released, its TAP fd request and Release refused — and cube-dev would get
/// another gateway address under the running sandboxes (a successor does this before it
/// asks for the hand-over, so the running agent keeps serving unchanged). Reads the records
/// without changing anything. Errors name the first sandbox, its address and the key.
fn check_records_in_cidr(state_dir: &std::path::Path, cidr: network_agent::config::Cidr) -> anyhow::Result<()> {
    let (records, _) =
        StateStore::peek(state_dir).with_context(|| format!("read state_dir {}", state_dir.display()))?;
    let outside: Vec<_> = records.iter().filter(|(_, r)| cidr.index_of(r.sandbox_ip).is_none()).collect();
    if let Some((_, r)) = outside.first() {
        bail!(
            "cidr {cidr} does not contain sandbox {} ({}, TAP {}) recorded in {} ({} record(s) outside it): \
             release the sandboxes of the previous cidr (or start with it) before changing cidr; nothing was changed",
            r.sandbox_id,
            r.sandbox_ip,
            r.tap_name,
            state_dir.display(),
            outside.len()
        );
    }
    Ok(())
}

/// What to do when a start failed on a permission error and the agent is not root: it
/// creates TAPs and cube-dev, loads and pins eBPF and enters `dataplane_netns`, which needs
/// root (decision O3). `None` for any other failure.
fn privilege_hint(e: &anyhow::Error) -> Option<String> {
    let uid = nix::unistd::geteuid();
    if uid.is_root() {
        return None;
    }
    let denied = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied)
            || c.downcast_ref::<nix::errno::Errno>()
                .is_some_and(|n| matches!(n, nix::errno::Errno::EPERM | nix::errno::Errno::EACCES))
    }) || {
        let text = format!("{e:#}");
        text.contains("EPERM") || text.contains("EACCES") || text.contains("ermission denied")
    };
    denied.then(|| {
        format!(
            "running as uid {uid}: the agent must run as root (it enters dataplane_netns, creates TAPs and \
             cube-dev and loads eBPF into bpffs); start it as root, e.g. `sudo scripts/start-network-agent.sh`, \
             or in a privileged container as the Helm chart does"
        )
    })
}

/// Reads the configuration file with the command-line flags over it.
type Loader = Box<dyn Fn() -> Result<Config, String> + Send + Sync>;

async fn run(cfg: Arc<network_agent::config::Validated>, load: Option<Loader>) -> anyhow::Result<()> {
    // Installed first: SIGHUP's default action would end the agent (a SIGHUP during the start
    // is applied once the loop below runs).
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    let raw = &cfg.raw;
    let t_all = Instant::now();
    tracing::info!(dataplane_netns = %raw.dataplane_netns, bpffs_dir = %raw.bpffs_dir.display(), "starting");

    // The dataplane namespace threads (netlink sockets opened there and kept).
    let host = step("enter dataplane netns", || {
        let ns = if raw.dataplane_netns.is_empty() { None } else { Some(Netns::open(&raw.dataplane_netns)?) };
        let params = HostParams { mtu: raw.mtu, mvm_mac: cfg.mvm_mac, cube_dev: raw.cube_dev_name.clone() };
        Ok(Arc::new(NetnsHost::new(ns.as_ref(), raw.warm_parallelism, params)?))
    })?;

    // 0. Before anything on the node changes (the running agent may still serve it): every
    //    sandbox recorded in state_dir must lie in this configuration's cidr (H12).
    step("state within cidr", || check_records_in_cidr(&raw.state_dir, cfg.cidr))?;

    // 1. Datapath: load the programs; pinned links are adopted by the attaches below. Another
    //    object than the active slot's is switched to at once; a start that fails before this
    //    agent owns its sockets (e.g. a refused hand-over) switches back (U11).
    let active_before = handover::ActiveSlot::read(&raw.bpffs_dir);
    // A running agent is connected to (without a word yet) before this process can switch
    // the datapath: should it die anywhere after the switch, even before it asks for the
    // hand-over, the running agent sees the connection end and makes its own slot active
    // again (U13).
    let early_conn = (!raw.handover_socket.as_os_str().is_empty()).then(|| handover::connect(&raw.handover_socket));
    let dp = step("load datapath", || {
        check_bpffs(&raw.bpffs_dir)?;
        let dcfg = DatapathConfig {
            mvm_inner_ip: u32::from_ne_bytes(raw.mvm_inner_ip.octets()),
            mvm_gateway_ip: u32::from_ne_bytes(raw.mvm_gw_dest_ip.octets()),
            mvm_mac: cfg.mvm_mac,
            gateway_mac: cfg.gw_mac,
            // Set from `limits` by the loader.
            session_budget: 0,
        };
        let obj = (!raw.bpf_object.is_empty()).then(|| PathBuf::from(&raw.bpf_object));
        let reaper = Duration::from_secs(raw.reaper_interval_secs);
        let limits = cubevs::MapLimits {
            policy_entries_per_sandbox: raw.policy_entries_per_sandbox,
            sessions_per_sandbox: raw.sessions_per_sandbox,
            session_floor: raw.session_floor_per_sandbox,
            dns_query_floor: raw.dns_query_floor_per_sandbox,
            frag_floor: raw.frag_floor_per_sandbox,
            dns_learned_floor: raw.dns_learned_floor_per_sandbox,
            l7_connect_rate: raw.l7_connect_rate_per_sandbox,
            l7_connect_burst: raw.l7_connect_burst_per_sandbox,
            ..Default::default()
        };
        let attach = match raw.tc_attach.as_str() {
            "tcx" => cubevs::AttachMode::Tcx,
            "legacy" => cubevs::AttachMode::LegacyTc,
            // `auto`: a warm-up filter first, moved to its tcx link in the background (F5, T1).
            _ => cubevs::AttachMode::TcxDeferred,
        };
        let dp = CubeVsDataplane::load(host.clone(), obj, dcfg, attach, raw.bpffs_dir.clone(), reaper, limits)?;
        // Checked here, written once it is known whether a running agent hands over (H10).
        dp.check_always_denied(&cfg.always_denied)?;
        Ok(Arc::new(dp))
    })?;

    // Until this process owns its sockets (bound fresh, or handed over), another agent may
    // serve on this node: any failure until then switches back (U11).
    let mut slot_rollback = handover::SlotRollback::after_load(&raw.bpffs_dir, active_before);
    // This agent's own slot, made active again after a hand-over it offers fails (U13).
    let own_slot = dp.slot().and_then(|s| handover::OwnSlot::after_own_load(&raw.bpffs_dir, s));
    if let Some(g) = slot_rollback.as_mut() {
        g.arm();
    }

    // 2. cube-dev and 3. the uplink (SNAT address, XDP, per-netns sysctls) are node-wide: the
    //    uplink is found and checked here (read only); both are written once this process owns
    //    its sockets, on a fresh start right after the bind (an agent started next to a running
    //    one stops there, H7), on a hand-over after STOPPED, so a successor refused or killed
    //    before that leaves the running agent's cube-dev MTU, uplink entry, XDP mode and tc
    //    attachments as they were (H14).
    let gw = cfg.gateway_ip();
    let (eth, uplink_ifindex, uplink_ip) = step("uplink check", || {
        let eth = if raw.eth_name.is_empty() {
            host.default_route_dev()?.context("no IPv4 default route in the dataplane netns; set eth_name")?
        } else {
            raw.eth_name.clone()
        };
        let (ifindex, ips) = host.link_ipv4(&eth).with_context(|| format!("uplink {eth}"))?;
        if ips.len() != 1 {
            bail!("uplink {eth} must carry exactly one IPv4 address, has {ips:?}");
        }
        Ok((eth, ifindex, ips[0]))
    })?;
    let cube_dev = || -> anyhow::Result<()> {
        host.ensure_cube_dev(cfg.gw_mac, gw, cfg.cidr)?;
        dp.attach_cube_dev(&raw.cube_dev_name, gw)?;
        Ok(())
    };
    let uplink = || -> anyhow::Result<()> {
        dp.attach_uplink(&eth, uplink_ip)?;
        // After from_world: whatever XDP passes finds the TC path in place.
        let xdp = dp.attach_uplink_xdp(&eth, cfg.xdp_mode)?;
        tracing::info!(uplink = %eth, mode = %cfg.xdp_mode, attached = ?xdp, "xdp fast path");
        dp.set_snat_ips(&[SnatIp { ip: uplink_ip, ifindex: uplink_ifindex }])?;
        if !raw.ip_local_port_range.is_empty() {
            host.netns_sysctl("ipv4/ip_local_port_range", &raw.ip_local_port_range)?;
        }
        tracing::info!(uplink = %eth, ip = %uplink_ip, "uplink found");
        Ok(())
    };

    // Live upgrade: ask a running agent for its listeners and TAP fds (handover/). Any
    // failure before READY leaves the old agent serving; this process exits. A running agent
    // that vanishes before its offer is complete (killed meanwhile) is a crash: fresh start (H11).
    let mut handover_conn = None;
    let mut adopted_listeners = None;
    let mut received = HashMap::new();
    if let Some(conn) = early_conn {
        let sock = &raw.handover_socket;
        let t = Instant::now();
        let mut old_pid = None;
        let offer = conn.and_then(|conn| {
            let Some(conn) = conn else { return Ok(None) };
            old_pid = handover::peer_pid(&conn);
            handover::begin(&conn)?;
            tracing::info!(socket = %sock.display(), "asked the running agent for a hand-over; waiting for its offer");
            let (m, fds) = handover::recv_offer(&conn)?;
            let (l, taps) = handover::split_offer(m, fds)?;
            Ok(Some((conn, l, taps)))
        });
        match offer {
            Ok(None) => tracing::info!(socket = %sock.display(), "no running agent to take over from: fresh start"),
            Ok(Some((conn, l, taps))) => {
                // Checked before recovery touches anything: a mismatch leaves the old agent as it was.
                let listeners = step("receive hand-over", || Listeners::adopt(raw, l))?;
                tracing::info!(
                    taps = taps.len(),
                    ms = t.elapsed().as_secs_f64() * 1e3,
                    "received listeners and TAP fds from the running agent"
                );
                adopted_listeners = Some(listeners);
                received = taps;
                handover_conn = Some(conn);
            }
            // Its other sockets close as its exit goes on: fresh start once it has exited. One
            // that still runs closed the connection for another reason (it handed over to
            // another successor meanwhile): not ours to replace.
            Err(e)
                if handover::predecessor_gone(&e, sock)
                    && old_pid.is_none_or(|pid| handover::wait_exited(pid, handover::STOP_TIMEOUT)) =>
            {
                tracing::warn!(
                    socket = %sock.display(),
                    pid = ?old_pid,
                    "the running agent vanished before its hand-over offer was complete ({e}): fresh start (if another \
                     successor took over meanwhile, binding its sockets below refuses)"
                );
            }
            Err(e) => {
                let hint = if handover::predecessor_gone(&e, sock) || e.kind() == std::io::ErrorKind::ConnectionReset {
                    " (the running agent closed the hand-over without an offer: another successor may have taken over)"
                } else {
                    ""
                };
                tracing::error!(step = "receive hand-over", "startup step failed: {e}{hint}");
                return Err(anyhow::anyhow!("{e}{hint}"))
                    .with_context(|| format!("hand-over socket {}", sock.display()))
                    .context("startup step `receive hand-over`");
            }
        }
    }
    let listeners = match adopted_listeners {
        Some(l) => l,
        None => step("bind listeners", || Listeners::bind(raw))?,
    };
    if handover_conn.is_none()
        && let Some(mut g) = slot_rollback.take()
    {
        // The sockets are ours: no other agent serves here, this start's datapath stays.
        g.disarm();
    }

    // The node's always-denied list (R30): on a fresh start now that the sockets are ours (an
    // agent started next to a running one stopped at the bind above, H7), before any TAP is
    // adopted or created; on a hand-over only once this agent has taken over (below), so a
    // successor that gives up or dies before that never changes the list the running agent
    // enforces (H10).
    if handover_conn.is_none() {
        step("cube-dev", cube_dev)?;
        step("uplink", uplink)?;
        step("always-denied list", || {
            let cut = dp.set_always_denied(&cfg.always_denied)?;
            tracing::info!(always_denied = ?raw.always_denied_cidrs, sessions_deleted = cut, "node always-denied list written");
            Ok(())
        })?;
    }

    // 4. State and recovery.
    let agent = step("recover", || {
        let store =
            StateStore::open(&raw.state_dir).with_context(|| format!("state dir {}", raw.state_dir.display()))?;
        let agent = Arc::new(Agent::new(cfg.clone(), host.clone(), dp.clone() as Arc<dyn Dataplane>, store));
        agent.metrics.register_datapath(dp.clone() as Arc<dyn Dataplane>)?;
        let s = agent.recover_with(received)?;
        tracing::info!(?s, "recovered");
        match dp.gc_link_pins() {
            Ok(gone) if !gone.is_empty() => tracing::info!(?gone, "removed link pins of vanished interfaces"),
            Ok(_) => {}
            Err(e) => tracing::warn!("link pin GC: {e}"),
        }
        Ok(agent)
    })?;
    if let Some(conn) = handover_conn.take() {
        // The state is ours once the previous agent reads READY; it stops accepting and says
        // STOPPED, then this one starts accepting (connections wait in the shared backlog).
        step("hand-over commit", || Ok(handover::commit(&conn)?))?;
        if let Some(mut g) = slot_rollback.take() {
            g.disarm();
        }
        // The serving agent runs its own object: another successor's failure handled by the
        // previous agent meanwhile may have made the previous agent's slot active (U13).
        if let Some(o) = &own_slot {
            o.ensure("the hand-over");
        }
        agent.adopt_warm_pool();
        tracing::info!("hand-over complete: the previous agent stopped accepting and exits");
        // Ours now: this configuration's cube-dev and uplink settings (H14). A failure keeps
        // the previous agent's (nobody else serves any more), as for the list below.
        for (what, r) in [("cube-dev", cube_dev()), ("uplink", uplink())] {
            match r {
                Ok(()) => tracing::info!(step = what, "node settings written after the hand-over"),
                Err(e) => tracing::error!(
                    step = what,
                    "writing the node settings after the hand-over failed ({e:#}); the previous agent's stay in force"
                ),
            }
        }
        // Ours now: this configuration's list replaces the previous agent's in place. As on a
        // SIGHUP (R51), only sessions toward newly listed entries are cut, and a failed write
        // keeps the previous list (this agent serves anyway: nobody else does any more).
        match dp.update_always_denied(&cfg.always_denied) {
            Ok(cut) => tracing::info!(
                always_denied = ?raw.always_denied_cidrs,
                sessions_deleted = cut,
                "node always-denied list written"
            ),
            Err(e) => tracing::error!(
                error = %e,
                "writing always_denied_cidrs after the hand-over failed; the previous agent's list stays in force"
            ),
        }
    }

    // 5. Listeners (adopted from the previous agent, or bound before recovery: a second agent
    //    on the same sockets stops there, before it changes anything); health first, then
    //    gRPC and the fd socket.
    let Listeners { grpc: grpc_listener, tap_fd: fd_listener, health, for_handover } = listeners;
    // Every accept loop can be stopped for a hand-over (listeners.rs).
    let acceptors = Acceptors::default();
    let mut health_task = tokio::spawn(until_stopped(acceptors.token(), http::serve(health, agent.clone())));
    // The CubeEgress bridge (dataplane_sockets.rs, decision L9): with a dataplane namespace
    // the gateway's admin API and its bootstrap are on THAT namespace's loopback. The dump
    // listener is not handed over: the previous agent closed it when it stopped accepting
    // (before the commit above), so it is bound afresh here (decision L10).
    let dp_sockets = if raw.dataplane_netns.is_empty() {
        network_agent::dataplane_sockets::DataplaneSockets::local()
    } else {
        network_agent::dataplane_sockets::DataplaneSockets::open(&raw.dataplane_netns)
            .with_context(|| format!("dataplane_netns {} (CubeEgress bridge)", raw.dataplane_netns))?
    };
    let mut dump_task = None;
    if dp_sockets.is_dataplane() && !raw.egress_dump_listen.is_empty() {
        let addr: std::net::SocketAddr = raw.egress_dump_listen.parse().context("egress_dump_listen")?;
        let l = dp_sockets
            .bind(addr)
            .await
            .with_context(|| format!("bind egress_dump_listen {addr} in {}", raw.dataplane_netns))?;
        let l = tokio::net::TcpListener::from_std(l)?;
        tracing::info!(listen = %addr, netns = %raw.dataplane_netns, "CubeEgress bootstrap dump listener");
        let serve = until_stopped(acceptors.token(), http::serve_routes(l, agent.clone(), http::Routes::DumpOnly));
        dump_task = Some(tokio::spawn(async move {
            if let Some(Err(e)) = serve.await {
                tracing::error!("egress_dump_listen stopped: {e}");
            }
        }));
    }
    // CubeEgress push client (egress_sync.rs): before gRPC serves, so no Ensure skips it.
    // Its loop stops when this agent hands over: a stale full sync must not undo the
    // successor's pushes (the successor starts with a full sync of its own).
    let mut egress_loop = None;
    if !raw.cube_egress_admin_url.is_empty() {
        let timeout = std::time::Duration::from_millis(raw.cube_egress_push_timeout_ms);
        let sync = network_agent::egress_sync::EgressSync::new_in(
            &raw.cube_egress_admin_url,
            timeout,
            tokio::runtime::Handle::current(),
            agent.metrics.clone(),
            dp_sockets.clone(),
        )
        .map_err(anyhow::Error::msg)?;
        agent.set_egress_sync(sync.clone());
        egress_loop = Some(tokio::spawn(sync.run(Arc::downgrade(&agent))));
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
    let gate = Arc::new(MutationGate::default());
    let router = tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(grpc::Service::server_with_gate(agent.clone(), gate.clone()));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut stop = stop_rx.clone();
    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let grpc_task = match grpc_listener {
        GrpcListener::Unix(l) => {
            // Standard clients send the socket path as `:authority`: normalise it (uds_authority.rs).
            // Only root, our uid or `allowed_peer_uids` is served (R40, R50): any other user's
            // connection is dropped at accept.
            let uids = raw.allowed_peer_uids.clone();
            let incoming = UnixListenerStream::new(l)
                .filter(move |s| match s {
                    Ok(c) if !listeners::peer_allowed(c, &uids) => {
                        tracing::warn!(peer = ?c.peer_cred().map(|c| c.uid()).ok(), "gRPC client of another user refused");
                        false
                    }
                    _ => true,
                })
                .map(|s| s.map(NormalizeAuthority::new));
            let incoming = listeners::incoming(incoming, acceptors.token());
            tokio::spawn(async move { router.serve_with_incoming_shutdown(incoming, shutdown).await })
        }
        GrpcListener::Tcp(l) => {
            let incoming = listeners::incoming(tokio_stream::wrappers::TcpListenerStream::new(l), acceptors.token());
            tokio::spawn(async move { router.serve_with_incoming_shutdown(incoming, shutdown).await })
        }
    };
    let fd_agent = agent.clone();
    // fd requests in flight, waited for after a hand-over.
    let fd_inflight = InFlight::default();
    let fd_token_src = fd_inflight.token_source();
    let fd_token = acceptors.token();
    let fd_uids = raw.allowed_peer_uids.clone();
    let fd_task = tokio::spawn(until_stopped(fd_token, async move {
        loop {
            let stream = match fd_listener.accept().await {
                Ok((s, _)) if !listeners::peer_allowed(&s, &fd_uids) => {
                    // Another user gets no TAP (R40): dropped unanswered.
                    tracing::warn!(peer = ?s.peer_cred().map(|c| c.uid()).ok(), "TAP fd client of another user refused");
                    continue;
                }
                Ok((s, _)) => s,
                Err(e) => {
                    // E.g. EMFILE: back off instead of spinning.
                    tracing::warn!("fd socket accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (a, t) = (fd_agent.clone(), fd_token_src.token());
            tokio::spawn(async move {
                fdserver::handle_conn(stream, a).await;
                drop(t);
            });
        }
    }));
    agent.set_started();
    tracing::info!(ms = t_all.elapsed().as_secs_f64() * 1e3, "serving; warming the TAP pool in the background");

    // The hand-over socket for the next upgrade (replaces the previous agent's path).
    let (handed_tx, mut handed_rx) = tokio::sync::oneshot::channel::<()>();
    if !raw.handover_socket.as_os_str().is_empty() {
        let l = step("hand-over listener", || {
            let l = handover::bind(&raw.handover_socket)
                .with_context(|| format!("bind handover_socket {}", raw.handover_socket.display()))?;
            l.set_nonblocking(true)?;
            Ok(tokio::net::UnixListener::from_std(l)?)
        })?;
        let (a, g, fds, ep) = (agent.clone(), gate.clone(), Arc::new(for_handover), raw.grpc_listen.clone());
        let stop: handover::StopAccepting = Box::new(move || {
            Box::pin(async move {
                acceptors.stop().await;
                if let Some(t) = egress_loop {
                    t.abort();
                    let _ = t.await;
                }
            })
        });
        tokio::spawn(async move {
            handover::serve(l, a, g, fds, ep, stop, own_slot).await;
            let _ = handed_tx.send(());
        });
    } else {
        drop(for_handover);
        std::mem::forget(handed_tx);
    }

    // SIGHUP: `always_denied_cidrs` from the file, applied in place (reload.rs, R51).
    let reloader = network_agent::reload::Reloader {
        load,
        running: cfg.clone(),
        dp: dp.clone(),
        gate: gate.clone(),
        metrics: agent.metrics.clone(),
    };
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            reloader.reload().await;
        }
    });

    // 6. Pool warm-up and maintenance, off the async workers; each pass enters the mutation
    //    gate, and none runs once the state was handed to a successor.
    let m_agent = agent.clone();
    let interval = Duration::from_secs(raw.maintenance_interval_secs);
    let target = raw.tap_init_num;
    let par = raw.warm_parallelism;
    let m_gate = gate.clone();
    let m_dp = dp.clone();
    tokio::spawn(async move {
        let a = m_agent.clone();
        let t = Instant::now();
        let made = match m_gate.enter().await {
            Entry::Here(_g) => tokio::task::spawn_blocking(move || a.warm(target, par)).await.unwrap_or(0),
            _ => return,
        };
        tracing::info!(created = made, target, ms = t.elapsed().as_secs_f64() * 1e3, "TAP pool warm");
        // TAPs on their warm-up filter (F5) move to tcx a few at a time between passes,
        // without waiting for the interval while any is left.
        let mut converting = true;
        loop {
            if converting {
                // A conversion holds RTNL over a grace period: not while calls are in flight.
                yield_to_calls(&m_agent, false, interval).await;
                let a = m_agent.clone();
                converting = match m_gate.enter().await {
                    Entry::Here(_g) => {
                        tokio::task::spawn_blocking(move || a.convert_filters(FILTERS_PER_TURN)).await.unwrap_or(false)
                    }
                    _ => return,
                };
            }
            // A pass no call woke (idle for an interval) also trims the pool's surplus (F10);
            // a pass between filter conversions is not idle (the surplus a burst handed back
            // would be deleted under the next burst, F15).
            let mut idle = false;
            if !converting {
                idle = tokio::time::timeout(interval, m_agent.kick.notified()).await.is_err();
            }
            // A pass a call kicked waits for the burst to end, unless the pool runs low (F15).
            if !idle {
                yield_to_calls(&m_agent, true, interval).await;
            }
            let a = m_agent.clone();
            match m_gate.enter().await {
                Entry::Here(_g) => {
                    let _ = tokio::task::spawn_blocking(move || a.maintain_pass(idle)).await;
                }
                _ => return,
            }
            converting = converting || m_dp.filters_pending() > 0;
        }
    });

    // SIGTERM / SIGINT: stop serving; the datapath, TAPs and pins stay in place.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping (datapath, TAPs and pins stay)"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping (datapath, TAPs and pins stay)"),
        _ = &mut handed_rx => tracing::info!("handed over: no longer accepting; finishing in-flight requests"),
        r = &mut health_task => match r {
            // Stopped for a hand-over that is committing.
            Ok(None) => {
                let _ = (&mut handed_rx).await;
                tracing::info!("handed over: no longer accepting; finishing in-flight requests");
            }
            r => bail!("health server stopped: {r:?}"),
        },
    }
    // Stop accepting everywhere; gRPC finishes in-flight calls (forwarded ones included).
    let _ = stop_tx.send(true);
    fd_task.abort();
    health_task.abort();
    if let Some(t) = dump_task {
        t.abort();
    }
    // After a hand-over, forwarded calls may take longer than a plain stop allows.
    let grace = Duration::from_secs(if gate.handed_over() { 10 } else { 5 });
    let _ = tokio::time::timeout(grace, grpc_task).await;
    if gate.sockets_shared() && !gate.handed_over() {
        // Stopped while an offer was out: the successor may already serve on these sockets.
        tracing::info!("stopped during a hand-over: the socket files are left to the successor");
        return Ok(());
    }
    if gate.handed_over() {
        // In-flight fd and HTTP requests finish within their deadlines; the socket files
        // belong to the successor now.
        if !fd_inflight.drained(fdserver::DEADLINE * 2).await {
            tracing::warn!("fd requests still in flight after their deadlines");
        }
        // Health requests the old agent accepted take milliseconds (not tracked).
        tokio::time::sleep(Duration::from_millis(100)).await;
        if raw.after_handover == AfterHandover::Wait {
            let n = agent.close_tap_fds();
            tracing::info!(closed = n, "handed over: holding no TAP or listener; idle until SIGTERM/SIGINT");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        tracing::info!("handed over: exiting");
        return Ok(());
    }
    if let Endpoint::Unix(p) = parse_endpoint(&raw.grpc_listen)? {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_file(&raw.tap_fd_listen);
    Ok(())
}
