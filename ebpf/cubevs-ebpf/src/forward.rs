//! Forwarding: redirect to the uplink next hop found by the kernel FIB and neighbour table
//! (`bpf_fib_lookup`, falling back to `bpf_redirect_neigh` when the neighbour is not resolved
//! yet or forwarding is disabled on the device), so no gateway MAC is configured at load time
//! (`reference/upstream.md §8.6`).

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FWD_DISABLED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_OUTPUT,
        TC_ACT_SHOT, bpf_fib_lookup, bpf_redir_neigh,
    },
    helpers::generated::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use cubevs_common::counter;

use crate::{maps::count, packet::set_macs};

const AF_INET: u8 = 2;

/// Sends the (already SNATed) packet `src → dst` out of `oif` towards its next hop.
#[inline(always)]
pub fn to_next_hop(ctx: &TcContext, oif: u32, src: u32, dst: u32, l4_proto: u8) -> i32 {
    // SAFETY: bpf_fib_lookup is plain old data; zero is a valid value.
    let mut p: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    p.family = AF_INET;
    p.l4_protocol = l4_proto;
    p.ifindex = oif;
    p.__bindgen_anon_3.ipv4_src = src;
    p.__bindgen_anon_4.ipv4_dst = dst;
    // SAFETY: valid context and parameter pointers.
    let rc = unsafe {
        fib_lookup(ctx.skb.skb as *mut _, &mut p, core::mem::size_of::<bpf_fib_lookup>() as i32, BPF_FIB_LOOKUP_OUTPUT)
    };
    if rc == BPF_FIB_LKUP_RET_SUCCESS as i64 {
        if set_macs(ctx, &p.dmac, &p.smac).is_err() {
            return TC_ACT_SHOT;
        }
        // SAFETY: plain helper call.
        return unsafe { bpf_redirect(p.ifindex, 0) } as i32;
    }
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64 {
        let mut nh = bpf_redir_neigh {
            nh_family: AF_INET as u32,
            // SAFETY: the union's IPv4 member is set by the lookup for AF_INET.
            __bindgen_anon_1: aya_ebpf::bindings::bpf_redir_neigh__bindgen_ty_1 {
                ipv4_nh: unsafe { p.__bindgen_anon_4.ipv4_dst },
            },
        };
        // SAFETY: valid parameter pointer and size.
        return unsafe { bpf_redirect_neigh(p.ifindex, &mut nh, core::mem::size_of::<bpf_redir_neigh>() as i32, 0) }
            as i32;
    }
    if rc == BPF_FIB_LKUP_RET_FWD_DISABLED as i64 {
        // `bpf_fib_lookup` refuses when IPv4 forwarding is off on the device; let the kernel
        // route and resolve the next hop itself instead (no forwarding check there).
        // SAFETY: NULL parameters are allowed: the helper looks up the route.
        return unsafe { bpf_redirect_neigh(oif, core::ptr::null_mut(), 0, 0) } as i32;
    }
    count(counter::CUBE_DROP_FIB);
    TC_ACT_SHOT
}
