//! Live upgrade hand-over: a new agent takes the running agent's listening sockets and TAP
//! queue fds over a Unix socket (`handover_socket`, mode 0600, peer uid checked with
//! SO_PEERCRED on both sides), so no listener is rebound, no TAP is reopened (`TUNSETIFF`) and
//! requests that arrive meanwhile wait in the shared kernel backlog instead of being refused.
//! The pattern is CubeEgress's listener handoff (`egress/src/handoff.rs`, decisions E9, E18) plus the
//! TAP fds and a mutation gate.
//!
//! Protocol (version [`PROTOCOL_VERSION`]), on one `SOCK_STREAM` connection, lines end in `\n`:
//!
//! 1. successor → old: `BEGIN <version>`, on a connection made before the successor's
//!    datapath load (the old agent waits [`STEP_TIMEOUT`] for the line). Another version: old
//!    answers `REFUSE <why>` and closes. A connection that fails anywhere before the commit
//!    has the old agent make its own datapath slot active again (U13).
//! 2. old: closes its [`MutationGate`] (waits for running Ensure/Release/Reconcile calls and the
//!    maintenance pass; later ones queue), then sends `OFFER <version>`, a 4-byte little-endian
//!    length and the [`Manifest`] JSON, then the fds in manifest order (listeners, then TAPs)
//!    in messages of one byte `F` carrying at most [`MAX_FDS_PER_MESSAGE`] fds each
//!    (SCM_RIGHTS limit 253).
//! 3. successor: checks every fd (each listener is bound where its configuration says, the
//!    `TUNGETIFF` name of each TAP fd and the TAP's ifindex match the manifest), recovers from
//!    the state files with the received fds, then sends `READY`. Any failure, or closing the
//!    connection, is an abort: the old agent answers `ABORT <why>` if it can, opens the gate
//!    and keeps serving; the successor exits.
//! 4. old, on `READY`: stops accepting on every listener (waits until no accept loop is left),
//!    marks the gate handed over (queued and later mutations, and reads on connections it still
//!    serves, are forwarded to the successor over `grpc_listen`) and sends `STOPPED`. Existing
//!    gRPC connections get an HTTP/2 GOAWAY; in-flight requests finish; the process exits
//!    without removing the socket files.
//! 5. successor, on `STOPPED` (or the old agent's end of the connection closing): starts
//!    accepting. Until then connections wait in the listen backlog.
//!
//! Between steps 1 and 5 reads (GetNetwork, ListNetworks, fd requests, health) are answered by
//! the old agent from its state, which no mutation changes while the gate is closed; fd
//! requests are only ever accepted by one agent at a time, so none sees a stale pool.
//!
//! Files: this one (constants and the manifest), `gate.rs` (the mutation gate), `wire.rs` (the
//! socket, its lines and the offer on the wire), `successor.rs` (the new agent's steps),
//! `slot_rollback.rs` (the datapath switch of a successor whose hand-over fails, undone) and
//! `predecessor.rs` (the old agent's loop).

use std::{collections::HashMap, io, os::fd::OwnedFd, time::Duration};

use serde::{Deserialize, Serialize};

mod gate;
mod predecessor;
mod slot_rollback;
mod successor;
mod wire;

pub use gate::{Entry, MutationGate};
pub use predecessor::{StopAccepting, serve};
pub use slot_rollback::{ActiveSlot, OwnSlot, SlotRollback};
pub use successor::{STOP_TIMEOUT, begin, commit, connect, peer_pid, predecessor_gone, split_offer, wait_exited};
pub use wire::{bind, peer_allowed, read_line, recv_offer, send_offer, verify_tap};

/// Version of the hand-over protocol and manifest; a successor refuses any other.
pub const PROTOCOL_VERSION: u32 = 1;
/// Fds per SCM_RIGHTS message (the kernel's `SCM_MAX_FD` is 253).
pub const MAX_FDS_PER_MESSAGE: usize = 253;
/// Largest accepted manifest in bytes (a pool of 65536 TAPs needs about 8 MiB).
pub const MAX_MANIFEST: usize = 16 << 20;
/// How long each side waits for the other's next step.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// Which listening socket an fd is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ListenerKind {
    /// `grpc_listen` as a Unix socket.
    GrpcUnix,
    /// `grpc_listen` as TCP.
    GrpcTcp,
    /// `tap_fd_listen`.
    TapFd,
    /// `health_listen` (HTTP).
    Health,
}

/// One TAP in the manifest; its queue fd follows in the fd stream when `has_fd`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapRecord {
    /// `z<ip>`.
    pub name: String,
    /// Pool state (`Ready`, `Active`, `Cleaning`).
    pub state: String,
    /// Owning sandbox, if any.
    pub owner: Option<String>,
    /// ifindex in the dataplane netns.
    pub ifindex: u32,
    /// Whether the old agent held a queue fd (a Cleaning TAP whose VMM holds it has none).
    pub has_fd: bool,
}

/// What the old agent hands over, besides the fds themselves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The listening sockets, in fd order.
    pub listeners: Vec<ListenerKind>,
    /// Every TAP of the pool; fds follow the listeners' for those with `has_fd`, in this order.
    pub taps: Vec<TapRecord>,
}

impl Manifest {
    /// Number of fds that follow the manifest.
    pub fn fd_count(&self) -> usize {
        self.listeners.len() + self.taps.iter().filter(|t| t.has_fd).count()
    }
}

/// A TAP queue fd received from the previous agent, with what its manifest said.
#[derive(Debug)]
pub struct ReceivedTap {
    /// Pool state in the previous agent (`Ready`, `Active`, `Cleaning`).
    pub state: String,
    /// ifindex in the dataplane netns (recovery checks it against the live TAP).
    pub ifindex: u32,
    /// The queue fd (checked with `TUNGETIFF`).
    pub fd: OwnedFd,
}

/// A checked offer: the listeners and the TAP fds by TAP name.
pub type Offer = (Vec<(ListenerKind, OwnedFd)>, HashMap<String, ReceivedTap>);

pub(crate) fn proto_err(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}
