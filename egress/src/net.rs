//! Sockets: transparent listeners (`IP_TRANSPARENT`, `reference/upstream.md §4.1`) and the
//! handoff Unix socket with its peer check; the hand-over protocol itself is in
//! [`crate::handoff`].

use std::{
    net::{SocketAddr, TcpListener},
    os::unix::net::{UnixListener, UnixStream},
    path::Path,
};

use anyhow::Context;
use socket2::{Domain, Protocol, Socket, Type};

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

/// Binds the handoff Unix socket (replacing a stale file) with mode 0600: it is bound under a
/// temporary name, restricted, then renamed into place, so the path never exists with a wider
/// mode. Connections are still checked with [`peer_allowed`] (a file mode is not an identity).
/// Errors: also a directory on the path another user controls (decision R44: that user could
/// swap the socket for theirs, and a successor would hand its listeners to them).
pub fn handoff_listener(path: &Path) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        cubenet_sys::trusted_path::ensure_dir(dir, "handoff_socket directory")?;
    }
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
    cubenet_sys::peer_uid::unix_peer_uid(conn).context("SO_PEERCRED")
}

/// Whether a handoff peer may receive or give listeners: it runs as our effective uid or as
/// root. Errors reading the credentials count as "no".
pub fn peer_allowed(conn: &UnixStream) -> bool {
    cubenet_sys::peer_uid::unix_peer_allowed(conn)
}
