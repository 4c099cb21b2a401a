//! Error type of the `cubevs` library.

use std::path::PathBuf;

/// Everything the library can fail with. Each variant names the object it was working on.
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
    /// The object has no program of that name.
    #[error("program {0} not found in the eBPF object")]
    NoProgram(&'static str),
    /// A program operation (load, attach, test run) failed.
    #[error("{what}: {source}")]
    Program {
        /// What was being done, e.g. `attach from_cube to tcx ingress of z192.168.0.2`.
        what: String,
        /// aya's error.
        source: Box<aya::programs::ProgramError>,
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
}
