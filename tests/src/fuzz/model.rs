//! The node state the fuzzer programs into the datapath's maps, and what it knows about it
//! without asking the datapath: which sandbox is registered where with which version, the
//! policy rule, the port maps, which connections the world opened to a host port.

use std::{collections::HashSet, net::Ipv4Addr};

use cubevs::{
    Maps, PortMapping, Proto, SandboxEntry, SnatAddr,
    policy::{BASELINE_DENY, EgressPolicy, parse_cidr},
};
use serde::{Deserialize, Serialize};

use super::rng::Rng;
use crate::topology::NODE_IP;

/// One sandbox as the fuzzer registered it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sandbox {
    /// Interface (TAP) ifindex.
    pub ifindex: u32,
    /// mvm IP.
    pub ip: [u8; 4],
    /// Registration version (changes when the TAP is reused by a new sandbox).
    pub version: u32,
    /// `false` between a release and the next reuse of the TAP.
    pub registered: bool,
    /// `allow_internet_access`.
    pub allow_internet: bool,
    /// `allow_out` CIDRs.
    pub allow_out: Vec<String>,
    /// `deny_out` CIDRs.
    pub deny_out: Vec<String>,
    /// Port maps (TCP/UDP, host port, guest port).
    pub ports: Vec<(bool, u16, u16)>,
}

impl Sandbox {
    /// The sandbox's egress policy.
    pub fn policy(&self) -> EgressPolicy {
        EgressPolicy {
            allow_internet_access: self.allow_internet,
            allow_out: self.allow_out.clone(),
            deny_out: self.deny_out.clone(),
            ..Default::default()
        }
    }

    /// The policy rule, written from its documentation (not from the datapath): an
    /// `allow_out` match always wins; otherwise the baseline private ranges, `deny_out` (or
    /// everything when `allow_internet_access` is false) deny; everything else is allowed.
    pub fn allows(&self, dst: [u8; 4]) -> bool {
        let hit = |c: &String| {
            let c = parse_cidr(c, "fuzz").expect("model CIDR");
            let mask = if c.len == 0 { 0 } else { u32::MAX << (32 - c.len) };
            u32::from_be_bytes(dst) & mask == u32::from(c.addr)
        };
        if self.allow_out.iter().any(hit) {
            return true;
        }
        let baseline: Vec<String> = BASELINE_DENY.iter().map(|s| s.to_string()).collect();
        if baseline.iter().any(hit) || !self.allow_internet {
            return false;
        }
        !self.deny_out.iter().any(hit)
    }
}

/// A connection the world opened to a host port (remote address/port, host port, proto).
pub type WorldOpened = ([u8; 4], u16, u16, u8);

/// The whole fuzzed node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    /// Sandboxes by slot.
    pub sandboxes: Vec<Sandbox>,
    /// Connections the world opened to a host port (filled by the oracle as DNATs happen).
    #[serde(skip)]
    pub world_opened: HashSet<WorldOpened>,
}

/// Destinations the generator and the policies draw from.
pub const DESTS: [[u8; 4]; 8] = [
    [198, 51, 100, 1],
    [203, 0, 113, 10],
    [8, 8, 8, 8],
    [10, 0, 0, 1],
    [1, 1, 1, 1],
    [192, 168, 0, 4],
    [172, 16, 0, 9],
    [100, 64, 0, 1],
];

const CIDRS: [&str; 7] =
    ["198.51.100.1/32", "203.0.113.0/24", "8.8.8.8", "10.0.0.0/8", "192.168.0.0/16", "0.0.0.0/1", "100.64.0.0/10"];

/// First ifindex of the fuzzed sandboxes (the rig's own sandbox uses 100).
pub const FIRST_IFINDEX: u32 = 100;
/// Guest ports that get mapped.
pub const GUEST_PORTS: [u16; 3] = [8080, 53, 22];

impl Model {
    /// A random node: `n` sandboxes with random versions, policies and port maps (host ports
    /// from the agent's default range 20000–29999, as the agent hands them out).
    pub fn random(rng: &mut Rng, n: usize) -> Self {
        // Versions never repeat on a node (the agent's promise, decision A8): each epoch draws
        // from its own block of 4,096 (random start + at most 48 reuses of +1..5), so a stale
        // entry an earlier epoch left in a map the reinstall does not clear
        // (`portmap_sessions`, `frag_sessions`) can never match a later sandbox (R7).
        static NEXT_BLOCK: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let base = NEXT_BLOCK.fetch_add(4096, std::sync::atomic::Ordering::Relaxed);
        let mut m = Model::default();
        for i in 0..n {
            let mut sb = Sandbox {
                ifindex: FIRST_IFINDEX + i as u32,
                ip: [192, 168, 0, 3 + i as u8],
                version: base + 1 + rng.below(1000) as u32,
                registered: true,
                allow_internet: true,
                allow_out: Vec::new(),
                deny_out: Vec::new(),
                ports: Vec::new(),
            };
            randomize_policy(rng, &mut sb);
            for (j, gp) in GUEST_PORTS.iter().enumerate() {
                if rng.chance(50) {
                    let tcp = rng.chance(60);
                    sb.ports.push((tcp, 20000 + 10 * i as u16 + j as u16, *gp));
                }
            }
            m.sandboxes.push(sb);
        }
        m
    }

    /// The registered sandbox on `ifindex`.
    pub fn on_ifindex(&self, ifindex: u32) -> Option<&Sandbox> {
        self.sandboxes.iter().find(|s| s.ifindex == ifindex && s.registered)
    }

    /// The registered sandbox with mvm IP `ip`.
    pub fn with_ip(&self, ip: [u8; 4]) -> Option<&Sandbox> {
        self.sandboxes.iter().find(|s| s.ip == ip && s.registered)
    }

    /// The port map of a registered sandbox for host port `host_port` (TCP when `tcp`):
    /// (sandbox, guest port).
    pub fn host_port(&self, tcp: bool, host_port: u16) -> Option<(&Sandbox, u16)> {
        self.sandboxes
            .iter()
            .filter(|s| s.registered)
            .find_map(|s| s.ports.iter().find(|p| p.0 == tcp && p.1 == host_port).map(|p| (s, p.2)))
    }

    /// Programs the node into `maps` from scratch: removes every session, port map, policy and
    /// registration the fuzzer may have left, resets the SNAT address (and its port cursor),
    /// then registers every sandbox.
    pub fn install(&self, maps: &Maps, uplink_ifindex: u32, max_ifindex: u32) {
        for (k, s) in maps.sessions.entries().expect("sessions") {
            maps.sessions.delete(&k, &s).expect("delete session");
        }
        for ifindex in FIRST_IFINDEX..=max_ifindex {
            maps.ports.delete_of(ifindex).expect("ports");
            maps.policy.remove(ifindex).expect("policy");
            maps.sandboxes.unregister(ifindex).expect("unregister");
        }
        maps.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: uplink_ifindex }]).expect("snat");
        for sb in &self.sandboxes {
            if sb.registered {
                register(maps, sb);
            }
        }
    }
}

fn randomize_policy(rng: &mut Rng, sb: &mut Sandbox) {
    sb.allow_internet = rng.chance(70);
    sb.allow_out = (0..rng.below(3)).map(|_| rng.pick(&CIDRS).to_string()).collect();
    sb.deny_out = (0..rng.below(3)).map(|_| rng.pick(&CIDRS).to_string()).collect();
}

/// Registers `sb` with its policy and port maps.
pub fn register(maps: &Maps, sb: &Sandbox) {
    maps.sandboxes
        .register(&SandboxEntry {
            ifindex: sb.ifindex,
            ip: Ipv4Addr::from(sb.ip),
            version: sb.version,
            id: format!("fuzz-{}", sb.ifindex),
        })
        .expect("register");
    maps.policy.replace(sb.ifindex, &sb.policy()).expect("policy");
    for &(tcp, host_port, guest_port) in &sb.ports {
        let proto = if tcp { Proto::Tcp } else { Proto::Udp };
        maps.ports.add(&PortMapping { proto, host_port, ifindex: sb.ifindex, guest_port }).expect("port map");
    }
}

/// A state change between frames.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// The agent releases the sandbox in slot `0` as it does today: sessions, port maps and
    /// policy deleted, then unregistered.
    Release(usize),
    /// The TAP of slot `0` goes to a new sandbox (same ifindex and mvm IP, version `1`, policy
    /// and ports as given) while sessions created by the previous one in the release window
    /// are still in the maps (issue 10 item 1 describes how they get there).
    Reuse(usize, u32, Box<Sandbox>),
}

impl Event {
    /// A random event for `model`.
    pub fn random(rng: &mut Rng, model: &Model) -> Self {
        let slot = rng.below(model.sandboxes.len());
        let sb = &model.sandboxes[slot];
        if sb.registered && rng.chance(50) {
            return Event::Release(slot);
        }
        let mut next = sb.clone();
        next.version = sb.version + 1 + rng.below(5) as u32;
        next.registered = true;
        randomize_policy(rng, &mut next);
        Event::Reuse(slot, next.version, Box::new(next))
    }

    /// Applies the event to the maps and the model.
    pub fn apply(&self, maps: &Maps, model: &mut Model) {
        match self {
            Event::Release(slot) => {
                let sb = &mut model.sandboxes[*slot];
                maps.sessions.delete_of(sb.ifindex).expect("delete sessions");
                maps.ports.delete_of(sb.ifindex).expect("ports");
                maps.policy.remove(sb.ifindex).expect("policy");
                maps.sandboxes.unregister(sb.ifindex).expect("unregister");
                sb.registered = false;
            }
            Event::Reuse(slot, _, next) => {
                let old = &model.sandboxes[*slot];
                if old.registered {
                    maps.ports.delete_of(old.ifindex).expect("ports");
                    maps.policy.remove(old.ifindex).expect("policy");
                    maps.sandboxes.unregister(old.ifindex).expect("unregister");
                }
                register(maps, next);
                model.sandboxes[*slot] = (**next).clone();
            }
        }
    }
}
