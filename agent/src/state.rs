//! Durable per-sandbox state (`reference/upstream.md §2.7`): one JSON file per sandbox named
//! `<state_dir>/<sandbox_id>.<phase>.json`, phase `creating` → `success` → `deleting`,
//! advanced by rename. Writes go to `<id>.tmp.json`, are fsynced, renamed, and the directory is
//! fsynced (no fsync on tmpfs, the default location). Directory 0700, files 0600. Every
//! open, rename and unlink of a record is relative to one descriptor of the directory, opened
//! with the store (decision F18): no path walk from `/` per call, and the records stay in the
//! directory that was checked at open even if its path is later replaced.

use std::{
    fs::{self, File},
    io::Write,
    net::Ipv4Addr,
    os::{
        fd::OwnedFd,
        unix::fs::{DirBuilderExt, PermissionsExt},
    },
    path::{Path, PathBuf},
    sync::Arc,
};

use nix::{
    fcntl::{OFlag, openat, renameat},
    sys::stat::Mode,
    unistd::{UnlinkatFlags, fsync, unlinkat},
};

use serde::{Deserialize, Serialize};

use crate::dataplane::{EgressPolicy, Proto};

/// Intent phase of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Ensure in progress: resources may be half-made; recovery cleans them.
    Creating,
    /// Ensure committed: the sandbox is live; recovery adopts it.
    Success,
    /// Release in progress: recovery finishes the cleanup.
    Deleting,
}

impl Phase {
    /// File-name component.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Creating => "creating",
            Phase::Success => "success",
            Phase::Deleting => "deleting",
        }
    }
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "creating" => Phase::Creating,
            "success" => Phase::Success,
            "deleting" => Phase::Deleting,
            _ => return None,
        })
    }
}

/// One port mapping as persisted and reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortRecord {
    /// Protocol.
    pub proto: Proto,
    /// Guest port.
    pub container_port: u16,
    /// Host port.
    pub host_port: u16,
    /// Host IP reported back (informational).
    pub host_ip: String,
}

/// Everything needed to rebuild one sandbox's network.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// Sandbox id.
    pub sandbox_id: String,
    /// TAP name (`z<ip>`).
    pub tap_name: String,
    /// TAP ifindex when committed.
    pub tap_ifindex: u32,
    /// mvm IP.
    pub sandbox_ip: Ipv4Addr,
    /// Datapath version.
    pub version: u32,
    /// Port mappings (host ports assigned).
    pub port_mappings: Vec<PortRecord>,
    /// Egress policy.
    pub policy: EgressPolicy,
    /// Caller's persist_metadata merged with ours.
    pub persist_metadata: std::collections::BTreeMap<String, String>,
}

/// Validates a sandbox id for use as a file name and map key: 1–64 bytes (the datapath's
/// metadata holds 64) of
/// `[A-Za-z0-9_.:-]`, not starting with `.`.
pub fn validate_sandbox_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("must not be empty".into());
    }
    if id.len() > 64 {
        return Err(format!("is {} bytes, the limit is 64", id.len()));
    }
    if id.starts_with('.') || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b)) {
        return Err(format!("{id:?} may only contain A-Z a-z 0-9 _ . : - and must not start with ."));
    }
    Ok(())
}

/// A caller-supplied sandbox id or TAP name as a log field (decision O19): as is when it has the
/// form of a valid sandbox id (`sandbox_id=sb-1`, what `grep` and the README's recipes match),
/// else quoted with Rust escapes (`"x\n2026-… INFO …"`), so a caller cannot write what looks
/// like another event into the text log (a newline in a refused id or an fd request's name).
#[derive(Clone, Copy, Debug)]
pub struct LogSafe<'a>(pub &'a str);

impl std::fmt::Display for LogSafe<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if validate_sandbox_id(self.0).is_ok() { f.write_str(self.0) } else { write!(f, "{:?}", self.0) }
    }
}

/// Result of [`StateStore::scan`]: readable records with their phase, and unreadable files
/// with the reason.
pub type Scan = (Vec<(Phase, SandboxRecord)>, Vec<(PathBuf, String)>);

/// The store.
#[derive(Debug, Clone)]
pub struct StateStore {
    dir: PathBuf,
    /// The directory, opened read-only: every record operation is relative to it.
    dirfd: Arc<OwnedFd>,
    /// fsync makes no sense on tmpfs (its contents die with the machine either way);
    /// upstream skips it there too (`reference/upstream.md §2.7`).
    durable: bool,
}

impl StateStore {
    /// Opens (creating, mode 0700) the directory. Errors: also `PermissionDenied` when a
    /// directory on its path is another user's or writable by others ([`cubenet_sys::trusted_path`]).
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
        // No other user may swap the directory for one holding forged records (R40).
        cubenet_sys::trusted_path::check(dir, "state_dir")
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("{e:#}")))?;
        let tmpfs = nix::sys::statfs::statfs(dir)
            .map(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
            .unwrap_or(false);
        let dirfd = Arc::new(OwnedFd::from(File::open(dir)?));
        Ok(Self { dir: dir.to_path_buf(), dirfd, durable: !tmpfs })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file name (in the directory) of `id`'s record in `phase`.
    fn name(id: &str, phase: &str) -> String {
        format!("{id}.{phase}.json")
    }

    fn unlink(&self, name: &str) -> std::io::Result<()> {
        Ok(unlinkat(&*self.dirfd, name, UnlinkatFlags::NoRemoveDir)?)
    }

    fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        Ok(renameat(&*self.dirfd, from, &*self.dirfd, to)?)
    }

    fn sync_dir(&self) -> std::io::Result<()> {
        if !self.durable {
            return Ok(());
        }
        Ok(fsync(&*self.dirfd)?)
    }

    /// Writes `rec` as phase `phase` atomically, removing any other phase of the same id.
    /// On failure the previous file (if any) is untouched and the temporary file is removed.
    pub fn write(&self, rec: &SandboxRecord, phase: Phase) -> std::io::Result<()> {
        let tmp = Self::name(&rec.sandbox_id, "tmp");
        let written = (|| {
            let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_CLOEXEC;
            let mut f = File::from(openat(&*self.dirfd, tmp.as_str(), flags, Mode::from_bits_truncate(0o600))?);
            fault::check("write")?;
            f.write_all(&serde_json::to_vec(rec).map_err(std::io::Error::other)?)?;
            fault::check("fsync")?;
            if self.durable {
                f.sync_all()?;
            }
            fault::check("rename")?;
            self.rename(&tmp, &Self::name(&rec.sandbox_id, phase.as_str()))
        })();
        if let Err(e) = written {
            // A full disk must not also keep a stray file per failed call.
            let _ = self.unlink(&tmp);
            return Err(e);
        }
        for other in [Phase::Creating, Phase::Success, Phase::Deleting] {
            if other != phase {
                let _ = self.unlink(&Self::name(&rec.sandbox_id, other.as_str()));
            }
        }
        self.sync_dir()
    }

    /// Moves the record of `id` from `from` to `to` (rename).
    pub fn advance(&self, id: &str, from: Phase, to: Phase) -> std::io::Result<()> {
        fault::check("rename")?;
        self.rename(&Self::name(id, from.as_str()), &Self::name(id, to.as_str()))?;
        self.sync_dir()
    }

    /// Removes every file of `id`.
    pub fn remove(&self, id: &str) -> std::io::Result<()> {
        fault::check("unlink")?;
        for p in ["tmp", "creating", "success", "deleting"] {
            match self.unlink(&Self::name(id, p)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        self.sync_dir()
    }

    /// Reads every record; leftover `tmp` files are deleted; unreadable files are returned as
    /// errors (path, message) so recovery can refuse to start.
    pub fn scan(&self) -> std::io::Result<Scan> {
        scan_dir(&self.dir, true)
    }

    /// Reads every record under `dir` without changing anything (no directory created, no
    /// `tmp` file removed: a running agent may be writing one), for the checks an agent makes
    /// before it touches the node (decision H12). A missing directory holds no records.
    /// Errors: the directory cannot be read; unreadable files are returned as by
    /// [`StateStore::scan`].
    pub fn peek(dir: &Path) -> std::io::Result<Scan> {
        match fs::metadata(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Vec::new(), Vec::new())),
            _ => scan_dir(dir, false),
        }
    }

    /// Number of record files (any phase), for leak checks.
    pub fn count(&self) -> usize {
        fs::read_dir(&self.dir).map(|d| d.flatten().count()).unwrap_or(0)
    }
}

/// [`StateStore::scan`] of `dir`; `remove_tmp` deletes leftover `tmp` files.
fn scan_dir(dir: &Path, remove_tmp: bool) -> std::io::Result<Scan> {
    let mut out = Vec::new();
    let mut bad = Vec::new();
    for e in fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".json") else { continue };
        let Some((id, phase)) = stem.rsplit_once('.') else { continue };
        if phase == "tmp" {
            if remove_tmp {
                let _ = fs::remove_file(e.path());
            }
            continue;
        }
        let Some(phase) = Phase::parse(phase) else { continue };
        match fs::read(e.path())
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<SandboxRecord>(&b).map_err(|e| e.to_string()))
        {
            Ok(rec) if rec.sandbox_id == id => out.push((phase, rec)),
            Ok(rec) => bad.push((e.path(), format!("file names sandbox {id:?} but holds {:?}", rec.sandbox_id))),
            Err(m) => bad.push((e.path(), m)),
        }
    }
    out.sort_by(|a, b| a.1.sandbox_id.cmp(&b.1.sandbox_id));
    Ok((out, bad))
}

/// Fault injection for the reliability suite (issue 14): tmpfs gives a real ENOSPC, but no
/// local filesystem gives EIO on demand without a block device (dm-error) the tests must not
/// create. When the environment variable [`fault::ENV`] names a file, every store operation
/// first reads it: a line `<op> <errno>` (op `write`, `fsync`, `rename` or `unlink`, errno a
/// number, e.g. `rename 5`) makes that operation fail with that errno. Unset (production): one
/// `OnceLock` read per operation, nothing else.
pub mod fault {
    use std::{path::PathBuf, sync::OnceLock};

    /// The environment variable naming the fault file.
    pub const ENV: &str = "CUBENET_STATE_FAULTS";

    fn file() -> Option<&'static PathBuf> {
        static F: OnceLock<Option<PathBuf>> = OnceLock::new();
        F.get_or_init(|| std::env::var_os(ENV).map(PathBuf::from)).as_ref()
    }

    /// `Err(errno)` when the fault file asks `op` to fail.
    pub fn check(op: &str) -> std::io::Result<()> {
        let Some(f) = file() else { return Ok(()) };
        let text = std::fs::read_to_string(f).unwrap_or_default();
        for line in text.lines() {
            let mut w = line.split_whitespace();
            if w.next() == Some(op)
                && let Some(errno) = w.next().and_then(|e| e.parse().ok())
            {
                tracing::warn!(op, errno, "injected state store fault");
                return Err(std::io::Error::from_raw_os_error(errno));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_safe_quotes_only_what_is_not_an_id() {
        assert_eq!(LogSafe("sb-1").to_string(), "sb-1");
        assert_eq!(LogSafe("z192.168.0.2").to_string(), "z192.168.0.2");
        let forged = "x\n2026-12-02T04:46:10Z  INFO network released sandbox_id=sb-1";
        let shown = LogSafe(forged).to_string();
        assert!(!shown.contains('\n') && shown.starts_with("\"x\\n2026"), "{shown}");
        assert_eq!(LogSafe("").to_string(), "\"\"");
        assert_eq!(LogSafe("a b\u{1b}[31m").to_string(), "\"a b\\u{1b}[31m\"");
    }

    fn rec(id: &str) -> SandboxRecord {
        SandboxRecord {
            sandbox_id: id.into(),
            tap_name: "z192.168.0.2".into(),
            tap_ifindex: 7,
            sandbox_ip: Ipv4Addr::new(192, 168, 0, 2),
            version: 3,
            port_mappings: vec![PortRecord {
                proto: Proto::Tcp,
                container_port: 80,
                host_port: 20001,
                host_ip: String::new(),
            }],
            policy: EgressPolicy::default(),
            persist_metadata: Default::default(),
        }
    }

    #[test]
    fn phases_and_permissions() {
        let dir = std::env::temp_dir().join(format!("cubenet-state-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let s = StateStore::open(&dir).unwrap();
        assert_eq!(fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        s.write(&rec("sb-1"), Phase::Creating).unwrap();
        s.advance("sb-1", Phase::Creating, Phase::Success).unwrap();
        let f = dir.join("sb-1.success.json");
        assert_eq!(fs::metadata(&f).unwrap().permissions().mode() & 0o777, 0o600);
        fs::write(dir.join("sb-2.tmp.json"), b"{").unwrap();
        fs::write(dir.join("sb-3.success.json"), b"not json").unwrap();
        let (recs, bad) = s.scan().unwrap();
        assert_eq!(recs, vec![(Phase::Success, rec("sb-1"))]);
        assert_eq!(bad.len(), 1);
        assert!(!dir.join("sb-2.tmp.json").exists());
        s.write(&rec("sb-1"), Phase::Deleting).unwrap();
        assert!(!f.exists());
        s.remove("sb-1").unwrap();
        fs::remove_file(dir.join("sb-3.success.json")).unwrap();
        assert_eq!(s.count(), 0);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Attack: the state directory's path is swapped for another directory after the store
    /// opened (and checked) it. No record goes into the swapped-in directory: every operation
    /// is relative to the directory opened (F18).
    #[test]
    fn records_stay_in_the_directory_opened() {
        let base = std::env::temp_dir().join(format!("cubenet-state-swap-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(&base).unwrap();
        let dir = base.join("state");
        let s = StateStore::open(&dir).unwrap();
        s.write(&rec("sb-1"), Phase::Creating).unwrap();
        let moved = base.join("moved");
        fs::rename(&dir, &moved).unwrap();
        fs::create_dir(&dir).unwrap();
        s.advance("sb-1", Phase::Creating, Phase::Success).unwrap();
        s.write(&rec("sb-2"), Phase::Creating).unwrap();
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "a record went into the swapped-in directory");
        assert!(moved.join("sb-1.success.json").exists());
        assert!(moved.join("sb-2.creating.json").exists());
        s.remove("sb-1").unwrap();
        s.remove("sb-2").unwrap();
        assert_eq!(fs::read_dir(&moved).unwrap().count(), 0);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn sandbox_id_rules() {
        assert!(validate_sandbox_id("abc-123_x.y:z").is_ok());
        assert!(validate_sandbox_id("").is_err());
        assert!(validate_sandbox_id("../etc").is_err());
        assert!(validate_sandbox_id("a/b").is_err());
        assert!(validate_sandbox_id(&"a".repeat(65)).is_err());
        assert!(validate_sandbox_id(&"a".repeat(64)).is_ok());
    }
}
