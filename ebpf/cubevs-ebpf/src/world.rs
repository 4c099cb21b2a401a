//! The reverse path from the world shared by `from_world` (TC) and `xdp_world` (XDP):
//! host-port DNAT and reverse NAT of sessions, with every map update, state transition and
//! check the TC path has always done (decisions D19, D20, D21, D26, X1). The callers decide
//! what the outcomes mean for their hook (TC verdicts vs XDP actions) and count the pass
//! cases; drops and redirects are counted here (node counters and the sandbox's
//! `sandbox_stats`: what it delivers as `in`, an RST outside the window as its drop), so both
//! hooks leave the same counters.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use cubevs_common::{
    DatapathConfig, PortmapKey, PortmapSession, SessionKey,
    conntrack::{
        Dir,
        flags::{ACK, FIN, RST, SYN},
        timeout, udp,
    },
    counter, proto,
};

use crate::{
    maps::{
        EGRESS_SESSIONS, HOST_PORT_RELEASED, IFINDEX_TO_MVMMETA, INGRESS_SESSIONS, MVMIP_TO_IFINDEX, PORTMAP_SESSIONS,
        REMOTE_PORT_MAPPING, REMOTE_PORT_MAPPING_UDP, count, node, sandbox_drop, sandbox_in,
    },
    nat,
    packet::{Frame, IP_DST_OFF, Ipv4, L4, set_ip, set_macs, set_port},
    track,
};

/// What the shared reverse path did with a frame.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Not for this path (no host-port mapping / no reverse session): frame untouched.
    NotOurs,
    /// A host-port DNAT frame that did not arrive on the registered uplink: untouched.
    WrongDevice,
    /// A reverse session without its egress half (being deleted): untouched.
    NoSession,
    /// Must be dropped (counted): stale sandbox version, RST outside the window, host port
    /// of an unregistered sandbox.
    Drop,
    /// A rewrite failed after the session was updated: the frame may be half rewritten.
    Failed,
    /// Rewritten for the sandbox: redirect to `ifindex`; `version` is the session's sandbox
    /// version (for the fragment table).
    Redirect {
        /// Sandbox interface.
        ifindex: u32,
        /// Sandbox version the frame was accepted for.
        version: u32,
    },
}

/// Host-port DNAT: a TCP/UDP frame to the uplink address whose destination port is a mapped
/// host port goes to `169.254.68.6:<guest port>` on the sandbox interface, when it arrived on
/// the registered uplink (`ingress_ifindex`) from a source a world host may have (R63, else
/// dropped and counted `drop_to_sandbox`). Records the connection in `portmap_sessions`; a
/// TCP segment of a connection recorded for the interface's previous sandbox version, or of
/// an unrecorded connection while the host port was released less than D20's ESTABLISHED
/// timeout ago, is dropped (`drop_stale_version`, R73, R74).
#[inline(always)]
pub fn host_port<C: Frame>(ctx: &C, ip: &Ipv4, l4: &L4, cfg: &DatapathConfig, ingress_ifindex: u32) -> Outcome {
    let node = node();
    if ip.dst != node.uplink_ip || (ip.proto != proto::TCP && ip.proto != proto::UDP) {
        return Outcome::NotOurs;
    }
    // SAFETY: plain map lookups; values are copied out.
    let mapped = unsafe {
        if ip.proto == proto::TCP { REMOTE_PORT_MAPPING.get(&l4.dport) } else { REMOTE_PORT_MAPPING_UDP.get(&l4.dport) }
    }
    .copied();
    let Some(mp) = mapped else { return Outcome::NotOurs };
    if ingress_ifindex != node.uplink_ifindex {
        return Outcome::WrongDevice;
    }
    if !world_source(ip.src, cfg, node.uplink_ip, node.cube_dev_ip) {
        count(counter::WORLD_DROP_TO_SANDBOX);
        return Outcome::Drop;
    }
    // SAFETY: plain map lookup; one field copied out.
    let Some(version) = (unsafe { IFINDEX_TO_MVMMETA.get(&mp.ifindex) }).map(|m| m.version) else {
        count(counter::WORLD_DROP_PORTMAP_UNREGISTERED);
        return Outcome::Drop;
    };
    let opens = ip.proto != proto::TCP || l4.tcp_flags & (SYN | ACK | FIN | RST) == SYN;
    let tracked = track_portmap(
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
        opens,
    );
    if !tracked {
        count(counter::WORLD_DROP_STALE_VERSION);
        return Outcome::Drop;
    }
    if set_ip(ctx, ip, IP_DST_OFF, ip.dst, cfg.mvm_inner_ip).is_err()
        || set_port(ctx, ip, false, l4.dport, mp.listen_port).is_err()
        || set_macs(ctx, &cfg.mvm_mac, &cfg.gateway_mac).is_err()
    {
        return Outcome::Failed;
    }
    count(counter::WORLD_PORTMAP);
    sandbox_in(mp.ifindex, ctx.wire_len());
    Outcome::Redirect { ifindex: mp.ifindex, version }
}

/// True when `src` (NBO) may be the source of a world frame to a host port (decision R63).
/// Not: the guest link's addresses (the gateway 169.254.68.5, which a guest takes for the
/// host, and its own 169.254.68.6), a registered sandbox's mvm IP, the node's uplink or
/// cube-dev address, and the sources the kernel itself calls martian (0/8, 127/8, 224/4,
/// 240/4, the limited broadcast). The DNAT redirects straight into the TAP, past the host's
/// martian and reverse-path checks, so a host on the uplink's segment spoofing the gateway
/// reached the guest as its host.
#[inline(always)]
fn world_source(src: u32, cfg: &DatapathConfig, uplink_ip: u32, cube_dev_ip: u32) -> bool {
    let first = src.to_ne_bytes()[0];
    if first == 0 || first == 127 || first >= 224 {
        return false;
    }
    if src == cfg.mvm_gateway_ip || src == cfg.mvm_inner_ip || src == uplink_ip || src == cube_dev_ip {
        return false;
    }
    MVMIP_TO_IFINDEX.get_ptr(&src).is_none()
}

/// Reverse NAT of a session reply (TCP, UDP, or ICMP echo reply: the echo id is in
/// `l4.sport`): conntrack update, destination rewritten to the sandbox's inner address and
/// port. Drops replies of a session whose sandbox version is no longer the one registered on
/// its interface, and RSTs outside the tracked window.
#[inline(always)]
pub fn reverse<C: Frame>(ctx: &C, ip: &Ipv4, l4: &L4, cfg: &DatapathConfig) -> Outcome {
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
    let Some(rv) = (unsafe { INGRESS_SESSIONS.get(&rkey) }).copied() else { return Outcome::NotOurs };
    let ekey = SessionKey {
        src_ip: rv.vm_ip,
        dst_ip: ip.src,
        sport: rv.vm_port,
        dport: remote_port,
        version: rv.version,
        proto: ip.proto,
        _pad: [0; 3],
    };
    let Some(s) = EGRESS_SESSIONS.get_ptr_mut(&ekey) else { return Outcome::NoSession };
    // SAFETY: valid map value pointer.
    let vm_ifindex = unsafe { (*s).vm_ifindex };
    // The session must belong to the sandbox registered on its interface now: a released or
    // reused TAP never receives the replies of its previous owner's flows.
    // SAFETY: plain map lookup; two fields copied out.
    let current = unsafe { IFINDEX_TO_MVMMETA.get(&vm_ifindex) }.map(|m| (m.version, m.ip));
    if current != Some((rv.version, rv.vm_ip)) {
        count(counter::WORLD_DROP_STALE_VERSION);
        return Outcome::Drop;
    }
    if ip.proto == proto::TCP {
        if !track::tcp_segment(s, Dir::Reply, ip, l4, false) {
            count(counter::WORLD_DROP_RST_WINDOW);
            sandbox_drop(vm_ifindex, counter::WORLD_DROP_RST_WINDOW);
            return Outcome::Drop;
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
    if set_ip(ctx, ip, IP_DST_OFF, ip.dst, cfg.mvm_inner_ip).is_err()
        || set_port(ctx, ip, false, our_port, rv.vm_port).is_err()
        || set_macs(ctx, &cfg.mvm_mac, &cfg.gateway_mac).is_err()
    {
        return Outcome::Failed;
    }
    count(counter::WORLD_REVERSE_NAT);
    sandbox_in(vm_ifindex, ctx.wire_len());
    Outcome::Redirect { ifindex: vm_ifindex, version: rv.version }
}

/// Records (or refreshes, at most once a second) the connection `k` the world opened to host
/// port `host_port` (NBO) of the sandbox with `version`. `opens`: the frame may start a
/// connection (a TCP SYN without ACK/FIN/RST, or UDP). Returns false, recording nothing, for a
/// TCP segment that does not open one while `k` is recorded for another sandbox version: a
/// connection the port's previous owner on this interface accepted, which the next owner must
/// neither read nor answer (decision R73); and for one while `k` is not recorded at all and
/// `host_port` was released (`host_port_released`) less than the ESTABLISHED timeout ago:
/// possibly a connection of the port's previous owner on another interface (decision R74).
/// Only TCP reaches that check (`opens` is true for UDP), and only a segment without an entry,
/// so established connections with an entry take no extra lookup.
#[inline(always)]
fn track_portmap(k: &PortmapKey, version: u32, host_port: u16, opens: bool) -> bool {
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(p) = PORTMAP_SESSIONS.get_ptr_mut(k) else {
        if !opens && released_recently(host_port, now) {
            return false;
        }
        let v = PortmapSession { access_ns: now, version, host_port, _pad: 0 };
        let _ = PORTMAP_SESSIONS.insert(k, &v, 0);
        return true;
    };
    // SAFETY: valid map value pointer.
    unsafe {
        if (*p).version == version && (*p).host_port == host_port {
            if now.wrapping_sub((*p).access_ns) > 1_000_000_000 {
                (*p).access_ns = now;
            }
            return true;
        }
        if !opens && (*p).version != version {
            return false;
        }
    }
    let v = PortmapSession { access_ns: now, version, host_port, _pad: 0 };
    let _ = PORTMAP_SESSIONS.insert(k, &v, 0);
    true
}

/// True when TCP `host_port` (NBO) was released less than
/// [`timeout::TCP_ESTABLISHED`] before `now` (CLOCK_MONOTONIC ns), per `host_port_released`
/// (decision R74). A release stamped after `now` (written between this packet's clock read
/// and its lookup) counts as recent.
#[inline(always)]
fn released_recently(host_port: u16, now: u64) -> bool {
    // SAFETY: plain map lookup; the value is copied out.
    match unsafe { HOST_PORT_RELEASED.get(&host_port) } {
        Some(&at) => at > now || now - at < timeout::TCP_ESTABLISHED,
        None => false,
    }
}
