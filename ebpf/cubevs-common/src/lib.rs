//! Types and constants shared by the CubeVS eBPF programs (kernel side) and the `cubevs`
//! userspace library.
//!
//! Every type here is read by both sides, so each is `#[repr(C)]`, spells out its padding as
//! named fields, and carries a compile-time size assertion. With the `user` feature the types
//! implement [`aya::Pod`] so userspace can use them as map keys/values and load-time globals.
//!
//! Byte order: fields named `*_ip` hold an IPv4 address in **network byte order** as read from
//! the wire into a `u32` (so `169.254.68.6` is `u32::from_ne_bytes([169, 254, 68, 6])`);
//! `ifindex` fields are host order.
#![no_std]

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

/// Name of the eBPF object file produced by `cargo xtask build-ebpf`.
pub const OBJECT_FILE_NAME: &str = "cubevs.bpf.o";

/// Program names inside the object (the `#[classifier]` function names).
pub mod prog {
    /// TC ingress of every sandbox interface (TAP, or a veth standing in for one).
    pub const FROM_CUBE: &str = "from_cube";
    /// Every TC program in the object, in load order.
    pub const ALL: &[&str] = &[FROM_CUBE];
}

/// Name of the load-time global holding [`DatapathConfig`].
pub const CONFIG_GLOBAL: &str = "CONFIG";

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
    /// Explicit padding to a multiple of 4 bytes; always zero.
    pub _pad: [u8; 4],
}

impl DatapathConfig {
    /// The upstream defaults (`reference/upstream.md §1.5`).
    pub const DEFAULT: Self = Self {
        mvm_inner_ip: u32::from_ne_bytes(guest::INNER_IP),
        mvm_gateway_ip: u32::from_ne_bytes(guest::GATEWAY_IP),
        mvm_mac: guest::MAC,
        gateway_mac: guest::GATEWAY_MAC,
        _pad: [0; 4],
    };
}

impl Default for DatapathConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 24);

pod!(DatapathConfig);

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
