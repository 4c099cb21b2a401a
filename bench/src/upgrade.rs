//! Node upgrades under load (issue 12, "Measured"). A veth guest (real kernel stack) runs a
//! long TCP stream to the world, a new-connection loop (target 1,000/s: connect, 1-byte
//! echo, close) and a 1 ms ping while one operation runs. Per operation three rows,
//! `<operation>: resets` (TCP resets seen by the guest or the world, `count`),
//! `<operation>: failed connects` (`count`) and `<operation>: max gap` (longest interval
//! without a ping reply or stream progress, `ms`), each beside the same figure over an
//! equally long no-operation control window of the same load just before it.
//!
//! Structure: [`measure`] runs the load around any operation and returns its rows; each
//! operation family has one function that builds what it needs and calls [`measure`]
//! ([`datapath_operations`]: `datapath switch`, `datapath rollback`;
//! `crate::gateway_swap::run`: `gateway swap`, with its own HTTPS load). Another operation
//! (`agent upgrade`, `agent restart`) is one more such function called from [`run`].

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
    netns::{ChildGuard, TestNetns},
    topology::{CUBE_DEV, CUBE_DEV_IP, NODE_IP, NODE_UPLINK, Topology},
};
use cubevs::{Datapath, LoadOptions, SandboxEntry, SnatAddr, slots};

use crate::report::Row;

/// The world address the guest talks to (RFC 5737, the world namespace of [`Topology`]).
const WORLD: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const STREAM_PORT: u16 = 7301;
const CONNECT_PORT: u16 = 7302;
/// Load before the operation: the control window lies in it.
const WARM_UP: Duration = Duration::from_millis(2500);
/// The operation window reaches this far before and after the operation.
const MARGIN: Duration = Duration::from_millis(500);

/// Everything the load saw, with the instant of each event so that any window can be
/// counted afterwards.
#[derive(Default)]
struct Events {
    resets: Mutex<Vec<Instant>>,
    failed_connects: Mutex<Vec<Instant>>,
    connects: AtomicU64,
    /// Instants at which the world read stream bytes.
    progress: Mutex<Vec<Instant>>,
}

impl Events {
    fn reset(&self) {
        self.resets.lock().unwrap().push(Instant::now());
    }
}

fn is_reset(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe)
}

fn count_in(t: &[Instant], from: Instant, to: Instant) -> f64 {
    t.iter().filter(|x| **x >= from && **x <= to).count() as f64
}

/// Longest interval in [`from`, `to`] without an instant of `t` (window edges count): its
/// length in ms and its start.
fn longest_gap(t: &[Instant], from: Instant, to: Instant) -> (f64, Instant) {
    let mut inside: Vec<Instant> = t.iter().copied().filter(|x| *x >= from && *x <= to).collect();
    inside.sort();
    let mut edges = vec![from];
    edges.extend(inside);
    edges.push(to);
    edges.windows(2).map(|w| ((w[1] - w[0]).as_secs_f64() * 1e3, w[0])).fold(
        (0.0, from),
        |a, b| {
            if b.0 > a.0 { b } else { a }
        },
    )
}

fn max_gap_ms(t: &[Instant], from: Instant, to: Instant) -> f64 {
    longest_gap(t, from, to).0
}

/// Milliseconds from `at` to `t` (negative: before).
fn offset_ms(t: Instant, at: Instant) -> f64 {
    if t >= at { (t - at).as_secs_f64() * 1e3 } else { -((at - t).as_secs_f64() * 1e3) }
}

/// `ping -D` reply lines: `[1700000000.123456] 64 bytes from ...`, mapped onto `Instant`s
/// through `epoch0` (an `Instant` and the Unix time taken together).
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

/// The world side: a stream sink and a one-byte echo, counting the resets they see.
fn servers(world: &TestNetns, stop: Arc<AtomicBool>, ev: Arc<Events>) -> Vec<thread::JoinHandle<()>> {
    let stream = world.run(|| TcpListener::bind((WORLD, STREAM_PORT))).expect("bind stream");
    let conns = world.run(|| TcpListener::bind((WORLD, CONNECT_PORT))).expect("bind connect");
    let (s1, e1) = (stop.clone(), ev.clone());
    let a = thread::spawn(move || {
        let Ok((mut s, _)) = stream.accept() else { return };
        s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        while !s1.load(Ordering::Relaxed) {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => e1.progress.lock().unwrap().push(Instant::now()),
                Err(e) if is_reset(&e) => {
                    e1.reset();
                    break;
                }
                Err(_) => {}
            }
        }
    });
    conns.set_nonblocking(true).unwrap();
    let b = thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match conns.accept() {
                Ok((mut s, _)) => {
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                    let mut b = [0u8; 1];
                    if let Err(e) = s.read_exact(&mut b).and_then(|()| s.write_all(&b))
                        && is_reset(&e)
                    {
                        ev.reset();
                    }
                }
                Err(_) => thread::sleep(Duration::from_micros(200)),
            }
        }
    });
    vec![a, b]
}

/// The guest side: the long stream and the new-connection loop.
fn clients(guest: &TestNetns, stop: Arc<AtomicBool>, ev: Arc<Events>) -> Vec<thread::JoinHandle<()>> {
    let (s, e) = (stop.clone(), ev.clone());
    let stream = guest.spawn_thread(move || {
        let Ok(mut st) = TcpStream::connect((WORLD, STREAM_PORT)) else {
            e.reset();
            return;
        };
        let chunk = vec![7u8; 16 * 1024];
        while !s.load(Ordering::Relaxed) {
            if let Err(err) = st.write_all(&chunk) {
                if is_reset(&err) {
                    e.reset();
                }
                return;
            }
            thread::sleep(Duration::from_micros(500));
        }
    });
    let connector = guest.spawn_thread(move || {
        let addr = SocketAddr::from((WORLD, CONNECT_PORT));
        while !stop.load(Ordering::Relaxed) {
            let t = Instant::now();
            let r = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).and_then(|mut st| {
                st.set_read_timeout(Some(Duration::from_secs(1)))?;
                st.write_all(b"x")?;
                let mut b = [0u8; 1];
                st.read_exact(&mut b)
            });
            match r {
                Ok(()) => {
                    ev.connects.fetch_add(1, Ordering::Relaxed);
                }
                Err(err) => {
                    if is_reset(&err) {
                        ev.reset();
                    }
                    ev.failed_connects.lock().unwrap().push(t);
                }
            }
            // Pace at about 1,000 new connections per second.
            if let Some(rest) = Duration::from_millis(1).checked_sub(t.elapsed()) {
                thread::sleep(rest);
            }
        }
    });
    vec![stream, connector]
}

/// Runs the load between `guest` and `world`, performs `op` after [`WARM_UP`], and returns
/// the three rows of operation `name`. The operation window is the operation ± [`MARGIN`];
/// the control window is as long and ends 100 ms before it (shorter, from the load's
/// first 300 ms on, when the operation took longer than the warm-up leaves room for).
/// Panics when `op` fails: a failed operation has no figures.
pub fn measure(guest: &TestNetns, world: &TestNetns, name: &str, op: impl FnOnce() -> Result<(), String>) -> Vec<Row> {
    // Clients stop first: a server that goes away under a connecting client resets it.
    let server_stop = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let ev = Arc::new(Events::default());
    let server_threads = servers(world, server_stop.clone(), ev.clone());
    let started = Instant::now();
    let client_threads = clients(guest, stop.clone(), ev.clone());
    let epoch0 = (Instant::now(), unix_now());
    let log = std::env::temp_dir().join(format!("cubevs-upgrade-ping-{}.txt", std::process::id()));
    let file = std::fs::File::create(&log).expect("ping log");
    let mut pinger = ChildGuard::from_child(
        guest
            .command("ping")
            .args(["-D", "-i", "0.001", "-W", "1"])
            .arg(WORLD.to_string())
            .stdout(file)
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn ping"),
    );
    thread::sleep(WARM_UP);
    let at = Instant::now();
    let res = op();
    let took = at.elapsed();
    res.unwrap_or_else(|e| panic!("{name}: {e}"));
    thread::sleep(MARGIN + Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for t in client_threads {
        let _ = t.join();
    }
    server_stop.store(true, Ordering::Relaxed);
    for t in server_threads {
        let _ = t.join();
    }
    // SIGINT (by PID, to the ping we spawned): ping flushes its buffered output and exits.
    // SAFETY: kill(2) on our own child's PID.
    unsafe { libc::kill(pinger.id() as libc::pid_t, libc::SIGINT) };
    let _ = pinger.child().wait();
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);

    let pings = ping_times(&out, epoch0);
    let progress = ev.progress.lock().unwrap().clone();
    let resets = ev.resets.lock().unwrap().clone();
    let failed = ev.failed_connects.lock().unwrap().clone();
    let (from, to) = (at - MARGIN, at + took + MARGIN);
    let cto = from - Duration::from_millis(100);
    let cfrom = cto.checked_sub(to - from).filter(|t| *t >= started + Duration::from_millis(300));
    let cfrom = cfrom.unwrap_or(started + Duration::from_millis(300));
    let gap = |f, t| max_gap_ms(&pings, f, t).max(max_gap_ms(&progress, f, t));
    let figures = [
        ("resets", count_in(&resets, from, to), count_in(&resets, cfrom, cto), "count", "0"),
        ("failed connects", count_in(&failed, from, to), count_in(&failed, cfrom, cto), "count", "0"),
        ("max gap", gap(from, to), gap(cfrom, cto), "ms", "<= 1 ms"),
    ];
    let (ping_gap, ping_at) = longest_gap(&pings, from, to);
    let (stream_gap, stream_at) = longest_gap(&progress, from, to);
    eprintln!(
        "{name}: operation {:.2} ms; {} connects in {:.1} s; ping gap {ping_gap:.2} ms from {:+.1} ms, \
         stream gap {stream_gap:.2} ms from {:+.1} ms (relative to the operation); \
         control window {:.0} ms: ping gap {:.2} ms, stream gap {:.2} ms",
        took.as_secs_f64() * 1e3,
        ev.connects.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64(),
        offset_ms(ping_at, at),
        offset_ms(stream_at, at),
        (cto - cfrom).as_secs_f64() * 1e3,
        max_gap_ms(&pings, cfrom, cto),
        max_gap_ms(&progress, cfrom, cto),
    );
    figures
        .into_iter()
        .map(|(case, value, control, unit, target)| Row {
            bench: "upgrade".into(),
            case: format!("{name}: {case}"),
            value,
            spread: (value, value),
            unit: unit.into(),
            baseline: Some(("same load, no operation".to_string(), control)),
            target: Some(target.into()),
        })
        .collect()
}

/// `datapath switch` then `datapath rollback` (tcx link program replacement, the
/// `cubenet-cli datapath` library calls) on a pinned datapath serving one veth guest: the
/// standby slot holds a second build of the object (one byte appended: another sha256,
/// new programs), loaded and self-tested before the load starts.
pub fn datapath_operations() -> Vec<Row> {
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
    m.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: up }]).expect("snat");
    m.sandboxes
        .register(&SandboxEntry {
            ifindex: g.node_ifindex,
            ip: Ipv4Addr::new(192, 168, 0, 2),
            version: 1,
            id: "bench".into(),
        })
        .expect("register");
    // Without a policy an interface denies every new flow; the baseline allows the world.
    m.policy.install_default_deny(g.node_ifindex).expect("baseline policy");
    let next = std::env::temp_dir().join(format!("cubevs-upgrade-bench-{}.bpf.o", std::process::id()));
    let mut bytes = std::fs::read(&object).expect("read object");
    bytes.push(0);
    std::fs::write(&next, bytes).expect("write object");
    slots::load_standby(&pin, &next).expect("load standby");

    let gns = topo.guest_ns(&g);
    let mut rows =
        measure(gns, &topo.world, "datapath switch", || slots::switch(&pin).map(|_| ()).map_err(|e| e.to_string()));
    rows.extend(measure(gns, &topo.world, "datapath rollback", || {
        slots::rollback(&pin).map(|_| ()).map_err(|e| e.to_string())
    }));
    let _ = std::fs::remove_file(next);
    drop(dp);
    rows
}

/// Every upgrade operation this build can perform, three rows each (`rounds`: the gateway
/// swap's rounds).
pub fn run(rounds: usize) -> Vec<Row> {
    // One function per operation family.
    let mut rows = datapath_operations();
    rows.extend(crate::upgrade_agent::agent_operations());
    rows.extend(crate::gateway_swap::run(rounds));
    rows
}
