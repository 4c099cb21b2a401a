//! A TLS handshake flood from one sandbox address beside a keep-alive HTTPS client on another,
//! both through CubeEgress's TPROXY path: what `egress_gateway_handshake_flood_starves_no_other_sandbox`
//! (decision R90) measures.
//!
//! The flood ([`Flood`]) runs `loops` tasks on their own threads, each connecting from its
//! source address again and again and either completing a full TLS 1.3 handshake (no
//! resumption, no certificate check: the cheapest client that still makes the gateway do all
//! its work) and closing, or sending a canned ClientHello, waiting for the gateway's first
//! answer bytes and resetting the connection (the gateway has signed by then; the client did
//! nothing but one `write`), or sending garbage. The victim ([`victim`]) sends `GET` requests
//! back to back over keep-alive connections from its own address.

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{netns::TestNetns, tls};

/// What each flood connection does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloodKind {
    /// A full TLS 1.3 handshake (client resumption off), then close.
    Handshake,
    /// A full handshake, one `GET /flood` with `Connection: close` read to its end (the
    /// gateway's upstream handshake for it included), then close.
    Request,
    /// A canned ClientHello; once the gateway answers (ServerHello… sent: it has done the key
    /// exchange and signed), reset the connection.
    HelloAbort,
    /// 512 bytes that are no TLS record, then close.
    Garbage,
}

/// A running flood; [`Flood::stop`] ends it.
pub struct Flood {
    stop: Arc<AtomicBool>,
    /// Handshakes completed (kind `Handshake`), requests answered 200 (`Request`), gateway answers received (`HelloAbort`),
    /// or garbage connections made (`Garbage`).
    pub done: Arc<AtomicU64>,
    /// Connects or handshakes that failed.
    pub failed: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Flood {
    /// Stops every loop and waits for its threads.
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// Accepts any server certificate: the flood does not care whom it talks to, and verifying
/// would only cost the attacker CPU.
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn flood_config() -> Arc<rustls::ClientConfig> {
    let p = tls::provider();
    let mut c = rustls::ClientConfig::builder_with_provider(p.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(NoVerify(p)))
        .with_no_client_auth();
    c.resumption = rustls::client::Resumption::disabled();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(c)
}

/// The bytes of one ClientHello for `name` (TLS records as a client sends them first).
fn canned_hello(name: &str) -> Vec<u8> {
    let sni = rustls::pki_types::ServerName::try_from(name.to_string()).expect("server name");
    let mut c = rustls::ClientConnection::new(flood_config(), sni).expect("client connection");
    let mut out = Vec::new();
    while c.wants_write() {
        c.write_tls(&mut out).expect("write hello");
    }
    out
}

async fn tcp_from(src: Ipv4Addr, to: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind(SocketAddr::from((src, 0)))?;
    let t = tokio::time::timeout(Duration::from_secs(10), s.connect(to))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timeout"))??;
    t.set_nodelay(true)?;
    Ok(t)
}

async fn flood_once(
    kind: FloodKind,
    tls: &tokio_rustls::TlsConnector,
    hello: &[u8],
    name: &str,
    src: Ipv4Addr,
    to: SocketAddr,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut tcp = tcp_from(src, to).await?;
    match kind {
        FloodKind::Handshake => {
            let sni = rustls::pki_types::ServerName::try_from(name.to_string())?;
            let t = tokio::time::timeout(Duration::from_secs(10), tls.connect(sni, tcp))
                .await
                .map_err(|_| "TLS timeout")??;
            drop(t);
        }
        FloodKind::Request => {
            let sni = rustls::pki_types::ServerName::try_from(name.to_string())?;
            let mut t = tokio::time::timeout(Duration::from_secs(10), tls.connect(sni, tcp))
                .await
                .map_err(|_| "TLS timeout")??;
            t.write_all(format!("GET /flood HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
            let mut resp = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), t.read_to_end(&mut resp))
                .await
                .map_err(|_| "no answer")??;
            if !resp.starts_with(b"HTTP/1.1 200") {
                return Err(format!("answer: {}", String::from_utf8_lossy(&resp[..resp.len().min(80)])).into());
            }
        }
        FloodKind::HelloAbort => {
            tcp.write_all(hello).await?;
            let mut b = [0u8; 1];
            let n =
                tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut b)).await.map_err(|_| "no answer")??;
            if n == 0 {
                return Err("closed without an answer".into());
            }
            // RST: nothing of the gateway's flight is read or acknowledged.
            tcp.set_zero_linger()?;
        }
        FloodKind::Garbage => {
            tcp.write_all(&[0x5a; 512]).await?;
        }
    }
    Ok(())
}

/// Starts `loops` flood tasks (on `threads` threads in `ns`, each with its own runtime) from
/// `src` to `to` with SNI `name`.
pub fn flood(
    ns: &TestNetns,
    kind: FloodKind,
    name: &str,
    src: Ipv4Addr,
    to: SocketAddr,
    loops: usize,
    threads: usize,
) -> Flood {
    let stop = Arc::new(AtomicBool::new(false));
    let (done, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let hello = Arc::new(canned_hello(name));
    let handles = (0..threads)
        .map(|i| {
            let (stop, done, failed, hello, name) =
                (stop.clone(), done.clone(), failed.clone(), hello.clone(), name.to_string());
            let mine = loops / threads + usize::from(i < loops % threads);
            ns.spawn_thread(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("flood runtime");
                rt.block_on(async move {
                    let tls = tokio_rustls::TlsConnector::from(flood_config());
                    let tasks: Vec<_> = (0..mine)
                        .map(|_| {
                            let (stop, done, failed, hello, name, tls) =
                                (stop.clone(), done.clone(), failed.clone(), hello.clone(), name.clone(), tls.clone());
                            tokio::spawn(async move {
                                while !stop.load(Ordering::Relaxed) {
                                    match flood_once(kind, &tls, &hello, &name, src, to).await {
                                        Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                                        Err(_) => {
                                            tokio::time::sleep(Duration::from_millis(5)).await;
                                            failed.fetch_add(1, Ordering::Relaxed)
                                        }
                                    };
                                }
                            })
                        })
                        .collect();
                    for t in tasks {
                        let _ = t.await;
                    }
                });
            })
        })
        .collect();
    Flood { stop, done, failed, threads: handles }
}

/// What [`victim`] saw.
#[derive(Debug, Default, Clone)]
pub struct VictimReport {
    /// Requests answered 200.
    pub ok: u64,
    /// Connects, handshakes or requests that failed.
    pub failed: u64,
    /// Latency of every answered request (sent → body read), microseconds, sorted.
    pub latencies_us: Vec<u64>,
    /// The first errors.
    pub errors: Vec<String>,
}

impl VictimReport {
    /// The `q` quantile (0..=1) of the latencies, in milliseconds (0 when none).
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        let i = ((self.latencies_us.len() - 1) as f64 * q).round() as usize;
        self.latencies_us[i] as f64 / 1000.0
    }
}

type Sender = hyper::client::conn::http1::SendRequest<http_body_util::Empty<Bytes>>;

async fn victim_connect(
    tls: &tokio_rustls::TlsConnector,
    name: &str,
    src: Ipv4Addr,
    to: SocketAddr,
) -> Result<Sender, Box<dyn std::error::Error + Send + Sync>> {
    let tcp = tcp_from(src, to).await?;
    let sni = rustls::pki_types::ServerName::try_from(name.to_string())?;
    let t = tokio::time::timeout(Duration::from_secs(10), tls.connect(sni, tcp)).await.map_err(|_| "TLS timeout")??;
    let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(t)).await?;
    tokio::spawn(conn);
    Ok(s)
}

/// One keep-alive HTTP/1.1-over-TLS client (trusting only `ca_pem`) from `src` in `ns`,
/// sending `GET path` with Host `name` to `to` back to back for `dur`, on a thread of its
/// own. A connection that fails is replaced.
pub fn victim(
    ns: &TestNetns,
    ca_pem: &str,
    name: &str,
    src: Ipv4Addr,
    to: SocketAddr,
    path: &str,
    dur: Duration,
) -> VictimReport {
    let (ca, name, path) = (ca_pem.to_string(), name.to_string(), path.to_string());
    ns.spawn_thread(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("victim runtime");
        rt.block_on(async move {
            let tls = tokio_rustls::TlsConnector::from(tls::client_config(&ca));
            let out = Arc::new(std::sync::Mutex::new(VictimReport::default()));
            let end = tokio::time::Instant::now() + dur;
            let tasks: Vec<_> = (0..1)
                .map(|_| {
                    let (tls, name, path, out) = (tls.clone(), name.clone(), path.clone(), out.clone());
                    tokio::spawn(async move {
                        let mut sender: Option<Sender> = None;
                        while tokio::time::Instant::now() < end {
                            let mut s = match sender.take() {
                                Some(s) if !s.is_closed() => s,
                                _ => match victim_connect(&tls, &name, src, to).await {
                                    Ok(s) => s,
                                    Err(e) => {
                                        {
                                            let mut o = out.lock().expect("victim lock");
                                            o.failed += 1;
                                            if o.errors.len() < 5 {
                                                o.errors.push(format!("connect: {e}"));
                                            }
                                        }
                                        tokio::time::sleep(Duration::from_millis(20)).await;
                                        continue;
                                    }
                                },
                            };
                            let t = Instant::now();
                            let r = async {
                                use http_body_util::BodyExt;
                                s.ready().await?;
                                let req = Request::get(path.as_str())
                                    .header("host", name.as_str())
                                    .body(http_body_util::Empty::<Bytes>::new())?;
                                let resp = s.send_request(req).await?;
                                let status = resp.status();
                                resp.into_body().collect().await?;
                                if status != 200 {
                                    return Err::<(), Box<dyn std::error::Error + Send + Sync>>(
                                        format!("HTTP {status}").into(),
                                    );
                                }
                                Ok(())
                            };
                            let r = tokio::time::timeout(Duration::from_secs(10), r).await;
                            let mut o = out.lock().expect("victim lock");
                            match r {
                                Ok(Ok(())) => {
                                    o.ok += 1;
                                    o.latencies_us.push(t.elapsed().as_micros() as u64);
                                    sender = Some(s);
                                }
                                Ok(Err(e)) => {
                                    o.failed += 1;
                                    if o.errors.len() < 5 {
                                        o.errors.push(format!("request: {e}"));
                                    }
                                }
                                Err(_) => {
                                    o.failed += 1;
                                    if o.errors.len() < 5 {
                                        o.errors.push("request: no answer in 10 s".into());
                                    }
                                }
                            }
                        }
                    })
                })
                .collect();
            for t in tasks {
                let _ = t.await;
            }
            let mut o = std::mem::take(&mut *out.lock().expect("victim lock"));
            o.latencies_us.sort_unstable();
            o
        })
    })
    .join()
    .expect("victim thread")
}
