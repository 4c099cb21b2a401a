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
//!   namespace, programming the topology's node namespace; [`agent_upgrade`]: its live
//!   upgrade (hand-over to a new binary), crash restart, and a kernel guest on a frame relay.
//! - [`mntns::PrivateTmpfs`]: a size-limited tmpfs in a private mount namespace (real ENOSPC).
//! - [`l7`]: world DNS + HTTP/HTTPS servers that record requests, and the real `cube-egress`
//!   behind TPROXY in a namespace (the L7 path end to end); [`egress`]: the real
//!   `cube-egress` as a bare process with its admin API, as the agent tests drive it.
//! - [`tls`]: a throwaway CA, leaves and client configs for TLS tests.
//! - [`rig::Rig`]: the CubeVS datapath under `BPF_PROG_TEST_RUN` with one sandbox registered;
//!   [`frames`] builds the exact frames it is fed and compared with.
//! - [`vm`]: real Linux guests under QEMU on a TAP fd, configured and checked from the kernel
//!   command line (image built by `scripts/guest-image.sh`).
//!
//! Root-only tests call [`require_root`] first; every test that cannot run here calls
//! [`skip`], which prints `SKIPPED: <test>: <reason>` and records it for `scripts/test.sh`.
pub mod agent;
pub mod agent_upgrade;
pub mod bpffs;
pub mod capture;
pub mod deny_probe;
pub mod dns;
pub mod egress;
pub mod egress_swap;
pub mod frames;
pub mod fuzz;
pub mod grpcio;
pub mod guest;
pub mod hsflood;
pub mod l7;
pub mod mntns;
pub mod netns;
pub mod packet;
pub mod pod;
pub mod rig;
pub mod servers;
pub mod smol;
pub mod tap_node;
pub mod tls;
pub mod topology;
pub mod veth_node;
pub mod vm;

/// Polls `f` every 50 ms for up to `timeout`; panics naming `what` when it never holds.
pub fn wait_for(what: &str, timeout: std::time::Duration, mut f: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < end {
        if f() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// A scratch directory, removed with everything in it on drop (also on panic).
#[derive(Debug)]
pub struct TmpDir(pub std::path::PathBuf);

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Environment variable naming the directory where [`skip`] records skipped tests (one file
/// per test, named after it, holding the reason). `scripts/test.sh` sets it and lists them.
pub const SKIP_DIR_ENV: &str = "CUBENET_SKIP_DIR";

/// Reports that `test` did not run here and why: prints `SKIPPED: <test>: <reason>` on its own
/// line to stderr (shown by the runner with `--nocapture`) and, when [`SKIP_DIR_ENV`] is set,
/// writes `<dir>/<test>` with the reason so the test command counts it as skipped, not passed.
/// The caller returns right after.
pub fn skip(test: &str, reason: impl std::fmt::Display) {
    let line = format!("SKIPPED: {test}: {reason}");
    eprintln!("\n{line}\n");
    if let Some(dir) = std::env::var_os(SKIP_DIR_ENV) {
        let dir = std::path::PathBuf::from(dir);
        let file = dir.join(test.replace(['/', '\0'], "_"));
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&file, format!("{reason}\n"))) {
            // The skip must not pass silently: fail the test instead.
            panic!("{line} (could not record it in {}: {e})", file.display());
        }
    }
}

/// True when the process can run root-only tests; otherwise [`skip`]s `test`.
pub fn require_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    skip(test, "needs root (CAP_NET_ADMIN, CAP_BPF, CAP_SYS_ADMIN)");
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
