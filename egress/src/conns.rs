//! Per-sandbox budget of concurrent proxy connections (decision R18).
//!
//! Every accepted connection holds one file descriptor until it ends (an idle HTTP/1 client
//! up to the 30 s header timeout, a silent TLS client up to the 10 s hello timeout), and the
//! process has one descriptor limit for all sandboxes: one sandbox that kept opening and
//! holding connections made `accept(2)` fail with EMFILE for everyone. Each sandbox (peer
//! address) may now hold at most [`ConnBudget::per_sandbox`] connections; the next one is
//! closed at accept and counted (`cube_egress_connections_refused_total`).

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

/// Smallest automatic per-sandbox budget.
pub const MIN_AUTO: usize = 64;
/// The automatic budget is the descriptor limit divided by this.
pub const AUTO_SHARE: u64 = 16;

/// Live connections per sandbox, bounded.
#[derive(Debug)]
pub struct ConnBudget {
    per_sandbox: usize,
    live: Mutex<HashMap<Ipv4Addr, usize>>,
}

/// One admitted connection; gives its place back when dropped.
#[derive(Debug)]
pub struct ConnSlot {
    budget: Arc<ConnBudget>,
    sandbox: Ipv4Addr,
}

impl ConnBudget {
    /// A budget of `per_sandbox` (≥ 1) live connections per sandbox.
    pub fn new(per_sandbox: usize) -> Arc<ConnBudget> {
        Arc::new(ConnBudget { per_sandbox: per_sandbox.max(1), live: Mutex::new(HashMap::new()) })
    }

    /// The automatic budget for a process whose soft descriptor limit is `nofile`:
    /// max([`MIN_AUTO`], `nofile` / [`AUTO_SHARE`]), so one sandbox holds at most a sixteenth
    /// of the descriptors.
    pub fn auto(nofile: u64) -> usize {
        (nofile / AUTO_SHARE).max(MIN_AUTO as u64) as usize
    }

    /// Connections one sandbox may hold.
    pub fn per_sandbox(&self) -> usize {
        self.per_sandbox
    }

    /// Takes a place for a connection of `sandbox`, or `None` when it holds its whole budget.
    pub fn admit(self: &Arc<Self>, sandbox: Ipv4Addr) -> Option<ConnSlot> {
        let mut live = self.live.lock().expect("conn budget lock");
        let n = live.entry(sandbox).or_insert(0);
        if *n >= self.per_sandbox {
            return None;
        }
        *n += 1;
        Some(ConnSlot { budget: self.clone(), sandbox })
    }

    /// Live connections of `sandbox`.
    pub fn live(&self, sandbox: Ipv4Addr) -> usize {
        self.live.lock().expect("conn budget lock").get(&sandbox).copied().unwrap_or(0)
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        let mut live = self.budget.live.lock().expect("conn budget lock");
        if let Some(n) = live.get_mut(&self.sandbox) {
            *n -= 1;
            if *n == 0 {
                live.remove(&self.sandbox);
            }
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
        let b = ConnBudget::new(2);
        let (a, c) = (Ipv4Addr::new(192, 168, 0, 2), Ipv4Addr::new(192, 168, 0, 3));
        let s1 = b.admit(a).unwrap();
        let _s2 = b.admit(a).unwrap();
        assert!(b.admit(a).is_none(), "a third connection of the same sandbox");
        assert!(b.admit(c).is_some(), "another sandbox is unaffected");
        drop(s1);
        assert_eq!(b.live(a), 1);
        assert!(b.admit(a).is_some(), "a place given back is usable again");
        assert_eq!(ConnBudget::auto(256), MIN_AUTO);
        assert_eq!(ConnBudget::auto(20_000), 1250);
    }
}
