//! Datapath upgrade under load (issue 12, "Measured"): `datapath switch` and `datapath
//! rollback` while a veth guest (real kernel stack) runs a long TCP stream to the world, a
//! new-connection loop (target 1,000/s: connect, 1-byte echo, close) and a 1 ms ping. Per
//! operation: TCP resets seen by the guest or the world, failed connects, and the longest
//! interval without a ping reply or stream progress in the window of ±0.5 s around it.

use std::{
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use cubenet_tests::{
    bpffs::BpfFs,
    netns::ChildGuard,
    topology::{CUBE_DEV, CUBE_DEV_IP, NODE_IP, NODE_UPLINK, Topology},
};
use cubevs::{Datapath, LoadOptions, SandboxEntry, SnatAddr, slots};

use crate::report::Row;

const WORLD: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const STREAM_PORT: u16 = 7301;
const CONNECT_PORT: u16 = 7302;

#[derive(Default)]
struct Counters {
    resets: AtomicU64,
    failed_connects: AtomicU64,
    connects: AtomicU64,
    /// Instants at which the world read stream bytes.
    progress: Mutex<Vec<Instant>>,
}

fn is_reset(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe)
}

fn max_gap_ms(mut t: Vec<Instant>, from: Instant, to: Instant) -> f64 {
    t.retain(|x| *x >= from && *x <= to);
    t.sort();
    let mut edges = vec![from];
    edges.extend(t);
    edges.push(to);
    edges.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3).fold(0.0, f64::max)
}

/// `ping -D` reply lines: `[1700000000.123456] 64 bytes from ...`.
fn ping_times(out: &str, epoch0: (Instant, f64)) -> Vec<Instant> {
    out.lines()
        .filter(|l| l.contains("bytes from"))
        .filter_map(|l| l.strip_prefix('[')?.split(']').next()?.parse::<f64>().ok())
        .filter_map(|ts| {
            let d = ts - epoch0.1;
            (d >= 0.0).then(|| epoch0.0 + Duration::from_secs_f64(d))
        })
        .collect()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn servers(topo: &Topology, stop: Arc<AtomicBool>, c: Arc<Counters>) -> Vec<thread::JoinHandle<()>> {
    let stream = topo.world.run(|| TcpListener::bind((WORLD, STREAM_PORT))).expect("bind stream");
    let conns = topo.world.run(|| TcpListener::bind((WORLD, CONNECT_PORT))).expect("bind connect");
    let (s1, c1) = (stop.clone(), c.clone());
    let a = thread::spawn(move || {
        let Ok((mut s, _)) = stream.accept() else { return };
        s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        while !s1.load(Ordering::Relaxed) {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => c1.progress.lock().unwrap().push(Instant::now()),
                Err(e) if is_reset(&e) => {
                    c1.resets.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(_) => {}
            }
        }
    });
    let (s2, c2) = (stop, c);
    conns.set_nonblocking(true).unwrap();
    let b = thread::spawn(move || {
        while !s2.load(Ordering::Relaxed) {
            match conns.accept() {
                Ok((mut s, _)) => {
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                    let mut b = [0u8; 1];
                    match s.read_exact(&mut b).and_then(|()| s.write_all(&b)) {
                        Err(e) if is_reset(&e) => {
                            c2.resets.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
                Err(_) => thread::sleep(Duration::from_micros(200)),
            }
        }
    });
    vec![a, b]
}

/// Runs the switch and rollback measurements; rows `datapath switch: …` and
/// `datapath rollback: …`.
pub fn run() -> Vec<Row> {
    let mut topo = Topology::new();
    topo.add_cube_dev();
    let g = topo.add_veth_guest(0);
    let bpffs = BpfFs::new();
    let pin = bpffs.path().join("cubevs");
    let object = cubenet_tests::ebpf_object();
    let mut dp =
        Datapath::load(LoadOptions { object: object.clone(), pin_dir: Some(pin.clone()), ..LoadOptions::new() })
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
    // A second build of the same object (one byte appended): a different sha256, new programs.
    let next = std::env::temp_dir().join(format!("cubevs-upgrade-bench-{}.bpf.o", std::process::id()));
    let mut bytes = std::fs::read(&object).expect("read object");
    bytes.push(0);
    std::fs::write(&next, bytes).expect("write object");
    slots::load_standby(&pin, &next).expect("load standby");

    let gns = topo.guest_ns(&g);
    let mut rows = Vec::new();
    for op in ["datapath switch", "datapath rollback"] {
        // Clients stop first: a server that goes away under a connecting client resets it.
        let server_stop = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let c = Arc::new(Counters::default());
        let server_threads = servers(&topo, server_stop.clone(), c.clone());
        let mut threads = Vec::new();
        let (s, cc) = (stop.clone(), c.clone());
        threads.push(gns.spawn_thread(move || {
            let Ok(mut st) = TcpStream::connect((WORLD, STREAM_PORT)) else {
                cc.resets.fetch_add(1, Ordering::Relaxed);
                return;
            };
            let chunk = vec![7u8; 16 * 1024];
            while !s.load(Ordering::Relaxed) {
                if let Err(e) = st.write_all(&chunk) {
                    if is_reset(&e) {
                        cc.resets.fetch_add(1, Ordering::Relaxed);
                    }
                    return;
                }
                thread::sleep(Duration::from_micros(500));
            }
        }));
        let (s, cc) = (stop.clone(), c.clone());
        threads.push(gns.spawn_thread(move || {
            let addr = SocketAddr::from((WORLD, CONNECT_PORT));
            while !s.load(Ordering::Relaxed) {
                let t = Instant::now();
                let r = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).and_then(|mut st| {
                    st.set_read_timeout(Some(Duration::from_secs(1)))?;
                    st.write_all(b"x")?;
                    let mut b = [0u8; 1];
                    st.read_exact(&mut b)
                });
                match r {
                    Ok(()) => cc.connects.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        if is_reset(&e) {
                            cc.resets.fetch_add(1, Ordering::Relaxed);
                        }
                        cc.failed_connects.fetch_add(1, Ordering::Relaxed)
                    }
                };
                // Pace at about 1,000 new connections per second.
                if let Some(rest) = Duration::from_millis(1).checked_sub(t.elapsed()) {
                    thread::sleep(rest);
                }
            }
        }));
        let epoch0 = (Instant::now(), unix_now());
        let log = std::env::temp_dir().join(format!("cubevs-upgrade-ping-{}.txt", std::process::id()));
        let file = std::fs::File::create(&log).expect("ping log");
        let mut pinger = ChildGuard::from_child(
            std::process::Command::new("ip")
                .args(["netns", "exec", gns.name(), "ping", "-D", "-i", "0.001", "-W", "1", "-c", "4000"])
                .arg(WORLD.to_string())
                .stdout(file)
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("spawn ping"),
        );
        thread::sleep(Duration::from_millis(1800));
        let at = Instant::now();
        let res = if op == "datapath switch" { slots::switch(&pin) } else { slots::rollback(&pin) };
        let took = at.elapsed();
        res.unwrap_or_else(|e| panic!("{op}: {e}"));
        thread::sleep(Duration::from_millis(800));
        let (from, to) = (at - Duration::from_millis(500), at + took + Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            let _ = t.join();
        }
        server_stop.store(true, Ordering::Relaxed);
        for t in server_threads {
            let _ = t.join();
        }
        let _ = pinger.child().kill();
        let _ = pinger.child().wait();
        let out = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        let ping_gap = max_gap_ms(ping_times(&out, epoch0), from, to);
        let stream_gap = max_gap_ms(c.progress.lock().unwrap().clone(), from, to);
        let gap = ping_gap.max(stream_gap);
        // Control: the same measure over an equally long window before the operation.
        let (cfrom, cto) = (from - (to - from) - Duration::from_millis(100), from - Duration::from_millis(100));
        let pings = ping_times(&out, epoch0);
        let control = max_gap_ms(pings, cfrom, cto).max(max_gap_ms(c.progress.lock().unwrap().clone(), cfrom, cto));
        eprintln!(
            "{op}: {:.2} ms in the kernel+userspace, {} connects, ping gap {ping_gap:.2} ms, stream gap {stream_gap:.2} ms, \
             control window gap {control:.2} ms",
            took.as_secs_f64() * 1e3,
            c.connects.load(Ordering::Relaxed)
        );
        let row = |case: &str, value: f64, unit: &str, target: &str, baseline: Option<f64>| Row {
            bench: "upgrade".into(),
            case: format!("{op}: {case}"),
            value,
            spread: (value, value),
            unit: unit.into(),
            baseline: baseline.map(|b| ("same load, no operation".to_string(), b)),
            target: Some(target.into()),
        };
        rows.push(row("resets", c.resets.load(Ordering::Relaxed) as f64, "count", "0", None));
        rows.push(row("failed connects", c.failed_connects.load(Ordering::Relaxed) as f64, "count", "0", None));
        rows.push(row("max gap", gap, "ms", "<= 1 ms", Some(control)));
    }
    let _ = std::fs::remove_file(next);
    drop(dp);
    rows
}
