//! The agent's three listening sockets (`grpc_listen`, `tap_fd_listen`, `health_listen`):
//! bound afresh, or adopted from the previous agent in a live upgrade (`crate::handover`), in
//! which case each handed-over socket must be the one the configuration names.

use std::{
    future::Future,
    net::SocketAddr,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use futures::{Stream, StreamExt};

use crate::{config::Config, handover::ListenerKind};

/// `grpc_listen` parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `unix://PATH`.
    Unix(PathBuf),
    /// `tcp://HOST:PORT` or `HOST:PORT`.
    Tcp(String),
}

/// Parses `unix://path`, `tcp://host:port` or `host:port` (`reference/upstream.md §1.1`).
pub fn parse_endpoint(s: &str) -> anyhow::Result<Endpoint> {
    if let Some(p) = s.strip_prefix("unix://") {
        return Ok(Endpoint::Unix(PathBuf::from(p)));
    }
    let hp = s.strip_prefix("tcp://").unwrap_or(s);
    if hp.rsplit_once(':').is_some_and(|(_, port)| port.parse::<u16>().is_ok()) {
        return Ok(Endpoint::Tcp(hp.to_string()));
    }
    bail!("config key `grpc_listen`: {s:?} is not unix://PATH, tcp://HOST:PORT or HOST:PORT")
}

/// The gRPC listener.
#[derive(Debug)]
pub enum GrpcListener {
    /// Unix socket.
    Unix(tokio::net::UnixListener),
    /// TCP.
    Tcp(tokio::net::TcpListener),
}

/// The listening sockets, plus a duplicate of each (same socket) to hand to a successor.
#[derive(Debug)]
pub struct Listeners {
    /// `grpc_listen`.
    pub grpc: GrpcListener,
    /// `tap_fd_listen`.
    pub tap_fd: tokio::net::UnixListener,
    /// `health_listen`.
    pub health: tokio::net::TcpListener,
    /// Duplicates in hand-over order.
    pub for_handover: Vec<(ListenerKind, OwnedFd)>,
}

/// Binds a Unix listener at `p` with mode 0600 (decision R40), plus an ACL for the
/// `allowed_peer_uids` ([`restrict`], R50): the parent directory must be trusted
/// ([`cubenet_sys::trusted_path`]); the socket is restricted right after the bind, whatever the
/// umask (a stranger who connects in between is still refused by [`peer_allowed`]). It is
/// bound in place, not renamed into place: a successor checks a handed-over socket's bound
/// name against its configuration.
fn bind_unix(p: &Path, uids: &[u32]) -> anyhow::Result<std::os::unix::net::UnixListener> {
    if let Some(d) = p.parent() {
        cubenet_sys::trusted_path::ensure_dir(d, "socket directory")?;
    }
    // A socket file someone still accepts on belongs to a running agent: never take it away
    // (only a dead one, left by a crash, is replaced).
    if std::os::unix::net::UnixStream::connect(p).is_ok() {
        bail!(
            "{} is served by a running process (another agent?): stop it, or start this agent with its \
             handover_socket to take over",
            p.display()
        );
    }
    let _ = std::fs::remove_file(p);
    let l = std::os::unix::net::UnixListener::bind(p).with_context(|| format!("bind {}", p.display()))?;
    restrict(p, uids)?;
    Ok(l)
}

/// Makes the socket file `p` connectable by its owner and `uids` only: mode 0600, plus a POSIX
/// ACL granting `uids` read/write when the list is not empty (removed when it is, so a socket
/// adopted from a predecessor follows this configuration). A filesystem without ACLs leaves the
/// file 0666 (logged): SO_PEERCRED ([`peer_allowed`]) is then the only check.
pub fn restrict(p: &Path, uids: &[u32]) -> anyhow::Result<()> {
    use cubenet_sys::socket_acl::Access;
    match cubenet_sys::socket_acl::restrict(p, uids).with_context(|| format!("restrict access to {}", p.display()))? {
        Access::WorldConnectable => tracing::warn!(
            socket = %p.display(),
            "no POSIX ACLs on this filesystem: socket is 0666 so allowed_peer_uids can connect; other users are refused at accept"
        ),
        Access::Acl => tracing::info!(socket = %p.display(), uids = ?uids, "socket open to allowed_peer_uids"),
        Access::OwnerOnly => {}
    }
    Ok(())
}

/// Whether a Unix-socket peer runs as root, as the agent's effective uid or as one of `uids`
/// (`allowed_peer_uids`; SO_PEERCRED, errors count as no). The gRPC and TAP fd sockets serve
/// only those (decisions R40, R50); the hand-over socket only root and our uid.
pub fn peer_allowed(conn: &tokio::net::UnixStream, uids: &[u32]) -> bool {
    cubenet_sys::peer_uid::unix_peer_allowed_with(conn, uids)
}

fn unix_at(fd: OwnedFd, want: &Path, key: &str) -> anyhow::Result<std::os::unix::net::UnixListener> {
    let l = std::os::unix::net::UnixListener::from(fd);
    let at = l.local_addr().with_context(|| format!("handed-over {key} socket"))?;
    if at.as_pathname() != Some(want) {
        bail!("handed-over {key} socket is bound to {:?}, the configuration says {}", at, want.display());
    }
    Ok(l)
}

/// What to do when a TCP listen address cannot be bound: `EADDRNOTAVAIL` means no interface of
/// the agent's namespace has the address — typically loopback still down in a new namespace.
fn addr_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::AddrNotAvailable => {
            " (no interface in the agent's network namespace has this address; in a new namespace \
             bring loopback up first: `ip link set lo up`)"
        }
        std::io::ErrorKind::AddrInUse => " (another process listens there: stop it or choose another port)",
        _ => "",
    }
}

/// `SO_NETNS_COOKIE` (Linux 5.14+, `include/uapi/asm-generic/socket.h`): the 64-bit cookie of
/// the network namespace a socket was created in.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// The network namespace cookie of `fd`'s socket; `None` when the kernel does not know the
/// option (before 5.14).
fn netns_cookie(fd: &impl std::os::fd::AsRawFd) -> Option<u64> {
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `v` and `len` outlive the call and `len` is `v`'s size.
    let rc = unsafe {
        libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, SO_NETNS_COOKIE, (&mut v as *mut u64).cast(), &mut len)
    };
    (rc == 0).then_some(v)
}

/// Whether a handed-over TCP listener lives in another network namespace than this process
/// (compared by `SO_NETNS_COOKIE` with a socket made here). A TCP address names a socket only
/// within one namespace: the predecessor's health socket in its own pod's namespace is of no
/// use to a successor in another pod (decision K16). Unknown (old kernel) = same.
pub fn from_other_netns(fd: &impl std::os::fd::AsRawFd) -> bool {
    let Ok(here) = std::net::UdpSocket::bind("127.0.0.1:0") else { return false };
    match (netns_cookie(fd), netns_cookie(&here)) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    }
}

/// A handed-over TCP listener from another network namespace is closed and `want` bound
/// afresh here (K16); one from this namespace must be bound to `want`.
fn tcp_at(fd: OwnedFd, want: &str, key: &str) -> anyhow::Result<std::net::TcpListener> {
    if from_other_netns(&fd) {
        drop(fd);
        let l = std::net::TcpListener::bind(want)
            .map_err(|e| anyhow::anyhow!("bind {key} {want}: {e}{}", addr_hint(&e)))?;
        tracing::info!(listen = %want, "{key}: the previous agent's socket is in another network namespace; bound afresh here");
        return Ok(l);
    }
    let l = std::net::TcpListener::from(fd);
    let at = l.local_addr().with_context(|| format!("handed-over {key} socket"))?;
    let want_addr: Option<SocketAddr> = want.parse().ok();
    if want_addr.is_some_and(|w| w != at) {
        bail!("handed-over {key} socket is bound to {at}, the configuration says {want}");
    }
    Ok(l)
}

impl Listeners {
    /// Binds all three afresh, replacing Unix socket files nobody accepts on. Errors: an address
    /// in use, a Unix socket a running process accepts on.
    pub fn bind(raw: &Config) -> anyhow::Result<Self> {
        let health = std::net::TcpListener::bind(&raw.health_listen)
            .map_err(|e| anyhow::anyhow!("bind health_listen {}: {e}{}", raw.health_listen, addr_hint(&e)))?;
        let grpc = match parse_endpoint(&raw.grpc_listen)? {
            Endpoint::Unix(p) => Either::Unix(bind_unix(&p, &raw.allowed_peer_uids)?),
            Endpoint::Tcp(a) => Either::Tcp(
                std::net::TcpListener::bind(&a)
                    .map_err(|e| anyhow::anyhow!("bind grpc_listen {a}: {e}{}", addr_hint(&e)))?,
            ),
        };
        let tap_fd = bind_unix(&raw.tap_fd_listen, &raw.allowed_peer_uids)?;
        Self::finish(grpc, tap_fd, health)
    }

    /// Adopts the previous agent's sockets: exactly one of each kind, each bound where this
    /// configuration says. A TCP listener (health, gRPC over TCP) from another network
    /// namespace (the predecessor runs in another pod) is bound afresh in this one instead.
    pub fn adopt(raw: &Config, fds: Vec<(ListenerKind, OwnedFd)>) -> anyhow::Result<Self> {
        let (mut grpc, mut tap_fd, mut health) = (None, None, None);
        let endpoint = parse_endpoint(&raw.grpc_listen)?;
        for (kind, fd) in fds {
            match (kind, &endpoint) {
                (ListenerKind::GrpcUnix, Endpoint::Unix(p)) if grpc.is_none() => {
                    let l = unix_at(fd, p, "grpc_listen")?;
                    restrict(p, &raw.allowed_peer_uids)?;
                    grpc = Some(Either::Unix(l))
                }
                (ListenerKind::GrpcTcp, Endpoint::Tcp(a)) if grpc.is_none() => {
                    grpc = Some(Either::Tcp(tcp_at(fd, a, "grpc_listen")?))
                }
                (ListenerKind::TapFd, _) if tap_fd.is_none() => {
                    let l = unix_at(fd, &raw.tap_fd_listen, "tap_fd_listen")?;
                    restrict(&raw.tap_fd_listen, &raw.allowed_peer_uids)?;
                    tap_fd = Some(l)
                }
                (ListenerKind::Health, _) if health.is_none() => {
                    health = Some(tcp_at(fd, &raw.health_listen, "health_listen")?)
                }
                (k, _) => bail!("handed-over listener {k:?} does not fit this configuration (or is repeated)"),
            }
        }
        match (grpc, tap_fd, health) {
            (Some(g), Some(t), Some(h)) => Self::finish(g, t, h),
            _ => bail!("the previous agent did not hand over all three listeners"),
        }
    }

    fn finish(
        grpc: Either,
        tap_fd: std::os::unix::net::UnixListener,
        health: std::net::TcpListener,
    ) -> anyhow::Result<Self> {
        let mut for_handover = Vec::with_capacity(3);
        let grpc = match grpc {
            Either::Unix(l) => {
                l.set_nonblocking(true)?;
                for_handover.push((ListenerKind::GrpcUnix, OwnedFd::from(l.try_clone()?)));
                GrpcListener::Unix(tokio::net::UnixListener::from_std(l)?)
            }
            Either::Tcp(l) => {
                l.set_nonblocking(true)?;
                for_handover.push((ListenerKind::GrpcTcp, OwnedFd::from(l.try_clone()?)));
                GrpcListener::Tcp(tokio::net::TcpListener::from_std(l)?)
            }
        };
        tap_fd.set_nonblocking(true)?;
        for_handover.push((ListenerKind::TapFd, OwnedFd::from(tap_fd.try_clone()?)));
        health.set_nonblocking(true)?;
        for_handover.push((ListenerKind::Health, OwnedFd::from(health.try_clone()?)));
        Ok(Self {
            grpc,
            tap_fd: tokio::net::UnixListener::from_std(tap_fd)?,
            health: tokio::net::TcpListener::from_std(health)?,
            for_handover,
        })
    }
}

enum Either {
    Unix(std::os::unix::net::UnixListener),
    Tcp(std::net::TcpListener),
}

/// Stops the accept loops of the listeners and tells when none is left (a hand-over commits
/// only then, so no connection is accepted by the old agent after the successor serves).
/// Each loop holds an [`AcceptToken`]; [`Acceptors::stop`] signals them and waits until every
/// token is dropped. Dropping `Acceptors` without `stop` leaves the loops running.
#[derive(Debug)]
pub struct Acceptors {
    stop: tokio::sync::watch::Sender<bool>,
    alive: Option<tokio::sync::mpsc::Sender<()>>,
    done: tokio::sync::mpsc::Receiver<()>,
}

/// Held by one accept loop; see [`Acceptors`].
#[derive(Debug)]
pub struct AcceptToken {
    stop: tokio::sync::watch::Receiver<bool>,
    _alive: tokio::sync::mpsc::Sender<()>,
}

impl Default for Acceptors {
    fn default() -> Self {
        let (alive, done) = tokio::sync::mpsc::channel(1);
        Self { stop: tokio::sync::watch::Sender::new(false), alive: Some(alive), done }
    }
}

impl Acceptors {
    /// A token for one more accept loop.
    pub fn token(&self) -> AcceptToken {
        AcceptToken {
            stop: self.stop.subscribe(),
            _alive: self.alive.clone().expect("tokens are handed out before stop"),
        }
    }

    /// Signals every loop to stop and resolves once all of them dropped their token.
    pub async fn stop(mut self) {
        self.stop.send_replace(true);
        self.alive.take();
        // `None` once every sender (token) is gone.
        let _ = self.done.recv().await;
    }
}

impl AcceptToken {
    /// Resolves when the loops are told to stop (never, if the [`Acceptors`] is dropped).
    pub async fn stopped(&mut self) {
        if self.stop.wait_for(|s| *s).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Counts requests in flight (each holds a token) so a stopping agent can wait for exactly
/// those instead of sleeping.
#[derive(Debug)]
pub struct InFlight {
    tx: tokio::sync::mpsc::Sender<()>,
    rx: tokio::sync::mpsc::Receiver<()>,
}

impl Default for InFlight {
    fn default() -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        Self { tx, rx }
    }
}

/// Held by one request in flight; see [`InFlight`].
#[derive(Debug)]
pub struct RequestToken(#[allow(dead_code)] tokio::sync::mpsc::Sender<()>);

/// Hands out [`RequestToken`]s (held by an accept loop; counts as in flight until dropped).
#[derive(Clone, Debug)]
pub struct TokenSource(tokio::sync::mpsc::Sender<()>);

impl TokenSource {
    /// A token for one more request.
    pub fn token(&self) -> RequestToken {
        RequestToken(self.0.clone())
    }
}

impl InFlight {
    /// A source of tokens for an accept loop.
    pub fn token_source(&self) -> TokenSource {
        TokenSource(self.tx.clone())
    }

    /// Waits until every token and token source is dropped, at most `limit`; returns whether
    /// they all were.
    pub async fn drained(self, limit: std::time::Duration) -> bool {
        let Self { tx, mut rx } = self;
        drop(tx);
        tokio::time::timeout(limit, rx.recv()).await.is_ok()
    }
}

/// Runs the accept loop `fut` until it ends or `token` says stop (then `None`; `fut`, with its
/// listener, is dropped before the token).
pub async fn until_stopped<F: Future>(mut token: AcceptToken, fut: F) -> Option<F::Output> {
    let r = tokio::select! {
        biased;
        _ = token.stopped() => None,
        r = fut => Some(r),
    };
    drop(token);
    r
}

/// A stream of accepted connections (for tonic's `serve_with_incoming`) that ends when
/// `token` says stop; the listener stream is dropped before the token.
pub fn incoming<S>(stream: S, token: AcceptToken) -> impl Stream<Item = S::Item>
where
    S: Stream + Unpin,
{
    futures::stream::unfold(Some((stream, token)), |state| async move {
        let (mut s, mut token) = state?;
        let item = tokio::select! {
            biased;
            _ = token.stopped() => None,
            i = s.next() => i,
        };
        match item {
            Some(i) => Some((i, Some((s, token)))),
            None => {
                drop(s);
                drop(token);
                None
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_listener_of_another_netns_is_rebound_here() {
        // Same namespace: adopted as is (and checked against the configuration).
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap().to_string();
        assert!(!from_other_netns(&l));
        let adopted = tcp_at(OwnedFd::from(l), &at, "health_listen").unwrap();
        assert_eq!(adopted.local_addr().unwrap().to_string(), at);
        // Another namespace (root only: unshare on a thread of its own, never a tokio worker).
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: tcp_listener_of_another_netns_is_rebound_here (other netns part): needs root");
            return;
        }
        let foreign = std::thread::spawn(|| {
            // SAFETY: plain syscall on this thread only.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare");
            std::net::TcpListener::bind("0.0.0.0:0").unwrap()
        })
        .join()
        .unwrap();
        assert!(from_other_netns(&foreign), "a listener from a new namespace must be told apart");
        let fresh = tcp_at(OwnedFd::from(foreign), "127.0.0.1:0", "health_listen").unwrap();
        assert!(!from_other_netns(&fresh), "the replacement is bound in this namespace");
        // The fresh socket accepts here.
        let to = fresh.local_addr().unwrap();
        std::net::TcpStream::connect(to).unwrap();
        assert!(fresh.accept().is_ok());
    }
}
