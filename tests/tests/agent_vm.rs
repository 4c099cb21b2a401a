//! A real Linux guest (QEMU TCG, virtio-net) on a TAP handed out by the network-agent's fd
//! socket: the agent started by its script in its own namespace sets everything up (pool TAP,
//! cube-dev, uplink, SNAT, host port, policy), the guest resolves its gateway, pings and fetches
//! from world, and serves on a host port the agent assigned.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    time::Duration,
};

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    packet, require_root, servers,
    topology::{NODE_IP, WORLD_IP, mac_string},
    vm::{Check, GuestConfig, GuestImage, Vm},
};

/// Generous: TCG on 2 shared cores, with other tests running beside it.
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
const CHECKS_TIMEOUT: Duration = Duration::from_secs(120);

fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

#[test]
fn real_guest_on_an_agent_tap() {
    if !require_root("real_guest_on_an_agent_tap") {
        return;
    }
    let Some(img) = GuestImage::for_test("real_guest_on_an_agent_tap") else { return };
    let mut a = AgentUnderTest::prepare("vm", 2, "");
    a.start();
    let world_http = servers::http(&a.topo.world, WORLD_IP, 80);

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let r = rt.block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: "sb-vm".into(),
            port_mappings: vec![pb::PortMapping { protocol: "tcp".into(), container_port: 8080, ..Default::default() }],
            cubevs_context: Some(pb::CubeVsContext { allow_internet_access: Some(true), ..Default::default() }),
            ..Default::default()
        })
        .await
        .expect("ensure")
        .into_inner()
    });
    let host_port = r.port_mappings[0].host_port as u16;
    let (reply, fd) = tap_fd(&a.tap_socket(), &r.interfaces[0].name, "sb-vm");
    assert_eq!(reply["errCode"], "0", "{reply}");

    // The guest is configured from the agent's answer, as a VMM launcher would.
    let i = &r.interfaces[0];
    let (ip, prefix) = i.ip_cidrs[0].split_once('/').unwrap();
    let arp = &r.arp_neighbors[0];
    let mac = |s: &str| -> [u8; 6] {
        let v: Vec<u8> = s.split(':').map(|b| u8::from_str_radix(b, 16).unwrap()).collect();
        v.try_into().unwrap()
    };
    let w = |port| SocketAddrV4::new(Ipv4Addr::from(WORLD_IP), port);
    let checks = vec![
        Check::Arp(i.gateway.parse().unwrap()),
        Check::Ping(Ipv4Addr::from(WORLD_IP)),
        Check::Http(w(80), "/".into()),
    ];
    let cfg = GuestConfig {
        mac: mac(&i.mac_address),
        ip: ip.parse().unwrap(),
        prefix: prefix.parse().unwrap(),
        gw: i.gateway.parse().unwrap(),
        gw_mac: Some(mac(&arp.mac_address)),
        serve_port: Some(8080),
        checks: checks.clone(),
        ..GuestConfig::cubevs()
    };
    let vm = Vm::boot(&img, fd.expect("fd"), &cfg).expect("boot QEMU");
    let ready = vm.wait_ready(BOOT_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("[agent-vm] boot-to-ready {:.2} s", ready.as_secs_f64());
    let results = vm.wait_done(CHECKS_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    for res in &results {
        eprintln!("[agent-vm] {} {} {} ms {}", res.spec, if res.pass { "PASS" } else { "FAIL" }, res.ms, res.detail);
    }
    assert!(results.len() == checks.len() && results.iter().all(|r| r.pass), "{results:?}\n{}", vm.console());
    assert_eq!(results[0].detail, mac_string(packet::GATEWAY_MAC));
    assert!(results[2].detail.starts_with("you are 198.51.100.2:"), "SNAT: {:?}", results[2]);
    assert!(!world_http.peers().is_empty());

    // world → node:<assigned host port> → guest httpd:8080.
    let mapped = SocketAddr::from((NODE_IP, host_port));
    let body = a
        .topo
        .world
        .run(move || http_get(mapped, "/cgi-bin/whoami"))
        .unwrap_or_else(|e| panic!("world → host port {host_port}: {e}\n{}", vm.console()));
    assert!(body.contains(" 200 ") && body.contains("you are 198.51.100.1:"), "{body}");

    // QEMU gone, Release returns the TAP to Ready.
    drop(vm);
    rt.block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.unwrap();
        c.release_network(pb::ReleaseNetworkRequest { sandbox_id: "sb-vm".into(), ..Default::default() })
            .await
            .unwrap();
    });
    // Ready after the free check, which the Release leaves to the maintenance pass it wakes.
    let t0 = std::time::Instant::now();
    loop {
        let taps = a.http_json("/v1/network/taps");
        let t = taps["taps"].as_array().unwrap().iter().find(|t| t["tapName"] == i.name.as_str()).unwrap().clone();
        if t["state"] == "Ready" {
            break;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "TAP not back in Ready: {t}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
