//! Attacks on host-port assignment through gRPC (the real agent, its datapath port maps read
//! back): a sandbox asking for another's host port (same or other protocol, alone or behind a
//! port it could have), a Reconcile naming another's port, and a huge repeated
//! `port_mappings` list. Properties users rely on that had no test: a host port, once
//! assigned, maps to its sandbox only until that sandbox is released; a refused Ensure keeps
//! no port; the agent stays serving.

use cubenet_proto::v1 as pb;
use cubenet_tests::{agent::AgentUnderTest, require_root};
use tonic::Code;

fn pm(proto: &str, container: u32, host: u32) -> pb::PortMapping {
    pb::PortMapping { protocol: proto.into(), container_port: container, host_port: host, host_ip: String::new() }
}

fn req(id: &str, ports: Vec<pb::PortMapping>) -> pb::EnsureNetworkRequest {
    pb::EnsureNetworkRequest { sandbox_id: id.into(), port_mappings: ports, ..Default::default() }
}

/// `(host port, ifindex, guest port)` of every datapath port map.
fn portmaps(a: &AgentUnderTest) -> Vec<(u64, u64, u64)> {
    let j = a.http_json("/v1/dataplane/portmaps");
    let mut v: Vec<_> = j["portMappings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let f = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("{k} in {m}"));
            (f("host_port"), f("ifindex"), f("guest_port"))
        })
        .collect();
    v.sort();
    v
}

#[test]
fn host_ports_cannot_be_taken_or_remapped_by_another_sandbox() {
    if !require_root("host_ports_cannot_be_taken_or_remapped_by_another_sandbox") {
        return;
    }
    let mut a = AgentUnderTest::prepare("hostports", 3, "host_port_range = \"20000-20009\"\n");
    a.start();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut c = rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).unwrap();

    let ra = rt.block_on(c.ensure_network(req("sb-a", vec![pm("tcp", 80, 0)]))).unwrap().into_inner();
    let p = ra.port_mappings[0].host_port;
    let a_ifindex = a.http_json("/v1/network/taps")["taps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tapName"] == ra.interfaces[0].name.as_str())
        .map(|t| t["tapIfIndex"].as_u64().unwrap_or_else(|| panic!("tapIfIndex in {t}")))
        .unwrap_or_else(|| panic!("tap of sb-a not listed"));
    let before = portmaps(&a);
    assert_eq!(before, vec![(u64::from(p), a_ifindex, 80)], "{before:?}");

    // B asks for A's port: TCP, UDP, and behind a free port it could have had.
    let free = if p == 20009 { 20008 } else { 20009 };
    for (case, ports) in [
        ("tcp", vec![pm("tcp", 22, p)]),
        ("udp", vec![pm("udp", 53, p)]),
        ("second of two", vec![pm("tcp", 8080, free), pm("tcp", 22, p)]),
    ] {
        let e = rt.block_on(c.ensure_network(req("sb-b", ports))).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{case}: {e:?}");
        assert!(e.message().contains("port_mappings[") && e.message().contains("already in use"), "{case}: {e:?}");
        assert_eq!(portmaps(&a), before, "{case}: the datapath port maps changed");
    }
    // Nothing of B's stayed: not listed, and the free port it named first is still free.
    let e = rt.block_on(c.get_network(pb::GetNetworkRequest { sandbox_id: "sb-b".into(), ..Default::default() }));
    assert_eq!(e.unwrap_err().code(), Code::NotFound);
    let rc = rt.block_on(c.ensure_network(req("sb-c", vec![pm("tcp", 8080, free)]))).unwrap().into_inner();
    assert_eq!(rc.port_mappings[0].host_port, free);

    // A Reconcile of C naming A's port changes no mapping (a Reconcile re-asserts C's own).
    let rec = pb::ReconcileNetworkRequest {
        sandbox_id: "sb-c".into(),
        port_mappings: vec![pm("tcp", 22, p)],
        ..Default::default()
    };
    let _ = rt.block_on(c.reconcile_network(rec));
    let maps = portmaps(&a);
    assert!(maps.contains(&(u64::from(p), a_ifindex, 80)), "{maps:?}");
    assert_eq!(maps.iter().filter(|m| m.0 == u64::from(p)).count(), 1, "{maps:?}");

    // A huge repeated field: 100,000 mappings on a 10-port range. Refused as exhausted (or
    // too large), nothing kept, the agent serves on.
    let many: Vec<_> = (0..100_000u32).map(|i| pm("tcp", 1 + i % 65535, 0)).collect();
    let e = rt.block_on(c.ensure_network(req("sb-many", many))).unwrap_err();
    assert!(matches!(e.code(), Code::ResourceExhausted | Code::InvalidArgument), "{e:?}");
    assert_eq!(portmaps(&a).len(), 2);
    let e = rt.block_on(c.get_network(pb::GetNetworkRequest { sandbox_id: "sb-many".into(), ..Default::default() }));
    assert_eq!(e.unwrap_err().code(), Code::NotFound);

    // A message over the gRPC limit (5 MiB of metadata): refused by the transport, nothing kept.
    let mut big = req("sb-big", vec![]);
    big.persist_metadata.insert("k".into(), "v".repeat(5 << 20));
    let e = rt.block_on(c.ensure_network(big)).unwrap_err();
    assert!(matches!(e.code(), Code::ResourceExhausted | Code::OutOfRange | Code::Internal), "{e:?}");
    let mut c = rt.block_on(network_agent::client::connect(&a.grpc_endpoint())).unwrap();
    let e = rt.block_on(c.get_network(pb::GetNetworkRequest { sandbox_id: "sb-big".into(), ..Default::default() }));
    assert_eq!(e.unwrap_err().code(), Code::NotFound);

    // Once A is released, its port is free for B.
    rt.block_on(c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "sb-a".into(), ..Default::default() }))
        .unwrap();
    let rb = rt.block_on(c.ensure_network(req("sb-b", vec![pm("udp", 53, p)]))).unwrap().into_inner();
    assert_eq!(rb.port_mappings[0].host_port, p);
    assert_eq!(portmaps(&a).iter().filter(|m| m.0 == u64::from(p)).count(), 1);
}
