//! Live agent upgrades (issue 12) for tests and the `upgrade` benchmark: agent generations
//! started by `scripts/start-network-agent.sh` with `NETWORK_AGENT_HANDOVER_SOCKET`, the
//! hand-over to a new binary, a crash restart, and [`KernelGuest`], a guest whose network
//! stack is a kernel's in a namespace, carried over the agent's TAP fd by a frame relay that
//! plays the VMM.

use std::{
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use cubenet_sys::tap::{Tap, TapOptions, VNET_HDR_LEN};

use crate::{
    agent::{AgentUnderTest, workspace_bin},
    netns::{ChildGuard, TestNetns},
};

/// The hand-over socket every agent generation of `a` uses (`<dir>/cube/handover.sock`).
pub fn handover_socket(a: &AgentUnderTest) -> PathBuf {
    a.dir.join("cube/handover.sock")
}

/// The start script with the hand-over socket set, as an operator starts every agent
/// generation; `args` go to `NETWORK_AGENT_ARGS` (none when empty).
pub fn spawn_agent(a: &AgentUnderTest, args: &str) -> ChildGuard {
    let mut cmd = a.script_command();
    cmd.env("NETWORK_AGENT_HANDOVER_SOCKET", handover_socket(a));
    if !args.is_empty() {
        cmd.env("NETWORK_AGENT_ARGS", args);
    }
    ChildGuard::from_child(cmd.spawn().expect("spawn start-network-agent.sh"))
}

/// Polls `f` every 20 ms until it holds; `Err` naming `what` after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Result<(), String> {
    let t = Instant::now();
    while !f() {
        if t.elapsed() >= timeout {
            return Err(format!("{what} not within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Waits until `n` agent generations of `a` have bound their hand-over socket (the file a
/// killed agent leaves does not count).
pub fn wait_handover_listening(a: &AgentUnderTest, n: usize) -> Result<(), String> {
    wait_until("hand-over socket", Duration::from_secs(10), || a.log().matches(r#""hand-over listener""#).count() >= n)
}

/// Starts the first generation and waits until it is ready and listens for a hand-over.
pub fn start(a: &mut AgentUnderTest) {
    a.child = Some(spawn_agent(a, ""));
    a.wait_ready(Duration::from_secs(30));
    wait_handover_listening(a, 1).unwrap_or_else(|e| panic!("{e}:\n{}", a.log()));
}

/// Waits for `c` to exit; `Err` after `timeout`.
pub fn wait_exit(c: &mut ChildGuard, timeout: Duration) -> Result<std::process::ExitStatus, String> {
    let t = Instant::now();
    loop {
        if let Some(st) = c.child().try_wait().map_err(|e| e.to_string())? {
            return Ok(st);
        }
        if t.elapsed() >= timeout {
            return Err(format!("agent {} did not exit within {timeout:?}", c.id()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Upgrades `a` to a copy of the agent binary (a new version at another path): the successor
/// is started while the old agent runs. Returns once the successor serves (its log says the
/// hand-over completed) and `/readyz` answers 200 — the old agent still finishes its
/// in-flight requests then — with the old agent's process, to be waited for.
pub fn hand_over(a: &mut AgentUnderTest) -> Result<ChildGuard, String> {
    static GENERATION: AtomicUsize = AtomicUsize::new(0);
    let next = a.dir.join(format!("network-agent-next-{}", GENERATION.fetch_add(1, Ordering::Relaxed)));
    std::fs::copy(workspace_bin("network-agent"), &next).map_err(|e| format!("copy the agent binary: {e}"))?;
    a.agent_bin = Some(next);
    let old = a.child.take().ok_or("no agent running")?;
    let done_before = a.log().matches("hand-over complete").count();
    a.child = Some(spawn_agent(a, ""));
    wait_until("hand-over", Duration::from_secs(60), || a.log().matches("hand-over complete").count() > done_before)?;
    wait_until("successor ready", Duration::from_secs(30), || matches!(a.http("/readyz"), Some((200, _))))?;
    Ok(old)
}

/// [`hand_over`], then waits until the old agent exited with status 0. Returns the time
/// from the successor's start until then.
pub fn upgrade(a: &mut AgentUnderTest) -> Result<Duration, String> {
    let t = Instant::now();
    let mut old = hand_over(a)?;
    let st = wait_exit(&mut old, Duration::from_secs(60))?;
    if !st.success() {
        return Err(format!("old agent exit {st}"));
    }
    Ok(t.elapsed())
}

/// `kill -9` of the running agent, then a new start (nothing to hand over) until `/readyz`
/// answers 200.
pub fn crash_restart(a: &mut AgentUnderTest) -> Result<(), String> {
    let mut old = a.child.take().ok_or("no agent running")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(old.id() as i32), nix::sys::signal::Signal::SIGKILL)
        .map_err(|e| e.to_string())?;
    wait_exit(&mut old, Duration::from_secs(10))?;
    a.child = Some(spawn_agent(a, ""));
    wait_until("restarted agent ready", Duration::from_secs(60), || matches!(a.http("/readyz"), Some((200, _))))
}

/// A guest whose network stack is a kernel's: a TAP `eth0` in a namespace of its own,
/// configured from the Ensure response (MAC, address, MTU, default route), and two relay
/// threads (playing the VMM) that copy frames, vnet header included, between it and the TAP
/// fd the agent handed out. The guest TAP has no offloads, so the guest kernel sends plain
/// frames; GSO or checksum-offloaded frames from the host pass through with their header.
#[derive(Debug)]
pub struct KernelGuest {
    /// The guest's namespace (run its sockets with [`TestNetns::run`]).
    pub ns: TestNetns,
    stop: Arc<AtomicBool>,
    relays: Vec<JoinHandle<()>>,
}

impl KernelGuest {
    /// `vmm_fd`: the TAP fd from the agent's fd socket; `mac`, `ip_cidr` (`a.b.c.d/n`),
    /// `gateway` and `mtu`: the Ensure response's interface.
    pub fn new(vmm_fd: OwnedFd, mac: &str, ip_cidr: &str, gateway: &str, mtu: u32) -> Self {
        let ns = TestNetns::new("guest");
        let opts = TapOptions { vnet_hdr: true, vnet_hdr_len: VNET_HDR_LEN, offload: 0, persist: false };
        let guest_fd = ns.run(move || {
            let t = Tap::open("eth0", opts).expect("guest TAP");
            let _ = std::fs::write("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "1");
            t.into_fd()
        });
        ns.ip(&["link", "set", "eth0", "address", mac, "mtu", &mtu.to_string()]);
        ns.ip(&["addr", "add", ip_cidr, "dev", "eth0"]);
        ns.ip(&["link", "set", "eth0", "up"]);
        ns.ip(&["route", "add", "default", "via", gateway]);
        let (vmm, guest) = (Arc::new(vmm_fd), Arc::new(guest_fd));
        let stop = Arc::new(AtomicBool::new(false));
        let relays = vec![relay(vmm.clone(), guest.clone(), stop.clone()), relay(guest, vmm, stop.clone())];
        Self { ns, stop, relays }
    }
}

fn relay(from: Arc<OwnedFd>, to: Arc<OwnedFd>, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536 + VNET_HDR_LEN];
        while !stop.load(Ordering::Relaxed) {
            let mut fds = [nix::poll::PollFd::new(from.as_fd(), nix::poll::PollFlags::POLLIN)];
            if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(20u16)).unwrap_or(0) == 0 {
                continue;
            }
            match nix::unistd::read(&*from, &mut buf) {
                Ok(n) if n > 0 => {
                    // A full TAP queue drops the frame, as a real NIC would.
                    let _ = nix::unistd::write(&*to, &buf[..n]);
                }
                Ok(_) | Err(nix::errno::Errno::EAGAIN) => {}
                Err(e) => panic!("relay read: {e}"),
            }
        }
    })
}

impl Drop for KernelGuest {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for r in self.relays.drain(..) {
            let _ = r.join();
        }
    }
}
