//! The datapath slot an agent switched at its start, switched back when the start fails
//! before the agent serves, e.g. a refused hand-over (decision U11); and the running agent's
//! own slot, made active again after a hand-over it offered failed (decision U13). Both undo
//! through [`restore`], one place.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use cubevs::slots::{Restored, SLOT_NAMES};
use cubevs_common::DatapathConfig;

/// The active slot and what it holds (read from the slot metadata).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActiveSlot {
    /// Slot index (0 = `a`, 1 = `b`).
    pub slot: usize,
    /// sha256 of the object in it.
    pub sha256: [u8; 32],
    /// The configuration its programs were loaded with.
    pub config: DatapathConfig,
}

impl ActiveSlot {
    /// The slot active under `pin_dir` now (`None`: no slot metadata, unreadable, or nothing
    /// active).
    pub fn read(pin_dir: &Path) -> Option<Self> {
        let m = cubevs::layout::read_meta(pin_dir).ok().flatten()?;
        let slot = m.active?;
        Some(Self { slot, sha256: m.slots[slot].sha256, config: m.config })
    }
}

/// Tries of [`cubevs::slots::restore`] while another updater holds the pin directory's lock
/// (a process killed mid-update releases it when it dies).
const BUSY_TRIES: usize = 250;

/// Makes `want`'s object active again under `pin_dir` (with its configuration), retrying
/// while another updater holds the lock; with `expect_active`, only while that slot is
/// still active.
fn restore(pin_dir: &Path, want: &ActiveSlot, expect_active: Option<usize>) -> Result<Restored, String> {
    for _ in 0..BUSY_TRIES {
        match cubevs::slots::restore(pin_dir, &want.sha256, Some(want.config), expect_active) {
            Ok(r) => return Ok(r),
            Err(cubevs::Error::Busy { .. }) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    }
    Err("another updater held the pin directory's lock".into())
}

/// An agent's start loads its eBPF object before it knows whether another agent serves the
/// node: another object than the active slot's is self-tested, pinned into the standby slot
/// and switched to on every pinned link (U5). Until this process owns its sockets (a
/// committed hand-over, or a fresh bind), a failure — a refused or aborted hand-over, a bad
/// offer, a failed recovery, a bind refused because a running agent holds the socket (H7) —
/// leaves the node to the running agent, and this guard, dropped armed, makes the previous
/// slot active again (same links, its programs stayed pinned). A process killed (`kill -9`)
/// in that window cannot: the running agent does it when the hand-over fails ([`OwnSlot`]).
#[derive(Debug)]
pub struct SlotRollback {
    pin_dir: PathBuf,
    /// The slot that was active before this process's load.
    from: ActiveSlot,
    /// The slot this process's load made active.
    to: usize,
    armed: bool,
}

impl SlotRollback {
    /// `Some` (disarmed) when this process's load changed the active slot from `before`.
    pub fn after_load(pin_dir: &Path, before: Option<ActiveSlot>) -> Option<Self> {
        let (from, to) = (before?, ActiveSlot::read(pin_dir)?.slot);
        (from.slot != to).then(|| Self { pin_dir: pin_dir.to_path_buf(), from, to, armed: false })
    }

    /// Another agent may serve on this node until this one owns its sockets: a failure before
    /// [`SlotRollback::disarm`] switches back.
    pub fn arm(&mut self) {
        self.armed = true;
    }

    /// This agent owns its sockets (hand-over committed, or bound fresh): the new slot stays.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for SlotRollback {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (from, to) = (SLOT_NAMES[self.from.slot], SLOT_NAMES[self.to]);
        // Only if the node still runs what this process switched to (nobody switched since).
        match restore(&self.pin_dir, &self.from, Some(self.to)) {
            Ok(_) => tracing::warn!(
                from = to,
                to = from,
                "start failed before this agent served: the datapath it switched to was rolled back; a running \
                 agent keeps its datapath"
            ),
            Err(e) => tracing::error!(
                slot = to,
                previous = from,
                "start failed before this agent served and its datapath switch could not be rolled back ({e}): \
                 a running agent serves on the new programs; `cubenet-cli datapath rollback` restores the previous"
            ),
        }
    }
}

/// The datapath a serving agent runs: the slot its own start activated (its object's sha256
/// and configuration). A successor switches the node to its own object at its start (U5); when
/// the hand-over this agent offered then fails for any reason — the successor died (also
/// `kill -9` before `READY`, which no guard of its own survives), timed out, was refused or
/// aborted — [`OwnSlot::ensure`] makes this agent's slot active again (U13).
#[derive(Clone, Debug)]
pub struct OwnSlot {
    pin_dir: PathBuf,
    own: ActiveSlot,
}

impl OwnSlot {
    /// `slot`, the one this agent's own datapath load activated (`cubevs::Datapath::slot`),
    /// as the metadata records it; `None` when unreadable.
    pub fn after_own_load(pin_dir: &Path, slot: usize) -> Option<Self> {
        let m = cubevs::layout::read_meta(pin_dir).ok().flatten()?;
        let own = ActiveSlot { slot, sha256: m.slots.get(slot)?.sha256, config: m.config };
        Some(Self { pin_dir: pin_dir.to_path_buf(), own })
    }

    /// Makes this agent's slot active on every pinned link unless it is (blocking: takes the
    /// update lock, waiting while another updater holds it). `after` says when, for the log
    /// (e.g. `the failed hand-over`).
    pub fn ensure(&self, after: &str) {
        let own = SLOT_NAMES[self.own.slot];
        match restore(&self.pin_dir, &self.own, None) {
            Ok(Restored::AlreadyActive(_)) => {}
            Ok(Restored::Switched { from, to }) => tracing::warn!(
                from = SLOT_NAMES[from],
                to = SLOT_NAMES[to],
                "after {after} another agent's object was active: this agent's datapath is active again"
            ),
            Err(e) => tracing::error!(
                slot = own,
                "after {after} this agent's datapath could not be made active again ({e}): it serves on the \
                 programs of the active slot; `cubenet-cli datapath rollback` restores the previous"
            ),
        }
    }
}
