//! Test topologies: a "node" namespace (where the datapath lives) with a veth uplink to a
//! "world" namespace (the outside), and sandbox guests hanging off the node.
//!
//! ```text
//!  world ns                      node ns                         guest ns (veth guest)
//!  wp0 198.51.100.1/24 ──veth── up0 198.51.100.2/24
//!                                vg<N> ─────────────veth──────── eth0 169.254.68.6/30
//!                                                                 MAC 20:90:6f:fc:fc:fc
//!                                tap<N> ◄── fd held by a TapGuest   default via 169.254.68.5
//! ```

use cubenet_sys::tap::{Tap, TapOptions};

use crate::{guest::VethGuest, netns::TestNetns};

/// Uplink interface name in the node namespace.
pub const NODE_UPLINK: &str = "up0";
/// cube-dev name in the node namespace.
pub const CUBE_DEV: &str = "cube-dev";
/// cube-dev address (the default sandbox CIDR 192.168.0.0/18's .1).
pub const CUBE_DEV_IP: [u8; 4] = [192, 168, 0, 1];
/// Uplink peer name in the world namespace.
pub const WORLD_IF: &str = "wp0";
/// Node uplink address.
pub const NODE_IP: [u8; 4] = [198, 51, 100, 2];
/// World address (the node's default gateway).
pub const WORLD_IP: [u8; 4] = [198, 51, 100, 1];
/// Prefix length of the uplink subnet.
pub const UPLINK_PREFIX: u8 = 24;

/// Dotted-quad rendering of an address.
pub fn dotted(ip: [u8; 4]) -> String {
    std::net::Ipv4Addr::from(ip).to_string()
}

/// Node and world namespaces joined by a veth uplink. Dropping it deletes both namespaces
/// (and with them every device inside).
#[derive(Debug)]
pub struct Topology {
    /// Guests are dropped before the namespaces they hang off.
    guests: Vec<TestNetns>,
    /// The node namespace (where the datapath and sandbox interfaces live).
    pub node: TestNetns,
    /// The world namespace (servers, the default gateway).
    pub world: TestNetns,
}

impl Topology {
    /// Builds node + world with the uplink configured and the node's default route via world.
    pub fn new() -> Self {
        let node = TestNetns::new("node");
        let world = TestNetns::new("world");
        node.ip(&["link", "add", NODE_UPLINK, "type", "veth", "peer", "name", WORLD_IF, "netns", world.name()]);
        node.ip(&["addr", "add", &format!("{}/{UPLINK_PREFIX}", dotted(NODE_IP)), "dev", NODE_UPLINK]);
        node.ip(&["link", "set", NODE_UPLINK, "up"]);
        world.ip(&["addr", "add", &format!("{}/{UPLINK_PREFIX}", dotted(WORLD_IP)), "dev", WORLD_IF]);
        world.ip(&["link", "set", WORLD_IF, "up"]);
        node.ip(&["route", "add", "default", "via", &dotted(WORLD_IP)]);
        Self { guests: Vec::new(), node, world }
    }

    /// Adds a veth guest: a namespace whose `eth0` is configured like a microVM NIC
    /// (169.254.68.6/30, MAC 20:90:6f:fc:fc:fc, default via 169.254.68.5, IPv6 off), with its peer
    /// `vg<index>` up in the node namespace. The datapath treats `vg<index>` like a TAP.
    pub fn add_veth_guest(&mut self, index: u32) -> VethGuest {
        let ns = TestNetns::new(&format!("g{index}"));
        let node_if = format!("vg{index}");
        self.node.ip(&["link", "add", &node_if, "type", "veth", "peer", "name", "eth0", "netns", ns.name()]);
        self.node.ip(&["link", "set", &node_if, "up"]);
        let mac = mac_string(cubevs_mac());
        ns.ip(&["link", "set", "eth0", "address", &mac]);
        ns.ip(&["addr", "add", "169.254.68.6/30", "dev", "eth0"]);
        // IPv6 off, as on the test TAPs: the kernel's own router solicitations, MLD reports and
        // DAD probes would otherwise reach the datapath at random moments and count as drops.
        ns.run(|| {
            let _ = std::fs::write("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "1");
        });
        ns.ip(&["link", "set", "eth0", "up"]);
        ns.ip(&["route", "add", "default", "via", "169.254.68.5"]);
        let node_ifindex = self.node.run({
            let n = node_if.clone();
            move || cubenet_sys::ifindex(&n).expect("veth ifindex")
        });
        let path = ns.path();
        let name = ns.name().to_string();
        self.guests.push(ns);
        VethGuest { ns_name: name, ns_path: path, node_if, node_ifindex }
    }

    /// Creates TAP `name` in the node namespace with `opts`, sets it up with IPv6 off, and
    /// returns the open queue fd (the caller plays the VMM). The TAP disappears with the
    /// node namespace.
    pub fn add_tap(&self, name: &str, opts: TapOptions) -> (Tap, u32) {
        let n = name.to_string();
        let (tap, ifindex) = self.node.run(move || {
            let tap = Tap::open(&n, opts).expect("create TAP");
            let idx = cubenet_sys::ifindex(&n).expect("TAP ifindex");
            let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{n}/disable_ipv6"), "1");
            (tap, idx)
        });
        self.node.ip(&["link", "set", name, "up"]);
        (tap, ifindex)
    }

    /// Creates cube-dev in the node namespace like the agent does (`reference/upstream.md
    /// §2.8`): gateway MAC, `192.168.0.1/18` (so the CIDR routes through it), NOARP, up.
    /// Upstream uses a dummy; this machine's kernel has no dummy driver, so here it is one end
    /// of a veth pair whose peer `cube-dev-p` is up and unused (the agent itself falls back to
    /// an ifb, `docs/decisions.md` A4).
    /// Returns its ifindex.
    pub fn add_cube_dev(&self) -> u32 {
        self.node.ip(&["link", "add", CUBE_DEV, "type", "veth", "peer", "name", "cube-dev-p"]);
        self.node.ip(&["link", "set", "cube-dev-p", "up"]);
        self.node.ip(&["link", "set", CUBE_DEV, "arp", "off"]);
        self.node.ip(&["link", "set", CUBE_DEV, "address", &mac_string(crate::packet::GATEWAY_MAC)]);
        self.node.ip(&["addr", "add", &format!("{}/18", dotted(CUBE_DEV_IP)), "dev", CUBE_DEV]);
        self.node.ip(&["link", "set", CUBE_DEV, "up"]);
        self.node.run(|| cubenet_sys::ifindex(CUBE_DEV).expect("cube-dev ifindex"))
    }

    /// Attaches `dp` in the node namespace (on its thread, like the agent): the uplink, cube-dev
    /// ([`Self::add_cube_dev`]) and each interface of `sandboxes` (adopting whatever the pins
    /// already hold). Returns it.
    pub fn attach_datapath(&self, dp: cubevs::Datapath, sandboxes: &[&VethGuest]) -> cubevs::Datapath {
        let ifs: Vec<String> = sandboxes.iter().map(|g| g.node_if.clone()).collect();
        self.node
            .thread()
            .run(move || {
                let mut dp = dp;
                dp.attach_uplink(NODE_UPLINK, std::net::Ipv4Addr::from(NODE_IP)).expect("attach uplink");
                dp.attach_cube_dev(CUBE_DEV, std::net::Ipv4Addr::from(CUBE_DEV_IP)).expect("attach cube-dev");
                for i in &ifs {
                    dp.attach_sandbox(i).expect("attach guest");
                }
                dp
            })
            .expect("node thread")
    }

    /// Adds `cidr` on the world side (an extra address on `wp0`) and routes it from the
    /// node via world, e.g. a "private-range" server address.
    pub fn add_world_address(&self, addr: [u8; 4], prefix: u8) {
        self.world.ip(&["addr", "add", &format!("{}/{prefix}", dotted(addr)), "dev", WORLD_IF]);
        let net = u32::from_be_bytes(addr) & (u32::MAX << (32 - prefix));
        let net = std::net::Ipv4Addr::from(net);
        self.node.ip(&["route", "add", &format!("{net}/{prefix}"), "via", &dotted(WORLD_IP)]);
    }

    /// The world side's MAC (what the node's FIB resolves its next hop to).
    pub fn world_mac(&self) -> [u8; 6] {
        self.world.run(|| read_mac(WORLD_IF))
    }

    /// The node uplink's MAC.
    pub fn node_uplink_mac(&self) -> [u8; 6] {
        self.node.run(|| read_mac(NODE_UPLINK))
    }

    /// The namespace of a guest added with [`Topology::add_veth_guest`].
    pub fn guest_ns(&self, guest: &VethGuest) -> &TestNetns {
        self.guests.iter().find(|g| g.name() == guest.ns_name).expect("guest belongs to this topology")
    }
}

impl Default for Topology {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Guests first (their veth peers live in node), then node and world (field order).
        self.guests.clear();
    }
}

fn cubevs_mac() -> [u8; 6] {
    crate::packet::GUEST_MAC
}

/// `aa:bb:cc:dd:ee:ff` rendering of a MAC.
pub fn mac_string(mac: [u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// The MAC of `ifname` in the calling thread's netns (`SIOCGIFHWADDR`; sysfs would show the
/// mount namespace's view instead).
fn read_mac(ifname: &str) -> [u8; 6] {
    // SIOCGIFHWADDR on a socket created in this thread's netns.
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("socket for SIOCGIFHWADDR");
    let mut req = [0u8; 40];
    req[..ifname.len()].copy_from_slice(ifname.as_bytes());
    // SAFETY: SIOCGIFHWADDR fills a struct ifreq (40 bytes) in place.
    let rc = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&sock), libc::SIOCGIFHWADDR, req.as_mut_ptr()) };
    assert_eq!(rc, 0, "SIOCGIFHWADDR {ifname}: {}", std::io::Error::last_os_error());
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&req[18..24]);
    mac
}
