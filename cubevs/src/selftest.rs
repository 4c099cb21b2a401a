//! Self-test of a loaded (not yet attached) datapath: `BPF_PROG_TEST_RUN` of canned frames
//! against the LIVE pinned maps, chosen so that no path writes state other than the
//! statistics in `counters` (each run adds one to the counter of its reason):
//!
//! | program      | frame                                            | expected                              |
//! |--------------|--------------------------------------------------|---------------------------------------|
//! | `from_cube`  | ARP who-has 169.254.68.5 from the guest, on the interface of a registered sandbox (only when one is) | `TC_ACT_REDIRECT`, ARP reply from the configured gateway MAC |
//! | `from_cube`  | IPv4/UDP on ingress ifindex 0 (never registered) | `TC_ACT_SHOT`                         |
//! | `from_world` | an ARP reply (not IPv4)                           | `TC_ACT_OK`, frame unchanged          |
//! | `from_world` | TCP ACK 198.51.100.7:40000 → 192.0.2.9:9          | `TC_ACT_OK`, unchanged (reverse-NAT lookup miss) |
//! | `from_envoy` | IPv4 to 192.0.2.77 (no sandbox)                    | `TC_ACT_SHOT`                         |
//!
//! The documentation addresses (RFC 5737) are never sandbox, uplink or session addresses, so
//! the outcome does not depend on the live map contents. The ARP proxy answers registered
//! interfaces only in newer datapaths (an unregistered TAP gets nothing, ARP included), so
//! its case runs on the ifindex of a sandbox registered in the live maps, which holds for
//! either behaviour; it is left out on a node without sandboxes (the redirect is not
//! performed by `BPF_PROG_TEST_RUN`, so nothing reaches that sandbox). Alternative rejected:
//! snapshot and restore of the maps around state-writing paths (a restore races live traffic).

use aya::programs::SchedClassifier;
use cubevs_common::{DatapathConfig, prog};

use crate::{
    Error,
    testrun::{self, SkBuffCtx, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
};

/// One canned packet's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckResult {
    /// Short name, e.g. `from_cube arp proxy`.
    pub name: &'static str,
    /// `None` when the verdict and bytes matched, else what differed.
    pub failure: Option<String>,
}

/// The whole self-test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// Every check, in order.
    pub checks: Vec<CheckResult>,
}

impl Report {
    /// True when every check matched.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.failure.is_none())
    }

    /// `name: failure` of each failed check, `; `-separated.
    pub fn failures(&self) -> String {
        self.checks
            .iter()
            .filter_map(|c| c.failure.as_ref().map(|f| format!("{}: {f}", c.name)))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

const GUEST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const P_ARP: u16 = 0x0806;
const P_IP: u16 = 0x0800;

fn eth(dst: [u8; 6], src: [u8; 6], proto: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&proto.to_be_bytes());
    f
}

fn arp(op: u16, sha: [u8; 6], spa: [u8; 4], tha: [u8; 6], tpa: [u8; 4]) -> Vec<u8> {
    let mut f = eth(if op == 1 { [0xff; 6] } else { tha }, sha, P_ARP);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4]);
    f.extend_from_slice(&op.to_be_bytes());
    f.extend_from_slice(&sha);
    f.extend_from_slice(&spa);
    f.extend_from_slice(&tha);
    f.extend_from_slice(&tpa);
    f
}

fn ipv4(src: [u8; 4], dst: [u8; 4], proto: u8, l4: &[u8]) -> Vec<u8> {
    let mut f = eth(PEER_MAC, GUEST_MAC, P_IP);
    let total = (20 + l4.len()) as u16;
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&src);
    h[16..20].copy_from_slice(&dst);
    let mut sum: u32 = h.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f.extend_from_slice(&h);
    f.extend_from_slice(l4);
    f
}

fn tcp_ack(sport: u16, dport: u16) -> [u8; 20] {
    let mut t = [0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = 0x10;
    t[14..16].copy_from_slice(&1024u16.to_be_bytes());
    t
}

fn udp(sport: u16, dport: u16) -> [u8; 12] {
    let mut u = [0u8; 12];
    u[0..2].copy_from_slice(&sport.to_be_bytes());
    u[2..4].copy_from_slice(&dport.to_be_bytes());
    u[4..6].copy_from_slice(&12u16.to_be_bytes());
    u[8..12].copy_from_slice(b"ping");
    u
}

struct Case {
    name: &'static str,
    prog: &'static str,
    frame: Vec<u8>,
    ingress_ifindex: u32,
    verdict: u32,
    /// Expected output frame; `None`: not compared (dropped frames).
    out: Option<Vec<u8>>,
}

fn cases(cfg: &DatapathConfig, sandbox_ifindex: Option<u32>) -> Vec<Case> {
    let guest_ip = cfg.mvm_inner_ip.to_ne_bytes();
    let gw_ip = cfg.mvm_gateway_ip.to_ne_bytes();
    let who_has = arp(1, GUEST_MAC, guest_ip, [0; 6], gw_ip);
    let mut reply = arp(2, cfg.gateway_mac, gw_ip, GUEST_MAC, guest_ip);
    reply[0..6].copy_from_slice(&GUEST_MAC);
    let foreign_arp = arp(2, PEER_MAC, [192, 0, 2, 1], GUEST_MAC, [192, 0, 2, 2]);
    let world_tcp = ipv4([198, 51, 100, 7], [192, 0, 2, 9], 6, &tcp_ack(40000, 9));
    let arp_proxy = sandbox_ifindex.map(|ifindex| Case {
        name: "from_cube arp proxy",
        prog: prog::FROM_CUBE,
        frame: who_has,
        ingress_ifindex: ifindex,
        verdict: TC_ACT_REDIRECT,
        out: Some(reply),
    });
    arp_proxy
        .into_iter()
        .chain([
            Case {
                name: "from_cube unregistered drop",
                prog: prog::FROM_CUBE,
                frame: ipv4(guest_ip, [192, 0, 2, 9], 17, &udp(40000, 53)),
                ingress_ifindex: 0,
                verdict: TC_ACT_SHOT,
                out: None,
            },
            Case {
                name: "from_world non-ip pass",
                prog: prog::FROM_WORLD,
                frame: foreign_arp.clone(),
                ingress_ifindex: 0,
                verdict: TC_ACT_OK,
                out: Some(foreign_arp),
            },
            Case {
                name: "from_world reverse-nat miss pass",
                prog: prog::FROM_WORLD,
                frame: world_tcp.clone(),
                ingress_ifindex: 0,
                verdict: TC_ACT_OK,
                out: Some(world_tcp),
            },
            Case {
                name: "from_envoy unknown sandbox drop",
                prog: prog::FROM_ENVOY,
                frame: ipv4([192, 0, 2, 1], [192, 0, 2, 77], 17, &udp(40000, 53)),
                ingress_ifindex: 0,
                verdict: TC_ACT_SHOT,
                out: None,
            },
        ])
        .collect()
}

/// Runs every canned frame through the programs `get(name)` returns, loaded with `cfg`.
/// `sandbox_ifindex`: the interface of a sandbox registered in the live maps, for the ARP
/// proxy case (left out when `None`).
///
/// Errors only when a program is missing or `BPF_PROG_TEST_RUN` itself fails; wrong
/// verdicts or bytes are reported in the [`Report`].
pub fn run<'a>(
    get: impl Fn(&str) -> Option<&'a SchedClassifier>,
    cfg: &DatapathConfig,
    sandbox_ifindex: Option<u32>,
) -> Result<Report, Error> {
    let mut checks = Vec::new();
    for c in cases(cfg, sandbox_ifindex) {
        let p = get(c.prog).ok_or(Error::Missing(c.prog))?;
        let ctx = SkBuffCtx { ingress_ifindex: c.ingress_ifindex, ..Default::default() };
        let got = testrun::run(p, &c.frame, ctx, 1)?;
        let failure = if got.verdict != c.verdict {
            Some(format!("verdict {} (expected {})", got.verdict, c.verdict))
        } else if let Some(want) = &c.out
            && got.data != *want
        {
            Some(format!("output frame differs: got {:02x?}, expected {:02x?}", got.data, want))
        } else {
            None
        };
        checks.push(CheckResult { name: c.name, failure });
    }
    Ok(Report { checks })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arp_case_only_with_a_registered_sandbox() {
        let cfg = DatapathConfig::DEFAULT;
        let without: Vec<_> = cases(&cfg, None).iter().map(|c| c.name).collect();
        assert!(!without.contains(&"from_cube arp proxy"));
        assert_eq!(without.len(), 4);
        let with = cases(&cfg, Some(42));
        assert_eq!(with.len(), 5);
        let arp = with.iter().find(|c| c.name == "from_cube arp proxy").unwrap();
        assert_eq!(arp.ingress_ifindex, 42);
        // The expected reply: to the guest, from the gateway MAC, sender = the asked address.
        let out = arp.out.as_ref().unwrap();
        assert_eq!(&out[0..6], &GUEST_MAC);
        assert_eq!(&out[6..12], &cfg.gateway_mac);
        assert_eq!(&out[20..22], &2u16.to_be_bytes());
        assert_eq!(&out[22..28], &cfg.gateway_mac);
        assert_eq!(&out[28..32], &cfg.mvm_gateway_ip.to_ne_bytes());
    }

    #[test]
    fn canned_ipv4_headers_have_valid_checksums() {
        for c in cases(&DatapathConfig::DEFAULT, None) {
            if c.frame[12..14] != P_IP.to_be_bytes() {
                continue;
            }
            let h = &c.frame[14..34];
            let mut sum: u32 = h.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum();
            while sum > 0xffff {
                sum = (sum & 0xffff) + (sum >> 16);
            }
            assert_eq!(sum, 0xffff, "{}", c.name);
        }
    }
}
