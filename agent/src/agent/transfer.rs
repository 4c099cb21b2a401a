//! The pool as the live-upgrade hand-over sends it (`crate::handover`).

use std::{os::fd::OwnedFd, sync::Arc};

use super::{Agent, lock};
use crate::handover::TapRecord;

impl Agent {
    /// The pool as a hand-over manifest: every TAP with its state, owner and ifindex, and the
    /// agent's queue fd where it holds one (same order as the records with `has_fd`). Call
    /// with the mutation gate closed, so the pool does not change until the successor has it.
    pub fn handover_taps(&self) -> (Vec<TapRecord>, Vec<Arc<OwnedFd>>) {
        let inner = lock(&self.inner);
        let mut recs = Vec::new();
        let mut fds = Vec::new();
        for t in inner.pool.iter() {
            recs.push(TapRecord {
                name: t.name.clone(),
                state: t.state().as_str().to_string(),
                owner: t.owner().map(str::to_string),
                ifindex: t.ifindex,
                has_fd: t.fd.is_some(),
            });
            if let Some(fd) = &t.fd {
                fds.push(fd.clone());
            }
        }
        (recs, fds)
    }

    /// After a hand-over: closes the agent's TAP queue fds (the successor holds the same
    /// queues) so they no longer count as held. Returns how many were closed.
    pub fn close_tap_fds(&self) -> usize {
        let mut inner = lock(&self.inner);
        let names: Vec<String> = inner.pool.iter().filter(|t| t.fd.is_some()).map(|t| t.name.clone()).collect();
        for n in &names {
            inner.pool.set_fd(n, None);
        }
        names.len()
    }
}
