//! Per-packet cost with BPF_PROG_TEST_RUN (issue 6 §1): every program path, repeat=1 many
//! times (rewriting paths cannot be repeated in place), beside `baseline_pass` on the same
//! frame — the floor of a TC program run.

use cubenet_tests::{
    frames::{Tcp, icmp, tcp, udp},
    packet::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC, arp_request},
    rig::{Rig, SB_IFINDEX, SB_IP},
    topology::{CUBE_DEV_IP, NODE_IP, WORLD_IP},
};
use cubevs::{MapLimits, PortMapping, Proto, prog};

use crate::report::{Row, stats};

const RUNS: usize = 2000;

/// Case names of the new-flow rows.
const NEW_SYN: &str = "from_cube new TCP SYN (policy + session quota + session)";
const NEW_SYN_NO_QUOTA: &str = "from_cube new TCP SYN, no session quota (budget 0)";
const NEW_SYN_PORTMAP: &str =
    "from_cube new TCP SYN from a port-mapped guest port (dropped after session + port-map lookups)";
const NEW_SYN_OVER_BUDGET: &str = "from_cube new TCP SYN over the session budget (dropped after policy + quota check)";
const ESTABLISHED: &str = "from_cube established TCP (egress SNAT)";
const ROUNDS: usize = 5;

fn measure(
    rig: &Rig,
    program: &'static str,
    ifindex: u32,
    frame: impl Fn(usize) -> Vec<u8> + Send + Sync + Clone + 'static,
) -> (f64, (f64, f64)) {
    let mut all = Vec::new();
    for round in 0..ROUNDS {
        let f = frame.clone();
        let v = rig.run_many(program, ifindex, RUNS, move |i| f(round * RUNS + i));
        all.extend(v.into_iter().map(|x| x as f64));
    }
    stats(&mut all)
}

/// Runs the per-packet benchmark.
pub fn run() -> Vec<Row> {
    let rig = Rig::new();
    let m = &rig.maps;
    let (wm, um, up) = (rig.world_mac, rig.up_mac, rig.uplink_ifindex);
    let est = |_| {
        tcp(
            GUEST_MAC,
            GATEWAY_MAC,
            GUEST_IP,
            WORLD_IP,
            Tcp { sport: 40000, dport: 80, seq: 2, ack: Some(1), win: 1000, ..Default::default() },
            b"",
        )
    };
    // Sessions used by the established / reverse paths.
    rig.cube(tcp(
        GUEST_MAC,
        GATEWAY_MAC,
        GUEST_IP,
        WORLD_IP,
        Tcp { sport: 40000, dport: 80, seq: 1, syn: true, win: 1000, ..Default::default() },
        b"",
    ));
    rig.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, b"q"));
    let snat_port = m.sessions.list().unwrap().iter().find(|s| s.proto == "tcp").map(|s| s.snat_port).unwrap();
    m.ports.add(&PortMapping { proto: Proto::Tcp, host_port: 20080, ifindex: SB_IFINDEX, guest_port: 8080 }).unwrap();

    let floor = measure(&rig, prog::BASELINE_PASS, SB_IFINDEX, est);
    let base = Some(("baseline_pass".to_string(), floor.0));
    let mut rows = vec![Row {
        bench: "per-packet".into(),
        case: "baseline_pass (empty TC program)".into(),
        value: floor.0,
        spread: floor.1,
        unit: "ns/pkt".into(),
        baseline: None,
        target: None,
    }];
    let mut extra = Vec::new();
    let mut add = |case: &str,
                   program: &'static str,
                   ifx: u32,
                   target: Option<&str>,
                   f: Box<dyn Fn(usize) -> Vec<u8> + Send + Sync>| {
        let f: std::sync::Arc<dyn Fn(usize) -> Vec<u8> + Send + Sync> = f.into();
        let (v, s) = measure(&rig, program, ifx, move |i| f(i));
        rows.push(Row {
            bench: "per-packet".into(),
            case: case.into(),
            value: v,
            spread: s,
            unit: "ns/pkt".into(),
            baseline: base.clone(),
            target: target.map(str::to_string),
        });
    };
    add(ESTABLISHED, prog::FROM_CUBE, SB_IFINDEX, Some("<= 150 ns/pkt"), Box::new(est));
    // A new 5-tuple every run: vary the guest port and the remote address (10,000 runs, below
    // the default session budget of 16,384: every run creates a session).
    let new_syn = |i: usize| {
        let dst = [198, 51, 100, 1 + (i / 30000) as u8 % 200];
        tcp(
            GUEST_MAC,
            GATEWAY_MAC,
            GUEST_IP,
            dst,
            Tcp { sport: 1024 + (i % 30000) as u16, dport: 443, seq: 1, syn: true, win: 1000, ..Default::default() },
            b"",
        )
    };
    add(NEW_SYN, prog::FROM_CUBE, SB_IFINDEX, None, Box::new(new_syn));
    // Same run, same frames: a datapath loaded without the per-sandbox session quota (budget
    // 0). The difference to the row above is what the quota check and charge add.
    {
        let off = Rig::with_limits(MapLimits { sessions_per_sandbox: 0, ..MapLimits::default() });
        let (v, s) = measure(&off, prog::FROM_CUBE, SB_IFINDEX, new_syn);
        extra.push(Row {
            bench: "per-packet".into(),
            case: NEW_SYN_NO_QUOTA.into(),
            value: v,
            spread: s,
            unit: "ns/pkt".into(),
            baseline: base.clone(),
            target: None,
        });
    }
    // The new-flow breakdown (decision V7): the same kind of SYN (a new 5-tuple every run)
    // stopped at successive steps of the path. From a port-mapped guest port: dropped right
    // after the session lookup (a miss) and the port-map lookup (a hit).
    add(
        NEW_SYN_PORTMAP,
        prog::FROM_CUBE,
        SB_IFINDEX,
        None,
        Box::new(|i: usize| {
            tcp(
                GUEST_MAC,
                GATEWAY_MAC,
                GUEST_IP,
                [198, 51, 100, 1 + (i / 30000) as u8 % 200],
                Tcp {
                    sport: 8080,
                    dport: 1024 + (i % 30000) as u16,
                    seq: 1,
                    syn: true,
                    win: 1000,
                    ..Default::default()
                },
                b"",
            )
        }),
    );
    // A datapath whose sandbox holds its whole session budget (1, used by one session): the
    // SYN runs the port-map lookup (a miss), the policy (generation, both tries, the learned
    // addresses) and the quota check, then is dropped, before any session is created.
    {
        let full = Rig::with_limits(MapLimits { sessions_per_sandbox: 1, ..MapLimits::default() });
        full.cube(new_syn(usize::MAX / 2));
        let (v, s) = measure(&full, prog::FROM_CUBE, SB_IFINDEX, new_syn);
        extra.push(Row {
            bench: "per-packet".into(),
            case: NEW_SYN_OVER_BUDGET.into(),
            value: v,
            spread: s,
            unit: "ns/pkt".into(),
            baseline: base.clone(),
            target: None,
        });
    }
    // Same run, same frames: the budget but no node-wide floor (decision Q4), so the difference
    // to the first row is what the floor's lookups of `session_floor` add (the sandbox is above
    // its floor of 64 after its first flows, so the full check runs).
    {
        let off = Rig::with_limits(MapLimits { session_floor: 0, ..MapLimits::default() });
        let (v, s) = measure(&off, prog::FROM_CUBE, SB_IFINDEX, new_syn);
        extra.push(Row {
            bench: "per-packet".into(),
            case: "from_cube new TCP SYN, session quota without the node floor (floor 0)".into(),
            value: v,
            spread: s,
            unit: "ns/pkt".into(),
            baseline: base.clone(),
            target: None,
        });
    }
    // The node's always-denied list (decision R30): the same SYNs on fresh rigs, one with the
    // list empty (control), one with it full (64 /24s that never cover the destination, so every
    // SYN runs the `node_deny` lookup and goes on), measured alternately twice (A B A B, each
    // row the mean of its two medians) so drift of the machine hits both. The difference is
    // what the list costs a new flow.
    {
        let list: Vec<cubevs::Cidr> =
            (0..64).map(|i| cubevs::Cidr::new(std::net::Ipv4Addr::new(100, 100, i, 0), 24)).collect();
        let mut sums = [(0.0, (0.0, 0.0)); 2];
        for _ in 0..2 {
            for (k, full) in [false, true].into_iter().enumerate() {
                let rig = Rig::new();
                if full {
                    rig.maps.node_deny.replace(&list).expect("node_deny");
                }
                let (v, s) = measure(&rig, prog::FROM_CUBE, SB_IFINDEX, new_syn);
                sums[k] = (sums[k].0 + v / 2.0, (sums[k].1.0 + s.0 / 2.0, sums[k].1.1 + s.1 / 2.0));
            }
        }
        for (k, case) in [
            "from_cube new TCP SYN, fresh rig, always-denied list empty (control of the next row)",
            "from_cube new TCP SYN, fresh rig, always-denied list full (64 entries, no match)",
        ]
        .into_iter()
        .enumerate()
        {
            extra.push(Row {
                bench: "per-packet".into(),
                case: case.into(),
                value: sums[k].0,
                spread: sums[k].1,
                unit: "ns/pkt".into(),
                baseline: base.clone(),
                target: None,
            });
        }
    }
    add(
        "from_cube established UDP",
        prog::FROM_CUBE,
        SB_IFINDEX,
        None,
        Box::new(|_| udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, b"q")),
    );
    add(
        "from_cube ARP proxy",
        prog::FROM_CUBE,
        SB_IFINDEX,
        None,
        Box::new(|_| arp_request(GUEST_MAC, GUEST_IP, GATEWAY_IP)),
    );
    add(
        "from_cube gateway path (ICMP to gateway)",
        prog::FROM_CUBE,
        SB_IFINDEX,
        None,
        Box::new(|_| icmp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, GATEWAY_IP, true, 7, 1)),
    );
    add(
        "from_world reverse NAT (TCP)",
        prog::FROM_WORLD,
        up,
        None,
        Box::new(move |_| {
            tcp(
                wm,
                um,
                WORLD_IP,
                NODE_IP,
                Tcp { sport: 80, dport: snat_port, seq: 9, ack: Some(2), win: 1000, ..Default::default() },
                b"",
            )
        }),
    );
    add(
        "from_world host-port DNAT (TCP)",
        prog::FROM_WORLD,
        up,
        None,
        Box::new(move |_| {
            tcp(
                wm,
                um,
                [203, 0, 113, 9],
                NODE_IP,
                Tcp { sport: 5555, dport: 20080, seq: 1, syn: true, win: 1000, ..Default::default() },
                b"",
            )
        }),
    );
    add(
        "from_world pass-through (not ours)",
        prog::FROM_WORLD,
        up,
        None,
        Box::new(move |_| udp(wm, um, WORLD_IP, NODE_IP, 53, 31999, b"x")),
    );
    add(
        "from_envoy host -> sandbox",
        prog::FROM_ENVOY,
        0,
        None,
        Box::new(|_| {
            tcp(
                [2, 0, 0, 0, 0, 1],
                [2, 0, 0, 0, 0, 2],
                CUBE_DEV_IP,
                SB_IP,
                Tcp { sport: 4444, dport: 8080, seq: 5, syn: true, win: 100, ..Default::default() },
                b"",
            )
        }),
    );
    // Same run, same frame: the established path once more without the sandbox's
    // `sandbox_stats` entry (lookup miss, no update). The difference to the row above is what
    // per-sandbox counting adds.
    m.sandbox_stats.remove(SB_IFINDEX).expect("remove stats entry");
    add("from_cube established TCP, no per-sandbox counter entry", prog::FROM_CUBE, SB_IFINDEX, None, Box::new(est));
    m.sandbox_stats.reset(SB_IFINDEX).expect("reset stats entry");
    // The no-quota row right after the row it is compared with.
    let at = rows.iter().position(|r| r.case.contains("session quota + session")).map_or(rows.len(), |i| i + 1);
    for (i, r) in extra.into_iter().enumerate() {
        rows.insert(at + i, r);
    }
    rows
}

/// The new-flow entry of "Targets and misses" from the per-packet rows of `rows`: the new SYN
/// beside the floor and the established path, and what each step adds (the breakdown rows).
/// `None` without those rows.
pub fn new_flow_note(rows: &[Row]) -> Option<String> {
    let get = |case: &str| rows.iter().find(|r| r.bench == "per-packet" && r.case == case).map(|r| r.value);
    let floor = get("baseline_pass (empty TC program)")?;
    let (est, full, no_quota) = (get(ESTABLISHED)?, get(NEW_SYN)?, get(NEW_SYN_NO_QUOTA)?);
    let (portmap, over) = (get(NEW_SYN_PORTMAP)?, get(NEW_SYN_OVER_BUDGET)?);
    Some(format!(
        "- new-flow setup beside the floor (issue 15, no figure set): a new TCP SYN costs {full:.0} ns/pkt ({:.0} ns \
         above the {floor:.0} ns floor; the established path {est:.0} ns). The same SYN stopped at successive steps \
         (rows above): after the sandbox, session (miss) and port-map lookups {portmap:.0} ns; after the policy \
         (generation read twice, both LPM tries, two learned-address lookups) and the quota check {over:.0} ns \
         (+{:.0}); the rest (+{:.0}) is the port draw, the two session inserts, the quota charge, the SNAT rewrite \
         and the FIB forward, the last two also in the established row. Without a session budget {no_quota:.0} ns.\n",
        full - floor,
        over - portmap,
        full - over,
    ))
}
