//! Attacks on the agent's local control plane by another user of the node (decision R40).
//!
//! 1. The gRPC and TAP fd sockets: the agent started under umask 0 (the old agent's sockets
//!    were then 0777, and uid 65534 took a live sandbox's TAP queue fd: every frame of that
//!    guest). Now both are 0600 whatever the umask, and with their mode widened by hand a
//!    stranger's connection is still dropped at accept (SO_PEERCRED): no fd, no gRPC answer.
//! 2. The directories: a socket directory (`/tmp/cube` by default) or `state_dir`
//!    (`/dev/shm/cube/…`) that another user created first, one that others may write, or a
//!    symlink another user owns. The old agent bound its sockets in them (the owner could then
//!    swap a socket for their own and receive cubelet's EnsureNetwork requests, secrets
//!    included, and answer its TAP fd requests) and kept its state there (swappable for forged
//!    records the next start adopts). Now the agent refuses to start and names the path.
//! 3. `allowed_peer_uids` (R50): a listed uid is served on both sockets, any other is still
//!    refused by the file and at accept, the dumps stay root's; a successor adopting the
//!    sockets applies its own list to them.

use std::{
    os::unix::{
        fs::{MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    netns::ChildGuard,
    require_root,
};

const NOBODY: u32 = 65534;

/// Connects to the TAP fd socket as uid 65534, asks for `tap` of `sandbox` as the VMM does
/// and prints what came back: `connect-errno N`, or `reply <payload> fds <n>`.
const FD_AS_NOBODY: &str = "import socket, sys, array\n\
s = socket.socket(socket.AF_UNIX)\n\
try:\n    s.connect(sys.argv[1])\n\
except OSError as e:\n    print('connect-errno', e.errno); sys.exit(0)\n\
s.settimeout(10)\n\
try:\n    s.sendall(('{\"name\":\"%s\",\"sandboxId\":\"%s\"}' % (sys.argv[2], sys.argv[3])).encode())\n    \
msg, anc, _, _ = s.recvmsg(256, socket.CMSG_SPACE(4))\n\
except OSError as e:\n    print('closed', e.errno); sys.exit(0)\n\
fds = sum(len(d) // 4 for (l, t, d) in anc if l == socket.SOL_SOCKET and t == socket.SCM_RIGHTS)\n\
print('reply', msg.decode() or '-', 'fds', fds)\n";

/// Connects to the gRPC socket as uid 65534, sends the HTTP/2 preface and an empty SETTINGS
/// frame, and prints how many bytes the server sent back (its SETTINGS frame, if it serves).
const GRPC_AS_NOBODY: &str = "import socket, sys\n\
s = socket.socket(socket.AF_UNIX)\n\
try:\n    s.connect(sys.argv[1])\n\
except OSError as e:\n    print('connect-errno', e.errno); sys.exit(0)\n\
s.settimeout(10)\n\
try:\n    s.sendall(b'PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n' + bytes([0,0,0,4,0,0,0,0,0])); print('received', len(s.recv(4096)))\n\
except OSError as e:\n    print('closed', e.errno)\n";

fn as_nobody(script: &str, args: &[&str]) -> String {
    as_uid(NOBODY, script, args)
}

fn as_uid(uid: u32, script: &str, args: &[&str]) -> String {
    let out = std::process::Command::new("/usr/bin/python3")
        .args(["-c", script])
        .args(args)
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::null())
        .output()
        .expect("python3 as another uid");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn ensure(a: &AgentUnderTest, id: &str) -> String {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        let r = c
            .ensure_network(pb::EnsureNetworkRequest { sandbox_id: id.into(), ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        r.interfaces[0].name.clone()
    })
}

#[test]
fn agent_sockets_serve_no_other_user_whatever_the_umask() {
    if !require_root("agent_sockets_serve_no_other_user_whatever_the_umask") {
        return;
    }
    let mut a = AgentUnderTest::prepare("sockuser", 1, "");
    let mut cmd = a.script_command();
    // SAFETY: umask(2) is async-signal-safe and cannot fail.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0);
            Ok(())
        });
    }
    a.child = Some(ChildGuard::from_child(cmd.spawn().unwrap()));
    a.wait_ready(Duration::from_secs(30));
    let tap = ensure(&a, "sb-victim");
    let grpc_sock = a.dir.join("cube/grpc.sock");
    let tap_sock = a.tap_socket();
    let tap_sock_s = tap_sock.to_str().unwrap();
    let grpc_sock_s = grpc_sock.to_str().unwrap();
    let eacces = format!("connect-errno {}", libc::EACCES);
    // The old agent's 0777 sockets: `reply {"errCode":"0",…} fds 1`, the victim's TAP queue.
    assert_eq!(as_nobody(FD_AS_NOBODY, &[tap_sock_s, &tap, "sb-victim"]), eacces, "uid 65534 asked for the TAP");
    assert_eq!(as_nobody(GRPC_AS_NOBODY, &[grpc_sock_s]), eacces, "uid 65534 spoke gRPC");
    for s in [&grpc_sock, &tap_sock] {
        let md = std::fs::metadata(s).unwrap();
        assert_eq!(md.mode() & 0o777, 0o600, "{} under umask 0", s.display());
        assert_eq!(md.uid(), 0);
    }

    // Widened by hand (an operator's chmod, a volume with other semantics): still nothing.
    for s in [&grpc_sock, &tap_sock] {
        std::fs::set_permissions(s, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let got = as_nobody(FD_AS_NOBODY, &[tap_sock_s, &tap, "sb-victim"]);
    assert!(got == "reply - fds 0" || got.starts_with("closed "), "a stranger got an answer: {got}");
    let got = as_nobody(GRPC_AS_NOBODY, &[grpc_sock_s]);
    assert!(got == "received 0" || got.starts_with("closed "), "a stranger was served gRPC: {got}");
    let log = a.log();
    assert!(log.contains("TAP fd client of another user refused"), "{log}");
    assert!(log.contains("gRPC client of another user refused"), "{log}");

    // Root (cubelet) is served as before.
    let (reply, fd) = tap_fd(&tap_sock, &tap, "sb-victim");
    assert_eq!(reply["errCode"], "0", "{reply}");
    assert!(fd.is_some());
}

/// `allowed_peer_uids` (decision R50): a cubelet/VMM running as uid 65534 is served on both
/// sockets (TAP fd received, gRPC answered); uid 65533, not listed, is still refused on both,
/// by the file ACL and, with the mode widened by hand, at accept; the listed uid still gets
/// 403 from the `/v1/` dumps (R42 unchanged) and `/metrics` as before.
#[test]
fn allowed_peer_uids_are_served_and_no_other_user_is() {
    if !require_root("allowed_peer_uids_are_served_and_no_other_user_is") {
        return;
    }
    const LISTED: u32 = NOBODY;
    const STRANGER: u32 = 65533;
    let mut a = AgentUnderTest::prepare("peeruids", 1, "allowed_peer_uids = [65534]\n");
    a.start();
    let tap = ensure(&a, "sb-vmm");
    let grpc_sock = a.dir.join("cube/grpc.sock");
    let tap_sock = a.tap_socket();
    let (tap_sock_s, grpc_sock_s) = (tap_sock.to_str().unwrap(), grpc_sock.to_str().unwrap());

    // The listed uid: the TAP queue fd, and the server's HTTP/2 SETTINGS frame.
    let got = as_uid(LISTED, FD_AS_NOBODY, &[tap_sock_s, &tap, "sb-vmm"]);
    assert!(got.starts_with("reply {") && got.contains("\"errCode\":\"0\"") && got.ends_with("fds 1"), "{got}");
    let got = as_uid(LISTED, GRPC_AS_NOBODY, &[grpc_sock_s]);
    let n: usize = got.strip_prefix("received ").and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(n > 0, "the listed uid got no gRPC answer: {got}");

    // Another uid: refused by the socket file (owner root, 0600 plus the ACL of uid 65534).
    let eacces = format!("connect-errno {}", libc::EACCES);
    assert_eq!(as_uid(STRANGER, FD_AS_NOBODY, &[tap_sock_s, &tap, "sb-vmm"]), eacces, "uid 65533 asked for the TAP");
    assert_eq!(as_uid(STRANGER, GRPC_AS_NOBODY, &[grpc_sock_s]), eacces, "uid 65533 spoke gRPC");
    // Widened by hand: still dropped at accept (SO_PEERCRED against the list).
    for s in [&grpc_sock, &tap_sock] {
        std::fs::set_permissions(s, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let got = as_uid(STRANGER, FD_AS_NOBODY, &[tap_sock_s, &tap, "sb-vmm"]);
    assert!(got == "reply - fds 0" || got.starts_with("closed "), "an unlisted uid got an answer: {got}");
    let got = as_uid(STRANGER, GRPC_AS_NOBODY, &[grpc_sock_s]);
    assert!(got == "received 0" || got.starts_with("closed "), "an unlisted uid was served gRPC: {got}");
    let log = a.log();
    assert!(log.contains("TAP fd client of another user refused"), "{log}");
    assert!(log.contains("gRPC client of another user refused"), "{log}");

    // The HTTP listener's rules are unchanged: the dumps are root's and ours only.
    let (code, body) = a.agent_ns().curl_as(LISTED, &["http://127.0.0.1:19090/v1/policies/dump"]);
    assert_eq!(code, 403, "a listed uid read the dump: {body}");
    assert_eq!(a.agent_ns().curl_as(LISTED, &["http://127.0.0.1:19090/metrics"]).0, 200);
    // Root is served as before.
    let (reply, fd) = tap_fd(&tap_sock, &tap, "sb-vmm");
    assert_eq!(reply["errCode"], "0", "{reply}");
    assert!(fd.is_some());
}

/// R50 across a live upgrade: the sockets a successor adopts follow the successor's
/// `allowed_peer_uids`, not the list of the agent that bound them. Listed by the old agent, uid
/// 65534 gets its TAP; dropped from the successor's configuration, it is refused again, by the
/// socket file and at accept.
#[test]
fn a_successor_applies_its_own_allowed_peer_uids_to_adopted_sockets() {
    if !require_root("a_successor_applies_its_own_allowed_peer_uids_to_adopted_sockets") {
        return;
    }
    let mut a = AgentUnderTest::prepare("peeruids-ho", 1, "allowed_peer_uids = [65534]\n");
    cubenet_tests::agent_upgrade::start(&mut a);
    let tap = ensure(&a, "sb-vmm");
    let tap_sock = a.tap_socket();
    let tap_sock_s = tap_sock.to_str().unwrap();
    let got = as_nobody(FD_AS_NOBODY, &[tap_sock_s, &tap, "sb-vmm"]);
    assert!(got.ends_with("fds 1"), "the listed uid got no TAP from the old agent: {got}");

    let cfg = a.dir.join("agent.toml");
    let toml = std::fs::read_to_string(&cfg).unwrap().replace("allowed_peer_uids = [65534]\n", "");
    std::fs::write(&cfg, toml).unwrap();
    cubenet_tests::agent_upgrade::upgrade(&mut a).unwrap_or_else(|e| panic!("{e}:\n{}", a.log()));
    a.wait_ready(Duration::from_secs(30));
    assert!(a.log().contains("hand-over complete"), "{}", a.log());
    let eacces = format!("connect-errno {}", libc::EACCES);
    assert_eq!(as_nobody(FD_AS_NOBODY, &[tap_sock_s, &tap, "sb-vmm"]), eacces, "the adopted socket kept the old ACL");
    let grpc_sock = a.dir.join("cube/grpc.sock");
    assert_eq!(as_nobody(GRPC_AS_NOBODY, &[grpc_sock.to_str().unwrap()]), eacces);
    for s in [&grpc_sock, &tap_sock] {
        assert_eq!(std::fs::metadata(s).unwrap().mode() & 0o777, 0o600, "{}", s.display());
        std::fs::set_permissions(s, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let got = as_nobody(FD_AS_NOBODY, &[tap_sock_s, &tap, "sb-vmm"]);
    assert!(got == "reply - fds 0" || got.starts_with("closed "), "the successor served the dropped uid: {got}");
    let (reply, fd) = tap_fd(&tap_sock, &tap, "sb-vmm");
    assert_eq!(reply["errCode"], "0", "{reply}");
    assert!(fd.is_some());
}

/// Starts the agent and expects it to refuse to start with `want` in its log.
fn refuses(a: &AgentUnderTest, case: &str, want: &str) {
    let mut cmd = a.script_command();
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    let mut c = ChildGuard::from_child(cmd.spawn().unwrap());
    let st = c.exit_within(Duration::from_secs(20));
    let log = a.log();
    let st = st.unwrap_or_else(|| panic!("{case}: the agent started:\n{log}"));
    assert!(!st.success(), "{case}: {st}\n{log}");
    assert!(log.contains(want), "{case}: want {want:?} in:\n{log}");
    eprintln!("{case}: refused ({want})");
    // Each case starts from an empty log.
    std::fs::write(a.dir.join("log/agent.log"), "").unwrap();
}

fn chown(p: &Path, uid: u32) {
    std::os::unix::fs::lchown(p, Some(uid), Some(uid)).unwrap();
}

#[test]
fn agent_refuses_directories_another_user_controls() {
    if !require_root("agent_refuses_directories_another_user_controls") {
        return;
    }
    // The hand-over socket's directory too (the rig's directory name is known in advance).
    let ho = std::env::temp_dir().join(format!("cubenet-agent-{}-dirowner/ho", std::process::id()));
    let mut a =
        AgentUnderTest::prepare("dirowner", 1, &format!("handover_socket = \"{}/handover.sock\"\n", ho.display()));
    assert!(a.dir.join("ho") == ho);
    let cube = a.dir.join("cube");
    let state = a.state_dir();

    // The socket directory created first by another user (as `/tmp/cube` can be).
    chown(&cube, NOBODY);
    refuses(&a, "socket directory of uid 65534", &format!("socket directory {}", cube.display()));
    assert!(!cube.join("grpc.sock").exists(), "bound in a directory of uid 65534");
    chown(&cube, 0);

    // A socket directory everyone may write.
    std::fs::set_permissions(&cube, std::fs::Permissions::from_mode(0o777)).unwrap();
    refuses(&a, "socket directory 0777", "is writable by other users (mode 777)");
    std::fs::set_permissions(&cube, std::fs::Permissions::from_mode(0o755)).unwrap();

    // A symlink another user owns, to a directory root owns: its owner can re-point it later.
    let real = a.dir.join("cube-real");
    std::fs::rename(&cube, &real).unwrap();
    std::os::unix::fs::symlink(&real, &cube).unwrap();
    chown(&cube, NOBODY);
    refuses(&a, "symlink of uid 65534", "is owned by uid 65534");
    std::fs::remove_file(&cube).unwrap();
    std::fs::rename(&real, &cube).unwrap();

    // The state directory of another user: swappable for forged records.
    chown(&state, NOBODY);
    refuses(&a, "state_dir of uid 65534", &format!("state_dir {}", state.display()));
    chown(&state, 0);

    // The hand-over socket's directory of another user (bound once the agent serves).
    std::fs::create_dir(&ho).unwrap();
    chown(&ho, NOBODY);
    refuses(&a, "handover_socket directory of uid 65534", &format!("handover_socket directory {}", ho.display()));
    chown(&ho, 0);

    // Everything root's again: the agent starts.
    a.start();
    assert_eq!(std::fs::metadata(&state).unwrap().mode() & 0o777, 0o700);
}

/// Descriptors the agent process holds.
fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// The TAP fd socket asked for what is not the caller's: a Ready pool TAP (no owner), another
/// sandbox's TAP by a near-miss id, by ifindex, by a path-like name; then 600 clients that
/// vanish mid-handoff (request sent, socket closed before the reply; or nothing sent). No fd
/// goes out for the first, and the agent's descriptor count comes back to where it was (the
/// duplicate it made for each vanished client is closed), the owner is still served.
#[test]
fn tap_fd_socket_gives_nothing_foreign_and_leaks_nothing() {
    if !require_root("tap_fd_socket_gives_nothing_foreign_and_leaks_nothing") {
        return;
    }
    let mut a = AgentUnderTest::prepare("fdforeign", 2, "");
    a.start();
    let tap = ensure(&a, "sb-a");
    let taps = a.http_json("/v1/network/taps");
    let list = taps["taps"].as_array().unwrap();
    let ready = list.iter().find(|t| t["state"] == "Ready").unwrap_or_else(|| panic!("no Ready TAP: {taps}"));
    let ready_name = ready["tapName"].as_str().unwrap().to_string();
    let ifindex = list.iter().find(|t| t["tapName"] == tap.as_str()).unwrap()["tapIfIndex"].to_string();
    let sock = a.tap_socket();
    for (name, id) in [
        (ready_name.as_str(), "sb-a"),
        (ready_name.as_str(), "anything"),
        (tap.as_str(), "sb-a "),
        (tap.as_str(), "SB-A"),
        (ifindex.as_str(), "sb-a"),
        (&format!("../{tap}") as &str, "sb-a"),
    ] {
        let (reply, fd) = tap_fd(&sock, name, id);
        assert_eq!(reply["errCode"], "1002", "{name}/{id}: {reply}");
        assert!(fd.is_none(), "{name}/{id}");
    }

    let pid = a.child.as_mut().unwrap().id();
    let (reply, fd) = tap_fd(&sock, &tap, "sb-a");
    assert_eq!(reply["errCode"], "0");
    drop(fd);
    // The pool refills behind the Ensure (one more TAP, one more queue fd): measure after it.
    cubenet_tests::wait_for("the pool refilled", Duration::from_secs(20), || {
        let j = a.http_json("/v1/network/taps");
        j["stateCounts"]["Ready"] == 2 && j["stateCounts"]["Active"] == 1
    });
    let baseline = fd_count(pid);
    let req = format!(r#"{{"name":"{tap}","sandboxId":"sb-a"}}"#);
    for i in 0..600 {
        let s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        if i % 2 == 0 {
            std::io::Write::write_all(&mut &s, req.as_bytes()).unwrap();
        }
        drop(s);
    }
    // Every vanished client is answered or timed out (1 s deadlines), then its fds are gone.
    let t = Instant::now();
    // Background work (maintenance netlink sockets) may hold a few at any moment; a leak
    // would be one per vanished client (300 requests were sent).
    const SLACK: usize = 16;
    let mut now = fd_count(pid);
    while now > baseline + SLACK && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
        now = fd_count(pid);
    }
    assert!(now <= baseline + SLACK, "the agent holds {now} descriptors, {baseline} before 600 vanishing clients");
    eprintln!("descriptors: {baseline} before, {now} after 600 vanishing clients");
    let (reply, fd) = tap_fd(&sock, &tap, "sb-a");
    assert_eq!(reply["errCode"], "0", "{reply}");
    assert!(fd.is_some());
}

const SECRET: &str = "sk-live-R42-0123456789";

/// Loopback is every local process, not only root: uid 65534 on the node asks the agent's
/// health listener and its CubeEgress bootstrap listener (in the dataplane namespace) for
/// the policy dump, which holds every sandbox's injection secret. The old agent served it
/// (decision R42); now both answer 403 to it, and root (the gateway's bootstrap, the CLI) is
/// served as before. `/metrics` stays open (it holds no secret).
#[test]
fn agent_dumps_serve_no_other_local_user() {
    if !require_root("agent_dumps_serve_no_other_local_user") {
        return;
    }
    let mut a = AgentUnderTest::prepare("dumpuser", 1, "");
    a.start();
    let rule = pb::EgressRule {
        id: "api".into(),
        r#match: Some(pb::EgressMatch { host: Some("api.example.test".into()), ..Default::default() }),
        action: Some(pb::EgressAction {
            allow: true,
            inject: vec![pb::EgressInject { header: "Authorization".into(), secret: SECRET.into(), format: None }],
            ..Default::default()
        }),
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: "sb-secret".into(),
            cubevs_context: Some(pb::CubeVsContext { rules: vec![rule], ..Default::default() }),
            ..Default::default()
        })
        .await
    })
    .unwrap();
    let listeners = [
        (a.agent_ns(), "http://127.0.0.1:19090/v1/policies/dump"),
        (&a.topo.node, "http://127.0.0.1:19091/v1/policies/dump"),
        (a.agent_ns(), "http://127.0.0.1:19090/v1/network/taps"),
        // Names and learned addresses of every sandbox (O18, O20).
        (a.agent_ns(), "http://127.0.0.1:19090/v1/dataplane/fqdn"),
    ];
    for (ns, url) in listeners {
        let (code, body) = ns.curl_as(NOBODY, &[url]);
        assert!(!body.contains(SECRET), "uid 65534 read the secret from {url}");
        assert_eq!(code, 403, "{url}: {body}");
        let (code, body) = ns.curl_as(0, &[url]);
        assert_eq!(code, 200, "root, {url}: {body}");
    }
    let (_, dump) = a.agent_ns().curl_as(0, &["http://127.0.0.1:19090/v1/policies/dump"]);
    assert!(dump.contains(SECRET), "the bootstrap dump carries the secret: {dump}");
    assert_eq!(a.agent_ns().curl_as(NOBODY, &["http://127.0.0.1:19090/metrics"]).0, 200);
    assert!(a.log().contains("/v1/ client of another user refused"), "{}", a.log());
}
