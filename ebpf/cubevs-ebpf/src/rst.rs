//! TCP RST synthesis for denied or sessionless TCP from a guest (`reference/upstream.md §3.5`
//! `tcp_reply_reset`): the frame is rewritten in place into a 54-byte RST from the original
//! destination to the guest and sent back out of the interface it came in on.

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    helpers::generated::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use cubevs_common::{
    DatapathConfig,
    conntrack::flags::{ACK, FIN, RST, SYN},
    ether, proto,
};

use crate::packet::{Ipv4, L4, csum_add, csum_fold};

/// Length of the synthesized frame: Ethernet + IPv4 (no options) + TCP (no options).
pub const RST_LEN: usize = 54;

/// Answers the TCP segment (`ip`, `l4`) with a RST into the guest on `ifindex`.
/// Drops instead when the segment is itself a RST, carries IP options or is a GSO skb.
#[inline(always)]
pub fn reply(ctx: &TcContext, cfg: &DatapathConfig, ip: &Ipv4, l4: &L4, ifindex: u32) -> i32 {
    if l4.tcp_flags & RST != 0 || ip.ihl != 20 {
        return TC_ACT_SHOT;
    }
    // SAFETY: `skb` is the context pointer.
    if unsafe { (*ctx.skb.skb).gso_segs } > 1 {
        return TC_ACT_SHOT;
    }
    let Ok(seq_in) = ctx.load::<[u8; 4]>(ip.l4_off + 4) else { return TC_ACT_SHOT };
    let Ok(ack_in) = ctx.load::<[u8; 4]>(ip.l4_off + 8) else { return TC_ACT_SHOT };
    let payload = (ip.tot_len as u32).wrapping_sub(ip.ihl as u32).wrapping_sub(l4.tcp_hlen as u32);
    let (seq, ack, flags) = if l4.tcp_flags & ACK != 0 {
        (ack_in, [0u8; 4], RST)
    } else {
        let mut n = u32::from_be_bytes(seq_in).wrapping_add(payload);
        if l4.tcp_flags & SYN != 0 {
            n = n.wrapping_add(1);
        }
        if l4.tcp_flags & FIN != 0 {
            n = n.wrapping_add(1);
        }
        ([0u8; 4], n.to_be_bytes(), RST | ACK)
    };

    let mut f = [0u8; RST_LEN];
    f[0..6].copy_from_slice(&cfg.mvm_mac);
    f[6..12].copy_from_slice(&cfg.gateway_mac);
    f[12..14].copy_from_slice(&ether::P_IP.to_be_bytes());
    // IPv4: 20 bytes, total 40, DF, TTL 64.
    let i = ether::HDR_LEN;
    f[i] = 0x45;
    f[i + 3] = 40;
    f[i + 6] = 0x40;
    f[i + 8] = 64;
    f[i + 9] = proto::TCP;
    f[i + 12..i + 16].copy_from_slice(&ip.dst.to_ne_bytes());
    f[i + 16..i + 20].copy_from_slice(&cfg.mvm_inner_ip.to_ne_bytes());
    let ip_csum = csum_fold(csum_add(0, &f[i..i + 20]));
    f[i + 10..i + 12].copy_from_slice(&ip_csum.to_be_bytes());
    // TCP: ports swapped, 20-byte header, window 0.
    let t = i + 20;
    f[t..t + 2].copy_from_slice(&l4.dport.to_ne_bytes());
    f[t + 2..t + 4].copy_from_slice(&l4.sport.to_ne_bytes());
    f[t + 4..t + 8].copy_from_slice(&seq);
    f[t + 8..t + 12].copy_from_slice(&ack);
    f[t + 12] = 0x50;
    f[t + 13] = flags;
    let mut sum = csum_add(0, &f[i + 12..i + 20]);
    sum += proto::TCP as u32 + 20;
    sum = csum_add(sum, &f[t..t + 20]);
    let tcp_csum = csum_fold(sum);
    f[t + 16..t + 18].copy_from_slice(&tcp_csum.to_be_bytes());

    // SAFETY: valid context pointer.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, RST_LEN as u32, 0) } != 0 {
        return TC_ACT_SHOT;
    }
    if ctx.store(0, &f, 0).is_err() {
        return TC_ACT_SHOT;
    }
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}
