//! The L7 path with real processes, shared by `tests/tests/l7_e2e.rs`, the demo's `sb-4-l7`
//! and the `l7` benchmark: a world with a DNS server for several names and HTTP/HTTPS servers
//! that record every request they see (headers included), and the real `cube-egress` binary
//! started in the node namespace behind `scripts/cube-egress-net.sh up` (TPROXY on cube-dev).
//!
//! ```text
//!  guest ─TAP─ CubeVS from_cube (mark 0xCE01/0xCE02) ─► cube-dev ingress ─TPROXY─► cube-egress (node ns)
//!                                                                                  │ upstream leg
//!  world ns: DNS 198.51.100.1:53, HTTP :80 + HTTPS :443 on the names' addresses ◄──┘ (node address)
//! ```

use std::{
    convert::Infallible,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, body::Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use simple_dns::{CLASS, Packet, PacketFlag, QTYPE, RCODE, ResourceRecord, TYPE, rdata::RData};

use crate::{
    egress_swap::{egress_bin, script, text},
    netns::{ChildGuard, TestNetns},
    servers, tls,
};

/// One request as a world server saw it.
#[derive(Debug, Clone)]
pub struct SeenRequest {
    /// `http` or `https`.
    pub scheme: &'static str,
    /// The TCP peer (the node's uplink address when the request came through the gateway or SNAT).
    pub peer: SocketAddr,
    /// The local address the request arrived on.
    pub local: SocketAddr,
    /// Request method.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Every header as (lower-case name, value), in order.
    pub headers: Vec<(String, String)>,
}

impl SeenRequest {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// World servers: DNS for several names, HTTP on :80 and HTTPS on :443 of each address, with
/// the requests they saw. Everything stops when it is dropped.
pub struct World {
    /// The CA the HTTPS servers' certificate chains to (the gateway's upstream trust).
    pub ca: tls::TestCa,
    /// Every request seen, in arrival order.
    pub seen: Arc<Mutex<Vec<SeenRequest>>>,
    /// The DNS server (records the clients it answered).
    pub dns: servers::Server,
    rt: tokio::runtime::Runtime,
}

impl World {
    /// Starts DNS on `dns_ip:53` answering each `(name, address)` of `records` (A records, TTL
    /// 60; other types of a known name: empty answer; other names: NXDOMAIN), and HTTP :80 plus
    /// HTTPS :443 (one certificate naming every name, signed by a fresh world CA, ALPN h2 and
    /// http/1.1) on every address of `serve`. The addresses must exist in `ns`.
    pub fn start(
        ns: &TestNetns,
        dns_ip: Ipv4Addr,
        records: &[(&str, Ipv4Addr)],
        serve: &[Ipv4Addr],
    ) -> anyhow::Result<World> {
        let table: Vec<(String, Ipv4Addr)> =
            records.iter().map(|(n, a)| (n.trim_end_matches('.').to_ascii_lowercase(), *a)).collect();
        let dns = servers::udp_responder(ns, dns_ip.octets(), 53, move |q, _| answer(q, &table))?;
        let ca = tls::make_ca("CubeNet L7 world CA");
        let names: Vec<&str> = records.iter().map(|(n, _)| *n).collect();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls::server_config_names(&ca, &names)));
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let seen: Arc<Mutex<Vec<SeenRequest>>> = Arc::default();
        for &ip in serve {
            for (port, scheme) in [(80u16, "http"), (443, "https")] {
                let addr = SocketAddr::from((ip, port));
                let l = ns.run(move || std::net::TcpListener::bind(addr))?;
                l.set_nonblocking(true)?;
                let (seen, acceptor) = (seen.clone(), acceptor.clone());
                rt.spawn(async move {
                    let Ok(l) = tokio::net::TcpListener::from_std(l) else { return };
                    loop {
                        let Ok((stream, peer)) = l.accept().await else { continue };
                        let (seen, acceptor) = (seen.clone(), acceptor.clone());
                        tokio::spawn(async move {
                            let svc = hyper::service::service_fn(move |r| record(seen.clone(), scheme, peer, addr, r));
                            let b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                            if scheme == "https" {
                                if let Ok(t) = acceptor.accept(stream).await {
                                    let _ = b.serve_connection(TokioIo::new(t), svc).await;
                                }
                            } else {
                                let _ = b.serve_connection(TokioIo::new(stream), svc).await;
                            }
                        });
                    }
                });
            }
        }
        Ok(World { ca, seen, dns, rt })
    }

    /// Every request seen so far.
    pub fn requests(&self) -> Vec<SeenRequest> {
        self.seen.lock().expect("seen lock").clone()
    }

    /// The requests seen so far whose path starts with `prefix`.
    pub fn requests_to(&self, prefix: &str) -> Vec<SeenRequest> {
        self.requests().into_iter().filter(|r| r.path.starts_with(prefix)).collect()
    }

    /// The runtime the servers run on (for clients that want to share it).
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }
}

async fn record(
    seen: Arc<Mutex<Vec<SeenRequest>>>,
    scheme: &'static str,
    peer: SocketAddr,
    local: SocketAddr,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/").to_string();
    let headers = req
        .headers()
        .iter()
        .map(|(n, v)| (n.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
        .collect();
    seen.lock().expect("seen lock").push(SeenRequest {
        scheme,
        peer,
        local,
        method: req.method().to_string(),
        path: path.clone(),
        headers,
    });
    Ok(Response::new(Full::new(Bytes::from(format!("world {scheme} {path} from {peer}\n")))))
}

/// The DNS reply to one query against `table`, or `None` for a message that is not a query.
fn answer(query: &[u8], table: &[(String, Ipv4Addr)]) -> Option<Vec<u8>> {
    let q = Packet::parse(query).ok()?;
    if q.has_flags(PacketFlag::RESPONSE) || q.questions.len() != 1 {
        return None;
    }
    let question = q.questions[0].clone();
    let mut reply = q.into_reply();
    reply.set_flags(PacketFlag::AUTHORITATIVE_ANSWER);
    let asked = question.qname.to_string().trim_end_matches('.').to_ascii_lowercase();
    match table.iter().find(|(n, _)| *n == asked) {
        None => *reply.rcode_mut() = RCODE::NameError,
        Some((_, ip)) if question.qtype == QTYPE::TYPE(TYPE::A) => reply.answers.push(ResourceRecord::new(
            question.qname.clone(),
            CLASS::IN,
            60,
            RData::A(simple_dns::rdata::A { address: u32::from(*ip) }),
        )),
        Some(_) => {}
    }
    reply.build_bytes_vec().ok()
}

/// The real `cube-egress` in a namespace behind `cube-egress-net.sh up`: its own CA (the
/// sandbox's trust anchor), the world CA as its upstream extra trust, an audit file, a
/// bootstrap URL and a DNS server for the destination check. Dropping it kills the gateway,
/// runs `cube-egress-net.sh down` in the namespace and removes its directory.
pub struct Gateway {
    /// The gateway's CA certificate (PEM): what a sandbox client trusts.
    pub ca_pem: String,
    /// Working directory (CA, world CA, audit file, gateway log).
    pub dir: PathBuf,
    /// `http://<admin>/admin/v1`.
    pub admin: String,
    ns_path: PathBuf,
    child: Option<ChildGuard>,
}

/// How to start a [`Gateway`].
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// The sandbox CIDR (listen address = network + 1; also `cube-egress-net.sh`'s).
    pub sandbox_cidr: String,
    /// Policy dump URL ("" = none).
    pub bootstrap_url: String,
    /// DNS server for the destination check (E14).
    pub dns_server: SocketAddr,
    /// Admin API address (in the gateway's namespace).
    pub admin_addr: SocketAddr,
    /// The `cube-egress` binary (`None`: [`egress_bin`]).
    pub bin: Option<PathBuf>,
}

impl GatewayOptions {
    /// The gateway beside an agent rig ([`crate::agent::AgentUnderTest`], sandbox CIDR
    /// 192.168.0.0/24): bootstrapped from the agent's dump (`http://<HEALTH>/v1/policies/dump`,
    /// [`crate::agent::HEALTH`]), the world namespace's DNS server (`WORLD_IP:53`) for the
    /// destination check, its admin API on 127.0.0.1:9091, binary `bin` (`None`: [`egress_bin`]).
    pub fn for_agent(bin: Option<PathBuf>) -> GatewayOptions {
        GatewayOptions {
            sandbox_cidr: "192.168.0.0/24".into(),
            bootstrap_url: format!("http://{}/v1/policies/dump", crate::agent::HEALTH),
            dns_server: SocketAddr::from((crate::topology::WORLD_IP, 53)),
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 9091)),
            bin,
        }
    }
}

impl Gateway {
    /// Runs `cube-egress-net.sh up` in `ns` and starts the gateway there (binary:
    /// [`egress_bin`]), trusting `world_ca_pem` upstream; waits until `GET /admin/v1/health`
    /// answers 200 with a bootstrap status other than `pending`. Root only.
    pub fn start(ns: &TestNetns, dir: &Path, world_ca_pem: &str, o: &GatewayOptions) -> anyhow::Result<Gateway> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir.join("ca"))?;
        let ca = tls::make_ca("CubeSandbox Egress CA (L7 test)");
        std::fs::write(dir.join("ca/cube-root-ca.crt"), &ca.pem)?;
        std::fs::write(dir.join("ca/cube-root-ca.key"), &ca.key_pem)?;
        std::fs::write(dir.join("world-ca.pem"), world_ca_pem)?;
        let mut g = Gateway {
            ca_pem: ca.pem,
            dir: dir.to_path_buf(),
            admin: format!("http://{}/admin/v1", o.admin_addr),
            ns_path: ns.path(),
            child: None,
        };
        let up = ns
            .command("bash")
            .arg(script())
            .arg("up")
            .env("CUBE_SANDBOX_NETWORK_CIDR", &o.sandbox_cidr)
            .env("CUBE_EGRESS_MARKS_CONF", "/nonexistent")
            .stdin(std::process::Stdio::null())
            .output()?;
        anyhow::ensure!(up.status.success(), "cube-egress-net.sh up: {}", text(&up));
        let log = std::fs::File::create(dir.join("cube-egress.log"))?;
        let d = |p: &str| dir.join(p).to_string_lossy().into_owned();
        let child = ns
            .command(o.bin.clone().unwrap_or_else(egress_bin).to_str().unwrap_or_default())
            .args(["--sandbox-cidr", &o.sandbox_cidr, "--admin-addr", &o.admin_addr.to_string()])
            .args(["--ca-dir", &d("ca"), "--upstream-extra-ca", &d("world-ca.pem"), "--audit-file", &d("audit.jsonl")])
            .args(["--bootstrap-url", &o.bootstrap_url, "--dns-server", &o.dns_server.to_string()])
            .args(["--drain-timeout-secs", "2"])
            .env("CUBE_EGRESS_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        g.child = Some(ChildGuard::from_child(child));
        let t = Instant::now();
        loop {
            if let Some(h) = g.health(ns)
                && h["bootstrap_status"].as_str().is_some_and(|s| s != "pending")
            {
                break;
            }
            if let Some(c) = g.child.as_mut()
                && let Ok(Some(st)) = c.child().try_wait()
            {
                anyhow::bail!("cube-egress exited ({st}): {}", g.log());
            }
            anyhow::ensure!(t.elapsed() < Duration::from_secs(30), "cube-egress not healthy after 30 s: {}", g.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(g)
    }

    /// `GET /admin/v1/health` from inside `ns` (`None` unless 200 with JSON).
    pub fn health(&self, ns: &TestNetns) -> Option<Value> {
        let (code, body) = self.admin_get(ns, "/health");
        if code != 200 {
            return None;
        }
        serde_json::from_str(&body).ok()
    }

    /// `GET <admin>/<path>` with curl in `ns`: (code or 0, body).
    pub fn admin_get(&self, ns: &TestNetns, path: &str) -> (u16, String) {
        let o = ns.exec("curl", &["-s", "--max-time", "5", "-w", "\n%{http_code}", &format!("{}{path}", self.admin)]);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    /// The gateway's PID.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, ChildGuard::id)
    }

    /// The gateway CA certificate's path (for `curl --cacert`).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca/cube-root-ca.crt")
    }

    /// The audit file's path.
    pub fn audit_file(&self) -> PathBuf {
        self.dir.join("audit.jsonl")
    }

    /// The audit file's raw text.
    pub fn audit_text(&self) -> String {
        std::fs::read_to_string(self.audit_file()).unwrap_or_default()
    }

    /// Every audit line parsed (a line that is not JSON is an error).
    pub fn audit_records(&self) -> anyhow::Result<Vec<Value>> {
        self.audit_text()
            .lines()
            .map(|l| serde_json::from_str(l).map_err(|e| anyhow::anyhow!("audit line is not JSON ({e}): {l}")))
            .collect()
    }

    /// The gateway's stdout/stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("cube-egress.log")).unwrap_or_default()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.child.take();
        if let Ok(f) = std::fs::File::open(&self.ns_path) {
            // `cube-egress-net.sh down` inside the namespace the gateway ran in.
            let mut cmd = std::process::Command::new("bash");
            cmd.arg(script()).arg("down").stdin(std::process::Stdio::null());
            // SAFETY: only setns (async-signal-safe) between fork and exec, on an fd opened before.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    nix::sched::setns(std::os::fd::AsFd::as_fd(&f), nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(std::io::Error::from)
                });
            }
            let _ = cmd.output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What [`https_load`] measured.
#[derive(Debug, Default, Clone)]
pub struct HttpsLoad {
    /// Requests answered 200.
    pub ok: u64,
    /// Connects, handshakes or requests that failed.
    pub failed: u64,
    /// Latency of every answered request (request sent → body read), microseconds.
    pub latencies_us: Vec<u64>,
    /// Wall time of the load.
    pub elapsed: Duration,
    /// The first failures, for messages.
    pub errors: Vec<String>,
}

/// `conns` keep-alive HTTP/1.1-over-TLS clients (rustls trusting only `ca_pem`, SNI `name`)
/// in namespace `ns`, each sending `GET path` (Host `name`) to `addr` back to back for `dur`.
/// A failed connection is replaced after 20 ms. Bounded by `dur` (plus one request's 10 s
/// timeout).
pub fn https_load(
    ns: &TestNetns,
    ca_pem: &str,
    name: &str,
    addr: SocketAddr,
    path: &str,
    conns: usize,
    dur: Duration,
) -> HttpsLoad {
    let (ca, name, path) = (ca_pem.to_string(), name.to_string(), path.to_string());
    let h = ns.spawn_thread(move || {
        // A runtime on this thread only: its sockets are created in the namespace.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("load runtime");
        rt.block_on(load(tls::client_config(&ca), name, addr, path, conns, dur))
    });
    h.join().expect("load thread")
}

type Sender = hyper::client::conn::http1::SendRequest<http_body_util::Empty<Bytes>>;

async fn connect(
    tls: &tokio_rustls::TlsConnector,
    name: &str,
    addr: SocketAddr,
) -> Result<Sender, Box<dyn std::error::Error + Send + Sync>> {
    let tcp = tokio::time::timeout(Duration::from_secs(10), tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| "connect timeout")??;
    tcp.set_nodelay(true)?;
    let sni = rustls::pki_types::ServerName::try_from(name.to_string())?;
    let t = tokio::time::timeout(Duration::from_secs(10), tls.connect(sni, tcp)).await.map_err(|_| "TLS timeout")??;
    let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(t)).await?;
    tokio::spawn(conn);
    Ok(s)
}

async fn one(s: &mut Sender, name: &str, path: &str) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    use http_body_util::BodyExt;
    let req = Request::get(path).header("host", name).body(http_body_util::Empty::<Bytes>::new())?;
    let resp =
        tokio::time::timeout(Duration::from_secs(10), s.send_request(req)).await.map_err(|_| "no response")??;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if status != 200 {
        return Err(format!("HTTP {status}: {}", String::from_utf8_lossy(&body)).into());
    }
    Ok(())
}

fn fail(out: &Mutex<HttpsLoad>, what: String) {
    let mut o = out.lock().expect("load lock");
    o.failed += 1;
    if o.errors.len() < 10 {
        o.errors.push(what);
    }
}

async fn load(
    tls: Arc<rustls::ClientConfig>,
    name: String,
    addr: SocketAddr,
    path: String,
    conns: usize,
    dur: Duration,
) -> HttpsLoad {
    let tls = tokio_rustls::TlsConnector::from(tls);
    let out = Arc::new(Mutex::new(HttpsLoad::default()));
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + dur;
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (tls, name, path, out) = (tls.clone(), name.clone(), path.clone(), out.clone());
        tasks.push(tokio::spawn(async move {
            let mut sender: Option<Sender> = None;
            while tokio::time::Instant::now() < deadline {
                if let Some(s) = sender.as_mut()
                    && (s.is_closed() || s.ready().await.is_err())
                {
                    sender = None;
                }
                let mut s = match sender.take() {
                    Some(s) => s,
                    None => match connect(&tls, &name, addr).await {
                        Ok(s) => s,
                        Err(e) => {
                            fail(&out, format!("connect: {e}"));
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    },
                };
                let t = Instant::now();
                match one(&mut s, &name, &path).await {
                    Ok(()) => {
                        let mut o = out.lock().expect("load lock");
                        o.ok += 1;
                        o.latencies_us.push(t.elapsed().as_micros() as u64);
                        sender = Some(s);
                    }
                    Err(e) => fail(&out, format!("request: {e}")),
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let mut o = std::mem::take(&mut *out.lock().expect("load lock"));
    o.elapsed = started.elapsed();
    o
}
