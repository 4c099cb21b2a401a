//! Sockets: transparent listeners (`IP_TRANSPARENT`, `reference/upstream.md §4.1`) and the
//! listener handoff to a successor process over a Unix socket (SCM_RIGHTS).
//!
//! Handoff protocol (version 1): the successor connects to the predecessor's handoff socket;
//! the predecessor sends one message whose payload is `cube-egress-handoff v1\n` and whose
//! SCM_RIGHTS carries three listening fds in order HTTP, HTTPS, admin; it then stops accepting
//! and drains. The successor adopts the fds instead of binding.

use std::{
    io::{IoSlice, IoSliceMut},
    net::{SocketAddr, TcpListener},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::net::{UnixListener, UnixStream},
    },
    path::Path,
};

use anyhow::{Context, bail};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use socket2::{Domain, Protocol, Socket, Type};

/// Payload of a handoff message.
pub const HANDOFF_MAGIC: &[u8] = b"cube-egress-handoff v1\n";

/// The three listeners of a gateway process.
#[derive(Debug)]
pub struct Listeners {
    /// Transparent HTTP listener.
    pub http: TcpListener,
    /// Transparent HTTPS listener.
    pub https: TcpListener,
    /// Admin / metrics listener (not transparent).
    pub admin: TcpListener,
}

/// Binds a TCP listener on `addr` (backlog 4096, `SO_REUSEADDR`), with `IP_TRANSPARENT` when
/// `transparent` (needs CAP_NET_ADMIN; lets TPROXY deliver connections for any destination).
pub fn bind(addr: SocketAddr, transparent: bool) -> anyhow::Result<TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    if transparent {
        s.set_ip_transparent_v4(true).context("IP_TRANSPARENT (needs CAP_NET_ADMIN)")?;
    }
    s.bind(&addr.into()).with_context(|| format!("bind {addr}"))?;
    s.listen(4096)?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

/// Sends `listeners` to one successor connected on `conn`.
pub fn send_listeners(conn: &UnixStream, l: &Listeners) -> anyhow::Result<()> {
    let fds: [RawFd; 3] = [l.http.as_raw_fd(), l.https.as_raw_fd(), l.admin.as_raw_fd()];
    let iov = [IoSlice::new(HANDOFF_MAGIC)];
    sendmsg::<()>(conn.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
        .context("sendmsg SCM_RIGHTS")?;
    Ok(())
}

/// Connects to a predecessor's handoff socket and receives its listeners.
pub fn take_listeners(path: &Path) -> anyhow::Result<Listeners> {
    let conn = UnixStream::connect(path).with_context(|| format!("connect {}", path.display()))?;
    if !peer_allowed(&conn) {
        bail!("handoff socket {} is served by uid {:?}, not ours or root", path.display(), peer_uid(&conn).ok());
    }
    let mut buf = [0u8; 64];
    let mut iov = [IoSliceMut::new(&mut buf)];
    let mut cmsg = nix::cmsg_space!([RawFd; 3]);
    let msg =
        recvmsg::<()>(conn.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC).context("recvmsg")?;
    let n = msg.bytes;
    let mut fds = Vec::new();
    for c in msg.cmsgs().context("control messages")? {
        if let ControlMessageOwned::ScmRights(v) = c {
            fds.extend(v);
        }
    }
    // SAFETY: the kernel just installed these fds in our table; we own them from here on.
    let owned: Vec<OwnedFd> = fds.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }).collect();
    if &buf[..n] != HANDOFF_MAGIC || owned.len() != 3 {
        bail!("bad handoff message ({n} bytes, {} fds)", owned.len());
    }
    let mut it = owned.into_iter().map(|fd| {
        let l = TcpListener::from(fd);
        l.set_nonblocking(true).map(|_| l)
    });
    let l = Listeners {
        http: it.next().expect("3 fds")?,
        https: it.next().expect("3 fds")?,
        admin: it.next().expect("3 fds")?,
    };
    let admin = l.admin.local_addr()?;
    if !admin.ip().is_loopback() {
        bail!("handed-over admin listener {admin} is not on loopback");
    }
    Ok(l)
}

/// Binds the handoff Unix socket (replacing a stale file) with mode 0600: it is bound under a
/// temporary name, restricted, then renamed into place, so the path never exists with a wider
/// mode. Connections are still checked with [`peer_allowed`] (a file mode is not an identity).
pub fn handoff_listener(path: &Path) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let l = UnixListener::bind(&tmp).with_context(|| format!("bind {}", tmp.display()))?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("place handoff socket {}", path.display()));
    }
    l.set_nonblocking(true)?;
    Ok(l)
}

/// The uid of the process at the other end of a Unix socket (SO_PEERCRED).
pub fn peer_uid(conn: &UnixStream) -> anyhow::Result<u32> {
    let cred = nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::PeerCredentials).context("SO_PEERCRED")?;
    Ok(cred.uid())
}

/// Whether a handoff peer may receive or give listeners: it runs as our effective uid or as
/// root. Errors reading the credentials count as "no".
pub fn peer_allowed(conn: &UnixStream) -> bool {
    let me = nix::unistd::geteuid().as_raw();
    peer_uid(conn).is_ok_and(|uid| uid == me || uid == 0)
}
