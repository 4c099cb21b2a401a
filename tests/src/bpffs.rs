//! A private bpffs instance for one test: every mount of bpffs is a fresh, empty filesystem,
//! so pins made by a test never land in the machine's `/sys/fs/bpf`.

use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};

/// A bpffs mounted at a temporary directory; unmounted and removed on drop.
#[derive(Debug)]
pub struct BpfFs {
    dir: PathBuf,
}

impl BpfFs {
    /// Mounts a new bpffs at `/tmp/cubenet-bpffs-<pid>-<n>`.
    pub fn new() -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("cubenet-bpffs-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create bpffs mountpoint");
        mount(Some("bpf"), &dir, Some("bpf"), MsFlags::empty(), None::<&str>)
            .unwrap_or_else(|e| panic!("mount bpffs at {}: {e}", dir.display()));
        Self { dir }
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Default for BpfFs {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for BpfFs {
    fn drop(&mut self) {
        // Unmounting drops the pins; links and maps go away with their last reference.
        let _ = umount2(&self.dir, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.dir);
    }
}
