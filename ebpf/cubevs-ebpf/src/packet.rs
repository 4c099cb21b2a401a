//! Packet access helpers: header parsing with bounds checks, field rewrites with incremental
//! checksum updates (`bpf_l3_csum_replace` / `bpf_l4_csum_replace`, which also handle
//! CHECKSUM_PARTIAL and GSO skbs), MAC rewrites and full checksums for synthesized headers.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use cubevs_common::{ether, proto};

/// Offset of the IPv4 header.
pub const IP_OFF: usize = ether::HDR_LEN;
/// Offset of the IPv4 source address.
pub const IP_SRC_OFF: usize = IP_OFF + 12;
/// Offset of the IPv4 destination address.
pub const IP_DST_OFF: usize = IP_OFF + 16;

/// The fields of an Ethernet/IPv4 frame the programs decide on, copied out of the packet.
#[derive(Clone, Copy)]
pub struct Ipv4 {
    /// Source address (NBO).
    pub src: u32,
    /// Destination address (NBO).
    pub dst: u32,
    /// IP protocol.
    pub proto: u8,
    /// Offset of the L4 header.
    pub l4_off: usize,
    /// Fragment (MF set or non-zero offset).
    pub fragment: bool,
    /// A fragment other than the first (non-zero offset): no L4 header.
    pub later_fragment: bool,
    /// Total length from the IP header.
    pub tot_len: u16,
    /// Header length in bytes.
    pub ihl: usize,
    /// IP identification (NBO).
    pub id: u16,
}

/// L4 fields: ports (NBO; ICMP: echo id in `sport`, 0 in `dport`), TCP flags, ICMP type.
#[derive(Clone, Copy)]
pub struct L4 {
    /// Source port or ICMP echo id (NBO).
    pub sport: u16,
    /// Destination port (NBO), 0 for ICMP.
    pub dport: u16,
    /// TCP flags byte (0 for others).
    pub tcp_flags: u8,
    /// ICMP type (0 for others).
    pub icmp_type: u8,
    /// TCP data offset in bytes (0 for others).
    pub tcp_hlen: usize,
    /// TCP sequence number, host order (0 for others).
    pub seq: u32,
    /// TCP acknowledgment number, host order (0 for others).
    pub ack: u32,
    /// TCP raw window, host order (0 for others).
    pub win: u16,
}

/// ICMP echo request type.
pub const ICMP_ECHO_REQUEST: u8 = 8;
/// ICMP echo reply type.
pub const ICMP_ECHO_REPLY: u8 = 0;

/// Makes at least `len` bytes (or the whole packet, if shorter) directly readable; a helper
/// call only when the linear part is actually short (non-linear GSO skbs).
#[inline(always)]
pub fn ensure_linear(ctx: &TcContext, len: usize) {
    let want = if (ctx.len() as usize) < len { ctx.len() as usize } else { len };
    if ctx.data() + want > ctx.data_end() {
        let _ = ctx.pull_data(want as u32);
    }
}

#[inline(always)]
fn ptr_at<T>(ctx: &TcContext, off: usize) -> Option<*const T> {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some((start + off) as *const T)
}

/// EtherType of the frame (host order), `None` when shorter than an Ethernet header.
#[inline(always)]
pub fn ethertype(ctx: &TcContext) -> Option<u16> {
    let p = ptr_at::<[u8; 2]>(ctx, 12)?;
    // SAFETY: bounds checked by ptr_at.
    Some(u16::from_be_bytes(unsafe { *p }))
}

/// Parses the IPv4 header (caller checked the EtherType).
#[inline(always)]
pub fn ipv4(ctx: &TcContext) -> Option<Ipv4> {
    let h = ptr_at::<[u8; 20]>(ctx, IP_OFF)?;
    // SAFETY: bounds checked by ptr_at.
    let h = unsafe { &*h };
    if h[0] >> 4 != 4 {
        return None;
    }
    let ihl = ((h[0] & 0x0f) as usize) * 4;
    if ihl < 20 {
        return None;
    }
    let frag = u16::from_be_bytes([h[6], h[7]]);
    Some(Ipv4 {
        src: u32::from_ne_bytes([h[12], h[13], h[14], h[15]]),
        dst: u32::from_ne_bytes([h[16], h[17], h[18], h[19]]),
        proto: h[9],
        l4_off: IP_OFF + ihl,
        fragment: frag & 0x3fff != 0,
        later_fragment: frag & 0x1fff != 0,
        tot_len: u16::from_be_bytes([h[2], h[3]]),
        ihl,
        id: u16::from_ne_bytes([h[4], h[5]]),
    })
}

/// Parses the L4 header of `ip` (TCP, UDP or ICMP); `None` if truncated or another protocol.
#[inline(always)]
pub fn l4(ctx: &TcContext, ip: &Ipv4) -> Option<L4> {
    let off = ip.l4_off;
    if off > 14 + 60 {
        return None;
    }
    match ip.proto {
        proto::TCP => {
            let t = ptr_at::<[u8; 20]>(ctx, off)?;
            // SAFETY: bounds checked by ptr_at.
            let t = unsafe { &*t };
            Some(L4 {
                sport: u16::from_ne_bytes([t[0], t[1]]),
                dport: u16::from_ne_bytes([t[2], t[3]]),
                tcp_flags: t[13],
                icmp_type: 0,
                tcp_hlen: ((t[12] >> 4) as usize) * 4,
                seq: u32::from_be_bytes([t[4], t[5], t[6], t[7]]),
                ack: u32::from_be_bytes([t[8], t[9], t[10], t[11]]),
                win: u16::from_be_bytes([t[14], t[15]]),
            })
        }
        proto::UDP => {
            let u = ptr_at::<[u8; 8]>(ctx, off)?;
            // SAFETY: bounds checked by ptr_at.
            let u = unsafe { &*u };
            Some(L4 {
                sport: u16::from_ne_bytes([u[0], u[1]]),
                dport: u16::from_ne_bytes([u[2], u[3]]),
                tcp_flags: 0,
                icmp_type: 0,
                tcp_hlen: 0,
                seq: 0,
                ack: 0,
                win: 0,
            })
        }
        proto::ICMP => {
            let i = ptr_at::<[u8; 8]>(ctx, off)?;
            // SAFETY: bounds checked by ptr_at.
            let i = unsafe { &*i };
            Some(L4 {
                sport: u16::from_ne_bytes([i[4], i[5]]),
                dport: 0,
                tcp_flags: 0,
                icmp_type: i[0],
                tcp_hlen: 0,
                seq: 0,
                ack: 0,
                win: 0,
            })
        }
        _ => None,
    }
}

/// Sequence space a TCP segment occupies: payload bytes, plus one each for SYN and FIN.
#[inline(always)]
pub fn tcp_seg_len(ip: &Ipv4, l4: &L4) -> u32 {
    let hdrs = ip.ihl as u32 + l4.tcp_hlen as u32;
    let tot = ip.tot_len as u32;
    let mut n = tot.saturating_sub(hdrs);
    if l4.tcp_flags & 0x02 != 0 {
        n += 1;
    }
    if l4.tcp_flags & 0x01 != 0 {
        n += 1;
    }
    n
}

/// Offset of the L4 checksum for `proto` relative to the L4 header.
#[inline(always)]
fn l4_csum_off(proto: u8) -> usize {
    match proto {
        proto::TCP => 16,
        proto::UDP => 6,
        _ => 2,
    }
}

/// Flags for `bpf_l4_csum_replace` of a pseudo-header field of `proto` (UDP zero checksum
/// stays zero).
#[inline(always)]
fn pseudo_flags(proto: u8) -> u64 {
    let mut f = BPF_F_PSEUDO_HDR as u64 | 4;
    if proto == proto::UDP {
        f |= BPF_F_MARK_MANGLED_0 as u64;
    }
    f
}

#[inline(always)]
fn ptr_mut<T>(ctx: &TcContext, off: usize) -> Option<*mut T> {
    ptr_at::<T>(ctx, off).map(|p| p as *mut T)
}

/// RFC 1624 incremental update of a 16-bit one's-complement checksum (`csum`, wire bytes)
/// for a 16-bit field changing from `old` to `new` (wire bytes).
#[inline(always)]
pub fn csum_replace2(csum: [u8; 2], old: [u8; 2], new: [u8; 2]) -> [u8; 2] {
    let mut sum = !u16::from_be_bytes(csum) as u32;
    sum += !u16::from_be_bytes(old) as u32;
    sum += u16::from_be_bytes(new) as u32;
    csum_fold(sum).to_be_bytes()
}

/// RFC 1624 incremental update of a 16-bit one's-complement checksum (`csum`, wire bytes)
/// for a 32-bit field changing from `old` to `new` (wire bytes).
#[inline(always)]
pub fn csum_replace4(csum: [u8; 2], old: [u8; 4], new: [u8; 4]) -> [u8; 2] {
    let mut sum = !u16::from_be_bytes(csum) as u32;
    sum += !u16::from_be_bytes([old[0], old[1]]) as u32;
    sum += !u16::from_be_bytes([old[2], old[3]]) as u32;
    sum += u16::from_be_bytes([new[0], new[1]]) as u32;
    sum += u16::from_be_bytes([new[2], new[3]]) as u32;
    csum_fold(sum).to_be_bytes()
}

/// Rewrites the IPv4 address at `addr_off` (IP_SRC_OFF / IP_DST_OFF) from `old` to `new`.
///
/// The L4 pseudo-header checksum of TCP/UDP goes through `bpf_l4_csum_replace` (correct for
/// CHECKSUM_PARTIAL and GSO skbs); the IP header checksum (always complete) is updated
/// incrementally in place, and the address is written directly.
#[inline(always)]
pub fn set_ip(ctx: &TcContext, ip: &Ipv4, addr_off: usize, old: u32, new: u32) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    if ip.proto == proto::TCP || ip.proto == proto::UDP {
        ctx.l4_csum_replace(ip.l4_off + l4_csum_off(ip.proto), old as u64, new as u64, pseudo_flags(ip.proto))?;
    }
    // Packet pointers are invalid after a helper that may change the skb: look them up again.
    let hdr = ptr_mut::<[u8; 20]>(ctx, IP_OFF).ok_or(-1i64)?;
    // SAFETY: bounds checked by ptr_mut; `addr_off` is IP_SRC_OFF or IP_DST_OFF (inside the
    // 20-byte header).
    unsafe {
        let h = &mut *hdr;
        let a = addr_off - IP_OFF;
        let c = csum_replace4([h[10], h[11]], old.to_ne_bytes(), new.to_ne_bytes());
        h[10] = c[0];
        h[11] = c[1];
        if a == 12 {
            h[12..16].copy_from_slice(&new.to_ne_bytes());
        } else {
            h[16..20].copy_from_slice(&new.to_ne_bytes());
        }
    }
    Ok(())
}

/// Rewrites the source (`src = true`) or destination port (NBO) of a TCP/UDP header, or the
/// echo id of an ICMP header (either flag), with its checksum. Ports are not part of the
/// pseudo-header: no pseudo flag (`reference/upstream.md §8.7`).
#[inline(always)]
pub fn set_port(ctx: &TcContext, ip: &Ipv4, src: bool, old: u16, new: u16) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    let field = match ip.proto {
        proto::ICMP => 4,
        _ if src => 0,
        _ => 2,
    };
    let mut flags = 2u64;
    if ip.proto == proto::UDP {
        flags |= BPF_F_MARK_MANGLED_0 as u64;
    }
    ctx.l4_csum_replace(ip.l4_off + l4_csum_off(ip.proto), old as u64, new as u64, flags)?;
    if ip.l4_off + field > 14 + 60 + 4 {
        return Err(-1);
    }
    let p = ptr_mut::<[u8; 2]>(ctx, ip.l4_off + field).ok_or(-1i64)?;
    // SAFETY: bounds checked by ptr_mut.
    unsafe { *p = new.to_ne_bytes() };
    Ok(())
}

/// Writes the Ethernet destination and source MACs.
#[inline(always)]
pub fn set_macs(ctx: &TcContext, dst: &[u8; 6], src: &[u8; 6]) -> Result<(), i64> {
    let p = ptr_mut::<[u8; 12]>(ctx, 0).ok_or(-1i64)?;
    // SAFETY: bounds checked by ptr_mut.
    let m = unsafe { &mut *p };
    m[..6].copy_from_slice(dst);
    m[6..].copy_from_slice(src);
    Ok(())
}

/// Folds a 32-bit one's-complement sum into the final 16-bit checksum (as stored, NBO bytes).
#[inline(always)]
pub fn csum_fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// One's-complement sum of big-endian 16-bit words of `bytes` (even length).
#[inline(always)]
pub fn csum_add(mut sum: u32, bytes: &[u8]) -> u32 {
    let mut i = 0;
    while i + 1 < bytes.len() {
        sum += u16::from_be_bytes([bytes[i], bytes[i + 1]]) as u32;
        i += 2;
    }
    sum
}
