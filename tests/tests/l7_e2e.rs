//! Issue 11 end to end: a sandbox reaches the internet by name and through CubeEgress, with
//! real packets all the way (root only).
//!
//! ```text
//!  guest ns (kernel stack, curl, busybox nslookup)
//!    └─ relay (plays the VMM) ─ agent TAP z192.168.0.x ─ CubeVS from_cube
//!         ├─ UDP 53 to 198.51.100.1 (allow_out): SNAT → world DNS; the reply is learned
//!         └─ TCP 80/443 to a learned address of an L7 name: mark 0xCE01/0xCE02, source = mvm IP,
//!            redirect → cube-dev ingress → TPROXY (cube-egress-net.sh) → cube-egress (node ns)
//!               └─ upstream leg from the node address → world HTTP/HTTPS servers (record headers)
//!    replies: cube-egress → cube-dev egress (from_envoy) → TAP → guest
//! ```
//!
//! The agent runs in the dataplane (node) namespace with the gateway, so its rule pushes and
//! the gateway's bootstrap from the agent's dump go over that namespace's loopback (L7).

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    agent_upgrade::KernelGuest,
    l7::{Gateway, GatewayOptions, World},
    netns::TestNetns,
    require_root,
    topology::{NODE_IP, WORLD_IP},
};
use serde_json::Value;

/// The name the sandbox may reach, through CubeEgress.
const API: &str = "api.l7.test";
/// A name the world resolves but the sandbox's policy does not allow.
const OTHER: &str = "other.l7.test";
const API_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const OTHER_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
/// The credential CubeEgress injects; the guest never has it.
const SECRET: &str = "sk-l7e2e-SECRET-4b9d0e7a11";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// The sandbox's context: DNS server reachable (allow_out), no other internet, `API` by DNS
/// learning on 80/443, and two L7 rules for it: deny `/admin*`, allow the rest injecting
/// `Authorization: Bearer <SECRET>`.
fn l7_context() -> pb::CubeVsContext {
    pb::CubeVsContext {
        allow_internet_access: Some(false),
        allow_out: vec![format!("{}/32", Ipv4Addr::from(WORLD_IP))],
        allow_fqdn: vec![pb::FqdnAllow { name: API.into(), ports: vec![80, 443] }],
        rules: vec![
            pb::EgressRule {
                id: "deny-admin".into(),
                r#match: Some(pb::EgressMatch {
                    host: Some(API.into()),
                    path: Some("/admin*".into()),
                    ..Default::default()
                }),
                action: Some(pb::EgressAction { allow: false, ..Default::default() }),
            },
            pb::EgressRule {
                id: "api".into(),
                r#match: Some(pb::EgressMatch { host: Some(API.into()), ..Default::default() }),
                action: Some(pb::EgressAction {
                    allow: true,
                    audit: Some("metadata".into()),
                    inject: vec![pb::EgressInject {
                        header: "Authorization".into(),
                        secret: SECRET.into(),
                        format: Some("Bearer ${SECRET}".into()),
                    }],
                    inject_plain_http: false,
                }),
            },
        ],
        ..Default::default()
    }
}

/// `busybox nslookup -type=a name server` in the guest: the first answer address.
fn nslookup(g: &TestNetns, name: &str) -> Result<Ipv4Addr, String> {
    let o = g.exec("busybox", &["nslookup", "-type=a", name, &Ipv4Addr::from(WORLD_IP).to_string()]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    let after_name = out.split_once("\nName:").map(|(_, r)| r).unwrap_or("");
    after_name
        .lines()
        .find_map(|l| l.strip_prefix("Address:").and_then(|a| a.trim().parse().ok()))
        .ok_or_else(|| format!("nslookup {name}: {}: {out}", o.status))
}

/// What curl in the guest got: exit code, HTTP status (0 when none), body.
#[derive(Debug)]
struct Curl {
    exit: i32,
    status: u16,
    body: String,
    stderr: String,
}

/// curl's exit 7 (no connection) at once: the SYN got a RST (a dropped SYN would end in exit
/// 28 at `--max-time`).
fn refused(c: &Curl) -> bool {
    c.exit == 7 && (c.stderr.contains("Couldn't connect") || c.stderr.contains("Connection refused"))
}

/// `curl` with default options in the guest, the name pinned to the address the guest
/// resolved (`--resolve`: curl's resolver reads the host's resolv.conf), trusting only the
/// gateway CA for HTTPS.
fn curl(g: &TestNetns, url: &str, resolve: &str, cacert: &std::path::Path, extra: &[&str]) -> Curl {
    let mut args = vec!["-sS", "--max-time", "15", "--resolve", resolve, "--cacert", cacert.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["-w", "\n%{http_code}", url]);
    let o = g.exec("curl", &args);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
    Curl {
        exit: o.status.code().unwrap_or(-1),
        status: code.trim().parse().unwrap_or(0),
        body: body.to_string(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// The datapath counter `program`/`reason` from the agent's `/metrics`
/// (`cubenet_datapath_packets_total`), 0 when absent.
fn metric(a: &AgentUnderTest, program: &str, reason: &str) -> u64 {
    let (_, body) = a.http("/metrics").expect("/metrics");
    let series = format!(r#"cubenet_datapath_packets_total{{program="{program}",reason="{reason}"}} "#);
    body.lines().find_map(|l| l.strip_prefix(&series)?.trim().parse::<f64>().ok()).unwrap_or(0.0) as u64
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn audit_for<'a>(recs: &'a [Value], event: &str, path: &str) -> Vec<&'a Value> {
    recs.iter().filter(|r| r["event"] == event && r["http"]["path"].as_str() == Some(path)).collect()
}

#[test]
fn l7_guest_reaches_the_world_by_name_through_cube_egress() {
    if !require_root("l7_guest_reaches_the_world_by_name_through_cube_egress") {
        return;
    }
    let mut a = AgentUnderTest::prepare("l7e2e", 1, "cube_egress_admin_url = \"http://127.0.0.1:9091\"\n");
    a.in_dataplane = true;
    a.topo.add_world_address(API_IP.octets(), 24);
    a.topo.world.ip(&["addr", "add", &format!("{OTHER_IP}/24"), "dev", "wp0"]);
    let world =
        World::start(&a.topo.world, Ipv4Addr::from(WORLD_IP), &[(API, API_IP), (OTHER, OTHER_IP)], &[API_IP, OTHER_IP])
            .expect("world servers");
    a.start();

    // Ensure while no gateway runs: the rules reach it later through the agent's dump.
    let r = rt()
        .block_on(async {
            let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
            c.ensure_network(pb::EnsureNetworkRequest {
                sandbox_id: "sb-l7".into(),
                cubevs_context: Some(l7_context()),
                ..Default::default()
            })
            .await
        })
        .expect("EnsureNetwork")
        .into_inner();
    let sandbox_ip = r.persist_metadata["sandbox_ip"].clone();
    let ifc = &r.interfaces[0];
    let (reply, fd) = tap_fd(&a.tap_socket(), &ifc.name, &r.sandbox_id);
    assert_eq!(reply["errCode"], "0", "{reply}");
    let guest = KernelGuest::new(fd.expect("TAP fd"), &ifc.mac_address, &ifc.ip_cidrs[0], &ifc.gateway, ifc.mtu as u32);
    let g = &guest.ns;

    let gw_dir = std::env::temp_dir().join(format!("cubenet-l7e2e-{}", std::process::id()));
    let gw = Gateway::start(&a.topo.node, &gw_dir, &world.ca.pem, &GatewayOptions::for_agent(None))
        .unwrap_or_else(|e| panic!("gateway: {e}"));
    let health = gw.health(&a.topo.node).expect("gateway health");
    assert_eq!(health["bootstrap_status"], "ready", "bootstrapped from the agent's dump: {health}");
    assert_eq!(health["policy_count"], 1, "{health}");
    let (code, pol) = gw.admin_get(&a.topo.node, &format!("/policies/{sandbox_ip}"));
    assert_eq!(code, 200, "{pol}");
    assert!(!pol.contains(SECRET), "the admin API never shows the secret: {pol}");
    let cacert = gw.ca_file();

    // Before the name is resolved its address is not allowed (allow_internet_access=false).
    let early = curl(g, &format!("https://{API}/v1/early"), &format!("{API}:443:{API_IP}"), &cacert, &[]);
    assert_eq!((early.exit, early.status), (7, 0), "refused before DNS: {early:?}");
    assert!(refused(&early), "a RST, not a timeout: {early:?}");

    // DNS through the datapath; the answer is learned.
    let learned_before = metric(&a, "from_world", "dns_learned");
    let ip = nslookup(g, API).expect("the guest resolves the allowed name");
    assert_eq!(ip, API_IP);
    assert!(world.dns.peers().iter().any(|p| p.ip() == Ipv4Addr::from(NODE_IP)), "the DNS query left SNATed");
    wait_for("the learned entry", Duration::from_secs(5), || metric(&a, "from_world", "dns_learned") > learned_before);

    // HTTPS to the allowed name: intercepted (curl trusts only the gateway CA), answered by the
    // world server, which saw the injected credential; the guest never sent it.
    let resolve = format!("{API}:443:{ip}");
    let ok = curl(g, &format!("https://{API}/v1/models"), &resolve, &cacert, &[]);
    assert_eq!((ok.exit, ok.status), (0, 200), "{ok:?}\ngateway log:\n{}", gw.log());
    assert!(ok.body.starts_with("world https /v1/models from 198.51.100.2:"), "{ok:?}");
    let seen = world.requests_to("/v1/models");
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].header("authorization"), Some(format!("Bearer {SECRET}").as_str()), "{seen:?}");
    assert_eq!(seen[0].local.ip(), API_IP);
    assert_eq!(seen[0].peer.ip(), Ipv4Addr::from(NODE_IP), "the upstream leg leaves from the node");
    for h in ["x-forwarded-for", "x-real-ip", "forwarded"] {
        assert!(seen[0].header(h).is_none(), "{h} leaked: {seen:?}");
    }
    // A guest that forges the header gets it replaced, never forwarded.
    let forged =
        curl(g, &format!("https://{API}/v1/forged"), &resolve, &cacert, &["-H", "Authorization: Bearer guest"]);
    assert_eq!(forged.status, 200, "{forged:?}");
    let seen = world.requests_to("/v1/forged");
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].header("authorization"), Some(format!("Bearer {SECRET}").as_str()));

    // A denied path: 403 from the gateway, never seen by the world.
    let denied = curl(g, &format!("https://{API}/admin/keys"), &resolve, &cacert, &[]);
    assert_eq!(denied.status, 403, "{denied:?}");
    assert!(denied.body.contains("rule_deny"), "{denied:?}");
    assert!(world.requests_to("/admin").is_empty(), "{:?}", world.requests());

    // Plain HTTP to the name: the rule has no scheme, so port 80 is steered to CubeEgress too;
    // the gateway checks the destination belongs to the Host and does not inject over HTTP.
    let plain = curl(g, &format!("http://{API}/v1/plain"), &format!("{API}:80:{ip}"), &cacert, &[]);
    assert_eq!((plain.exit, plain.status), (0, 200), "{plain:?}\ngateway log:\n{}", gw.log());
    let seen = world.requests_to("/v1/plain");
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].scheme, "http");
    assert!(seen[0].header("authorization").is_none(), "no credential over plain HTTP: {seen:?}");

    // A client that shuts its write side after the request (busybox nc, as the demo's guest
    // does) still gets the answer: the gateway supports HTTP/1 half-close (regression).
    let req = format!("GET /v1/half-close HTTP/1.0\r\nHost: {API}\r\n\r\n");
    let o = g.exec("sh", &["-c", &format!("printf '{}' | busybox nc -w 10 {ip} 80", req.replace("\r\n", "\\r\\n"))]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200"), "half-closed request: {o:?}");
    assert_eq!(world.requests_to("/v1/half-close").len(), 1);

    // Another name resolves (the DNS server is allowed) but its address is refused.
    let other = nslookup(g, OTHER).expect("the other name resolves");
    assert_eq!(other, OTHER_IP);
    for (url, port) in [(format!("https://{OTHER}/x"), 443), (format!("http://{OTHER}/x"), 80)] {
        let c = curl(g, &url, &format!("{OTHER}:{port}:{other}"), &cacert, &[]);
        assert_eq!((c.exit, c.status), (7, 0), "{url} refused: {c:?}");
        assert!(refused(&c), "{url}: a RST, not a timeout: {c:?}");
    }
    assert!(world.requests().iter().all(|r| r.local.ip() != OTHER_IP), "{:?}", world.requests());

    // The datapath steered the flows (mark + redirect), and the gateway saw the sandbox's own
    // address as the client (TPROXY keeps it).
    assert!(metric(&a, "from_cube", "l7_steered") >= 4, "steered counter");
    let audit_text = gw.audit_text();
    assert!(!audit_text.contains(SECRET), "the audit never holds the secret");
    let recs = gw.audit_records().expect("audit JSON lines");
    let models = audit_for(&recs, "http_request", "/v1/models");
    assert_eq!(models.len(), 1, "{audit_text}");
    let m = models[0];
    assert_eq!(m["sandbox"]["src_ip"], sandbox_ip.as_str(), "{m}");
    assert_eq!(m["conn"]["original_dst_ip"], API_IP.to_string(), "{m}");
    assert_eq!(m["conn"]["original_dst_port"], 443, "{m}");
    assert_eq!(m["tls"]["sni"], API, "{m}");
    assert!(m["redacted_request_headers"].get("authorization").is_none(), "the guest sent no credential: {m}");
    assert_eq!(m["policy"]["decision"], "allow", "{m}");
    assert_eq!(m["policy"]["matched_rule"], "api", "{m}");
    assert_eq!(m["credentials"]["injected"], serde_json::json!(["authorization"]), "{m}");
    assert!(m["credentials"]["secret_ids"][0].as_str().is_some_and(|f| f.starts_with("fp-")), "{m}");
    let deny = audit_for(&recs, "http_request", "/admin/keys");
    assert_eq!(deny.len(), 1, "{audit_text}");
    assert_eq!(
        (deny[0]["http"]["status"].as_u64(), deny[0]["policy"]["matched_rule"].as_str()),
        (Some(403), Some("deny-admin"))
    );
    let plain_rec = audit_for(&recs, "http_request", "/v1/plain");
    assert_eq!(plain_rec.len(), 1, "{audit_text}");
    assert_eq!(plain_rec[0]["conn"]["original_dst_port"], 80);
    assert_eq!(plain_rec[0]["sandbox"]["src_ip"], sandbox_ip.as_str());
    for rec in &recs {
        if let Some(ip) = rec["sandbox"]["src_ip"].as_str() {
            assert_eq!(ip, sandbox_ip, "every record names the sandbox: {rec}");
        }
    }
    drop(gw);
    drop(guest);
}
