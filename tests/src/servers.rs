//! Small servers bound inside a test namespace: an HTTP responder that answers with the
//! client address it saw, and a UDP echo that prefixes the client address; and the guest side
//! of that echo ([`udp_flood`], [`udp_ask`]).

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use crate::netns::TestNetns;

/// A background server thread, stopped and joined on drop.
#[derive(Debug)]
pub struct Server {
    /// Address the server listens on.
    pub addr: SocketAddr,
    /// Clients seen, in order.
    pub peers: Arc<Mutex<Vec<SocketAddr>>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Server {
    /// Clients seen so far.
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().expect("peers").clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves HTTP/1.0-style responses on `ip:port` inside `ns`: each request gets
/// `200 OK` with body `you are <client ip>:<port>\n`, then the connection closes.
pub fn http(ns: &TestNetns, ip: [u8; 4], port: u16) -> Server {
    let addr = SocketAddr::from((ip, port));
    // The socket belongs to the namespace it was created in, whatever thread uses it later.
    let listener = ns.run(move || TcpListener::bind(addr)).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("local addr");
    let (stop, peers) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
    let (s, p) = (stop.clone(), peers.clone());
    let thread = thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((mut conn, peer)) => {
                    p.lock().expect("peers").push(peer);
                    let _ = conn.set_nonblocking(false);
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 2048];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut chunk) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let body = format!("you are {peer}\n");
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(resp.as_bytes());
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(5)),
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    Server { addr, peers, stop, thread: Some(thread) }
}

/// A UDP responder on `ip:port` inside `ns`: every datagram goes to `handler(payload, peer)`;
/// a `Some(reply)` is sent back and the peer recorded in [`Server::peers`], `None` is ignored.
pub fn udp_responder(
    ns: &TestNetns,
    ip: [u8; 4],
    port: u16,
    mut handler: impl FnMut(&[u8], SocketAddr) -> Option<Vec<u8>> + Send + 'static,
) -> std::io::Result<Server> {
    let addr = SocketAddr::from((ip, port));
    let sock = ns.run(move || UdpSocket::bind(addr))?;
    sock.set_read_timeout(Some(Duration::from_millis(20)))?;
    let addr = sock.local_addr()?;
    let (stop, peers) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
    let (s, p) = (stop.clone(), peers.clone());
    let thread = thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while !s.load(Ordering::Relaxed) {
            if let Ok((n, peer)) = sock.recv_from(&mut buf)
                && let Some(reply) = handler(&buf[..n], peer)
            {
                p.lock().expect("peers").push(peer);
                let _ = sock.send_to(&reply, peer);
            }
        }
    });
    Ok(Server { addr, peers, stop, thread: Some(thread) })
}

/// A UDP echo on `ip:port` inside `ns`: replies `<client ip>:<port>|<payload>`.
pub fn udp_echo(ns: &TestNetns, ip: [u8; 4], port: u16) -> Server {
    udp_responder(ns, ip, port, |payload, peer| {
        let mut reply = format!("{peer}|").into_bytes();
        reply.extend_from_slice(payload);
        Some(reply)
    })
    .unwrap_or_else(|e| panic!("bind udp {}:{port}: {e}", std::net::Ipv4Addr::from(ip)))
}

/// Sends one datagram (`flow<i>`) from each of `n` fresh sockets (fresh source ports: one new
/// flow each) to `to`; returns the sockets, kept open so the ports stay the caller's.
pub fn udp_flood(to: std::net::SocketAddr, n: usize) -> Vec<std::net::UdpSocket> {
    (0..n)
        .map(|i| {
            let u = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
            u.send_to(format!("flow{i}").as_bytes(), to).expect("send");
            u
        })
        .collect()
}

/// Sends `msg` from `u` to the [`udp_echo`] at `to` and waits up to 2 s for its echo (the
/// reply ending in `msg`), skipping earlier echoes still queued on the socket.
pub fn udp_ask(u: &std::net::UdpSocket, to: std::net::SocketAddr, msg: &[u8]) -> std::io::Result<String> {
    u.set_read_timeout(Some(std::time::Duration::from_secs(2)))?;
    u.send_to(msg, to)?;
    let mut buf = [0u8; 512];
    loop {
        let n = u.recv(&mut buf)?;
        let s = String::from_utf8_lossy(&buf[..n]).into_owned();
        if s.ends_with(&*String::from_utf8_lossy(msg)) {
            return Ok(s);
        }
    }
}

/// Every datagram `u` receives, in order, up to and including the first that equals `marker`
/// (a control sent last on the same path: once it is in, anything sent before it that was going
/// to arrive has). Stops at the socket's read timeout; panics naming `what` when the marker never
/// arrived, so a lost control is never taken for "nothing leaked".
pub fn udp_recv_until(u: &std::net::UdpSocket, marker: &str, what: &str) -> Vec<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    while let Ok(n) = u.recv(&mut buf) {
        let s = String::from_utf8_lossy(&buf[..n]).into_owned();
        let done = s == marker;
        got.push(s);
        if done {
            return got;
        }
    }
    panic!("{what}: {marker:?} never arrived; received {got:?}");
}
