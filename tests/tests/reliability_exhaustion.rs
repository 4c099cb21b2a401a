//! Exhaustion (issue 14): the session maps, the SNAT port range and the agent's host ports and
//! policy capacity driven to their limits. Each test checks that the limit answers a clear error
//! (gRPC) or a counted drop (datapath), that what other sandboxes already have keeps working,
//! and that everything works again once the load falls (the reaper expires the flood, or the
//! flooding sandbox is released).
//!
//! A flooding sandbox stops at its live-session budget (`MapLimits::sessions_per_sandbox`,
//! capped at half of the session maps; decision Q1), so the other sandboxes' new flows must
//! still be forwarded, toward any endpoint (asserted).
//!
//! Prints one `RELIABILITY {json}` line per test (read by `cargo xtask reliability`).

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    frames::udp,
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX},
    topology::WORLD_IP,
};
use cubevs::{
    EgressPolicy, MapLimits, SandboxEntry, prog,
    reaper::{self, Timeouts},
    testrun::{TC_ACT_REDIRECT, TC_ACT_SHOT},
};
use cubevs_common::counter;
use tonic::Code;

/// The second sandbox of the rig tests.
const B_IFINDEX: u32 = 101;

fn rig_with_b(sessions: u32) -> Rig {
    let r = Rig::with_limits(MapLimits { sessions, ..Default::default() });
    r.maps
        .sandboxes
        .register(&SandboxEntry { ifindex: B_IFINDEX, ip: Ipv4Addr::new(192, 168, 0, 4), version: 3, id: "b".into() })
        .expect("register b");
    let open = EgressPolicy { allow_internet_access: true, ..Default::default() };
    r.maps.policy.replace(B_IFINDEX, &open).expect("policy b");
    r.maps.policy.replace(SB_IFINDEX, &open).expect("policy a");
    r
}

/// A guest UDP datagram to the world (`dport` at `WORLD_IP`).
fn guest_udp(sport: u16, dport: u16) -> Vec<u8> {
    udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, sport, dport, b"q")
}

fn counter(r: &Rig, idx: u32) -> u64 {
    r.maps.counters.get(idx).expect("counter")
}

/// Runs `from_cube` on `ifindex` for every frame; returns how many were redirected.
fn flood(r: &Rig, ifindex: u32, n: usize, frame: impl Fn(usize) -> Vec<u8> + Send + 'static) -> u64 {
    let before = counter(r, counter::CUBE_NEW_SESSION);
    r.run_many(prog::FROM_CUBE, ifindex, n, frame);
    counter(r, counter::CUBE_NEW_SESSION) - before
}

fn report(case: &str, inputs: u64, violations: &[String], start: Instant, extra: serde_json::Value) {
    let mut r = serde_json::json!({
        "case": case,
        "inputs": inputs,
        "violations": if violations.is_empty() { serde_json::json!({}) } else { serde_json::json!({"limits": violations.len()}) },
        "secs": start.elapsed().as_secs_f64(),
    });
    if let (Some(r), Some(e)) = (r.as_object_mut(), extra.as_object()) {
        r.extend(e.clone());
    }
    println!("RELIABILITY {r}");
}

/// One sandbox opens more flows than the session maps hold: it stops at its budget (the
/// default, capped at half of the maps), the others keep opening flows.
#[test]
fn session_maps_full() {
    if !require_root("reliability_exhaustion session_maps_full") {
        return;
    }
    const CAP: u32 = 1024;
    const FLOOD: usize = CAP as usize + 500;
    let start = Instant::now();
    let r = rig_with_b(CAP);
    let budget = MapLimits { sessions: CAP, ..Default::default() }.session_budget().expect("budget");
    let mut v = Vec::new();
    // B's flow exists before the flood and has been answered (UDP replied: 180 s timeout).
    let b_flow = guest_udp(7000, 53);
    assert_eq!(r.run(prog::FROM_CUBE, b_flow.clone(), B_IFINDEX).verdict, TC_ACT_REDIRECT);
    let s = r.maps.sessions.list().unwrap()[0].clone();
    let reply = udp(r.world_mac, r.up_mac, WORLD_IP, cubenet_tests::topology::NODE_IP, 53, s.snat_port, b"a");
    assert_eq!(r.world(reply).verdict, TC_ACT_REDIRECT, "B's reply");

    // A floods: every new flow over its budget is dropped and counted; the maps never fill.
    let drops0 = counter(&r, counter::CUBE_DROP_SESSION_QUOTA);
    let made = flood(&r, SB_IFINDEX, FLOOD, |i| guest_udp(10_000 + i as u16, 53));
    let dropped = counter(&r, counter::CUBE_DROP_SESSION_QUOTA) - drops0;
    let (egress, ingress) = r.maps.sessions.counts();
    if made + dropped != FLOOD as u64 {
        v.push(format!("{made} sessions + {dropped} counted quota drops for {FLOOD} new flows"));
    }
    if made != u64::from(budget) || egress != budget as usize + 1 || ingress != budget as usize + 1 {
        v.push(format!("{made} sessions made (budget {budget}), maps hold ({egress}, {ingress}) of {CAP}"));
    }
    let a_stats = r.maps.sandbox_stats.get(SB_IFINDEX).expect("stats").expect("A's entry");
    if a_stats.drops["session_quota"] != dropped {
        v.push(format!("A's session_quota drops {} != {dropped}", a_stats.drops["session_quota"]));
    }
    // B's existing flow is unaffected.
    if r.run(prog::FROM_CUBE, b_flow.clone(), B_IFINDEX).verdict != TC_ACT_REDIRECT {
        v.push("B's established flow dropped while A floods".into());
    }
    // B's new flows while A is at its budget: forwarded.
    let b_new_while_full = r.run(prog::FROM_CUBE, guest_udp(7001, 53), B_IFINDEX).verdict;
    if b_new_while_full != TC_ACT_REDIRECT {
        v.push("B's new flow dropped while A floods".into());
    }

    // Load falls: the reaper expires the unreplied flood (30 s), B's replied flow stays.
    let now = reaper::monotonic_ns() + Duration::from_secs(31).as_nanos() as u64;
    let swept = reaper::sweep(&r.maps.sessions, &Timeouts::default(), now).expect("sweep");
    let left = r.maps.sessions.list().unwrap();
    if !left.iter().any(|s| s.guest_port == 7000) {
        v.push("the sweep removed B's replied flow".into());
    }
    for (who, ifindex, sport) in [("A", SB_IFINDEX, 20_000), ("B", B_IFINDEX, 7002)] {
        if r.run(prog::FROM_CUBE, guest_udp(sport, 53), ifindex).verdict != TC_ACT_REDIRECT {
            v.push(format!("{who}'s new flow dropped after the flood expired"));
        }
    }
    report(
        "exhaust-session-maps",
        FLOOD as u64,
        &v,
        start,
        serde_json::json!({
            "capacity": CAP, "budget": budget, "sessions_made": made, "counted_drops": dropped,
            "other_sandbox_new_flow_while_full": if b_new_while_full == TC_ACT_SHOT { "dropped" } else { "forwarded" },
            "swept": format!("{swept:?}"), "left_after_sweep": left.len(),
        }),
    );
    assert!(v.is_empty(), "{}", v.join("\n"));
}

/// One sandbox tries to use up the SNAT ports toward one remote endpoint (35,536 per
/// endpoint): its budget (16,384 by default, below half of them) stops it, and another
/// sandbox's new flows to that endpoint still find a port.
#[test]
fn snat_ports_of_one_endpoint_exhausted() {
    if !require_root("reliability_exhaustion snat_ports_of_one_endpoint_exhausted") {
        return;
    }
    const FLOOD: usize = 38_000;
    const B_FLOWS: u16 = 64;
    let start = Instant::now();
    let r = rig_with_b(1 << 16);
    let budget = MapLimits { sessions: 1 << 16, ..Default::default() }.session_budget().expect("budget");
    let mut v = Vec::new();
    let quota0 = counter(&r, counter::CUBE_DROP_SESSION_QUOTA);
    let snat0 = counter(&r, counter::CUBE_DROP_NO_SNAT);
    // Guest ports 1..=38000 to WORLD_IP:53: more flows than SNAT ports for that endpoint.
    let made = flood(&r, SB_IFINDEX, FLOOD, |i| guest_udp(1 + i as u16, 53));
    let dropped = counter(&r, counter::CUBE_DROP_SESSION_QUOTA) - quota0;
    let no_port = counter(&r, counter::CUBE_DROP_NO_SNAT) - snat0;
    let span = u64::from(cubevs_common::snat::PORT_SPAN);
    if made != u64::from(budget) || made + dropped != FLOOD as u64 || no_port != 0 {
        v.push(format!(
            "{made} sessions (budget {budget}) + {dropped} quota drops + {no_port} no-port drops for {FLOOD} flows, \
             {span} ports"
        ));
    }
    // Other endpoints have their own port space: B still opens flows there.
    if r.run(prog::FROM_CUBE, guest_udp(7000, 54), B_IFINDEX).verdict != TC_ACT_REDIRECT {
        v.push("B's new flow to another endpoint dropped".into());
    }
    // B toward the endpoint A holds ports of: every new flow finds a port (A holds < 50 %).
    let b_same = (0..B_FLOWS)
        .filter(|i| r.run(prog::FROM_CUBE, guest_udp(7100 + i, 53), B_IFINDEX).verdict == TC_ACT_REDIRECT)
        .count();
    if b_same != B_FLOWS as usize {
        v.push(format!("B opened {b_same} of {B_FLOWS} new flows to the endpoint A floods"));
    }
    // Load falls: the flood expires, A opens flows to the endpoint again.
    let now = reaper::monotonic_ns() + Duration::from_secs(31).as_nanos() as u64;
    reaper::sweep(&r.maps.sessions, &Timeouts::default(), now).expect("sweep");
    if r.run(prog::FROM_CUBE, guest_udp(50_001, 53), SB_IFINDEX).verdict != TC_ACT_REDIRECT {
        v.push("A's new flow to the endpoint dropped after the flood expired".into());
    }
    report(
        "exhaust-snat-ports",
        FLOOD as u64,
        &v,
        start,
        serde_json::json!({
            "ports_per_endpoint": span, "budget": budget, "sessions_made": made, "counted_drops": dropped,
            "other_sandbox_same_endpoint": format!("{b_same}/{B_FLOWS}"),
        }),
    );
    assert!(v.is_empty(), "{}", v.join("\n"));
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn ensure_req(id: &str, ports: usize, allow: &[String]) -> pb::EnsureNetworkRequest {
    pb::EnsureNetworkRequest {
        sandbox_id: id.into(),
        port_mappings: (0..ports)
            .map(|i| pb::PortMapping {
                protocol: "tcp".into(),
                container_port: 8080 + i as u32,
                host_port: 0,
                host_ip: String::new(),
            })
            .collect(),
        cubevs_context: Some(pb::CubeVsContext { allow_out: allow.to_vec(), ..Default::default() }),
        ..Default::default()
    }
}

/// The agent's host-port range and per-sandbox policy capacity driven to their limits.
#[test]
fn agent_host_ports_and_policy_capacity() {
    if !require_root("reliability_exhaustion agent_host_ports_and_policy_capacity") {
        return;
    }
    let start = Instant::now();
    // 5 host ports, 4 policy entries per sandbox.
    let mut a =
        AgentUnderTest::prepare("exhaust", 2, "host_port_range = \"20000-20004\"\npolicy_entries_per_sandbox = 4\n");
    a.start();
    let rt = rt();
    let mut c = rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).expect("connect");
    let mut v = Vec::new();
    let cidrs = |n: usize| (0..n).map(|i| format!("203.0.113.{}/32", i + 1)).collect::<Vec<_>>();
    let mut inputs = 0u64;

    // Host ports: 2 + 2 fit, the third sandbox's 2 do not.
    for id in ["hp-1", "hp-2"] {
        inputs += 1;
        rt.block_on(c.ensure_network(ensure_req(id, 2, &cidrs(4)))).unwrap_or_else(|e| panic!("{id}: {e:?}"));
    }
    inputs += 1;
    match rt.block_on(c.ensure_network(ensure_req("hp-3", 2, &[]))) {
        Ok(_) => v.push("hp-3 got 2 host ports from a range with 1 left".into()),
        Err(e) if e.code() != Code::ResourceExhausted || !e.message().contains("20000-20004") => {
            v.push(format!("hp-3: {:?} {:?} (want RESOURCE_EXHAUSTED naming the range)", e.code(), e.message()));
        }
        Err(_) => {}
    }
    let pms = a.http_json("/v1/dataplane/portmaps")["portMappings"].as_array().unwrap().len();
    if pms != 4 {
        v.push(format!("{pms} port maps after the refused Ensure, want 4"));
    }
    // The last free port is still usable (the failed call returned the one it took).
    inputs += 1;
    if let Err(e) = rt.block_on(c.ensure_network(ensure_req("hp-4", 1, &[]))) {
        v.push(format!("hp-4 (1 port, 1 free): {e:?}"));
    }
    // Recovery: release one, the refused request now fits.
    rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "hp-1".into(), ..Default::default() }))
        .expect("release hp-1");
    inputs += 1;
    if let Err(e) = rt.block_on(c.ensure_network(ensure_req("hp-3", 2, &[]))) {
        v.push(format!("hp-3 after a release: {e:?}"));
    }

    // Policy capacity: 5 entries are refused, naming the field and the limit; a sandbox at
    // its limit does not keep another from reaching its own.
    inputs += 1;
    match rt.block_on(c.ensure_network(ensure_req("pol-5", 0, &cidrs(5)))) {
        Ok(_) => v.push("pol-5: 5 allow_out entries accepted with a limit of 4".into()),
        Err(e) if e.code() != Code::InvalidArgument || !e.message().contains("cubevs_context.allow_out") => {
            v.push(format!("pol-5: {:?} {:?}", e.code(), e.message()));
        }
        Err(_) => {}
    }
    inputs += 1;
    let reconcile = |allow: Vec<String>| pb::ReconcileNetworkRequest {
        sandbox_id: "hp-2".into(),
        cubevs_context: Some(pb::CubeVsContext { allow_out: allow, ..Default::default() }),
        ..Default::default()
    };
    match rt.block_on(c.reconcile_network(reconcile(cidrs(5)))) {
        Ok(_) => v.push("reconcile hp-2 with 5 entries accepted".into()),
        Err(e) if e.code() != Code::InvalidArgument => v.push(format!("reconcile 5: {:?} {:?}", e.code(), e.message())),
        Err(_) => {}
    }
    // Policy replaces at the limit, many times over (two generations live during each):
    // never a capacity error, and the trie holds exactly the live entries afterwards.
    for i in 0..50 {
        inputs += 1;
        let allow: Vec<String> = (0..4).map(|j| format!("10.{i}.{j}.0/24")).collect();
        if let Err(e) = rt.block_on(c.reconcile_network(reconcile(allow))) {
            v.push(format!("reconcile #{i} at the limit: {e:?}"));
            break;
        }
    }
    let pol = a.http_json("/v1/dataplane/policies");
    let hp2 = pol["policies"].as_array().unwrap().iter().find(|p| p["sandboxID"] == "hp-2").cloned();
    let want: Vec<String> = (0..4).map(|j| format!("10.49.{j}.0/24")).collect();
    if hp2.as_ref().map(|p| p["policy"]["allow"].clone()) != Some(serde_json::json!(want)) {
        v.push(format!("hp-2's policy after 50 replaces: {hp2:?}"));
    }
    // Everyone is still served.
    let nets = rt.block_on(c.list_networks(pb::ListNetworksRequest::default())).unwrap().into_inner().networks;
    for n in &nets {
        let (reply, fd) = tap_fd(&a.tap_socket(), &n.tap_name, &n.sandbox_id);
        if reply["errCode"] != "0" || fd.is_none() {
            v.push(format!("{} not served: {reply}", n.sandbox_id));
        }
    }
    report("exhaust-agent-ports-policy", inputs, &v, start, serde_json::json!({"networks": nets.len()}));
    assert!(v.is_empty(), "{}\nlog tail:\n{}", v.join("\n"), {
        let log = a.log();
        log[log.len().saturating_sub(3000)..].to_string()
    });
}
