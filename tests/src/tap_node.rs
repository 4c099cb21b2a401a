//! A node with one real TAP under the real datapath, for attacks whose frames only a TAP
//! writer can make (VLAN tags, the `virtio_net_hdr` in front of each frame: `attack_vlan`,
//! `attack_gso`, `attack_csum_offload`): a fresh topology with cube-dev, the TAP [`TAP`] opened as the pool
//! opens it (vnet header 12, CSUM/TSO), the CubeVS object pinned in the test's own bpffs and
//! attached (uplink, cube-dev, the TAP), SNAT to the node's uplink address, the sandbox
//! registered as version 1 (`sb-a`, [`A_IP`], its `sandbox_stats` zeroed) with the baseline
//! deny the agent installs on a fresh TAP. Everything goes with the value (datapath first,
//! then the pins and namespaces).

use std::net::Ipv4Addr;

use cubenet_sys::tap::{TapOptions, VNET_HDR_LEN};
use cubevs::{Datapath, LoadOptions, SandboxEntry, SnatAddr};

use crate::{
    bpffs::BpfFs,
    ebpf_object,
    guest::TapGuest,
    topology::{CUBE_DEV, CUBE_DEV_IP, NODE_IP, NODE_UPLINK, Topology},
};

/// The TAP's name.
pub const TAP: &str = "z192.168.0.3";
/// The sandbox's mvm IP, as registered.
pub const A_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 3);

/// See the module docs.
pub struct TapNode {
    /// The TAP queue, as a VMM holds it (closed before the namespaces go).
    pub guest: TapGuest,
    /// The node and world namespaces.
    pub topo: Topology,
    /// The TAP's ifindex (in the node namespace).
    pub ifindex: u32,
    /// The attached datapath (`Some` until drop).
    pub dp: Option<Datapath>,
    _bpffs: BpfFs,
}

impl Drop for TapNode {
    fn drop(&mut self) {
        // Programs and maps go before the bpffs they are pinned in.
        self.dp.take();
    }
}

impl TapNode {
    /// Builds the node (see the module docs). Panics on any setup failure (root needed).
    pub fn new() -> Self {
        let topo = Topology::new();
        topo.add_cube_dev();
        let (tap, ifindex) = topo.add_tap(TAP, TapOptions::POOL);
        let bpffs = BpfFs::new();
        let dp = Datapath::load(LoadOptions {
            object: ebpf_object(),
            pin_dir: Some(bpffs.path().join("cubevs")),
            ..LoadOptions::new()
        })
        .unwrap_or_else(|e| panic!("load datapath: {e}"));
        let dp = topo.node.run(move || {
            let mut dp = dp;
            dp.attach_uplink(NODE_UPLINK, Ipv4Addr::from(NODE_IP)).expect("attach uplink");
            dp.attach_cube_dev(CUBE_DEV, Ipv4Addr::from(CUBE_DEV_IP)).expect("attach cube-dev");
            dp.attach_sandbox(TAP).expect("attach sandbox");
            dp
        });
        let maps = dp.maps();
        let uplink = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).unwrap());
        maps.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: uplink }]).expect("snat");
        maps.sandbox_stats.reset(ifindex).expect("stats");
        let sb = SandboxEntry { ifindex, ip: A_IP, version: 1, id: "sb-a".into() };
        maps.sandboxes.register(&sb).expect("register");
        maps.policy.install_default_deny(ifindex).expect("policy");
        TapNode { guest: TapGuest::new(tap.into_fd(), VNET_HDR_LEN), topo, ifindex, dp: Some(dp), _bpffs: bpffs }
    }

    /// The attached datapath.
    pub fn dp(&self) -> &Datapath {
        self.dp.as_ref().expect("datapath")
    }

    /// Writes `buf` (a `virtio_net_hdr` of 12 bytes, then the frame) into the TAP, as a VMM
    /// does: the node sees the frame arrive on the TAP's ingress.
    pub fn write(&self, buf: &[u8]) {
        let n = nix::unistd::write(self.guest.fd(), buf).expect("write frame to TAP");
        assert_eq!(n, buf.len(), "short write to TAP");
    }

    /// Runs `ethtool -K <uplink> <args>` in the node namespace (offloads of the uplink).
    pub fn uplink_offloads(&self, args: &[&str]) {
        let mut a = vec!["-K", NODE_UPLINK];
        a.extend_from_slice(args);
        let o = self.topo.node.exec("ethtool", &a);
        assert!(o.status.success(), "ethtool: {}", String::from_utf8_lossy(&o.stderr));
    }
}

impl Default for TapNode {
    fn default() -> Self {
        Self::new()
    }
}
