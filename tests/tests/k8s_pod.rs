//! The CubeNode pod for real, under podman (root; prints `SKIPPED:` without podman, the k8s
//! venv or the guest image).
//!
//! 1. `scripts/build-images.sh --profile debug --no-save` (cached) builds the two images into
//!    the private storage of `scripts/k8s-lib.sh`;
//! 2. the chart is rendered in underlay mode with the node namespace of a test topology as the
//!    dataplane (`underlay.netnsPath=/run/netns/<node>`), host paths under a temp dir and a
//!    private bpffs, and its DaemonSet template converted to a Pod (`chart_check.py pod`);
//! 3. `podman kube play --network none` runs it: preflight, network-agent, both CubeEgress slots
//!    and cube-egress-net;
//! 4. as cubelet: EnsureNetwork over the mounted gRPC socket, the TAP fd from the TAP socket, a
//!    real QEMU guest that reaches world over it; CubeEgress answers its health in the node
//!    namespace and its TPROXY rules are there;
//! 5. while the guest streams a TCP upload to a slow world server, the agent container is
//!    replaced in the running pod by one from a newer image (`podman container clone
//!    --destroy`: same pod, same netns and volumes — what the kubelet does for an in-place
//!    image update); the upload completes byte-exact with no reset, because the datapath is
//!    pinned and the TAP is held by QEMU; the new agent adopts the sandbox, and (asserted, the
//!    limit of a restart, decision K14) cannot hand out that TAP again while QEMU holds it.
//! 6. everything is removed (pod, containers, namespaces, bpffs, temp dir); images stay cached.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddrV4, TcpListener},
    path::PathBuf,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::tap_fd,
    bpffs::BpfFs,
    pod::{
        PodGuard, build_images, drill_prerequisites, exec_wget, logs, podman, podman_ok, render_pod, retag_newer,
        wait_value as wait_for,
    },
    servers,
    topology::{Topology, WORLD_IP},
    vm::{Check, GuestConfig, GuestImage, Unavailable, Vm},
};

const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// Bytes the guest uploads through the agent replacement.
const UPLOAD: u64 = 12 * 1024 * 1024;
const SINK_PORT: u16 = 9000;

/// A world server that reads slowly (64 KiB per 50 ms ≈ 1.3 MB/s), so an upload spans the
/// agent replacement; reads `UPLOAD` bytes (or to EOF), fails on a reset or a timeout, then
/// answers `got <n>` (busybox nc in the guest does not half-close after stdin's EOF). It stops
/// reading `HELD_BACK` bytes short of the end until `release` is set: the guest (and so QEMU,
/// which holds the TAP) cannot finish before the test has asked for the TAP again (a loaded
/// machine replaced the agent in more time than the whole upload took, and QEMU had exited).
struct SlowSink {
    received: Arc<AtomicU64>,
    release: Arc<std::sync::atomic::AtomicBool>,
    result: std::sync::mpsc::Receiver<Result<u64, String>>,
}

/// See [`SlowSink`].
const HELD_BACK: u64 = 1024 * 1024;

fn slow_sink(topo: &Topology) -> SlowSink {
    let (tx, rx) = std::sync::mpsc::channel();
    let received = Arc::new(AtomicU64::new(0));
    let r = received.clone();
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let released = release.clone();
    let listener =
        topo.world.run(|| TcpListener::bind(SocketAddrV4::new(Ipv4Addr::from(WORLD_IP), SINK_PORT)).unwrap());
    std::thread::spawn(move || {
        let res = (|| {
            let (mut s, _) = listener.accept().map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            while r.load(Ordering::SeqCst) < UPLOAD {
                if r.load(Ordering::SeqCst) >= UPLOAD - HELD_BACK && !released.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if buf[..n].iter().any(|&b| b != 0) {
                            return Err("non-zero byte in the upload".to_string());
                        }
                        r.fetch_add(n as u64, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) => return Err(format!("read after {} bytes: {e}", r.load(Ordering::SeqCst))),
                }
            }
            let n = r.load(Ordering::SeqCst);
            let _ = writeln!(s, "got {n}");
            Ok(n)
        })();
        let _ = tx.send(res);
    });
    SlowSink { received, release, result: rx }
}

#[test]
fn cube_node_pod_under_podman_survives_agent_replacement() {
    const T: &str = "cube_node_pod_under_podman_survives_agent_replacement";
    let Some(py) = drill_prerequisites(T) else { return };
    let img = match GuestImage::ensure() {
        Ok(img) => img,
        Err(e) if e.downcast_ref::<Unavailable>().is_some() => {
            cubenet_tests::skip(T, e);
            return;
        }
        Err(e) => panic!("{e:#}"),
    };

    // 1. Images (cached by their inputs digest).
    let t0 = Instant::now();
    let (agent_ref, egress_ref) = build_images();
    eprintln!("[k8s-pod] images {agent_ref} {egress_ref} ready in {:.1} s", t0.elapsed().as_secs_f64());

    // 2. Topology, host paths, render → Pod.
    let topo = Topology::new();
    let bpffs = BpfFs::new();
    let dir = std::env::temp_dir().join(format!("cubenet-k8s-pod-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for d in ["cube", "state", "log", "modules", "handover"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    struct DirGuard(PathBuf);
    impl Drop for DirGuard {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _dir_guard = DirGuard(dir.clone());
    let (repo_a, tag) = agent_ref.rsplit_once(':').unwrap();
    let (repo_e, _) = egress_ref.rsplit_once(':').unwrap();
    let values = serde_json::json!({
        "mode": "underlay",
        "cidr": "192.168.0.0/24",
        "underlay": {"netnsPath": topo.node.path().to_str().unwrap(), "healthHostPort": null},
        "images": {
            "networkAgent": {"repository": repo_a, "tag": tag, "pullPolicy": "Never"},
            "cubeEgress": {"repository": repo_e, "tag": tag, "pullPolicy": "Never"},
        },
        "agent": {"tapInitNum": 2, "logLevel": "info"},
        "hostPaths": {
            "socketDir": dir.join("cube"),
            "bpffs": bpffs.path(),
            "stateDir": dir.join("state"),
            "logDir": dir.join("log"),
            "modules": dir.join("modules"),
            "handoverDir": dir.join("handover"),
        },
    });
    let pod_yaml = render_pod(std::path::Path::new(&py), &dir.join("render"), &values, "cubenet-node");

    // 3. kube play.
    let t1 = Instant::now();
    let _ = podman(&["pod", "rm", "--force", "cubenet-node"]);
    let pod_guard = PodGuard("cubenet-node".into());
    podman_ok(&["kube", "play", "--network", "none", pod_yaml.to_str().unwrap()]);
    let agent_c = "cubenet-node-network-agent";
    let ready = wait_for("agent /readyz", Duration::from_secs(120), || {
        exec_wget(agent_c, "http://127.0.0.1:19090/readyz", false).filter(|b| b.contains("ready"))
    });
    eprintln!("[k8s-pod] pod played, agent ready in {:.1} s ({})", t1.elapsed().as_secs_f64(), ready.trim());
    let agent_log = logs(agent_c);
    assert!(agent_log.contains("\"level\":\"INFO\""), "agent logs are not JSON lines:\n{agent_log}");
    let pf = logs("cubenet-node-preflight");
    assert!(pf.contains("overlaps no route") && pf.contains("bpffs at /sys/fs/bpf: ok"), "preflight:\n{pf}");

    // CubeEgress: health in the node namespace (one slot serves, the other parks), and the
    // TPROXY plumbing installed there.
    let health = wait_for("CubeEgress health", Duration::from_secs(90), || {
        exec_wget("cubenet-node-cube-egress", "http://127.0.0.1:9091/admin/v1/health", true)
            .or_else(|| exec_wget("cubenet-node-cube-egress-standby", "http://127.0.0.1:9091/admin/v1/health", true))
    });
    assert!(health.contains("\"status\":\"ok\""), "{health}");
    // Its bootstrap (chart `egress.bootstrapUrl: auto`) reaches the agent's dump listener that
    // the agent, in the pod's namespace, binds in the node namespace (decision L9).
    let health = wait_for("CubeEgress bootstrapped from the agent", Duration::from_secs(90), || {
        exec_wget("cubenet-node-cube-egress", "http://127.0.0.1:9091/admin/v1/health", true)
            .or_else(|| exec_wget("cubenet-node-cube-egress-standby", "http://127.0.0.1:9091/admin/v1/health", true))
            .filter(|h| h.contains("\"bootstrap_status\":\"ready\""))
    });
    eprintln!("[k8s-pod] CubeEgress health: {}", health.trim());
    wait_for("TPROXY chain in the node namespace", Duration::from_secs(60), || {
        let s = topo.node.exec("iptables", &["-t", "mangle", "-S", "TRANSPROXY"]);
        let s = String::from_utf8_lossy(&s.stdout).into_owned();
        s.contains("TPROXY").then_some(s)
    });
    let parked = logs("cubenet-node-cube-egress") + &logs("cubenet-node-cube-egress-standby");
    assert!(parked.contains("parked as standby"), "no slot parked:\n{parked}");
    assert!(
        parked.lines().any(|l| l.starts_with('{') && l.contains(r#""message":"cube-egress listening""#)),
        "CubeEgress does not log JSON lines (egress.logFormat json):\n{parked}"
    );

    // 4. As cubelet.
    let grpc = format!("unix://{}", dir.join("cube/network-agent-grpc.sock").display());
    let tap_sock = dir.join("cube/network-agent-tap.sock");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let r = rt.block_on(async {
        let mut c = network_agent::client::connect(&grpc).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: "sb-k8s".into(),
            cubevs_context: Some(pb::CubeVsContext { allow_internet_access: Some(true), ..Default::default() }),
            ..Default::default()
        })
        .await
        .expect("ensure")
        .into_inner()
    });
    let i = &r.interfaces[0];
    let (reply, fd) = tap_fd(&tap_sock, &i.name, "sb-k8s");
    assert_eq!(reply["errCode"], "0", "{reply}");
    let world_http = servers::http(&topo.world, WORLD_IP, 80);
    let sink = slow_sink(&topo);
    let w = |port| SocketAddrV4::new(Ipv4Addr::from(WORLD_IP), port);
    let checks = vec![Check::Http(w(80), "/".into()), Check::Send(w(SINK_PORT), UPLOAD)];
    let cfg = GuestConfig { checks: checks.clone(), check_timeout_secs: 100, ..GuestConfig::cubevs() };
    let vm = Vm::boot(&img, fd.expect("fd"), &cfg).expect("boot QEMU");
    vm.wait_ready(BOOT_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));

    // 5. The upload is flowing: replace the agent container in place with a newer image.
    wait_for("upload under way", Duration::from_secs(60), || {
        (sink.received.load(Ordering::SeqCst) > 256 * 1024).then(String::new)
    });
    let newer = format!("{repo_a}:{tag}-drill");
    retag_newer(&agent_ref, &newer, "io.cubenet.drill=in-place-update");
    let before = sink.received.load(Ordering::SeqCst);
    let t2 = Instant::now();
    let agent_c2 = "cubenet-node-network-agent-2";
    // Stop first (SIGTERM, as the kubelet does), then clone: podman 4.3's `clone --destroy`
    // of a running container races runc's state under load ("cannot remove container ... as
    // it is running").
    let old_log = logs(agent_c);
    podman_ok(&["stop", "--time", "10", agent_c]);
    wait_for("old agent container exited", Duration::from_secs(30), || {
        let st = podman_ok(&["inspect", "--format", "{{.State.Status}}", agent_c]);
        (st.trim() == "exited" || st.trim() == "stopped").then_some(st)
    });
    podman_ok(&["container", "clone", "--destroy", agent_c, agent_c2, &newer]);
    podman_ok(&["start", agent_c2]);
    let swapped = t2.elapsed();
    let image_now = podman_ok(&["inspect", "--format", "{{.ImageName}} {{.Pod}}", agent_c2]);
    assert!(image_now.contains("-drill"), "{image_now}");
    wait_for("new agent /readyz", Duration::from_secs(120), || {
        exec_wget(agent_c2, "http://127.0.0.1:19090/readyz", false).filter(|b| b.contains("ready"))
    });
    eprintln!(
        "[k8s-pod] agent container replaced by {newer} in {:.1} s, ready after {:.1} s; upload at {before} bytes then",
        swapped.as_secs_f64(),
        t2.elapsed().as_secs_f64()
    );
    let new_log = logs(agent_c2);
    let got = rt.block_on(async {
        let mut c = network_agent::client::connect(&grpc).await.unwrap();
        c.get_network(pb::GetNetworkRequest { sandbox_id: "sb-k8s".into(), ..Default::default() }).await
    });
    assert!(got.is_ok(), "the new agent lost sb-k8s: {got:?}\n{new_log}");
    // The documented limit (decision K14): a restarted agent cannot hand the TAP out again
    // while QEMU holds it (no hand-over of TAP fds between containers).
    let (again, fd_again) = tap_fd(&tap_sock, &i.name, "sb-k8s");
    if fd_again.is_some() || again["errCode"] == "0" {
        // Seen in 2 of 7 runs on 2026-12-02 (cause not found): what the node says then.
        let qemu = Command::new("pgrep").args(["-a", "qemu-system"]).output().map(|o| o.stdout).unwrap_or_default();
        let link = topo.node.exec("ip", &["-d", "link", "show", &i.name]).stdout;
        // Seen again on 2026-12-02 with QEMU defunct: the guest had ended, so nobody held
        // the TAP; its console and the sink's count tell why it ended.
        panic!(
            "expected the restart limit (K14), got {again}\nqemu: {}\nsink: {} of {UPLOAD} bytes\nlink: {}\n\
             guest console:\n{}\n{new_log}",
            String::from_utf8_lossy(&qemu),
            sink.received.load(Ordering::SeqCst),
            String::from_utf8_lossy(&link),
            vm.console()
        );
    }
    let during = sink.received.load(Ordering::SeqCst);
    assert!(during < UPLOAD, "the upload ended before the replacement finished ({during} bytes)");
    sink.release.store(true, Ordering::SeqCst);

    let results = vm.wait_done(Duration::from_secs(150)).unwrap_or_else(|e| panic!("{e:#}\n{}", vm.console()));
    for res in &results {
        eprintln!(
            "[k8s-pod] guest {} {} {} ms {}",
            res.spec,
            if res.pass { "PASS" } else { "FAIL" },
            res.ms,
            res.detail
        );
    }
    let sunk = sink.result.recv_timeout(Duration::from_secs(10)).expect("sink result");
    assert_eq!(sunk, Ok(UPLOAD), "world sink");
    assert!(results.len() == checks.len() && results.iter().all(|r| r.pass), "{results:?}\n{}", vm.console());
    assert_eq!(results[1].detail, format!("got {UPLOAD}"));
    assert!(!world_http.peers().is_empty());

    // Operations: the sandbox's datapath counters, read with the CLI inside the new agent
    // container, count the whole upload (out) across the replacement; the agent's JSON log
    // lines name the sandbox on Ensure and the fd hand-off.
    let c = podman_ok(&["exec", agent_c2, "cubenet-cli", "--json", "sandbox", "sb-k8s"]);
    let c: serde_json::Value = serde_json::from_str(&c).unwrap_or_else(|e| panic!("cubenet-cli: {e}: {c}"));
    eprintln!("[k8s-pod] cubenet-cli sandbox sb-k8s: {c}");
    assert!(c["out"]["bytes"].as_u64().unwrap() > UPLOAD, "the upload is not in the counters: {c}");
    assert!(c["in"]["packets"].as_u64().unwrap() > 0, "{c}");
    let metrics = exec_wget(agent_c2, "http://127.0.0.1:19090/metrics", false).expect("metrics");
    assert!(metrics.contains(r#"cubenet_sandbox_bytes_total{direction="out",sandbox="sb-k8s"}"#), "{metrics}");
    // CubeEgress's metrics, relayed by the agent from the dataplane namespace where the
    // chart's gateway serves them on its loopback admin address (O26; what the PodMonitor
    // scrapes).
    let egress_metrics =
        exec_wget(agent_c2, "http://127.0.0.1:19090/metrics/cube-egress", false).expect("/metrics/cube-egress");
    assert!(egress_metrics.lines().any(|l| l.starts_with("cube_egress_connections{")), "{egress_metrics}");
    for msg in ["network ensured", "TAP fd handed out"] {
        assert!(
            old_log.lines().any(|l| l.contains(msg) && l.contains(r#""sandbox_id":"sb-k8s""#)),
            "no JSON {msg:?} line with sandbox_id sb-k8s:\n{old_log}"
        );
    }

    // A new sandbox through the new agent.
    rt.block_on(async {
        let mut c = network_agent::client::connect(&grpc).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: "sb-k8s-2".into(), ..Default::default() })
            .await
            .expect("ensure through the new agent");
    });
    drop(vm);
    // The pod first: its replaced agent container still uses the drill image.
    drop(pod_guard);
    let rmi = podman(&["rmi", &newer]);
    assert!(rmi.status.success(), "podman rmi {newer}: {}", String::from_utf8_lossy(&rmi.stderr));
}
