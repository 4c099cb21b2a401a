//! `network_agent.api.v1.NetworkAgent` over tonic (wire format `reference/upstream.md §1.1`),
//! a thin translation onto [`Agent`]: every call runs on the blocking pool, never on a tokio
//! worker, because the agent does netns and datapath work synchronously.

use std::{collections::BTreeMap, sync::Arc};

use cubenet_proto::v1::{
    self as pb,
    network_agent_server::{NetworkAgent, NetworkAgentServer},
};
use tonic::{Request, Response, Status};

use crate::{
    agent::{Agent, AgentError, EnsureRequest, NetworkView, parse_port_request},
    dataplane::EgressPolicy,
    state::SandboxRecord,
};
use cubevs::policy::FqdnAllow;

/// The service.
#[derive(Clone, Debug)]
pub struct Service {
    agent: Arc<Agent>,
}

impl Service {
    /// A tonic server for `agent`.
    pub fn server(agent: Arc<Agent>) -> NetworkAgentServer<Self> {
        NetworkAgentServer::new(Self { agent })
    }
}

/// gRPC status of an agent error: the field is named in the message of INVALID_ARGUMENT.
pub fn status(e: AgentError) -> Status {
    match e {
        AgentError::Invalid { .. } => Status::invalid_argument(e.to_string()),
        AgentError::NotFound(_) => Status::not_found(e.to_string()),
        AgentError::Exhausted(_) => Status::resource_exhausted(e.to_string()),
        AgentError::Busy(_) => Status::unavailable(e.to_string()),
        AgentError::Internal(_) => Status::internal(e.to_string()),
    }
}

async fn blocking<R: Send + 'static>(f: impl FnOnce() -> Result<R, AgentError> + Send + 'static) -> Result<R, Status> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Status::internal(format!("worker: {e}")))?.map_err(status)
}

/// One gRPC rule in the gateway's wire model (`egress_policy::RuleSpec`); validation is the
/// gateway's own (`cubevs::policy::compile`). Absent `action` is the only error found here.
fn rule(i: usize, r: pb::EgressRule) -> Result<egress_policy::RuleSpec, Status> {
    use egress_policy::{ActionSpec, InjectSpec, MatchSpec, Ports, RuleSpec};
    let m = r.r#match.unwrap_or_default();
    let a = r.action.ok_or_else(|| {
        status(AgentError::Invalid {
            field: format!("{}rules[{i}].action", crate::dataplane::POLICY_FIELD_PREFIX),
            reason: "required".into(),
        })
    })?;
    let port = match m.port.len() {
        0 => None,
        1 => Some(Ports::One(m.port[0])),
        _ => Some(Ports::Many(m.port)),
    };
    Ok(RuleSpec {
        id: r.id,
        matcher: MatchSpec {
            sni: m.sni,
            host: m.host,
            method: (!m.method.is_empty()).then_some(m.method),
            path: m.path,
            scheme: m.scheme,
            port,
        },
        action: ActionSpec {
            allow: a.allow,
            audit: a.audit,
            inject: (!a.inject.is_empty()).then(|| {
                a.inject
                    .into_iter()
                    .map(|j| InjectSpec { header: j.header, secret: j.secret, format: j.format })
                    .collect()
            }),
            inject_plain_http: a.inject_plain_http,
        },
    })
}

fn policy(ctx: Option<pb::CubeVsContext>) -> Result<Option<EgressPolicy>, Status> {
    let Some(c) = ctx else { return Ok(None) };
    Ok(Some(EgressPolicy {
        allow_internet_access: c.allow_internet_access.unwrap_or(true),
        allow_out: c.allow_out,
        deny_out: c.deny_out,
        allow_fqdn: c.allow_fqdn.into_iter().map(|f| FqdnAllow { name: f.name, ports: f.ports }).collect(),
        rules: c.rules.into_iter().enumerate().map(|(i, r)| rule(i, r)).collect::<Result<_, _>>()?,
    }))
}

/// `persist_metadata` key of a ReconcileNetworkRequest that overrides
/// `flush_sessions_on_policy_tighten` for that call: `"true"` or `"false"`.
pub const FLUSH_ON_TIGHTEN_KEY: &str = "cubenet.io/flush-sessions-on-tighten";

fn flush_override(meta: &std::collections::HashMap<String, String>) -> Result<Option<bool>, Status> {
    match meta.get(FLUSH_ON_TIGHTEN_KEY).map(String::as_str) {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(v) => Err(status(AgentError::Invalid {
            field: format!("persist_metadata[{FLUSH_ON_TIGHTEN_KEY:?}]"),
            reason: format!("{v:?} is not \"true\" or \"false\""),
        })),
    }
}

fn ports(v: &[pb::PortMapping]) -> Result<Vec<crate::agent::PortRequest>, Status> {
    v.iter()
        .enumerate()
        .map(|(i, p)| parse_port_request(i, &p.protocol, p.container_port, p.host_port, &p.host_ip))
        .collect::<Result<_, _>>()
        .map_err(status)
}

fn pb_ports(r: &SandboxRecord) -> Vec<pb::PortMapping> {
    r.port_mappings
        .iter()
        .map(|p| pb::PortMapping {
            protocol: p.proto.to_string(),
            container_port: p.container_port.into(),
            host_port: p.host_port.into(),
            host_ip: p.host_ip.clone(),
        })
        .collect()
}

/// The pieces every Ensure-shaped response carries.
struct Shape {
    interfaces: Vec<pb::Interface>,
    routes: Vec<pb::Route>,
    arp_neighbors: Vec<pb::ArpNeighbor>,
    port_mappings: Vec<pb::PortMapping>,
    persist_metadata: std::collections::HashMap<String, String>,
}

fn shape(v: &NetworkView) -> Shape {
    let r = &v.record;
    Shape {
        interfaces: vec![pb::Interface {
            name: r.tap_name.clone(),
            mac_address: v.mac.clone(),
            ip_cidrs: vec![v.ip_cidr.clone()],
            gateway: v.gateway.to_string(),
            mtu: v.mtu as i32,
        }],
        routes: vec![pb::Route {
            destination_cidr: "0.0.0.0/0".into(),
            gateway: v.gateway.to_string(),
            device: "eth0".into(),
        }],
        arp_neighbors: vec![pb::ArpNeighbor {
            ip: v.gateway.to_string(),
            mac_address: v.gateway_mac.clone(),
            device: "eth0".into(),
        }],
        port_mappings: pb_ports(r),
        persist_metadata: r.persist_metadata.clone().into_iter().collect(),
    }
}

fn ensure_response(v: &NetworkView) -> pb::EnsureNetworkResponse {
    let s = shape(v);
    pb::EnsureNetworkResponse {
        sandbox_id: v.record.sandbox_id.clone(),
        network_handle: v.record.sandbox_id.clone(),
        interfaces: s.interfaces,
        routes: s.routes,
        arp_neighbors: s.arp_neighbors,
        port_mappings: s.port_mappings,
        persist_metadata: s.persist_metadata,
    }
}

fn check_handle(sandbox_id: &str, handle: &str) -> Result<(), Status> {
    if !handle.is_empty() && handle != sandbox_id {
        return Err(Status::invalid_argument(format!(
            "invalid network_handle: {handle:?} does not belong to sandbox_id {sandbox_id:?}"
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl NetworkAgent for Service {
    async fn ensure_network(
        &self,
        req: Request<pb::EnsureNetworkRequest>,
    ) -> Result<Response<pb::EnsureNetworkResponse>, Status> {
        let r = req.into_inner();
        let er = EnsureRequest {
            sandbox_id: r.sandbox_id,
            ports: ports(&r.port_mappings)?,
            policy: policy(r.cubevs_context)?,
            persist_metadata: r.persist_metadata.into_iter().collect::<BTreeMap<_, _>>(),
        };
        let agent = self.agent.clone();
        let v = blocking(move || agent.ensure(er)).await?;
        Ok(Response::new(ensure_response(&v)))
    }

    async fn release_network(
        &self,
        req: Request<pb::ReleaseNetworkRequest>,
    ) -> Result<Response<pb::ReleaseNetworkResponse>, Status> {
        let r = req.into_inner();
        check_handle(&r.sandbox_id, &r.network_handle)?;
        let agent = self.agent.clone();
        let id = r.sandbox_id.clone();
        let released = blocking(move || agent.release(&id)).await?;
        Ok(Response::new(pb::ReleaseNetworkResponse { released, persist_metadata: r.persist_metadata }))
    }

    async fn reconcile_network(
        &self,
        req: Request<pb::ReconcileNetworkRequest>,
    ) -> Result<Response<pb::ReconcileNetworkResponse>, Status> {
        let r = req.into_inner();
        check_handle(&r.sandbox_id, &r.network_handle)?;
        let agent = self.agent.clone();
        let id = r.sandbox_id.clone();
        let p = policy(r.cubevs_context)?;
        let flush = flush_override(&r.persist_metadata)?;
        let v = blocking(move || agent.reconcile(&id, p, flush)).await?;
        let s = shape(&v);
        Ok(Response::new(pb::ReconcileNetworkResponse {
            sandbox_id: v.record.sandbox_id.clone(),
            network_handle: v.record.sandbox_id.clone(),
            converged: true,
            interfaces: s.interfaces,
            routes: s.routes,
            arp_neighbors: s.arp_neighbors,
            port_mappings: s.port_mappings,
            persist_metadata: s.persist_metadata,
        }))
    }

    async fn get_network(
        &self,
        req: Request<pb::GetNetworkRequest>,
    ) -> Result<Response<pb::GetNetworkResponse>, Status> {
        let r = req.into_inner();
        check_handle(&r.sandbox_id, &r.network_handle)?;
        let agent = self.agent.clone();
        let v = blocking(move || agent.get(&r.sandbox_id)).await?;
        let s = shape(&v);
        Ok(Response::new(pb::GetNetworkResponse {
            sandbox_id: v.record.sandbox_id.clone(),
            network_handle: v.record.sandbox_id.clone(),
            interfaces: s.interfaces,
            routes: s.routes,
            arp_neighbors: s.arp_neighbors,
            port_mappings: s.port_mappings,
            persist_metadata: s.persist_metadata,
        }))
    }

    async fn list_networks(
        &self,
        _req: Request<pb::ListNetworksRequest>,
    ) -> Result<Response<pb::ListNetworksResponse>, Status> {
        let agent = self.agent.clone();
        let list = blocking(move || Ok(agent.list())).await?;
        Ok(Response::new(pb::ListNetworksResponse {
            networks: list
                .iter()
                .map(|r| pb::NetworkState {
                    sandbox_id: r.sandbox_id.clone(),
                    network_handle: r.sandbox_id.clone(),
                    tap_name: r.tap_name.clone(),
                    tap_ifindex: r.tap_ifindex as i32,
                    sandbox_ip: r.sandbox_ip.to_string(),
                    port_mappings: pb_ports(r),
                })
                .collect(),
        }))
    }

    async fn health(&self, _req: Request<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        let (ok, status) = match self.agent.readiness() {
            Ok(()) => (true, "ok".to_string()),
            Err(e) => (false, e),
        };
        Ok(Response::new(pb::HealthResponse { ok, status }))
    }
}
