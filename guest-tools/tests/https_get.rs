//! `cubenet-https-get` against a rustls server on loopback (one fresh CA, a leaf for
//! `api.test`): the answer comes back; a wrong name, a foreign CA and plain TCP are refused.

use std::{
    io::{Read, Write},
    net::TcpListener,
    path::Path,
    process::{Command, Output},
    sync::Arc,
    thread,
};

use rcgen::{CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::{ServerConfig, ServerConnection, StreamOwned, pki_types::PrivateKeyDer};

/// A self-signed CA: its PEM and an issuer.
fn ca(cn: &str) -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, cn);
    let pem = p.self_signed(&key).unwrap().pem();
    (pem, Issuer::new(p, key))
}

/// Serves `conns` TLS connections on a loopback port (leaf for `api.test`), answering each
/// request with its first line echoed; returns the port.
fn serve(issuer: &Issuer<'static, KeyPair>, conns: usize) -> u16 {
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["api.test".to_string()]).unwrap().signed_by(&key, issuer).unwrap();
    let cfg = Arc::new(
        ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], PrivateKeyDer::Pkcs8(key.serialize_der().into()))
            .unwrap(),
    );
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    thread::spawn(move || {
        for s in l.incoming().take(conns) {
            let Ok(s) = s else { continue };
            let mut t = StreamOwned::new(ServerConnection::new(cfg.clone()).unwrap(), s);
            let mut req = Vec::new();
            let mut b = [0u8; 512];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match t.read(&mut b) {
                    Ok(n) if n > 0 => req.extend_from_slice(&b[..n]),
                    _ => break,
                }
            }
            let text = String::from_utf8_lossy(&req).into_owned();
            let first = text.lines().next().unwrap_or("").to_string();
            let host = text.lines().find(|l| l.starts_with("Host: ")).unwrap_or("").to_string();
            let _ = write!(t, "HTTP/1.0 418 I'm a teapot\r\nServer: t\r\n\r\ngot {first} {host}\n");
            t.conn.send_close_notify();
            let _ = t.flush();
        }
    });
    port
}

fn get(port: u16, name: &str, ca: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cubenet-https-get"))
        .args(["127.0.0.1", &port.to_string(), name, "/v1/x?y=1"])
        .arg(ca)
        .output()
        .unwrap()
}

fn tmp(name: &str, text: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("cubenet-https-get-{}-{name}", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn answers_through_a_verified_handshake_and_refuses_wrong_name_ca_or_no_tls() {
    let (pem, issuer) = ca("test CA");
    let (other_pem, _) = ca("other CA");
    let (ca_file, other_file) = (tmp("ca.pem", &pem), tmp("other.pem", &other_pem));
    let port = serve(&issuer, 3);

    let ok = get(port, "api.test", &ca_file);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert_eq!(
        String::from_utf8_lossy(&ok.stdout),
        "HTTP/1.0 418 I'm a teapot\ngot GET /v1/x?y=1 HTTP/1.0 Host: api.test\n"
    );

    // Attack: a certificate for another name (the client asks for other.test).
    let name = get(port, "other.test", &ca_file);
    assert!(!name.status.success() && name.stdout.is_empty());
    assert!(String::from_utf8_lossy(&name.stderr).contains("not valid for name"), "{name:?}");

    // Attack: a chain to a CA the client was not given.
    let foreign = get(port, "api.test", &other_file);
    assert!(!foreign.status.success() && foreign.stdout.is_empty());
    assert!(String::from_utf8_lossy(&foreign.stderr).contains("UnknownIssuer"), "{foreign:?}");

    // A plain-TCP server (no TLS) is no answer.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let plain = l.local_addr().unwrap().port();
    thread::spawn(move || {
        if let Ok((mut s, _)) = l.accept() {
            let _ = s.write_all(b"HTTP/1.0 200 OK\r\n\r\nplain\n");
        }
    });
    let p = get(plain, "api.test", &ca_file);
    assert!(!p.status.success() && p.stdout.is_empty(), "{p:?}");

    // Bad arguments: a clear error, no connection.
    let bad = Command::new(env!("CARGO_BIN_EXE_cubenet-https-get")).args(["x", "1"]).output().unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("usage:"));
    let _ = std::fs::remove_file(ca_file);
    let _ = std::fs::remove_file(other_file);
}
