//! network-agent figures (issue 6 §2–3): EnsureNetwork + TAP fd handoff latency at concurrency
//! 1, 10 and 50 with a warm pool beside an empty pool (on-demand TAP creation: what the pool
//! buys), at 50 also beside the same clients' calls that do no work in the agent (the gRPC + fd
//! floor, [`floor_latency`]), Release latency, time for 500 TAPs to reach Ready, and the agent's
//! RSS.
//!
//! The agent is the release build, started by `scripts/start-network-agent.sh` in its own
//! namespace with the harness node namespace as its dataplane (`cubenet_tests::agent`).

use std::time::{Duration, Instant};

use cubenet_proto::v1 as pb;
use cubenet_tests::agent::{AgentUnderTest, tap_fd};

use crate::report::Row;

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0
}

pub(crate) fn agent_pid(a: &mut AgentUnderTest) -> u32 {
    // The start script execs the agent, so the child's PID is the agent's.
    a.child.as_ref().map(|c| c.id()).unwrap_or(0)
}

/// Waits (at most 10 s) until the pool holds at least `ready` Ready TAPs and none Cleaning:
/// a warm pool for the next round.
fn wait_pool(a: &AgentUnderTest, ready: u64) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if let Some((200, body)) = a.http("/v1/network/taps")
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&body)
        {
            let c = &v["stateCounts"];
            if c["Ready"].as_u64().unwrap_or(0) >= ready && c["Cleaning"].as_u64().unwrap_or(1) == 0 {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("  pool not back to {ready} Ready within 10 s; measuring anyway");
}

/// CPU time (user + system, s) the process `pid` and its threads (exited ones included) used
/// so far: `/proc/<pid>/stat` utime + stime, in clock ticks of 10 ms.
pub(crate) fn cpu_s(pid: u32) -> f64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the `(comm)`: state is field 3, utime 14, stime 15.
    let Some((_, rest)) = s.rsplit_once(')') else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) + ticks(12)) / hz
}

/// What [`create_latency`] measured.
#[derive(Default)]
pub(crate) struct Latency {
    /// Ensure + fd per sandbox (ms).
    pub ensure_ms: Vec<f64>,
    /// Release per sandbox (ms).
    pub release_ms: Vec<f64>,
    /// Agent CPU (s) over the Ensure+fd bursts, from the first request to the last answer.
    pub ensure_cpu_s: f64,
    /// Agent CPU (s) over the Release bursts.
    pub release_cpu_s: f64,
    /// Agent CPU (s) over the whole measured run (set by the caller; 0 when not read).
    pub run_cpu_s: f64,
}

impl Latency {
    /// Appends the calls and CPU of `o`.
    pub fn add(&mut self, o: Latency) {
        self.ensure_ms.extend(o.ensure_ms);
        self.release_ms.extend(o.release_ms);
        self.ensure_cpu_s += o.ensure_cpu_s;
        self.release_cpu_s += o.release_cpu_s;
        self.run_cpu_s += o.run_cpu_s;
    }
}

/// Ensure + fd (ms) and Release (ms) for `rounds` rounds of `conc` concurrent sandboxes.
/// With `warm`, each round starts once the pool is back to `conc` Ready TAPs.
fn create_latency(a: &AgentUnderTest, conc: usize, rounds: usize, warm: bool) -> (Vec<f64>, Vec<f64>) {
    let l = create_latency_cpu(a, conc, rounds, warm, 0);
    (l.ensure_ms, l.release_ms)
}

/// [`create_latency`], also reading the CPU time of the agent `pid` (0: not read) around each
/// burst of Ensure+fd and of Release.
pub(crate) fn create_latency_cpu(a: &AgentUnderTest, conc: usize, rounds: usize, warm: bool, pid: u32) -> Latency {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let endpoint = a.grpc_endpoint();
    let sock = a.tap_socket();
    let mut out = Latency::default();
    let cpu = |pid: u32| if pid == 0 { 0.0 } else { cpu_s(pid) };
    for round in 0..rounds {
        if warm {
            wait_pool(a, conc as u64);
        }
        let (endpoint, sock) = (endpoint.clone(), sock.clone());
        let (e, r, ec, rc) = rt.block_on(async move {
            let mut ensure_ms = Vec::new();
            let mut release_ms = Vec::new();
            let mut connects = Vec::new();
            for i in 0..conc {
                let endpoint = endpoint.clone();
                connects.push(tokio::spawn(async move {
                    let c = network_agent::client::connect(&endpoint).await.expect("connect");
                    (i, c)
                }));
            }
            // Connected first, so the CPU window holds the RPCs only.
            let mut clients = Vec::new();
            for t in connects {
                clients.push(t.await.expect("connect task"));
            }
            let c0 = cpu(pid);
            let mut tasks = Vec::new();
            for (i, mut c) in clients {
                let sock = sock.clone();
                tasks.push(tokio::spawn(async move {
                    let id = format!("bench-{round}-{i}");
                    let t = Instant::now();
                    let resp = c
                        .ensure_network(pb::EnsureNetworkRequest { sandbox_id: id.clone(), ..Default::default() })
                        .await
                        .expect("EnsureNetwork")
                        .into_inner();
                    let tap = resp.interfaces.first().map(|i| i.name.clone()).expect("interface");
                    let (reply, fd) = tokio::task::spawn_blocking({
                        let (sock, id) = (sock.clone(), id.clone());
                        move || tap_fd(&sock, &tap, &id)
                    })
                    .await
                    .expect("fd task");
                    assert!(fd.is_some(), "fd handoff failed: {reply}");
                    let e = t.elapsed().as_secs_f64() * 1e3;
                    drop(fd);
                    (id, e, c)
                }));
            }
            let mut done = Vec::new();
            for t in tasks {
                done.push(t.await.expect("ensure task"));
            }
            let c1 = cpu(pid);
            let mut rel = Vec::new();
            for (id, e, mut c) in done {
                ensure_ms.push(e);
                rel.push(tokio::spawn(async move {
                    let t = Instant::now();
                    c.release_network(pb::ReleaseNetworkRequest { sandbox_id: id, ..Default::default() })
                        .await
                        .expect("Release");
                    t.elapsed().as_secs_f64() * 1e3
                }));
            }
            for r in rel {
                release_ms.push(r.await.expect("release task"));
            }
            let c2 = cpu(pid);
            (ensure_ms, release_ms, c1 - c0, c2 - c1)
        });
        out.ensure_ms.extend(e);
        out.release_ms.extend(r);
        out.ensure_cpu_s += ec;
        out.release_cpu_s += rc;
    }
    out
}

/// What [`floor_latency`] measured.
#[derive(Default)]
pub(crate) struct Floor {
    /// Refused Ensure + fd round trip per client (ms).
    pub ms: Vec<f64>,
    /// Refused Release round trip per client (ms): gRPC alone, the Release figure's floor.
    pub release_ms: Vec<f64>,
    /// Agent CPU (s) over the Ensure + fd bursts (0 when not read).
    pub cpu_s: f64,
}

impl Floor {
    /// Appends the calls and CPU of `o`.
    pub fn add(&mut self, o: Floor) {
        self.ms.extend(o.ms);
        self.release_ms.extend(o.release_ms);
        self.cpu_s += o.cpu_s;
    }
}

/// This machine's floor under the Ensure+fd figure: `rounds` bursts of `conc` clients shaped
/// exactly like [`create_latency_cpu`]'s (own connection each, connected first, the fd request
/// on a blocking thread), whose calls do no work in the agent: EnsureNetwork with
/// `port_mappings[0].protocol = "sctp"`, refused in the gRPC handler with INVALID_ARGUMENT
/// before the agent's core, then the fd socket asked for a TAP the sandbox does not hold
/// (errCode "1002" after one lookup, answered on the fd server's task). What is left is gRPC
/// (client and server), the fd socket and the scheduling of `conc` clients on this machine.
/// Then the same clients, at once, each a ReleaseNetwork whose `network_handle` is not its
/// `sandbox_id` (INVALID_ARGUMENT in the handler): the Release figure's floor, gRPC alone.
/// Also reads the agent `pid`'s CPU (0: not read) around each Ensure + fd burst.
pub(crate) fn floor_latency(a: &AgentUnderTest, conc: usize, rounds: usize, pid: u32) -> Floor {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let endpoint = a.grpc_endpoint();
    let sock = a.tap_socket();
    let cpu = |pid: u32| if pid == 0 { 0.0 } else { cpu_s(pid) };
    let mut out = Floor::default();
    for round in 0..rounds {
        let (endpoint, sock) = (endpoint.clone(), sock.clone());
        let (ms, rel_ms, c) = rt.block_on(async move {
            let mut connects = Vec::new();
            for i in 0..conc {
                let endpoint = endpoint.clone();
                connects.push(tokio::spawn(async move {
                    (i, network_agent::client::connect(&endpoint).await.expect("connect"))
                }));
            }
            let mut clients = Vec::new();
            for t in connects {
                clients.push(t.await.expect("connect task"));
            }
            let c0 = cpu(pid);
            let mut tasks = Vec::new();
            for (i, mut c) in clients {
                let sock = sock.clone();
                tasks.push(tokio::spawn(async move {
                    let id = format!("floor-{round}-{i}");
                    let t = Instant::now();
                    let err = c
                        .ensure_network(pb::EnsureNetworkRequest {
                            sandbox_id: id.clone(),
                            port_mappings: vec![pb::PortMapping {
                                protocol: "sctp".into(),
                                container_port: 80,
                                ..Default::default()
                            }],
                            ..Default::default()
                        })
                        .await
                        .expect_err("an sctp mapping is refused");
                    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
                    let (reply, fd) = tokio::task::spawn_blocking(move || tap_fd(&sock, "z192.168.255.254", &id))
                        .await
                        .expect("fd task");
                    assert!(fd.is_none() && reply["errCode"] == "1002", "fd floor: {reply}");
                    let e = t.elapsed().as_secs_f64() * 1e3;
                    (e, c)
                }));
            }
            let mut ms = Vec::new();
            let mut clients = Vec::new();
            for t in tasks {
                let (e, c) = t.await.expect("floor task");
                ms.push(e);
                clients.push(c);
            }
            let c1 = cpu(pid);
            let mut rel = Vec::new();
            for (i, mut c) in clients.into_iter().enumerate() {
                rel.push(tokio::spawn(async move {
                    let t = Instant::now();
                    let err = c
                        .release_network(pb::ReleaseNetworkRequest {
                            sandbox_id: format!("floor-{round}-{i}"),
                            network_handle: "not-this-sandbox".into(),
                            ..Default::default()
                        })
                        .await
                        .expect_err("a foreign network_handle is refused");
                    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
                    t.elapsed().as_secs_f64() * 1e3
                }));
            }
            let mut rel_ms = Vec::new();
            for t in rel {
                rel_ms.push(t.await.expect("release floor task"));
            }
            (ms, rel_ms, c1 - c0)
        });
        out.ms.extend(ms);
        out.release_ms.extend(rel_ms);
        out.cpu_s += c;
    }
    out
}

/// Warms a pool of `n + extra` and waits until every TAP is on its tcx link, measures
/// Ensure+fd for `extra` sandboxes at concurrency 50 with none registered (baseline), registers
/// `n` sandboxes, measures the same with them registered, and the agent's RSS.
pub fn run_scale(n: usize, extra: usize) -> Vec<Row> {
    let mut a = AgentUnderTest::prepare("bench-scale", n + extra, "cidr = \"192.168.0.0/18\"\n");
    let t = Instant::now();
    let child = a.spawn_script();
    a.child = Some(child);
    a.wait_ready(Duration::from_secs(900));
    let warm_s = t.elapsed().as_secs_f64();
    let pid = agent_pid(&mut a);
    let rss_pool = rss_mib(pid);
    // Every TAP on its tcx link first (F5), so no warm-up work runs during the measurements.
    let t = Instant::now();
    wait_metric_zero(&a, "cubenet_tap_warmup_filters", Duration::from_secs(900));
    let convert_s = t.elapsed().as_secs_f64();
    // Ensure+fd with nothing registered yet: the baseline of the same figure with n registered.
    let (mut e0, _) = create_latency(&a, 50, (extra / 50).max(1), true);
    wait_pool(&a, (n + extra) as u64);
    // Register n sandboxes, 50 at a time, and keep them.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let endpoint = a.grpc_endpoint();
    let t = Instant::now();
    rt.block_on(async {
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(50));
        let mut tasks = Vec::new();
        for i in 0..n {
            let (endpoint, sem) = (endpoint.clone(), sem.clone());
            tasks.push(tokio::spawn(async move {
                let _p = sem.acquire().await.expect("semaphore");
                let mut c = network_agent::client::connect(&endpoint).await.expect("connect");
                c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: format!("reg-{i}"), ..Default::default() })
                    .await
                    .expect("EnsureNetwork");
            }));
        }
        for t in tasks {
            t.await.expect("ensure task");
        }
    });
    let register_s = t.elapsed().as_secs_f64();
    let rss_n = rss_mib(pid);
    let rate = n as f64 / register_s;
    let (mut e, _) = create_latency(&a, 50, (extra / 50).max(1), true);
    let full = run_scale_sessions(&a, &rt, extra, pid);
    let mut rows = vec![
        Row {
            bench: "agent-scale".into(),
            case: format!("agent RSS with {n} registered sandboxes"),
            value: rss_n,
            spread: (rss_n, rss_n),
            unit: "MiB".into(),
            baseline: Some((format!("RSS with {} pooled TAPs, none registered", n + extra), rss_pool)),
            target: Some("<= 50 MB".into()),
        },
        Row {
            bench: "agent-scale".into(),
            case: format!("Ensure rate registering {n} sandboxes (concurrency 50)"),
            value: rate,
            spread: (rate, rate),
            unit: "Ensure/s".into(),
            baseline: None,
            target: None,
        },
    ];
    for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
        let v = pct(&mut e, q);
        rows.push(Row {
            bench: "agent-scale".into(),
            case: format!("Ensure+fd {name}, concurrency 50, with {n} registered"),
            value: v,
            spread: (pct(&mut e, 0.1), pct(&mut e, 0.9)),
            unit: "ms".into(),
            baseline: Some((format!("{name} with none registered"), pct(&mut e0, q))),
            target: None,
        });
    }
    rows.extend(full);
    eprintln!(
        "  pool of {} warmed in {warm_s:.1} s, on tcx {convert_s:.1} s later; {n} registered in {register_s:.1} s",
        n + extra
    );
    rows
}

/// The RSS target in one run: registers `extra` more sandboxes (every pooled TAP Active:
/// `n + extra` registered, 8,192 with the defaults), writes 1,000,000 established sessions
/// (`CUBENET_BENCH_SESSIONS` for fewer) spread over them straight into the agent's pinned
/// maps, waits two reaper passes and reads the agent's RSS.
fn run_scale_sessions(a: &AgentUnderTest, rt: &tokio::runtime::Runtime, extra: usize, pid: u32) -> Vec<Row> {
    let sessions: usize =
        std::env::var("CUBENET_BENCH_SESSIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let endpoint = a.grpc_endpoint();
    // The latency rounds' TAPs are Ready again only after the maintenance pass's free check (F2).
    wait_pool(a, extra as u64);
    rt.block_on(async {
        let mut c = network_agent::client::connect(&endpoint).await.expect("connect");
        for i in 0..extra {
            c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: format!("reg-x{i}"), ..Default::default() })
                .await
                .expect("EnsureNetwork");
        }
    });
    let rss_registered = rss_mib(pid);
    let dp = cubevs::Datapath::load(cubevs::LoadOptions {
        object: cubenet_tests::ebpf_object(),
        pin_dir: Some(a.pin_dir()),
        ..cubevs::LoadOptions::new()
    })
    .expect("adopt the agent's maps");
    let maps = dp.maps();
    let registered = maps.sandboxes.list().expect("sandboxes");
    let entries = crate::agent_sessions::make_sessions(&registered, std::net::Ipv4Addr::new(198, 51, 100, 2), sessions);
    let written = maps.sessions.insert_batch(&entries).expect("fill sessions");
    drop(entries);
    // Two reaper passes (5 s interval) over the full maps.
    std::thread::sleep(Duration::from_secs(11));
    let rss = rss_mib(pid);
    eprintln!("  {} sandboxes registered, {written} sessions: RSS {rss:.1} MiB", registered.len());
    let label = if sessions == 1_000_000 { "1M".to_string() } else { sessions.to_string() };
    vec![Row {
        bench: "agent-scale".into(),
        case: format!("agent RSS, {} sandboxes + {label} sessions", registered.len()),
        value: rss,
        spread: (rss, rss),
        unit: "MiB".into(),
        baseline: Some((format!("RSS with {} sandboxes, no sessions", registered.len()), rss_registered)),
        target: Some("<= 50 MB".into()),
    }]
}

pub(crate) fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Polls `/metrics` until the gauge `name` reads 0 (at most `timeout`); `None` on timeout.
fn wait_metric_zero(a: &AgentUnderTest, name: &str, timeout: Duration) -> Option<()> {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if let Some((200, body)) = a.http("/metrics")
            && body.lines().any(|l| l.strip_prefix(name).is_some_and(|v| v.trim() == "0"))
        {
            return Some(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("  {name} not 0 within {timeout:?}");
    None
}

/// `cubenet_tap_create_phase_seconds{phase}` from the agent's `/metrics`: (phase, sum in s,
/// count), in creation order.
fn create_phases(a: &AgentUnderTest) -> Vec<(String, f64, f64)> {
    let Some((200, body)) = a.http("/metrics") else { return Vec::new() };
    let mut out: Vec<(String, f64, f64)> = Vec::new();
    for l in body.lines() {
        let (kind, rest) = if let Some(r) = l.strip_prefix("cubenet_tap_create_phase_seconds_sum{phase=\"") {
            (0, r)
        } else if let Some(r) = l.strip_prefix("cubenet_tap_create_phase_seconds_count{phase=\"") {
            (1, r)
        } else {
            continue;
        };
        let Some((phase, v)) = rest.split_once("\"} ") else { continue };
        let Ok(v) = v.trim().parse::<f64>() else { continue };
        let i = match out.iter().position(|(p, ..)| p == phase) {
            Some(i) => i,
            None => {
                out.push((phase.to_string(), 0.0, 0.0));
                out.len() - 1
            }
        };
        if kind == 0 { out[i].1 = v } else { out[i].2 = v }
    }
    const ORDER: [&str; 7] = ["tuntap", "sysctl", "link", "neighbour", "attach", "policy", "pool"];
    out.sort_by_key(|(p, ..)| ORDER.iter().position(|o| o == p).unwrap_or(ORDER.len()));
    out
}

/// Pool warm-up (500 TAPs from cold, with the time per creation step) and restart with 500
/// Active sandboxes, each beside the agent's fixed startup with no pool.
pub fn run_pool() -> Vec<Row> {
    let mut rows = Vec::new();
    // Pool warm-up: 500 TAPs from cold, beside an agent with no pool (its fixed startup).
    let mut empty = AgentUnderTest::prepare("bench-nopool", 0, "");
    let t = Instant::now();
    empty.start();
    let startup_s = t.elapsed().as_secs_f64();
    let idle_rss = rss_mib(agent_pid(&mut empty));
    drop(empty);
    let mut warm = AgentUnderTest::prepare("bench-pool500", 500, "cidr = \"192.168.0.0/22\"\n");
    let t = Instant::now();
    let child = warm.spawn_script();
    warm.child = Some(child);
    warm.wait_ready(Duration::from_secs(300));
    let warm_s = t.elapsed().as_secs_f64();
    let rss500 = rss_mib(agent_pid(&mut warm));
    rows.push(Row {
        bench: "agent".into(),
        case: "500 TAPs Ready (start to /readyz)".into(),
        value: warm_s,
        spread: (warm_s, warm_s),
        unit: "s".into(),
        baseline: Some(("start with tap_init_num=0".into(), startup_s)),
        target: Some("<= 2 s".into()),
    });
    let phases = create_phases(&warm);
    let total: f64 = phases.iter().map(|(_, s, n)| if *n > 0.0 { s / n } else { 0.0 }).sum::<f64>() * 1e6;
    for (phase, sum, n) in &phases {
        let us = if *n > 0.0 { sum / n * 1e6 } else { 0.0 };
        rows.push(Row {
            bench: "agent".into(),
            case: format!("warm-up step {phase} per TAP ({n} TAPs)"),
            value: us,
            spread: (us, us),
            unit: "µs".into(),
            baseline: Some(("all steps per TAP".into(), total)),
            target: None,
        });
    }
    let wall_us = warm_s.max(0.0) * 1e6 / 500.0;
    eprintln!("  500 TAPs: {warm_s:.2} s wall ({wall_us:.0} µs per TAP), steps sum {total:.0} µs per TAP (per worker)");
    rows.push(Row {
        bench: "agent".into(),
        case: "agent RSS with 500 pooled TAPs".into(),
        value: rss500,
        spread: (rss500, rss500),
        unit: "MiB".into(),
        baseline: Some(("RSS with no pool".into(), idle_rss)),
        target: Some("<= 50 MB".into()),
    });

    // The default (F5) Ready on warm-up filters: time until every TAP is on its tcx link too.
    let converted_s = wait_metric_zero(&warm, "cubenet_tap_warmup_filters", Duration::from_secs(300))
        .map(|_| t.elapsed().as_secs_f64());
    drop(warm);

    // The same with tcx links at creation (`tc_attach = "tcx"`, the default before F5).
    let mut tcx = AgentUnderTest::prepare("bench-pool500-tcx", 500, "cidr = \"192.168.0.0/22\"\ntc_attach = \"tcx\"\n");
    let t = Instant::now();
    let child = tcx.spawn_script();
    tcx.child = Some(child);
    tcx.wait_ready(Duration::from_secs(300));
    let tcx_s = t.elapsed().as_secs_f64();
    rows.push(Row {
        bench: "agent".into(),
        case: "500 TAPs Ready, tc_attach = tcx (start to /readyz)".into(),
        value: tcx_s,
        spread: (tcx_s, tcx_s),
        unit: "s".into(),
        baseline: Some(("tc_attach = auto (filter first, F5)".into(), warm_s)),
        target: None,
    });
    if let Some(c) = converted_s {
        rows.push(Row {
            bench: "agent".into(),
            case: "500 TAPs on their tcx link, tc_attach = auto (start to 0 warm-up filters)".into(),
            value: c,
            spread: (c, c),
            unit: "s".into(),
            baseline: Some(("tc_attach = tcx Ready".into(), tcx_s)),
            target: None,
        });
    }
    for (phase, sum, n) in create_phases(&tcx) {
        if phase != "attach" {
            continue;
        }
        let us = if n > 0.0 { sum / n * 1e6 } else { 0.0 };
        let auto = phases.iter().find(|(p, ..)| p == "attach").map_or(0.0, |(_, s, n)| s / n * 1e6);
        rows.push(Row {
            bench: "agent".into(),
            case: format!("warm-up step attach per TAP, tc_attach = tcx ({n} TAPs)"),
            value: us,
            spread: (us, us),
            unit: "µs".into(),
            baseline: Some(("auto (warm-up filter) attach per TAP".into(), auto)),
            target: None,
        });
    }
    drop(tcx);

    // Restart with 500 Active sandboxes (no pool: what is timed is adopting them).
    let mut act = AgentUnderTest::prepare("bench-active500", 0, "cidr = \"192.168.0.0/22\"\n");
    act.start();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let endpoint = act.grpc_endpoint();
    rt.block_on(async {
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(50));
        let mut tasks = Vec::new();
        for i in 0..500 {
            let (endpoint, sem) = (endpoint.clone(), sem.clone());
            tasks.push(tokio::spawn(async move {
                let _p = sem.acquire().await.expect("semaphore");
                let mut c = network_agent::client::connect(&endpoint).await.expect("connect");
                c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: format!("act-{i}"), ..Default::default() })
                    .await
                    .expect("EnsureNetwork");
            }));
        }
        for t in tasks {
            t.await.expect("ensure task");
        }
    });
    act.kill(nix::sys::signal::Signal::SIGKILL);
    let t = Instant::now();
    let child = act.spawn_script();
    act.child = Some(child);
    act.wait_ready(Duration::from_secs(300));
    let restart_s = t.elapsed().as_secs_f64();
    let adopted = act.http_json("/v1/network/taps")["stateCounts"]["Active"].as_u64().unwrap_or(0);
    assert_eq!(adopted, 500, "every sandbox adopted after the restart");
    rows.push(Row {
        bench: "agent".into(),
        case: "restart with 500 Active (start to /readyz)".into(),
        value: restart_s,
        spread: (restart_s, restart_s),
        unit: "s".into(),
        baseline: Some(("start with tap_init_num=0".into(), startup_s)),
        target: Some("<= 1 s".into()),
    });
    rows
}

/// Runs the agent benchmark: [`run_pool`], then Ensure+fd and Release latency. With
/// `CUBENET_BASELINE_AGENT=<network-agent binary>` (e.g. main's build) the Release rows stand
/// beside that agent measured in the same run, else beside the empty-pool Ensure.
pub fn run() -> Vec<Row> {
    let mut rows = run_pool();
    let baseline_bin = std::env::var_os("CUBENET_BASELINE_AGENT").map(std::path::PathBuf::from);
    rows.extend(run_rate(1000, baseline_bin.as_deref()));

    // Create latency, warm pool vs empty pool.
    for conc in [1usize, 10, 50] {
        let rounds = (100 / conc).clamp(2, 20);
        let mut pooled = AgentUnderTest::prepare(&format!("bench-warm{conc}"), conc.max(1) + 8, "");
        pooled.start();
        let (mut e_warm, mut r_warm) = create_latency(&pooled, conc, rounds, true);
        // The same clients' calls with no work in the agent, on the same agent (issue 15).
        let mut floor = (conc == 50).then(|| floor_latency(&pooled, conc, rounds, 0));
        drop(pooled);
        let mut r_base = baseline_bin.as_ref().map(|bin| {
            let mut old = AgentUnderTest::prepare(&format!("bench-base{conc}"), conc.max(1) + 8, "");
            old.agent_bin = Some(bin.clone());
            old.start();
            create_latency(&old, conc, rounds, true).1
        });
        // Empty pool: every Ensure creates its TAP; one round so nothing comes back warm.
        let mut cold = AgentUnderTest::prepare(&format!("bench-cold{conc}"), 0, "");
        cold.start();
        let (mut e_cold, _) = create_latency(&cold, conc, 1, false);
        drop(cold);
        let cold_p50 = pct(&mut e_cold, 0.5);
        for (q, name) in [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")] {
            let v = pct(&mut e_warm, q);
            rows.push(Row {
                bench: "agent".into(),
                case: format!("Ensure+fd {name}, concurrency {conc}, warm pool"),
                value: v,
                spread: (pct(&mut e_warm, 0.1), pct(&mut e_warm, 0.9)),
                unit: "ms".into(),
                baseline: Some((format!("empty pool {name}"), pct(&mut e_cold, q))),
                target: (conc == 50 && name == "p99").then(|| "<= 2 ms".to_string()),
            });
        }
        if let Some(f) = floor.as_mut() {
            for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
                let v = pct(&mut f.ms, q);
                rows.push(Row {
                    bench: "agent".into(),
                    case: format!(
                        "gRPC + fd floor {name}, concurrency {conc} (Ensure refused in the handler, fd errCode 1002)"
                    ),
                    value: v,
                    spread: (pct(&mut f.ms, 0.1), pct(&mut f.ms, 0.9)),
                    unit: "ms".into(),
                    baseline: Some((format!("Ensure+fd {name}, warm pool, same agent"), pct(&mut e_warm, q))),
                    target: None,
                });
            }
            for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
                let v = pct(&mut f.release_ms, q);
                rows.push(Row {
                    bench: "agent".into(),
                    case: format!("gRPC floor {name}, concurrency {conc} (Release refused in the handler)"),
                    value: v,
                    spread: (pct(&mut f.release_ms, 0.1), pct(&mut f.release_ms, 0.9)),
                    unit: "ms".into(),
                    baseline: Some((format!("Release {name}, same agent"), pct(&mut r_warm, q))),
                    target: None,
                });
            }
        }
        for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
            let v = pct(&mut r_warm, q);
            let baseline = match r_base.as_mut() {
                Some(b) => (format!("main agent Release {name}"), pct(b, q)),
                None => ("empty-pool Ensure+fd p50".into(), cold_p50),
            };
            rows.push(Row {
                bench: "agent".into(),
                case: format!("Release {name}, concurrency {conc}"),
                value: v,
                spread: (pct(&mut r_warm, 0.1), pct(&mut r_warm, 0.9)),
                unit: "ms".into(),
                baseline: Some(baseline),
                target: (conc == 50 && name == "p99").then(|| "<= 5 ms".to_string()),
            });
        }
    }
    rows
}

/// Ensures `ids` through the agent from `clients` concurrent clients, each with its own
/// connection, taking the next id until none is left. Returns Ensure/s over the whole run.
/// With `refused`, every Ensure carries an sctp port mapping and is refused with
/// INVALID_ARGUMENT in the gRPC handler: the same clients' rate with no work in the agent's
/// core (the sustained rate's floor).
fn ensure_rate(a: &AgentUnderTest, ids: Vec<String>, clients: usize, refused: bool) -> f64 {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let endpoint = a.grpc_endpoint();
    let n = ids.len();
    let queue = std::sync::Arc::new(std::sync::Mutex::new(ids));
    let t = Instant::now();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for _ in 0..clients {
            let (endpoint, queue) = (endpoint.clone(), queue.clone());
            tasks.push(tokio::spawn(async move {
                let mut c = network_agent::client::connect(&endpoint).await.expect("connect");
                loop {
                    let Some(id) = queue.lock().expect("queue").pop() else { return };
                    let port_mappings = if refused {
                        vec![pb::PortMapping { protocol: "sctp".into(), container_port: 80, ..Default::default() }]
                    } else {
                        Vec::new()
                    };
                    let r = c
                        .ensure_network(pb::EnsureNetworkRequest {
                            sandbox_id: id,
                            port_mappings,
                            ..Default::default()
                        })
                        .await;
                    match r {
                        Err(e) if refused => assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}"),
                        r => {
                            r.expect("EnsureNetwork");
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.expect("ensure task");
        }
    });
    n as f64 / t.elapsed().as_secs_f64()
}

/// Sustained Ensure rate: 50 clients register `n` sandboxes on a warm pool of `n + 8` TAPs
/// (every TAP on its tcx link first, so no warm-up work runs meanwhile), beside the agent
/// `baseline_bin` (e.g. main's build) measured the same way in the same run; with a baseline,
/// each agent runs twice (fresh each time) and the row shows the means, spread = this build's
/// two runs. A second row: the same 50 clients' rate on this build's agents when every Ensure
/// is refused in the gRPC handler (`ensure_rate`'s `refused`), measured right after each of
/// this build's runs: the rate gRPC and the clients allow on this machine.
/// A third row: the agent's CPU (utime + stime of all its threads, 10 ms ticks, so ±10 µs per
/// Ensure over 1,000) per Ensure over each sustained run, beside the baseline's: it does not
/// depend on how much of this shared machine a run got, which the rate does (issue 15, F23).
pub fn run_rate(n: usize, baseline_bin: Option<&std::path::Path>) -> Vec<Row> {
    let floors = std::cell::RefCell::new(Vec::new());
    // Agent CPU per Ensure over each sustained run (µs), this build's and the baseline's: unlike
    // the rate, it does not depend on how much of the shared machine the run got.
    let cpu_us = std::cell::RefCell::new((Vec::new(), Vec::new()));
    let measure = |bin: Option<&std::path::Path>, tag: &str| {
        let mut a = AgentUnderTest::prepare(tag, n + 8, "cidr = \"192.168.0.0/21\"\n");
        a.agent_bin = bin.map(|b| b.to_path_buf());
        let child = a.spawn_script();
        a.child = Some(child);
        a.wait_ready(Duration::from_secs(600));
        if bin.is_none() {
            wait_metric_zero(&a, "cubenet_tap_warmup_filters", Duration::from_secs(600));
        }
        let pid = agent_pid(&mut a);
        let c0 = cpu_s(pid);
        let rate = ensure_rate(&a, (0..n).map(|i| format!("rate-{i}")).collect(), 50, false);
        let per_call = (cpu_s(pid) - c0) * 1e6 / n as f64;
        let mut c = cpu_us.borrow_mut();
        if bin.is_none() {
            c.0.push(per_call)
        } else {
            c.1.push(per_call)
        }
        drop(c);
        if bin.is_none() {
            floors.borrow_mut().push(ensure_rate(&a, (0..n).map(|i| format!("floor-{i}")).collect(), 50, true));
        }
        rate
    };
    // With a baseline, each agent twice in the order this, baseline, baseline, this: the
    // position in the run weighed more than the binary on this shared machine (whichever ran
    // second won), and this order gives both the same positions.
    let (rate, base, spread) = match baseline_bin {
        None => {
            let r = measure(None, "bench-rate");
            (r, None, (r, r))
        }
        Some(b) => {
            let r1 = measure(None, "bench-rate-1");
            let b1 = measure(Some(b), "bench-rate-base-1");
            let b2 = measure(Some(b), "bench-rate-base-2");
            let r2 = measure(None, "bench-rate-2");
            eprintln!("  sustained rate: this build {r1:.0}, {r2:.0}; baseline {b1:.0}, {b2:.0} Ensure/s");
            ((r1 + r2) / 2.0, Some((b1 + b2) / 2.0), (r1.min(r2), r1.max(r2)))
        }
    };
    let (cpu_ours, cpu_base) = cpu_us.into_inner();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let cpu_spread = cpu_ours.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &f| (lo.min(f), hi.max(f)));
    eprintln!("  agent CPU per Ensure in the sustained runs: this build {cpu_ours:.0?}; baseline {cpu_base:.0?} µs");
    let floors = floors.into_inner();
    let floor = floors.iter().sum::<f64>() / floors.len() as f64;
    let floor_spread = floors.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &f| (lo.min(f), hi.max(f)));
    vec![
        Row {
            bench: "agent".into(),
            case: format!("Ensure sustained rate, 50 clients ({n} sandboxes, warm pool)"),
            value: rate,
            spread,
            unit: "Ensure/s".into(),
            baseline: base.map(|b| ("main agent".to_string(), b)),
            target: Some(">= 5000 Ensure/s".into()),
        },
        Row {
            bench: "agent".into(),
            case: format!("agent CPU per Ensure in the sustained rate run, 50 clients ({n} sandboxes)"),
            value: mean(&cpu_ours),
            spread: cpu_spread,
            unit: "µs".into(),
            baseline: (!cpu_base.is_empty()).then(|| ("main agent".to_string(), mean(&cpu_base))),
            target: None,
        },
        Row {
            bench: "agent".into(),
            case: format!("gRPC floor sustained rate, 50 clients ({n} Ensures refused in the handler)"),
            value: floor,
            spread: floor_spread,
            unit: "calls/s".into(),
            baseline: Some(("Ensure sustained rate, same agents".to_string(), rate)),
            target: None,
        },
    ]
}
