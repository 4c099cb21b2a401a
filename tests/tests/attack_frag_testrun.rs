//! Attack on fragmented replies (`BPF_PROG_TEST_RUN`, exact verdicts and map state): sandbox
//! A and a server A controls in the world flood `frag_sessions_v2` (one map shared by every
//! sandbox: one entry per first fragment) with twice its size in first fragments of replies
//! to A's own session, between the first and the later fragment of a reply to sandbox B.
//! Property: B's fragmented reply is still delivered whole (decision R12: the map never
//! evicts, each sandbox's inserts are budgeted, so the flood stops only A's own tracking).
//!
//! Second attack: later fragments carry no ports, so they are matched by `{server, node
//! address, IP id, proto}`, and the IP id is the server's choice (one counter per destination
//! on Linux: every sandbox behind the node address shares it). Sandbox B makes a resolver both
//! sandboxes use send it a fragmented answer with the IP id of A's answer in flight (it winds
//! the counter with small queries). Property: A's later fragments never reach B (decision R16:
//! the colliding entry becomes ambiguous and what follows it is dropped).

use std::net::Ipv4Addr;

use cubenet_tests::{
    frames::{fragment, udp},
    packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
    rig::{Rig, SB_IFINDEX, VERSION},
    topology::{NODE_IP, WORLD_IP},
};
use cubevs::{
    SandboxEntry, prog,
    testrun::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
};
use cubevs_common::{budget::KIND_FRAG, counter, limits};

const B_IFINDEX: u32 = 101;
/// The attacker's server (TEST-NET-3; routed via the world).
const EVIL: [u8; 4] = [203, 0, 113, 50];

/// A UDP flow of the sandbox on `ifindex` to `dst`:`dport`; returns its SNAT port.
fn open(r: &Rig, ifindex: u32, dst: [u8; 4], dport: u16) -> u16 {
    let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, dst, 5000, dport, b"q");
    assert_eq!(r.run(prog::FROM_CUBE, f, ifindex).verdict, TC_ACT_REDIRECT);
    let s = r.maps.sessions.list().unwrap();
    s.iter().find(|s| s.vm_ifindex == ifindex).expect("session").snat_port
}

#[test]
fn a_fragment_flood_never_loses_another_sandboxs_fragmented_reply() {
    if !require_root("attack_frag_testrun a_fragment_flood_never_loses_another_sandboxs_fragmented_reply") {
        return;
    }
    let r = Rig::new();
    r.add_sandbox(&SandboxEntry {
        ifindex: B_IFINDEX,
        ip: Ipv4Addr::new(192, 168, 0, 4),
        version: 3,
        id: "sb-b".into(),
    });
    let a_port = open(&r, SB_IFINDEX, EVIL, 9000);
    let b_port = open(&r, B_IFINDEX, WORLD_IP, 53);

    // B's reply: first fragment delivered and recorded; then the flood: twice the map's size in
    // first fragments of replies to A's session; then B's later fragment. B's entry lives
    // FRAG_TIMEOUT_NS (2 s), so the delivery is judged only when the flood fit in that window:
    // the frames are built beforehand, and on a machine too loaded for that the scenario runs
    // again after the reaper cleared the expired entries (at most 5 times; the verdict of an
    // attempt that overran is not an answer either way).
    let answer: Vec<u8> = (0..40u8).collect();
    let (wm, um) = (r.world_mac, r.up_mac);
    let flood = 2 * limits::FRAG_SESSIONS as usize;
    let frames: std::sync::Arc<Vec<Vec<u8>>> = std::sync::Arc::new(
        (0..flood).map(|i| fragment(&udp(wm, um, EVIL, NODE_IP, 9000, a_port, &[0u8; 40]), i as u16, 24).0).collect(),
    );
    let mut flooded = 0u64;
    let mut judged = false;
    for attempt in 0..5u16 {
        let (b1, b2) =
            fragment(&udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 53, b_port, &answer), 0x4242 + attempt, 24);
        assert_eq!(r.world(b1).verdict, TC_ACT_REDIRECT, "B's first fragment");
        let t0 = std::time::Instant::now();
        let frag0 = r.maps.counters.get(counter::WORLD_REVERSE_NAT).unwrap();
        let f = frames.clone();
        r.run_many(prog::FROM_WORLD, r.uplink_ifindex, flood, move |i| f[i].clone());
        let delivered = r.maps.counters.get(counter::WORLD_REVERSE_NAT).unwrap() - frag0;
        assert_eq!(delivered, flood as u64, "every flood fragment reached A (the attack happened)");
        flooded += flood as u64;
        let b_entries = r.maps.frags.list(Some(B_IFINDEX));
        let out = r.world(b2);
        if t0.elapsed() >= std::time::Duration::from_nanos(cubevs_common::FRAG_TIMEOUT_NS) {
            eprintln!("attempt {attempt}: the flood outlasted B's 2 s window ({:?}); again", t0.elapsed());
            std::thread::sleep(std::time::Duration::from_secs(2));
            r.maps.frags.reap(cubevs::reaper::monotonic_ns()).expect("reap");
            continue;
        }
        // B's entry survived the flood, and B's later fragment still reaches B.
        assert_eq!(b_entries.len(), 1, "B's entry kept: {b_entries:?}");
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "B's later fragment was not delivered");
        assert_eq!(&out.data[30..34], &GUEST_IP, "to the guest address");
        judged = true;
        break;
    }
    assert!(judged, "no attempt fit the flood into B's fragment window (machine too loaded)");

    // A fragmented reply to B after the flood is recorded too (A cannot fill the map).
    let (c1, c2) = fragment(&udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 53, b_port, &answer), 0x4343, 24);
    assert_eq!(r.world(c1).verdict, TC_ACT_REDIRECT, "B's next first fragment");
    let out = r.world(c2);
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "B's next later fragment was not delivered");
    assert_eq!(&out.data[30..34], &GUEST_IP, "to the guest address");

    // How: A's budget refused most of its flood (delivered, not recorded) and A holds no more
    // than it was let record (R12).
    let over = r.maps.counters.get(counter::WORLD_FRAG_OVER_BUDGET).unwrap();
    assert!(over > 0, "A's budget refused part of the flood");
    let a_entries = r.maps.frags.list(Some(SB_IFINDEX)).len() as u64;
    assert!(a_entries <= flooded - over, "A holds only what it was let record: {a_entries}");

    // Entries expire and the reaper deletes them (nothing before expiry); a later fragment
    // without its entry goes to the host.
    assert_eq!(r.maps.frags.reap(0).unwrap(), 0, "nothing expired at time 0");
    let n = r.maps.frags.list(None).len();
    assert_eq!(r.maps.frags.reap(u64::MAX).unwrap(), n, "every entry expired at the end of time");
    assert!(r.maps.frags.list(None).is_empty());
    let (_, d2) = fragment(&udp(r.world_mac, r.up_mac, WORLD_IP, NODE_IP, 53, b_port, &answer), 0x4343, 24);
    assert_eq!(r.world(d2).verdict, TC_ACT_OK, "a reaped entry is not followed");
}

#[test]
fn a_colliding_ip_id_never_delivers_another_sandboxs_fragment() {
    if !require_root("attack_frag_testrun a_colliding_ip_id_never_delivers_another_sandboxs_fragment") {
        return;
    }
    let r = Rig::new();
    r.add_sandbox(&SandboxEntry {
        ifindex: B_IFINDEX,
        ip: Ipv4Addr::new(192, 168, 0, 4),
        version: 3,
        id: "sb-b".into(),
    });
    let a_port = open(&r, SB_IFINDEX, WORLD_IP, 53);
    let b_port = open(&r, B_IFINDEX, WORLD_IP, 53);
    let b_in = || r.maps.sandbox_stats.get(B_IFINDEX).unwrap().map_or(0, |c| c.in_packets);
    let (wm, um) = (r.world_mac, r.up_mac);
    let secret: Vec<u8> = b"A's answer, second half: SECRET-A-0123456789abcdefgh".to_vec();

    // Control: without a collision A's answer arrives whole, in A.
    let (a1, a2) = fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, a_port, &secret), 0x1000, 24);
    assert_eq!(r.world(a1).verdict, TC_ACT_REDIRECT);
    let out = r.world(a2);
    assert_eq!(out.verdict, TC_ACT_REDIRECT, "A's later fragment (control)");
    assert_eq!(r.maps.frags.list(Some(SB_IFINDEX)).len(), 1);

    // A's answer 0x2000: first fragment in; then B's answer with the same IP id; then A's
    // later fragment.
    let (a1, a2) = fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, a_port, &secret), 0x2000, 24);
    let (b1, b2) =
        fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, b_port, b"B's own answer, 40 bytes long......."), 0x2000, 24);
    assert_eq!(r.world(a1).verdict, TC_ACT_REDIRECT, "A's first fragment");
    assert_eq!(r.world(b1).verdict, TC_ACT_REDIRECT, "B's first fragment (its own session)");
    let before = b_in();
    let out = r.world(a2);
    assert_ne!(out.verdict, TC_ACT_REDIRECT, "A's later fragment was delivered (to B: {} → {})", before, b_in());
    assert_eq!(b_in(), before, "B was charged a packet of A's");
    assert_eq!(out.verdict, TC_ACT_SHOT);
    // B's own later fragment is ambiguous too: dropped, not delivered into A.
    assert_eq!(r.world(b2).verdict, TC_ACT_SHOT);
    assert_eq!(r.maps.counters.get(counter::WORLD_FRAG_AMBIGUOUS).unwrap(), 3, "collision + two later fragments");
    assert!(r.maps.frags.list(Some(B_IFINDEX)).is_empty(), "B never owns A's entry");
    // The entry keeps its owner (A, whose charge the reaper gives back) and is marked.
    let marked: Vec<_> = r.maps.frags.list(Some(SB_IFINDEX)).into_iter().filter(|e| e.ip_id == 0x2000).collect();
    assert_eq!(marked.len(), 1, "{marked:?}");
    assert!(marked[0].ambiguous && marked[0].charged && marked[0].version == VERSION, "{marked:?}");
    // A repeating its first fragment (its server retransmits) renews the entry but keeps the
    // mark: B's later fragment is still not delivered into A.
    let (a1r, _) = fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, a_port, &secret), 0x2000, 24);
    assert_eq!(r.world(a1r).verdict, TC_ACT_REDIRECT, "A's repeated first fragment");
    let (_, b2r) =
        fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, b_port, b"B's own answer, 40 bytes long......."), 0x2000, 24);
    assert_eq!(r.world(b2r).verdict, TC_ACT_SHOT, "the mark survives the owner's repeat");
    assert_eq!(r.maps.counters.get(counter::WORLD_FRAG_AMBIGUOUS).unwrap(), 4);
    // Reaped, the marked entry's charge goes back to A, exactly (Q6): nothing leaks from the
    // node count however many collisions two sandboxes make.
    let a_live = || r.maps.track.usage(SB_IFINDEX, VERSION, KIND_FRAG).unwrap().map_or(0, |u| u.live());
    assert_eq!(a_live(), 2, "A's two entries (0x1000, 0x2000) are charged to A");
    r.maps.frags.reap(u64::MAX).expect("reap");
    assert_eq!(a_live(), 0, "the marked entry's charge was given back to its owner");
    assert_eq!(r.maps.track.state(KIND_FRAG).unwrap().node.live(), 0, "node count back to 0");

    // The same sandbox repeating an id (a retransmitted datagram) is no collision.
    let (a1, a2) = fragment(&udp(wm, um, WORLD_IP, NODE_IP, 53, a_port, &secret), 0x3000, 24);
    assert_eq!(r.world(a1.clone()).verdict, TC_ACT_REDIRECT);
    assert_eq!(r.world(a1).verdict, TC_ACT_REDIRECT);
    assert_eq!(r.world(a2).verdict, TC_ACT_REDIRECT, "A's later fragment after its own repeat");
    assert_eq!(r.maps.counters.get(counter::WORLD_FRAG_AMBIGUOUS).unwrap(), 4);
}
