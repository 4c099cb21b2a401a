//! CubeVS eBPF programs. One module per attach point; shared packet helpers beside them.
//!
//! | program     | attach point                              | module          |
//! |-------------|-------------------------------------------|-----------------|
//! | `from_cube` | tcx ingress of every sandbox interface    | [`from_cube`]   |
//! | `from_world`| tcx ingress of the uplink                 | [`from_world`]  |
//! | `from_envoy`| tcx egress of cube-dev                    | [`from_envoy`]  |
//! | `xdp_world` | XDP on the uplink (optional fast path)    | [`xdp_world`]   |
//! | `baseline_pass` | never attached; benchmark floor       | [`baseline`]    |
//!
//! Helpers: [`maps`] (every map), [`packet`] (parsing, rewrites, checksums), [`policy`],
//! [`nat`] (SNAT ports, sessions), [`forward`] (FIB next hop), [`rst`] (RST synthesis),
//! [`arp`] (proxy), [`config`] (load-time constants), [`track`] (TCP state and sequence
//! tracking), [`icmp_err`] (ICMP errors from the world), [`frag`] (fragmented replies), [`world`] (reverse
//! path shared by `from_world` and `xdp_world`), [`dns`] (DNS learning), [`new_flow`] (new
//! connections to CubeEgress per sandbox).
#![no_std]
#![no_main]
// `atomic_xadd`: the bpfel target has no atomic read-modify-write in `core::sync::atomic`
// (`atomic_cas: false`), but the BPF ISA has atomic add (`quota`).
#![feature(core_intrinsics)]
#![allow(internal_features)]
// Map keys are passed by reference on purpose: no struct copies on the hot path.
#![allow(clippy::needless_borrows_for_generic_args)]

mod arp;
mod baseline;
mod budget;
mod config;
mod csum_offload;
mod dns;
mod forward;
mod frag;
mod from_cube;
mod from_envoy;
mod from_world;
mod icmp_err;
mod learned_floor;
mod maps;
mod nat;
mod new_flow;
mod packet;
mod policy;
mod quota;
mod rst;
mod track;
mod track_floor;
mod world;
mod xdp_world;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic path; this is never executed.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
