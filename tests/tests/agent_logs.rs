//! JSON-lines logs (`NETWORK_AGENT_LOG_FORMAT=json` / `CUBE_EGRESS_LOG_FORMAT=json`, what the Helm chart sets): every line
//! the agent writes is one JSON object, and the Ensure, TAP fd and Release events carry the
//! sandbox id as a `sandbox_id` field (a log collector can select one sandbox's history).

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    netns::ChildGuard,
    require_root,
};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

#[test]
fn json_log_lines_carry_sandbox_id_on_ensure_fd_release() {
    const T: &str = "json_log_lines_carry_sandbox_id_on_ensure_fd_release";
    if !require_root(T) {
        return;
    }
    let mut a = AgentUnderTest::prepare("jsonlog", 1, "");
    let child = a.script_command().env("NETWORK_AGENT_LOG_FORMAT", "json").spawn().expect("spawn start script");
    a.child = Some(ChildGuard::from_child(child));
    a.wait_ready(std::time::Duration::from_secs(30));

    let r = rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        let r = c
            .ensure_network(pb::EnsureNetworkRequest { sandbox_id: "sb-log".into(), ..Default::default() })
            .await
            .expect("ensure")
            .into_inner();
        // A refused Ensure names its sandbox too.
        let bad = c
            .ensure_network(pb::EnsureNetworkRequest {
                sandbox_id: "sb-bad".into(),
                port_mappings: vec![pb::PortMapping {
                    protocol: "tcp".into(),
                    container_port: 80,
                    host_port: 1,
                    ..Default::default()
                }],
                ..Default::default()
            })
            .await;
        assert!(bad.is_err());
        r
    });
    let (reply, fd) = tap_fd(&a.tap_socket(), &r.interfaces[0].name, "sb-log");
    assert_eq!(reply["errCode"], "0", "{reply}");
    drop(fd);
    let (reply, _) = tap_fd(&a.tap_socket(), "z192.168.0.250", "sb-log");
    assert_eq!(reply["errCode"], "1002", "{reply}");
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "sb-log".into(), ..Default::default() })
            .await
            .expect("release");
    });

    // Every agent line is a JSON object (the start script's own lines are prefixed text).
    let log = a.log();
    let events: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.starts_with("[start-network-agent]") && !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}\n{log}")))
        .collect();
    let find = |msg: &str, id: &str| {
        events
            .iter()
            .find(|e| e["message"] == msg && e["sandbox_id"] == id)
            .unwrap_or_else(|| panic!("no {msg:?} event with sandbox_id {id}:\n{log}"))
    };
    let ensured = find("network ensured", "sb-log");
    assert_eq!(ensured["level"], "INFO");
    assert_eq!(ensured["tap"], r.interfaces[0].name.as_str());
    assert!(ensured["ms"].is_number() && ensured["ifindex"].is_number(), "{ensured}");
    let failed = find("ensure failed", "sb-bad");
    assert_eq!(failed["level"], "WARN");
    // A port's field with its reason (an L7 rule's reason, which may quote a credential, is
    // never logged: unit test `reasons_are_logged_for_address_fields_and_never_for_rules`).
    let err = failed["error"].as_str().unwrap_or_default();
    assert!(err.starts_with("invalid port_mappings[0].host_port: "), "{failed}");
    assert_eq!(find("TAP fd handed out", "sb-log")["tap"], r.interfaces[0].name.as_str());
    assert_eq!(find("TAP fd refused: the sandbox holds no such TAP", "sb-log")["tap"], "z192.168.0.250");
    assert_eq!(find("network released", "sb-log")["level"], "INFO");
}

/// CubeEgress in the same format (`CUBE_EGRESS_LOG_FORMAT=json`, the chart's `egress.logFormat`):
/// its start-up event is one JSON object with the listen addresses as fields; an unknown
/// format is refused with status 2.
#[test]
fn cube_egress_json_log_lines() {
    use std::{
        io::{BufRead, BufReader},
        process::{Command, Stdio},
    };
    const T: &str = "cube_egress_json_log_lines";
    if !require_root(T) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("cubenet-egress-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = cubenet_tests::tls::make_ca("log test CA");
    std::fs::write(dir.join("cube-root-ca.crt"), &ca.pem).unwrap();
    std::fs::write(dir.join("cube-root-ca.key"), &ca.key_pem).unwrap();
    let cmd = |fmt: &str| {
        let mut c = Command::new(cubenet_tests::agent::workspace_bin("cube-egress"));
        c.args(["--ca-dir", dir.to_str().unwrap(), "--audit-file", dir.join("a.jsonl").to_str().unwrap()])
            .args(["--listen-ip", "127.0.0.1", "--http-port", "0", "--https-port", "0", "--admin-addr", "127.0.0.1:0"])
            .env("CUBE_EGRESS_LOG_FORMAT", fmt)
            .env("CUBE_EGRESS_LOG", "info")
            .stdin(Stdio::null());
        c
    };
    let bad = cmd("xml").output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("CUBE_EGRESS_LOG_FORMAT"), "{bad:?}");

    let mut child = ChildGuard::from_child(cmd("json").stderr(Stdio::piped()).spawn().unwrap());
    let stderr = child.child().stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut seen = Vec::new();
    let listening = loop {
        let l = rx.recv_timeout(std::time::Duration::from_secs(20)).unwrap_or_else(|e| panic!("{e}: {seen:?}"));
        let v: serde_json::Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"));
        if v["message"] == "cube-egress listening" {
            break v;
        }
        seen.push(l);
    };
    assert_eq!(listening["level"], "INFO");
    assert!(listening["http"].as_str().is_some_and(|a| a.starts_with("127.0.0.1:")), "{listening}");
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a caller tries to forge into the text log (O19).
const FORGED: &str =
    "2026-12-02T04:46:10.000000Z  INFO network_agent::agent::service: network released sandbox_id=sb-text ms=0.1";

/// The default text format, as `NETWORK_AGENT_LOG_FILE` (and any redirect or collector) gets
/// it: no terminal colour codes, so `grep 'sandbox_id=sb-text'` finds the sandbox's events and
/// a refused Ensure's field (decision O2).
#[test]
fn text_log_file_is_plain_and_greppable_by_sandbox_id() {
    const T: &str = "text_log_file_is_plain_and_greppable_by_sandbox_id";
    if !require_root(T) {
        return;
    }
    let mut a = AgentUnderTest::prepare("textlog", 1, "");
    let child = a.script_command().env_remove("NETWORK_AGENT_LOG_FORMAT").spawn().expect("spawn start script");
    a.child = Some(ChildGuard::from_child(child));
    a.wait_ready(std::time::Duration::from_secs(30));
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: "sb-text".into(), ..Default::default() })
            .await
            .expect("ensure");
        let bad = c
            .ensure_network(pb::EnsureNetworkRequest {
                sandbox_id: "sb-text-bad".into(),
                cubevs_context: Some(pb::CubeVsContext {
                    allow_out: vec!["10.0.0.300/8".into()],
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .expect_err("a bad allow_out is refused");
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        // Attack (O19): ids that carry a forged event after a newline; refused, and logged
        // quoted on one line, so the forged "release" of sb-text never appears as a line.
        for id in [format!("x\n{FORGED}"), format!("{FORGED}\r\n")] {
            let e = c
                .ensure_network(pb::EnsureNetworkRequest { sandbox_id: id, ..Default::default() })
                .await
                .expect_err("an id with a newline is refused");
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
        }
    });
    // The same through the TAP fd socket (any JSON strings are accepted there, then refused).
    let fd_reply = tap_fd(&a.tap_socket(), &format!("z\n{FORGED}"), "sb-text");
    assert_eq!(fd_reply.0["errCode"], "1002", "{:?}", fd_reply.0);
    let log = a.log();
    assert!(!log.contains('\x1b'), "terminal escape codes in the log file:\n{log:?}");
    assert!(
        !log.lines().any(|l| l.contains("network released") && !l.contains("ensure failed") && !l.contains("TAP fd")),
        "a caller forged a log line:\n{log}"
    );
    assert_eq!(log.lines().filter(|l| l.contains("ensure failed") && l.contains("\\n")).count(), 2, "{log}");
    let line = |needle: &str| {
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?}:\n{log}"))
            .to_string()
    };
    assert!(line("sandbox_id=sb-text ").contains("network ensured"), "{log}");
    let failed = line("sandbox_id=sb-text-bad ");
    assert!(failed.contains("WARN") && failed.contains("ensure failed"), "{failed}");
    assert!(failed.contains("error=invalid cubevs_context.allow_out[0]"), "{failed}");
}

/// CubeEgress's default text format on a pipe: plain text, no colour codes (O2).
#[test]
fn cube_egress_text_log_has_no_colour_codes() {
    use std::{
        io::{BufRead, BufReader},
        process::{Command, Stdio},
    };
    const T: &str = "cube_egress_text_log_has_no_colour_codes";
    if !require_root(T) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("cubenet-egress-textlog-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = cubenet_tests::tls::make_ca("text log test CA");
    std::fs::write(dir.join("cube-root-ca.crt"), &ca.pem).unwrap();
    std::fs::write(dir.join("cube-root-ca.key"), &ca.key_pem).unwrap();
    let mut child = ChildGuard::from_child(
        Command::new(cubenet_tests::agent::workspace_bin("cube-egress"))
            .args(["--ca-dir", dir.to_str().unwrap(), "--audit-file", dir.join("a.jsonl").to_str().unwrap()])
            .args(["--listen-ip", "127.0.0.1", "--http-port", "0", "--https-port", "0", "--admin-addr", "127.0.0.1:0"])
            .env_remove("CUBE_EGRESS_LOG_FORMAT")
            .env("CUBE_EGRESS_LOG", "info")
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = child.child().stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut seen = Vec::new();
    let listening = loop {
        let l = rx.recv_timeout(std::time::Duration::from_secs(20)).unwrap_or_else(|e| panic!("{e}: {seen:?}"));
        if l.contains("cube-egress listening") {
            break l;
        }
        seen.push(l);
    };
    for l in seen.iter().chain([&listening]) {
        assert!(!l.contains('\x1b'), "terminal escape codes: {l:?}");
    }
    assert!(listening.contains(" INFO ") && listening.contains("http=127.0.0.1:"), "{listening:?}");
    // Which CA it signs with, as openssl prints the certificate's fingerprint (O8).
    let fp = Command::new("openssl")
        .args(["x509", "-noout", "-fingerprint", "-sha256", "-in"])
        .arg(dir.join("cube-root-ca.crt"))
        .output()
        .unwrap();
    let fp = String::from_utf8_lossy(&fp.stdout).trim().rsplit_once('=').map(|(_, f)| f.to_string()).unwrap();
    assert!(seen.iter().any(|l| l.contains("CA loaded") && l.contains(&format!("sha256={fp}"))), "{fp}: {seen:?}");
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
}
