//! The agent relays CubeEgress's `/metrics` on its own listener, `GET /metrics/cube-egress`
//! (decision O26): the gateway's admin address is the dataplane namespace's loopback, which a
//! cluster Prometheus cannot reach. The agent runs in a namespace of its own and programs the
//! node namespace, the real `cube-egress` runs there (its default admin address, the agent's
//! default `cube_egress_admin_url`), so every fetch crosses namespaces as in the chart's
//! underlay mode (decision L9). The attack (a sandbox reads the relay) is in
//! `attack_node_services.rs`.
//!
//! - `agent_relays_the_gateway_metrics`: the relayed text is the gateway's own and moves with
//!   it (one request through the gateway's listener, then its deny counter is 1 there); with
//!   the gateway stopped the relay answers 503 at once and the agent's `/metrics` is as fast
//!   as ever; a gateway that accepts and never answers costs the push timeout, not more, and
//!   holds no `/metrics` scrape meanwhile; each failure counts by reason.
//! - `oversize_gateway_metrics_are_refused_in_bounded_memory`: a fake admin server streaming
//!   an endless body gets 502 long before the timeout, the agent's peak memory stays flat and
//!   the server gets to send little; a declared oversize length and a 500 are refused too.

use std::{
    io::{Read, Write},
    net::TcpListener,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use cubenet_tests::{
    TmpDir,
    agent::AgentUnderTest,
    egress::{ADMIN, AdminGateway, admin},
    require_root,
};

fn tmpdir(tag: &str) -> TmpDir {
    let d = std::env::temp_dir().join(format!("cubenet-egm-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TmpDir(d)
}

/// `GET path` on the agent's listener: (status, body, how long it took).
fn timed(a: &AgentUnderTest, path: &str) -> (u16, String, Duration) {
    let t = Instant::now();
    let (code, body) = a.http(path).unwrap_or_else(|| panic!("GET {path}: no answer"));
    (code, body, t.elapsed())
}

/// The value of the series `name` (the whole series text, labels included) in `text`.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

fn scrape_errors(a: &AgentUnderTest, reason: &str) -> f64 {
    let (code, m, _) = timed(a, "/metrics");
    assert_eq!(code, 200, "{m}");
    series(&m, &format!("cubenet_egress_scrape_errors_total{{reason=\"{reason}\"}}"))
        .unwrap_or_else(|| panic!("no scrape error series for {reason}:\n{m}"))
}

/// The agent's peak resident memory, kB (`VmHWM`).
fn peak_kb(a: &mut AgentUnderTest) -> u64 {
    let pid = a.child.as_mut().expect("agent running").child().id();
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(st.lines().any(|l| l == "Name:\tnetwork-agent"), "pid {pid} is not the agent:\n{st}");
    st.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .expect("VmHWM")
}

#[test]
fn agent_relays_the_gateway_metrics() {
    if !require_root("agent_relays_the_gateway_metrics") {
        return;
    }
    let tmp = tmpdir("relay");
    let mut a = AgentUnderTest::prepare("egm-relay", 1, "cube_egress_push_timeout_ms = 3000\n");
    a.start();

    // No gateway yet: connection refused in the dataplane namespace, answered at once.
    let (code, body, took) = timed(&a, "/metrics/cube-egress");
    assert_eq!(code, 503, "{body}");
    assert_eq!(body.trim().lines().count(), 1, "one-line reason: {body:?}");
    assert!(body.contains("connect"), "{body}");
    assert!(took < Duration::from_millis(1500), "{took:?}");
    assert_eq!(scrape_errors(&a, "unreachable"), 1.0);

    // The real gateway in the node namespace: its own text, through the agent.
    let gw = AdminGateway::start(&a.topo.node, &tmp.0, "");
    let deny = "cube_egress_requests_total{decision=\"deny\"}";
    let (code, relayed, _) = timed(&a, "/metrics/cube-egress");
    assert_eq!(code, 200, "{relayed}");
    assert_eq!(series(&relayed, deny), Some(0.0), "{relayed}");
    assert!(relayed.contains("# TYPE cube_egress_request_duration_seconds histogram"), "{relayed}");
    assert!(!relayed.contains("cubenet_"), "the agent's own series are not mixed in:\n{relayed}");

    // One request through the gateway's HTTP listener (cube-dev's address): denied, no policy.
    let reply = a.topo.node.run(|| -> std::io::Result<String> {
        let mut s = std::net::TcpStream::connect("192.168.0.1:18080")?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.write_all(b"GET /x HTTP/1.1\r\nHost: api.example.com\r\nConnection: close\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    });
    let reply = reply.expect("the gateway's listener answers");
    assert!(reply.starts_with("HTTP/1.1 403"), "{reply}");
    let (code, relayed, _) = timed(&a, "/metrics/cube-egress");
    assert_eq!(code, 200, "{relayed}");
    assert_eq!(series(&relayed, deny), Some(1.0), "{relayed}");
    let (_, direct) = admin(&a.topo.node, "GET", "/metrics", "");
    assert_eq!(series(&direct, deny), Some(1.0), "the gateway's own /metrics:\n{direct}");

    // Gateway stopped: 503 at once; the agent's own /metrics unaffected.
    gw.stop(&a.topo.node);
    let (code, body, took) = timed(&a, "/metrics/cube-egress");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("connect"), "{body}");
    assert!(took < Duration::from_millis(1500), "{took:?}");
    let (code, m, took) = timed(&a, "/metrics");
    assert_eq!(code, 200);
    assert!(took < Duration::from_millis(1500), "{took:?}");
    assert!(m.contains("cubenet_pool_taps"), "{m}");
    assert_eq!(scrape_errors(&a, "unreachable"), 2.0);

    // A gateway that accepts and never answers (a listener nobody accepts on): the relay ends
    // at the push timeout (3 s) with 503; a /metrics scrape meanwhile does not wait for it.
    let hole = a.topo.node.run(|| TcpListener::bind(ADMIN)).expect("black hole on the admin address");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| tx.send(timed(&a, "/metrics/cube-egress")).unwrap());
        std::thread::sleep(Duration::from_millis(300));
        let (code, _, took) = timed(&a, "/metrics");
        assert_eq!(code, 200);
        assert!(took < Duration::from_millis(1500), "/metrics waited for the relay: {took:?}");
    });
    let (code, body, took) = rx.recv().unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("no answer within 3000 ms"), "{body}");
    assert!(took >= Duration::from_millis(2900) && took < Duration::from_millis(6000), "{took:?}");
    assert_eq!(scrape_errors(&a, "timeout"), 1.0);
    drop(hole);
    assert!(a.log().contains("cube-egress /metrics relay failed"), "{}", a.log());
}

/// What the fake admin server sends: an endless chunked body, a declared 2 GiB one, a 500.
#[derive(Clone, Copy)]
enum Fake {
    Endless,
    Declared,
    Error,
}

/// Serves the next `GET /metrics` on `l` as `mode` (the agent's health polls get a 404);
/// counts the body bytes written into `sent`.
fn serve_one(l: &TcpListener, mode: Fake, sent: &AtomicU64) {
    let mut s = loop {
        let (mut s, _) = l.accept().unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && s.read(&mut b).unwrap_or(0) == 1 {
            head.push(b[0]);
        }
        if head.starts_with(b"GET /metrics ") {
            break s;
        }
        let _ = s.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    };
    let chunk = "cube_egress_fake_total 1\n".repeat(2621); // ~64 KiB
    match mode {
        Fake::Endless => {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n");
            // Up to 4 GiB, until the agent hangs up.
            for _ in 0..65_536 {
                if s.write_all(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes()).is_err() {
                    return;
                }
                sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
        }
        Fake::Declared => {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2147483648\r\n\r\n");
            let _ = s.write_all(chunk.as_bytes());
            std::thread::sleep(Duration::from_millis(200));
        }
        Fake::Error => {
            let _ = s.write_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops");
        }
    }
}

#[test]
fn oversize_gateway_metrics_are_refused_in_bounded_memory() {
    if !require_root("oversize_gateway_metrics_are_refused_in_bounded_memory") {
        return;
    }
    // A long timeout: a refusal has to come from the size bound, not the clock.
    let mut a = AgentUnderTest::prepare("egm-big", 1, "cube_egress_push_timeout_ms = 10000\n");
    a.start();
    let l = a.topo.node.run(|| TcpListener::bind(ADMIN)).expect("fake admin address");
    let sent = Arc::new(AtomicU64::new(0));
    let server = {
        let sent = sent.clone();
        std::thread::spawn(move || {
            for mode in [Fake::Endless, Fake::Declared, Fake::Error] {
                serve_one(&l, mode, &sent);
            }
        })
    };
    let before = peak_kb(&mut a);
    let (code, body, took) = timed(&a, "/metrics/cube-egress");
    let after = peak_kb(&mut a);
    let sent_mib = sent.load(Ordering::Relaxed) >> 20;
    eprintln!("endless body: {code} after {took:?}; server wrote {sent_mib} MiB; agent peak {before} -> {after} kB");
    assert_eq!(code, 502, "{}", &body[..body.len().min(300)]);
    assert_eq!(body.trim(), "cube-egress /metrics: body over 1048576 bytes");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(after.saturating_sub(before) < 16 * 1024, "agent peak memory grew {} kB", after - before);
    assert!(sent_mib < 32, "the agent read {sent_mib} MiB");

    let (code, body, took) = timed(&a, "/metrics/cube-egress");
    assert_eq!((code, body.trim()), (502, "cube-egress /metrics: body over 1048576 bytes"));
    assert!(took < Duration::from_secs(2), "a declared oversize length is refused before reading: {took:?}");
    let (code, body, _) = timed(&a, "/metrics/cube-egress");
    assert_eq!((code, body.trim()), (502, "cube-egress /metrics: answered 500 Internal Server Error"));
    server.join().unwrap();
    assert_eq!(scrape_errors(&a, "too_large"), 2.0);
    assert_eq!(scrape_errors(&a, "status"), 1.0);
}
