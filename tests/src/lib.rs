//! Network-namespace test harness for CubeNet.
//!
//! Everything here builds its own network namespaces and never touches the machine's own
//! interfaces, routes, sysctls or `/sys/fs/bpf`:
//!
//! - [`netns::TestNetns`]: a uniquely named namespace, deleted on drop (also on panic);
//!   run code on a thread inside it, spawn processes in it, run `ip` against it.
//! - [`topology::Topology`]: a "node" and a "world" namespace joined by a veth uplink
//!   (node 198.51.100.2/24, world 198.51.100.1/24, node default route via world), plus
//!   sandbox guests: [`guest::VethGuest`] (a namespace configured like a microVM NIC, so the
//!   real kernel stack is the guest) and TAPs for [`guest::TapGuest`].
//! - [`guest::TapGuest`]: owns a TAP fd and speaks raw Ethernet ([`packet`] builds and
//!   parses frames with `etherparse`), with a smoltcp TCP/IP stack on the same fd ([`smol`]).
//! - [`servers`]: TCP/HTTP and UDP echo servers bound inside a namespace.
//! - [`bpffs::BpfFs`]: a private bpffs instance mounted in a temporary directory.
//! - [`agent::AgentUnderTest`]: the network-agent started by its start script in its own
//!   namespace, programming the topology's node namespace.
//! - [`tls`]: a throwaway CA, leaves and client configs for TLS tests.
//! - [`rig::Rig`]: the CubeVS datapath under `BPF_PROG_TEST_RUN` with one sandbox registered;
//!   [`frames`] builds the exact frames it is fed and compared with.
//! - [`vm`]: real Linux guests under QEMU on a TAP fd, configured and checked from the kernel
//!   command line (image built by `scripts/guest-image.sh`).
//!
//! Root-only tests call [`require_root`] first, which prints a loud SKIP line when not root.
pub mod agent;
pub mod bpffs;
pub mod frames;
pub mod fuzz;
pub mod guest;
pub mod netns;
pub mod packet;
pub mod rig;
pub mod servers;
pub mod smol;
pub mod tls;
pub mod topology;
pub mod vm;

/// True when the process can run root-only tests. Otherwise prints a loud skip notice naming
/// `test` to stderr (visible with `--nocapture` and in the test summary of the runner).
pub fn require_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    eprintln!("\n!!! SKIPPED {test}: needs root (CAP_NET_ADMIN, CAP_BPF, CAP_SYS_ADMIN) !!!\n");
    false
}

/// Path of the CubeVS eBPF object the tests load; panics with a clear message when missing.
pub fn ebpf_object() -> std::path::PathBuf {
    let p = std::env::var_os("CUBEVS_BPF_OBJECT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/ebpf/cubevs.bpf.o"));
    assert!(p.exists(), "eBPF object {} missing: run `cargo xtask build-ebpf` first", p.display());
    p
}
