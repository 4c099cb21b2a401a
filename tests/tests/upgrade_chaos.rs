//! The adversary of the agent's live upgrade (task "upchaos"): faults a running sandbox must
//! not notice, with the real agent binaries started by the start script, a guest on the TAP
//! fd the agent handed out and test hosts in the world namespace the test creates.
//!
//! - A successor whose configuration changes `always_denied_cidrs` but is refused (here its
//!   `tap_fd_listen` does not fit the handed-over socket) must not change the list the running
//!   agent enforces: before H10 it wrote its list into the shared `node_deny` map at its start,
//!   before asking for the hand-over, so the metadata address the running agent denies became
//!   reachable for every sandbox. After a successful hand-over the successor's list applies.
//! - The running agent killed while a successor waits for its offer (`kill -9` between
//!   `BEGIN` and the offer, made deterministic by stopping it with SIGSTOP first and killing
//!   it once the successor's connection waits in its hand-over socket's backlog): before H11
//!   the successor exited on the broken connection and nobody served; now it starts fresh as
//!   after a crash, with the sandbox's identity, state and traffic unchanged.
//! - A successor with another `cidr` while a sandbox runs in the old one: before H12 it took
//!   over, moved cube-dev's gateway address and left the sandbox's TAP alone (not adopted: its
//!   fd request, Release and listing lost); now it is refused before it changes anything.
//! - A successor that brings another eBPF object (switched to at its start, U5) and is then
//!   refused: before U11 the running agent stayed on the refused version's programs; now the
//!   previous slot is active again on every pinned link; so after an agent with it started
//!   without the hand-over socket stops at the bind (H7). A successful upgrade keeps the new.
//! - A successor on a node that cannot refill its pool to `tap_init_num` (a nearly full CIDR):
//!   before H13 it stayed not ready (`/readyz` 503) although its predecessor was ready and
//!   Ensures succeed; now it is ready as its predecessor was.
//! - Two successors started at once: exactly one agent serves afterwards (the loser exits
//!   with the reason, or takes over from the winner in turn), and the sandbox keeps its
//!   listing, TAP fd, traffic and policy. No gap on the old code; it guards H11's fresh start,
//!   which must never let the loser replace the winner.

use std::{path::Path, time::Duration};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    agent_upgrade::{handover_socket, spawn_agent, start, upgrade, wait_exit, wait_until},
    deny_probe::DenyProbe,
    netns::ChildGuard,
    require_root, topology,
};
use nix::{sys::signal::Signal, unistd::Pid};

/// Alibaba Cloud's metadata address: in the agent's default `always_denied_cidrs`.
const METADATA: [u8; 4] = [100, 100, 100, 200];
const PORT: u16 = 7100;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn ensure(a: &AgentUnderTest, id: &str) -> pb::EnsureNetworkResponse {
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: id.into(),
            cubevs_context: Some(pb::CubeVsContext {
                allow_internet_access: Some(true),
                allow_out: vec!["0.0.0.0/0".into()],
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("ensure {id}: {e}\n{}", a.log()))
        .into_inner()
    })
}

fn list(a: &AgentUnderTest) -> Vec<pb::NetworkState> {
    rt().block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.list_networks(pb::ListNetworksRequest::default()).await.expect("list").into_inner().networks
    })
}

/// Connections waiting, not yet accepted, in the backlog of the listening Unix socket the
/// agent with PID `pid` placed at `path` (`ss`'s Recv-Q of a listening socket; `ss` names it
/// by its bound name, `<path>.tmp-<pid>`, renamed into place since, H6); `None` when no such
/// socket listens.
fn backlog(a: &AgentUnderTest, path: &Path, pid: u32) -> Option<usize> {
    let bound = format!("{}.tmp-{pid}", path.display());
    let out = a.agent_ns().command("ss").arg("-xlnH").output().expect("ss");
    assert!(out.status.success(), "ss: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 5 && f[4] == bound).then(|| f[2].parse::<usize>().ok()).flatten()
        })
        .next()
}

#[test]
fn a_refused_successor_never_changes_the_always_denied_list() {
    if !require_root("a_refused_successor_never_changes_the_always_denied_list") {
        return;
    }
    // The running agent enforces its default list (100.100.100.200/32).
    let mut a = AgentUnderTest::prepare("chaos-deny", 2, "");
    start(&mut a);
    let hosts = DenyProbe::new(&a, METADATA, PORT);
    let r = ensure(&a, "sb-all");
    let g = a.guest(&r);
    assert!(!hosts.reaches(&g, 41001, "p1"), "allow_out 0.0.0.0/0 reached the always-denied address");

    // The next version's file empties the list; a successor started with it whose
    // tap_fd_listen does not fit the running agent's socket is refused and exits.
    let cfg = a.dir.join("agent.toml");
    let toml = std::fs::read_to_string(&cfg).unwrap() + "always_denied_cidrs = []\n";
    std::fs::write(&cfg, toml).unwrap();
    let other = a.dir.join("cube/other-tap.sock");
    let mut bad = spawn_agent(&a, &format!("--tap-fd-listen {}", other.display()));
    let st = wait_exit(&mut bad, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert!(!st.success(), "a successor on another tap_fd_listen took over:\n{}", a.log());
    let log = a.log();
    assert!(log.contains("handed-over tap_fd_listen socket is bound to"), "{log}");
    assert!(log.contains("hand-over aborted, this agent keeps serving"), "{log}");
    assert!(a.child.as_mut().unwrap().child().try_wait().unwrap().is_none(), "the running agent exited");
    // The running agent's list still holds for the running sandbox, and for a new one.
    assert!(!hosts.reaches(&g, 41002, "p2"), "a refused successor opened the running agent's always-denied address");
    let r2 = ensure(&a, "sb-new");
    let g2 = a.guest(&r2);
    assert!(!hosts.reaches(&g2, 41003, "p3"), "a refused successor opened the always-denied address to a new sandbox");

    // A successor with that file that takes over: its list applies from then on.
    upgrade(&mut a).unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert!(hosts.reaches(&g, 41004, "p4"), "the successor's emptied list did not apply after the hand-over");
    assert!(hosts.reaches(&g2, 41005, "p5"), "the successor's emptied list did not apply after the hand-over");
    drop((g, g2));
    a.release("sb-all");
    a.release("sb-new");
}

#[test]
fn the_running_agent_killed_before_its_offer_leaves_the_successor_serving() {
    if !require_root("the_running_agent_killed_before_its_offer_leaves_the_successor_serving") {
        return;
    }
    let mut a = AgentUnderTest::prepare("chaos-vanish", 2, "");
    start(&mut a);
    let hosts = DenyProbe::new(&a, METADATA, PORT);
    let r = ensure(&a, "sb-live");
    let g = a.guest(&r);
    assert!(!hosts.reaches(&g, 42001, "v1"), "allow_out 0.0.0.0/0 reached the always-denied address");
    let before: Vec<pb::NetworkState> = list(&a);
    assert_eq!(before.len(), 1, "{before:?}");

    // The running agent is stopped, so the successor's BEGIN waits in its hand-over socket's
    // backlog; it is killed once the successor waits for the offer.
    let mut old = a.child.take().expect("agent running");
    let old_pid = Pid::from_raw(old.id() as i32);
    nix::sys::signal::kill(old_pid, Signal::SIGSTOP).unwrap();
    let sock = handover_socket(&a);
    assert_eq!(backlog(&a, &sock, old.id()), Some(0), "the running agent's hand-over listener");
    let mut next: ChildGuard = spawn_agent(&a, "");
    wait_until("successor's connection in the hand-over backlog", Duration::from_secs(60), || {
        backlog(&a, &sock, old_pid.as_raw() as u32).unwrap_or(0) > 0
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    nix::sys::signal::kill(old_pid, Signal::SIGKILL).unwrap();
    wait_exit(&mut old, Duration::from_secs(10)).unwrap();

    // Somebody serves: the successor, started fresh (not an exit leaving the node without agent).
    let exited = std::cell::Cell::new(None);
    wait_until("successor ready", Duration::from_secs(60), || {
        exited.set(next.child().try_wait().unwrap());
        exited.get().is_some() || matches!(a.http("/readyz"), Some((200, _)))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert!(exited.get().is_none(), "the successor exited ({:?}): nobody serves\n{}", exited.get(), a.log());
    let log = a.log();
    assert!(log.contains("the running agent vanished before its hand-over offer was complete"), "{log}");
    a.child = Some(next);

    // The sandbox kept its identity (TAP, ifindex, address, handle), its policy, the node's
    // list and its traffic; new calls are served.
    assert_eq!(list(&a), before, "the sandbox's state changed across the crash during the hand-over");
    assert!(!hosts.reaches(&g, 42002, "v2"), "the always-denied address opened after the crash");
    let r2 = ensure(&a, "sb-after");
    let g2 = a.guest(&r2);
    assert!(!hosts.reaches(&g2, 42003, "v3"), "the always-denied address is open to a new sandbox");
    drop((g, g2));
    a.release("sb-live");
    a.release("sb-after");
    assert!(list(&a).is_empty(), "{:?}", list(&a));
}

/// cube-dev's IPv4 addresses in the dataplane namespace (`ip -4 -o addr`), as text.
fn cube_dev_addrs(a: &AgentUnderTest) -> String {
    let out = a.topo.node.command("ip").args(["-4", "-o", "addr", "show", "dev", "cube-dev"]).output().unwrap();
    assert!(out.status.success(), "ip addr: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().filter_map(|l| l.split_whitespace().nth(3)).collect::<Vec<_>>().join(" ")
}

#[test]
fn a_successor_with_another_cidr_is_refused_before_it_changes_the_node() {
    if !require_root("a_successor_with_another_cidr_is_refused_before_it_changes_the_node") {
        return;
    }
    let mut a = AgentUnderTest::prepare("chaos-cidr", 2, "");
    start(&mut a);
    let hosts = DenyProbe::new(&a, METADATA, PORT);
    let r = ensure(&a, "sb-cidr");
    let tap = r.interfaces[0].name.clone();
    let g = a.guest(&r);
    assert!(!hosts.reaches(&g, 43001, "c1"), "allow_out 0.0.0.0/0 reached the always-denied address");
    let before = list(&a);
    let dev = cube_dev_addrs(&a);
    assert_eq!(dev, "192.168.0.1/24");

    // The next version's start moves the node to another cidr while sb-cidr runs in the old.
    const DONE: &str = "hand-over complete";
    let done = a.log().matches(DONE).count();
    let mut next = spawn_agent(&a, "--cidr 192.168.1.0/24");
    let exited = std::cell::Cell::new(None);
    wait_until("the successor's exit or hand-over", Duration::from_secs(60), || {
        exited.set(next.child().try_wait().unwrap());
        exited.get().is_some() || a.log().matches(DONE).count() > done
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert!(
        exited.get().is_some_and(|st| !st.success()),
        "a successor whose cidr leaves out a running sandbox took over:\n{}",
        a.log()
    );
    let log = a.log();
    assert!(
        log.contains("cidr 192.168.1.0/24 does not contain sandbox sb-cidr (192.168.0.2, TAP z192.168.0.2)"),
        "the refusal must name the key and the sandbox:\n{log}"
    );

    // Nothing changed: the running agent serves the sandbox on the same TAP, address and
    // gateway; its fd request, traffic and Release work; new sandboxes are served.
    assert!(a.child.as_mut().unwrap().child().try_wait().unwrap().is_none(), "the running agent exited");
    assert_eq!(cube_dev_addrs(&a), dev, "the refused successor changed cube-dev's address");
    assert_eq!(list(&a), before);
    let (reply, fd) = tap_fd(&a.tap_socket(), &tap, "sb-cidr");
    assert_eq!(reply["errCode"], "0", "{reply}");
    drop(fd);
    assert!(!hosts.reaches(&g, 43002, "c2"), "the always-denied address opened");
    let r2 = ensure(&a, "sb-next");
    assert!(r2.persist_metadata["sandbox_ip"].starts_with("192.168.0."), "{r2:?}");
    drop(g);
    a.release("sb-cidr");
    a.release("sb-next");
    assert!(list(&a).is_empty());
}

#[test]
fn two_successors_at_once_leave_exactly_one_agent_serving() {
    if !require_root("two_successors_at_once_leave_exactly_one_agent_serving") {
        return;
    }
    let mut a = AgentUnderTest::prepare("chaos-two", 2, "");
    start(&mut a);
    let hosts = DenyProbe::new(&a, METADATA, PORT);
    let r = ensure(&a, "sb-two");
    let tap = r.interfaces[0].name.clone();
    let g = a.guest(&r);
    let before = list(&a);

    // Two upgrades started together (e.g. an operator's retry beside a supervisor's): each asks
    // whoever listens on the hand-over socket; the old agent serves one hand-over at a time.
    let old = a.child.take().expect("agent running");
    let mut procs = [old, spawn_agent(&a, ""), spawn_agent(&a, "")];
    let mut status: [Option<std::process::ExitStatus>; 3] = [None; 3];
    wait_until("two of the three agents to exit", Duration::from_secs(120), || {
        for (p, st) in procs.iter_mut().zip(status.iter_mut()) {
            if st.is_none() {
                *st = p.child().try_wait().unwrap();
            }
        }
        status.iter().filter(|s| s.is_some()).count() >= 2
    })
    .unwrap_or_else(|e| panic!("{e}: {status:?}\n{}", a.log()));
    // Give a third exit (none must come) no chance to hide: the survivor serves.
    wait_until("the survivor ready", Duration::from_secs(30), || matches!(a.http("/readyz"), Some((200, _))))
        .unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    for (p, st) in procs.iter_mut().zip(status.iter_mut()) {
        if st.is_none() {
            *st = p.child().try_wait().unwrap();
        }
    }
    let alive: Vec<usize> = (0..3).filter(|&i| status[i].is_none()).collect();
    for l in a.log().lines().filter(|l| l.contains("hand-over complete") || l.contains("startup step failed")) {
        eprintln!("{l}");
    }
    eprintln!("exits (old, first, second): {status:?}");
    assert_eq!(alive.len(), 1, "exactly one agent must serve: {status:?}\n{}", a.log());
    let log = a.log();
    assert!(log.contains("hand-over complete"), "{log}");
    // The old agent handed over (status 0); a successor that lost the race exited with an error
    // saying why, or handed over in turn (0).
    assert_eq!(status[0].map(|s| s.success()), Some(true), "the old agent: {status:?}\n{log}");
    let [old, s1, s2] = procs;
    drop(old);
    let survivor = if alive[0] == 1 { s1 } else { s2 };
    a.child = Some(survivor);

    // The sandbox noticed nothing: same listing, its fd (the survivor holds the handed-over
    // queue), traffic and policy; new calls are served.
    assert_eq!(list(&a), before);
    let (reply, fd) = tap_fd(&a.tap_socket(), &tap, "sb-two");
    assert_eq!(reply["errCode"], "0", "{reply}\n{log}");
    drop(fd);
    assert!(!hosts.reaches(&g, 44001, "t1"), "the always-denied address opened");
    let r2 = ensure(&a, "sb-two-next");
    drop(g);
    a.release("sb-two");
    a.release(&r2.sandbox_id);
    assert!(list(&a).is_empty());
}

/// The real object with one byte appended: the same programs, another sha256, so a start with
/// it pins and switches to the standby slot (as `upgrade_slots.rs` builds it).
fn other_build(dir: &Path) -> std::path::PathBuf {
    let mut elf = std::fs::read(cubenet_tests::ebpf_object()).unwrap();
    elf.push(0);
    let p = dir.join("cubevs-other.o");
    std::fs::write(&p, elf).unwrap();
    p
}

/// A successful upgrade of `a` to an agent configured with the object `obj`: the node runs it
/// afterwards on every pinned link, in the slot other than `active`.
fn upgrade_to_object(a: &mut AgentUnderTest, obj: &Path, active: usize) {
    let cfg = a.dir.join("agent.toml");
    let toml = std::fs::read_to_string(&cfg).unwrap();
    let line = toml.lines().find(|l| l.starts_with("bpf_object =")).expect("bpf_object line").to_string();
    std::fs::write(&cfg, toml.replace(&line, &format!("bpf_object = \"{}\"", obj.display()))).unwrap();
    upgrade(a).unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    let (after, links_after) = slots_in_use(a);
    assert_eq!(after, Some(1 - active), "the upgrade's object must be active");
    assert!(links_after.iter().all(|s| *s == after), "{links_after:?}");
}

/// The active slot, which every pinned link runs (asserted), and those links' slots.
fn running_slot(a: &AgentUnderTest) -> (usize, Vec<Option<usize>>) {
    let (active, links) = slots_in_use(a);
    let active = active.expect("an active slot");
    assert!(!links.is_empty() && links.iter().all(|s| *s == Some(active)), "{active} {links:?}");
    (active, links)
}

/// The active slot and the slot each pinned link runs.
fn slots_in_use(a: &AgentUnderTest) -> (Option<usize>, Vec<Option<usize>>) {
    let st = cubevs::slots::status(&a.pin_dir()).expect("datapath status");
    (st.meta.active, st.attach.iter().map(|p| p.slot).collect())
}

#[test]
fn a_refused_successor_with_another_object_leaves_the_datapath_as_it_was() {
    if !require_root("a_refused_successor_with_another_object_leaves_the_datapath_as_it_was") {
        return;
    }
    let mut a = AgentUnderTest::prepare("chaos-object", 2, "");
    start(&mut a);
    let hosts = DenyProbe::new(&a, METADATA, PORT);
    let r = ensure(&a, "sb-obj");
    let g = a.guest(&r);
    assert!(!hosts.reaches(&g, 45001, "o1"), "allow_out 0.0.0.0/0 reached the always-denied address");
    let (active, links) = running_slot(&a);

    // The next version brings another eBPF object; its start switches the node to it, then
    // its hand-over is refused (its tap_fd_listen does not fit): the running agent must keep
    // the datapath it had.
    let obj = other_build(&a.dir);
    let other = a.dir.join("cube/other-tap.sock");
    let mut bad = spawn_agent(&a, &format!("--bpf-object {} --tap-fd-listen {}", obj.display(), other.display()));
    let st = wait_exit(&mut bad, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert!(!st.success(), "a successor on another tap_fd_listen took over:\n{}", a.log());
    assert!(a.child.as_mut().unwrap().child().try_wait().unwrap().is_none(), "the running agent exited");
    let (now, links_now) = slots_in_use(&a);
    assert_eq!(now, Some(active), "a refused successor left its datapath active:\n{}", a.log());
    assert!(
        links_now.len() >= links.len() && links_now.iter().all(|s| *s == Some(active)),
        "every pinned link must run slot {active} again: {links_now:?}"
    );
    assert!(a.log().contains("was rolled back"), "{}", a.log());
    assert!(!hosts.reaches(&g, 45002, "o2"), "the always-denied address opened");

    // An agent with that object started without the hand-over socket (an old start command)
    // stops at binding the sockets the running agent serves (H7): its switch is undone too.
    let rolled = a.log().matches("was rolled back").count();
    let mut cmd = a.script_command();
    cmd.env("NETWORK_AGENT_ARGS", format!("--bpf-object {} --health-listen 127.0.0.1:19091", obj.display()));
    let mut second = ChildGuard::from_child(cmd.spawn().unwrap());
    let st = wait_exit(&mut second, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert!(!st.success());
    assert!(a.log().contains("is served by a running process"), "{}", a.log());
    assert!(a.log().matches("was rolled back").count() > rolled, "{}", a.log());
    let (now, links_now) = slots_in_use(&a);
    assert_eq!(now, Some(active), "an agent stopped at the bind left its datapath active");
    assert!(links_now.iter().all(|s| *s == Some(active)), "{links_now:?}");
    let r2 = ensure(&a, "sb-obj-next");
    let g2 = a.guest(&r2);
    assert!(!hosts.reaches(&g2, 45003, "o3"), "the always-denied address is open to a new sandbox");

    // The same object in an upgrade that succeeds: the node runs it afterwards.
    upgrade_to_object(&mut a, &obj, active);
    assert!(!hosts.reaches(&g, 45004, "o4"), "the always-denied address opened after the upgrade");
    drop((g, g2));
    a.release("sb-obj");
    a.release("sb-obj-next");
}

#[test]
fn a_successor_on_a_full_node_is_ready_as_its_predecessor_was() {
    if !require_root("a_successor_on_a_full_node_is_ready_as_its_predecessor_was") {
        return;
    }
    // A /24 (253 addresses) nearly full of sandboxes: after 250 the pool keeps the 3 left
    // Ready and cannot refill to tap_init_num = 4.
    let mut a = AgentUnderTest::prepare("chaos-full", 4, "");
    start(&mut a);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let ep = a.grpc_endpoint();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for k in 0..10 {
            let ep = ep.clone();
            tasks.push(tokio::spawn(async move {
                let mut c = network_agent::client::connect(&ep).await.unwrap();
                for i in 0..25 {
                    let req = pb::EnsureNetworkRequest { sandbox_id: format!("sb-full-{k}-{i}"), ..Default::default() };
                    // Near the /24's end an Ensure can find every free address on a TAP the
                    // refill is still creating (RESOURCE_EXHAUSTED, seen once in CI); a caller
                    // retries that code, as cubelet does.
                    let mut tries = 0;
                    loop {
                        match c.ensure_network(req.clone()).await {
                            Ok(_) => break,
                            Err(e) if e.code() == tonic::Code::ResourceExhausted && tries < 50 => {
                                tries += 1;
                                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                            }
                            Err(e) => panic!("ensure: {e:?}"),
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    wait_until("3 Ready TAPs", Duration::from_secs(60), || {
        a.http_json("/v1/network/taps")["stateCounts"]["Ready"].as_u64() == Some(3)
    })
    .unwrap_or_else(|e| panic!("{e}: {}", a.http_json("/v1/network/taps")["stateCounts"]));
    assert!(matches!(a.http("/readyz"), Some((200, _))), "the running agent can serve an Ensure: ready");

    // The successor takes over the same pool: as ready as its predecessor (before H13 it
    // waited for 4 Ready TAPs the node cannot give it: /readyz 503, gRPC health NOT_SERVING).
    upgrade(&mut a).unwrap_or_else(|e| panic!("{e}: {:?}\n{}", a.http("/readyz"), a.log()));
    let r = ensure(&a, "sb-after-upgrade");
    assert!(r.persist_metadata["sandbox_ip"].starts_with("192.168.0."), "{r:?}");
    a.release("sb-after-upgrade");
}

#[test]
fn a_successor_killed_after_its_datapath_switch_leaves_the_running_agents_datapath() {
    if !require_root("a_successor_killed_after_its_datapath_switch_leaves_the_running_agents_datapath") {
        return;
    }
    let mut a = AgentUnderTest::prepare("chaos-kill9", 2, "");
    start(&mut a);
    let hosts = DenyProbe::new(&a, METADATA, PORT);
    let r = ensure(&a, "sb-k9");
    let g = a.guest(&r);
    // Every probe also proves the sandbox's traffic flows (its control datagram must arrive).
    assert!(!hosts.reaches(&g, 46001, "k1"), "allow_out 0.0.0.0/0 reached the always-denied address");
    let before = list(&a);
    let (active, _) = running_slot(&a);

    // The worst moment, made deterministic: the running agent is stopped, so the successor
    // (another object) switches every link to its slot and then waits for the offer, before
    // READY; it is killed there (no guard of its own runs), then the running agent resumes.
    let old = a.child.take().expect("agent running");
    let old_pid = Pid::from_raw(old.id() as i32);
    nix::sys::signal::kill(old_pid, Signal::SIGSTOP).unwrap();
    let obj = other_build(&a.dir);
    let mut next = spawn_agent(&a, &format!("--bpf-object {}", obj.display()));
    wait_until("the successor's datapath switch", Duration::from_secs(60), || {
        let (now, links_now) = slots_in_use(&a);
        now == Some(1 - active) && links_now.iter().all(|s| *s == now)
    })
    .unwrap_or_else(|e| {
        let _ = nix::sys::signal::kill(old_pid, Signal::SIGCONT);
        panic!("{e}\n{}", a.log())
    });
    assert!(!hosts.reaches(&g, 46002, "k2"), "the always-denied address opened on the successor's programs");
    let sock = handover_socket(&a);
    wait_until("the successor's connection in the hand-over backlog", Duration::from_secs(60), || {
        backlog(&a, &sock, old_pid.as_raw() as u32).unwrap_or(0) > 0
    })
    .unwrap_or_else(|e| {
        let _ = nix::sys::signal::kill(old_pid, Signal::SIGCONT);
        panic!("{e}\n{}", a.log())
    });
    assert!(next.child().try_wait().unwrap().is_none(), "the successor exited before READY:\n{}", a.log());
    nix::sys::signal::kill(Pid::from_raw(next.id() as i32), Signal::SIGKILL).unwrap();
    wait_exit(&mut next, Duration::from_secs(10)).unwrap();
    assert!(!hosts.reaches(&g, 46003, "k3"), "the always-denied address opened after the kill");
    nix::sys::signal::kill(old_pid, Signal::SIGCONT).unwrap();
    a.child = Some(old);

    // The running agent sees the hand-over fail and makes its own slot active again.
    let restored = wait_until("the running agent's slot active again", Duration::from_secs(30), || {
        let (now, links_now) = slots_in_use(&a);
        now == Some(active) && links_now.iter().all(|s| *s == Some(active))
    });
    assert!(restored.is_ok(), "the dead successor's datapath stayed active: {:?}\n{}", slots_in_use(&a), a.log());
    assert!(
        a.log().contains(
            "after the failed hand-over another agent's object was active: this agent's datapath is active again"
        ),
        "{}",
        a.log()
    );
    assert!(a.child.as_mut().unwrap().child().try_wait().unwrap().is_none(), "the running agent exited");
    assert_eq!(list(&a), before, "the sandbox's state changed");
    assert!(!hosts.reaches(&g, 46004, "k4"), "the always-denied address opened");
    let r2 = ensure(&a, "sb-k9-next");
    let g2 = a.guest(&r2);
    assert!(!hosts.reaches(&g2, 46005, "k5"), "the always-denied address is open to a new sandbox");

    // A later normal upgrade with that object works and keeps it.
    upgrade_to_object(&mut a, &obj, active);
    assert_eq!(list(&a).len(), 2);
    assert!(!hosts.reaches(&g, 46006, "k6"), "the always-denied address opened after the upgrade");
    assert!(!hosts.reaches(&g2, 46007, "k7"), "the always-denied address opened after the upgrade");
    drop((g, g2));
    a.release("sb-k9");
    a.release("sb-k9-next");
    assert!(list(&a).is_empty());
}

/// What a successor must not change before it has taken over (H14), as the node shows it:
/// cube-dev's MTU, the uplink's XDP attachment, the uplink entry of the pinned `node_config`
/// map (ifindex and address: host ports are DNATed to it), and the tc programs on `up0`,
/// cube-dev and the spare interface `spare`.
fn node_settings(a: &AgentUnderTest, spare: &str) -> String {
    let link = |dev: &str| {
        let l = a.topo.node.ip(&["-o", "link", "show", "dev", dev]);
        let f: Vec<&str> = l.split_whitespace().collect();
        let mtu = f.iter().position(|w| *w == "mtu").map(|i| f[i + 1]).unwrap_or("?").to_string();
        let xdp = f.iter().filter(|w| w.starts_with("xdp")).cloned().collect::<Vec<_>>().join(",");
        format!("{dev}: mtu {mtu} xdp [{xdp}]")
    };
    let node = {
        let data = aya::maps::MapData::from_pin(a.pin_dir().join("maps/node_config")).expect("node_config pin");
        let arr = aya::maps::Array::<_, [u8; 16]>::try_from(aya::maps::Map::Array(data)).expect("node_config");
        arr.get(&0, 0).expect("node_config entry")
    };
    let names = [topology::NODE_UPLINK.to_string(), topology::CUBE_DEV.to_string(), spare.to_string()];
    let tc = a.topo.node.run(move || {
        names
            .iter()
            .map(|n| {
                let ingress = cubevs::tcx_programs(n, aya::programs::tc::TcAttachType::Ingress).unwrap_or_default();
                let egress = cubevs::tcx_programs(n, aya::programs::tc::TcAttachType::Egress).unwrap_or_default();
                let filters = |dir: &str| {
                    let o = std::process::Command::new("tc").args(["filter", "show", "dev", n, dir]).output();
                    o.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
                };
                format!(
                    "{n}: tcx in {ingress:?} out {egress:?} filters {:?} {:?}",
                    filters("ingress"),
                    filters("egress")
                )
            })
            .collect::<Vec<_>>()
    });
    format!(
        "{}; {}; node_config uplink {:?}; {}",
        link(topology::CUBE_DEV),
        link(topology::NODE_UPLINK),
        &node[8..16],
        tc.join("; ")
    )
}

#[test]
fn a_refused_successor_leaves_the_node_settings_as_they_were() {
    if !require_root("a_refused_successor_leaves_the_node_settings_as_they_were") {
        return;
    }
    let mut a = AgentUnderTest::prepare("chaos-node", 2, "");
    start(&mut a);
    let hosts = DenyProbe::new(&a, METADATA, PORT);
    let r = ensure(&a, "sb-node");
    let g = a.guest(&r);
    assert!(!hosts.reaches(&g, 47001, "n1"), "allow_out 0.0.0.0/0 reached the always-denied address");
    // A second interface with one IPv4 address (a veth: the kernel may lack dummy links): a
    // valid `eth_name` for the next version.
    const SPARE: &str = "spare0";
    a.topo.node.ip(&["link", "add", SPARE, "type", "veth", "peer", "name", "spare1"]);
    a.topo.node.ip(&["addr", "add", "10.123.0.1/24", "dev", SPARE]);
    a.topo.node.ip(&["link", "set", SPARE, "up"]);
    let before = node_settings(&a, SPARE);
    assert!(before.contains("cube-dev: mtu 1500 xdp []") && before.contains("up0: mtu 1500 xdp []"), "{before}");
    let listed = list(&a);

    // Successors whose configuration changes node settings, each refused at the hand-over
    // (its tap_fd_listen does not fit the running agent's socket).
    let cfg = a.dir.join("agent.toml");
    let orig = std::fs::read_to_string(&cfg).unwrap();
    let other = a.dir.join("cube/other-tap.sock");
    for (i, extra) in ["mtu = 1400\nxdp_mode = \"generic\"\n", "eth_name = \"spare0\"\n", "tc_attach = \"legacy\"\n"]
        .into_iter()
        .enumerate()
    {
        std::fs::write(&cfg, format!("{orig}{extra}")).unwrap();
        let aborted = a.log().matches("hand-over aborted, this agent keeps serving").count();
        let mut bad = spawn_agent(&a, &format!("--tap-fd-listen {}", other.display()));
        let st = wait_exit(&mut bad, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
        assert!(!st.success(), "a successor on another tap_fd_listen took over:\n{}", a.log());
        assert!(a.log().matches("hand-over aborted, this agent keeps serving").count() > aborted, "{}", a.log());
        assert!(a.child.as_mut().unwrap().child().try_wait().unwrap().is_none(), "the running agent exited");
        let now = node_settings(&a, SPARE);
        assert_eq!(now, before, "a refused successor with {extra:?} changed the node's settings:\n{}", a.log());
        let port = 47010 + i as u16;
        assert!(!hosts.reaches(&g, port, &format!("n{port}")), "the always-denied address opened");
    }
    assert_eq!(list(&a), listed);

    // A successor that takes over writes its settings after STOPPED.
    std::fs::write(&cfg, format!("{orig}mtu = 1400\nxdp_mode = \"generic\"\n")).unwrap();
    upgrade(&mut a).unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    let after = node_settings(&a, SPARE);
    assert!(after.contains("cube-dev: mtu 1400") && after.contains("up0: mtu 1500 xdp [xdpgeneric"), "{after}");
    assert!(!hosts.reaches(&g, 47020, "n20"), "the always-denied address opened after the upgrade");
    let r2 = ensure(&a, "sb-node-next");
    let g2 = a.guest(&r2);
    assert!(!hosts.reaches(&g2, 47021, "n21"), "the always-denied address is open to a new sandbox");
    drop((g, g2));
    a.release("sb-node");
    a.release("sb-node-next");
}
