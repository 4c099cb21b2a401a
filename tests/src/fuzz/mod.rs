//! Reliability fuzzing of the CubeVS datapath under `BPF_PROG_TEST_RUN` (issue 14).
//!
//! - [`rng::Rng`]: the seeded generator every choice comes from (a run is reproducible from its
//!   seed).
//! - [`frames`]: structure-aware frames (valid and broken Ethernet/ARP/IPv4 with options and
//!   fragments, TCP with every flag combination and options, UDP, ICMP echo and errors with
//!   embedded headers), built with `etherparse` and then mutated.
//! - [`model`]: the node state the fuzzer programs into the maps (sandboxes, versions,
//!   policies, port maps) and what it knows independently of the datapath (the policy rule,
//!   which connections the world opened to a host port).
//! - [`oracle`]: the invariants checked on every output.
//! - [`case`]: a failing input as a self-contained regression case (state + steps), saved
//!   under `tests/regressions/` and replayed by `reliability_fuzz::replay_regressions`.
//! - [`driver`]: epochs of random state and frames against a [`crate::rig::Rig`].
pub mod case;
pub mod driver;
pub mod frames;
pub mod model;
pub mod oracle;
pub mod rng;
