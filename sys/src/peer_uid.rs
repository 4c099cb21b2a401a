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

/// Whether `uid` is trusted: root or this process's effective uid.
pub fn allowed(uid: Option<u32>) -> bool {
    uid.is_some_and(|u| u == 0 || u == nix::unistd::geteuid().as_raw())
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
