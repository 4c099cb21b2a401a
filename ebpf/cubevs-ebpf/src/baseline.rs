//! `baseline_pass` / `baseline_xdp_pass`: a TC and an XDP program that only let the packet
//! continue. Never attached by the agent; benchmarks run them with BPF_PROG_TEST_RUN as the
//! floor of per-packet cost of each hook.

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action::XDP_PASS},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

#[classifier]
pub fn baseline_pass(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}

#[xdp]
pub fn baseline_xdp_pass(_ctx: XdpContext) -> u32 {
    XDP_PASS
}
