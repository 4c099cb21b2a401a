//! Attack on the DNS learner's parser (`BPF_PROG_TEST_RUN`, exact map state): the name server a
//! sandbox may ask, or anyone answering for it, sends malformed answers to tracked queries: a
//! question that is a compression pointer to itself, an A record whose RDLENGTH is not 4, an A
//! record cut off by the end of the datagram, an A record of class CHAOS, and a count of 65,535
//! answers over one. Properties users rely on (no test before): the response is still delivered
//! (learning never changes a verdict), no "bait" address (one that is not a complete IN A record
//! of 4 bytes inside the datagram) is ever learned, the complete records of a lying count are
//! learned, and the learner works for the next genuine answer.

use std::net::Ipv4Addr;

use cubenet_tests::{
    dns,
    frames::udp,
    require_root,
    rig::{Rig, SB_IFINDEX},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{EgressPolicy, policy::FqdnAllow, testrun::TC_ACT_REDIRECT};

const RESOLVER: [u8; 4] = WORLD_IP;
const NAME: &str = "api.example.com";

/// Header of a NOERROR response with one question and `ancount` answers.
fn header(id: u16, ancount: u16) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&0x8180u16.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    m.extend_from_slice(&ancount.to_be_bytes());
    m.extend_from_slice(&[0, 0, 0, 0]);
    m
}

/// The question for `NAME`, IN A.
fn question(m: &mut Vec<u8>) {
    m.extend_from_slice(&dns::wire(NAME));
    m.extend_from_slice(&[0, 1, 0, 1]);
}

/// A record owned by the question (pointer 0xc00c), `class`, TTL 600, `rdata` with `rdlength`.
fn record(m: &mut Vec<u8>, class: u16, rdlength: u16, rdata: &[u8]) {
    m.extend_from_slice(&[0xc0, 0x0c, 0, 1]);
    m.extend_from_slice(&class.to_be_bytes());
    m.extend_from_slice(&600u32.to_be_bytes());
    m.extend_from_slice(&rdlength.to_be_bytes());
    m.extend_from_slice(rdata);
}

#[test]
fn malformed_answers_are_delivered_and_never_learn_a_bait_address() {
    if !require_root("attack_dns_parser_testrun malformed_answers_are_delivered_and_never_learn_a_bait_address") {
        return;
    }
    let r = Rig::with_policy(&EgressPolicy {
        allow_internet_access: false,
        allow_out: vec![format!("{}/32", Ipv4Addr::from(RESOLVER))],
        allow_fqdn: vec![FqdnAllow { name: NAME.into(), ports: vec![] }],
        ..Default::default()
    });
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    // 1. The question is a pointer to itself; an answer carries bait 6.6.6.1.
    let mut m = header(1, 1);
    m.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1]);
    record(&mut m, 1, 4, &[6, 6, 6, 1]);
    cases.push(("question pointer loop", m));
    // 2. An "A" record of 16 bytes starting with bait 6.6.6.2.
    let mut m = header(2, 1);
    question(&mut m);
    record(&mut m, 1, 16, &[6, 6, 6, 2, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
    cases.push(("A with RDLENGTH 16", m));
    // 3. An A record cut off after two bytes of its address (bait 6.6.x.x).
    let mut m = header(3, 1);
    question(&mut m);
    record(&mut m, 1, 4, &[6, 6]);
    cases.push(("A cut off by the datagram's end", m));
    // 4. An A record of class CHAOS with bait 6.6.6.4.
    let mut m = header(4, 1);
    question(&mut m);
    record(&mut m, 3, 4, &[6, 6, 6, 4]);
    cases.push(("A of class CHAOS", m));
    // 5. ANCOUNT 65,535 over one complete record (learned) and nothing else.
    let mut m = header(5, u16::MAX);
    question(&mut m);
    record(&mut m, 1, 4, &[203, 0, 113, 21]);
    cases.push(("ANCOUNT 65,535 over one record", m));

    for (i, (name, msg)) in cases.iter().enumerate() {
        let id = i as u16 + 1;
        let snat = r.dns_query(SB_IFINDEX, 41000 + id, id, RESOLVER, NAME);
        let out = r.world(udp(r.world_mac, r.up_mac, RESOLVER, NODE_IP, 53, snat, msg));
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "{name}: the response was not delivered");
        let learned = r.learned_ips(SB_IFINDEX);
        assert!(learned.iter().all(|ip| ip.octets()[0] != 6), "{name}: a bait address was learned: {learned:?}");
    }
    assert_eq!(r.learned_ips(SB_IFINDEX), [Ipv4Addr::new(203, 0, 113, 21)], "the lying count's record");

    // The next genuine answer is learned.
    let snat = r.dns_query(SB_IFINDEX, 42000, 0x7777, RESOLVER, NAME);
    r.dns_respond(snat, 0x7777, RESOLVER, NAME, [203, 0, 113, 22]);
    let mut l = r.learned_ips(SB_IFINDEX);
    l.sort();
    assert_eq!(l, [Ipv4Addr::new(203, 0, 113, 21), Ipv4Addr::new(203, 0, 113, 22)]);
}
