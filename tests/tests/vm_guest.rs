//! A real Linux guest (Debian 12 kernel, virtio-net, busybox) under QEMU TCG on a TAP with the
//! pool's settings (vnet header 12, CSUM|TSO4|TSO6, persistent), networked by the CubeVS
//! datapath: the building block of the demo (issue 5). QEMU gets the TAP as an inherited fd
//! (`-netdev tap,fd=N`), the way a VMM consumes the agent's fd handoff.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    os::fd::OwnedFd,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use cubenet_sys::tap::TapOptions;
use cubenet_tests::{
    bpffs::BpfFs,
    ebpf_object,
    netns::TestNetns,
    packet, require_root, servers,
    topology::{CUBE_DEV, CUBE_DEV_IP, NODE_IP, NODE_UPLINK, Topology, WORLD_IP, mac_string},
    vm::{Check, CheckResult, GuestConfig, GuestImage, Vm},
};
use cubevs::{Datapath, DatapathConfig, LoadOptions, Maps, PortMapping, Proto, SandboxEntry, SnatAddr};

const TAP_NAME: &str = "z192.168.0.2";
const TAP_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
/// Generous: TCG on 2 shared cores, with other tests running beside it.
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
const CHECKS_TIMEOUT: Duration = Duration::from_secs(120);
/// Bulk transfer size in each direction (exercises checksum offload and TSO/GSO end to end).
const BULK: u64 = 4 << 20;

struct Node {
    tap_ifindex: u32,
    maps: Arc<Maps>,
    _dp: Datapath,
    _bpffs: BpfFs,
    // Dropped last: namespaces (and every device in them).
    topo: Topology,
}

/// The guest image, or a loud skip with the proven environmental reason.
fn image(test: &str) -> Option<GuestImage> {
    GuestImage::for_test(test)
}

/// Node + world, cube-dev, one pool-style TAP with the datapath attached and the sandbox
/// registered with the baseline policy; returns the TAP fd for QEMU.
fn setup() -> (Node, OwnedFd) {
    let topo = Topology::new();
    topo.add_cube_dev();
    let (tap, tap_ifindex) = topo.add_tap(TAP_NAME, TapOptions::POOL);
    let bpffs = BpfFs::new();
    let dp = Datapath::load(LoadOptions {
        object: ebpf_object(),
        config: DatapathConfig::DEFAULT,
        pin_dir: Some(bpffs.path().join("cubevs")),
        ..LoadOptions::new()
    })
    .unwrap_or_else(|e| panic!("load datapath: {e}"));
    let dp = topo
        .node
        .thread()
        .run(move || {
            let mut dp = dp;
            dp.attach_uplink(NODE_UPLINK, Ipv4Addr::from(NODE_IP)).expect("attach uplink");
            dp.attach_cube_dev(CUBE_DEV, Ipv4Addr::from(CUBE_DEV_IP)).expect("attach cube-dev");
            dp.attach_sandbox(TAP_NAME).expect("attach TAP");
            dp
        })
        .expect("node thread");
    let maps = dp.maps();
    let uplink_ifindex = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).unwrap());
    maps.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: uplink_ifindex }]).expect("snat");
    maps.sandboxes
        .register(&SandboxEntry { ifindex: tap_ifindex, ip: TAP_IP, version: 1, id: "sb-vm".into() })
        .expect("register");
    maps.policy.install_default_deny(tap_ifindex).expect("baseline policy");
    (Node { tap_ifindex, maps, _dp: dp, _bpffs: bpffs, topo }, tap.into_fd())
}

/// A thread in `ns` serving one kind of bulk TCP exchange per connection until dropped.
struct Bulk {
    stop: Arc<AtomicBool>,
    bytes: Arc<AtomicU64>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Bulk {
    /// `serve_http`: answer any request with a `len`-byte body. Otherwise a sink: read `len`
    /// bytes (or to EOF), answer `got <n>`, close. `bytes` counts what was received/sent.
    fn start(ns: &TestNetns, addr: SocketAddr, len: u64, serve_http: bool) -> Self {
        let l = ns.run(move || TcpListener::bind(addr)).expect("bind bulk server");
        l.set_nonblocking(true).unwrap();
        let (stop, bytes) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let (s, b) = (stop.clone(), bytes.clone());
        let thread = thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Ok((mut c, _)) = l.accept() else {
                    thread::sleep(Duration::from_millis(10));
                    continue;
                };
                c.set_nonblocking(false).unwrap();
                c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut buf = vec![0u8; 64 * 1024];
                if serve_http {
                    let mut head = Vec::new();
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let hdr = format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n");
                    let _ = c.write_all(hdr.as_bytes());
                    buf.fill(b'x');
                    let mut left = len;
                    while left > 0 {
                        let k = left.min(buf.len() as u64) as usize;
                        if c.write_all(&buf[..k]).is_err() {
                            break;
                        }
                        left -= k as u64;
                        b.fetch_add(k as u64, Ordering::Relaxed);
                    }
                } else {
                    let mut got = 0u64;
                    while got < len {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => got += n as u64,
                        }
                    }
                    b.fetch_add(got, Ordering::Relaxed);
                    let _ = c.write_all(format!("got {got}\n").as_bytes());
                }
            }
        });
        Self { stop, bytes, thread: Some(thread) }
    }
}

impl Drop for Bulk {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn find<'a>(results: &'a [CheckResult], check: &Check) -> &'a CheckResult {
    let spec = check.spec();
    results.iter().find(|r| r.spec == spec).unwrap_or_else(|| panic!("no result for {spec}: {results:?}"))
}

/// `ethtool -k` of the TAP, reduced to the offload lines that matter here.
fn tap_offloads(node: &Node) -> String {
    let out = node.topo.node.exec("ethtool", &["-k", TAP_NAME]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .filter(|l| {
            ["tx-checksumming:", "tcp-segmentation-offload:", "generic-segmentation-offload:", "rx-checksumming:"]
                .iter()
                .any(|k| l.trim_start().starts_with(k))
        })
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(", ")
}

/// (rx packets, rx bytes, tx packets, tx bytes) of the TAP; rx is what the guest sent.
fn tap_stats(node: &Node) -> [u64; 4] {
    let out = node.topo.node.exec("ip", &["-s", "-j", "link", "show", "dev", TAP_NAME]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output");
    let s = &v[0]["stats64"];
    let n = |dir: &str, k: &str| s[dir][k].as_u64().unwrap_or_else(|| panic!("stats64.{dir}.{k} in {v}"));
    [n("rx", "packets"), n("rx", "bytes"), n("tx", "packets"), n("tx", "bytes")]
}

fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: t\r\n\r\n").as_bytes())?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    Ok(body)
}

#[test]
fn real_guest_egress_checks() {
    if !require_root("real_guest_egress_checks") {
        return;
    }
    let Some(img) = image("real_guest_egress_checks") else { return };
    let (node, tap_fd) = setup();
    let world = &node.topo.world;
    let world_http = servers::http(world, WORLD_IP, 80);
    node.topo.add_world_address([10, 99, 0, 1], 24);
    let private_http = servers::http(world, [10, 99, 0, 1], 80);
    let big = Bulk::start(world, SocketAddr::from((WORLD_IP, 8081)), BULK, true);
    let sink = Bulk::start(world, SocketAddr::from((WORLD_IP, 9000)), BULK, false);

    let w = |port| SocketAddrV4::new(Ipv4Addr::from(WORLD_IP), port);
    let checks = vec![
        Check::Arp(Ipv4Addr::from(packet::GATEWAY_IP)),
        Check::Ping(Ipv4Addr::from(WORLD_IP)),
        Check::Http(w(80), "/".into()),
        Check::Refused(SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 1), 80)),
        Check::Fetch(w(8081), "/big".into()),
        Check::Send(w(9000), BULK),
        // Must FAIL: ICMP to the private range is denied (proves failures are reported).
        Check::Ping(Ipv4Addr::new(10, 99, 0, 1)),
    ];
    let cfg = GuestConfig { checks: checks.clone(), ..GuestConfig::cubevs() };
    let vm = Vm::boot(&img, tap_fd, &cfg).expect("boot QEMU");
    let ready = vm.wait_ready(BOOT_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!(
        "[vm] QEMU pid {} boot-to-ready {:.2} s (guest uptime at ready {:?} ms)",
        vm.pid(),
        ready.as_secs_f64(),
        vm.guest_ready_ms()
    );
    let results = vm.wait_done(CHECKS_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let offloads = tap_offloads(&node);
    let [rxp, rxb, txp, txb] = tap_stats(&node);
    let console = vm.console();
    for l in console.lines().filter(|l| l.contains("CUBENET-INFO")) {
        eprintln!("[vm] guest {l}");
    }
    for r in &results {
        eprintln!("[vm] {} {} {} ms {}", r.spec, if r.pass { "PASS" } else { "FAIL" }, r.ms, r.detail);
    }
    eprintln!("[vm] TAP offloads with the guest running (set by QEMU from virtio features): {offloads}");
    // Without segmentation offload each direction's 4 MiB needs at least BULK / 1448 (MSS)
    // frames by itself; fewer frames in total prove super-frames crossed the TAP and the datapath.
    let min_frames = BULK.div_ceil(1448);
    eprintln!(
        "[vm] TAP frames: from guest {rxp} (avg {} B), to guest {txp} (avg {} B); one direction's bulk \
         alone needs >= {min_frames} MSS frames: TSO from guest {}, GSO to guest {}",
        rxb / rxp.max(1),
        txb / txp.max(1),
        if rxp < min_frames { "proven" } else { "not proven" },
        if txp < min_frames { "proven" } else { "not proven" },
    );
    assert_eq!(results.len(), checks.len(), "{results:?}\n{}", vm.console());
    let (denied, rest) = results.split_last().expect("results");
    assert!(rest.iter().all(|r| r.pass), "failed checks: {results:?}\n{}", vm.console());
    assert!(!denied.pass && denied.spec == checks[6].spec(), "ping to 10.99.0.1 must fail: {denied:?}");

    // The ARP proxy answered with the gateway MAC.
    assert_eq!(find(&results, &checks[0]).detail, mac_string(packet::GATEWAY_MAC));
    // HTTP went out SNATed to the node uplink address.
    let http = find(&results, &checks[2]);
    assert!(http.detail.starts_with("you are 198.51.100.2:"), "{http:?}");
    let peers = world_http.peers();
    assert!(!peers.is_empty() && peers.iter().all(|p| p.ip() == std::net::IpAddr::from(NODE_IP)), "{peers:?}");
    // The private range was refused by policy before reaching the server.
    assert!(private_http.peers().is_empty(), "private server reached: {:?}", private_http.peers());
    // Bulk both ways, byte-exact.
    assert_eq!(find(&results, &checks[4]).detail, format!("bytes {BULK}"));
    assert_eq!(find(&results, &checks[5]).detail, format!("got {BULK}"));
    assert_eq!((big.bytes.load(Ordering::Relaxed), sink.bytes.load(Ordering::Relaxed)), (BULK, BULK));
    // The datapath saw it: sessions and denies were counted.
    let c = node.maps.counters.read().expect("counters");
    let get = |r: &str| c.iter().find(|v| v.reason == r).map(|v| v.packets).unwrap_or(0);
    assert!(get("new_session") > 0 && get("reverse_nat") > 0 && get("deny") > 0, "{c:?}");
}

#[test]
fn real_guest_serves_on_a_mapped_port() {
    if !require_root("real_guest_serves_on_a_mapped_port") {
        return;
    }
    let Some(img) = image("real_guest_serves_on_a_mapped_port") else { return };
    let (node, tap_fd) = setup();
    node.maps
        .ports
        .add(&PortMapping { proto: Proto::Tcp, host_port: 20080, ifindex: node.tap_ifindex, guest_port: 8080 })
        .expect("port map");
    let cfg = GuestConfig {
        serve_port: Some(8080),
        checks: vec![Check::Ping(Ipv4Addr::from(WORLD_IP))],
        ..GuestConfig::cubevs()
    };
    let vm = Vm::boot(&img, tap_fd, &cfg).expect("boot QEMU");
    let ready = vm.wait_ready(BOOT_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("[vm] serving guest: boot-to-ready {:.2} s", ready.as_secs_f64());
    let results = vm.wait_done(CHECKS_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(results.len() == 1 && results[0].pass, "{results:?}\n{}", vm.console());

    // world → node:20080 → guest httpd:8080; the CGI reports the client it saw.
    let mapped = SocketAddr::from((NODE_IP, 20080));
    let t0 = Instant::now();
    let body = node
        .topo
        .world
        .run(move || http_get(mapped, "/cgi-bin/whoami"))
        .unwrap_or_else(|e| panic!("world → mapped port: {e}\n{}", vm.console()));
    eprintln!("[vm] world fetched the guest's page in {:?}", t0.elapsed());
    assert!(body.starts_with("HTTP/1.") && body.contains(" 200 "), "{body}");
    assert!(body.contains("you are 198.51.100.1:"), "guest should see the world client: {body}");
    let index = node.topo.world.run(move || http_get(mapped, "/")).expect("index");
    assert!(index.contains("cubenet guest"), "{index}");
    // The guest keeps running after CUBENET-DONE when it serves; drop kills it by PID.
    let pid = vm.pid();
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists(), "serving guest exited");
    drop(vm);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(stat.is_empty(), "QEMU {pid} still present after drop: {stat}");
}
