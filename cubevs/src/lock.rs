//! One datapath updater at a time per node: an exclusive `flock(2)` on the pin directory
//! itself (a bpffs directory can be opened `O_DIRECTORY` and flocked; bpffs accepts no
//! regular files, so there is no separate lock file). Taken by `load`/`switch`/`rollback`
//! (non-blocking: a second updater gets [`Error::Busy`]) and by the agent's start and
//! attach/detach (blocking: they wait for an update to finish, which takes milliseconds
//! after the verifier has run).

use std::{
    fs::File,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use crate::Error;

/// A held lock; released when dropped (or when the process dies).
#[derive(Debug)]
pub struct UpdateLock {
    _dir: File,
    path: PathBuf,
}

impl UpdateLock {
    fn open(dir: &Path) -> Result<File, Error> {
        std::fs::create_dir_all(dir)
            .map_err(|source| Error::Pin { what: format!("create {}", dir.display()), source })?;
        File::open(dir).map_err(|source| Error::Pin { what: format!("open {} for locking", dir.display()), source })
    }

    /// Takes the lock on `dir` or fails at once with [`Error::Busy`] when another process
    /// holds it.
    pub fn try_acquire(dir: &Path) -> Result<Self, Error> {
        let f = Self::open(dir)?;
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(Error::Busy { path: dir.to_path_buf() });
            }
            return Err(Error::Pin { what: format!("flock {}", dir.display()), source: e });
        }
        Ok(Self { _dir: f, path: dir.to_path_buf() })
    }

    /// Takes the lock on `dir`, waiting for the current holder.
    pub fn acquire(dir: &Path) -> Result<Self, Error> {
        let f = Self::open(dir)?;
        loop {
            // SAFETY: flock on an fd we own.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Self { _dir: f, path: dir.to_path_buf() });
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(Error::Pin { what: format!("flock {}", dir.display()), source: e });
            }
        }
    }

    /// The locked directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for UpdateLock {
    /// Unlocks before the fd closes: a `flock` belongs to the open file description, and a
    /// child this process forks (a `Command` of any thread) holds a copy of every fd from the
    /// fork until its exec closes the `O_CLOEXEC` ones, so closing ours alone could leave the
    /// lock held for that window and fail the next updater's `try_acquire` with `Busy`.
    /// `LOCK_UN` releases it for every copy.
    fn drop(&mut self) {
        // SAFETY: unlock of an fd we own.
        unsafe { libc::flock(self._dir.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// An exclusive `flock(2)` on the pinned maps' directory (`<pin_dir>/maps`, not the updater
/// lock's `<pin_dir>`) while alive: serialises the read-modify-write of a userspace-only count
/// map (`session_closed`, `track_closed`) across processes sharing the pins (decisions Q2, Q5,
/// Q6). `None` (unpinned maps, private to this process) locks nothing. Blocks; retries EINTR.
pub(crate) struct Flock<'a>(Option<&'a File>);

impl<'a> Flock<'a> {
    /// Takes the lock on `f`; `map` names the count map in the error. Errors: `MapSyscall`
    /// when `flock` fails.
    pub(crate) fn take(f: Option<&'a File>, map: &'static str) -> Result<Self, Error> {
        if let Some(f) = f {
            loop {
                // SAFETY: flock on an open fd we own.
                if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
                    break;
                }
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Err(Error::MapSyscall { map, op: "flock maps dir", source: e });
                }
            }
        }
        Ok(Self(f))
    }
}

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        if let Some(f) = self.0 {
            // SAFETY: unlock of an fd we own.
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child forked while the lock is held (and not yet exec'd, as any `Command` is for a
    /// moment) must not keep the lock after the guard drops.
    #[test]
    fn a_forked_child_never_keeps_the_update_lock() {
        let dir = std::env::temp_dir().join(format!("cubevs-lock-test-{}", std::process::id()));
        let lock = UpdateLock::try_acquire(&dir).unwrap();
        // SAFETY: the child only sleeps and exits (async-signal-safe calls only).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            unsafe {
                libc::usleep(500_000);
                libc::_exit(0);
            }
        }
        drop(lock);
        let again = UpdateLock::try_acquire(&dir);
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        let _ = std::fs::remove_dir(&dir);
        assert!(again.is_ok(), "the lock stayed with the forked child: {:?}", again.err());
    }
}
