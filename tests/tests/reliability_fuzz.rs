//! Datapath fuzzing under `BPF_PROG_TEST_RUN` (issue 14): every program gets
//! `CUBENET_FUZZ_FRAMES` structure-aware frames (default 20,000) from seed `CUBENET_FUZZ_SEED`
//! (default 14) against random sandboxes, versions, policies, port maps and sessions; every
//! output is checked by `cubenet_tests::fuzz::oracle`. The first failure of each invariant is
//! minimized and saved under `tests/regressions/` (unless `CUBENET_FUZZ_SAVE=0`), and
//! `replay_regressions` replays every saved case.
//!
//! Each test prints one `RELIABILITY {json}` line (read by `cargo xtask reliability`).

use cubenet_tests::{
    fuzz::{
        case::Case,
        driver::{self, Report, Runner},
        model::Model,
        oracle,
    },
    require_root,
};
use cubevs::{prog, testrun::TC_ACT_REDIRECT};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn print(r: &Report) {
    println!("RELIABILITY {}", serde_json::to_string(r).expect("report json"));
}

fn fuzz(program: &'static str) {
    if !require_root(&format!("reliability_fuzz {program}")) {
        return;
    }
    let rig = driver::rig();
    let runner = Runner::new(&rig);
    let frames = env_u64("CUBENET_FUZZ_FRAMES", 20_000);
    let seed = env_u64("CUBENET_FUZZ_SEED", 14);
    let save = std::env::var("CUBENET_FUZZ_SAVE").map_or(true, |v| v != "0");
    let r = runner.fuzz(program, seed, frames, save);
    print(&r);
    for p in &r.saved {
        eprintln!("saved regression case {}", p.display());
    }
    assert!(r.total() == 0, "{program}: {} violations {:?}; first of each: {:#?}", r.total(), r.violations, r.examples);
}

#[test]
fn fuzz_from_cube() {
    fuzz(prog::FROM_CUBE);
}

#[test]
fn fuzz_from_world() {
    fuzz(prog::FROM_WORLD);
}

#[test]
fn fuzz_from_envoy() {
    fuzz(prog::FROM_ENVOY);
}

/// Every case under `tests/regressions/` replays without a violation.
#[test]
fn replay_regressions() {
    if !require_root("reliability_fuzz replay_regressions") {
        return;
    }
    let cases = Case::load_all();
    let rig = driver::rig();
    let runner = Runner::new(&rig);
    let mut failed = Vec::new();
    for (path, case) in &cases {
        let v = runner.replay(case);
        if !v.is_empty() {
            failed.push(format!("{}: {:?}", path.display(), v));
        }
    }
    let r = Report {
        case: "replay-regressions".into(),
        inputs: cases.len() as u64,
        runs: cases.iter().map(|(_, c)| c.steps.len() as u64).sum(),
        violations: if failed.is_empty() {
            Default::default()
        } else {
            [("replay".to_string(), failed.len() as u64)].into()
        },
        ..Default::default()
    };
    print(&r);
    assert!(failed.is_empty(), "{} of {} regression cases fail:\n{}", failed.len(), cases.len(), failed.join("\n"));
}

/// The oracle itself flags what it must (no root: pure functions on crafted frames).
#[test]
fn oracle_flags_policy_bypass_and_foreign_delivery() {
    use cubenet_tests::{
        frames::{Tcp, tcp},
        packet::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC},
        topology::NODE_IP,
    };
    let mut rng = cubenet_tests::fuzz::rng::Rng::new(1);
    let mut m = Model::random(&mut rng, 1);
    let sb = &mut m.sandboxes[0];
    sb.allow_internet = true;
    sb.allow_out.clear();
    sb.deny_out.clear();
    sb.ports = vec![(true, 20000, 8080)];
    let ifindex = sb.ifindex;
    let ack = Tcp { sport: 8080, dport: 5000, ack: Some(1), ..Default::default() };
    let input = tcp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, [10, 0, 0, 1], ack, b"");
    // The mapped fast path of issue 10 item 2: host port 20000 to 10.0.0.1, never opened by it.
    let output = tcp([2; 6], [3; 6], NODE_IP, [10, 0, 0, 1], Tcp { sport: 20000, ..ack }, b"");
    let v = oracle::check_cube(&m, ifindex, &input, TC_ACT_REDIRECT, &output, &[]);
    assert!(v.iter().any(|x| x.invariant == "policy-bypass"), "{v:?}");
    // A reply rewritten with a broken checksum.
    let mut broken = output.clone();
    broken[14 + 20 + 16] ^= 0xff;
    let v = oracle::check_cube(&m, ifindex, &input, TC_ACT_REDIRECT, &broken, &[]);
    assert!(v.iter().any(|x| x.invariant == "checksum"), "{v:?}");
    // A redirect from a TAP nobody is registered on.
    let v = oracle::check_cube(&m, ifindex + 7, &input, TC_ACT_REDIRECT, &output, &[]);
    assert_eq!(v[0].invariant, "unregistered-tap");
    // from_envoy toward an mvm IP no sandbox has.
    let to = tcp([2; 6], [3; 6], [192, 168, 0, 1], [192, 168, 0, 77], ack, b"");
    let out = tcp(GATEWAY_MAC, GUEST_MAC, [169, 254, 68, 5], GUEST_IP, ack, b"");
    let v = oracle::check_envoy(&m, &to, TC_ACT_REDIRECT, &out);
    assert!(v.iter().any(|x| x.invariant == "foreign-delivery"), "{v:?}");
    // A guest's ICMP error (type 3) handed to the node's stack through its gateway (R70).
    let mut err = cubenet_tests::frames::icmp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, GATEWAY_IP, true, 1, 1);
    err[34] = 3;
    let mut fwd = err.clone();
    fwd[26..30].copy_from_slice(&m.sandboxes[0].ip);
    fwd[30..34].copy_from_slice(&[192, 168, 0, 1]);
    let v = oracle::check_cube(&m, ifindex, &err, TC_ACT_REDIRECT, &fwd, &[]);
    assert!(v.iter().any(|x| x.invariant == "gateway-icmp-error"), "{v:?}");
}

/// Found by the fuzzer after issue 10 (R7): an ICMP error whose embedded header is a later
/// fragment embeds payload bytes where ports would be, so it names no flow; it must reach the
/// host untouched, never be "reverse-translated" into a sandbox whose session those bytes match.
#[test]
fn icmp_error_about_a_later_fragment_names_no_flow() {
    use cubenet_tests::{
        frames::udp,
        packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
        rig::Rig,
        topology::{NODE_IP, WORLD_IP},
    };
    use cubevs::testrun::TC_ACT_OK;
    if !require_root("reliability_fuzz icmp_error_about_a_later_fragment_names_no_flow") {
        return;
    }
    fn csum(b: &[u8]) -> [u8; 2] {
        let mut s: u32 = b.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
        while s > 0xffff {
            s = (s & 0xffff) + (s >> 16);
        }
        (!(s as u16)).to_be_bytes()
    }
    // Time exceeded from a router, embedding `inner` (IP header + 8 bytes).
    let error = |r: &Rig, inner: &[u8]| {
        let mut ip = vec![0x45, 0, 0, (20 + 8 + inner.len()) as u8, 0, 0, 0, 0, 64, 1, 0, 0];
        ip.extend_from_slice(&[198, 51, 100, 254]);
        ip.extend_from_slice(&NODE_IP);
        let c = csum(&ip);
        ip[10..12].copy_from_slice(&c);
        let mut icmp = vec![11, 0, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(inner);
        let c = csum(&icmp);
        icmp[2..4].copy_from_slice(&c);
        let mut f = r.up_mac.to_vec();
        f.extend_from_slice(&r.world_mac);
        f.extend_from_slice(&[0x08, 0x00]);
        f.extend_from_slice(&ip);
        f.extend_from_slice(&icmp);
        f
    };
    let r = Rig::new();
    let out = r.cube(udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, 5000, 53, b"query"));
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    let sent = out.data[14..42].to_vec();
    // Control: the error about the datagram as sent is delivered.
    assert_eq!(r.world(error(&r, &sent)).verdict, TC_ACT_REDIRECT);
    // The same bytes claimed as a later fragment (offset 16 bytes): not ours, untouched.
    let mut frag = sent.clone();
    frag[6..8].copy_from_slice(&2u16.to_be_bytes());
    frag[10..12].copy_from_slice(&[0, 0]);
    let c = csum(&frag[..20]);
    frag[10..12].copy_from_slice(&c);
    let err = error(&r, &frag);
    let got = r.world(err.clone());
    assert_eq!((got.verdict, got.data), (TC_ACT_OK, err));
}
