//! `GET /v1/policies/dump`: the CubeEgress bootstrap source (`reference/upstream.md §1.2`,
//! §4.5). Shape `{"policies": {"<sandboxIP>": {"policy_id": "<sandboxIP>", "rules": [...]}}}`;
//! sandboxes without rules are omitted. The body holds raw secrets (the gateway needs them):
//! served to loopback peers only (`http.rs`), never logged.

use std::collections::BTreeMap;

use crate::agent::Agent;

/// The dump body.
pub fn dump(agent: &Agent) -> serde_json::Value {
    let policies: BTreeMap<String, egress_policy::PolicySpec> =
        agent.egress_policies().into_iter().map(|(ip, p)| (ip.to_string(), p)).collect();
    serde_json::json!({ "policies": policies })
}
