//! `cargo xtask bench dns` (issue 11): the cost of DNS learning per packet with
//! BPF_PROG_TEST_RUN, each case beside the plain path it rides on, measured in the same run:
//! - a DNS response that is learned (tail call into `dns_response`: session lookups, parse,
//!   two A records written, tail call back into `from_world`) beside the plain SNAT reverse
//!   path of a UDP reply of the same size from another port;
//! - an unsolicited response (parsed up to its header and track lookup) beside the same;
//! - a tracked guest query (`dns_query`: pattern lookups per label) beside an established
//!   UDP packet of the same size to another port;
//! - an established steered (L7) TCP packet (marked, source rewritten, into cube-dev) beside
//!   an established plain SNAT TCP packet, and the same for a new flow's SYN.
//!
//! Every learned response needs a fresh tracked query, so those cases alternate one query and
//! one response and time only the response (`repeat = 1`).

use cubenet_tests::{
    dns::{self, Owner, a},
    frames::{Tcp, tcp, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    rig::{Rig, SB_IFINDEX},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{EgressPolicy, policy::FqdnAllow, prog};

use crate::report::{Row, stats};

const RUNS: usize = 3000;
/// Tracked queries timed per phase: one sandbox may track `limits::DNS_QUERIES_PER_SANDBOX`
/// (512) per window of `budget::DNS_WINDOW_NS` (R11), a retransmission included; the setup takes
/// two. The two phases that track (learned responses, tracked queries) each get a fresh window.
const TRACKED_RUNS: usize = 500;
const NAME: &str = "api.example.com";

fn row(case: &str, v: &mut [f64], baseline: Option<(&str, f64)>) -> Row {
    let (value, spread) = stats(v);
    Row {
        bench: "dns".into(),
        case: case.into(),
        value,
        spread,
        unit: "ns/pkt".into(),
        baseline: baseline.map(|(l, b)| (l.to_string(), b)),
        target: None,
    }
}

/// Runs the DNS learning benchmark.
pub fn run() -> Vec<Row> {
    let rig = Rig::new();
    rig.maps
        .policy
        .replace(
            SB_IFINDEX,
            &EgressPolicy {
                allow_fqdn: vec![FqdnAllow { name: NAME.into(), ports: vec![] }],
                rules: vec![
                    serde_json::from_value(serde_json::json!({
                        "id": "api", "match": {"host": NAME}, "action": {"allow": true}
                    }))
                    .expect("rule"),
                ],
                ..Default::default()
            },
        )
        .expect("policy");
    let (wm, um, up) = (rig.world_mac, rig.up_mac, rig.uplink_ifindex);
    let answers = [a(Owner::Question, [203, 0, 113, 10], 600), a(Owner::Question, [203, 0, 113, 11], 600)];
    let response = dns::response(0x4242, NAME, &answers);
    let query = dns::query(0x4242, NAME);

    // Sessions: guest port 5000 to the resolver (DNS) and 5001 to port 5353 (plain UDP).
    rig.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5001, 5353, &query));
    rig.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, &query));
    let sessions = rig.maps.sessions.list().expect("sessions");
    let snat = |rport| sessions.iter().find(|s| s.remote_port == rport).expect("session").snat_port;
    let (dns_snat, plain_snat) = (snat(53), snat(5353));

    // Plain SNAT reverse path: a reply of the same size from port 5353.
    let plain_reply = udp(wm, um, WORLD_IP, NODE_IP, 5353, plain_snat, &response);
    let mut plain: Vec<f64> =
        rig.run_many(prog::FROM_WORLD, up, RUNS, move |_| plain_reply.clone()).into_iter().map(|x| x as f64).collect();
    let plain_med = stats(&mut plain).0;

    // Learned responses: one tracked query, then its response, timed.
    let mut learned = Vec::with_capacity(TRACKED_RUNS);
    for i in 0..TRACKED_RUNS {
        let id = i as u16;
        rig.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, &dns::query(id, NAME)));
        let out = rig.run(
            prog::FROM_WORLD,
            udp(wm, um, WORLD_IP, NODE_IP, 53, dns_snat, &dns::response(id, NAME, &answers)),
            up,
        );
        learned.push(out.duration.as_nanos() as f64);
    }
    let learned_count = rig.maps.counters.get(cubevs_common::counter::DNS_RESP_LEARNED).unwrap_or(0);
    assert!(learned_count >= 2 * TRACKED_RUNS as u64, "every response learned ({learned_count})");

    // Unsolicited: no query tracked for this id.
    let stray = udp(wm, um, WORLD_IP, NODE_IP, 53, dns_snat, &dns::response(0xffff, NAME, &answers));
    let mut unsolicited: Vec<f64> =
        rig.run_many(prog::FROM_WORLD, up, RUNS, move |_| stray.clone()).into_iter().map(|x| x as f64).collect();

    // Queries: a tracked one beside a plain established UDP packet of the same size.
    // A fresh budget window for the tracked queries (the learned phase used the last one).
    std::thread::sleep(std::time::Duration::from_nanos(cubevs_common::budget::DNS_WINDOW_NS + 100_000_000));
    let q = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, &query);
    let mut tracked: Vec<f64> = rig
        .run_many(prog::FROM_CUBE, SB_IFINDEX, TRACKED_RUNS, move |_| q.clone())
        .into_iter()
        .map(|x| x as f64)
        .collect();
    let p = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5001, 5353, &query);
    let mut plain_q: Vec<f64> =
        rig.run_many(prog::FROM_CUBE, SB_IFINDEX, RUNS, move |_| p.clone()).into_iter().map(|x| x as f64).collect();
    let plain_q_med = stats(&mut plain_q).0;
    let over = rig.maps.counters.get(cubevs_common::counter::DNS_QUERY_OVER_BUDGET).unwrap_or(0);
    assert_eq!(over, 0, "a timed query went over the sandbox's tracking budget: the rows would time the refusal");

    // Steering: learned L7 address (203.0.113.10, learned above) on 443 beside plain SNAT
    // to the world address on 443; established ACKs, then new SYNs.
    let l7_dst = [203, 0, 113, 10];
    let seg = |dst: [u8; 4], sport: u16, t: Tcp| {
        tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, Tcp { sport, dport: 443, win: 1000, ..t }, b"")
    };
    let syn = Tcp { seq: 1, syn: true, ..Default::default() };
    let ack = Tcp { seq: 2, ack: Some(1), ..Default::default() };
    rig.cube(seg(l7_dst, 41000, syn));
    rig.cube(seg(WORLD_IP, 41001, syn));
    let steered = rig.maps.counters.get(cubevs_common::counter::CUBE_L7_NEW).unwrap_or(0);
    assert_eq!(steered, 1, "the L7 flow was steered");
    let (a1, a2) = (seg(l7_dst, 41000, ack), seg(WORLD_IP, 41001, ack));
    let mut est_l7: Vec<f64> =
        rig.run_many(prog::FROM_CUBE, SB_IFINDEX, RUNS, move |_| a1.clone()).into_iter().map(|x| x as f64).collect();
    let mut est_snat: Vec<f64> =
        rig.run_many(prog::FROM_CUBE, SB_IFINDEX, RUNS, move |_| a2.clone()).into_iter().map(|x| x as f64).collect();
    let est_snat_med = stats(&mut est_snat).0;
    // New flows: a fresh guest port every run.
    let mut new_l7: Vec<f64> = rig
        .run_many(prog::FROM_CUBE, SB_IFINDEX, RUNS, move |i| seg(l7_dst, 1024 + (i % 30000) as u16, syn))
        .into_iter()
        .map(|x| x as f64)
        .collect();
    let mut new_snat: Vec<f64> = rig
        .run_many(prog::FROM_CUBE, SB_IFINDEX, RUNS, move |i| seg(WORLD_IP, 1024 + (i % 30000) as u16, syn))
        .into_iter()
        .map(|x| x as f64)
        .collect();
    let new_snat_med = stats(&mut new_snat).0;

    let base = "from_world plain SNAT reverse (UDP reply, same size)";
    let tbase = "from_cube established TCP, plain SNAT";
    let nbase = "from_cube new TCP SYN, plain SNAT";
    let qbase = "from_cube established UDP (same size, not DNS)";
    vec![
        row(base, &mut plain, None),
        row("from_world DNS response learned (2 A records)", &mut learned, Some((base, plain_med))),
        row("from_world DNS response unsolicited (ignored)", &mut unsolicited, Some((base, plain_med))),
        row(qbase, &mut plain_q, None),
        row("from_cube DNS query tracked (allowed name)", &mut tracked, Some((qbase, plain_q_med))),
        row(tbase, &mut est_snat, None),
        row("from_cube established TCP, steered to CubeEgress (mark)", &mut est_l7, Some((tbase, est_snat_med))),
        row(nbase, &mut new_snat, None),
        row("from_cube new TCP SYN, steered (L7 session + mark)", &mut new_l7, Some((nbase, new_snat_med))),
    ]
}
