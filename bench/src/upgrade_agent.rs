//! `agent upgrade` and `agent restart` rows of `cargo xtask bench upgrade` (issue 12): the load
//! of [`crate::upgrade::measure`] (long TCP stream, ~1,000 new connections/s, 1 ms ping) from a
//! kernel guest whose frames go through the agent's TAP — a relay plays the VMM
//! (`cubenet_tests::agent_upgrade::KernelGuest`) — around a live hand-over to a new agent binary
//! (`agent upgrade`: from the successor's start until the old agent exited) and around
//! `kill -9` + restart until `/readyz` (`agent restart`). The agent is the build
//! `cubenet_tests::agent::workspace_bin` names (release under `cargo xtask bench`).

use cubenet_proto::v1 as pb;
use cubenet_tests::{
    agent::{AgentUnderTest, tap_fd},
    agent_upgrade::{self, KernelGuest},
    topology::Topology,
};

use crate::{report::Row, upgrade::measure};

/// Both agent operations, three rows each.
pub fn agent_operations() -> Vec<Row> {
    let mut a = AgentUnderTest::prepare("bench-upgrade", 2, "");
    agent_upgrade::start(&mut a);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let r = rt.block_on(async {
        let mut c = network_agent::client::connect(&a.grpc_endpoint()).await.expect("connect");
        c.ensure_network(pb::EnsureNetworkRequest {
            sandbox_id: "bench-upgrade".into(),
            cubevs_context: Some(pb::CubeVsContext { allow_internet_access: Some(true), ..Default::default() }),
            ..Default::default()
        })
        .await
        .expect("ensure")
        .into_inner()
    });
    // An idle runtime would keep the gRPC connection open without answering the old agent's
    // GOAWAY, holding its exit back.
    drop(rt);
    let ifc = r.interfaces[0].clone();
    let (reply, fd) = tap_fd(&a.tap_socket(), &ifc.name, "bench-upgrade");
    assert_eq!(reply["errCode"], "0", "{reply}");
    let guest = KernelGuest::new(fd.expect("TAP fd"), &ifc.mac_address, &ifc.ip_cidrs[0], &ifc.gateway, ifc.mtu as u32);
    // `measure` borrows the world namespace while the operation needs the whole agent: the
    // topology is held apart meanwhile (a throwaway one stands in) and put back at the end.
    let topo = std::mem::replace(&mut a.topo, Topology::new());
    let mut rows = measure(&guest.ns, &topo.world, "agent upgrade", || agent_upgrade::upgrade(&mut a).map(drop));
    rows.extend(measure(&guest.ns, &topo.world, "agent restart", || agent_upgrade::crash_restart(&mut a)));
    drop(guest);
    drop(std::mem::replace(&mut a.topo, topo));
    rows
}
