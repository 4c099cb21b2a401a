//! `cargo xtask bench dns` (issue 11): the cost of DNS learning per packet with
//! BPF_PROG_TEST_RUN, each case beside the plain path it rides on, measured in the same run:
//! - a DNS response that is learned (tail call into `dns_response`: session lookups, parse,
//!   two A records written, tail call back into `from_world`) beside the plain SNAT reverse
//!   path of a UDP reply of the same size from another port;
//! - an unsolicited response (parsed up to its header and track lookup) beside the same;
//! - a tracked guest query (`dns_query`: pattern lookups per label) beside an established
//!   UDP packet of the same size to another port.
//!
//! Every learned response needs a fresh tracked query, so those cases alternate one query and
//! one response and time only the response (`repeat = 1`).

use cubenet_tests::{
    dns::{self, Owner, a},
    frames::udp,
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    rig::{Rig, SB_IFINDEX},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{EgressPolicy, policy::FqdnAllow, prog};

use crate::report::{Row, stats};

const RUNS: usize = 3000;
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
            &EgressPolicy { allow_fqdn: vec![FqdnAllow { name: NAME.into(), ports: vec![] }], ..Default::default() },
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
    let mut learned = Vec::with_capacity(RUNS);
    for i in 0..RUNS {
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
    assert!(learned_count >= 2 * RUNS as u64, "every response learned ({learned_count})");

    // Unsolicited: no query tracked for this id.
    let stray = udp(wm, um, WORLD_IP, NODE_IP, 53, dns_snat, &dns::response(0xffff, NAME, &answers));
    let mut unsolicited: Vec<f64> =
        rig.run_many(prog::FROM_WORLD, up, RUNS, move |_| stray.clone()).into_iter().map(|x| x as f64).collect();

    // Queries: a tracked one beside a plain established UDP packet of the same size.
    let q = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, &query);
    let mut tracked: Vec<f64> =
        rig.run_many(prog::FROM_CUBE, SB_IFINDEX, RUNS, move |_| q.clone()).into_iter().map(|x| x as f64).collect();
    let p = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5001, 5353, &query);
    let mut plain_q: Vec<f64> =
        rig.run_many(prog::FROM_CUBE, SB_IFINDEX, RUNS, move |_| p.clone()).into_iter().map(|x| x as f64).collect();
    let plain_q_med = stats(&mut plain_q).0;

    let base = "from_world plain SNAT reverse (UDP reply, same size)";
    let qbase = "from_cube established UDP (same size, not DNS)";
    vec![
        row(base, &mut plain, None),
        row("from_world DNS response learned (2 A records)", &mut learned, Some((base, plain_med))),
        row("from_world DNS response unsolicited (ignored)", &mut unsolicited, Some((base, plain_med))),
        row(qbase, &mut plain_q, None),
        row("from_cube DNS query tracked (allowed name)", &mut tracked, Some((qbase, plain_q_med))),
    ]
}
