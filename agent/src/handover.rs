//! Live upgrade hand-over: a new agent takes the running agent's listening sockets and TAP
//! queue fds over a Unix socket (`handover_socket`, mode 0600, peer uid checked with
//! SO_PEERCRED on both sides), so no listener is rebound, no TAP is reopened (`TUNSETIFF`) and
//! requests that arrive meanwhile wait in the shared kernel backlog instead of being refused.
//! The pattern is CubeEgress's listener handoff (`egress/src/handoff.rs`, decisions E9, E18) plus the
//! TAP fds and a mutation gate.
//!
//! Protocol (version [`PROTOCOL_VERSION`]), on one `SOCK_STREAM` connection, lines end in `\n`:
//!
//! 1. successor → old: `BEGIN <version>`. Another version: old answers `REFUSE <why>` and
//!    closes; nothing changed.
//! 2. old: closes its [`MutationGate`] (waits for running Ensure/Release/Reconcile calls and the
//!    maintenance pass; later ones queue), then sends `OFFER <version>`, a 4-byte little-endian
//!    length and the [`Manifest`] JSON, then the fds in manifest order (listeners, then TAPs)
//!    in messages of one byte `F` carrying at most [`MAX_FDS_PER_MESSAGE`] fds each
//!    (SCM_RIGHTS limit 253).
//! 3. successor: checks every fd (each listener is bound where its configuration says, the
//!    `TUNGETIFF` name of each TAP fd and the TAP's ifindex match the manifest), recovers from
//!    the state files with the received fds, then sends `READY`. Any failure, or closing the
//!    connection, is an abort: the old agent answers `ABORT <why>` if it can, opens the gate
//!    and keeps serving; the successor exits.
//! 4. old, on `READY`: stops accepting on every listener (waits until no accept loop is left),
//!    marks the gate handed over (queued and later mutations, and reads on connections it still
//!    serves, are forwarded to the successor over `grpc_listen`) and sends `STOPPED`. Existing
//!    gRPC connections get an HTTP/2 GOAWAY; in-flight requests finish; the process exits
//!    without removing the socket files.
//! 5. successor, on `STOPPED` (or the old agent's end of the connection closing): starts
//!    accepting. Until then connections wait in the listen backlog.
//!
//! Between steps 1 and 5 reads (GetNetwork, ListNetworks, fd requests, health) are answered by
//! the old agent from its state, which no mutation changes while the gate is closed; fd
//! requests are only ever accepted by one agent at a time, so none sees a stale pool.

use std::{
    collections::HashMap,
    future::Future,
    io::{self, Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::net::{UnixListener, UnixStream},
    },
    path::Path,
    pin::Pin,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

use crate::agent::Agent;

/// Version of the hand-over protocol and manifest; a successor refuses any other.
pub const PROTOCOL_VERSION: u32 = 1;
/// Fds per SCM_RIGHTS message (the kernel's `SCM_MAX_FD` is 253).
pub const MAX_FDS_PER_MESSAGE: usize = 253;
/// Largest accepted manifest in bytes (a pool of 65536 TAPs needs about 8 MiB).
pub const MAX_MANIFEST: usize = 16 << 20;
/// How long each side waits for the other's next step.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// Which listening socket an fd is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ListenerKind {
    /// `grpc_listen` as a Unix socket.
    GrpcUnix,
    /// `grpc_listen` as TCP.
    GrpcTcp,
    /// `tap_fd_listen`.
    TapFd,
    /// `health_listen` (HTTP).
    Health,
}

/// One TAP in the manifest; its queue fd follows in the fd stream when `has_fd`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapRecord {
    /// `z<ip>`.
    pub name: String,
    /// Pool state (`Ready`, `Active`, `Cleaning`).
    pub state: String,
    /// Owning sandbox, if any.
    pub owner: Option<String>,
    /// ifindex in the dataplane netns.
    pub ifindex: u32,
    /// Whether the old agent held a queue fd (a Cleaning TAP whose VMM holds it has none).
    pub has_fd: bool,
}

/// What the old agent hands over, besides the fds themselves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The listening sockets, in fd order.
    pub listeners: Vec<ListenerKind>,
    /// Every TAP of the pool; fds follow the listeners' for those with `has_fd`, in this order.
    pub taps: Vec<TapRecord>,
}

impl Manifest {
    /// Number of fds that follow the manifest.
    pub fn fd_count(&self) -> usize {
        self.listeners.len() + self.taps.iter().filter(|t| t.has_fd).count()
    }
}

fn proto_err(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Serialises mutations against a hand-over. Every mutating call (gRPC Ensure, Release,
/// Reconcile; a maintenance pass) enters it; a hand-over closes it, which waits for running
/// mutations and queues new ones. After the successor is ready, entering yields the
/// successor's gRPC endpoint instead (forward the call there); after an abort it opens again.
#[derive(Debug, Default)]
pub struct MutationGate {
    lock: Arc<RwLock<()>>,
    handed_over: AtomicBool,
    /// An offer is out (listeners and TAP fds sent), not yet committed or aborted.
    offering: AtomicBool,
    successor: OnceLock<String>,
}

/// The result of entering the gate.
#[derive(Debug)]
pub enum Entry {
    /// Mutate here; hold the guard until done.
    Here(OwnedRwLockReadGuard<()>),
    /// The state belongs to the successor at this gRPC endpoint.
    Forward(String),
    /// Handed over without a forwarding endpoint (maintenance: just stop).
    Gone,
}

impl MutationGate {
    /// Waits until mutations may run here, or the state has moved on.
    pub async fn enter(&self) -> Entry {
        let g = self.lock.clone().read_owned().await;
        if !self.handed_over.load(Ordering::Acquire) {
            return Entry::Here(g);
        }
        match self.successor.get() {
            Some(e) => Entry::Forward(e.clone()),
            None => Entry::Gone,
        }
    }

    /// Closes the gate: waits for running mutations; new ones queue until the guard drops.
    pub async fn close(&self) -> OwnedRwLockWriteGuard<()> {
        self.lock.clone().write_owned().await
    }

    /// Marks the state as the successor's (call while holding the closed gate).
    pub fn hand_over(&self, successor_endpoint: Option<String>) {
        if let Some(e) = successor_endpoint {
            let _ = self.successor.set(e);
        }
        self.handed_over.store(true, Ordering::Release);
    }

    /// The successor's gRPC endpoint once the state was handed to it (reads forward there).
    pub fn successor(&self) -> Option<String> {
        if self.handed_over() { self.successor.get().cloned() } else { None }
    }

    /// Whether the listening sockets may belong to a successor: an offer is out or was
    /// committed. A stopping agent then leaves the socket files alone.
    pub fn sockets_shared(&self) -> bool {
        self.offering.load(Ordering::Acquire) || self.handed_over()
    }

    /// Whether the state was handed to a successor.
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(Ordering::Acquire)
    }
}

/// Binds the hand-over socket with mode 0600: bound under a temporary name, restricted, then
/// renamed into place (the path never exists with a wider mode; as CubeEgress does, E9).
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let l = UnixListener::bind(&tmp)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(l)
}

/// Whether the peer runs as our effective uid or as root (SO_PEERCRED; errors count as no).
pub fn peer_allowed(conn: &UnixStream) -> bool {
    let me = nix::unistd::geteuid().as_raw();
    nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::PeerCredentials)
        .is_ok_and(|c| c.uid() == me || c.uid() == 0)
}

/// Successor side, step 1: connects to a running agent and asks for the hand-over. `Ok(None)`
/// when no agent listens there (no socket file, or nobody accepting: a crash left it).
/// Errors: the peer runs as another uid (`PermissionDenied`), I/O.
pub fn begin(path: &Path) -> io::Result<Option<UnixStream>> {
    let s = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ECONNREFUSED)) => return Ok(None),
        Err(e) => return Err(e),
    };
    if !peer_allowed(&s) {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "hand-over peer runs as another user"));
    }
    s.set_read_timeout(Some(STEP_TIMEOUT))?;
    s.set_write_timeout(Some(STEP_TIMEOUT))?;
    (&s).write_all(format!("BEGIN {PROTOCOL_VERSION}\n").as_bytes())?;
    Ok(Some(s))
}

/// Reads one `\n`-terminated line of at most 256 bytes (byte by byte: nothing after the line,
/// such as the manifest length, is consumed).
pub fn read_line(s: &UnixStream) -> io::Result<String> {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    loop {
        if (&*s).read(&mut b)? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "hand-over peer closed"));
        }
        if b[0] == b'\n' {
            return String::from_utf8(out).map_err(|_| proto_err("non-UTF-8 line"));
        }
        out.push(b[0]);
        if out.len() > 256 {
            return Err(proto_err("line too long"));
        }
    }
}

/// Old side, step 2: sends `OFFER`, the manifest and `fds` (exactly [`Manifest::fd_count`],
/// in order).
pub fn send_offer(s: &UnixStream, manifest: &Manifest, fds: &[RawFd]) -> io::Result<()> {
    if fds.len() != manifest.fd_count() {
        return Err(proto_err(format!("{} fds for a manifest of {}", fds.len(), manifest.fd_count())));
    }
    let json = serde_json::to_vec(manifest).map_err(|e| proto_err(e.to_string()))?;
    let mut w = s;
    w.write_all(format!("OFFER {}\n", manifest.version).as_bytes())?;
    w.write_all(&(json.len() as u32).to_le_bytes())?;
    w.write_all(&json)?;
    for chunk in fds.chunks(MAX_FDS_PER_MESSAGE) {
        let iov = [io::IoSlice::new(b"F")];
        let cmsg = [ControlMessage::ScmRights(chunk)];
        sendmsg::<()>(s.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None).map_err(io::Error::from)?;
    }
    Ok(())
}

/// Successor side, step 2: receives the offer (its `OFFER` line, the manifest and its fds,
/// close-on-exec). Errors name what was wrong: a `REFUSE` from the old agent, another protocol
/// version, a manifest over [`MAX_MANIFEST`], a missing or truncated fd message.
pub fn recv_offer(s: &UnixStream) -> io::Result<(Manifest, Vec<OwnedFd>)> {
    let line = read_line(s)?;
    match line.split_once(' ') {
        Some(("OFFER", v)) if v == PROTOCOL_VERSION.to_string() => {}
        Some(("OFFER", v)) => {
            return Err(proto_err(format!("protocol version {v} offered (this agent speaks {PROTOCOL_VERSION})")));
        }
        _ => return Err(proto_err(format!("the running agent answered {line:?}"))),
    }
    let mut len = [0u8; 4];
    (&*s).read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MANIFEST {
        return Err(proto_err(format!("manifest of {len} bytes is over {MAX_MANIFEST}")));
    }
    let mut json = vec![0u8; len];
    (&*s).read_exact(&mut json)?;
    let m: Manifest = serde_json::from_slice(&json).map_err(|e| proto_err(format!("manifest: {e}")))?;
    if m.version != PROTOCOL_VERSION {
        return Err(proto_err(format!("protocol version {} (this agent speaks {PROTOCOL_VERSION})", m.version)));
    }
    let want = m.fd_count();
    let mut fds = Vec::with_capacity(want);
    while fds.len() < want {
        let mut b = [0u8; 1];
        let mut iov = [io::IoSliceMut::new(&mut b)];
        let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS_PER_MESSAGE]);
        let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(io::Error::from)?;
        if msg.bytes == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "hand-over peer closed during the fds"));
        }
        let mut got = 0;
        for c in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for f in raw {
                    // SAFETY: the kernel installed this fd in our table for us (SCM_RIGHTS).
                    fds.push(unsafe { OwnedFd::from_raw_fd(f) });
                    got += 1;
                }
            }
        }
        if got == 0 || msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(proto_err("fd message without fds or truncated (RLIMIT_NOFILE?)"));
        }
    }
    if fds.len() != want {
        return Err(proto_err(format!("{} fds received, manifest says {want}", fds.len())));
    }
    Ok((m, fds))
}

/// A TAP queue fd received from the previous agent, with what its manifest said.
#[derive(Debug)]
pub struct ReceivedTap {
    /// Pool state in the previous agent (`Ready`, `Active`, `Cleaning`).
    pub state: String,
    /// ifindex in the dataplane netns (recovery checks it against the live TAP).
    pub ifindex: u32,
    /// The queue fd (checked with `TUNGETIFF`).
    pub fd: OwnedFd,
}

/// A checked offer: the listeners and the TAP fds by TAP name.
pub type Offer = (Vec<(ListenerKind, OwnedFd)>, HashMap<String, ReceivedTap>);

/// Splits a received offer into the listeners and the TAP fds by name, checking each TAP fd
/// with `TUNGETIFF` (its TAP's name) without reopening anything. Errors: an fd that is not a
/// queue of the TAP the manifest names, a TAP named twice.
pub fn split_offer(m: Manifest, fds: Vec<OwnedFd>) -> io::Result<Offer> {
    if fds.len() != m.fd_count() {
        return Err(proto_err(format!("{} fds for a manifest of {}", fds.len(), m.fd_count())));
    }
    let mut it = fds.into_iter();
    let listeners: Vec<_> = m.listeners.iter().zip(it.by_ref()).map(|(k, f)| (*k, f)).collect();
    let mut taps = HashMap::new();
    for t in m.taps.into_iter().filter(|t| t.has_fd) {
        let fd = it.next().ok_or_else(|| proto_err("fewer fds than the manifest"))?;
        verify_tap(&fd, &t.name).map_err(proto_err)?;
        let name = t.name.clone();
        if taps.insert(t.name, ReceivedTap { state: t.state, ifindex: t.ifindex, fd }).is_some() {
            return Err(proto_err(format!("TAP {name} is in the manifest twice")));
        }
    }
    Ok((listeners, taps))
}

/// Checks that a received TAP fd is a queue of `name` (`TUNGETIFF`), without reopening it.
pub fn verify_tap(fd: &OwnedFd, name: &str) -> Result<(), String> {
    use std::os::fd::AsFd;
    match cubenet_sys::tap::attached_name(fd.as_fd()) {
        Ok(n) if n == name => Ok(()),
        Ok(n) => Err(format!("fd for {name} is attached to {n}")),
        Err(e) => Err(format!("fd for {name}: {e}")),
    }
}

/// Successor side, steps 3 and 5: tells the old agent `READY` and waits for `STOPPED` (it no
/// longer accepts). Errors: the old agent answered `ABORT` (it keeps serving: this process
/// must exit). If the old agent's end closed without `ABORT`, or stays silent for
/// [`STOP_TIMEOUT`] after `READY`, it died or hangs after committing: the successor serves
/// anyway (`Ok(false)`) — it holds the same sockets and TAP queues.
pub fn commit(s: &UnixStream) -> io::Result<bool> {
    s.set_read_timeout(Some(STOP_TIMEOUT))?;
    if let Err(e) = (&*s).write_all(b"READY\n") {
        // An abort is written before the old agent closes: it is still readable here.
        return match read_line(s) {
            Ok(l) if l.starts_with("ABORT") => Err(proto_err(format!("the running agent aborted: {l}"))),
            _ => {
                tracing::warn!("hand-over: the previous agent is gone ({e}); serving");
                Ok(false)
            }
        };
    }
    match read_line(s) {
        Ok(l) if l == "STOPPED" => Ok(true),
        Ok(l) => Err(proto_err(format!("the running agent answered {l:?} to READY"))),
        Err(e) => {
            tracing::warn!("hand-over: no STOPPED from the previous agent ({e}); serving anyway");
            Ok(false)
        }
    }
}

/// How long the successor waits for `STOPPED` after `READY` (the old agent only has to stop
/// its accept loops).
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Stops the caller's accept loops; resolves when none is left (see `listeners::Acceptors`).
pub type StopAccepting = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Old side: answers hand-over requests on `listener` until one completes, then returns (the
/// caller finishes in-flight requests and exits). A refused, failed or aborted hand-over
/// reopens the gate and the agent keeps serving. `listeners` are the duplicates to pass;
/// `grpc_endpoint` is where mutations are forwarded once the successor is ready;
/// `stop_accepting` is called once, on `READY`.
pub async fn serve(
    listener: tokio::net::UnixListener,
    agent: Arc<Agent>,
    gate: Arc<MutationGate>,
    listeners: Arc<Vec<(ListenerKind, OwnedFd)>>,
    grpc_endpoint: String,
    stop_accepting: StopAccepting,
) {
    let mut stop_accepting = Some(stop_accepting);
    loop {
        let conn = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!("hand-over socket accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let conn = match conn.into_std().and_then(|c| c.set_nonblocking(false).map(|()| c)) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("hand-over connection: {e}");
                continue;
            }
        };
        if !peer_allowed(&conn) {
            let uid = nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials).map(|c| c.uid());
            tracing::warn!(?uid, "hand-over request from another user refused");
            continue;
        }
        let t = std::time::Instant::now();
        match offer(conn, &agent, &gate, &listeners, &grpc_endpoint, &mut stop_accepting).await {
            Ok(n) => {
                tracing::info!(taps = n, ms = t.elapsed().as_secs_f64() * 1e3, "handed over to the successor");
                return;
            }
            Err(e) => tracing::warn!("hand-over aborted, this agent keeps serving: {e}"),
        }
    }
}

async fn blocking<R: Send + 'static>(f: impl FnOnce() -> io::Result<R> + Send + 'static) -> io::Result<R> {
    tokio::task::spawn_blocking(f).await.map_err(io::Error::other)?
}

async fn offer(
    conn: UnixStream,
    agent: &Arc<Agent>,
    gate: &MutationGate,
    listeners: &Arc<Vec<(ListenerKind, OwnedFd)>>,
    grpc_endpoint: &str,
    stop_accepting: &mut Option<StopAccepting>,
) -> io::Result<usize> {
    conn.set_read_timeout(Some(STEP_TIMEOUT))?;
    conn.set_write_timeout(Some(STEP_TIMEOUT))?;
    let conn = Arc::new(conn);
    let c = conn.clone();
    let line = blocking(move || read_line(&c)).await?;
    if line != format!("BEGIN {PROTOCOL_VERSION}") {
        let c = conn.clone();
        let _ = blocking(move || {
            (&*c).write_all(format!("REFUSE this agent speaks BEGIN {PROTOCOL_VERSION}\n").as_bytes())
        })
        .await;
        return Err(proto_err(format!("expected BEGIN {PROTOCOL_VERSION}, got {line:?}: refused")));
    }
    // From here no mutation runs in this agent until the successor is ready or gave up.
    let guard = gate.close().await;
    gate.offering.store(true, Ordering::Release);
    tracing::info!("hand-over: mutations paused, sending listeners and TAP fds");
    let (taps, tap_fds) = agent.handover_taps();
    let n = taps.len();
    let manifest = Manifest { version: PROTOCOL_VERSION, listeners: listeners.iter().map(|(k, _)| *k).collect(), taps };
    let mut raw: Vec<RawFd> = listeners.iter().map(|(_, f)| f.as_raw_fd()).collect();
    raw.extend(tap_fds.iter().map(|f| f.as_raw_fd()));
    let c = conn.clone();
    let reply = blocking(move || {
        send_offer(&c, &manifest, &raw)?;
        // The fds stay open (the Arcs live here) until the successor has them.
        drop(tap_fds);
        read_line(&c)
    })
    .await;
    match reply {
        Ok(r) if r == "READY" => {
            // Commit: no accept here from now on, then mutations move to the successor.
            if let Some(stop) = stop_accepting.take() {
                stop().await;
            }
            gate.hand_over(Some(grpc_endpoint.to_string()));
            drop(guard);
            let c = conn.clone();
            if let Err(e) = blocking(move || (&*c).write_all(b"STOPPED\n")).await {
                tracing::warn!("hand-over: could not send STOPPED ({e}); the successor serves after its timeout");
            }
            Ok(n)
        }
        other => {
            let why = match other {
                Ok(r) => format!("successor said {r:?}"),
                Err(e) => e.to_string(),
            };
            let c = conn.clone();
            let msg = format!("ABORT {why}\n");
            let _ = blocking(move || (&*c).write_all(msg.as_bytes())).await;
            gate.offering.store(false, Ordering::Release);
            drop(guard);
            Err(proto_err(why))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offer_round_trip_batches_fds() {
        let (a, b) = UnixStream::pair().unwrap();
        // 300 fds: two SCM_RIGHTS messages (253 + 47).
        let files: Vec<std::fs::File> = (0..300).map(|_| std::fs::File::open("/dev/null").unwrap()).collect();
        let taps = (0..297)
            .map(|i| TapRecord {
                name: format!("z10.0.{}.{}", i / 256, i % 256),
                state: "Ready".into(),
                owner: None,
                ifindex: i,
                has_fd: true,
            })
            .collect();
        let m = Manifest {
            version: PROTOCOL_VERSION,
            listeners: vec![ListenerKind::GrpcUnix, ListenerKind::TapFd, ListenerKind::Health],
            taps,
        };
        let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        let sender = std::thread::spawn(move || send_offer(&a, &m, &raw).map(|()| m));
        let (got, fds) = recv_offer(&b).unwrap();
        assert_eq!(got, sender.join().unwrap().unwrap());
        assert_eq!(fds.len(), 300);
        let wrong = Manifest { version: PROTOCOL_VERSION, listeners: vec![], taps: vec![] };
        assert!(send_offer(&b, &wrong, &[0]).is_err(), "fd count must match the manifest");
    }

    #[test]
    fn other_versions_are_refused() {
        // A manifest claiming another version behind a correct OFFER line.
        let (a, b) = UnixStream::pair().unwrap();
        let json = br#"{"version":2,"listeners":[],"taps":[]}"#;
        (&a).write_all(b"OFFER 1\n").unwrap();
        (&a).write_all(&(json.len() as u32).to_le_bytes()).unwrap();
        (&a).write_all(json).unwrap();
        let e = recv_offer(&b).unwrap_err();
        assert!(e.to_string().contains("protocol version 2"), "{e}");
        // An OFFER of another version.
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(b"OFFER 7\n").unwrap();
        let e = recv_offer(&b).unwrap_err();
        assert!(e.to_string().contains("protocol version 7 offered"), "{e}");
        // A refusal is reported with its reason.
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(b"REFUSE this agent speaks BEGIN 1\n").unwrap();
        let e = recv_offer(&b).unwrap_err();
        assert!(e.to_string().contains("REFUSE this agent speaks BEGIN 1"), "{e}");
    }

    #[test]
    fn split_offer_checks_tap_fds() {
        // /dev/null is no TAP queue: TUNGETIFF fails and the offer is refused.
        let m = Manifest {
            version: PROTOCOL_VERSION,
            listeners: vec![ListenerKind::Health],
            taps: vec![TapRecord {
                name: "z10.0.0.2".into(),
                state: "Active".into(),
                owner: Some("sb".into()),
                ifindex: 7,
                has_fd: true,
            }],
        };
        let fds: Vec<OwnedFd> = (0..2).map(|_| std::fs::File::open("/dev/null").unwrap().into()).collect();
        let e = split_offer(m.clone(), fds).unwrap_err();
        assert!(e.to_string().contains("fd for z10.0.0.2"), "{e}");
        let one: Vec<OwnedFd> = vec![std::fs::File::open("/dev/null").unwrap().into()];
        assert!(split_offer(m, one).is_err(), "fd count must match the manifest");
    }

    #[test]
    fn commit_tells_abort_from_a_vanished_predecessor() {
        // STOPPED: committed.
        let (old, new) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            assert_eq!(read_line(&old).unwrap(), "READY");
            (&old).write_all(b"STOPPED\n").unwrap();
        });
        assert!(commit(&new).unwrap());
        t.join().unwrap();
        // ABORT written before the old agent closed: this successor must exit.
        let (old, new) = UnixStream::pair().unwrap();
        (&old).write_all(b"ABORT successor too slow\n").unwrap();
        drop(old);
        let e = commit(&new).unwrap_err();
        assert!(e.to_string().contains("ABORT successor too slow"), "{e}");
        // Closed without a word: the old agent is gone, serve.
        let (old, new) = UnixStream::pair().unwrap();
        drop(old);
        assert!(!commit(&new).unwrap());
    }

    #[tokio::test]
    async fn gate_waits_for_mutations_and_forwards_after_hand_over() {
        let gate = Arc::new(MutationGate::default());
        let Entry::Here(running) = gate.enter().await else { panic!("open gate") };
        let g = gate.clone();
        let closing = tokio::spawn(async move { g.close().await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!closing.is_finished(), "close must wait for the running mutation");
        drop(running);
        let closed = closing.await.unwrap();
        let g = gate.clone();
        let queued = tokio::spawn(async move { matches!(g.enter().await, Entry::Forward(e) if e == "unix:///s") });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!queued.is_finished(), "a mutation must queue while the gate is closed");
        assert!(!gate.sockets_shared());
        gate.hand_over(Some("unix:///s".into()));
        assert!(gate.sockets_shared());
        drop(closed);
        assert!(queued.await.unwrap(), "a queued mutation is forwarded after the hand-over");
        assert!(gate.handed_over());
    }
}
