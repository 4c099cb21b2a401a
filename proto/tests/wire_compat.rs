//! Old clients keep working byte for byte: a message encoded from the frozen pre-CubeNet
//! schema (`tests/network_agent_v1_old.proto`) decodes with the live schema with the new
//! fields empty and re-encodes to the same bytes, and the live schema with only the old
//! fields set encodes exactly as the old one does.

use cubenet_proto::{v1 as new, v1_old as old};
use prost::Message;

fn old_request() -> old::EnsureNetworkRequest {
    old::EnsureNetworkRequest {
        sandbox_id: "sb-old".into(),
        idempotency_key: "k1".into(),
        port_mappings: vec![old::PortMapping {
            protocol: "tcp".into(),
            container_port: 8080,
            host_port: 0,
            host_ip: String::new(),
        }],
        persist_metadata: [("a".to_string(), "b".to_string())].into(),
        cubevs_context: Some(old::CubeVsContext {
            allow_internet_access: Some(false),
            allow_out: vec!["198.51.100.1/32".into()],
            deny_out: vec!["8.8.8.8".into()],
        }),
        ..Default::default()
    }
}

#[test]
fn old_bytes_decode_unchanged_and_reencode_identically() {
    let bytes = old_request().encode_to_vec();
    let n = new::EnsureNetworkRequest::decode(bytes.as_slice()).expect("live schema decodes old bytes");
    let c = n.cubevs_context.as_ref().expect("context");
    assert_eq!(c.allow_internet_access, Some(false));
    assert_eq!(c.allow_out, vec!["198.51.100.1/32"]);
    assert_eq!(c.deny_out, vec!["8.8.8.8"]);
    assert!(c.allow_fqdn.is_empty() && c.rules.is_empty(), "new fields stay empty");
    assert_eq!(n.encode_to_vec(), bytes, "byte for byte");
    let r = new::ReconcileNetworkRequest {
        sandbox_id: "sb-old".into(),
        cubevs_context: n.cubevs_context.clone(),
        ..Default::default()
    };
    let o = old::ReconcileNetworkRequest::decode(r.encode_to_vec().as_slice()).unwrap();
    assert_eq!(o.encode_to_vec(), r.encode_to_vec());
}

#[test]
fn responses_carry_no_new_fields() {
    // The live responses decode with the old schema without losing a byte.
    let resp = new::EnsureNetworkResponse {
        sandbox_id: "sb".into(),
        network_handle: "h".into(),
        interfaces: vec![new::Interface {
            name: "z192.168.0.2".into(),
            mac_address: "20:90:6f:00:00:02".into(),
            ip_cidrs: vec!["169.254.68.6/30".into()],
            gateway: "169.254.68.5".into(),
            mtu: 1500,
        }],
        persist_metadata: [("sandbox_ip".to_string(), "192.168.0.2".to_string())].into(),
        ..Default::default()
    };
    let b = resp.encode_to_vec();
    assert_eq!(old::EnsureNetworkResponse::decode(b.as_slice()).unwrap().encode_to_vec(), b);
}

#[test]
fn new_fields_use_new_tags_only() {
    // An old decoder skips the new fields and keeps every old one.
    let mut n = new::CubeVsContext {
        allow_internet_access: Some(true),
        allow_out: vec!["1.1.1.1".into()],
        deny_out: vec![],
        allow_fqdn: vec![new::FqdnAllow { name: "api.example.com".into(), ports: vec![443] }],
        rules: vec![new::EgressRule { id: "r".into(), r#match: None, action: None }],
    };
    let o = old::CubeVsContext::decode(n.encode_to_vec().as_slice()).unwrap();
    assert_eq!(o.allow_out, vec!["1.1.1.1"]);
    n.allow_fqdn.clear();
    n.rules.clear();
    assert_eq!(o.encode_to_vec(), n.encode_to_vec());
}
