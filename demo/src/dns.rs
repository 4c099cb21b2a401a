//! A tiny authoritative UDP DNS responder for one name, bound inside a namespace: `A` queries
//! for that name get one address, other types of that name get an empty answer, any other
//! name gets NXDOMAIN. Messages are parsed and built with `simple-dns`.

use std::net::Ipv4Addr;

use anyhow::{Context, Result};
use cubenet_tests::{netns::TestNetns, servers};
use simple_dns::{CLASS, Packet, PacketFlag, QTYPE, RCODE, ResourceRecord, TYPE, rdata::RData};

/// Serves `name` → `answer` on UDP `ip:53` inside `ns`; the returned server records the clients
/// it answered and stops on drop.
pub fn start(ns: &TestNetns, ip: Ipv4Addr, name: &str, answer: Ipv4Addr) -> Result<servers::Server> {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    servers::udp_responder(ns, ip.octets(), 53, move |query, _| answer_query(query, &name, answer))
        .with_context(|| format!("bind udp {ip}:53"))
}

/// The reply to one query message, or `None` when it is not a parseable query.
pub fn answer_query(query: &[u8], name: &str, answer: Ipv4Addr) -> Option<Vec<u8>> {
    let q = Packet::parse(query).ok()?;
    if q.has_flags(PacketFlag::RESPONSE) || q.questions.len() != 1 {
        return None;
    }
    let question = q.questions[0].clone();
    let mut reply = q.into_reply();
    reply.set_flags(PacketFlag::AUTHORITATIVE_ANSWER);
    let asked = question.qname.to_string().trim_end_matches('.').to_ascii_lowercase();
    if asked != name {
        *reply.rcode_mut() = RCODE::NameError;
    } else if question.qtype == QTYPE::TYPE(TYPE::A) {
        reply.answers.push(ResourceRecord::new(
            question.qname.clone(),
            CLASS::IN,
            60,
            RData::A(simple_dns::rdata::A { address: u32::from(answer) }),
        ));
    }
    reply.build_bytes_vec().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use simple_dns::{Name, QCLASS, Question};

    fn query(name: &str, qtype: TYPE) -> Vec<u8> {
        let mut q = Packet::new_query(7);
        q.questions.push(Question::new(Name::new_unchecked(name), QTYPE::TYPE(qtype), QCLASS::CLASS(CLASS::IN), false));
        q.build_bytes_vec().unwrap()
    }

    #[test]
    fn answers_a_for_its_name_only() {
        let ip = Ipv4Addr::new(198, 51, 100, 1);
        let r = answer_query(&query("Demo.Cubenet.Test", TYPE::A), "demo.cubenet.test", ip).unwrap();
        let p = Packet::parse(&r).unwrap();
        assert_eq!((p.id(), p.rcode(), p.answers.len()), (7, RCODE::NoError, 1));
        assert!(matches!(&p.answers[0].rdata, RData::A(a) if a.address == u32::from(ip)));
        let r = answer_query(&query("demo.cubenet.test", TYPE::AAAA), "demo.cubenet.test", ip).unwrap();
        assert!(Packet::parse(&r).unwrap().answers.is_empty());
        let r = answer_query(&query("other.test", TYPE::A), "demo.cubenet.test", ip).unwrap();
        assert_eq!(Packet::parse(&r).unwrap().rcode(), RCODE::NameError);
        assert!(answer_query(b"junk", "demo.cubenet.test", ip).is_none());
    }
}
