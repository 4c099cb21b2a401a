//! The fuzz loop: epochs of a random node (sandboxes, versions, policies, port maps) and
//! frames for one target program, with other programs' frames mixed in so the target meets
//! live sessions and world-opened connections; every run of every program is checked by
//! [`super::oracle`]. The first failure of each invariant is minimized and saved as a
//! [`Case`].

use std::{collections::BTreeMap, path::PathBuf, time::Instant};

use cubevs::prog;
use cubevs_common::{NatSession, SessionKey};
use serde::Serialize;

use super::{
    case::{Case, Ingress, ReplyTo, Step, hex, unhex},
    frames::{self, Flow, proto},
    model::{DESTS, Event, FIRST_IFINDEX, GUEST_PORTS, Model},
    oracle::{self, Violation},
    rng::Rng,
};
use crate::{
    packet::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    rig::Rig,
    topology::{CUBE_DEV_IP, NODE_IP, NODE_UPLINK, WORLD_IP},
};

/// Sandboxes per epoch.
const SANDBOXES: usize = 3;
/// Steps per epoch (the node is reinstalled after each).
const EPOCH: usize = 48;
/// Highest ifindex the fuzzer registers (slots plus the rig's).
const MAX_IFINDEX: u32 = FIRST_IFINDEX + SANDBOXES as u32;

/// The three programs.
pub const PROGRAMS: [&str; 3] = [prog::FROM_CUBE, prog::FROM_WORLD, prog::FROM_ENVOY];

/// The outcome of one fuzz case.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Case name (`fuzz-<program>`).
    pub case: String,
    /// Seed.
    pub seed: u64,
    /// Frames run through the target program.
    pub inputs: u64,
    /// Runs of all programs (target + setup frames), all checked.
    pub runs: u64,
    /// Violations by invariant (over all runs).
    pub violations: BTreeMap<String, u64>,
    /// First detail seen per invariant.
    pub examples: BTreeMap<String, String>,
    /// Regression cases written.
    pub saved: Vec<PathBuf>,
    /// Wall time in seconds.
    pub secs: f64,
}

impl Report {
    /// Total violations.
    pub fn total(&self) -> u64 {
        self.violations.values().sum()
    }
}

type Snapshot = Vec<(SessionKey, NatSession)>;

/// Session map size of the fuzz rig: small, so the per-run snapshot (a batched walk of every
/// bucket) stays cheap; the fuzzer never holds more than a few hundred sessions.
pub const FUZZ_SESSIONS: u32 = 4096;

/// A [`Rig`] sized for fuzzing ([`FUZZ_SESSIONS`]).
pub fn rig() -> Rig {
    Rig::with_limits(cubevs::MapLimits { sessions: FUZZ_SESSIONS, ..Default::default() })
}

/// A rig plus what a step needs to run.
pub struct Runner<'a> {
    rig: &'a Rig,
    uplink: u32,
}

impl<'a> Runner<'a> {
    /// A runner on `rig`.
    pub fn new(rig: &'a Rig) -> Self {
        let uplink = rig.maps.node.get().expect("node config").uplink_ifindex;
        assert_ne!(uplink, 0, "rig has no uplink ifindex");
        let _ = NODE_UPLINK;
        Self { rig, uplink }
    }

    fn snapshot(&self) -> Snapshot {
        self.rig.maps.sessions.entries().expect("sessions")
    }

    /// Installs `model` from scratch; returns the (empty) session snapshot.
    pub fn install(&self, model: &Model) -> Snapshot {
        model.install(&self.rig.maps, self.uplink, MAX_IFINDEX);
        self.snapshot()
    }

    /// Runs one step, checks it, and updates `pre` to the sessions after it.
    pub fn step(&self, model: &mut Model, step: &Step, pre: &mut Snapshot) -> Vec<Violation> {
        let Step::Frame { program, ingress, hex: h, reply_to } = step else {
            let Step::Event(e) = step else { unreachable!() };
            e.apply(&self.rig.maps, model);
            *pre = self.snapshot();
            return Vec::new();
        };
        let mut frame = unhex(h);
        if let Some(r) = reply_to {
            reaim(&mut frame, r, pre);
        }
        let ifindex = match ingress {
            Ingress::Uplink => self.uplink,
            Ingress::Ifindex(i) => *i,
        };
        let program: &'static str = PROGRAMS.iter().find(|p| **p == program.as_str()).expect("program name");
        let out = self.rig.run(program, frame.clone(), ifindex);
        let post = self.snapshot();
        let v = match program {
            prog::FROM_CUBE => oracle::check_cube(model, ifindex, &frame, out.verdict, &out.data, &post),
            prog::FROM_WORLD => oracle::check_world(model, ifindex, self.uplink, &frame, out.verdict, &out.data, pre),
            _ => oracle::check_envoy(model, &frame, out.verdict, &out.data),
        };
        *pre = post;
        v
    }

    /// Replays `case` on a freshly installed node; returns the violations of every step
    /// (index, violation).
    pub fn replay(&self, case: &Case) -> Vec<(usize, Violation)> {
        let mut model = case.model.clone();
        let mut pre = self.install(&model);
        let mut out = Vec::new();
        for (i, s) in case.steps.iter().enumerate() {
            out.extend(self.step(&mut model, s, &mut pre).into_iter().map(|v| (i, v)));
        }
        out
    }

    /// Fuzzes `target` with `frames` inputs from `seed`; saves the first failure of each
    /// invariant (minimized) when `save`.
    pub fn fuzz(&self, target: &'static str, seed: u64, frames: u64, save: bool) -> Report {
        let start = Instant::now();
        let mut rng = Rng::new(seed ^ u64::from(target.len() as u32) << 32);
        let mut r = Report { case: format!("fuzz-{target}"), seed, ..Default::default() };
        while r.inputs < frames {
            let mut model = Model::random(&mut rng, SANDBOXES);
            let initial = model.clone();
            let mut pre = self.install(&model);
            let mut steps = Vec::new();
            for _ in 0..EPOCH {
                if r.inputs >= frames {
                    break;
                }
                let step = if rng.chance(3) {
                    Step::Event(Event::random(&mut rng, &model))
                } else {
                    let program = pick_program(&mut rng, target);
                    if program == target {
                        r.inputs += 1;
                    }
                    r.runs += 1;
                    self.frame_step(&mut rng, program, &model, &pre)
                };
                let v = self.step(&mut model, &step, &mut pre);
                steps.push(step);
                for x in v {
                    *r.violations.entry(x.invariant.to_string()).or_default() += 1;
                    if r.examples.contains_key(x.invariant) {
                        continue;
                    }
                    r.examples.insert(x.invariant.to_string(), x.detail.clone());
                    if save {
                        let case = Case {
                            case: r.case.clone(),
                            seed,
                            invariant: x.invariant.to_string(),
                            detail: x.detail.clone(),
                            model: initial.clone(),
                            steps: steps.clone(),
                        };
                        if let Some(p) = self.minimize(case.clone()).save() {
                            r.saved.push(p);
                        }
                        // Minimizing reinstalled the node: rebuild this epoch's state.
                        let _ = self.replay(&case);
                        pre = self.snapshot();
                    }
                }
            }
        }
        r.secs = start.elapsed().as_secs_f64();
        r
    }

    /// Drops every step before the last whose removal keeps the last step failing the same
    /// invariant (one greedy pass, last to first).
    fn minimize(&self, mut case: Case) -> Case {
        let fails = |c: &Case| {
            let last = c.steps.len() - 1;
            self.replay(c).iter().any(|(i, v)| *i == last && v.invariant == c.invariant)
        };
        if !fails(&case) {
            return case;
        }
        let mut i = case.steps.len() - 1;
        while i > 0 {
            i -= 1;
            let mut c = case.clone();
            c.steps.remove(i);
            if fails(&c) {
                case = c;
            }
        }
        case
    }

    fn frame_step(&self, rng: &mut Rng, program: &'static str, model: &Model, pre: &Snapshot) -> Step {
        let (frame, ingress, reply_to) = match program {
            prog::FROM_CUBE => {
                (cube_frame(rng, model, pre), Ingress::Ifindex(FIRST_IFINDEX + rng.below(4) as u32), None)
            }
            prog::FROM_WORLD => {
                let (f, r) = self.world_frame(rng, model, pre);
                let ingress =
                    if rng.chance(90) { Ingress::Uplink } else { Ingress::Ifindex(*rng.pick(&[FIRST_IFINDEX, 1, 0])) };
                (f, ingress, r)
            }
            _ => (envoy_frame(rng, model), Ingress::Ifindex(0), None),
        };
        Step::Frame { program: program.to_string(), ingress, hex: hex(&frame), reply_to }
    }

    fn world_frame(&self, rng: &mut Rng, model: &Model, pre: &Snapshot) -> (Vec<u8>, Option<ReplyTo>) {
        let (wmac, umac) = (self.rig.world_mac, self.rig.up_mac);
        let base = Flow {
            smac: wmac,
            dmac: umac,
            src: *rng.pick(&[WORLD_IP, DESTS[1], DESTS[2], DESTS[3]]),
            dst: NODE_IP,
            proto: *rng.pick(&[proto::TCP, proto::UDP, proto::ICMP]),
            sport: {
                let r = rng.u16();
                *rng.pick(&[80, 443, 53, 5000, r])
            },
            dport: rng.u16(),
        };
        let roll = rng.below(100);
        let (mut frame, reply) = if roll < 45 && !pre.is_empty() {
            let (k, s) = rng.pick(pre);
            let f = Flow {
                src: k.dst_ip.to_ne_bytes(),
                dst: s.node_ip.to_ne_bytes(),
                proto: k.proto,
                sport: if k.proto == proto::ICMP { u16::from_be(s.node_port) } else { u16::from_be(k.dport) },
                dport: u16::from_be(s.node_port),
                ..base
            };
            let key =
                (k.src_ip.to_ne_bytes(), k.dst_ip.to_ne_bytes(), u16::from_be(k.sport), u16::from_be(k.dport), k.proto);
            (frames::l4_frame(rng, &f, true), Some(key))
        } else if roll < 70 {
            let sb = rng.pick(&model.sandboxes);
            let ports: Vec<_> = sb.ports.clone();
            let (tcp, host) = if ports.is_empty() {
                (true, 20000)
            } else {
                let p = rng.pick(&ports);
                (p.0, p.1)
            };
            let f = Flow {
                proto: if tcp { proto::TCP } else { proto::UDP },
                dport: host,
                sport: 5000 + rng.below(3) as u16,
                ..base
            };
            (frames::l4_frame(rng, &f, false), None)
        } else if roll < 82 && !pre.is_empty() {
            // An ICMP error about a packet a session sent (PMTU, TTL).
            let (k, s) = rng.pick(pre);
            let inner = Flow {
                src: s.node_ip.to_ne_bytes(),
                dst: k.dst_ip.to_ne_bytes(),
                proto: k.proto,
                sport: u16::from_be(s.node_port),
                dport: u16::from_be(k.dport),
                ..base
            };
            let f = Flow { src: *rng.pick(&[k.dst_ip.to_ne_bytes(), [203, 0, 113, 1]]), proto: proto::ICMP, ..base };
            (frames::icmp_error(rng, &f, &inner), None)
        } else {
            let dst = *rng.pick(&[NODE_IP, NODE_IP, [192, 168, 0, 3], GUEST_IP]);
            {
                let reply = rng.chance(50);
                (frames::l4_frame(rng, &Flow { dst, ..base }, reply), None)
            }
        };
        if rng.chance(25) {
            frames::mutate(rng, &mut frame);
        }
        (frame, reply)
    }
}

fn pick_program(rng: &mut Rng, target: &'static str) -> &'static str {
    let setup = match target {
        prog::FROM_WORLD => 35,
        prog::FROM_CUBE => 20,
        _ => 10,
    };
    if !rng.chance(setup) {
        return target;
    }
    if target == prog::FROM_CUBE { prog::FROM_WORLD } else { prog::FROM_CUBE }
}

fn cube_frame(rng: &mut Rng, model: &Model, pre: &Snapshot) -> Vec<u8> {
    let spoof = *rng.pick(&[[192, 168, 0, 4], NODE_IP, [169, 254, 68, 7], [0, 0, 0, 0], [198, 51, 100, 9]]);
    let src = if rng.chance(90) { GUEST_IP } else { spoof };
    if rng.chance(8) {
        let tip = *rng.pick(&[GATEWAY_IP, NODE_IP, [192, 168, 0, 4], [8, 8, 8, 8]]);
        return frames::arp(rng, GUEST_MAC, src, tip);
    }
    let dst = match rng.below(20) {
        0..=1 => GATEWAY_IP,
        2 => NODE_IP,
        3 => CUBE_DEV_IP,
        4 => model.sandboxes[rng.below(model.sandboxes.len())].ip,
        _ => *rng.pick(&DESTS),
    };
    let mut f = Flow {
        smac: GUEST_MAC,
        dmac: if rng.chance(95) { GATEWAY_MAC } else { [0xff; 6] },
        src,
        dst,
        proto: *rng.pick(&[proto::TCP, proto::TCP, proto::UDP, proto::ICMP]),
        sport: if rng.chance(40) { *rng.pick(&GUEST_PORTS) } else { 40000 + rng.below(8) as u16 },
        dport: {
            let r = rng.u16();
            *rng.pick(&[80, 443, 53, 8080, 5000, 5001, 5002, r])
        },
    };
    if rng.chance(30) && !pre.is_empty() {
        // Continue a live session of some sandbox (the frame may arrive on another TAP).
        let (k, _) = rng.pick(pre);
        f.dst = k.dst_ip.to_ne_bytes();
        f.sport = u16::from_be(k.sport);
        f.dport = u16::from_be(k.dport);
        f.proto = k.proto;
    }
    if rng.chance(15) {
        // A reply from a mapped guest port to a world peer that may or may not have opened it.
        f.proto = proto::TCP;
        f.sport = *rng.pick(&GUEST_PORTS);
        f.dst = *rng.pick(&[WORLD_IP, DESTS[1], DESTS[3]]);
        f.dport = 5000 + rng.below(3) as u16;
    }
    let mut frame = frames::l4_frame(rng, &f, false);
    if rng.chance(25) {
        frames::mutate(rng, &mut frame);
    }
    frame
}

fn envoy_frame(rng: &mut Rng, model: &Model) -> Vec<u8> {
    let dst = if rng.chance(80) {
        model.sandboxes[rng.below(model.sandboxes.len())].ip
    } else {
        *rng.pick(&[[192, 168, 0, 9], NODE_IP, GUEST_IP, [8, 8, 8, 8]])
    };
    let f = Flow {
        smac: [0x02, 0, 0, 0, 0, 1],
        dmac: [0x02, 0, 0, 0, 0, 2],
        src: *rng.pick(&[CUBE_DEV_IP, CUBE_DEV_IP, NODE_IP, [10, 1, 2, 3]]),
        dst,
        proto: *rng.pick(&[proto::TCP, proto::UDP, proto::ICMP]),
        sport: rng.u16(),
        dport: {
            let r = rng.u16();
            *rng.pick(&[8080, 22, r])
        },
    };
    let reply = rng.chance(50);
    let mut frame = frames::l4_frame(rng, &f, reply);
    if rng.chance(30) {
        frames::mutate(rng, &mut frame);
    }
    frame
}

/// Re-aims a reply at the SNAT port the session `r` has now (the datapath may pick another
/// port on replay): rewrites the destination port (ICMP: identifier) and fixes the L4
/// checksum incrementally so its validity is unchanged.
fn reaim(frame: &mut [u8], r: &ReplyTo, pre: &Snapshot) {
    let Some((_, s)) = pre.iter().find(|(k, _)| {
        k.src_ip.to_ne_bytes() == r.0
            && k.dst_ip.to_ne_bytes() == r.1
            && u16::from_be(k.sport) == r.2
            && (r.4 == proto::ICMP || u16::from_be(k.dport) == r.3)
            && k.proto == r.4
    }) else {
        return;
    };
    let f = oracle::parse(frame);
    let Some(ip) = f.ip else { return };
    let l4 = 14 + ip.ihl;
    let (port_off, csum_off) = match ip.proto {
        proto::TCP => (2, 16),
        proto::UDP => (2, 6),
        proto::ICMP => (4, 2),
        _ => return,
    };
    if frame.len() < l4 + csum_off + 2 || frame.len() < l4 + port_off + 2 {
        return;
    }
    let old = u16::from_be_bytes([frame[l4 + port_off], frame[l4 + port_off + 1]]);
    let new = u16::from_be(s.node_port);
    frame[l4 + port_off..l4 + port_off + 2].copy_from_slice(&new.to_be_bytes());
    let c = u16::from_be_bytes([frame[l4 + csum_off], frame[l4 + csum_off + 1]]);
    if ip.proto == proto::UDP && c == 0 {
        return;
    }
    // RFC 1624: HC' = ~(~HC + ~m + m').
    let mut sum = u32::from(!c) + u32::from(!old) + u32::from(new);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    frame[l4 + csum_off..l4 + csum_off + 2].copy_from_slice(&(!(sum as u16)).to_be_bytes());
}
