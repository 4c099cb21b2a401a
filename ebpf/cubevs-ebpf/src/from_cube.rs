//! `from_cube`: tcx ingress of every sandbox interface (what the guest sends).
//!
//! Today: the ARP proxy; other frames continue unchanged. The full path (policy, SNAT,
//! conntrack, gateway access; `reference/upstream.md §3.4`) is built on this entry point.

use aya_ebpf::{bindings::TC_ACT_OK, macros::classifier, programs::TcContext};
use cubevs_common::ether::{HDR_LEN, P_ARP};

use crate::{arp, config};

#[classifier]
pub fn from_cube(ctx: TcContext) -> i32 {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + HDR_LEN > end {
        return TC_ACT_OK;
    }
    // SAFETY: bounds checked above.
    let ethertype = unsafe { u16::from_be_bytes(*((start + 12) as *const [u8; 2])) };
    if ethertype == P_ARP {
        // SAFETY: `skb` is the context pointer the kernel passed in.
        let ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
        return arp::proxy(&ctx, ifindex, config::get().gateway_mac);
    }
    TC_ACT_OK
}
