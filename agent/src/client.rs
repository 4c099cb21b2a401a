//! Client helpers for the CLI and tests: a gRPC channel to `grpc_listen` (Unix or TCP) and a
//! minimal HTTP/1.0 GET for the loopback endpoints.

use std::io::{Read, Write};

use cubenet_proto::v1::network_agent_client::NetworkAgentClient;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// Connects to `unix://PATH`, `tcp://HOST:PORT` or `HOST:PORT`. The error names the endpoint
/// and the root cause (e.g. `connect unix:///tmp/cube/network-agent-grpc.sock: No such file or
/// directory (os error 2)`).
pub async fn connect(endpoint: &str) -> anyhow::Result<NetworkAgentClient<Channel>> {
    connect_inner(endpoint).await.map_err(|e| {
        let root = e.chain().last().map(|c| c.to_string()).unwrap_or_default();
        anyhow::anyhow!("connect {endpoint}: {root} (is the agent running there? set --grpc or CUBENET_GRPC)")
    })
}

async fn connect_inner(endpoint: &str) -> anyhow::Result<NetworkAgentClient<Channel>> {
    let ch = if let Some(path) = endpoint.strip_prefix("unix://") {
        let path = path.to_string();
        Endpoint::try_from("http://agent.invalid")?
            .connect_with_connector(tower::service_fn(move |_| {
                let p = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
            }))
            .await?
    } else {
        let hp = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
        Endpoint::try_from(format!("http://{hp}"))?.connect().await?
    };
    Ok(NetworkAgentClient::new(ch))
}

/// `GET path` on `addr` (`host:port`); returns (status, body). Own code: a one-shot loopback
/// request does not justify an HTTP client stack.
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((code, body.to_string()))
}
