//! Storms against the network-agent (issue 14): 10,000 malformed gRPC requests and 10,000
//! malformed fd-socket requests (random bytes, gRPC frames with random bodies for every
//! method and unknown ones, lying length prefixes, oversized messages, the compressed flag
//! without an encoding, half-open connections, JSON of the wrong shape), with a valid
//! Ensure → TAP fd → Release cycle after every 100 bad requests. Asserts: the agent never
//! dies, every valid cycle succeeds, and its fd count and RSS come back to baseline
//! (tolerances: [`FD_TOLERANCE`], [`RSS_TOLERANCE_KIB`]).
//!
//! Prints one `RELIABILITY {json}` line per storm (read by `cargo xtask reliability`).

use std::{
    io::Write,
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use bytes::Bytes;
use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, request_tap_fd, tap_fd},
    fuzz::rng::Rng,
    require_root,
};
use http_body_util::{BodyExt, Full};

/// Extra fds the agent may hold after the storm (a lazily opened log or metrics handle, the
/// tokio runtime's blocking-pool eventfds): anything above means a leaked connection or TAP.
const FD_TOLERANCE: usize = 8;
/// Extra RSS the agent may keep after the storm: the allocator keeps freed arenas (the
/// oversized requests allocate ~5 MiB each, per worker thread); a leak of the 10,000 requests
/// would exceed it.
const RSS_TOLERANCE_KIB: u64 = 32 * 1024;
/// Bad requests per storm.
const STORM: usize = 10_000;
/// A valid cycle after this many bad requests.
const VALID_EVERY: usize = 100;

const METHODS: [&str; 7] = [
    "/network_agent.api.v1.NetworkAgent/EnsureNetwork",
    "/network_agent.api.v1.NetworkAgent/ReleaseNetwork",
    "/network_agent.api.v1.NetworkAgent/ReconcileNetwork",
    "/network_agent.api.v1.NetworkAgent/GetNetwork",
    "/network_agent.api.v1.NetworkAgent/ListNetworks",
    "/grpc.health.v1.Health/Check",
    "/network_agent.api.v1.NetworkAgent/NoSuchMethod",
];

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn alive(pid: u32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None).is_ok()
}

/// One valid Ensure → fd → Release cycle; panics (with the agent log) on any failure.
fn valid_cycle(rt: &tokio::runtime::Runtime, a: &AgentUnderTest, id: &str) {
    let mut c = rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).expect("connect");
    let r = rt
        .block_on(c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: id.into(), ..Default::default() }))
        .unwrap_or_else(|e| panic!("valid Ensure {id} failed during the storm: {e:?}\n{}", a.log()))
        .into_inner();
    let name = &r.interfaces[0].name;
    // The right TAP and sandbox, but not the upstream request object (issue 10 item 21):
    // a JSON array around it, or an extra wrapper, must get an error and no fd.
    for bad in [
        serde_json::json!([{"name": name, "sandboxId": id}]),
        serde_json::json!({"request": {"name": name, "sandboxId": id}}),
    ] {
        let s = UnixStream::connect(a.tap_socket()).expect("connect fd socket");
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        (&s).write_all(bad.to_string().as_bytes()).unwrap();
        assert_eq!(recv_reply(&s), Some(false), "fd handed out for {bad}");
    }
    let (reply, fd) = tap_fd(&a.tap_socket(), name, id);
    assert_eq!(reply["errCode"], "0", "valid fd request {id}: {reply}");
    assert!(fd.is_some());
    drop(fd);
    let rel = rt
        .block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: id.into(), ..Default::default() }))
        .unwrap_or_else(|e| panic!("valid Release {id}: {e:?}"))
        .into_inner();
    assert!(rel.released, "{id}");
}

/// An HTTP/2 connection to the gRPC socket for raw requests.
async fn h2(sock: &Path) -> Option<hyper::client::conn::http2::SendRequest<Full<Bytes>>> {
    let io = hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(sock).await.ok()?);
    let (send, conn) = hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io).await.ok()?;
    tokio::spawn(conn);
    Some(send)
}

/// A gRPC message with a chosen flag and length prefix (possibly lying) and body.
fn grpc_frame(rng: &mut Rng) -> Vec<u8> {
    let body_len = match rng.below(10) {
        0..=6 => rng.below(64),
        7 | 8 => rng.below(4096),
        _ => 0,
    };
    let body = rng.bytes(body_len);
    let compressed = u8::from(rng.chance(5));
    let len = match rng.below(10) {
        0 => u32::MAX,
        1 => body_len as u32 + 1 + rng.below(100) as u32,
        2 => body_len.saturating_sub(1) as u32,
        _ => body_len as u32,
    };
    let mut f = vec![compressed];
    f.extend_from_slice(&len.to_be_bytes());
    f.extend(body);
    if rng.chance(5) {
        f.truncate(rng.below(f.len()));
    }
    f
}

async fn raw_grpc(
    send: &mut hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    path: &str,
    body: Vec<u8>,
    content_type: &str,
) -> Result<(), String> {
    let req = hyper::Request::post(format!("http://agent.invalid{path}"))
        .header("content-type", content_type)
        .header("te", "trailers")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    // Drain the body and trailers; the status does not matter, an answer does.
    let _ = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect()).await;
    Ok(())
}

#[derive(serde::Serialize, Default)]
struct Report {
    case: String,
    inputs: u64,
    violations: std::collections::BTreeMap<String, u64>,
    secs: f64,
    valid_cycles: u64,
    fds_before: usize,
    fds_after: usize,
    rss_kib_before: u64,
    rss_kib_after: u64,
}

fn settle(pid: u32, fds_before: usize) -> (usize, u64) {
    let t = Instant::now();
    while fds(pid) > fds_before + FD_TOLERANCE && t.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(200));
    }
    (fds(pid), rss_kib(pid))
}

fn finish(mut r: Report, pid: u32, start: Instant) {
    let (f, rss) = settle(pid, r.fds_before);
    r.fds_after = f;
    r.rss_kib_after = rss;
    r.secs = start.elapsed().as_secs_f64();
    if !alive(pid) {
        *r.violations.entry("agent-died".into()).or_default() += 1;
    }
    if r.fds_after > r.fds_before + FD_TOLERANCE {
        *r.violations.entry("fd-growth".into()).or_default() += 1;
    }
    if r.rss_kib_after > r.rss_kib_before + RSS_TOLERANCE_KIB {
        *r.violations.entry("rss-growth".into()).or_default() += 1;
    }
    println!("RELIABILITY {}", serde_json::to_string(&r).expect("json"));
    assert!(
        r.violations.is_empty(),
        "{}: {:?} (fds {} → {}, RSS {} → {} KiB)",
        r.case,
        r.violations,
        r.fds_before,
        r.fds_after,
        r.rss_kib_before,
        r.rss_kib_after
    );
}

/// Reads the agent's answer with room for one SCM_RIGHTS fd: `None` on timeout/error,
/// `Some(true)` when an fd came (it is closed at once).
fn recv_reply(s: &UnixStream) -> Option<bool> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut buf = [0u8; 256];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC).ok()?;
    let mut got = false;
    for c in msg.cmsgs().ok()? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            for f in fds {
                // SAFETY: the kernel installed this fd in our table for us (SCM_RIGHTS).
                drop(unsafe { OwnedFd::from_raw_fd(f) });
                got = true;
            }
        }
    }
    Some(got)
}

fn start_agent(tag: &str) -> (AgentUnderTest, u32, tokio::runtime::Runtime) {
    let mut a = AgentUnderTest::prepare(tag, 4, "");
    a.start();
    let pid = a.child.as_ref().expect("agent child").id();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Warm up (first connections, lazily allocated pools) before the baseline.
    for k in 0..5 {
        valid_cycle(&rt, &a, &format!("warm-{k}"));
    }
    (a, pid, rt)
}

#[test]
fn storm_grpc_malformed_requests() {
    if !require_root("reliability_storm storm_grpc_malformed_requests") {
        return;
    }
    let (a, pid, rt) = start_agent("stormgrpc");
    let sock: PathBuf = a.dir.join("cube/grpc.sock");
    let mut r =
        Report { case: "storm-grpc".into(), fds_before: fds(pid), rss_kib_before: rss_kib(pid), ..Default::default() };
    let start = Instant::now();
    let mut rng = Rng::new(std::env::var("CUBENET_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(14));
    let mut half_open = Vec::new();
    let mut send = rt.block_on(h2(&sock)).expect("h2 connect");
    for i in 0..STORM {
        match rng.below(100) {
            // Random bytes (sometimes after the HTTP/2 preface) on a fresh connection.
            0..=29 => {
                if let Ok(mut s) = UnixStream::connect(&sock) {
                    let mut b = if rng.chance(50) { b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec() } else { Vec::new() };
                    let n = rng.below(2048);
                    b.extend(rng.bytes(n));
                    let _ = s.write_all(&b);
                }
            }
            // Half-open: a partial preface, held until the end of the storm (at most 200).
            30..=31 => {
                if half_open.len() < 200
                    && let Ok(mut s) = UnixStream::connect(&sock)
                {
                    let _ = s.write_all(&b"PRI * HTTP/2.0\r\n"[..rng.below(16)]);
                    half_open.push(s);
                }
            }
            // Oversized: a 5 MiB message (above the 4 MiB default limit).
            32 if i % 7 == 0 => {
                let mut f = vec![0u8];
                f.extend_from_slice(&(5u32 << 20).to_be_bytes());
                f.extend(std::iter::repeat_n(0x0a, 5 << 20));
                let path = *rng.pick(&METHODS);
                if rt.block_on(raw_grpc(&mut send, path, f, "application/grpc")).is_err() {
                    send = rt.block_on(h2(&sock)).expect("h2 reconnect");
                }
            }
            // gRPC frames with random (wrong-typed) bodies, lying lengths, other content types.
            _ => {
                let path = *rng.pick(&METHODS);
                let ct = *rng.pick(&["application/grpc", "application/grpc", "application/grpc+proto", "text/plain"]);
                let f = grpc_frame(&mut rng);
                if rt.block_on(raw_grpc(&mut send, path, f, ct)).is_err() {
                    send = rt.block_on(h2(&sock)).expect("h2 reconnect");
                }
            }
        }
        r.inputs += 1;
        if (i + 1) % VALID_EVERY == 0 {
            assert!(alive(pid), "agent died after {} bad requests\n{}", i + 1, a.log());
            valid_cycle(&rt, &a, &format!("valid-{i}"));
            r.valid_cycles += 1;
        }
    }
    drop(half_open);
    drop(send);
    valid_cycle(&rt, &a, "after-storm");
    finish(r, pid, start);
}

#[test]
fn storm_fd_socket_malformed_requests() {
    if !require_root("reliability_storm storm_fd_socket_malformed_requests") {
        return;
    }
    let (a, pid, rt) = start_agent("stormfd");
    let sock = a.tap_socket();
    let mut r = Report {
        case: "storm-fd-socket".into(),
        fds_before: fds(pid),
        rss_kib_before: rss_kib(pid),
        ..Default::default()
    };
    let start = Instant::now();
    let mut rng = Rng::new(std::env::var("CUBENET_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(14));
    let mut half_open = Vec::new();
    for i in 0..STORM {
        let req: Vec<u8> = match rng.below(10) {
            // (7, half-open, yields an empty request: nothing is sent on that connection.)
            0 => {
                let n = rng.below(512);
                rng.bytes(n)
            }
            1 => b"[]".to_vec(),
            2 => br#"{"name":"","sandboxId":""}"#.to_vec(),
            3 => br#"{"name":5,"sandboxId":["x"]}"#.to_vec(),
            4 => format!(r#"{{"name":"z192.168.0.{}","sandboxId":"nobody"}}"#, rng.below(256)).into_bytes(),
            5 => format!(r#"{{"name":"{}","sandboxId":"x"}}"#, "z".repeat(rng.below(70_000))).into_bytes(),
            6 => b"{\"name\":\"z192.168.0.2\"".to_vec(),
            7 => {
                // Half-open: nothing sent, held until the end (at most 200).
                if half_open.len() < 200
                    && let Ok(s) = UnixStream::connect(&sock)
                {
                    half_open.push(s);
                }
                Vec::new()
            }
            8 => br#"{"name":"z192.168.0.2","sandboxId":"x","extra":{"deep":[[[[[[[[1]]]]]]]]}}"#.to_vec(),
            _ => b"null".to_vec(),
        };
        if !req.is_empty()
            && let Ok(mut s) = UnixStream::connect(&sock)
        {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s.write_all(&req);
            // EOF after the request, as a client that gave up: the agent must answer or close.
            let _ = s.shutdown(std::net::Shutdown::Write);
            match recv_reply(&s) {
                None => *r.violations.entry("no-answer-after-eof".into()).or_default() += 1,
                // None of these requests names a TAP its sandbox owns: no fd may come.
                Some(true) => *r.violations.entry("fd-for-bad-request".into()).or_default() += 1,
                Some(false) => {}
            }
        }
        r.inputs += 1;
        if (i + 1) % VALID_EVERY == 0 {
            assert!(alive(pid), "agent died after {} bad requests\n{}", i + 1, a.log());
            valid_cycle(&rt, &a, &format!("valid-{i}"));
            r.valid_cycles += 1;
            // A well-formed request for a TAP nobody owns still gets its error code.
            let (reply, fd) = request_tap_fd(&sock, br#"{"name":"z192.168.0.250","sandboxId":"nobody"}"#);
            assert_eq!(reply["errCode"], "1002", "{reply}");
            assert!(fd.is_none());
        }
    }
    drop(half_open);
    valid_cycle(&rt, &a, "after-storm");
    finish(r, pid, start);
}
