//! Crash points for CubeEgress (issue 14): `kill -9` of the gateway at random moments while
//! sandbox clients (curl, one unique path per request) send plain-HTTP requests through it to a
//! world server that answers after 200 ms, then a restart. Afterwards: no request reached the
//! world twice and no client got an answer the world did not give exactly once (nothing
//! answered twice, nothing answered from nowhere); every audit line is a complete JSON record,
//! also across the restarts (a record cut by the kill must not swallow the next process's
//! first record); every request that reached the world, and every one a client got an answer
//! for, has its audit record (`http_request_start`, written before forwarding, or `http_request`):
//! none may be lost to the kill (E20; before E20 the writer thread still held the records of the
//! requests in flight at the kill).
//! CI: 10 crash points, 8 clients; `CUBENET_RELIABILITY_LONG=1`: 100 points, 50 clients.
//!
//! Rig as in `egress.rs`: sandbox namespace behind `cube-dev`, mangle marks standing in for
//! the datapath, `cube-egress-net.sh up` (TPROXY), the agent's policy dump served in the node.
//! Prints one `RELIABILITY {json}` line (read by `cargo xtask reliability`).

use std::{
    collections::{BTreeMap, BTreeSet},
    convert::Infallible,
    net::SocketAddr,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use cubenet_tests::{
    TmpDir,
    egress_swap::{SANDBOX_IP, STEER_HTTP, egress_bin, sandbox_behind_cube_dev, script},
    fuzz::rng::Rng,
    netns::{ChildGuard, TestNetns},
    require_root,
    topology::Topology,
};
use http_body_util::Full;
use hyper::{Request, Response, body::Incoming};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

const WORLD: &str = "198.51.100.1";

/// World paths seen, with how many times.
type Seen = Arc<Mutex<BTreeMap<String, u32>>>;

/// Plain HTTP in `ns` on `addr`: counts each path, answers after 200 ms.
fn world_server(rt: &tokio::runtime::Runtime, ns: &TestNetns, addr: SocketAddr) -> Seen {
    let l = ns.run(move || std::net::TcpListener::bind(addr)).unwrap();
    l.set_nonblocking(true).unwrap();
    let seen: Seen = Arc::default();
    let s = seen.clone();
    rt.spawn(async move {
        let l = tokio::net::TcpListener::from_std(l).unwrap();
        loop {
            let Ok((stream, _)) = l.accept().await else { continue };
            let s = s.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |r: Request<Incoming>| {
                    let s = s.clone();
                    async move {
                        let path = r.uri().path().to_string();
                        *s.lock().unwrap().entry(path.clone()).or_default() += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!("ok {path}\n")))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    seen
}

/// The agent's policy dump endpoint (always ready).
fn dump_server(rt: &tokio::runtime::Runtime, ns: &TestNetns, dump: Value) -> SocketAddr {
    let l = ns.run(|| std::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let body = dump.to_string();
    rt.spawn(async move {
        let l = tokio::net::TcpListener::from_std(l).unwrap();
        loop {
            let Ok((stream, _)) = l.accept().await else { continue };
            let body = body.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_r: Request<Incoming>| {
                    let body = body.clone();
                    async move { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body)))) }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    addr
}

/// Sandbox namespace on `cube-dev` plus the port-80 mark the datapath would set.
fn sandbox_net(topo: &Topology) -> TestNetns {
    sandbox_behind_cube_dev(topo, &[STEER_HTTP])
}

/// Runs `cube-egress-net.sh down` in the node namespace on drop (also on panic).
struct NetDown<'a>(&'a TestNetns);
impl Drop for NetDown<'_> {
    fn drop(&mut self) {
        let _ = self.0.exec("bash", &[script().to_str().unwrap(), "down"]);
    }
}

fn admin_health(node: &TestNetns) -> String {
    let o = node.exec("curl", &["-s", "--max-time", "2", "http://127.0.0.1:9091/admin/v1/health"]);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn start_gateway(node: &TestNetns, dir: &Path, dump: SocketAddr) -> ChildGuard {
    let audit = dir.join("log/access.jsonl");
    let gw = node.spawn(
        egress_bin().to_str().unwrap(),
        &[
            "--sandbox-cidr",
            "192.168.0.0/18",
            "--ca-dir",
            dir.join("ca").to_str().unwrap(),
            "--audit-file",
            audit.to_str().unwrap(),
            "--bootstrap-url",
            &format!("http://{dump}/v1/policies/dump"),
            "--bootstrap-retry-secs",
            "1",
            "--drain-timeout-secs",
            "1",
        ],
    );
    let t = Instant::now();
    while !admin_health(node).contains("\"bootstrap_status\":\"ready\"") {
        assert!(t.elapsed() < Duration::from_secs(20), "gateway not ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    gw
}

#[test]
fn kill9_during_requests() {
    if !require_root("reliability_egress_crash kill9_during_requests") {
        return;
    }
    let long = std::env::var("CUBENET_RELIABILITY_LONG").is_ok_and(|v| v == "1");
    let (points, clients) = if long { (100, 50) } else { (10, 8) };
    let mut rng = Rng::new(std::env::var("CUBENET_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(14));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let tmp = TmpDir(std::env::temp_dir().join(format!("cube-egress-crash-{}", std::process::id())));
    let dir = tmp.0.clone();
    std::fs::create_dir_all(dir.join("ca")).unwrap();
    let ca = cubenet_tests::tls::make_ca("CubeSandbox Egress crash CA");
    std::fs::write(dir.join("ca/cube-root-ca.crt"), &ca.pem).unwrap();
    std::fs::write(dir.join("ca/cube-root-ca.key"), &ca.key_pem).unwrap();

    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = Arc::new(sandbox_net(&topo));
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap());
    let policy = json!({"policy_id": SANDBOX_IP, "rules": [
        {"id": "plain", "match": {"host": WORLD, "scheme": "http"}, "action": {"allow": true}}
    ]});
    let dump = dump_server(&rt, node, json!({"policies": {SANDBOX_IP: policy}}));
    let _down = NetDown(node);
    let o = node.exec("bash", &[script().to_str().unwrap(), "up"]);
    assert!(o.status.success(), "up: {}", String::from_utf8_lossy(&o.stderr));

    let start = Instant::now();
    let answered: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let mut gw = start_gateway(node, &dir, dump);
    let mut sent = 0u64;
    for point in 0..points {
        let stop = Arc::new(AtomicBool::new(false));
        let handles: Vec<_> = (0..clients)
            .map(|k| {
                let (sb, stop, answered) = (sb.clone(), stop.clone(), answered.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let path = format!("/p{point}/c{k}/r{n}");
                        n += 1;
                        let o = sb.exec("curl", &["-sS", "--max-time", "5", &format!("http://{WORLD}{path}")]);
                        let body = String::from_utf8_lossy(&o.stdout).into_owned();
                        if o.status.success() {
                            answered.lock().unwrap().push((path, body));
                        }
                    }
                    n
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300 + rng.below(1200) as u64));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(gw.id() as i32), nix::sys::signal::Signal::SIGKILL)
            .expect("kill gateway");
        let _ = gw.child().wait();
        stop.store(true, Ordering::Relaxed);
        sent += handles.into_iter().map(|h| h.join().unwrap()).sum::<u64>();
        gw = start_gateway(node, &dir, dump);
    }
    // One more round on the last process, then let its writer catch up.
    let (_, body, _) = {
        let o = sb.exec("curl", &["-sS", "--max-time", "5", &format!("http://{WORLD}/final")]);
        (0, String::from_utf8_lossy(&o.stdout).into_owned(), o)
    };
    assert_eq!(body, "ok /final\n", "gateway serves after the last restart");
    std::thread::sleep(Duration::from_millis(500));
    drop(gw);

    let mut v = Vec::new();
    let seen = seen.lock().unwrap().clone();
    for (path, n) in &seen {
        if *n > 1 {
            v.push(format!("{path} reached the world {n} times"));
        }
    }
    let answered = answered.lock().unwrap().clone();
    let mut answered_paths = BTreeSet::new();
    for (path, body) in &answered {
        if !answered_paths.insert(path.clone()) {
            v.push(format!("{path} answered twice"));
        }
        if body != &format!("ok {path}\n") {
            v.push(format!("{path} answered {body:?}, not the world's answer"));
        }
        if seen.get(path) != Some(&1) {
            v.push(format!("{path} answered but the world saw it {:?} times", seen.get(path)));
        }
    }
    // Audit: complete lines only; answered requests without a record are counted.
    let text = std::fs::read_to_string(dir.join("log/access.jsonl")).unwrap_or_default();
    let mut torn = Vec::new();
    let mut audited = BTreeSet::new();
    for (i, l) in text.lines().enumerate() {
        match serde_json::from_str::<Value>(l) {
            Ok(r) if r["event"] == "http_request" || r["event"] == "http_request_start" => {
                if let Some(p) = r["http"]["path"].as_str() {
                    audited.insert(p.to_string());
                }
            }
            Ok(_) => {}
            Err(e) => torn.push(format!("line {}: {e}: {}", i + 1, &l[..l.len().min(160)])),
        }
    }
    if !torn.is_empty() {
        v.push(format!("{} audit lines are not complete JSON records: {}", torn.len(), torn.join(" | ")));
    }
    let unaudited: Vec<&String> = answered_paths.iter().filter(|p| !audited.contains(*p)).collect();
    let world_unaudited: Vec<&String> = seen.keys().filter(|p| !audited.contains(*p)).collect();
    if !unaudited.is_empty() {
        v.push(format!(
            "{} answered requests have no audit record, e.g. {:?}",
            unaudited.len(),
            &unaudited[..unaudited.len().min(10)]
        ));
    }
    if !world_unaudited.is_empty() {
        v.push(format!(
            "{} requests reached the world without an audit record, e.g. {:?}",
            world_unaudited.len(),
            &world_unaudited[..world_unaudited.len().min(10)]
        ));
    }
    let report = json!({
        "case": "crash-egress-kill9",
        "inputs": points,
        "violations": if v.is_empty() { json!({}) } else { json!({"egress": v.len()}) },
        "secs": start.elapsed().as_secs_f64(),
        "clients": clients,
        "requests_sent": sent,
        "answered": answered.len(),
        "reached_world": seen.len(),
        "answered_without_audit_record": unaudited.len(),
        "reached_world_without_audit_record": world_unaudited.len(),
        "audit_lines": text.lines().count(),
    });
    println!("RELIABILITY {report}");
    assert!(v.is_empty(), "{} violations:\n{}", v.len(), v.join("\n"));
}
