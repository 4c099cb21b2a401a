//! A size-limited tmpfs in a private mount namespace, for real `ENOSPC` in the agent's state
//! store (issue 14) without mounting anything in the machine's own mount namespace.
//!
//! A holder process (`unshare --mount --propagation private`) mounts the tmpfs on a directory
//! the test owns and sleeps; processes started with [`PrivateTmpfs::enter`] join its mount
//! namespace (so an agent restarted after `kill -9` sees the same files), and the test reads
//! and writes the tmpfs through `/proc/<holder>/root`. Dropping it kills the holder; the mount
//! disappears with the last process in the namespace.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use crate::netns::ChildGuard;

/// See the module docs.
#[derive(Debug)]
pub struct PrivateTmpfs {
    holder: ChildGuard,
    mountpoint: PathBuf,
}

impl PrivateTmpfs {
    /// Mounts a tmpfs of `size` (tmpfs syntax: `256k`, `1m`) on `mountpoint` (created if
    /// missing) in a new private mount namespace. Panics with the holder's error when the
    /// mount fails.
    pub fn new(mountpoint: &Path, size: &str) -> Self {
        std::fs::create_dir_all(mountpoint).expect("create mountpoint");
        let script = format!(
            "mount -t tmpfs -o size={size},mode=0755 cubenet-rel {} || exit 1; echo ready; exec sleep 1000000",
            mountpoint.display()
        );
        let mut child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn unshare");
        let out = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line).expect("read holder");
        assert_eq!(line.trim(), "ready", "tmpfs holder failed to mount {}", mountpoint.display());
        Self { holder: ChildGuard::from_child(child), mountpoint: mountpoint.to_path_buf() }
    }

    /// PID of the holder (its mount namespace is the one to join).
    pub fn pid(&self) -> u32 {
        self.holder.id()
    }

    /// `path` (absolute, under the mountpoint) as the test can reach it: through the holder's
    /// root, which resolves in its mount namespace.
    pub fn host_path(&self, path: &Path) -> PathBuf {
        assert!(path.starts_with(&self.mountpoint), "{} is not under the tmpfs", path.display());
        PathBuf::from(format!("/proc/{}/root", self.pid())).join(path.strip_prefix("/").unwrap())
    }

    /// A command that runs `prog` inside the holder's mount namespace (`nsenter -m`, no fork,
    /// so the PID is the program's).
    pub fn enter(&self, prog: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.pid().to_string(), "-m", "--", prog]);
        c
    }

    /// Fills the tmpfs with `<mountpoint>/filler` until `ENOSPC`; returns the bytes written.
    pub fn fill(&self) -> u64 {
        use std::io::Write;
        let p = self.host_path(&self.mountpoint.join("filler"));
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&p).expect("open filler");
        let chunk = vec![0xa5u8; 4096];
        let mut n = 0u64;
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(k) => n += k as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("fill {}: {e}", p.display()),
            }
        }
        n
    }

    /// Frees what [`fill`](Self::fill) took.
    pub fn unfill(&self) {
        let p = self.host_path(&self.mountpoint.join("filler"));
        let _ = std::fs::remove_file(p);
    }
}
