//! `from_world`: tcx ingress of the uplink (`reference/upstream.md §3.6`).
//!
//! Host-port DNAT (TCP and UDP) to `169.254.68.6:<guest port>` on the sandbox interface;
//! reverse NAT of sessions (TCP, UDP, ICMP echo reply) with conntrack update; everything
//! else continues into the host stack untouched. Session replies from UDP port 53 are
//! offered to the DNS learning hook first.

use aya_ebpf::{bindings::TC_ACT_OK, helpers::generated::bpf_redirect, macros::classifier, programs::TcContext};
use cubevs_common::{
    SessionKey,
    conntrack::{Dir, tcp_step, udp},
    counter, ether, proto,
};

use crate::{
    config, dns,
    maps::{EGRESS_SESSIONS, INGRESS_SESSIONS, REMOTE_PORT_MAPPING, REMOTE_PORT_MAPPING_UDP, count, node},
    nat,
    packet::{self, ICMP_ECHO_REPLY, IP_DST_OFF, set_ip, set_macs, set_port},
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
    if ip.fragment {
        return pass();
    }
    let Some(l4) = packet::l4(&ctx, &ip) else { return pass() };
    let cfg = config::get();
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
    let vm_ifindex = unsafe {
        if ip.proto == proto::TCP {
            let st = tcp_step((*s).state, (*s).close_dir, (*s).active_close, Dir::Reply, l4.tcp_flags);
            (*s).state = st.state;
            (*s).close_dir = st.close_dir;
            (*s).active_close = st.active_close;
        } else if (*s).state != udp::REPLIED {
            (*s).state = udp::REPLIED;
        }
        (*s).vm_ifindex
    };
    nat::touch(s);
    if set_ip(&ctx, &ip, IP_DST_OFF, ip.dst, cfg.mvm_inner_ip).is_err()
        || set_port(&ctx, &ip, false, our_port, rv.vm_port).is_err()
        || set_macs(&ctx, &cfg.mvm_mac, &cfg.gateway_mac).is_err()
    {
        return pass();
    }
    count(counter::WORLD_REVERSE_NAT);
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(vm_ifindex, 0) as i32 }
}
