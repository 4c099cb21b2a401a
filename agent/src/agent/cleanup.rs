//! Scrubbing a TAP for reuse (Cleaning → Ready).

use std::{
    os::fd::{AsFd, OwnedFd},
    sync::Arc,
};

use super::{Agent, Transition, lock};

/// Reads queued frames off a TAP fd without blocking (at most 1024), so a reused TAP starts
/// empty. Uses `poll(…, 0)` so the shared file status flags are not changed.
fn drain(fd: &OwnedFd) -> usize {
    let mut buf = vec![0u8; 65536 + 12];
    let mut n = 0;
    while n < 1024 {
        let mut pfd = [nix::poll::PollFd::new(fd.as_fd(), nix::poll::PollFlags::POLLIN)];
        match nix::poll::poll(&mut pfd, nix::poll::PollTimeout::ZERO) {
            Ok(1) => {}
            _ => break,
        }
        if nix::unistd::read(fd, &mut buf).is_err() {
            break;
        }
        n += 1;
    }
    n
}

impl Agent {
    /// Scrubs a TAP for reuse (`reference/upstream.md §2.4` order): drain queued frames,
    /// remove port maps, sandbox entry (verified gone) and policy, make sure the agent holds a
    /// usable fd (never reopening one a VMM still holds), install the baseline deny, delete the
    /// owner's state, free its ports, mark Ready. On error the TAP stays Cleaning with the
    /// error recorded. Returns whether it reached Ready.
    ///
    /// Only a TAP in Cleaning is scrubbed, and only by one caller at a time: a maintenance pass
    /// racing a Release must not scrub the TAP again after it went Ready and was handed to the
    /// next sandbox.
    pub fn cleanup_tap(&self, name: &str) -> bool {
        let (ifindex, owner, fd) = {
            let mut inner = lock(&self.inner);
            if self.transit(&mut inner, name, Transition::BeginScrub).is_err() {
                return false;
            }
            let t = inner.pool.get(name).expect("just transitioned");
            (t.ifindex, t.owner().map(str::to_string), t.fd.clone())
        };
        let res = (|| -> Result<(), String> {
            let fd = match fd {
                Some(fd) => fd,
                None => {
                    let fd = Arc::new(
                        self.host
                            .reopen_tap(name)
                            .map_err(|e| format!("reopen {name}: {e} (a process still holds it; left untouched)"))?,
                    );
                    lock(&self.inner).pool.set_fd(name, Some(fd.clone()));
                    fd
                }
            };
            drain(&fd);
            self.dp.delete_port_mappings_of(ifindex).map_err(|e| e.to_string())?;
            self.dp.delete_sessions_of(ifindex).map_err(|e| e.to_string())?;
            self.dp.unregister_sandbox(ifindex).map_err(|e| e.to_string())?;
            if self.dp.sandbox(ifindex).map_err(|e| e.to_string())?.is_some() {
                return Err(format!("{name}: sandbox entry still present after unregister"));
            }
            if self.dp.port_mappings().map_err(|e| e.to_string())?.iter().any(|m| m.ifindex == ifindex) {
                return Err(format!("{name}: port mappings still present after delete"));
            }
            // One atomic replace by the baseline deny (no window without policy).
            self.dp.install_default_deny(ifindex).map_err(|e| e.to_string())?;
            if let Some(o) = &owner {
                self.store.remove(o).map_err(|e| format!("remove state of {o}: {e}"))?;
            }
            Ok(())
        })();
        let mut inner = lock(&self.inner);
        match res {
            Ok(()) => {
                if let Some(o) = &owner {
                    inner.ports.release_owner(o);
                    inner.sandboxes.remove(o);
                }
                self.transit(&mut inner, name, Transition::Cleaned).is_ok()
            }
            Err(e) => {
                tracing::warn!("cleanup of {name} failed (stays Cleaning): {e}");
                let _ = self.transit(&mut inner, name, Transition::ScrubFailed(e));
                false
            }
        }
    }
}
