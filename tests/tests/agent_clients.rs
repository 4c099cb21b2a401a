//! The agent's client-facing edges, end to end against the agent started by its script:
//! standard gRPC clients with their default options on the Unix socket (grpcio, tonic),
//! NOT_FOUND for unknown sandboxes, the fd socket's exact request object, and the Prometheus
//! exposition of the datapath counters.

use std::time::Duration;

use cubenet_proto::v1 as pb;
use cubenet_sys::tap::VNET_HDR_LEN;
use cubenet_tests::{
    agent::{AgentUnderTest, request_tap_fd, tap_fd},
    grpcio::agent_stubs,
    guest::TapGuest,
    packet::GATEWAY_IP,
    require_root,
};
use tonic::Code;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn ensure(a: &AgentUnderTest, rt: &tokio::runtime::Runtime, id: &str) -> pb::EnsureNetworkResponse {
    rt.block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.expect("connect gRPC");
        c.ensure_network(pb::EnsureNetworkRequest { sandbox_id: id.into(), ..Default::default() }).await
    })
    .expect("EnsureNetwork")
    .into_inner()
}

/// grpcio with **no channel options** on `unix:///…`: since grpcio 1.57 its `:authority` is
/// the %-encoded socket path, which h2 refuses with RST_STREAM(PROTOCOL_ERROR) unless the
/// agent normalises it. A second channel sends the raw path, as grpc-java does.
#[test]
fn python_grpcio_with_default_options_is_served() {
    if !require_root("python_grpcio_with_default_options_is_served") {
        return;
    }
    let mut a = AgentUnderTest::prepare("python", 1, "");
    a.start();
    let (py, pydir) = agent_stubs(&a.dir);
    let script = r#"
import sys, grpc
sys.path.insert(0, sys.argv[1])
import network_agent_pb2 as pb, network_agent_pb2_grpc as rpc
print("grpcio", grpc.__version__)
ch = grpc.insecure_channel(sys.argv[2])  # default options: the client's own :authority
s = rpc.NetworkAgentStub(ch)
r = s.EnsureNetwork(pb.EnsureNetworkRequest(sandbox_id="py-1",
    port_mappings=[pb.PortMapping(protocol="tcp", container_port=8080)],
    cubevs_context=pb.CubeVSContext(allow_internet_access=True, deny_out=["10.0.0.0/8"])))
assert r.sandbox_id == "py-1" and r.network_handle == "py-1", r
assert r.interfaces[0].ip_cidrs[0] == "169.254.68.6/30", r
assert r.interfaces[0].mtu == 1500
assert r.port_mappings[0].host_port >= 20000
assert r.persist_metadata["host_tap_name"] == r.interfaces[0].name
# Same connection again: the client's HPACK dynamic table is in use now.
g = s.GetNetwork(pb.GetNetworkRequest(sandbox_id="py-1"))
assert g.interfaces == r.interfaces and g.port_mappings == r.port_mappings
l = s.ListNetworks(pb.ListNetworksRequest())
assert [n.sandbox_id for n in l.networks] == ["py-1"], l
assert l.networks[0].tap_ifindex > 0 and l.networks[0].sandbox_ip.startswith("192.168.0.")
for call, req in [(s.GetNetwork, pb.GetNetworkRequest(sandbox_id="ghost")),
                  (s.ReconcileNetwork, pb.ReconcileNetworkRequest(sandbox_id="ghost"))]:
    try:
        call(req)
        raise SystemExit("unknown sandbox answered")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
try:
    s.EnsureNetwork(pb.EnsureNetworkRequest(sandbox_id=""))
    raise SystemExit("empty sandbox_id accepted")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
assert s.Health(pb.HealthRequest()).ok
# What the README promises a cubelet developer: a repeated Ensure returns the network as it is
# (its new ports, policy and metadata are ignored); the agent's four keys win over the caller's;
# a field this .proto does not know (tag 99) is ignored; a call past its deadline is safe to retry.
again = s.EnsureNetwork(pb.EnsureNetworkRequest(sandbox_id="py-1",
    port_mappings=[pb.PortMapping(protocol="udp", container_port=53)],
    cubevs_context=pb.CubeVSContext(allow_internet_access=False), persist_metadata={"k": "v"}))
assert again == r, again
m = s.EnsureNetwork(pb.EnsureNetworkRequest(sandbox_id="py-2",
    persist_metadata={"sandbox_ip": "1.2.3.4", "cubelet": "x"})).persist_metadata
assert m["sandbox_ip"].startswith("192.168.0.") and m["cubelet"] == "x", m
raw_ensure = ch.unary_unary("/network_agent.api.v1.NetworkAgent/EnsureNetwork",
    request_serializer=lambda b: b, response_deserializer=pb.EnsureNetworkResponse.FromString)
u = raw_ensure(pb.EnsureNetworkRequest(sandbox_id="py-2").SerializeToString() + bytes([0x98, 0x06, 0x01]))
assert u.sandbox_id == "py-2" and u.persist_metadata == m, u
try:
    s.EnsureNetwork(pb.EnsureNetworkRequest(sandbox_id="py-3"), timeout=0.000001)
except grpc.RpcError as e:
    # The client ends the call itself: grpcio reports DEADLINE_EXCEEDED, or CANCELLED
    # "Timeout expired" when its timer fires before the call is started.
    assert e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), e
t = s.EnsureNetwork(pb.EnsureNetworkRequest(sandbox_id="py-3"))
assert t.sandbox_id == "py-3" and s.GetNetwork(pb.GetNetworkRequest(sandbox_id="py-3")).interfaces == t.interfaces
for i in ["py-2", "py-3"]:
    assert s.ReleaseNetwork(pb.ReleaseNetworkRequest(sandbox_id=i)).released
# grpc-java's default: the raw socket path as :authority.
raw = grpc.insecure_channel(sys.argv[2], options=[("grpc.default_authority", sys.argv[2][len("unix://"):])])
assert rpc.NetworkAgentStub(raw).Health(pb.HealthRequest()).ok
rel = s.ReleaseNetwork(pb.ReleaseNetworkRequest(sandbox_id="py-1"))
assert rel.released
print("PYTHON-OK", r.interfaces[0].name)
"#;
    let endpoint = a.grpc_endpoint();
    let out = std::process::Command::new(&py).arg("-c").arg(script).arg(&pydir).arg(&endpoint).output().unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && so.contains("PYTHON-OK"), "{so}\n{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("{}", so.trim());
}

/// tonic's own client with its defaults, and the NOT_FOUND codes, over the same socket.
#[test]
fn tonic_default_client_and_not_found() {
    if !require_root("tonic_default_client_and_not_found") {
        return;
    }
    let mut a = AgentUnderTest::prepare("tonic", 1, "");
    a.start();
    let rt = rt();
    let path = a.dir.join("cube/grpc.sock");
    rt.block_on(async {
        // The URI tonic's examples use for Unix sockets; its authority is what tonic sends.
        let ch = tonic::transport::Endpoint::try_from("http://[::]:50051")
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_| {
                let p = path.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(p).await?))
                }
            }))
            .await
            .unwrap();
        let mut c = pb::network_agent_client::NetworkAgentClient::new(ch);
        assert!(c.health(pb::HealthRequest::default()).await.unwrap().into_inner().ok);
        let e = c
            .get_network(pb::GetNetworkRequest { sandbox_id: "ghost".into(), ..Default::default() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
        assert!(e.message().contains("ghost"), "{e:?}");
    });
}

/// The fd socket answers only the exact upstream request object; an array, an empty or
/// missing name, extra or repeated keys get errCode 1001 and never an fd.
#[test]
fn fd_socket_accepts_only_the_request_object() {
    if !require_root("fd_socket_accepts_only_the_request_object") {
        return;
    }
    let mut a = AgentUnderTest::prepare("fdstrict", 1, "");
    a.start();
    let rt = rt();
    let r = ensure(&a, &rt, "sb-1");
    let tap = r.interfaces[0].name.clone();
    let sock = a.tap_socket();
    let cases: Vec<String> = vec![
        format!(r#"["{tap}","sb-1"]"#),
        r#"{"name":"","sandboxId":"sb-1"}"#.into(),
        r#"{"sandboxId":"sb-1"}"#.into(),
        format!(r#"{{"name":"{tap}","sandboxId":""}}"#),
        format!(r#"{{"name":"{tap}","sandboxId":"sb-1","extra":1}}"#),
        format!(r#"{{"name":"z192.168.0.250","name":"{tap}","sandboxId":"sb-1"}}"#),
        format!(r#"{{"name":"{tap}","sandboxId":["sb-1"]}}"#),
    ];
    for req in cases {
        let (reply, fd) = request_tap_fd(&sock, req.as_bytes());
        assert_eq!(reply["errCode"], "1001", "request {req}: {reply}");
        assert_eq!(reply["errMsg"], "Parse json failed");
        assert!(fd.is_none(), "an fd came for {req}");
    }
    // The real request still works.
    let (reply, fd) = tap_fd(&sock, &tap, "sb-1");
    assert_eq!(reply["errCode"], "0", "{reply}");
    assert!(fd.is_some());
}

fn metric(text: &str, line_prefix: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(line_prefix)?.trim().parse().ok())
}

/// `/metrics`: the datapath counters are Prometheus counters (`…_total`, `# TYPE … counter`),
/// no datapath value is exported as a gauge, and values only grow as packets pass.
#[test]
fn datapath_counters_are_exported_as_monotonic_counters() {
    if !require_root("datapath_counters_are_exported_as_monotonic_counters") {
        return;
    }
    let mut a = AgentUnderTest::prepare("metrics", 1, "reaper_interval_secs = 1\n");
    a.start();
    let rt = rt();
    let r = ensure(&a, &rt, "sb-m");
    let (reply, fd) = tap_fd(&a.tap_socket(), &r.interfaces[0].name, "sb-m");
    assert_eq!(reply["errCode"], "0");
    let guest = TapGuest::new(fd.unwrap(), VNET_HDR_LEN);
    let arp = r#"cubenet_datapath_packets_total{program="from_cube",reason="arp_proxied"}"#;

    let (code, m1) = a.http("/metrics").unwrap();
    assert_eq!(code, 200);
    for family in
        ["cubenet_datapath_packets_total", "cubenet_reaper_runs_total", "cubenet_reaper_removed_sessions_total"]
    {
        assert!(m1.contains(&format!("# TYPE {family} counter\n")), "{family} not a counter:\n{m1}");
    }
    for l in m1.lines().filter(|l| l.starts_with("# TYPE ") && l.ends_with(" gauge")) {
        let name = l.split_whitespace().nth(2).unwrap();
        assert!(!name.contains("datapath") && !name.contains("reaper"), "datapath value as a gauge: {l}");
    }
    assert!(!m1.contains("cubenet_datapath_counter"), "{m1}");
    let arp1 = metric(&m1, arp).unwrap_or(0);
    let runs1 = metric(&m1, "cubenet_reaper_runs_total ").expect("reaper runs");

    for _ in 0..3 {
        guest.arp(GATEWAY_IP, Duration::from_secs(2)).expect("ARP reply");
    }
    std::thread::sleep(Duration::from_millis(2500)); // at least one more reaper sweep
    let m2 = a.http("/metrics").unwrap().1;
    let arp2 = metric(&m2, arp).expect("arp counter after ARP");
    assert!(arp2 >= arp1 + 3, "ARP counter {arp1} → {arp2}");
    let runs2 = metric(&m2, "cubenet_reaper_runs_total ").unwrap();
    assert!(runs2 > runs1, "reaper runs {runs1} → {runs2}");
    // Monotonic: every datapath series of the first scrape is still there and not smaller.
    for l in m1.lines().filter(|l| l.starts_with("cubenet_datapath_packets_total{")) {
        let (series, v) = l.rsplit_once(' ').unwrap();
        let v1: u64 = v.parse().unwrap();
        let v2 = metric(&m2, &format!("{series} ")).unwrap_or_else(|| panic!("{series} vanished"));
        assert!(v2 >= v1, "{series}: {v1} → {v2}");
    }
}
