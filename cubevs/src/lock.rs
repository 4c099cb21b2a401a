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
