//! Attack on the node's always-denied list (`always_denied_cidrs`, decision R30) through the
//! real agent and real packets: a test host answers at 100.100.100.200 (Alibaba Cloud's
//! metadata address, in 100.64.0.0/10) in the world namespace the test creates. Sandboxes
//! whose policies allow `0.0.0.0/0`, or `100.64.0.0/10` with the internet closed, send it
//! UDP datagrams and pings. Property: with the agent's default list nothing reaches the host
//! (each guest's control datagram to another world address does); after a restart with
//! `always_denied_cidrs = []` the same guests on the same TAPs reach it, so it is the list
//! (rewritten in place at start) that denied them, not the baseline or the policy. A flow
//! opened while the list was empty dies at the restart that lists its address again.
//!
//! SIGHUP (decision R51): the running agent re-reads `always_denied_cidrs` from its file; a
//! flow opened while the address was unlisted is cut at the reload that lists it, the address
//! reopens at the reload that unlists it, a bad file keeps the list in force, and any other
//! changed key is only logged as needing a restart.

use std::{
    net::{SocketAddr, UdpSocket},
    time::Duration,
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::AgentUnderTest,
    deny_probe::DenyProbe,
    guest::TapGuest,
    packet::{self, Transport},
    require_root,
    topology::WORLD_IP,
};

const METADATA: [u8; 4] = [100, 100, 100, 200];
const PORT: u16 = 7100;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn ensure(a: &AgentUnderTest, id: &str, internet: bool, allow: &[&str]) -> pb::EnsureNetworkResponse {
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: id.into(),
            cubevs_context: Some(pb::CubeVsContext {
                allow_internet_access: Some(internet),
                allow_out: allow.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("ensure")
        .into_inner()
    })
}

/// Pings the metadata host from `g`: whether an echo reply comes back.
fn ping(g: &TapGuest, seq: u16) -> bool {
    g.send(&packet::icmp_echo_request(METADATA, 0x77, seq));
    g.recv_matching(Duration::from_secs(2), |f| {
        packet::parse_ipv4(f).is_some_and(|s| s.src == METADATA && s.transport == Transport::EchoReply(0x77, seq))
    })
    .is_some()
}

#[test]
fn always_denied_list_beats_every_allow_and_a_restart_without_it_reopens() {
    if !require_root("always_denied_list_beats_every_allow_and_a_restart_without_it_reopens") {
        return;
    }
    // The agent's default list (no key in the TOML): 100.100.100.200/32.
    let mut a = AgentUnderTest::prepare("always-denied", 2, "");
    a.start();
    let hosts = DenyProbe::new(&a, METADATA, PORT);
    let ra = ensure(&a, "sb-all", true, &["0.0.0.0/0"]);
    let rb = ensure(&a, "sb-cgnat", false, &["100.64.0.0/10", "198.51.100.1/32"]);
    let (ga, gb) = (a.guest(&ra), a.guest(&rb));

    assert!(!hosts.reaches(&ga, 40001, "a1"), "allow_out 0.0.0.0/0 reached the always-denied address");
    assert!(!hosts.reaches(&gb, 40002, "b1"), "allow_out 100.64.0.0/10 reached the always-denied address");
    assert!(!ping(&ga, 1), "a ping from sb-all was answered by the always-denied address");
    assert!(!ping(&gb, 2), "a ping from sb-cgnat was answered by the always-denied address");
    // Counted as what they are: each sandbox's datagram and ping are policy drops.
    let counters = a.http_json("/v1/dataplane/counters");
    for id in ["sb-all", "sb-cgnat"] {
        let c = counters["sandboxes"].as_array().unwrap().iter().find(|s| s["sandboxID"] == id).expect(id);
        assert_eq!(c["drops"]["policy"], 2, "{id}: {c}");
    }
    let log = a.log();
    assert!(log.contains("node always-denied list written"), "{log}");

    // Restart with the list emptied: the map is rewritten in place, the same sandboxes (adopted
    // from their state, same TAPs) now reach the host.
    a.kill(nix::sys::signal::Signal::SIGTERM);
    let cfg = a.dir.join("agent.toml");
    let toml = std::fs::read_to_string(&cfg).unwrap() + "always_denied_cidrs = []\n";
    std::fs::write(&cfg, toml).unwrap();
    a.start();
    assert!(hosts.reaches(&ga, 40003, "a2"), "without the list, allow_out 0.0.0.0/0 must reach it:\n{}", a.log());
    assert!(hosts.reaches(&gb, 40004, "b2"), "without the list, allow_out 100.64.0.0/10 must reach it");
    assert!(ping(&ga, 3), "without the list, sb-all's ping must be answered");

    // And back: a restart with the entry again closes it for the running sandboxes, also the
    // flows opened while it was open (the UDP session of `a2`, same ports, is deleted).
    a.kill(nix::sys::signal::Signal::SIGTERM);
    let toml = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("always_denied_cidrs = []\n", "always_denied_cidrs = [\"203.0.113.0/24\", \"100.100.100.200\"]\n");
    std::fs::write(&cfg, toml).unwrap();
    a.start();
    assert!(!hosts.reaches(&ga, 40003, "a3"), "a flow opened while the list was empty outlived the restart");
    assert!(!hosts.reaches(&ga, 40005, "a4"), "the list restored at restart was not enforced");
    assert!(!hosts.reaches(&gb, 40006, "b3"), "the list restored at restart was not enforced");
}

/// The `result` series of `cubenet_config_reloads_total` on `/metrics` (0 when absent).
fn reloads(a: &AgentUnderTest, result: &str) -> u64 {
    let (_, m) = a.http("/metrics").expect("metrics");
    let want = format!("cubenet_config_reloads_total{{result=\"{result}\"}} ");
    m.lines().find_map(|l| l.strip_prefix(&want)).map_or(0, |v| v.trim().parse().unwrap())
}

#[test]
fn sighup_reloads_the_list_and_cuts_flows_to_newly_listed_addresses() {
    if !require_root("sighup_reloads_the_list_and_cuts_flows_to_newly_listed_addresses") {
        return;
    }
    const RELOADED: &str = "SIGHUP: node always-denied list reloaded";
    const INVALID: &str = "SIGHUP: configuration invalid";
    let mut a = AgentUnderTest::prepare("always-denied-hup", 2, "always_denied_cidrs = []\n");
    a.start();
    let cfg = a.dir.join("agent.toml");
    let original = std::fs::read_to_string(&cfg).unwrap();
    let hosts = DenyProbe::new(&a, METADATA, PORT);
    let r = ensure(&a, "sb-hup", true, &["0.0.0.0/0"]);
    let g = a.guest(&r);
    // Unlisted: the flow (UDP, guest port 41001) reaches the host.
    assert!(hosts.reaches(&g, 41001, "h1"), "unlisted, the address must be reachable:\n{}", a.log());

    // Listed in the file, plus a key that is read only at start.
    let listed = original
        .replace("always_denied_cidrs = []\n", "always_denied_cidrs = [\"203.0.113.0/24\", \"100.100.100.200\"]\n")
        .replace("maintenance_interval_secs = 1\n", "maintenance_interval_secs = 2\n");
    std::fs::write(&cfg, &listed).unwrap();
    a.signal(nix::sys::signal::Signal::SIGHUP);
    let n = a.wait_log_count(RELOADED, 0, Duration::from_secs(20));
    // The running flow (same ports: its session existed) is cut, and a new one is refused.
    assert!(!hosts.reaches(&g, 41001, "h2"), "the flow opened while unlisted outlived the reload");
    assert!(!hosts.reaches(&g, 41002, "h3"), "a new flow reached the address listed by the reload");
    assert!(!ping(&g, 1), "a ping reached the address listed by the reload");
    let log = a.log();
    assert!(log.contains("needs a restart") && log.contains("maintenance_interval_secs"), "{log}");
    // Exactly the one UDP session toward the newly listed address was cut (not the control's).
    let line = log.lines().find(|l| l.contains(RELOADED)).unwrap();
    // Without the colour codes (`ESC [ … m`) the text log puts around field names.
    let plain: String = line
        .split('\x1b')
        .enumerate()
        .map(|(i, p)| if i == 0 { p } else { p.split_once('m').map_or(p, |(_, rest)| rest) })
        .collect();
    assert!(plain.contains("sessions_deleted=1"), "{plain}");
    assert_eq!(reloads(&a, "applied"), 1);

    // A bad file: logged, the list in force stays.
    std::fs::write(
        &cfg,
        original.replace("always_denied_cidrs = []\n", "always_denied_cidrs = [\"100.100.100.200/10\"]\n"),
    )
    .unwrap();
    a.signal(nix::sys::signal::Signal::SIGHUP);
    a.wait_log_count(INVALID, 0, Duration::from_secs(20));
    assert!(a.log().contains("always_denied_cidrs"), "the error names the key:\n{}", a.log());
    assert!(!hosts.reaches(&g, 41003, "h4"), "a bad file opened the listed address");
    assert_eq!(reloads(&a, "invalid"), 1);

    // Unlisted again: the same guest reaches the address, on the port that was cut too.
    std::fs::write(&cfg, &original).unwrap();
    a.signal(nix::sys::signal::Signal::SIGHUP);
    a.wait_log_count(RELOADED, n, Duration::from_secs(20));
    assert!(hosts.reaches(&g, 41001, "h5"), "the address stayed closed after the reload that unlisted it");
    assert!(ping(&g, 2), "the ping stayed refused after the reload that unlisted it");
    assert_eq!(reloads(&a, "applied"), 2);
}

/// Attack (R85): the link-local instance metadata service of most clouds (AWS, GCP, Azure,
/// OpenStack, Oracle) answers at 169.254.169.254 with the node's credentials. The baseline
/// denies 169.254.0.0/16, but `allow_out` beats the baseline, so a sandbox allowed
/// `0.0.0.0/0` (or `169.254.0.0/16`) reached it as the node (SNAT) with the agent's default
/// list, which named Alibaba Cloud's address only. Now the default list has 169.254.169.254/32
/// too: with no key in the TOML, nothing reaches a host there, while the same guest's
/// datagram to another world address does.
#[test]
fn the_default_list_closes_the_cloud_metadata_address_to_allow_everything_policies() {
    if !require_root("the_default_list_closes_the_cloud_metadata_address_to_allow_everything_policies") {
        return;
    }
    const IMDS: [u8; 4] = [169, 254, 169, 254];
    let mut a = AgentUnderTest::prepare("imds", 2, "");
    a.start();
    a.topo.add_world_address(IMDS, 32);
    let bind = |ip: [u8; 4]| {
        a.topo.world.run(move || {
            let s = UdpSocket::bind(SocketAddr::from((ip, PORT))).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            s
        })
    };
    let (imds, control) = (bind(IMDS), bind(WORLD_IP));
    let mut buf = [0u8; 64];
    for (id, allow, sport) in [("sb-all", "0.0.0.0/0", 40101), ("sb-ll", "169.254.0.0/16", 40102)] {
        let r = ensure(&a, id, true, &[allow]);
        let g = a.guest(&r);
        g.send(&packet::udp(IMDS, sport, PORT, id.as_bytes()));
        g.send(&packet::udp(WORLD_IP, sport, PORT, id.as_bytes()));
        let n = control.recv(&mut buf).unwrap_or_else(|e| panic!("{id}: control datagram lost: {e}"));
        assert_eq!(&buf[..n], id.as_bytes());
        imds.set_nonblocking(true).unwrap();
        let got = imds.recv(&mut buf).ok().map(|n| String::from_utf8_lossy(&buf[..n]).into_owned());
        imds.set_nonblocking(false).unwrap();
        assert_eq!(got, None, "allow_out {allow} reached the cloud metadata address with the default list");
    }
}
