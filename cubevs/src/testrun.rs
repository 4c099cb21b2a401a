//! `BPF_PROG_TEST_RUN` for the datapath's TC programs and `xdp_world`: run a program once on a crafted frame
//! and get back its verdict and the (possibly rewritten) frame.
//!
//! Notes from the kernel: helpers such as `bpf_redirect` return their verdict
//! (`TC_ACT_REDIRECT` = 7) but nothing is sent; `ifindex` in the context must name a device in
//! the caller's netns; with `repeat > 1` the program reruns on the already rewritten frame.

use std::time::Duration;

use aya::programs::{SchedClassifier, TestRun, TestRunOptions, Xdp};

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

/// `XDP_DROP`.
pub const XDP_DROP: u32 = 1;
/// `XDP_PASS`: continue into the stack (the TC path).
pub const XDP_PASS: u32 = 2;
/// `XDP_REDIRECT`: returned by `bpf_redirect`.
pub const XDP_REDIRECT: u32 = 4;

/// The UAPI `struct xdp_md` (24 bytes) as `BPF_PROG_TEST_RUN` takes it: `data` and
/// `data_meta` are 0 (no metadata), `data_end` the frame length (set by [`run_xdp`]);
/// `ingress_ifindex` must name a device in the caller's netns (0: none) and `rx_queue_index`
/// one of its RX queues.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct XdpMdCtx {
    /// `ifindex` of the receiving device (`ctx->ingress_ifindex`).
    pub ingress_ifindex: u32,
    /// RX queue of that device.
    pub rx_queue_index: u32,
}

impl XdpMdCtx {
    /// The context as the kernel reads it for a frame of `len` bytes (`data`, `data_end`,
    /// `data_meta`, `ingress_ifindex`, `rx_queue_index`, `egress_ifindex`; native byte order).
    pub fn to_bytes(&self, len: usize) -> [u8; 24] {
        let fields = [0, len as u32, 0, self.ingress_ifindex, self.rx_queue_index, 0u32];
        let mut out = [0u8; 24];
        for (chunk, v) in out.chunks_exact_mut(4).zip(fields) {
            chunk.copy_from_slice(&v.to_ne_bytes());
        }
        out
    }
}

/// Runs the XDP program `prog` on `frame` `repeat` times (at least once) with `ctx`; the
/// verdict is an `XDP_*` action. A redirect is only reported, never performed.
pub fn run_xdp(prog: &Xdp, frame: &[u8], ctx: XdpMdCtx, repeat: u32) -> Result<TestRunOutput, Error> {
    let ctx_bytes = ctx.to_bytes(frame.len());
    let mut out = vec![0u8; frame.len() + 256];
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(frame);
    opts.data_out = Some(&mut out);
    opts.ctx_in = Some(&ctx_bytes);
    opts.repeat = repeat.max(1);
    let res = prog
        .test_run(opts)
        .map_err(|source| Error::Program { what: "BPF_PROG_TEST_RUN (xdp)".into(), source: Box::new(source) })?;
    out.truncate(res.data_size_out as usize);
    // XDP has no mark: 0.
    Ok(TestRunOutput { verdict: res.return_value, data: out, duration: res.duration, mark: 0 })
}
