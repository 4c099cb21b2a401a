//! Soak (issue 14): the agent and datapath under `minutes` of mixed load, sampled over time.
//!
//! One agent (release binary under `cargo xtask bench`) programs a harness node namespace;
//! world runs an HTTP server. A driver loop, until the deadline: Ensure a new sandbox and take
//! its TAP fd; from that guest (smoltcp on the TAP) open and close 3 TCP connections to world
//! and ping it 3 times; Reconcile the policy of another live sandbox (alternately tightening,
//! which flushes its flows with a new version, and loosening); Release the oldest when more
//! than 6 are alive. The agent's reaper (1 s) and maintenance (1 s) run throughout.
//!
//! Every 5 s a sample: agent RSS, open fds, sessions in the maps, datapath registrations, port
//! maps, cycles done and errors (failed calls, exchanges, pings). Written as JSON rows beside a
//! same-run baseline (the first sample after a 30 s warm-up, or the first sample in shorter
//! runs), the whole series to `target/soak.json` and a PNG plot to `target/soak.png`. Growth =
//! least-squares slope over the samples after the warm-up, per minute. Never fails on time.

use std::{
    collections::VecDeque,
    path::PathBuf,
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    guest::TapGuest,
    packet::{self, Transport},
    servers, smol,
    topology::WORLD_IP,
};
use serde::Serialize;

use crate::report::Row;

/// TAPs created with a virtio-net header (the pool's TAP options).
const VNET_HDR_LEN: usize = 12;
/// Sandboxes kept alive at once.
const LIVE: usize = 6;
/// Sample period.
const SAMPLE: Duration = Duration::from_secs(5);
/// Samples before this are warm-up (the pool fills, maps and allocator settle).
const WARMUP: Duration = Duration::from_secs(30);

/// One sample of the series.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    /// Seconds since the start.
    pub t_s: f64,
    /// Agent resident set (MiB).
    pub rss_mib: f64,
    /// Agent open fds.
    pub fds: f64,
    /// Egress sessions in the datapath.
    pub sessions: f64,
    /// Datapath sandbox registrations.
    pub registrations: f64,
    /// Port maps in the datapath.
    pub portmaps: f64,
    /// Ensure → traffic → Reconcile → Release cycles done.
    pub cycles: f64,
    /// Errors so far (calls, TCP exchanges, pings).
    pub errors: f64,
}

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0
}

fn fds(pid: u32) -> f64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as f64).unwrap_or(0.0)
}

fn count(a: &AgentUnderTest, path: &str, key: &str) -> f64 {
    a.http(path)
        .and_then(|(_, b)| serde_json::from_str::<serde_json::Value>(&b).ok())
        .and_then(|v| v[key].as_array().map(Vec::len))
        .unwrap_or(0) as f64
}

/// Least-squares slope of `y` over `t` (per second); 0 with fewer than 2 points.
fn slope(t: &[f64], y: &[f64]) -> f64 {
    let n = t.len() as f64;
    if t.len() < 2 {
        return 0.0;
    }
    let (mt, my) = (t.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let num: f64 = t.iter().zip(y).map(|(a, b)| (a - mt) * (b - my)).sum();
    let den: f64 = t.iter().map(|a| (a - mt).powi(2)).sum();
    if den == 0.0 { 0.0 } else { num / den }
}

/// Runs the soak for `minutes` and returns its rows; writes the series and plot under
/// `target/`.
pub fn run(minutes: f64) -> Vec<Row> {
    let mut a = AgentUnderTest::prepare("soak", 4, "reaper_interval_secs = 1\n");
    a.start();
    let pid = a.child.as_ref().map(|c| c.id()).expect("agent pid");
    let _http = servers::http(&a.topo.world, WORLD_IP, 80);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let mut c = rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).expect("connect");
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(minutes * 60.0);
    let mut live: VecDeque<String> = VecDeque::new();
    let (mut cycles, mut errors, mut n) = (0u64, 0u64, 0u64);
    let mut series: Vec<Sample> = Vec::new();
    let mut next_sample = start;
    let mut err_kinds: std::collections::BTreeMap<&'static str, u64> = Default::default();
    let mut fail = |k: &'static str, errors: &mut u64| {
        *errors += 1;
        *err_kinds.entry(k).or_default() += 1;
    };
    while Instant::now() < deadline {
        if Instant::now() >= next_sample {
            series.push(Sample {
                t_s: start.elapsed().as_secs_f64(),
                rss_mib: rss_mib(pid),
                fds: fds(pid),
                sessions: count(&a, "/v1/dataplane/sessions", "sessions"),
                registrations: count(&a, "/v1/dataplane/sandboxes", "sandboxes"),
                portmaps: count(&a, "/v1/dataplane/portmaps", "portMappings"),
                cycles: cycles as f64,
                errors: errors as f64,
            });
            next_sample += SAMPLE;
        }
        n += 1;
        let id = format!("soak-{n}");
        let req = pb::EnsureNetworkRequest {
            sandbox_id: id.clone(),
            port_mappings: vec![pb::PortMapping { protocol: "tcp".into(), container_port: 8080, ..Default::default() }],
            cubevs_context: Some(pb::CubeVsContext { allow_internet_access: Some(true), ..Default::default() }),
            ..Default::default()
        };
        let r = match rt.block_on(c.ensure_network(req)) {
            Ok(r) => r.into_inner(),
            Err(_) => {
                fail("ensure", &mut errors);
                continue;
            }
        };
        live.push_back(id.clone());
        let (reply, fd) = tap_fd(&a.tap_socket(), &r.interfaces[0].name, &id);
        match fd {
            Some(fd) if reply["errCode"] == "0" => {
                let g = TapGuest::new(fd, VNET_HDR_LEN);
                g.drain();
                for k in 0..3u16 {
                    let out = smol::tcp_exchange_with(
                        &mut smol::GuestDevice::new(&g, false),
                        WORLD_IP,
                        80,
                        41000 + k,
                        b"GET / HTTP/1.0\r\n\r\n",
                        Duration::from_secs(5),
                    );
                    if !out.connected || out.received.is_empty() {
                        fail("tcp", &mut errors);
                    }
                }
                for seq in 0..3u16 {
                    g.send(&packet::icmp_echo_request(WORLD_IP, 0x77, seq));
                    let back = g.recv_matching(Duration::from_secs(2), |f| {
                        packet::parse_ipv4(f).is_some_and(|s| s.transport == Transport::EchoReply(0x77, seq))
                    });
                    if back.is_none() {
                        fail("ping", &mut errors);
                    }
                }
            }
            _ => fail("tap_fd", &mut errors),
        }
        // Policy churn on another live sandbox: tighten (new version, flows flushed) / loosen.
        if let Some(other) = live.iter().rev().nth(1).cloned() {
            let ctx = if n % 2 == 0 {
                pb::CubeVsContext {
                    allow_internet_access: Some(true),
                    deny_out: vec![format!("203.0.113.{}/32", n % 250 + 1)],
                    ..Default::default()
                }
            } else {
                pb::CubeVsContext { allow_internet_access: Some(true), ..Default::default() }
            };
            let req =
                pb::ReconcileNetworkRequest { sandbox_id: other, cubevs_context: Some(ctx), ..Default::default() };
            if rt.block_on(c.reconcile_network(req)).is_err() {
                fail("reconcile", &mut errors);
            }
        }
        while live.len() > LIVE {
            let old = live.pop_front().expect("non-empty");
            let req = pb::ReleaseNetworkRequest { sandbox_id: old, ..Default::default() };
            if !rt.block_on(c.release_network(req)).is_ok_and(|r| r.into_inner().released) {
                fail("release", &mut errors);
            }
        }
        cycles += 1;
    }
    // Final sample after releasing everything and two reaper/maintenance passes.
    for id in live.drain(..) {
        let _ = rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: id, ..Default::default() }));
    }
    std::thread::sleep(Duration::from_secs(3));
    let last = Sample {
        t_s: start.elapsed().as_secs_f64(),
        rss_mib: rss_mib(pid),
        fds: fds(pid),
        sessions: count(&a, "/v1/dataplane/sessions", "sessions"),
        registrations: count(&a, "/v1/dataplane/sandboxes", "sandboxes"),
        portmaps: count(&a, "/v1/dataplane/portmaps", "portMappings"),
        cycles: cycles as f64,
        errors: errors as f64,
    };
    series.push(last.clone());

    let warm: Vec<&Sample> = series.iter().filter(|s| s.t_s >= WARMUP.as_secs_f64()).collect();
    let steady: Vec<&Sample> = if warm.len() >= 2 { warm } else { series.iter().collect() };
    let base = steady[0].clone();
    let t: Vec<f64> = steady.iter().map(|s| s.t_s).collect();
    let per_min = |f: fn(&Sample) -> f64| slope(&t, &steady.iter().map(|s| f(s)).collect::<Vec<_>>()) * 60.0;
    let row = |case: &str, value: f64, unit: &str, baseline: Option<(String, f64)>| Row {
        bench: "soak".into(),
        case: case.into(),
        value,
        spread: (value, value),
        unit: unit.into(),
        baseline,
        target: None,
    };
    let at_base = |v: f64| Some((format!("at {:.0} s", base.t_s), v));
    let rows = vec![
        row("agent RSS at the end", last.rss_mib, "MiB", at_base(base.rss_mib)),
        row("agent RSS growth (slope after warm-up)", per_min(|s| s.rss_mib), "MiB/min", None),
        row("agent fds at the end", last.fds, "fds", at_base(base.fds)),
        row("agent fd growth (slope after warm-up)", per_min(|s| s.fds), "fds/min", None),
        row("sessions left after releasing all", last.sessions, "sessions", None),
        row("sessions in the maps, max", series.iter().map(|s| s.sessions).fold(0.0, f64::max), "sessions", None),
        row("registrations left after releasing all", last.registrations, "entries", None),
        row("port maps left after releasing all", last.portmaps, "entries", None),
        row("cycles (ensure, 3 TCP, 3 pings, reconcile, release)", cycles as f64, "cycles", None),
        row("errors", errors as f64, "errors", None),
    ];
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target");
    let json = serde_json::json!({
        "minutes": minutes, "cycles": cycles, "errors": errors, "error_kinds": err_kinds,
        "rss_growth_mib_per_min": per_min(|s| s.rss_mib), "fd_growth_per_min": per_min(|s| s.fds),
        "samples": series,
    });
    let _ = std::fs::write(root.join("soak.json"), serde_json::to_string_pretty(&json).unwrap_or_default());
    match crate::plot::soak_png(&root.join("soak.png"), &series) {
        Ok(()) => eprintln!("wrote {} and {}", root.join("soak.json").display(), root.join("soak.png").display()),
        Err(e) => eprintln!("wrote {}; no plot: {e}", root.join("soak.json").display()),
    }
    eprintln!("soak: {cycles} cycles, {errors} errors {err_kinds:?}");
    rows
}
