//! `from_cube`: tcx ingress of every sandbox interface — everything a guest sends
//! (`reference/upstream.md §3.4`, with the changes of issue 3).
//!
//! 1. No registered sandbox on the interface → drop everything, ARP included (decision D25).
//! 2. A frame that carried a VLAN tag (taken off by the kernel before tc) → drop (decision R9).
//!    ARP → proxy; other non-IPv4 → drop; a GSO frame other than TCP with segments of 48 bytes
//!    or more → drop (decision R100); a checksum offload request for anything but the TCP/UDP
//!    checksum field → drop (decision R101).
//! 3. Source must be the guest address; every path below treats it as the sandbox's mvm IP
//!    (upstream rewrites it first; we rewrite the source once, to its final value, per path).
//! 4. To the gateway (169.254.68.5): ICMP echo (request or reply) and TCP non-SYN are DNATed
//!    to cube-dev and redirected into cube-dev ingress (replies to host-originated flows); the
//!    rest, ICMP errors included, dropped (decision R70).
//! 5. From a port-mapped guest port (no session): SYN dropped; packets of a connection the world
//!    opened to that host port (`portmap_sessions`, same sandbox version) are SNATed to the node
//!    address and host port (TCP fast path; UDP checks policy first); other TCP is dropped,
//!    other UDP classified like any new flow (decision D20).
//! 6. Fragments and protocols other than TCP, UDP, ICMP echo → drop; so is every destination
//!    in 0.0.0.0/8, 127.0.0.0/8, 224.0.0.0/4 or 255.255.255.255, whatever the policy (R47).
//! 7. To the node address: policy, then delivered to the host through cube-dev.
//! 8. Sessions: established flows follow their session; new flows are classified once
//!    (ALLOW_OUT > learned DNS answers > DENY_OUT > allow), SNATed and tracked; denied TCP
//!    gets a RST. UDP to port 53 that leaves this way is offered to the DNS learning hook.
//!
//! 9. A new flow of a sandbox holding its whole live-session budget is dropped and counted
//!    (`drop_session_quota`, decision Q1); its existing flows and other sandboxes are untouched.
//!    A sandbox holding its floor or more opens another only while the node-wide live
//!    sessions are under the ceiling that keeps every registered sandbox's floor free
//!    (`drop_node_sessions`, decision Q4).
//!
//! 10. A SYN that would open a connection to CubeEgress (a new L7 flow, or an L7 session's
//!     finished port reused) takes a token from its sandbox version's bucket
//!     (rate and burst in `new_flow_config`); an empty bucket drops it
//!     (`drop_new_flow_rate`, decision R91). Established flows and other classes take none.
//!
//! Every verdict after step 1 is also charged to the sandbox (`sandbox_stats`): forwarded
//! packets as `out`, drops by reason (`cubevs_common::stats`); ARP is not counted.

use aya_ebpf::{
    bindings::{BPF_F_INGRESS, TC_ACT_SHOT},
    helpers::{bpf_ktime_get_ns, generated::bpf_redirect},
    macros::classifier,
    programs::TcContext,
};
use cubevs_common::{
    DatapathConfig, MvmPort, NatSession, PortmapKey, SessionKey,
    conntrack::{
        CLASS_L7, Dir,
        flags::{ACK, FIN, RST, SYN},
        tcp, timeout, udp,
    },
    counter, ether, l7, proto,
    quota::COUNTED,
};

use crate::{
    arp, config, csum_offload, dns,
    forward::to_next_hop,
    maps::{
        EGRESS_SESSIONS, IFINDEX_TO_MVMMETA, LOCAL_PORT_MAPPING, LOCAL_PORT_MAPPING_UDP, PORTMAP_SESSIONS, count, node,
        sandbox_drop, sandbox_out,
    },
    nat, new_flow,
    packet::{
        self, ICMP_ECHO_REPLY, ICMP_ECHO_REQUEST, IP_DST_OFF, IP_SRC_OFF, Ipv4, L4, set_ip, set_port, tcp_seg_len,
    },
    policy, quota, rst, track,
};

#[classifier]
pub fn from_cube(ctx: TcContext) -> i32 {
    packet::ensure_linear(&ctx, ether::HDR_LEN + 60 + 20);
    // SAFETY: `skb` is the context pointer the kernel passed in.
    let ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    let cfg = config::get();
    // SAFETY: plain map lookup; the value is copied out.
    let Some((version, sandbox_ip)) = (unsafe { IFINDEX_TO_MVMMETA.get(&ifindex) }).map(|m| (m.version, m.ip)) else {
        return drop(ifindex, counter::CUBE_DROP_UNREGISTERED);
    };
    // The kernel took an 802.1Q/802.1ad tag off this frame before tc ran; forwarded, the skb
    // would leave the uplink tagged (VLAN hopping). A guest has no VLANs: drop (decision R9).
    // SAFETY: `skb` is the context pointer the kernel passed in.
    if unsafe { (*ctx.skb.skb).vlan_present } != 0 {
        return drop(ifindex, counter::CUBE_DROP_PROTO);
    }
    // A GSO frame the uplink would cut into more packets than the VMM charged for (R100).
    // SAFETY: `skb` is the context pointer the kernel passed in.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    match packet::ethertype(&ctx) {
        Some(ether::P_ARP) => {
            count(counter::CUBE_ARP);
            arp::proxy(&ctx, ifindex, cfg.gateway_mac)
        }
        Some(ether::P_IP) if gso_size != 0 && !tcp_gso_ok(&ctx, gso_size) => drop(ifindex, counter::CUBE_DROP_PROTO),
        // A checksum offload request pointing anywhere but the L4 checksum (R101).
        Some(ether::P_IP) if !packet::ipv4(&ctx).is_none_or(|ip| csum_offload::request_ok(&ctx, &ip)) => {
            drop(ifindex, counter::CUBE_DROP_PROTO)
        }
        Some(ether::P_IP) => ipv4(&ctx, &cfg, ifindex, version, sandbox_ip),
        Some(_) => drop(ifindex, counter::CUBE_DROP_PROTO),
        None => drop(ifindex, counter::CUBE_DROP_MALFORMED),
    }
}

/// Linux's smallest TCP send MSS (`TCP_MIN_SND_MSS`): its own stack never cuts a segment
/// smaller, so a guest kernel's TSO frames never ask for less.
const MIN_GSO_SIZE: u32 = 48;

/// True for a GSO frame (`gso_size` non-zero) the datapath may pass on: TCP, cut into segments
/// of at least [`MIN_GSO_SIZE`] bytes. The TAP writer chooses `gso_type` and `gso_size` in its
/// `virtio_net_hdr` whatever offloads the TAP announced; a device without the offload then
/// segments the frame in software, so a frame of 64 KiB with `gso_size` 1 left the uplink as
/// 65,535 one-byte segments, and UDP "fragmentation offload" as IPv4 fragments of 8 bytes
/// (which `from_cube` otherwise never forwards). The pool's TAPs announce TSO only, so no
/// honest guest sends UDP GSO (decision R100).
#[inline(always)]
fn tcp_gso_ok(ctx: &TcContext, gso_size: u32) -> bool {
    gso_size >= MIN_GSO_SIZE && packet::ipv4(ctx).is_some_and(|ip| ip.proto == proto::TCP)
}

/// Drops the packet: counts `reason` and charges it to the sandbox on `ifindex` (when it is a
/// per-sandbox drop reason).
#[inline(always)]
fn drop(ifindex: u32, reason: u32) -> i32 {
    count(reason);
    sandbox_drop(ifindex, reason);
    TC_ACT_SHOT
}

/// A packet of the sandbox on `ifindex` redirected by `verdict` (gateway, host): charged as
/// sent.
#[inline(always)]
fn sent(ctx: &TcContext, ifindex: u32, verdict: i32) -> i32 {
    sandbox_out(ifindex, ctx.len());
    verdict
}

/// Forwards the SNATed packet to its next hop; charges it to the sandbox as sent, or as a
/// `no_route` drop when the FIB has no route.
#[inline(always)]
fn forward(ctx: &TcContext, ifindex: u32, oif: u32, src: u32, dst: u32, l4_proto: u8) -> i32 {
    let len = ctx.len();
    let v = to_next_hop(ctx, oif, src, dst, l4_proto);
    if v == TC_ACT_SHOT {
        sandbox_drop(ifindex, counter::CUBE_DROP_FIB);
    } else {
        sandbox_out(ifindex, len);
    }
    v
}

#[inline(always)]
fn syn_only(flags: u8) -> bool {
    flags & (SYN | ACK | FIN | RST) == SYN
}

#[inline(always)]
fn ipv4(ctx: &TcContext, cfg: &DatapathConfig, ifindex: u32, version: u32, sandbox_ip: u32) -> i32 {
    let Some(ip) = packet::ipv4(ctx) else { return drop(ifindex, counter::CUBE_DROP_MALFORMED) };
    if ip.src != cfg.mvm_inner_ip {
        return drop(ifindex, counter::CUBE_DROP_SPOOF);
    }
    if ip.fragment || !matches!(ip.proto, proto::TCP | proto::UDP | proto::ICMP) {
        return drop(ifindex, counter::CUBE_DROP_PROTO);
    }
    if never_a_flow(ip.dst) {
        return drop(ifindex, counter::CUBE_DROP_PROTO);
    }
    let Some(l4) = packet::l4(ctx, &ip) else { return drop(ifindex, counter::CUBE_DROP_MALFORMED) };
    let guest_ip = ip.src;
    let node = node();
    if is_dns_query(&ip, &l4) && ip.dst != cfg.mvm_gateway_ip && ip.dst != node.uplink_ip {
        // Tail call to `dns_query`, which comes back here; returns only if it already ran.
        dns::enter(ctx, cubevs_common::dns::slot::QUERY);
    }

    if ip.dst == cfg.mvm_gateway_ip {
        // ICMP: echo only. An error would reach the node's own stack untranslated, where
        // Linux applies "fragmentation needed" about a quoted echo reply with no socket to
        // match: a guest set the node's path MTU towards any host (decision R70).
        let echo = l4.icmp_type == ICMP_ECHO_REQUEST || l4.icmp_type == ICMP_ECHO_REPLY;
        let ok = (ip.proto == proto::ICMP && echo) || (ip.proto == proto::TCP && !syn_only(l4.tcp_flags));
        if !ok
            || node.cube_dev_ifindex == 0
            || set_ip(ctx, &ip, IP_SRC_OFF, guest_ip, sandbox_ip).is_err()
            || set_ip(ctx, &ip, IP_DST_OFF, ip.dst, node.cube_dev_ip).is_err()
        {
            return drop(ifindex, counter::CUBE_DROP_GATEWAY);
        }
        count(counter::CUBE_GATEWAY);
        // SAFETY: plain helper call.
        return sent(ctx, ifindex, unsafe { bpf_redirect(node.cube_dev_ifindex, BPF_F_INGRESS as u64) } as i32);
    }

    if ip.proto == proto::ICMP && l4.icmp_type != ICMP_ECHO_REQUEST {
        return drop(ifindex, counter::CUBE_DROP_PROTO);
    }

    if ip.dst == node.uplink_ip && node.uplink_ip != 0 {
        if !policy::allowed(ifindex, ip.dst) {
            return deny(ctx, cfg, &ip, &l4, ifindex);
        }
        if set_ip(ctx, &ip, IP_SRC_OFF, guest_ip, sandbox_ip).is_err() {
            return drop(ifindex, counter::CUBE_DROP_MALFORMED);
        }
        count(counter::CUBE_HOST);
        // SAFETY: plain helper call.
        return sent(ctx, ifindex, unsafe { bpf_redirect(node.cube_dev_ifindex, BPF_F_INGRESS as u64) } as i32);
    }

    let key = SessionKey {
        src_ip: sandbox_ip,
        dst_ip: ip.dst,
        sport: l4.sport,
        dport: l4.dport,
        version,
        proto: ip.proto,
        _pad: [0; 3],
    };
    'existing: {
        if let Some(s) = EGRESS_SESSIONS.get_ptr_mut(&key) {
            // SAFETY: valid map value pointer.
            let state = unsafe { (*s).state };
            if ip.proto == proto::TCP {
                let reopen = syn_only(l4.tcp_flags) && track::is_reopen(state);
                if reopen {
                    // The guest reuses the port of a finished connection: a new connection, so
                    // the policy decides again. Denied now: gone. Its class changed (a rule made
                    // the address L7, or no longer): the old session goes and the SYN is
                    // classified as a new flow below (N10).
                    let class = policy::flow_class(ifindex, version, ip.dst, l4.dport, true);
                    let l7_now = class == policy::FLOW_L7 && l7::scheme_of(l4.dport) != 0 && node.cube_dev_ifindex != 0;
                    // SAFETY: valid map value pointer.
                    let sess = unsafe { *s };
                    if class == policy::FLOW_DENY {
                        nat::delete_session(&key, &sess);
                        return deny(ctx, cfg, &ip, &l4, ifindex);
                    }
                    if l7_now != (sess.packet_class == CLASS_L7) {
                        nat::delete_session(&key, &sess);
                        count(counter::CUBE_RECLASSIFIED);
                        break 'existing;
                    }
                    // A new connection to CubeEgress on a reused port costs the node a
                    // handshake like a new flow: it takes a token too (R91).
                    if l7_now && !new_flow::take(ifindex, version) {
                        return drop(ifindex, counter::CUBE_DROP_NEW_FLOW_RATE);
                    }
                }
                // A reopened port starts a new connection on the same SNAT port: the remote sees
                // the guest's own 4-tuple reused, which its TIME_WAIT accepts (D15).
                if !track::tcp_segment(s, Dir::Original, &ip, &l4, reopen) {
                    // The guest's own stack decides what its RST means; only our state is kept.
                    count(counter::CUBE_RST_OUT_OF_WINDOW);
                }
            }
            nat::touch(s);
            count(counter::CUBE_ESTABLISHED);
            // SAFETY: valid map value pointer.
            let sess = unsafe { *s };
            if sess.packet_class == CLASS_L7 {
                // The class was fixed when the flow began: it never switches midway.
                return steer(ctx, ifindex, &ip, guest_ip, sandbox_ip, sess.l7_scheme, node.cube_dev_ifindex);
            }
            return snat_out(ctx, ifindex, &ip, &l4, guest_ip, &sess);
        }
    }

    // No session: a reply from a port-mapped guest port? (Checked after the session lookup, so
    // established flows skip this lookup; sessions are never created from mapped ports.)
    if ip.proto != proto::ICMP {
        let mp = MvmPort { ifindex, listen_port: l4.sport, _pad: 0 };
        // SAFETY: plain map lookups; values are copied out.
        let host_port = unsafe {
            if ip.proto == proto::TCP { LOCAL_PORT_MAPPING.get(&mp) } else { LOCAL_PORT_MAPPING_UDP.get(&mp) }
        }
        .copied();
        if let Some(host_port) = host_port {
            if ip.proto == proto::TCP && syn_only(l4.tcp_flags) {
                return drop(ifindex, counter::CUBE_DROP_PORTMAP_SYN);
            }
            let pk = PortmapKey {
                ifindex,
                remote_ip: ip.dst,
                guest_port: l4.sport,
                remote_port: l4.dport,
                proto: ip.proto,
                _pad: [0; 3],
            };
            // SAFETY: plain map lookup; the value is copied out.
            if let Some(ps) = unsafe { PORTMAP_SESSIONS.get(&pk) }.copied() {
                if ps.version != version {
                    return drop(ifindex, counter::CUBE_DROP_PORTMAP_STALE);
                }
                let idle = if ip.proto == proto::TCP { timeout::TCP_ESTABLISHED } else { timeout::UDP_REPLIED };
                // SAFETY: helper without arguments.
                let fresh = unsafe { bpf_ktime_get_ns() }.wrapping_sub(ps.access_ns) <= idle;
                if fresh {
                    if ip.proto == proto::UDP && !policy::allowed(ifindex, ip.dst) {
                        return drop(ifindex, counter::CUBE_DENY);
                    }
                    if set_ip(ctx, &ip, IP_SRC_OFF, guest_ip, node.uplink_ip).is_err()
                        || set_port(ctx, &ip, true, l4.sport, host_port).is_err()
                    {
                        return drop(ifindex, counter::CUBE_DROP_MALFORMED);
                    }
                    count(counter::CUBE_PORTMAP_REPLY);
                    return forward(ctx, ifindex, node.uplink_ifindex, node.uplink_ip, ip.dst, ip.proto);
                }
            }
            // Not a connection the world opened to this host port. TCP: dropped, not answered
            // with a RST, so a live connection whose entry was evicted (LRU) survives: the
            // client's next segment re-records it. UDP: classified like any new flow below.
            if ip.proto == proto::TCP {
                return drop(ifindex, counter::CUBE_DROP_PORTMAP_UNTRACKED);
            }
        }
    }

    if ip.proto == proto::TCP && !syn_only(l4.tcp_flags) {
        count(counter::CUBE_NO_SESSION);
        sandbox_drop(ifindex, counter::CUBE_NO_SESSION);
        return rst::reply(ctx, cfg, &ip, &l4, ifindex);
    }
    let class = policy::flow_class(ifindex, version, ip.dst, l4.dport, ip.proto == proto::TCP);
    if class == policy::FLOW_DENY {
        return deny(ctx, cfg, &ip, &l4, ifindex);
    }
    // The sandbox's live-session budget (decision Q1) and the node-wide floor (Q4): checked
    // after policy, so a denied flow is a policy drop, never a quota one.
    if let Some(reason) = quota::admit(ifindex, version, cfg.session_budget) {
        return drop(ifindex, reason);
    }
    let counted = if cfg.session_budget != 0 { COUNTED } else { 0 };
    let scheme = l7::scheme_of(l4.dport);
    if class == policy::FLOW_L7 && ip.proto == proto::TCP && scheme != 0 && node.cube_dev_ifindex != 0 {
        // The sandbox's new connections to CubeEgress (R91): after the quota, so a SYN the
        // quota drops takes no token.
        if !new_flow::take(ifindex, version) {
            return drop(ifindex, counter::CUBE_DROP_NEW_FLOW_RATE);
        }
        let first = nat::FirstSeg { seen: 1, end: l4.seq.wrapping_add(tcp_seg_len(&ip, &l4)), win: l4.win as u32 };
        if nat::create_l7_session(&key, ifindex, node.cube_dev_ifindex, scheme, first, counted).is_none() {
            return drop(ifindex, counter::CUBE_DROP_NO_SNAT);
        }
        count(counter::CUBE_L7_NEW);
        return steer(ctx, ifindex, &ip, guest_ip, sandbox_ip, scheme, node.cube_dev_ifindex);
    }
    let (state, first) = if ip.proto == proto::TCP {
        (tcp::SYN_SENT, nat::FirstSeg { seen: 1, end: l4.seq.wrapping_add(tcp_seg_len(&ip, &l4)), win: l4.win as u32 })
    } else {
        (udp::UNREPLIED, nat::FirstSeg { seen: 0, end: 0, win: 0 })
    };
    let Some(sess) = nat::create_session(&key, ifindex, state, first, counted) else {
        return drop(ifindex, counter::CUBE_DROP_NO_SNAT);
    };
    count(counter::CUBE_NEW_SESSION);
    snat_out(ctx, ifindex, &ip, &l4, guest_ip, &sess)
}

/// True for a destination (NBO) no sandbox flow may have, whatever its policy allows (decision
/// R47): "this network" 0.0.0.0/8 and loopback 127.0.0.0/8 (never valid off a host, RFC 1122),
/// multicast 224.0.0.0/4 and the limited broadcast 255.255.255.255. With IPv4 forwarding on,
/// `bpf_fib_lookup` resolves multicast and the limited broadcast by the default route, so they
/// left the uplink to the node's router as the node (RIP to 224.0.0.9, DHCP to the broadcast).
#[inline(always)]
fn never_a_flow(dst: u32) -> bool {
    let first = dst.to_ne_bytes()[0];
    first == 0 || first == 127 || (224..=239).contains(&first) || dst == u32::MAX
}

/// UDP to port 53 (not to the gateway or the node): a DNS query for the learning hook.
#[inline(always)]
fn is_dns_query(ip: &Ipv4, l4: &L4) -> bool {
    ip.proto == proto::UDP && l4.dport == cubevs_common::dns::SERVER_PORT.to_be()
}

#[inline(always)]
fn deny(ctx: &TcContext, cfg: &DatapathConfig, ip: &Ipv4, l4: &L4, ifindex: u32) -> i32 {
    count(counter::CUBE_DENY);
    sandbox_drop(ifindex, counter::CUBE_DENY);
    if ip.proto == proto::TCP { rst::reply(ctx, cfg, ip, l4, ifindex) } else { TC_ACT_SHOT }
}

/// Sends a packet of an L7 flow to CubeEgress: source rewritten to the sandbox IP (the
/// gateway keys its policy on it), `skb->mark` set to the scheme's mark under the mask
/// (other mark bits kept), frame otherwise unchanged (its destination MAC is already
/// cube-dev's), redirected into cube-dev's ingress where TPROXY picks it up.
#[inline(always)]
fn steer(ctx: &TcContext, ifindex: u32, ip: &Ipv4, guest_ip: u32, sandbox_ip: u32, scheme: u8, cube_dev: u32) -> i32 {
    if cube_dev == 0 || set_ip(ctx, ip, IP_SRC_OFF, guest_ip, sandbox_ip).is_err() {
        return drop(ifindex, counter::CUBE_DROP_MALFORMED);
    }
    // Volatile 32-bit accesses: LLVM otherwise narrows the masked update to a 2-byte store,
    // which the verifier refuses on `__sk_buff.mark`.
    // SAFETY: `skb` is the context pointer the kernel passed in; `mark` is writable by TC.
    unsafe {
        let p = core::ptr::addr_of_mut!((*ctx.skb.skb).mark);
        let mark = core::ptr::read_volatile(p);
        core::ptr::write_volatile(p, (mark & !l7::MARK_MASK) | l7::mark_of(scheme));
    }
    count(counter::CUBE_L7_STEERED);
    // SAFETY: plain helper call.
    sent(ctx, ifindex, unsafe { bpf_redirect(cube_dev, BPF_F_INGRESS as u64) as i32 })
}

#[inline(always)]
fn snat_out(ctx: &TcContext, ifindex: u32, ip: &Ipv4, l4: &L4, guest_ip: u32, s: &NatSession) -> i32 {
    if set_ip(ctx, ip, IP_SRC_OFF, guest_ip, s.node_ip).is_err()
        || set_port(ctx, ip, true, l4.sport, s.node_port).is_err()
    {
        return drop(ifindex, counter::CUBE_DROP_MALFORMED);
    }
    forward(ctx, ifindex, s.node_ifindex, s.node_ip, ip.dst, ip.proto)
}
