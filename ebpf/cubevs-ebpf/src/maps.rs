//! Every map of the datapath. Layouts are the shared types of `cubevs_common`; names are the
//! `cubevs_common::map` constants (userspace pins each under `<pin_dir>/maps/<name>`), and
//! sizes are the `cubevs_common::limits` defaults, which userspace may override at load.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, ProgramArray},
};
use cubevs_common::{
    AllowValue, BudgetKey, BudgetValue, FragKey, FragTarget, IngressValue, MvmMeta, MvmPort, NatSession, NewFlowBucket,
    NewFlowConfig, NodeConfig, PolicyLpmData, PortmapKey, PortmapSession, QuotaKey, SandboxStats, SessionKey, SnatIp,
    TrackCount,
    dns::{DnsAllowKey, DnsAllowName, DnsAllowValue, DnsQueryKey, DnsQueryValue, LearnedKey, LearnedValue, Scratch},
    limits, stats,
};

/// Sandbox mvm IP (NBO) → ifindex.
#[map(name = "mvmip_to_ifindex")]
pub static MVMIP_TO_IFINDEX: HashMap<u32, u32> = HashMap::with_max_entries(limits::SANDBOXES, 0);

/// ifindex → sandbox metadata; an interface without an entry drops everything.
#[map(name = "ifindex_to_mvmmeta")]
pub static IFINDEX_TO_MVMMETA: HashMap<u32, MvmMeta> = HashMap::with_max_entries(limits::SANDBOXES, 0);

/// TCP host port (NBO) → sandbox port.
#[map(name = "remote_port_mapping")]
pub static REMOTE_PORT_MAPPING: HashMap<u16, MvmPort> = HashMap::with_max_entries(limits::PORT_MAPPINGS, 0);

/// TCP host port (NBO) → CLOCK_MONOTONIC ns of its last release (userspace-written only,
/// decision R74; optional: userspace may run an object without it).
#[map(name = "host_port_released")]
pub static HOST_PORT_RELEASED: HashMap<u16, u64> = HashMap::with_max_entries(limits::PORT_MAPPINGS, 0);

/// TCP sandbox port → host port (NBO).
#[map(name = "local_port_mapping")]
pub static LOCAL_PORT_MAPPING: HashMap<MvmPort, u16> = HashMap::with_max_entries(limits::PORT_MAPPINGS, 0);

/// UDP host port (NBO) → sandbox port.
#[map(name = "remote_port_mapping_udp")]
pub static REMOTE_PORT_MAPPING_UDP: HashMap<u16, MvmPort> = HashMap::with_max_entries(limits::PORT_MAPPINGS, 0);

/// UDP sandbox port → host port (NBO).
#[map(name = "local_port_mapping_udp")]
pub static LOCAL_PORT_MAPPING_UDP: HashMap<MvmPort, u16> = HashMap::with_max_entries(limits::PORT_MAPPINGS, 0);

/// Guest-side session key → session.
#[map(name = "egress_sessions")]
pub static EGRESS_SESSIONS: HashMap<SessionKey, NatSession> = HashMap::with_max_entries(limits::SESSIONS, 0);

/// World-side session key → reverse NAT entry.
#[map(name = "ingress_sessions")]
pub static INGRESS_SESSIONS: HashMap<SessionKey, IngressValue> = HashMap::with_max_entries(limits::SESSIONS, 0);

/// Sessions the datapath charged per sandbox version (kernel-written only, `crate::quota`).
#[map(name = "session_opened")]
pub static SESSION_OPENED: HashMap<QuotaKey, u64> = HashMap::with_max_entries(limits::SESSION_QUOTA_KEYS, 0);

/// Charged sessions userspace deleted per sandbox version (userspace-written only).
#[map(name = "session_closed")]
pub static SESSION_CLOSED: HashMap<QuotaKey, u64> = HashMap::with_max_entries(limits::SESSION_QUOTA_KEYS, 0);

/// Node-wide charged-session count and the floor's limits (`cubevs_common::floor`; key
/// `OPENED` kernel-written only, `CLOSED` and `LIMITS` userspace-written only).
#[map(name = "session_floor")]
pub static SESSION_FLOOR: HashMap<u32, u64> = HashMap::with_max_entries(limits::SESSION_FLOOR_KEYS, 0);

/// Tracking entries the datapath charged per sandbox version (kernel-written only,
/// `crate::track_floor`, decision Q6).
#[map(name = "track_opened")]
pub static TRACK_OPENED: HashMap<QuotaKey, TrackCount> = HashMap::with_max_entries(limits::SESSION_QUOTA_KEYS, 0);

/// Charged tracking entries userspace deleted per sandbox version (userspace-written only).
#[map(name = "track_closed")]
pub static TRACK_CLOSED: HashMap<QuotaKey, TrackCount> = HashMap::with_max_entries(limits::SESSION_QUOTA_KEYS, 0);

/// `dns_learned` entries the datapath charged per sandbox version (kernel-written only,
/// `crate::learned_floor`, decision R66).
#[map(name = "learned_opened")]
pub static LEARNED_OPENED: HashMap<QuotaKey, u64> = HashMap::with_max_entries(limits::SESSION_QUOTA_KEYS, 0);

/// Charged `dns_learned` entries userspace deleted per sandbox version (userspace-written only).
#[map(name = "learned_closed")]
pub static LEARNED_CLOSED: HashMap<QuotaKey, u64> = HashMap::with_max_entries(limits::SESSION_QUOTA_KEYS, 0);

/// Node-wide charged learned entries and the learned floor's limits
/// (`cubevs_common::learned_floor`; key `OPENED` kernel-written only, `CLOSED` and `LIMITS`
/// userspace-written only).
#[map(name = "learned_floor")]
pub static LEARNED_FLOOR: HashMap<u32, u64> = HashMap::with_max_entries(limits::LEARNED_FLOOR_KEYS, 0);

/// SNAT addresses, 4 slots.
#[map(name = "snat_iplist")]
pub static SNAT_IPLIST: Array<SnatIp> = Array::with_max_entries(limits::SNAT_IPS, 0);

/// Allowed destinations per (ifindex, generation).
#[map(name = "allow_out")]
pub static ALLOW_OUT: LpmTrie<PolicyLpmData, AllowValue> = LpmTrie::with_max_entries(limits::POLICY_ENTRIES, 0);

/// Denied destinations per (ifindex, generation).
#[map(name = "deny_out")]
pub static DENY_OUT: LpmTrie<PolicyLpmData, u32> = LpmTrie::with_max_entries(limits::POLICY_ENTRIES, 0);

/// The node's extra always-denied destinations (`{prefixlen, addr NBO}` → 1; decision R30),
/// written by userspace only.
#[map(name = "node_deny")]
pub static NODE_DENY: LpmTrie<u32, u8> = LpmTrie::with_max_entries(limits::NODE_DENY, 0);

/// FQDN allow patterns per (ifindex, generation).
#[map(name = "dns_allow")]
/// Not preallocated: userspace sizes it like the policy tries (every sandbox, two
/// generations, at its limit), so the size costs memory only when used.
pub static DNS_ALLOW: HashMap<DnsAllowKey, DnsAllowValue> =
    HashMap::with_max_entries(limits::DNS_ALLOW, BPF_F_NO_PREALLOC);

/// The name of each `dns_allow` pattern under the same key: a query is tracked only when the
/// suffix whose hash matched is that name byte for byte (decision R48). Not preallocated,
/// sized like `dns_allow` by userspace.
#[map(name = "dns_allow_names")]
pub static DNS_ALLOW_NAMES: HashMap<DnsAllowKey, DnsAllowName> =
    HashMap::with_max_entries(limits::DNS_ALLOW, BPF_F_NO_PREALLOC);

/// Guest queries for allowed names waiting for their response. Not an LRU: nothing is
/// evicted, each sandbox's inserts are budgeted (`crate::budget`), userspace deletes expired
/// entries (decision R11).
#[map(name = "dns_query_track_v2")]
pub static DNS_QUERY_TRACK: HashMap<DnsQueryKey, DnsQueryValue> = HashMap::with_max_entries(limits::DNS_QUERIES, 0);

/// Addresses learned from answers.
#[map(name = "dns_learned")]
pub static DNS_LEARNED: HashMap<LearnedKey, LearnedValue> =
    HashMap::with_max_entries(limits::DNS_LEARNED, BPF_F_NO_PREALLOC);

/// DNS tail-call targets (`cubevs_common::dns::slot`), filled by userspace at load.
#[map(name = "dns_progs")]
pub static DNS_PROGS: ProgramArray = ProgramArray::with_max_entries(cubevs_common::dns::slot::COUNT, 0);

/// Per-CPU DNS parser scratch.
#[map(name = "dns_scratch")]
pub static DNS_SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

/// ifindex → active policy generation (missing = 0).
#[map(name = "policy_gen")]
pub static POLICY_GEN: HashMap<u32, u32> = HashMap::with_max_entries(limits::SANDBOXES, 0);

/// Node addresses at index 0.
#[map(name = "node_config")]
pub static NODE_CONFIG: Array<NodeConfig> = Array::with_max_entries(1, 0);

/// Connections the world opened to a host port (guest-side key); LRU, no reaper needed.
#[map(name = "portmap_sessions")]
pub static PORTMAP_SESSIONS: LruHashMap<PortmapKey, PortmapSession> =
    LruHashMap::with_max_entries(limits::PORTMAP_SESSIONS, 0);

/// Fragmented world datagrams whose first fragment matched a session. Not an LRU: nothing is
/// evicted, each sandbox's inserts are budgeted (`crate::budget`), userspace deletes expired
/// entries (decision R12).
#[map(name = "frag_sessions_v2")]
pub static FRAG_SESSIONS: HashMap<FragKey, FragTarget> = HashMap::with_max_entries(limits::FRAG_SESSIONS, 0);

/// Per-sandbox insert windows of `dns_query_track_v2` and `frag_sessions_v2` (datapath-written
/// only). LRU: a sandbox has one key per kind, so only new interfaces' first inserts evict, and
/// an evicted window only restarts that sandbox's count.
#[map(name = "insert_budget")]
pub static INSERT_BUDGET: LruHashMap<BudgetKey, BudgetValue> = LruHashMap::with_max_entries(limits::INSERT_BUDGET, 0);

/// Per-sandbox-version buckets of new connections to CubeEgress (`crate::new_flow`,
/// decision R91; datapath-written only). LRU: two keys per sandbox fit, so only a released
/// version's bucket is evicted, and an evicted bucket only starts full again.
#[map(name = "new_flow_rate")]
pub static NEW_FLOW_RATE: LruHashMap<QuotaKey, NewFlowBucket> = LruHashMap::with_max_entries(limits::NEW_FLOW_KEYS, 0);

/// Rate and burst of the `new_flow_rate` buckets (index 0; userspace-written).
#[map(name = "new_flow_config")]
pub static NEW_FLOW_CONFIG: Array<NewFlowConfig> = Array::with_max_entries(1, 0);

/// Verdict and drop-reason COUNTERS.
#[map(name = "counters")]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(limits::COUNTERS, 0);

/// Adds one to counter `idx` (a `cubevs_common::counter` slot).
#[inline(always)]
pub fn count(idx: u32) {
    if let Some(p) = COUNTERS.get_ptr_mut(idx) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *p += 1 };
    }
}

/// The node configuration (zeroed until userspace writes it).
#[inline(always)]
pub fn node() -> NodeConfig {
    NODE_CONFIG.get(0).copied().unwrap_or(NodeConfig {
        cube_dev_ifindex: 0,
        cube_dev_ip: 0,
        uplink_ifindex: 0,
        uplink_ip: 0,
    })
}

/// Per-sandbox counters (`cubevs_common::stats`): ifindex → per-CPU [`SandboxStats`]. Entries
/// are created (zeroed) and deleted by userspace only; the helpers below add to an existing
/// entry and do nothing for an interface without one.
#[map(name = "sandbox_stats")]
pub static SANDBOX_STATS: PerCpuHashMap<u32, SandboxStats> = PerCpuHashMap::with_max_entries(limits::SANDBOXES, 0);

/// Charges one forwarded packet of `len` bytes sent by the sandbox on `ifindex`.
#[inline(always)]
pub fn sandbox_out(ifindex: u32, len: u32) {
    if let Some(s) = SANDBOX_STATS.get_ptr_mut(&ifindex) {
        // SAFETY: valid per-CPU map value pointer, no concurrent writer on this CPU.
        unsafe {
            (*s).out_packets += 1;
            (*s).out_bytes += len as u64;
        }
    }
}

/// Charges one packet of `len` bytes delivered to the sandbox on `ifindex`.
#[inline(always)]
pub fn sandbox_in(ifindex: u32, len: u32) {
    if let Some(s) = SANDBOX_STATS.get_ptr_mut(&ifindex) {
        // SAFETY: valid per-CPU map value pointer, no concurrent writer on this CPU.
        unsafe {
            (*s).in_packets += 1;
            (*s).in_bytes += len as u64;
        }
    }
}

/// Charges a drop counted as datapath counter `reason` to the sandbox on `ifindex`, when the
/// reason is a per-sandbox drop (`cubevs_common::stats::drop_slot`).
#[inline(always)]
pub fn sandbox_drop(ifindex: u32, reason: u32) {
    let Some(slot) = stats::drop_slot(reason) else { return };
    if let Some(s) = SANDBOX_STATS.get_ptr_mut(&ifindex) {
        // SAFETY: valid per-CPU map value pointer, no concurrent writer on this CPU; the slot
        // is below DROP_SLOTS (asserted in cubevs_common::stats).
        unsafe {
            if let Some(d) = (*s).drops.get_mut(slot as usize) {
                *d += 1;
            }
        }
    }
}
