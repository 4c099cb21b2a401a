//! A minimal stub resolver: one `A` query over UDP to the configured servers, answers parsed
//! with `simple-dns` (the crate the demo's DNS server uses). Our own code rather than a full
//! resolver crate: [`crate::dest`] keeps its own per-name address sets (union of answers,
//! TTL floor), so only the question/answer exchange is needed here.
//!
//! Limits: IPv4 `A` records only; a truncated (TC) answer is used as is (no TCP retry); the
//! first server that answers wins; CNAME chains are followed inside one response.

use std::{
    collections::HashSet,
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    time::Duration,
};

use anyhow::{Context, bail};
use simple_dns::{CLASS, Name, Packet, PacketFlag, QCLASS, QTYPE, Question, RCODE, TYPE, rdata::RData};

/// Nameservers of a `resolv.conf` file (`nameserver <ipv4>` lines, port 53, at most 3 as
/// glibc uses). Errors: the file cannot be read.
pub fn servers_from_resolv_conf(path: &Path) -> anyhow::Result<Vec<SocketAddr>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<Ipv4Addr>().ok())
        .map(|ip| SocketAddr::from((ip, 53)))
        .take(3)
        .collect())
}

/// Resolves `name` to its IPv4 addresses with their TTLs (seconds), asking `servers` in order
/// (each at most `timeout`) until one answers. NXDOMAIN or NODATA → `Ok(empty)`. Errors: no
/// server answered, or the answer was SERVFAIL/REFUSED/malformed.
pub async fn resolve_a(servers: &[SocketAddr], name: &str, timeout: Duration) -> anyhow::Result<Vec<(Ipv4Addr, u32)>> {
    let mut last = anyhow::anyhow!("no DNS server configured");
    for s in servers {
        match tokio::time::timeout(timeout, query(*s, name)).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => last = e.context(format!("DNS server {s}")),
            Err(_) => last = anyhow::anyhow!("DNS server {s}: no answer in {timeout:?}"),
        }
    }
    Err(last)
}

async fn query(server: SocketAddr, name: &str) -> anyhow::Result<Vec<(Ipv4Addr, u32)>> {
    let mut idb = [0u8; 2];
    rustls::crypto::ring::default_provider().secure_random.fill(&mut idb).map_err(|_| anyhow::anyhow!("random id"))?;
    let id = u16::from_be_bytes(idb);
    let mut q = Packet::new_query(id);
    q.set_flags(PacketFlag::RECURSION_DESIRED);
    let qname = Name::new(name).context("invalid DNS name")?;
    q.questions.push(Question::new(qname, QTYPE::TYPE(TYPE::A), QCLASS::CLASS(CLASS::IN), false));
    let msg = q.build_bytes_vec().context("build DNS query")?;
    let sock = tokio::net::UdpSocket::bind(if server.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }).await?;
    // A connected socket only receives datagrams from the server's address and port.
    sock.connect(server).await?;
    sock.send(&msg).await?;
    let mut buf = vec![0u8; 4096];
    loop {
        let n = sock.recv(&mut buf).await?;
        let Ok(p) = Packet::parse(&buf[..n]) else { continue };
        if p.id() != id || !p.has_flags(PacketFlag::RESPONSE) {
            continue;
        }
        return answers(&p, name);
    }
}

/// The `A` records of `name` in a response, following CNAMEs (any order) from `name`.
fn answers(p: &Packet<'_>, name: &str) -> anyhow::Result<Vec<(Ipv4Addr, u32)>> {
    match p.rcode() {
        RCODE::NoError | RCODE::NameError => {}
        rc => bail!("DNS error {rc:?}"),
    }
    let norm = |n: &Name<'_>| n.to_string().trim_end_matches('.').to_ascii_lowercase();
    let mut names: HashSet<String> = HashSet::from([name.trim_end_matches('.').to_ascii_lowercase()]);
    // Each pass can only add names; a chain of n CNAMEs needs at most n passes.
    for _ in 0..p.answers.len() {
        let before = names.len();
        for rr in &p.answers {
            if let RData::CNAME(c) = &rr.rdata
                && names.contains(&norm(&rr.name))
            {
                names.insert(norm(&c.0));
            }
        }
        if names.len() == before {
            break;
        }
    }
    Ok(p.answers
        .iter()
        .filter(|rr| rr.class == CLASS::IN && names.contains(&norm(&rr.name)))
        .filter_map(|rr| match &rr.rdata {
            RData::A(a) => Some((Ipv4Addr::from(a.address), rr.ttl)),
            _ => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use simple_dns::{ResourceRecord, rdata};

    fn responder(reply: impl Fn(&Packet<'_>) -> Vec<u8> + Send + 'static) -> SocketAddr {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = s.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((n, peer)) = s.recv_from(&mut buf) {
                let q = Packet::parse(&buf[..n]).unwrap();
                let _ = s.send_to(&reply(&q), peer);
            }
        });
        addr
    }

    #[tokio::test]
    async fn follows_cnames_and_ignores_other_names() {
        let addr = responder(|q| {
            let mut r = q.clone().into_reply();
            let qn = q.questions[0].qname.clone();
            let target = Name::new_unchecked("edge.cdn.test");
            r.answers.push(ResourceRecord::new(
                Name::new_unchecked("unrelated.test"),
                CLASS::IN,
                60,
                RData::A(rdata::A { address: u32::from(Ipv4Addr::new(6, 6, 6, 6)) }),
            ));
            r.answers.push(ResourceRecord::new(
                target.clone(),
                CLASS::IN,
                30,
                RData::A(rdata::A { address: u32::from(Ipv4Addr::new(192, 0, 2, 9)) }),
            ));
            r.answers.push(ResourceRecord::new(qn, CLASS::IN, 300, RData::CNAME(rdata::CNAME(target))));
            r.build_bytes_vec().unwrap()
        });
        let v = resolve_a(&[addr], "API.example.test", Duration::from_secs(2)).await.unwrap();
        assert_eq!(v, vec![(Ipv4Addr::new(192, 0, 2, 9), 30)]);
    }

    #[tokio::test]
    async fn nxdomain_is_empty_and_silence_is_an_error() {
        let nx = responder(|q| {
            let mut r = q.clone().into_reply();
            *r.rcode_mut() = RCODE::NameError;
            r.build_bytes_vec().unwrap()
        });
        assert!(resolve_a(&[nx], "nope.test", Duration::from_secs(2)).await.unwrap().is_empty());
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = resolve_a(&[silent.local_addr().unwrap()], "x.test", Duration::from_millis(200)).await.unwrap_err();
        assert!(e.to_string().contains("no answer"), "{e}");
        // The second server answers when the first is silent.
        let ok = responder(|q| {
            let mut r = q.clone().into_reply();
            r.answers.push(ResourceRecord::new(
                q.questions[0].qname.clone(),
                CLASS::IN,
                5,
                RData::A(rdata::A { address: u32::from(Ipv4Addr::new(192, 0, 2, 1)) }),
            ));
            r.build_bytes_vec().unwrap()
        });
        let v = resolve_a(&[silent.local_addr().unwrap(), ok], "x.test", Duration::from_millis(200)).await.unwrap();
        assert_eq!(v, vec![(Ipv4Addr::new(192, 0, 2, 1), 5)]);
    }

    #[test]
    fn resolv_conf_servers() {
        let f = std::env::temp_dir().join(format!("cube-egress-resolv-{}", std::process::id()));
        std::fs::write(&f, "# x\nsearch a.test\nnameserver 10.0.0.53\nnameserver ::1\nnameserver 10.0.0.54\n").unwrap();
        let v = servers_from_resolv_conf(&f).unwrap();
        assert_eq!(v, vec!["10.0.0.53:53".parse().unwrap(), "10.0.0.54:53".parse().unwrap()]);
        std::fs::remove_file(&f).unwrap();
    }
}
