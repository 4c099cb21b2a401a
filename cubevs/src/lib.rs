//! `cubevs`: the userspace side of the CubeVS eBPF datapath.
//!
//! - [`Datapath`] loads the eBPF object (built by `cargo xtask build-ebpf`, see
//!   [`default_object_path`]) with a [`DatapathConfig`] in its `CONFIG` global, creates or
//!   adopts the pinned maps, and attaches `from_cube` (sandbox interfaces), `from_world`
//!   (uplink) and `from_envoy` (cube-dev) with pinned tcx links (legacy tc as fallback), and
//!   optionally `xdp_world` on the uplink ([`XdpMode`]).
//! - [`Maps`] is the typed, thread-safe API over every map, one wrapper per map family:
//!   [`SandboxTable`], [`PortMaps`], [`Sessions`], [`SnatTable`], [`PolicyTable`],
//!   [`NodeTable`], [`Counters`], [`SandboxStatsTable`].
//! - [`reaper`] expires idle sessions; [`dns_reaper`] expires learned DNS addresses; [`testrun`] runs programs on crafted frames with
//!   `BPF_PROG_TEST_RUN`.
//!
//! Interface names are resolved in the **calling thread's** network namespace: call the
//! attach functions from a thread inside the dataplane netns (`cubenet_sys::netns`).
mod batch;
mod bpf_sys;
mod counters;
mod datapath;
pub mod dns_reaper;
mod error;
mod frags;
pub mod insert_budget;
pub mod layout;
pub mod learned_floor;
pub mod lock;
pub mod new_flow;
mod node;
mod node_deny;
mod periodic;
pub mod policy;
mod ports;
pub mod quota;
pub mod reaper;
mod sandbox;
mod sandbox_stats;
pub mod selftest;
pub mod sessions;
pub mod skb_layout;
pub mod slots;
mod snat;
pub mod testrun;
pub mod track_floor;
mod xdp;

pub use counters::{CounterValue, Counters};
pub use cubevs_common::{DatapathConfig, guest, prog};
pub use datapath::{
    AttachMode, Datapath, LoadOptions, MapLimits, default_object_path, tcx_ingress_programs, tcx_programs,
};
pub use error::Error;
pub use frags::{FragEntry, FragTable};
pub use node::NodeTable;
pub use node_deny::NodeDenyTable;
pub use policy::{Cidr, EgressPolicy, PolicyDump, PolicyLimits, PolicyTable};
pub use ports::{PortMapping, PortMaps, Proto};
pub use quota::{FloorState, QuotaUsage};
pub use sandbox::{SandboxEntry, SandboxTable};
pub use sandbox_stats::{SandboxCounters, SandboxStatsTable};
pub use sessions::{SessionView, Sessions};
pub use snat::{SnatAddr, SnatTable};
pub use xdp::{XdpAttached, XdpMode};

/// `BPF_NOEXIST` map update flag.
pub(crate) const BPF_NOEXIST: u64 = 1;

/// Every map of the datapath behind its typed wrapper. Cheap to share (`Arc<Maps>`), usable
/// from any thread (map operations are netns-independent).
pub struct Maps {
    /// `ifindex_to_mvmmeta` + `mvmip_to_ifindex`.
    pub sandboxes: SandboxTable,
    /// The four port-mapping maps.
    pub ports: PortMaps,
    /// `egress_sessions` + `ingress_sessions`, and the session-budget maps `session_opened` +
    /// `session_closed` ([`quota`]).
    pub sessions: std::sync::Arc<Sessions>,
    /// `snat_iplist`.
    pub snat: SnatTable,
    /// `allow_out`, `deny_out`, `policy_gen`, and the DNS learning maps `dns_allow`,
    /// `dns_learned`, `dns_query_track_v2`.
    pub policy: PolicyTable,
    /// `node_config`.
    pub node: NodeTable,
    /// `counters`.
    pub counters: Counters,
    /// `sandbox_stats` (per-sandbox packets, bytes and drops).
    pub sandbox_stats: SandboxStatsTable,
    /// `frag_sessions_v2` (fragmented world replies in flight).
    pub frags: FragTable,
    /// `track_opened`, `track_closed` and the tracking keys of `session_floor`: the floor of
    /// `dns_query_track_v2` and `frag_sessions_v2` (decision Q6).
    pub track: std::sync::Arc<track_floor::TrackFloor>,
    /// `node_deny`: the node's extra always-denied CIDRs (decision R30).
    pub node_deny: NodeDenyTable,
    /// `insert_budget`, read-only: each sandbox version's DNS query and learning windows.
    pub budget: insert_budget::InsertBudgetTable,
    /// `new_flow_rate`, read-only: each sandbox version's bucket of new connections to
    /// CubeEgress (decision R91).
    pub new_flow: new_flow::NewFlowTable,
}

impl std::fmt::Debug for Maps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maps").finish_non_exhaustive()
    }
}
