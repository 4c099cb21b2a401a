//! Release latency and agent RSS with the session maps full (issue 10 item 13 / datapath item
//! 1): `n` sandboxes are registered through the agent, `sessions` ESTABLISHED sessions spread
//! over half of them are written straight into the agent's pinned maps with batched updates, then each
//! sandbox is released one at a time (the other half, released before the fill, is the
//! baseline). Release unregisters and walks no session map (decision
//! D19), so its latency should not grow with the sessions; RSS is read after two reaper passes.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{agent::AgentUnderTest, ebpf_object};
use cubevs::{Datapath, LoadOptions, SandboxEntry};
use cubevs_common::{NatSession, SessionKey, conntrack, proto};

use crate::report::{Row, stats};

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// `sessions` established TCP sessions, spread round-robin over `sandboxes`, SNATed to
/// `snat_ip`; every egress and reverse key distinct.
pub(crate) fn make_sessions(
    sandboxes: &[SandboxEntry],
    snat_ip: Ipv4Addr,
    sessions: usize,
) -> Vec<(SessionKey, NatSession)> {
    let now = cubevs::reaper::monotonic_ns();
    let snat = u32::from_ne_bytes(snat_ip.octets());
    (0..sessions)
        .map(|j| {
            let sb = &sandboxes[j % sandboxes.len()];
            let remote = Ipv4Addr::from(0x0b00_0000u32 + (j / 30_000) as u32);
            let port = (j % 30_000) as u16;
            let key = SessionKey {
                src_ip: u32::from_ne_bytes(sb.ip.octets()),
                dst_ip: u32::from_ne_bytes(remote.octets()),
                sport: (1024 + port).to_be(),
                dport: 443u16.to_be(),
                version: sb.version,
                proto: proto::TCP,
                _pad: [0; 3],
            };
            let s = NatSession {
                access_ns: now,
                node_ifindex: 1,
                node_ip: snat,
                vm_ifindex: sb.ifindex,
                vm_ip: key.src_ip,
                node_port: (30_000 + port).to_be(),
                vm_port: key.sport,
                state: conntrack::tcp::ESTABLISHED,
                active_close: 0,
                packet_class: conntrack::CLASS_SNAT,
                l7_scheme: 0,
                close_dir: 0,
                td_seen: 0,
                _pad0: [0; 2],
                td_end: [0; 2],
                td_maxwin: [0; 2],
                quota: 0,
                node_quota: 0,
                _reserved: [0; 10],
            };
            (key, s)
        })
        .collect()
}

/// Label of a session count in case names (`1M` for 1,000,000).
fn label(n: usize) -> String {
    if n.is_multiple_of(1_000_000) { format!("{}M", n / 1_000_000) } else { n.to_string() }
}

/// Releases `ids` one at a time; returns each Release's latency (ms).
fn release_all(rt: &tokio::runtime::Runtime, endpoint: &str, ids: &[String]) -> Vec<f64> {
    rt.block_on(async {
        let mut c = network_agent::client::connect(endpoint).await.expect("connect");
        let mut ms = Vec::new();
        for id in ids {
            let t = Instant::now();
            c.release_network(pb::ReleaseNetworkRequest { sandbox_id: id.clone(), ..Default::default() })
                .await
                .expect("Release");
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        ms
    })
}

/// Registers `sandboxes` sandboxes; releases half of them (baseline), fills `sessions`
/// sessions spread over the other half, and releases those one by one.
pub fn run(sandboxes: usize, sessions: usize) -> Vec<Row> {
    let mut a = AgentUnderTest::prepare("bench-sessions", sandboxes + 8, "");
    a.start();
    let pid = a.child.as_ref().map(|c| c.id()).unwrap_or(0);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let endpoint = a.grpc_endpoint();
    let ids: Vec<String> = (0..sandboxes).map(|i| format!("sess-{i}")).collect();
    rt.block_on(async {
        let mut c = network_agent::client::connect(&endpoint).await.expect("connect");
        for id in &ids {
            c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: id.clone(), ..Default::default() })
                .await
                .expect("EnsureNetwork");
        }
    });
    // The agent's pinned maps, adopted by a second loader (nothing attached).
    let dp = Datapath::load(LoadOptions { object: ebpf_object(), pin_dir: Some(a.pin_dir()), ..LoadOptions::new() })
        .expect("adopt the agent's maps");
    let maps = dp.maps();
    let registered: Vec<SandboxEntry> =
        maps.sandboxes.list().expect("sandboxes").into_iter().filter(|e| ids.contains(&e.id)).collect();
    assert_eq!(registered.len(), sandboxes, "registered sandboxes");
    let rss_before = rss_mib(pid);
    // Baseline: the first half is released before any session exists.
    let (empty_ids, full_ids) = ids.split_at(sandboxes / 2);
    let mut release_empty_ms = release_all(&rt, &endpoint, empty_ids);
    let registered: Vec<SandboxEntry> = registered.into_iter().filter(|e| full_ids.contains(&e.id)).collect();
    let entries = make_sessions(&registered, Ipv4Addr::new(198, 51, 100, 2), sessions);
    let t = Instant::now();
    let written = maps.sessions.insert_batch(&entries).expect("fill sessions");
    let fill_s = t.elapsed().as_secs_f64();
    drop(entries);
    assert_eq!(written, sessions);
    assert_eq!(maps.sessions.counts(), (sessions, sessions), "maps filled");
    // Two reaper passes (5 s interval) over the full maps.
    std::thread::sleep(Duration::from_secs(11));
    let rss_full = rss_mib(pid);
    let mut release_ms = release_all(&rt, &endpoint, full_ids);
    // The reaper purges the released sandboxes' sessions in its next passes.
    let t = Instant::now();
    while maps.sessions.counts().0 > 0 && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let purge_s = t.elapsed().as_secs_f64();
    let left = maps.sessions.counts();
    eprintln!(
        "  {sessions} sessions filled in {fill_s:.2} s; after release the reaper left {left:?} after {purge_s:.1} s"
    );
    let l = label(sessions);
    let (_, spread) = stats(&mut release_ms.clone());
    let mut rows = Vec::new();
    for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
        rows.push(Row {
            bench: "agent-sessions".into(),
            case: format!("release {name} with {l} sessions"),
            value: pct(&mut release_ms, q),
            spread,
            unit: "ms".into(),
            baseline: Some((format!("{name} with no sessions"), pct(&mut release_empty_ms, q))),
            target: None,
        });
    }
    rows.push(Row {
        bench: "agent-sessions".into(),
        case: format!("agent RSS with {l} sessions"),
        value: rss_full,
        spread: (rss_full, rss_full),
        unit: "MiB".into(),
        baseline: Some((format!("RSS with {sandboxes} sandboxes, no sessions"), rss_before)),
        target: Some("<= 50 MB".into()),
    });
    rows
}
