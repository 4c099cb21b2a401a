//! Gateway swap: the running gateway (predecessor) hands its listening sockets and its state to
//! a successor over a Unix socket, and stops accepting only once the successor says it is ready
//! (decisions E9, E16, E18).
//!
//! Protocol version 2 (one connection, successor connects to the predecessor's `handoff_socket`;
//! both sides check the peer with SO_PEERCRED, [`crate::net::peer_allowed`]):
//! 1. predecessor → successor: one message whose payload is [`HANDOFF_MAGIC_V2`] and whose
//!    SCM_RIGHTS carries three listening fds in order HTTP, HTTPS, admin;
//! 2. predecessor → successor: a big-endian `u32` byte length, then that many bytes of JSON
//!    [`HandoffState`] (every policy with its secrets, the learned-address table, the bootstrap
//!    status), at most [`MAX_STATE_BYTES`];
//! 3. successor → predecessor: [`READY`] once the state is installed, before it accepts.
//!
//! The predecessor keeps accepting until step 3 (both processes accept on the shared sockets
//! for a moment; each connection goes to one of them). Without [`READY`] within
//! [`ACK_TIMEOUT`] (successor died, bad state) it unfreezes its admin API and keeps serving.
//! Admin changes are refused (503) from the snapshot on, so no change is lost between the
//! snapshot and the switch. Version 1 (a predecessor built before E18) sends step 1 only and
//! stops at once; a successor then loads its policies from the bootstrap URL.

use std::{
    collections::{BTreeMap, HashMap},
    io::{IoSlice, IoSliceMut, Read, Write},
    net::{Ipv4Addr, TcpListener},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::net::UnixStream,
    },
    path::Path,
    time::Duration,
};

use anyhow::{Context, bail};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};

use crate::{
    App,
    dest::LearnedAddr,
    net::{Listeners, peer_allowed, peer_uid},
    policy::{Policy, PolicySpec},
    store::BootstrapStatus,
};

/// Payload of a version-1 handoff message (listeners only).
pub const HANDOFF_MAGIC_V1: &[u8] = b"cube-egress-handoff v1\n";
/// Payload of a version-2 handoff message (listeners, then state, then [`READY`]).
pub const HANDOFF_MAGIC_V2: &[u8] = b"cube-egress-handoff v2\n";
/// The successor's answer once its state is installed.
pub const READY: &[u8] = b"ready\n";
/// How long the predecessor waits for [`READY`] (and each side for the other's bytes).
pub const ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest accepted state document, bytes (policies are at most 1 MiB each through the admin
/// API; 256 MiB leaves room for hundreds of large policies).
pub const MAX_STATE_BYTES: u32 = 256 << 20;

/// Most leaves a successor mints before READY (about 1 ms each in a release build).
pub const PREMINT_MAX: usize = 256;

/// Everything a successor needs to decide exactly as the predecessor would.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandoffState {
    /// The predecessor's bootstrap status (`ready`, `skipped`, `pending`, `failed`).
    pub bootstrap_status: String,
    /// Sandbox IP → policy, secrets intact (the socket is 0600 and peer-checked).
    pub policies: BTreeMap<Ipv4Addr, PolicySpec>,
    /// The learned-address table with remaining lifetimes.
    pub learned: Vec<LearnedAddr>,
    /// Names of the predecessor's most recent leaves (no keys): the successor mints them
    /// before READY, so its first handshakes do not wait for minting.
    #[serde(default)]
    pub leaf_names: Vec<String>,
}

impl HandoffState {
    /// Snapshot of `app`'s policies, learned addresses and bootstrap status.
    pub fn capture(app: &App) -> HandoffState {
        HandoffState {
            bootstrap_status: app.store.status().as_str().to_string(),
            policies: app.store.all().into_iter().map(|(ip, p)| (ip, p.spec.clone())).collect(),
            learned: app.dest.export_learned(),
            leaf_names: app.certs.recent_names(PREMINT_MAX),
        }
    }

    /// Installs the state into a fresh `app` (all or nothing) and returns the predecessor's
    /// bootstrap status. Errors: an unknown status, a policy that does not compile, an invalid
    /// learned entry.
    pub fn install(self, app: &App) -> anyhow::Result<BootstrapStatus> {
        let status = BootstrapStatus::parse(&self.bootstrap_status)
            .with_context(|| format!("unknown bootstrap_status {:?}", self.bootstrap_status))?;
        let mut policies = HashMap::with_capacity(self.policies.len());
        for (ip, spec) in self.policies {
            let p = Policy::compile(spec).map_err(|e| anyhow::anyhow!("policies.{ip}.{e}"))?;
            policies.insert(ip, p);
        }
        app.dest.import_learned(&self.learned).map_err(|e| anyhow::anyhow!("{e}"))?;
        app.store.replace_all(policies);
        Ok(status)
    }
}

/// Predecessor side: sends `l` and `state` to the successor on `conn` and waits for [`READY`]
/// (blocking, at most [`ACK_TIMEOUT`]). `Ok` means the successor took over: stop accepting.
/// Errors: any send/receive failure, a wrong answer, or no answer in time (keep serving).
pub fn offer(conn: &UnixStream, l: &Listeners, state: &HandoffState) -> anyhow::Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(ACK_TIMEOUT))?;
    conn.set_write_timeout(Some(ACK_TIMEOUT))?;
    let fds: [RawFd; 3] = [l.http.as_raw_fd(), l.https.as_raw_fd(), l.admin.as_raw_fd()];
    let iov = [IoSlice::new(HANDOFF_MAGIC_V2)];
    let n = sendmsg::<()>(conn.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
        .context("sendmsg SCM_RIGHTS")?;
    if n != HANDOFF_MAGIC_V2.len() {
        bail!("short handoff message ({n} bytes)");
    }
    let body = serde_json::to_vec(state).context("encode state")?;
    let len = u32::try_from(body.len()).ok().filter(|n| *n <= MAX_STATE_BYTES).context("state too large")?;
    let mut w = conn;
    w.write_all(&len.to_be_bytes()).and_then(|()| w.write_all(&body)).context("send state")?;
    let mut ack = [0u8; READY.len()];
    let mut r = conn;
    r.read_exact(&mut ack).context("no ready from the successor")?;
    if ack != READY {
        bail!("unexpected answer from the successor: {:?}", String::from_utf8_lossy(&ack));
    }
    Ok(())
}

/// Successor side of an open hand-over: the listeners, the predecessor's state (`None` from a
/// version-1 predecessor) and the signal to send once ready.
#[derive(Debug)]
pub struct Taken {
    /// The three listening sockets.
    pub listeners: Listeners,
    /// The predecessor's state (version 2).
    pub state: Option<HandoffState>,
    /// Tells the predecessor to stop accepting.
    pub ready: ReadySignal,
}

/// The connection to the predecessor, kept open until [`ReadySignal::send`].
#[derive(Debug)]
pub struct ReadySignal {
    conn: UnixStream,
    version: u8,
}

impl ReadySignal {
    /// Tells the predecessor that this process is ready and accepts from now on (version 2;
    /// nothing to say to a version-1 predecessor, which stopped already). Errors: the
    /// predecessor is gone (it gave up waiting and keeps serving: do not serve).
    pub fn send(&self) -> anyhow::Result<()> {
        if self.version >= 2 {
            let mut w = &self.conn;
            w.write_all(READY).context("send ready")?;
        }
        Ok(())
    }
}

/// Connects to a predecessor's handoff socket and receives its listeners and state (blocking).
/// `Ok(None)` when `optional` and nobody serves the path (no file, or a stale one: the first
/// slot of a pair starts this way). Errors: no predecessor (when not `optional`), a peer that is neither our uid nor root, a malformed
/// message, a state larger than [`MAX_STATE_BYTES`] or not valid JSON.
pub fn take(path: &Path, optional: bool) -> anyhow::Result<Option<Taken>> {
    let conn = match UnixStream::connect(path) {
        Ok(c) => c,
        Err(e)
            if optional && matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e).with_context(|| format!("connect {}", path.display())),
    };
    if !peer_allowed(&conn) {
        bail!("handoff socket {} is served by uid {:?}, not ours or root", path.display(), peer_uid(&conn).ok());
    }
    conn.set_read_timeout(Some(ACK_TIMEOUT))?;
    conn.set_write_timeout(Some(ACK_TIMEOUT))?;
    // Exactly the magic's length: the state bytes that follow are read separately.
    let mut buf = [0u8; HANDOFF_MAGIC_V2.len()];
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
    let version = match &buf[..n] {
        m if m == HANDOFF_MAGIC_V2 => 2,
        m if m == HANDOFF_MAGIC_V1 => 1,
        _ => bail!("bad handoff message ({n} bytes, {} fds)", owned.len()),
    };
    if owned.len() != 3 {
        bail!("bad handoff message ({} fds, want 3)", owned.len());
    }
    let mut it = owned.into_iter().map(|fd| {
        let l = TcpListener::from(fd);
        l.set_nonblocking(true).map(|_| l)
    });
    let listeners = Listeners {
        http: it.next().expect("3 fds")?,
        https: it.next().expect("3 fds")?,
        admin: it.next().expect("3 fds")?,
    };
    let admin = listeners.admin.local_addr()?;
    if !admin.ip().is_loopback() {
        bail!("handed-over admin listener {admin} is not on loopback");
    }
    let state = if version == 2 {
        let mut r = &conn;
        let mut len = [0u8; 4];
        r.read_exact(&mut len).context("read state length")?;
        let len = u32::from_be_bytes(len);
        if len > MAX_STATE_BYTES {
            bail!("state of {len} bytes is larger than {MAX_STATE_BYTES}");
        }
        let mut body = vec![0u8; len as usize];
        r.read_exact(&mut body).context("read state")?;
        Some(serde_json::from_slice(&body).context("state is not a valid hand-over document")?)
    } else {
        None
    };
    Ok(Some(Taken { listeners, state, ready: ReadySignal { conn, version } }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{dest::LearnedSpec, net};

    fn app(dir: &Path) -> App {
        let ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        let mut ca = ca;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = ca.self_signed(&key).unwrap();
        std::fs::create_dir_all(dir.join("ca")).unwrap();
        std::fs::write(dir.join("ca/cube-root-ca.crt"), cert.pem()).unwrap();
        std::fs::write(dir.join("ca/cube-root-ca.key"), key.serialize_pem()).unwrap();
        let cfg = crate::config::Config {
            ca_dir: dir.join("ca"),
            audit_file: dir.join("audit.jsonl"),
            dns_servers: vec!["127.0.0.1:9".parse().unwrap()],
            ..Default::default()
        };
        App::new(&cfg).unwrap()
    }

    fn st_names(t: &Taken) -> Vec<String> {
        t.state.as_ref().map(|s| s.leaf_names.clone()).unwrap_or_default()
    }

    /// Policies (with secrets), learned addresses (with their lifetimes) and the bootstrap
    /// status arrive intact over a real socket pair, and the successor's READY completes the
    /// predecessor's offer.
    #[test]
    fn state_and_listeners_move() {
        let dir = std::env::temp_dir().join(format!("cube-egress-handoff-{}", std::process::id()));
        let (old, new) = (app(&dir.join("old")), app(&dir.join("new")));
        let spec = r#"{"policy_id":"p","rules":[{"id":"r","match":{"sni":"api.example.test"},
            "action":{"allow":true,"inject":[{"header":"Authorization","secret":"s3cr3t"}]}}]}"#;
        old.store.put("192.168.0.2".parse().unwrap(), Policy::from_json(spec.as_bytes()).unwrap());
        old.store.set_status(BootstrapStatus::Ready);
        let learned = LearnedSpec {
            names: [("api.example.test".to_string(), vec!["198.51.100.1".to_string()])].into(),
            ttl_secs: Some(60),
        };
        old.dest.set_learned("192.168.0.2".parse().unwrap(), &learned).unwrap();
        let l = Listeners {
            http: net::bind("127.0.0.1:0".parse().unwrap(), false).unwrap(),
            https: net::bind("127.0.0.1:0".parse().unwrap(), false).unwrap(),
            admin: net::bind("127.0.0.1:0".parse().unwrap(), false).unwrap(),
        };
        let sock = dir.join("h.sock");
        let hl = net::handoff_listener(&sock).unwrap();
        hl.set_nonblocking(false).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let sb = "192.168.0.2".parse().unwrap();
        rt.block_on(old.certs.server_config(sb, crate::certs::CertName::Dns("api.example.test".into()))).unwrap();
        let state = HandoffState::capture(&old);
        assert_eq!(state.leaf_names, vec!["api.example.test".to_string()]);
        let pred = std::thread::spawn(move || {
            let (c, _) = hl.accept().unwrap();
            let r = offer(&c, &l, &state);
            (r, l.https.local_addr().unwrap())
        });
        let taken = take(&sock, false).unwrap().expect("a predecessor");
        let st = taken.state.clone().expect("version 2 carries state");
        assert_eq!(st.install(&new).unwrap(), BootstrapStatus::Ready);
        assert_eq!(rt.block_on(new.certs.premint(&st_names(&taken))), 1, "leaf minted before READY");
        taken.ready.send().unwrap();
        assert!(take(&dir.join("none.sock"), true).unwrap().is_none(), "optional: nobody there");
        assert!(take(&dir.join("none.sock"), false).is_err());
        let (r, https) = pred.join().unwrap();
        r.unwrap();
        assert_eq!(taken.listeners.https.local_addr().unwrap(), https, "the same listening socket");
        let p = new.store.get("192.168.0.2".parse().unwrap()).expect("policy moved");
        assert_eq!(p.spec.rules[0].action.inject.as_ref().unwrap()[0].secret, "s3cr3t", "secret intact");
        assert_eq!(new.dest.learned("192.168.0.2".parse().unwrap()), old.dest.learned("192.168.0.2".parse().unwrap()));
        let ttl = new.dest.export_learned()[0].ttl_ms;
        assert!(ttl > 50_000 && ttl <= 60_000, "remaining lifetime kept: {ttl}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A successor that takes the sockets but never says READY: the offer fails (the
    /// predecessor keeps serving).
    #[test]
    fn no_ready_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        let l = Listeners {
            http: net::bind("127.0.0.1:0".parse().unwrap(), false).unwrap(),
            https: net::bind("127.0.0.1:0".parse().unwrap(), false).unwrap(),
            admin: net::bind("127.0.0.1:0".parse().unwrap(), false).unwrap(),
        };
        let st = HandoffState {
            bootstrap_status: "ready".into(),
            policies: BTreeMap::new(),
            learned: Vec::new(),
            leaf_names: Vec::new(),
        };
        let reader = std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            let mut b = b;
            let _ = b.read(&mut buf);
            drop(b);
        });
        assert!(offer(&a, &l, &st).is_err());
        reader.join().unwrap();
    }
}
