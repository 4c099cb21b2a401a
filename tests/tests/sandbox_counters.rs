//! Per-sandbox datapath counters end to end (issue 13 "Operations"): the agent started by its
//! script, a guest on a TAP fd it handed out sending real frames through the TAP into
//! `from_cube`, the world answering through `from_world`; the counters read through
//! `/v1/dataplane/counters`, `cubenet-cli sandbox <id>` (table and `--json`) and `/metrics`.
//!
//! Exact figures: packets and L2 bytes each way equal what the guest wrote and read; policy
//! and spoof drops equal the frames sent for them. Attacks: (1) the TAP's next owner (sandbox
//! B on A's reused TAP) starts at zero, and the world's replies to A's old flow, sent after B
//! took the TAP, are never charged to B; (2) a released sandbox's series leave `/metrics` and
//! the CLI refuses it; an agent restart (`kill -9`, recovery re-registers) keeps the counts.

use std::{net::UdpSocket, time::Duration};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, HEALTH, workspace_bin},
    frames,
    guest::TapGuest,
    packet::{self, GATEWAY_MAC, GUEST_MAC, Transport},
    require_root,
    topology::{NODE_IP, WORLD_IP},
};

/// In the world namespace and denied to sandbox A by its policy.
const DENIED: [u8; 4] = [203, 0, 113, 10];

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn ensure(a: &AgentUnderTest, id: &str, deny: &[&str]) -> pb::EnsureNetworkResponse {
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: id.into(),
            cubevs_context: Some(pb::CubeVsContext {
                allow_internet_access: Some(true),
                deny_out: deny.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("ensure")
        .into_inner()
    })
}

/// Pings world once; returns (request frame length, reply frame length).
fn ping(g: &TapGuest, seq: u16) -> (u64, u64) {
    let req = packet::icmp_echo_request(WORLD_IP, 0x77, seq);
    g.send(&req);
    let reply = g
        .recv_matching(Duration::from_secs(3), |f| {
            packet::parse_ipv4(f).is_some_and(|s| s.transport == Transport::EchoReply(0x77, seq))
        })
        .unwrap_or_else(|| panic!("no echo reply {seq}"));
    (req.len() as u64, reply.len() as u64)
}

/// `cubenet-cli [--json] sandbox ID` in the agent namespace: (exit ok, stdout, stderr).
fn cli(a: &AgentUnderTest, json: bool, id: &str) -> (bool, String, String) {
    let mut cmd = a.ns.command(workspace_bin("cubenet-cli").to_str().unwrap());
    cmd.args(["--http", HEALTH]);
    if json {
        cmd.arg("--json");
    }
    let o = cmd.args(["sandbox", id]).output().expect("run cubenet-cli");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `cubenet-cli --json sessions --sandbox ID` in the agent namespace: the sessions it lists.
fn sessions_cli(a: &AgentUnderTest, id: &str) -> Vec<serde_json::Value> {
    let o =
        a.ns.command(workspace_bin("cubenet-cli").to_str().unwrap())
            .args(["--http", HEALTH, "--json", "sessions", "--sandbox", id])
            .output()
            .expect("run cubenet-cli");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "cubenet-cli sessions --sandbox {id}: {}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("cli json: {e}: {out}"));
    j["sessions"].as_array().cloned().unwrap_or_default()
}

fn counters(a: &AgentUnderTest, id: &str) -> serde_json::Value {
    let (ok, out, err) = cli(a, true, id);
    assert!(ok, "cubenet-cli sandbox {id}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("cli json: {e}: {out}"))
}

fn metric(text: &str, series: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

fn global(a: &AgentUnderTest, reason: &str) -> u64 {
    let (_, m) = a.http("/metrics").expect("metrics");
    metric(&m, &format!(r#"cubenet_datapath_packets_total{{program="from_world",reason="{reason}"}}"#)).unwrap_or(0)
}

#[test]
fn sandbox_counters_exact_reset_on_reuse_and_bounded_series() {
    const T: &str = "sandbox_counters_exact_reset_on_reuse_and_bounded_series";
    if !require_root(T) {
        return;
    }
    // One warm TAP: B gets A's TAP back after A's Release.
    let mut a = AgentUnderTest::prepare("sbcount", 1, "");
    a.start();

    // --- sandbox A: exact traffic each way, drops by reason --------------------------------
    let ra = ensure(&a, "sb-a", &["203.0.113.0/24"]);
    let ga = a.guest(&ra);
    let (mut out_b, mut in_b) = (0, 0);
    for seq in 1..=3 {
        let (o, i) = ping(&ga, seq);
        out_b += o;
        in_b += i;
    }
    // A UDP flow to world whose replies will later come back after A is gone.
    let world = a.topo.world.run(|| UdpSocket::bind(std::net::SocketAddr::from((WORLD_IP, 7000))).unwrap());
    world.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let probe = packet::udp(WORLD_IP, 4000, 7000, b"hello");
    ga.send(&probe);
    out_b += probe.len() as u64;
    let mut buf = [0u8; 64];
    let (_, a_snat) = world.recv_from(&mut buf).expect("A's UDP did not reach world");
    assert_eq!(a_snat.ip(), std::net::IpAddr::from(NODE_IP));
    // Policy: two datagrams to a denied address; one spoofed source.
    for _ in 0..2 {
        ga.send(&packet::udp(DENIED, 4001, 53, b"denied"));
    }
    ga.send(&frames::udp(GUEST_MAC, GATEWAY_MAC, [169, 254, 68, 99], WORLD_IP, 4002, 7000, b"spoof"));

    let c = counters(&a, "sb-a");
    eprintln!("[sbcount] sb-a: {c}");
    assert_eq!(c["sandboxID"], "sb-a");
    assert_eq!(c["out"]["packets"], 4, "3 pings + 1 UDP forwarded: {c}");
    assert_eq!(c["out"]["bytes"], out_b, "{c}");
    assert_eq!(c["in"]["packets"], 3, "3 echo replies delivered: {c}");
    assert_eq!(c["in"]["bytes"], in_b, "{c}");
    assert_eq!(c["drops"]["policy"], 2, "{c}");
    assert_eq!(c["drops"]["spoof"], 1, "{c}");
    let other_drops: u64 = c["drops"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "policy" && *k != "spoof")
        .map(|(_, v)| v.as_u64().unwrap())
        .sum();
    assert_eq!(other_drops, 0, "{c}");

    // The table form names the same figures.
    let (ok, table, err) = cli(&a, false, "sb-a");
    assert!(ok, "{err}");
    eprintln!("[sbcount] cubenet-cli sandbox sb-a:\n{table}");
    let row = |first: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(first))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
    };
    assert_eq!(row("out").unwrap()[1..], [4.to_string(), out_b.to_string()]);
    assert_eq!(row("in").unwrap()[1..], [3.to_string(), in_b.to_string()]);
    assert_eq!(row("policy").unwrap()[1], "2");
    assert!(table.lines().any(|l| l.starts_with("live sessions: ") && l.ends_with(" of 16384")), "{table}");

    // /metrics: one series set for A.
    let (_, m) = a.http("/metrics").unwrap();
    assert!(m.contains("# TYPE cubenet_sandbox_packets_total counter"), "{m}");
    assert_eq!(metric(&m, r#"cubenet_sandbox_packets_total{direction="out",sandbox="sb-a"}"#), Some(4), "{m}");
    assert_eq!(metric(&m, r#"cubenet_sandbox_bytes_total{direction="in",sandbox="sb-a"}"#), Some(in_b), "{m}");
    assert_eq!(metric(&m, r#"cubenet_sandbox_drops_total{reason="policy",sandbox="sb-a"}"#), Some(2), "{m}");
    assert_eq!(metric(&m, r#"cubenet_sandbox_drops_total{reason="spoof",sandbox="sb-a"}"#), Some(1), "{m}");
    // The node-wide floor's gauges (decision Q4): one registered sandbox reserves 64 of the
    // 1,048,576 session entries (plus one per CPU), and every live session is charged.
    let ceiling = cubevs::quota::floor_ceiling(1 << 20, 1, 64, cubevs::quota::floor_margin());
    assert_eq!(metric(&m, "cubenet_sessions_node_ceiling"), Some(u64::from(ceiling)), "{m}");
    let live = a.http_json("/v1/dataplane/sessions")["sessions"].as_array().unwrap().len() as u64;
    assert!(live >= 1, "A's UDP flow is a session");
    assert_eq!(metric(&m, "cubenet_sessions_node_charged"), Some(live), "{m}");
    // `cubenet-cli sessions --sandbox sb-a`: A's sessions only, its UDP flow among them.
    let mine = sessions_cli(&a, "sb-a");
    assert!(mine.iter().any(|s| s["snat"].as_str() == Some(&a_snat.to_string())), "{mine:?}");
    let reg = a.http_json("/v1/dataplane/sandboxes");
    let a_if = reg["sandboxes"].as_array().unwrap().iter().find(|s| s["id"] == "sb-a").unwrap()["ifindex"].clone();
    assert!(mine.iter().all(|s| s["ifindex"] == a_if), "{mine:?}");
    // Its live count against `sessions_per_sandbox` (Q1): A's UDP flow is charged.
    let q = &counters(&a, "sb-a")["sessions"];
    assert_eq!(q["budget"], 16384, "{q}");
    assert!(q["live"].as_u64().is_some_and(|n| n >= 1), "{q}");
    // The tracking floor's gauges (decision Q6): 4 of each 65,536-entry map reserved for A.
    let ceiling = cubevs::quota::floor_ceiling(1 << 16, 1, 4, cubevs::quota::floor_margin());
    for map in ["dns_query_track", "frag_sessions"] {
        let series = format!(r#"cubenet_tracking_node_ceiling{{map="{map}"}}"#);
        assert_eq!(metric(&m, &series), Some(u64::from(ceiling)), "{m}");
        let series = format!(r#"cubenet_tracking_node_charged{{map="{map}"}}"#);
        assert_eq!(metric(&m, &series), Some(0), "{m}");
    }

    // An agent restart re-registers A (recovery) and keeps its counts.
    a.kill(nix::sys::signal::Signal::SIGKILL);
    a.start();
    let c2 = counters(&a, "sb-a");
    assert_eq!(
        (c2["out"].clone(), c2["in"].clone(), c2["drops"].clone()),
        (c["out"].clone(), c["in"].clone(), c["drops"].clone())
    );

    // --- Release A, B takes the same TAP -----------------------------------------------------
    drop(ga);
    a.release("sb-a");
    let (ok, _, err) = cli(&a, false, "sb-a");
    assert!(!ok && err.contains("not registered"), "a released sandbox must be refused: {err}");
    let (_, m) = a.http("/metrics").unwrap();
    assert!(!m.contains("sb-a"), "series of released sb-a remain:\n{m}");

    // A's TAP is Ready again once the maintenance pass the Release woke has found it free (F2);
    // until then the pool's other Ready TAP would be B's. Wait for that state, not for a time.
    let tap_a = ra.interfaces[0].name.clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !a.http_json("/v1/network/taps")["taps"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["tapName"] == tap_a.as_str() && t["state"] == "Ready")
    {
        assert!(std::time::Instant::now() < deadline, "A's TAP never became Ready:\n{}", a.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let rb = ensure(&a, "sb-b", &[]);
    assert_eq!(rb.interfaces[0].name, ra.interfaces[0].name, "B must reuse A's TAP for this test");
    let gb = a.guest(&rb);
    let zero = counters(&a, "sb-b");
    assert_eq!((zero["out"]["packets"].as_u64(), zero["in"]["packets"].as_u64()), (Some(0), Some(0)), "{zero}");
    assert!(zero["drops"].as_object().unwrap().values().all(|v| v == 0), "B inherits A's drops: {zero}");
    assert_eq!(zero["sessions"]["live"], 0, "B inherits A's live session count: {zero}");

    // Attack: the world answers A's old flow now that B holds the TAP.
    let stale_before = global(&a, "drop_stale_version");
    let a_session_alive = a.http_json("/v1/dataplane/sessions")["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["snat"].as_str() == Some(&a_snat.to_string()));
    for _ in 0..3 {
        world.send_to(b"to-a", a_snat).unwrap();
    }
    let leaked = gb.recv_matching(
        Duration::from_millis(500),
        |f| matches!(packet::parse_ipv4(f), Some(s) if matches!(&s.transport, Transport::Udp(7000, 4000, _))),
    );
    assert!(leaked.is_none(), "A's flow reached B's guest");
    let stale = global(&a, "drop_stale_version") - stale_before;
    eprintln!("[sbcount] A's session still mapped when attacked: {a_session_alive}; drop_stale_version +{stale}");
    if a_session_alive {
        assert_eq!(stale, 3, "the stale replies must be dropped by the version check");
    }
    // B's session view never shows A's flow on the same TAP (another version).
    let b_sessions = sessions_cli(&a, "sb-b");
    assert!(!b_sessions.iter().any(|s| s["snat"].as_str() == Some(&a_snat.to_string())), "{b_sessions:?}");
    let after = counters(&a, "sb-b");
    assert_eq!((after["out"]["packets"].as_u64(), after["in"]["packets"].as_u64()), (Some(0), Some(0)), "{after}");
    assert!(after["drops"].as_object().unwrap().values().all(|v| v == 0), "A's traffic charged to B: {after}");

    // B's own traffic counts from zero.
    let (o, i) = ping(&gb, 9);
    let c = counters(&a, "sb-b");
    assert_eq!((c["out"]["packets"].as_u64(), c["out"]["bytes"].as_u64()), (Some(1), Some(o)), "{c}");
    assert_eq!((c["in"]["packets"].as_u64(), c["in"]["bytes"].as_u64()), (Some(1), Some(i)), "{c}");
    let (_, m) = a.http("/metrics").unwrap();
    assert_eq!(metric(&m, r#"cubenet_sandbox_packets_total{direction="out",sandbox="sb-b"}"#), Some(1), "{m}");
    assert_eq!(m.matches("cubenet_sandbox_packets_total{").count(), 2, "one sandbox, two directions:\n{m}");
}
