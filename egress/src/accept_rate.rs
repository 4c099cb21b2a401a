//! Per-sandbox rate of new proxy connections, checked at accept (decision R102).
//!
//! CubeVS bounds the SYNs each sandbox sends toward the gateway (R91, 200/s with a burst of
//! 400 by default), so on a node the gateway never sees more. Without that bound (the agent's
//! `l7_connect_rate_per_sandbox = 0`, or a gateway reached by another path) one sandbox that
//! opened connections as fast as it could and wrote garbage into them (no TLS record: no
//! handshake turn, R90, is ever asked for) put a task per connection into the runtime's queue
//! ahead of every other sandbox's work: 5,000–6,000 connections/s left a victim's keep-alive
//! requests at 3 % of its rate alone (`egress_gateway_handshake_flood_starves_no_other_sandbox`).
//!
//! [`AcceptRate`] is a GCRA (a token bucket without a refill timer) per source IPv4 address:
//! `rate` connections per second with a burst of `burst`. A connection over it is reset at
//! accept, before any task, read or TLS work, and counted as
//! `cube_egress_connections_refused_total{reason="sandbox_rate"}`. The defaults are twice the
//! datapath's, so on a node the datapath's bound (a dropped SYN the client retransmits)
//! always acts first.

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    sync::Mutex,
    time::{Duration, Instant},
};

/// Default `new_conns_per_sandbox_per_sec` (twice the agent's `l7_connect_rate_per_sandbox`).
pub const DEFAULT_RATE: u32 = 400;
/// Default `new_conns_burst_per_sandbox` (twice the agent's `l7_connect_burst_per_sandbox`).
pub const DEFAULT_BURST: u32 = 800;
/// Source addresses tracked at once. Addresses whose bucket is full again are forgotten first;
/// when that is not enough (more than this many sources in debt at once, more than a /18 of
/// sandboxes) a new source is admitted untracked rather than refused.
pub const MAX_TRACKED: usize = 16_384;

/// New-connection buckets per source address; `rate` 0 admits everything.
#[derive(Debug)]
pub struct AcceptRate {
    /// Time one connection costs (1 / rate); `None` = off.
    interval: Option<Duration>,
    /// Most debt a source may carry: `burst` × `interval`.
    tolerance: Duration,
    /// Theoretical arrival time of each source's next connection, as an offset from `base`.
    tat: Mutex<HashMap<Ipv4Addr, Duration>>,
    base: Instant,
}

impl AcceptRate {
    /// `rate` connections per second per source with a burst of `burst` (≥ 1; 0 is taken as
    /// 1); `rate` 0 = unbounded.
    pub fn new(rate: u32, burst: u32) -> AcceptRate {
        let interval = (rate > 0).then(|| Duration::from_secs(1) / rate);
        let tolerance = interval.unwrap_or_default() * burst.max(1);
        AcceptRate { interval, tolerance, tat: Mutex::new(HashMap::new()), base: Instant::now() }
    }

    /// Whether `src` may open one more connection now; charges it when it may.
    pub fn admit(&self, src: Ipv4Addr) -> bool {
        self.admit_at(src, Instant::now())
    }

    /// [`Self::admit`] at time `now` (≥ the time this was built).
    pub fn admit_at(&self, src: Ipv4Addr, now: Instant) -> bool {
        let Some(interval) = self.interval else { return true };
        let now = now.saturating_duration_since(self.base);
        let mut tat = self.tat.lock().expect("accept rate lock");
        if tat.len() >= MAX_TRACKED && !tat.contains_key(&src) {
            tat.retain(|_, t| *t > now);
            if tat.len() >= MAX_TRACKED {
                return true;
            }
        }
        let next = tat.get(&src).copied().unwrap_or(now).max(now) + interval;
        if next - now > self.tolerance {
            return false;
        }
        tat.insert(src, next);
        true
    }

    /// Sources tracked now.
    pub fn tracked(&self) -> usize {
        self.tat.lock().expect("accept rate lock").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_gets_its_burst_then_its_rate_and_no_other_source_pays() {
        let r = AcceptRate::new(100, 10);
        let t0 = Instant::now();
        let (a, b) = (Ipv4Addr::new(192, 168, 0, 2), Ipv4Addr::new(192, 168, 0, 3));
        let burst = (0..50).filter(|_| r.admit_at(a, t0)).count();
        assert_eq!(burst, 10, "the burst at one instant");
        assert!(r.admit_at(b, t0), "another source is unaffected");
        assert!(!r.admit_at(a, t0 + Duration::from_millis(5)), "half an interval later: still in debt");
        assert!(r.admit_at(a, t0 + Duration::from_millis(10)), "one interval later: one more");
        assert!(!r.admit_at(a, t0 + Duration::from_millis(10)));
        // Over one second at 1,000 attempts per second: the rate (100) and nothing more.
        let admitted = (0..1000).filter(|i| r.admit_at(a, t0 + Duration::from_millis(20 + i))).count();
        assert!((99..=101).contains(&admitted), "{admitted} admitted in 1 s at 100/s");
        // Idle for the burst's length: the whole burst again.
        let later = t0 + Duration::from_secs(3);
        assert_eq!((0..50).filter(|_| r.admit_at(a, later)).count(), 10);
    }

    #[test]
    fn zero_rate_admits_everything_and_tracks_nothing() {
        let r = AcceptRate::new(0, 0);
        let a = Ipv4Addr::new(10, 0, 0, 1);
        assert!((0..10_000).all(|_| r.admit(a)));
        assert_eq!(r.tracked(), 0);
    }

    #[test]
    fn tracked_sources_are_bounded() {
        let r = AcceptRate::new(1, 1);
        let t0 = Instant::now();
        for i in 0..(MAX_TRACKED as u32 + 100) {
            assert!(r.admit_at(Ipv4Addr::from(0x0a00_0000 + i), t0), "first connection of source {i}");
        }
        assert!(r.tracked() <= MAX_TRACKED, "{} tracked", r.tracked());
        // Once their buckets are full again, the old sources are forgotten for new ones.
        let later = t0 + Duration::from_secs(5);
        assert!(r.admit_at(Ipv4Addr::new(172, 16, 0, 1), later));
        assert!(r.tracked() < 10, "{} tracked after the prune", r.tracked());
    }
}
