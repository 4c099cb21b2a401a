//! `BPF_PROG_TEST_RUN` for the datapath's TC programs: run a program once on a crafted frame
//! and get back its verdict and the (possibly rewritten) frame.
//!
//! Notes from the kernel: helpers such as `bpf_redirect` return their verdict
//! (`TC_ACT_REDIRECT` = 7) but nothing is sent; `ifindex` in the context must name a device in
//! the caller's netns; with `repeat > 1` the program reruns on the already rewritten frame.

use std::time::Duration;

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};

use crate::Error;

/// `TC_ACT_OK`: continue.
pub const TC_ACT_OK: u32 = 0;
/// `TC_ACT_SHOT`: drop.
pub const TC_ACT_SHOT: u32 = 2;
/// `TC_ACT_REDIRECT`: returned by `bpf_redirect*`.
pub const TC_ACT_REDIRECT: u32 = 7;

/// The leading fields of the UAPI `struct __sk_buff` (48 bytes). The kernel accepts a shorter
/// context than the full struct; only `mark`, `priority`, `ingress_ifindex`, `ifindex` (and
/// later fields we do not pass) may be non-zero.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct SkBuffCtx {
    /// Must be zero.
    pub len: u32,
    /// Must be zero.
    pub pkt_type: u32,
    /// `skb->mark`.
    pub mark: u32,
    /// Must be zero.
    pub queue_mapping: u32,
    /// Must be zero.
    pub protocol: u32,
    /// Must be zero.
    pub vlan_present: u32,
    /// Must be zero.
    pub vlan_tci: u32,
    /// Must be zero.
    pub vlan_proto: u32,
    /// `skb->priority`.
    pub priority: u32,
    /// `skb->skb_iif`: the interface the frame "arrived" on.
    pub ingress_ifindex: u32,
    /// `skb->dev`: must exist in the caller's netns (0 = loopback).
    pub ifindex: u32,
    /// Must be zero.
    pub tc_index: u32,
}

const _: () = assert!(std::mem::size_of::<SkBuffCtx>() == 48);

impl SkBuffCtx {
    /// The context as the kernel reads it (native byte order, field by field).
    pub fn to_bytes(&self) -> [u8; 48] {
        let fields = [
            self.len,
            self.pkt_type,
            self.mark,
            self.queue_mapping,
            self.protocol,
            self.vlan_present,
            self.vlan_tci,
            self.vlan_proto,
            self.priority,
            self.ingress_ifindex,
            self.ifindex,
            self.tc_index,
        ];
        let mut out = [0u8; 48];
        for (chunk, v) in out.chunks_exact_mut(4).zip(fields) {
            chunk.copy_from_slice(&v.to_ne_bytes());
        }
        out
    }
}

/// Outcome of one test run.
#[derive(Clone, Debug)]
pub struct TestRunOutput {
    /// The program's return value (a `TC_ACT_*` verdict).
    pub verdict: u32,
    /// The frame after the program ran.
    pub data: Vec<u8>,
    /// Kernel-measured time per run.
    pub duration: Duration,
    /// `skb->mark` after the run (from the output context).
    pub mark: u32,
}

/// Runs `prog` on `frame` `repeat` times (at least once) with `ctx`.
pub fn run(prog: &SchedClassifier, frame: &[u8], ctx: SkBuffCtx, repeat: u32) -> Result<TestRunOutput, Error> {
    let ctx_bytes = ctx.to_bytes();
    // The kernel writes the whole `struct __sk_buff` back (ENOSPC when the buffer is smaller).
    let mut ctx_out = [0u8; 256];
    // Room for programs that grow the frame (e.g. encapsulation, RST synthesis).
    let mut out = vec![0u8; frame.len() + 256];
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(frame);
    opts.data_out = Some(&mut out);
    opts.ctx_in = Some(&ctx_bytes);
    opts.ctx_out = Some(&mut ctx_out);
    opts.repeat = repeat.max(1);
    let res = prog
        .test_run(opts)
        .map_err(|source| Error::Program { what: "BPF_PROG_TEST_RUN".into(), source: Box::new(source) })?;
    out.truncate(res.data_size_out as usize);
    // `mark` is the third u32 of `struct __sk_buff`.
    let mark = u32::from_ne_bytes([ctx_out[8], ctx_out[9], ctx_out[10], ctx_out[11]]);
    Ok(TestRunOutput { verdict: res.return_value, data: out, duration: res.duration, mark })
}
