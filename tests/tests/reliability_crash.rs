//! Crash points (issue 14): `kill -9` of the network-agent at random moments of an
//! Ensure → TAP fd → Release storm from concurrent clients, then a restart. After every
//! restart: every sandbox a client was told exists is listed and its TAP fd is served; every
//! one it was told is gone is not listed; TAP interfaces in the node, pool entries, datapath
//! registrations, port maps and state files agree (nothing leaked, nothing half-written).
//! At the end everything is released and the node must be back to its baseline.
//! CI: 10 crash points, 8 clients; `CUBENET_RELIABILITY_LONG=1`: 100 crash points, 50 clients.
//!
//! The same storm across live upgrades (`handover_during_ensure_release_storm`, task
//! "upchaos"): a hand-over to a new agent binary at random moments instead of the kill; every
//! call is answered — one whose HTTP/2 connection the old agent closed before it was sent
//! (tonic has no transparent retry: `CANCELLED` "connection closed", about one per hand-over)
//! is retried once as gRPC-core/grpc-go clients do by themselves, and must then succeed — and
//! the same invariants hold after every hand-over.
//!
//! Prints one `RELIABILITY {json}` line (read by `cargo xtask reliability`).

use std::{
    collections::BTreeSet,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    agent_upgrade,
    fuzz::rng::Rng,
    require_root,
};

/// TAPs the pool keeps ready.
const POOL: usize = 4;

/// What the clients were told.
#[derive(Default)]
struct Ledger {
    /// Ensure answered OK (and no Release answered since).
    exists: BTreeSet<String>,
    /// Release answered `released`.
    gone: BTreeSet<String>,
    /// A call failed mid-flight (the agent died): either outcome is allowed.
    unknown: BTreeSet<String>,
    /// Answered calls.
    answered: u64,
    /// In-flight calls at a kill, retried (as a Release) after the restart.
    retried: u64,
    /// Calls that failed (expected at a kill; a violation at a hand-over, which refuses none).
    failed: u64,
    /// Per client: its sandboxes still alive, oldest first (each client keeps up to
    /// [`KEEP`] alive across crash points, so there is always something to lose).
    kept: Vec<std::collections::VecDeque<String>>,
}

/// Sandboxes each client keeps alive.
const KEEP: usize = 2;

fn ensure_req(id: &str) -> pb::EnsureNetworkRequest {
    pb::EnsureNetworkRequest {
        sandbox_id: id.into(),
        port_mappings: vec![pb::PortMapping {
            protocol: "tcp".into(),
            container_port: 8080,
            host_port: 0,
            host_ip: String::new(),
        }],
        ..Default::default()
    }
}

async fn client_loop(
    endpoint: String,
    sock: std::path::PathBuf,
    k: usize,
    point: usize,
    stop: Arc<AtomicBool>,
    ledger: Arc<Mutex<Ledger>>,
    retry: bool,
) {
    let Ok(mut c) = network_agent::client::connect(&endpoint).await else { return };
    // With `retry`, a call that never got an answer (the transport failed: CANCELLED or
    // UNAVAILABLE, e.g. its HTTP/2 connection closed under it at a hand-over) is retried once
    // on a new connection, as gRPC-core and grpc-go clients do transparently; its answer binds.
    let retryable = |e: &tonic::Status| retry && matches!(e.code(), tonic::Code::Cancelled | tonic::Code::Unavailable);
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let new = format!("c{k}-p{point}-{n}");
        n += 1;
        let id = new.clone();
        ledger.lock().unwrap().unknown.insert(id.clone());
        let mut r = c.ensure_network(ensure_req(&id)).await;
        if let Err(e) = &r
            && retryable(e)
        {
            eprintln!("Ensure {id} retried: {e}");
            ledger.lock().unwrap().retried += 1;
            let Ok(c2) = network_agent::client::connect(&endpoint).await else { return };
            c = c2;
            r = c.ensure_network(ensure_req(&id)).await;
        }
        match r {
            Ok(r) => {
                let r = r.into_inner();
                {
                    let mut l = ledger.lock().unwrap();
                    l.unknown.remove(&id);
                    l.exists.insert(id.clone());
                    l.answered += 1;
                }
                let (name, sock, i2) = (r.interfaces[0].name.clone(), sock.clone(), id.clone());
                let _ = tokio::task::spawn_blocking(move || quiet_tap_fd(&sock, &name, &i2)).await;
            }
            Err(e) => {
                eprintln!("Ensure {id} failed: {e}");
                ledger.lock().unwrap().failed += 1;
                return;
            }
        }
        // Keep the new one; release the oldest once more than KEEP are alive.
        let id = {
            let mut l = ledger.lock().unwrap();
            l.kept[k].push_back(new);
            if l.kept[k].len() <= KEEP {
                continue;
            }
            l.kept[k].pop_front().unwrap()
        };
        {
            // In flight: a kill now may leave it either way.
            let mut l = ledger.lock().unwrap();
            l.exists.remove(&id);
            l.unknown.insert(id.clone());
        }
        let release = pb::ReleaseNetworkRequest { sandbox_id: id.clone(), ..Default::default() };
        let mut r = c.release_network(release.clone()).await;
        if let Err(e) = &r
            && retryable(e)
        {
            eprintln!("Release {id} retried: {e}");
            ledger.lock().unwrap().retried += 1;
            let Ok(c2) = network_agent::client::connect(&endpoint).await else { return };
            c = c2;
            r = c.release_network(release).await;
        }
        match r {
            Ok(r) if r.get_ref().released => {
                let mut l = ledger.lock().unwrap();
                l.unknown.remove(&id);
                l.exists.remove(&id);
                l.gone.insert(id);
                l.answered += 1;
            }
            r => {
                eprintln!("Release {id} failed: {r:?}");
                ledger.lock().unwrap().failed += 1;
                return;
            }
        }
    }
}

/// A TAP fd request that tolerates the agent dying mid-way (the VMM's view: just an error).
fn quiet_tap_fd(sock: &std::path::Path, tap: &str, id: &str) -> Option<std::os::fd::OwnedFd> {
    use std::{
        io::Write,
        os::fd::{AsRawFd, FromRawFd, OwnedFd},
    };

    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let s = std::os::unix::net::UnixStream::connect(sock).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    (&s).write_all(serde_json::json!({"name": tap, "sandboxId": id}).to_string().as_bytes()).ok()?;
    let mut buf = [0u8; 256];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC).ok()?;
    for c in msg.cmsgs().ok()? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            // SAFETY: the kernel installed this fd in our table for us (SCM_RIGHTS).
            return fds.first().map(|&f| unsafe { OwnedFd::from_raw_fd(f) });
        }
    }
    None
}

fn taps_json(a: &AgentUnderTest) -> serde_json::Value {
    a.http_json("/v1/network/taps")
}

/// The consistency invariants after a restart; returns violations.
fn check(a: &AgentUnderTest, rt: &tokio::runtime::Runtime, l: &Ledger) -> Vec<String> {
    let mut v = Vec::new();
    let mut c = rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).expect("connect");
    let nets = rt.block_on(c.list_networks(pb::ListNetworksRequest::default())).expect("list").into_inner().networks;
    let listed: BTreeSet<String> = nets.iter().map(|n| n.sandbox_id.clone()).collect();
    for id in &l.exists {
        if !listed.contains(id) {
            v.push(format!("told exists, not listed: {id}"));
            continue;
        }
        let n = nets.iter().find(|n| &n.sandbox_id == id).unwrap();
        let (reply, fd) = tap_fd(&a.tap_socket(), &n.tap_name, id);
        if reply["errCode"] != "0" || fd.is_none() {
            v.push(format!("told exists, TAP fd not served: {id}: {reply}"));
        }
    }
    for id in &l.gone {
        if listed.contains(id) {
            v.push(format!("told gone, still listed: {id}"));
        }
    }
    // Pool, node interfaces, datapath and state files agree. The pool lists every TAP the
    // agent owns on the node, also surplus ones its trim is deleting (retiring, T1); the two
    // listings are read one after the other while such a deletion may finish in between, so
    // they must agree once the trim is done (bounded), never leave a TAP nobody lists.
    let t = Instant::now();
    loop {
        let taps = taps_json(a);
        let pool: BTreeSet<String> =
            taps["taps"].as_array().unwrap().iter().map(|t| t["tapName"].as_str().unwrap().to_string()).collect();
        let node: BTreeSet<String> = a.node_taps().into_iter().collect();
        if pool == node {
            break;
        }
        if t.elapsed() > Duration::from_secs(20) {
            let unlisted: Vec<_> = node.difference(&pool).collect();
            let gone: Vec<_> = pool.difference(&node).collect();
            v.push(format!("node TAPs not in the pool {unlisted:?}, pool TAPs not on the node {gone:?}"));
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let sandboxes = a.http_json("/v1/dataplane/sandboxes")["sandboxes"].as_array().unwrap().len();
    let portmaps = a.http_json("/v1/dataplane/portmaps")["portMappings"].as_array().unwrap().len();
    if sandboxes != nets.len() {
        v.push(format!("{sandboxes} datapath registrations for {} networks", nets.len()));
    }
    let ports: usize = nets.iter().map(|n| n.port_mappings.len()).sum();
    if portmaps != ports {
        v.push(format!("{portmaps} port maps in the datapath for {ports} listed"));
    }
    let files: Vec<String> = std::fs::read_dir(a.state_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let stray: Vec<&String> =
        files.iter().filter(|f| !listed.iter().any(|id| f.starts_with(&format!("{id}.")))).collect();
    if !stray.is_empty() || files.len() != nets.len() {
        v.push(format!("state files {files:?} for {} networks (stray {stray:?})", nets.len()));
    }
    v
}

#[test]
fn kill9_during_ensure_release_storm() {
    if !require_root("reliability_crash kill9_during_ensure_release_storm") {
        return;
    }
    let long = std::env::var("CUBENET_RELIABILITY_LONG").is_ok_and(|v| v == "1");
    let (points, clients) = if long { (100, 50) } else { (10, 8) };
    let mut rng = Rng::new(std::env::var("CUBENET_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(14));
    let mut a = AgentUnderTest::prepare("crash", POOL, "");
    a.start();
    let baseline: BTreeSet<String> = a.node_taps().into_iter().collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let ledger = Arc::new(Mutex::new(Ledger { kept: vec![Default::default(); clients], ..Default::default() }));
    let start = Instant::now();
    let mut violations = Vec::new();
    for point in 0..points {
        let stop = Arc::new(AtomicBool::new(false));
        let handles: Vec<_> = (0..clients)
            .map(|k| {
                rt.spawn(client_loop(a.grpc_endpoint(), a.tap_socket(), k, point, stop.clone(), ledger.clone(), false))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100 + rng.below(1400) as u64));
        a.kill(nix::sys::signal::Signal::SIGKILL);
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            let _ = rt.block_on(h);
        }
        a.child = Some(a.spawn_script());
        a.wait_ready(Duration::from_secs(60));
        let mut l = ledger.lock().unwrap();
        for x in check(&a, &rt, &l) {
            violations.push(format!("crash point {point}: {x}"));
        }
        // A client whose call died with the agent retries it once the agent is back, as
        // cubelet does: here the retry is a Release (idempotent), so in-flight sandboxes do
        // not pile up over 100 crash points and exhaust the address range. Its answer is
        // binding: the next check sees them gone.
        let unknown: Vec<String> = std::mem::take(&mut l.unknown).into_iter().collect();
        l.retried += unknown.len() as u64;
        let mut c = rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).expect("connect");
        for id in unknown {
            let r = rt.block_on(
                c.release_network(pb::ReleaseNetworkRequest { sandbox_id: id.clone(), ..Default::default() }),
            );
            if r.is_ok_and(|r| r.into_inner().released) {
                l.exists.remove(&id);
                l.gone.insert(id);
            } else {
                violations.push(format!("crash point {point}: retried release of in-flight {id} failed"));
            }
        }
        let Ledger { kept, gone, .. } = &mut *l;
        for k in kept {
            k.retain(|id| !gone.contains(id));
        }
    }
    // Release everything still there; the node must return to its baseline.
    let mut c = rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).expect("connect");
    let nets = rt.block_on(c.list_networks(pb::ListNetworksRequest::default())).unwrap().into_inner().networks;
    for n in &nets {
        let r = rt.block_on(
            c.release_network(pb::ReleaseNetworkRequest { sandbox_id: n.sandbox_id.clone(), ..Default::default() }),
        );
        if !r.is_ok_and(|r| r.into_inner().released) {
            violations.push(format!("final release of {} failed", n.sandbox_id));
        }
    }
    let t = Instant::now();
    loop {
        let c = &taps_json(&a)["stateCounts"];
        let settled = c["Ready"].as_u64() == Some(POOL as u64)
            && c["Active"].as_u64() == Some(0)
            && c["Cleaning"].as_u64() == Some(0)
            && a.node_taps().len() == baseline.len();
        if settled {
            break;
        }
        if t.elapsed() > Duration::from_secs(30) {
            violations.push(format!("not back to baseline: {c} node TAPs {:?}", a.node_taps()));
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    for (what, path, key) in [
        ("port maps", "/v1/dataplane/portmaps", "portMappings"),
        ("registrations", "/v1/dataplane/sandboxes", "sandboxes"),
        ("sessions", "/v1/dataplane/sessions", "sessions"),
    ] {
        let n = a.http_json(path)[key].as_array().map_or(usize::MAX, Vec::len);
        if n != 0 {
            violations.push(format!("{n} {what} left after releasing everything"));
        }
    }
    let files = std::fs::read_dir(a.state_dir()).unwrap().count();
    if files != 0 {
        violations.push(format!("{files} state files left after releasing everything"));
    }
    let l = ledger.lock().unwrap();
    let report = serde_json::json!({
        "case": "crash-kill9",
        "inputs": points,
        "violations": if violations.is_empty() { serde_json::json!({}) } else { serde_json::json!({"consistency": violations.len()}) },
        "secs": start.elapsed().as_secs_f64(),
        "clients": clients,
        "answered_calls": l.answered,
        "told_exists": l.exists.len(),
        "told_gone": l.gone.len(),
        "in_flight_retried": l.retried,
    });
    println!("RELIABILITY {report}");
    assert!(violations.is_empty(), "{} violations:\n{}\nlog tail:\n{}", violations.len(), violations.join("\n"), {
        let log = a.log();
        log[log.len().saturating_sub(4000)..].to_string()
    });
}

#[test]
fn handover_during_ensure_release_storm() {
    if !require_root("reliability_crash handover_during_ensure_release_storm") {
        return;
    }
    let (points, clients) = (6, 8);
    let mut rng = Rng::new(std::env::var("CUBENET_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(12));
    // A /20: the storm's churn may outgrow a /24's addresses whatever the hand-over does.
    let mut a = AgentUnderTest::prepare("handover-storm", POOL, "cidr = \"192.168.0.0/20\"\n");
    agent_upgrade::start(&mut a);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let ledger = Arc::new(Mutex::new(Ledger { kept: vec![Default::default(); clients], ..Default::default() }));
    let mut violations = Vec::new();
    for point in 0..points {
        let stop = Arc::new(AtomicBool::new(false));
        let handles: Vec<_> = (0..clients)
            .map(|k| {
                rt.spawn(client_loop(a.grpc_endpoint(), a.tap_socket(), k, point, stop.clone(), ledger.clone(), true))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100 + rng.below(1400) as u64));
        if let Err(e) = agent_upgrade::upgrade(&mut a) {
            violations.push(format!("hand-over {point}: {e}"));
            break;
        }
        // A little more load on the new agent, then every client finishes its call.
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            let _ = rt.block_on(h);
        }
        let mut l = ledger.lock().unwrap();
        if l.failed > 0 || !l.unknown.is_empty() {
            violations.push(format!(
                "hand-over {point}: {} call(s) failed, unanswered: {:?}",
                std::mem::take(&mut l.failed),
                std::mem::take(&mut l.unknown)
            ));
        }
        for x in check(&a, &rt, &l) {
            violations.push(format!("hand-over {point}: {x}"));
        }
        // The pool's growth under the storm (released TAPs wait for a maintenance pass while
        // calls flow), printed for the report, not asserted.
        eprintln!("hand-over {point}: {} node TAPs, pool {}", a.node_taps().len(), taps_json(&a)["stateCounts"]);
    }
    let l = ledger.lock().unwrap();
    let report = serde_json::json!({
        "case": "handover-storm",
        "inputs": points,
        "violations": if violations.is_empty() { serde_json::json!({}) } else { serde_json::json!({"consistency": violations.len()}) },
        "clients": clients,
        "answered_calls": l.answered,
        "told_exists": l.exists.len(),
        "told_gone": l.gone.len(),
    });
    println!("RELIABILITY {report}");
    assert!(violations.is_empty(), "{} violations:\n{}\nlog tail:\n{}", violations.len(), violations.join("\n"), {
        let log = a.log();
        log[log.len().saturating_sub(4000)..].to_string()
    });
    assert!(l.answered > 0, "the storm made no call");
    drop(l);
    // Everything released: the node returns to its pool.
    let mut c = rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).expect("connect");
    let nets = rt.block_on(c.list_networks(pb::ListNetworksRequest::default())).unwrap().into_inner().networks;
    for n in &nets {
        let r = rt.block_on(
            c.release_network(pb::ReleaseNetworkRequest { sandbox_id: n.sandbox_id.clone(), ..Default::default() }),
        );
        assert!(r.is_ok_and(|r| r.into_inner().released), "final release of {}", n.sandbox_id);
    }
    assert_eq!(std::fs::read_dir(a.state_dir()).unwrap().count(), 0, "state files left");
}
