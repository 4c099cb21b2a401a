//! The old agent's side of a hand-over: answer requests, offer, commit or abort.

use std::{
    future::Future,
    io::{self, Write},
    os::{
        fd::{AsRawFd, OwnedFd, RawFd},
        unix::net::UnixStream,
    },
    pin::Pin,
    sync::Arc,
    time::Duration,
};

use super::{
    ListenerKind, Manifest, MutationGate, OwnSlot, PROTOCOL_VERSION, STEP_TIMEOUT, peer_allowed, proto_err, read_line,
    send_offer,
};
use crate::agent::Agent;

/// Stops the caller's accept loops; resolves when none is left (see `listeners::Acceptors`).
pub type StopAccepting = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Old side: answers hand-over requests on `listener` until one completes, then returns (the
/// caller finishes in-flight requests and exits). A refused, failed or aborted hand-over
/// reopens the gate and the agent keeps serving, on its own datapath: `own` (this agent's
/// slot) is made active again should the successor have switched the node to its object and
/// given up or died before `READY` (U13). `listeners` are the duplicates to pass;
/// `grpc_endpoint` is where mutations are forwarded once the successor is ready;
/// `stop_accepting` is called once, on `READY`.
pub async fn serve(
    listener: tokio::net::UnixListener,
    agent: Arc<Agent>,
    gate: Arc<MutationGate>,
    listeners: Arc<Vec<(ListenerKind, OwnedFd)>>,
    grpc_endpoint: String,
    stop_accepting: StopAccepting,
    own: Option<OwnSlot>,
) {
    let mut stop_accepting = Some(stop_accepting);
    loop {
        let conn = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!("hand-over socket accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let conn = match conn.into_std().and_then(|c| c.set_nonblocking(false).map(|()| c)) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("hand-over connection: {e}");
                continue;
            }
        };
        if !peer_allowed(&conn) {
            let uid = nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials).map(|c| c.uid());
            tracing::warn!(?uid, "hand-over request from another user refused");
            continue;
        }
        let t = std::time::Instant::now();
        match offer(conn, &agent, &gate, &listeners, &grpc_endpoint, &mut stop_accepting).await {
            Ok(n) => {
                tracing::info!(taps = n, ms = t.elapsed().as_secs_f64() * 1e3, "handed over to the successor");
                return;
            }
            Err(e) => {
                tracing::warn!("hand-over aborted, this agent keeps serving: {e}");
                if let Some(o) = own.clone() {
                    let _ = tokio::task::spawn_blocking(move || o.ensure("the failed hand-over")).await;
                }
            }
        }
    }
}

async fn blocking<R: Send + 'static>(f: impl FnOnce() -> io::Result<R> + Send + 'static) -> io::Result<R> {
    tokio::task::spawn_blocking(f).await.map_err(io::Error::other)?
}

async fn offer(
    conn: UnixStream,
    agent: &Arc<Agent>,
    gate: &MutationGate,
    listeners: &Arc<Vec<(ListenerKind, OwnedFd)>>,
    grpc_endpoint: &str,
    stop_accepting: &mut Option<StopAccepting>,
) -> io::Result<usize> {
    conn.set_read_timeout(Some(STEP_TIMEOUT))?;
    conn.set_write_timeout(Some(STEP_TIMEOUT))?;
    let conn = Arc::new(conn);
    let c = conn.clone();
    let line = blocking(move || read_line(&c)).await?;
    if line != format!("BEGIN {PROTOCOL_VERSION}") {
        let c = conn.clone();
        let _ = blocking(move || {
            (&*c).write_all(format!("REFUSE this agent speaks BEGIN {PROTOCOL_VERSION}\n").as_bytes())
        })
        .await;
        return Err(proto_err(format!("expected BEGIN {PROTOCOL_VERSION}, got {line:?}: refused")));
    }
    // From here no mutation runs in this agent until the successor is ready or gave up.
    let guard = gate.close().await;
    gate.set_offering(true);
    tracing::info!("hand-over: mutations paused, sending listeners and TAP fds");
    let (taps, tap_fds) = agent.handover_taps();
    let n = taps.len();
    let manifest = Manifest { version: PROTOCOL_VERSION, listeners: listeners.iter().map(|(k, _)| *k).collect(), taps };
    let mut raw: Vec<RawFd> = listeners.iter().map(|(_, f)| f.as_raw_fd()).collect();
    raw.extend(tap_fds.iter().map(|f| f.as_raw_fd()));
    let c = conn.clone();
    let reply = blocking(move || {
        send_offer(&c, &manifest, &raw)?;
        // The fds stay open (the Arcs live here) until the successor has them.
        drop(tap_fds);
        read_line(&c)
    })
    .await;
    match reply {
        Ok(r) if r == "READY" => {
            // Commit: no accept here from now on, then mutations move to the successor.
            if let Some(stop) = stop_accepting.take() {
                stop().await;
            }
            gate.hand_over(Some(grpc_endpoint.to_string()));
            drop(guard);
            let c = conn.clone();
            if let Err(e) = blocking(move || (&*c).write_all(b"STOPPED\n")).await {
                tracing::warn!("hand-over: could not send STOPPED ({e}); the successor serves after its timeout");
            }
            Ok(n)
        }
        other => {
            let why = match other {
                Ok(r) => format!("successor said {r:?}"),
                Err(e) => e.to_string(),
            };
            let c = conn.clone();
            let msg = format!("ABORT {why}\n");
            let _ = blocking(move || (&*c).write_all(msg.as_bytes())).await;
            gate.set_offering(false);
            drop(guard);
            Err(proto_err(why))
        }
    }
}
