//! Directories a CubeNet process trusts with its control plane: no other user may be able to
//! rename, replace or redirect anything on the way to them. The agent checks the socket
//! directories of `grpc_listen`, `tap_fd_listen` and `handover_socket`, and `state_dir`
//! (decision R40); CubeEgress the directories of `audit_file` and `handoff_socket` (R44).
//!
//! The defaults live under world-writable sticky directories (`/tmp/cube`, `/dev/shm/cube`):
//! a local user who creates `/tmp/cube` (or a symlink of that name) before the agent starts
//! would otherwise own the directory the agent binds its sockets in and could later swap a
//! socket for their own (cubelet would then send EnsureNetwork requests, secrets included, and
//! TAP fd requests to them), or swap the state directory for one with forged records that the
//! next start adopts. The rule is OpenSSH's `StrictModes` walk: every directory on the path,
//! as written and after resolving symlinks, is owned by root or by the agent's effective uid
//! and is not writable by group or others unless it is sticky (`/tmp`); every symlink on the
//! path is owned by root or by us; the directory itself is never writable by group or others.

use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

/// A directory on the checked path that another user could control, or one that cannot be
/// inspected; the message names `what` (the config key), the directory and the offending path.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Untrusted(String);

type Result<T> = std::result::Result<T, Untrusted>;

macro_rules! bail {
    ($($t:tt)*) => { return Err(Untrusted(format!($($t)*))) };
}

fn io<T>(r: std::io::Result<T>, ctx: impl FnOnce() -> String) -> Result<T> {
    r.map_err(|e| Untrusted(format!("{}: {e}", ctx())))
}

/// Mode bits: writable by group or others.
const GO_WRITE: u32 = 0o022;
/// Mode bit: sticky (only an entry's owner may rename or remove it).
const STICKY: u32 = 0o1000;

fn owner_ok(uid: u32) -> bool {
    uid == 0 || uid == nix::unistd::geteuid().as_raw()
}

/// Every prefix of `p` (`/`, `/a`, `/a/b`, …, `p`).
fn prefixes(p: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = p.ancestors().map(Path::to_path_buf).collect();
    out.reverse();
    out
}

fn check_component(p: &Path, last: bool, what: &str, dir: &Path) -> Result<()> {
    let md = io(fs::symlink_metadata(p), || format!("{what} {}: lstat {}", dir.display(), p.display()))?;
    let who = || format!("{what} {}: {}", dir.display(), p.display());
    if !owner_ok(md.uid()) {
        bail!(
            "{} is owned by uid {} (neither root nor this process's uid {}): that user could replace what the \
             agent puts there; remove it or use a directory only root owns",
            who(),
            md.uid(),
            nix::unistd::geteuid()
        );
    }
    if md.file_type().is_symlink() {
        return Ok(());
    }
    if !md.is_dir() {
        bail!("{} is not a directory", who());
    }
    let mode = md.mode();
    if mode & GO_WRITE != 0 && (last || mode & STICKY == 0) {
        bail!(
            "{} is writable by other users (mode {:o}){}",
            who(),
            mode & 0o7777,
            if last { "" } else { " and not sticky" }
        );
    }
    Ok(())
}

/// Checks that `dir` (which exists) is trusted, see the module docs. Errors name the offending
/// path, its owner or mode.
pub fn check(dir: &Path, what: &str) -> Result<()> {
    let abs = io(std::path::absolute(dir), || format!("{what} {}", dir.display()))?;
    // As written: symlinks and the directories holding them.
    let lexical = prefixes(&abs);
    for (i, p) in lexical.iter().enumerate() {
        check_component(p, i + 1 == lexical.len() && !is_symlink(p), what, dir)?;
    }
    // Resolved: the directories actually used.
    let real = io(fs::canonicalize(&abs), || format!("{what} {}: resolve", dir.display()))?;
    let resolved = prefixes(&real);
    for (i, p) in resolved.iter().enumerate() {
        check_component(p, i + 1 == resolved.len(), what, dir)?;
    }
    Ok(())
}

fn is_symlink(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

/// Creates `dir` if missing (as `create_dir_all`, mode 0755 before the umask) and [`check`]s it.
pub fn ensure_dir(dir: &Path, what: &str) -> Result<()> {
    io(fs::create_dir_all(dir), || format!("{what}: create {}", dir.display()))?;
    check(dir, what)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cubenet-trusted-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        d
    }

    #[test]
    fn a_private_directory_passes_and_a_shared_one_is_refused() {
        let d = tmp("modes");
        ensure_dir(&d.join("cube"), "socket directory").unwrap();
        let shared = d.join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o777)).unwrap();
        let e = check(&shared, "socket directory").unwrap_err().to_string();
        assert!(e.contains("writable by other users (mode 777)"), "{e}");
        // Sticky is fine for an ancestor (as /tmp), never for the directory itself.
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(check(&shared, "x").is_err());
        ensure_dir(&shared.join("inner"), "x").unwrap();
        // Group-writable, not sticky, as an ancestor: refused.
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o775)).unwrap();
        let e = check(&shared.join("inner"), "x").unwrap_err().to_string();
        assert!(e.contains("and not sticky"), "{e}");
        // A symlink of ours to a trusted directory is followed and checked.
        std::os::unix::fs::symlink(d.join("cube"), d.join("link")).unwrap();
        check(&d.join("link"), "x").unwrap();
        let _ = fs::remove_dir_all(&d);
    }
}
