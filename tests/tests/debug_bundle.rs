//! `cubenet-cli bundle` against the real agent (started by its script in its own namespace):
//! the bundle holds what an operator needs to report a node's problem, never a sandbox's L7
//! credential, and is still written (with the failures listed) when the agent is down.

use std::{path::Path, process::Stdio};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, HEALTH, workspace_bin},
    require_root,
};

const SECRET: &str = "sk-bundle-must-never-contain-this-0123456789";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Runs `cubenet-cli … bundle --out OUT …` in the agent's namespace: (exit code, stdout+stderr).
fn bundle(a: &AgentUnderTest, out: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let o = a
        .agent_ns()
        .command(workspace_bin("cubenet-cli").to_str().unwrap())
        .args(["--grpc", &a.grpc_endpoint(), "--http", HEALTH, "bundle", "--out", out.to_str().unwrap()])
        .args(["--bpffs-dir", a.pin_dir().to_str().unwrap()])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (o.status.code(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

fn read(dir: &Path, f: &str) -> String {
    std::fs::read_to_string(dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"))
}

#[test]
fn debug_bundle_has_the_node_state_and_no_credentials() {
    const T: &str = "debug_bundle_has_the_node_state_and_no_credentials";
    if !require_root(T) {
        return;
    }
    // No gateway here: the push is off; the rules still live in the agent (and its dump).
    let mut a = AgentUnderTest::prepare("bundle", 2, "cube_egress_admin_url = \"\"\n");
    a.start();
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: "sb-bundle".into(),
            port_mappings: vec![pb::PortMapping { protocol: "tcp".into(), container_port: 8080, ..Default::default() }],
            cubevs_context: Some(pb::CubeVsContext {
                allow_internet_access: Some(true),
                rules: vec![pb::EgressRule {
                    id: "api".into(),
                    r#match: Some(pb::EgressMatch { host: Some("api.example.com".into()), ..Default::default() }),
                    action: Some(pb::EgressAction {
                        allow: true,
                        inject: vec![pb::EgressInject {
                            header: "Authorization".into(),
                            secret: SECRET.into(),
                            format: Some("Bearer ${SECRET}".into()),
                        }],
                        ..Default::default()
                    }),
                }],
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("ensure");
    });
    // The agent does hold the secret (its bootstrap dump serves it): the bundle must not copy it.
    let (_, dump) = a.http("/v1/policies/dump").expect("dump");
    assert!(dump.contains(SECRET), "the test's premise: the dump carries the secret");

    let out = a.dir.join("bundle-up");
    let cfg = a.dir.join("agent.toml");
    let log = a.dir.join("log/agent.log");
    let (code, text) = bundle(&a, &out, &["--file", cfg.to_str().unwrap(), "--file", log.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("0 failed"), "{text}");
    let manifest = read(&out, "MANIFEST.txt");
    assert!(!manifest.contains("FAILED"), "{manifest}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&out).unwrap().permissions().mode() & 0o777, 0o700);

    assert_eq!(read(&out, "readyz.txt"), "HTTP 200\nready");
    assert!(
        read(&out, "metrics.txt").contains("cubenet_sandbox_packets_total{direction=\"out\",sandbox=\"sb-bundle\"}")
    );
    let nets: serde_json::Value = serde_json::from_str(&read(&out, "networks.json")).unwrap();
    assert_eq!(nets["networks"][0]["sandboxID"], "sb-bundle", "{nets}");
    let tap = nets["networks"][0]["tapName"].as_str().unwrap().to_string();
    let counters: serde_json::Value = serde_json::from_str(&read(&out, "counters.json")).unwrap();
    assert!(counters["sandboxes"].as_array().unwrap().iter().any(|s| s["sandboxID"] == "sb-bundle"), "{counters}");
    assert!(read(&out, "taps.json").contains(&tap));
    assert!(read(&out, "portmaps.json").contains("8080"));
    let fqdn: serde_json::Value = serde_json::from_str(&read(&out, "fqdn.json")).unwrap();
    assert!(fqdn["sandboxes"].as_array().unwrap().iter().any(|s| s["sandboxID"] == "sb-bundle"), "{fqdn}");
    let dp: serde_json::Value = serde_json::from_str(&read(&out, "datapath-status.json")).unwrap();
    // The CLI runs in the agent's namespace, the TAPs live in the dataplane's: match by ifindex.
    let ifindex = nets["networks"][0]["tapIfIndex"].clone();
    assert!(
        dp["attachPoints"].as_array().unwrap().iter().any(|p| p["hook"] == "from_cube" && p["ifindex"] == ifindex),
        "{dp}"
    );
    assert!(read(&out, "files/0-agent.toml").contains("tap_init_num = 2"));
    assert!(read(&out, "files/1-agent.log").contains("sandbox_id=sb-bundle"));
    assert!(!out.join("sessions.json").exists(), "sessions are opt-in (--sessions)");

    // Attack: the credential is in the agent's memory, state and dump, and in no bundle file.
    for e in walk(&out) {
        let bytes = std::fs::read(&e).unwrap();
        assert!(!String::from_utf8_lossy(&bytes).contains(SECRET), "{} carries the sandbox's credential", e.display());
    }

    // An existing directory is never written into.
    let (code, text) = bundle(&a, &out, &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("already exists"), "{text}");

    // The agent down: the bundle is still written, the failures named, the pins still read.
    a.kill(nix::sys::signal::Signal::SIGTERM);
    let down = a.dir.join("bundle-down");
    let (code, text) = bundle(&a, &down, &["--sessions"]);
    assert_eq!(code, Some(0), "{text}");
    let manifest = read(&down, "MANIFEST.txt");
    for f in ["healthz.txt", "metrics.txt", "networks.json", "sessions.json"] {
        assert!(manifest.contains(&format!("FAILED {f}: ")), "{f}: {manifest}");
    }
    assert!(manifest.contains("ok     datapath-status.json"), "{manifest}");
    assert!(text.contains("failed (see MANIFEST.txt)"), "{text}");
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
