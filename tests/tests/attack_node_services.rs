//! Attack: a sandbox reads the agent's health/metrics listener through the node address
//! (decision R41). The Helm chart binds `health_listen` on `0.0.0.0:19090` (kubelet probes,
//! Prometheus) and the datapath delivers a guest's flow to the node address to the host
//! (upstream's "host service access"), so a guest with the default policy reached `/metrics`:
//! every other sandbox's id (`cubenet_sandbox_*{sandbox="…"}`) with its packet and byte
//! counts, a side channel on its neighbours' traffic. The agent now answers a peer inside the
//! sandbox `cidr` 403 on every path; a scraper on the node's network still gets `/metrics`.
//!
//! The guest is a kernel stack on the TAP fd the agent handed out (`KernelGuest`), the agent
//! runs in the dataplane namespace with the chart's listener address.

use std::{net::Ipv4Addr, time::Duration};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    agent_upgrade::KernelGuest,
    netns::TestNetns,
    require_root,
    topology::NODE_IP,
};

/// `curl` from `ns`: (HTTP status, body); status 0 when no answer came.
fn get(ns: &TestNetns, url: &str) -> (u16, String) {
    let o = ns.exec("curl", &["-s", "-m", "10", "-w", "\n%{http_code}", url]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", &out));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// The agent in the dataplane namespace with the chart's listener address, running.
fn chart_agent(tag: &str) -> AgentUnderTest {
    let mut a = AgentUnderTest::prepare(tag, 2, "");
    a.in_dataplane = true;
    // The chart's listener: every address of the node namespace.
    let cfg = std::fs::read_to_string(a.dir.join("agent.toml")).unwrap();
    let cfg = cfg.replace("health_listen = \"127.0.0.1:19090\"", "health_listen = \"0.0.0.0:19090\"");
    assert!(cfg.contains("0.0.0.0:19090"));
    std::fs::write(a.dir.join("agent.toml"), cfg).unwrap();
    a.start();
    a
}

/// Ensures `id` with `ctx` and returns it with a kernel guest on its TAP.
fn guest(a: &AgentUnderTest, id: &str, ctx: Option<pb::CubeVsContext>) -> KernelGuest {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let r = rt
        .block_on(async {
            let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
            c.ensure_network(pb::EnsureNetworkRequest {
                sandbox_id: id.into(),
                cubevs_context: ctx,
                ..Default::default()
            })
            .await
        })
        .unwrap()
        .into_inner();
    let ifc = &r.interfaces[0];
    let (reply, fd) = tap_fd(&a.tap_socket(), &ifc.name, &r.sandbox_id);
    assert_eq!(reply["errCode"], "0", "{reply}");
    KernelGuest::new(fd.expect("TAP fd"), &ifc.mac_address, &ifc.ip_cidrs[0], &ifc.gateway, ifc.mtu as u32)
}

/// `curl` from the guest, one retry when nothing answered (the first SYN may race the
/// guest's ARP for its gateway).
fn guest_get(g: &KernelGuest, url: &str) -> (u16, String) {
    let got = get(&g.ns, url);
    if got.0 != 0 {
        return got;
    }
    std::thread::sleep(Duration::from_millis(200));
    get(&g.ns, url)
}

#[test]
fn sandbox_cannot_read_the_agent_listener_via_the_node_address() {
    if !require_root("sandbox_cannot_read_the_agent_listener_via_the_node_address") {
        return;
    }
    let a = chart_agent("nodesvc");
    let _neighbour = a_sandbox(&a, "sb-neighbour-secret-id");
    let guest = guest(&a, "sb-attacker", None);

    // A scraper on the node's network reads the metrics (and is refused the /v1/ dumps).
    let node = Ipv4Addr::from(NODE_IP);
    let (code, body) = get(&a.topo.world, &format!("http://{node}:19090/metrics"));
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("sb-neighbour-secret-id"), "the scrape lists the sandboxes: {body}");
    assert_eq!(get(&a.topo.world, &format!("http://{node}:19090/v1/network/taps")).0, 403);

    // The sandbox, through the node address: nothing.
    for path in ["/metrics", "/healthz", "/readyz", "/v1/network/taps", "/v1/policies/dump", "/v1/dataplane/fqdn"] {
        let (code, body) = guest_get(&guest, &format!("http://{node}:19090{path}"));
        assert!(!body.contains("sb-neighbour-secret-id"), "{path}: the sandbox read its neighbour's id:\n{body}");
        assert_eq!(code, 403, "{path}: {body}");
    }
    assert!(a.log().contains("sandbox client refused"), "{}", a.log());
}

fn a_sandbox(a: &AgentUnderTest, id: &str) -> String {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: id.into(), ..Default::default() }).await
    })
    .unwrap()
    .into_inner()
    .sandbox_id
}

/// The most permissive policy a caller can give (`allow_out` 0.0.0.0/0 beats the always-denied
/// ranges), and every other address of the node the guest can name: cube-dev's (the sandbox
/// CIDR's `.1`, where CubeEgress listens), loopback, the guest's gateway, the limited broadcast.
/// None of them may hand the guest the agent's metrics (a path that SNATed the guest to the
/// node address before delivering it locally would pass R41's source check).
#[test]
fn sandbox_cannot_reach_the_agent_listener_by_any_node_address() {
    if !require_root("sandbox_cannot_reach_the_agent_listener_by_any_node_address") {
        return;
    }
    let a = chart_agent("nodesvc-any");
    let _neighbour = a_sandbox(&a, "sb-neighbour-secret-id");
    let ctx = pb::CubeVsContext { allow_out: vec!["0.0.0.0/0".into()], ..Default::default() };
    let guest = guest(&a, "sb-attacker", Some(ctx));
    for addr in ["198.51.100.2", "192.168.0.1", "127.0.0.1", "169.254.68.5", "169.254.68.6", "255.255.255.255"] {
        let (code, body) = guest_get(&guest, &format!("http://{addr}:19090/metrics"));
        eprintln!("{addr}:19090/metrics -> {code}");
        assert!(!body.contains("sb-neighbour-secret-id"), "{addr}: the sandbox read its neighbour's id:\n{body}");
        assert_ne!(code, 200, "{addr}: {body}");
    }
}

/// The operator's way to close host service access for a sandbox: `deny_out` naming the node
/// address. The guest then reaches no listener there (a RST, no answer), the agent's included;
/// the world scraper still does. A property users rely on that had no test.
#[test]
fn deny_out_of_the_node_address_closes_host_services() {
    if !require_root("deny_out_of_the_node_address_closes_host_services") {
        return;
    }
    let a = chart_agent("nodesvc-deny");
    let node = Ipv4Addr::from(NODE_IP);
    let ctx = pb::CubeVsContext { deny_out: vec![format!("{node}/32")], ..Default::default() };
    let guest = guest(&a, "sb-denied", Some(ctx));
    let o = guest.ns.exec(
        "curl",
        &["-s", "-m", "10", "-o", "/dev/null", "-w", "%{http_code}", &format!("http://{node}:19090/healthz")],
    );
    let code = String::from_utf8_lossy(&o.stdout).to_string();
    // curl exit 7: connection refused (the datapath's RST), not 28 (a timeout).
    assert_eq!((o.status.code(), code.as_str()), (Some(7), "000"), "{o:?}");
    assert_eq!(get(&a.topo.world, &format!("http://{node}:19090/healthz")).0, 200);
}

/// The agent relays CubeEgress's `/metrics` on the same listener (`/metrics/cube-egress`,
/// decision O26), which the gateway itself only serves on the dataplane's loopback: the relay
/// must not hand a sandbox what its own loopback never could (the gateway's request, deny and
/// injection counts, a side channel on every other sandbox's L7 traffic). The real gateway on
/// the node's loopback; the scraper on the node's network gets its text, the sandbox 403.
#[test]
fn sandbox_cannot_read_the_gateway_metrics_through_the_agent() {
    if !require_root("sandbox_cannot_read_the_gateway_metrics_through_the_agent") {
        return;
    }
    let a = chart_agent("nodesvc-egm");
    let dir = std::env::temp_dir().join(format!("cubenet-nodesvc-egm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dir = cubenet_tests::TmpDir(dir);
    let _gw = cubenet_tests::egress::AdminGateway::start(&a.topo.node, &dir.0, "");
    let guest = guest(&a, "sb-attacker", None);
    let node = Ipv4Addr::from(NODE_IP);
    let url = format!("http://{node}:19090/metrics/cube-egress");
    let (code, body) = get(&a.topo.world, &url);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("cube_egress_requests_total"), "the scraper gets the gateway's metrics: {body}");
    let (code, body) = guest_get(&guest, &url);
    assert!(!body.contains("cube_egress_"), "the sandbox read the gateway's metrics:\n{body}");
    assert_eq!(code, 403, "{body}");
}
