//! Issue 4 acceptance that needs the full CubeVS datapath (SNAT, conntrack, host-port DNAT):
//! the agent started by its script in its own namespace, a TAP guest on an fd handed out by
//! the agent, talking to the world namespace; and a `kill -9` of the agent while the guest
//! holds a long TCP connection and pings, with no loss.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant as StdInstant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::AgentUnderTest,
    guest::TapGuest,
    packet::{self, Transport},
    require_root, servers, smol,
    topology::{NODE_IP, WORLD_IP},
};
use smoltcp::{
    iface::SocketSet,
    socket::tcp,
    time::Instant,
    wire::{IpAddress, Ipv4Address},
};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn ensure(a: &AgentUnderTest, id: &str, udp_port: Option<u32>) -> pb::EnsureNetworkResponse {
    let rt = rt();
    rt.block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: id.into(),
            port_mappings: udp_port
                .map(|p| pb::PortMapping { protocol: "udp".into(), container_port: p, ..Default::default() })
                .into_iter()
                .collect(),
            cubevs_context: Some(pb::CubeVsContext { allow_internet_access: Some(true), ..Default::default() }),
            ..Default::default()
        })
        .await
        .expect("ensure")
        .into_inner()
    })
}

fn ping_world(g: &TapGuest, seq: u16) -> bool {
    g.send(&packet::icmp_echo_request(WORLD_IP, 0x99, seq));
    g.recv_matching(Duration::from_secs(2), |f| {
        packet::parse_ipv4(f).is_some_and(|s| s.transport == Transport::EchoReply(0x99, seq))
    })
    .is_some()
}

#[test]
fn guest_on_agent_tap_reaches_world_and_host_port_reaches_guest() {
    if !require_root("guest_on_agent_tap_reaches_world_and_host_port_reaches_guest") {
        return;
    }
    let mut a = AgentUnderTest::prepare("dp-world", 2, "");
    a.start();
    let _http = servers::http(&a.topo.world, WORLD_IP, 80);
    let r = ensure(&a, "sb-w", Some(5353));
    let hp = r.port_mappings[0].host_port as u16;
    let g = a.guest(&r);
    assert!(g.arp(packet::GATEWAY_IP, Duration::from_secs(2)).is_some());
    assert!(ping_world(&g, 1), "no echo reply from world");
    let body = tcp_request(&g, 80, b"GET / HTTP/1.0\r\n\r\n");
    assert!(body.contains("you are 198.51.100.2:"), "SNAT to the uplink address: {body:?}");

    // Host port from world → guest UDP 5353, and the guest's reply comes back from the host port.
    let sock = a.topo.world.run(|| UdpSocket::bind("198.51.100.1:0").unwrap());
    sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    sock.send_to(b"to-guest", SocketAddr::from((NODE_IP, hp))).unwrap();
    let f = g
        .recv_matching(Duration::from_secs(2), |f| {
            matches!(packet::parse_ipv4(f), Some(s) if matches!(&s.transport, Transport::Udp(_, 5353, p) if p == b"to-guest"))
        })
        .expect("host port did not reach the guest");
    let s = packet::parse_ipv4(&f).unwrap();
    let Transport::Udp(wport, _, _) = s.transport else { unreachable!() };
    assert_eq!(s.dst, packet::GUEST_IP);
    g.send(&packet::udp(s.src, 5353, wport, b"from-guest"));
    let mut buf = [0u8; 64];
    let (n, from) = sock.recv_from(&mut buf).expect("guest reply did not reach world");
    assert_eq!(&buf[..n], b"from-guest");
    assert_eq!(from, SocketAddr::from((NODE_IP, hp)));

    // Release + re-Ensure on the same TAP: new version, the old flows are gone.
    let sessions = a.http_json("/v1/dataplane/sessions");
    assert!(!sessions["sessions"].as_array().unwrap().is_empty(), "{sessions}");
    drop(g);
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "sb-w".into(), ..Default::default() }).await.unwrap();
    });
    // Release unregisters and walks no session map (decision D19): the old flows are dead at
    // once and the reaper's next pass (every 5 s) deletes them.
    let old_ifindex = r.persist_metadata["host_tap_name"].clone();
    let t = StdInstant::now();
    let mut sessions = a.http_json("/v1/dataplane/sessions");
    while !sessions["sessions"].as_array().unwrap().is_empty() && t.elapsed() < Duration::from_secs(12) {
        std::thread::sleep(Duration::from_millis(200));
        sessions = a.http_json("/v1/dataplane/sessions");
    }
    assert!(sessions["sessions"].as_array().unwrap().is_empty(), "old flows of {old_ifindex} survived: {sessions}");
    let r2 = ensure(&a, "sb-w2", None);
    assert_eq!(r2.interfaces[0].name, r.interfaces[0].name);
    let g2 = a.guest(&r2);
    assert!(ping_world(&g2, 2));
    sock.send_to(b"to-guest", SocketAddr::from((NODE_IP, hp))).unwrap();
    assert!(
        g2.recv_matching(
            Duration::from_millis(500),
            |f| matches!(packet::parse_ipv4(f), Some(s) if matches!(s.transport, Transport::Udp(..)))
        )
        .is_none(),
        "the released host port still reaches the reused TAP"
    );
}

/// One TCP request from the guest to `world:port`; returns what came back before the close.
/// Pool TAPs offload checksums, so received checksums are not verified.
fn tcp_request(g: &TapGuest, port: u16, req: &[u8]) -> String {
    let out = smol::tcp_exchange_with(
        &mut smol::GuestDevice::new(g, false),
        WORLD_IP,
        port,
        40001,
        req,
        Duration::from_secs(5),
    );
    String::from_utf8_lossy(&out.received).into_owned()
}

#[derive(Debug, Default)]
struct Traffic {
    echoes: usize,
    max_gap: Duration,
    broke: Option<String>,
    pings_sent: u16,
    pings_back: Vec<u16>,
}

/// Holds a TCP connection to `world:7000` (an echo server), echoing 16 bytes every 20 ms, and
/// pings world every 50 ms, until `stop`.
fn drive(g: TapGuest, stop: Arc<AtomicBool>) -> Traffic {
    let replies = Mutex::new(Vec::new());
    // Echo replies of our pings are counted here; smoltcp never sees them.
    let mut dev = smol::GuestDevice::new(&g, false).with_divert(|f| match packet::parse_ipv4(f) {
        Some(s) => match s.transport {
            Transport::EchoReply(0x55, seq) => {
                replies.lock().unwrap().push(seq);
                true
            }
            _ => false,
        },
        None => false,
    });
    let mut iface = smol::guest_interface(&mut dev, 41000);
    let sock = tcp::Socket::new(tcp::SocketBuffer::new(vec![0; 65535]), tcp::SocketBuffer::new(vec![0; 65535]));
    let mut set = SocketSet::new(vec![]);
    let h = set.add(sock);
    set.get_mut::<tcp::Socket>(h)
        .connect(iface.context(), (IpAddress::from(Ipv4Address::from(WORLD_IP)), 7000), 41000)
        .unwrap();
    let mut t = Traffic::default();
    let (mut last_echo, mut next_send, mut next_ping) = (StdInstant::now(), StdInstant::now(), StdInstant::now());
    let mut pending = 0usize;
    let mut established = false;
    while !stop.load(Ordering::Relaxed) {
        iface.poll(Instant::now(), &mut dev, &mut set);
        let s = set.get_mut::<tcp::Socket>(h);
        if s.state() == tcp::State::Established {
            if !established {
                established = true;
                last_echo = StdInstant::now();
            }
            if pending == 0 && StdInstant::now() >= next_send && s.can_send() {
                s.send_slice(b"0123456789abcdef").unwrap();
                pending = 16;
                next_send = StdInstant::now() + Duration::from_millis(20);
            }
            if s.can_recv() {
                let n = s.recv(|d| (d.len(), d.len())).unwrap();
                pending = pending.saturating_sub(n);
                if pending == 0 {
                    t.echoes += 1;
                    t.max_gap = t.max_gap.max(last_echo.elapsed());
                    last_echo = StdInstant::now();
                }
            }
        } else if established {
            t.broke = Some(format!("TCP left Established: {:?}", s.state()));
            break;
        }
        if StdInstant::now() >= next_ping {
            t.pings_sent += 1;
            g.send(&packet::icmp_echo_request(WORLD_IP, 0x55, t.pings_sent));
            next_ping = StdInstant::now() + Duration::from_millis(50);
        }
        let mut fds = [nix::poll::PollFd::new(std::os::fd::AsFd::as_fd(g.fd()), nix::poll::PollFlags::POLLIN)];
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(5u16));
    }
    // Let the last replies arrive.
    let end = StdInstant::now() + Duration::from_millis(300);
    while StdInstant::now() < end {
        iface.poll(Instant::now(), &mut dev, &mut set);
        std::thread::sleep(Duration::from_millis(5));
    }
    if !established {
        t.broke = Some("never established".into());
    }
    drop(iface);
    drop(dev);
    t.pings_back = replies.into_inner().unwrap();
    t
}

fn echo_server(a: &AgentUnderTest) -> std::thread::JoinHandle<()> {
    let l = a.topo.world.run(|| TcpListener::bind("198.51.100.1:7000").unwrap());
    std::thread::spawn(move || {
        if let Ok((mut c, _)) = l.accept() {
            let mut buf = [0u8; 4096];
            while let Ok(n) = c.read(&mut buf) {
                if n == 0 || c.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    })
}

#[test]
fn kill9_keeps_long_tcp_and_ping_without_loss() {
    if !require_root("kill9_keeps_long_tcp_and_ping_without_loss") {
        return;
    }
    let mut a = AgentUnderTest::prepare("dp-kill9", 2, "");
    a.start();
    let _srv = echo_server(&a);
    let r = ensure(&a, "sb-long", None);
    let get = |a: &AgentUnderTest| {
        rt().block_on(async {
            let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
            c.get_network(pb::GetNetworkRequest { sandbox_id: "sb-long".into(), ..Default::default() })
                .await
                .unwrap()
                .into_inner()
        })
    };
    let before = get(&a);
    let g = a.guest(&r);
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let driver = std::thread::spawn(move || drive(g, st));
    std::thread::sleep(Duration::from_millis(800));

    let status = a.kill(nix::sys::signal::Signal::SIGKILL);
    assert!(!status.success());
    std::thread::sleep(Duration::from_millis(1000));
    a.child = Some(a.spawn_script());
    a.wait_ready(Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(800));
    stop.store(true, Ordering::Relaxed);
    let t = driver.join().unwrap();

    assert!(t.broke.is_none(), "{t:?}");
    assert!(t.echoes > 50, "{t:?}");
    // An echo every 20 ms; a stall this long would mean the flow stopped during the restart.
    assert!(t.max_gap < Duration::from_millis(500), "TCP stalled: {t:?}");
    let mut back = t.pings_back.clone();
    back.sort();
    back.dedup();
    assert_eq!(back.len(), t.pings_sent as usize, "lost pings: sent {}, back {:?}", t.pings_sent, back);
    assert_eq!(get(&a), before, "GetNetwork changed across the restart");
    assert!(a.log().contains("adopted: 1"), "{}", a.log());
}
