//! Cleaning a TAP for reuse (Cleaning → Ready).

use std::{os::fd::OwnedFd, sync::Arc};

use super::{Agent, Transition, lock};
use crate::dataplane::PortMapping;

impl Agent {
    /// Cleans a Cleaning TAP for reuse (`reference/upstream.md §2.4`). Two parts, each retried
    /// by the maintenance loop until it succeeds:
    ///
    /// 1. **Scrub** (once): delete the TAP's port maps and sessions, unregister its sandbox
    ///    (verified gone), replace its policy by the baseline deny, delete the owner's state
    ///    file, free the owner's host ports and forget the owner (its id may be ensured again).
    ///    Policy writes never block this: when the baseline cannot be written (the policy
    ///    tries are full), the TAP's entries are removed instead — `from_cube` drops everything
    ///    an unregistered TAP sends, and an Ensure installs its policy before registering.
    /// 2. **Free check**: the agent closes its own queue fd and opens a new one. A single-queue
    ///    TAP that another process still holds (a VMM that was handed the fd and has not
    ///    exited) refuses that with `EBUSY`: the TAP stays Cleaning, ownerless, and is retried.
    ///    Only a TAP nobody else holds goes Ready, with a fresh, empty queue.
    ///
    /// A TAP that recovery found held by an unknown process is not scrubbed until it is free.
    /// Only a TAP in Cleaning is cleaned, and only by one caller at a time: a maintenance pass
    /// racing a Release must not scrub the TAP again after it went Ready and was handed to the
    /// next sandbox. Returns whether the TAP reached Ready; failures are recorded on the TAP.
    pub fn cleanup_tap(&self, name: &str) -> bool {
        self.cleanup(name, None, false, true)
    }

    /// [`Agent::cleanup_tap`] for a TAP whose mvm IP the caller already passed to
    /// [`Agent::abort_node_sockets`] after its scrub (a batch of released TAPs, R72).
    pub(super) fn cleanup_tap_sockets_aborted(&self, name: &str) -> bool {
        self.cleanup(name, None, false, false)
    }

    /// Aborts the node's TCP connections to the mvm IPs of `taps` (`(name, ip)`, each scrubbed:
    /// unregistered, so nothing new reaches the old sandbox) in one sock_diag dump (R72): the
    /// next sandbox on such a TAP gets the same address, and `from_envoy` delivers what any
    /// host socket sends to the address's holder, so nothing CubeEgress or a node process still
    /// holds for the old sandbox may be retransmitted to the next one. Runs before the TAPs can
    /// go Ready, off the Release call (each dump walks the kernel's whole established hash,
    /// ~1-2 ms whatever it finds). Best effort: a kernel without CONFIG_INET_DIAG_DESTROY keeps
    /// them, logged.
    /// A TAP already done since its scrub is skipped (a TAP a VMM holds stays Cleaning through
    /// many passes).
    pub(super) fn abort_node_sockets(&self, taps: &[(String, std::net::Ipv4Addr)]) {
        let taps: Vec<&(String, std::net::Ipv4Addr)> = {
            let mut inner = lock(&self.inner);
            taps.iter().filter(|(n, _)| inner.sockets_aborted.insert(n.clone())).collect()
        };
        if taps.is_empty() {
            return;
        }
        let ips: Vec<std::net::Ipv4Addr> = taps.iter().map(|(_, ip)| *ip).collect();
        match self.host.abort_sockets_to(&ips) {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                taps = taps.len(),
                aborted = n,
                "aborted the node's TCP connections to released sandboxes"
            ),
            Err(e) => {
                tracing::warn!(taps = taps.len(), error = %e, "could not abort the node's TCP connections to released sandboxes")
            }
        }
    }

    /// The Release path's cleanup: the scrub only (its port maps deleted one by one from
    /// `ports`, the owner's record, so nothing here walks the tables of other sandboxes); the
    /// free check is left to the maintenance pass, which the caller wakes. The TAP stays
    /// Cleaning (scrubbed, ownerless) until then, so a TAP a VMM still holds is never reused.
    /// Returns whether the scrub succeeded (else the TAP records the error, as in
    /// [`Agent::cleanup_tap`]).
    pub(super) fn scrub_released(&self, name: &str, ports: &[PortMapping]) -> bool {
        self.cleanup(name, Some(ports), true, false)
    }

    /// The scrub (unless done), then, unless `defer_free_check`, the node's sockets to the mvm
    /// IP aborted (when `abort_sockets`) and the free check; Ready only after all of them.
    fn cleanup(&self, name: &str, ports: Option<&[PortMapping]>, defer_free_check: bool, abort_sockets: bool) -> bool {
        if self.transit(&mut lock(&self.inner), name, Transition::BeginScrub).is_err() {
            return false;
        }
        self.cleanup_claimed(name, ports, defer_free_check, abort_sockets)
    }

    /// [`Agent::cleanup_tap_sockets_aborted`] for a TAP the caller already moved to scrubbing
    /// (`Transition::BeginScrub`) in the critical section where it chose it, so concurrent
    /// callers choosing among the same released TAPs never pick the same one (T3).
    pub(super) fn cleanup_claimed_sockets_aborted(&self, name: &str) -> bool {
        self.cleanup_claimed(name, None, false, false)
    }

    /// The body of [`Agent::cleanup`] once `BeginScrub` is done.
    fn cleanup_claimed(
        &self,
        name: &str,
        ports: Option<&[PortMapping]>,
        defer_free_check: bool,
        abort_sockets: bool,
    ) -> bool {
        let (ifindex, ip, owner, scrubbed, hands_off) = {
            let inner = lock(&self.inner);
            let t = inner.pool.get(name).expect("scrubbing TAPs stay in the pool");
            (t.ifindex, t.ip, t.owner().map(str::to_string), t.scrubbed(), t.is_hands_off())
        };
        let res = (|| -> Result<bool, String> {
            if hands_off {
                self.reopen_if_free(name)?;
            }
            if !scrubbed {
                self.scrub(name, ifindex, owner.as_deref(), ports)?;
                let mut inner = lock(&self.inner);
                if let Some(o) = &owner {
                    inner.ports.release_owner(o);
                    inner.sandboxes.remove(o);
                }
                // Its mvm IP's node sockets are to be aborted again before it goes Ready.
                inner.sockets_aborted.remove(name);
                self.transit(&mut inner, name, Transition::Scrubbed).map_err(|e| e.to_string())?;
                if defer_free_check {
                    return Ok(false);
                }
            }
            if abort_sockets {
                self.abort_node_sockets(&[(name.to_string(), ip)]);
            }
            self.reopen_if_free(name).map(|_| true)
        })();
        let mut inner = lock(&self.inner);
        match res {
            Ok(false) => self.transit(&mut inner, name, Transition::Deferred).is_ok(),
            Ok(true) => self.transit(&mut inner, name, Transition::Cleaned).is_ok(),
            Err(e) => {
                // Once per distinct error: a TAP a VMM holds fails the same way every pass.
                if inner.pool.get(name).and_then(|t| t.last_error()) == Some(e.as_str()) {
                    tracing::debug!("cleanup of {name} not finished (stays Cleaning): {e}");
                } else {
                    tracing::warn!("cleanup of {name} not finished (stays Cleaning): {e}");
                }
                let _ = self.transit(&mut inner, name, Transition::ScrubFailed(e));
                false
            }
        }
    }

    /// Part 1 of [`Agent::cleanup_tap`] in the datapath and the state store. With `ports`
    /// (the owner's mappings from its record) exactly those are deleted; without, every
    /// mapping of `ifindex` is searched for (recovery and retries, where no record may exist).
    fn scrub(
        &self,
        name: &str,
        ifindex: u32,
        owner: Option<&str>,
        ports: Option<&[PortMapping]>,
    ) -> Result<(), String> {
        // Unregister first: from then on the datapath drops the old sandbox's packets in both
        // directions and its sessions are dead; the reaper purges them in its next batched
        // pass (decision D19), so Release costs O(1) in sessions.
        self.dp.unregister_sandbox(ifindex).map_err(|e| e.to_string())?;
        // The node's TCP connections to the old sandbox are aborted after this, before the TAP
        // can go Ready (`abort_node_sockets`, R72), off the Release call.
        match ports {
            // Only the agent writes mappings, always from the record: deleting the record's
            // mappings (each a compare-and-delete on the ifindex) deletes all of them, in
            // O(own ports) instead of a walk over every sandbox's.
            Some(ports) => {
                for m in ports {
                    self.dp.delete_port_mapping(m).map_err(|e| e.to_string())?;
                }
            }
            None => {
                self.dp.delete_port_mappings_of(ifindex).map_err(|e| e.to_string())?;
                if self.dp.port_mappings().map_err(|e| e.to_string())?.iter().any(|m| m.ifindex == ifindex) {
                    return Err(format!("{name}: port mappings still present after delete"));
                }
            }
        }
        if self.dp.sandbox(ifindex).map_err(|e| e.to_string())?.is_some() {
            return Err(format!("{name}: sandbox entry still present after unregister"));
        }
        self.baseline_policy(name, ifindex)?;
        if let Some(o) = owner {
            self.store.remove(o).map_err(|e| format!("remove state of {o}: {e}"))?;
        }
        Ok(())
    }

    /// Gives the unregistered TAP `name` the baseline deny: one atomic replace when the policy
    /// tries have room for it; else its entries are removed (freeing room) and the baseline is
    /// tried once more, and if it still does not fit the TAP stays without entries — safe,
    /// because `from_cube` drops everything an unregistered TAP sends. Fails only when the
    /// entries cannot be removed.
    pub(super) fn baseline_policy(&self, name: &str, ifindex: u32) -> Result<(), String> {
        let Err(e) = self.dp.install_default_deny(ifindex) else { return Ok(()) };
        self.dp
            .remove_policy(ifindex)
            .map_err(|e2| format!("{name}: baseline deny: {e}; removing the policy: {e2}"))?;
        if let Err(e) = self.dp.install_default_deny(ifindex) {
            tracing::warn!("{name}: no baseline deny ({e}); its policy entries are removed and it is unregistered");
        }
        Ok(())
    }

    /// Part 2 of [`Agent::cleanup_tap`]: closes the agent's queue fd of `name` and opens a new
    /// one, which succeeds only when no other process holds the TAP (a single-queue TAP takes
    /// one attached queue; `EBUSY` otherwise). The new fd is kept.
    fn reopen_if_free(&self, name: &str) -> Result<Arc<OwnedFd>, String> {
        let old = {
            let mut inner = lock(&self.inner);
            let old = inner.pool.get(name).and_then(|t| t.fd.clone());
            inner.pool.set_fd(name, None);
            old
        };
        // The last reference closes the fd; the queue detaches only if nobody else holds it.
        drop(old);
        match self.host.reopen_tap(name) {
            Ok(fd) => {
                let fd = Arc::new(fd);
                lock(&self.inner).pool.set_fd(name, Some(fd.clone()));
                Ok(fd)
            }
            Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
                Err(format!("{name} is still held by another process (a VMM?); waiting until it is closed"))
            }
            Err(e) => Err(format!("reopen {name}: {e}")),
        }
    }
}
