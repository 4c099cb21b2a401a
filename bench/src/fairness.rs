//! Uplink bandwidth between sandboxes (decision R80): what one sandbox's single TCP stream to
//! the world gets alone, beside what it gets while another sandbox sends with 8 streams at
//! full blast, through CubeVS. Measured twice: on the bare veth uplink (the bottleneck is the
//! CPU) and with the node's uplink capped at [`CAP_MBIT`] by a `tbf` qdisc in the node's test
//! namespace (a bottleneck link, as a node's NIC is). CubeVS has no shaper: the figures show
//! how much of the uplink a noisy neighbour takes, which is what the VMM's virtio-net rate
//! limiter (upstream Cubelet's `qos_enabled`) is for. Never fails on time.

use std::{
    net::Ipv4Addr,
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use cubenet_tests::{
    bpffs::BpfFs,
    guest::VethGuest,
    netns::TestNetns,
    topology::{NODE_IP, NODE_UPLINK, Topology},
};
use cubevs::{Datapath, LoadOptions, SandboxEntry, SnatAddr};

use crate::report::{Row, stats};

/// The emulated uplink, Mbit/s.
const CAP_MBIT: u32 = 200;
/// Streams of the noisy sandbox.
const NOISY_STREAMS: u32 = 8;
/// Seconds of the measured stream (after 1 s omitted).
const SECS: u32 = 4;

struct Setup {
    topo: Topology,
    victim: VethGuest,
    noisy: VethGuest,
    _dp: Datapath,
    _bpffs: BpfFs,
}

fn setup() -> Setup {
    let mut topo = Topology::new();
    topo.add_cube_dev();
    let victim = topo.add_veth_guest(0);
    let noisy = topo.add_veth_guest(1);
    let bpffs = BpfFs::new();
    let dp = Datapath::load(LoadOptions {
        object: cubenet_tests::ebpf_object(),
        pin_dir: Some(bpffs.path().join("cubevs")),
        ..LoadOptions::new()
    })
    .expect("load datapath");
    let dp = topo.attach_datapath(dp, &[&victim, &noisy]);
    let m = dp.maps();
    let up = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).unwrap());
    m.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: up }]).unwrap();
    for (g, ip, id) in
        [(&victim, Ipv4Addr::new(192, 168, 0, 2), "victim"), (&noisy, Ipv4Addr::new(192, 168, 0, 3), "noisy")]
    {
        m.sandboxes.register(&SandboxEntry { ifindex: g.node_ifindex, ip, version: 1, id: id.into() }).unwrap();
        m.policy.install_default_deny(g.node_ifindex).unwrap();
    }
    Setup { topo, victim, noisy, _dp: dp, _bpffs: bpffs }
}

/// Starts a one-off iperf3 server on the world side on `port`.
fn server(world: &TestNetns, port: u16) -> cubenet_tests::netns::ChildGuard {
    let child = world
        .command("iperf3")
        .args(["-s", "-1", "-B", "198.51.100.1", "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("iperf3 server");
    cubenet_tests::netns::ChildGuard::from_child(child)
}

fn received_mbit(out: &std::process::Output) -> f64 {
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("iperf3 output: {e}: {}", String::from_utf8_lossy(&out.stdout)));
    json["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or_else(|| panic!("iperf3 result: {json}")) / 1e6
}

/// The victim's one stream alone (`noisy` false) or beside the noisy sandbox's
/// [`NOISY_STREAMS`] streams, which start first and run past the victim's end. Returns
/// (victim Mbit/s, noisy Mbit/s or 0).
fn measure(s: &Setup, noisy: bool) -> (f64, f64) {
    let mut servers = vec![server(&s.topo.world, 5201)];
    let mut noisy_child = None;
    if noisy {
        servers.push(server(&s.topo.world, 5202));
        thread::sleep(Duration::from_millis(300));
        let child = s
            .topo
            .guest_ns(&s.noisy)
            .command("iperf3")
            .args(["-c", "198.51.100.1", "-p", "5202", "-t", &(SECS + 3).to_string(), "-P"])
            .arg(NOISY_STREAMS.to_string())
            .arg("-J")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("noisy iperf3");
        noisy_child = Some(child);
        // Let its streams ramp up before the victim's starts.
        thread::sleep(Duration::from_millis(1000));
    } else {
        thread::sleep(Duration::from_millis(300));
    }
    let start = Instant::now();
    let out = s
        .topo
        .guest_ns(&s.victim)
        .exec("iperf3", &["-c", "198.51.100.1", "-p", "5201", "-t", &(SECS + 1).to_string(), "-O", "1", "-J"]);
    let victim = received_mbit(&out);
    let noisy_mbit = match noisy_child {
        Some(c) => {
            let o = c.wait_with_output().expect("noisy iperf3 output");
            received_mbit(&o)
        }
        None => 0.0,
    };
    for mut g in servers {
        let _ = g.child().wait();
    }
    eprintln!(
        "  victim {:.1} Mbit/s{} ({:.1} s)",
        victim,
        if noisy { format!(", noisy ({NOISY_STREAMS} streams) {noisy_mbit:.1} Mbit/s") } else { String::new() },
        start.elapsed().as_secs_f64()
    );
    (victim, noisy_mbit)
}

/// Runs `rounds` rounds of (alone, beside the noisy sandbox) on the bare uplink and on the
/// capped one; rows in Mbit/s, the victim beside the noisy sandbox next to its own figure alone
/// as the baseline.
pub fn run(rounds: usize) -> Vec<Row> {
    let s = setup();
    let mut rows = Vec::new();
    for capped in [false, true] {
        if capped {
            s.topo.node.exec("tc", &["qdisc", "del", "dev", NODE_UPLINK, "root"]);
            let out = s.topo.node.exec(
                "tc",
                &[
                    "qdisc",
                    "add",
                    "dev",
                    NODE_UPLINK,
                    "root",
                    "tbf",
                    "rate",
                    &format!("{CAP_MBIT}mbit"),
                    "burst",
                    "256kb",
                    "latency",
                    "50ms",
                ],
            );
            assert!(out.status.success(), "tc tbf: {}", String::from_utf8_lossy(&out.stderr));
        }
        let link = if capped { format!("uplink capped at {CAP_MBIT} Mbit/s") } else { "bare veth uplink".to_string() };
        eprintln!("  {link}");
        let (mut alone, mut beside, mut noisy) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            // Alternate the order: the machine's other load drifts over minutes.
            let order = if round % 2 == 0 { [false, true] } else { [true, false] };
            for with_noise in order {
                let (v, n) = measure(&s, with_noise);
                if with_noise {
                    beside.push(v);
                    noisy.push(n);
                } else {
                    alone.push(v);
                }
            }
        }
        let (alone_med, alone_spread) = stats(&mut alone);
        let (beside_med, beside_spread) = stats(&mut beside);
        let (noisy_med, noisy_spread) = stats(&mut noisy);
        let case = |what: &str| format!("{link}: {what}");
        rows.push(Row {
            bench: "fairness".into(),
            case: case("victim 1 stream alone"),
            value: alone_med,
            spread: alone_spread,
            unit: "Mbit/s".into(),
            baseline: None,
            target: None,
        });
        rows.push(Row {
            bench: "fairness".into(),
            case: case(&format!("victim 1 stream beside a sandbox's {NOISY_STREAMS}")),
            value: beside_med,
            spread: beside_spread,
            unit: "Mbit/s".into(),
            baseline: Some(("victim alone".into(), alone_med)),
            target: None,
        });
        rows.push(Row {
            bench: "fairness".into(),
            case: case(&format!("noisy sandbox {NOISY_STREAMS} streams")),
            value: noisy_med,
            spread: noisy_spread,
            unit: "Mbit/s".into(),
            baseline: None,
            target: None,
        });
    }
    rows
}
