//! The uid owning a loopback TCP client's socket, from the kernel's socket tables
//! (`/proc/thread-self/net/tcp` and `tcp6`, as seen from the listener's namespace): a TCP
//! peer has no SO_PEERCRED, but on loopback its socket is in the same table as ours. The
//! agent's `/v1/` dumps (one of them with every sandbox's injection secrets, decision R42) and
//! CubeEgress's admin API (R43) are served only to root and the server's own uid, not to
//! every local process.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Parses `ADDR:PORT` of a `/proc/net/tcp{,6}` row: the address as 1 or 4 native-endian
/// 32-bit words in hex, the port as big-endian hex.
fn parse_endpoint(s: &str) -> Option<SocketAddr> {
    let (addr, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| u32::from_str_radix(addr.get(i * 8..i * 8 + 8)?, 16).ok().map(u32::to_ne_bytes);
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip.to_canonical(), port))
}

/// The uid of the socket whose local end is `peer` and remote end `local` in `table` (the
/// text of `/proc/net/tcp` or `tcp6`); IPv4-mapped addresses match their IPv4 form.
pub fn find_uid(table: &str, peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let (peer, local) = (canon(peer), canon(local));
    table.lines().skip(1).find_map(|row| {
        let f: Vec<&str> = row.split_whitespace().collect();
        let (l, r) = (parse_endpoint(f.get(1)?)?, parse_endpoint(f.get(2)?)?);
        (l == peer && r == local).then(|| f.get(7)?.parse().ok()).flatten()
    })
}

/// The uid owning the client socket of the connection `peer` → `local`, reading the tables
/// with `read` (in the listener's namespace). `None` when it is not found (not loopback, gone).
pub fn owner(
    peer: SocketAddr,
    local: SocketAddr,
    read: impl Fn(&std::path::Path) -> std::io::Result<String>,
) -> Option<u32> {
    ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"]
        .iter()
        .find_map(|p| find_uid(&read(std::path::Path::new(p)).ok()?, peer, local))
}

/// `SOCK_DIAG_BY_FAMILY` (`linux/sock_diag.h`).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `INET_DIAG_NOCOOKIE`.
const NOCOOKIE: u32 = !0;

/// The uid owning the TCP socket `peer` → `local` (the client's end of a connection we
/// accepted), asked from the kernel with one exact `NETLINK_SOCK_DIAG` lookup in the calling
/// thread's namespace: O(1), where the `/proc` table costs O(sockets). `Ok(None)` when the
/// kernel has no such socket.
///
/// Request: `nlmsghdr` (16 bytes) + `inet_diag_req_v2` (56 bytes: family, protocol, ext, pad,
/// states u32, then `inet_diag_sockid`: sport/dport big-endian u16, src/dst as 4 big-endian
/// u32 words, ifindex u32, cookie 2×u32 = `INET_DIAG_NOCOOKIE`). Reply: `inet_diag_msg`, whose
/// `idiag_uid` is at offset 64 (4 + 48-byte sockid + expires, rqueue, wqueue).
// Built by hand rather than with netlink-packet-sock-diag: one fixed 72-byte request and one u32
// read from the reply, in a crate that otherwise depends only on libc/nix.
pub fn owner_by_diag(peer: SocketAddr, local: SocketAddr) -> std::io::Result<Option<u32>> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let (peer, local) = (
        SocketAddr::new(peer.ip().to_canonical(), peer.port()),
        SocketAddr::new(local.ip().to_canonical(), local.port()),
    );
    let addr_bytes = |ip: IpAddr| -> [u8; 16] {
        let mut b = [0u8; 16];
        match ip {
            IpAddr::V4(v4) => b[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => b.copy_from_slice(&v6.octets()),
        }
        b
    };
    let family = match (peer.ip(), local.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET as u8,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6 as u8,
        _ => return Ok(None),
    };
    let mut req = Vec::with_capacity(72);
    req.extend_from_slice(&72u32.to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // seq
    req.extend_from_slice(&0u32.to_ne_bytes()); // pid
    req.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    req.extend_from_slice(&(!0u32).to_ne_bytes()); // every state
    req.extend_from_slice(&peer.port().to_be_bytes());
    req.extend_from_slice(&local.port().to_be_bytes());
    req.extend_from_slice(&addr_bytes(peer.ip()));
    req.extend_from_slice(&addr_bytes(local.ip()));
    req.extend_from_slice(&0u32.to_ne_bytes()); // ifindex
    req.extend_from_slice(&NOCOOKIE.to_ne_bytes());
    req.extend_from_slice(&NOCOOKIE.to_ne_bytes());
    debug_assert_eq!(req.len(), 72);
    // SAFETY: plain syscalls on a socket we own; buffers outlive the calls.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned here.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `req` is a valid buffer of its length.
    if unsafe { libc::send(sock.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut buf = [0u8; 8192];
    // SAFETY: `buf` is a valid writable buffer of its length.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let msg = &buf[..n as usize];
    if msg.len() < 16 {
        return Ok(None);
    }
    let kind = u16::from_ne_bytes([msg[4], msg[5]]);
    if kind != SOCK_DIAG_BY_FAMILY || msg.len() < 16 + 68 {
        // NLMSG_ERROR: no such socket (ENOENT) or a kernel without the lookup.
        return Ok(None);
    }
    let at = 16 + 64;
    Ok(Some(u32::from_ne_bytes([msg[at], msg[at + 1], msg[at + 2], msg[at + 3]])))
}

/// [`owner_by_diag`], falling back to the `/proc` tables of the calling thread's namespace when
/// the kernel answers nothing (no `tcp_diag`/`inet_diag` module, for one).
pub fn owner_here(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    match owner_by_diag(peer, local) {
        Ok(Some(uid)) => Some(uid),
        _ => owner(peer, local, |p| std::fs::read_to_string(p)),
    }
}

/// Whether `uid` is trusted: root or this process's effective uid.
pub fn allowed(uid: Option<u32>) -> bool {
    allowed_with(uid, &[])
}

/// Whether `uid` is root, this process's effective uid, or one of `extra` (an operator's
/// `allowed_peer_uids`, decision R50).
pub fn allowed_with(uid: Option<u32>, extra: &[u32]) -> bool {
    uid.is_some_and(|u| u == 0 || u == nix::unistd::geteuid().as_raw() || extra.contains(&u))
}

/// The uid of the process at the other end of a Unix stream socket (SO_PEERCRED).
pub fn unix_peer_uid(conn: &impl std::os::fd::AsFd) -> nix::Result<u32> {
    nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::PeerCredentials).map(|c| c.uid())
}

/// Whether the peer of a Unix stream socket is trusted ([`allowed`]); an error reading its
/// credentials counts as no. The agent's gRPC, TAP fd and hand-over sockets (R40, H-series)
/// and CubeEgress's handoff socket (E16) serve only such peers.
pub fn unix_peer_allowed(conn: &impl std::os::fd::AsFd) -> bool {
    allowed(unix_peer_uid(conn).ok())
}

/// [`unix_peer_allowed`], also admitting the uids of `extra` ([`allowed_with`]): the agent's
/// gRPC and TAP fd sockets with `allowed_peer_uids` (R50).
pub fn unix_peer_allowed_with(conn: &impl std::os::fd::AsFd, extra: &[u32]) -> bool {
    allowed_with(unix_peer_uid(conn).ok(), extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:4A92 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:C350 0100007F:4A92 01 00000000:00000000 00:00000000 00000000 65534        0 2 1 0 20 4 30 10 -1
   2: 0100007F:4A92 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 20 4 30 10 -1
";

    #[test]
    fn finds_the_client_socket_owner() {
        let agent: SocketAddr = "127.0.0.1:19090".parse().unwrap();
        let client: SocketAddr = "127.0.0.1:50000".parse().unwrap();
        assert_eq!(find_uid(TCP, client, agent), Some(65534));
        // The agent's own end of the same connection is not the client.
        assert_eq!(find_uid(TCP, agent, client), Some(0));
        // A dual-stack listener sees the client as ::ffff:127.0.0.1.
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:50000".parse().unwrap();
        let agent6: SocketAddr = "[::ffff:127.0.0.1]:19090".parse().unwrap();
        assert_eq!(find_uid(TCP, mapped, agent6), Some(65534));
        assert_eq!(find_uid(TCP, "127.0.0.1:50001".parse().unwrap(), agent), None);
        assert!(!allowed(Some(65534)) && allowed(Some(0)) && !allowed(None));
        assert!(allowed_with(Some(65534), &[1001, 65534]) && !allowed_with(Some(65533), &[65534]));
        assert!(allowed_with(Some(0), &[]) && !allowed_with(None, &[65534]));
    }

    #[test]
    fn diag_finds_our_own_loopback_client() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_s, peer) = l.accept().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(owner_by_diag(peer, l.local_addr().unwrap()).unwrap(), Some(me));
        // The same answer as the `/proc` table.
        assert_eq!(owner(peer, l.local_addr().unwrap(), |p| std::fs::read_to_string(p)), Some(me));
        drop(c);
        let gone: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(owner_by_diag(gone, l.local_addr().unwrap()).unwrap(), None);
    }

    #[test]
    fn parses_ipv6_rows() {
        // ::1 port 19090, as the kernel prints it on little-endian machines.
        let e = parse_endpoint("00000000000000000000000001000000:4A92").unwrap();
        if cfg!(target_endian = "little") {
            assert_eq!(e, "[::1]:19090".parse().unwrap());
        }
    }
}
