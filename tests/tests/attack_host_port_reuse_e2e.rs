//! Attack with the real agent (R73/R74 end to end; `attack_host_port_reuse_testrun` holds the
//! exact verdicts): a world client connected to sandbox A through A's TCP host port keeps its
//! connection open while A is released and the same host port is assigned to sandbox B (the
//! range has one port, so B must get it). The client then sends on its old connection, and its
//! kernel retransmits.
//!
//! Property held: none of the old connection's segments reaches B's TAP, whichever TAP B got
//! (A's own after its scrub: R73's version check; the other one: R74's `host_port_released`
//! stamp, written by the agent's Release through the library). A new connection to the port
//! reaches B from its SYN.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant as StdInstant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::AgentUnderTest,
    guest::TapGuest,
    packet::{self, Transport},
    require_root, smol,
    topology::NODE_IP,
};
use smoltcp::{iface::SocketSet, socket::tcp, time::Instant};

const GUEST_PORT: u16 = 8080;
const HOST_PORT: u16 = 20000;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn ensure(a: &AgentUnderTest, id: &str) -> pb::EnsureNetworkResponse {
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: id.into(),
            port_mappings: vec![pb::PortMapping {
                protocol: "tcp".into(),
                container_port: u32::from(GUEST_PORT),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("ensure {id}: {e}"))
        .into_inner()
    })
}

/// A guest TCP echo server on `GUEST_PORT` (smoltcp on the TAP fd) until `stop`; returns the
/// bytes it echoed.
fn echo_guest(g: TapGuest, stop: Arc<AtomicBool>) -> JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut dev = smol::GuestDevice::new(&g, false);
        let mut iface = smol::guest_interface(&mut dev, 7);
        let mut set = SocketSet::new(vec![]);
        let h =
            set.add(tcp::Socket::new(tcp::SocketBuffer::new(vec![0; 16384]), tcp::SocketBuffer::new(vec![0; 16384])));
        set.get_mut::<tcp::Socket>(h).listen(GUEST_PORT).unwrap();
        let mut echoed = 0;
        while !stop.load(Ordering::Relaxed) {
            iface.poll(Instant::now(), &mut dev, &mut set);
            let s = set.get_mut::<tcp::Socket>(h);
            if s.can_recv() && s.can_send() {
                let data = s.recv(|d| (d.len(), d.to_vec())).unwrap();
                echoed += s.send_slice(&data).unwrap();
            }
            let mut fds = [nix::poll::PollFd::new(std::os::fd::AsFd::as_fd(g.fd()), nix::poll::PollFlags::POLLIN)];
            let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(5u16));
        }
        echoed
    })
}

fn tap_state(a: &AgentUnderTest, name: &str) -> String {
    let j = a.http_json("/v1/network/taps");
    let t = j["taps"].as_array().unwrap().iter().find(|t| t["tapName"] == name).cloned();
    t.map(|t| t["state"].as_str().unwrap_or_default().to_string()).unwrap_or_else(|| format!("absent: {j}"))
}

/// Whether a TCP segment to `GUEST_PORT` reaches `g` within `wait`; `syn`: only a SYN counts.
fn tcp_to_guest_port(g: &TapGuest, wait: Duration, syn: bool) -> Option<Vec<u8>> {
    g.recv_matching(wait, |f| {
        packet::parse_ipv4(f).is_some_and(|s| match s.transport {
            Transport::Tcp { dport, syn: is_syn, .. } => dport == GUEST_PORT && (!syn || is_syn),
            _ => false,
        })
    })
}

/// B on another TAP (R74): with two pooled TAPs, B takes the Ready one while A's is scrubbed.
#[test]
fn a_world_connection_to_a_released_host_port_never_reaches_the_next_owner_on_another_tap() {
    if !require_root("attack_host_port_reuse_e2e another_tap") {
        return;
    }
    reuse("hp-reuse2", 2, false);
}

/// B on A's TAP (R73): B's Ensure comes once A's TAP is Ready again, and the pool hands out
/// its first Ready TAP.
#[test]
fn a_world_connection_to_a_released_host_port_never_reaches_the_next_owner_on_the_same_tap() {
    if !require_root("attack_host_port_reuse_e2e same_tap") {
        return;
    }
    reuse("hp-reuse1", 2, true);
}

fn reuse(tag: &str, tap_init_num: usize, same_tap: bool) {
    let mut a = AgentUnderTest::prepare(tag, tap_init_num, &format!("host_port_range = \"{HOST_PORT}-{HOST_PORT}\"\n"));
    a.start();

    // A serves on its host port; a world client connects and gets an echo.
    let ra = ensure(&a, "sb-a");
    assert_eq!(ra.port_mappings[0].host_port, u32::from(HOST_PORT));
    let stop = Arc::new(AtomicBool::new(false));
    let server = echo_guest(a.guest(&ra), stop.clone());
    let mut client = a
        .topo
        .world
        .run(|| TcpStream::connect_timeout(&SocketAddr::from((NODE_IP, HOST_PORT)), Duration::from_secs(5)))
        .expect("world client connects to A's host port");
    client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    client.write_all(b"hello A").unwrap();
    let mut buf = [0u8; 7];
    client.read_exact(&mut buf).expect("A echoes");
    assert_eq!(&buf, b"hello A");
    stop.store(true, Ordering::Relaxed);
    assert_eq!(server.join().unwrap(), 7);

    // A goes (its VMM closed the TAP first); B gets the same host port at once.
    a.release("sb-a");
    if same_tap {
        let tap = ra.interfaces[0].name.clone();
        let t = StdInstant::now();
        while tap_state(&a, &tap) != "Ready" {
            assert!(t.elapsed() < Duration::from_secs(10), "A's TAP {tap} not Ready again: {}", tap_state(&a, &tap));
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let rb = ensure(&a, "sb-b");
    assert_eq!(rb.port_mappings[0].host_port, u32::from(HOST_PORT), "B must get the only port");
    assert_eq!(
        rb.interfaces[0].name == ra.interfaces[0].name,
        same_tap,
        "precondition: B on {} and A on {}",
        rb.interfaces[0].name,
        ra.interfaces[0].name
    );
    let gb = a.guest(&rb);

    // The old client writes on its connection; its kernel retransmits for as long as we wait.
    client.write_all(b"for A only").unwrap();
    let t = StdInstant::now();
    let leaked = tcp_to_guest_port(&gb, Duration::from_secs(3), false);
    assert!(
        leaked.is_none(),
        "a segment of A's world connection reached B's guest ({} TAP) after {:?}: {:?}",
        if same_tap { "same" } else { "other" },
        t.elapsed(),
        leaked.as_deref().and_then(packet::parse_ipv4)
    );

    // A new connection to the port reaches B from its SYN.
    let syn = std::thread::scope(|s| {
        // B's guest never answers: this connect only has to send its SYN.
        let connector = s.spawn(|| {
            a.topo
                .world
                .run(|| TcpStream::connect_timeout(&SocketAddr::from((NODE_IP, HOST_PORT)), Duration::from_secs(2)))
        });
        let syn = tcp_to_guest_port(&gb, Duration::from_secs(3), true);
        let _ = connector.join();
        syn
    });
    assert!(syn.is_some(), "a new world SYN did not reach B");
    drop(client);
}
