//! `l7` rows: HTTPS from a sandbox through the full L7 path — a kernel guest on the agent's
//! TAP → CubeVS mark and redirect → TPROXY → the real `cube-egress` (TLS interception,
//! credential injection, audit) → the world server — beside the same kind of guest going
//! guest → CubeVS SNAT → the same world server directly, in the same run. Rig:
//! `cubenet_tests::l7` (as `tests/tests/l7_e2e.rs`, which asserts the behaviour). Each case:
//! 8 keep-alive HTTP/1.1 clients for 5 s after a 1 s warm-up; req/s and p99 latency. Reported,
//! never asserted.

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    agent_upgrade::KernelGuest,
    dns,
    l7::{Gateway, GatewayOptions, HttpsLoad, World, https_load},
    topology::WORLD_IP,
};

use crate::report::Row;

const NAME: &str = "api.bench.l7.test";
const ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const CONNS: usize = 8;
const DURATION: Duration = Duration::from_secs(5);
const FULL: &str = "https full path (cube-egress)";
const DIRECT: &str = "https direct (snat)";

fn ensure(a: &AgentUnderTest, id: &str, ctx: pb::CubeVsContext) -> (pb::EnsureNetworkResponse, KernelGuest) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let r = rt
        .block_on(async {
            let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.expect("connect agent");
            c.ensure_network(pb::EnsureNetworkRequest {
                sandbox_id: id.into(),
                cubevs_context: Some(ctx),
                ..Default::default()
            })
            .await
        })
        .expect("EnsureNetwork")
        .into_inner();
    let ifc = r.interfaces[0].clone();
    let (reply, fd) = tap_fd(&a.tap_socket(), &ifc.name, id);
    assert_eq!(reply["errCode"], "0", "{reply}");
    let g = KernelGuest::new(fd.expect("TAP fd"), &ifc.mac_address, &ifc.ip_cidrs[0], &ifc.gateway, ifc.mtu as u32);
    (r, g)
}

fn l7_context() -> pb::CubeVsContext {
    pb::CubeVsContext {
        allow_internet_access: Some(false),
        allow_out: vec![format!("{}/32", Ipv4Addr::from(WORLD_IP))],
        allow_fqdn: vec![pb::FqdnAllow { name: NAME.into(), ports: vec![443] }],
        rules: vec![pb::EgressRule {
            id: "api".into(),
            r#match: Some(pb::EgressMatch { host: Some(NAME.into()), ..Default::default() }),
            action: Some(pb::EgressAction {
                allow: true,
                audit: Some("metadata".into()),
                inject: vec![pb::EgressInject {
                    header: "Authorization".into(),
                    secret: "sk-bench-l7".into(),
                    format: Some("Bearer ${SECRET}".into()),
                }],
                inject_plain_http: false,
            }),
        }],
        ..Default::default()
    }
}

/// p99 of `v` in ms (sorted in place).
fn p99_ms(v: &mut [u64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    v[((v.len() * 99).div_ceil(100)).saturating_sub(1)] as f64 / 1000.0
}

fn measure(label: &str, f: impl Fn(Duration) -> HttpsLoad) -> (f64, f64) {
    let _ = f(Duration::from_secs(1));
    let mut r = f(DURATION);
    let rps = r.ok as f64 / r.elapsed.as_secs_f64();
    let p99 = p99_ms(&mut r.latencies_us);
    eprintln!(
        "l7: {label}: {} ok, {} failed, {rps:.0} req/s, p99 {p99:.2} ms; first errors {:?}",
        r.ok, r.failed, r.errors
    );
    (rps, p99)
}

/// Runs both cases and returns four rows (req/s and p99 per case, the full path's with the
/// direct path as baseline).
pub fn run() -> Vec<Row> {
    let mut a = AgentUnderTest::prepare("bench-l7", 2, "");
    a.in_dataplane = true;
    a.topo.add_world_address(ADDR.octets(), 24);
    let world = World::start(&a.topo.world, Ipv4Addr::from(WORLD_IP), &[(NAME, ADDR)], &[ADDR]).expect("world servers");
    a.start();
    let (r, l7) = ensure(&a, "sb-bench-l7", l7_context());
    let sandbox_ip = r.persist_metadata["sandbox_ip"].clone();
    let direct_ctx = pb::CubeVsContext { allow_internet_access: Some(true), ..Default::default() };
    let (_, direct) = ensure(&a, "sb-bench-direct", direct_ctx);
    let dir = std::env::temp_dir().join(format!("cubenet-bench-l7-{}", std::process::id()));
    let gw = Gateway::start(&a.topo.node, &dir, &world.ca.pem, &GatewayOptions::for_agent(None)).expect("gateway");
    // The L7 guest resolves the name (CubeVS learns the address) before connecting.
    let learned = l7
        .ns
        .run(|| -> std::io::Result<usize> {
            let u = std::net::UdpSocket::bind("0.0.0.0:0")?;
            u.set_read_timeout(Some(Duration::from_secs(2)))?;
            u.send_to(&dns::query(0x4c37, NAME), SocketAddr::from((WORLD_IP, 53)))?;
            u.recv(&mut [0u8; 512])
        })
        .expect("DNS answer");
    eprintln!("l7: sandbox {sandbox_ip} resolved {NAME} ({learned} bytes)");
    let target = SocketAddr::from((ADDR, 443));
    let (full_rps, full_p99) = measure(FULL, |d| https_load(&l7.ns, &gw.ca_pem, NAME, target, "/bench", CONNS, d));
    let (direct_rps, direct_p99) =
        measure(DIRECT, |d| https_load(&direct.ns, &world.ca.pem, NAME, target, "/bench", CONNS, d));
    drop(gw);
    let row = |case: &str, value: f64, unit: &str, baseline: Option<(String, f64)>| Row {
        bench: "l7".into(),
        case: case.into(),
        value,
        spread: (value, value),
        unit: unit.into(),
        baseline,
        target: None,
    };
    vec![
        row(FULL, full_rps, "req/s", Some((DIRECT.into(), direct_rps))),
        row(DIRECT, direct_rps, "req/s", None),
        row(FULL, full_p99, "ms p99", Some((DIRECT.into(), direct_p99))),
        row(DIRECT, direct_p99, "ms p99", None),
    ]
}
