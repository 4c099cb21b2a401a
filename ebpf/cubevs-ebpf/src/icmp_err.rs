//! ICMP errors from the world for a tracked flow (destination unreachable incl. fragmentation
//! needed, time exceeded): reverse-translated and delivered to the guest, so PMTU discovery and
//! traceroute work through SNAT (decision D27).
//!
//! The error's outer destination is the SNAT address; its payload embeds the IP header and
//! first 8 L4 bytes of the packet *as we sent it* (source = SNAT address and port). Both are
//! rewritten to the guest's view: outer destination → 169.254.68.6, embedded source address →
//! 169.254.68.6 and embedded source port (or echo id) → the guest's, with the embedded IP
//! checksum, the embedded UDP checksum (or ICMP echo checksum) when present in the 8 bytes, and
//! the outer ICMP checksum updated incrementally. Only 20-byte outer and embedded IP headers
//! (the rest is passed to the host stack untouched). The embedded TCP checksum lies beyond the
//! 8 bytes RFC 792 guarantees and is left as is: no stack verifies it in an ICMP error.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::generated::bpf_redirect,
    programs::TcContext,
};
use cubevs_common::{DatapathConfig, SessionKey, counter, proto};

use crate::{
    maps::{EGRESS_SESSIONS, IFINDEX_TO_MVMMETA, INGRESS_SESSIONS, count, sandbox_in},
    packet::{IP_DST_OFF, Ipv4, csum_replace2, csum_replace4, set_ip, set_macs},
};

/// ICMP destination unreachable.
pub const ICMP_DEST_UNREACH: u8 = 3;
/// ICMP time exceeded.
pub const ICMP_TIME_EXCEEDED: u8 = 11;

const ICMP_OFF: usize = 14 + 20;
const INNER_OFF: usize = ICMP_OFF + 8;
const INNER_L4_OFF: usize = INNER_OFF + 20;

/// Handles the ICMP error in `ctx` (outer header `ip`, ICMP type already checked). Returns the
/// TC verdict: redirect into the sandbox, drop for a stale-version session, or `TC_ACT_OK`
/// (not ours) for anything else.
#[inline(always)]
pub fn reverse(ctx: &TcContext, ip: &Ipv4, cfg: &DatapathConfig) -> i32 {
    if ip.ihl != 20 {
        return TC_ACT_OK;
    }
    // The embedded header and its 8 L4 bytes must lie inside the outer IP packet: bytes past
    // its total length (link-layer padding) are not covered by the ICMP checksum, so
    // rewriting ports there would corrupt it, and they name no flow (fuzz seed 15, R13).
    if (ip.tot_len as usize) < INNER_L4_OFF + 8 - 14 {
        return TC_ACT_OK;
    }
    let Ok(inner) = ctx.load::<[u8; 28]>(INNER_OFF) else { return TC_ACT_OK };
    if inner[0] != 0x45 {
        return TC_ACT_OK;
    }
    // An error about a non-first fragment embeds payload bytes, not ports: it names no flow
    // (and no fragment of ours ever left: guests' fragments are dropped). Decision R7.
    if (u16::from_be_bytes([inner[6], inner[7]]) & 0x1fff) != 0 {
        return TC_ACT_OK;
    }
    let inner_proto = inner[9];
    let snat_ip = [inner[12], inner[13], inner[14], inner[15]];
    let remote_ip = u32::from_ne_bytes([inner[16], inner[17], inner[18], inner[19]]);
    if u32::from_ne_bytes(snat_ip) != ip.dst {
        return TC_ACT_OK;
    }
    // Our port (or echo id) and the remote port as they sit in the embedded L4 header, plus the
    // offset (inside the 8 bytes) of the checksum to fix, if any.
    let (our_port, remote_port, l4_csum_at) = match inner_proto {
        proto::TCP => ([inner[20], inner[21]], [inner[22], inner[23]], 0usize),
        proto::UDP => ([inner[20], inner[21]], [inner[22], inner[23]], 6),
        proto::ICMP if inner[20] == 8 => ([inner[24], inner[25]], [0, 0], 2),
        _ => return TC_ACT_OK,
    };
    let port_at = if inner_proto == proto::ICMP { 4 } else { 0 };
    let rkey = SessionKey {
        src_ip: remote_ip,
        dst_ip: ip.dst,
        sport: u16::from_ne_bytes(remote_port),
        dport: u16::from_ne_bytes(our_port),
        version: 0,
        proto: inner_proto,
        _pad: [0; 3],
    };
    // SAFETY: plain map lookup; the value is copied out.
    let Some(rv) = (unsafe { INGRESS_SESSIONS.get(&rkey) }).copied() else { return TC_ACT_OK };
    let ekey = SessionKey {
        src_ip: rv.vm_ip,
        dst_ip: remote_ip,
        sport: rv.vm_port,
        dport: rkey.sport,
        version: rv.version,
        proto: inner_proto,
        _pad: [0; 3],
    };
    // SAFETY: plain map lookup; one field copied out.
    let Some(vm_ifindex) = (unsafe { EGRESS_SESSIONS.get(&ekey) }).map(|s| s.vm_ifindex) else {
        return TC_ACT_OK;
    };
    // SAFETY: plain map lookup; two fields copied out.
    let current = unsafe { IFINDEX_TO_MVMMETA.get(&vm_ifindex) }.map(|m| (m.version, m.ip));
    if current != Some((rv.version, rv.vm_ip)) {
        count(counter::WORLD_DROP_STALE_VERSION);
        return TC_ACT_SHOT;
    }

    let guest_ip = cfg.mvm_inner_ip.to_ne_bytes();
    let guest_port = rv.vm_port.to_ne_bytes();
    // Embedded IP header checksum.
    let old_ip_csum = [inner[10], inner[11]];
    let new_ip_csum = csum_replace4(old_ip_csum, snat_ip, guest_ip);
    // Embedded L4 checksum (UDP: pseudo-header address and port; echo: the id). A zero UDP
    // checksum means "none" and stays zero.
    let mut l4_csum = None;
    if l4_csum_at != 0 {
        let old = [inner[20 + l4_csum_at], inner[21 + l4_csum_at]];
        if !(inner_proto == proto::UDP && old == [0, 0]) {
            let mut c = old;
            if inner_proto == proto::UDP {
                c = csum_replace4(c, snat_ip, guest_ip);
            }
            c = csum_replace2(c, our_port, guest_port);
            if inner_proto == proto::UDP && c == [0, 0] {
                c = [0xff, 0xff];
            }
            l4_csum = Some((old, c));
        }
    }
    // Outer ICMP checksum: covers every embedded byte we change.
    let icmp_csum_off = (ICMP_OFF + 2) as u32;
    let mut ok = ctx.l4_csum_replace(icmp_csum_off as usize, ne32(snat_ip), ne32(guest_ip), 4).is_ok()
        && ctx.l4_csum_replace(icmp_csum_off as usize, ne16(old_ip_csum), ne16(new_ip_csum), 2).is_ok()
        && ctx.l4_csum_replace(icmp_csum_off as usize, ne16(our_port), ne16(guest_port), 2).is_ok();
    if let Some((old, new)) = l4_csum {
        ok = ok && ctx.l4_csum_replace(icmp_csum_off as usize, ne16(old), ne16(new), 2).is_ok();
    }
    ok = ok
        && ctx.store(INNER_OFF + 10, &new_ip_csum, 0).is_ok()
        && ctx.store(INNER_OFF + 12, &guest_ip, 0).is_ok()
        && ctx.store(INNER_L4_OFF + port_at, &guest_port, 0).is_ok();
    if let Some((_, new)) = l4_csum {
        ok = ok && ctx.store(INNER_L4_OFF + l4_csum_at, &new, 0).is_ok();
    }
    if !ok
        || set_ip(ctx, ip, IP_DST_OFF, ip.dst, cfg.mvm_inner_ip).is_err()
        || set_macs(ctx, &cfg.mvm_mac, &cfg.gateway_mac).is_err()
    {
        return TC_ACT_SHOT;
    }
    count(counter::WORLD_ICMP_ERROR);
    sandbox_in(vm_ifindex, ctx.len());
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(vm_ifindex, 0) as i32 }
}

/// Wire bytes as the `u64` `bpf_l4_csum_replace` takes (the value as it sits in memory).
#[inline(always)]
fn ne32(b: [u8; 4]) -> u64 {
    u32::from_ne_bytes(b) as u64
}

#[inline(always)]
fn ne16(b: [u8; 2]) -> u64 {
    u16::from_ne_bytes(b) as u64
}
