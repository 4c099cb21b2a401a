//! Running the network-agent under test: started by `scripts/start-network-agent.sh` in a
//! namespace of its own (the "pod"), programming the topology's node namespace (the "host")
//! through `dataplane_netns`, pinning into a private bpffs, with sockets and state under a
//! private temporary directory. Everything is removed on drop.

use std::{
    io::{Read, Write},
    os::{fd::OwnedFd, unix::net::UnixStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use crate::{
    bpffs::BpfFs,
    netns::{ChildGuard, TestNetns},
    topology::Topology,
};

/// The health address inside the agent namespace (its own loopback, so tests never clash).
pub const HEALTH: &str = "127.0.0.1:19090";

/// Path of a workspace binary built by cargo: `$CUBENET_BIN_DIR/<name>` when set (benchmarks
/// and the demo use release builds), else the debug profile of this test build.
pub fn workspace_bin(name: &str) -> PathBuf {
    match std::env::var_os("CUBENET_BIN_DIR") {
        Some(dir) => {
            let p = PathBuf::from(dir).join(name);
            assert!(p.exists(), "{} missing: build it first", p.display());
            p
        }
        None => profile_bin("debug", name),
    }
}

/// Path of a workspace binary of cargo profile `profile` (`debug`, `release`).
pub fn profile_bin(profile: &str, name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target").join(profile).join(name);
    assert!(p.exists(), "{} missing: build the workspace (cargo build) first", p.display());
    p
}

/// An agent under test and everything it uses.
#[derive(Debug)]
pub struct AgentUnderTest {
    /// The agent's process; killed on drop.
    pub child: Option<ChildGuard>,
    /// The agent's own namespace.
    pub ns: TestNetns,
    /// Private bpffs (pins under `<bpffs>/cubevs`).
    pub bpffs: BpfFs,
    /// Temporary directory: config, sockets, state, logs.
    pub dir: PathBuf,
    /// The node/world topology whose node namespace is the dataplane.
    pub topo: Topology,
    /// The agent binary the start script execs (default: the debug build's `network-agent`).
    pub agent_bin: Option<PathBuf>,
    /// Run the start script in the mount namespace of this PID (`nsenter -m`), e.g. a
    /// [`crate::mntns::PrivateTmpfs`] holder.
    pub mount_ns_of: Option<u32>,
    /// Extra environment for the agent.
    pub env: Vec<(String, String)>,
    /// Run the agent in the node namespace (the dataplane) instead of [`AgentUnderTest::ns`],
    /// as upstream's pod does: its health/dump listener and its CubeEgress client then share
    /// the dataplane's loopback with a gateway there (decision L7).
    pub in_dataplane: bool,
}

impl AgentUnderTest {
    /// Creates the topology, the agent namespace, bpffs and config (`tap_init_num` TAPs,
    /// `extra` appended to the TOML; cidr 192.168.0.0/24 unless `extra` sets `cidr`), without
    /// starting the agent.
    pub fn prepare(tag: &str, tap_init_num: usize, extra: &str) -> Self {
        let topo = Topology::new();
        let ns = TestNetns::new("agent");
        let bpffs = BpfFs::new();
        let dir = std::env::temp_dir().join(format!("cubenet-agent-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("cube")).unwrap();
        std::fs::create_dir_all(dir.join("state")).unwrap();
        std::fs::create_dir_all(dir.join("log")).unwrap();
        let cfg = format!(
            "grpc_listen = \"unix://{d}/cube/grpc.sock\"\n\
             tap_fd_listen = \"{d}/cube/tap.sock\"\n\
             health_listen = \"{HEALTH}\"\n\
             dataplane_netns = \"{node}\"\n\
             {cidr}\
             tap_init_num = {tap_init_num}\n\
             bpffs_dir = \"{bpf}/cubevs\"\n\
             bpf_object = \"{obj}\"\n\
             state_dir = \"{d}/state\"\n\
             maintenance_interval_secs = 1\n\
             {reserved}{extra}",
            d = dir.display(),
            node = topo.node.path().display(),
            bpf = bpffs.path().display(),
            obj = crate::ebpf_object().display(),
            // `extra` may set its own CIDR (TOML forbids the key twice).
            cidr = if extra.contains("cidr =") { "" } else { "cidr = \"192.168.0.0/24\"\n" },
            reserved =
                if extra.contains("reserved_ports_file =") { "" } else { "reserved_ports_file = \"/nonexistent\"\n" },
        );
        std::fs::write(dir.join("agent.toml"), cfg).unwrap();
        Self {
            child: None,
            ns,
            bpffs,
            dir,
            topo,
            agent_bin: None,
            mount_ns_of: None,
            env: Vec::new(),
            in_dataplane: false,
        }
    }

    /// The namespace the agent runs in: [`AgentUnderTest::ns`], or the node namespace with
    /// [`AgentUnderTest::in_dataplane`].
    pub fn agent_ns(&self) -> &TestNetns {
        if self.in_dataplane { &self.topo.node } else { &self.ns }
    }

    /// Starts the agent through the start script and waits for `/readyz`.
    pub fn start(&mut self) {
        let child = self.spawn_script();
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(30));
    }

    /// Spawns the start script inside the agent namespace (log appended to `agent.log`).
    pub fn spawn_script(&self) -> ChildGuard {
        ChildGuard::from_child(self.script_command().spawn().expect("spawn start-network-agent.sh"))
    }

    /// The start script's command as [`AgentUnderTest::spawn_script`] runs it (in the agent
    /// namespace, log to `log/agent.log`, a 5 s wait bound), for tests that change its
    /// environment before spawning.
    pub fn script_command(&self) -> Command {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/start-network-agent.sh");
        let mut cmd = match self.mount_ns_of {
            Some(pid) => {
                let mut c = self.agent_ns().command("nsenter");
                c.args(["-t", &pid.to_string(), "-m", "--", "bash"]);
                c
            }
            None => self.agent_ns().command("bash"),
        };
        cmd.arg(script)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("NETWORK_AGENT_CONFIG", self.dir.join("agent.toml"))
            .env("NETWORK_AGENT_BIN", self.agent_bin.clone().unwrap_or_else(|| workspace_bin("network-agent")))
            .env("NETWORK_AGENT_LOG_DIR", self.dir.join("log"))
            .env("NETWORK_AGENT_LOG_FILE", self.dir.join("log/agent.log"))
            .env("NETWORK_AGENT_WAIT_SECS", "5")
            .env("NETWORK_AGENT_MOUNT_BPFFS", "0")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null());
        cmd
    }

    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log/agent.log")).unwrap_or_default()
    }

    /// Polls `/readyz` until 200 or `timeout` (panics with the log).
    pub fn wait_ready(&mut self, timeout: Duration) {
        let t = Instant::now();
        loop {
            if let Some((200, _)) = self.http("/readyz") {
                return;
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(st)) = c.child().try_wait()
            {
                panic!("agent exited ({st}) before ready:\n{}", self.log());
            }
            assert!(t.elapsed() < timeout, "agent not ready after {timeout:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `GET path` on the health address from inside the agent namespace.
    pub fn http(&self, path: &str) -> Option<(u16, String)> {
        let p = path.to_string();
        self.agent_ns().run(move || http_get(HEALTH, &p).ok())
    }

    /// `GET path` parsed as JSON (panics on non-200).
    pub fn http_json(&self, path: &str) -> serde_json::Value {
        let (code, body) = self.http(path).unwrap_or_else(|| panic!("GET {path} failed"));
        assert_eq!(code, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
    }

    /// `unix://…` gRPC endpoint.
    pub fn grpc_endpoint(&self) -> String {
        format!("unix://{}", self.dir.join("cube/grpc.sock").display())
    }

    /// The TAP fd socket.
    pub fn tap_socket(&self) -> PathBuf {
        self.dir.join("cube/tap.sock")
    }

    /// The sandbox's TAP fd from the fd socket (as a VMM asks for it: its first interface's name
    /// and its id) as a raw-frame guest with the pool's 12-byte vnet header, drained of what
    /// the kernel queued before. Panics unless the agent answers errCode 0 with an fd.
    pub fn guest(&self, r: &cubenet_proto::v1::EnsureNetworkResponse) -> crate::guest::TapGuest {
        let (reply, fd) = tap_fd(&self.tap_socket(), &r.interfaces[0].name, &r.sandbox_id);
        assert_eq!(reply["errCode"], "0", "{reply}");
        let g = crate::guest::TapGuest::new(fd.expect("errCode 0 without an fd"), cubenet_sys::tap::VNET_HDR_LEN);
        g.drain();
        g
    }

    /// ReleaseNetwork of `id` over gRPC (the agent's own client, a fresh connection); returns
    /// the answer's `released`. Panics, with the agent's log, when the call fails.
    pub fn release(&self, id: &str) -> bool {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let r = rt.block_on(async {
            let mut c = network_agent::client::connect(&self.grpc_endpoint()).await?;
            let req = cubenet_proto::v1::ReleaseNetworkRequest { sandbox_id: id.into(), ..Default::default() };
            Ok::<_, Box<dyn std::error::Error>>(c.release_network(req).await?.into_inner().released)
        });
        r.unwrap_or_else(|e| panic!("release {id}: {e}\n{}", self.log()))
    }

    /// The state directory.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// The bpffs pin directory of the datapath.
    pub fn pin_dir(&self) -> PathBuf {
        self.bpffs.path().join("cubevs")
    }

    /// Names of the cube TAPs in the node namespace.
    pub fn node_taps(&self) -> Vec<String> {
        let out = self.topo.node.ip(&["-j", "link", "show"]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j link");
        v.as_array()
            .unwrap()
            .iter()
            .filter_map(|l| l["ifname"].as_str().map(str::to_string))
            .filter(|n| n.starts_with('z'))
            .collect()
    }

    /// Sends `signal` to the running agent (it keeps running: SIGHUP reloads).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let c = self.child.as_ref().expect("agent running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), signal).expect("signal agent");
    }

    /// Waits until the log holds more than `before` lines containing `what` (panics with the
    /// log after `timeout`); returns the new count.
    pub fn wait_log_count(&self, what: &str, before: usize, timeout: Duration) -> usize {
        let t = Instant::now();
        loop {
            let n = self.log().matches(what).count();
            if n > before {
                return n;
            }
            assert!(t.elapsed() < timeout, "no new {what:?} in the log after {timeout:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the agent process with `signal` and reaps it.
    pub fn kill(&mut self, signal: nix::sys::signal::Signal) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("agent running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), signal).expect("kill agent");
        c.child().wait().expect("wait agent")
    }
}

impl Drop for AgentUnderTest {
    fn drop(&mut self) {
        self.child.take();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Minimal HTTP/1.0 GET returning (status, body).
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((code, body.to_string()))
}

/// One TAP fd request as the VMM makes it: a single write of `request`, one `recvmsg` with a
/// 256-byte buffer and one fd slot. Returns the JSON reply and the fd, if one came.
pub fn request_tap_fd(socket: &Path, request: &[u8]) -> (serde_json::Value, Option<OwnedFd>) {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::os::fd::{AsRawFd, FromRawFd};
    let s = UnixStream::connect(socket).unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    (&s).write_all(request).unwrap();
    let mut buf = [0u8; 256];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    // MSG_CMSG_CLOEXEC: processes the test spawns later must not inherit the TAP queue.
    let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC).expect("recvmsg");
    let mut fd = None;
    for c in msg.cmsgs().expect("cmsgs") {
        if let ControlMessageOwned::ScmRights(fds) = c {
            assert!(fds.len() <= 1, "more than one fd: {fds:?}");
            // SAFETY: the kernel installed these fds in our table for us (SCM_RIGHTS).
            fd = fds.first().map(|&f| unsafe { OwnedFd::from_raw_fd(f) });
        }
    }
    let n = msg.bytes;
    let v = serde_json::from_slice(&buf[..n])
        .unwrap_or_else(|e| panic!("reply {:?}: {e}", String::from_utf8_lossy(&buf[..n])));
    (v, fd)
}

/// `request_tap_fd` with the upstream JSON request.
pub fn tap_fd(socket: &Path, tap: &str, sandbox: &str) -> (serde_json::Value, Option<OwnedFd>) {
    let req = serde_json::json!({"name": tap, "sandboxId": sandbox}).to_string();
    request_tap_fd(socket, req.as_bytes())
}

/// Runs a command and returns its output (no status check).
pub fn output(cmd: &mut Command) -> std::process::Output {
    cmd.stdin(Stdio::null()).output().expect("spawn")
}
