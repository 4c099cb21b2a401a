//! The TAP fd server: the upstream VMM protocol byte for byte (`reference/upstream.md §1.3`).
//!
//! One JSON request per connection, `{"name":"<tap>","sandboxId":"<id>"}` (no framing), and one
//! `sendmsg` reply whose payload is JSON with a **string** `errCode`:
//! `{"errCode":"0","errMsg":"Success"}` with exactly one fd in `SCM_RIGHTS`;
//! `"1001"` "Parse json failed" (not exactly that object with two non-empty strings, or over
//! [`MAX_REQUEST`] bytes);
//! `"1002"` "Device cannot be found by current name" (no such TAP, or not this sandbox's);
//! `"-1"` "Unknown" (anything else). Errors carry no fd.
//!
//! Each connection is its own task with a 1 s read deadline and a 1 s write deadline, so a
//! slow or silent client cannot hold up others.

use std::{os::fd::AsRawFd, sync::Arc, time::Duration};

use sendfd::SendWithFd;
use serde::Deserialize;
use tokio::{io::AsyncReadExt, net::UnixStream};

use crate::{agent::Agent, state::LogSafe};

/// Largest accepted request in bytes.
pub const MAX_REQUEST: usize = 4096;
/// Read and write deadline per connection.
pub const DEADLINE: Duration = Duration::from_secs(1);

/// Reply codes (`errCode`, `errMsg`).
pub mod codes {
    /// Success, with the fd.
    pub const OK: (&str, &str) = ("0", "Success");
    /// The request is not the expected JSON.
    pub const PARSE: (&str, &str) = ("1001", "Parse json failed");
    /// No such TAP, or not this sandbox's.
    pub const NOT_FOUND: (&str, &str) = ("1002", "Device cannot be found by current name");
    /// Anything else.
    pub const UNKNOWN: (&str, &str) = ("-1", "Unknown");
}

/// The request object, exactly: both keys, strings, nothing else (unknown or repeated keys are
/// refused by serde).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FdRequest {
    name: String,
    #[serde(rename = "sandboxId")]
    sandbox_id: String,
}

/// The reply payload for a code.
pub fn reply((code, msg): (&str, &str)) -> Vec<u8> {
    // Fixed key order and spacing, as the upstream server writes it.
    format!(r#"{{"errCode":"{code}","errMsg":"{msg}"}}"#).into_bytes()
}

/// Parses a complete request; `None` = malformed (errCode 1001).
///
/// Only a JSON **object** `{"name":"<tap>","sandboxId":"<id>"}` with both values non-empty is a
/// request: serde would also read a struct from an array (`["z…","sb"]`), and an empty `name`
/// would mean "whichever TAP the sandbox has". `name` is required because the VMM always sends
/// it (`reference/upstream.md §1.3`) and a caller that names no TAP cannot be checked against it.
fn parse(buf: &[u8]) -> Option<FdRequest> {
    if buf.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    let r = serde_json::from_slice::<FdRequest>(buf).ok()?;
    (!r.name.is_empty() && !r.sandbox_id.is_empty()).then_some(r)
}

/// Serves one connection (spawn one task per accepted stream).
pub async fn handle_conn(stream: UnixStream, agent: Arc<Agent>) {
    if let Err(e) = handle(stream, agent).await {
        tracing::debug!("fd client: {e}");
    }
}

async fn read_request(stream: &mut UnixStream) -> Result<Vec<u8>, ()> {
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
            Ok(Ok(n)) => n,
            _ => return Err(()),
        };
        if n == 0 {
            return if buf.is_empty() { Err(()) } else { Ok(buf) };
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_REQUEST {
            return Ok(buf);
        }
        // The client sends one write without framing: stop at the first complete JSON value.
        if serde_json::from_slice::<serde_json::Value>(&buf).is_ok() {
            return Ok(buf);
        }
    }
}

async fn send(stream: &UnixStream, payload: &[u8], fd: Option<&std::os::fd::OwnedFd>) -> std::io::Result<()> {
    let fds: Vec<i32> = fd.map(|f| vec![f.as_raw_fd()]).unwrap_or_default();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        tokio::time::timeout_at(deadline, stream.writable())
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "write deadline"))??;
        match stream.send_with_fd(payload, &fds) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

async fn handle(mut stream: UnixStream, agent: Arc<Agent>) -> std::io::Result<()> {
    let buf = match read_request(&mut stream).await {
        Ok(b) => b,
        Err(()) => {
            // Silent or vanished client: answer parse failure if it is still there.
            agent.metrics.fd_handoffs.with_label_values(&[codes::PARSE.0]).inc();
            return send(&stream, &reply(codes::PARSE), None).await;
        }
    };
    let req = if buf.len() > MAX_REQUEST { None } else { parse(&buf) };
    let Some(req) = req else {
        agent.metrics.fd_handoffs.with_label_values(&[codes::PARSE.0]).inc();
        return send(&stream, &reply(codes::PARSE), None).await;
    };
    let a = agent.clone();
    let (tap, sandbox_id) = (req.name.clone(), req.sandbox_id.clone());
    // Inline when the fd is open (every TAP the agent created or reopened); the blocking pool
    // only for a lazy open after a restart.
    let res = match agent.tap_fd_if_open(&req.name, &req.sandbox_id) {
        Some(r) => Ok(r),
        None => tokio::task::spawn_blocking(move || a.tap_fd(&req.name, &req.sandbox_id)).await,
    };
    let (code, fd) = match res {
        Ok(Ok(Some(fd))) => {
            tracing::info!(sandbox_id = %LogSafe(&sandbox_id), tap = %LogSafe(&tap), "TAP fd handed out");
            (codes::OK, Some(fd))
        }
        Ok(Ok(None)) => {
            tracing::warn!(sandbox_id = %LogSafe(&sandbox_id), tap = %LogSafe(&tap), "TAP fd refused: the sandbox holds no such TAP");
            (codes::NOT_FOUND, None)
        }
        Ok(Err(e)) => {
            tracing::warn!(sandbox_id = %LogSafe(&sandbox_id), tap = %LogSafe(&tap), error = %e, "TAP fd handoff failed");
            (codes::UNKNOWN, None)
        }
        Err(_) => (codes::UNKNOWN, None),
    };
    agent.metrics.fd_handoffs.with_label_values(&[code.0]).inc();
    send(&stream, &reply(code), fd.as_ref()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_upstream_bytes() {
        assert_eq!(reply(codes::OK), br#"{"errCode":"0","errMsg":"Success"}"#);
        assert_eq!(reply(codes::PARSE), br#"{"errCode":"1001","errMsg":"Parse json failed"}"#);
        assert_eq!(reply(codes::NOT_FOUND), br#"{"errCode":"1002","errMsg":"Device cannot be found by current name"}"#);
        assert_eq!(reply(codes::UNKNOWN), br#"{"errCode":"-1","errMsg":"Unknown"}"#);
    }

    #[test]
    fn parses_requests() {
        let r = parse(br#"{"name":"z192.168.0.2","sandboxId":"sb"}"#).unwrap();
        assert_eq!((r.name.as_str(), r.sandbox_id.as_str()), ("z192.168.0.2", "sb"));
        assert!(parse(b"{").is_none());
        assert!(parse(br#"{"name":1}"#).is_none());
        assert!(parse(br#" ["z192.168.0.2","sb"]"#).is_none());
        assert!(parse(br#"{"name":"","sandboxId":"sb"}"#).is_none());
        assert!(parse(br#"{"name":"z192.168.0.2","sandboxId":""}"#).is_none());
        assert!(parse(br#"{"sandboxId":"sb"}"#).is_none());
        assert!(parse(br#"{"name":"z192.168.0.2","sandboxId":"sb","x":1}"#).is_none());
        assert!(parse(br#"{"name":"z192.168.0.2","name":"z192.168.0.3","sandboxId":"sb"}"#).is_none());
        assert!(parse(br#"{"name":"z192.168.0.2","sandboxId":"sb"} x"#).is_none());
    }
}
