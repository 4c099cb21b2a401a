//! A guest's checksum offload request, checked against where it points (decision R101).
//!
//! The VMM writes the guest's `virtio_net_hdr` in front of every frame it puts on the TAP; with
//! `VIRTIO_NET_HDR_F_NEEDS_CSUM` the kernel makes the skb `CHECKSUM_PARTIAL` with the header's
//! `csum_start`/`csum_offset`, requiring only that they lie inside the frame past its first 20
//! bytes. When the frame leaves a device that does not checksum in hardware (or one that
//! honours any offsets), the folded sum from `csum_start` to the end is written at
//! `csum_start + csum_offset`: anywhere in the IPv4 header, after `from_cube` decided the policy
//! and rewrote the source. The guest chooses the value through its payload, so it could turn
//! an allowed destination into an always-denied one, or the node's source address into another.
//! An honest guest (Linux virtio-net) asks only for the TCP or UDP checksum: `csum_start` at the
//! L4 header, `csum_offset` 16 (TCP) or 6 (UDP). Anything else is dropped.
//!
//! `__sk_buff` has no `ip_summed`, `csum_start` or `csum_offset`: the program reads them from
//! the `sk_buff` itself with `bpf_probe_read_kernel`, at offsets userspace found in the kernel's
//! BTF ([`SkbLayout`], load-time global `SKB_LAYOUT`).

use aya_ebpf::{helpers::bpf_probe_read_kernel, programs::TcContext};
use cubevs_common::{SkbLayout, proto};

use crate::packet::Ipv4;

/// Written by the loader (`EbpfLoader::override_global("SKB_LAYOUT", …)`); read with a volatile
/// load so the compiler cannot constant-fold the all-zero default ([`SkbLayout::UNKNOWN`]).
#[unsafe(no_mangle)]
static SKB_LAYOUT: SkbLayout = SkbLayout::UNKNOWN;

/// `ip_summed` value of a frame whose checksum is still to be written (`CHECKSUM_PARTIAL`).
const CHECKSUM_PARTIAL: u8 = 3;

/// Reads a `T` at byte `off` of the `sk_buff` behind `ctx`.
#[inline(always)]
fn read<T>(ctx: &TcContext, off: u16) -> Option<T> {
    let skb = ctx.skb.skb as *const u8;
    // SAFETY: bpf_probe_read_kernel copies from kernel memory or fails; `skb` is the kernel's
    // `struct sk_buff` this program runs on, `off` a field offset taken from its BTF.
    unsafe { bpf_probe_read_kernel(skb.wrapping_add(off as usize) as *const T) }.ok()
}

/// True unless the frame carries a checksum offload request that would write anywhere but the
/// TCP or UDP checksum field of `ip`. A failed read counts as a bad request (dropped).
#[inline(always)]
pub fn request_ok(ctx: &TcContext, ip: &Ipv4) -> bool {
    // SAFETY: SKB_LAYOUT is plain old data in .rodata; a volatile read of it is always valid.
    let layout = unsafe { core::ptr::read_volatile(&SKB_LAYOUT) };
    if layout.ip_summed == 0 {
        return true;
    }
    let Some(summed) = read::<u8>(ctx, layout.ip_summed) else {
        return false;
    };
    if (summed >> layout.ip_summed_shift) & 3 != CHECKSUM_PARTIAL {
        return true;
    }
    let field = match ip.proto {
        proto::TCP if !ip.later_fragment => 16,
        proto::UDP if !ip.later_fragment => 6,
        _ => return false,
    };
    let (Some(start), Some(offset), Some(mac)) = (
        read::<u16>(ctx, layout.csum_start),
        read::<u16>(ctx, layout.csum_offset),
        read::<u16>(ctx, layout.mac_header),
    ) else {
        return false;
    };
    offset == field && u32::from(start) == u32::from(mac) + ip.l4_off as u32
}
