//! Live upgrade hand-over: a new agent takes the running agent's listening sockets and TAP
//! queue fds over a Unix socket (`handover_socket`, mode 0600, peer uid checked with
//! SO_PEERCRED), so no listener is rebound, no TAP is reopened (`TUNSETIFF`) and requests that
//! arrive meanwhile wait in the shared kernel backlog instead of being refused.
//!
//! Protocol (version [`PROTOCOL_VERSION`]), on one `SOCK_STREAM` connection:
//!
//! 1. successor → old: `BEGIN <version>\n`.
//! 2. old: closes its [`MutationGate`] (waits for running Ensure/Release/Reconcile calls and the
//!    maintenance pass; later ones queue), then sends a 4-byte little-endian length and the
//!    [`Manifest`] JSON, then the fds in manifest order (listeners, then TAPs) in messages of
//!    one byte `F` carrying at most [`MAX_FDS_PER_MESSAGE`] fds each (SCM_RIGHTS limit 253).
//! 3. successor: checks every fd (listener address matches its config, `TUNGETIFF` name of each
//!    TAP fd matches the manifest), recovers from the state files with the received fds and
//!    starts serving on the received listeners, then sends `READY\n`. Any failure, or closing
//!    the connection, is an abort: the old agent opens the gate and keeps serving.
//! 4. old, on `READY`: marks the gate handed over (queued and later mutations are forwarded to
//!    the successor over `grpc_listen`), stops accepting, finishes in-flight requests and exits
//!    without removing the socket files.

use std::{
    io::{self, Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::net::{UnixListener, UnixStream},
    },
    path::Path,
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

/// Reads one `\n`-terminated line of at most 64 bytes.
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
        if out.len() > 64 {
            return Err(proto_err("line too long"));
        }
    }
}

/// Old side, step 2: sends the manifest and `fds` (exactly [`Manifest::fd_count`], in order).
pub fn send_offer(s: &UnixStream, manifest: &Manifest, fds: &[RawFd]) -> io::Result<()> {
    if fds.len() != manifest.fd_count() {
        return Err(proto_err(format!("{} fds for a manifest of {}", fds.len(), manifest.fd_count())));
    }
    let json = serde_json::to_vec(manifest).map_err(|e| proto_err(e.to_string()))?;
    let mut w = s;
    w.write_all(&(json.len() as u32).to_le_bytes())?;
    w.write_all(&json)?;
    for chunk in fds.chunks(MAX_FDS_PER_MESSAGE) {
        let iov = [io::IoSlice::new(b"F")];
        let cmsg = [ControlMessage::ScmRights(chunk)];
        sendmsg::<()>(s.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None).map_err(io::Error::from)?;
    }
    Ok(())
}

/// Successor side, step 2: receives the manifest and its fds (close-on-exec).
pub fn recv_offer(s: &UnixStream) -> io::Result<(Manifest, Vec<OwnedFd>)> {
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

/// Checks that a received TAP fd is a queue of `name` (`TUNGETIFF`), without reopening it.
pub fn verify_tap(fd: &OwnedFd, name: &str) -> Result<(), String> {
    use std::os::fd::AsFd;
    match cubenet_sys::tap::attached_name(fd.as_fd()) {
        Ok(n) if n == name => Ok(()),
        Ok(n) => Err(format!("fd for {name} is attached to {n}")),
        Err(e) => Err(format!("fd for {name}: {e}")),
    }
}

/// Old side: answers hand-over requests on `listener` until one completes, then returns (the
/// caller stops accepting and exits). A failed or aborted hand-over reopens the gate and the
/// agent keeps serving. `listeners` are the duplicates to pass; `grpc_endpoint` is where
/// mutations are forwarded once the successor is ready.
pub async fn serve(
    listener: tokio::net::UnixListener,
    agent: Arc<Agent>,
    gate: Arc<MutationGate>,
    listeners: Arc<Vec<(ListenerKind, OwnedFd)>>,
    grpc_endpoint: String,
) {
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
            tracing::warn!("hand-over request from another user refused");
            continue;
        }
        let t = std::time::Instant::now();
        match offer(conn, &agent, &gate, &listeners, &grpc_endpoint).await {
            Ok(n) => {
                tracing::info!(taps = n, ms = t.elapsed().as_secs_f64() * 1e3, "handed over to the successor");
                return;
            }
            Err(e) => tracing::warn!("hand-over aborted, this agent keeps serving: {e}"),
        }
    }
}

async fn offer(
    conn: UnixStream,
    agent: &Arc<Agent>,
    gate: &MutationGate,
    listeners: &Arc<Vec<(ListenerKind, OwnedFd)>>,
    grpc_endpoint: &str,
) -> io::Result<usize> {
    conn.set_read_timeout(Some(STEP_TIMEOUT))?;
    conn.set_write_timeout(Some(STEP_TIMEOUT))?;
    let conn = Arc::new(conn);
    let c = conn.clone();
    let line = tokio::task::spawn_blocking(move || read_line(&c)).await.map_err(io::Error::other)??;
    if line != format!("BEGIN {PROTOCOL_VERSION}") {
        return Err(proto_err(format!("expected BEGIN {PROTOCOL_VERSION}, got {line:?}")));
    }
    // From here no mutation runs in this agent until the successor is ready or gave up.
    let guard = gate.close().await;
    tracing::info!("hand-over: mutations paused, sending listeners and TAP fds");
    let (taps, tap_fds) = agent.handover_taps();
    let n = taps.len();
    let manifest =
        Manifest { version: PROTOCOL_VERSION, listeners: listeners.iter().map(|(k, _)| *k).collect(), taps };
    let mut raw: Vec<RawFd> = listeners.iter().map(|(_, f)| f.as_raw_fd()).collect();
    raw.extend(tap_fds.iter().map(|f| f.as_raw_fd()));
    let c = conn.clone();
    let reply = tokio::task::spawn_blocking(move || {
        send_offer(&c, &manifest, &raw)?;
        // The fds stay open (the Arcs live here) until the successor has them.
        drop(tap_fds);
        read_line(&c)
    })
    .await
    .map_err(io::Error::other)?;
    match reply {
        Ok(r) if r == "READY" => {
            gate.hand_over(Some(grpc_endpoint.to_string()));
            drop(guard);
            Ok(n)
        }
        Ok(r) => Err(proto_err(format!("successor said {r:?}"))),
        Err(e) => Err(e),
    }
}

/// Successor side, last step: tells the old agent to stop accepting and exit.
pub fn ready(s: &UnixStream) -> io::Result<()> {
    (&*s).write_all(b"READY\n")
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
        let (a, b) = UnixStream::pair().unwrap();
        let json = br#"{"version":2,"listeners":[],"taps":[]}"#;
        (&a).write_all(&(json.len() as u32).to_le_bytes()).unwrap();
        (&a).write_all(json).unwrap();
        let e = recv_offer(&b).unwrap_err();
        assert!(e.to_string().contains("protocol version 2"), "{e}");
    }
}
