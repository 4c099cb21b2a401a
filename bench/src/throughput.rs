//! Throughput and connection rate, veth guest (real kernel stack) ↔ world (issue 6 §4), through
//! (a) CubeVS, (b) the classic path — Linux bridge + iptables MASQUERADE + nf_conntrack — and
//! (c) plain routing without NAT (the ceiling), each in a fresh namespace topology.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use cubenet_tests::{
    bpffs::BpfFs,
    netns::TestNetns,
    topology::{CUBE_DEV, CUBE_DEV_IP, NODE_IP, NODE_UPLINK, Topology, WORLD_IP},
};
use cubevs::{Datapath, LoadOptions, SandboxEntry, SnatAddr};

use crate::report::{Row, stats};

/// The three paths compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// CubeVS eBPF datapath.
    Cubevs,
    /// Linux bridge + iptables MASQUERADE + nf_conntrack.
    BridgeIptables,
    /// Plain routing, no NAT.
    Routed,
}

impl Path {
    fn label(self) -> &'static str {
        match self {
            Path::Cubevs => "CubeVS",
            Path::BridgeIptables => "bridge+iptables",
            Path::Routed => "plain routing",
        }
    }
}

/// A topology with one guest behind the given path. Keeps everything alive until dropped.
pub(crate) struct Setup {
    own_guest: Option<TestNetns>,
    pub(crate) veth: Option<cubenet_tests::guest::VethGuest>,
    pub(crate) _dp: Option<Datapath>,
    _bpffs: Option<BpfFs>,
    pub(crate) topo: Topology,
}

impl Setup {
    pub(crate) fn guest(&self) -> &TestNetns {
        match (&self.own_guest, &self.veth) {
            (Some(g), _) => g,
            (None, Some(v)) => self.topo.guest_ns(v),
            (None, None) => unreachable!("a setup always has a guest"),
        }
    }
}

fn sh(ns: &TestNetns, args: &[&str]) {
    let out = ns.exec(args[0], &args[1..]);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

pub(crate) fn setup(path: Path) -> Setup {
    let mut topo = Topology::new();
    match path {
        Path::Cubevs => {
            topo.add_cube_dev();
            let g = topo.add_veth_guest(0);
            let bpffs = BpfFs::new();
            let mut dp = Datapath::load(LoadOptions {
                object: cubenet_tests::ebpf_object(),
                pin_dir: Some(bpffs.path().join("cubevs")),
                ..LoadOptions::new()
            })
            .expect("load datapath");
            let node_if = g.node_if.clone();
            dp = topo.node.run(move || {
                dp.attach_uplink(NODE_UPLINK, Ipv4Addr::from(NODE_IP)).expect("uplink");
                dp.attach_cube_dev(CUBE_DEV, Ipv4Addr::from(CUBE_DEV_IP)).expect("cube-dev");
                dp.attach_sandbox(&node_if).expect("sandbox");
                dp
            });
            let m = dp.maps();
            let up = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).unwrap());
            m.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: up }]).unwrap();
            m.sandboxes
                .register(&SandboxEntry {
                    ifindex: g.node_ifindex,
                    ip: Ipv4Addr::new(192, 168, 0, 2),
                    version: 1,
                    id: "bench".into(),
                })
                .unwrap();
            m.policy.install_default_deny(g.node_ifindex).unwrap();
            Setup { own_guest: None, veth: Some(g), _dp: Some(dp), _bpffs: Some(bpffs), topo }
        }
        Path::BridgeIptables | Path::Routed => {
            let guest = TestNetns::new("bg");
            let n = &topo.node;
            n.ip(&["link", "add", "vb0", "type", "veth", "peer", "name", "eth0", "netns", guest.name()]);
            let (node_addr, guest_addr, net) = if path == Path::Routed {
                ("10.201.0.1/24", "10.201.0.2/24", "10.201.0.0/24")
            } else {
                ("10.200.0.1/24", "10.200.0.2/24", "10.200.0.0/24")
            };
            if path == Path::BridgeIptables {
                n.ip(&["link", "add", "br0", "type", "bridge"]);
                n.ip(&["link", "set", "vb0", "master", "br0"]);
                n.ip(&["addr", "add", node_addr, "dev", "br0"]);
                n.ip(&["link", "set", "br0", "up"]);
                sh(
                    n,
                    &["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", net, "-o", NODE_UPLINK, "-j", "MASQUERADE"],
                );
                sh(
                    n,
                    &[
                        "iptables",
                        "-A",
                        "FORWARD",
                        "-m",
                        "conntrack",
                        "--ctstate",
                        "ESTABLISHED,RELATED",
                        "-j",
                        "ACCEPT",
                    ],
                );
                sh(n, &["iptables", "-A", "FORWARD", "-s", net, "-j", "ACCEPT"]);
            } else {
                n.ip(&["addr", "add", node_addr, "dev", "vb0"]);
                topo.world.ip(&["route", "add", net, "via", "198.51.100.2"]);
            }
            n.ip(&["link", "set", "vb0", "up"]);
            sh(n, &["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
            guest.ip(&["addr", "add", guest_addr, "dev", "eth0"]);
            guest.ip(&["link", "set", "eth0", "up"]);
            guest.ip(&["route", "add", "default", "via", node_addr.split('/').next().unwrap()]);
            Setup { own_guest: Some(guest), veth: None, _dp: None, _bpffs: None, topo }
        }
    }
}

fn iperf(s: &Setup, streams: u32, secs: u32) -> f64 {
    let mut server = s.topo.world.spawn("iperf3", &["-s", "-1", "-B", "198.51.100.1", "-p", "5201"]);
    thread::sleep(Duration::from_millis(300));
    let out = s.guest().exec(
        "iperf3",
        &["-c", "198.51.100.1", "-p", "5201", "-t", &secs.to_string(), "-O", "1", "-P", &streams.to_string(), "-J"],
    );
    let _ = server.child().wait();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("iperf3 output: {e}: {}", String::from_utf8_lossy(&out.stdout)));
    json["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or_else(|| panic!("iperf3 result: {json}")) / 1e9
}

/// Connections per second: `threads` clients connect, send a request, read the reply, close.
fn conn_rate(s: &Setup, threads: usize, dur: Duration) -> f64 {
    let listener = s.topo.world.run(|| TcpListener::bind(("198.51.100.1", 8090))).expect("bind rate server");
    let stop = Arc::new(AtomicBool::new(false));
    let mut servers = Vec::new();
    for _ in 0..4 {
        let l = listener.try_clone().expect("clone listener");
        let st = stop.clone();
        servers.push(thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                if let Ok((mut c, _)) = l.accept() {
                    let mut b = [0u8; 64];
                    let _ = c.read(&mut b);
                    let _ = c.write_all(b"ok");
                }
            }
        }));
    }
    let count = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..threads {
        let (c, e) = (count.clone(), errors.clone());
        clients.push(s.guest().spawn_thread(move || {
            let addr = SocketAddr::from((WORLD_IP, 8090));
            while start.elapsed() < dur {
                match TcpStream::connect_timeout(&addr, Duration::from_secs(1)).and_then(|mut t| {
                    t.write_all(b"hi")?;
                    let mut b = [0u8; 2];
                    t.read_exact(&mut b)
                }) {
                    Ok(()) => c.fetch_add(1, Ordering::Relaxed),
                    Err(_) => e.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    for c in clients {
        let _ = c.join();
    }
    let rate = count.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    if let Some(dp) = &s._dp {
        for c in dp.maps().counters.read().unwrap_or_default() {
            if c.packets > 0 && c.reason.starts_with("drop") {
                eprintln!("  cubevs counter {} {}: {}", c.program, c.reason, c.packets);
            }
        }
    }
    eprintln!("  {} connections, {} errors", count.load(Ordering::Relaxed), errors.load(Ordering::Relaxed));
    stop.store(true, Ordering::Relaxed);
    // Wake the blocked accepts.
    for _ in 0..servers.len() {
        let _ = s.topo.world.run(|| TcpStream::connect(("198.51.100.1", 8090)));
    }
    for t in servers {
        let _ = t.join();
    }
    rate
}

/// Runs the throughput benchmark: `rounds` repetitions of each measurement.
pub fn run(rounds: usize) -> Vec<Row> {
    let mut rows = Vec::new();
    let paths = [Path::Cubevs, Path::BridgeIptables, Path::Routed];
    let mut results: Vec<(Path, &str, Vec<f64>)> = Vec::new();
    for &p in &paths {
        let s = setup(p);
        let mut one = Vec::new();
        let mut four = Vec::new();
        let mut rate = Vec::new();
        for _ in 0..rounds {
            one.push(iperf(&s, 1, 4));
            four.push(iperf(&s, 4, 4));
            rate.push(conn_rate(&s, 4, Duration::from_secs(3)));
        }
        results.push((p, "TCP 1 stream", one));
        results.push((p, "TCP 4 streams", four));
        results.push((p, "connect-request-close, 4 clients", rate));
    }
    let median_of = |p: Path, case: &str| {
        let mut v = results.iter().find(|r| r.0 == p && r.1 == case).unwrap().2.clone();
        stats(&mut v).0
    };
    for (p, case, v) in &results {
        let mut v = v.clone();
        let (med, spread) = stats(&mut v);
        let unit = if case.starts_with("TCP") { "Gbit/s" } else { "conn/s" };
        let (baseline, target) = match p {
            Path::Cubevs => (
                Some((Path::BridgeIptables.label().to_string(), median_of(Path::BridgeIptables, case))),
                Some(if unit == "Gbit/s" { ">= 1.2x bridge+iptables" } else { ">= 1.5x bridge+iptables" }.to_string()),
            ),
            Path::BridgeIptables => (Some((Path::Routed.label().to_string(), median_of(Path::Routed, case))), None),
            Path::Routed => (None, None),
        };
        rows.push(Row {
            bench: "throughput".into(),
            case: format!("{}: {case}", p.label()),
            value: med,
            spread,
            unit: unit.into(),
            baseline,
            target,
        });
    }
    rows
}
