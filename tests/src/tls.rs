//! A throwaway certificate authority for TLS tests (rcgen + rustls with the ring provider):
//! the "world" servers' CA, leaves signed by it, and client configs trusting it.

use std::sync::Arc;

use rcgen::{CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

/// A CA: its PEM certificate and key, and an issuer for leaves.
pub struct TestCa {
    /// CA certificate, PEM.
    pub pem: String,
    /// CA private key, PEM.
    pub key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A self-signed CA named `cn`, valid from yesterday for a year.
pub fn make_ca(cn: &str) -> TestCa {
    let key = KeyPair::generate().expect("CA key");
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    p.distinguished_name.push(DnType::CommonName, cn);
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::days(1);
    p.not_after = now + time::Duration::days(365);
    let cert = p.self_signed(&key).expect("self-sign CA");
    let key_pem = key.serialize_pem();
    TestCa { pem: cert.pem(), key_pem, issuer: Issuer::new(p, key) }
}

/// The ring crypto provider.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server config with a fresh leaf for `name` signed by `ca`, ALPN h2 and http/1.1.
pub fn server_config(ca: &TestCa, name: &str) -> rustls::ServerConfig {
    server_config_names(ca, &[name])
}

/// A server config with one fresh leaf naming every name of `names` (SANs; the first is the
/// CN), signed by `ca`, ALPN h2 and http/1.1.
pub fn server_config_names(ca: &TestCa, names: &[&str]) -> rustls::ServerConfig {
    let key = KeyPair::generate().expect("leaf key");
    let mut p = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("leaf params");
    p.distinguished_name.push(DnType::CommonName, names[0]);
    let cert = p.signed_by(&key, &ca.issuer).expect("sign leaf");
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()))
        .expect("server config");
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    cfg
}

/// A client config trusting only the CA in `ca_pem`, ALPN http/1.1.
pub fn client_config(ca_pem: &str) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA PEM")).expect("add root");
    let mut c = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(c)
}
