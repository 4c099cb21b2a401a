//! CubeVS eBPF programs. One module per attach point; shared packet helpers beside them.
//!
//! | program     | attach point                              | module          |
//! |-------------|-------------------------------------------|-----------------|
//! | `from_cube` | tcx ingress of every sandbox interface    | [`from_cube`]   |
#![no_std]
#![no_main]

mod arp;
mod config;
mod from_cube;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic path; this is never executed.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
