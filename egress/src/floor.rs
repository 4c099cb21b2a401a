//! A floor per known sandbox and a shared ceiling over one bounded resource of the gateway
//! (decision R22): the proxy connections of the process (its descriptors) and the audit queue.
//!
//! Same scheme as the datapath's session floor (Q4): every known sandbox (one with a policy)
//! may always hold [`FloorPool::floor`] units; a unit beyond its floor, or any unit of a sandbox
//! without a policy or of no sandbox, is taken from the shared remainder, allowed while the
//! units held above floors are below `ceiling = capacity − known × floor`. Units held under
//! floors are at most `known × floor`, so the total stays within `capacity` and a victim below
//! its floor always finds room, whatever any group of other sandboxes holds.
//!
//! The floor follows the actual number of known sandboxes: `floor = min(configured floor,
//! capacity / (2 × known))`, so the reserve takes at most half the capacity and the other half
//! stays shared for bursts (as Q4 leaves half the session map shared); with more sandboxes than
//! that allows, 1 each while there are no more sandboxes than units, else 0. When a new
//! sandbox lowers the floor,
//! units already held under the old one stay charged as they were until given back: the bound
//! can be exceeded by at most the difference until then (as Q4's registration shortfall).

use std::{
    collections::HashMap,
    fmt,
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

/// Who has a floor: the sandboxes with a policy.
pub trait Members: Send + Sync {
    /// Whether `ip` is a known sandbox (has a policy).
    fn contains(&self, ip: Ipv4Addr) -> bool;
    /// How many known sandboxes there are.
    fn count(&self) -> usize;
}

/// No known sandbox: every unit comes from the shared pool (unit tests, tools).
#[derive(Debug, Default)]
pub struct NoMembers;

impl Members for NoMembers {
    fn contains(&self, _: Ipv4Addr) -> bool {
        false
    }
    fn count(&self) -> usize {
        0
    }
}

/// Why [`FloorPool::take`] refused a unit (the `reason` label of the refusal metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The sandbox already holds its own cap ([`FloorPool::per_sandbox`]).
    SandboxBudget,
    /// The sandbox used its floor (or has none) and the shared remainder is full.
    NodeCeiling,
}

impl Refusal {
    /// The metric label: `sandbox_budget` or `node_ceiling`.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::SandboxBudget => "sandbox_budget",
            Refusal::NodeCeiling => "node_ceiling",
        }
    }
}

/// One unit taken from a [`FloorPool`]; give it back with [`FloorPool::give_back`] exactly once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a charge must be given back"]
pub struct Charge {
    sandbox: Option<Ipv4Addr>,
    shared: bool,
}

impl Charge {
    /// Whether the unit came from the shared remainder (else from the sandbox's floor).
    pub fn is_shared(&self) -> bool {
        self.shared
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Held {
    floor: usize,
    shared: usize,
}

#[derive(Debug, Default)]
struct State {
    by_sandbox: HashMap<Ipv4Addr, Held>,
    floor_total: usize,
    shared: usize,
}

/// Units of one resource shared between sandboxes by floor and ceiling (module docs).
pub struct FloorPool {
    capacity: usize,
    floor: usize,
    per_sandbox: usize,
    members: Arc<dyn Members>,
    state: Mutex<State>,
}

impl fmt::Debug for FloorPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FloorPool")
            .field("capacity", &self.capacity)
            .field("floor", &self.floor)
            .field("per_sandbox", &self.per_sandbox)
            .finish_non_exhaustive()
    }
}

impl FloorPool {
    /// A pool of `capacity` units; each member of `members` may always hold `floor` of them (at
    /// most capacity / members); no sandbox holds more than `per_sandbox` (`usize::MAX`: no cap).
    pub fn new(capacity: usize, floor: usize, per_sandbox: usize, members: Arc<dyn Members>) -> FloorPool {
        FloorPool { capacity, floor, per_sandbox: per_sandbox.max(1), members, state: Mutex::default() }
    }

    /// Units in all.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Most units one sandbox may hold.
    pub fn per_sandbox(&self) -> usize {
        self.per_sandbox
    }

    /// The floor in force: min(configured floor, capacity / (2 × known sandboxes)), at least 1
    /// while there are no more known sandboxes than units.
    pub fn floor(&self) -> usize {
        self.limits(self.members.count()).0
    }

    /// The shared remainder in force: capacity − known × [`FloorPool::floor`].
    pub fn ceiling(&self) -> usize {
        self.limits(self.members.count()).1
    }

    /// (floor, ceiling) with `known` sandboxes: the floors take at most half the capacity
    /// while each can have one unit, so bursts above a floor keep room on a node with many
    /// sandboxes; past that one unit each while there are units for all, none beyond.
    fn limits(&self, known: usize) -> (usize, usize) {
        let k = known.max(1);
        let half = self.capacity / (2 * k);
        let floor = self.floor.min(if half > 0 { half } else { (self.capacity / k).min(1) });
        (floor, self.capacity.saturating_sub(known * floor))
    }

    /// Takes one unit for `sandbox` (`None`: a unit of no sandbox, from the shared remainder):
    /// from its floor when it is known and below it, else from the shared remainder when that
    /// is below the ceiling. Errors: [`Refusal`].
    pub fn take(&self, sandbox: Option<Ipv4Addr>) -> Result<Charge, Refusal> {
        let (floor, ceiling) = self.limits(self.members.count());
        let floor = if sandbox.is_some_and(|ip| self.members.contains(ip)) { floor } else { 0 };
        let mut st = self.state.lock().expect("floor pool lock");
        let held = sandbox.and_then(|ip| st.by_sandbox.get(&ip).copied()).unwrap_or_default();
        if held.floor + held.shared >= self.per_sandbox {
            return Err(Refusal::SandboxBudget);
        }
        let shared = if held.floor < floor {
            false
        } else if st.shared < ceiling {
            true
        } else {
            return Err(Refusal::NodeCeiling);
        };
        if shared {
            st.shared += 1;
        } else {
            st.floor_total += 1;
        }
        if let Some(ip) = sandbox {
            let h = st.by_sandbox.entry(ip).or_default();
            if shared {
                h.shared += 1;
            } else {
                h.floor += 1;
            }
        }
        Ok(Charge { sandbox, shared })
    }

    /// Gives a unit back.
    pub fn give_back(&self, c: Charge) {
        let mut st = self.state.lock().expect("floor pool lock");
        if c.shared {
            st.shared -= 1;
        } else {
            st.floor_total -= 1;
        }
        if let Some(ip) = c.sandbox
            && let Some(h) = st.by_sandbox.get_mut(&ip)
        {
            if c.shared {
                h.shared -= 1;
            } else {
                h.floor -= 1;
            }
            if h.floor + h.shared == 0 {
                st.by_sandbox.remove(&ip);
            }
        }
    }

    /// Units held by `sandbox`.
    pub fn held(&self, sandbox: Ipv4Addr) -> usize {
        let st = self.state.lock().expect("floor pool lock");
        st.by_sandbox.get(&sandbox).map(|h| h.floor + h.shared).unwrap_or(0)
    }

    /// Units held in all: (under floors, from the shared remainder).
    pub fn totals(&self) -> (usize, usize) {
        let st = self.state.lock().expect("floor pool lock");
        (st.floor_total, st.shared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Set(Vec<Ipv4Addr>);
    impl Members for Set {
        fn contains(&self, ip: Ipv4Addr) -> bool {
            self.0.contains(&ip)
        }
        fn count(&self) -> usize {
            self.0.len()
        }
    }

    fn ip(n: u8) -> Ipv4Addr {
        Ipv4Addr::new(192, 168, 0, n)
    }

    /// Attack: every known sandbox but one floods together; the last still gets its floor.
    #[test]
    fn colluding_members_leave_every_floor() {
        let members: Vec<Ipv4Addr> = (10..20).map(ip).collect();
        let p = FloorPool::new(100, 4, usize::MAX, Arc::new(Set(members.clone())));
        assert_eq!((p.floor(), p.ceiling()), (4, 60));
        let mut held = Vec::new();
        // Nine members and an unknown sandbox take all they can.
        for m in members[..9].iter().copied().chain([ip(99)]) {
            while let Ok(c) = p.take(Some(m)) {
                held.push(c);
            }
            assert_eq!(p.take(Some(m)), Err(Refusal::NodeCeiling));
        }
        assert_eq!(held.len(), 9 * 4 + 60, "nine floors and the whole remainder");
        assert_eq!(p.held(ip(99)), 0, "the shared remainder went to the first flooder");
        // The victim gets exactly its floor.
        let victim: Vec<Charge> = (0..4).map(|_| p.take(Some(members[9])).expect("floor")).collect();
        assert!(victim.iter().all(|c| !c.is_shared()));
        assert_eq!(p.take(Some(members[9])), Err(Refusal::NodeCeiling));
        assert_eq!(p.totals(), (40, 60));
        for c in held.into_iter().chain(victim) {
            p.give_back(c);
        }
        assert_eq!(p.totals(), (0, 0));
        assert_eq!(p.held(members[0]), 0);
    }

    #[test]
    fn per_sandbox_cap_and_small_capacity() {
        let p = FloorPool::new(10, 8, 3, Arc::new(Set(vec![ip(2), ip(3)])));
        // 2 members × 8 > 10: the floors take half the capacity.
        assert_eq!((p.floor(), p.ceiling()), (2, 6));
        let a: Vec<Charge> = (0..3).map(|_| p.take(Some(ip(2))).unwrap()).collect();
        assert_eq!(a.iter().filter(|c| c.is_shared()).count(), 1);
        assert_eq!(p.take(Some(ip(2))), Err(Refusal::SandboxBudget));
        for c in a {
            p.give_back(c);
        }
        // More members than half the units: one each while every member can have one.
        let three = FloorPool::new(3, 8, usize::MAX, Arc::new(Set(vec![ip(2), ip(3)])));
        assert_eq!((three.floor(), three.ceiling()), (1, 1));
        let crowd = FloorPool::new(3, 8, usize::MAX, Arc::new(Set((10..15).map(ip).collect())));
        assert_eq!((crowd.floor(), crowd.ceiling()), (0, 3), "no floor when units are fewer than members");
        let open = FloorPool::new(2, 8, usize::MAX, Arc::new(NoMembers));
        let (x, y) = (open.take(None).unwrap(), open.take(Some(ip(4))).unwrap());
        assert!(x.is_shared() && y.is_shared());
        assert_eq!(open.take(Some(ip(5))), Err(Refusal::NodeCeiling));
        open.give_back(x);
        open.give_back(y);
    }
}
