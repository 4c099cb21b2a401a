//! Network-namespace execution: a namespace handle and a dedicated thread that lives in it.
//!
//! Everything that resolves interface names, opens netlink sockets, creates TAPs or attaches
//! TC programs acts in the **calling thread's** netns. [`NetnsThread`] owns one OS thread that
//! entered the target namespace once and runs submitted closures there, so callers on any
//! thread (including async runtimes, through a blocking hand-off) act in the right namespace.

use std::{
    fs::File,
    os::fd::{AsFd, OwnedFd},
    path::{Path, PathBuf},
    sync::mpsc,
    thread,
};

use nix::sched::{CloneFlags, setns};

/// Errors of namespace handling.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file could not be opened.
    #[error("open netns {path}: {source}")]
    Open {
        /// Path that was opened.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// `setns(2)` failed.
    #[error("setns into {path}: {source}")]
    Setns {
        /// Namespace path.
        path: PathBuf,
        /// Underlying errno.
        source: nix::Error,
    },
    /// The namespace thread could not be spawned or has exited.
    #[error("netns thread for {0} is gone")]
    ThreadGone(PathBuf),
    /// The thread could not be spawned.
    #[error("spawn netns thread: {0}")]
    Spawn(std::io::Error),
}

/// An open handle on a network namespace (a file such as `/run/netns/NAME`, `/proc/1/ns/net`).
#[derive(Debug)]
pub struct Netns {
    path: PathBuf,
    fd: OwnedFd,
}

impl Netns {
    /// Opens the namespace file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, NetnsError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| NetnsError::Open { path: path.clone(), source })?;
        Ok(Self { path, fd: file.into() })
    }

    /// The namespace of the calling thread.
    pub fn current() -> Result<Self, NetnsError> {
        // /proc/thread-self names this thread's namespace, not the process leader's.
        Self::open("/proc/thread-self/ns/net")
    }

    /// Path this handle was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the **calling thread** into this namespace. Only call on a thread you own
    /// (never on an async runtime worker); prefer [`NetnsThread`] or [`run_in`].
    pub fn enter(&self) -> Result<(), NetnsError> {
        setns(self.fd.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|source| NetnsError::Setns { path: self.path.clone(), source })
    }

    /// Duplicates the handle.
    pub fn try_clone(&self) -> Result<Self, NetnsError> {
        let fd = self.fd.try_clone().map_err(|source| NetnsError::Open { path: self.path.clone(), source })?;
        Ok(Self { path: self.path.clone(), fd })
    }
}

impl AsFd for Netns {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Runs `f` on a fresh thread inside the namespace `ns` and returns its result.
///
/// Panics inside `f` are propagated to the caller.
pub fn run_in<R, F>(ns: &Netns, f: F) -> Result<R, NetnsError>
where
    R: Send + 'static,
    F: FnOnce() -> R + Send + 'static,
{
    let ns = ns.try_clone()?;
    let handle = thread::Builder::new()
        .name("netns-run".into())
        .spawn(move || -> Result<R, NetnsError> {
            ns.enter()?;
            Ok(f())
        })
        .map_err(NetnsError::Spawn)?;
    match handle.join() {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A long-lived OS thread inside one network namespace that runs submitted closures in order.
///
/// Dropping the handle stops the thread after the queued jobs finish.
#[derive(Debug)]
pub struct NetnsThread {
    path: PathBuf,
    tx: Option<mpsc::Sender<Job>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl NetnsThread {
    /// Spawns the thread and enters `ns`; fails if `setns` fails.
    pub fn spawn(ns: &Netns) -> Result<Self, NetnsError> {
        let ns = ns.try_clone()?;
        let path = ns.path.clone();
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = thread::Builder::new()
            .name("netns-exec".into())
            .spawn(move || {
                let entered = ns.enter();
                let ok = entered.is_ok();
                let _ = ready_tx.send(entered);
                if !ok {
                    return;
                }
                while let Ok(job) = rx.recv() {
                    job();
                }
            })
            .map_err(NetnsError::Spawn)?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self { path, tx: Some(tx), thread: Some(thread) }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(NetnsError::ThreadGone(path)),
        }
    }

    /// Path of the namespace this thread lives in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the namespace thread and waits for its result. Panics in `f` are propagated.
    pub fn run<R, F>(&self, f: F) -> Result<R, NetnsError>
    where
        R: Send + 'static,
        F: FnOnce() -> R + Send + 'static,
    {
        let rx = self.submit(f)?;
        match rx.recv() {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(_) => Err(NetnsError::ThreadGone(self.path.clone())),
        }
    }

    /// Queues `f` and returns a receiver for its outcome (`Err` carries a panic payload).
    /// Lets async callers wait without blocking a runtime worker.
    pub fn submit<R, F>(&self, f: F) -> Result<mpsc::Receiver<thread::Result<R>>, NetnsError>
    where
        R: Send + 'static,
        F: FnOnce() -> R + Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(out);
        });
        self.tx
            .as_ref()
            .ok_or_else(|| NetnsError::ThreadGone(self.path.clone()))?
            .send(job)
            .map_err(|_| NetnsError::ThreadGone(self.path.clone()))?;
        Ok(rx)
    }
}

impl Drop for NetnsThread {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_in_current_namespace() {
        let ns = Netns::current().expect("open own netns");
        let t = NetnsThread::spawn(&ns).expect("spawn");
        let ino = |p: &str| std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap();
        let mine = ino("/proc/thread-self/ns/net");
        let theirs = t.run(move || ino("/proc/thread-self/ns/net")).unwrap();
        assert_eq!(mine, theirs);
        assert_eq!(run_in(&ns, || 7).unwrap(), 7);
    }

    #[test]
    fn propagates_panics() {
        let ns = Netns::current().unwrap();
        let t = NetnsThread::spawn(&ns).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.run(|| panic!("boom"))));
        assert!(r.is_err());
        // The thread survives a panicking job.
        assert_eq!(t.run(|| 1).unwrap(), 1);
    }

    #[test]
    fn open_missing_namespace_names_path() {
        let e = Netns::open("/nonexistent/ns").unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ns"), "{e}");
    }
}
