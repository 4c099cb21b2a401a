//! Upstream TLS client configs, one per sandbox (decision R84): each sandbox's upstream
//! connections resume only TLS sessions its own connections made. rustls' default client
//! session store is keyed by server name alone, so with one config for the whole gateway
//! sandbox B's upstream handshake resumed a session sandbox A had made: B could tell from its
//! request time (one round trip and a certificate check less) that another sandbox had reached
//! the name, and the world server saw B's connection continue A's session.

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

use rustls::{ClientConfig, client::Resumption};

/// TLS sessions (tickets or TLS 1.2 session IDs) kept per sandbox (rustls' default for the whole
/// process is 256). Small: the store allocates its room up front, once per sandbox address
/// that made an upstream connection.
pub const SESSIONS_PER_SANDBOX: usize = 16;

/// The gateway's upstream TLS client configs: the same roots, ALPN and protocol versions for
/// every sandbox, a session store of its own per sandbox.
pub struct UpstreamTls {
    base: ClientConfig,
    per_sandbox: Mutex<HashMap<Ipv4Addr, Arc<ClientConfig>>>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls").finish_non_exhaustive()
    }
}

impl UpstreamTls {
    /// Configs derived from `base` (its resumption setting is replaced per sandbox).
    pub fn new(base: ClientConfig) -> UpstreamTls {
        UpstreamTls { base, per_sandbox: Mutex::new(HashMap::new()) }
    }

    /// The config for `sandbox`'s upstream connections, made on first use. At most one per
    /// sandbox address (the sandbox CIDR bounds them); [`Self::forget`] drops one.
    pub fn for_sandbox(&self, sandbox: Ipv4Addr) -> Arc<ClientConfig> {
        let mut m = self.per_sandbox.lock().expect("upstream tls lock");
        m.entry(sandbox)
            .or_insert_with(|| {
                let mut c = self.base.clone();
                c.resumption = Resumption::in_memory_sessions(SESSIONS_PER_SANDBOX);
                Arc::new(c)
            })
            .clone()
    }

    /// Drops `sandbox`'s config and its sessions (its policy was deleted: the next sandbox on
    /// the address starts without them).
    pub fn forget(&self, sandbox: Ipv4Addr) {
        self.per_sandbox.lock().expect("upstream tls lock").remove(&sandbox);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustls::{HandshakeKind, RootCertStore, ServerConfig, pki_types::ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// One TLS handshake of `client` against `server` over an in-memory pipe (reading the
    /// server's first bytes, so TLS 1.3 tickets reach the client's store); how it was done.
    async fn handshake(server: Arc<ServerConfig>, client: Arc<ClientConfig>) -> HandshakeKind {
        let (c, s) = tokio::io::duplex(64 << 10);
        let srv = tokio::spawn(async move {
            let mut t = tokio_rustls::TlsAcceptor::from(server).accept(s).await.unwrap();
            t.write_all(b"x").await.unwrap();
            t.flush().await.unwrap();
            let mut b = [0u8; 1];
            let _ = t.read(&mut b).await;
            t.get_ref().1.handshake_kind().unwrap()
        });
        let name = ServerName::try_from("api.example.test").unwrap();
        let mut t = tokio_rustls::TlsConnector::from(client).connect(name, c).await.unwrap();
        let mut b = [0u8; 1];
        t.read_exact(&mut b).await.unwrap();
        t.write_all(b"y").await.unwrap();
        t.flush().await.unwrap();
        drop(t);
        srv.await.unwrap()
    }

    /// Attack (R84): sandbox B's upstream handshake resumed the session sandbox A's request
    /// had made with the same server. Now B's is a full handshake, A's own still resumes, and
    /// a sandbox whose policy was deleted (Release) leaves nothing to the address's next one.
    #[tokio::test]
    async fn a_sandbox_never_resumes_another_sandboxs_upstream_session() {
        let leaf = rcgen::generate_simple_self_signed(vec!["api.example.test".to_string()]).unwrap();
        let server = Arc::new(
            ServerConfig::builder_with_provider(crate::certs::provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    vec![leaf.cert.der().clone()],
                    rustls::pki_types::PrivateKeyDer::Pkcs8(leaf.signing_key.serialize_der().into()),
                )
                .unwrap(),
        );
        let mut roots = RootCertStore::empty();
        roots.add(leaf.cert.der().clone()).unwrap();
        let base = ClientConfig::builder_with_provider(crate::certs::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tls = UpstreamTls::new(base);
        let (a, b) = (Ipv4Addr::new(192, 168, 0, 2), Ipv4Addr::new(192, 168, 0, 3));
        assert_eq!(handshake(server.clone(), tls.for_sandbox(a)).await, HandshakeKind::Full);
        assert_eq!(handshake(server.clone(), tls.for_sandbox(a)).await, HandshakeKind::Resumed, "A resumes its own");
        assert_eq!(
            handshake(server.clone(), tls.for_sandbox(b)).await,
            HandshakeKind::Full,
            "B resumed a session A's connection made"
        );
        tls.forget(a);
        assert_eq!(handshake(server, tls.for_sandbox(a)).await, HandshakeKind::Full, "the address's next sandbox");
    }
}
