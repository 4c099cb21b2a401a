//! The hand-over socket and what goes over it: lines, and the offer (manifest + fds).

use std::{
    io::{self, Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::net::{UnixListener, UnixStream},
    },
    path::Path,
};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

use super::{MAX_FDS_PER_MESSAGE, MAX_MANIFEST, Manifest, PROTOCOL_VERSION, proto_err};

/// Binds the hand-over socket: bound under a temporary name, set to 0600, then renamed into
/// place, so the configured path never has a wider mode (a stranger who connects to the
/// temporary name meanwhile is still refused by [`peer_allowed`]; as CubeEgress, E16).
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(d) = path.parent() {
        // The directory must be one no other user controls (R40).
        cubenet_sys::trusted_path::ensure_dir(d, "handover_socket directory")
            .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, format!("{e:#}")))?;
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
    cubenet_sys::peer_uid::unix_peer_allowed(conn)
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

/// Checks that a received TAP fd is a queue of `name` (`TUNGETIFF`), without reopening it.
pub fn verify_tap(fd: &OwnedFd, name: &str) -> Result<(), String> {
    use std::os::fd::AsFd;
    match cubenet_sys::tap::attached_name(fd.as_fd()) {
        Ok(n) if n == name => Ok(()),
        Ok(n) => Err(format!("fd for {name} is attached to {n}")),
        Err(e) => Err(format!("fd for {name}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::{super::*, *};

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
}
