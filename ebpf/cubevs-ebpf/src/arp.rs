//! ARP proxy: answers every Ethernet/IPv4 ARP request from a guest with the gateway MAC.
//!
//! Behaviour follows upstream `from_cube` step 1 (`reference/upstream.md §3.4`): the reply's
//! sender is the requested address with the gateway MAC, its target the requester; the frame is
//! rewritten in place and sent back out of the interface it came in on.

use aya_ebpf::{bindings::TC_ACT_SHOT, helpers::bpf_redirect, programs::TcContext};
use cubevs_common::ether::{ARP_LEN, ARP_OP_REPLY, ARP_OP_REQUEST, HDR_LEN, P_IP};

/// ARP payload (Ethernet hardware, IPv4 protocol) as it sits after the Ethernet header.
#[repr(C)]
struct ArpEth {
    htype: [u8; 2],
    ptype: [u8; 2],
    hlen: u8,
    plen: u8,
    op: [u8; 2],
    sha: [u8; 6],
    spa: [u8; 4],
    tha: [u8; 6],
    tpa: [u8; 4],
}

const _: () = assert!(core::mem::size_of::<ArpEth>() == ARP_LEN);

/// Turns the ARP request in `ctx` into a reply from `gateway_mac` and redirects it back out of
/// `ifindex`. Returns the TC verdict: `TC_ACT_REDIRECT` for a proxied request, `TC_ACT_SHOT`
/// for anything else (ARP replies, non-IPv4 ARP, truncated frames).
#[inline(always)]
pub fn proxy(ctx: &TcContext, ifindex: u32, gateway_mac: [u8; 6]) -> i32 {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + HDR_LEN + ARP_LEN > end {
        return TC_ACT_SHOT;
    }
    // SAFETY: bounds checked above against data_end, which the verifier also tracks.
    let eth = unsafe { &mut *(start as *mut [u8; HDR_LEN]) };
    let arp = unsafe { &mut *((start + HDR_LEN) as *mut ArpEth) };
    if u16::from_be_bytes(arp.htype) != 1
        || u16::from_be_bytes(arp.ptype) != P_IP
        || arp.hlen != 6
        || arp.plen != 4
        || u16::from_be_bytes(arp.op) != ARP_OP_REQUEST
    {
        return TC_ACT_SHOT;
    }
    let requester_mac = arp.sha;
    let requester_ip = arp.spa;
    let wanted_ip = arp.tpa;

    // Ethernet: to the requester, from the gateway.
    eth[0..6].copy_from_slice(&requester_mac);
    eth[6..12].copy_from_slice(&gateway_mac);
    arp.op = ARP_OP_REPLY.to_be_bytes();
    arp.sha = gateway_mac;
    arp.spa = wanted_ip;
    arp.tha = requester_mac;
    arp.tpa = requester_ip;

    // SAFETY: plain helper call; the kernel validates the ifindex.
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}
