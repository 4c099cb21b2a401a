//! DNS learning hooks (`reference/upstream.md §3.8`; parser in `cubevs_common::dns`).
//!
//! - [`on_query`] (from `from_cube`, UDP to port 53 that policy lets through): a standard
//!   IN A query whose name matches one of the sandbox's FQDN patterns (active policy
//!   generation) is tracked in `dns_query_track` under {ifindex, server, guest port, id,
//!   version} with the pattern's ports, for [`QUERY_TIMEOUT_NS`].
//! - [`on_response`] (from `from_world`, UDP from port 53 that matched a live session, after
//!   the reverse-NAT lookups): the tracked query with this server, guest port and id must
//!   exist, be unexpired and have the same question; then every IN A answer becomes
//!   `dns_learned` entries {ifindex, ip, port} (port 0 = any) expiring after
//!   clamp(TTL, floor, cap). The track entry is consumed.
//!
//! Neither hook ever changes the packet's verdict: DNS itself is decided by the CIDR policy
//! before the query hook runs and the response follows its session. No tail calls.

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{bpf_ktime_get_ns, generated::bpf_skb_load_bytes},
    programs::TcContext,
};
use cubevs_common::{
    counter,
    dns::{
        self, DnsAllowKey, DnsAllowValue, DnsQueryKey, DnsQueryValue, LearnedKey, LearnedValue, MSG_WINDOW,
        QUERY_TIMEOUT_NS, Reject, Scratch, flags,
    },
};

use crate::{
    maps::{DNS_ALLOW, DNS_LEARNED, DNS_QUERY_TRACK, DNS_SCRATCH, count},
    packet::Ipv4,
    policy,
};

/// Copies the UDP payload of `ip` (up to [`MSG_WINDOW`] bytes) into the per-CPU scratch.
/// Returns the scratch and the copied length.
#[inline(always)]
fn load(ctx: &TcContext, ip: &Ipv4) -> Option<(*mut Scratch, usize)> {
    let s = DNS_SCRATCH.get_ptr_mut(0)?;
    let off = ip.l4_off + 8;
    let udp_payload = (ip.tot_len as usize).checked_sub(ip.ihl + 8)?;
    let in_skb = (ctx.len() as usize).checked_sub(off)?;
    let mut n = if udp_payload < in_skb { udp_payload } else { in_skb };
    if n > MSG_WINDOW {
        n = MSG_WINDOW;
    }
    if n == 0 {
        return None;
    }
    // SAFETY: `s` is a valid per-CPU map value of MSG_WINDOW + … bytes and 0 < n ≤ MSG_WINDOW.
    let r = unsafe { bpf_skb_load_bytes(ctx.skb.skb as *const _, off as u32, (*s).msg.as_mut_ptr().cast(), n as u32) };
    if r != 0 {
        return None;
    }
    Some((s, n))
}

/// Tracks a guest DNS query when its name is allowed (see the module docs). `server` is the
/// destination address (NBO), `guest_port` the guest's source port (NBO).
#[inline(always)]
pub fn on_query(ctx: &TcContext, ip: &Ipv4, ifindex: u32, version: u32, guest_port: u16) {
    let Some(generation) = policy::generation(ifindex) else {
        count(counter::DNS_QUERY_NO_POLICY);
        return;
    };
    let Some((s, len)) = load(ctx, ip) else {
        count(counter::DNS_QUERY_UNPARSED);
        return;
    };
    // SAFETY: valid per-CPU map value; nothing else on this CPU touches it meanwhile.
    let s = unsafe { &mut *s };
    let mut found: Option<DnsAllowValue> = None;
    let q = dns::parse_query(s, len, |hash, subdomains| {
        let key = DnsAllowKey { ifindex, generation, name_hash: hash, subdomains: subdomains as u8, _pad: [0; 7] };
        // SAFETY: plain map lookup; the value is copied out.
        if let Some(v) = unsafe { DNS_ALLOW.get(&key) } {
            // Longer suffixes come later: the most specific pattern wins.
            found = Some(*v);
        }
        true
    });
    let q = match q {
        Ok(q) => q,
        Err(Reject::NotStandard | Reject::Malformed) => {
            count(counter::DNS_QUERY_UNPARSED);
            return;
        }
    };
    let Some(allow) = found else {
        count(counter::DNS_QUERY_NOT_ALLOWED);
        return;
    };
    let key = DnsQueryKey { ifindex, server_ip: ip.dst, guest_port, id: q.id, version };
    let v = DnsQueryValue {
        // SAFETY: helper without arguments.
        expires_ns: unsafe { bpf_ktime_get_ns() } + QUERY_TIMEOUT_NS,
        name_hash: q.name_hash,
        allow,
        _pad: 0,
    };
    if DNS_QUERY_TRACK.insert(&key, &v, BPF_ANY as u64).is_ok() {
        count(counter::DNS_QUERY_TRACKED);
    }
}

/// Learns the answers of a response to a tracked query (see the module docs). `server` is
/// the response's source address (NBO); `vm_ifindex`, `guest_port` (NBO) and `version` come
/// from the session the response matched.
#[inline(always)]
pub fn on_response(ctx: &TcContext, ip: &Ipv4, vm_ifindex: u32, guest_port: u16, version: u32) {
    let Some((s, len)) = load(ctx, ip) else {
        count(counter::DNS_RESP_UNPARSED);
        return;
    };
    // SAFETY: valid per-CPU map value; nothing else on this CPU touches it meanwhile.
    let s = unsafe { &mut *s };
    let Ok(h) = dns::header(s, len) else {
        count(counter::DNS_RESP_UNPARSED);
        return;
    };
    let key = DnsQueryKey { ifindex: vm_ifindex, server_ip: ip.src, guest_port, id: h.id, version };
    // SAFETY: plain map lookup; the value is copied out.
    let Some(tracked) = (unsafe { DNS_QUERY_TRACK.get(&key) }).copied() else {
        count(counter::DNS_RESP_UNSOLICITED);
        return;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if tracked.expires_ns <= now {
        let _ = DNS_QUERY_TRACK.remove(&key);
        count(counter::DNS_RESP_UNSOLICITED);
        return;
    }
    let (h, qhash, pos) = match dns::response_question(s, len) {
        Ok(r) => r,
        Err(_) => {
            count(counter::DNS_RESP_MISMATCH);
            return;
        }
    };
    if qhash != tracked.name_hash {
        // Same id, another question: not the answer to our query. The query stays tracked.
        count(counter::DNS_RESP_MISMATCH);
        return;
    }
    // One response per query.
    let _ = DNS_QUERY_TRACK.remove(&key);
    if h.flags & flags::RCODE != 0 {
        count(counter::DNS_RESP_RCODE);
        return;
    }
    if h.flags & flags::TC != 0 {
        count(counter::DNS_RESP_TRUNCATED);
    }
    let allow = tracked.allow;
    let w = dns::walk_answers(s, len, pos, h.ancount, |addr, ttl| {
        let value = LearnedValue { expires_ns: now + dns::learned_lifetime_ns(ttl), version, flags: 0 };
        let n = allow.port_count as usize;
        if n == 0 {
            learn(vm_ifindex, addr, 0, &value);
            return;
        }
        let mut i = 0;
        while i < dns::MAX_PORTS {
            if i >= n {
                break;
            }
            learn(vm_ifindex, addr, allow.ports[i], &value);
            i += 1;
        }
    });
    if w.not_walked != 0 {
        count(counter::DNS_NOT_WALKED);
    }
}

#[inline(always)]
fn learn(ifindex: u32, ip: u32, port: u16, v: &LearnedValue) {
    let key = LearnedKey { ifindex, ip, port, _pad: 0 };
    // A renewal never shortens an entry: keep the later expiry.
    // SAFETY: plain map lookup; the value is copied out.
    if let Some(old) = unsafe { DNS_LEARNED.get(&key) }
        && old.version == v.version
        && old.expires_ns > v.expires_ns
    {
        count(counter::DNS_RESP_LEARNED);
        return;
    }
    if DNS_LEARNED.insert(&key, v, BPF_ANY as u64).is_ok() {
        count(counter::DNS_RESP_LEARNED);
    } else {
        count(counter::DNS_LEARN_FULL);
    }
}

/// True when a learned entry of `ifindex` (sandbox `version`) lets a new flow reach `daddr`
/// (NBO) on `dport` (NBO; 0 for ICMP): an entry for that port or for every port, unexpired.
#[inline(always)]
pub fn learned_allows(ifindex: u32, version: u32, daddr: u32, dport: u16) -> bool {
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let ok = |port: u16| {
        let key = LearnedKey { ifindex, ip: daddr, port, _pad: 0 };
        // SAFETY: plain map lookup; fields copied out.
        match unsafe { DNS_LEARNED.get(&key) } {
            Some(v) => v.version == version && v.expires_ns > now,
            None => false,
        }
    };
    (dport != 0 && ok(dport)) || ok(0)
}
