//! Abort every TCP socket of the calling thread's network namespace whose peer is one of some
//! IPv4 addresses (`SOCK_DESTROY`, what `ss -K dst ADDR` does; kernel
//! `CONFIG_INET_DIAG_DESTROY`).
//!
//! The agent calls it when a sandbox is released (decision R72): a released sandbox's mvm IP
//! goes to the next sandbox on its TAP, and CubeVS delivers whatever a host socket sends to the
//! address's current holder. A node process's connection to the old sandbox, whose data nobody
//! acknowledges any more, would otherwise be retransmitted to the new one for up to
//! `tcp_retries2` (~15 minutes). An aborted socket sends a RST, drops its queues, and its
//! owner's next call fails with `ECONNABORTED`.
//!
//! Wire format (`linux/inet_diag.h`, `linux/sock_diag.h`): `nlmsghdr` (16 bytes) +
//! `inet_diag_req_v2` (56 bytes: family, protocol, ext, pad, states u32, then the 48-byte
//! `inet_diag_sockid`: sport/dport big-endian u16, src/dst as 16 bytes each (IPv4 in the first
//! 4), ifindex u32, cookie 2×u32). A dump (`SOCK_DIAG_BY_FAMILY` + `NLM_F_DUMP`) answers one
//! `inet_diag_msg` per socket (family, state, timer, retrans, then that sockid at offset 4);
//! `SOCK_DESTROY` takes the same request naming one socket by its sockid, cookie included.
// Built by hand as `peer_uid::owner_by_diag` is: fixed-size records, libc only.

use std::{
    io,
    net::Ipv4Addr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

/// `SOCK_DIAG_BY_FAMILY`.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `SOCK_DESTROY`.
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const HDR: usize = 16;
const REQ_LEN: usize = HDR + 56;
/// Offset of `inet_diag_sockid` in `inet_diag_msg` and of the end of the message we read.
const MSG_ID: usize = 4;
const MSG_MIN: usize = MSG_ID + 48;

/// `INET_DIAG_REQ_BYTECODE`: the dump request's attribute carrying a filter program.
const INET_DIAG_REQ_BYTECODE: u16 = 1;
/// `INET_DIAG_BC_D_COND`: "the remote address is in this prefix (and port, -1 = any)".
const INET_DIAG_BC_D_COND: u8 = 8;
/// `INET_DIAG_BC_JMP`: jump `no` bytes ahead.
const INET_DIAG_BC_JMP: u8 = 1;
/// One peer's part of the filter: a `D_COND` op (`inet_diag_bc_op` 4 bytes +
/// `inet_diag_hostcond` 8 + the IPv4 address 4) and a `JMP` op (4).
const PEER_LEN: usize = 20;
/// Peers per dump: each socket runs the filter op by op, so larger sets are split into
/// several dumps (the attribute's length is a u16 as well).
const PEERS_PER_DUMP: usize = 256;

/// TCP states that hold data for a peer: every state but LISTEN (10), TIME_WAIT (6) and
/// CLOSE (7) (`include/net/tcp_states.h`; bit n = state n).
const STATES: u32 = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 4) | (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11);

fn request(kind: u16, flags: u16, seq: u32, states: u32, id: &[u8; 48]) -> Vec<u8> {
    let mut req = Vec::with_capacity(REQ_LEN);
    req.extend_from_slice(&(REQ_LEN as u32).to_ne_bytes());
    req.extend_from_slice(&kind.to_ne_bytes());
    req.extend_from_slice(&flags.to_ne_bytes());
    req.extend_from_slice(&seq.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&[libc::AF_INET as u8, libc::IPPROTO_TCP as u8, 0, 0]);
    req.extend_from_slice(&states.to_ne_bytes());
    req.extend_from_slice(id);
    req
}

fn diag_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned right below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn send(sock: &OwnedFd, req: &[u8]) -> io::Result<()> {
    // SAFETY: `req` is a valid buffer of its length.
    if unsafe { libc::send(sock.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn recv(sock: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a valid writable buffer of its length.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The dump request for the TCP sockets whose remote address is one of `peers` (1 to
/// [`PEERS_PER_DUMP`]): the request with an `INET_DIAG_REQ_BYTECODE` attribute holding a
/// filter, so the kernel copies only the matching sockets (the node's other sockets,
/// CubeEgress's included, cost a filter run each, not a message). Per peer, a `D_COND` op
/// {AF_INET, prefix 32, pad 2, port -1 (any), address big-endian} whose match jumps `yes` =
/// 16 to a `JMP` op that jumps `no` = the bytes left (exactly off the end: accept), and whose
/// mismatch jumps `no` = 20 to the next peer's op (the last one's 24: past the end, reject).
/// `yes` is a u8, so the far jump is the `JMP`'s u16 `no`; every jump target is an op
/// boundary on the `yes` walk, as `inet_diag_bc_audit` requires.
fn dump_request(peers: &[Ipv4Addr]) -> Vec<u8> {
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    let mut req = request(SOCK_DIAG_BY_FAMILY, flags, 1, STATES, &[0; 48]);
    let filter_len = PEER_LEN * peers.len();
    req.extend_from_slice(&((4 + filter_len) as u16).to_ne_bytes());
    req.extend_from_slice(&INET_DIAG_REQ_BYTECODE.to_ne_bytes());
    for (i, peer) in peers.iter().enumerate() {
        let no = if i + 1 == peers.len() { PEER_LEN + 4 } else { PEER_LEN };
        req.extend_from_slice(&[INET_DIAG_BC_D_COND, 16]);
        req.extend_from_slice(&(no as u16).to_ne_bytes());
        req.extend_from_slice(&[libc::AF_INET as u8, 32, 0, 0]);
        req.extend_from_slice(&(-1i32).to_ne_bytes());
        req.extend_from_slice(&peer.octets());
        let to_end = filter_len - i * PEER_LEN - 16;
        req.extend_from_slice(&[INET_DIAG_BC_JMP, 4]);
        req.extend_from_slice(&(to_end as u16).to_ne_bytes());
    }
    let len = req.len() as u32;
    req[0..4].copy_from_slice(&len.to_ne_bytes());
    req
}

/// The netlink messages in `buf` as (type, payload).
fn messages(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut at = 0usize;
    std::iter::from_fn(move || {
        let h = buf.get(at..at + HDR)?;
        let len = u32::from_ne_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let kind = u16::from_ne_bytes([h[4], h[5]]);
        if len < HDR || at + len > buf.len() {
            return None;
        }
        let payload = &buf[at + HDR..at + len];
        at += (len + 3) & !3;
        Some((kind, payload))
    })
}

/// The `errno` of an `NLMSG_ERROR` payload (0 = an ACK).
fn nl_errno(payload: &[u8]) -> i32 {
    payload.get(..4).map(|b| -i32::from_ne_bytes([b[0], b[1], b[2], b[3]])).unwrap_or(0)
}

/// The sockids of every TCP socket (states [`STATES`]) whose remote address is one of
/// `peers` (1 to [`PEERS_PER_DUMP`]), and how many socket messages the kernel sent (the
/// filter's proof: equal to the matches).
fn dump(sock: &OwnedFd, peers: &[Ipv4Addr]) -> io::Result<(Vec<[u8; 48]>, usize)> {
    send(sock, &dump_request(peers))?;
    let mut found = Vec::new();
    let mut sent = 0;
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = recv(sock, &mut buf)?;
        if n == 0 {
            return Ok((found, sent));
        }
        for (kind, p) in messages(&buf[..n]) {
            match kind {
                NLMSG_DONE => return Ok((found, sent)),
                NLMSG_ERROR => return Err(io::Error::from_raw_os_error(nl_errno(p))),
                SOCK_DIAG_BY_FAMILY if p.len() >= MSG_MIN && p[0] == libc::AF_INET as u8 => {
                    sent += 1;
                    let id: [u8; 48] = p[MSG_ID..MSG_ID + 48].try_into().expect("48 bytes");
                    // sockid: sport 0..2, dport 2..4, src 4..20, dst 20..36. The kernel's
                    // filter already matched; checked again so a kernel that ignored it
                    // never makes us abort another peer's socket.
                    let dst = Ipv4Addr::new(id[20], id[21], id[22], id[23]);
                    if peers.contains(&dst) {
                        found.push(id);
                    }
                }
                _ => {}
            }
        }
    }
}

/// Aborts every TCP socket of the calling thread's namespace connected to one of `peers`
/// (any port, any local address), in every state but LISTEN, TIME_WAIT and CLOSE. One dump per
/// [`PEERS_PER_DUMP`] peers: the kernel walks its whole established hash (262,144 buckets on a
/// 24 GiB machine, ~1-2 ms of CPU) for each dump whatever the filter, so callers batch the
/// addresses of many released sandboxes into one call. Returns how many were aborted (a socket
/// that closed meanwhile is not counted); no peers: nothing, no syscall.
///
/// Errors: the sock_diag socket cannot be opened or dumped, or the kernel refuses to destroy
/// (`EOPNOTSUPP` without `CONFIG_INET_DIAG_DESTROY`, `EPERM` without `CAP_NET_ADMIN`).
pub fn abort_tcp_to(peers: &[Ipv4Addr]) -> io::Result<usize> {
    if peers.is_empty() {
        return Ok(0);
    }
    let sock = diag_socket()?;
    let mut ids = Vec::new();
    for chunk in peers.chunks(PEERS_PER_DUMP) {
        ids.extend(dump(&sock, chunk)?.0);
    }
    let mut aborted = 0;
    let mut buf = [0u8; 4096];
    for (i, id) in ids.iter().enumerate() {
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
        send(&sock, &request(SOCK_DESTROY, flags, 2 + i as u32, !0, id))?;
        let n = recv(&sock, &mut buf)?;
        let errno = messages(&buf[..n]).find(|(k, _)| *k == NLMSG_ERROR).map(|(_, p)| nl_errno(p)).unwrap_or(0);
        match errno {
            0 => aborted += 1,
            libc::ENOENT => {}
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
    Ok(aborted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_the_kernel_layout() {
        let mut id = [0u8; 48];
        id[20..24].copy_from_slice(&[192, 168, 0, 2]);
        let r = request(SOCK_DESTROY, 5, 7, !0, &id);
        assert_eq!(r.len(), 72);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 72);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), SOCK_DESTROY);
        assert_eq!(r[16..18], [libc::AF_INET as u8, libc::IPPROTO_TCP as u8]);
        assert_eq!(r[24 + 20..24 + 24], [192, 168, 0, 2]);
    }

    #[test]
    fn the_dump_carries_a_remote_address_filter_the_kernel_accepts() {
        let peers = [Ipv4Addr::new(192, 168, 0, 2), Ipv4Addr::new(192, 168, 0, 9)];
        let r = dump_request(&peers);
        assert_eq!(r.len(), 72 + 4 + 2 * PEER_LEN);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()) as usize, r.len());
        // rtattr {len 44, type INET_DIAG_REQ_BYTECODE}.
        assert_eq!(u16::from_ne_bytes([r[72], r[73]]), 44);
        assert_eq!(u16::from_ne_bytes([r[74], r[75]]), INET_DIAG_REQ_BYTECODE);
        let f = &r[76..];
        // Peer 0: D_COND yes 16 (its JMP), no 20 (peer 1); JMP to the end (40 - 16 = 24).
        assert_eq!(f[0..2], [INET_DIAG_BC_D_COND, 16]);
        assert_eq!(u16::from_ne_bytes([f[2], f[3]]), 20);
        assert_eq!(f[4..8], [libc::AF_INET as u8, 32, 0, 0]);
        assert_eq!(i32::from_ne_bytes(f[8..12].try_into().unwrap()), -1);
        assert_eq!(f[12..16], [192, 168, 0, 2]);
        assert_eq!(f[16..18], [INET_DIAG_BC_JMP, 4]);
        assert_eq!(u16::from_ne_bytes([f[18], f[19]]), 24);
        // Peer 1 (last): mismatch jumps past the end (24 > the 20 left): reject.
        assert_eq!(u16::from_ne_bytes([f[22], f[23]]), 24);
        assert_eq!(f[32..36], [192, 168, 0, 9]);
        assert_eq!(u16::from_ne_bytes([f[38], f[39]]), 4);
    }

    /// Real kernel, this process's namespace, loopback only, read-only (nothing is aborted):
    /// connections to 127.0.0.2, .3 and .4; the dump for {.2, .4} gets those to .2 and .4 and
    /// the kernel sends nothing else (its filter ran, not only ours).
    #[test]
    fn the_kernel_filters_the_dump_by_peer() {
        use std::net::{TcpListener, TcpStream};
        let pair = |ip: &str| {
            let l = TcpListener::bind((ip, 0)).expect("bind loopback");
            let port = l.local_addr().unwrap().port();
            let c = TcpStream::connect((ip, port)).expect("connect");
            let (s, _) = l.accept().expect("accept");
            (port, c, s)
        };
        let (p2, _c2, _s2) = pair("127.0.0.2");
        let (p3, _c3, _s3) = pair("127.0.0.3");
        let (p4, _c4, _s4) = pair("127.0.0.4");
        let sock = diag_socket().expect("sock_diag socket");
        let peers = [Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 4)];
        let (found, sent) = dump(&sock, &peers).expect("dump");
        assert_eq!(found.len(), sent, "the kernel sent sockets of other peers");
        // At least the client sockets (their remote port is the listener's); an accepted one
        // peers with whatever source address the kernel chose for its client.
        let dport = |id: &[u8; 48]| u16::from_be_bytes([id[2], id[3]]);
        assert!(found.iter().any(|id| dport(id) == p2 && id[20..24] == [127, 0, 0, 2]), "{found:?}");
        assert!(found.iter().any(|id| dport(id) == p4 && id[20..24] == [127, 0, 0, 4]), "{found:?}");
        assert!(!found.iter().any(|id| dport(id) == p3), "a socket to 127.0.0.3: {found:?}");
        // One peer alone (the last op rejects on mismatch).
        let (found, sent) = dump(&sock, &peers[1..]).expect("dump");
        assert_eq!(found.len(), sent);
        assert!(found.iter().all(|id| id[20..24] == [127, 0, 0, 4]) && !found.is_empty());
    }

    #[test]
    fn messages_walks_aligned_records_and_stops_at_a_short_one() {
        let mut buf = Vec::new();
        for (kind, payload) in [(20u16, vec![1u8; 5]), (NLMSG_DONE, vec![])] {
            buf.extend_from_slice(&((HDR + payload.len()) as u32).to_ne_bytes());
            buf.extend_from_slice(&kind.to_ne_bytes());
            buf.extend_from_slice(&[0; 10]);
            buf.extend_from_slice(&payload);
            buf.resize((buf.len() + 3) & !3, 0);
        }
        buf.extend_from_slice(&[0xff; 8]);
        let got: Vec<(u16, usize)> = messages(&buf).map(|(k, p)| (k, p.len())).collect();
        assert_eq!(got, vec![(20, 5), (NLMSG_DONE, 0)]);
    }
}
