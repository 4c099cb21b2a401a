//! How the agent starts: what `scripts/start-network-agent.sh` waits for, configurations the
//! agent must refuse at start, and per-namespace settings read in the dataplane namespace.

use std::{
    fs::File,
    process::Stdio,
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{agent::AgentUnderTest, netns::ChildGuard, require_root};
use tonic::Code;

/// Logging to stderr only (no log file, no log directory): the script waits for nothing and
/// the agent is ready at once, creating its own socket and state directories. The old script
/// waited for `/data/log/network-agent` regardless and failed when the bound passed.
#[test]
fn start_script_logging_to_stderr_waits_for_nothing() {
    if !require_root("start_script_logging_to_stderr_waits_for_nothing") {
        return;
    }
    let mut a = AgentUnderTest::prepare("stderr", 1, "");
    // Neither the socket nor the state directory exists: the agent makes them.
    std::fs::remove_dir_all(a.dir.join("cube")).unwrap();
    std::fs::remove_dir_all(a.dir.join("state")).unwrap();
    let stderr = a.dir.join("stderr.log");
    let mut cmd = a.script_command();
    cmd.env_remove("NETWORK_AGENT_LOG_DIR")
        .env_remove("NETWORK_AGENT_LOG_FILE")
        .env("NETWORK_AGENT_WAIT_SECS", "20")
        .stdout(Stdio::null())
        .stderr(File::create(&stderr).unwrap());
    let t = Instant::now();
    a.child = Some(ChildGuard::from_child(cmd.spawn().unwrap()));
    let read = || std::fs::read_to_string(&stderr).unwrap_or_default();
    loop {
        if let Some((200, _)) = a.http("/readyz") {
            break;
        }
        if let Ok(Some(st)) = a.child.as_mut().unwrap().child().try_wait() {
            panic!("start script exited ({st}):\n{}", read());
        }
        assert!(t.elapsed() < Duration::from_secs(15), "not ready after 15 s:\n{}", read());
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = read();
    assert!(log.contains("(1) directories present: none to wait for"), "{log}");
    // The agent's own log went to stderr.
    assert!(log.contains("serving; warming the TAP pool"), "{log}");
    assert!(a.dir.join("cube/grpc.sock").exists() && a.dir.join("state").is_dir());
    eprintln!("ready through the script in {:?}", t.elapsed());
}

/// Logging to a file whose directory is missing: a bounded wait, then a failure that names the
/// directory (never a silent start that loses the log).
#[test]
fn start_script_fails_clearly_when_the_log_directory_is_missing() {
    if !require_root("start_script_fails_clearly_when_the_log_directory_is_missing") {
        return;
    }
    let a = AgentUnderTest::prepare("nologdir", 1, "");
    let missing = a.dir.join("no-such-log-volume");
    let mut cmd = a.script_command();
    cmd.env_remove("NETWORK_AGENT_LOG_DIR")
        .env("NETWORK_AGENT_LOG_FILE", missing.join("agent.log"))
        .env("NETWORK_AGENT_WAIT_SECS", "2")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let t = Instant::now();
    let out = cmd.spawn().unwrap().wait_with_output().unwrap();
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(8), "{took:?}: {err}");
    assert!(
        err.contains(&format!("directory {} (log or volume) did not appear within 2s", missing.display())),
        "{err}"
    );
}

/// `start-network-agent.sh --help` prints its usage and `--config x` is refused, instead of
/// starting the agent with the defaults (whose `dataplane_netns` is the node's namespace). The
/// binary is a path that does not exist, so a regression fails here without starting anything.
#[test]
fn start_script_takes_no_arguments_and_has_help() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/start-network-agent.sh");
    let run = |arg: &str| {
        std::process::Command::new("bash")
            .arg(&script)
            .arg(arg)
            .env("NETWORK_AGENT_BIN", "/nonexistent/network-agent")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let help = run("--help");
    let out = String::from_utf8_lossy(&help.stdout);
    assert_eq!(help.status.code(), Some(0), "{help:?}");
    assert!(out.starts_with("Starts the CubeNet network-agent") && out.contains("NETWORK_AGENT_CONFIG"), "{out}");
    let bad = run("--config");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert!(err.contains("no arguments taken (got '--config')") && err.contains("NETWORK_AGENT_ARGS"), "{err}");
}

/// A CIDR whose TAP names `z<ip>` exceed 15 bytes is refused at start with the key named;
/// the old agent started and failed later, per TAP, from 192.168.100.100 on.
#[test]
fn cidr_whose_tap_names_do_not_fit_is_refused_at_start() {
    if !require_root("cidr_whose_tap_names_do_not_fit_is_refused_at_start") {
        return;
    }
    let a = AgentUnderTest::prepare("longnames", 1, "cidr = \"192.168.100.0/24\"\n");
    let mut cmd = a.script_command();
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    let mut c = ChildGuard::from_child(cmd.spawn().unwrap());
    let st = c.exit_within(Duration::from_secs(15)).expect("the agent started with an unusable CIDR");
    assert!(!st.success());
    let mut err = String::new();
    std::io::Read::read_to_string(c.child().stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("config key `cidr`") && err.contains("\"z192.168.100.254\" (16 bytes)"), "{err}");
}

/// Started without root (uid 65534, as a newcomer running it from a shell might), the agent
/// exits 1 naming the step that was refused and saying it must run as root, before it
/// changes anything (decision O3).
#[test]
fn agent_started_without_root_says_it_needs_root() {
    if !require_root("agent_started_without_root_says_it_needs_root") {
        return;
    }
    let a = AgentUnderTest::prepare("nonroot", 1, "");
    let out = a
        .agent_ns()
        .command("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(cubenet_tests::agent::workspace_bin("network-agent"))
        .arg("--config")
        .arg(a.dir.join("agent.toml"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("startup step `enter dataplane netns`"), "{err}");
    assert!(
        err.contains("network-agent: running as uid 65534: the agent must run as root")
            && err.contains("sudo scripts/start-network-agent.sh"),
        "{err}"
    );
    // Nothing was made: no cube-dev in the dataplane namespace, no pins.
    let links = a.topo.node.exec("ip", &["-o", "link", "show"]);
    assert!(!String::from_utf8_lossy(&links.stdout).contains("cube-dev"));
    assert!(!a.bpffs.path().join("cubevs").exists());
}

/// A health address no interface of the agent's namespace has (as 127.0.0.1 is while a new
/// namespace's loopback is down): the start fails naming the key and saying what to do.
#[test]
fn unbindable_health_address_says_what_to_do() {
    if !require_root("unbindable_health_address_says_what_to_do") {
        return;
    }
    let a = AgentUnderTest::prepare("noaddr", 1, "");
    let mut cmd = a.script_command();
    cmd.env("NETWORK_AGENT_ARGS", "--health-listen 192.0.2.77:19090").stdout(Stdio::null()).stderr(Stdio::piped());
    let mut c = ChildGuard::from_child(cmd.spawn().unwrap());
    let st = c.exit_within(Duration::from_secs(30)).expect("the agent started without its health address");
    assert_eq!(st.code(), Some(1));
    let log = a.log();
    assert!(
        log.contains("bind health_listen 192.0.2.77:19090: Cannot assign requested address")
            && log.contains("bring loopback up first: `ip link set lo up`"),
        "{log}"
    );
}

/// `bpffs_dir` outside any bpf filesystem, the agent started directly (the script would refuse
/// first): the start fails naming the key and how to mount one, before anything is created
/// (it failed deep in the loader with `map … requested pinning. pinning failed`; O14).
#[test]
fn bpffs_dir_not_on_bpffs_is_refused_clearly() {
    if !require_root("bpffs_dir_not_on_bpffs_is_refused_clearly") {
        return;
    }
    let a = AgentUnderTest::prepare("notbpffs", 1, "");
    let pins = a.dir.join("not-bpffs/cubevs");
    let out = a
        .agent_ns()
        .command(cubenet_tests::agent::workspace_bin("network-agent").to_str().unwrap())
        .arg("--config")
        .arg(a.dir.join("agent.toml"))
        .arg("--bpffs-dir")
        .arg(&pins)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "bpffs_dir {} is not on a bpf filesystem ({} is not bpffs)",
            pins.display(),
            a.dir.display()
        )) && err.contains("mount -t bpf bpf"),
        "{err}"
    );
    assert!(!a.dir.join("not-bpffs").exists(), "the agent created pin directories off bpffs");
    let links = a.topo.node.exec("ip", &["-o", "link", "show"]);
    assert!(!String::from_utf8_lossy(&links.stdout).contains("cube-dev"));
}

/// `ip_local_reserved_ports` is a per-namespace sysctl: the agent (in its own namespace) must
/// honour the dataplane namespace's list when it picks host ports.
#[test]
fn reserved_ports_come_from_the_dataplane_namespace() {
    if !require_root("reserved_ports_come_from_the_dataplane_namespace") {
        return;
    }
    let mut a = AgentUnderTest::prepare(
        "reserved",
        2,
        "reserved_ports_file = \"/proc/sys/net/ipv4/ip_local_reserved_ports\"\nhost_port_range = \"20000-20003\"\n",
    );
    const SYSCTL: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";
    a.topo.node.run(|| std::fs::write(SYSCTL, "20000-20002")).unwrap();
    assert_eq!(a.topo.node.run(|| std::fs::read_to_string(SYSCTL)).unwrap().trim(), "20000-20002");
    assert_eq!(
        a.ns.run(|| std::fs::read_to_string(SYSCTL)).unwrap().trim(),
        "",
        "the agent namespace has its own list"
    );
    a.start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let req = |id: &str| pb::EnsureNetworkRequest {
        sandbox_id: id.into(),
        port_mappings: vec![pb::PortMapping { protocol: "tcp".into(), container_port: 8080, ..Default::default() }],
        ..Default::default()
    };
    rt.block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        let r = c.ensure_network(req("sb-1")).await.unwrap().into_inner();
        assert_eq!(r.port_mappings[0].host_port, 20003, "a reserved port was assigned: {r:?}");
        let e = c.ensure_network(req("sb-2")).await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    });
}
