//! The CubeNet demo driver: plays cubelet against a real network-agent and boots real Linux
//! guests (QEMU) on the TAPs it hands out.
//!
//! [`run`] builds an isolated node/world topology (the test harness's [`Topology`]), starts
//! the agent with `scripts/start-network-agent.sh` (dataplane = the node namespace, private
//! bpffs), serves HTTP and DNS in world, then for each sandbox: `EnsureNetwork` over gRPC
//! (generated `cubenet-proto` client), the TAP fd over the fd socket (upstream JSON protocol),
//! and a QEMU guest whose virtio-net device uses that fd, configured from the Ensure response.
//! The guests run their checks from their kernel command line; the driver adds the checks only
//! the outside can make (what world saw, world → host port, node → sandbox), releases every
//! network and removes everything — or, with `keep`, leaves it running.
//!
//! The fourth sandbox (`sb-4-l7`) reaches a name through CubeEgress: the driver starts the
//! real `cube-egress` in the node namespace behind `scripts/cube-egress-net.sh` (TPROXY), which
//! bootstraps from the agent's policy dump; the agent runs in the node namespace beside it, so
//! its pushes and the dump share that loopback (decision L7).
//!
//! The binary (`cubenet-demo`, run by `scripts/demo.sh`) runs four sandboxes; the automated
//! test (`demo/tests/demo.rs`) runs the same code with one.

pub mod cleanup;

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    os::fd::OwnedFd,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, HEALTH, profile_bin, tap_fd},
    l7::{Gateway, GatewayOptions, World},
    servers,
    topology::{CUBE_DEV_IP, NODE_IP, WORLD_IP, dotted},
    vm::{Check, GuestConfig, GuestImage, Vm},
};

/// World's web server and DNS server address (the node's default gateway).
pub const WORLD: Ipv4Addr = Ipv4Addr::new(WORLD_IP[0], WORLD_IP[1], WORLD_IP[2], WORLD_IP[3]);
/// A world server in a private range (10.0.0.0/8, routed from the node via world).
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
/// Another public world server (TEST-NET-3), not on sandbox 3's allow list.
pub const OTHER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// A name world's DNS server resolves to [`WORLD`].
pub const DNS_NAME: &str = "web.world.cubenet.test";
/// The name sandbox 4 may reach (allow_fqdn + L7 rules), through CubeEgress.
pub const L7_NAME: &str = "api.l7.cubenet.test";
/// [`L7_NAME`]'s address (world serves HTTP :80 and HTTPS :443 there).
pub const L7_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
/// A name world resolves that sandbox 4 may not reach.
pub const L7_OTHER_NAME: &str = "other.l7.cubenet.test";
/// [`L7_OTHER_NAME`]'s address.
pub const L7_OTHER_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 30);
/// The credential CubeEgress injects for sandbox 4 (the guest never has it).
pub const L7_SECRET: &str = "sk-demo-L7-0f3c9a5e21";
/// The port every guest serves HTTP on (busybox httpd).
pub const GUEST_PORT: u16 = 8080;
/// A node-side server on cube-dev's address: guests must not reach it.
pub const NODE_PORT: u16 = 8081;

const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
const CHECKS_TIMEOUT: Duration = Duration::from_secs(120);

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// How many of the four sandboxes (1–4; 1 = the default sandbox only; 4 adds CubeEgress).
    pub guests: usize,
    /// Cargo profile whose `network-agent` to start (`release`, `debug`).
    pub profile: String,
    /// Leave everything running and return the cleanup commands instead of removing it.
    pub keep: bool,
    /// Progress lines on stderr.
    pub verbose: bool,
}

/// One line of the summary table.
#[derive(Clone, Debug)]
pub struct Row {
    /// Sandbox id.
    pub sandbox: String,
    /// Its TAP.
    pub tap: String,
    /// Its mvm IP (the node-side address of the sandbox).
    pub mvm_ip: String,
    /// What was checked.
    pub check: String,
    /// Whether it passed.
    pub pass: bool,
    /// How long it took, ms.
    pub ms: u64,
    /// One line of evidence.
    pub detail: String,
}

/// The outcome of [`run`].
#[derive(Debug, Default)]
pub struct Report {
    /// Every check, in order.
    pub rows: Vec<Row>,
    /// Wall time of [`run`].
    pub elapsed: Duration,
    /// With `keep`: how to explore and clean up.
    pub kept: Option<String>,
}

impl Report {
    /// True when every row passed (and there is at least one).
    pub fn passed(&self) -> bool {
        !self.rows.is_empty() && self.rows.iter().all(|r| r.pass)
    }

    /// The summary table (plain text, aligned columns).
    pub fn table(&self) -> String {
        let head = ["sandbox", "TAP", "mvm IP", "check", "result", "time", "detail"];
        let cells: Vec<[String; 7]> = self
            .rows
            .iter()
            .map(|r| {
                [
                    r.sandbox.clone(),
                    r.tap.clone(),
                    r.mvm_ip.clone(),
                    r.check.clone(),
                    if r.pass { "PASS".into() } else { "FAIL".into() },
                    format!("{:.2} s", r.ms as f64 / 1000.0),
                    r.detail.chars().take(60).collect(),
                ]
            })
            .collect();
        let mut w = head.map(str::len);
        for c in &cells {
            for (i, s) in c.iter().enumerate() {
                w[i] = w[i].max(s.chars().count());
            }
        }
        let line = |c: &[String]| {
            let mut s = String::new();
            for (i, v) in c.iter().enumerate() {
                if i + 1 == c.len() {
                    s += v;
                } else {
                    s += &format!("{v:<width$}  ", width = w[i]);
                }
            }
            s.trim_end().to_string() + "\n"
        };
        let mut out = line(&head.map(String::from));
        out += &line(&w.map(|n| "-".repeat(n)));
        for c in &cells {
            out += &line(c);
        }
        let failed = self.rows.iter().filter(|r| !r.pass).count();
        out += &format!(
            "\n{} checks, {} passed, {} failed; wall time {:.1} s\n",
            self.rows.len(),
            self.rows.len() - failed,
            failed,
            self.elapsed.as_secs_f64()
        );
        out
    }
}

/// One sandbox of the plan.
struct Plan {
    id: &'static str,
    request: pb::EnsureNetworkRequest,
}

fn plans(n: usize) -> Vec<Plan> {
    let req = |id: &str| pb::EnsureNetworkRequest { sandbox_id: id.into(), ..Default::default() };
    let all = vec![
        // 1. Defaults: no context at all (internet allowed, no lists).
        Plan { id: "sb-1-default", request: req("sb-1-default") },
        // 2. A port mapping: guest 8080/tcp on a host port the agent picks.
        Plan {
            id: "sb-2-portmap",
            request: pb::EnsureNetworkRequest {
                port_mappings: vec![pb::PortMapping {
                    protocol: "tcp".into(),
                    container_port: GUEST_PORT.into(),
                    ..Default::default()
                }],
                ..req("sb-2-portmap")
            },
        },
        // 3. No internet, except world's web server.
        Plan {
            id: "sb-3-allowlist",
            request: pb::EnsureNetworkRequest {
                cubevs_context: Some(pb::CubeVsContext {
                    allow_internet_access: Some(false),
                    allow_out: vec![format!("{WORLD}/32")],
                    ..Default::default()
                }),
                ..req("sb-3-allowlist")
            },
        },
        // 4. No internet, the DNS server, and one name by DNS learning whose HTTP goes through
        //    CubeEgress: /admin* denied, the rest allowed with a credential injected.
        Plan {
            id: "sb-4-l7",
            request: pb::EnsureNetworkRequest { cubevs_context: Some(l7_context()), ..req("sb-4-l7") },
        },
    ];
    all.into_iter().take(n.clamp(1, 4)).collect()
}

/// Sandbox 4's context. The guest speaks HTTPS with `cubenet-https-get` (rustls, trusting the
/// gateway's CA: decision L20) and plain HTTP with busybox nc; the allow rule injects over
/// plain HTTP too (`inject_plain_http`; the gateway still checks the destination belongs to the
/// Host through its resolver).
fn l7_context() -> pb::CubeVsContext {
    pb::CubeVsContext {
        allow_internet_access: Some(false),
        allow_out: vec![format!("{WORLD}/32")],
        allow_fqdn: vec![pb::FqdnAllow { name: L7_NAME.into(), ports: vec![80, 443] }],
        rules: vec![
            pb::EgressRule {
                id: "deny-admin".into(),
                r#match: Some(pb::EgressMatch {
                    host: Some(L7_NAME.into()),
                    path: Some("/admin*".into()),
                    ..Default::default()
                }),
                action: Some(pb::EgressAction { allow: false, ..Default::default() }),
            },
            pb::EgressRule {
                id: "api".into(),
                r#match: Some(pb::EgressMatch { host: Some(L7_NAME.into()), ..Default::default() }),
                action: Some(pb::EgressAction {
                    allow: true,
                    audit: Some("metadata".into()),
                    inject: vec![pb::EgressInject {
                        header: "Authorization".into(),
                        secret: L7_SECRET.into(),
                        format: Some("Bearer ${SECRET}".into()),
                    }],
                    inject_plain_http: true,
                }),
            },
        ],
        ..Default::default()
    }
}

/// A sandbox whose network exists.
struct Sandbox {
    id: String,
    tap: String,
    mvm_ip: Ipv4Addr,
    resp: pb::EnsureNetworkResponse,
    fd: Option<OwnedFd>,
    checks: Vec<(String, Check)>,
    /// Extra kernel command-line words (sandbox 4: `cubenet.ca=`, the gateway's CA).
    cmdline: Vec<String>,
    vm: Option<Vm>,
}

impl Sandbox {
    fn row(&self, check: impl Into<String>, pass: bool, ms: u64, detail: impl Into<String>) -> Row {
        Row {
            sandbox: self.id.clone(),
            tap: self.tap.clone(),
            mvm_ip: self.mvm_ip.to_string(),
            check: check.into(),
            pass,
            ms,
            detail: detail.into(),
        }
    }

    /// The guest's network, from the Ensure response only.
    fn guest_config(&self) -> Result<GuestConfig> {
        let i = self.resp.interfaces.first().context("Ensure response has no interface")?;
        let cidr = i.ip_cidrs.first().context("interface has no address")?;
        let (ip, prefix) = cidr.split_once('/').with_context(|| format!("bad ip_cidr {cidr}"))?;
        // The default route's gateway, else the interface's.
        let gw = self
            .resp
            .routes
            .iter()
            .find(|r| r.destination_cidr == "0.0.0.0/0" || r.destination_cidr.is_empty())
            .map(|r| r.gateway.clone())
            .filter(|g| !g.is_empty())
            .unwrap_or_else(|| i.gateway.clone());
        let gw: Ipv4Addr = gw.parse().with_context(|| format!("bad gateway {gw:?}"))?;
        let gw_mac = match self.resp.arp_neighbors.iter().find(|a| a.ip == gw.to_string()) {
            Some(a) => Some(parse_mac(&a.mac_address)?),
            None => None,
        };
        let mut extra = self.cmdline.clone();
        if i.mtu > 0 {
            extra.push(format!("cubenet.mtu={}", i.mtu));
        }
        Ok(GuestConfig {
            mac: parse_mac(&i.mac_address)?,
            ip: ip.parse()?,
            prefix: prefix.parse()?,
            gw,
            gw_mac,
            serve_port: Some(GUEST_PORT),
            checks: self.checks.iter().map(|(_, c)| c.clone()).collect(),
            extra_cmdline: extra,
            ..GuestConfig::cubevs()
        })
    }
}

fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let v: Vec<u8> = s.split(':').map(|b| u8::from_str_radix(b, 16)).collect::<Result<_, _>>()?;
    v.try_into().map_err(|_| anyhow!("bad MAC {s:?}"))
}

fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// First body line of an HTTP response, if it is a 200.
fn ok_body(resp: &str) -> Option<String> {
    let (head, body) = resp.split_once("\r\n\r\n")?;
    head.lines().next()?.contains(" 200 ").then(|| body.lines().next().unwrap_or("").to_string())
}

struct Progress {
    t0: Instant,
    on: bool,
}

impl Progress {
    fn say(&self, msg: impl AsRef<str>) {
        if self.on {
            eprintln!("[demo {:6.2}s] {}", self.t0.elapsed().as_secs_f64(), msg.as_ref());
        }
    }
}

fn ms(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}

/// Runs the demo (root only). Errors are setup failures; failed checks are rows that did not
/// pass ([`Report::passed`]).
pub fn run(opts: &Options) -> Result<Report> {
    let t0 = Instant::now();
    let p = Progress { t0, on: opts.verbose };
    let img = GuestImage::ensure()?;
    p.say(format!("guest image {}", img.dir.display()));

    // Topology + agent (started by its script, dataplane = node namespace, private bpffs).
    let plan = plans(opts.guests);
    let mut a = AgentUnderTest::prepare("demo", plan.len() + 1, "");
    a.agent_bin = Some(profile_bin(&opts.profile, "network-agent"));
    // Beside CubeEgress in the dataplane namespace (L7): pushes and the dump on its loopback.
    a.in_dataplane = true;
    for n in [a.topo.node.name(), a.topo.world.name(), a.ns.name()] {
        cleanup::netns(n);
    }
    cleanup::bpffs(a.bpffs.path());
    cleanup::dir(&a.dir);
    p.say(format!("namespaces: node {} (agent, dataplane), world {}", a.topo.node.name(), a.topo.world.name()));
    let child = a.spawn_script();
    cleanup::pid(child.id(), "network-agent");
    a.child = Some(child);
    a.wait_ready(Duration::from_secs(30));
    p.say(format!(
        "agent ready (pid {}, log {})",
        a.child.as_ref().map_or(0, |c| c.id()),
        a.dir.join("log/agent.log").display()
    ));

    // World: web servers (public, private range, another public address) and DNS.
    a.topo.add_world_address(PRIVATE.octets(), 8);
    a.topo.add_world_address(OTHER.octets(), 24);
    let mut web = Some(servers::http(&a.topo.world, WORLD_IP, 80));
    let private_web = servers::http(&a.topo.world, PRIVATE.octets(), 80);
    let other_web = servers::http(&a.topo.world, OTHER.octets(), 80);
    for ip in [L7_IP, L7_OTHER_IP] {
        a.topo.world.ip(&["addr", "add", &format!("{ip}/24"), "dev", cubenet_tests::topology::WORLD_IF]);
    }
    // DNS for every name, and the L7 web servers (they record what they see).
    let world = World::start(
        &a.topo.world,
        WORLD,
        &[(DNS_NAME, WORLD), (L7_NAME, L7_IP), (L7_OTHER_NAME, L7_OTHER_IP)],
        &[L7_IP, L7_OTHER_IP],
    )?;
    // Node: a server on cube-dev's address (the agent gave cube-dev the CIDR's .1).
    let node_web = servers::http(&a.topo.node, CUBE_DEV_IP, NODE_PORT);
    p.say(format!(
        "world serves HTTP on {WORLD}:80, {PRIVATE}:80, {OTHER}:80, HTTP+HTTPS on {L7_IP} and {L7_OTHER_IP}, DNS on {WORLD}:53"
    ));

    // Cubelet's part: Ensure over gRPC, TAP fd over the fd socket.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let endpoint = a.grpc_endpoint();
    let mut client = rt.block_on(network_agent::client::connect(&endpoint))?;
    let mut rows = Vec::new();
    let mut sbs = Vec::new();
    for pl in &plan {
        let t = Instant::now();
        let resp = rt
            .block_on(client.ensure_network(pl.request.clone()))
            .map_err(|s| anyhow!("EnsureNetwork {}: {s}", pl.id))?
            .into_inner();
        let tap = resp.interfaces.first().map(|i| i.name.clone()).context("no interface")?;
        let mvm_ip: Ipv4Addr =
            resp.persist_metadata.get("sandbox_ip").context("no sandbox_ip in persist_metadata")?.parse()?;
        let (reply, fd) = tap_fd(&a.tap_socket(), &tap, pl.id);
        let mut sb = Sandbox {
            id: pl.id.to_string(),
            tap,
            mvm_ip,
            resp,
            fd: None,
            checks: Vec::new(),
            cmdline: Vec::new(),
            vm: None,
        };
        let ok = reply["errCode"] == "0" && fd.is_some();
        let ports: Vec<String> = sb
            .resp
            .port_mappings
            .iter()
            .map(|m| format!("{}:{}→{}", m.protocol, m.host_port, m.container_port))
            .collect();
        rows.push(sb.row(
            "EnsureNetwork + TAP fd",
            ok,
            ms(t),
            format!(
                "fd errCode {}{}",
                reply["errCode"].as_str().unwrap_or("?"),
                if ports.is_empty() { String::new() } else { format!("; ports {}", ports.join(",")) }
            ),
        ));
        p.say(format!("{}: TAP {} mvm IP {} ({reply})", sb.id, sb.tap, sb.mvm_ip));
        sb.fd = fd;
        sbs.push(sb);
    }

    // CubeEgress for sandbox 4, started after its Ensure: its rules come from the agent's dump.
    let mut gateway = None;
    if let Some(sb) = sbs.iter_mut().find(|s| s.id == "sb-4-l7") {
        let t = Instant::now();
        let dir = std::env::temp_dir().join(format!("cubenet-demo-{}-egress", std::process::id()));
        cleanup::dir(&dir);
        let opts_gw = GatewayOptions::for_agent(Some(profile_bin(&opts.profile, "cube-egress")));
        let gw = Gateway::start(&a.topo.node, &dir, &world.ca.pem, &opts_gw)?;
        cleanup::pid(gw.pid(), "cube-egress");
        let h = gw.health(&a.topo.node).unwrap_or_default();
        let (code, pol) = gw.admin_get(&a.topo.node, &format!("/policies/{}", sb.mvm_ip));
        rows.push(sb.row(
            "CubeEgress up, bootstrapped from the agent's dump",
            h["bootstrap_status"] == "ready" && code == 200 && !pol.contains(L7_SECRET),
            ms(t),
            format!("{}, {} policies; TPROXY on cube-dev", h["bootstrap_status"], h["policy_count"]),
        ));
        p.say(format!("cube-egress pid {} in the node namespace (dir {})", gw.pid(), dir.display()));
        // The guest trusts the gateway's CA only (it never sees the world CA or the secret).
        sb.cmdline.push(cubenet_tests::vm::ca_cmdline(&gw.ca_pem)?);
        gateway = Some(gw);
    }

    // The checks each guest runs.
    let w = |ip: Ipv4Addr, port| SocketAddrV4::new(ip, port);
    let cube_dev = Ipv4Addr::from(CUBE_DEV_IP);
    let n = sbs.len();
    for k in 0..n {
        let next = (n > 1).then(|| (sbs[(k + 1) % n].id.clone(), sbs[(k + 1) % n].mvm_ip));
        let gw = sbs[k].guest_config().map(|c| c.gw).unwrap_or(Ipv4Addr::UNSPECIFIED);
        let mut c: Vec<(String, Check)> = vec![(format!("gateway {gw} answers ARP"), Check::Arp(gw))];
        match k {
            0 => {
                c.push((format!("HTTP world {WORLD}:80"), Check::Http(w(WORLD, 80), "/".into())));
                c.push((format!("DNS {DNS_NAME} via {WORLD}"), Check::Dns(DNS_NAME.into(), WORLD)));
                c.push((format!("private {PRIVATE}:80 refused"), Check::Refused(w(PRIVATE, 80))));
                c.push((format!("HTTP world {OTHER}:80"), Check::Http(w(OTHER, 80), "/".into())));
            }
            1 => c.push((format!("HTTP world {WORLD}:80"), Check::Http(w(WORLD, 80), "/".into()))),
            3 => {
                let vhost = |path: &str, status| Check::HttpHost {
                    addr: w(L7_IP, 80),
                    host: L7_NAME.into(),
                    path: path.into(),
                    status,
                };
                c.push((format!("DNS {L7_NAME} (learned)"), Check::Dns(L7_NAME.into(), WORLD)));
                let https = |path: &str, status| Check::Https {
                    addr: w(L7_IP, 443),
                    host: L7_NAME.into(),
                    path: path.into(),
                    status,
                };
                c.push(("HTTP /v1/models via CubeEgress → 200".into(), vhost("/v1/models", 200)));
                c.push(("denied path /admin/keys → 403".into(), vhost("/admin/keys", 403)));
                c.push(("HTTPS /v1/models via CubeEgress → 200".into(), https("/v1/models", 200)));
                c.push(("HTTPS denied path /admin/keys → 403".into(), https("/admin/keys", 403)));
                c.push((format!("DNS {L7_OTHER_NAME}"), Check::Dns(L7_OTHER_NAME.into(), WORLD)));
                c.push((format!("its address {L7_OTHER_IP}:80 refused"), Check::Refused(w(L7_OTHER_IP, 80))));
            }
            _ => {
                c.push((format!("allowed {WORLD}:80 (allow_out)"), Check::Http(w(WORLD, 80), "/".into())));
                c.push((format!("not allowed {OTHER}:80 refused"), Check::Refused(w(OTHER, 80))));
            }
        }
        if let Some((id, ip)) = next {
            c.push((format!("sandbox {id} {ip}:{GUEST_PORT} refused"), Check::Refused(w(ip, GUEST_PORT))));
        }
        c.push((format!("node cube-dev {cube_dev}:{NODE_PORT} refused"), Check::Refused(w(cube_dev, NODE_PORT))));
        sbs[k].checks = c;
    }

    // Boot every guest at once (QEMU in this process's namespace; it needs only the fd).
    for sb in &mut sbs {
        let Some(fd) = sb.fd.take() else { continue };
        let cfg = sb.guest_config()?;
        let vm = Vm::boot(&img, fd, &cfg)?;
        cleanup::pid(vm.pid(), &format!("qemu {}", sb.id));
        p.say(format!("{}: QEMU pid {} booting ({} {} gw {})", sb.id, vm.pid(), cfg.ip, mac(&cfg.mac), cfg.gw));
        sb.vm = Some(vm);
    }
    for sb in &sbs {
        let Some(vm) = &sb.vm else { continue };
        match vm.wait_ready(BOOT_TIMEOUT) {
            Ok(d) => {
                rows.push(sb.row(
                    "boot to CUBENET-READY",
                    true,
                    d.as_millis() as u64,
                    format!("guest uptime {} ms", vm.guest_ready_ms().unwrap_or(0)),
                ));
                p.say(format!("{}: ready after {:.1} s", sb.id, d.as_secs_f64()));
            }
            Err(e) => {
                rows.push(sb.row("boot to CUBENET-READY", false, BOOT_TIMEOUT.as_millis() as u64, format!("{e:#}")))
            }
        }
    }
    for sb in &sbs {
        let Some(vm) = &sb.vm else { continue };
        let results = match vm.wait_done(CHECKS_TIMEOUT) {
            Ok(r) => r,
            Err(e) => {
                p.say(format!("{}: {e:#}", sb.id));
                Vec::new()
            }
        };
        if results.len() != sb.checks.len() || results.iter().any(|r| !r.pass) {
            // The evidence for a failure: the guest's console, last lines.
            let console = vm.console();
            let tail: Vec<&str> = console.lines().rev().take(40).collect();
            eprintln!("--- {} console (last {} lines) ---", sb.id, tail.len());
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
        for (label, check) in &sb.checks {
            match results.iter().find(|r| r.spec == check.spec()) {
                Some(r) => {
                    // An HTTPS 200 must be the world server's own answer, relayed by CubeEgress.
                    let relayed = match check {
                        Check::Https { path, status: 200, .. } => r.detail.starts_with(&format!("world https {path} ")),
                        _ => true,
                    };
                    rows.push(sb.row(label.clone(), r.pass && relayed, r.ms, r.detail.clone()))
                }
                None => rows.push(sb.row(label.clone(), false, 0, "no result from the guest")),
            }
        }
        p.say(format!("{}: guest checks done", sb.id));
    }

    // What only the outside can check.
    let node = Ipv4Addr::from(NODE_IP);
    if let Some(sb) = sbs.first() {
        let peers = web.as_ref().map(servers::Server::peers).unwrap_or_default();
        let saw_node = peers.iter().any(|s| s.ip() == std::net::IpAddr::V4(node));
        let saw: Vec<String> = peers.iter().map(ToString::to_string).collect();
        rows.push(sb.row("world saw the node address", saw_node, 0, format!("peers {}", saw.join(" "))));
        let private = private_web.peers();
        rows.push(sb.row(
            format!("private {PRIVATE} saw nothing"),
            private.is_empty(),
            0,
            count(private.len(), "connection"),
        ));
        let dns_peers = world.dns.peers();
        rows.push(sb.row(
            "world DNS saw the node address",
            dns_peers.iter().any(|s| s.ip() == std::net::IpAddr::V4(node)),
            0,
            count(dns_peers.len(), "query"),
        ));
    }
    if let Some(sb) = sbs.get(1) {
        let hp = sb.resp.port_mappings.first().map_or(0, |m| m.host_port as u16);
        let t = Instant::now();
        let target = SocketAddr::from((node, hp));
        let got = a.topo.world.run(move || http_get(target, "/cgi-bin/whoami"));
        let (pass, detail) = match got.as_deref().map(ok_body) {
            Ok(Some(b)) => (b.starts_with(&format!("you are {WORLD}:")), b),
            Ok(None) => (false, "not a 200".to_string()),
            Err(e) => (false, e.to_string()),
        };
        rows.push(sb.row(format!("world → {node}:{hp} → guest :{GUEST_PORT}"), pass, ms(t), detail));
        let t = Instant::now();
        let target = SocketAddr::from((sb.mvm_ip, GUEST_PORT));
        let got = a.topo.node.run(move || http_get(target, "/"));
        let (pass, detail) = match got.as_deref().map(ok_body) {
            Ok(Some(b)) => (b == "cubenet guest", b),
            Ok(None) => (false, "not a 200".to_string()),
            Err(e) => (false, e.to_string()),
        };
        rows.push(sb.row(format!("node → {}:{GUEST_PORT} (guest serves)", sb.mvm_ip), pass, ms(t), detail));
    }
    if let Some(sb) = sbs.get(2) {
        let other = other_web.peers();
        rows.push(sb.row(
            format!("{OTHER} saw only sandbox 1"),
            other.iter().all(|s| s.ip() == std::net::IpAddr::V4(node)) && other.len() <= 1,
            0,
            count(other.len(), "connection"),
        ));
    }
    if let (Some(sb), Some(gw)) = (sbs.get(3), gateway.as_ref()) {
        l7_rows(sb, gw, &world, &mut rows);
    }
    let node_peers = node_web.peers();
    rows.push(Row {
        sandbox: "(all)".into(),
        tap: "-".into(),
        mvm_ip: "-".into(),
        check: format!("cube-dev {cube_dev}:{NODE_PORT} saw no guest"),
        pass: node_peers.is_empty(),
        ms: 0,
        detail: count(node_peers.len(), "connection"),
    });

    if opts.keep {
        let rows = by_sandbox(rows, &plan);
        std::mem::forget(gateway);
        return keep(a, sbs, web.take(), rows, t0, opts, &p);
    }

    // Release: QEMU first (the VMM goes away), then the network; the TAP returns to Ready.
    for sb in &mut sbs {
        if let Some(vm) = sb.vm.take() {
            let pid = vm.pid();
            drop(vm);
            cleanup::forget_pid(pid);
        }
        let t = Instant::now();
        let released = rt.block_on(
            client.release_network(pb::ReleaseNetworkRequest { sandbox_id: sb.id.clone(), ..Default::default() }),
        );
        let tap_state = || {
            a.http("/v1/network/taps")
                .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok())
                .and_then(|v| {
                    let t = v["taps"].as_array()?.iter().find(|t| t["tapName"] == sb.tap.as_str())?;
                    t["state"].as_str().map(str::to_string)
                })
                .unwrap_or_default()
        };
        // Release answers once the sandbox is gone; the TAP turns Ready after the check that
        // no VMM still holds it, in the maintenance pass the Release wakes (decision F2).
        let mut state = tap_state();
        let deadline = Instant::now() + Duration::from_secs(10);
        while state == "Cleaning" && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            state = tap_state();
        }
        let pass = released.as_ref().is_ok_and(|r| r.get_ref().released) && state == "Ready";
        rows.push(sb.row("ReleaseNetwork (TAP back to Ready)", pass, ms(t), format!("TAP state {state}")));
    }
    p.say("released; removing the agent, namespaces, bpffs and temp dir");
    drop(client);
    drop(gateway);
    drop((web, private_web, other_web, world, node_web));
    drop(a);
    cleanup::take();
    Ok(Report { rows: by_sandbox(rows, &plan), elapsed: t0.elapsed(), kept: None })
}

/// What only the outside sees of sandbox 4: the world server's and the gateway's view.
fn l7_rows(sb: &Sandbox, gw: &Gateway, world: &World, rows: &mut Vec<Row>) {
    let node = Ipv4Addr::from(NODE_IP);
    let bearer = format!("Bearer {L7_SECRET}");
    for scheme in ["http", "https"] {
        let seen: Vec<_> = world.requests_to("/v1/models").into_iter().filter(|r| r.scheme == scheme).collect();
        let injected = seen.iter().any(|r| r.header("authorization") == Some(bearer.as_str()));
        rows.push(sb.row(
            format!("world saw the injected credential ({scheme})"),
            seen.len() == 1 && injected && seen[0].peer.ip() == node,
            0,
            format!("{} request(s) from {}", seen.len(), seen.first().map_or("-".into(), |r| r.peer.to_string())),
        ));
    }
    let admin = world.requests_to("/admin");
    rows.push(sb.row("world never saw /admin", admin.is_empty(), 0, count(admin.len(), "request")));
    let text = gw.audit_text();
    let recs = gw.audit_records().unwrap_or_default();
    let req = |path: &str| {
        recs.iter().find(|r| r["event"] == "http_request" && r["http"]["path"].as_str() == Some(path)).cloned()
    };
    let (models, admin) = (req("/v1/models").unwrap_or_default(), req("/admin/keys").unwrap_or_default());
    let pass = models["policy"]["decision"] == "allow"
        && models["credentials"]["secret_ids"][0].as_str().is_some_and(|f| f.starts_with("fp-"))
        && admin["http"]["status"] == 403
        && !text.contains(L7_SECRET);
    rows.push(sb.row(
        "audit: allow + deny records, no secret",
        pass,
        0,
        format!("{} records, secret as {}", recs.len(), models["credentials"]["secret_ids"][0].as_str().unwrap_or("?")),
    ));
    let src = models["sandbox"]["src_ip"].as_str().unwrap_or("?").to_string();
    rows.push(sb.row(
        "CubeEgress saw the sandbox IP (TPROXY)",
        src == sb.mvm_ip.to_string(),
        0,
        format!("client {src}"),
    ));
}

/// Rows grouped by sandbox in plan order (then the rows about all of them), chronological
/// within a sandbox.
fn by_sandbox(mut rows: Vec<Row>, plan: &[Plan]) -> Vec<Row> {
    rows.sort_by_key(|r| plan.iter().position(|p| p.id == r.sandbox).unwrap_or(plan.len()));
    rows
}

fn count(n: usize, what: &str) -> String {
    match (n, what) {
        (1, _) => format!("1 {what}"),
        (_, "query") => format!("{n} queries"),
        _ => format!("{n} {what}s"),
    }
}

fn mac(m: &[u8; 6]) -> String {
    cubenet_tests::topology::mac_string(*m)
}

/// `--keep`: everything stays; world's in-process servers are replaced by a busybox httpd so
/// the topology stays explorable after this process exits.
fn keep(
    a: AgentUnderTest,
    sbs: Vec<Sandbox>,
    web: Option<servers::Server>,
    rows: Vec<Row>,
    t0: Instant,
    opts: &Options,
    p: &Progress,
) -> Result<Report> {
    drop(web);
    let www = a.dir.join("www");
    std::fs::create_dir_all(&www)?;
    std::fs::write(www.join("index.html"), "cubenet demo world\n")?;
    let httpd = a
        .topo
        .world
        .command("busybox")
        .args(["httpd", "-f", "-p", &format!("{WORLD}:80"), "-h"])
        .arg(&www)
        .stdin(std::process::Stdio::null())
        .spawn()
        .context("spawn busybox httpd in world")?;
    cleanup::pid(httpd.id(), "busybox httpd (world web server)");
    p.say(format!("world web server now busybox httpd pid {}", httpd.id()));
    let res = cleanup::take();
    let script_path = PathBuf::from(format!("/tmp/cubenet-demo-{}-cleanup.sh", std::process::id()));
    std::fs::write(&script_path, res.script())?;
    let bin = profile_bin(&opts.profile, "cubenet-cli");
    let bin = bin.canonicalize().unwrap_or(bin);
    let ag = a.agent_ns().name().to_string();
    let mut text = String::new();
    text += "Left running (--keep):\n";
    for (pid, what) in &res.pids {
        text += &format!("  pid {pid}: {what}\n");
    }
    text += &format!(
        "  namespaces: node {} (agent, dataplane, TAPs, cube-dev, CubeEgress), world {}\n",
        a.topo.node.name(),
        a.topo.world.name(),
    );
    text += &format!("  agent dir {} (config, sockets, state, log/agent.log)\n\nExplore:\n", a.dir.display());
    text += &format!("  ip netns exec {ag} {} --grpc {} list\n", bin.display(), a.grpc_endpoint());
    text += &format!("  ip netns exec {ag} {} taps        # also: sessions, portmaps, policies\n", bin.display());
    text += &format!("  ip netns exec {ag} curl -s http://{HEALTH}/metrics\n");
    if let Some(sb) = sbs.get(1) {
        let hp = sb.resp.port_mappings.first().map_or(0, |m| m.host_port);
        text += &format!(
            "  ip netns exec {} curl -s http://{}:{hp}/cgi-bin/whoami   # world → sandbox 2\n",
            a.topo.world.name(),
            dotted(NODE_IP)
        );
    }
    for sb in &sbs {
        text += &format!(
            "  ip netns exec {} curl -s http://{}:{GUEST_PORT}/   # node → {}\n",
            a.topo.node.name(),
            sb.mvm_ip,
            sb.id
        );
    }
    text += &format!("  ip -n {} -br link; ip -n {} route\n", a.topo.node.name(), a.topo.node.name());
    text += &format!("\nClean up (exactly what this run created):\n  sh {}\nwhich runs:\n", script_path.display());
    for l in res.script().lines().filter(|l| !l.starts_with('#')) {
        text += &format!("  {l}\n");
    }
    // Leave every guard un-dropped: the processes, namespaces, mount and dir stay.
    for sb in sbs {
        std::mem::forget(sb.vm);
        std::mem::forget(sb.fd);
    }
    std::mem::forget(httpd);
    std::mem::forget(a);
    Ok(Report { rows, elapsed: t0.elapsed(), kept: Some(text) })
}

/// Fails when not root (the demo creates namespaces, TAPs and a bpffs mount).
pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the demo needs root (network namespaces, TAPs, eBPF): run it with sudo");
    }
    Ok(())
}

/// Sanity of a report for callers that want an error.
pub fn check(report: &Report) -> Result<()> {
    ensure!(report.passed(), "some checks failed:\n{}", report.table());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(sandbox: &str, pass: bool) -> Row {
        Row {
            sandbox: sandbox.into(),
            tap: "z192.168.0.2".into(),
            mvm_ip: "192.168.0.2".into(),
            check: "HTTP world".into(),
            pass,
            ms: 1234,
            detail: "you are 198.51.100.2:30000".into(),
        }
    }

    #[test]
    fn table_counts_failures_and_passed_needs_rows() {
        assert!(!Report::default().passed());
        let ok = Report { rows: vec![row("sb-1-default", true)], ..Default::default() };
        assert!(ok.passed());
        let bad = Report { rows: vec![row("sb-1-default", true), row("sb-2-portmap", false)], ..Default::default() };
        assert!(!bad.passed());
        let t = bad.table();
        assert!(t.starts_with("sandbox ") && t.contains("FAIL") && t.contains("1.23 s"), "{t}");
        assert!(t.contains("2 checks, 1 passed, 1 failed"), "{t}");
    }

    #[test]
    fn rows_grouped_by_plan_order() {
        let plan = plans(3);
        let rows = vec![row("(all)", true), row("sb-3-allowlist", true), row("sb-1-default", true)];
        let order: Vec<String> = by_sandbox(rows, &plan).into_iter().map(|r| r.sandbox).collect();
        assert_eq!(order, ["sb-1-default", "sb-3-allowlist", "(all)"]);
        assert_eq!(plans(9).len(), 4);
        assert_eq!(plans(0).len(), 1);
    }
}
