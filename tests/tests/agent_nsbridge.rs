//! The CubeEgress bridge (decision L9), with the real counterparts as the Helm chart's
//! `underlay` mode places them: the agent in a namespace of its own (the "pod") with
//! `dataplane_netns` = the node namespace, and the real `cube-egress` in the NODE namespace
//! with its admin API on the node's 127.0.0.1:9091 (its default) and `--bootstrap-url` on the
//! agent's `egress_dump_listen` (default 127.0.0.1:19091, bound by the agent inside the node
//! namespace). Nothing of either listens in the other's namespace.
//!
//! - `gateway_in_the_dataplane_bootstraps_and_gets_pushes`: the gateway bootstraps from the
//!   dump (a sandbox Ensured while the gateway was down), an Ensure with rules reaches it,
//!   Release deletes it; the dump listener serves nothing else.
//! - `dump_listener_refuses_other_namespaces_and_non_loopback`: with the listener on
//!   0.0.0.0 in the node namespace, a peer namespace over a veth and a non-loopback source on
//!   the node itself get 403 and no secret; the agent's own namespace has no such listener.

use std::time::Duration;

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    TmpDir,
    agent::{AgentUnderTest, http_get},
    egress::{ADMIN, AdminGateway, admin_json},
    netns::TestNetns,
    require_root, wait_for,
};
use serde_json::Value;

const SECRET: &str = "sk-live-NSBRIDGE-SECRET-0c4e91d7";
const DUMP: &str = "127.0.0.1:19091";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn ctx(rule: &str) -> pb::CubeVsContext {
    pb::CubeVsContext {
        allow_internet_access: Some(true),
        allow_fqdn: vec![pb::FqdnAllow { name: "*.example.com".into(), ports: vec![443] }],
        rules: vec![pb::EgressRule {
            id: rule.into(),
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
    }
}

/// Ensure with `rule`; returns the sandbox IP.
fn ensure(a: &AgentUnderTest, id: &str, rule: &str) -> String {
    rt().block_on(async {
        let mut cl = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        let r = cl
            .ensure_network(pb::EnsureNetworkRequest {
                sandbox_id: id.into(),
                cubevs_context: Some(ctx(rule)),
                ..Default::default()
            })
            .await
            .expect("ensure")
            .into_inner();
        r.persist_metadata["sandbox_ip"].clone()
    })
}

/// `GET path` on `addr` from inside `ns`: (status, body), status 0 when unreachable.
fn get_in(ns: &TestNetns, addr: &str, path: &str) -> (u16, String) {
    let (a, p) = (addr.to_string(), path.to_string());
    ns.run(move || http_get(&a, &p)).unwrap_or((0, String::new()))
}

fn gateway_policy(node: &TestNetns, ip: &str) -> Option<Value> {
    admin_json(node, &format!("/admin/v1/policies/{ip}"))
}

#[test]
fn gateway_in_the_dataplane_bootstraps_and_gets_pushes() {
    if !require_root("gateway_in_the_dataplane_bootstraps_and_gets_pushes") {
        return;
    }
    // Defaults: cube_egress_admin_url http://127.0.0.1:9091, egress_dump_listen 127.0.0.1:19091.
    let mut a = AgentUnderTest::prepare("nsbridge", 3, "cube_egress_push_timeout_ms = 5000\n");
    assert!(!a.in_dataplane, "the agent runs in a namespace of its own");
    let dir = TmpDir(a.dir.join("gw"));
    std::fs::create_dir_all(&dir.0).unwrap();
    a.start();
    let node = &a.topo.node;

    // The dump listener is in the node namespace, not the agent's.
    assert_eq!(get_in(&a.ns, DUMP, "/v1/policies/dump").0, 0, "a dump listener in the agent's own namespace");
    let (c, b) = get_in(node, DUMP, "/v1/policies/dump");
    assert_eq!(c, 200, "{b}");
    assert_eq!(serde_json::from_str::<Value>(&b).unwrap()["policies"], serde_json::json!({}));
    // It serves nothing but the dump (no metrics, TAPs or datapath dumps in the node's loopback).
    for p in ["/metrics", "/healthz", "/v1/network/taps", "/v1/dataplane/sessions"] {
        assert_eq!(get_in(node, DUMP, p).0, 404, "{p} on egress_dump_listen");
    }

    // sb-1 is Ensured while no gateway runs: only the bootstrap can give it its rules first.
    let ip1 = ensure(&a, "sb-1", "one");
    let (c, b) = get_in(node, DUMP, "/v1/policies/dump");
    assert_eq!(c, 200);
    assert!(b.contains(SECRET), "the dump carries the secret for the gateway");

    // The real gateway in the node namespace bootstraps from the dump listener.
    let gw = AdminGateway::start(node, &dir.0, &format!("http://{DUMP}/v1/policies/dump"));
    let (_, h) = get_in(node, ADMIN, "/admin/v1/health");
    let h: Value = serde_json::from_str(&h).unwrap();
    assert_eq!(h["bootstrap_status"], "ready", "bootstrap from the dump listener: {h}");
    let log = gw.log();
    assert!(log.contains("bootstrap ready"), "{log}");
    let p = gateway_policy(node, &ip1).expect("sb-1's policy on the gateway");
    assert_eq!(p["rules"][0]["id"], "one");
    assert!(!p.to_string().contains(SECRET), "the gateway's read path redacts the secret");

    // The push reaches the gateway in the node namespace: Ensure, then Release.
    let ip2 = ensure(&a, "sb-2", "two");
    wait_for("sb-2's rules on the gateway", Duration::from_secs(10), || gateway_policy(node, &ip2).is_some());
    assert_eq!(gateway_policy(node, &ip2).unwrap()["rules"][0]["id"], "two");
    let m = a.http("/metrics").expect("metrics").1;
    assert!(m.contains("cubenet_egress_up 1"), "the agent sees the gateway up");
    assert!(a.release("sb-2"));
    wait_for("sb-2's policy deleted", Duration::from_secs(10), || gateway_policy(node, &ip2).is_none());
    assert!(gateway_policy(node, &ip1).is_some(), "sb-1 untouched");
    assert!(a.release("sb-1"));
    wait_for("sb-1's policy deleted", Duration::from_secs(10), || gateway_policy(node, &ip1).is_none());
    drop(gw);
    assert!(!a.log().contains(SECRET), "the agent logged the secret");
}

#[test]
fn dump_listener_refuses_other_namespaces_and_non_loopback() {
    if !require_root("dump_listener_refuses_other_namespaces_and_non_loopback") {
        return;
    }
    let mut a = AgentUnderTest::prepare(
        "nsbridge-attack",
        2,
        "cube_egress_admin_url = \"\"\negress_dump_listen = \"0.0.0.0:19091\"\n",
    );
    a.start();
    let ip = ensure(&a, "sb-1", "one");
    let node = &a.topo.node;

    // A peer namespace over a veth into the node namespace.
    let peer = TestNetns::new("nsbpeer");
    cubenet_tests::netns::ip(&[
        "link",
        "add",
        "nsba",
        "netns",
        node.name(),
        "type",
        "veth",
        "peer",
        "name",
        "nsbp",
        "netns",
        peer.name(),
    ]);
    node.ip(&["addr", "add", "10.252.0.1/30", "dev", "nsba"]);
    node.ip(&["link", "set", "nsba", "up"]);
    peer.ip(&["addr", "add", "10.252.0.2/30", "dev", "nsbp"]);
    peer.ip(&["link", "set", "nsbp", "up"]);
    let (code, body) = get_in(&peer, "10.252.0.1:19091", "/v1/policies/dump");
    assert_eq!(code, 403, "a peer namespace reads the dump: {body}");
    assert!(!body.contains(SECRET));
    // A non-loopback source on the node itself.
    let (code, body) = get_in(node, "10.252.0.1:19091", "/v1/policies/dump");
    assert_eq!(code, 403, "{body}");
    assert!(!body.contains(SECRET));
    // The agent's own namespace has no listener there (the agent is not in the node's).
    assert_eq!(get_in(&a.ns, "127.0.0.1:19091", "/v1/policies/dump").0, 0);
    // Loopback of the node namespace: the dump, with the secret.
    let (code, body) = get_in(node, DUMP, "/v1/policies/dump");
    assert_eq!(code, 200, "{body}");
    let d: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(d["policies"][&ip]["rules"][0]["action"]["inject"][0]["secret"], SECRET);
    assert!(a.release("sb-1"));
}
