//! Proxy connections per sandbox: a per-sandbox budget (decision R18) inside a floor and a
//! node ceiling derived from the descriptor limit (decision R22).
//!
//! Every accepted connection holds one file descriptor until it ends (an idle HTTP/1 client
//! up to the 30 s header timeout, a silent TLS client up to the 10 s hello timeout) and one
//! more while it talks to its upstream; the process has one descriptor limit for all
//! sandboxes. One sandbox that kept opening and holding connections made `accept(2)` fail with
//! EMFILE for everyone (R18: per-sandbox budget); sixteen or more within their budgets still
//! could (R22). Now the connections of all sandboxes are a [`FloorPool`] of
//! [`ConnBudget::capacity_for`] places: each sandbox with a policy may always hold
//! `conn_floor_per_sandbox`, the rest is shared under the ceiling, and no sandbox holds more
//! than `max_conns_per_sandbox`. A connection over its limit is closed at accept and counted
//! by reason (`cube_egress_connections_refused_total{reason}`); a request that would need a
//! second upstream socket of its connection takes a place too, or gets 503 (R24).

use std::{net::Ipv4Addr, sync::Arc};

use crate::floor::{Charge, FloorPool, Members, Refusal};

/// Smallest automatic per-sandbox budget.
pub const MIN_AUTO: usize = 64;
/// The automatic budget is the descriptor limit divided by this.
pub const AUTO_SHARE: u64 = 16;
/// Descriptors kept out of the connection pool for the process itself (listeners, audit
/// file, epoll, admin connections, DNS sockets, hand-over).
pub const FD_RESERVE: u64 = 64;
/// Descriptors one place stands for: a connection's own and its first upstream socket. Every
/// further concurrent request of the connection takes a place of its own (R24, `proxy.rs`).
pub const FDS_PER_CONN: u64 = 2;
/// Default `conn_floor_per_sandbox`.
pub const DEFAULT_FLOOR: usize = 8;

/// Live proxy connections of all sandboxes, bounded by floor, ceiling and per-sandbox budget.
#[derive(Debug)]
pub struct ConnBudget {
    pool: FloorPool,
}

/// One admitted connection; gives its place back when dropped.
#[derive(Debug)]
pub struct ConnSlot {
    budget: Arc<ConnBudget>,
    charge: Option<Charge>,
}

impl ConnBudget {
    /// A budget of `capacity` connections in all, `floor` always available to each sandbox
    /// with a policy in `members`, at most `per_sandbox` (≥ 1) per sandbox.
    pub fn new(capacity: usize, floor: usize, per_sandbox: usize, members: Arc<dyn Members>) -> Arc<ConnBudget> {
        Arc::new(ConnBudget { pool: FloorPool::new(capacity, floor, per_sandbox, members) })
    }

    /// The automatic budget for a process whose soft descriptor limit is `nofile`:
    /// max([`MIN_AUTO`], `nofile` / [`AUTO_SHARE`]), so one sandbox holds at most a sixteenth
    /// of the descriptors.
    pub fn auto(nofile: u64) -> usize {
        (nofile / AUTO_SHARE).max(MIN_AUTO as u64) as usize
    }

    /// Connections all sandboxes may hold with a descriptor limit of `nofile`:
    /// (`nofile` − [`FD_RESERVE`]) / [`FDS_PER_CONN`], at least 1.
    pub fn capacity_for(nofile: u64) -> usize {
        (nofile.saturating_sub(FD_RESERVE) / FDS_PER_CONN).max(1) as usize
    }

    /// Connections one sandbox may hold.
    pub fn per_sandbox(&self) -> usize {
        self.pool.per_sandbox()
    }

    /// The pool (floor, ceiling, totals).
    pub fn pool(&self) -> &FloorPool {
        &self.pool
    }

    /// Takes a place for a connection of `sandbox`. Errors: [`Refusal::SandboxBudget`] (it holds
    /// `per_sandbox`), [`Refusal::NodeCeiling`] (its floor is used, or it has no policy, and the
    /// shared remainder is full).
    pub fn admit(self: &Arc<Self>, sandbox: Ipv4Addr) -> Result<ConnSlot, Refusal> {
        let charge = self.pool.take(Some(sandbox))?;
        Ok(ConnSlot { budget: self.clone(), charge: Some(charge) })
    }

    /// Live connections of `sandbox`.
    pub fn live(&self, sandbox: Ipv4Addr) -> usize {
        self.pool.held(sandbox)
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        if let Some(c) = self.charge.take() {
            self.budget.pool.give_back(c);
        }
    }
}

/// Raises the soft descriptor limit to the hard one (what Go's runtime does at start) and
/// returns the soft limit now in force (1024 when it cannot be read).
pub fn raise_nofile() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local `rlimit`.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 1024;
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                return raised.rlim_cur;
            }
        }
    }
    r.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_per_sandbox_and_given_back() {
        let b = ConnBudget::new(100, DEFAULT_FLOOR, 2, Arc::new(crate::floor::NoMembers));
        let (a, c) = (Ipv4Addr::new(192, 168, 0, 2), Ipv4Addr::new(192, 168, 0, 3));
        let s1 = b.admit(a).unwrap();
        let _s2 = b.admit(a).unwrap();
        assert_eq!(b.admit(a).unwrap_err(), Refusal::SandboxBudget, "a third connection of the same sandbox");
        assert!(b.admit(c).is_ok(), "another sandbox is unaffected");
        drop(s1);
        assert_eq!(b.live(a), 1);
        assert!(b.admit(a).is_ok(), "a place given back is usable again");
        assert_eq!(ConnBudget::auto(256), MIN_AUTO);
        assert_eq!(ConnBudget::auto(20_000), 1250);
        assert_eq!(ConnBudget::capacity_for(256), 96);
        assert_eq!(ConnBudget::capacity_for(10), 1);
    }
}
