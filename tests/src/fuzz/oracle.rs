//! The invariants checked on every `BPF_PROG_TEST_RUN` output. They are written from what the
//! datapath promises (README, issue 10/14), not from how today's programs do it:
//!
//! - `verdict`: `from_cube`/`from_envoy` only drop or redirect; `from_world` drops, redirects or
//!   passes, and a pass leaves the frame untouched.
//! - `unregistered-tap`: nothing but an ARP reply leaves a TAP with no registered sandbox.
//! - `spoofed-source`: nothing from a guest whose IPv4 source is not the guest address leaves.
//! - `snat-not-owned`: a frame from a TAP toward the uplink carries the node address and the
//!   port of a session this sandbox owns (current version, this ifindex, this guest port), or
//!   the host port mapped to the guest port it came from.
//! - `policy-bypass`: it goes only to destinations the sandbox's policy allows, unless it is a
//!   reply on a host port to a connection the world opened.
//! - `foreign-delivery`: a frame redirected into a TAP (`from_world`, `from_envoy`) is for the
//!   sandbox registered there now: a host port it maps, a session of its current version, or its
//!   own mvm IP. `bpf_redirect`'s target is not visible in a test run, so the target is the one
//!   the maps name for the output's tuple (port map → `ifindex`; session → `vm_ifindex`;
//!   `mvmip_to_ifindex` for `from_envoy`), compared with what the fuzzer registered.
//! - `portmap-device`: host-port DNAT only for frames that arrived on the uplink.
//! - `checksum`: every emitted IPv4 header checksum is valid when the input's was; the L4
//!   checksum (TCP/UDP with pseudo-header, ICMP) sums to the same value as the input's (so a
//!   valid one stays valid — also for a first fragment, whose checksum covers bytes not in the
//!   frame); synthesized frames (RST) are fully valid.
//! - `unexpected-output`: anything else a program emits.

use cubevs::testrun::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT};
use cubevs_common::{NatSession, SessionKey};

use super::{
    frames::{proto, tcp_flags},
    model::Model,
};
use crate::{
    packet::{GATEWAY_IP, GUEST_IP, GUEST_MAC},
    topology::{CUBE_DEV_IP, NODE_IP},
};

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Invariant name (see the module docs).
    pub invariant: &'static str,
    /// What was seen.
    pub detail: String,
}

/// A snapshot of `egress_sessions`.
pub type Sessions = [(SessionKey, NatSession)];

/// The parsed parts of a frame the invariants need (offsets bounds-checked; host order).
#[derive(Clone, Debug, Default)]
pub struct Frame<'a> {
    /// The whole frame.
    pub raw: &'a [u8],
    /// EtherType.
    pub ethertype: u16,
    /// IPv4 fields when the frame is IPv4 with a complete header.
    pub ip: Option<Ip>,
}

/// IPv4 + L4 fields.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ip {
    /// Header length in bytes.
    pub ihl: usize,
    /// Total length field.
    pub tot_len: usize,
    /// Protocol.
    pub proto: u8,
    /// Source.
    pub src: [u8; 4],
    /// Destination.
    pub dst: [u8; 4],
    /// Fragment offset (8-byte units).
    pub frag_off: u16,
    /// More-fragments bit.
    pub mf: bool,
    /// TCP/UDP ports or (ICMP) identifier in `sport`, 0 in `dport`; `None` when cut off.
    pub ports: Option<(u16, u16)>,
    /// TCP flags or ICMP type.
    pub flags: u8,
}

/// Parses `raw` (Ethernet II, IPv4).
pub fn parse(raw: &[u8]) -> Frame<'_> {
    let mut f = Frame { raw, ..Default::default() };
    if raw.len() < 14 {
        return f;
    }
    f.ethertype = u16::from_be_bytes([raw[12], raw[13]]);
    if f.ethertype != 0x0800 || raw.len() < 34 || raw[14] >> 4 != 4 {
        return f;
    }
    // An IHL below 20 is no IPv4 header; an IHL past the frame end still has its fixed
    // 20 bytes parsed (the programs read them), with no L4.
    let ihl = ((raw[14] & 0x0f) as usize) * 4;
    if ihl < 20 {
        return f;
    }
    let frag = u16::from_be_bytes([raw[20], raw[21]]);
    let mut ip = Ip {
        ihl,
        tot_len: u16::from_be_bytes([raw[16], raw[17]]) as usize,
        proto: raw[23],
        src: raw[26..30].try_into().expect("4 bytes"),
        dst: raw[30..34].try_into().expect("4 bytes"),
        frag_off: frag & 0x1fff,
        mf: frag & 0x2000 != 0,
        ports: None,
        flags: 0,
    };
    let l4 = raw.get(14 + ihl..).unwrap_or(&[]);
    if ip.frag_off == 0 {
        let be = |i: usize| u16::from_be_bytes([l4[i], l4[i + 1]]);
        match ip.proto {
            proto::TCP if l4.len() >= 20 => {
                ip.ports = Some((be(0), be(2)));
                ip.flags = l4[13];
            }
            proto::UDP if l4.len() >= 8 => ip.ports = Some((be(0), be(2))),
            proto::ICMP if l4.len() >= 8 => {
                ip.ports = Some((be(4), 0));
                ip.flags = l4[0];
            }
            _ => {}
        }
    }
    f.ip = Some(ip);
    f
}

fn sum16(mut acc: u32, b: &[u8]) -> u32 {
    for c in b.chunks(2) {
        acc += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    acc
}

fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    // 0x0000 and 0xffff are the same number in ones' complement.
    if s == 0 { 0xffff } else { s as u16 }
}

/// True when the IPv4 header checksum of `f` is valid.
pub fn ip_csum_ok(f: &Frame) -> bool {
    f.ip.is_some_and(|ip| f.raw.get(14..14 + ip.ihl).is_some_and(|h| fold(sum16(0, h)) == 0xffff))
}

/// The ones'-complement sum of the L4 bytes in the frame (up to the IP total length) plus,
/// for TCP/UDP, the pseudo-header; 0xffff for a complete segment with a valid checksum.
/// `None` for non-first fragments, protocols without an L4 checksum, and frames whose IHL or
/// total length leave no room for the L4 header (no receiver reads a checksum there).
pub fn l4_sum(f: &Frame) -> Option<u16> {
    let ip = f.ip?;
    if ip.frag_off != 0 || !matches!(ip.proto, proto::TCP | proto::UDP | proto::ICMP) {
        return None;
    }
    let start = 14 + ip.ihl;
    let min_l4 = if ip.proto == proto::TCP { 20 } else { 8 };
    if ip.tot_len < ip.ihl + min_l4 || f.raw.len() < start + min_l4 {
        return None;
    }
    let end = (14 + ip.tot_len).min(f.raw.len()).max(start);
    let l4 = &f.raw[start..end];
    let mut s = 0;
    if ip.proto != proto::ICMP {
        s = sum16(s, &ip.src);
        s = sum16(s, &ip.dst);
        s += u32::from(ip.proto) + (ip.tot_len.saturating_sub(ip.ihl) as u32 & 0xffff);
    }
    Some(fold(sum16(s, l4)))
}

fn udp_no_csum(f: &Frame) -> bool {
    f.ip.is_some_and(|ip| {
        let o = 14 + ip.ihl + 6;
        ip.proto == proto::UDP && ip.frag_off == 0 && f.raw.get(o..o + 2) == Some(&[0, 0])
    })
}

/// `checksum`: `out` is `inp` rewritten by NAT.
fn check_nat_csum(inp: &Frame, out: &Frame, v: &mut Vec<Violation>) {
    if ip_csum_ok(inp) && !ip_csum_ok(out) {
        v.push(Violation { invariant: "checksum", detail: "IPv4 header checksum broken by the rewrite".into() });
    }
    if udp_no_csum(inp) && udp_no_csum(out) {
        return;
    }
    let (a, b) = (l4_sum(inp), l4_sum(out));
    if a.is_some() && a != b {
        v.push(Violation {
            invariant: "checksum",
            detail: format!("L4 checksum sum {a:04x?} before, {b:04x?} after the rewrite (fragment: {})", {
                let ip = inp.ip.unwrap_or_default();
                ip.mf || ip.frag_off != 0
            }),
        });
    }
}

fn bad(v: &mut Vec<Violation>, invariant: &'static str, detail: String) {
    v.push(Violation { invariant, detail });
}

fn ip4(a: [u8; 4]) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(a)
}

/// The network-order `u32` of an address as the maps store it.
fn nbo(a: [u8; 4]) -> u32 {
    u32::from_ne_bytes(a)
}

/// Checks one run of `from_cube` on `ingress`; `post` is `egress_sessions` after the run.
pub fn check_cube(
    model: &Model,
    ingress: u32,
    input: &[u8],
    verdict: u32,
    output: &[u8],
    post: &Sessions,
) -> Vec<Violation> {
    let mut v = Vec::new();
    if verdict == TC_ACT_SHOT {
        return v;
    }
    if verdict != TC_ACT_REDIRECT {
        bad(&mut v, "verdict", format!("from_cube returned {verdict}"));
        return v;
    }
    let (inp, out) = (parse(input), parse(output));
    if out.ethertype == 0x0806 {
        // The ARP proxy answers on the TAP the request came from (issue 10 item 10 decides
        // whether an unregistered TAP gets an answer).
        if inp.ethertype != 0x0806 || output.get(0..6) != input.get(22..28) {
            bad(&mut v, "unexpected-output", "ARP frame not a reply to the requester".into());
        }
        return v;
    }
    let Some(sb) = model.on_ifindex(ingress) else {
        bad(&mut v, "unregistered-tap", format!("IPv4 redirected from ifindex {ingress}, no sandbox registered"));
        return v;
    };
    let (Some(iip), Some(oip)) = (inp.ip, out.ip) else {
        bad(&mut v, "unexpected-output", format!("redirected a non-IPv4 frame (ethertype {:04x})", out.ethertype));
        return v;
    };
    if iip.src != GUEST_IP {
        bad(
            &mut v,
            "spoofed-source",
            format!("input source {} left as {} → {}", ip4(iip.src), ip4(oip.src), ip4(oip.dst)),
        );
        return v;
    }
    if oip.dst == GUEST_IP {
        // A reply synthesized for the guest (RST): fully valid, back to the guest.
        if oip.proto != proto::TCP || oip.flags & tcp_flags::RST == 0 || output.get(0..6) != Some(&GUEST_MAC[..]) {
            bad(&mut v, "unexpected-output", format!("frame to the guest that is not a RST: {oip:?}"));
        }
        if !ip_csum_ok(&out) || l4_sum(&out) != Some(0xffff) {
            bad(&mut v, "checksum", "synthesized RST has a bad checksum".into());
        }
        return v;
    }
    if oip.src == NODE_IP {
        let (Some((isport, _)), Some((osport, odport))) = (iip.ports, oip.ports) else {
            bad(&mut v, "unexpected-output", "SNATed frame without ports".into());
            return v;
        };
        let owned = post.iter().any(|(k, s)| {
            s.node_ip == nbo(NODE_IP)
                && u16::from_be(s.node_port) == osport
                && k.dst_ip == nbo(oip.dst)
                && k.proto == oip.proto
                && (oip.proto == proto::ICMP || u16::from_be(k.dport) == odport)
                && u16::from_be(k.sport) == isport
                && k.src_ip == nbo(sb.ip)
                && k.version == sb.version
                && s.vm_ifindex == sb.ifindex
        });
        let mapped = oip.proto != proto::ICMP
            && sb
                .ports
                .iter()
                .any(|&(tcp, host, guest)| tcp == (oip.proto == proto::TCP) && host == osport && guest == isport);
        if !owned && !mapped {
            bad(
                &mut v,
                "snat-not-owned",
                format!(
                    "{}:{osport} → {}:{odport} proto {} matches no session or host port of ifindex {} version {}",
                    ip4(oip.src),
                    ip4(oip.dst),
                    oip.proto,
                    sb.ifindex,
                    sb.version
                ),
            );
        }
        let world_opened = mapped && model.world_opened.contains(&(oip.dst, odport, osport, oip.proto));
        if !sb.allows(oip.dst) && !world_opened {
            bad(
                &mut v,
                "policy-bypass",
                format!(
                    "{} {} sport {isport}→{osport} flags {:02x} to {}:{odport} left, policy denies it{}",
                    if oip.proto == proto::TCP {
                        "TCP"
                    } else if oip.proto == proto::UDP {
                        "UDP"
                    } else {
                        "ICMP"
                    },
                    if owned { "session" } else { "host-port" },
                    iip.flags,
                    ip4(oip.dst),
                    if mapped { " (not a connection the world opened)" } else { "" }
                ),
            );
        }
        check_nat_csum(&inp, &out, &mut v);
        return v;
    }
    if oip.src == sb.ip {
        let gateway = oip.dst == CUBE_DEV_IP && iip.dst == GATEWAY_IP;
        let host = oip.dst == NODE_IP && iip.dst == NODE_IP && sb.allows(NODE_IP);
        if !gateway && !host {
            bad(&mut v, "unexpected-output", format!("{} → {} toward cube-dev", ip4(oip.src), ip4(oip.dst)));
        }
        // Only echo reaches the node's stack as ICMP from a guest: an error would be taken as
        // the node's path MTU or a socket error (decision R70).
        if oip.proto == proto::ICMP && !matches!(iip.flags, 0 | 8) {
            bad(&mut v, "gateway-icmp-error", format!("ICMP type {} from a guest toward cube-dev", iip.flags));
        }
        check_nat_csum(&inp, &out, &mut v);
        return v;
    }
    bad(&mut v, "unexpected-output", format!("{} → {} from a TAP", ip4(oip.src), ip4(oip.dst)));
    v
}

/// The session a world frame (or the packet embedded in an ICMP error) replies to: the
/// egress entry whose SNAT address/port and remote match.
fn session_for(
    pre: &Sessions,
    node: [u8; 4],
    node_port: u16,
    remote: [u8; 4],
    remote_port: u16,
    p: u8,
) -> Option<&(SessionKey, NatSession)> {
    pre.iter().find(|(k, s)| {
        s.node_ip == nbo(node)
            && u16::from_be(s.node_port) == node_port
            && k.dst_ip == nbo(remote)
            && k.proto == p
            && (p == proto::ICMP || u16::from_be(k.dport) == remote_port)
    })
}

/// Checks one run of `from_world` that arrived on `ingress` (`uplink` is the uplink's
/// ifindex); `pre` is `egress_sessions` before the run. Records connections the world opens
/// to host ports in `model`.
#[allow(clippy::too_many_arguments)]
pub fn check_world(
    model: &mut Model,
    ingress: u32,
    uplink: u32,
    input: &[u8],
    verdict: u32,
    output: &[u8],
    pre: &Sessions,
) -> Vec<Violation> {
    let mut v = Vec::new();
    match verdict {
        TC_ACT_SHOT => return v,
        TC_ACT_OK => {
            if output != input {
                bad(&mut v, "unexpected-output", "frame passed to the host stack modified".into());
            }
            return v;
        }
        TC_ACT_REDIRECT => {}
        _ => {
            bad(&mut v, "verdict", format!("from_world returned {verdict}"));
            return v;
        }
    }
    let (inp, out) = (parse(input), parse(output));
    let (Some(iip), Some(oip)) = (inp.ip, out.ip) else {
        bad(&mut v, "unexpected-output", "redirected a non-IPv4 frame".into());
        return v;
    };
    if oip.dst != GUEST_IP || output.get(0..6) != Some(&GUEST_MAC[..]) {
        bad(&mut v, "unexpected-output", format!("redirected frame to {} is not for a guest", ip4(oip.dst)));
        return v;
    }
    let tcp = iip.proto == proto::TCP;
    if let (true, Some((isport, idport)), Some((_, odport))) = (iip.dst == NODE_IP, iip.ports, oip.ports)
        && iip.proto != proto::ICMP
        && model.host_port(tcp, idport).is_some_and(|(_, g)| g == odport)
    {
        if ingress != uplink {
            bad(&mut v, "portmap-device", format!("host port {idport} DNATed for a frame from ifindex {ingress}"));
        }
        // Any client segment DNATed to a host port records the connection (decision D20:
        // a live connection whose entry was evicted recovers on the client's next segment),
        // so the guest may answer it; a SYN is not required (R7).
        model.world_opened.insert((iip.src, isport, idport, iip.proto));
        check_nat_csum(&inp, &out, &mut v);
        return v;
    }
    // Reverse NAT: of the frame itself, or of the packet an ICMP error embeds.
    let l4 = &input[(14 + iip.ihl).min(input.len())..];
    let mut about = String::new();
    let (sess, want_port) = if iip.proto == proto::ICMP && iip.flags != 0 {
        let e = parse_embedded(l4);
        match e {
            Some(e) => {
                let (sp, dp) = e.ports.unwrap_or((0, 0));
                about = format!(
                    " (ICMP type {} about {}:{sp} → {}:{dp} proto {} fragment offset {})",
                    iip.flags,
                    ip4(e.src),
                    ip4(e.dst),
                    e.proto,
                    e.frag_off
                );
                (session_for(pre, e.src, sp, e.dst, dp, e.proto), None)
            }
            None => (None, None),
        }
    } else {
        match iip.ports {
            Some((sp, _)) if iip.proto == proto::ICMP => {
                (session_for(pre, iip.dst, sp, iip.src, 0, iip.proto), Some(0))
            }
            Some((sp, dp)) => (session_for(pre, iip.dst, dp, iip.src, sp, iip.proto), Some(1)),
            None => (None, None),
        }
    };
    let Some((k, s)) = sess else {
        bad(
            &mut v,
            "foreign-delivery",
            format!(
                "redirected {} → {} proto {}{about} matches no host port or session",
                ip4(iip.src),
                ip4(iip.dst),
                iip.proto
            ),
        );
        return v;
    };
    if let (Some(which), Some(p)) = (want_port, oip.ports) {
        let got = if which == 0 { p.0 } else { p.1 };
        if got != u16::from_be(k.sport) {
            bad(
                &mut v,
                "unexpected-output",
                format!("reply delivered to guest port {got}, session's is {}", u16::from_be(k.sport)),
            );
        }
    }
    match model.on_ifindex(s.vm_ifindex) {
        Some(o) if nbo(o.ip) == k.src_ip && o.version == k.version => {}
        o => bad(
            &mut v,
            "foreign-delivery",
            format!(
                "reply for the session of {} version {} delivered into ifindex {} where {}",
                std::net::Ipv4Addr::from(k.src_ip.to_ne_bytes()),
                k.version,
                s.vm_ifindex,
                o.map_or("no sandbox is registered".to_string(), |o| format!("version {} is registered", o.version))
            ),
        ),
    }
    check_nat_csum(&inp, &out, &mut v);
    v
}

/// The IPv4 header + ports of the packet embedded in an ICMP error (`icmp` = ICMP message).
fn parse_embedded(icmp: &[u8]) -> Option<Ip> {
    let mut fake = vec![0u8; 14];
    fake[12] = 0x08;
    fake.extend_from_slice(icmp.get(8..)?);
    let f = parse(&fake);
    let mut ip = f.ip?;
    // An ICMP error embeds only the first 8 bytes of the original L4 header (RFC 792): for
    // TCP that is the ports and sequence number, never a full header, which `parse` wants (R7).
    if ip.proto == proto::TCP && ip.ports.is_none() && ip.frag_off == 0 {
        let l4 = fake.get(14 + ip.ihl..).unwrap_or(&[]);
        if l4.len() >= 4 {
            ip.ports = Some((u16::from_be_bytes([l4[0], l4[1]]), u16::from_be_bytes([l4[2], l4[3]])));
        }
    }
    if ip.proto == proto::ICMP {
        // The embedded echo request's identifier is at the same offset (4) as parsed.
        ip.ports = ip.ports.map(|(id, _)| (id, 0));
    }
    Some(ip)
}

/// Checks one run of `from_envoy` (cube-dev egress, host → sandbox).
pub fn check_envoy(model: &Model, input: &[u8], verdict: u32, output: &[u8]) -> Vec<Violation> {
    let mut v = Vec::new();
    if verdict == TC_ACT_SHOT {
        return v;
    }
    if verdict != TC_ACT_REDIRECT {
        bad(&mut v, "verdict", format!("from_envoy returned {verdict}"));
        return v;
    }
    let (inp, out) = (parse(input), parse(output));
    let (Some(iip), Some(oip)) = (inp.ip, out.ip) else {
        bad(&mut v, "unexpected-output", "redirected a non-IPv4 frame".into());
        return v;
    };
    if model.with_ip(iip.dst).is_none() {
        bad(
            &mut v,
            "foreign-delivery",
            format!("frame for {} redirected, no sandbox registered with that IP", ip4(iip.dst)),
        );
    }
    let want_src = if iip.src == CUBE_DEV_IP { GATEWAY_IP } else { iip.src };
    if oip.dst != GUEST_IP || oip.src != want_src || output.get(0..6) != Some(&GUEST_MAC[..]) {
        bad(&mut v, "unexpected-output", format!("{} → {} after DNAT", ip4(oip.src), ip4(oip.dst)));
    }
    check_nat_csum(&inp, &out, &mut v);
    v
}
