//! The agent's FQDN/L7 policy model and how it drives CubeEgress (issue 11, "Policy model" and
//! "The agent drives CubeEgress"), end to end with the real agent and the real `cube-egress`
//! binary (the agent in a namespace of its own programming the node namespace; the gateway
//! in the node namespace when the agent pushes to it, decision L9, and in the agent's when it
//! bootstraps from `health_listen`):
//!
//! - `l7_fields_validate_and_old_clients_are_unchanged`: a client generated from the
//!   pre-CubeNet schema gets exactly what a new client sending the same fields gets (stored
//!   state, datapath policy); bad FQDN entries and rules are INVALID_ARGUMENT naming the field
//!   path and change nothing (no state, no TAP taken, a live sandbox's record and maps
//!   untouched).
//! - `l7_agent_pushes_rules_to_the_gateway`: Ensure with the gateway down, the rules arrive
//!   when it starts; Reconcile and Release reach it before they return; a refused Reconcile
//!   leaves the gateway's copy; an agent restart removes a stale gateway policy; a gateway
//!   restart gets the full set; the secret never appears in the agent's log (debug level);
//!   state files are 0600.
//! - `l7_dump_bootstraps_the_gateway_and_is_loopback_only`: `GET /v1/policies/dump` is
//!   refused to a peer in another namespace over a veth and to a non-loopback source on the
//!   agent's own host, and the real gateway bootstraps from it.

use std::time::{Duration, Instant};

use cubenet_proto::{v1 as pb, v1_old as old};
use cubenet_tests::{
    TmpDir,
    agent::{AgentUnderTest, http_get},
    egress::{ADMIN, AdminGateway, admin, admin_json},
    netns::{ChildGuard, TestNetns},
    require_root, wait_for,
};
use serde_json::{Value, json};
use tonic::Code;

const SECRET: &str = "sk-live-L7AGENT-SECRET-5f1d2c9a";
const SECRET2: &str = "sk-live-L7AGENT-ROTATED-77e0b4aa";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

// ------------------------------------------------------------------ gRPC helpers

fn inject_rule(id: &str, host: &str, secret: &str) -> pb::EgressRule {
    pb::EgressRule {
        id: id.into(),
        r#match: Some(pb::EgressMatch { host: Some(host.into()), path: Some("/v1/*".into()), ..Default::default() }),
        action: Some(pb::EgressAction {
            allow: true,
            audit: Some("metadata".into()),
            inject: vec![pb::EgressInject {
                header: "Authorization".into(),
                secret: secret.into(),
                format: Some("Bearer ${SECRET}".into()),
            }],
            inject_plain_http: false,
        }),
    }
}

fn l7_ctx(rules: Vec<pb::EgressRule>) -> pb::CubeVsContext {
    pb::CubeVsContext {
        allow_internet_access: Some(true),
        allow_fqdn: vec![pb::FqdnAllow { name: "*.example.com".into(), ports: vec![443] }],
        rules,
        ..Default::default()
    }
}

fn ensure(
    a: &AgentUnderTest,
    id: &str,
    c: Option<pb::CubeVsContext>,
) -> Result<pb::EnsureNetworkResponse, tonic::Status> {
    rt().block_on(async {
        let mut cl = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        cl.ensure_network(pb::EnsureNetworkRequest { sandbox_id: id.into(), cubevs_context: c, ..Default::default() })
            .await
            .map(|r| r.into_inner())
    })
}

fn reconcile(
    a: &AgentUnderTest,
    id: &str,
    c: pb::CubeVsContext,
) -> Result<pb::ReconcileNetworkResponse, tonic::Status> {
    rt().block_on(async {
        let mut cl = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        cl.reconcile_network(pb::ReconcileNetworkRequest {
            sandbox_id: id.into(),
            cubevs_context: Some(c),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
    })
}

/// A client generated from the frozen pre-CubeNet schema, over the agent's Unix socket.
async fn old_client(a: &AgentUnderTest) -> old::network_agent_client::NetworkAgentClient<tonic::transport::Channel> {
    let path = a.grpc_endpoint().strip_prefix("unix://").unwrap().to_string();
    let ch =
        tonic::transport::Endpoint::try_from("http://agent.invalid")
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_| {
                let p = path.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(p).await?))
                }
            }))
            .await
            .expect("connect (old client)");
    old::network_agent_client::NetworkAgentClient::new(ch)
}

fn assert_invalid<T: std::fmt::Debug>(r: Result<T, tonic::Status>, field: &str) {
    let e = r.expect_err("expected INVALID_ARGUMENT");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains(field), "{:?} does not name {field:?}", e.message());
    assert!(!e.message().contains(SECRET), "the error quotes the secret: {:?}", e.message());
}

fn sandbox_ip(r: &pb::EnsureNetworkResponse) -> String {
    r.persist_metadata["sandbox_ip"].clone()
}

/// Every file of the state directory with its bytes.
fn state_files(a: &AgentUnderTest) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(a.state_dir())
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

fn state_record(a: &AgentUnderTest, id: &str) -> Value {
    serde_json::from_slice(&std::fs::read(a.state_dir().join(format!("{id}.success.json"))).unwrap()).unwrap()
}

fn datapath_policy(a: &AgentUnderTest, tap: &str) -> Value {
    let pol = a.http_json("/v1/dataplane/policies");
    pol["policies"].as_array().unwrap().iter().find(|p| p["tapName"] == tap).expect("tap listed")["policy"].clone()
}

fn tap_states(a: &AgentUnderTest) -> Vec<String> {
    let taps = a.http_json("/v1/network/taps");
    taps["taps"].as_array().unwrap().iter().map(|t| t["state"].as_str().unwrap().to_string()).collect()
}

// ------------------------------------------------------------------ HTTP and the gateway

fn gateway_policy(ns: &TestNetns, ip: &str) -> Option<Value> {
    admin_json(ns, &format!("/admin/v1/policies/{ip}"))
}

fn gateway_ips(ns: &TestNetns) -> Vec<String> {
    let (c, b) = admin(ns, "GET", "/admin/v1/policies", "");
    assert_eq!(c, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    let mut ips: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    ips.sort();
    ips
}

fn tmpdir(tag: &str) -> TmpDir {
    let d = std::env::temp_dir().join(format!("cubenet-l7-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TmpDir(d)
}

/// The rule ids of a gateway policy, and that every secret in it is redacted.
fn rule_ids(p: &Value) -> Vec<String> {
    let s = p.to_string();
    assert!(!s.contains(SECRET) && !s.contains(SECRET2), "the gateway's read path leaks a secret: {s}");
    p["rules"].as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap().to_string()).collect()
}

// ------------------------------------------------------------------ tests

#[test]
fn l7_fields_validate_and_old_clients_are_unchanged() {
    if !require_root("l7_fields_validate_and_old_clients_are_unchanged") {
        return;
    }
    // No gateway in this test: the push is disabled.
    let mut a = AgentUnderTest::prepare("l7-compat", 3, "cube_egress_admin_url = \"\"\n");
    a.start();

    // An old client and a new one send the same (old) fields.
    let old_ctx = old::CubeVsContext {
        allow_internet_access: Some(false),
        allow_out: vec!["198.51.100.1/32".into(), "203.0.113.0/24".into()],
        deny_out: vec!["203.0.113.7".into()],
    };
    let ro = rt()
        .block_on(async {
            old_client(&a)
                .await
                .ensure_network(old::EnsureNetworkRequest {
                    sandbox_id: "sb-old".into(),
                    cubevs_context: Some(old_ctx.clone()),
                    ..Default::default()
                })
                .await
        })
        .expect("old client ensure")
        .into_inner();
    let new_ctx = pb::CubeVsContext {
        allow_internet_access: old_ctx.allow_internet_access,
        allow_out: old_ctx.allow_out.clone(),
        deny_out: old_ctx.deny_out.clone(),
        ..Default::default()
    };
    let rn = ensure(&a, "sb-new", Some(new_ctx.clone())).expect("new client ensure");
    let (so, sn) = (state_record(&a, "sb-old"), state_record(&a, "sb-new"));
    assert_eq!(so["policy"], sn["policy"], "stored policy");
    let keys: Vec<&String> = so["policy"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["allow_internet_access", "allow_out", "deny_out"], "state JSON shape of an old client");
    let tap_old = ro.interfaces[0].name.clone();
    let tap_new = rn.interfaces[0].name.clone();
    assert_eq!(datapath_policy(&a, &tap_old), datapath_policy(&a, &tap_new), "datapath policy");
    // The old client reconciles too, and the dump holds nothing (no rules).
    let rr = rt().block_on(async {
        old_client(&a)
            .await
            .reconcile_network(old::ReconcileNetworkRequest {
                sandbox_id: "sb-old".into(),
                cubevs_context: Some(old_ctx.clone()),
                ..Default::default()
            })
            .await
    });
    assert!(rr.expect("old client reconcile").into_inner().converged);
    assert_eq!(state_record(&a, "sb-old")["policy"], so["policy"]);
    assert_eq!(a.http_json("/v1/policies/dump"), json!({"policies": {}}));

    // FQDN entries and rules are stored with the policy.
    let rf = ensure(&a, "sb-fqdn", Some(l7_ctx(vec![inject_rule("api", "api.example.com", SECRET)]))).expect("l7");
    let sf = state_record(&a, "sb-fqdn");
    assert_eq!(sf["policy"]["allow_fqdn"], json!([{"name": "*.example.com", "ports": [443]}]));
    assert_eq!(sf["policy"]["rules"][0]["id"], "api");
    assert!(a.release("sb-fqdn"));
    drop(rf);
    // The released TAP's free check and the pool trim run in the maintenance pass the Release
    // wakes: let the pool settle (3 Ready, nothing Cleaning) before "nothing changes" is checked.
    wait_for("the pool settled after the Release", Duration::from_secs(10), || {
        let st = tap_states(&a);
        !st.iter().any(|s| s == "Cleaning") && st.iter().filter(|s| *s == "Ready").count() == 3
    });

    // Bad input: INVALID_ARGUMENT naming the field path; nothing changes.
    let fq = |name: &str, ports: Vec<u32>| pb::FqdnAllow { name: name.into(), ports };
    let ok_fqdn = fq("api.example.com", vec![443]);
    let mut bad: Vec<(pb::CubeVsContext, &str)> = Vec::new();
    let with_fqdn = |f: Vec<pb::FqdnAllow>| pb::CubeVsContext { allow_fqdn: f, ..new_ctx.clone() };
    let with_rules = |r: Vec<pb::EgressRule>| pb::CubeVsContext { rules: r, ..new_ctx.clone() };
    bad.push((with_fqdn(vec![ok_fqdn.clone(), fq("a.*.example.com", vec![])]), "cubevs_context.allow_fqdn[1].name"));
    bad.push((with_fqdn(vec![fq("bücher.example", vec![])]), "cubevs_context.allow_fqdn[0].name"));
    bad.push((with_fqdn(vec![fq(&format!("{}.com", "a".repeat(64)), vec![])]), "cubevs_context.allow_fqdn[0].name"));
    bad.push((with_fqdn(vec![fq("1.2.3.4", vec![])]), "cubevs_context.allow_fqdn[0].name"));
    bad.push((
        with_fqdn(vec![ok_fqdn.clone(), fq("b.example.com", vec![443, 0])]),
        "cubevs_context.allow_fqdn[1].ports[1]",
    ));
    bad.push((with_fqdn(vec![fq("b.example.com", vec![65536])]), "cubevs_context.allow_fqdn[0].ports[0]"));
    bad.push((with_fqdn(vec![fq("b.example.com", (1..=9).collect())]), "cubevs_context.allow_fqdn[0].ports"));
    let good = inject_rule("api", "api.example.com", SECRET);
    let mut r = good.clone();
    r.r#match.as_mut().unwrap().path = Some("/a*b*".into());
    bad.push((with_rules(vec![r]), "cubevs_context.rules[0].match.path"));
    let mut r = good.clone();
    r.action = None;
    bad.push((with_rules(vec![good.clone(), r]), "cubevs_context.rules[1].action"));
    bad.push((with_rules(vec![good.clone(), good.clone()]), "cubevs_context.rules[1].id"));
    let mut r = good.clone();
    r.r#match.as_mut().unwrap().host = Some("api.*.com".into());
    bad.push((with_rules(vec![r]), "cubevs_context.rules[0].match.host"));
    let mut r = good.clone();
    r.r#match.as_mut().unwrap().port = vec![70000];
    r.r#match.as_mut().unwrap().scheme = Some("https".into());
    bad.push((with_rules(vec![r]), "cubevs_context.rules[0].match.port"));
    let mut r = good.clone();
    r.action.as_mut().unwrap().inject[0].header = "Bad Header".into();
    bad.push((with_rules(vec![r]), "cubevs_context.rules[0].action.inject[0].header"));
    let mut r = good.clone();
    r.action.as_mut().unwrap().inject[0].secret = format!("{SECRET}\r\nX-Evil: 1");
    bad.push((with_rules(vec![r]), "cubevs_context.rules[0].action.inject[0].secret"));

    let before_files = state_files(&a);
    let before_taps = tap_states(&a);
    let before_pol = datapath_policy(&a, &tap_new);
    for (c, field) in bad {
        assert_invalid(ensure(&a, "sb-bad", Some(c.clone())), field);
        assert_invalid(reconcile(&a, "sb-new", c), field);
        assert_eq!(state_files(&a), before_files, "state changed after a refused call ({field})");
        assert_eq!(tap_states(&a), before_taps, "TAP pool changed after a refused call ({field})");
        assert_eq!(datapath_policy(&a, &tap_new), before_pol, "datapath changed after a refused call ({field})");
    }
    assert_eq!(a.http_json("/v1/policies/dump"), json!({"policies": {}}));
    assert!(!a.log().contains(SECRET), "the agent logged the secret");
}

#[test]
fn l7_agent_pushes_rules_to_the_gateway() {
    if !require_root("l7_agent_pushes_rules_to_the_gateway") {
        return;
    }
    let tmp = tmpdir("push");
    // Default cube_egress_admin_url (http://127.0.0.1:9091, the gateway's default admin
    // address); debug logging so that every log line the push path has is checked.
    let mut a = AgentUnderTest::prepare("l7-push", 3, "cube_egress_push_timeout_ms = 5000\n");
    let start_agent = |a: &mut AgentUnderTest| {
        let mut cmd = a.script_command();
        cmd.env("RUST_LOG", "debug");
        a.child = Some(ChildGuard::from_child(cmd.spawn().expect("spawn agent")));
        a.wait_ready(Duration::from_secs(30));
    };
    start_agent(&mut a);

    // 1. Gateway down — a black hole on its address (connections are queued, never
    //    answered), so a push would wait the whole 5 s timeout: Ensure does not wait; the
    //    rules arrive when the gateway starts.
    let hole = a.topo.node.run(|| std::net::TcpListener::bind(ADMIN)).expect("black hole on the admin address");
    let t = Instant::now();
    let r1 = ensure(&a, "sb-1", Some(l7_ctx(vec![inject_rule("api", "api.example.com", SECRET)]))).expect("ensure");
    assert!(t.elapsed() < Duration::from_secs(4), "Ensure waited for a gateway that is down: {:?}", t.elapsed());
    let ip1 = sandbox_ip(&r1);
    let metrics = |a: &AgentUnderTest| a.http("/metrics").unwrap().1;
    wait_for("pending push in /metrics", Duration::from_secs(15), || {
        let m = metrics(&a);
        m.contains("cubenet_egress_pending 1") && m.contains("cubenet_egress_up 0")
    });
    drop(hole);
    let gw = AdminGateway::start(&a.topo.node, &tmp.0, "");
    let t = Instant::now();
    wait_for("sb-1's rules on the gateway", Duration::from_secs(10), || gateway_policy(&a.topo.node, &ip1).is_some());
    eprintln!("rules arrived {:?} after the gateway came up", t.elapsed());
    let p = gateway_policy(&a.topo.node, &ip1).unwrap();
    assert_eq!(p["policy_id"], ip1.as_str());
    assert_eq!(rule_ids(&p), ["api"]);
    assert_eq!(p["rules"][0]["match"], json!({"host": "api.example.com", "path": "/v1/*"}));
    assert_eq!(p["rules"][0]["action"]["inject"][0]["header"], "Authorization");
    wait_for("push done in /metrics", Duration::from_secs(5), || {
        let m = metrics(&a);
        m.contains("cubenet_egress_pending 0")
            && m.contains("cubenet_egress_up 1")
            && m.contains("cubenet_egress_push_total{result=\"ok\"} ")
            && !m.contains("cubenet_egress_push_total{result=\"ok\"} 0\n")
    });

    // 2. Gateway up: Reconcile's new rules are there when it returns.
    let ctx2 = l7_ctx(vec![inject_rule("api-v2", "api.example.com", SECRET2), {
        let mut deny = inject_rule("deny-admin", "api.example.com", SECRET2);
        deny.r#match.as_mut().unwrap().path = Some("/admin/*".into());
        deny.action = Some(pb::EgressAction { allow: false, ..Default::default() });
        deny
    }]);
    reconcile(&a, "sb-1", ctx2.clone()).expect("reconcile");
    assert_eq!(rule_ids(&gateway_policy(&a.topo.node, &ip1).unwrap()), ["api-v2", "deny-admin"]);

    // 3. A refused Reconcile changes nothing, on the gateway either.
    let before = state_files(&a);
    let mut badr = inject_rule("x", "api.example.com", SECRET);
    badr.r#match.as_mut().unwrap().path = Some("/a*b*".into());
    assert_invalid(reconcile(&a, "sb-1", l7_ctx(vec![badr])), "cubevs_context.rules[0].match.path");
    assert_eq!(state_files(&a), before);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(rule_ids(&gateway_policy(&a.topo.node, &ip1).unwrap()), ["api-v2", "deny-admin"]);

    // 4. A sandbox without rules has no gateway policy.
    let r2 = ensure(&a, "sb-2", None).expect("ensure sb-2");
    let ip2 = sandbox_ip(&r2);
    assert_eq!(gateway_policy(&a.topo.node, &ip2), None);

    // 5. A stale policy (an address of no sandbox) is removed when the agent (re)starts.
    let stray = json!({"policy_id": "stray", "rules": [{"id": "all", "action": {"allow": true}}]}).to_string();
    assert_eq!(admin(&a.topo.node, "PUT", "/admin/v1/policies/192.168.0.200", &stray).0, 200);
    a.kill(nix::sys::signal::Signal::SIGTERM);
    start_agent(&mut a);
    wait_for("stale policy deleted", Duration::from_secs(10), || {
        gateway_policy(&a.topo.node, "192.168.0.200").is_none()
    });
    assert_eq!(gateway_ips(&a.topo.node), std::slice::from_ref(&ip1));

    // 6. Gateway down: Release and a new Ensure; a fresh gateway gets exactly the live set.
    gw.stop(&a.topo.node);
    let t = Instant::now();
    assert!(a.release("sb-1"));
    let r3 = ensure(&a, "sb-3", Some(l7_ctx(vec![inject_rule("three", "three.example.com", SECRET)]))).unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "calls waited for a gateway that is down: {:?}", t.elapsed());
    let ip3 = sandbox_ip(&r3);
    let gw = AdminGateway::start(&a.topo.node, &tmp.0, "");
    wait_for("sb-3's rules on the restarted gateway", Duration::from_secs(10), || {
        gateway_ips(&a.topo.node) == [ip3.clone()]
    });
    assert_eq!(rule_ids(&gateway_policy(&a.topo.node, &ip3).unwrap()), ["three"]);

    // 7. A restart between two health polls (the gateway lost its policies): the agent
    //    notices the count and re-sends ...
    assert_eq!(admin(&a.topo.node, "DELETE", &format!("/admin/v1/policies/{ip3}"), "").0, 200);
    wait_for("lost policy re-sent", Duration::from_secs(10), || gateway_policy(&a.topo.node, &ip3).is_some());
    // ... and a policy put there behind its back (an address without a sandbox) is removed.
    assert_eq!(admin(&a.topo.node, "PUT", "/admin/v1/policies/192.168.0.201", &stray).0, 200);
    wait_for("foreign policy deleted", Duration::from_secs(10), || {
        gateway_policy(&a.topo.node, "192.168.0.201").is_none()
    });
    assert_eq!(gateway_ips(&a.topo.node), std::slice::from_ref(&ip3));

    // 8. Ensure with the gateway up: the rules are there when Ensure returns.
    let r4 = ensure(&a, "sb-4", Some(l7_ctx(vec![inject_rule("four", "four.example.com", SECRET)]))).unwrap();
    let ip4 = sandbox_ip(&r4);
    assert_eq!(rule_ids(&gateway_policy(&a.topo.node, &ip4).expect("pushed before Ensure returned")), ["four"]);
    assert!(a.release("sb-4"));
    assert_eq!(gateway_policy(&a.topo.node, &ip4), None);

    // 9. Release with the gateway up: gone when Release returns.
    let dump = a.http("/v1/policies/dump").unwrap().1;
    assert!(dump.contains(SECRET), "the loopback dump carries the secret for the gateway");
    assert!(a.release("sb-3"));
    assert_eq!(gateway_policy(&a.topo.node, &ip3), None);
    assert!(a.release("sb-2"));

    // Secrets: never in the agent's log; state files are 0600 in a 0700 directory.
    let log = a.log();
    assert!(log.contains("cube-egress"), "the push path logged nothing (log level?):\n{log}");
    for s in [SECRET, SECRET2] {
        assert!(!log.contains(s), "the agent logged a secret");
    }
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(a.state_dir()).unwrap().permissions().mode() & 0o777, 0o700);
    drop(gw);
}

#[test]
fn l7_dump_bootstraps_the_gateway_and_is_loopback_only() {
    if !require_root("l7_dump_bootstraps_the_gateway_and_is_loopback_only") {
        return;
    }
    let tmp = tmpdir("dump");
    // Push disabled: the gateway can only learn the rules from its bootstrap.
    let mut a = AgentUnderTest::prepare("l7-dump", 2, "cube_egress_admin_url = \"\"\n");
    // Listen on every address of the agent's namespace (the dump must still refuse
    // non-loopback peers).
    let cfg = std::fs::read_to_string(a.dir.join("agent.toml")).unwrap();
    std::fs::write(
        a.dir.join("agent.toml"),
        cfg.replace("health_listen = \"127.0.0.1:19090\"", "health_listen = \"0.0.0.0:19090\""),
    )
    .unwrap();
    a.start();
    let r = ensure(&a, "sb-1", Some(l7_ctx(vec![inject_rule("api", "api.example.com", SECRET)]))).expect("ensure");
    let ip = sandbox_ip(&r);
    let st = state_files(&a);
    assert!(st.iter().any(|(_, b)| String::from_utf8_lossy(b).contains(SECRET)), "state keeps the rules");
    use std::os::unix::fs::PermissionsExt;
    for (name, _) in &st {
        let m = std::fs::metadata(a.state_dir().join(name)).unwrap().permissions().mode() & 0o777;
        assert_eq!(m, 0o600, "{name}");
    }

    // A peer namespace over a veth.
    let peer = TestNetns::new("l7peer");
    cubenet_tests::netns::ip(&[
        "link",
        "add",
        "l7a",
        "netns",
        a.ns.name(),
        "type",
        "veth",
        "peer",
        "name",
        "l7p",
        "netns",
        peer.name(),
    ]);
    a.ns.ip(&["addr", "add", "10.251.0.1/30", "dev", "l7a"]);
    a.ns.ip(&["link", "set", "l7a", "up"]);
    peer.ip(&["addr", "add", "10.251.0.2/30", "dev", "l7p"]);
    peer.ip(&["link", "set", "l7p", "up"]);
    let from_peer = |path: &str| {
        let p = path.to_string();
        peer.run(move || http_get("10.251.0.1:19090", &p)).expect("peer reaches the listener")
    };
    assert_eq!(from_peer("/healthz").0, 200, "the listener is reachable from the peer");
    let (code, body) = from_peer("/v1/policies/dump");
    assert_eq!(code, 403, "{body}");
    assert!(!body.contains(SECRET));
    // A non-loopback source on the agent's own host too.
    let (code, body) = a.ns.run(|| http_get("10.251.0.1:19090", "/v1/policies/dump")).unwrap();
    assert_eq!(code, 403, "{body}");

    // Loopback: the CubeEgress bootstrap shape.
    let d = a.http_json("/v1/policies/dump");
    let pols = d["policies"].as_object().unwrap();
    assert_eq!(pols.keys().collect::<Vec<_>>(), [&ip]);
    assert_eq!(d["policies"][&ip]["policy_id"], ip.as_str());
    assert_eq!(d["policies"][&ip]["rules"][0]["action"]["inject"][0]["secret"], SECRET);

    // The real gateway bootstraps from it.
    let url = "http://127.0.0.1:19090/v1/policies/dump";
    let gw = AdminGateway::start(&a.ns, &tmp.0, url);
    wait_for("bootstrap ready", Duration::from_secs(10), || {
        let (c, b) = admin(&a.ns, "GET", "/admin/v1/health", "");
        c == 200 && serde_json::from_str::<Value>(&b).unwrap()["bootstrap_status"] == "ready"
    });
    let h: Value = serde_json::from_str(&admin(&a.ns, "GET", "/admin/v1/health", "").1).unwrap();
    assert_eq!(h["policy_count"], 1);
    let p = gateway_policy(&a.ns, &ip).expect("bootstrapped policy");
    assert_eq!(rule_ids(&p), ["api"]);
    assert_eq!(p["rules"][0]["match"], json!({"host": "api.example.com", "path": "/v1/*"}));
    drop(gw);
    assert!(a.release("sb-1"));
    assert!(!a.log().contains(SECRET), "the agent logged the secret");
    assert!(!std::fs::read_to_string(tmp.0.join("gateway.log")).unwrap_or_default().contains(SECRET));
}
