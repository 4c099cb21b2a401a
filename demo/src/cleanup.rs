//! What the demo created, recorded as it goes, so that it can be removed when the demo is
//! interrupted (SIGINT/SIGTERM: the destructors of the main thread never run then), or printed
//! as exact cleanup commands after `--keep`.
//!
//! Only resources this process created are recorded: PIDs of the children it spawned, the
//! namespaces it added, its private bpffs mount and its temporary directories.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Mutex,
};

/// Everything to remove, in the order it is removed: processes, namespaces, mounts, dirs.
#[derive(Debug, Default, Clone)]
pub struct Resources {
    /// Child processes (PID, what it is).
    pub pids: Vec<(u32, String)>,
    /// Network namespaces (names for `ip netns del`).
    pub netns: Vec<String>,
    /// The private bpffs mount point.
    pub bpffs: Option<PathBuf>,
    /// Temporary directories.
    pub dirs: Vec<PathBuf>,
}

static REGISTRY: Mutex<Option<Resources>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut Resources) -> R) -> R {
    let mut g = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(Resources::default))
}

/// Records a child process.
pub fn pid(pid: u32, what: &str) {
    with(|r| r.pids.push((pid, what.to_string())));
}

/// Forgets a child process (it was killed and reaped).
pub fn forget_pid(pid: u32) {
    with(|r| r.pids.retain(|(p, _)| *p != pid));
}

/// Records a namespace.
pub fn netns(name: &str) {
    with(|r| r.netns.push(name.to_string()));
}

/// Records the bpffs mount point.
pub fn bpffs(dir: &Path) {
    with(|r| r.bpffs = Some(dir.to_path_buf()));
}

/// Records a temporary directory.
pub fn dir(dir: &Path) {
    with(|r| r.dirs.push(dir.to_path_buf()));
}

/// Takes what is recorded, leaving the registry empty (the normal path: the owners' destructors
/// remove everything, or `--keep` hands it to the user).
pub fn take() -> Resources {
    with(std::mem::take)
}

/// Removes everything recorded (the interrupted path). Best effort, never panics.
pub fn remove_all() {
    let r = take();
    for (p, _) in &r.pids {
        // SAFETY: kill(2) on a PID this process spawned (and has not reaped, so it cannot have
        // been reused).
        unsafe { libc::kill(*p as libc::pid_t, libc::SIGKILL) };
    }
    for (p, _) in &r.pids {
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(*p as i32), None);
    }
    for n in &r.netns {
        let _ = Command::new("ip").args(["netns", "del", n]).stderr(Stdio::null()).status();
    }
    if let Some(b) = &r.bpffs {
        let _ = nix::mount::umount2(b, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(b);
    }
    for d in &r.dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}

impl Resources {
    /// The shell commands that remove these resources.
    pub fn script(&self) -> String {
        let mut s = String::from("#!/bin/sh\n# Removes what `cubenet-demo --keep` left running.\n");
        for (p, what) in &self.pids {
            s += &format!("kill {p} 2>/dev/null  # {what}\n");
        }
        s += "sleep 1\n";
        for n in &self.netns {
            s += &format!("ip netns del {n}\n");
        }
        if let Some(b) = &self.bpffs {
            s += &format!("umount {0} && rmdir {0}\n", b.display());
        }
        for d in &self.dirs {
            s += &format!("rm -rf {}\n", d.display());
        }
        s
    }
}
