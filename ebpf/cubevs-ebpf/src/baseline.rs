//! `baseline_pass`: a TC program that only returns `TC_ACT_OK`. Never attached by the agent;
//! benchmarks run it with BPF_PROG_TEST_RUN as the floor of per-packet cost.

use aya_ebpf::{bindings::TC_ACT_OK, macros::classifier, programs::TcContext};

#[classifier]
pub fn baseline_pass(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}
