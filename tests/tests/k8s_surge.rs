//! A surge upgrade of the CubeNode pod under podman (root; prints `SKIPPED:` without podman,
//! buildah or the k8s venv), decision K15: what the DaemonSet controller does with the chart's
//! default underlay strategy (maxSurge 1, maxUnavailable 0), pod by pod.
//!
//! 1. Pod A (the chart rendered in underlay mode onto a test topology's node namespace, as in
//!    `k8s_pod.rs`) serves; a sandbox is Ensured over A's gRPC socket and its TAP fd carried by
//!    a frame relay into a guest namespace with a kernel stack (`KernelGuest`, the VMM's role).
//!    The sandbox has an L7 rule: its port-80 flows to `api.surge.test` go through CubeEgress
//!    (datapath mark → TPROXY → the gateway in the node namespace).
//! 2. Running for the whole drill: a TCP stream from the guest to a world echo server (4 KiB
//!    every 20 ms, every byte checked), a keep-alive HTTP/1.1 client in the guest through
//!    CubeEgress (one GET every 50 ms, reconnecting only when asked to), and a cubelet loop
//!    (TAP fd requests for the sandbox, GetNetwork, and a new Ensure each round).
//! 3. Pod B of the upgraded release (new image tags, a changed value) starts beside A in a
//!    network namespace of its own: its agent takes A's listeners and TAP fds over through the
//!    hand-over socket on the shared host path and serves health in B's namespace; its first
//!    CubeEgress slot takes A's gateway over (listeners and state); A's agent container stands
//!    down (answers /healthz only, not ready), A's gateway slot parks.
//! 4. Attack: the kubelet restarts A's agent container and a gateway slot of A (a liveness
//!    failure, a crash): A's agent stands down again at once and its slot parks; B never
//!    hands anything back (no ping-pong).
//! 5. Pod A is stopped as the kubelet does when the controller deletes it (SIGTERM, grace
//!    period), then removed.
//!
//! Asserted: the stream saw every byte and no error, the keep-alive client no failed request
//! (reconnects only on `Connection: close`), the cubelet loop no failure — including TAP fd
//! requests for the sandbox whose TAP the relay holds, answered by B after the hand-over (the
//! restart limit of K14 is gone) —, B ready in its own namespace, the gateway, the capture
//! rules and the agent still serving after A is gone.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::tap_fd,
    agent_upgrade::KernelGuest,
    bpffs::BpfFs,
    l7::World,
    netns::TestNetns,
    pod::{
        KeepAlive, PodGuard, build_images, drill_prerequisites, exec_wget, logs, podman, podman_ok, render_pod,
        retag_newer, wait_value,
    },
    topology::{Topology, WORLD_IP},
};

const T: &str = "cube_node_surge_upgrade_hands_over_agent_and_gateway";
/// The name the sandbox reaches through CubeEgress.
const API: &str = "api.surge.test";
const API_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const ECHO_PORT: u16 = 9000;
const CHUNK: usize = 4096;

/// A TCP stream from the guest to a world echo server: CHUNK bytes of a running pattern every
/// 20 ms, each echo checked; counts bytes, records the first error.
struct Stream {
    stop: Arc<AtomicBool>,
    echoed: Arc<AtomicU64>,
    client: std::thread::JoinHandle<Result<u64, String>>,
}

fn start_stream(topo: &Topology, guest: &TestNetns) -> Stream {
    let addr = SocketAddrV4::new(Ipv4Addr::from(WORLD_IP), ECHO_PORT);
    let l = topo.world.run(move || TcpListener::bind(addr).unwrap());
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = l.accept() {
            let mut buf = vec![0u8; 65536];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 || s.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let echoed = Arc::new(AtomicU64::new(0));
    let (st, ec) = (stop.clone(), echoed.clone());
    let client = guest.spawn_thread(move || {
        let mut s =
            TcpStream::connect_timeout(&SocketAddr::V4(addr), Duration::from_secs(10)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut sent = 0u64;
        let (mut out, mut back) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
        while !st.load(Ordering::Relaxed) {
            for (i, b) in out.iter_mut().enumerate() {
                *b = ((sent + i as u64) % 251) as u8;
            }
            s.write_all(&out).map_err(|e| format!("write after {sent} bytes: {e}"))?;
            s.read_exact(&mut back).map_err(|e| format!("read after {sent} bytes: {e}"))?;
            if back != out {
                return Err(format!("echo differs after {sent} bytes"));
            }
            sent += CHUNK as u64;
            ec.store(sent, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(sent)
    });
    Stream { stop, echoed, client }
}

/// The sandbox's context: the world address (DNS, echo server) allowed, `API` by DNS learning
/// on port 80, and an L7 rule allowing it (its port-80 flows go through CubeEgress).
fn context() -> pb::CubeVsContext {
    pb::CubeVsContext {
        allow_internet_access: Some(false),
        allow_out: vec![format!("{}/32", Ipv4Addr::from(WORLD_IP))],
        allow_fqdn: vec![pb::FqdnAllow { name: API.into(), ports: vec![80] }],
        rules: vec![pb::EgressRule {
            id: "api".into(),
            r#match: Some(pb::EgressMatch { host: Some(API.into()), ..Default::default() }),
            action: Some(pb::EgressAction { allow: true, ..Default::default() }),
        }],
        ..Default::default()
    }
}

/// What the cubelet loop saw.
#[derive(Debug, Default)]
struct Cubelet {
    rounds: u64,
    fds: u64,
    ensures: u64,
    failures: Vec<String>,
}

#[test]
fn cube_node_surge_upgrade_hands_over_agent_and_gateway() {
    let Some(py) = drill_prerequisites(T) else { return };

    // Images (cached by their inputs digest), and the "upgrade": new tags of both.
    let (agent_ref, egress_ref) = build_images();
    let (repo_a, tag) = agent_ref.rsplit_once(':').unwrap();
    let (repo_e, _) = egress_ref.rsplit_once(':').unwrap();
    let new_tag = format!("{tag}-surge");
    retag_newer(&agent_ref, &format!("{repo_a}:{new_tag}"), "io.cubenet.drill=surge");
    retag_newer(&egress_ref, &format!("{repo_e}:{new_tag}"), "io.cubenet.drill=surge");
    struct Images(Vec<String>);
    impl Drop for Images {
        fn drop(&mut self) {
            for i in &self.0 {
                let _ = podman(&["rmi", "--force", i]);
            }
        }
    }
    let _images = Images(vec![format!("{repo_a}:{new_tag}"), format!("{repo_e}:{new_tag}")]);

    // Topology (world: DNS + HTTP for API, the echo server), host paths, the two renders.
    let topo = Topology::new();
    topo.add_world_address(API_IP.octets(), 24);
    let world = World::start(&topo.world, Ipv4Addr::from(WORLD_IP), &[(API, API_IP)], &[API_IP]).expect("world");
    let bpffs = BpfFs::new();
    let dir = std::env::temp_dir().join(format!("cubenet-k8s-surge-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for d in ["cube", "state", "log", "modules", "handover"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    let _dir_guard = cubenet_tests::TmpDir(dir.clone());
    let values = |tag: &str, warm: u32| {
        serde_json::json!({
            "mode": "underlay",
            "cidr": "192.168.0.0/24",
            "underlay": {"netnsPath": topo.node.path().to_str().unwrap()},
            "images": {
                "networkAgent": {"repository": repo_a, "tag": tag, "pullPolicy": "Never"},
                "cubeEgress": {"repository": repo_e, "tag": tag, "pullPolicy": "Never"},
            },
            "agent": {"tapInitNum": 2, "warmParallelism": warm},
            "hostPaths": {
                "socketDir": dir.join("cube"),
                "bpffs": bpffs.path(),
                "stateDir": dir.join("state"),
                "logDir": dir.join("log"),
                "modules": dir.join("modules"),
                "handoverDir": dir.join("handover"),
            },
        })
    };
    let pod_a = render_pod(&py, &dir.join("render-a"), &values(tag, 4), "cubenet-a");
    let pod_b = render_pod(&py, &dir.join("render-b"), &values(&new_tag, 2), "cubenet-b");
    let a_yaml = std::fs::read_to_string(&pod_a).unwrap();
    assert!(a_yaml.contains("CUBENET_POD_UID") && a_yaml.contains("CUBE_EGRESS_HANDOFF_SOCKET"), "{a_yaml}");

    // 1. Pod A.
    for p in ["cubenet-a", "cubenet-b"] {
        let _ = podman(&["pod", "rm", "--force", p]);
    }
    let guard_a = PodGuard("cubenet-a".into());
    podman_ok(&["kube", "play", "--network", "none", pod_a.to_str().unwrap()]);
    let agent_a = "cubenet-a-network-agent";
    wait_value("pod A agent /readyz", Duration::from_secs(120), || {
        exec_wget(agent_a, "http://127.0.0.1:19090/readyz", false).filter(|b| b.contains("ready"))
    });
    let gw_health = |c: &str| exec_wget(c, "http://127.0.0.1:9091/admin/v1/health", true);
    wait_value("pod A's CubeEgress bootstrapped", Duration::from_secs(90), || {
        gw_health("cubenet-a-cube-egress").filter(|h| h.contains("\"bootstrap_status\":\"ready\""))
    });
    wait_value("TPROXY chain in the node namespace", Duration::from_secs(60), || {
        let s = topo.node.exec("iptables", &["-t", "mangle", "-S", "TRANSPROXY"]);
        let s = String::from_utf8_lossy(&s.stdout).into_owned();
        s.contains("TPROXY").then_some(s)
    });
    eprintln!("[k8s-surge] pod A serving");

    // The sandbox, as cubelet and the VMM.
    let grpc = format!("unix://{}", dir.join("cube/network-agent-grpc.sock").display());
    let tap_sock = dir.join("cube/network-agent-tap.sock");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let r = rt.block_on(async {
        let mut c = network_agent::client::connect(&grpc).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: "sb-surge".into(),
            cubevs_context: Some(context()),
            ..Default::default()
        })
        .await
        .expect("ensure")
        .into_inner()
    });
    let ifc = r.interfaces[0].clone();
    let (reply, fd) = tap_fd(&tap_sock, &ifc.name, "sb-surge");
    assert_eq!(reply["errCode"], "0", "{reply}");
    let guest = KernelGuest::new(fd.expect("TAP fd"), &ifc.mac_address, &ifc.ip_cidrs[0], &ifc.gateway, ifc.mtu as u32);
    let g = &guest.ns;
    // DNS through the datapath: the answer is learned and fed to the gateway.
    let o = g.exec("busybox", &["nslookup", "-type=a", API, &Ipv4Addr::from(WORLD_IP).to_string()]);
    assert!(String::from_utf8_lossy(&o.stdout).contains(&API_IP.to_string()), "nslookup: {o:?}");
    wait_value("an L7 request through pod A's CubeEgress", Duration::from_secs(30), || {
        let o = g.exec(
            "curl",
            &["-s", "--max-time", "5", "--resolve", &format!("{API}:80:{API_IP}"), &format!("http://{API}/probe")],
        );
        let b = String::from_utf8_lossy(&o.stdout).into_owned();
        b.contains("/probe").then_some(b)
    });
    let sandbox_ip: Ipv4Addr = r.persist_metadata["sandbox_ip"].parse().unwrap();
    let probes = world.requests_to("/probe");
    assert!(
        !probes.is_empty() && probes.iter().all(|p| p.peer.ip() != sandbox_ip),
        "the L7 requests come from the gateway's upstream leg, not the sandbox: {probes:?}"
    );

    // 2. Load for the whole drill.
    let stream = start_stream(&topo, g);
    let ka = KeepAlive::start(g, SocketAddr::from((API_IP, 80)), API, "ka", Duration::from_millis(50));
    let stop = Arc::new(AtomicBool::new(false));
    let cubelet = Arc::new(Mutex::new(Cubelet::default()));
    let loop_handle = {
        let (stop, cubelet, grpc, tap_sock, tap) =
            (stop.clone(), cubelet.clone(), grpc.clone(), tap_sock.clone(), ifc.name.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                // The helper panics on a reset or a refused connect: a failure here, not a crash.
                let (reply, ok_fd) = match std::panic::catch_unwind(|| tap_fd(&tap_sock, &tap, "sb-surge")) {
                    Ok((reply, fd)) => {
                        let ok = reply["errCode"] == "0" && fd.is_some();
                        (reply, ok)
                    }
                    Err(e) => (serde_json::json!(format!("{:?}", e.downcast_ref::<String>())), false),
                };
                let res: Result<(), String> = rt.block_on(async {
                    let mut c = network_agent::client::connect(&grpc).await.map_err(|e| format!("connect: {e}"))?;
                    c.get_network(pb::GetNetworkRequest { sandbox_id: "sb-surge".into(), ..Default::default() })
                        .await
                        .map_err(|e| format!("GetNetwork: {e}"))?;
                    if n.is_multiple_of(4) {
                        c.ensure_network(pb::EnsureNetworkRequest {
                            sandbox_id: format!("sb-w-{n}"),
                            ..Default::default()
                        })
                        .await
                        .map_err(|e| format!("Ensure sb-w-{n}: {e}"))?;
                    }
                    Ok(())
                });
                let mut cl = cubelet.lock().unwrap();
                cl.rounds += 1;
                if ok_fd {
                    cl.fds += 1;
                } else {
                    cl.failures.push(format!("round {n}: TAP fd: {reply}"));
                }
                match res {
                    Ok(()) => cl.ensures += u64::from(n.is_multiple_of(4)),
                    Err(e) => cl.failures.push(format!("round {n}: {e}")),
                }
                drop(cl);
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    };
    std::thread::sleep(Duration::from_secs(2));

    // 3. Pod B beside A.
    let t_b = Instant::now();
    let guard_b = PodGuard("cubenet-b".into());
    podman_ok(&["kube", "play", "--network", "none", pod_b.to_str().unwrap()]);
    let agent_b = "cubenet-b-network-agent";
    // B's health is served in B's own namespace (not the socket of A's namespace, K16).
    wait_value("pod B agent /readyz in B's namespace", Duration::from_secs(180), || {
        exec_wget(agent_b, "http://127.0.0.1:19090/readyz", false).filter(|b| b.contains("ready"))
    });
    let log_b = logs(agent_b);
    assert!(log_b.contains("received listeners and TAP fds from the running agent"), "B did not take over:\n{log_b}");
    assert!(log_b.contains("bound afresh here"), "B must bind health in its own namespace:\n{log_b}");
    let stood = wait_value("pod A's agent stands down", Duration::from_secs(60), || {
        let l = logs(agent_a);
        l.contains("standing down: the agent handed the node over").then_some(l)
    });
    let healthz_a = wait_value("pod A answers /healthz while stood down", Duration::from_secs(30), || {
        exec_wget(agent_a, "http://127.0.0.1:19090/healthz", false)
    });
    assert!(healthz_a.contains("stood down"), "{healthz_a}");
    assert!(exec_wget(agent_a, "http://127.0.0.1:19090/readyz", false).is_none(), "stood-down pod A must not be ready");
    // The gateway: B's first slot took A's over; A's slot that served parks after its restart.
    let slots_b = ["cubenet-b-cube-egress", "cubenet-b-cube-egress-standby"];
    wait_value("pod B's CubeEgress took over", Duration::from_secs(120), || {
        let l: String = slots_b.iter().map(|c| logs(c)).collect();
        l.contains("took over listeners and state from predecessor").then_some(l)
    });
    let slots_a = ["cubenet-a-cube-egress", "cubenet-a-cube-egress-standby"];
    wait_value("both of pod A's slots parked", Duration::from_secs(120), || {
        slots_a.iter().all(|c| logs(c).contains("parked as standby")).then(String::new)
    });
    let took = t_b.elapsed();
    let health = gw_health("cubenet-b-cube-egress").expect("gateway health after the swap");
    assert!(health.contains("\"policy_count\":1"), "the policy moved with the gateway: {health}");
    eprintln!("[k8s-surge] pod B took the agent and the gateway over {:.1} s after it was played", took.as_secs_f64());
    // The TAP a "VMM" (the relay) holds is handed out again by B (K14's restart limit is gone).
    let (again, fd_again) = tap_fd(&tap_sock, &ifc.name, "sb-surge");
    assert!(again["errCode"] == "0" && fd_again.is_some(), "B must hand out the held TAP: {again}");
    drop(fd_again);

    // Attack: the kubelet restarts the stood-down pod's containers (a liveness failure, a
    // crash). A's agent must stand down again at once, never take the node back from B (no
    // ping-pong), and A's gateway slot must park again; the load keeps running meanwhile.
    podman_ok(&["restart", "--time", "10", agent_a]);
    wait_value("pod A's restarted agent stands down again", Duration::from_secs(60), || {
        let l = logs(agent_a);
        l.contains("standing down: restarted after pod").then_some(l)
    });
    podman_ok(&["restart", "--time", "10", "cubenet-a-cube-egress"]);
    wait_value("pod A's restarted gateway slot parks again", Duration::from_secs(60), || {
        let l = logs("cubenet-a-cube-egress");
        (l.matches("parked as standby").count() >= 2).then_some(l)
    });
    std::thread::sleep(Duration::from_secs(3));
    let log_b = logs(agent_b);
    assert_eq!(
        log_b.matches("hand-over complete").count(),
        1,
        "B's agent must have handed over to nobody (and taken over only once):\n{log_b}"
    );
    assert!(
        !log_b.contains("hand-over: mutations paused") && !logs(agent_a).contains("received listeners"),
        "A took the node back"
    );
    wait_value("pod B agent still ready after the attack", Duration::from_secs(10), || {
        exec_wget(agent_b, "http://127.0.0.1:19090/readyz", false).filter(|b| b.contains("ready"))
    });
    let slots: String = slots_b.iter().map(|c| logs(c)).collect();
    assert_eq!(slots.matches("stopping: no new connections").count(), 0, "B's gateway must keep serving:\n{slots}");

    // 4. The controller deletes pod A: SIGTERM to every container, grace period, removal.
    let echoed_before_stop = stream.echoed.load(Ordering::Relaxed);
    podman_ok(&["pod", "stop", "--time", "30", "cubenet-a"]);
    drop(guard_a);
    std::thread::sleep(Duration::from_secs(3));
    wait_value("pod B agent still ready", Duration::from_secs(10), || {
        exec_wget(agent_b, "http://127.0.0.1:19090/readyz", false).filter(|b| b.contains("ready"))
    });
    assert!(gw_health("cubenet-b-cube-egress").is_some(), "the gateway must still answer after pod A is gone");
    let chain = topo.node.exec("iptables", &["-t", "mangle", "-S", "TRANSPROXY"]);
    assert!(String::from_utf8_lossy(&chain.stdout).contains("TPROXY"), "pod A's stop removed the capture rules");

    // Results.
    stop.store(true, Ordering::Relaxed);
    loop_handle.join().unwrap();
    stream.stop.store(true, Ordering::Relaxed);
    let sent = stream.client.join().unwrap();
    let ka = ka.finish();
    let cl = cubelet.lock().unwrap();
    eprintln!(
        "[k8s-surge] stream {sent:?} bytes; keep-alive ok {} connects {} closes {} failures {:?}; cubelet rounds {} fds {} ensures {} failures {:?}",
        ka.ok, ka.connects, ka.closes, ka.failures, cl.rounds, cl.fds, cl.ensures, cl.failures
    );
    let sent = sent.unwrap_or_else(|e| panic!("the guest's TCP stream broke: {e}"));
    assert!(sent > echoed_before_stop, "the stream must flow after pod A is gone");
    assert!(ka.failures.is_empty(), "keep-alive client failures: {:?}", ka.failures);
    assert!(ka.ok > 100, "{ka:?}");
    let seen = world.requests_to("/ka/");
    assert_eq!(seen.len() as u64, ka.ok, "every keep-alive request reached the world once");
    assert!(cl.failures.is_empty(), "cubelet failures: {:?}", cl.failures);
    assert!(cl.fds > 10 && cl.ensures > 2, "{cl:?}");
    assert!(stood.contains("claims the node's agent (previous claim: none)"), "{stood}");

    // A new sandbox through B after A is gone.
    rt.block_on(async {
        let mut c = network_agent::client::connect(&grpc).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: "sb-after".into(), ..Default::default() })
            .await
            .expect("ensure through pod B");
    });
    drop(cl);
    drop(guest);
    drop(guard_b);
}
