//! Attack (decision R91): sandbox A churns plain TCP connections to an address its policy
//! steers to CubeEgress (64 loops of connect, 512 bytes of garbage, close) while sandbox B
//! sends keep-alive HTTPS requests through the gateway. Real agent, real CubeVS datapath,
//! real `cube-egress` behind TPROXY, two kernel guests (root only).
//!
//! The node's TCP stack completes every one of A's handshakes for the gateway (TPROXY) before
//! the gateway can admit anything, so R90's handshake gate could not bound it: B kept 12–25 %
//! of its rate alone. Now the datapath drops A's SYNs beyond its bucket of new connections
//! (`l7_connect_rate_per_sandbox`, `l7_connect_burst_per_sandbox`). The figures are printed
//! beside B alone in the same run; the assertion compares request counts, not times.
//! `CUBENET_L7_CONNECT_RATE` (e.g. `0`: no bound) overrides the agent's rate, for measuring.

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    agent_upgrade::KernelGuest,
    egress::admin_json,
    hsflood::{FloodKind, flood, victim},
    l7::{Gateway, GatewayOptions, World},
    require_root,
    topology::WORLD_IP,
};

const API: &str = "api.l7.test";
const API_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// DNS through the world resolver, `API` by name on 443 through CubeEgress.
fn l7_context() -> pb::CubeVsContext {
    pb::CubeVsContext {
        allow_internet_access: Some(false),
        allow_out: vec![format!("{}/32", Ipv4Addr::from(WORLD_IP))],
        allow_fqdn: vec![pb::FqdnAllow { name: API.into(), ports: vec![443] }],
        rules: vec![pb::EgressRule {
            id: "api".into(),
            r#match: Some(pb::EgressMatch { host: Some(API.into()), ..Default::default() }),
            action: Some(pb::EgressAction { allow: true, ..Default::default() }),
        }],
        ..Default::default()
    }
}

/// A sandbox with its kernel guest, the name resolved (learned) and its policy in the gateway.
fn sandbox(a: &AgentUnderTest, id: &str) -> (KernelGuest, Ipv4Addr) {
    let r = rt()
        .block_on(async {
            let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
            c.ensure_network(pb::EnsureNetworkRequest {
                sandbox_id: id.into(),
                cubevs_context: Some(l7_context()),
                ..Default::default()
            })
            .await
        })
        .expect("EnsureNetwork")
        .into_inner();
    let ifc = &r.interfaces[0];
    let (reply, fd) = tap_fd(&a.tap_socket(), &ifc.name, &r.sandbox_id);
    assert_eq!(reply["errCode"], "0", "{reply}");
    let guest = KernelGuest::new(fd.expect("TAP fd"), &ifc.mac_address, &ifc.ip_cidrs[0], &ifc.gateway, ifc.mtu as u32);
    let o = guest.ns.exec("busybox", &["nslookup", "-type=a", API, &Ipv4Addr::from(WORLD_IP).to_string()]);
    assert!(String::from_utf8_lossy(&o.stdout).contains(&API_IP.to_string()), "{id} resolves the name: {o:?}");
    let sandbox_ip = r.persist_metadata["sandbox_ip"].clone();
    let t = Instant::now();
    while admin_json(&a.topo.node, &format!("/admin/v1/policies/{sandbox_ip}")).is_none() {
        assert!(t.elapsed() < Duration::from_secs(15), "{id}'s policy never reached the gateway");
        std::thread::sleep(Duration::from_millis(100));
    }
    let guest_ip = ifc.ip_cidrs[0].split('/').next().unwrap().parse().unwrap();
    (guest, guest_ip)
}

fn metric(a: &AgentUnderTest, reason: &str) -> u64 {
    let (_, body) = a.http("/metrics").expect("/metrics");
    let series = format!(r#"cubenet_datapath_packets_total{{program="from_cube",reason="{reason}"}} "#);
    body.lines().find_map(|l| l.strip_prefix(&series)?.trim().parse::<f64>().ok()).unwrap_or(0.0) as u64
}

#[test]
fn one_sandboxs_connection_churn_leaves_another_its_l7_requests() {
    if !require_root("attack_l7_churn one_sandboxs_connection_churn_leaves_another_its_l7_requests") {
        return;
    }
    let rate = std::env::var("CUBENET_L7_CONNECT_RATE").ok();
    let extra = format!(
        "cube_egress_admin_url = \"http://127.0.0.1:9091\"\n{}",
        rate.as_ref().map(|r| format!("l7_connect_rate_per_sandbox = {r}\n")).unwrap_or_default()
    );
    let loops: usize = std::env::var("CUBENET_HSFLOOD_LOOPS").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let window = Duration::from_secs(3);
    let mut a = AgentUnderTest::prepare("l7churn", 2, &extra);
    a.in_dataplane = true;
    a.topo.add_world_address(API_IP.octets(), 24);
    let world =
        World::start(&a.topo.world, Ipv4Addr::from(WORLD_IP), &[(API, API_IP)], &[API_IP]).expect("world servers");
    a.start();
    let gw_dir = std::env::temp_dir().join(format!("cubenet-l7churn-{}", std::process::id()));
    let gw = Gateway::start(&a.topo.node, &gw_dir, &world.ca.pem, &GatewayOptions::for_agent(None))
        .unwrap_or_else(|e| panic!("gateway: {e}"));
    let ca_pem = std::fs::read_to_string(gw.ca_file()).expect("gateway CA");
    let (attacker, a_ip) = sandbox(&a, "sb-attacker");
    let (victim_guest, b_ip) = sandbox(&a, "sb-victim");
    let to = SocketAddr::from((API_IP, 443));

    let alone = victim(&victim_guest.ns, &ca_pem, API, b_ip, to, "/alone", window);
    assert!(alone.ok > 0 && alone.failed == 0, "the victim alone: {alone:?}\n{}", gw.log());
    let drops_before = metric(&a, "drop_new_flow_rate");
    let f = flood(&attacker.ns, FloodKind::Garbage, API, a_ip, to, loops, 2);
    std::thread::sleep(Duration::from_millis(500));
    let before = f.done.load(Ordering::SeqCst);
    let under = victim(&victim_guest.ns, &ca_pem, API, b_ip, to, "/under-churn", window);
    let churned = f.done.load(Ordering::SeqCst) - before;
    let failed = f.failed.load(Ordering::SeqCst);
    f.stop();
    let drops = metric(&a, "drop_new_flow_rate") - drops_before;
    println!(
        "rate {}: victim alone {} requests ({:.0}/s, p50 {:.2} ms); under churn ({loops} loops, {churned} connections \
         in the window, {:.0}/s, {failed} failed, {drops} SYNs dropped by the bucket): {} requests ({:.0}/s, {:.0} % \
         of alone, {} failed), p50 {:.2} ms, p99 {:.2} ms",
        rate.as_deref().unwrap_or("default"),
        alone.ok,
        alone.ok as f64 / window.as_secs_f64(),
        alone.quantile_ms(0.5),
        churned as f64 / window.as_secs_f64(),
        under.ok,
        under.ok as f64 / window.as_secs_f64(),
        100.0 * under.ok as f64 / alone.ok as f64,
        under.failed,
        under.quantile_ms(0.5),
        under.quantile_ms(0.99),
    );
    assert_eq!(under.failed, 0, "the victim's requests failed: {:?}", under.errors);
    assert_eq!(world.requests_to("/under-churn").len() as u64, under.ok);
    // The datapath's bucket did the bounding (the gateway's own, R102, acts only above it).
    assert!(rate.is_some() || drops > 0, "no SYN dropped by the bucket under {churned} connections");
    // The victim keeps at least half its rate alone.
    assert!(
        under.ok * 2 >= alone.ok,
        "the churn starved the victim: {} requests under it, {} alone",
        under.ok,
        alone.ok
    );
    drop(gw);
}
