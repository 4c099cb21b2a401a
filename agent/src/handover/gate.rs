//! The mutation gate of a hand-over (see the module docs of `handover`).

use std::sync::{
    Arc, OnceLock,
    atomic::{AtomicBool, Ordering},
};

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

/// Serialises mutations against a hand-over. Every mutating call (gRPC Ensure, Release,
/// Reconcile; a maintenance pass) enters it; a hand-over closes it, which waits for running
/// mutations and queues new ones. After the successor is ready, entering yields the
/// successor's gRPC endpoint instead (forward the call there); after an abort it opens again.
#[derive(Debug, Default)]
pub struct MutationGate {
    lock: Arc<RwLock<()>>,
    handed_over: AtomicBool,
    /// An offer is out (listeners and TAP fds sent), not yet committed or aborted.
    offering: AtomicBool,
    successor: OnceLock<String>,
}

/// The result of entering the gate.
#[derive(Debug)]
pub enum Entry {
    /// Mutate here; hold the guard until done.
    Here(OwnedRwLockReadGuard<()>),
    /// The state belongs to the successor at this gRPC endpoint.
    Forward(String),
    /// Handed over without a forwarding endpoint (maintenance: just stop).
    Gone,
}

impl MutationGate {
    /// Waits until mutations may run here, or the state has moved on.
    pub async fn enter(&self) -> Entry {
        let g = self.lock.clone().read_owned().await;
        if !self.handed_over.load(Ordering::Acquire) {
            return Entry::Here(g);
        }
        match self.successor.get() {
            Some(e) => Entry::Forward(e.clone()),
            None => Entry::Gone,
        }
    }

    /// Closes the gate: waits for running mutations; new ones queue until the guard drops.
    pub async fn close(&self) -> OwnedRwLockWriteGuard<()> {
        self.lock.clone().write_owned().await
    }

    /// Marks the state as the successor's (call while holding the closed gate).
    pub fn hand_over(&self, successor_endpoint: Option<String>) {
        if let Some(e) = successor_endpoint {
            let _ = self.successor.set(e);
        }
        self.handed_over.store(true, Ordering::Release);
    }

    /// The successor's gRPC endpoint once the state was handed to it (reads forward there).
    pub fn successor(&self) -> Option<String> {
        if self.handed_over() { self.successor.get().cloned() } else { None }
    }

    /// Marks an offer as out (`true`, right after closing the gate) or withdrawn (`false`,
    /// on abort).
    pub(super) fn set_offering(&self, on: bool) {
        self.offering.store(on, Ordering::Release);
    }

    /// Whether the listening sockets may belong to a successor: an offer is out or was
    /// committed. A stopping agent then leaves the socket files alone.
    pub fn sockets_shared(&self) -> bool {
        self.offering.load(Ordering::Acquire) || self.handed_over()
    }

    /// Whether the state was handed to a successor.
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn gate_waits_for_mutations_and_forwards_after_hand_over() {
        let gate = Arc::new(MutationGate::default());
        let Entry::Here(running) = gate.enter().await else { panic!("open gate") };
        let g = gate.clone();
        let closing = tokio::spawn(async move { g.close().await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!closing.is_finished(), "close must wait for the running mutation");
        drop(running);
        let closed = closing.await.unwrap();
        let g = gate.clone();
        let queued = tokio::spawn(async move { matches!(g.enter().await, Entry::Forward(e) if e == "unix:///s") });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!queued.is_finished(), "a mutation must queue while the gate is closed");
        assert!(!gate.sockets_shared());
        gate.hand_over(Some("unix:///s".into()));
        assert!(gate.sockets_shared());
        drop(closed);
        assert!(queued.await.unwrap(), "a queued mutation is forwarded after the hand-over");
        assert!(gate.handed_over());
    }
}
