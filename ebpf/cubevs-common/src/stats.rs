//! Per-sandbox counters: the value of the per-CPU hash map `sandbox_stats` (key: the sandbox
//! interface's `u32` ifindex, host order), written by `from_cube`, `from_world` and
//! `from_envoy` at their verdict points and summed over CPUs by userspace.
//!
//! Userspace owns the entries: it writes a zeroed [`SandboxStats`] when a sandbox is
//! registered on an interface (so the next owner of a reused TAP starts at 0) and deletes it
//! when the sandbox is unregistered. The programs only update an existing entry (never insert),
//! so the map never holds more entries than there are registered sandboxes.
//!
//! Directions are the sandbox's: **out** = what the guest sent and the datapath forwarded
//! (to the world, the node or the gateway), **in** = what the datapath delivered to the
//! guest's interface (reverse NAT, host-port DNAT, host → sandbox). Bytes are `skb->len` at
//! the verdict (the L2 frame without FCS), packets one per verdict.

/// Number of drop-reason slots in [`SandboxStats::drops`] (all used since decision Q4; a new
/// reason needs a layout change or has to share a slot).
pub const DROP_SLOTS: usize = 12;

/// Per-sandbox drop reasons: indexes into [`SandboxStats::drops`]. Each groups one or more
/// datapath counters (`crate::counter`), see [`drop_slot`].
pub mod drop {
    /// Denied by egress policy (`from_cube` `deny`; TCP answered with a RST).
    pub const POLICY: u32 = 0;
    /// Source address is not the guest's (`drop_spoof`).
    pub const SPOOF: u32 = 1;
    /// Not ARP/IPv4, a fragment, or a protocol other than TCP/UDP/ICMP echo (`drop_proto`).
    pub const PROTOCOL: u32 = 2;
    /// Truncated or malformed headers (`drop_malformed`).
    pub const MALFORMED: u32 = 3;
    /// Traffic to the gateway other than ICMP or TCP non-SYN (`drop_gateway`).
    pub const GATEWAY: u32 = 4;
    /// From a port-mapped guest port but not part of a connection the world opened to it
    /// (`drop_portmap_syn`, `drop_portmap_stale`, `drop_portmap_untracked`).
    pub const PORTMAP: u32 = 5;
    /// No SNAT address configured or no free SNAT port (`drop_no_snat`).
    pub const NO_SNAT_PORT: u32 = 6;
    /// The FIB found no route for the SNATed packet (`drop_fib`).
    pub const NO_ROUTE: u32 = 7;
    /// TCP non-SYN without a session (answered with a RST; `no_session`).
    pub const NO_SESSION: u32 = 8;
    /// A world RST outside the session's tracked window (`from_world` `drop_rst_window`).
    pub const RST_WINDOW: u32 = 9;
    /// New flow over the sandbox's live-session budget (`drop_session_quota`).
    pub const SESSION_QUOTA: u32 = 10;
    /// New flow of a sandbox at or over its floor while the node's shared sessions are at
    /// their ceiling (`drop_node_sessions`, decision Q4).
    pub const NODE_SESSIONS: u32 = 11;
    /// Names of the used slots, for metrics and the CLI (`reason` label values).
    pub const NAMES: &[(u32, &str)] = &[
        (POLICY, "policy"),
        (SPOOF, "spoof"),
        (PROTOCOL, "protocol"),
        (MALFORMED, "malformed"),
        (GATEWAY, "gateway"),
        (PORTMAP, "portmap"),
        (NO_SNAT_PORT, "no_snat_port"),
        (NO_ROUTE, "no_route"),
        (NO_SESSION, "no_session"),
        (RST_WINDOW, "rst_window"),
        (SESSION_QUOTA, "session_quota"),
        (NODE_SESSIONS, "node_sessions"),
    ];
}

/// The per-sandbox drop slot a datapath counter (`crate::counter::*`) adds to, or `None`
/// when that counter is not a drop of a registered sandbox's packet (verdicts that forward,
/// drops before a sandbox is known, drops of a previous owner's flows).
#[inline(always)]
pub const fn drop_slot(counter: u32) -> Option<u32> {
    use crate::counter as c;
    match counter {
        c::CUBE_DENY => Some(drop::POLICY),
        c::CUBE_DROP_SPOOF => Some(drop::SPOOF),
        c::CUBE_DROP_PROTO => Some(drop::PROTOCOL),
        c::CUBE_DROP_MALFORMED => Some(drop::MALFORMED),
        c::CUBE_DROP_GATEWAY => Some(drop::GATEWAY),
        c::CUBE_DROP_PORTMAP_SYN | c::CUBE_DROP_PORTMAP_STALE | c::CUBE_DROP_PORTMAP_UNTRACKED => Some(drop::PORTMAP),
        c::CUBE_DROP_NO_SNAT => Some(drop::NO_SNAT_PORT),
        c::CUBE_DROP_FIB => Some(drop::NO_ROUTE),
        c::CUBE_NO_SESSION => Some(drop::NO_SESSION),
        c::WORLD_DROP_RST_WINDOW => Some(drop::RST_WINDOW),
        c::CUBE_DROP_SESSION_QUOTA => Some(drop::SESSION_QUOTA),
        c::CUBE_DROP_NODE_SESSIONS => Some(drop::NODE_SESSIONS),
        _ => None,
    }
}

/// Counters of one sandbox on one CPU (userspace sums the per-CPU values).
///
/// Layout: 128 bytes, `#[repr(C)]`, sixteen `u64`, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SandboxStats {
    /// Packets the guest sent that the datapath forwarded.
    pub out_packets: u64,
    /// Bytes (`skb->len`) of those packets.
    pub out_bytes: u64,
    /// Packets the datapath delivered to the guest's interface.
    pub in_packets: u64,
    /// Bytes (`skb->len`) of those packets.
    pub in_bytes: u64,
    /// Drops by reason, indexed by [`drop`] slots.
    pub drops: [u64; DROP_SLOTS],
}

const _: () = assert!(core::mem::size_of::<SandboxStats>() == 128);
pod!(SandboxStats);
const _: () = assert!(drop::NAMES.len() <= DROP_SLOTS);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_drop_slot_is_named_once_and_in_range() {
        for (i, (slot, _)) in drop::NAMES.iter().enumerate() {
            assert!((*slot as usize) < DROP_SLOTS);
            assert_eq!(drop::NAMES.iter().filter(|(s, _)| s == slot).count(), 1, "slot {slot} named twice");
            assert_eq!(*slot as usize, i, "names in slot order");
        }
        // Every counter a slot maps to is a named drop; forwarding verdicts map to none.
        assert_eq!(drop_slot(crate::counter::CUBE_ESTABLISHED), None);
        assert_eq!(drop_slot(crate::counter::CUBE_DROP_UNREGISTERED), None, "no sandbox to charge");
        assert_eq!(drop_slot(crate::counter::WORLD_DROP_STALE_VERSION), None, "never the next owner's");
        assert_eq!(drop_slot(crate::counter::CUBE_DENY), Some(drop::POLICY));
    }
}
