//! Issue 4 acceptance with today's datapath (ARP proxy): the network-agent started by
//! `scripts/start-network-agent.sh` in its own namespace, programming the harness node
//! namespace. Pool, Ensure, fd handoff + TAP guest ARP, Release/reuse, kill -9 recovery,
//! 50 concurrent Ensure/Release back to baseline, fd-socket bad input, gRPC validation,
//! config errors. Standard gRPC clients (grpcio, tonic defaults) are in `agent_clients.rs`.
//! Tests needing SNAT/conntrack/port-map DNAT live in `agent_datapath.rs`.

use std::{
    collections::BTreeSet,
    path::Path,
    time::{Duration, Instant},
};

use cubenet_proto::v1::{self as pb, network_agent_client::NetworkAgentClient};
use cubenet_sys::tap::VNET_HDR_LEN;
use cubenet_tests::{
    agent::{AgentUnderTest, output, request_tap_fd, tap_fd, workspace_bin},
    guest::TapGuest,
    netns::leftover_namespaces,
    packet::{self, GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC},
    require_root,
};
use tonic::{Code, transport::Channel};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

async fn client(a: &AgentUnderTest) -> NetworkAgentClient<Channel> {
    network_agent::client::connect(&a.grpc_endpoint()).await.expect("connect gRPC")
}

fn ensure_req(id: &str, ports: &[u32]) -> pb::EnsureNetworkRequest {
    pb::EnsureNetworkRequest {
        sandbox_id: id.into(),
        port_mappings: ports
            .iter()
            .map(|p| pb::PortMapping {
                protocol: "tcp".into(),
                container_port: *p,
                host_port: 0,
                host_ip: String::new(),
            })
            .collect(),
        cubevs_context: Some(pb::CubeVsContext {
            allow_internet_access: Some(false),
            allow_out: vec!["198.51.100.0/24".into()],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// An Ensure of sandbox `ok` with `(protocol, container_port, host_port)` mappings.
fn pm_req(ports: &[(&str, u32, u32)]) -> pb::EnsureNetworkRequest {
    pb::EnsureNetworkRequest {
        port_mappings: ports
            .iter()
            .map(|&(protocol, container_port, host_port)| pb::PortMapping {
                protocol: protocol.into(),
                container_port,
                host_port,
                host_ip: String::new(),
            })
            .collect(),
        ..ensure_req("ok", &[])
    }
}

fn state_counts(a: &AgentUnderTest) -> (u64, u64, u64) {
    let j = a.http_json("/v1/network/taps");
    let c = &j["stateCounts"];
    (c["Ready"].as_u64().unwrap(), c["Active"].as_u64().unwrap(), c["Cleaning"].as_u64().unwrap())
}

fn tap_of(a: &AgentUnderTest, name: &str) -> serde_json::Value {
    let j = a.http_json("/v1/network/taps");
    j["taps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tapName"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("{name}: {j}"))
}

fn state_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect()
}

fn assert_arp(guest: &TapGuest) {
    let reply = guest.arp(GATEWAY_IP, Duration::from_secs(2)).expect("no ARP reply through the agent's TAP");
    assert_eq!(reply, packet::arp_reply(GATEWAY_MAC, GATEWAY_IP, GUEST_MAC, GUEST_IP));
}

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

#[test]
fn pool_ensure_fd_arp_release_reuse() {
    if !require_root("pool_ensure_fd_arp_release_reuse") {
        return;
    }
    let names;
    {
        let mut a = AgentUnderTest::prepare("basic", 3, "");
        names = vec![a.ns.name().to_string(), a.topo.node.name().to_string()];
        a.start();
        // Pool: 3 Ready TAPs in the node namespace. Each got from_cube as a warm-up tc filter
        // and the maintenance loop moves it to a pinned tcx link (F5): in the end exactly one
        // from_cube per TAP, on tcx, and no filter.
        assert_eq!(state_counts(&a), (3, 0, 0));
        let taps = a.node_taps();
        assert_eq!(taps.len(), 3, "{taps:?}");
        wait_for("every pool TAP on its tcx link, warm-up filter gone", Duration::from_secs(20), || {
            let progs = a.topo.node.run({
                let t = taps.clone();
                move || t.iter().map(|n| cubevs::tcx_ingress_programs(n).unwrap()).collect::<Vec<_>>()
            });
            let filters: Vec<String> = taps
                .iter()
                .map(|t| {
                    let out = output(a.topo.node.command("tc").args(["filter", "show", "dev", t, "ingress"]));
                    String::from_utf8_lossy(&out.stdout).into_owned()
                })
                .filter(|f| f.contains("from_cube"))
                .collect();
            (progs.iter().all(|p| p == &vec!["from_cube".to_string()]) && filters.is_empty()).then(String::new)
        });
        let pins: Vec<String> = std::fs::read_dir(a.pin_dir().join("links"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(pins.iter().filter(|p| p.starts_with("from_cube_")).count(), 3, "{pins:?}");
        assert!(pins.iter().any(|p| p.starts_with("from_world_")), "uplink not attached: {pins:?}");
        assert!(pins.iter().any(|p| p.starts_with("from_envoy_")), "cube-dev not attached: {pins:?}");
        // cube-dev: gateway MAC, CIDR .1, route for the CIDR.
        let dev = a.topo.node.ip(&["-j", "addr", "show", "dev", "cube-dev"]);
        assert!(dev.contains("20:90:6f:cf:cf:cf") && dev.contains("192.168.0.1"), "{dev}");
        let route = a.topo.node.ip(&["route", "show", "192.168.0.0/24"]);
        assert!(route.contains("dev cube-dev"), "{route}");

        let rt = rt();
        let mut c = rt.block_on(client(&a));
        let r = rt.block_on(c.ensure_network(ensure_req("sb-a", &[80]))).expect("ensure").into_inner();
        assert_eq!(r.sandbox_id, "sb-a");
        assert_eq!(r.network_handle, "sb-a");
        let i = &r.interfaces[0];
        assert!(i.name.starts_with("z192.168.0."), "{i:?}");
        assert_eq!((i.mac_address.as_str(), i.gateway.as_str(), i.mtu), ("20:90:6f:fc:fc:fc", "169.254.68.5", 1500));
        assert_eq!(i.ip_cidrs, vec!["169.254.68.6/30"]);
        assert_eq!(r.routes[0].gateway, "169.254.68.5");
        assert_eq!(
            (r.arp_neighbors[0].ip.as_str(), r.arp_neighbors[0].mac_address.as_str()),
            ("169.254.68.5", "20:90:6f:cf:cf:cf")
        );
        let hp = r.port_mappings[0].host_port;
        assert!((20000..=29999).contains(&hp), "{hp}");
        for k in ["sandbox_ip", "host_tap_name", "mvm_inner_ip", "gateway_ip"] {
            assert!(r.persist_metadata.contains_key(k), "{k} missing: {:?}", r.persist_metadata);
        }
        assert_eq!(r.persist_metadata["host_tap_name"], i.name);
        assert_eq!(r.persist_metadata["gateway_ip"], "192.168.0.1");
        // Idempotent, and Get returns the same.
        let again = rt.block_on(c.ensure_network(ensure_req("sb-a", &[80]))).unwrap().into_inner();
        assert_eq!(again, r);
        let got = rt
            .block_on(c.get_network(pb::GetNetworkRequest { sandbox_id: "sb-a".into(), ..Default::default() }))
            .unwrap()
            .into_inner();
        assert_eq!(
            (got.interfaces.clone(), got.port_mappings.clone()),
            (r.interfaces.clone(), r.port_mappings.clone())
        );
        assert_eq!(tap_of(&a, &i.name)["state"], "Active");
        let v1 = serde_json::from_slice::<serde_json::Value>(
            &std::fs::read(a.state_dir().join("sb-a.success.json")).expect("success state file"),
        )
        .unwrap()["version"]
            .as_u64()
            .unwrap();

        // fd handoff → the TAP guest resolves its gateway through the datapath.
        let (reply, fd) = tap_fd(&a.tap_socket(), &i.name, "sb-a");
        assert_eq!(reply, serde_json::json!({"errCode": "0", "errMsg": "Success"}));
        let guest = TapGuest::new(fd.expect("fd with errCode 0"), VNET_HDR_LEN);
        guest.drain();
        assert_arp(&guest);

        // The CLI sees the same network, as JSON.
        let out = a
            .ns
            .exec(workspace_bin("cubenet-cli").to_str().unwrap(), &["--grpc", &a.grpc_endpoint(), "--json", "list"]);
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cli json");
        assert_eq!(j["networks"][0]["sandboxID"], "sb-a", "{j}");

        let pol = a.http_json("/v1/dataplane/policies");
        let mine =
            pol["policies"].as_array().unwrap().iter().find(|p| p["tapName"] == i.name.as_str()).unwrap().clone();
        assert_eq!(mine["policy"]["allow"], serde_json::json!(["198.51.100.0/24"]), "{mine}");
        assert_eq!(a.http_json("/v1/dataplane/portmaps")["portMappings"].as_array().unwrap().len(), 1);

        // Release: the TAP goes back to Ready, the handoff is refused.
        drop(guest);
        let rel = rt
            .block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "sb-a".into(), ..Default::default() }))
            .unwrap()
            .into_inner();
        assert!(rel.released);
        // Ready after the free check, which the Release leaves to the maintenance pass it wakes.
        wait_for("sb-a's TAP back in Ready", Duration::from_secs(5), || {
            (tap_of(&a, &i.name)["state"] == "Ready").then(String::new)
        });
        assert!(state_files(&a.state_dir()).is_empty());
        let (reply, fd) = tap_fd(&a.tap_socket(), &i.name, "sb-a");
        assert_eq!(reply["errCode"], "1002");
        assert!(fd.is_none());
        let e = rt
            .block_on(c.get_network(pb::GetNetworkRequest { sandbox_id: "sb-a".into(), ..Default::default() }))
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound);

        // Reuse: a new sandbox gets the same TAP, a newer version and none of the old state.
        let mut req = ensure_req("sb-b", &[]);
        req.cubevs_context = None;
        let r2 = rt.block_on(c.ensure_network(req)).unwrap().into_inner();
        assert_eq!(r2.interfaces[0].name, i.name, "first Ready TAP is reused");
        assert!(r2.port_mappings.is_empty());
        let v2 = serde_json::from_slice::<serde_json::Value>(
            &std::fs::read(a.state_dir().join("sb-b.success.json")).unwrap(),
        )
        .unwrap()["version"]
            .as_u64()
            .unwrap();
        assert!(v2 > v1, "version {v2} not newer than {v1}");
        let pm = a.http_json("/v1/dataplane/portmaps");
        assert_eq!(pm["portMappings"].as_array().unwrap().len(), 0, "old port mapping survived: {pm}");
        let pol = a.http_json("/v1/dataplane/policies");
        let mine =
            pol["policies"].as_array().unwrap().iter().find(|p| p["tapName"] == i.name.as_str()).unwrap().clone();
        assert_eq!(mine["policy"]["allow"], serde_json::json!([]), "old policy survived: {mine}");
        assert!(!mine["policy"]["deny"].as_array().unwrap().contains(&serde_json::json!("0.0.0.0/0")), "{mine}");
        // Reconcile with a new policy converges and replaces it.
        let rc = rt
            .block_on(c.reconcile_network(pb::ReconcileNetworkRequest {
                sandbox_id: "sb-b".into(),
                cubevs_context: Some(pb::CubeVsContext {
                    allow_internet_access: Some(true),
                    deny_out: vec!["203.0.113.0/24".into()],
                    ..Default::default()
                }),
                ..Default::default()
            }))
            .unwrap()
            .into_inner();
        assert!(rc.converged);
        assert_eq!(rc.interfaces, r2.interfaces);
        let pol = a.http_json("/v1/dataplane/policies");
        let mine =
            pol["policies"].as_array().unwrap().iter().find(|p| p["tapName"] == i.name.as_str()).unwrap().clone();
        assert!(mine["policy"]["deny"].as_array().unwrap().contains(&serde_json::json!("203.0.113.0/24")), "{mine}");
        let (reply, fd) = tap_fd(&a.tap_socket(), &i.name, "sb-b");
        assert_eq!(reply["errCode"], "0");
        let guest = TapGuest::new(fd.unwrap(), VNET_HDR_LEN);
        guest.drain();
        assert_arp(&guest);

        // SIGTERM: the agent exits, the TAPs and pins stay.
        let st = a.kill(nix::sys::signal::Signal::SIGTERM);
        assert!(st.success(), "{st}\n{}", a.log());
        assert_eq!(a.node_taps().len(), taps.len().max(a.node_taps().len()));
        assert!(a.node_taps().contains(&i.name));
        assert!(a.pin_dir().join("links").read_dir().unwrap().count() >= 3);
        assert_arp(&guest);
    }
    let left = leftover_namespaces();
    assert!(names.iter().all(|n| !left.contains(n)), "{left:?}");
}

#[test]
fn kill9_recovery_keeps_guest_and_state() {
    if !require_root("kill9_recovery_keeps_guest_and_state") {
        return;
    }
    let mut a = AgentUnderTest::prepare("kill9", 2, "");
    a.start();
    let rt = rt();
    let mut c = rt.block_on(client(&a));
    let r = rt.block_on(c.ensure_network(ensure_req("sb-live", &[8080]))).unwrap().into_inner();
    let r2 = rt.block_on(c.ensure_network(ensure_req("sb-idle", &[]))).unwrap().into_inner();
    let tap = r.interfaces[0].name.clone();
    let (_, fd) = tap_fd(&a.tap_socket(), &tap, "sb-live");
    let guest = TapGuest::new(fd.unwrap(), VNET_HDR_LEN);
    guest.drain();
    assert_arp(&guest);
    let ifindex_before = a.topo.node.run({
        let t = tap.clone();
        move || cubenet_sys::ifindex(&t).unwrap()
    });
    let get = |c: &mut NetworkAgentClient<Channel>, id: &str| {
        rt.block_on(c.get_network(pb::GetNetworkRequest { sandbox_id: id.into(), ..Default::default() }))
            .unwrap()
            .into_inner()
    };
    let before = get(&mut c, "sb-live");
    let before_idle = get(&mut c, "sb-idle");

    let st = a.kill(nix::sys::signal::Signal::SIGKILL);
    assert!(!st.success());
    // The guest keeps being answered while the agent is down (pinned datapath): no loss.
    let t = Instant::now();
    let mut answered = 0;
    while t.elapsed() < Duration::from_millis(500) {
        assert_arp(&guest);
        answered += 1;
    }
    assert!(answered > 5);

    a.child = Some(a.spawn_script());
    a.wait_ready(Duration::from_secs(30));
    let log = a.log();
    assert!(log.contains("adopted: 2"), "{log}");
    let mut c = rt.block_on(client(&a));
    assert_eq!(get(&mut c, "sb-live"), before);
    assert_eq!(get(&mut c, "sb-idle"), before_idle);
    let listed = rt.block_on(c.list_networks(pb::ListNetworksRequest {})).unwrap().into_inner();
    assert_eq!(listed.networks.len(), 2);
    // Same TAP, same ifindex, still held by the guest, still answered.
    let ifindex_after = a.topo.node.run({
        let t = tap.clone();
        move || cubenet_sys::ifindex(&t).unwrap()
    });
    assert_eq!(ifindex_before, ifindex_after);
    assert_eq!(tap_of(&a, &tap)["state"], "Active");
    assert_arp(&guest);
    // The in-use TAP was not reopened: a handoff for it must not steal the guest's queue
    // (the agent's own fd died with it; reopening a TAP a VMM holds is refused with -1).
    let (reply, fd) = tap_fd(&a.tap_socket(), &tap, "sb-live");
    assert_eq!(reply["errCode"], "-1", "{reply}");
    assert!(fd.is_none());
    assert_arp(&guest);
    // The idle sandbox's TAP (no VMM) is opened lazily and handed out.
    let (reply, fd) = tap_fd(&a.tap_socket(), &r2.interfaces[0].name, "sb-idle");
    assert_eq!(reply["errCode"], "0", "{reply}");
    assert!(fd.is_some());
    // Releases still work after recovery.
    drop(guest);
    for id in ["sb-live", "sb-idle"] {
        rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: id.into(), ..Default::default() }))
            .unwrap();
    }
    assert!(state_files(&a.state_dir()).is_empty(), "{:?}\n{}", state_files(&a.state_dir()), a.log());
}

#[test]
fn fifty_concurrent_ensures_and_releases_return_to_baseline() {
    if !require_root("fifty_concurrent_ensures_and_releases_return_to_baseline") {
        return;
    }
    const N: usize = 50;
    let mut a = AgentUnderTest::prepare("fifty", 4, "");
    a.start();
    let baseline_taps = a.node_taps();
    assert_eq!(baseline_taps.len(), 4);
    let rt = rt();

    // Ensure + fd latency at concurrency 1.
    let mut serial = Vec::new();
    let mut releases = Vec::new();
    {
        let mut c = rt.block_on(client(&a));
        for k in 0..10 {
            let id = format!("serial-{k}");
            let t = Instant::now();
            let r = rt
                .block_on(c.ensure_network(ensure_req(&id, &[80])))
                .unwrap_or_else(|e| {
                    panic!(
                        "ensure {id}: {e:?}\nstate dir: {:?}\n{}",
                        std::fs::read_dir(a.state_dir()).map(|d| d.count()),
                        a.log()
                    )
                })
                .into_inner();
            let (reply, fd) = tap_fd(&a.tap_socket(), &r.interfaces[0].name, &id);
            serial.push(t.elapsed());
            assert_eq!(reply["errCode"], "0");
            drop(fd);
            let t = Instant::now();
            rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: id, ..Default::default() })).unwrap();
            releases.push(t.elapsed());
        }
    }

    // 50 concurrent Ensure + fd.
    let endpoint = a.grpc_endpoint();
    let sock = a.tap_socket();
    let mt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    let results: Vec<(String, pb::EnsureNetworkResponse, Duration)> = mt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for k in 0..N {
            let (endpoint, sock) = (endpoint.clone(), sock.clone());
            set.spawn(async move {
                let id = format!("sb-{k:02}");
                let mut c = network_agent::client::connect(&endpoint).await.unwrap();
                let t = Instant::now();
                let r = c.ensure_network(ensure_req(&id, &[80])).await.unwrap().into_inner();
                let name = r.interfaces[0].name.clone();
                let i2 = id.clone();
                let (reply, fd) = tokio::task::spawn_blocking(move || tap_fd(&sock, &name, &i2)).await.unwrap();
                let took = t.elapsed();
                assert_eq!(reply["errCode"], "0", "{id}: {reply}");
                assert!(fd.is_some());
                (id, r, took)
            });
        }
        let mut v = Vec::new();
        while let Some(r) = set.join_next().await {
            v.push(r.expect("ensure task"));
        }
        v
    });
    assert_eq!(results.len(), N);
    let taps: BTreeSet<_> = results.iter().map(|(_, r, _)| r.interfaces[0].name.clone()).collect();
    let ports: BTreeSet<_> = results.iter().map(|(_, r, _)| r.port_mappings[0].host_port).collect();
    assert_eq!(taps.len(), N, "TAPs must be distinct");
    assert_eq!(ports.len(), N, "host ports must be distinct");
    assert_eq!(state_counts(&a).1, N as u64);
    assert_eq!(a.http_json("/v1/dataplane/portmaps")["portMappings"].as_array().unwrap().len(), N);
    assert_eq!(state_files(&a.state_dir()).len(), N);
    assert_eq!(a.http_json("/v1/dataplane/sandboxes")["sandboxes"].as_array().unwrap().len(), N);
    let mut conc: Vec<Duration> = results.iter().map(|r| r.2).collect();

    // Concurrent Ensures of one id make one network.
    let same: Vec<String> = mt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let endpoint = endpoint.clone();
            set.spawn(async move {
                let mut c = network_agent::client::connect(&endpoint).await.unwrap();
                c.ensure_network(ensure_req("sb-same", &[])).await.unwrap().into_inner().interfaces[0].name.clone()
            });
        }
        let mut v = Vec::new();
        while let Some(r) = set.join_next().await {
            v.push(r.unwrap());
        }
        v
    });
    assert!(same.iter().all(|n| n == &same[0]), "{same:?}");

    // 50 (+1) concurrent Releases.
    let ids: Vec<String> = results.iter().map(|r| r.0.clone()).chain(["sb-same".to_string()]).collect();
    mt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for id in ids {
            let endpoint = endpoint.clone();
            set.spawn(async move {
                let mut c = network_agent::client::connect(&endpoint).await.unwrap();
                let r = c
                    .release_network(pb::ReleaseNetworkRequest { sandbox_id: id.clone(), ..Default::default() })
                    .await
                    .unwrap()
                    .into_inner();
                assert!(r.released, "{id}");
            });
        }
        while let Some(r) = set.join_next().await {
            r.expect("release task");
        }
    });

    // Baseline: TAP count, map entries, host ports, state files.
    let t = Instant::now();
    loop {
        let (ready, active, cleaning) = state_counts(&a);
        if ready == 4 && active == 0 && cleaning == 0 && a.node_taps().len() == baseline_taps.len() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "not back to baseline: {:?} {:?}",
            state_counts(&a),
            a.node_taps()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(a.http_json("/v1/dataplane/portmaps")["portMappings"].as_array().unwrap().len(), 0);
    assert_eq!(a.http_json("/v1/dataplane/sandboxes")["sandboxes"].as_array().unwrap().len(), 0);
    assert_eq!(a.http_json("/v1/dataplane/sessions")["sessions"].as_array().unwrap().len(), 0);
    assert!(state_files(&a.state_dir()).is_empty());
    let metrics = a.http("/metrics").unwrap().1;
    assert!(metrics.contains("cubenet_ensure_total{result=\"ok\"} 68"), "{metrics}");
    let neigh = a.topo.node.ip(&["neigh", "show", "dev", "cube-dev"]);
    assert_eq!(neigh.lines().count(), 4, "{neigh}");

    eprintln!(
        "FIGURES: Ensure+fd at concurrency 1: p50 {:?} p99 {:?}; Release at concurrency 1: p50 {:?} p99 {:?}; \
         Ensure+fd at concurrency {N}: p50 {:?} p99 {:?}",
        percentile(&mut serial, 0.5),
        percentile(&mut serial, 0.99),
        percentile(&mut releases, 0.5),
        percentile(&mut releases, 0.99),
        percentile(&mut conc, 0.5),
        percentile(&mut conc, 0.99)
    );
}

/// What a VMM sees of a handed-out fd, as the README's TAP fd section says: a single-queue
/// TAP in TAP mode without packet info, with a 12-byte vnet header, CSUM/TSO offloads and the
/// configured MTU; the fd arrives blocking and shares its open file description with the
/// agent's queue fd (so a second request sees a flag the first fd's owner set); closing every
/// handed-out fd leaves the TAP to be handed out again.
fn vmm_view_of_the_fd(a: &AgentUnderTest, fd: std::os::fd::OwnedFd, tap: &str, sandbox: &str) {
    use std::os::fd::AsRawFd;
    const TUNGETIFF: libc::c_ulong = 0x8004_54d2;
    const TUNGETVNETHDRSZ: libc::c_ulong = 0x8004_54d7;
    const IFF_MULTI_QUEUE: i32 = 0x0100;
    let mut ifr = [0u8; 40];
    // SAFETY: TUNGETIFF fills a struct ifreq (40 bytes); TUNGETVNETHDRSZ an int.
    assert_eq!(unsafe { libc::ioctl(fd.as_raw_fd(), TUNGETIFF, ifr.as_mut_ptr()) }, 0, "TUNGETIFF");
    let name = String::from_utf8_lossy(&ifr[..16]).trim_end_matches('\0').to_string();
    let flags = i32::from(i16::from_ne_bytes([ifr[16], ifr[17]]));
    assert_eq!(name, tap);
    let want = i32::from(cubenet_sys::tap::IFF_TAP | cubenet_sys::tap::IFF_NO_PI | cubenet_sys::tap::IFF_VNET_HDR);
    assert_eq!(flags & want, want, "flags {flags:#x}");
    assert_eq!(flags & IFF_MULTI_QUEUE, 0, "flags {flags:#x}");
    let mut hdr: libc::c_int = 0;
    assert_eq!(unsafe { libc::ioctl(fd.as_raw_fd(), TUNGETVNETHDRSZ, &mut hdr) }, 0, "TUNGETVNETHDRSZ");
    assert_eq!(hdr as usize, VNET_HDR_LEN);
    let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    assert_eq!(fl & libc::O_NONBLOCK, 0, "the fd arrives blocking");
    // The VMM sets O_NONBLOCK (upstream's client does): the same open file description.
    assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) }, 0);
    let (reply, fd2) = tap_fd(&a.tap_socket(), tap, sandbox);
    assert_eq!(reply["errCode"], "0");
    let fd2 = fd2.expect("second fd");
    assert_ne!(unsafe { libc::fcntl(fd2.as_raw_fd(), libc::F_GETFL) } & libc::O_NONBLOCK, 0);
    assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl) }, 0);
    let k = a.topo.node.exec("ethtool", &["-k", tap]);
    let k = String::from_utf8_lossy(&k.stdout).into_owned();
    for f in ["tx-checksumming: on", "tcp-segmentation-offload: on"] {
        assert!(k.lines().any(|l| l.trim() == f), "{f} in {k}");
    }
    let link = a.topo.node.ip(&["link", "show", "dev", tap]);
    assert!(link.contains("mtu 1500 "), "{link}");
    drop((fd, fd2));
    let (reply, fd3) = tap_fd(&a.tap_socket(), tap, sandbox);
    assert_eq!(reply["errCode"], "0", "after the VMM closed its fds");
    assert!(fd3.is_some());
}

#[test]
fn fd_socket_bad_input_gets_error_codes_and_no_fd() {
    if !require_root("fd_socket_bad_input_gets_error_codes_and_no_fd") {
        return;
    }
    let mut a = AgentUnderTest::prepare("fdbad", 2, "");
    a.start();
    let rt = rt();
    let mut c = rt.block_on(client(&a));
    let r1 = rt.block_on(c.ensure_network(ensure_req("sb-1", &[]))).unwrap().into_inner();
    let r2 = rt.block_on(c.ensure_network(ensure_req("sb-2", &[]))).unwrap().into_inner();
    let sock = a.tap_socket();

    // A silent client does not block others.
    let silent = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let t = Instant::now();
    let (reply, fd) = tap_fd(&sock, &r1.interfaces[0].name, "sb-1");
    assert_eq!(reply["errCode"], "0");
    assert!(fd.is_some());
    // Causal, not timed: the silent client is still connected (a server taking clients one
    // at a time would have had to time it out, after 1 s, before answering this one).
    silent.set_nonblocking(true).unwrap();
    let still = std::io::Read::read(&mut &silent, &mut [0u8; 1]);
    assert!(
        matches!(&still, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "blocked behind a silent client ({:?}): it was {still:?}",
        t.elapsed()
    );
    drop(silent);
    vmm_view_of_the_fd(&a, fd.unwrap(), &r1.interfaces[0].name, "sb-1");

    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), "1001"),
        (b"[]".to_vec(), "1001"),
        (format!("{{\"name\":\"{}\",\"sandboxId\":\"{}\"}}", "x".repeat(8000), "sb-1").into_bytes(), "1001"),
        (br#"{"name":"z192.168.0.250","sandboxId":"sb-1"}"#.to_vec(), "1002"),
        (format!(r#"{{"name":"{}","sandboxId":"nobody"}}"#, r1.interfaces[0].name).into_bytes(), "1002"),
        // Another sandbox's TAP.
        (format!(r#"{{"name":"{}","sandboxId":"sb-1"}}"#, r2.interfaces[0].name).into_bytes(), "1002"),
    ];
    for (req, code) in cases {
        let (reply, fd) = request_tap_fd(&sock, &req);
        assert_eq!(reply["errCode"], code, "request {:?}", String::from_utf8_lossy(&req[..req.len().min(80)]));
        assert!(reply["errCode"].is_string());
        assert!(fd.is_none(), "an fd came with errCode {code}");
    }
    let m = a.http("/metrics").unwrap().1;
    assert!(m.contains("cubenet_fd_handoffs_total{err_code=\"1002\"} 3"), "{m}");
}

#[test]
fn grpc_validation_and_health() {
    if !require_root("grpc_validation_and_health") {
        return;
    }
    let mut a = AgentUnderTest::prepare("grpcbad", 1, "");
    a.start();
    let rt = rt();
    let mut c = rt.block_on(client(&a));
    let cases: Vec<(pb::EnsureNetworkRequest, &str)> = vec![
        (ensure_req("", &[]), "sandbox_id"),
        (ensure_req("../x", &[]), "sandbox_id"),
        (ensure_req("ok", &[0]), "port_mappings[0].container_port"),
        (ensure_req("ok", &[70000]), "port_mappings[0].container_port"),
        (
            pb::EnsureNetworkRequest {
                port_mappings: vec![pb::PortMapping {
                    protocol: "sctp".into(),
                    container_port: 1,
                    ..Default::default()
                }],
                ..ensure_req("ok", &[])
            },
            "port_mappings[0].protocol",
        ),
        (
            pb::EnsureNetworkRequest {
                port_mappings: vec![pb::PortMapping {
                    protocol: "tcp".into(),
                    container_port: 1,
                    host_port: 80,
                    ..Default::default()
                }],
                ..ensure_req("ok", &[])
            },
            "port_mappings[0].host_port",
        ),
        (
            pb::EnsureNetworkRequest {
                cubevs_context: Some(pb::CubeVsContext {
                    allow_out: vec!["10.0.0.0/8".into(), "bogus".into()],
                    ..Default::default()
                }),
                ..ensure_req("ok", &[])
            },
            "cubevs_context.allow_out[1]",
        ),
        // O23: one guest port to two host ports (was INTERNAL after a TAP was taken), and one
        // host port for TCP and UDP.
        (pm_req(&[("tcp", 8080, 20700), ("tcp", 8080, 20701)]), "port_mappings[1].container_port"),
        (pm_req(&[("tcp", 53, 20702), ("udp", 53, 20702)]), "port_mappings[1].host_port"),
        // O25: persist_metadata is bounded (64 KiB of keys and values).
        (
            pb::EnsureNetworkRequest {
                persist_metadata: [("blob".to_string(), "x".repeat(70_000))].into(),
                ..ensure_req("ok", &[])
            },
            "persist_metadata",
        ),
    ];
    for (req, field) in cases {
        let e = rt.block_on(c.ensure_network(req)).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{field}: {e:?}");
        assert!(e.message().contains(field), "{field} not named in {:?}", e.message());
    }
    // Nothing was left behind by the rejected calls.
    assert_eq!(state_counts(&a), (1, 0, 0));
    assert!(state_files(&a.state_dir()).is_empty());
    let e = rt
        .block_on(c.get_network(pb::GetNetworkRequest { sandbox_id: "ghost".into(), ..Default::default() }))
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = rt
        .block_on(c.reconcile_network(pb::ReconcileNetworkRequest { sandbox_id: "ghost".into(), ..Default::default() }))
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let r =
        rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "ghost".into(), ..Default::default() }));
    assert!(r.unwrap().into_inner().released);
    let h = rt.block_on(c.health(pb::HealthRequest::default())).unwrap().into_inner();
    assert!(h.ok, "{h:?}");
    // O23: identical mappings (grpcio/grpc-go send what the caller listed) are one mapping.
    let r = rt
        .block_on(c.ensure_network(pm_req(&[("tcp", 8080, 0), ("", 8080, 0), ("udp", 8080, 0)])))
        .unwrap()
        .into_inner();
    let got: Vec<_> = r.port_mappings.iter().map(|m| (m.protocol.as_str(), m.container_port)).collect();
    assert_eq!(got, vec![("tcp", 8080), ("udp", 8080)], "{r:?}");
    assert!(
        rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "ok".into(), ..Default::default() }))
            .unwrap()
            .into_inner()
            .released
    );
    // grpc.health.v1 reports SERVING for "".
    let ch = rt.block_on(async {
        let c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        drop(c);
        tonic::transport::Endpoint::try_from("http://agent.invalid")
            .unwrap()
            .connect_with_connector(tower_connector(a.dir.join("cube/grpc.sock")))
            .await
            .unwrap()
    });
    let mut hc = tonic_health::pb::health_client::HealthClient::new(ch);
    let s =
        rt.block_on(hc.check(tonic_health::pb::HealthCheckRequest { service: String::new() })).unwrap().into_inner();
    assert_eq!(s.status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    // Loopback-only endpoints, 405 on other methods, readiness.
    assert_eq!(a.http("/healthz").unwrap(), (200, "ok".to_string()));
    assert_eq!(a.http("/readyz").unwrap(), (200, "ready".to_string()));
}

fn tower_connector(
    path: std::path::PathBuf,
) -> impl tower_service::Service<
    tonic::transport::Uri,
    Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone {
    tower::service_fn(move |_| {
        let p = path.clone();
        async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
    })
}

#[test]
fn invalid_config_and_conflicting_state_refuse_to_start() {
    if !require_root("invalid_config_and_conflicting_state_refuse_to_start") {
        return;
    }
    // An invalid key: the script exits non-zero and the message names the key.
    let a = AgentUnderTest::prepare("badcfg", 1, "mtu = 10\n");
    let mut child = a.spawn_script();
    let st = child.child().wait().unwrap();
    assert!(!st.success());
    // --print-config failed before the log redirect: the reason went to stderr; re-run to see it.
    let out = std::process::Command::new(workspace_bin("network-agent"))
        .args(["--config", a.dir.join("agent.toml").to_str().unwrap(), "--check-config"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`mtu`"), "{out:?}");
    drop(a);

    // Two state records claiming one TAP: recovery refuses with a clear message.
    let mut a = AgentUnderTest::prepare("conflict", 1, "");
    for id in ["sb-x", "sb-y"] {
        let rec = serde_json::json!({
            "sandbox_id": id, "tap_name": "z192.168.0.9", "tap_ifindex": 99, "sandbox_ip": "192.168.0.9",
            "version": 1, "port_mappings": [], "policy": {"allow_internet_access": true, "allow_out": [], "deny_out": []},
            "persist_metadata": {}
        });
        std::fs::write(a.state_dir().join(format!("{id}.success.json")), rec.to_string()).unwrap();
    }
    let mut child = a.spawn_script();
    let st = child.child().wait().unwrap();
    assert!(!st.success());
    assert!(a.log().contains("conflicting identity"), "{}", a.log());
    a.child = None;
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<String>) -> String {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t.elapsed() < timeout, "{what} not seen within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn grpc_health(rt: &tokio::runtime::Runtime, a: &AgentUnderTest) -> i32 {
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::try_from("http://agent.invalid")
            .unwrap()
            .connect_with_connector(tower_connector(a.dir.join("cube/grpc.sock")))
            .await
            .unwrap();
        let mut hc = tonic_health::pb::health_client::HealthClient::new(ch);
        hc.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.unwrap().into_inner().status
    })
}

/// Issue 10 item 11: a Release that arrives while the VMM still holds the TAP fd must not put
/// the TAP back in the pool; it stays Cleaning (scrubbed, ownerless) until the fd is closed.
#[test]
fn released_tap_held_by_a_vmm_is_not_reused_until_closed() {
    if !require_root("released_tap_held_by_a_vmm_is_not_reused_until_closed") {
        return;
    }
    let mut a = AgentUnderTest::prepare("held", 1, "");
    a.start();
    let rt = rt();
    let mut c = rt.block_on(client(&a));
    let r = rt.block_on(c.ensure_network(ensure_req("sb-held", &[8080]))).unwrap().into_inner();
    let tap = r.interfaces[0].name.clone();
    // The VMM's fd, received over the fd socket exactly as the VMM gets it.
    let (reply, vmm_fd) = tap_fd(&a.tap_socket(), &tap, "sb-held");
    assert_eq!(reply["errCode"], "0");
    let vmm_fd = vmm_fd.unwrap();
    let rel = rt
        .block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "sb-held".into(), ..Default::default() }))
        .unwrap()
        .into_inner();
    assert!(rel.released);
    // Scrubbed right away (no registration, no port map, no state), but not reusable.
    let t = tap_of(&a, &tap);
    assert_eq!(t["state"], "Cleaning", "{t}");
    // The free check runs in the maintenance pass the Release wakes, and finds the VMM.
    wait_for("the free check finding the VMM", Duration::from_secs(5), || {
        let t = tap_of(&a, &tap);
        assert_eq!(t["state"], "Cleaning", "{t}");
        t["lastError"].as_str().unwrap().contains("held by another process").then(String::new)
    });
    assert_eq!(a.http_json("/v1/dataplane/portmaps")["portMappings"].as_array().unwrap().len(), 0);
    assert!(!a.http_json("/v1/dataplane/sandboxes").to_string().contains("sb-held"));
    assert!(state_files(&a.state_dir()).is_empty(), "{:?}", state_files(&a.state_dir()));
    // Maintenance passes (every second here) keep it out of the pool while the fd is open,
    // and the next Ensures get other TAPs.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(tap_of(&a, &tap)["state"], "Cleaning");
    for id in ["sb-next-1", "sb-next-2"] {
        let n = rt.block_on(c.ensure_network(ensure_req(id, &[]))).unwrap().into_inner();
        assert_ne!(n.interfaces[0].name, tap, "{id} got the TAP a VMM still holds");
    }
    // The same id can be ensured again: its old network is gone.
    let again = rt.block_on(c.ensure_network(ensure_req("sb-held", &[]))).unwrap().into_inner();
    assert_ne!(again.interfaces[0].name, tap);
    // The VMM exits: the TAP returns to Ready.
    drop(vmm_fd);
    wait_for("the closed TAP back in Ready", Duration::from_secs(10), || {
        (tap_of(&a, &tap)["state"] == "Ready").then(String::new)
    });
    assert_eq!(tap_of(&a, &tap)["lastError"], "");
}

/// Issue 10 item 12: Release writes its durable intent before it forgets anything; when the
/// state store cannot write, the sandbox stays Active and whole, and a retry works.
#[test]
fn release_keeps_the_sandbox_when_its_intent_cannot_be_written() {
    if !require_root("release_keeps_the_sandbox_when_its_intent_cannot_be_written") {
        return;
    }
    let mut a = AgentUnderTest::prepare("intent", 1, "");
    a.start();
    let rt = rt();
    let mut c = rt.block_on(client(&a));
    let r = rt.block_on(c.ensure_network(ensure_req("sb-s", &[80]))).unwrap().into_inner();
    let tap = r.interfaces[0].name.clone();
    // Release records its intent by renaming `sb-s.success.json` to `sb-s.deleting.json`
    // (decision R5); a non-empty directory squatting on the target makes that rename fail.
    let squat = a.state_dir().join("sb-s.deleting.json");
    std::fs::create_dir(&squat).unwrap();
    std::fs::write(squat.join("x"), b"x").unwrap();
    let release = |c: &mut NetworkAgentClient<Channel>| {
        rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "sb-s".into(), ..Default::default() }))
    };
    let e = release(&mut c).unwrap_err();
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    let got = rt
        .block_on(c.get_network(pb::GetNetworkRequest { sandbox_id: "sb-s".into(), ..Default::default() }))
        .expect("the sandbox is still there")
        .into_inner();
    assert_eq!(got.port_mappings, r.port_mappings);
    assert_eq!(tap_of(&a, &tap)["state"], "Active");
    assert_eq!(a.http_json("/v1/dataplane/portmaps")["portMappings"].as_array().unwrap().len(), 1);
    assert!(a.http_json("/v1/dataplane/sandboxes").to_string().contains("sb-s"));
    assert!(a.state_dir().join("sb-s.success.json").exists());
    // The store works again: the retry releases for real.
    std::fs::remove_dir_all(&squat).unwrap();
    assert!(release(&mut c).unwrap().into_inner().released);
    wait_for("the released TAP back in Ready", Duration::from_secs(5), || {
        (tap_of(&a, &tap)["state"] == "Ready").then(String::new)
    });
    assert!(state_files(&a.state_dir()).is_empty(), "{:?}", state_files(&a.state_dir()));
    assert_eq!(a.http_json("/v1/dataplane/portmaps")["portMappings"].as_array().unwrap().len(), 0);
}

/// Issue 10 item 20: readiness says whether an Ensure can succeed now. With no Ready TAP and
/// TAP creation failing (here: cube-dev deleted under the agent), `/readyz` is 503 with the
/// reason and both health services say not serving; a TAP back in Ready makes it ready again.
#[test]
fn readiness_follows_whether_an_ensure_can_succeed() {
    if !require_root("readiness_follows_whether_an_ensure_can_succeed") {
        return;
    }
    let mut a = AgentUnderTest::prepare("readiness", 1, "");
    a.start();
    let rt = rt();
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    assert_eq!(a.http("/readyz").unwrap(), (200, "ready".to_string()));
    wait_for("grpc health SERVING", Duration::from_secs(5), || (grpc_health(&rt, &a) == serving).then(String::new));
    let mut c = rt.block_on(client(&a));
    a.topo.node.ip(&["link", "del", "cube-dev"]);
    // The only Ready TAP is taken; the pool tries to refill and cannot.
    rt.block_on(c.ensure_network(ensure_req("sb-1", &[]))).unwrap();
    let body = wait_for("/readyz 503", Duration::from_secs(15), || match a.http("/readyz") {
        Some((503, b)) => Some(b),
        _ => None,
    });
    assert!(body.contains("no Ready TAP and the pool cannot refill") && body.contains("cube-dev"), "{body}");
    wait_for("grpc health NOT_SERVING", Duration::from_secs(5), || {
        (grpc_health(&rt, &a) == not_serving).then(String::new)
    });
    let h = rt.block_on(c.health(pb::HealthRequest::default())).unwrap().into_inner();
    assert!(!h.ok && h.status.contains("cannot refill"), "{h:?}");
    // Readiness told the truth: an Ensure fails now.
    assert!(rt.block_on(c.ensure_network(ensure_req("sb-2", &[]))).is_err());
    // A Release returns a TAP to Ready: an Ensure can succeed again.
    rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "sb-1".into(), ..Default::default() }))
        .unwrap();
    wait_for("/readyz 200", Duration::from_secs(10), || {
        (a.http("/readyz").map(|r| r.0) == Some(200)).then(String::new)
    });
    wait_for("grpc health SERVING again", Duration::from_secs(5), || {
        (grpc_health(&rt, &a) == serving).then(String::new)
    });
    assert!(rt.block_on(c.health(pb::HealthRequest::default())).unwrap().into_inner().ok);
}

/// `tc_attach = "legacy"` (decision F4): every pool TAP gets exactly one `from_cube` filter on a
/// clsact ingress and no tcx program; an Ensure/Release cycle and a kill -9 restart (recovery
/// re-attaches every TAP) leave exactly one filter per TAP, never a duplicate. A restart with
/// the default `auto` then moves every TAP, Active ones included, to a tcx link (F5).
#[test]
fn legacy_tc_attach_puts_one_filter_on_each_tap() {
    if !require_root("legacy_tc_attach_puts_one_filter_on_each_tap") {
        return;
    }
    let mut a = AgentUnderTest::prepare("legacy", 2, "tc_attach = \"legacy\"\n");
    a.start();
    let filters = |a: &AgentUnderTest| -> Vec<(String, usize, Vec<String>)> {
        a.node_taps()
            .into_iter()
            .map(|t| {
                let out = output(a.topo.node.command("tc").args(["filter", "show", "dev", &t, "ingress"]));
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                let n = text.lines().filter(|l| l.contains("from_cube") && l.contains("direct-action")).count();
                let tcx = a.topo.node.run({
                    let t = t.clone();
                    move || cubevs::tcx_ingress_programs(&t).unwrap_or_default()
                });
                (t, n, tcx)
            })
            .collect()
    };
    let check = |a: &AgentUnderTest, what: &str| {
        let f = filters(a);
        assert!(!f.is_empty(), "{what}: no TAPs");
        assert!(f.iter().all(|(_, n, tcx)| *n == 1 && tcx.is_empty()), "{what}: {f:?}");
    };
    check(&a, "warm pool");
    let rt = rt();
    let mut c = rt.block_on(client(&a));
    let r = rt.block_on(c.ensure_network(ensure_req("sb-l", &[]))).expect("ensure").into_inner();
    let (reply, fd) = tap_fd(&a.tap_socket(), &r.interfaces[0].name, "sb-l");
    assert_eq!(reply["errCode"], "0", "{reply}");
    drop(fd);
    rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "sb-l".into(), ..Default::default() }))
        .expect("release");
    // The refill made a third TAP while the released one was cleaned; the trim retires one
    // from the pool before it detaches and deletes it: wait until the node holds only the 2.
    wait_for("the pool back to 2 Ready and 2 TAPs on the node", Duration::from_secs(10), || {
        (state_counts(&a) == (2, 0, 0) && a.node_taps().len() == 2).then(String::new)
    });
    check(&a, "after Ensure/Release");
    a.kill(nix::sys::signal::Signal::SIGKILL);
    a.start();
    assert_eq!(state_counts(&a), (2, 0, 0));
    check(&a, "after a kill -9 restart");

    // The same node restarted with the default (`auto`, F5): recovery queues every adopted
    // TAP, the Active one included, and the maintenance loop puts each on its tcx link and
    // removes its filter.
    let mut c = rt.block_on(client(&a));
    rt.block_on(c.ensure_network(ensure_req("sb-m", &[]))).expect("ensure");
    a.kill(nix::sys::signal::Signal::SIGKILL);
    let cfg_path = a.dir.join("agent.toml");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap().replace("tc_attach = \"legacy\"\n", "");
    std::fs::write(&cfg_path, cfg).unwrap();
    a.start();
    assert_eq!(state_counts(&a).1, 1, "sb-m adopted Active");
    wait_for("every TAP on its tcx link, no filter, after the switch to auto", Duration::from_secs(20), || {
        let f = filters(&a);
        (f.len() == 3 && f.iter().all(|(_, n, tcx)| *n == 0 && tcx == &vec!["from_cube".to_string()])).then(String::new)
    });
}
