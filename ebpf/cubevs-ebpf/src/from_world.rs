//! `from_world`: tcx ingress of the uplink (`reference/upstream.md §3.6`).
//!
//! Host-port DNAT (TCP and UDP) to `169.254.68.6:<guest port>` on the sandbox interface, only
//! for packets arriving on the registered uplink (decision D26), recording the connection in
//! `portmap_sessions` so the guest's replies may leave (D20); reverse NAT of sessions (TCP,
//! UDP, ICMP echo reply) with conntrack update, dropped when the session's sandbox version is
//! no longer the one registered on its interface (D19) or for an RST outside the tracked
//! window (D21); everything else continues into the host stack untouched. UDP from port 53
//! is offered to the DNS learning hook first (tail call, `crate::dns`).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_ktime_get_ns, generated::bpf_redirect},
    macros::classifier,
    programs::TcContext,
};
use cubevs_common::{
    PortmapKey, PortmapSession, SessionKey,
    conntrack::{Dir, udp},
    counter, ether, proto,
};

use crate::{
    config, dns, frag, icmp_err,
    maps::{
        EGRESS_SESSIONS, IFINDEX_TO_MVMMETA, INGRESS_SESSIONS, PORTMAP_SESSIONS, REMOTE_PORT_MAPPING,
        REMOTE_PORT_MAPPING_UDP, count, node,
    },
    nat,
    packet::{self, ICMP_ECHO_REPLY, IP_DST_OFF, set_ip, set_macs, set_port},
    track,
};

#[inline(always)]
fn pass() -> i32 {
    count(counter::WORLD_PASS);
    TC_ACT_OK
}

#[classifier]
pub fn from_world(ctx: TcContext) -> i32 {
    packet::ensure_linear(&ctx, ether::HDR_LEN + 60 + 20);
    if packet::ethertype(&ctx) != Some(ether::P_IP) {
        return pass();
    }
    let Some(ip) = packet::ipv4(&ctx) else { return pass() };
    let cfg = config::get();
    if ip.later_fragment {
        return frag::later(&ctx, &ip, &cfg);
    }
    let Some(l4) = packet::l4(&ctx, &ip) else { return pass() };
    let node = node();
    if ip.proto == proto::UDP && l4.sport == cubevs_common::dns::SERVER_PORT.to_be() {
        // Tail call to `dns_response`, which comes back here; returns only if it already ran.
        dns::enter(&ctx, cubevs_common::dns::slot::RESPONSE);
    }

    if ip.dst == node.uplink_ip && (ip.proto == proto::TCP || ip.proto == proto::UDP) {
        // SAFETY: plain map lookups; values are copied out.
        let mapped = unsafe {
            if ip.proto == proto::TCP {
                REMOTE_PORT_MAPPING.get(&l4.dport)
            } else {
                REMOTE_PORT_MAPPING_UDP.get(&l4.dport)
            }
        }
        .copied();
        if let Some(mp) = mapped {
            // SAFETY: `skb` is the context pointer the kernel passed in.
            if unsafe { (*ctx.skb.skb).ingress_ifindex } != node.uplink_ifindex {
                count(counter::WORLD_PORTMAP_WRONG_DEV);
                return TC_ACT_OK;
            }
            // SAFETY: plain map lookup; one field copied out.
            let Some(version) = (unsafe { IFINDEX_TO_MVMMETA.get(&mp.ifindex) }).map(|m| m.version) else {
                count(counter::WORLD_DROP_PORTMAP_UNREGISTERED);
                return TC_ACT_SHOT;
            };
            track_portmap(
                &PortmapKey {
                    ifindex: mp.ifindex,
                    remote_ip: ip.src,
                    guest_port: mp.listen_port,
                    remote_port: l4.sport,
                    proto: ip.proto,
                    _pad: [0; 3],
                },
                version,
                l4.dport,
            );
            if set_ip(&ctx, &ip, IP_DST_OFF, ip.dst, cfg.mvm_inner_ip).is_err()
                || set_port(&ctx, &ip, false, l4.dport, mp.listen_port).is_err()
                || set_macs(&ctx, &cfg.mvm_mac, &cfg.gateway_mac).is_err()
            {
                return pass();
            }
            count(counter::WORLD_PORTMAP);
            // SAFETY: plain helper call.
            return unsafe { bpf_redirect(mp.ifindex, 0) } as i32;
        }
    }

    if ip.proto == proto::ICMP && l4.icmp_type != ICMP_ECHO_REPLY {
        if l4.icmp_type == icmp_err::ICMP_DEST_UNREACH || l4.icmp_type == icmp_err::ICMP_TIME_EXCEEDED {
            let v = icmp_err::reverse(&ctx, &ip, &cfg);
            if v != TC_ACT_OK {
                return v;
            }
        }
        return pass();
    }
    let icmp = ip.proto == proto::ICMP;
    // ICMP: the echo id (in `sport`) is our SNAT id; the remote "port" is 0.
    let (remote_port, our_port) = if icmp { (0, l4.sport) } else { (l4.sport, l4.dport) };
    let rkey = SessionKey {
        src_ip: ip.src,
        dst_ip: ip.dst,
        sport: remote_port,
        dport: our_port,
        version: 0,
        proto: ip.proto,
        _pad: [0; 3],
    };
    // SAFETY: plain map lookup; the value is copied out.
    let Some(rv) = (unsafe { INGRESS_SESSIONS.get(&rkey) }).copied() else { return pass() };
    let ekey = SessionKey {
        src_ip: rv.vm_ip,
        dst_ip: ip.src,
        sport: rv.vm_port,
        dport: remote_port,
        version: rv.version,
        proto: ip.proto,
        _pad: [0; 3],
    };
    let Some(s) = EGRESS_SESSIONS.get_ptr_mut(&ekey) else {
        count(counter::WORLD_STALE);
        return TC_ACT_OK;
    };
    // SAFETY: valid map value pointer.
    let vm_ifindex = unsafe { (*s).vm_ifindex };
    // The session must belong to the sandbox registered on its interface now: a released or
    // reused TAP never receives the replies of its previous owner's flows.
    // SAFETY: plain map lookup; two fields copied out.
    let current = unsafe { IFINDEX_TO_MVMMETA.get(&vm_ifindex) }.map(|m| (m.version, m.ip));
    if current != Some((rv.version, rv.vm_ip)) {
        count(counter::WORLD_DROP_STALE_VERSION);
        return TC_ACT_SHOT;
    }
    if ip.proto == proto::TCP {
        if !track::tcp_segment(s, Dir::Reply, &ip, &l4, false) {
            count(counter::WORLD_DROP_RST_WINDOW);
            return TC_ACT_SHOT;
        }
    } else {
        // SAFETY: valid map value pointer.
        unsafe {
            if (*s).state != udp::REPLIED {
                (*s).state = udp::REPLIED;
            }
        }
    }
    nat::touch(s);
    if set_ip(&ctx, &ip, IP_DST_OFF, ip.dst, cfg.mvm_inner_ip).is_err()
        || set_port(&ctx, &ip, false, our_port, rv.vm_port).is_err()
        || set_macs(&ctx, &cfg.mvm_mac, &cfg.gateway_mac).is_err()
    {
        return pass();
    }
    if ip.fragment {
        frag::first(&ip, vm_ifindex, rv.version);
    }
    count(counter::WORLD_REVERSE_NAT);
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(vm_ifindex, 0) as i32 }
}

/// Records (or refreshes, at most once a second) the connection `k` the world opened to host
/// port `host_port` (NBO) of the sandbox with `version`.
#[inline(always)]
fn track_portmap(k: &PortmapKey, version: u32, host_port: u16) {
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(p) = PORTMAP_SESSIONS.get_ptr_mut(k) {
        // SAFETY: valid map value pointer.
        unsafe {
            if (*p).version == version && (*p).host_port == host_port {
                if now.wrapping_sub((*p).access_ns) > 1_000_000_000 {
                    (*p).access_ns = now;
                }
                return;
            }
        }
    }
    let v = PortmapSession { access_ns: now, version, host_port, _pad: 0 };
    let _ = PORTMAP_SESSIONS.insert(k, &v, 0);
}
