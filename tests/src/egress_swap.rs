//! CubeEgress swap rig: a gateway behind the real TPROXY path, an HTTPS world server that counts
//! every request it sees, and a load generator in the sandbox namespace (keep-alive and
//! connection-per-request HTTPS clients) that records every failure. Shared by
//! `tests/tests/egress_swap.rs` (asserts) and the `gateway swap` benchmark rows (reports).
//!
//! ```text
//!  sandbox ns 192.168.0.2 ─veth─ node ns: cube-dev 192.168.0.1/18, marks + cube-egress-net.sh up ─ world ns
//!   load generator                 cube-egress (slot A, then slot B after the swap)              198.51.100.1:443
//! ```

use std::{
    collections::HashMap,
    convert::Infallible,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Output,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::{Request, Response, body::Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};

use crate::{
    netns::{ChildGuard, TestNetns},
    tls,
    topology::Topology,
    wait_for,
};

/// The sandbox's address.
pub const SANDBOX_IP: &str = "192.168.0.2";
/// The gateway address (cube-dev).
pub const GATEWAY: &str = "192.168.0.1";
/// The world server's address.
pub const WORLD: &str = "198.51.100.1";
/// The name the sandbox asks for (SNI and Host).
pub const NAME: &str = "api.example.test";
/// The credential the policy injects (only when the destination belongs to [`NAME`], which
/// only the learned-address table says here: no DNS server answers).
pub const SECRET: &str = "sk-swap-0123456789";
/// The admin API.
pub const ADMIN: &str = "http://127.0.0.1:9091/admin/v1";

/// What the world server saw of one request path.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// How many times the path arrived.
    pub count: u32,
    /// How many of those carried the injected credential.
    pub with_credential: u32,
}

/// The namespaces, servers and files of one swap scenario; removes everything on drop.
pub struct SwapRig {
    /// The gateway and world servers' runtime.
    pub rt: tokio::runtime::Runtime,
    /// Node and world namespaces.
    pub topo: Topology,
    /// The sandbox namespace.
    pub sb: TestNetns,
    /// Working directory (CA, audit file, handoff socket).
    pub dir: PathBuf,
    /// Gateway CA certificate (PEM), trusted by the load generator.
    pub ca_pem: String,
    /// Path → what the world server saw.
    pub seen: Arc<Mutex<HashMap<String, Seen>>>,
}

impl Drop for SwapRig {
    fn drop(&mut self) {
        let _ = self.topo.node.exec("bash", &[script().to_str().unwrap_or_default(), "down"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `scripts/cube-egress-net.sh`.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/cube-egress-net.sh")
}

/// The `cube-egress` binary: `CUBE_EGRESS_BIN`, else beside the running test or benchmark
/// binary in `target/<profile>/`.
pub fn egress_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("CUBE_EGRESS_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir");
    let candidates = [dir.join("cube-egress"), dir.parent().expect("profile dir").join("cube-egress")];
    let found = candidates.iter().find(|p| p.exists()).cloned();
    found.unwrap_or_else(|| panic!("cube-egress missing next to {}: run `cargo build -p cube-egress`", exe.display()))
}

/// Formats a command's status and output for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

async fn world_handler(
    seen: Arc<Mutex<HashMap<String, Seen>>>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_string();
    let cred =
        req.headers().get("authorization").is_some_and(|v| v.as_bytes() == format!("Bearer {SECRET}").as_bytes());
    {
        let mut s = seen.lock().expect("seen lock");
        let e = s.entry(path.clone()).or_default();
        e.count += 1;
        e.with_credential += u32::from(cred);
    }
    Ok(Response::new(Full::new(Bytes::from(format!("ok {path}\n")))))
}

impl SwapRig {
    /// Builds the namespaces, the world server (trusting a world CA the gateway trusts), the
    /// datapath stand-in (marks on sandbox port-443 traffic) and `cube-egress-net.sh up`.
    /// Root only.
    pub fn new() -> SwapRig {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
        // One directory per rig: the tests of one binary run in parallel in one process.
        static RIGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = RIGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("cube-egress-swap-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("ca")).expect("tmp dir");
        let topo = Topology::new();
        let sb = sandbox_net(&topo);
        let gw_ca = tls::make_ca("CubeSandbox Egress swap CA");
        let world_ca = tls::make_ca("world swap CA");
        std::fs::write(dir.join("ca/cube-root-ca.crt"), &gw_ca.pem).expect("write CA");
        std::fs::write(dir.join("ca/cube-root-ca.key"), &gw_ca.key_pem).expect("write CA key");
        std::fs::write(dir.join("world-ca.pem"), &world_ca.pem).expect("write world CA");
        let seen: Arc<Mutex<HashMap<String, Seen>>> = Arc::default();
        let addr: SocketAddr = format!("{WORLD}:443").parse().expect("addr");
        let l = topo.world.run(move || std::net::TcpListener::bind(addr)).expect("bind world");
        l.set_nonblocking(true).expect("nonblocking");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls::server_config(&world_ca, NAME)));
        let s = seen.clone();
        rt.spawn(async move {
            let l = tokio::net::TcpListener::from_std(l).expect("world listener");
            loop {
                let Ok((stream, _)) = l.accept().await else { continue };
                let (s, acceptor) = (s.clone(), acceptor.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |r| world_handler(s.clone(), r));
                    if let Ok(t) = acceptor.accept(stream).await {
                        let b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                        let _ = b.serve_connection(TokioIo::new(t), svc).await;
                    }
                });
            }
        });
        let rig = SwapRig { rt, topo, sb, dir, ca_pem: gw_ca.pem, seen };
        let o = rig.topo.node.exec("bash", &[script().to_str().expect("utf-8 path"), "up"]);
        assert!(o.status.success(), "cube-egress-net.sh up: {}", text(&o));
        rig
    }

    /// The handoff socket both slots use.
    pub fn handoff_socket(&self) -> PathBuf {
        self.dir.join("handoff.sock")
    }

    /// The shared audit file.
    pub fn audit_file(&self) -> PathBuf {
        self.dir.join("log/access.jsonl")
    }

    /// The command line of one gateway slot (no bootstrap URL: the policy comes from the admin
    /// API, so only a state hand-over can give it to a successor) plus `extra`.
    pub fn gateway_args(&self, extra: &[&str]) -> Vec<String> {
        let d = |p: &str| self.dir.join(p).to_string_lossy().into_owned();
        let mut a: Vec<String> = [
            "--sandbox-cidr",
            "192.168.0.0/18",
            "--ca-dir",
            &d("ca"),
            "--upstream-extra-ca",
            &d("world-ca.pem"),
            "--audit-file",
            &self.audit_file().to_string_lossy(),
            "--bootstrap-url",
            "",
            "--drain-timeout-secs",
            "15",
            "--handoff-socket",
            &self.handoff_socket().to_string_lossy(),
            // Nothing answers here: only learned addresses bind names to destinations.
            "--dns-server",
            "127.0.0.1:9",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    /// Starts one gateway slot in the node namespace.
    pub fn spawn_gateway(&self, extra: &[&str]) -> ChildGuard {
        let args = self.gateway_args(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut cmd = self.topo.node.command(egress_bin().to_str().expect("utf-8 path"));
        cmd.args(&args).env("CUBE_EGRESS_LOG", "info").stdin(std::process::Stdio::null());
        ChildGuard::from_child(cmd.spawn().expect("spawn cube-egress"))
    }

    /// Starts one gateway slot from the binary `bin` in the node namespace, its log (JSON
    /// lines, `CUBE_EGRESS_LOG_FORMAT=json`) written to `<dir>/<name>.log` for
    /// [`SwapRig::gateway_events`].
    pub fn spawn_gateway_logged(&self, bin: &Path, name: &str, extra: &[&str]) -> ChildGuard {
        let args = self.gateway_args(extra);
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).expect("gateway log file");
        let mut cmd = self.topo.node.command(bin.to_str().expect("utf-8 path"));
        cmd.args(&args)
            .env("CUBE_EGRESS_LOG", "info")
            .env("CUBE_EGRESS_LOG_FORMAT", "json")
            .stdin(std::process::Stdio::null())
            .stderr(log);
        ChildGuard::from_child(cmd.spawn().expect("spawn cube-egress"))
    }

    /// The log messages of the gateway started as `name` by [`SwapRig::spawn_gateway_logged`]:
    /// (wall-clock time, message), in order. Lines that are not JSON log events are skipped.
    pub fn gateway_events(&self, name: &str) -> Vec<(std::time::SystemTime, String)> {
        let text = std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let v: Value = serde_json::from_str(l).ok()?;
                let t = parse_utc(v["timestamp"].as_str()?)?;
                let msg = v["message"].as_str().unwrap_or_default().to_string();
                Some((t, msg))
            })
            .collect()
    }

    /// `curl` against the admin API in the node namespace: (HTTP code or 0, body).
    pub fn admin(&self, args: &[&str]) -> (u16, String) {
        let mut a = vec!["-s", "--max-time", "5", "-w", "\n%{http_code}"];
        a.extend_from_slice(args);
        let o = self.topo.node.exec("curl", &a);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    /// Waits for the admin API, then installs the sandbox's policy (allow [`NAME`], inject
    /// [`SECRET`]) and its learned address for [`NAME`].
    pub fn configure(&self) {
        wait_for("admin health", Duration::from_secs(15), || self.admin(&[&format!("{ADMIN}/health")]).0 == 200);
        let policy = json!({"policy_id": "swap", "rules": [{"id": "api", "match": {"sni": NAME},
            "action": {"allow": true, "inject": [{"header": "Authorization", "secret": SECRET, "format": "Bearer ${SECRET}"}]}}]});
        let (code, body) =
            self.admin(&["-X", "PUT", "--data", &policy.to_string(), &format!("{ADMIN}/policies/{SANDBOX_IP}")]);
        assert_eq!(code, 200, "PUT policy: {body}");
        let learned = json!({"names": {NAME: [WORLD]}, "ttl_secs": 600});
        let (code, body) =
            self.admin(&["-X", "PUT", "--data", &learned.to_string(), &format!("{ADMIN}/learned/{SANDBOX_IP}")]);
        assert_eq!(code, 200, "PUT learned: {body}");
    }

    /// One `GET path` through the gateway with `openssl s_client` at its defaults (TLS 1.3,
    /// tickets on) from the sandbox, trusting the gateway CA: the session is saved to `sess`
    /// (`-sess_out`) and, when `resume`, first offered from it (`-sess_in`). Returns stdout
    /// and stderr together (`New, TLSv1.3` or `Reused, TLSv1.3`, then the response).
    pub fn openssl_get(&self, path: &str, sess: &Path, resume: bool) -> String {
        self.openssl_get_with(path, sess, resume, &[])
    }

    /// [`Self::openssl_get`] with more `s_client` options (`-tls1_2 -no_ticket`: resumption by
    /// session ID only).
    pub fn openssl_get_with(&self, path: &str, sess: &Path, resume: bool, extra: &[&str]) -> String {
        let (ca, sess) = (self.dir.join("ca/cube-root-ca.crt"), sess.to_string_lossy().into_owned());
        let ca = ca.to_string_lossy().into_owned();
        let req = format!("GET {path} HTTP/1.1\r\nHost: {NAME}\r\nConnection: close\r\n\r\n");
        let mut args = vec![
            "s_client",
            "-connect",
            "198.51.100.1:443",
            "-servername",
            NAME,
            "-CAfile",
            &ca,
            "-verify_return_error",
            "-ign_eof",
            "-sess_out",
            &sess,
        ];
        if resume {
            args.extend(["-sess_in", &sess]);
        }
        args.extend(extra);
        let mut child = self
            .sb
            .command("openssl")
            .args(&args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn openssl");
        {
            use std::io::Write;
            let mut stdin = child.stdin.take().expect("stdin");
            stdin.write_all(req.as_bytes()).expect("write request");
        }
        let o = child.wait_with_output().expect("openssl");
        text(&o)
    }

    /// Every audit line (each must be JSON).
    pub fn audit_lines(&self) -> Vec<Value> {
        std::fs::read_to_string(self.audit_file())
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("audit line is not JSON ({e}): {l}")))
            .collect()
    }

    /// Starts the load generator in the sandbox namespace for `dur`.
    pub fn start_load(&self, keepalive: usize, fresh: usize, dur: Duration) -> std::thread::JoinHandle<LoadReport> {
        let ca = self.ca_pem.clone();
        self.sb.spawn_thread(move || {
            // A runtime on this thread only: its sockets are created in the sandbox namespace.
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("load runtime");
            rt.block_on(load(tls::client_config(&ca), keepalive, fresh, dur))
        })
    }
}

/// Parses the UTC timestamps of `tracing-subscriber`'s JSON log, `YYYY-MM-DDTHH:MM:SS[.f]Z`
/// (`None` for anything else).
fn parse_utc(s: &str) -> Option<std::time::SystemTime> {
    let s = s.strip_suffix('Z')?;
    let (date, clock) = s.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = clock.split_once('.').unwrap_or((clock, ""));
    let mut c = hms.splitn(3, ':').map(|x| x.parse::<u64>().ok());
    let (hh, mm, ss) = (c.next()??, c.next()??, c.next()??);
    let nanos = if frac.is_empty() { 0 } else { format!("{frac:0<9}").get(..9)?.parse::<u32>().ok()? };
    // Days from 1970-01-01 (Howard Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    Some(std::time::UNIX_EPOCH + Duration::new(secs, nanos))
}

/// The sandbox namespace behind `cube-dev` and the datapath stand-in (mark on port 443 from
/// `cube-dev`, as CubeVS marks L7 flows).
fn sandbox_net(topo: &Topology) -> TestNetns {
    sandbox_behind_cube_dev(topo, &[STEER_HTTPS])
}

/// The steering mark CubeVS sets on a sandbox's port-80 flows that go through CubeEgress
/// (`scripts/cube-egress-net.sh` `CUBE_EGRESS_MARK_HTTP`), as `(destination port, mark)`.
pub const STEER_HTTP: (&str, &str) = ("80", "0xCE010000");
/// The same for port 443 (`CUBE_EGRESS_MARK_HTTPS`).
pub const STEER_HTTPS: (&str, &str) = ("443", "0xCE020000");

/// A sandbox namespace `sb` behind a `cube-dev` veth in the node namespace ([`SANDBOX_IP`]/18 on
/// its `eth0`, [`GATEWAY`]/18 on `cube-dev`, default route via the gateway), with iptables
/// standing in for the datapath's steering marks on `marks` ([`steer_marks`]). Panics when a
/// command fails.
pub fn sandbox_behind_cube_dev(topo: &Topology, marks: &[(&str, &str)]) -> TestNetns {
    let node = &topo.node;
    let sb = TestNetns::new("sb");
    node.ip(&["link", "add", "cube-dev", "type", "veth", "peer", "name", "eth0", "netns", sb.name()]);
    node.ip(&["addr", "add", &format!("{GATEWAY}/18"), "dev", "cube-dev"]);
    node.ip(&["link", "set", "cube-dev", "up"]);
    sb.ip(&["addr", "add", &format!("{SANDBOX_IP}/18"), "dev", "eth0"]);
    sb.ip(&["link", "set", "eth0", "up"]);
    sb.ip(&["route", "add", "default", "via", GATEWAY]);
    steer_marks(node, "-I", marks);
    sb
}

/// Inserts (`op` `-I`) or deletes (`-D`) one mangle `PREROUTING` rule per `(port, mark)` in
/// `node` that marks TCP from `cube-dev` to that destination port, as CubeVS marks the flows it
/// steers to CubeEgress (tests without the datapath). Panics when iptables fails.
pub fn steer_marks(node: &TestNetns, op: &str, marks: &[(&str, &str)]) {
    for (port, mark) in marks {
        let rule = ["-t", "mangle", op, "PREROUTING", "-i", "cube-dev", "-p", "tcp", "--dport", port];
        let o = node.exec("iptables", &[&rule[..], &["-j", "MARK", "--set-mark", mark]].concat());
        assert!(o.status.success(), "mark rule {op} {port}: {}", text(&o));
    }
}

/// What the load generator saw.
#[derive(Debug, Default, Clone)]
pub struct LoadReport {
    /// Requests answered 200 with their own path echoed.
    pub ok: u64,
    /// TCP connects or TLS handshakes that failed.
    pub failed_connects: u64,
    /// Requests sent that got no answer, an error or a wrong answer.
    pub failed_requests: u64,
    /// Failures whose cause was a TCP reset.
    pub resets: u64,
    /// Longest interval without any completed request while the load ran: from the first
    /// completion to the load's end (the requests still answered after the end, when the
    /// clients have stopped sending, do not count).
    pub max_gap: Duration,
    /// When that interval began, from the start of the load.
    pub max_gap_at: Duration,
    /// Paths answered 200 (each exactly once by construction: unique per request).
    pub ok_paths: Vec<String>,
    /// The first failures, for messages.
    pub errors: Vec<String>,
    /// Requests answered with `Connection: close` (reconnects asked by a draining gateway).
    pub closes: u64,
    /// When the load started (monotonic and wall clock), the origin of the offsets below.
    pub started: Option<(Instant, std::time::SystemTime)>,
    /// Every completion (a request answered 200), from the start, sorted.
    pub done: Vec<Duration>,
    /// Completions answered with `Connection: close`, from the start.
    pub close_at: Vec<Duration>,
    /// Successful connects (TCP connect, TLS handshake, HTTP/1 handshake): (began, ready),
    /// from the start.
    pub connects: Vec<(Duration, Duration)>,
    /// When each successful connect that did a full TLS handshake began (the others resumed
    /// a session with a ticket from the same worker's earlier connection: each worker has its
    /// own rustls default in-memory session store), from the start, sorted.
    pub full_handshakes: Vec<Duration>,
    /// Successful connects per worker (each its own client): `[worker]` = (began, ready) in
    /// order, from the start.
    pub worker_connects: Vec<Vec<(Duration, Duration)>>,
}

impl LoadReport {
    /// The longest interval within `[from, to]` (offsets from the start) without a completion,
    /// and when it began: between successive completions in the window, and from `from` to
    /// the first / from the last to `to` when completions lie beyond those edges (the window
    /// is inside the run). Zero when nothing completed in or around it.
    pub fn max_gap_in(&self, from: Duration, to: Duration) -> (Duration, Duration) {
        let lo = self.done.partition_point(|d| *d < from);
        let hi = self.done.partition_point(|d| *d <= to);
        let mut pts: Vec<Duration> = Vec::with_capacity(hi - lo + 2);
        if lo > 0 {
            pts.push(from);
        }
        pts.extend_from_slice(&self.done[lo..hi]);
        if hi < self.done.len() {
            pts.push(to);
        }
        pts.windows(2).map(|w| (w[1] - w[0], w[0])).max().unwrap_or_default()
    }

    /// The `q` quantile (0..=1) of the intervals between successive completions.
    pub fn gap_quantile(&self, q: f64) -> Duration {
        let mut g: Vec<Duration> = self.done.windows(2).map(|w| w[1] - w[0]).collect();
        if g.is_empty() {
            return Duration::ZERO;
        }
        g.sort();
        g[((g.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize]
    }

    /// The offset from this load's start of a wall-clock time (a gateway log event), in ms
    /// (negative before the start).
    pub fn offset_ms(&self, t: std::time::SystemTime) -> f64 {
        let Some((_, wall)) = self.started else { return f64::NAN };
        match t.duration_since(wall) {
            Ok(d) => d.as_secs_f64() * 1e3,
            Err(e) => -e.duration().as_secs_f64() * 1e3,
        }
    }

    /// The offset from this load's start of a monotonic instant (e.g. when a successor was
    /// spawned), in ms.
    pub fn instant_ms(&self, t: Instant) -> f64 {
        let Some((start, _)) = self.started else { return f64::NAN };
        if t >= start { (t - start).as_secs_f64() * 1e3 } else { -(start - t).as_secs_f64() * 1e3 }
    }
}

#[derive(Default)]
struct Tally {
    r: LoadReport,
    done: Vec<Instant>,
    close_at: Vec<Instant>,
    connects: Vec<(Instant, Instant)>,
    per_worker: Vec<Vec<(Instant, Instant)>>,
    full: Vec<Instant>,
}

impl Tally {
    fn fail(&mut self, connect: bool, what: String, err: &(dyn std::error::Error + 'static)) {
        if connect {
            self.r.failed_connects += 1;
        } else {
            self.r.failed_requests += 1;
        }
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(e) = cur {
            if let Some(io) = e.downcast_ref::<std::io::Error>()
                && io.kind() == std::io::ErrorKind::ConnectionReset
            {
                self.r.resets += 1;
                break;
            }
            cur = e.source();
        }
        if self.r.errors.len() < 20 {
            self.r.errors.push(format!("{what}: {err} ({err:?})"));
        }
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

/// A new connection and whether its TLS handshake resumed a session.
async fn connect(tls: &tokio_rustls::TlsConnector) -> Result<(Sender, bool), Box<dyn std::error::Error + Send + Sync>> {
    let tcp = tokio::time::timeout(Duration::from_secs(10), tokio::net::TcpStream::connect(format!("{WORLD}:443")))
        .await
        .map_err(|_| "connect timeout")??;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from(NAME)?.to_owned();
    let t =
        tokio::time::timeout(Duration::from_secs(10), tls.connect(name, tcp)).await.map_err(|_| "TLS timeout")??;
    let resumed = t.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
    let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(t)).await?;
    tokio::spawn(conn);
    Ok((s, resumed))
}

/// One request on `s`: `Ok(close)` when answered 200 with its path (close = the server asked
/// to close the connection), `Err` otherwise.
async fn request(s: &mut Sender, path: &str) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let req = Request::get(path).header("host", NAME).body(Empty::<Bytes>::new())?;
    let resp =
        tokio::time::timeout(Duration::from_secs(20), s.send_request(req)).await.map_err(|_| "no response")??;
    let status = resp.status();
    let close = resp.headers().get("connection").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    let body = resp.into_body().collect().await?.to_bytes();
    if status != 200 || body != format!("ok {path}\n").as_bytes() {
        return Err(format!("HTTP {status}: {}", String::from_utf8_lossy(&body)).into());
    }
    Ok(close)
}

/// Distinguishes the paths of successive load runs in one process.
static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

async fn load(tls: Arc<rustls::ClientConfig>, keepalive: usize, fresh: usize, dur: Duration) -> LoadReport {
    let run = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let deadline = tokio::time::Instant::now() + dur;
    let (started, started_wall) = (Instant::now(), std::time::SystemTime::now());
    let mut tasks = Vec::new();
    for w in 0..keepalive + fresh {
        // Each worker is its own client, as each sandbox process is: its own session store
        // (rustls' default in-memory one), so a reconnect resumes only with a ticket this
        // worker got.
        let mut own = (*tls).clone();
        own.resumption = rustls::client::Resumption::default();
        let (tls, tally) = (tokio_rustls::TlsConnector::from(Arc::new(own)), tally.clone());
        let keep = w < keepalive;
        tasks.push(tokio::spawn(async move {
            let mut sender: Option<Sender> = None;
            let mut n = 0u64;
            while tokio::time::Instant::now() < deadline {
                // A real client checks a pooled connection before reuse; one the server closed
                // while idle is replaced, not counted (no request was sent on it).
                if let Some(s) = sender.as_mut()
                    && (s.is_closed() || s.ready().await.is_err())
                {
                    sender = None;
                }
                let mut s = match sender.take() {
                    Some(s) => s,
                    None => match (Instant::now(), connect(&tls).await) {
                        (began, Ok((s, resumed))) => {
                            let mut t = tally.lock().expect("tally");
                            let ready = Instant::now();
                            t.connects.push((began, ready));
                            if t.per_worker.len() <= w {
                                t.per_worker.resize(w + 1, Vec::new());
                            }
                            t.per_worker[w].push((began, ready));
                            if !resumed {
                                t.full.push(began);
                            }
                            s
                        }
                        (_, Err(e)) => {
                            tally.lock().expect("tally").fail(true, format!("worker {w} connect"), &*e);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    },
                };
                n += 1;
                let path = format!("/swap/{run}/{}{w}-{n}", if keep { "k" } else { "f" });
                let res = request(&mut s, &path).await;
                let mut t = tally.lock().expect("tally");
                match res {
                    Ok(close) => {
                        t.r.ok += 1;
                        t.r.closes += u64::from(close);
                        t.r.ok_paths.push(path);
                        let now = Instant::now();
                        t.done.push(now);
                        if close {
                            t.close_at.push(now);
                        }
                        if keep && !close {
                            sender = Some(s);
                        }
                    }
                    Err(e) => t.fail(false, path, &*e),
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let mut t = std::mem::take(&mut *tally.lock().expect("tally"));
    t.done.sort();
    t.r.started = Some((started, started_wall));
    t.r.done = t.done.iter().map(|d| *d - started).collect();
    if let Some(first) = t.r.done.first() {
        (t.r.max_gap, t.r.max_gap_at) = t.r.max_gap_in(*first, dur);
    }
    t.r.close_at = t.close_at.iter().map(|d| *d - started).collect();
    t.r.close_at.sort();
    t.r.connects = t.connects.iter().map(|(a, b)| (*a - started, *b - started)).collect();
    t.r.connects.sort();
    t.r.worker_connects =
        t.per_worker.iter().map(|v| v.iter().map(|(a, b)| (*a - started, *b - started)).collect()).collect();
    t.r.full_handshakes = t.full.iter().map(|a| *a - started).collect();
    t.r.full_handshakes.sort();
    t.r
}

/// Sends SIGTERM to a child we spawned.
pub fn sigterm(child: &ChildGuard) {
    // SAFETY: kill(2) on the PID of a child we spawned and still own.
    let _ = unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
}

/// Waits up to `timeout` for `child` to exit.
pub fn wait_exit(child: &mut ChildGuard, timeout: Duration) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if let Ok(Some(s)) = child.child().try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

impl Default for SwapRig {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log timestamps become the same instants as the wall clock's (checked against
    /// values computed independently), leap day and fractions included.
    #[test]
    fn parse_utc_timestamps() {
        let at = |s: &str| parse_utc(s).map(|t| t.duration_since(std::time::UNIX_EPOCH).unwrap());
        assert_eq!(at("2026-12-01T16:30:00.5Z"), Some(Duration::from_millis(1_796_142_600_500)));
        assert_eq!(at("1970-01-01T00:00:00Z"), Some(Duration::ZERO));
        assert_eq!(at("2024-02-29T23:59:59.000001234Z"), Some(Duration::new(1_709_251_199, 1_234)));
        assert_eq!(at("2026-12-01T16:30:00"), None, "no zone");
        assert_eq!(at("yesterday"), None);
    }

    /// Gaps are measured inside the window: edges count only where completions lie beyond
    /// them, so a window cuts a gap that crosses it.
    #[test]
    fn max_gap_in_window() {
        let ms = Duration::from_millis;
        let r = LoadReport { done: [1, 2, 10, 11, 30].map(ms).to_vec(), ..Default::default() };
        assert_eq!(r.max_gap_in(ms(0), ms(40)), (ms(19), ms(11)));
        assert_eq!(r.max_gap_in(ms(1), ms(20)), (ms(9), ms(11)), "cut at the window's end");
        assert_eq!(r.max_gap_in(ms(5), ms(10)), (ms(5), ms(5)), "cut at the window's start");
        assert_eq!(r.max_gap_in(ms(12), ms(29)), (ms(17), ms(12)), "no completion inside");
        assert_eq!(LoadReport::default().max_gap_in(ms(0), ms(5)), (Duration::ZERO, Duration::ZERO));
    }
}
