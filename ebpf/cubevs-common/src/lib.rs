//! Types and constants shared by the CubeVS eBPF programs (kernel side) and the `cubevs`
//! userspace library.
//!
//! Every type here is read by both sides, so each is `#[repr(C)]`, spells out its padding as
//! named fields, and carries a compile-time size assertion. With the `user` feature the types
//! implement [`aya::Pod`] so userspace can use them as map keys/values and load-time globals.
//!
//! Byte order: fields named `*_ip` hold an IPv4 address in **network byte order** as read from
//! the wire into a `u32` (so `169.254.68.6` is `u32::from_ne_bytes([169, 254, 68, 6])`); fields
//! named `*_port` hold a port in **network byte order** unless their doc says otherwise;
//! `ifindex` fields are host order.
#![no_std]

pub mod conntrack;

/// Declares `unsafe impl aya::Pod` for shared types when built for userspace.
macro_rules! pod {
    ($($t:ty),* $(,)?) => {
        $(
            #[cfg(feature = "user")]
            // SAFETY: the type is `#[repr(C)]`, `Copy`, has no implicit padding (asserted by
            // size) and every bit pattern is a valid value.
            unsafe impl aya::Pod for $t {}
        )*
    };
}

pub mod stats;
pub use stats::SandboxStats;
pub mod dns;

pod!(
    dns::DnsAllowKey,
    dns::DnsAllowValue,
    dns::DnsAllowName,
    dns::DnsQueryKey,
    dns::DnsQueryValue,
    dns::LearnedKey,
    dns::LearnedValue
);

/// Name of the eBPF object file produced by `cargo xtask build-ebpf`.
pub const OBJECT_FILE_NAME: &str = "cubevs.bpf.o";

/// Program names inside the object (the `#[classifier]` function names).
pub mod prog {
    /// tcx ingress of every sandbox interface (TAP, or a veth standing in for one).
    pub const FROM_CUBE: &str = "from_cube";
    /// tcx ingress of the uplink: reverse NAT and host-port DNAT.
    pub const FROM_WORLD: &str = "from_world";
    /// tcx egress of cube-dev: host → sandbox.
    pub const FROM_ENVOY: &str = "from_envoy";
    /// Returns `TC_ACT_OK` and nothing else: the per-packet cost floor for benchmarks.
    pub const BASELINE_PASS: &str = "baseline_pass";
    /// XDP on the uplink: the fast reverse path (optional, `xdp_mode`); not in [`ALL`].
    pub const XDP_WORLD: &str = "xdp_world";
    /// Returns `XDP_PASS` and nothing else: the XDP per-packet floor for benchmarks.
    pub const BASELINE_XDP_PASS: &str = "baseline_xdp_pass";
    /// Every XDP program in the object.
    pub const XDP_ALL: &[&str] = &[XDP_WORLD, BASELINE_XDP_PASS];
    /// Tail-called by `from_cube` for a guest DNS query: tracks it, tail-calls `from_cube`
    /// back (slot [`super::dns::slot`]).
    pub const DNS_QUERY: &str = "dns_query";
    /// Tail-called by `from_world` for a DNS response: learns it, tail-calls `from_world` back.
    pub const DNS_RESPONSE: &str = "dns_response";
    /// Every TC program in the object, in load order.
    pub const ALL: &[&str] = &[FROM_CUBE, FROM_WORLD, FROM_ENVOY, BASELINE_PASS, DNS_QUERY, DNS_RESPONSE];
}

/// Map names (pinned under `<pin_dir>/maps/<name>`). Upstream names and layouts where they
/// exist (`reference/upstream.md §3.2`).
pub mod map {
    /// `u32` sandbox IP → `u32` ifindex.
    pub const MVMIP_TO_IFINDEX: &str = "mvmip_to_ifindex";
    /// `u32` ifindex → [`super::MvmMeta`].
    pub const IFINDEX_TO_MVMMETA: &str = "ifindex_to_mvmmeta";
    /// TCP: `u16` host port (NBO) → [`super::MvmPort`].
    pub const REMOTE_PORT_MAPPING: &str = "remote_port_mapping";
    /// TCP: [`super::MvmPort`] → `u16` host port (NBO).
    pub const LOCAL_PORT_MAPPING: &str = "local_port_mapping";
    /// UDP twin of [`REMOTE_PORT_MAPPING`] (upstream maps only TCP).
    pub const REMOTE_PORT_MAPPING_UDP: &str = "remote_port_mapping_udp";
    /// UDP twin of [`LOCAL_PORT_MAPPING`].
    pub const LOCAL_PORT_MAPPING_UDP: &str = "local_port_mapping_udp";
    /// [`super::SessionKey`] (guest side) → [`super::NatSession`].
    pub const EGRESS_SESSIONS: &str = "egress_sessions";
    /// [`super::SessionKey`] (world side, version 0) → [`super::IngressValue`].
    pub const INGRESS_SESSIONS: &str = "ingress_sessions";
    /// `u32` slot (0..4) → [`super::SnatIp`].
    pub const SNAT_IPLIST: &str = "snat_iplist";
    /// LPM trie: [`super::PolicyLpmData`] → [`super::AllowValue`].
    pub const ALLOW_OUT: &str = "allow_out";
    /// LPM trie: [`super::PolicyLpmData`] → `u32` (1).
    pub const DENY_OUT: &str = "deny_out";
    /// Hash: [`super::dns::DnsAllowKey`] → [`super::dns::DnsAllowValue`], FQDN allow patterns
    /// per (ifindex, generation).
    pub const DNS_ALLOW: &str = "dns_allow";
    /// FQDN pattern names under `dns_allow`'s keys (decision R48; absent in older objects).
    pub const DNS_ALLOW_NAMES: &str = "dns_allow_names";
    /// Hash (not LRU): [`super::dns::DnsQueryKey`] → [`super::dns::DnsQueryValue`], guest
    /// queries for allowed names waiting for their response; each sandbox inserts at most
    /// [`super::limits::DNS_QUERIES_PER_SANDBOX`] per window ([`super::budget`]), expired
    /// entries are deleted by userspace. `_v2`: the pre-R11 `dns_query_track` was an LRU any
    /// sandbox could flush; a pin of that name is left alone (the other slot may use it).
    pub const DNS_QUERY_TRACK: &str = "dns_query_track_v2";
    /// Hash: [`super::dns::LearnedKey`] → [`super::dns::LearnedValue`], addresses learned from
    /// answers, with expiry.
    pub const DNS_LEARNED: &str = "dns_learned";
    /// Per-CPU [`super::dns::Scratch`] (not pinned: no state across packets).
    pub const DNS_SCRATCH: &str = "dns_scratch";
    /// Program array of the DNS tail calls ([`super::dns::slot`]); pinned so the entries
    /// survive an agent restart (the kernel clears an unpinned array when its last user
    /// reference goes), re-filled on every load.
    pub const DNS_PROGS: &str = "dns_progs";
    /// `u32` ifindex → `u32` active policy generation.
    pub const POLICY_GEN: &str = "policy_gen";
    /// `u32` 0 → [`super::NodeConfig`].
    pub const NODE_CONFIG: &str = "node_config";
    /// Per-CPU `u64` counters indexed by [`super::counter`].
    pub const COUNTERS: &str = "counters";
    /// Per-CPU hash: `u32` ifindex → [`super::SandboxStats`] (per-sandbox packets, bytes and
    /// drops; entries written by userspace only, see [`super::stats`]).
    pub const SANDBOX_STATS: &str = "sandbox_stats";
    /// LRU: [`super::PortmapKey`] → [`super::PortmapSession`], connections the world opened to
    /// a host port; only their packets take the mapped fast path out (not in upstream).
    pub const PORTMAP_SESSIONS: &str = "portmap_sessions";
    /// Hash (not LRU): [`super::FragKey`] → [`super::FragTarget`], fragmented replies from the
    /// world whose first fragment matched a session; later fragments follow it until
    /// [`super::FragTarget::expires_ns`] (not in upstream). Each sandbox inserts at most
    /// [`super::limits::FRAG_PER_SANDBOX`] per window ([`super::budget`]); expired entries are
    /// deleted by userspace. `_v2`: the pre-R12 `frag_sessions` was an LRU with an 8-byte
    /// value; a pin of that name is left alone (the other slot may use it).
    pub const FRAG_SESSIONS: &str = "frag_sessions_v2";
    /// LRU: [`super::BudgetKey`] → [`super::BudgetValue`], the insert windows of
    /// [`super::budget`] (written by the datapath only).
    pub const INSERT_BUDGET: &str = "insert_budget";
    /// LRU: [`super::QuotaKey`] → [`super::NewFlowBucket`], each sandbox version's bucket of
    /// new connections to CubeEgress ([`super::new_flow`], decision R91; written by the
    /// datapath only).
    pub const NEW_FLOW_RATE: &str = "new_flow_rate";
    /// Array, one entry: [`super::NewFlowConfig`], the rate and burst of the `new_flow_rate`
    /// buckets (written by userspace at every load; all zero, e.g. never written: no bound).
    pub const NEW_FLOW_CONFIG: &str = "new_flow_config";
    /// Hash: [`super::QuotaKey`] → `u64` sessions the kernel charged to that sandbox version
    /// (created and atomically added to / subtracted from by the datapath only, see
    /// [`super::quota`]).
    pub const SESSION_OPENED: &str = "session_opened";
    /// Hash: [`super::QuotaKey`] → `u64` charged sessions userspace deleted (written by the
    /// `cubevs` library only, under its sessions lock; see [`super::quota`]).
    pub const SESSION_CLOSED: &str = "session_closed";
    /// Hash: `u32` key → `u64` ([`super::floor`], decision Q4): the node-wide count of
    /// charged live sessions (key [`super::floor::OPENED`] written by the datapath only,
    /// [`super::floor::CLOSED`] by the `cubevs` library only) and the floor and ceiling
    /// ([`super::floor::LIMITS`], library only); keys 3 to 7 hold the same for the tracking
    /// floor of `dns_query_track_v2` and `frag_sessions_v2` (decision Q6).
    pub const SESSION_FLOOR: &str = "session_floor";
    /// Hash (not LRU): `u16` TCP host port (NBO) → `u64` CLOCK_MONOTONIC ns at which the
    /// `cubevs` library last released (deleted) that host port's mapping (decision R74;
    /// written by the library only, read by the datapath, not in upstream). A TCP segment that
    /// is not a bare SYN, to a host port released less than
    /// [`super::conntrack::timeout::TCP_ESTABLISHED`] ago, with no `portmap_sessions` entry, is
    /// dropped: it belongs to a connection of the port's previous owner. At most one entry per
    /// host port ([`super::limits::PORT_MAPPINGS`] entries cover every `u16`); an entry is
    /// never deleted, only overwritten at the next release.
    pub const HOST_PORT_RELEASED: &str = "host_port_released";
    /// Maps an older object may lack and still be loaded into a slot beside the pins (it runs
    /// without them; the `cubevs` library keeps them up to date for the objects that use
    /// them): `session_floor` (decision Q4), whose absence only means no node-wide check.
    ///
    /// `track_opened` / `track_closed` (decision Q6): without them an object tracks with no
    /// floor.
    ///
    /// `node_deny` (decision R30): an object without it does not enforce the node's extra
    /// always-denied list (only the baseline).
    ///
    /// `dns_allow_names` (decision R48): an object without it matches FQDN patterns by hash
    /// alone.
    ///
    /// `learned_opened` / `learned_closed` / `learned_floor` (decision R66): without them an
    /// object learns with no floor (only its R60 budget).
    ///
    /// `host_port_released` (decision R74): without it a released host port's next owner on
    /// another interface still gets the previous owner's world connections (R73's limit).
    ///
    /// `new_flow_rate`, `new_flow_config` (decision R91): without it an object does not bound a sandbox's new
    /// connections to CubeEgress (R90's limit).
    pub const OPTIONAL: &[&str] = &[
        SESSION_FLOOR,
        TRACK_OPENED,
        TRACK_CLOSED,
        NODE_DENY,
        DNS_ALLOW_NAMES,
        LEARNED_OPENED,
        LEARNED_CLOSED,
        LEARNED_FLOOR,
        HOST_PORT_RELEASED,
        NEW_FLOW_RATE,
        NEW_FLOW_CONFIG,
    ];
    /// LPM trie: key `{prefixlen: u32, addr: u32 NBO}` (8 bytes) → `u8` 1, the node's extra
    /// always-denied destinations (agent key `always_denied_cidrs`, decision R30): checked
    /// before every allow of every sandbox, and never learned from a DNS answer. Written by
    /// the `cubevs` library only, replaced in place at every agent start; at most
    /// [`super::limits::NODE_DENY`] entries.
    pub const NODE_DENY: &str = "node_deny";
    /// Hash: [`super::QuotaKey`] → [`super::TrackCount`], tracking entries the datapath
    /// charged to a sandbox version (datapath-written only, decision Q6).
    pub const TRACK_OPENED: &str = "track_opened";
    /// Hash: [`super::QuotaKey`] → [`super::TrackCount`], charged tracking entries userspace
    /// deleted (written by the `cubevs` library only).
    pub const TRACK_CLOSED: &str = "track_closed";
    /// Hash: [`super::QuotaKey`] → `u64`, `dns_learned` entries the datapath charged to a
    /// sandbox version (created and atomically added to / subtracted from by the datapath
    /// only, decision R66; see [`super::learned_floor`]).
    pub const LEARNED_OPENED: &str = "learned_opened";
    /// Hash: [`super::QuotaKey`] → `u64`, charged `dns_learned` entries userspace deleted
    /// (written by the `cubevs` library only, decision R66).
    pub const LEARNED_CLOSED: &str = "learned_closed";
    /// Hash: `u32` key → `u64` ([`super::learned_floor`], decision R66): the node-wide count of
    /// charged `dns_learned` entries ([`super::learned_floor::OPENED`] datapath only,
    /// [`super::learned_floor::CLOSED`] library only) and the floor and ceiling
    /// ([`super::learned_floor::LIMITS`], library only).
    pub const LEARNED_FLOOR: &str = "learned_floor";
    /// Every map of the datapath (all pinned).
    pub const ALL: &[&str] = &[
        MVMIP_TO_IFINDEX,
        IFINDEX_TO_MVMMETA,
        REMOTE_PORT_MAPPING,
        LOCAL_PORT_MAPPING,
        REMOTE_PORT_MAPPING_UDP,
        LOCAL_PORT_MAPPING_UDP,
        EGRESS_SESSIONS,
        INGRESS_SESSIONS,
        SNAT_IPLIST,
        ALLOW_OUT,
        DENY_OUT,
        DNS_ALLOW,
        DNS_QUERY_TRACK,
        DNS_LEARNED,
        DNS_PROGS,
        POLICY_GEN,
        NODE_CONFIG,
        COUNTERS,
        SANDBOX_STATS,
        PORTMAP_SESSIONS,
        FRAG_SESSIONS,
        INSERT_BUDGET,
        NEW_FLOW_RATE,
        NEW_FLOW_CONFIG,
        SESSION_OPENED,
        SESSION_CLOSED,
        SESSION_FLOOR,
        TRACK_OPENED,
        TRACK_CLOSED,
        NODE_DENY,
        DNS_ALLOW_NAMES,
        LEARNED_OPENED,
        LEARNED_CLOSED,
        LEARNED_FLOOR,
        HOST_PORT_RELEASED,
        NEW_FLOW_RATE,
    ];
}

/// Default `max_entries` (userspace may override at load, `LoadOptions::limits`).
pub mod limits {
    /// Sandboxes (ifindex / mvm IP maps), upstream 8192.
    pub const SANDBOXES: u32 = 8192;
    /// Port mappings per protocol, upstream 65536.
    pub const PORT_MAPPINGS: u32 = 65536;
    /// Sessions per direction, upstream 1,048,576.
    pub const SESSIONS: u32 = 1 << 20;
    /// Live sessions one sandbox version may hold ([`super::quota`]; not in upstream): 16,384,
    /// below half of one remote endpoint's SNAT ports ([`super::snat::PORT_SPAN`] / 2 =
    /// 17,768), so one sandbox holding its whole budget toward one endpoint leaves the others'
    /// 32 random draws a miss chance of at most (16,384 / 35,536)^32 ≈ 1.7e-11 (decision Q1).
    pub const SESSIONS_PER_SANDBOX: u32 = 1 << 14;
    /// Entries of `session_opened` / `session_closed`: two (ifindex, version) keys per sandbox
    /// (the live one and a released one not yet collected).
    pub const SESSION_QUOTA_KEYS: u32 = 2 * SANDBOXES;
    /// Live sessions every registered sandbox version may always open, whatever the others
    /// hold ([`super::floor`], decision Q4): 64. With [`SANDBOXES`] (8,192) interfaces all
    /// registered, the reserve is 8,192 × 64 = 524,288, half of [`SESSIONS`], so the floor
    /// holds on a full node and the other half stays shared.
    pub const SESSION_FLOOR: u32 = 64;
    /// Entries of `session_floor`: all eight keys used ([`super::floor`]: three for sessions,
    /// five for DNS and fragment tracking).
    pub const SESSION_FLOOR_KEYS: u32 = 8;
    /// `dns_query_track_v2` entries every registered sandbox version may always hold, whatever
    /// the others hold (decision Q6): 4. With [`SANDBOXES`] (8,192) registered the reserve is
    /// 32,768, half of [`DNS_QUERIES`].
    pub const DNS_QUERY_FLOOR: u32 = 4;
    /// `frag_sessions_v2` entries every registered sandbox version may always hold (decision
    /// Q6): 4, the same half of [`FRAG_SESSIONS`] at 8,192 sandboxes.
    pub const FRAG_FLOOR: u32 = 4;
    /// `dns_learned` entries every registered sandbox version may always hold, whatever the
    /// others hold (decision R66): 8. With [`SANDBOXES`] (8,192) registered the reserve is
    /// 65,536, a quarter of [`DNS_LEARNED`]; the rest is shared under the ceiling.
    pub const DNS_LEARNED_FLOOR: u32 = 8;
    /// Entries of `learned_floor`: its three keys ([`super::learned_floor`]).
    pub const LEARNED_FLOOR_KEYS: u32 = 3;
    /// Policy entries in `allow_out` / `deny_out`, summed over all sandboxes: the object's
    /// placeholder only; `cubevs` sizes the tries at load from its per-sandbox limit
    /// (`MapLimits::policy_entries`).
    pub const POLICY_ENTRIES: u32 = 1 << 16;
    /// Upstream's per-TAP inner trie size (for reference; CubeNet's per-sandbox limit is
    /// `cubevs::policy::DEFAULT_ENTRIES_PER_SANDBOX`, 1,024 per list).
    pub const POLICY_ENTRIES_PER_SANDBOX: u32 = 8192;
    /// SNAT IP slots, upstream `MAX_SNAT_IPS`.
    pub const SNAT_IPS: u32 = 4;
    /// Counter slots.
    pub const COUNTERS: u32 = 64;
    /// Entries of `new_flow_rate`: two sandbox versions per sandbox, as
    /// [`SESSION_QUOTA_KEYS`] (LRU: a released version's bucket is evicted first).
    pub const NEW_FLOW_KEYS: u32 = 2 * SANDBOXES;
    /// Tracked host-port connections (`portmap_sessions`, LRU: the oldest is evicted first).
    pub const PORTMAP_SESSIONS: u32 = 1 << 18;
    /// Fragmented datagrams in flight from the world (`frag_sessions_v2`, hash: when full, a
    /// new first fragment is not recorded; nothing is evicted).
    pub const FRAG_SESSIONS: u32 = 1 << 16;
    /// First fragments one sandbox may record per [`super::budget::FRAG_WINDOW_NS`] (decision
    /// R12): 1,024 per 2 s. An entry lives [`super::FRAG_TIMEOUT_NS`] plus up to one reaper
    /// interval, so one sandbox holds at most about 1,024 × (1 + (2 s + interval) / 2 s)
    /// entries (4,608 at the 5 s default), far below [`FRAG_SESSIONS`].
    pub const FRAG_PER_SANDBOX: u32 = 1024;
    /// Keys of `insert_budget`: three kinds per sandbox (the learned kind per sandbox
    /// version), with room for released interfaces and versions, which linger until the LRU
    /// drops them. An LRU drop of a live key only restarts that sandbox's window.
    pub const INSERT_BUDGET: u32 = 4 * SANDBOXES;
    /// FQDN allow patterns summed over all sandboxes and two generations each (`dns_allow`;
    /// userspace sizes it at load).
    pub const DNS_ALLOW: u32 = 1 << 16;
    /// Queries in flight (`dns_query_track_v2`, hash: when full, a new query is not tracked;
    /// nothing is evicted).
    pub const DNS_QUERIES: u32 = 1 << 16;
    /// Queries one sandbox may track per [`super::budget::DNS_WINDOW_NS`] (decision R11): 512
    /// per 10 s. An entry lives [`super::dns::QUERY_TIMEOUT_NS`] plus up to one reaper
    /// interval, so one sandbox holds at most about 512 × (1 + (10 s + interval) / 10 s)
    /// entries (1,280 at the 5 s default), far below [`DNS_QUERIES`].
    pub const DNS_QUERIES_PER_SANDBOX: u32 = 512;
    /// Learned (address, port) entries over all sandboxes (`dns_learned`); when full, new
    /// answers are not learned (counted), never evicting another sandbox's entries.
    pub const DNS_LEARNED: u32 = 1 << 18;
    /// New learned (address, port) entries one sandbox version may make per
    /// [`super::budget::DNS_LEARNED_WINDOW_NS`] (one day; decision R60): 8,192. A renewal of
    /// its own entry is free. An entry lives at most [`super::dns::TTL_CAP_S`] (the window)
    /// plus one reaper interval, so one sandbox holds at most about 2 × 8,192 = 16,384
    /// entries, 1/16 of [`DNS_LEARNED`]: alone it can no longer fill the map that every
    /// sandbox's learning needs (before R60 one sandbox with an 8-port pattern filled it in
    /// about 40 s: 512 queries per 10 s × 16 answers × 8 ports).
    pub const DNS_LEARNED_PER_SANDBOX: u32 = 8192;
    /// Entries of `node_deny` (the node's extra always-denied CIDRs, decision R30): 64.
    pub const NODE_DENY: u32 = 64;
}

/// Name of the load-time global holding [`DatapathConfig`].
pub const CONFIG_GLOBAL: &str = "CONFIG";

/// Byte offsets of the running kernel's `struct sk_buff` fields `from_cube` reads with
/// `bpf_probe_read_kernel` to refuse a guest's checksum offload request that points anywhere
/// but the TCP/UDP checksum field (decision R101): `__sk_buff` exposes none of them, and their
/// places differ between kernel builds, so userspace reads them from the kernel's BTF
/// (`/sys/kernel/btf/vmlinux`) and writes them into the load-time global
/// [`SKB_LAYOUT_GLOBAL`]. All offsets are from the start of `struct sk_buff`, host order.
///
/// Layout: 12 bytes, `#[repr(C)]`, no implicit padding. [`SkbLayout::UNKNOWN`] (all zero: no
/// field of `sk_buff` that matters here sits at offset 0) leaves the check off, as in an object
/// loaded by userspace older than R101.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SkbLayout {
    /// Offset of the byte holding the `ip_summed:2` bitfield (0 = unknown: no check).
    pub ip_summed: u16,
    /// Offset of `csum_start` (u16: where the checksum starts, counted from `skb->head`).
    pub csum_start: u16,
    /// Offset of `csum_offset` (u16: where the checksum goes, counted from `csum_start`).
    pub csum_offset: u16,
    /// Offset of `mac_header` (u16: the Ethernet header, counted from `skb->head`).
    pub mac_header: u16,
    /// Bit position of `ip_summed` in its byte, from the least significant bit.
    pub ip_summed_shift: u8,
    /// Explicit padding, always zero.
    pub _pad: [u8; 3],
}

impl SkbLayout {
    /// No layout known: `from_cube` does not look at checksum offload requests.
    pub const UNKNOWN: Self =
        Self { ip_summed: 0, csum_start: 0, csum_offset: 0, mac_header: 0, ip_summed_shift: 0, _pad: [0; 3] };
}

const _: () = assert!(core::mem::size_of::<SkbLayout>() == 12);

/// Name of the load-time global holding [`SkbLayout`].
pub const SKB_LAYOUT_GLOBAL: &str = "SKB_LAYOUT";

/// Guest-facing constants of upstream (`reference/upstream.md §1.5`, `§3.3`).
pub mod guest {
    /// Address every guest sees as its own: 169.254.68.6.
    pub const INNER_IP: [u8; 4] = [169, 254, 68, 6];
    /// Address every guest uses as its gateway: 169.254.68.5.
    pub const GATEWAY_IP: [u8; 4] = [169, 254, 68, 5];
    /// MAC of every guest NIC: 20:90:6f:fc:fc:fc.
    pub const MAC: [u8; 6] = [0x20, 0x90, 0x6f, 0xfc, 0xfc, 0xfc];
    /// MAC the ARP proxy answers with, also cube-dev's MAC: 20:90:6f:cf:cf:cf.
    pub const GATEWAY_MAC: [u8; 6] = [0x20, 0x90, 0x6f, 0xcf, 0xcf, 0xcf];
    /// Prefix length of the guest address (169.254.68.6/30).
    pub const PREFIX_LEN: u8 = 30;
}

/// SNAT and hashing constants (`reference/upstream.md §3.3`, `§3.5`).
pub mod snat {
    /// First SNAT port (`MAX_PORT_START`); SNAT ports are 30000..=65535.
    pub const PORT_MIN: u16 = 30000;
    /// Number of SNAT ports per SNAT IP.
    pub const PORT_SPAN: u32 = 65536 - PORT_MIN as u32;
    /// Insert-if-absent attempts (each a fresh random port) before a new flow is dropped;
    /// upstream makes 10 sequential ones. With a fraction `u` of one remote endpoint's ports in
    /// use, a new flow to it is dropped with probability `u^32` (decision D22).
    pub const MAX_TRIES: u32 = 32;
    /// Seed of the SNAT slot hash (`HASH_SEED`).
    pub const HASH_SEED: u32 = 0xebcf_0700;
}

/// Constants the programs read at run time, written into the object's `CONFIG` global at load
/// (upstream rewrites `const volatile` globals the same way, `reference/upstream.md §3.3`).
///
/// Layout: 24 bytes, `#[repr(C)]`, no implicit padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatapathConfig {
    /// Guest inner address (network byte order), default 169.254.68.6.
    pub mvm_inner_ip: u32,
    /// Guest gateway address (network byte order), default 169.254.68.5.
    pub mvm_gateway_ip: u32,
    /// Guest NIC MAC, default 20:90:6f:fc:fc:fc.
    pub mvm_mac: [u8; 6],
    /// Gateway MAC answered by the ARP proxy (cube-dev's MAC), default 20:90:6f:cf:cf:cf.
    pub gateway_mac: [u8; 6],
    /// Live sessions one sandbox version may hold (host order, [`quota`]); 0 = no quota (the
    /// padding this field replaced was always zero, so objects loaded by older userspace run
    /// without one). Default [`limits::SESSIONS_PER_SANDBOX`].
    pub session_budget: u32,
}

impl DatapathConfig {
    /// The upstream defaults (`reference/upstream.md §1.5`).
    pub const DEFAULT: Self = Self {
        mvm_inner_ip: u32::from_ne_bytes(guest::INNER_IP),
        mvm_gateway_ip: u32::from_ne_bytes(guest::GATEWAY_IP),
        mvm_mac: guest::MAC,
        gateway_mac: guest::GATEWAY_MAC,
        session_budget: limits::SESSIONS_PER_SANDBOX,
    };
}

impl Default for DatapathConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 24);

/// Node addresses the programs need, written by userspace when it attaches the uplink and
/// cube-dev (map `node_config`, one entry at index 0). 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeConfig {
    /// cube-dev ifindex (host → sandbox and gateway traffic go through it).
    pub cube_dev_ifindex: u32,
    /// cube-dev address (NBO), the sandbox CIDR's .1.
    pub cube_dev_ip: u32,
    /// Uplink ifindex.
    pub uplink_ifindex: u32,
    /// Uplink address (NBO): host ports are DNATed when addressed to it.
    pub uplink_ip: u32,
}
const _: () = assert!(core::mem::size_of::<NodeConfig>() == 16);

/// Per-sandbox metadata, `ifindex_to_mvmmeta` value (upstream `mvm_meta`, 128 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MvmMeta {
    /// Sandbox version: part of every session key, so a reused interface never matches the
    /// flows of its previous sandbox.
    pub version: u32,
    /// Sandbox "mvm IP" (NBO): what the guest's 169.254.68.6 is rewritten to.
    pub ip: u32,
    /// Sandbox id, NUL-padded (longer ids are truncated).
    pub uuid: [u8; 64],
    /// DNS policy flags (reserved for FQDN learning).
    pub dns_policy_flags: u8,
    /// Reserved; zero.
    pub _reserved: [u8; 55],
}
const _: () = assert!(core::mem::size_of::<MvmMeta>() == 128);

/// A sandbox port: `remote_port_mapping` value and `local_port_mapping` key (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MvmPort {
    /// Sandbox interface ifindex.
    pub ifindex: u32,
    /// Guest listen port (NBO).
    pub listen_port: u16,
    /// Padding; zero.
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<MvmPort>() == 8);

/// Session key (20 bytes). Egress key: guest side `{sandbox ip, remote ip, guest port, remote
/// port, sandbox version, proto}`. Ingress key: world side `{remote ip, SNAT ip, remote port,
/// SNAT port, 0, proto}`. ICMP echo: the echo id stands in for the guest/SNAT port and the
/// remote port is 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SessionKey {
    /// Source address (NBO).
    pub src_ip: u32,
    /// Destination address (NBO).
    pub dst_ip: u32,
    /// Source port (NBO).
    pub sport: u16,
    /// Destination port (NBO).
    pub dport: u16,
    /// Sandbox version (egress keys) or 0 (ingress keys).
    pub version: u32,
    /// IP protocol number.
    pub proto: u8,
    /// Padding; zero.
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<SessionKey>() == 20);

impl SessionKey {
    /// The world-side (`ingress_sessions`) key of this egress key once SNATed to
    /// `snat_ip:snat_port` (both NBO): `{remote ip, SNAT ip, remote port, SNAT port, 0, proto}`.
    /// For ICMP echo the SNAT port is the echo id and the remote "port" is 0. Used by the
    /// datapath to reserve and release ports and by userspace to delete both directions.
    #[inline(always)]
    pub fn reverse(&self, snat_ip: u32, snat_port: u16) -> SessionKey {
        let remote_port = if self.proto == proto::ICMP { 0 } else { self.dport };
        SessionKey {
            src_ip: self.dst_ip,
            dst_ip: snat_ip,
            sport: remote_port,
            dport: snat_port,
            version: 0,
            proto: self.proto,
            _pad: [0; 3],
        }
    }
}

/// Egress session (`egress_sessions` value, upstream `nat_session`, 64 bytes). `Default` is
/// all zeros (padding included).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatSession {
    /// Last use, `bpf_ktime_get_ns` (CLOCK_MONOTONIC ns); refreshed lazily (≥ 1 s apart).
    pub access_ns: u64,
    /// Egress (uplink) ifindex of the SNAT IP.
    pub node_ifindex: u32,
    /// SNAT address (NBO).
    pub node_ip: u32,
    /// Sandbox interface ifindex.
    pub vm_ifindex: u32,
    /// Sandbox mvm IP (NBO).
    pub vm_ip: u32,
    /// SNAT port (NBO).
    pub node_port: u16,
    /// Guest port (NBO).
    pub vm_port: u16,
    /// Conntrack state ([`conntrack::tcp`] or [`conntrack::udp`]).
    pub state: u8,
    /// 1 when the guest closed first (its FIN moved the session into FIN_WAIT).
    pub active_close: u8,
    /// Packet class: [`conntrack::CLASS_SNAT`].
    pub packet_class: u8,
    /// L7 scheme (0 none); reserved for L7 steering.
    pub l7_scheme: u8,
    /// Direction that sent the first FIN (0 none, 1 original/guest, 2 reply/world).
    pub close_dir: u8,
    /// TCP: which directions [`Self::td_end`] holds (bit 0 original/guest, bit 1 reply/world).
    pub td_seen: u8,
    /// Padding; zero.
    pub _pad0: [u8; 2],
    /// TCP, per direction (0 guest, 1 world): highest `seq + payload + SYN + FIN` sent (host
    /// order), as nf_conntrack's `td_end`. RSTs are checked against it.
    pub td_end: [u32; 2],
    /// TCP, per direction: largest raw (unscaled) window advertised, nf_conntrack's
    /// `td_maxwin` before scaling.
    pub td_maxwin: [u32; 2],
    /// [`quota::COUNTED`] when the session was charged to its sandbox's budget
    /// (`session_opened`), so whoever deletes it gives the charge back; 0 for sessions made
    /// without a quota (older objects, budget 0, userspace restores), which are never
    /// subtracted (decision Q2). Was reserved (always zero) before the quota existed.
    pub quota: u8,
    /// [`quota::COUNTED`] when the session was also charged to the node-wide count
    /// (`session_floor` key [`floor::OPENED`], decision Q4), so whoever deletes it subtracts it
    /// there too; 0 for sessions made by objects older than the floor (which never charged the
    /// node count: never subtracted, so a switch or rollback cannot underflow it). Was reserved
    /// (always zero) before.
    pub node_quota: u8,
    /// Reserved; zero.
    pub _reserved: [u8; 10],
}
const _: () = assert!(core::mem::size_of::<NatSession>() == 64);

/// Key of `portmap_sessions` (16 bytes): a connection the world opened to a host port, seen
/// from the guest side `{sandbox ifindex, remote ip, guest port, remote port, proto}`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortmapKey {
    /// Sandbox interface ifindex.
    pub ifindex: u32,
    /// Remote (world client) address (NBO).
    pub remote_ip: u32,
    /// Guest listen port (NBO).
    pub guest_port: u16,
    /// Remote port (NBO).
    pub remote_port: u16,
    /// IP protocol number (TCP or UDP).
    pub proto: u8,
    /// Padding; zero.
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<PortmapKey>() == 16);

/// Value of `portmap_sessions` (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortmapSession {
    /// Last packet from the world, `bpf_ktime_get_ns`.
    pub access_ns: u64,
    /// Sandbox version when the world opened the connection.
    pub version: u32,
    /// Host port the world addressed (NBO).
    pub host_port: u16,
    /// Padding; zero.
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<PortmapSession>() == 16);

/// Key of `frag_sessions_v2` (12 bytes): a fragmented datagram from the world, as the IP header
/// identifies it (`{src, dst, IP id, proto}`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    /// Source address (NBO).
    pub src_ip: u32,
    /// Destination address (NBO): the SNAT address.
    pub dst_ip: u32,
    /// IP identification (NBO).
    pub ip_id: u16,
    /// IP protocol number.
    pub proto: u8,
    /// [`track::FRAG_CHARGED`] in entries charged to the tracking floor (decision Q6); 0 in
    /// those of older objects.
    pub _pad: u8,
}
const _: () = assert!(core::mem::size_of::<FragKey>() == 12);

/// How long a later fragment may follow its first fragment: 2 s, CLOCK_MONOTONIC ns (Linux
/// waits up to 30 s to reassemble, but the fragments of one datagram leave the sender back to
/// back; a later fragment past this is passed to the host like one without a first fragment).
pub const FRAG_TIMEOUT_NS: u64 = 2_000_000_000;

/// Value of `frag_sessions_v2` (16 bytes): where the first fragment went, and until when.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragTarget {
    /// Sandbox interface ifindex.
    pub ifindex: u32,
    /// Sandbox version of the session the first fragment matched; with
    /// [`FRAG_AMBIGUOUS`] set, two sandboxes' first fragments claimed the key (decision R16).
    pub version: u32,
    /// Expiry, CLOCK_MONOTONIC ns (`bpf_ktime_get_ns`): first fragment + [`FRAG_TIMEOUT_NS`].
    pub expires_ns: u64,
}
const _: () = assert!(core::mem::size_of::<FragTarget>() == 16);

/// Bit of [`FragTarget::version`] (decision R16): another sandbox's first fragment named the
/// entry's key while it was live, so its later fragments cannot be told apart and are dropped
/// until the entry expires. The entry keeps its owner (`ifindex`, `version` without this bit),
/// which its charge is given back to (Q6); sandbox versions stay below 2^31.
pub const FRAG_AMBIGUOUS: u32 = 1 << 31;

/// Per-sandbox insert budgets of the shared, non-evicting maps `dns_query_track_v2` and
/// `frag_sessions_v2` (decisions R11, R12; not in upstream).
///
/// A sandbox may insert at most `cap` entries of a kind per window: the window state
/// ([`BudgetValue`]) is written by the datapath only (atomic add; a window that is over is
/// restarted by a plain store, so concurrent CPUs may overshoot by at most one insert each per
/// window). Entries expire and are deleted by userspace, so one sandbox's share of a map is
/// bounded by `cap × (1 + (lifetime + reaper interval) / window)`, and since the maps never
/// evict, no sandbox can remove another's entry. Over its budget, a sandbox's own new entry
/// is not made (counted), its packet is forwarded as before.
pub mod budget {
    /// [`super::BudgetKey::kind`] of tracked DNS queries.
    pub const KIND_DNS_QUERY: u32 = 1;
    /// [`super::BudgetKey::kind`] of recorded first fragments.
    pub const KIND_FRAG: u32 = 2;
    /// Window of [`KIND_DNS_QUERY`]: the query lifetime, 10 s.
    pub const DNS_WINDOW_NS: u64 = super::dns::QUERY_TIMEOUT_NS;
    /// Window of [`KIND_FRAG`]: the fragment lifetime, 2 s.
    pub const FRAG_WINDOW_NS: u64 = super::FRAG_TIMEOUT_NS;
    /// Low byte of [`learned_kind`]: new `dns_learned` entries (decision R60).
    pub const KIND_DNS_LEARNED: u32 = 3;
    /// Window of the learned kind: the longest a learned entry lives
    /// ([`super::dns::TTL_CAP_S`], one day), so a window's entries are gone (reaped) about one
    /// window later.
    pub const DNS_LEARNED_WINDOW_NS: u64 = super::dns::TTL_CAP_S as u64 * 1_000_000_000;

    /// [`super::BudgetKey::kind`] of the new learned entries of sandbox `version`:
    /// [`KIND_DNS_LEARNED`] in bits 0..8, the version's low 24 bits above. Per version, so a
    /// sandbox on a reused interface never inherits its predecessor's used day.
    #[inline(always)]
    pub const fn learned_kind(version: u32) -> u32 {
        KIND_DNS_LEARNED | (version << 8)
    }

    /// [`super::BudgetKey::kind`] of the tracked queries of sandbox `version` (decision R64):
    /// [`KIND_DNS_QUERY`] in bits 0..8, the version's low 24 bits above, as [`learned_kind`],
    /// so a sandbox on a reused interface never inherits its predecessor's 10 s window. (An
    /// object before R64 keys the window by [`KIND_DNS_QUERY`] alone: a different key, so a
    /// switch between the two starts each sandbox's window afresh once.)
    #[inline(always)]
    pub const fn query_kind(version: u32) -> u32 {
        KIND_DNS_QUERY | (version << 8)
    }
}

/// The per-sandbox bound on new connections steered to CubeEgress (decision R91): a token
/// bucket of [`NewFlowConfig::burst`] connections refilled at [`NewFlowConfig::rate`] a
/// second, kept as a GCRA "theoretical arrival time" per
/// sandbox version in `new_flow_rate` ([`NewFlowBucket`], [`QuotaKey`]). The node's TCP stack
/// completes every such handshake for the gateway (TPROXY) before the gateway sees it, so
/// the gateway cannot bound this work; the datapath drops the SYN before it reaches the node.
/// The bucket is keyed by version, so the next sandbox on a reused interface starts full.
/// Approximate under races: two CPUs admitting one sandbox's SYNs at the same instant may both
/// take the last token (at most one extra connection per CPU).
pub mod new_flow {
    /// Default rate: new connections to CubeEgress per second per sandbox.
    pub const RATE: u32 = 200;
    /// Default burst: connections a sandbox may open back to back.
    pub const BURST: u32 = 400;
    /// Nanoseconds per second.
    pub const NS_PER_SEC: u64 = 1_000_000_000;

    /// The admission of one new connection at `now_ns` by a bucket whose stored theoretical
    /// arrival time is `tat_ns` (`None`: no entry yet, a full bucket), at `rate` a second
    /// with depth `burst` (both at least 1). `Some(new tat)`: admitted, store it; `None`:
    /// the bucket is empty. Shared by the datapath and userspace's reading of the bucket.
    #[inline(always)]
    pub const fn admit(tat_ns: Option<u64>, now_ns: u64, rate: u32, burst: u32) -> Option<u64> {
        let interval = NS_PER_SEC / rate as u64;
        let tolerance = interval * burst as u64;
        let tat = match tat_ns {
            Some(t) if t > now_ns => t,
            _ => now_ns,
        };
        let next = tat + interval;
        if next - now_ns > tolerance { None } else { Some(next) }
    }

    /// Connections the bucket of stored time `tat_ns` would admit back to back at `now_ns`.
    pub const fn available(tat_ns: Option<u64>, now_ns: u64, rate: u32, burst: u32) -> u32 {
        if rate == 0 {
            return u32::MAX;
        }
        let interval = NS_PER_SEC / rate as u64;
        let used = match tat_ns {
            Some(t) if t > now_ns => (t - now_ns).div_ceil(interval),
            _ => 0,
        };
        let b = burst as u64;
        if used >= b { 0 } else { (b - used) as u32 }
    }
}

/// Value of `new_flow_rate` (8 bytes): one sandbox version's new-connection bucket
/// ([`new_flow`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NewFlowBucket {
    /// Theoretical arrival time, CLOCK_MONOTONIC ns: the bucket is full when it is at or
    /// before now, and each admitted connection moves it one interval (1 s / rate) later.
    pub tat_ns: u64,
}
const _: () = assert!(core::mem::size_of::<NewFlowBucket>() == 8);

/// Value of `new_flow_config` (8 bytes, index 0): the [`new_flow`] buckets' parameters,
/// written by userspace at every load (a map, not a `CONFIG` field: objects built before R91
/// keep loading with this userspace, and an older userspace leaves it untouched).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NewFlowConfig {
    /// New connections to CubeEgress one sandbox version may open per second; 0 = no bound.
    pub rate: u32,
    /// How many of those it may open back to back (the bucket's depth; 0 counts as 1).
    pub burst: u32,
}
const _: () = assert!(core::mem::size_of::<NewFlowConfig>() == 8);

/// Key of `insert_budget` (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BudgetKey {
    /// Sandbox interface ifindex (host order).
    pub ifindex: u32,
    /// [`budget::query_kind`], [`budget::KIND_FRAG`] or [`budget::learned_kind`].
    pub kind: u32,
}
const _: () = assert!(core::mem::size_of::<BudgetKey>() == 8);

/// Value of `insert_budget` (16 bytes): the current window of one sandbox and kind.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BudgetValue {
    /// Start of the window, CLOCK_MONOTONIC ns.
    pub start_ns: u64,
    /// Inserts taken in the window.
    pub used: u64,
}
const _: () = assert!(core::mem::size_of::<BudgetValue>() == 16);

/// Reverse NAT entry (`ingress_sessions` value, 16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngressValue {
    /// Sandbox version of the egress session.
    pub version: u32,
    /// Sandbox mvm IP (NBO).
    pub vm_ip: u32,
    /// Guest port or ICMP echo id (NBO).
    pub vm_port: u16,
    /// Padding; zero.
    pub _pad: [u16; 3],
}
const _: () = assert!(core::mem::size_of::<IngressValue>() == 16);

/// One SNAT address (`snat_iplist` value, 16 bytes).
///
/// Upstream keeps a `bpf_spin_lock` and a `u16` watermark in its 16 bytes; we keep the size.
/// Each attempt at a new flow's SNAT port is `PORT_MIN + bpf_get_prandom_u32() % PORT_SPAN`
/// (at most `MAX_TRIES`), and insert-if-absent on the reverse key is what guarantees
/// uniqueness; `port_cursor` only counts attempts.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnatIp {
    /// Egress ifindex for this address.
    pub ifindex: u32,
    /// SNAT address (NBO); 0 = slot unused.
    pub ip: u32,
    /// Port attempts made on this slot (host order), advanced by the datapath on every try.
    pub port_cursor: u64,
}
const _: () = assert!(core::mem::size_of::<SnatIp>() == 16);

/// LPM data of the policy tries (12 bytes): `{ifindex, generation, ip}`. The trie prefix
/// length is `64 + CIDR length`, so the first 64 bits (interface and generation) always match
/// exactly and the address part is longest-prefix matched.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PolicyLpmData {
    /// Sandbox interface ifindex.
    pub ifindex: u32,
    /// Policy generation (flipped on every replace; see `policy_gen`).
    pub generation: u32,
    /// Address (NBO).
    pub ip: u32,
}
const _: () = assert!(core::mem::size_of::<PolicyLpmData>() == 12);

/// Bits of the LPM prefix taken by [`PolicyLpmData::ifindex`] and `generation`.
pub const POLICY_PREFIX_BITS: u32 = 64;

/// `allow_out` value (upstream `net_policy_value_v3`, 16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllowValue {
    /// Expiry (CLOCK_MONOTONIC ns); 0 = static, never expires.
    pub expires_ns: u64,
    /// [`allow_flag`] bits: 0 = a plain allow entry.
    pub flags: u8,
    /// L7 scheme (reserved).
    pub scheme: u8,
    /// CIDR length of the entry as written (guards merges against covering entries).
    pub key_prefixlen: u8,
    /// Padding; zero.
    pub _pad: [u8; 5],
}
const _: () = assert!(core::mem::size_of::<AllowValue>() == 16);

/// Per-sandbox live-session budget (not in upstream; decisions Q1-Q3).
///
/// A sandbox version's live sessions are `opened - closed`: `opened` (`session_opened`) is
/// written by the kernel only (atomic add when `from_cube` creates a session, atomic subtract
/// when it deletes one itself), `closed` (`session_closed`) by userspace only (the one deleter
/// path of the `cubevs` library, under its sessions lock). Neither side ever overwrites the
/// other's counter, so no update is lost. Only sessions whose [`NatSession::quota`] is
/// [`COUNTED`] are charged and given back. A new flow is admitted while `opened - closed <
/// budget`; the check and the add are not one atomic step, so concurrent new flows on other
/// CPUs may overshoot the budget by at most one per CPU.
pub mod quota {
    /// [`super::NatSession::quota`] of a session charged to `session_opened`.
    pub const COUNTED: u8 = 1;
}

/// Node-wide reserved floor (not in upstream; decision Q4). Every registered sandbox version
/// may always hold `floor` live sessions; a sandbox holding `floor` or more may open another
/// only while the node-wide count of charged live sessions is below `ceiling` =
/// `capacity - registered × floor - margin` (capacity: `max_entries` of `egress_sessions`;
/// margin: one per possible CPU, for concurrent check-then-charge on other CPUs). Sessions
/// admitted above a floor are thus at most `ceiling`, and the floors of all registered
/// sandboxes fit in the rest of the map.
///
/// Map `session_floor` (hash, `u32` key → `u64`), keys each written by one side only (as in
/// [`quota`]): [`OPENED`] by the datapath (atomic add on every session it charges, subtract when
/// it deletes one itself), [`CLOSED`] by the `cubevs` library (charged sessions it deleted,
/// [`NatSession::node_quota`]), [`LIMITS`] by the library ([`pack`]ed floor and ceiling,
/// rewritten on every register/unregister). No [`LIMITS`] entry, or floor 0: no node-wide check.
///
/// The same scheme bounds the tracking maps `dns_query_track_v2` and `frag_sessions_v2`
/// (decision Q6): node counts in [`DNS_OPENED`]/[`FRAG_OPENED`] (datapath) and
/// [`DNS_CLOSED`]/[`FRAG_CLOSED`] (library), per-version counts in `track_opened` /
/// `track_closed` ([`crate::TrackCount`]), floors and ceilings in [`TRACK_LIMITS`].
pub mod floor {
    /// Key: charged sessions the datapath created, less those it deleted itself.
    pub const OPENED: u32 = 0;
    /// Key: charged sessions userspace deleted.
    pub const CLOSED: u32 = 1;
    /// Key: `floor` in bits 32..64, `ceiling` in bits 0..32 (host order), see [`pack`].
    pub const LIMITS: u32 = 2;
    /// Key: charged `dns_query_track_v2` entries the datapath made, less those it deleted
    /// itself (datapath-written only; decision Q6).
    pub const DNS_OPENED: u32 = 3;
    /// Key: charged `dns_query_track_v2` entries userspace deleted (library-written only).
    pub const DNS_CLOSED: u32 = 4;
    /// Key: charged `frag_sessions_v2` entries the datapath made (datapath-written only; the
    /// datapath never deletes them).
    pub const FRAG_OPENED: u32 = 5;
    /// Key: charged `frag_sessions_v2` entries userspace deleted (library-written only).
    pub const FRAG_CLOSED: u32 = 6;
    /// Key: the tracking floors and ceilings (library-written only): the
    /// [`track_half`] of `dns_query_track_v2` in bits 32..64, of `frag_sessions_v2` in bits
    /// 0..32. Absent (older userspace): no floor, no node-wide check.
    pub const TRACK_LIMITS: u32 = 7;

    /// One half of [`TRACK_LIMITS`]: `floor` (at most 255) in bits 24..32, `ceiling` (at most
    /// 2^24 - 1, above the 65,536 entries of either map) in bits 0..24.
    #[inline(always)]
    pub const fn track_half(floor: u32, ceiling: u32) -> u32 {
        let f = if floor > 0xFF { 0xFF } else { floor };
        let c = if ceiling > 0xFF_FFFF { 0xFF_FFFF } else { ceiling };
        (f << 24) | c
    }

    /// (floor, ceiling) of the [`TRACK_LIMITS`] value `v` for `kind`
    /// ([`crate::budget::KIND_DNS_QUERY`] or [`crate::budget::KIND_FRAG`]).
    #[inline(always)]
    pub const fn track_unpack(v: u64, kind: u32) -> (u32, u32) {
        let h = if kind == crate::budget::KIND_DNS_QUERY { (v >> 32) as u32 } else { v as u32 };
        (h >> 24, h & 0xFF_FFFF)
    }

    /// The `session_floor` keys (opened, closed) of the node count of `kind`.
    #[inline(always)]
    pub const fn track_keys(kind: u32) -> (u32, u32) {
        if kind == crate::budget::KIND_DNS_QUERY { (DNS_OPENED, DNS_CLOSED) } else { (FRAG_OPENED, FRAG_CLOSED) }
    }

    /// The [`LIMITS`] value of `floor` and `ceiling`.
    #[inline(always)]
    pub const fn pack(floor: u32, ceiling: u32) -> u64 {
        ((floor as u64) << 32) | ceiling as u64
    }

    /// (floor, ceiling) of a [`LIMITS`] value.
    #[inline(always)]
    pub const fn unpack(v: u64) -> (u32, u32) {
        ((v >> 32) as u32, v as u32)
    }
}

/// Key of `session_opened` / `session_closed` (8 bytes): a sandbox version on an interface,
/// so a released sandbox's sessions (old version) never charge the next owner of the TAP.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QuotaKey {
    /// Sandbox interface ifindex (host order).
    pub ifindex: u32,
    /// Sandbox version (`MvmMeta::version`).
    pub version: u32,
}
const _: () = assert!(core::mem::size_of::<QuotaKey>() == 8);

/// Value of `track_opened` / `track_closed` (16 bytes, decision Q6): entries of
/// `dns_query_track_v2` and of `frag_sessions_v2` charged to one sandbox version (key
/// [`QuotaKey`]). `track_opened` is written by the datapath only (atomic adds), `track_closed`
/// by the `cubevs` library only; the live count is `opened - closed`, per field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackCount {
    /// Tracked DNS queries ([`budget::KIND_DNS_QUERY`]).
    pub dns_queries: u64,
    /// Recorded first fragments ([`budget::KIND_FRAG`]).
    pub frags: u64,
}
const _: () = assert!(core::mem::size_of::<TrackCount>() == 16);

/// Marks of a charged tracking entry (decision Q6): an entry made by an object older than the
/// tracking floor carries neither, so userspace never subtracts it.
pub mod track {
    /// `DnsQueryValue::_pad` of a query charged to its sandbox version and to the node.
    pub const DNS_CHARGED: u32 = 1;
    /// `FragKey::_pad` of a first fragment charged to its sandbox version and to the node
    /// (in the key: `FragTarget` has no spare byte; later fragments look this key up, so the
    /// entries of older objects, `_pad` 0, are not followed by newer ones, and back).
    pub const FRAG_CHARGED: u8 = 1;
}

/// Reserved floor of `dns_learned` (decision R66, the scheme of [`floor`] and Q6): every
/// registered sandbox version may always hold its floor of learned entries; a version at or
/// over it makes a new entry only while the node's charged learned entries are below
/// `capacity - registered × floor - possible CPUs`.
///
/// Counts are `opened - closed`, each written by one side only: `learned_opened`
/// ([`crate::QuotaKey`] → `u64`) and [`OPENED`] by the datapath (atomic add when it makes a
/// charged entry; when it takes over a previous version's charged entry on the same interface
/// it moves the per-version charge, the node count stays), `learned_closed` and [`CLOSED`] by
/// the `cubevs` library (charged entries its reaper and purges deleted). A charged entry
/// carries [`CHARGED`] in bits [`MARK_SHIFT`].. of `LearnedValue::flags`, kept by renewals;
/// entries an older object made carry 0 and are never subtracted.
pub mod learned_floor {
    /// Key of `learned_floor`: charged entries the datapath made (datapath-written only).
    pub const OPENED: u32 = 0;
    /// Key: charged entries userspace deleted (library-written only).
    pub const CLOSED: u32 = 1;
    /// Key: [`super::floor::pack`]ed floor and ceiling (library-written only). Absent (older
    /// userspace) or floor 0: no node-wide check.
    pub const LIMITS: u32 = 2;
    /// Shift of the charge mark in `LearnedValue::flags` (bits 8..16).
    pub const MARK_SHIFT: u32 = 8;
    /// Mask of the charge mark in `LearnedValue::flags`.
    pub const MARK_MASK: u32 = 0xFF << MARK_SHIFT;
    /// `LearnedValue::flags` mark of an entry charged to its version and to the node.
    pub const CHARGED: u32 = 1 << MARK_SHIFT;

    /// Whether the `LearnedValue::flags` value `flags` carries the charge mark.
    #[inline(always)]
    pub const fn is_charged(flags: u32) -> bool {
        flags & MARK_MASK == CHARGED
    }
}

/// [`AllowValue::flags`] (decision N10): a `/32` entry for an IPv4 literal that an L7 rule names
/// (`match.host` / `match.sni`). New TCP flows to it on a steered port go to CubeEgress; its
/// other ports and protocols get what the policy says without the entry ([`allow_flag::L3_ALLOWED`]
/// when an `allow_out` entry covers the address, else `deny_out` / default as usual).
pub mod allow_flag {
    /// TCP/80 is steered (mark [`crate::l7::MARK_HTTP`]).
    pub const L7_HTTP: u8 = 1;
    /// TCP/443 is steered (mark [`crate::l7::MARK_HTTPS`]).
    pub const L7_HTTPS: u8 = 2;
    /// Other ports and protocols are allowed (an `allow_out` entry covers the address).
    pub const L3_ALLOWED: u8 = 4;
    /// Userspace bookkeeping, ignored by the programs: the address is also an `allow_out`
    /// `/32` as written (so a rescan lists it under both).
    pub const ALLOW_OUT_ENTRY: u8 = 8;
    /// The flag of a [`crate::l7`] scheme (`SCHEME_HTTP` 1 / `SCHEME_HTTPS` 2), 0 for none.
    #[inline(always)]
    pub const fn of_scheme(scheme: u8) -> u8 {
        match scheme {
            crate::l7::SCHEME_HTTP => L7_HTTP,
            crate::l7::SCHEME_HTTPS => L7_HTTPS,
            _ => 0,
        }
    }
}

pod!(
    QuotaKey,
    TrackCount,
    DatapathConfig,
    SkbLayout,
    NodeConfig,
    MvmMeta,
    MvmPort,
    SessionKey,
    NatSession,
    IngressValue,
    SnatIp,
    PolicyLpmData,
    AllowValue,
    PortmapKey,
    PortmapSession,
    FragKey,
    FragTarget,
    BudgetKey,
    BudgetValue,
    NewFlowBucket,
    NewFlowConfig
);

/// Counter slots (per-CPU `u64`, map `counters`). Userspace sums across CPUs.
pub mod counter {
    /// xdp_world: reply or host-port frame rewritten and redirected into a sandbox by the XDP
    /// fast path (also counted under its `from_world` verdict, e.g. `reverse_nat`).
    pub const XDP_REDIRECT: u32 = 58;
    /// from_cube: ARP request proxied.
    pub const CUBE_ARP: u32 = 0;
    /// from_cube: dropped, interface has no registered sandbox.
    pub const CUBE_DROP_UNREGISTERED: u32 = 1;
    /// from_cube: dropped, truncated or malformed headers.
    pub const CUBE_DROP_MALFORMED: u32 = 2;
    /// from_cube: dropped, not ARP/IPv4, a fragment, or a protocol other than TCP/UDP/ICMP echo.
    pub const CUBE_DROP_PROTO: u32 = 3;
    /// from_cube: to the gateway, redirected into cube-dev.
    pub const CUBE_GATEWAY: u32 = 4;
    /// from_cube: dropped, gateway traffic other than ICMP / TCP non-SYN.
    pub const CUBE_DROP_GATEWAY: u32 = 5;
    /// from_cube: port-mapped reply, fast path to the uplink.
    pub const CUBE_PORTMAP_REPLY: u32 = 6;
    /// from_cube: dropped, SYN from a port-mapped guest port.
    pub const CUBE_DROP_PORTMAP_SYN: u32 = 7;
    /// from_cube: denied by policy (TCP answered with RST).
    pub const CUBE_DENY: u32 = 8;
    /// from_cube: new session created.
    pub const CUBE_NEW_SESSION: u32 = 9;
    /// from_cube: established session forwarded.
    pub const CUBE_ESTABLISHED: u32 = 10;
    /// from_cube: dropped, no SNAT IP configured or no free port.
    pub const CUBE_DROP_NO_SNAT: u32 = 11;
    /// from_cube: TCP non-SYN without session (answered with RST).
    pub const CUBE_NO_SESSION: u32 = 12;
    /// from_cube: dropped, FIB lookup found no route.
    pub const CUBE_DROP_FIB: u32 = 13;
    /// from_cube: to the node address, delivered to the host.
    pub const CUBE_HOST: u32 = 14;
    /// from_cube: dropped, source address is not the guest's.
    pub const CUBE_DROP_SPOOF: u32 = 15;
    /// from_cube: dropped, a port-mapped reply whose tracked connection belongs to an earlier
    /// sandbox version.
    pub const CUBE_DROP_PORTMAP_STALE: u32 = 16;
    /// from_cube: guest RST outside the tracked window (state kept, forwarded).
    pub const CUBE_RST_OUT_OF_WINDOW: u32 = 17;
    /// from_cube: session insert lost a race with another CPU; the winner's session was used.
    pub const CUBE_INSERT_RACE: u32 = 18;
    /// from_cube: dropped, TCP from a port-mapped guest port that is not part of a connection
    /// the world opened to the host port (nor of a session).
    pub const CUBE_DROP_PORTMAP_UNTRACKED: u32 = 19;
    /// from_world: host-port DNAT to a sandbox.
    pub const WORLD_PORTMAP: u32 = 20;
    /// from_world: reverse NAT of a session.
    pub const WORLD_REVERSE_NAT: u32 = 21;
    /// from_world: not ours, passed to the host stack.
    pub const WORLD_PASS: u32 = 22;
    /// from_world: reverse entry without egress session (stale), passed.
    pub const WORLD_STALE: u32 = 23;
    /// from_world: dropped, the session's sandbox version is no longer the one registered on
    /// its interface (released or reused TAP); or a host-port TCP segment (not a bare SYN) of
    /// the port's previous owner: recorded for the interface's previous version (R73), or
    /// unrecorded while the port was released less than 3 h ago (R74).
    pub const WORLD_DROP_STALE_VERSION: u32 = 24;
    /// from_world: RST outside the tracked window: dropped, session state kept.
    pub const WORLD_DROP_RST_WINDOW: u32 = 25;
    /// from_world: to a host port but not arriving on the registered uplink: not DNATed, passed.
    pub const WORLD_PORTMAP_WRONG_DEV: u32 = 26;
    /// from_world: host port mapped to an interface without a registered sandbox: dropped.
    pub const WORLD_DROP_PORTMAP_UNREGISTERED: u32 = 27;
    /// from_world: ICMP error (unreachable, time exceeded) for a session, reverse-translated
    /// (outer destination and embedded header) into the sandbox.
    pub const WORLD_ICMP_ERROR: u32 = 28;
    /// from_world: later fragment of a datagram whose first fragment matched a session.
    pub const WORLD_FRAGMENT: u32 = 29;
    /// from_world: a first fragment whose `{src, dst, IP id, proto}` an unexpired entry of
    /// another sandbox already holds: the entry is made ambiguous ([`super::FRAG_AMBIGUOUS`]) and the later
    /// fragments of both datagrams are dropped and counted here, never delivered to the wrong
    /// sandbox (decision R16).
    pub const WORLD_FRAG_AMBIGUOUS: u32 = 32;
    /// from_envoy: host → sandbox DNAT.
    pub const ENVOY_TO_SANDBOX: u32 = 30;
    /// from_envoy: dropped, unknown destination, or a packet the node forwarded from an
    /// interface rather than sent from a host socket (decision R61).
    pub const ENVOY_DROP_UNKNOWN: u32 = 31;
    /// from_cube: a guest query for an allowed name not tracked: its sandbox used its window's
    /// budget ([`super::limits::DNS_QUERIES_PER_SANDBOX`]), holds its floor while the node is
    /// at the tracking ceiling ([`super::floor`], decision Q6), or `dns_query_track_v2` is full.
    pub const DNS_QUERY_OVER_BUDGET: u32 = 38;
    /// from_world: a first fragment not recorded: its sandbox used its window's budget
    /// ([`super::limits::FRAG_PER_SANDBOX`]), holds its floor while the node is at the tracking
    /// ceiling (decision Q6), another sandbox's entry holds the key, or `frag_sessions_v2` is
    /// full (delivered; its later fragments go to the host).
    pub const WORLD_FRAG_OVER_BUDGET: u32 = 39;
    /// from_cube: a guest query (UDP/53, IN A) for an allowed name, tracked.
    pub const DNS_QUERY_TRACKED: u32 = 40;
    /// from_cube: a guest query for a name no FQDN pattern allows (forwarded, not tracked).
    pub const DNS_QUERY_NOT_ALLOWED: u32 = 41;
    /// from_cube: UDP/53 that is not a standard single-question IN A query (forwarded).
    pub const DNS_QUERY_UNPARSED: u32 = 42;
    /// from_cube: query from an interface without a policy generation (not tracked).
    pub const DNS_QUERY_NO_POLICY: u32 = 43;
    /// from_world: A records learned (one per record).
    pub const DNS_RESP_LEARNED: u32 = 44;
    /// from_world: UDP from port 53 for a session without a tracked query (wrong id, no
    /// query, or an expired one): nothing learned.
    pub const DNS_RESP_UNSOLICITED: u32 = 45;
    /// from_world: tracked id but a different question: nothing learned, the query stays.
    pub const DNS_RESP_MISMATCH: u32 = 46;
    /// from_world: truncated (TC) response: its complete A records learned, counted.
    pub const DNS_RESP_TRUNCATED: u32 = 47;
    /// from_world: response not parsable as a standard IN A response: nothing learned.
    pub const DNS_RESP_UNPARSED: u32 = 48;
    /// from_world: response with an error RCODE: nothing learned.
    pub const DNS_RESP_RCODE: u32 = 49;
    /// from_world: `dns_learned` full, or the sandbox's new-entry budget for the day used up
    /// (`limits::DNS_LEARNED_PER_SANDBOX`, decision R60): a record was not learned.
    pub const DNS_LEARN_FULL: u32 = 50;
    /// from_world: answers not walked (beyond 16 or beyond the 1,024-byte window).
    pub const DNS_NOT_WALKED: u32 = 51;
    /// from_cube: a new flow allowed by a learned entry (no static allow entry matched).
    pub const DNS_LEARNED_FLOW: u32 = 52;
    /// from_cube / from_world: the tail call into the DNS program failed (empty slot during
    /// a load): the packet went on untouched, not learned from.
    pub const DNS_TAIL_CALL_FAILED: u32 = 53;
    /// dns_query / dns_response: the tail call back into the main program failed; the query
    /// was dropped (TAP side) or the response passed to the host (uplink side).
    pub const DNS_TAIL_BACK_FAILED: u32 = 54;
    /// from_cube: new TCP flow to an L7 (learned) address on 80/443: session of class L7.
    pub const CUBE_L7_NEW: u32 = 55;
    /// from_cube: packet of an L7 session marked and steered to cube-dev unchanged.
    pub const CUBE_L7_STEERED: u32 = 56;
    /// from_envoy: CubeEgress reply of an L7 session (its conntrack state advanced).
    pub const ENVOY_L7_REPLY: u32 = 57;
    /// from_cube: new flow dropped, its sandbox holds its whole live-session budget
    /// (`DatapathConfig::session_budget`, [`super::quota`]).
    pub const CUBE_DROP_SESSION_QUOTA: u32 = 59;
    /// from_world: addressed to a registered sandbox's mvm IP (the sandbox CIDR routed to the
    /// node from its LAN): dropped; the world reaches a sandbox only through its host ports.
    /// Also a frame to a host port from a source no world host may have (the guest link's
    /// gateway or guest address, an mvm IP, the node's own, a martian; decision R63).
    pub const WORLD_DROP_TO_SANDBOX: u32 = 60;
    /// from_cube: a guest SYN reused a finished session whose class (SNAT / L7) the policy no
    /// longer gives its destination: the session was deleted and the SYN classified anew.
    pub const CUBE_RECLASSIFIED: u32 = 61;
    /// from_cube: new flow dropped, its sandbox holds at least its floor and the node-wide
    /// live sessions are at the ceiling ([`super::floor`], decision Q4).
    pub const CUBE_DROP_NODE_SESSIONS: u32 = 62;
    /// from_world: an A record in an always-denied range (private, loopback, link-local:
    /// [`super::dns::always_denied`]) not learned: a DNS answer never opens what the baseline
    /// denies (decision R15).
    pub const DNS_RESP_NOT_PUBLIC: u32 = 63;
    /// from_cube: a SYN that would open a connection to CubeEgress (a new L7 flow, or a
    /// finished L7 session's port reused) dropped: its sandbox has used its new-connection
    /// bucket ([`super::new_flow`], decision R91). No session is made; the guest retransmits.
    pub const CUBE_DROP_NEW_FLOW_RATE: u32 = 33;
    /// Names of the slots, for metrics and dumps.
    pub const NAMES: &[(u32, &str, &str)] = &[
        (XDP_REDIRECT, "xdp_world", "redirect"),
        (CUBE_ARP, "from_cube", "arp_proxied"),
        (CUBE_DROP_UNREGISTERED, "from_cube", "drop_unregistered"),
        (CUBE_DROP_MALFORMED, "from_cube", "drop_malformed"),
        (CUBE_DROP_PROTO, "from_cube", "drop_proto"),
        (CUBE_GATEWAY, "from_cube", "gateway"),
        (CUBE_DROP_GATEWAY, "from_cube", "drop_gateway"),
        (CUBE_PORTMAP_REPLY, "from_cube", "portmap_reply"),
        (CUBE_DROP_PORTMAP_SYN, "from_cube", "drop_portmap_syn"),
        (CUBE_DENY, "from_cube", "deny"),
        (CUBE_NEW_SESSION, "from_cube", "new_session"),
        (CUBE_ESTABLISHED, "from_cube", "established"),
        (CUBE_DROP_NO_SNAT, "from_cube", "drop_no_snat"),
        (CUBE_NO_SESSION, "from_cube", "no_session"),
        (CUBE_DROP_FIB, "from_cube", "drop_fib"),
        (CUBE_HOST, "from_cube", "host"),
        (CUBE_DROP_SPOOF, "from_cube", "drop_spoof"),
        (CUBE_DROP_PORTMAP_STALE, "from_cube", "drop_portmap_stale"),
        (CUBE_RST_OUT_OF_WINDOW, "from_cube", "rst_out_of_window"),
        (CUBE_INSERT_RACE, "from_cube", "insert_race"),
        (CUBE_DROP_PORTMAP_UNTRACKED, "from_cube", "drop_portmap_untracked"),
        (WORLD_PORTMAP, "from_world", "portmap"),
        (WORLD_REVERSE_NAT, "from_world", "reverse_nat"),
        (WORLD_PASS, "from_world", "pass"),
        (WORLD_STALE, "from_world", "stale"),
        (WORLD_DROP_STALE_VERSION, "from_world", "drop_stale_version"),
        (WORLD_DROP_RST_WINDOW, "from_world", "drop_rst_window"),
        (WORLD_PORTMAP_WRONG_DEV, "from_world", "portmap_wrong_dev"),
        (WORLD_DROP_PORTMAP_UNREGISTERED, "from_world", "drop_portmap_unregistered"),
        (WORLD_ICMP_ERROR, "from_world", "icmp_error"),
        (WORLD_FRAGMENT, "from_world", "fragment"),
        (WORLD_FRAG_AMBIGUOUS, "from_world", "frag_ambiguous"),
        (ENVOY_TO_SANDBOX, "from_envoy", "to_sandbox"),
        (ENVOY_DROP_UNKNOWN, "from_envoy", "drop_unknown"),
        (DNS_QUERY_OVER_BUDGET, "from_cube", "dns_query_over_budget"),
        (WORLD_FRAG_OVER_BUDGET, "from_world", "frag_over_budget"),
        (DNS_QUERY_TRACKED, "from_cube", "dns_query_tracked"),
        (DNS_QUERY_NOT_ALLOWED, "from_cube", "dns_query_not_allowed"),
        (DNS_QUERY_UNPARSED, "from_cube", "dns_query_unparsed"),
        (DNS_QUERY_NO_POLICY, "from_cube", "dns_query_no_policy"),
        (DNS_RESP_LEARNED, "from_world", "dns_learned"),
        (DNS_RESP_UNSOLICITED, "from_world", "dns_unsolicited"),
        (DNS_RESP_MISMATCH, "from_world", "dns_mismatch"),
        (DNS_RESP_TRUNCATED, "from_world", "dns_truncated"),
        (DNS_RESP_UNPARSED, "from_world", "dns_unparsed"),
        (DNS_RESP_RCODE, "from_world", "dns_rcode"),
        (DNS_LEARN_FULL, "from_world", "dns_learn_full"),
        (DNS_NOT_WALKED, "from_world", "dns_not_walked"),
        (DNS_RESP_NOT_PUBLIC, "from_world", "dns_not_public"),
        (DNS_LEARNED_FLOW, "from_cube", "dns_learned_flow"),
        (DNS_TAIL_CALL_FAILED, "dns", "tail_call_failed"),
        (DNS_TAIL_BACK_FAILED, "dns", "tail_back_failed"),
        (CUBE_L7_NEW, "from_cube", "l7_new"),
        (CUBE_RECLASSIFIED, "from_cube", "reclassified"),
        (CUBE_L7_STEERED, "from_cube", "l7_steered"),
        (ENVOY_L7_REPLY, "from_envoy", "l7_reply"),
        (CUBE_DROP_SESSION_QUOTA, "from_cube", "drop_session_quota"),
        (CUBE_DROP_NODE_SESSIONS, "from_cube", "drop_node_sessions"),
        (CUBE_DROP_NEW_FLOW_RATE, "from_cube", "drop_new_flow_rate"),
        (WORLD_DROP_TO_SANDBOX, "from_world", "drop_to_sandbox"),
    ];
}

/// L7 steering to CubeEgress (`reference/upstream.md §3.3`, `§3.9`, `§4.2`): upstream's
/// `skb->mark` values under its mask, the defaults of `/etc/cubeegress/l7-marks.conf` that
/// `scripts/cube-egress-net.sh`'s TPROXY rules match on cube-dev.
pub mod l7 {
    /// Bits of `skb->mark` the datapath owns.
    pub const MARK_MASK: u32 = 0xFFFF_0000;
    /// Plain HTTP flows (TPROXY to the gateway's :8080).
    pub const MARK_HTTP: u32 = 0xCE01_0000;
    /// HTTPS flows (TPROXY to the gateway's :8443).
    pub const MARK_HTTPS: u32 = 0xCE02_0000;
    /// `NatSession::l7_scheme`: HTTP.
    pub const SCHEME_HTTP: u8 = 1;
    /// `NatSession::l7_scheme`: HTTPS.
    pub const SCHEME_HTTPS: u8 = 2;
    /// The scheme of a destination port (NBO) on an L7 address: 80 → HTTP, 443 → HTTPS,
    /// other ports 0 (not steered: the gateway listens for these two only).
    #[inline(always)]
    pub const fn scheme_of(dport_nbo: u16) -> u8 {
        match u16::from_be(dport_nbo) {
            80 => SCHEME_HTTP,
            443 => SCHEME_HTTPS,
            _ => 0,
        }
    }
    /// The mark value of `scheme`.
    #[inline(always)]
    pub const fn mark_of(scheme: u8) -> u32 {
        if scheme == SCHEME_HTTP { MARK_HTTP } else { MARK_HTTPS }
    }
}

/// Ethernet and ARP constants used by the ARP proxy.
pub mod ether {
    /// Length of an Ethernet II header.
    pub const HDR_LEN: usize = 14;
    /// EtherType IPv4.
    pub const P_IP: u16 = 0x0800;
    /// EtherType ARP.
    pub const P_ARP: u16 = 0x0806;
    /// Length of an Ethernet/IPv4 ARP payload.
    pub const ARP_LEN: usize = 28;
    /// ARP opcode: request.
    pub const ARP_OP_REQUEST: u16 = 1;
    /// ARP opcode: reply.
    pub const ARP_OP_REPLY: u16 = 2;
}

/// IP protocol numbers.
pub mod proto {
    /// ICMP.
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reverse_key_swaps_sides_and_zeroes_version() {
        let k = SessionKey { src_ip: 1, dst_ip: 2, sport: 3, dport: 4, version: 9, proto: proto::TCP, _pad: [0; 3] };
        let r = k.reverse(5, 6);
        assert_eq!((r.src_ip, r.dst_ip, r.sport, r.dport, r.version, r.proto), (2, 5, 4, 6, 0, proto::TCP));
        let icmp = SessionKey { proto: proto::ICMP, dport: 0, ..k };
        assert_eq!(icmp.reverse(5, 6).sport, 0, "ICMP: remote port 0, SNAT id in dport");
    }

    /// The bucket admits `burst` back to back, then one per interval; a long quiet spell
    /// refills it to `burst`, never beyond.
    #[test]
    fn new_flow_bucket_bursts_then_refills_at_the_rate() {
        let (rate, burst) = (10, 3);
        let mut tat = None;
        for i in 0..3 {
            assert_eq!(new_flow::available(tat, 1_000, rate, burst), 3 - i);
            tat = Some(new_flow::admit(tat, 1_000, rate, burst).expect("within the burst"));
        }
        assert_eq!(new_flow::admit(tat, 1_000, rate, burst), None, "beyond the burst");
        assert_eq!(new_flow::available(tat, 1_000, rate, burst), 0);
        // One interval (100 ms) later exactly one more.
        let t = 1_000 + 100_000_000;
        tat = Some(new_flow::admit(tat, t, rate, burst).expect("refilled one"));
        assert_eq!(new_flow::admit(tat, t, rate, burst), None);
        // An hour later: full, not more.
        let t = t + 3_600 * new_flow::NS_PER_SEC;
        assert_eq!(new_flow::available(tat, t, rate, burst), 3);
        for _ in 0..3 {
            tat = Some(new_flow::admit(tat, t, rate, burst).expect("full again"));
        }
        assert_eq!(new_flow::admit(tat, t, rate, burst), None);
    }
}
