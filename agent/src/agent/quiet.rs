//! When pool upkeep may run: it yields to Ensure/Release calls in flight (decision F15).
//!
//! A call kicks the maintenance loop (refill after an Ensure, the free check after a Release).
//! Run at once, that upkeep (TAP creation with its tcx attach, each reopen of a released
//! queue: netlink and TUN ioctls that wait for RCU grace periods under RTNL) competes for the
//! node's CPU and RTNL with the very burst that kicked it. Instead the loop waits until no call
//! has been in flight for [`QUIET`], and then does the whole burst's upkeep in one pass —
//! unless the pool's Ready TAPs have fallen below the low watermark, when it refills at once
//! (the pool never runs dry because of the wait), or the wait has lasted the maintenance
//! interval (a steady stream of calls still gets its free checks and refill).

use std::{
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use super::{Agent, lock};

/// How long no Ensure/Release must have been in flight before a kicked upkeep pass runs.
pub const QUIET: Duration = Duration::from_millis(30);

/// Counts the Ensure/Release calls in flight and remembers when the last one ended.
#[derive(Debug)]
pub(super) struct CallTracker {
    in_flight: AtomicUsize,
    last_end: Mutex<Option<Instant>>,
}

impl Default for CallTracker {
    fn default() -> Self {
        Self { in_flight: AtomicUsize::new(0), last_end: Mutex::new(None) }
    }
}

/// Marks one call in flight until dropped.
pub(super) struct InFlight<'a>(&'a CallTracker);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        // The end time first: a reader that sees the count fall sees this call's end too.
        *lock(&self.0.last_end) = Some(Instant::now());
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl CallTracker {
    /// One call starts; it ends when the guard drops.
    pub(super) fn begin(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self)
    }

    /// Whether a call is in flight now.
    pub(super) fn busy(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) > 0
    }

    /// How much longer upkeep should wait at `now` for the calls to be quiet for `quiet`:
    /// `None` when it may run now.
    pub(super) fn wait_at(&self, now: Instant, quiet: Duration) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return Some(quiet);
        }
        let last = (*lock(&self.last_end))?;
        let since = now.saturating_duration_since(last);
        (since < quiet).then(|| quiet - since)
    }
}

impl Agent {
    /// The Ready count below which a kicked refill never waits for the calls to be quiet:
    /// a quarter of `tap_init_num`, at least 1.
    pub fn low_watermark(&self) -> usize {
        (self.cfg.raw.tap_init_num / 4).max(1)
    }

    /// How long the maintenance loop should still hold back a kicked pass (decision F15):
    /// `None` when it may run now — no Ensure/Release has been in flight for [`QUIET`], or,
    /// with `pool_matters` (a refill may be needed), the Ready TAPs are below
    /// [`Agent::low_watermark`]. The caller bounds the total wait.
    pub fn upkeep_wait(&self, pool_matters: bool) -> Option<Duration> {
        if pool_matters && self.ready_taps.load(Ordering::Relaxed) < self.low_watermark() {
            return None;
        }
        self.calls.wait_at(Instant::now(), QUIET)
    }

    /// Whether an upkeep pass should stop before its next TAP (free check, creation, filter
    /// conversion) and leave the rest to the pass after the calls: a call is in flight and the
    /// pool holds at least [`Agent::low_watermark`] Ready TAPs. The call kicks the loop when it
    /// ends, so the remainder runs once the calls are quiet again.
    pub(super) fn upkeep_should_yield(&self) -> bool {
        self.calls.busy() && self.ready_taps.load(Ordering::Relaxed) >= self.low_watermark()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_while_a_call_is_in_flight_and_for_quiet_after_the_last() {
        let t = CallTracker::default();
        let q = Duration::from_millis(30);
        let now = Instant::now();
        assert_eq!(t.wait_at(now, q), None, "no call yet");
        let g = t.begin();
        let g2 = t.begin();
        assert_eq!(t.wait_at(now + Duration::from_secs(9), q), Some(q), "in flight");
        drop(g);
        assert_eq!(t.wait_at(now + Duration::from_secs(9), q), Some(q), "one still in flight");
        drop(g2);
        let end = (*lock(&t.last_end)).expect("end recorded");
        assert_eq!(t.wait_at(end + Duration::from_millis(10), q), Some(Duration::from_millis(20)));
        assert_eq!(t.wait_at(end + q, q), None);
        assert_eq!(t.wait_at(end + Duration::from_secs(1), q), None);
    }
}
