//! The datapath slot an agent switched at its start, switched back when the start fails
//! before the agent serves, e.g. a refused hand-over (decision U11).

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

/// An agent's start loads its eBPF object before it knows whether another agent serves the
/// node: another object than the active slot's is self-tested, pinned into the standby slot
/// and switched to on every pinned link (U5). Until this process owns its sockets (a
/// committed hand-over, or a fresh bind), a failure — a refused or aborted hand-over, a bad
/// offer, a failed recovery, a bind refused because a running agent holds the socket (H7) —
/// leaves the node to the running agent, and this guard, dropped armed, makes the previous
/// slot active again ([`cubevs::slots::rollback`]: same links, its programs stayed pinned).
/// Not covered: a process killed (`kill -9`) in that window (`cubenet-cli datapath rollback`).
#[derive(Debug)]
pub struct SlotRollback {
    pin_dir: PathBuf,
    /// The slot that was active before this process's load.
    from: usize,
    /// The slot this process's load made active.
    to: usize,
    armed: bool,
}

/// Tries of [`cubevs::slots::rollback`] while another updater holds the pin directory's lock.
const BUSY_TRIES: usize = 250;

impl SlotRollback {
    /// The slot active under `pin_dir` now (`None`: no slot metadata, unreadable, or nothing
    /// active). Read before the datapath load.
    pub fn active(pin_dir: &Path) -> Option<usize> {
        cubevs::layout::read_meta(pin_dir).ok().flatten().and_then(|m| m.active)
    }

    /// `Some` (disarmed) when this process's load changed the active slot from `before`.
    pub fn after_load(pin_dir: &Path, before: Option<usize>) -> Option<Self> {
        let (from, to) = (before?, Self::active(pin_dir)?);
        (from != to).then(|| Self { pin_dir: pin_dir.to_path_buf(), from, to, armed: false })
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

    fn roll_back(&self) -> Result<(), String> {
        for _ in 0..BUSY_TRIES {
            // Only if the node still runs what this process switched to (nobody switched since).
            match Self::active(&self.pin_dir) {
                Some(a) if a == self.to => {}
                other => return Err(format!("the active slot is {other:?} now, not the one this agent switched to")),
            }
            match cubevs::slots::rollback(&self.pin_dir) {
                Ok(_) => return Ok(()),
                Err(cubevs::Error::Busy { .. }) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(e.to_string()),
            }
        }
        Err("another updater held the pin directory's lock".into())
    }
}

impl Drop for SlotRollback {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (from, to) = (cubevs::slots::SLOT_NAMES[self.from], cubevs::slots::SLOT_NAMES[self.to]);
        match self.roll_back() {
            Ok(()) => tracing::warn!(
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
