//! Bootstrap: load every policy from the agent's dump URL before serving (`reference/upstream.md §4.5`).
//!
//! Until it succeeds every request gets 403 (fail closed). Unlike upstream (exit after 3 failed
//! attempts) we keep the listeners and keep retrying: status `failed` after the first round.

use std::{sync::Arc, time::Duration};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

use crate::{
    App,
    policy::{Policy, PolicySpec, parse_sandbox_ip},
    store::{BootstrapStatus, PolicyStore},
};

/// Per-attempt timeout (upstream: 10 s).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Loads a dump body `{"policies": {"<ip>": policy}}` into the store; returns how many loaded.
/// Invalid entries are skipped with a warning. Errors: not JSON / no `policies` object, or a
/// non-empty dump of which nothing loaded.
pub fn load_dump(store: &PolicyStore, body: &[u8]) -> anyhow::Result<usize> {
    let v: serde_json::Value = serde_json::from_slice(body).context("dump is not JSON")?;
    let Some(map) = v.get("policies").and_then(|p| p.as_object()) else { bail!("dump has no `policies` object") };
    let mut loaded = 0;
    for (ip, pol) in map {
        let res = parse_sandbox_ip(ip).map_err(|e| e.to_string()).and_then(|ip| {
            let spec: PolicySpec = serde_json::from_value(pol.clone()).map_err(|e| e.to_string())?;
            Policy::compile(spec).map(|p| (ip, p)).map_err(|e| e.to_string())
        });
        match res {
            Ok((ip, p)) => {
                store.put(ip, p);
                loaded += 1;
            }
            Err(e) => tracing::warn!(sandbox = %ip, error = %e, "skipping invalid policy in dump"),
        }
    }
    if !map.is_empty() && loaded == 0 {
        bail!("dump had {} policies but none was valid", map.len());
    }
    Ok(loaded)
}

async fn fetch(url: &str) -> anyhow::Result<Bytes> {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(crate::certs::upstream_client_config(None)?)
        .https_or_http()
        .enable_http1()
        .build();
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(https);
    let uri: http::Uri = url.parse().context("bootstrap URL")?;
    let resp = tokio::time::timeout(ATTEMPT_TIMEOUT, client.get(uri)).await.context("timeout")??;
    if !resp.status().is_success() {
        bail!("HTTP {}", resp.status());
    }
    Ok(tokio::time::timeout(ATTEMPT_TIMEOUT, resp.into_body().collect()).await.context("timeout")??.to_bytes())
}

/// Runs the bootstrap: `skipped` when the URL is empty; otherwise `attempts` tries with
/// 0.5 s / 1 s / … backoff, status `failed` after them, then retries every `retry` forever.
pub async fn run(app: Arc<App>, url: String, attempts: u32, retry: Duration) {
    if url.is_empty() {
        app.store.set_status(BootstrapStatus::Skipped);
        tracing::info!("bootstrap skipped (no URL)");
        return;
    }
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let res = match fetch(&url).await {
            Ok(body) => load_dump(&app.store, &body),
            Err(e) => Err(e),
        };
        match res {
            Ok(n) => {
                app.store.set_status(BootstrapStatus::Ready);
                tracing::info!(policies = n, attempt, "bootstrap ready");
                return;
            }
            Err(e) => {
                tracing::warn!(attempt, error = %format!("{e:#}"), %url, "bootstrap attempt failed");
                let delay = if attempt < attempts {
                    Duration::from_millis(500 * u64::from(attempt))
                } else {
                    if attempt == attempts {
                        app.store.set_status(BootstrapStatus::Failed);
                    }
                    retry
                };
                tokio::time::sleep(delay).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dump_loading() {
        let store = PolicyStore::default();
        let good = r#"{"policy_id":"a","rules":[{"id":"r","action":{"allow":true}}]}"#;
        let body = format!(
            r#"{{"policies":{{"192.168.0.2":{good},"192.168.0.3":{{"policy_id":"","rules":[]}},"1.2.3":{good}}}}}"#
        );
        assert_eq!(load_dump(&store, body.as_bytes()).unwrap(), 1, "invalid entries are skipped");
        assert!(store.get("192.168.0.2".parse().unwrap()).is_some());
        assert!(store.get("192.168.0.3".parse().unwrap()).is_none());
        assert_eq!(load_dump(&store, br#"{"policies":{}}"#).unwrap(), 0, "an empty dump is valid");
        let bad_only = r#"{"policies":{"192.168.0.9":{"policy_id":"","rules":[]}}}"#;
        assert!(load_dump(&store, bad_only.as_bytes()).is_err(), "non-empty dump with nothing valid fails");
        assert!(load_dump(&store, b"{}").is_err());
        assert!(load_dump(&store, b"nope").is_err());
    }
}
