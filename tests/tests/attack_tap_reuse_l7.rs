//! Attack: a TAP (and so its mvm IP) released by sandbox A and handed to sandbox B, while
//! CubeEgress still holds one of A's L7 connections with response data in flight. A's VMM is
//! gone, so nothing acknowledges that data and CubeEgress's kernel retransmits it to A's
//! mvm IP; `from_cube`/`from_envoy` know the address, not the sandbox, and deliver what a
//! host socket sends to whoever holds the address now. B, the next sandbox on the TAP, reads
//! its own TAP and watches for A's bytes. Real agent, real `cube-egress`, a kernel guest for
//! A, the raw TAP for B (root only).
//!
//! Property: nothing of a released sandbox's connections reaches the next sandbox on its
//! address. CubeEgress resets a sandbox's connections when its policy is deleted (the agent's
//! Release push), so its kernel drops the unsent and unacknowledged data (decision R71); the
//! agent aborts every node TCP socket to the address when it scrubs the TAP (R72), which also
//! covers node processes and a gateway that missed the push.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, TcpListener},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_sys::tap::VNET_HDR_LEN;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    agent_upgrade::KernelGuest,
    egress::{admin, admin_json},
    guest::TapGuest,
    l7::{Gateway, GatewayOptions, World},
    require_root,
    topology::WORLD_IP,
};

/// The name A streams from, through CubeEgress (plain HTTP, port 80).
const STREAM: &str = "stream.l7.test";
const STREAM_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 40);
/// What every chunk of A's response carries; B must never see it.
const MARK: &[u8] = b"A-PRIVATE-";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn ensure(a: &AgentUnderTest, id: &str, ctx: Option<pb::CubeVsContext>) -> pb::EnsureNetworkResponse {
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: id.into(), cubevs_context: ctx, ..Default::default() })
            .await
    })
    .expect("EnsureNetwork")
    .into_inner()
}

fn tap_states(a: &AgentUnderTest) -> Vec<String> {
    let taps = a.http_json("/v1/network/taps");
    taps["taps"].as_array().unwrap().iter().map(|t| t["state"].as_str().unwrap().to_string()).collect()
}

/// A's context: DNS through the world resolver, `STREAM` by name on port 80 through CubeEgress.
fn l7_context() -> pb::CubeVsContext {
    pb::CubeVsContext {
        allow_internet_access: Some(false),
        allow_out: vec![format!("{}/32", Ipv4Addr::from(WORLD_IP))],
        allow_fqdn: vec![pb::FqdnAllow { name: STREAM.into(), ports: vec![80] }],
        rules: vec![pb::EgressRule {
            id: "stream".into(),
            r#match: Some(pb::EgressMatch { host: Some(STREAM.into()), ..Default::default() }),
            action: Some(pb::EgressAction { allow: true, ..Default::default() }),
        }],
        ..Default::default()
    }
}

/// A world server on `STREAM_IP:80` that answers every request with an endless chunked body,
/// one 1,000-byte chunk starting with [`MARK`] every 10 ms, until the client goes or `stop`.
/// Returns the number of chunks written so far.
fn stream_server(a: &AgentUnderTest, stop: Arc<AtomicBool>) -> Arc<AtomicU64> {
    let l = a.topo.world.run(|| TcpListener::bind((STREAM_IP, 80))).expect("bind stream server");
    let sent = Arc::new(AtomicU64::new(0));
    let counter = sent.clone();
    std::thread::spawn(move || {
        l.set_nonblocking(true).unwrap();
        while !stop.load(Ordering::Relaxed) {
            let Ok((mut s, _)) = l.accept() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let (stop, counter) = (stop.clone(), counter.clone());
            std::thread::spawn(move || {
                s.set_nonblocking(false).unwrap();
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
                    .is_err()
                {
                    return;
                }
                for n in 0u64.. {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let mut chunk = format!("{}{n:08}\n", String::from_utf8_lossy(MARK)).into_bytes();
                    chunk.resize(1000, b'.');
                    let mut msg = format!("{:x}\r\n", chunk.len()).into_bytes();
                    msg.extend_from_slice(&chunk);
                    msg.extend_from_slice(b"\r\n");
                    if s.write_all(&msg).is_err() {
                        return;
                    }
                    counter.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10));
                }
            });
        }
    });
    sent
}

/// The gateway's Prometheus text (its admin listener, from the node namespace).
fn gateway_metrics(a: &AgentUnderTest) -> String {
    let o = a.topo.node.exec("curl", &["-sS", "--max-time", "5", "http://127.0.0.1:9091/metrics"]);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_released_sandboxs_l7_stream_never_reaches_the_next_sandbox_on_its_tap() {
    if !require_root("attack_tap_reuse_l7 a_released_sandboxs_l7_stream_never_reaches_the_next_sandbox_on_its_tap") {
        return;
    }
    // One TAP: B gets A's TAP and so A's mvm IP.
    let mut a = AgentUnderTest::prepare("tapreuse", 1, "cube_egress_admin_url = \"http://127.0.0.1:9091\"\n");
    a.in_dataplane = true;
    a.topo.add_world_address(STREAM_IP.octets(), 24);
    let world = World::start(&a.topo.world, Ipv4Addr::from(WORLD_IP), &[(STREAM, STREAM_IP)], &[]).expect("world DNS");
    let stop = Arc::new(AtomicBool::new(false));
    let sent = stream_server(&a, stop.clone());
    a.start();
    let gw_dir = std::env::temp_dir().join(format!("cubenet-tapreuse-{}", std::process::id()));
    let gw = Gateway::start(&a.topo.node, &gw_dir, &world.ca.pem, &GatewayOptions::for_agent(None))
        .unwrap_or_else(|e| panic!("gateway: {e}"));

    let ra = ensure(&a, "sb-a", Some(l7_context()));
    let a_ip = ra.persist_metadata["sandbox_ip"].clone();
    let ifc = &ra.interfaces[0];
    let (reply, fd) = tap_fd(&a.tap_socket(), &ifc.name, &ra.sandbox_id);
    assert_eq!(reply["errCode"], "0", "{reply}");
    let guest = KernelGuest::new(fd.expect("TAP fd"), &ifc.mac_address, &ifc.ip_cidrs[0], &ifc.gateway, ifc.mtu as u32);
    let o = guest.ns.exec("busybox", &["nslookup", "-type=a", STREAM, &Ipv4Addr::from(WORLD_IP).to_string()]);
    assert!(String::from_utf8_lossy(&o.stdout).contains(&STREAM_IP.to_string()), "A resolves the name: {o:?}");
    let t = Instant::now();
    while admin_json(&a.topo.node, &format!("/admin/v1/policies/{a_ip}")).is_none() {
        assert!(t.elapsed() < Duration::from_secs(15), "A's policy never reached the gateway\n{}", gw.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    // A streams through CubeEgress; its curl runs on after A's VMM is gone (and is cut off).
    let out = gw_dir.join("a-stream.txt");
    let curl = guest.ns.spawn(
        "curl",
        &[
            "-sS",
            "--max-time",
            "30",
            "--resolve",
            &format!("{STREAM}:80:{STREAM_IP}"),
            "-o",
            out.to_str().unwrap(),
            &format!("http://{STREAM}/stream"),
        ],
    );
    let t = Instant::now();
    while sent.load(Ordering::Relaxed) < 50 {
        assert!(t.elapsed() < Duration::from_secs(15), "A's stream never started\ngateway log:\n{}", gw.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let got = std::fs::read(&out).unwrap_or_default();
    assert!(contains(&got, MARK), "A received its stream through CubeEgress");

    // The agent's Release deletes A's policy in the gateway before anything else (as
    // `agent_l7` shows); done here first, alone, so the gateway's own reset is what is
    // checked (the agent's socket abort at the scrub, R72, would otherwise race it).
    let (code, body) = admin(&a.topo.node, "DELETE", &format!("/admin/v1/policies/{a_ip}"), "");
    assert_eq!(code, 200, "{body}");
    let t = Instant::now();
    while !gateway_metrics(&a).lines().any(|l| l == "cube_egress_connections_closed_released_total 1") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the gateway never reset A's connection when A's policy was deleted:\n{}",
            gateway_metrics(&a)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A's VMM ends (nothing reads or acknowledges its TAP any more), then cubelet releases A.
    drop(guest);
    drop(curl);
    assert!(a.release("sb-a"));
    let t = Instant::now();
    while tap_states(&a) != ["Ready"] {
        assert!(t.elapsed() < Duration::from_secs(15), "A's TAP never went Ready: {:?}", tap_states(&a));
        std::thread::sleep(Duration::from_millis(100));
    }

    // B gets the same TAP and address and reads everything that arrives on it.
    let rb = ensure(&a, "sb-b", None);
    assert_eq!(rb.persist_metadata["sandbox_ip"], a_ip, "B must get A's TAP and address for this attack");
    let ifb = &rb.interfaces[0];
    let (reply, fd) = tap_fd(&a.tap_socket(), &ifb.name, &rb.sandbox_id);
    assert_eq!(reply["errCode"], "0", "{reply}");
    let b = TapGuest::new(fd.expect("B's TAP fd"), VNET_HDR_LEN);
    let mut leaked = 0usize;
    let mut frames = 0usize;
    let t = Instant::now();
    // TCP's retransmission back-off doubles from 200 ms: a 12 s watch sees several rounds.
    while t.elapsed() < Duration::from_secs(12) {
        if let Some(f) = b.recv(Duration::from_millis(500)) {
            frames += 1;
            if contains(&f, MARK) {
                leaked += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    eprintln!(
        "B read {frames} frames, {leaked} with A's data; the world wrote {} chunks",
        sent.load(Ordering::Relaxed)
    );
    assert_eq!(leaked, 0, "B read A's response data on A's old address\ngateway log:\n{}", gw.log());
    drop(gw);
}

/// The same reuse with a node process instead of CubeEgress: a connection the node opened to
/// A's mvm IP (as cubelet's exec or file channels do) with data in flight when A ends. Its
/// retransmissions went to B on A's old address; the agent now aborts the node's TCP sockets
/// to a released sandbox's address before its TAP goes Ready again (R72), so its kernel sends
/// a RST (dropped: the address is unregistered) and drops the data.
#[test]
fn a_node_connection_to_a_released_sandbox_never_reaches_the_next_sandbox_on_its_tap() {
    if !require_root(
        "attack_tap_reuse_l7 a_node_connection_to_a_released_sandbox_never_reaches_the_next_sandbox_on_its_tap",
    ) {
        return;
    }
    let mut a = AgentUnderTest::prepare("tapreuse-node", 1, "");
    a.in_dataplane = true;
    a.start();
    let ra = ensure(&a, "sb-a", None);
    let a_ip: Ipv4Addr = ra.persist_metadata["sandbox_ip"].parse().unwrap();
    let ifc = &ra.interfaces[0];
    let (reply, fd) = tap_fd(&a.tap_socket(), &ifc.name, &ra.sandbox_id);
    assert_eq!(reply["errCode"], "0", "{reply}");
    let guest = KernelGuest::new(fd.expect("TAP fd"), &ifc.mac_address, &ifc.ip_cidrs[0], &ifc.gateway, ifc.mtu as u32);
    // A serves on 9000 and reads what the node sends.
    let l = guest.ns.run(|| TcpListener::bind(("0.0.0.0", 9000))).expect("guest listener");
    let got = Arc::new(AtomicU64::new(0));
    let got_a = got.clone();
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = l.accept() {
            let mut buf = [0u8; 65536];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    return;
                }
                got_a.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let stop_n = stop.clone();
    let node_conn =
        a.topo.node.run(move || std::net::TcpStream::connect_timeout(&(a_ip, 9000).into(), Duration::from_secs(5)));
    let mut node_conn = node_conn.expect("the node connects to A");
    std::thread::spawn(move || {
        for n in 0u64.. {
            if stop_n.load(Ordering::Relaxed) {
                return;
            }
            let mut chunk = format!("{}{n:08}\n", String::from_utf8_lossy(MARK)).into_bytes();
            chunk.resize(1000, b'.');
            if node_conn.write_all(&chunk).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    let t = Instant::now();
    while got.load(Ordering::Relaxed) < 20_000 {
        assert!(t.elapsed() < Duration::from_secs(15), "A never got the node's data");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(guest);
    assert!(a.release("sb-a"));
    let t = Instant::now();
    while tap_states(&a) != ["Ready"] {
        assert!(t.elapsed() < Duration::from_secs(15), "A's TAP never went Ready: {:?}", tap_states(&a));
        std::thread::sleep(Duration::from_millis(100));
    }
    let rb = ensure(&a, "sb-b", None);
    assert_eq!(rb.persist_metadata["sandbox_ip"], a_ip.to_string(), "B must get A's TAP and address");
    let ifb = &rb.interfaces[0];
    let (reply, fd) = tap_fd(&a.tap_socket(), &ifb.name, &rb.sandbox_id);
    assert_eq!(reply["errCode"], "0", "{reply}");
    let b = TapGuest::new(fd.expect("B's TAP fd"), VNET_HDR_LEN);
    let (mut frames, mut leaked) = (0usize, 0usize);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(12) {
        if let Some(f) = b.recv(Duration::from_millis(500)) {
            frames += 1;
            leaked += usize::from(contains(&f, MARK));
        }
    }
    stop.store(true, Ordering::Relaxed);
    eprintln!("B read {frames} frames, {leaked} with A's data");
    assert_eq!(leaked, 0, "B read the node's data for A on A's old address\nagent log:\n{}", a.log());
    assert!(a.log().contains("aborted the node's TCP connections to released sandboxes"), "{}", a.log());
}
