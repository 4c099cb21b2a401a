//! `cargo xtask bench egress`: requests/s and added latency through cube-egress vs mitmproxy,
//! with the same client, upstream, CA and topology, in one run; plus each proxy's RSS.
//!
//! ```text
//!  sandbox ns (load generator) ─veth─ node ns (proxy under test) ─veth─ world ns (HTTPS server)
//! ```
//!
//! Phases: `direct` (node forwards, no proxy: the baseline latency), `cube-egress` (datapath
//! marks + `cube-egress-net.sh up` + TPROXY, policy allows the SNI), `mitmproxy` (mitmdump in
//! transparent mode behind an iptables REDIRECT, using the same CA and trusting the same world
//! CA). Each phase runs `BENCH_CONC` (default 16) keep-alive HTTP/1.1-over-TLS connections for
//! `BENCH_SECS` (default 10) seconds. Needs root; `MITMDUMP` overrides the mitmdump path (empty:
//! no mitmproxy phase). `CUBE_EGRESS_BASELINE_BIN` adds the cube-egress phase again with that
//! binary (label `CUBE_EGRESS_BASELINE_LABEL`), e.g. the previous release, measured in the same run.
//! Figures are printed (a table, then one `ROW {json}` line per figure; `BENCH_JSON` also writes
//! them to a file), never asserted.

use std::{
    convert::Infallible,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use cubenet_tests::{
    egress_swap::{SANDBOX_IP, STEER_HTTP, STEER_HTTPS, sandbox_behind_cube_dev, steer_marks},
    netns::TestNetns,
    require_root, tls,
    topology::Topology,
};
use http_body_util::{BodyExt, Empty, Full};
use hyper::{Request, Response, body::Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};

const WORLD: &str = "198.51.100.1";
const NAME: &str = "api.example.test";

fn serve_world(rt: &tokio::runtime::Runtime, world: &TestNetns, cfg: rustls::ServerConfig) {
    let addr: SocketAddr = format!("{WORLD}:443").parse().unwrap();
    let l = world.run(move || std::net::TcpListener::bind(addr)).unwrap();
    l.set_nonblocking(true).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    rt.spawn(async move {
        let l = tokio::net::TcpListener::from_std(l).unwrap();
        loop {
            let Ok((s, _)) = l.accept().await else { continue };
            let a = acceptor.clone();
            tokio::spawn(async move {
                let Ok(t) = a.accept(s).await else { return };
                let svc = hyper::service::service_fn(|_r: Request<Incoming>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hello from world\n"))))
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(t), svc)
                    .await;
            });
        }
    });
}

struct Stats {
    requests: u64,
    errors: u64,
    secs: f64,
    lat_us: Vec<u64>,
}

impl Stats {
    fn pct(&self, p: f64) -> f64 {
        if self.lat_us.is_empty() {
            return f64::NAN;
        }
        let i = ((self.lat_us.len() as f64 - 1.0) * p).round() as usize;
        self.lat_us[i] as f64 / 1000.0
    }
    fn rps(&self) -> f64 {
        self.requests as f64 / self.secs
    }
}

async fn worker(tls: Arc<rustls::ClientConfig>, deadline: Instant) -> (u64, u64, Vec<u64>) {
    let (mut ok, mut err, mut lat) = (0u64, 0u64, Vec::new());
    let connector = tokio_rustls::TlsConnector::from(tls);
    let name = rustls::pki_types::ServerName::try_from(NAME).unwrap();
    'outer: while Instant::now() < deadline {
        let conn = async {
            let tcp = tokio::net::TcpStream::connect(format!("{WORLD}:443")).await.ok()?;
            tcp.set_nodelay(true).ok()?;
            let t = connector.connect(name.clone(), tcp).await.ok()?;
            let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(t)).await.ok()?;
            tokio::spawn(conn);
            Some(send)
        };
        let Some(mut send) = conn.await else {
            err += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        while Instant::now() < deadline {
            let req = Request::get("/bench").header("host", NAME).body(Empty::<Bytes>::new()).unwrap();
            let t0 = Instant::now();
            let r = async {
                let resp = send.send_request(req).await.ok()?;
                let ok = resp.status().is_success();
                resp.into_body().collect().await.ok()?;
                ok.then_some(())
            }
            .await;
            match r {
                Some(()) => {
                    ok += 1;
                    lat.push(t0.elapsed().as_micros() as u64);
                }
                None => {
                    err += 1;
                    continue 'outer;
                }
            }
        }
    }
    (ok, err, lat)
}

/// Runs the load generator on threads inside the sandbox namespace.
fn load(sb: &TestNetns, ca_pem: &str, conc: usize, secs: u64) -> Stats {
    let tls = tls::client_config(ca_pem);
    sb.run(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async move {
            // Warm-up (connections, leaf cache) outside the measurement.
            let _ = worker(tls.clone(), Instant::now() + Duration::from_millis(500)).await;
            let start = Instant::now();
            let deadline = start + Duration::from_secs(secs);
            let hs: Vec<_> = (0..conc).map(|_| tokio::spawn(worker(tls.clone(), deadline))).collect();
            let mut s = Stats { requests: 0, errors: 0, secs: 0.0, lat_us: Vec::new() };
            for h in hs {
                let (ok, err, lat) = h.await.unwrap();
                s.requests += ok;
                s.errors += err;
                s.lat_us.extend(lat);
            }
            s.secs = start.elapsed().as_secs_f64();
            s.lat_us.sort_unstable();
            s
        })
    })
}

/// (current RSS, peak RSS) of a process in MiB, from /proc.
fn rss_mib(pid: u32) -> (f64, f64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
            / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn wait_port(ns: &TestNetns, addr: &str) {
    let a: SocketAddr = addr.parse().unwrap();
    for _ in 0..200 {
        if ns.run(move || std::net::TcpStream::connect_timeout(&a, Duration::from_millis(100)).is_ok()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{addr} never came up");
}

fn sh(ns: &TestNetns, prog: &str, args: &[&str]) {
    let o = ns.exec(prog, args);
    assert!(o.status.success(), "{prog} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn main() {
    if !require_root("egress benchmark") {
        std::process::exit(1);
    }
    let secs: u64 = std::env::var("BENCH_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let conc: usize = std::env::var("BENCH_CONC").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
    let egress_bin = std::env::var("CUBE_EGRESS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().join("cube-egress"));
    let mitmdump = std::env::var("MITMDUMP").unwrap_or_else(|_| {
        let venv = repo().join("target/mitmproxy-venv/bin/mitmdump");
        if venv.exists() { venv.to_string_lossy().into_owned() } else { "mitmdump".into() }
    });
    let dir = std::env::temp_dir().join(format!("cube-egress-bench-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("ca")).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();

    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_behind_cube_dev(&topo, &[]);
    world.ip(&["route", "add", "192.168.0.0/18", "via", "198.51.100.2"]);
    // Only inside our node namespace: lets the direct baseline be routed.
    sh(node, "sysctl", &["-q", "-w", "net.ipv4.ip_forward=1"]);

    let gw_ca = tls::make_ca("bench gateway CA");
    let world_ca = tls::make_ca("bench world CA");
    std::fs::write(dir.join("ca/cube-root-ca.crt"), &gw_ca.pem).unwrap();
    std::fs::write(dir.join("ca/cube-root-ca.key"), &gw_ca.key_pem).unwrap();
    std::fs::write(dir.join("world-ca.pem"), &world_ca.pem).unwrap();
    std::fs::write(dir.join("mitmproxy-ca.pem"), format!("{}{}", gw_ca.key_pem, gw_ca.pem)).unwrap();
    serve_world(&rt, world, tls::server_config(&world_ca, NAME));

    println!("egress benchmark: {conc} keep-alive HTTP/1.1+TLS connections x {secs} s per phase, 2-core host");

    // Phase 1: direct.
    let direct = load(&sb, &world_ca.pem, conc, secs);

    // Phase 2: cube-egress; then, when `CUBE_EGRESS_BASELINE_BIN` names another build (e.g. the
    // previous release), the same phase on it, so both are measured in one run.
    let egress = egress_phase(node, &sb, &dir, &gw_ca.pem, &egress_bin, conc, secs);
    let baseline = std::env::var_os("CUBE_EGRESS_BASELINE_BIN").map(|b| {
        let label = std::env::var("CUBE_EGRESS_BASELINE_LABEL").unwrap_or_else(|_| "baseline".into());
        (format!("cube-egress ({label})"), egress_phase(node, &sb, &dir, &gw_ca.pem, Path::new(&b), conc, secs))
    });

    // Phase 3: mitmproxy (transparent mode, REDIRECT), same CA and upstream trust; skipped
    // when `MITMDUMP` is set to the empty string.
    let mitm = (!mitmdump.is_empty()).then(|| mitm_phase(node, &sb, &dir, &gw_ca.pem, &mitmdump, conc, secs));
    let (egress_stats, egress_rss) = egress;
    let base50 = direct.pct(0.5);
    let base99 = direct.pct(0.99);
    println!();
    println!("| path | req/s | errors | p50 ms | p99 ms | added p50 ms | added p99 ms | RSS MiB (peak) |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut row = |name: &str, s: &Stats, rss: Option<(f64, f64)>| {
        println!(
            "| {name} | {:.0} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
            s.rps(),
            s.errors,
            s.pct(0.5),
            s.pct(0.99),
            s.pct(0.5) - base50,
            s.pct(0.99) - base99,
            rss.map(|(c, p)| format!("{c:.1} ({p:.1})")).unwrap_or_else(|| "-".into())
        );
        for (what, value, unit) in [
            ("req/s", s.rps(), "req/s"),
            ("p50", s.pct(0.5), "ms"),
            ("p99", s.pct(0.99), "ms"),
            ("errors", s.errors as f64, "count"),
        ] {
            rows.push(serde_json::json!({
                "bench": "egress", "case": format!("{name}: {what}"), "value": value, "unit": unit,
                "baseline": if name.starts_with("direct") { serde_json::Value::Null } else { serde_json::json!(["direct (no proxy)", match what { "req/s" => direct.rps(), "p50" => base50, "p99" => base99, _ => direct.errors as f64 }]) },
            }));
        }
    };
    row("direct (no proxy)", &direct, None);
    row("cube-egress", &egress_stats, Some(egress_rss));
    if let Some((label, (s, rss))) = &baseline {
        row(label, s, Some(*rss));
    }
    if let Some((s, rss)) = &mitm {
        row("mitmproxy", s, Some(*rss));
    }
    println!();
    if let Some((label, (s, _))) = &baseline {
        println!(
            "cube-egress / {label}: {:.2}x requests/s, p50 {:+.2} ms, p99 {:+.2} ms",
            egress_stats.rps() / s.rps(),
            egress_stats.pct(0.5) - s.pct(0.5),
            egress_stats.pct(0.99) - s.pct(0.99)
        );
    }
    if let Some((s, rss)) = &mitm {
        println!(
            "cube-egress / mitmproxy: {:.1}x requests/s, {:.2}x RSS (targets: >= 10x, <= 0.20x)",
            egress_stats.rps() / s.rps(),
            egress_rss.1 / rss.1
        );
    }
    for r in &rows {
        println!("ROW {r}");
    }
    if let Some(p) = std::env::var_os("BENCH_JSON") {
        std::fs::write(&p, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
    drop(rt);
}

/// Phase with mitmproxy: REDIRECT to mitmdump in transparent mode; returns (stats, RSS).
fn mitm_phase(
    node: &TestNetns,
    sb: &TestNetns,
    dir: &Path,
    ca_pem: &str,
    mitmdump: &str,
    conc: usize,
    secs: u64,
) -> (Stats, (f64, f64)) {
    sh(
        node,
        "iptables",
        &[
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-i",
            "cube-dev",
            "-p",
            "tcp",
            "--dport",
            "443",
            "-j",
            "REDIRECT",
            "--to-ports",
            "8081",
        ],
    );
    let mut mitm = node.spawn(
        mitmdump,
        &[
            "--mode",
            "transparent",
            "--listen-port",
            "8081",
            "-q",
            "--set",
            &format!("confdir={}", dir.display()),
            "--set",
            &format!("ssl_verify_upstream_trusted_ca={}", dir.join("world-ca.pem").display()),
            "--set",
            "connection_strategy=lazy",
        ],
    );
    wait_port(node, "127.0.0.1:8081");
    let stats = load(sb, ca_pem, conc, secs);
    let rss = rss_mib(mitm.id());
    drop(mitm.child().kill());
    let _ = mitm.child().wait();
    (stats, rss)
}

/// Phase with a cube-egress binary behind the datapath marks and TPROXY; returns (stats, RSS).
fn egress_phase(
    node: &TestNetns,
    sb: &TestNetns,
    dir: &Path,
    ca_pem: &str,
    egress_bin: &Path,
    conc: usize,
    secs: u64,
) -> (Stats, (f64, f64)) {
    steer_marks(node, "-I", &[STEER_HTTP, STEER_HTTPS]);
    let script = repo().join("scripts/cube-egress-net.sh");
    sh(node, "bash", &[script.to_str().unwrap(), "up"]);
    let mut gw = node.spawn(
        egress_bin.to_str().unwrap(),
        &[
            "--ca-dir",
            dir.join("ca").to_str().unwrap(),
            "--upstream-extra-ca",
            dir.join("world-ca.pem").to_str().unwrap(),
            "--audit-file",
            dir.join("access.jsonl").to_str().unwrap(),
            "--bootstrap-url",
            "",
        ],
    );
    wait_port(node, "127.0.0.1:9091");
    let pol = format!(
        r#"{{"policy_id":"bench","rules":[{{"id":"api","match":{{"sni":"{NAME}"}},"action":{{"allow":true}}}}]}}"#
    );
    sh(
        node,
        "curl",
        &["-sf", "-X", "PUT", "--data", &pol, &format!("http://127.0.0.1:9091/admin/v1/policies/{SANDBOX_IP}")],
    );
    let stats = load(sb, ca_pem, conc, secs);
    let rss = rss_mib(gw.id());
    // SAFETY: signalling the child we spawned, by its PID.
    unsafe { libc::kill(gw.id() as i32, libc::SIGTERM) };
    let _ = gw.child().wait();
    sh(node, "bash", &[script.to_str().unwrap(), "down"]);
    steer_marks(node, "-D", &[STEER_HTTP, STEER_HTTPS]);

    let _ = std::fs::remove_file(dir.join("access.jsonl"));
    (stats, rss)
}
