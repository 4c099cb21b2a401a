//! Fault injection (issue 14): the agent's state store on a full disk (a real, size-limited
//! tmpfs in a private mount namespace: `ENOSPC`), failing `write`/`fsync`/`rename`/`unlink`
//! (`EIO` through the store's fault file, `network_agent::state::fault`), TAP creation meeting
//! interfaces of the next TAP names that are not the agent's, and a TAP creation that fails
//! midway (after the TAP exists: the gateway device deleted under the agent).
//! In every case: the failing call answers a clear error naming the operation and the cause,
//! nothing it touched is left half-made (TAP back to Ready, no port map, registration or state
//! file), every other sandbox keeps being served, the call works again once the fault is gone,
//! and a `kill -9` + restart afterwards recovers exactly what the clients were told exists.
//!
//! Prints one `RELIABILITY {json}` line per test (read by `cargo xtask reliability`).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    mntns::PrivateTmpfs,
    require_root,
};
use tonic::Code;

const POOL: usize = 2;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn ensure_req(id: &str) -> pb::EnsureNetworkRequest {
    pb::EnsureNetworkRequest {
        sandbox_id: id.into(),
        port_mappings: vec![pb::PortMapping {
            protocol: "tcp".into(),
            container_port: 8080,
            host_port: 0,
            host_ip: String::new(),
        }],
        cubevs_context: Some(pb::CubeVsContext { allow_out: vec!["198.51.100.0/24".into()], ..Default::default() }),
        ..Default::default()
    }
}

/// One gRPC connection to the agent under test.
struct Client<'a> {
    rt: &'a tokio::runtime::Runtime,
    c: pb::network_agent_client::NetworkAgentClient<tonic::transport::Channel>,
}

impl<'a> Client<'a> {
    fn new(rt: &'a tokio::runtime::Runtime, a: &AgentUnderTest) -> Self {
        Self { rt, c: rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).expect("connect") }
    }
    fn ensure(&mut self, id: &str) -> Result<pb::EnsureNetworkResponse, tonic::Status> {
        self.rt.block_on(self.c.ensure_network(ensure_req(id))).map(tonic::Response::into_inner)
    }
    fn release(&mut self, id: &str) -> Result<bool, tonic::Status> {
        self.rt
            .block_on(self.c.release_network(pb::ReleaseNetworkRequest { sandbox_id: id.into(), ..Default::default() }))
            .map(|r| r.into_inner().released)
    }
    fn reconcile(&mut self, id: &str, allow: &str) -> Result<(), tonic::Status> {
        let req = pb::ReconcileNetworkRequest {
            sandbox_id: id.into(),
            cubevs_context: Some(pb::CubeVsContext { allow_out: vec![allow.into()], ..Default::default() }),
            ..Default::default()
        };
        self.rt.block_on(self.c.reconcile_network(req)).map(drop)
    }
    fn list(&mut self) -> Vec<pb::NetworkState> {
        self.rt.block_on(self.c.list_networks(pb::ListNetworksRequest::default())).expect("list").into_inner().networks
    }
}

/// The allow list the datapath holds for `id`'s TAP.
fn dp_allow(a: &AgentUnderTest, id: &str) -> serde_json::Value {
    let pol = a.http_json("/v1/dataplane/policies");
    pol["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["sandboxID"] == id)
        .map(|p| p["policy"]["allow"].clone())
        .unwrap_or(serde_json::Value::Null)
}

/// Consistency of the node with what the clients were told: `exists` listed and served (TAP
/// fd), nothing else listed; pool = node TAPs; one registration, port map set and state file
/// per network, nothing more. Returns the violations.
/// Transient differences (a TAP being created or trimmed by the background pool) are waited
/// out for up to 10 s; what stays is a violation.
fn consistency(a: &AgentUnderTest, c: &mut Client, state: &Path, exists: &BTreeSet<String>) -> Vec<String> {
    let t = Instant::now();
    loop {
        let v = consistency_once(a, c, state, exists);
        if v.is_empty() || t.elapsed() > Duration::from_secs(10) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn consistency_once(a: &AgentUnderTest, c: &mut Client, state: &Path, exists: &BTreeSet<String>) -> Vec<String> {
    let mut v = Vec::new();
    let nets = c.list();
    let listed: BTreeSet<String> = nets.iter().map(|n| n.sandbox_id.clone()).collect();
    if &listed != exists {
        v.push(format!("listed {listed:?}, clients were told {exists:?}"));
    }
    for n in &nets {
        let (reply, fd) = tap_fd(&a.tap_socket(), &n.tap_name, &n.sandbox_id);
        if reply["errCode"] != "0" || fd.is_none() {
            v.push(format!("{} listed, TAP fd not served: {reply}", n.sandbox_id));
        }
    }
    let taps = a.http_json("/v1/network/taps");
    let pool: BTreeSet<String> =
        taps["taps"].as_array().unwrap().iter().map(|t| t["tapName"].as_str().unwrap().to_string()).collect();
    let node: BTreeSet<String> = a.node_taps().into_iter().collect();
    if pool != node {
        v.push(format!("node TAPs {node:?} != pool {pool:?}"));
    }
    let active = taps["stateCounts"]["Active"].as_u64().unwrap_or(0) as usize;
    if active != nets.len() {
        v.push(format!("{active} Active TAPs for {} networks", nets.len()));
    }
    let regs = a.http_json("/v1/dataplane/sandboxes")["sandboxes"].as_array().unwrap().len();
    if regs != nets.len() {
        v.push(format!("{regs} datapath registrations for {} networks", nets.len()));
    }
    let pms = a.http_json("/v1/dataplane/portmaps")["portMappings"].as_array().unwrap().len();
    let ports: usize = nets.iter().map(|n| n.port_mappings.len()).sum();
    if pms != ports {
        v.push(format!("{pms} port maps in the datapath for {ports} listed"));
    }
    let mut files: Vec<String> =
        std::fs::read_dir(state).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    let want: Vec<String> = listed.iter().map(|id| format!("{id}.success.json")).collect();
    if files != want {
        v.push(format!("state files {files:?}, want {want:?}"));
    }
    v
}

/// Waits (bounded) until the pool has `POOL` Ready TAPs and none Cleaning.
fn settle(a: &AgentUnderTest) {
    let t = Instant::now();
    loop {
        let c = a.http_json("/v1/network/taps")["stateCounts"].clone();
        if c["Ready"].as_u64() == Some(POOL as u64) && c["Cleaning"].as_u64().unwrap_or(0) == 0 {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "pool not settled: {c}\n{}", a.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn restart(a: &mut AgentUnderTest) {
    a.kill(nix::sys::signal::Signal::SIGKILL);
    a.child = Some(a.spawn_script());
    a.wait_ready(Duration::from_secs(60));
}

fn assert_clean(case: &str, violations: &[String], a: &AgentUnderTest) {
    assert!(
        violations.is_empty(),
        "{case}: {} violations:\n{}\nlog tail:\n{}",
        violations.len(),
        violations.join("\n"),
        {
            let log = a.log();
            log[log.len().saturating_sub(4000)..].to_string()
        }
    );
}

fn report(case: &str, inputs: usize, violations: &[String], start: Instant, extra: serde_json::Value) {
    let mut r = serde_json::json!({
        "case": case,
        "inputs": inputs,
        "violations": if violations.is_empty() { serde_json::json!({}) } else { serde_json::json!({"consistency": violations.len()}) },
        "secs": start.elapsed().as_secs_f64(),
    });
    if let (Some(r), Some(e)) = (r.as_object_mut(), extra.as_object()) {
        r.extend(e.clone());
    }
    println!("RELIABILITY {r}");
}

fn expect_err(what: &str, r: Result<impl std::fmt::Debug, tonic::Status>, code: Code, needles: &[&str]) -> Vec<String> {
    match r {
        Ok(x) => vec![format!("{what}: succeeded under the fault: {x:?}")],
        Err(e) if e.code() != code => vec![format!("{what}: code {:?}, want {code:?}: {}", e.code(), e.message())],
        Err(e) => needles
            .iter()
            .filter(|n| !e.message().contains(*n))
            .map(|n| format!("{what}: error {:?} does not say {n:?}", e.message()))
            .collect(),
    }
}

/// A real full disk: the state store on a 512 KiB tmpfs filled to the last page.
#[test]
fn state_store_enospc() {
    if !require_root("reliability_faults state_store_enospc") {
        return;
    }
    let start = Instant::now();
    let mut a = AgentUnderTest::prepare("enospc", POOL, "");
    let fs_dir = a.dir.join("fs");
    let tmpfs = PrivateTmpfs::new(&fs_dir, "512k");
    let state_dir = fs_dir.join("state");
    let cfg = std::fs::read_to_string(a.dir.join("agent.toml")).unwrap().replace(
        &format!("state_dir = \"{}\"", a.state_dir().display()),
        &format!("state_dir = \"{}\"", state_dir.display()),
    );
    std::fs::write(a.dir.join("agent.toml"), cfg).unwrap();
    a.mount_ns_of = Some(tmpfs.pid());
    a.start();
    let state = tmpfs.host_path(&state_dir);
    let rt = rt();
    let mut c = Client::new(&rt, &a);
    let mut v = Vec::new();
    let mut exists = BTreeSet::new();
    for id in ["sb-a", "sb-b"] {
        c.ensure(id).unwrap_or_else(|e| panic!("ensure {id}: {e:?}"));
        exists.insert(id.to_string());
    }
    let filled = tmpfs.fill();

    // Ensure on a full disk: a clear error, nothing half-made.
    v.extend(expect_err("ensure sb-c (full)", c.ensure("sb-c"), Code::Internal, &["state of sb-c", "No space left"]));
    settle(&a);
    v.extend(consistency(&a, &mut c, &state, &exists));

    // Reconcile with a new policy: its record cannot be written, so nothing changes.
    let before = dp_allow(&a, "sb-b");
    v.extend(expect_err(
        "reconcile sb-b (full)",
        c.reconcile("sb-b", "203.0.113.0/24"),
        Code::Internal,
        &["No space left"],
    ));
    if dp_allow(&a, "sb-b") != before {
        v.push(format!("reconcile failed but the datapath policy changed: {before} -> {}", dp_allow(&a, "sb-b")));
    }

    // Release needs no space (intent by rename, R5): a full disk never pins a sandbox.
    match c.release("sb-a") {
        Ok(true) => {
            exists.remove("sb-a");
        }
        r => v.push(format!("release sb-a on a full disk: {r:?}")),
    }
    settle(&a);
    v.extend(consistency(&a, &mut c, &state, &exists));

    // Space back: the same calls work.
    tmpfs.unfill();
    match c.ensure("sb-c") {
        Ok(_) => {
            exists.insert("sb-c".into());
        }
        Err(e) => v.push(format!("ensure sb-c after the disk was freed: {e:?}")),
    }
    if let Err(e) = c.reconcile("sb-b", "203.0.113.0/24") {
        v.push(format!("reconcile sb-b after the disk was freed: {e:?}"));
    }
    if dp_allow(&a, "sb-b") != serde_json::json!(["203.0.113.0/24"]) {
        v.push(format!("reconcile sb-b: datapath allow is {}", dp_allow(&a, "sb-b")));
    }

    // Full again, then kill -9 and restart on the full disk: recovery needs no space either.
    tmpfs.fill();
    restart(&mut a);
    let mut c = Client::new(&rt, &a);
    settle(&a);
    v.extend(consistency(&a, &mut c, &state, &exists));
    tmpfs.unfill();
    for id in exists.clone() {
        if !c.release(&id).is_ok_and(|r| r) {
            v.push(format!("final release of {id} failed"));
        }
        exists.remove(&id);
    }
    settle(&a);
    v.extend(consistency(&a, &mut c, &state, &exists));
    report("fault-state-enospc", 6, &v, start, serde_json::json!({"filler_bytes": filled}));
    assert_clean("state_store_enospc", &v, &a);
}

/// EIO on each store operation in turn, injected through the store's fault file.
#[test]
fn state_store_eio() {
    if !require_root("reliability_faults state_store_eio") {
        return;
    }
    let start = Instant::now();
    let mut a = AgentUnderTest::prepare("eio", POOL, "");
    let faults: PathBuf = a.dir.join("faults");
    std::fs::write(&faults, "").unwrap();
    a.env.push((network_agent::state::fault::ENV.into(), faults.display().to_string()));
    a.start();
    let state = a.state_dir();
    let rt = rt();
    let mut c = Client::new(&rt, &a);
    let mut v = Vec::new();
    let mut exists = BTreeSet::new();
    c.ensure("sb-keep").expect("ensure sb-keep");
    exists.insert("sb-keep".to_string());
    let set = |op: &str| std::fs::write(&faults, format!("{op} {}\n", libc::EIO)).unwrap();
    let clear = || std::fs::write(&faults, "").unwrap();
    let mut inputs = 0;
    for op in ["write", "fsync", "rename"] {
        let id = format!("sb-{op}");
        // Ensure under the fault: fails clearly, leaves nothing.
        set(op);
        inputs += 1;
        v.extend(expect_err(
            &format!("ensure {id} ({op} EIO)"),
            c.ensure(&id),
            Code::Internal,
            &[&id, "Input/output error"],
        ));
        clear();
        settle(&a);
        v.extend(consistency(&a, &mut c, &state, &exists).into_iter().map(|x| format!("after ensure/{op}: {x}")));
        match c.ensure(&id) {
            Ok(_) => {
                exists.insert(id.clone());
            }
            Err(e) => v.push(format!("ensure {id} after the fault: {e:?}")),
        }
        // Reconcile under the fault: fails, old policy stays in force.
        set(op);
        inputs += 1;
        let before = dp_allow(&a, &id);
        v.extend(expect_err(
            &format!("reconcile {id} ({op} EIO)"),
            c.reconcile(&id, "203.0.113.0/24"),
            Code::Internal,
            &["Input/output error"],
        ));
        if dp_allow(&a, &id) != before {
            v.push(format!("reconcile {id} failed under {op} EIO but the datapath policy changed"));
        }
        // Release under the fault: only a failing rename can stop it (then nothing changes).
        inputs += 1;
        match (op, c.release(&id)) {
            ("rename", Ok(r)) => v.push(format!("release {id} under rename EIO answered {r}")),
            ("rename", Err(e)) => {
                if !e.message().contains("Input/output error") {
                    v.push(format!("release {id} under rename EIO: unclear error {:?}", e.message()));
                }
            }
            (_, Ok(true)) => {
                exists.remove(&id);
            }
            (_, r) => v.push(format!("release {id} under {op} EIO: {r:?}")),
        }
        clear();
        settle(&a);
        v.extend(consistency(&a, &mut c, &state, &exists).into_iter().map(|x| format!("after release/{op}: {x}")));
    }
    // unlink: a release whose state file cannot be removed.
    set("unlink");
    inputs += 1;
    let r = c.release("sb-rename");
    let t = Instant::now();
    // The release itself succeeded (intent recorded); the record's removal is retried by
    // maintenance until the fault is gone. The sandbox must not be listed meanwhile.
    if !matches!(r, Ok(true)) {
        v.push(format!("release sb-rename under unlink EIO: {r:?}"));
    }
    exists.remove("sb-rename");
    std::thread::sleep(Duration::from_millis(1500));
    if c.list().iter().any(|n| n.sandbox_id == "sb-rename") {
        v.push("released sb-rename still listed under unlink EIO".into());
    }
    clear();
    loop {
        let left = consistency(&a, &mut c, &state, &exists);
        if left.is_empty() {
            break;
        }
        if t.elapsed() > Duration::from_secs(20) {
            v.extend(left.into_iter().map(|x| format!("after unlink EIO cleared: {x}")));
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Restart on top: exactly what the clients were told.
    restart(&mut a);
    let mut c = Client::new(&rt, &a);
    settle(&a);
    v.extend(consistency(&a, &mut c, &state, &exists).into_iter().map(|x| format!("after restart: {x}")));
    report("fault-state-eio", inputs, &v, start, serde_json::json!({}));
    assert_clean("state_store_eio", &v, &a);
}

/// A TAP creation that fails midway: the next address's TAP name is already taken in the
/// dataplane namespace by an interface the agent did not create.
#[test]
fn tap_creation_collision() {
    if !require_root("reliability_faults tap_creation_collision") {
        return;
    }
    let start = Instant::now();
    let mut a = AgentUnderTest::prepare("collide", POOL, "");
    a.start();
    let rt = rt();
    let mut c = Client::new(&rt, &a);
    let mut v = Vec::new();
    let mut exists = BTreeSet::new();
    // Take the pool; the next Ensure must create a TAP on demand.
    for id in ["sb-1", "sb-2"] {
        c.ensure(id).unwrap_or_else(|e| panic!("ensure {id}: {e:?}"));
        exists.insert(id.to_string());
    }
    // The pool refills in the background: wait, then take those too, so creation is on demand.
    settle(&a);
    for id in ["sb-3", "sb-4"] {
        c.ensure(id).unwrap_or_else(|e| panic!("ensure {id}: {e:?}"));
        exists.insert(id.to_string());
    }
    settle(&a);
    // Block every address the agent could pick next with a foreign interface of its TAP name
    // (ifb: the test kernel may lack the dummy driver) or a TAP.
    let used: BTreeSet<String> = a.node_taps().into_iter().collect();
    let mut foreign = Vec::new();
    for i in 2..40u8 {
        let name = format!("z192.168.0.{i}");
        // Every other one a persistent TAP: TUNSETIFF would attach to it, not fail.
        let args: &[&str] =
            if i % 2 == 0 { &["tuntap", "add", &name, "mode", "tap"] } else { &["link", "add", &name, "type", "ifb"] };
        if !used.contains(&name) && a.topo.node.exec("ip", args).status.success() {
            foreign.push(name);
        }
    }
    // Two Ensures take the Ready TAPs, the third must create one on demand, and the pool's
    // refill meets the collisions too.
    let mut errors = Vec::new();
    for id in ["sb-x", "sb-y", "sb-z"] {
        match c.ensure(id) {
            Ok(x) => {
                let name = &x.interfaces[0].name;
                if foreign.contains(name) {
                    v.push(format!("{id} got {name}, a foreign interface"));
                }
                exists.insert(id.to_string());
            }
            Err(e) => {
                if !(e.message().contains("create TAP") || e.message().contains("no free address")) {
                    v.push(format!("ensure {id} with colliding names: unclear error {:?}", e.message()));
                }
                errors.push((id, e.message().to_string()));
            }
        }
    }
    let refill_fail = a.http("/readyz");
    let ok = errors.is_empty();
    // Foreign interfaces are not the agent's to delete or use.
    let after: BTreeSet<String> = {
        let out = a.topo.node.ip(&["-j", "link", "show"]);
        let j: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        j.as_array().into_iter().flatten().filter_map(|l| l["ifname"].as_str().map(str::to_string)).collect()
    };
    let deleted: Vec<&String> = foreign.iter().filter(|n| !after.contains(*n)).collect();
    if !deleted.is_empty() {
        v.push(format!("the agent deleted {} foreign interfaces it did not create: {deleted:?}", deleted.len()));
    }
    // Everything else keeps being served; pool and maps agree (foreign dummies are not TAPs:
    // compare only tun devices).
    let nets = c.list();
    let listed: BTreeSet<String> = nets.iter().map(|n| n.sandbox_id.clone()).collect();
    if listed != exists {
        v.push(format!("listed {listed:?}, told {exists:?}"));
    }
    for n in &nets {
        let (reply, fd) = tap_fd(&a.tap_socket(), &n.tap_name, &n.sandbox_id);
        if reply["errCode"] != "0" || fd.is_none() {
            v.push(format!("{} not served after the collision: {reply}", n.sandbox_id));
        }
    }
    let regs = a.http_json("/v1/dataplane/sandboxes")["sandboxes"].as_array().unwrap().len();
    if regs != nets.len() {
        v.push(format!("{regs} registrations for {} networks", nets.len()));
    }
    // Remove the obstacles: creation works again.
    for n in &foreign {
        let _ = a.topo.node.exec("ip", &["link", "del", n]);
    }
    for (id, _) in &errors {
        match c.ensure(id) {
            Ok(_) => {
                exists.insert(id.to_string());
            }
            Err(e) => v.push(format!("ensure {id} after removing the collision: {e:?}")),
        }
    }
    let t = Instant::now();
    while a.http("/readyz").map(|r| r.0) != Some(200) && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(200));
    }
    settle(&a);
    let state = a.state_dir();
    v.extend(consistency(&a, &mut c, &state, &exists));
    report(
        "fault-tap-collision",
        foreign.len(),
        &v,
        start,
        serde_json::json!({"all_ensures_ok": ok, "errors": errors.iter().map(|e| format!("{}: {}", e.0, e.1)).collect::<Vec<_>>(), "readyz_while_blocked": refill_fail}),
    );
    assert_clean("tap_creation_collision", &v, &a);
}

/// A TAP creation that fails after the TAP exists (its gateway device vanished under the
/// agent): the half-made TAP must not stay behind, the error must say what failed, and a
/// restart (which recreates the gateway device) recovers everything.
#[test]
fn tap_creation_fails_midway() {
    if !require_root("reliability_faults tap_creation_fails_midway") {
        return;
    }
    let start = Instant::now();
    let mut a = AgentUnderTest::prepare("midway", 1, "");
    a.start();
    let rt = rt();
    let mut c = Client::new(&rt, &a);
    let mut v = Vec::new();
    let mut exists = BTreeSet::new();
    c.ensure("sb-1").expect("ensure sb-1");
    exists.insert("sb-1".to_string());
    // The pool refills its one Ready TAP.
    let t = Instant::now();
    while a.http_json("/v1/network/taps")["stateCounts"]["Ready"].as_u64() != Some(1) {
        assert!(t.elapsed() < Duration::from_secs(20), "pool did not refill");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The gateway device disappears: creation now fails after TUNSETIFF (neighbour step).
    a.topo.node.ip(&["link", "del", "cube-dev"]);
    c.ensure("sb-2").expect("ensure sb-2 from the Ready TAP");
    exists.insert("sb-2".to_string());
    let r = c.ensure("sb-3");
    v.extend(expect_err("ensure sb-3 (cube-dev gone)", r, Code::Internal, &["create TAP", "cube-dev"]));
    std::thread::sleep(Duration::from_millis(1500));
    let taps = a.http_json("/v1/network/taps");
    let pool: BTreeSet<String> =
        taps["taps"].as_array().unwrap().iter().map(|t| t["tapName"].as_str().unwrap().to_string()).collect();
    let node: BTreeSet<String> = a.node_taps().into_iter().collect();
    if pool != node {
        v.push(format!("half-made TAPs left: node {node:?}, pool {pool:?}"));
    }
    let ready = a.http("/readyz");
    if !ready.as_ref().is_some_and(|(code, body)| *code == 503 && body.contains("cube-dev")) {
        v.push(format!("readiness while TAPs cannot be made: {ready:?}"));
    }
    // A restart recreates the gateway device and recovers the sandboxes.
    restart(&mut a);
    let mut c = Client::new(&rt, &a);
    match c.ensure("sb-3") {
        Ok(_) => {
            exists.insert("sb-3".into());
        }
        Err(e) => v.push(format!("ensure sb-3 after the restart: {e:?}")),
    }
    let state = a.state_dir();
    v.extend(consistency(&a, &mut c, &state, &exists));
    report("fault-tap-midway", 3, &v, start, serde_json::json!({"readyz_while_broken": ready}));
    assert_clean("tap_creation_fails_midway", &v, &a);
}
