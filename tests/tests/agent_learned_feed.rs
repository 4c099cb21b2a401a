//! The learned-address feed (issue 11 remainder, decision N8), end to end: the real agent and
//! the real `cube-egress` in the node (dataplane) namespace, where the agent reaches it
//! (decision L9); a real DNS query and response pass the
//! agent's own datapath (`BPF_PROG_TEST_RUN` of the active slot's pinned `from_cube` and
//! `from_world` on the agent's TAP and uplink, so the learned entry is written by the kernel
//! into the agent's maps); the agent names it by the pattern it was learned for and the
//! gateway's `GET /admin/v1/learned/<sandboxIP>` shows it. A second sandbox with the same
//! patterns never gets the first one's addresses, and Release makes the gateway forget.
//! `static_l7_rule_through_the_agent`: an IPv4-literal L7 rule sent over gRPC is steered by the
//! agent's datapath (N10), other ports are not.

use std::time::Duration;

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    TmpDir,
    agent::AgentUnderTest,
    dns::{self, Owner, a},
    egress::{AdminGateway, admin, admin_json},
    frames::udp,
    netns::TestNetns,
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    topology::{NODE_UPLINK, WORLD_IP},
    wait_for,
};
use cubevs::{
    slots,
    testrun::{self, SkBuffCtx, TC_ACT_REDIRECT},
};
use serde_json::{Value, json};

/// Addresses the answers hand out (TEST-NET-3; denied by the CIDR policy below).
const ADDR_API: [u8; 4] = [203, 0, 113, 10];
const ADDR_CDN: [u8; 4] = [203, 0, 113, 20];

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Internet off, the resolver (the world address) allowed by CIDR, two names by DNS learning,
/// both named by L7 rules (so their learned addresses are L7).
fn ctx() -> pb::CubeVsContext {
    let rule = |id: &str, host: &str| pb::EgressRule {
        id: id.into(),
        r#match: Some(pb::EgressMatch { host: Some(host.into()), ..Default::default() }),
        action: Some(pb::EgressAction { allow: true, ..Default::default() }),
    };
    pb::CubeVsContext {
        allow_internet_access: Some(false),
        allow_out: vec![format!("{}/32", std::net::Ipv4Addr::from(WORLD_IP))],
        allow_fqdn: vec![
            pb::FqdnAllow { name: "api.example.com".into(), ports: vec![] },
            pb::FqdnAllow { name: "*.cdn.example".into(), ports: vec![443] },
        ],
        rules: vec![rule("api", "api.example.com"), rule("cdn", "*.cdn.example")],
        ..Default::default()
    }
}

fn ensure(a: &AgentUnderTest, id: &str) -> pb::EnsureNetworkResponse {
    rt().block_on(async {
        let mut cl = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        cl.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: id.into(),
            cubevs_context: Some(ctx()),
            ..Default::default()
        })
        .await
        .expect("ensure")
        .into_inner()
    })
}

/// The gateway's learned names of `ip` (`None` = 404 nothing learned).
fn learned(ns: &TestNetns, ip: &str) -> Option<Value> {
    admin_json(ns, &format!("/admin/v1/learned/{ip}")).map(|v| v["names"].clone())
}

/// A guest query for `name` (id `id`, guest port `gport`) out of `tap`, and the resolver's
/// answer `addr` back through the uplink, both through the agent's active programs. Returns
/// the query's and the response's verdicts.
fn resolve(ag: &AgentUnderTest, tap: &str, gport: u16, id: u16, name: &str, addr: [u8; 4]) -> (u32, u32) {
    let pin_dir = ag.pin_dir();
    let (world_mac, up_mac) = (ag.topo.world_mac(), ag.topo.node_uplink_mac());
    let (tap, name) = (tap.to_string(), name.to_string());
    ag.topo.node.run(move || {
        let meta = cubevs::layout::read_meta(&pin_dir).expect("meta").expect("slot metadata");
        let progs = slots::slot_programs(&pin_dir, meta.active.expect("active slot")).expect("slot programs");
        let tap_if = cubenet_sys::ifindex(&tap).expect("tap ifindex");
        let up_if = cubenet_sys::ifindex(NODE_UPLINK).expect("uplink ifindex");
        let q = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, gport, 53, &dns::query(id, &name));
        let ctx = |i| SkBuffCtx { ingress_ifindex: i, ..Default::default() };
        let out = testrun::run(&progs["from_cube"], &q, ctx(tap_if), 1).expect("run from_cube");
        // Left SNATed: the node address and port the answer comes back to.
        let (snat_ip, snat_port) = (
            [out.data[26], out.data[27], out.data[28], out.data[29]],
            u16::from_be_bytes([out.data[34], out.data[35]]),
        );
        let r = dns::response(id, &name, &[a(Owner::Question, addr, 600)]);
        let back = udp(world_mac, up_mac, WORLD_IP, snat_ip, 53, snat_port, &r);
        let resp = testrun::run(&progs["from_world"], &back, ctx(up_if), 1).expect("run from_world");
        (out.verdict, resp.verdict)
    })
}

#[test]
fn learned_addresses_reach_the_gateway_per_sandbox_and_go_on_release() {
    if !require_root("learned_addresses_reach_the_gateway_per_sandbox_and_go_on_release") {
        return;
    }
    let mut ag = AgentUnderTest::prepare("learned-feed", 2, "cube_egress_push_timeout_ms = 5000\n");
    let dir = TmpDir(ag.dir.join("gw"));
    let _gw = AdminGateway::start(&ag.topo.node, &dir.0, "");
    ag.start();

    let ra = ensure(&ag, "sb-a");
    let rb = ensure(&ag, "sb-b");
    let (ip_a, ip_b) = (ra.persist_metadata["sandbox_ip"].clone(), rb.persist_metadata["sandbox_ip"].clone());
    let tap_a = ra.persist_metadata["host_tap_name"].clone();
    wait_for("both policies on the gateway", Duration::from_secs(10), || {
        admin(&ag.topo.node, "GET", &format!("/admin/v1/policies/{ip_a}"), "").0 == 200
            && admin(&ag.topo.node, "GET", &format!("/admin/v1/policies/{ip_b}"), "").0 == 200
    });
    assert_eq!(learned(&ag.topo.node, &ip_a), None, "nothing learned yet");

    // Sandbox A resolves an exact name and a subdomain of a `*.` pattern.
    assert_eq!(resolve(&ag, &tap_a, 40000, 0x1111, "API.example.com", ADDR_API), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
    assert_eq!(resolve(&ag, &tap_a, 40001, 0x2222, "img.cdn.example", ADDR_CDN), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
    let want = json!({"api.example.com": ["203.0.113.10"], "*.cdn.example": ["203.0.113.20"]});
    wait_for("A's learned names on the gateway", Duration::from_secs(10), || {
        learned(&ag.topo.node, &ip_a).as_ref() == Some(&want)
    });
    let m = ag.http("/metrics").expect("metrics").1;
    // Exported at 0 from the start (O24): the count must have moved.
    assert!(
        m.contains("cubenet_egress_learned_push_total{result=\"ok\"} ")
            && !m.contains("cubenet_egress_learned_push_total{result=\"ok\"} 0\n"),
        "{m}"
    );

    // Attack: B has the same patterns and rules and learned nothing; it never gets A's
    // addresses, under any name (the feed runs every second: wait two more rounds).
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(learned(&ag.topo.node, &ip_b), None, "A's addresses fed under B");
    assert_eq!(learned(&ag.topo.node, &ip_a).as_ref(), Some(&want));

    // Release forgets A's learned names on the gateway; B still has nothing.
    assert!(ag.release("sb-a"));
    wait_for("A's learned names gone", Duration::from_secs(10), || learned(&ag.topo.node, &ip_a).is_none());
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(learned(&ag.topo.node, &ip_a), None, "fed again after Release");
    assert_eq!(learned(&ag.topo.node, &ip_b), None);
    assert!(ag.release("sb-b"));
}

#[test]
fn static_l7_rule_through_the_agent() {
    if !require_root("static_l7_rule_through_the_agent") {
        return;
    }
    use cubenet_tests::frames::{Tcp, tcp};
    let mut ag = AgentUnderTest::prepare("static-l7", 1, "cube_egress_admin_url = \"\"\n");
    ag.start();
    let c = pb::CubeVsContext {
        allow_internet_access: Some(false),
        rules: vec![pb::EgressRule {
            id: "ip".into(),
            r#match: Some(pb::EgressMatch { host: Some("203.0.113.10".into()), ..Default::default() }),
            action: Some(pb::EgressAction { allow: true, ..Default::default() }),
        }],
        ..Default::default()
    };
    let r = rt()
        .block_on(async {
            let mut cl = network_agent::client::connect(&ag.grpc_endpoint()).await.unwrap();
            cl.ensure_network(pb::EnsureNetworkRequest {
                sandbox_id: "sb-ip".into(),
                cubevs_context: Some(c),
                ..Default::default()
            })
            .await
        })
        .expect("ensure")
        .into_inner();
    let tap = r.persist_metadata["host_tap_name"].clone();
    let pol = ag.http_json("/v1/dataplane/policies");
    let p =
        pol["policies"].as_array().unwrap().iter().find(|p| p["tapName"] == tap.as_str()).unwrap()["policy"].clone();
    assert_eq!(p["l7"], json!(["203.0.113.10/32"]), "{p}");
    let pin_dir = ag.pin_dir();
    let (mark443, mark22) = ag.topo.node.run(move || {
        let meta = cubevs::layout::read_meta(&pin_dir).unwrap().unwrap();
        let progs = slots::slot_programs(&pin_dir, meta.active.unwrap()).unwrap();
        let tap_if = cubenet_sys::ifindex(&tap).unwrap();
        let run = |dport| {
            let t = Tcp { sport: 40000 + dport, dport, seq: 1, syn: true, win: 1000, ..Default::default() };
            let f = tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, ADDR_API, t, b"");
            let o =
                testrun::run(&progs["from_cube"], &f, SkBuffCtx { ingress_ifindex: tap_if, ..Default::default() }, 1)
                    .unwrap();
            (o.verdict, o.mark, o.data[26..30].to_vec())
        };
        (run(443), run(22))
    });
    let sandbox: std::net::Ipv4Addr = r.persist_metadata["sandbox_ip"].parse().unwrap();
    assert_eq!(mark443, (TC_ACT_REDIRECT, cubevs_common::l7::MARK_HTTPS, sandbox.octets().to_vec()), "steered");
    // Port 22 of the same address: internet off, no allow: a RST from it back to the guest.
    assert_eq!(mark22, (TC_ACT_REDIRECT, 0, ADDR_API.to_vec()), "denied by the CIDR policy");
}

/// The operator's view of DNS learning (decisions O18, O20): `GET /v1/dataplane/fqdn` and
/// `cubenet-cli sandbox ID` list a sandbox's `allow_fqdn` patterns with the addresses its own
/// datapath learned for each and its query and learning windows, so "why does this name not work" is answered per sandbox. Attack: a second
/// sandbox with the same patterns never shows the first one's addresses, and a released
/// sandbox's entries are shown for nobody.
#[test]
fn operator_sees_each_sandboxs_learned_addresses() {
    if !require_root("operator_sees_each_sandboxs_learned_addresses") {
        return;
    }
    use cubenet_tests::agent::{HEALTH, workspace_bin};
    let mut ag = AgentUnderTest::prepare("fqdn-view", 2, "cube_egress_admin_url = \"\"\n");
    ag.start();
    let ra = ensure(&ag, "sb-a");
    ensure(&ag, "sb-b");
    let tap_a = ra.persist_metadata["host_tap_name"].clone();
    let view = |id: &str| {
        let j = ag.http_json("/v1/dataplane/fqdn");
        j["sandboxes"].as_array().unwrap().iter().find(|s| s["sandboxID"] == id).cloned()
    };
    let patterns = |v: &Value| {
        let mut p: Vec<String> =
            v["allowFqdn"].as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect();
        p.sort();
        p
    };
    let a0 = view("sb-a").expect("sb-a listed");
    assert_eq!(patterns(&a0), ["*.cdn.example:443", "api.example.com"], "{a0}");
    assert_eq!((a0["learned"].clone(), a0["learnedEntries"].clone()), (json!({}), json!(0)), "{a0}");

    assert_eq!(resolve(&ag, &tap_a, 40000, 0x1111, "API.example.com", ADDR_API), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
    assert_eq!(resolve(&ag, &tap_a, 40001, 0x2222, "img.cdn.example", ADDR_CDN), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
    let want = json!({"api.example.com": ["203.0.113.10"], "*.cdn.example": ["203.0.113.20"]});
    let a1 = view("sb-a").unwrap();
    // One entry per learned (address, port): every port for the exact name, 443 for the wildcard.
    assert_eq!((a1["learned"].clone(), a1["learnedEntries"].clone()), (want, json!(2)), "{a1}");
    // The datapath's windows (O20): A's two new entries charged to its day window; its two
    // tracked queries to its 10 s window while that window is open.
    assert_eq!((a1["learnedDay"]["used"].clone(), a1["learnedDay"]["cap"].clone()), (json!(2), json!(8192)), "{a1}");
    let resets = a1["learnedDay"]["resets_in_secs"].as_u64().unwrap();
    assert!((1..=86_400).contains(&resets), "{a1}");
    let q = &a1["queryWindow"];
    assert_eq!(q["cap"], json!(512), "{a1}");
    assert!(q["used"] == json!(2) || (q["used"] == json!(0) && q["resets_in_secs"] == json!(0)), "{a1}");
    let b1 = view("sb-b").unwrap();
    for w in ["learnedDay", "queryWindow"] {
        assert_eq!((b1[w]["used"].clone(), b1[w]["resets_in_secs"].clone()), (json!(0), json!(0)), "B charged: {b1}");
    }
    assert_eq!(patterns(&b1), patterns(&a1));
    assert_eq!((b1["learned"].clone(), b1["learnedEntries"].clone()), (json!({}), json!(0)), "A's addresses under B");

    // The CLI, as an operator runs it where the agent's loopback is.
    let cli = |json: bool, id: &str| {
        let mut cmd = ag.ns.command(workspace_bin("cubenet-cli").to_str().unwrap());
        cmd.args(["--http", HEALTH]);
        if json {
            cmd.arg("--json");
        }
        let o = cmd.args(["sandbox", id]).output().expect("run cubenet-cli");
        assert!(o.status.success(), "cubenet-cli sandbox {id}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let table = cli(false, "sb-a");
    let row =
        |name: &str| table.lines().find(|l| l.starts_with(name)).map(|l| l.split_whitespace().collect::<Vec<_>>());
    assert_eq!(row("api.example.com"), Some(vec!["api.example.com", "203.0.113.10"]), "{table}");
    assert_eq!(row("*.cdn.example:443"), Some(vec!["*.cdn.example:443", "203.0.113.20"]), "{table}");
    assert!(table.contains("learned entries of this sandbox: 2"), "{table}");
    assert!(table.contains("new learned entries (day window): 2 of 8192, window resets in"), "{table}");
    let jb: Value = serde_json::from_str(&cli(true, "sb-b")).unwrap();
    assert_eq!((jb["learned"].clone(), jb["learnedEntries"].clone()), (json!({}), json!(0)), "{jb}");
    assert!(jb["drops"].is_object(), "the counters are still there: {jb}");

    // Released: gone from the view; B (same patterns) still shows nothing.
    assert!(ag.release("sb-a"));
    assert!(view("sb-a").is_none());
    assert_eq!(view("sb-b").unwrap()["learned"], json!({}));
    assert!(ag.release("sb-b"));
}
