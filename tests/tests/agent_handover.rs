//! Issue 12, agent upgrade with live sandboxes: a new agent binary, started by
//! `scripts/start-network-agent.sh` with `NETWORK_AGENT_HANDOVER_SOCKET`, takes the running
//! agent's listeners and TAP fds over (`agent/src/handover.rs`).
//!
//! 1. N Active sandboxes, one of them a kernel TCP stack in a guest netns whose frames a relay
//!    (playing the VMM) carries to and from the agent's TAP fd: no reset, no stall; afterwards
//!    the fd socket answers every Active sandbox with the same TAP (name and ifindex), the one
//!    the VMM holds included (it was not reopened), and Ensure/Release work.
//! 2. Continuous gRPC Ensure/Release (tonic and grpcio, default options), fd requests and new
//!    gRPC connections during the hand-over: zero refused or failed.
//! 3. Attacks on the hand-over socket: mode 0600; another uid is refused by the mode and, with
//!    the mode widened, by SO_PEERCRED; a bad protocol version is refused; a hand-over aborted
//!    after the offer, a successor whose configuration does not fit, and an agent started
//!    without the hand-over socket leave the old agent serving.
//! 4. Crash path: after `kill -9` there is nothing to hand over; the restarted agent answers
//!    `-1` for a TAP a VMM holds (documented) and `0` for one nobody holds.
//! 5. `after_handover = "wait"`: the old agent stays, holding no TAP fd and no listener, until
//!    SIGTERM (for supervisors that restart an exited process); SIGTERM while an offer is out
//!    leaves the socket files; the old agent never pushes to CubeEgress after the hand-over.

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    os::{
        fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
        unix::{fs::MetadataExt, fs::PermissionsExt, net::UnixStream, process::CommandExt},
    },
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use cubenet_proto::v1::{self as pb, network_agent_client::NetworkAgentClient};
use cubenet_sys::tap::VNET_HDR_LEN;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    agent_upgrade::{self, KernelGuest, handover_socket, spawn_agent, start},
    grpcio::agent_stubs,
    guest::TapGuest,
    netns::{ChildGuard, TestNetns},
    packet::{self, GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    topology::WORLD_IP,
};
use network_agent::handover;
use tonic::transport::Channel;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

async fn client(a: &AgentUnderTest) -> NetworkAgentClient<Channel> {
    network_agent::client::connect(&a.grpc_endpoint()).await.expect("connect gRPC")
}

fn ensure_req(id: &str) -> pb::EnsureNetworkRequest {
    pb::EnsureNetworkRequest {
        sandbox_id: id.into(),
        cubevs_context: Some(pb::CubeVsContext { allow_internet_access: Some(true), ..Default::default() }),
        ..Default::default()
    }
}

fn release_req(id: &str) -> pb::ReleaseNetworkRequest {
    pb::ReleaseNetworkRequest { sandbox_id: id.into(), ..Default::default() }
}

fn ensure(a: &AgentUnderTest, id: &str) -> pb::EnsureNetworkResponse {
    rt().block_on(async { client(a).await.ensure_network(ensure_req(id)).await.expect("ensure").into_inner() })
}

fn release(a: &AgentUnderTest, id: &str) {
    rt().block_on(async { client(a).await.release_network(release_req(id)).await.expect("release") });
}

/// The library's upgrade, asserted: the old agent exits 0 and both logged their side.
fn upgrade(a: &mut AgentUnderTest) -> Duration {
    let took = agent_upgrade::upgrade(a).unwrap_or_else(|e| panic!("{e}:\n{}", a.log()));
    a.wait_ready(Duration::from_secs(30));
    let log = a.log();
    assert!(log.contains("handed over to the successor"), "{log}");
    assert!(log.contains("hand-over complete"), "{log}");
    took
}

fn wait_until(what: &str, timeout: Duration, f: impl FnMut() -> bool) {
    agent_upgrade::wait_until(what, timeout, f).unwrap();
}

fn wait_exit(c: &mut ChildGuard, timeout: Duration, log: impl Fn() -> String) -> std::process::ExitStatus {
    agent_upgrade::wait_exit(c, timeout).unwrap_or_else(|e| panic!("{e}:\n{}", log()))
}

/// An fd request that reports failures instead of panicking (for the loops).
fn try_tap_fd(socket: &Path, tap: &str, sandbox: &str) -> Result<(String, Option<OwnedFd>), String> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let s = UnixStream::connect(socket).map_err(|e| format!("connect fd socket: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let req = serde_json::json!({"name": tap, "sandboxId": sandbox}).to_string();
    (&s).write_all(req.as_bytes()).map_err(|e| format!("write: {e}"))?;
    let mut buf = [0u8; 256];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| format!("recvmsg: {e}"))?;
    let mut fd = None;
    for c in msg.cmsgs().map_err(|e| e.to_string())? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            // SAFETY: the kernel installed these fds in our table for us (SCM_RIGHTS).
            fd = fds.first().map(|&f| unsafe { OwnedFd::from_raw_fd(f) });
        }
    }
    let n = msg.bytes;
    let v: serde_json::Value = serde_json::from_slice(&buf[..n])
        .map_err(|e| format!("reply {:?}: {e}", String::from_utf8_lossy(&buf[..n])))?;
    Ok((v["errCode"].as_str().unwrap_or_default().to_string(), fd))
}

/// The TAP a queue fd belongs to (`TUNGETIFF`).
fn attached(fd: &OwnedFd) -> String {
    cubenet_sys::tap::attached_name(fd.as_fd()).expect("TUNGETIFF")
}

fn node_ifindex(a: &AgentUnderTest, tap: &str) -> u32 {
    let t = tap.to_string();
    a.topo.node.run(move || cubenet_sys::ifindex(&t).unwrap())
}

/// What a long TCP connection saw.
#[derive(Debug, Default)]
struct Stream {
    echoes: usize,
    max_gap: Duration,
    error: Option<String>,
    /// When each echo came back.
    at: Vec<Instant>,
}

impl Stream {
    /// Longest interval between echoes that came back in [`from`, `to`].
    fn max_gap_in(&self, from: Instant, to: Instant) -> Duration {
        let v: Vec<_> = self.at.iter().filter(|t| **t >= from && **t <= to).collect();
        v.windows(2).map(|w| *w[1] - *w[0]).max().unwrap_or_default()
    }
}

/// World's echo server on 7000; counts connections that ended with an error (a reset).
fn echo_server(a: &AgentUnderTest, resets: Arc<AtomicUsize>) -> JoinHandle<()> {
    let l = a.topo.world.run(|| TcpListener::bind((std::net::Ipv4Addr::from(WORLD_IP), 7000)).unwrap());
    std::thread::spawn(move || {
        if let Ok((mut c, _)) = l.accept() {
            let mut buf = [0u8; 4096];
            loop {
                match c.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if c.write_all(&buf[..n]).is_err() {
                            resets.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                    }
                    Err(_) => {
                        resets.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
        }
    })
}

/// From the guest's kernel: one TCP connection to world:7000, 16 bytes echoed every 10 ms
/// until `stop`.
fn drive(ns: &TestNetns, stop: Arc<AtomicBool>) -> JoinHandle<Stream> {
    let mut c = ns.run(|| {
        TcpStream::connect_timeout(&(std::net::Ipv4Addr::from(WORLD_IP), 7000).into(), Duration::from_secs(5))
            .expect("guest connects to world:7000")
    });
    std::thread::spawn(move || {
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut s = Stream::default();
        let mut last = Instant::now();
        let mut buf = [0u8; 16];
        while !stop.load(Ordering::Relaxed) {
            let r = c.write_all(b"0123456789abcdef").and_then(|()| c.read_exact(&mut buf));
            if let Err(e) = r {
                s.error = Some(format!("after {} echoes: {e}", s.echoes));
                break;
            }
            s.echoes += 1;
            s.max_gap = s.max_gap.max(last.elapsed());
            last = Instant::now();
            s.at.push(last);
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    })
}

#[test]
fn upgrade_keeps_tcp_and_every_active_tap() {
    if !require_root("upgrade_keeps_tcp_and_every_active_tap") {
        return;
    }
    let mut a = AgentUnderTest::prepare("ho-up", 4, "");
    start(&mut a);
    let resets = Arc::new(AtomicUsize::new(0));
    let _srv = echo_server(&a, resets.clone());
    // Three Active sandboxes: one with a kernel guest on a relay, one with a raw-frame guest
    // (both hold their TAP like a VMM), one whose TAP nobody holds.
    let ids = ["sb-tcp", "sb-arp", "sb-idle"];
    let rs: Vec<_> = ids.iter().map(|id| ensure(&a, id)).collect();
    let taps: Vec<String> = rs.iter().map(|r| r.interfaces[0].name.clone()).collect();
    let ifindexes: Vec<u32> = taps.iter().map(|t| node_ifindex(&a, t)).collect();
    let (c, fd) = tap_fd(&a.tap_socket(), &taps[0], ids[0]);
    assert_eq!(c["errCode"], "0", "{c}");
    let ifc = &rs[0].interfaces[0];
    let kg = KernelGuest::new(fd.unwrap(), &ifc.mac_address, &ifc.ip_cidrs[0], &ifc.gateway, ifc.mtu as u32);
    let (c, fd) = tap_fd(&a.tap_socket(), &taps[1], ids[1]);
    assert_eq!(c["errCode"], "0", "{c}");
    let arp_guest = TapGuest::new(fd.unwrap(), VNET_HDR_LEN);
    arp_guest.drain();
    let arp_ok = |g: &TapGuest| {
        g.arp(GATEWAY_IP, Duration::from_secs(2))
            == Some(packet::arp_reply(GATEWAY_MAC, GATEWAY_IP, GUEST_MAC, GUEST_IP))
    };
    assert!(arp_ok(&arp_guest));

    let stop = Arc::new(AtomicBool::new(false));
    let driver = drive(&kg.ns, stop.clone());
    std::thread::sleep(Duration::from_millis(1500));
    let t_up = Instant::now();
    let took = upgrade(&mut a);
    let t_done = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let s = driver.join().unwrap();
    let control = s.max_gap_in(t_up - (t_done - t_up).min(Duration::from_millis(1400)), t_up);
    eprintln!(
        "hand-over: old agent gone {took:?} after the successor started; guest stream: {} echoes, \
         longest gap {:?} during the hand-over, {control:?} in as long a window before, error {:?}",
        s.echoes,
        s.max_gap_in(t_up, t_done),
        s.error
    );
    assert!(s.error.is_none(), "guest TCP broke across the hand-over: {s:?}\n{}", a.log());
    assert!(s.echoes > 50, "{s:?}");
    assert!(s.max_gap < Duration::from_millis(500), "guest TCP stalled: {s:?}");
    assert_eq!(resets.load(Ordering::Relaxed), 0, "world saw a reset");
    assert!(arp_ok(&arp_guest), "raw guest no longer answered");

    // Every Active sandbox is answered with its own TAP, same name and ifindex; the two a
    // VMM holds were not reopened (a reopen of a held single-queue TAP fails: errCode -1).
    for (i, id) in ids.iter().enumerate() {
        let (code, fd) = try_tap_fd(&a.tap_socket(), &taps[i], id).unwrap();
        assert_eq!(code, "0", "{id} after the hand-over:\n{}", a.log());
        assert_eq!(attached(&fd.unwrap()), taps[i]);
        assert_eq!(node_ifindex(&a, &taps[i]), ifindexes[i], "{id}: TAP recreated");
    }
    // The successor took every pool TAP's fd from the old agent (3 Active + the Ready ones).
    let n = a.node_taps().len();
    let log = a.log();
    assert!(n >= 7, "{n} TAPs");
    assert!(log.contains(&format!("handed_over_fds: {n}")), "the successor must hold all {n} TAP fds:\n{log}");
    // Ensure and Release work after the hand-over.
    let r = ensure(&a, "sb-after");
    let (code, fd) = try_tap_fd(&a.tap_socket(), &r.interfaces[0].name, "sb-after").unwrap();
    assert_eq!(code, "0");
    assert_eq!(attached(&fd.unwrap()), r.interfaces[0].name);
    drop(kg);
    drop(arp_guest);
    for id in ids.iter().chain(["sb-after"].iter()) {
        release(&a, id);
    }
    let left: Vec<_> = std::fs::read_dir(a.state_dir()).unwrap().flatten().collect();
    assert!(left.is_empty(), "state left: {left:?}");
}

/// Failures seen by one client loop, and when its operations completed.
#[derive(Debug, Default)]
struct Loop {
    ok: usize,
    failed: Vec<String>,
    done_at: Vec<Instant>,
}

fn spawn_loop(
    stop: Arc<AtomicBool>,
    mut op: impl FnMut(usize) -> Result<(), String> + Send + 'static,
) -> JoinHandle<Loop> {
    std::thread::spawn(move || {
        let mut l = Loop::default();
        let mut i = 0;
        while !stop.load(Ordering::Relaxed) {
            match op(i) {
                Ok(()) => l.ok += 1,
                Err(e) => l.failed.push(e),
            }
            l.done_at.push(Instant::now());
            i += 1;
        }
        l
    })
}

#[test]
fn requests_during_the_handover_are_all_served() {
    if !require_root("requests_during_the_handover_are_all_served") {
        return;
    }
    let mut a = AgentUnderTest::prepare("ho-loop", 4, "");
    start(&mut a);
    let stable = ensure(&a, "sb-stable");
    let stable_tap = stable.interfaces[0].name.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let ep = a.grpc_endpoint();
    let sock = a.tap_socket();

    // One long-lived default tonic channel: Ensure → fd request → Release, again and again.
    let (e2, s2) = (ep.clone(), sock.clone());
    let mut conn = None::<(tokio::runtime::Runtime, NetworkAgentClient<Channel>)>;
    let cycle = spawn_loop(stop.clone(), move |i| {
        let (rt, c) = conn.get_or_insert_with(|| {
            let rt = rt();
            let c = rt.block_on(network_agent::client::connect(&e2)).expect("connect");
            (rt, c)
        });
        let id = format!("sb-loop-{i}");
        let r = rt.block_on(c.ensure_network(ensure_req(&id))).map_err(|e| format!("ensure {id}: {e}"))?.into_inner();
        let (code, fd) = try_tap_fd(&s2, &r.interfaces[0].name, &id)?;
        if code != "0" || fd.is_none() {
            return Err(format!("fd for {id}: errCode {code}"));
        }
        rt.block_on(c.release_network(release_req(&id))).map_err(|e| format!("release {id}: {e}"))?;
        Ok(())
    });
    // fd requests for a sandbox that stays Active.
    let (s3, t3) = (sock.clone(), stable_tap.clone());
    let fds = spawn_loop(stop.clone(), move |_| {
        let (code, fd) = try_tap_fd(&s3, &t3, "sb-stable")?;
        if code != "0" || fd.as_ref().map(attached).as_deref() != Some(t3.as_str()) {
            return Err(format!("fd for sb-stable: errCode {code}"));
        }
        std::thread::sleep(Duration::from_millis(2));
        Ok(())
    });
    // A new gRPC connection per call (GetNetwork).
    let e4 = ep.clone();
    let fresh = spawn_loop(stop.clone(), move |_| {
        rt().block_on(async {
            let mut c = network_agent::client::connect(&e4).await.map_err(|e| format!("connect: {e:#}"))?;
            let g = c
                .get_network(pb::GetNetworkRequest { sandbox_id: "sb-stable".into(), ..Default::default() })
                .await
                .map_err(|e| format!("get: {e}"))?;
            if g.into_inner().interfaces.first().map(|i| i.name.as_str()) != Some(stable_tap.as_str()) {
                return Err("GetNetwork answered another TAP".to_string());
            }
            Ok(())
        })
    });

    // grpcio (Python) with default channel options on one channel: Ensure/Get/Release.
    let stop_file = a.dir.join("py-stop");
    // Killed on drop should the test fail before it is told to stop.
    let mut py = ChildGuard::from_child(grpcio_loop(&a, &stop_file));

    std::thread::sleep(Duration::from_millis(700));
    let t_up = Instant::now();
    let took = upgrade(&mut a);
    let t_done = Instant::now();
    std::thread::sleep(Duration::from_millis(700));
    stop.store(true, Ordering::Relaxed);
    std::fs::write(&stop_file, b"").unwrap();
    let (mut so, mut se) = (String::new(), String::new());
    py.child().stdout.take().unwrap().read_to_string(&mut so).unwrap();
    py.child().stderr.take().unwrap().read_to_string(&mut se).unwrap();
    let st = py.child().wait().unwrap();
    eprintln!("grpcio: {}", so.trim());
    assert!(st.success() && so.contains("FAILED 0"), "{so}\n{se}");
    for (name, h) in [("ensure/fd/release", cycle), ("fd requests", fds), ("new connections", fresh)] {
        let l = h.join().unwrap();
        let during = l.done_at.iter().filter(|t| **t > t_up && **t < t_done).count();
        let after = l.done_at.iter().filter(|t| **t > t_done).count();
        eprintln!(
            "{name}: {} ok, {} failed, {during} during the hand-over ({took:?}), {after} after",
            l.ok,
            l.failed.len()
        );
        assert!(l.failed.is_empty(), "{name}: {:?}\n{}", l.failed, a.log());
        assert!(during > 0 && after > 0, "{name}: {during} during, {after} after");
    }
    let forwarded = a.log().matches("forwarded to the successor agent").count();
    eprintln!("calls the old agent forwarded to the successor: {forwarded}");
    release(&a, "sb-stable");
    let left: Vec<_> = std::fs::read_dir(a.state_dir()).unwrap().flatten().collect();
    assert!(left.is_empty(), "state left: {left:?}");
}

/// Starts a grpcio client (default channel options, one channel) that cycles Ensure → Get →
/// Release until `stop` exists, then prints `OK n FAILED m` and each failure.
fn grpcio_loop(a: &AgentUnderTest, stop: &Path) -> std::process::Child {
    let (py, pydir) = agent_stubs(&a.dir);
    let script = r#"
import os, sys, grpc
sys.path.insert(0, sys.argv[1])
import network_agent_pb2 as pb, network_agent_pb2_grpc as rpc
s = rpc.NetworkAgentStub(grpc.insecure_channel(sys.argv[2]))
ok, failed, i = 0, [], 0
while not os.path.exists(sys.argv[3]):
    sid = "py-%d" % i
    i += 1
    try:
        r = s.EnsureNetwork(pb.EnsureNetworkRequest(sandbox_id=sid,
            cubevs_context=pb.CubeVSContext(allow_internet_access=True)))
        assert r.sandbox_id == sid
        assert s.GetNetwork(pb.GetNetworkRequest(sandbox_id=sid)).interfaces == r.interfaces
        assert s.ReleaseNetwork(pb.ReleaseNetworkRequest(sandbox_id=sid)).released
        ok += 1
    except Exception as e:
        failed.append("%s: %r" % (sid, e))
print("OK", ok, "FAILED", len(failed))
for f in failed:
    print(f)
"#;
    std::process::Command::new(&py)
        .arg("-c")
        .arg(script)
        .arg(&pydir)
        .arg(a.grpc_endpoint())
        .arg(stop)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Connects to `sock` as uid/gid 65534 and sends `BEGIN 1`; prints what happened.
fn as_nobody(sock: &Path) -> String {
    const SCRIPT: &str = "import socket, sys\n\
s = socket.socket(socket.AF_UNIX)\n\
try:\n    s.connect(sys.argv[1])\n\
except OSError as e:\n    print('connect-errno', e.errno); sys.exit(0)\n\
try:\n    s.sendall(b'BEGIN 1\\n'); s.settimeout(10); print('received', len(s.recv(4096)))\n\
except OSError as e:\n    print('closed', e.errno)\n";
    let out = std::process::Command::new("/usr/bin/python3")
        .args(["-c", SCRIPT])
        .arg(sock)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("python3 as nobody");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn serves(a: &AgentUnderTest, id: &str) {
    let r = ensure(a, id);
    let (code, fd) = try_tap_fd(&a.tap_socket(), &r.interfaces[0].name, id).unwrap();
    assert_eq!(code, "0", "{}", a.log());
    assert_eq!(attached(&fd.unwrap()), r.interfaces[0].name);
    release(a, id);
}

#[test]
fn handover_socket_refuses_strangers_bad_versions_and_failed_successors() {
    if !require_root("handover_socket_refuses_strangers_bad_versions_and_failed_successors") {
        return;
    }
    let mut a = AgentUnderTest::prepare("ho-attack", 2, "");
    start(&mut a);
    let sock = handover_socket(&a);
    let held = ensure(&a, "sb-held");
    let held_tap = held.interfaces[0].name.clone();
    let md = std::fs::metadata(&sock).unwrap();
    assert_eq!(md.mode() & 0o777, 0o600, "hand-over socket mode");
    assert_eq!(md.uid(), nix::unistd::geteuid().as_raw());

    // Another uid: refused by the mode, and with the mode widened, by SO_PEERCRED.
    assert_eq!(as_nobody(&sock), format!("connect-errno {}", libc::EACCES));
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let got = as_nobody(&sock);
    assert!(got == "received 0" || got.starts_with("closed "), "a stranger must get nothing: {got}");
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600)).unwrap();
    let log = a.log();
    assert!(log.contains("hand-over request from another user refused"), "{log}");
    serves(&a, "sb-a");

    // A bad protocol version is refused with a reason; nothing changes.
    let s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    (&s).write_all(b"BEGIN 99\n").unwrap();
    let line = handover::read_line(&s).unwrap();
    assert!(line.starts_with("REFUSE "), "{line}");
    drop(s);
    serves(&a, "sb-b");

    // A hand-over aborted after the offer: mutations wait meanwhile (reads and fd requests
    // are answered), then the old agent keeps serving and runs the queued Ensure itself.
    let s = handover::connect(&sock).unwrap().expect("agent listening");
    handover::begin(&s).unwrap();
    let (m, fds) = handover::recv_offer(&s).unwrap();
    assert_eq!(fds.len(), m.fd_count());
    assert_eq!(m.listeners.len(), 3);
    let t = m.taps.iter().find(|t| t.name == held_tap).expect("Active TAP in the manifest");
    assert_eq!((t.state.as_str(), t.owner.as_deref(), t.has_fd), ("Active", Some("sb-held"), true));
    let ep = a.grpc_endpoint();
    let queued = std::thread::spawn(move || {
        rt().block_on(async {
            let mut c = network_agent::client::connect(&ep).await.unwrap();
            c.ensure_network(ensure_req("sb-queued")).await.map(|r| r.into_inner())
        })
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(!queued.is_finished(), "an Ensure ran while the hand-over held the gate");
    let (code, _) = try_tap_fd(&a.tap_socket(), &held_tap, "sb-held").unwrap();
    assert_eq!(code, "0", "fd requests are answered during a hand-over");
    (&s).write_all(b"NOT-READY\n").unwrap();
    let line = handover::read_line(&s).unwrap();
    assert!(line.starts_with("ABORT "), "{line}");
    drop((s, fds));
    let r = queued.join().unwrap().expect("queued Ensure after the abort");
    assert_eq!(r.sandbox_id, "sb-queued");
    release(&a, "sb-queued");
    serves(&a, "sb-c");

    // A real successor whose configuration does not fit the handed-over sockets exits; the old
    // agent keeps serving.
    let other = a.dir.join("cube/other-tap.sock");
    let mut bad = spawn_agent(&a, &format!("--tap-fd-listen {}", other.display()));
    let st = wait_exit(&mut bad, Duration::from_secs(60), || a.log());
    assert!(!st.success());
    let log = a.log();
    assert!(log.contains("handed-over tap_fd_listen socket is bound to"), "{log}");
    assert!(log.contains("hand-over aborted, this agent keeps serving"), "{log}");
    assert!(a.child.as_mut().unwrap().child().try_wait().unwrap().is_none(), "old agent exited");
    serves(&a, "sb-d");
    let (code, _) = try_tap_fd(&a.tap_socket(), &held_tap, "sb-held").unwrap();
    assert_eq!(code, "0");
    // An agent started without the hand-over socket (e.g. an old start command) must not take
    // the sockets away from the running agent: it stops before recovery touches anything.
    let mut cmd = a.script_command();
    cmd.env("NETWORK_AGENT_ARGS", "--health-listen 127.0.0.1:19091");
    let mut second = ChildGuard::from_child(cmd.spawn().unwrap());
    let st = wait_exit(&mut second, Duration::from_secs(60), || a.log());
    assert!(!st.success());
    let log = a.log();
    assert!(log.contains("is served by a running process"), "{log}");
    assert!(a.child.as_mut().unwrap().child().try_wait().unwrap().is_none(), "old agent exited");
    serves(&a, "sb-d2");
    // And a proper hand-over still works afterwards.
    upgrade(&mut a);
    serves(&a, "sb-e");
    release(&a, "sb-held");
}

#[test]
fn crash_restart_answers_minus_one_for_a_held_tap() {
    if !require_root("crash_restart_answers_minus_one_for_a_held_tap") {
        return;
    }
    let mut a = AgentUnderTest::prepare("ho-crash", 2, "");
    start(&mut a);
    let held = ensure(&a, "sb-held");
    let idle = ensure(&a, "sb-idle");
    let (c, fd) = tap_fd(&a.tap_socket(), &held.interfaces[0].name, "sb-held");
    assert_eq!(c["errCode"], "0");
    let guest = TapGuest::new(fd.unwrap(), VNET_HDR_LEN);
    guest.drain();
    let arp_ok = |g: &TapGuest| {
        g.arp(GATEWAY_IP, Duration::from_secs(2))
            == Some(packet::arp_reply(GATEWAY_MAC, GATEWAY_IP, GUEST_MAC, GUEST_IP))
    };
    assert!(arp_ok(&guest));

    let st = a.kill(nix::sys::signal::Signal::SIGKILL);
    assert!(!st.success());
    assert!(handover_socket(&a).exists(), "kill -9 leaves the socket file");
    a.child = Some(spawn_agent(&a, ""));
    a.wait_ready(Duration::from_secs(30));
    let log = a.log();
    assert!(log.contains("no running agent to take over from: fresh start"), "{log}");
    // Documented: the TAP a VMM holds cannot be reopened, so its fd request answers -1...
    let (code, fd) = try_tap_fd(&a.tap_socket(), &held.interfaces[0].name, "sb-held").unwrap();
    assert_eq!(code, "-1");
    assert!(fd.is_none());
    // ...while the guest keeps its network, and a TAP nobody holds is opened and answered.
    assert!(arp_ok(&guest));
    let (code, fd) = try_tap_fd(&a.tap_socket(), &idle.interfaces[0].name, "sb-idle").unwrap();
    assert_eq!(code, "0");
    assert_eq!(attached(&fd.unwrap()), idle.interfaces[0].name);
    drop(guest);
    release(&a, "sb-held");
    release(&a, "sb-idle");
    // The restarted agent serves the next hand-over.
    agent_upgrade::wait_handover_listening(&a, 2).unwrap();
    upgrade(&mut a);
}

/// Open fds of process `pid` that are TAP queues (`/dev/net/tun`) or sockets.
fn tun_and_socket_fds(pid: u32) -> (usize, usize) {
    let mut tun = 0;
    let mut sock = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let Ok(l) = std::fs::read_link(e.path()) else { continue };
        let l = l.to_string_lossy();
        if l == "/dev/net/tun" {
            tun += 1;
        } else if l.starts_with("socket:") {
            sock += 1;
        }
    }
    (tun, sock)
}

#[test]
fn after_handover_wait_holds_nothing_until_sigterm() {
    if !require_root("after_handover_wait_holds_nothing_until_sigterm") {
        return;
    }
    let mut a = AgentUnderTest::prepare("ho-wait", 2, "after_handover = \"wait\"\n");
    start(&mut a);
    let r = ensure(&a, "sb-held");
    let tap = r.interfaces[0].name.clone();
    let (c, fd) = tap_fd(&a.tap_socket(), &tap, "sb-held");
    assert_eq!(c["errCode"], "0");
    let guest = TapGuest::new(fd.unwrap(), VNET_HDR_LEN);
    let mut old = a.child.take().unwrap();
    // The Ensure's maintenance pass refills the pool in the background (after the TAPs'
    // warm-up filters move to tcx, F5): two Ready TAPs and the Active one.
    // One sample decides (a second read raced a queue fd the refill held only for a moment
    // and failed in CI with 2).
    let pid = old.id();
    let mut tun_before = 0;
    wait_until("the pool refilled", Duration::from_secs(30), || {
        tun_before = tun_and_socket_fds(pid).0;
        tun_before >= 3
    });
    assert!(tun_before >= 3, "the agent holds its pool's queues: {tun_before}");
    a.child = Some(spawn_agent(&a, ""));
    wait_until("old agent idle", Duration::from_secs(60), || a.log().contains("idle until SIGTERM/SIGINT"));
    a.wait_ready(Duration::from_secs(30));
    assert!(old.child().try_wait().unwrap().is_none(), "old agent must wait for SIGTERM");
    let (tun, _) = tun_and_socket_fds(old.id());
    assert_eq!(tun, 0, "an idle old agent must hold no TAP queue");
    // It no longer makes a held TAP look held twice: the successor answers for it, and a
    // Release + VMM exit lets the TAP go Ready (the reopen is refused while anyone holds it).
    let (code, _) = try_tap_fd(&a.tap_socket(), &tap, "sb-held").unwrap();
    assert_eq!(code, "0");
    release(&a, "sb-held");
    drop(guest);
    wait_until("released TAP back to Ready", Duration::from_secs(15), || {
        let j = a.http_json("/v1/network/taps");
        j["taps"].as_array().unwrap().iter().any(|t| t["tapName"] == tap.as_str() && t["state"] == "Ready")
    });
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(old.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let st = wait_exit(&mut old, Duration::from_secs(10), || a.log());
    assert!(st.success(), "{st}");
    // Its exit removed none of the successor's sockets.
    assert!(a.tap_socket().exists() && handover_socket(&a).exists());
    serves(&a, "sb-after");
}

#[test]
fn sigterm_during_a_handover_leaves_the_sockets_to_the_successor() {
    if !require_root("sigterm_during_a_handover_leaves_the_sockets_to_the_successor") {
        return;
    }
    let mut a = AgentUnderTest::prepare("ho-term", 1, "");
    start(&mut a);
    // A successor that has the offer (and so the listening sockets) when the old agent is
    // told to stop: the files must stay, or the successor would serve unreachable sockets.
    let s = handover::connect(&handover_socket(&a)).unwrap().expect("agent listening");
    handover::begin(&s).unwrap();
    let (_m, fds) = handover::recv_offer(&s).unwrap();
    let mut old = a.child.take().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(old.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    wait_until("old agent stopping", Duration::from_secs(10), || a.log().contains("SIGTERM"));
    drop(s);
    let st = wait_exit(&mut old, Duration::from_secs(60), || a.log());
    assert!(st.success(), "{st}");
    let log = a.log();
    assert!(log.contains("the socket files are left to the successor"), "{log}");
    assert!(a.tap_socket().exists(), "tap_fd_listen removed during a hand-over");
    assert!(a.dir.join("cube/grpc.sock").exists(), "grpc_listen removed during a hand-over");
    drop(fds);
}

/// A stand-in for the CubeEgress admin API on the dataplane (node) namespace's 127.0.0.1:9091
/// (the agent's default `cube_egress_admin_url`, reached from there: decision L9): keeps what is PUT, records every DELETE, and
/// reports `policy_count` = held + `inflate` (a count the agents cannot explain makes them
/// run a full sync, which deletes every address they do not know).
struct FakeGateway {
    held: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
    deleted: Arc<std::sync::Mutex<Vec<String>>>,
    inflate: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeGateway {
    fn start(ns: &TestNetns) -> Self {
        let l = ns.run(|| TcpListener::bind("127.0.0.1:9091").expect("bind 127.0.0.1:9091 in the node netns"));
        l.set_nonblocking(true).unwrap();
        let held: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>> = Arc::default();
        let deleted: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
        let (inflate, stop) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let (h, d, i, s) = (held.clone(), deleted.clone(), inflate.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Ok((c, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                Self::answer(c, &h, &d, &i);
            }
        });
        Self { held, deleted, inflate, stop, thread: Some(thread) }
    }

    fn answer(
        mut c: TcpStream,
        held: &std::sync::Mutex<std::collections::BTreeSet<String>>,
        deleted: &std::sync::Mutex<Vec<String>>,
        inflate: &AtomicUsize,
    ) {
        c.set_nonblocking(false).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let (head_len, body_len) = loop {
            let Ok(n) = c.read(&mut chunk) else { return };
            if n == 0 {
                return;
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..p]).to_ascii_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:").and_then(|v| v.trim().parse::<usize>().ok()))
                    .unwrap_or(0);
                break (p + 4, len);
            }
        };
        while buf.len() < head_len + body_len {
            let Ok(n) = c.read(&mut chunk) else { return };
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let head = String::from_utf8_lossy(&buf[..head_len]).to_string();
        let mut first = head.lines().next().unwrap_or_default().split_whitespace();
        let (method, path) = (first.next().unwrap_or_default(), first.next().unwrap_or_default());
        let body = match (method, path) {
            ("GET", "/admin/v1/health") => {
                let n = held.lock().unwrap().len() + inflate.load(Ordering::Relaxed);
                format!(r#"{{"status":"ok","policy_count":{n}}}"#)
            }
            ("GET", "/admin/v1/policies") => {
                let m: serde_json::Map<String, serde_json::Value> =
                    held.lock().unwrap().iter().map(|ip| (ip.clone(), serde_json::json!({}))).collect();
                serde_json::Value::Object(m).to_string()
            }
            ("PUT", p) if p.starts_with("/admin/v1/policies/") => {
                held.lock().unwrap().insert(p["/admin/v1/policies/".len()..].to_string());
                "{}".into()
            }
            ("DELETE", p) if p.starts_with("/admin/v1/policies/") => {
                let ip = p["/admin/v1/policies/".len()..].to_string();
                held.lock().unwrap().remove(&ip);
                deleted.lock().unwrap().push(ip);
                "{}".into()
            }
            _ => "{}".into(),
        };
        let _ = write!(
            c,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
    }
}

impl Drop for FakeGateway {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn the_old_agent_never_pushes_to_cube_egress_after_the_handover() {
    if !require_root("the_old_agent_never_pushes_to_cube_egress_after_the_handover") {
        return;
    }
    // `wait`: the old agent stays alive, so a push loop it kept would have all the time it needs.
    let mut a = AgentUnderTest::prepare("ho-egress", 2, "after_handover = \"wait\"\n");
    let gw = FakeGateway::start(&a.topo.node);
    start(&mut a);
    let mut old = agent_upgrade::hand_over(&mut a).unwrap_or_else(|e| panic!("{e}:\n{}", a.log()));
    wait_until("old agent idle", Duration::from_secs(30), || a.log().contains("idle until SIGTERM/SIGINT"));
    // A sandbox with L7 rules exists only in the successor.
    let rule = pb::EgressRule {
        id: "inject".into(),
        r#match: Some(pb::EgressMatch {
            host: Some("api.example.com".into()),
            path: Some("/v1/*".into()),
            ..Default::default()
        }),
        action: Some(pb::EgressAction {
            allow: true,
            audit: Some("metadata".into()),
            inject: vec![pb::EgressInject {
                header: "Authorization".into(),
                secret: "s3cr3t-value".into(),
                format: Some("Bearer ${SECRET}".into()),
            }],
            inject_plain_http: false,
        }),
    };
    let r = rt().block_on(async {
        client(&a)
            .await
            .ensure_network(pb::EnsureNetworkRequest {
                sandbox_id: "sb-l7".into(),
                cubevs_context: Some(pb::CubeVsContext {
                    allow_internet_access: Some(true),
                    allow_fqdn: vec![pb::FqdnAllow { name: "*.example.com".into(), ports: vec![443] }],
                    rules: vec![rule],
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .expect("ensure with L7 rules")
            .into_inner()
    });
    let ip = r.persist_metadata["sandbox_ip"].clone();
    wait_until("the successor's PUT", Duration::from_secs(10), || gw.held.lock().unwrap().contains(&ip));
    // The CubeEgress bootstrap listener in the node namespace is not handed over but re-bound
    // (decision L10): with the old agent still alive, it is the successor's (only it has sb-l7).
    let (code, dump) = a
        .topo
        .node
        .run(|| cubenet_tests::agent::http_get("127.0.0.1:19091", "/v1/policies/dump"))
        .expect("the successor's egress_dump_listen in the node namespace");
    assert_eq!(code, 200, "{dump}");
    assert!(dump.contains(&format!("\"{ip}\"")), "the successor serves the dump: {dump}");
    // A policy_count nobody can explain: every live push loop runs a full sync now. The
    // successor's keeps sb-l7's policy; the old agent's (which never saw sb-l7) would delete it.
    gw.inflate.store(5, Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(3));
    let deleted = gw.deleted.lock().unwrap().clone();
    assert!(!deleted.contains(&ip), "a stale full sync deleted the successor's policy: {deleted:?}\n{}", a.log());
    assert!(gw.held.lock().unwrap().contains(&ip));
    assert!(old.child().try_wait().unwrap().is_none(), "the old agent must still be waiting");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(old.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(wait_exit(&mut old, Duration::from_secs(10), || a.log()).success());
    release(&a, "sb-l7");
    wait_until("the successor's DELETE", Duration::from_secs(10), || gw.deleted.lock().unwrap().contains(&ip));
}
