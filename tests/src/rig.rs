//! A datapath under `BPF_PROG_TEST_RUN`: the CubeVS object loaded (unpinned, or pinned in a
//! test's own bpffs: [`Rig::pinned`]) with one registered sandbox (its `sandbox_stats` entry
//! zeroed, as the agent does), inside a fresh node/world topology so `from_cube`'s FIB lookup
//! resolves the uplink next hop to known MACs (permanent neighbour, forwarding on in the node
//! netns).

use std::{
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

use cubenet_sys::netns::NetnsThread;
use cubevs::{
    Datapath, LoadOptions, MapLimits, Maps, SandboxEntry, SnatAddr, prog,
    testrun::{self, SkBuffCtx, TestRunOutput, XdpMdCtx},
};

use crate::topology::{CUBE_DEV_IP, NODE_IP, NODE_UPLINK, Topology, mac_string};

/// ifindex the rig's sandbox is registered on (a number only; frames "arrive" on it).
pub const SB_IFINDEX: u32 = 100;
/// The rig sandbox's mvm IP.
pub const SB_IP: [u8; 4] = [192, 168, 0, 3];
/// The rig sandbox's version.
pub const VERSION: u32 = 7;
/// ifindex recorded for cube-dev (redirect target only).
pub const CUBE_DEV_IFINDEX: u32 = 55;

/// See the module docs.
pub struct Rig {
    dp: Arc<Mutex<Datapath>>,
    /// The datapath's maps.
    pub maps: Arc<Maps>,
    thread: NetnsThread,
    /// MAC of the world side of the uplink (the next hop).
    pub world_mac: [u8; 6],
    /// MAC of the node uplink.
    pub up_mac: [u8; 6],
    /// ifindex of the node uplink (recorded in `node_config`; `world` frames arrive on it).
    pub uplink_ifindex: u32,
    /// Where [`Rig::pinned`] pinned the datapath.
    pin_dir: Option<std::path::PathBuf>,
    /// The map limits the datapath was loaded with (and is reloaded with).
    limits: MapLimits,
    _topo: Topology,
}

impl Rig {
    /// Builds the rig with default map sizes.
    pub fn new() -> Self {
        Self::with_limits(MapLimits::default())
    }

    /// Builds the rig with default map sizes and `policy` (instead of default-deny) for its
    /// sandbox.
    pub fn with_policy(policy: &cubevs::EgressPolicy) -> Self {
        let r = Self::new();
        r.maps.policy.replace(SB_IFINDEX, policy).expect("policy");
        r
    }

    /// Builds the rig with `limits` (e.g. larger session maps for scale benchmarks).
    pub fn with_limits(limits: MapLimits) -> Self {
        Self::build(limits, None)
    }

    /// Builds the rig with its maps and programs pinned under `pin_dir` (a directory in a
    /// test's own bpffs, [`crate::bpffs::BpfFs`]), as the agent loads the datapath: slots,
    /// metadata and every map pinned; [`Rig::reload`] then loads it again as a new process
    /// would, adopting the pins.
    pub fn pinned(pin_dir: std::path::PathBuf) -> Self {
        Self::build(MapLimits::default(), Some(pin_dir))
    }

    /// [`Rig::pinned`] with `limits` ([`Rig::reload`] loads with them again).
    pub fn pinned_with_limits(pin_dir: std::path::PathBuf, limits: MapLimits) -> Self {
        Self::build(limits, Some(pin_dir))
    }

    /// Loads the datapath again from the pins of [`Rig::pinned`], as a restarted or upgraded
    /// agent does: the maps (sandbox, policy, learned addresses) are the pinned ones, the
    /// library rebuilds its view of them by scanning, and the old handles are dropped.
    pub fn reload(&mut self) {
        let pin_dir = self.pin_dir.clone().expect("reload needs a pinned rig");
        let dp = Datapath::load(LoadOptions {
            object: crate::ebpf_object(),
            pin_dir: Some(pin_dir),
            limits: self.limits,
            ..LoadOptions::new()
        })
        .expect("reload datapath");
        self.maps = dp.maps();
        *self.dp.lock().expect("datapath lock") = dp;
    }

    fn build(limits: MapLimits, pin_dir: Option<std::path::PathBuf>) -> Self {
        let topo = Topology::new();
        let world_mac = topo.world_mac();
        let up_mac = topo.node_uplink_mac();
        topo.node.ip(&[
            "neigh",
            "replace",
            "198.51.100.1",
            "lladdr",
            &mac_string(world_mac),
            "dev",
            NODE_UPLINK,
            "nud",
            "permanent",
        ]);
        // bpf_fib_lookup answers only when forwarding is on for the egress device.
        let out = topo.node.exec("sysctl", &["-qw", "net.ipv4.conf.up0.forwarding=1"]);
        assert!(out.status.success(), "sysctl in node netns: {}", String::from_utf8_lossy(&out.stderr));
        let dp = Datapath::load(LoadOptions {
            object: crate::ebpf_object(),
            limits,
            pin_dir: pin_dir.clone(),
            ..LoadOptions::new()
        })
        .expect("load datapath");
        let maps = dp.maps();
        let up = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).expect("uplink ifindex"));
        maps.node.set_uplink(up, Ipv4Addr::from(NODE_IP)).expect("node config");
        maps.node.set_cube_dev(CUBE_DEV_IFINDEX, Ipv4Addr::from(CUBE_DEV_IP)).expect("node config");
        maps.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: up }]).expect("snat");
        // As the agent does before registering: the sandbox's counters start at zero.
        maps.sandbox_stats.reset(SB_IFINDEX).expect("sandbox stats");
        maps.sandboxes
            .register(&SandboxEntry {
                ifindex: SB_IFINDEX,
                ip: Ipv4Addr::from(SB_IP),
                version: VERSION,
                id: "sb".into(),
            })
            .expect("register");
        maps.policy.install_default_deny(SB_IFINDEX).expect("policy");
        let thread = topo.node.thread();
        Self {
            dp: Arc::new(Mutex::new(dp)),
            maps,
            thread,
            world_mac,
            up_mac,
            uplink_ifindex: up,
            pin_dir,
            limits,
            _topo: topo,
        }
    }

    /// The datapath's global counter `c` (`cubevs_common::counter`).
    pub fn counter(&self, c: u32) -> u64 {
        self.maps.counters.get(c).expect("counter")
    }

    /// Registers another sandbox `e` as the agent does: its counters zeroed, then the entry,
    /// then a default-deny policy.
    pub fn add_sandbox(&self, e: &SandboxEntry) {
        self.maps.sandbox_stats.reset(e.ifindex).expect("sandbox stats");
        self.maps.sandboxes.register(e).expect("register");
        self.maps.policy.install_default_deny(e.ifindex).expect("policy");
    }

    /// A guest DNS query for `name` with `id` from the sandbox on `ifindex` (the rig's guest
    /// address), guest port `gport`, to `resolver`:53 through `from_cube`; asserts it was
    /// forwarded and returns the SNAT port of its session.
    pub fn dns_query(&self, ifindex: u32, gport: u16, id: u16, resolver: [u8; 4], name: &str) -> u16 {
        use crate::{
            dns,
            frames::udp,
            packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
        };
        let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, resolver, gport, 53, &dns::query(id, name));
        assert_eq!(self.run(prog::FROM_CUBE, f, ifindex).verdict, testrun::TC_ACT_REDIRECT, "query forwarded");
        let s = self.maps.sessions.list().expect("sessions");
        s.iter().find(|s| s.vm_ifindex == ifindex && s.guest_port == gport).expect("dns session").snat_port
    }

    /// The answer `addr` (one A record, TTL 600) for `name` with `id` from `resolver`:53 to
    /// the node's `snat_port` through `from_world`; asserts it was delivered.
    pub fn dns_respond(&self, snat_port: u16, id: u16, resolver: [u8; 4], name: &str, addr: [u8; 4]) {
        use crate::{
            dns::{self, Owner, a},
            frames::udp,
        };
        let msg = dns::response(id, name, &[a(Owner::Question, addr, 600)]);
        let out = self.world(udp(self.world_mac, self.up_mac, resolver, NODE_IP, 53, snat_port, &msg));
        assert_eq!(out.verdict, testrun::TC_ACT_REDIRECT, "response delivered");
    }

    /// The addresses the datapath learned for the sandbox on `ifindex`.
    pub fn learned_ips(&self, ifindex: u32) -> Vec<Ipv4Addr> {
        self.maps.policy.learned(Some(ifindex)).iter().map(|e| e.ip).collect()
    }

    /// `n` UDP sessions of the rig sandbox (guest ports 50,000 + i to the world's port 53, SNAT
    /// ports 31,000 + i), as an object older than the session quota left them: charged to
    /// neither the sandbox nor the node (`quota` and `node_quota` 0). For
    /// `SessionMaps::insert_batch`.
    pub fn uncharged_udp_sessions(&self, n: u16) -> Vec<(cubevs_common::SessionKey, cubevs_common::NatSession)> {
        use crate::topology::WORLD_IP;
        (0..n)
            .map(|i| {
                let key = cubevs_common::SessionKey {
                    src_ip: u32::from_ne_bytes(SB_IP),
                    dst_ip: u32::from_ne_bytes(WORLD_IP),
                    sport: (50_000 + i).to_be(),
                    dport: 53u16.to_be(),
                    version: VERSION,
                    proto: 17,
                    _pad: [0; 3],
                };
                let s = cubevs_common::NatSession {
                    access_ns: cubevs::reaper::monotonic_ns(),
                    node_ifindex: self.uplink_ifindex,
                    node_ip: u32::from_ne_bytes(NODE_IP),
                    vm_ifindex: SB_IFINDEX,
                    vm_ip: key.src_ip,
                    node_port: (31_000 + i).to_be(),
                    vm_port: key.sport,
                    ..Default::default()
                };
                (key, s)
            })
            .collect()
    }

    /// Runs `program` once on `frame` arriving on `ingress_ifindex` (in the node netns).
    pub fn run(&self, program: &'static str, frame: Vec<u8>, ingress_ifindex: u32) -> TestRunOutput {
        let dp = self.dp.clone();
        self.thread
            .run(move || {
                let mut dp = dp.lock().expect("datapath lock");
                let p = dp.program(program).expect("program");
                testrun::run(p, &frame, SkBuffCtx { ingress_ifindex, ..Default::default() }, 1).expect("test run")
            })
            .expect("node thread")
    }

    /// Runs `program` on `frame` `repeat` times inside one `BPF_PROG_TEST_RUN` (the kernel
    /// loops; a frame the program rewrites is rerun rewritten). Returns the last run's output.
    pub fn run_repeat(
        &self,
        program: &'static str,
        frame: Vec<u8>,
        ingress_ifindex: u32,
        repeat: u32,
    ) -> TestRunOutput {
        let dp = self.dp.clone();
        self.thread
            .run(move || {
                let mut dp = dp.lock().expect("datapath lock");
                let p = dp.program(program).expect("program");
                testrun::run(p, &frame, SkBuffCtx { ingress_ifindex, ..Default::default() }, repeat).expect("test run")
            })
            .expect("node thread")
    }

    /// Runs `program` `n` times on `frame(i)` in one hop to the node thread; returns the
    /// kernel-measured ns of each run.
    pub fn run_many(
        &self,
        program: &'static str,
        ingress_ifindex: u32,
        n: usize,
        frame: impl Fn(usize) -> Vec<u8> + Send + 'static,
    ) -> Vec<u64> {
        let dp = self.dp.clone();
        self.thread
            .run(move || {
                let mut dp = dp.lock().expect("datapath lock");
                let p = dp.program(program).expect("program");
                (0..n)
                    .map(|i| {
                        let f = frame(i);
                        testrun::run(p, &f, SkBuffCtx { ingress_ifindex, ..Default::default() }, 1)
                            .expect("test run")
                            .duration
                            .as_nanos() as u64
                    })
                    .collect()
            })
            .expect("node thread")
    }

    /// A second handle of the rig datapath's kernel map `name` (`cubevs_common::map::*`),
    /// found among the maps `program` uses, for tests that set map state no frame can set
    /// quickly (e.g. a map nearly full of other sandboxes' entries). The kernel keeps the
    /// first 15 bytes of a map's name (`BPF_OBJ_NAME_LEN`), so a longer `name` is matched on
    /// those. Panics when `program` uses no map of that name.
    pub fn kernel_map(&self, program: &'static str, name: &str) -> aya::maps::MapData {
        let dp = self.dp.clone();
        let ids = self
            .thread
            .run(move || {
                let mut dp = dp.lock().expect("datapath lock");
                let info = dp.program(program).expect("program").info().expect("program info");
                info.map_ids().expect("map ids").unwrap_or_default()
            })
            .expect("node thread");
        let kernel_name = &name[..name.len().min(15)];
        let id = ids
            .into_iter()
            .find(|id| {
                aya::maps::MapInfo::from_id(*id).ok().and_then(|i| i.name_as_str().map(|n| n == kernel_name))
                    == Some(true)
            })
            .unwrap_or_else(|| panic!("{program} uses no map named {name}"));
        aya::maps::MapData::from_id(id).expect("open map by id")
    }

    /// `from_cube` on the rig sandbox's interface.
    pub fn cube(&self, frame: Vec<u8>) -> TestRunOutput {
        self.run(prog::FROM_CUBE, frame, SB_IFINDEX)
    }

    /// `from_world` on the uplink.
    pub fn world(&self, frame: Vec<u8>) -> TestRunOutput {
        self.run(prog::FROM_WORLD, frame, self.uplink_ifindex)
    }
}

impl Rig {
    /// `xdp_world` on a frame received by the device `ingress_ifindex` (in the node netns;
    /// normally [`Rig::uplink_ifindex`]).
    pub fn xdp_on(&self, frame: Vec<u8>, ingress_ifindex: u32) -> TestRunOutput {
        self.xdp_repeat(frame, ingress_ifindex, 1)
    }

    /// `xdp_world` on the uplink.
    pub fn xdp(&self, frame: Vec<u8>) -> TestRunOutput {
        self.xdp_on(frame, self.uplink_ifindex)
    }

    /// Runs the XDP program `program` `n` times on `frame(i)` received by `ingress_ifindex`, in
    /// one hop to the node thread; returns the kernel-measured ns of each run.
    pub fn xdp_many(
        &self,
        program: &'static str,
        ingress_ifindex: u32,
        n: usize,
        frame: impl Fn(usize) -> Vec<u8> + Send + 'static,
    ) -> Vec<u64> {
        let dp = self.dp.clone();
        self.thread
            .run(move || {
                let mut dp = dp.lock().expect("datapath lock");
                let p = dp.xdp_program_named(program).expect("xdp program");
                let ctx = XdpMdCtx { ingress_ifindex, rx_queue_index: 0 };
                (0..n)
                    .map(|i| {
                        let f = frame(i);
                        testrun::run_xdp(p, &f, ctx, 1).expect("xdp test run").duration.as_nanos() as u64
                    })
                    .collect()
            })
            .expect("node thread")
    }

    /// `xdp_world` `repeat` times inside one `BPF_PROG_TEST_RUN`; the last run's output.
    pub fn xdp_repeat(&self, frame: Vec<u8>, ingress_ifindex: u32, repeat: u32) -> TestRunOutput {
        let dp = self.dp.clone();
        self.thread
            .run(move || {
                let mut dp = dp.lock().expect("datapath lock");
                let p = dp.xdp_program().expect("xdp program");
                testrun::run_xdp(p, &frame, XdpMdCtx { ingress_ifindex, rx_queue_index: 0 }, repeat)
                    .expect("xdp test run")
            })
            .expect("node thread")
    }
}

impl Default for Rig {
    fn default() -> Self {
        Self::new()
    }
}
