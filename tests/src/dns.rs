//! DNS messages with exact bytes for the DNS learning tests and benchmarks: queries,
//! responses with A and CNAME answers, owner names as compression pointers or spelled out.

/// Wire format of a dotted name, with the terminating zero.
pub fn wire(name: &str) -> Vec<u8> {
    let mut v = Vec::new();
    for l in name.split('.').filter(|l| !l.is_empty()) {
        v.push(l.len() as u8);
        v.extend_from_slice(l.as_bytes());
    }
    v.push(0);
    v
}

/// Record type A.
pub const A: u16 = 1;
/// Record type CNAME.
pub const CNAME: u16 = 5;
/// Record type AAAA.
pub const AAAA: u16 = 28;
/// Flags of a standard query with RD.
pub const QUERY_FLAGS: u16 = 0x0100;
/// Flags of a standard NOERROR response (QR, RD, RA).
pub const RESPONSE_FLAGS: u16 = 0x8180;
/// TC bit.
pub const TC: u16 = 0x0200;
/// RCODE NXDOMAIN.
pub const NXDOMAIN: u16 = 3;

/// Owner name of an answer.
#[derive(Clone, Debug)]
pub enum Owner {
    /// Pointer to the question name (offset 12, `c0 0c`).
    Question,
    /// Pointer to the target of the previous CNAME answer.
    PrevTarget,
    /// Spelled out, uncompressed.
    Name(String),
}

/// One answer record.
#[derive(Clone, Debug)]
pub struct Answer {
    /// Owner name.
    pub owner: Owner,
    /// Record type.
    pub rtype: u16,
    /// TTL in seconds.
    pub ttl: u32,
    /// Record data; for CNAME the target's wire name.
    pub rdata: Vec<u8>,
}

/// An IN A answer.
pub fn a(owner: Owner, ip: [u8; 4], ttl: u32) -> Answer {
    Answer { owner, rtype: A, ttl, rdata: ip.to_vec() }
}

/// An IN CNAME answer pointing at `target` (spelled out).
pub fn cname(owner: Owner, target: &str, ttl: u32) -> Answer {
    Answer { owner, rtype: CNAME, ttl, rdata: wire(target) }
}

/// A DNS message: header, one question (`qname`, `qtype` IN), `answers`.
pub fn message(id: u16, flags: u16, qname: &str, qtype: u16, answers: &[Answer]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    m.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    m.extend_from_slice(&[0, 0, 0, 0]);
    m.extend_from_slice(&wire(qname));
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    let mut prev_target = 12usize;
    for an in answers {
        match &an.owner {
            Owner::Question => m.extend_from_slice(&[0xc0, 0x0c]),
            Owner::PrevTarget => m.extend_from_slice(&(0xc000 | prev_target as u16).to_be_bytes()),
            Owner::Name(n) => m.extend_from_slice(&wire(n)),
        }
        m.extend_from_slice(&an.rtype.to_be_bytes());
        m.extend_from_slice(&1u16.to_be_bytes());
        m.extend_from_slice(&an.ttl.to_be_bytes());
        m.extend_from_slice(&(an.rdata.len() as u16).to_be_bytes());
        if an.rtype == CNAME {
            prev_target = m.len();
        }
        m.extend_from_slice(&an.rdata);
    }
    m
}

/// A standard IN A query for `name`.
pub fn query(id: u16, name: &str) -> Vec<u8> {
    message(id, QUERY_FLAGS, name, A, &[])
}

/// A NOERROR response to an IN A query for `name`.
pub fn response(id: u16, name: &str, answers: &[Answer]) -> Vec<u8> {
    message(id, RESPONSE_FLAGS, name, A, answers)
}
