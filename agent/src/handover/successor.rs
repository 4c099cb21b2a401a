//! The new agent's side of a hand-over: ask, receive and check the offer, commit.

use std::{
    collections::HashMap,
    io::{self, Write},
    os::{fd::OwnedFd, unix::net::UnixStream},
    path::Path,
    time::Duration,
};

use super::{
    Manifest, Offer, PROTOCOL_VERSION, ReceivedTap, STEP_TIMEOUT, peer_allowed, proto_err, read_line, verify_tap,
};

/// Successor side, before its datapath load: connects to a running agent's hand-over socket
/// without a word yet. `Ok(None)` when no agent listens there (no socket file, or nobody
/// accepting: a crash left it). Connected first, so the running agent sees the connection end
/// should this process die anywhere after its datapath switch, also before [`begin`], and
/// makes its own datapath active again (U13). Errors: the peer runs as another uid
/// (`PermissionDenied`), I/O.
pub fn connect(path: &Path) -> io::Result<Option<UnixStream>> {
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
    Ok(Some(s))
}

/// Successor side, step 1: asks the running agent on `s` (from [`connect`]) for the hand-over.
/// The running agent waits [`STEP_TIMEOUT`] for this line after its accept.
pub fn begin(s: &UnixStream) -> io::Result<()> {
    (&*s).write_all(format!("BEGIN {PROTOCOL_VERSION}\n").as_bytes())
}

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

/// Whether `err`, from [`begin`] or [`super::recv_offer`], means the running agent vanished
/// before its offer was complete (killed mid-transfer: the connection ended without `REFUSE`
/// or `ABORT`) and nobody accepts on `path` any more. Then nothing was handed over and nobody
/// serves: the successor starts fresh, as after a crash (decision H11); its own start still
/// refuses sockets a live process serves (H7). `false` for a refusal, a bad offer, or when a
/// process accepts on `path` again (e.g. another successor took over meanwhile).
pub fn predecessor_gone(err: &io::Error, path: &Path) -> bool {
    let vanished =
        matches!(err.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe);
    vanished
        && match UnixStream::connect(path) {
            Ok(_) => false,
            Err(e) => matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ECONNREFUSED)),
        }
}

/// The peer's PID on the hand-over connection (SO_PEERCRED), `None` when unknown (e.g. a
/// process in a PID namespace this one cannot see reports 0).
pub fn peer_pid(s: &UnixStream) -> Option<i32> {
    nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::PeerCredentials).ok().map(|c| c.pid()).filter(|&p| p > 0)
}

/// Waits until process `pid` has exited, every thread of it (a pidfd turns readable then:
/// its files are closed by that time; the leader alone being a zombie is not enough, the
/// other threads may still be closing them), for at most `timeout`; `false` on timeout. A
/// process killed mid-hand-over closes its hand-over socket first and its listeners a moment
/// later: the successor's fresh start binds them after this (H11). A process that is gone
/// already (`ESRCH`) counts as exited.
pub fn wait_exited(pid: i32, timeout: Duration) -> bool {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    // SAFETY: `fd` was just returned by pidfd_open and is owned here only.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    let mut p = libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&fd), events: libc::POLLIN, revents: 0 };
    let t = std::time::Instant::now();
    loop {
        let left = timeout.saturating_sub(t.elapsed()).as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, left) };
        if n > 0 {
            return true;
        }
        if n == 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return false;
        }
    }
}

/// How long the successor waits for `STOPPED` after `READY` (the old agent only has to stop
/// its accept loops).
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::{super::*, *};

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
    fn wait_exited_sees_an_ended_process_and_times_out_on_a_live_one() {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        // Not reaped yet: a zombie once it ended (every thread gone), which counts as exited.
        assert!(wait_exited(c.id() as i32, Duration::from_secs(10)));
        c.wait().unwrap();
        assert!(wait_exited(c.id() as i32, Duration::ZERO), "a reaped process is gone");
        assert!(!wait_exited(std::process::id() as i32, Duration::from_millis(30)), "this process runs");
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(peer_pid(&a), Some(std::process::id() as i32));
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
}
