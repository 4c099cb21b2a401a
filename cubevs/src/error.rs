//! Error type of the `cubevs` library.

use std::path::PathBuf;

/// Everything the library can fail with. Each variant names the object it was working on;
/// validation errors name the offending field so callers can map them to
/// `INVALID_ARGUMENT`-style replies.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The eBPF object file is missing or unreadable.
    #[error("eBPF object {path}: {source} (build it with `cargo xtask build-ebpf`)")]
    Object {
        /// Path that was tried.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// Loading the object into the kernel failed (verifier, BTF, map creation).
    #[error("load eBPF object {path}: {source}")]
    Load {
        /// Object path.
        path: PathBuf,
        /// aya's error (includes the verifier log).
        source: Box<aya::EbpfError>,
    },
    /// A pinned map exists but its layout differs from the object's.
    #[error("pinned map {path} is incompatible with this datapath: {reason}")]
    IncompatiblePin {
        /// Pin path.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// The kernel's BTF lacks what the datapath needs to run safely (decision R101).
    #[error("kernel BTF: {what}: {reason} (the kernel needs CONFIG_DEBUG_INFO_BTF)")]
    KernelBtf {
        /// What was looked for.
        what: &'static str,
        /// Why it was not found.
        reason: String,
    },
    /// The object has no program or map of that name.
    #[error("{0} not found in the eBPF object")]
    Missing(&'static str),
    /// A program operation (load, attach, test run) failed.
    #[error("{what}: {source}")]
    Program {
        /// What was being done, e.g. `attach from_cube to tcx Ingress of z192.168.0.2`.
        what: String,
        /// aya's error.
        source: Box<aya::programs::ProgramError>,
    },
    /// A map operation failed in the kernel.
    #[error("map {map}: {op}: {source}")]
    Map {
        /// Map name.
        map: &'static str,
        /// Operation, e.g. `insert`.
        op: &'static str,
        /// aya's error.
        source: Box<aya::maps::MapError>,
    },
    /// A raw map syscall (batch lookup/delete) failed.
    #[error("map {map}: {op}: {source}")]
    MapSyscall {
        /// Map name.
        map: &'static str,
        /// Operation, e.g. `batch lookup`.
        op: &'static str,
        /// The errno.
        source: std::io::Error,
    },
    /// Pinning or reading a pin failed.
    #[error("{what}: {source}")]
    Pin {
        /// What was being done.
        what: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// An interface name could not be resolved in the calling thread's netns.
    #[error("interface {name}: {source}")]
    Interface {
        /// Interface name.
        name: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A caller-supplied value is invalid; nothing was changed.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// Field name, e.g. `allow_out[2]` or `host_port`.
        field: String,
        /// Why.
        reason: String,
    },
    /// A request would exceed a map's capacity; nothing was changed.
    #[error("{map} exceeds maximum entries: got {got}, max {max}")]
    TooManyEntries {
        /// Map name.
        map: &'static str,
        /// Entries requested.
        got: usize,
        /// Limit.
        max: usize,
    },
    /// The entry conflicts with an existing one; nothing was changed.
    #[error("conflict: {0}")]
    Conflict(String),
    /// Another process holds the datapath update lock of this pin directory.
    #[error("datapath update refused: another updater holds the lock on {path} (retry when it has finished)")]
    Busy {
        /// The locked pin directory.
        path: PathBuf,
    },
    /// A slot operation is not possible in the current state; nothing was changed.
    #[error("{0}")]
    Slot(String),
    /// The self-test of a newly loaded datapath failed; the active slot keeps serving.
    #[error("self-test of the standby datapath failed, active slot unchanged: {0}")]
    SelfTest(String),
}

impl Error {
    pub(crate) fn map(map: &'static str, op: &'static str) -> impl FnOnce(aya::maps::MapError) -> Error {
        move |source| Error::Map { map, op, source: Box::new(source) }
    }

    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::InvalidArgument { field: field.into(), reason: reason.into() }
    }
}

/// True when a map error is "no such key" (`ENOENT`), which deletes treat as success.
pub(crate) fn is_not_found(e: &aya::maps::MapError) -> bool {
    match e {
        aya::maps::MapError::KeyNotFound | aya::maps::MapError::ElementNotFound => true,
        aya::maps::MapError::SyscallError(s) => s.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// `Ok(None)` for a lookup that found no key ([`is_not_found`]), the other results as they are.
pub(crate) fn ok_absent<T>(r: Result<T, aya::maps::MapError>) -> Result<Option<T>, aya::maps::MapError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// True when a map error is "key exists" (`EEXIST` from a `BPF_NOEXIST` insert).
pub(crate) fn is_exists(e: &aya::maps::MapError) -> bool {
    matches!(e, aya::maps::MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::EEXIST))
}
