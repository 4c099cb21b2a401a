//! `cubenet-https-get <ip> <port> <sni/host> <path> <ca.pem>`: one HTTPS GET from the busybox
//! test guest, whose own TLS client (busybox `ssl_client`) sends no `signature_algorithms`
//! extension and so cannot talk to rustls servers such as CubeEgress (decision L20).
//!
//! Connects over TCP to `<ip>:<port>` (no name resolution: the guest resolves with busybox
//! `nslookup` first), does a TLS 1.3/1.2 handshake with rustls's default client settings
//! (ring provider, SNI `<sni/host>`, certificate verified for that name against the CA
//! certificates in `<ca.pem>` only, no system roots), sends
//! `GET <path> HTTP/1.0` with `Host: <sni/host>` and `Connection: close`, and prints the
//! response's status line, then the body, to stdout (headers are not printed).
//!
//! Exit status: 0 a response with a status line arrived (whatever the status), 1 any failure
//! (bad arguments, unreadable CA file, connect/handshake/verification error, no status line),
//! with the reason on stderr. Connect, read and write each time out after 10 s.
//!
//! Built statically by `scripts/guest-image.sh` (`-C target-feature=+crt-static`).

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use rustls_pki_types::{CertificateDer, ServerName, pem::PemObject};

/// Per-operation timeout (connect, each read, each write).
const TIMEOUT: Duration = Duration::from_secs(10);
/// Largest response kept (status, headers and body), bytes.
const MAX_RESPONSE: u64 = 1 << 20;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(out) => {
            let mut o = std::io::stdout().lock();
            // A closed stdout is the reader's business; nothing useful to report.
            let _ = o.write_all(&out).and_then(|()| o.flush());
        }
        Err(e) => {
            eprintln!("cubenet-https-get: {e:#}");
            std::process::exit(1);
        }
    }
}

/// Does the request and returns what to print: status line, `\n`, body.
fn run(args: &[String]) -> Result<Vec<u8>> {
    let [ip, port, host, path, ca] = args else {
        bail!("usage: cubenet-https-get <ip> <port> <sni/host> <path> <ca.pem> (got {} arguments)", args.len());
    };
    let ip: Ipv4Addr = ip.parse().with_context(|| format!("<ip> {ip:?} is not an IPv4 address"))?;
    let port: u16 = port.parse().with_context(|| format!("<port> {port:?} is not a port"))?;
    if !path.starts_with('/') || path.contains(|c: char| c.is_ascii_whitespace() || c.is_ascii_control()) {
        bail!("<path> {path:?} must start with / and contain no whitespace");
    }
    let name = ServerName::try_from(host.clone()).with_context(|| format!("<sni/host> {host:?} is not a DNS name"))?;

    let mut roots = RootCertStore::empty();
    let mut n = 0;
    for cert in CertificateDer::pem_file_iter(ca).with_context(|| format!("read CA file {ca}"))? {
        roots.add(cert.with_context(|| format!("parse CA file {ca}"))?).with_context(|| format!("CA in {ca}"))?;
        n += 1;
    }
    if n == 0 {
        bail!("no certificate in CA file {ca}");
    }
    // Default client settings: the process provider (ring, the only one built in), safe
    // default protocol versions (TLS 1.3 and 1.2), no client authentication.
    let config = ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
    let conn = ClientConnection::new(Arc::new(config), name).context("TLS client")?;

    let addr = SocketAddr::from((ip, port));
    let tcp = TcpStream::connect_timeout(&addr, TIMEOUT).with_context(|| format!("connect {addr}"))?;
    tcp.set_read_timeout(Some(TIMEOUT))?;
    tcp.set_write_timeout(Some(TIMEOUT))?;
    let mut tls = StreamOwned::new(conn, tcp);
    let req = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    tls.write_all(req.as_bytes()).with_context(|| format!("TLS handshake or request to {addr} ({host})"))?;
    tls.flush()?;

    let mut resp = Vec::new();
    match Read::by_ref(&mut tls).take(MAX_RESPONSE).read_to_end(&mut resp) {
        Ok(_) => {}
        // A server that closes without close_notify: HTTP/1.0 delimits the body by the close,
        // so what arrived is the whole answer.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !resp.is_empty() => {}
        Err(e) => return Err(e).with_context(|| format!("read response from {addr}")),
    }
    split(&resp)
}

/// Status line and body of a raw HTTP/1.x response.
fn split(resp: &[u8]) -> Result<Vec<u8>> {
    let end = resp.windows(4).position(|w| w == b"\r\n\r\n").context("no end of headers in the response")?;
    let line_end = resp.windows(2).position(|w| w == b"\r\n").unwrap_or(end);
    let status = &resp[..line_end];
    if !status.starts_with(b"HTTP/1.") {
        bail!("not an HTTP/1 status line: {:?}", String::from_utf8_lossy(status));
    }
    let mut out = status.to_vec();
    out.push(b'\n');
    out.extend_from_slice(&resp[end + 4..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn split_keeps_status_and_body() {
        let out = split(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 6\r\n\r\ndenied").unwrap();
        assert_eq!(out, b"HTTP/1.1 403 Forbidden\ndenied");
    }

    #[test]
    fn split_rejects_non_http() {
        assert!(split(b"SSH-2.0-x\r\n\r\n").is_err());
        assert!(split(b"HTTP/1.1 200 OK\r\nno end").is_err());
    }
}
