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
//! Extension (E24), asked for by the successor and optional both ways: instead of [`READY`] the
//! successor may answer [`MORE`]; the predecessor then sends a big-endian `u32` byte length and
//! that many bytes of JSON [`HandoffExtras`] (TLS session-ticket keys, the minted leaves with
//! their keys and, since E26, the TLS 1.2 session-ID cache; at most [`MAX_EXTRAS_BYTES`]) and waits for [`READY`] as before. A predecessor
//! built before E24 refuses [`MORE`] (closes, keeps serving, audits `handoff_aborted` once);
//! the successor then connects again and does plain version 2. A successor built before E24
//! never asks. Extras that do not install (another CA, a bad key) are logged and skipped: the
//! swap goes on, clients then do full handshakes as before. Key material travels only over
//! this peer-checked socket, is never written to disk, and `Debug` of the extras omits it.
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
    certs::LeafMaterial,
    dest::LearnedAddr,
    net::{Listeners, peer_allowed, peer_uid},
    policy::{Policy, PolicySpec},
    sessions::{MAX_SESSIONS, SessionMaterial},
    store::BootstrapStatus,
    tickets::TicketKeyMaterial,
};

/// Payload of a version-1 handoff message (listeners only).
pub const HANDOFF_MAGIC_V1: &[u8] = b"cube-egress-handoff v1\n";
/// Payload of a version-2 handoff message (listeners, then state, then [`READY`]).
pub const HANDOFF_MAGIC_V2: &[u8] = b"cube-egress-handoff v2\n";
/// The successor's answer once its state is installed.
pub const READY: &[u8] = b"ready\n";
/// The successor's request for [`HandoffExtras`] version 1 (as long as [`READY`], so a
/// predecessor built before E24 reads it whole and refuses it cleanly).
pub const MORE: &[u8] = b"more1\n";
/// Largest accepted extras document, bytes (256 leaves of ~1.3 KiB hex each, two keys, at most
/// 4096 TLS 1.2 sessions of at most ~2.7 KiB hex each: under 12 MiB in the worst case).
pub const MAX_EXTRAS_BYTES: u32 = 16 << 20;
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

/// What a successor may take besides the state, to cut what clients notice (E23-E25): TLS
/// session-ticket keys (clients resume instead of a full handshake) and the minted leaves with
/// their keys (no minting before READY). Unknown fields are ignored (a newer predecessor may
/// add some); every field may be missing.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct HandoffExtras {
    /// Format version (1).
    pub version: u32,
    /// SHA-256 of the predecessor's CA certificate, hex: leaves are installed only under the
    /// same CA.
    pub ca_sha256: String,
    /// Current and previous ticket keys, newest first (at most [`crate::tickets::MAX_KEYS`]).
    pub ticket_keys: Vec<TicketKeyMaterial>,
    /// The most recent leaves, newest first (at most [`PREMINT_MAX`]).
    pub leaves: Vec<LeafMaterial>,
    /// The most recent TLS 1.2 sessions (session-ID resumption), newest first (at most
    /// [`crate::sessions::MAX_SESSIONS`]; E26, absent from an older predecessor and ignored by
    /// an older successor).
    pub tls12_sessions: Vec<SessionMaterial>,
}

/// What [`HandoffExtras::install`] installed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtrasInstalled {
    /// Ticket keys taken.
    pub ticket_keys: usize,
    /// Leaves taken.
    pub leaves: usize,
    /// TLS 1.2 sessions taken (E26).
    pub tls12_sessions: usize,
}

impl HandoffExtras {
    /// Snapshot of `app`'s ticket keys and most recent leaves.
    pub fn capture(app: &App) -> HandoffExtras {
        HandoffExtras {
            version: 1,
            ca_sha256: app.certs.ca_sha256(),
            ticket_keys: app.certs.tickets().export(),
            leaves: app.certs.export_leaves(PREMINT_MAX),
            tls12_sessions: app.certs.sessions().export(MAX_SESSIONS),
        }
    }

    /// Installs what fits into `app` and logs what does not (never an error: the swap goes on
    /// without it). Leaves and TLS 1.2 sessions under another CA are skipped whole (the
    /// successor mints the leaves; those clients do a full handshake).
    pub fn install(&self, app: &App) -> ExtrasInstalled {
        let mut done = ExtrasInstalled::default();
        match app.certs.tickets().import(&self.ticket_keys) {
            Ok(n) => done.ticket_keys = n,
            Err(e) => tracing::warn!(error = %e, "predecessor's ticket keys refused; clients will do full handshakes"),
        }
        if self.ca_sha256 == app.certs.ca_sha256() {
            done.leaves = app.certs.install_leaves(&self.leaves[..self.leaves.len().min(PREMINT_MAX)]);
            let (stored, skipped) = app.certs.sessions().import(&self.tls12_sessions);
            done.tls12_sessions = stored;
            if skipped > 0 {
                tracing::warn!(skipped, "predecessor's TLS 1.2 sessions skipped (malformed, too large or expired)");
            }
        } else if !self.leaves.is_empty() || !self.tls12_sessions.is_empty() {
            tracing::warn!("predecessor's leaves and sessions are from another CA; minting instead");
        }
        done
    }
}

/// Predecessor side: sends `l` and `state` to the successor on `conn`, then `extras()` when
/// the successor asks for them ([`MORE`]), and waits for [`READY`] (blocking, at most
/// [`ACK_TIMEOUT`] per step). `Ok` means the successor took over: stop accepting. Errors: any
/// send/receive failure, a wrong answer, or no answer in time (keep serving).
pub fn offer(
    conn: &UnixStream,
    l: &Listeners,
    state: &HandoffState,
    extras: impl FnOnce() -> HandoffExtras,
) -> anyhow::Result<()> {
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
    if ack == MORE {
        let body = serde_json::to_vec(&extras()).context("encode extras")?;
        let len = u32::try_from(body.len()).ok().filter(|n| *n <= MAX_EXTRAS_BYTES).context("extras too large")?;
        w.write_all(&len.to_be_bytes()).and_then(|()| w.write_all(&body)).context("send extras")?;
        r.read_exact(&mut ack).context("no ready from the successor")?;
    }
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
    /// The predecessor's extras (E24; `None` from a predecessor built before E24).
    pub extras: Option<HandoffExtras>,
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

/// The predecessor closed the connection when asked for [`MORE`] (built before E24).
#[derive(Debug)]
struct ExtrasRefused;

impl std::fmt::Display for ExtrasRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("predecessor does not hand over extras")
    }
}

impl std::error::Error for ExtrasRefused {}

/// Connects to a predecessor's handoff socket and receives its listeners, state and extras
/// (blocking); a predecessor that refuses the extras ([`MORE`]) is asked again without them.
/// `Ok(None)` when `optional` and nobody serves the path (no file, or a stale one: the first
/// slot of a pair starts this way). Errors: no predecessor (when not `optional`), a peer that is neither our uid nor root, a malformed
/// message, a state larger than [`MAX_STATE_BYTES`] or not valid JSON, extras larger than
/// [`MAX_EXTRAS_BYTES`] (malformed extras are dropped with a warning instead).
pub fn take(path: &Path, optional: bool) -> anyhow::Result<Option<Taken>> {
    match take_once(path, optional, true) {
        Err(e) if e.is::<ExtrasRefused>() => {
            tracing::info!("predecessor predates hand-over extras (E24); taking over without them");
            take_once(path, optional, false)
        }
        r => r,
    }
}

/// One hand-over attempt; asks for extras when `ask_extras`.
fn take_once(path: &Path, optional: bool, ask_extras: bool) -> anyhow::Result<Option<Taken>> {
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
    let extras = if version == 2 && ask_extras { Some(read_extras(&conn)?) } else { None }.flatten();
    Ok(Some(Taken { listeners, state, extras, ready: ReadySignal { conn, version } }))
}

/// Sends [`MORE`] and reads the extras. `Err(ExtrasRefused)` when the predecessor closes
/// instead; `Ok(None)` (logged) for a document that is not valid extras JSON.
fn read_extras(conn: &UnixStream) -> anyhow::Result<Option<HandoffExtras>> {
    let refused = |e: std::io::Error| -> anyhow::Error {
        use std::io::ErrorKind::*;
        match e.kind() {
            UnexpectedEof | ConnectionReset | BrokenPipe => ExtrasRefused.into(),
            _ => anyhow::Error::from(e).context("read extras"),
        }
    };
    let (mut w, mut r) = (conn, conn);
    w.write_all(MORE).map_err(refused)?;
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(refused)?;
    let len = u32::from_be_bytes(len);
    if len > MAX_EXTRAS_BYTES {
        bail!("extras of {len} bytes are larger than {MAX_EXTRAS_BYTES}");
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).context("read extras")?;
    match serde_json::from_slice::<HandoffExtras>(&body) {
        Ok(x) => Ok(Some(x)),
        Err(e) => {
            // Only the parser's position: the document carries key material.
            tracing::warn!(line = e.line(), column = e.column(), "extras are not valid JSON; taking over without them");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustls_pki_types::pem::PemObject;

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
        assert_eq!(state.leaf_names, vec!["192.168.0.2/api.example.test".to_string()]);
        let pred = std::thread::spawn(move || {
            let (c, _) = hl.accept().unwrap();
            let r = offer(&c, &l, &state, HandoffExtras::default);
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

    fn listeners() -> Listeners {
        Listeners {
            http: net::bind("127.0.0.1:0".parse().unwrap(), false).unwrap(),
            https: net::bind("127.0.0.1:0".parse().unwrap(), false).unwrap(),
            admin: net::bind("127.0.0.1:0".parse().unwrap(), false).unwrap(),
        }
    }

    fn empty_state() -> HandoffState {
        HandoffState {
            bootstrap_status: "ready".into(),
            policies: BTreeMap::new(),
            learned: Vec::new(),
            leaf_names: vec!["192.168.0.2/api.example.test".into()],
        }
    }

    /// A full TLS handshake against `cfg` over an in-memory pipe, reading the server's first
    /// bytes (so TLS 1.3 tickets reach `client`'s session store); returns how it was done.
    async fn handshake(cfg: Arc<rustls::ServerConfig>, client: Arc<rustls::ClientConfig>) -> rustls::HandshakeKind {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (c, s) = tokio::io::duplex(64 << 10);
        let server = tokio::spawn(async move {
            let mut t = tokio_rustls::TlsAcceptor::from(cfg).accept(s).await.unwrap();
            t.write_all(b"hi").await.unwrap();
            t.flush().await.unwrap();
            let mut b = [0u8; 1];
            let _ = t.read(&mut b).await;
        });
        let name = rustls_pki_types::ServerName::try_from("api.example.test").unwrap();
        let mut t = tokio_rustls::TlsConnector::from(client).connect(name, c).await.unwrap();
        let mut b = [0u8; 2];
        t.read_exact(&mut b).await.unwrap();
        let kind = t.get_ref().1.handshake_kind().unwrap();
        drop(t);
        server.await.unwrap();
        kind
    }

    /// E23: over a real socket pair the successor gets the predecessor's ticket keys and leaf;
    /// a client that handshook with the predecessor resumes with the successor (no full
    /// handshake), is served the same leaf, and the successor minted nothing. Key bytes are
    /// absent from the extras' `Debug`.
    #[test]
    fn extras_let_clients_resume_across_the_swap() {
        let dir = std::env::temp_dir().join(format!("cube-egress-extras-{}", std::process::id()));
        let old = app(&dir.join("old"));
        // Same CA for both slots, as on a node.
        std::fs::create_dir_all(dir.join("new")).unwrap();
        let new = {
            let cfg = crate::config::Config {
                ca_dir: dir.join("old/ca"),
                audit_file: dir.join("new/audit.jsonl"),
                dns_servers: vec!["127.0.0.1:9".parse().unwrap()],
                ..Default::default()
            };
            App::new(&cfg).unwrap()
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let sb = "192.168.0.2".parse().unwrap();
        let name = crate::certs::CertName::Dns("api.example.test".into());
        let a_cfg = rt.block_on(old.certs.server_config(sb, name.clone())).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        let ca_pem = std::fs::read(dir.join("old/ca/cube-root-ca.crt")).unwrap();
        roots.add(rustls_pki_types::CertificateDer::from_pem_slice(&ca_pem).unwrap()).unwrap();
        // rustls' client defaults: an in-memory session store with resumption on.
        let client = Arc::new(
            rustls::ClientConfig::builder_with_provider(crate::certs::provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots.clone())
                .with_no_client_auth(),
        );
        assert_eq!(rt.block_on(handshake(a_cfg.clone(), client.clone())), rustls::HandshakeKind::Full);
        assert_eq!(
            rt.block_on(handshake(a_cfg.clone(), client.clone())),
            rustls::HandshakeKind::Resumed,
            "resumes with A"
        );
        // E26: a TLS 1.2 client that resumes by session ID only (no ticket extension).
        let client12 = {
            let mut c = rustls::ClientConfig::builder_with_provider(crate::certs::provider())
                .with_protocol_versions(&[&rustls::version::TLS12])
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
            c.resumption = rustls::client::Resumption::in_memory_sessions(16)
                .tls12_resumption(rustls::client::Tls12Resumption::SessionIdOnly);
            Arc::new(c)
        };
        assert_eq!(rt.block_on(handshake(a_cfg.clone(), client12.clone())), rustls::HandshakeKind::Full);
        assert_eq!(
            rt.block_on(handshake(a_cfg, client12.clone())),
            rustls::HandshakeKind::Resumed,
            "by session ID with A"
        );
        assert_eq!(old.certs.sessions().len(), 1, "one TLS 1.2 session stored, none for TLS 1.3");

        let l = listeners();
        let sock = dir.join("x.sock");
        let hl = net::handoff_listener(&sock).unwrap();
        hl.set_nonblocking(false).unwrap();
        let state = empty_state();
        let extras = HandoffExtras::capture(&old);
        let dbg = format!("{extras:?}");
        assert!(!dbg.contains(&extras.ticket_keys[0].key) && !dbg.contains(&extras.leaves[0].key), "{dbg}");
        assert!(!dbg.contains(&extras.tls12_sessions[0].value), "{dbg}");
        let pred = std::thread::spawn(move || {
            let (c, _) = hl.accept().unwrap();
            offer(&c, &l, &state, move || extras)
        });
        let taken = take(&sock, false).unwrap().unwrap();
        let x = taken.extras.clone().expect("extras asked for and sent");
        taken.state.clone().unwrap().install(&new).unwrap();
        assert_eq!(x.install(&new), ExtrasInstalled { ticket_keys: 1, leaves: 1, tls12_sessions: 1 });
        assert_eq!(rt.block_on(new.certs.premint(&st_names(&taken))), 1);
        assert_eq!(new.metrics.mints.get(), 0, "the leaf came over; nothing minted before READY");
        taken.ready.send().unwrap();
        pred.join().unwrap().unwrap();
        let b_cfg = rt.block_on(new.certs.server_config(sb, name)).unwrap();
        assert_eq!(
            rt.block_on(handshake(b_cfg.clone(), client.clone())),
            rustls::HandshakeKind::Resumed,
            "a session from A resumes with B"
        );
        assert_eq!(
            rt.block_on(handshake(b_cfg.clone(), client12.clone())),
            rustls::HandshakeKind::Resumed,
            "a TLS 1.2 session ID from A resumes with B"
        );
        // A successor without the keys (e.g. a pre-E24 build) makes the same client do a full
        // handshake: what the extras save.
        let lone = {
            let cfg = crate::config::Config {
                ca_dir: dir.join("old/ca"),
                audit_file: dir.join("new/audit2.jsonl"),
                dns_servers: vec!["127.0.0.1:9".parse().unwrap()],
                ..Default::default()
            };
            App::new(&cfg).unwrap()
        };
        let c_cfg = rt.block_on(lone.certs.server_config(sb, crate::certs::CertName::Dns("api.example.test".into())));
        let c_cfg = c_cfg.unwrap();
        assert_eq!(rt.block_on(handshake(c_cfg.clone(), client)), rustls::HandshakeKind::Full);
        assert_eq!(rt.block_on(handshake(c_cfg, client12)), rustls::HandshakeKind::Full);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Extras that must not be served are skipped and the swap goes on: leaves and TLS 1.2
    /// sessions from another CA (a CA rotated with the upgrade), a session that is not hex, a leaf whose key is not its certificate's (another
    /// leaf's key), a name that is no host name; ticket keys of the wrong size leave the
    /// successor's own keys in place.
    #[test]
    fn extras_that_do_not_fit_are_skipped() {
        let dir = std::env::temp_dir().join(format!("cube-egress-badextras-{}", std::process::id()));
        let (old, other_ca) = (app(&dir.join("old")), app(&dir.join("other")));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let sb = "192.168.0.2".parse().unwrap();
        for n in ["a.example.test", "b.example.test"] {
            rt.block_on(old.certs.server_config(sb, crate::certs::CertName::Dns(n.into()))).unwrap();
        }
        // A key is made at the snapshot when none was issued yet: both sides then share it.
        let mut good = HandoffExtras::capture(&old);
        assert_eq!((good.ticket_keys.len(), good.leaves.len()), (1, 2));
        good.tls12_sessions.push(SessionMaterial {
            key: crate::certs::hex(b"a.example.test\0id"),
            value: crate::certs::hex(b"session"),
            age_secs: 0,
        });
        // Another CA: nothing installed, nothing fails.
        assert_eq!(good.install(&other_ca), ExtrasInstalled { ticket_keys: 1, leaves: 0, tls12_sessions: 0 });
        // Same CA, but keys swapped between the two leaves, a bogus name and broken ticket keys.
        let same_ca = {
            let cfg = crate::config::Config {
                ca_dir: dir.join("old/ca"),
                audit_file: dir.join("old/audit2.jsonl"),
                dns_servers: vec!["127.0.0.1:9".parse().unwrap()],
                ..Default::default()
            };
            App::new(&cfg).unwrap()
        };
        let mut bad = good.clone();
        bad.leaves[0].key = good.leaves[1].key.clone();
        bad.leaves[1].name = "not a name/../x".into();
        bad.ticket_keys[0].key.truncate(10);
        bad.tls12_sessions[0].value = "not hex".into();
        let before = same_ca.certs.tickets().export();
        assert_eq!(bad.install(&same_ca), ExtrasInstalled { ticket_keys: 0, leaves: 0, tls12_sessions: 0 });
        assert!(same_ca.certs.sessions().is_empty(), "a malformed session is not stored");
        assert!(same_ca.certs.is_empty(), "no leaf served with a key that is not its own");
        assert_eq!(same_ca.certs.tickets().export().len(), before.len());
        assert_eq!(good.install(&same_ca), ExtrasInstalled { ticket_keys: 1, leaves: 2, tls12_sessions: 1 });
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// E26 both ways: an E24/E25 successor (extras without `tls12_sessions`) reads a new
    /// predecessor's document, the new field ignored; a new successor reads an E24/E25
    /// predecessor's document as having no sessions.
    #[test]
    fn tls12_sessions_are_optional_both_ways() {
        #[derive(Default, Deserialize)]
        #[serde(default)]
        #[allow(dead_code)]
        struct E25Extras {
            version: u32,
            ca_sha256: String,
            ticket_keys: Vec<TicketKeyMaterial>,
            leaves: Vec<LeafMaterial>,
        }
        let new = HandoffExtras {
            version: 1,
            tls12_sessions: vec![SessionMaterial { key: "00".into(), value: "01".into(), age_secs: 3 }],
            ..Default::default()
        };
        let doc = serde_json::to_vec(&new).unwrap();
        let old: E25Extras = serde_json::from_slice(&doc).expect("an E25 successor reads the new document");
        assert_eq!(old.version, 1);
        let from_old: HandoffExtras =
            serde_json::from_str(r#"{"version":1,"ca_sha256":"ab","ticket_keys":[],"leaves":[]}"#).unwrap();
        assert!(from_old.tls12_sessions.is_empty());
    }

    /// The pre-E24 predecessor's side of version 2, as it was: listeners, state, then exactly
    /// [`READY`] or an error.
    fn old_offer(conn: &UnixStream, l: &Listeners, state: &HandoffState) -> anyhow::Result<()> {
        let fds: [RawFd; 3] = [l.http.as_raw_fd(), l.https.as_raw_fd(), l.admin.as_raw_fd()];
        let iov = [IoSlice::new(HANDOFF_MAGIC_V2)];
        sendmsg::<()>(conn.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)?;
        let body = serde_json::to_vec(state)?;
        let mut w = conn;
        w.write_all(&(body.len() as u32).to_be_bytes())?;
        w.write_all(&body)?;
        let mut ack = [0u8; READY.len()];
        let mut r = conn;
        r.read_exact(&mut ack)?;
        if ack != READY {
            bail!("unexpected answer from the successor");
        }
        Ok(())
    }

    /// Fallback: a predecessor built before E24 refuses [`MORE`] and closes; the successor
    /// asks again without extras and takes over with the state alone.
    #[test]
    fn older_predecessor_still_hands_over() {
        let dir = std::env::temp_dir().join(format!("cube-egress-oldpred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("h.sock");
        let hl = net::handoff_listener(&sock).unwrap();
        hl.set_nonblocking(false).unwrap();
        let pred = std::thread::spawn(move || {
            let l = listeners();
            let (c, _) = hl.accept().unwrap();
            let first = old_offer(&c, &l, &empty_state());
            drop(c);
            let (c, _) = hl.accept().unwrap();
            (first, old_offer(&c, &l, &empty_state()))
        });
        let taken = take(&sock, false).unwrap().unwrap();
        assert!(taken.extras.is_none());
        assert_eq!(st_names(&taken), vec!["192.168.0.2/api.example.test".to_string()]);
        taken.ready.send().unwrap();
        let (first, second) = pred.join().unwrap();
        assert!(first.is_err(), "the old predecessor refused the extras request");
        second.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A successor built before E24 answers [`READY`] straight after the state: the new
    /// predecessor completes the swap and never captures its extras.
    #[test]
    fn older_successor_still_takes_over() {
        let (a, b) = UnixStream::pair().unwrap();
        let l = listeners();
        let succ = std::thread::spawn(move || {
            let mut buf = [0u8; HANDOFF_MAGIC_V2.len()];
            let mut iov = [IoSliceMut::new(&mut buf)];
            let mut cmsg = nix::cmsg_space!([RawFd; 3]);
            let msg = recvmsg::<()>(b.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC).unwrap();
            for c in msg.cmsgs().unwrap() {
                if let ControlMessageOwned::ScmRights(v) = c {
                    // SAFETY: fds the kernel just installed for us.
                    v.into_iter().for_each(|fd| drop(unsafe { OwnedFd::from_raw_fd(fd) }));
                }
            }
            let mut r = &b;
            let mut len = [0u8; 4];
            r.read_exact(&mut len).unwrap();
            let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
            r.read_exact(&mut body).unwrap();
            let _: HandoffState = serde_json::from_slice(&body).unwrap();
            let mut w = &b;
            w.write_all(READY).unwrap();
            b
        });
        let asked = std::sync::atomic::AtomicBool::new(false);
        offer(&a, &l, &empty_state(), || {
            asked.store(true, std::sync::atomic::Ordering::Relaxed);
            HandoffExtras::default()
        })
        .unwrap();
        assert!(!asked.into_inner(), "no extras captured for a successor that did not ask");
        drop(succ.join().unwrap());
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
        assert!(offer(&a, &l, &st, HandoffExtras::default).is_err());
        reader.join().unwrap();
    }
}
