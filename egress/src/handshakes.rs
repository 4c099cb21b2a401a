//! Per-sandbox admission of client TLS handshakes (decision R90).
//!
//! A TLS handshake is the gateway's costliest piece of work per connection (an ECDHE key
//! exchange and an ECDSA signature, a mint on a cache miss), and a connection costs the sandbox
//! almost nothing: a canned ClientHello and a reset. Connections were bounded in number (R18,
//! R22), not in rate, so one sandbox looping connect-handshake-close kept the runtime's queue
//! full of its handshakes and every other sandbox's requests waited behind them (measured:
//! the victim at 1 % of its rate alone, `egress_gateway_handshake_flood_starves_no_other_sandbox`).
//!
//! [`HandshakeGate`] gives each sandbox (source IPv4 address) at most `per_sandbox`
//! handshakes in progress, from its ClientHello (read, cheap) through minting, the key
//! exchange and the signature to the end of the handshake, or for [`TURN_HOLD`] at most (a
//! client that stalls its handshake then keeps its connection until the handshake timeout,
//! but no longer holds its sandbox's turn). A further connection of the same sandbox waits, in
//! arrival order and without being served, until one of them ends; other sandboxes never
//! wait for it. So whatever one sandbox opens, the runtime holds at most `per_sandbox` of its
//! handshakes at a time beside everyone else's work. A semaphore per sandbox with a waiting
//! queue, not a node-wide cap (one sandbox would fill a node-wide one) and not a token bucket
//! (it needs a rate that suits every machine; a concurrency bound adapts to the CPU).

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::Semaphore;

/// Default `handshakes_per_sandbox`: below the runtime's worker count on any node with two
/// cores or more, so one sandbox's handshakes never occupy every worker at once.
pub const DEFAULT_PER_SANDBOX: usize = 1;
/// Longest time one handshake holds its sandbox's turn; the handshake itself may go on (up
/// to the 10 s handshake timeout) without it.
pub const TURN_HOLD: Duration = Duration::from_secs(1);
/// Largest `handshakes_per_sandbox`.
pub const MAX_PER_SANDBOX: usize = 1024;

/// Handshakes in progress per sandbox, at most `per_sandbox` each.
#[derive(Debug)]
pub struct HandshakeGate {
    per_sandbox: usize,
    /// One semaphore per sandbox with a handshake in progress or waiting; removed with the
    /// last one (so the map holds at most one entry per live connection's sandbox).
    sems: Mutex<HashMap<Ipv4Addr, Arc<Semaphore>>>,
}

/// One admitted handshake: the sandbox's next one may start when this is dropped.
#[derive(Debug)]
pub struct HandshakeTurn {
    gate: Arc<HandshakeGate>,
    sandbox: Ipv4Addr,
    sem: Arc<Semaphore>,
    /// Whether the turn holds one of `sem`'s permits (given back on drop).
    held: bool,
}

impl HandshakeGate {
    /// A gate admitting `per_sandbox` (≥ 1; 0 is taken as 1) handshakes per sandbox at a time.
    pub fn new(per_sandbox: usize) -> Arc<HandshakeGate> {
        Arc::new(HandshakeGate { per_sandbox: per_sandbox.max(1), sems: Mutex::default() })
    }

    /// Handshakes one sandbox may have in progress.
    pub fn per_sandbox(&self) -> usize {
        self.per_sandbox
    }

    /// Sandboxes with a handshake in progress or waiting.
    pub fn sandboxes(&self) -> usize {
        self.sems.lock().expect("handshake gate lock").len()
    }

    /// Waits (first come, first served) until `sandbox` has fewer than `per_sandbox`
    /// handshakes in progress and takes a place; the second value is `true` when it had to
    /// wait. Cancel-safe: a dropped future holds nothing.
    pub async fn enter(self: &Arc<Self>, sandbox: Ipv4Addr) -> (HandshakeTurn, bool) {
        let sem = self
            .sems
            .lock()
            .expect("handshake gate lock")
            .entry(sandbox)
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_sandbox)))
            .clone();
        // The turn owns the only reference to `sem` outside the map from here, so a cancelled
        // wait still runs the map clean-up.
        let mut turn = HandshakeTurn { gate: self.clone(), sandbox, sem, held: false };
        let waited = match turn.sem.try_acquire() {
            Ok(p) => {
                p.forget();
                false
            }
            Err(_) => {
                // The semaphore is never closed.
                turn.sem.acquire().await.expect("handshake semaphore closed").forget();
                true
            }
        };
        turn.held = true;
        (turn, waited)
    }
}

impl Drop for HandshakeTurn {
    fn drop(&mut self) {
        if self.held {
            self.sem.add_permits(1);
        }
        let mut m = self.gate.sems.lock().expect("handshake gate lock");
        // Under the lock nobody can clone it from the map: two references (the map's and
        // ours) mean no other turn holds or waits on it.
        if m.get(&self.sandbox).is_some_and(|s| Arc::ptr_eq(s, &self.sem)) && Arc::strong_count(&self.sem) == 2 {
            m.remove(&self.sandbox);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(192, 168, 0, last)
    }

    #[tokio::test]
    async fn a_sandbox_waits_for_its_own_turns_only() {
        let g = HandshakeGate::new(2);
        let (a1, w1) = g.enter(ip(2)).await;
        let (a2, w2) = g.enter(ip(2)).await;
        assert!(!w1 && !w2);
        // The third of A's waits…
        let g2 = g.clone();
        let mut third = tokio::spawn(async move { g2.enter(ip(2)).await });
        tokio::task::yield_now().await;
        assert!(tokio::time::timeout(std::time::Duration::from_millis(50), &mut third).await.is_err());
        // …while B's is admitted at once.
        let (b1, wb) = g.enter(ip(3)).await;
        assert!(!wb);
        assert_eq!(g.sandboxes(), 2);
        drop(a1);
        let (a3, w3) = third.await.unwrap();
        assert!(w3, "the third handshake waited");
        drop((a2, a3, b1));
        assert_eq!(g.sandboxes(), 0, "no entry outlives its sandbox's last handshake");
    }

    #[tokio::test]
    async fn a_cancelled_wait_leaves_nothing_behind() {
        let g = HandshakeGate::new(1);
        let (a1, _) = g.enter(ip(2)).await;
        let g2 = g.clone();
        let waiting = tokio::spawn(async move { g2.enter(ip(2)).await });
        tokio::task::yield_now().await;
        waiting.abort();
        let _ = waiting.await;
        drop(a1);
        assert_eq!(g.sandboxes(), 0);
        let (_a, w) = g.enter(ip(2)).await;
        assert!(!w, "the aborted waiter holds no place");
    }

    #[test]
    fn zero_means_one() {
        assert_eq!(HandshakeGate::new(0).per_sandbox(), 1);
    }
}
