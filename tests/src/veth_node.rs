//! A node with one real veth guest under the real datapath, for attacks a guest makes on the
//! node itself (`attack_node_local`, `attack_gateway_icmp`): a fresh topology with cube-dev,
//! guest 0 ([`A_IP`] unless [`VethNode::with`] says otherwise), the CubeVS object pinned in the
//! test's own bpffs and attached (uplink, cube-dev, the guest), SNAT to the node's uplink
//! address, the guest registered as version 1 (`sb-a`, its `sandbox_stats` zeroed) with an open
//! egress policy (0.0.0.0/0), and the node namespace's loopback up. Everything goes with the value (datapath first, then the pins and
//! namespaces).

use std::net::Ipv4Addr;

use cubevs::{Datapath, EgressPolicy, LoadOptions, SandboxEntry, SnatAddr};

use crate::{
    bpffs::BpfFs,
    ebpf_object,
    guest::VethGuest,
    topology::{NODE_IP, NODE_UPLINK, Topology},
};

/// The guest's mvm IP, as registered (the guest itself runs with the fixed inner address
/// 169.254.68.6, as a real guest does).
pub const A_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 3);

/// See the module docs.
pub struct VethNode {
    /// The node, world and guest namespaces.
    pub topo: Topology,
    /// The one guest.
    pub a: VethGuest,
    /// The attached datapath (`Some` until drop).
    pub dp: Option<Datapath>,
    _bpffs: BpfFs,
}

impl Drop for VethNode {
    fn drop(&mut self) {
        // Programs and maps go before the bpffs they are pinned in.
        self.dp.take();
    }
}

impl VethNode {
    /// Builds the node (see the module docs). Panics on any setup failure (root needed).
    pub fn new() -> Self {
        let open = EgressPolicy { allow_out: vec!["0.0.0.0/0".into()], ..Default::default() };
        Self::with(A_IP, "sb-a", Some(&open))
    }

    /// The node with the guest registered as `ip` / `id` (version 1) and `policy` (`None`: the
    /// baseline deny, as the agent installs on a fresh TAP).
    pub fn with(ip: Ipv4Addr, id: &str, policy: Option<&EgressPolicy>) -> Self {
        let mut topo = Topology::new();
        topo.add_cube_dev();
        let a = topo.add_veth_guest(0);
        let bpffs = BpfFs::new();
        let dp = Datapath::load(LoadOptions {
            object: ebpf_object(),
            pin_dir: Some(bpffs.path().join("cubevs")),
            ..LoadOptions::new()
        })
        .unwrap_or_else(|e| panic!("load datapath: {e}"));
        let dp = topo.attach_datapath(dp, &[&a]);
        let maps = dp.maps();
        let uplink = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).unwrap());
        maps.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: uplink }]).expect("snat");
        maps.sandbox_stats.reset(a.node_ifindex).expect("stats");
        maps.sandboxes
            .register(&SandboxEntry { ifindex: a.node_ifindex, ip, version: 1, id: id.into() })
            .expect("register the guest");
        match policy {
            Some(p) => maps.policy.replace(a.node_ifindex, p).expect("the guest's policy"),
            None => maps.policy.install_default_deny(a.node_ifindex).expect("the guest's baseline deny"),
        }
        topo.node.ip(&["link", "set", "lo", "up"]);
        VethNode { topo, a, dp: Some(dp), _bpffs: bpffs }
    }

    /// The attached datapath.
    pub fn dp(&self) -> &Datapath {
        self.dp.as_ref().expect("datapath")
    }
}

impl Default for VethNode {
    fn default() -> Self {
        Self::new()
    }
}
