//! Pool state of a TAP (`reference/upstream.md §2.4`): Ready → Active → Cleaning → Ready.

use std::{net::Ipv4Addr, os::fd::OwnedFd, sync::Arc};

use serde::Serialize;

/// Pool state of a TAP (`reference/upstream.md §2.4`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum TapState {
    /// Unowned, baseline deny installed, no sandbox state.
    Ready,
    /// Owned by a sandbox.
    Active,
    /// Being scrubbed for reuse; failures stay here and the maintenance loop retries.
    Cleaning,
}

#[derive(Debug)]
pub(super) struct TapEntry {
    pub(super) name: String,
    pub(super) ip: Ipv4Addr,
    pub(super) ifindex: u32,
    pub(super) state: TapState,
    pub(super) owner: Option<String>,
    /// The agent's queue fd (None for an adopted Active TAP until first needed).
    pub(super) fd: Option<Arc<OwnedFd>>,
    pub(super) retry_count: u32,
    pub(super) last_error: Option<String>,
    /// A cleanup of this TAP is running (only one at a time: a second one could capture the
    /// next owner and delete its state).
    pub(super) scrubbing: bool,
}
