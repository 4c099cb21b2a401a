//! Egress policy through the agent's gRPC API (issue 10, items 16, 19 and 21): errors name the
//! field and the limit, one sandbox cannot exhaust the shared policy tries, and a Reconcile
//! that tightens a policy stops the established flows it now denies.

use std::{
    io::{Read, Write},
    net::TcpListener,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant as StdInstant},
};

use cubenet_proto::v1 as pb;
use cubenet_sys::tap::VNET_HDR_LEN;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    guest::TapGuest,
    require_root, smol,
    topology::WORLD_IP,
};
use smoltcp::{
    iface::SocketSet,
    socket::tcp,
    time::Instant,
    wire::{IpAddress, Ipv4Address},
};
use tonic::Code;

/// The agent's default per-sandbox limit (`policy_entries_per_sandbox`).
const LIMIT: usize = 1024;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn ctx(internet: bool, allow: Vec<String>, deny: Vec<String>) -> pb::CubeVsContext {
    pb::CubeVsContext { allow_internet_access: Some(internet), allow_out: allow, deny_out: deny, ..Default::default() }
}

/// `n` distinct /32 addresses in 11.0.0.0/8.
fn addrs(n: usize) -> Vec<String> {
    (0..n as u32).map(|i| std::net::Ipv4Addr::from(0x0b00_0000 + i).to_string()).collect()
}

fn ensure(
    a: &AgentUnderTest,
    id: &str,
    c: Option<pb::CubeVsContext>,
) -> Result<pb::EnsureNetworkResponse, tonic::Status> {
    rt().block_on(async {
        let mut cl = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        cl.ensure_network(pb::EnsureNetworkRequest { sandbox_id: id.into(), cubevs_context: c, ..Default::default() })
            .await
            .map(|r| r.into_inner())
    })
}

fn reconcile(
    a: &AgentUnderTest,
    id: &str,
    c: pb::CubeVsContext,
    meta: &[(&str, &str)],
) -> Result<pb::ReconcileNetworkResponse, tonic::Status> {
    rt().block_on(async {
        let mut cl = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        cl.reconcile_network(pb::ReconcileNetworkRequest {
            sandbox_id: id.into(),
            cubevs_context: Some(c),
            persist_metadata: meta.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
    })
}

/// The installed policy of `tap` from `/v1/dataplane/policies`.
fn policy_of(a: &AgentUnderTest, tap: &str) -> serde_json::Value {
    let pol = a.http_json("/v1/dataplane/policies");
    pol["policies"].as_array().unwrap().iter().find(|p| p["tapName"] == tap).expect("tap listed")["policy"].clone()
}

fn states(a: &AgentUnderTest) -> Vec<String> {
    let taps = a.http_json("/v1/network/taps");
    let list = taps.as_array().cloned().or_else(|| taps["taps"].as_array().cloned()).unwrap_or_default();
    list.iter().map(|t| t["state"].as_str().unwrap_or("?").to_string()).collect()
}

fn assert_invalid(r: Result<impl std::fmt::Debug, tonic::Status>, needles: &[&str]) {
    let e = r.expect_err("expected INVALID_ARGUMENT");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    for n in needles {
        assert!(e.message().contains(n), "{:?} does not name {n:?}", e.message());
    }
}

/// Item 21: a policy over the per-sandbox limit is INVALID_ARGUMENT naming the list and the
/// limit; malformed CIDRs (`1.2.3.4/+8`, leading zeros, spaces) are refused naming the entry,
/// also in `deny_out` when `allow_internet_access=false` ignores that list; nothing is left
/// behind, and a refused Reconcile leaves the old policy in force.
#[test]
fn policy_errors_name_the_field_and_the_limit() {
    if !require_root("policy_errors_name_the_field_and_the_limit") {
        return;
    }
    let mut a = AgentUnderTest::prepare("pol-errors", 2, "");
    a.start();
    let over = addrs(LIMIT + 1);
    assert_invalid(ensure(&a, "sb-x", Some(ctx(true, over.clone(), vec![]))), &["cubevs_context.allow_out", "1024"]);
    assert_invalid(ensure(&a, "sb-x", Some(ctx(true, vec![], over.clone()))), &["cubevs_context.deny_out", "1024"]);
    for bad in ["1.2.3.4/+8", "01.2.3.4", "1.2.3.4/08", " 1.2.3.4", "1.2.3.4/33", "1.2.3.4/", "1.2.3"] {
        assert_invalid(
            ensure(&a, "sb-x", Some(ctx(false, vec![bad.into()], vec![]))),
            &["cubevs_context.allow_out[0]"],
        );
        assert_invalid(
            ensure(&a, "sb-x", Some(ctx(false, vec!["1.1.1.1".into()], vec![bad.into()]))),
            &["cubevs_context.deny_out[0]"],
        );
    }
    // Nothing was stored or taken.
    assert!(std::fs::read_dir(a.state_dir()).unwrap().next().is_none(), "a refused Ensure left state");
    assert!(states(&a).iter().all(|s| s == "Ready"), "{:?}", states(&a));

    // At the limit is fine; a Reconcile over it is refused and the old policy stays.
    let r = ensure(&a, "sb-ok", Some(ctx(true, addrs(LIMIT), vec![]))).expect("ensure at the limit");
    let tap = r.interfaces[0].name.clone();
    let before = policy_of(&a, &tap);
    assert_eq!(before["allow"].as_array().unwrap().len(), LIMIT);
    assert_invalid(reconcile(&a, "sb-ok", ctx(true, vec![], over), &[]), &["cubevs_context.deny_out", "1024"]);
    assert_invalid(reconcile(&a, "sb-ok", ctx(false, vec![], vec!["1.2.3.4/+8".into()]), &[]), &["deny_out[0]"]);
    assert_eq!(policy_of(&a, &tap), before, "a refused Reconcile changed the policy");
    assert!(a.release("sb-ok"));
}

/// Item 19, as an attacker: sandboxes Ensure the largest deny lists the agent accepts
/// (halving on every refusal) until one is refused even at a single entry or 24 sandboxes
/// exist. Afterwards a normal sandbox still Ensures, an attacker can shrink its policy, and
/// every Release returns its TAP to Ready. Before the fix the attackers filled the shared
/// `deny_out` trie (65,536 entries), after which Ensure failed and released TAPs stayed
/// Cleaning.
#[test]
fn one_sandbox_cannot_lock_up_the_node() {
    if !require_root("one_sandbox_cannot_lock_up_the_node") {
        return;
    }
    let mut a = AgentUnderTest::prepare("pol-fair", 2, "");
    a.start();
    let mut size = 8192usize;
    let mut attackers = Vec::new();
    'attack: for i in 0..24 {
        let id = format!("sb-attack-{i}");
        loop {
            match ensure(&a, &id, Some(ctx(true, vec![], addrs(size)))) {
                Ok(_) => {
                    attackers.push(id);
                    break;
                }
                Err(_) if size > 1 => size /= 2,
                Err(e) => {
                    eprintln!("attacker {i} refused at one entry: {e:?}");
                    break 'attack;
                }
            }
        }
    }
    eprintln!("{} attackers hold {size} deny entries each (last size)", attackers.len());
    // Let the maintenance loop refill the pool (new TAPs install the baseline deny).
    std::thread::sleep(Duration::from_secs(2));

    let normal = ensure(&a, "sb-normal", Some(ctx(true, vec![], vec!["203.0.113.0/24".into()])));
    assert!(normal.is_ok(), "a normal sandbox cannot Ensure after the attack: {normal:?}");
    let first = attackers.first().expect("at least one attacker").clone();
    reconcile(&a, &first, ctx(true, vec![], vec!["203.0.113.7".into()]), &[]).expect("shrinking a policy");
    for id in attackers.iter().chain(std::iter::once(&"sb-normal".to_string())) {
        assert!(a.release(id));
    }
    let t = StdInstant::now();
    while states(&a).iter().any(|s| s != "Ready") && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let st = states(&a);
    assert!(st.iter().all(|s| s == "Ready"), "TAPs left after Release: {st:?}");
    assert!(std::fs::read_dir(a.state_dir()).unwrap().next().is_none(), "state left after Release");
}

/// A guest TCP flow to `world:7000` echoing 16 bytes every 20 ms; counts echoes and records
/// when the connection leaves Established.
struct Flow {
    echoes: Arc<AtomicU64>,
    broke: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Flow {
    fn start(g: TapGuest, local_port: u16) -> Self {
        let echoes = Arc::new(AtomicU64::new(0));
        let broke = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (e, b, s) = (echoes.clone(), broke.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut dev = smol::GuestDevice::new(&g, false);
            let mut iface = smol::guest_interface(&mut dev, local_port as u64);
            let sock = tcp::Socket::new(tcp::SocketBuffer::new(vec![0; 8192]), tcp::SocketBuffer::new(vec![0; 8192]));
            let mut set = SocketSet::new(vec![]);
            let h = set.add(sock);
            set.get_mut::<tcp::Socket>(h)
                .connect(iface.context(), (IpAddress::from(Ipv4Address::from(WORLD_IP)), 7000), local_port)
                .unwrap();
            let (mut established, mut pending, mut next) = (false, 0usize, StdInstant::now());
            while !s.load(Ordering::Relaxed) {
                iface.poll(Instant::now(), &mut dev, &mut set);
                let sk = set.get_mut::<tcp::Socket>(h);
                if sk.state() == tcp::State::Established {
                    established = true;
                    if pending == 0 && StdInstant::now() >= next && sk.can_send() {
                        sk.send_slice(b"0123456789abcdef").unwrap();
                        pending = 16;
                        next = StdInstant::now() + Duration::from_millis(20);
                    }
                    if sk.can_recv() {
                        let n = sk.recv(|d| (d.len(), d.len())).unwrap();
                        pending = pending.saturating_sub(n);
                        if pending == 0 {
                            e.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                } else if established {
                    *b.lock().unwrap() = Some(format!("left Established: {:?}", sk.state()));
                    break;
                }
                let mut fds = [nix::poll::PollFd::new(std::os::fd::AsFd::as_fd(g.fd()), nix::poll::PollFlags::POLLIN)];
                let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(5u16));
            }
        });
        Self { echoes, broke, stop, thread: Some(thread) }
    }

    fn echoes(&self) -> u64 {
        self.echoes.load(Ordering::Relaxed)
    }

    fn broke(&self) -> Option<String> {
        self.broke.lock().unwrap().clone()
    }

    /// Waits until `n` more echoes arrive (true) or `t` passes (false).
    fn advances(&self, n: u64, t: Duration) -> bool {
        let (start, t0) = (self.echoes(), StdInstant::now());
        while t0.elapsed() < t {
            if self.echoes() >= start + n {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn echo_server(a: &AgentUnderTest) {
    let l = a.topo.world.run(|| TcpListener::bind("198.51.100.1:7000").unwrap());
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

fn guest(a: &AgentUnderTest, r: &pb::EnsureNetworkResponse) -> TapGuest {
    let (reply, fd) = tap_fd(&a.tap_socket(), &r.interfaces[0].name, &r.sandbox_id);
    assert_eq!(reply["errCode"], "0", "{reply}");
    let g = TapGuest::new(fd.unwrap(), VNET_HDR_LEN);
    g.drain();
    g
}

/// Item 16: an established TCP flow keeps running across a Reconcile that does not tighten
/// the policy, and stops after a Reconcile whose new policy denies its destination (the
/// default, `flush_sessions_on_policy_tighten = true`). With the per-request override
/// `cubenet.io/flush-sessions-on-tighten: "false"` the flow survives the same tightening.
#[test]
fn reconcile_that_tightens_policy_stops_denied_flows() {
    if !require_root("reconcile_that_tightens_policy_stops_denied_flows") {
        return;
    }
    let mut a = AgentUnderTest::prepare("pol-flush", 2, "");
    a.start();
    echo_server(&a);
    let open = ctx(true, vec![], vec![]);
    let tight = ctx(true, vec![], vec!["198.51.100.1/32".into()]);

    let r = ensure(&a, "sb-flush", Some(open.clone())).expect("ensure");
    let flow = Flow::start(guest(&a, &r), 41000);
    assert!(flow.advances(5, Duration::from_secs(10)), "flow never ran: {:?}", flow.broke());
    // Same policy again (cubelet's periodic Reconcile) and a loosening one: the flow goes on.
    reconcile(&a, "sb-flush", open.clone(), &[]).expect("reconcile");
    reconcile(&a, "sb-flush", ctx(true, vec!["198.51.100.0/24".into()], vec![]), &[]).expect("reconcile");
    assert!(flow.advances(10, Duration::from_secs(5)), "a non-tightening Reconcile broke the flow: {:?}", flow.broke());
    // Tightening: the destination is now denied, so the established flow must stop.
    reconcile(&a, "sb-flush", tight.clone(), &[]).expect("reconcile");
    std::thread::sleep(Duration::from_millis(300));
    let after = flow.echoes();
    assert!(
        !flow.advances(3, Duration::from_secs(2)),
        "the flow still runs after a tightening Reconcile ({after} → {} echoes)",
        flow.echoes()
    );
    drop(flow);

    // The per-request override keeps established flows (upstream behaviour).
    let r2 = ensure(&a, "sb-keep", Some(open)).expect("ensure");
    let flow2 = Flow::start(guest(&a, &r2), 41001);
    assert!(flow2.advances(5, Duration::from_secs(10)), "flow never ran: {:?}", flow2.broke());
    reconcile(&a, "sb-keep", tight, &[("cubenet.io/flush-sessions-on-tighten", "false")]).expect("reconcile");
    assert!(flow2.advances(10, Duration::from_secs(5)), "flush was disabled but the flow stopped: {:?}", flow2.broke());
    assert_invalid(
        reconcile(&a, "sb-keep", ctx(true, vec![], vec![]), &[("cubenet.io/flush-sessions-on-tighten", "maybe")]),
        &["persist_metadata", "cubenet.io/flush-sessions-on-tighten"],
    );
}

/// The FQDN pattern names of interface `ifindex` in the pinned `dns_allow_names`:
/// (name_hash, subdomains, name length), the seal being `(0, 0xff, 0)`; sorted.
fn fqdn_names(a: &AgentUnderTest, ifindex: u32) -> Vec<(u64, u8, u8)> {
    use cubevs_common::dns::{DnsAllowKey, DnsAllowName};
    let data = aya::maps::MapData::from_pin(a.pin_dir().join("maps").join(cubevs_common::map::DNS_ALLOW_NAMES))
        .expect("open dns_allow_names");
    let m: aya::maps::HashMap<_, DnsAllowKey, DnsAllowName> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data)).expect("hash map");
    let mut v: Vec<_> = m
        .iter()
        .map(|e| e.expect("entry"))
        .filter(|(k, _)| k.ifindex == ifindex)
        .map(|(k, n)| (k.name_hash, k.subdomains, n.len))
        .collect();
    v.sort_unstable();
    v
}

/// Decision R52: a sandbox whose FQDN patterns an agent before R48 wrote (keys without names,
/// matched by their forgeable hash alone) gets their names from its state record when the new
/// agent adopts it, and its generation sealed; nothing else of its policy is rewritten. The
/// packets' side is `attack_dns_hash_upgrade_testrun`.
#[test]
fn adoption_names_fqdn_patterns_an_older_agent_wrote_without_names() {
    if !require_root("adoption_names_fqdn_patterns_an_older_agent_wrote_without_names") {
        return;
    }
    let mut a = AgentUnderTest::prepare("pol-fqdn-names", 1, "");
    a.start();
    let c = pb::CubeVsContext {
        allow_internet_access: Some(false),
        allow_out: vec![format!("{}/32", std::net::Ipv4Addr::from(WORLD_IP))],
        allow_fqdn: vec![pb::FqdnAllow { name: "*.github.com".into(), ports: vec![] }],
        ..Default::default()
    };
    let tap = ensure(&a, "sb-fqdn", Some(c)).expect("ensure").interfaces[0].name.clone();
    let name = tap.clone();
    let ifindex = a.topo.node.run(move || cubenet_sys::ifindex(&name).expect("tap ifindex"));
    let named = vec![(0, 0xff, 0), (cubevs_common::dns::name_hash("github.com"), 1, 11)];
    assert_eq!(fqdn_names(&a, ifindex), named, "this agent names and seals what it writes");
    let generation = policy_of(&a, &tap)["generation"].clone();
    assert!(generation.is_u64(), "{generation}");

    // Upgrade from an agent before R48: its names were never written.
    a.kill(nix::sys::signal::Signal::SIGTERM);
    let data = aya::maps::MapData::from_pin(a.pin_dir().join("maps").join(cubevs_common::map::DNS_ALLOW_NAMES))
        .expect("open dns_allow_names");
    let mut m: aya::maps::HashMap<_, cubevs_common::dns::DnsAllowKey, cubevs_common::dns::DnsAllowName> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data)).expect("hash map");
    let keys: Vec<_> = m.keys().map(|k| k.expect("key")).collect();
    for k in keys {
        m.remove(&k).expect("delete name");
    }
    drop(m);
    assert!(fqdn_names(&a, ifindex).is_empty());
    a.start();
    assert_eq!(fqdn_names(&a, ifindex), named, "the adopted sandbox's pattern is named and sealed");
    assert_eq!(policy_of(&a, &tap)["generation"], generation, "the policy was rewritten instead of named in place");
    assert!(a.log().contains("FQDN pattern names backfilled and sealed"), "{}", a.log());
    let (_, metrics) = a.http("/metrics").expect("metrics");
    assert!(metrics.contains("cubenet_fqdn_name_backfill_total{result=\"named\"} 1\n"), "{metrics}");
    assert!(metrics.contains("cubenet_fqdn_name_backfill_total{result=\"sealed_out\"} 0\n"), "{metrics}");
}
