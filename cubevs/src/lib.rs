//! `cubevs`: the userspace side of the CubeVS eBPF datapath.
//!
//! - [`Datapath`] loads the eBPF object (built by `cargo xtask build-ebpf`, see
//!   [`default_object_path`]) with a [`DatapathConfig`] written into its `CONFIG` global, and
//!   attaches its programs with tcx links that can be pinned under a bpffs directory so the
//!   datapath outlives the process.
//! - [`testrun`] runs a program on a crafted frame with `BPF_PROG_TEST_RUN`.
//!
//! Interface names are resolved in the **calling thread's** network namespace: call the
//! attach functions from a thread inside the dataplane netns (`cubenet_sys::netns`).
mod datapath;
mod error;
pub mod testrun;

pub use cubevs_common::{DatapathConfig, guest, prog};
pub use datapath::{Datapath, LoadOptions, default_object_path, tcx_ingress_programs};
pub use error::Error;
