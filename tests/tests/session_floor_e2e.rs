//! The node-wide reserved floor end to end (decision Q4): three veth guests (real kernel
//! stacks) behind the real datapath (pinned, tcx) with 256-entry session maps, budget 128 and
//! floor 16. Guests A and B collude: each floods 200 new UDP flows. A stops at its budget, B at
//! the node-wide ceiling (256 − 3 × 16 − CPUs); victim V still gets 16 answered flows, and its
//! 17th is dropped as `drop_node_sessions`, not for a full map. Without the floor (main before
//! Q4) A and B hold 128 + 128 = every entry and none of V's flows gets through.

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use cubenet_tests::{
    bpffs::BpfFs,
    ebpf_object,
    guest::VethGuest,
    require_root,
    servers::{self, udp_ask, udp_flood},
    topology::{NODE_IP, NODE_UPLINK, Topology, WORLD_IP},
};
use cubevs::{
    Datapath, LoadOptions, MapLimits, SandboxEntry, SnatAddr,
    quota::{floor_ceiling, floor_margin},
    reaper::{self, Timeouts},
};
use cubevs_common::counter;

const CAP: u32 = 256;
const BUDGET: u32 = 128;
const FLOOR: u32 = 16;
const FLOOD: usize = 200;

fn load_attach(topo: &Topology, bpffs: &BpfFs, guests: &[&VethGuest]) -> Datapath {
    let dp = Datapath::load(LoadOptions {
        object: ebpf_object(),
        pin_dir: Some(bpffs.path().join("cubevs")),
        limits: MapLimits {
            sessions: CAP,
            sandboxes: 4,
            sessions_per_sandbox: BUDGET,
            session_floor: FLOOR,
            ..Default::default()
        },
        ..LoadOptions::new()
    })
    .unwrap_or_else(|e| panic!("load datapath: {e}"));
    topo.attach_datapath(dp, guests)
}

#[test]
fn colluding_guests_leave_the_victim_its_floor() {
    if !require_root("session_floor_e2e colluding_guests_leave_the_victim_its_floor") {
        return;
    }
    let mut topo = Topology::new();
    topo.add_cube_dev();
    let a = topo.add_veth_guest(0);
    let b = topo.add_veth_guest(1);
    let v = topo.add_veth_guest(2);
    let bpffs = BpfFs::new();
    let dp = load_attach(&topo, &bpffs, &[&a, &b, &v]);
    let maps = dp.maps();
    let uplink = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).unwrap());
    maps.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: uplink }]).expect("snat");
    for (i, g) in [&a, &b, &v].into_iter().enumerate() {
        let ip = Ipv4Addr::new(192, 168, 0, 3 + i as u8);
        maps.sandbox_stats.reset(g.node_ifindex).expect("stats");
        let e = SandboxEntry { ifindex: g.node_ifindex, ip, version: 1, id: format!("sb-{i}") };
        maps.sandboxes.register(&e).expect("register");
        maps.policy.install_default_deny(g.node_ifindex).expect("policy");
    }
    let ceiling = floor_ceiling(CAP, 3, FLOOR, floor_margin());
    let st = maps.sessions.floor_state().unwrap().expect("floor map");
    assert_eq!((st.floor, st.ceiling), (FLOOR, ceiling));
    assert!(ceiling > BUDGET && ceiling < 2 * BUDGET, "A fits under the ceiling, A + B do not");
    let _echo = servers::udp_echo(&topo.world, WORLD_IP, 5353);
    let echo = SocketAddr::from((WORLD_IP, 5353));
    for g in [&a, &b, &v] {
        let _ = topo.guest_ns(g).exec("ping", &["-c", "1", "-W", "1", "169.254.68.5"]);
    }
    let live = |g: &VethGuest| maps.sessions.quota_usage(g.node_ifindex, 1).unwrap().map_or(0, |u| u.live());
    let drops = |g: &VethGuest, r: &str| maps.sandbox_stats.get(g.node_ifindex).unwrap().unwrap().drops[r];

    // The collusion: A, then B, flood new flows.
    // The kernel may run the veth's ingress after `send` returned: read once the count
    // reached what it must be, or after 2 s.
    let settled = |g: &VethGuest, want: i64| {
        let end = std::time::Instant::now() + Duration::from_secs(2);
        while live(g) != want && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        live(g)
    };
    let a_socks = topo.guest_ns(&a).run(move || udp_flood(echo, FLOOD));
    assert_eq!(settled(&a, i64::from(BUDGET)), i64::from(BUDGET), "A stops at its budget");
    let b_socks = topo.guest_ns(&b).run(move || udp_flood(echo, FLOOD));
    assert_eq!(
        settled(&b, i64::from(ceiling - BUDGET)),
        i64::from(ceiling - BUDGET),
        "B stops at the node-wide ceiling"
    );
    assert!(drops(&b, "node_sessions") >= (FLOOD as u64) - u64::from(ceiling - BUDGET));
    assert_eq!(drops(&a, "node_sessions"), 0);
    assert_eq!(maps.sessions.floor_state().unwrap().unwrap().usage.live(), i64::from(ceiling));

    // The victim: its floor's worth of new flows are all answered; one more is not.
    let gv = topo.guest_ns(&v);
    let (answered, extra) = gv.run(move || {
        let socks: Vec<UdpSocket> = (0..FLOOR).map(|_| UdpSocket::bind("0.0.0.0:0").expect("bind")).collect();
        let n = socks.iter().filter(|u| udp_ask(u, echo, b"victim").is_ok()).count();
        let one_more = UdpSocket::bind("0.0.0.0:0").expect("bind");
        let extra = udp_ask(&one_more, echo, b"over").is_ok();
        (n, extra)
    });
    assert_eq!(answered, FLOOR as usize, "every flow of the victim's floor is answered");
    assert!(!extra, "the victim's flow above its floor went out while the node was at its ceiling");
    assert_eq!(live(&v), i64::from(FLOOR));
    assert!(drops(&v, "node_sessions") >= 1);
    assert_eq!(drops(&v, "no_snat_port"), 0, "the map always had room");
    assert_eq!(maps.counters.get(counter::CUBE_DROP_NO_SNAT).unwrap(), 0);
    drop((a_socks, b_socks));

    // The flood expires (answered UDP: past the replied timeout): the node count is back to 0
    // and B gets its whole budget.
    let later = reaper::monotonic_ns() + Timeouts::default().udp_replied + 1_000_000_000;
    reaper::sweep(&maps.sessions, &Timeouts::default(), later).expect("sweep");
    let st = maps.sessions.floor_state().unwrap().unwrap();
    assert_eq!(st.usage.live(), 0, "no drift: {st:?}");
    assert_eq!(maps.sessions.counts().0, 0);
    let b_again = topo.guest_ns(&b).run(move || udp_flood(echo, BUDGET as usize));
    assert_eq!(live(&b), i64::from(BUDGET), "B opens its whole budget again");
    drop(b_again);
    drop(dp);
    drop(bpffs);
}
