//! JSON Lines audit log (`reference/upstream.md §4.7`): one object per request
//! (`event: "http_request"`) and per security event (`security_event`, `tls_handshake`).
//! Header values are redacted by name; bodies are never logged; secrets appear only as
//! fingerprints.

use std::{
    io::Write,
    path::{Path, PathBuf},
    sync::mpsc,
    time::{SystemTime, UNIX_EPOCH},
};

use serde_json::{Value, json};

/// Appends audit records to a file from a dedicated writer thread (records are queued, so the
/// proxy never blocks on disk).
#[derive(Debug, Clone)]
pub struct AuditLog {
    tx: mpsc::Sender<Value>,
}

impl AuditLog {
    /// Opens (creating parents and the file, append mode) and starts the writer thread.
    /// Errors: the directory or file cannot be created.
    pub fn open(path: &Path) -> anyhow::Result<AuditLog> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        let (tx, rx) = mpsc::channel::<Value>();
        let p: PathBuf = path.to_path_buf();
        std::thread::Builder::new().name("audit-writer".into()).spawn(move || {
            let mut w = std::io::BufWriter::new(file);
            while let Ok(v) = rx.recv() {
                let mut write = |v: &Value| {
                    let _ = serde_json::to_writer(&mut w, v);
                    let _ = w.write_all(b"\n");
                };
                write(&v);
                while let Ok(v) = rx.try_recv() {
                    write(&v);
                }
                if let Err(e) = w.flush() {
                    tracing::warn!(file = %p.display(), error = %e, "audit write failed");
                }
            }
        })?;
        Ok(AuditLog { tx })
    }

    /// Queues one record (adds `ts` when missing).
    pub fn write(&self, mut record: Value) {
        if let Value::Object(m) = &mut record {
            m.entry("ts").or_insert_with(|| json!(now_rfc3339()));
        }
        let _ = self.tx.send(record);
    }

    /// Queues a `security_event` record.
    pub fn security_event(&self, reason: &str, src_ip: &str, extra: Value) {
        let mut rec = json!({"event": "security_event", "sandbox": {"src_ip": src_ip}, "security": {"reason": reason}});
        if let (Value::Object(m), Value::Object(x)) = (&mut rec, extra) {
            for (k, v) in x {
                m.insert(k, v);
            }
        }
        self.write(rec);
    }
}

/// Current time as RFC 3339 UTC with microseconds.
pub fn now_rfc3339() -> String {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(d.as_nanos() as i128)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.microsecond()
    )
}

/// Redacted form of a header value by header name (upstream.md §4.7), or `None` when the
/// header is not sensitive and may be logged as is.
pub fn redact_header(name: &str, value: &str) -> Option<String> {
    let n = name.to_ascii_lowercase();
    match n.as_str() {
        "authorization" | "proxy-authorization" => {
            let scheme = value.trim().split_once(' ').map(|(s, _)| s).filter(|s| !s.is_empty()).unwrap_or("raw");
            Some(format!("<redacted:{scheme}>"))
        }
        "cookie" | "set-cookie" => {
            let names: Vec<&str> = value
                .split(';')
                .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim()))
                .filter(|k| !k.is_empty())
                .filter(|k| {
                    n == "cookie"
                        || !["path", "domain", "expires", "max-age", "samesite"]
                            .contains(&k.to_ascii_lowercase().as_str())
                })
                .collect();
            Some(format!("<redacted; names={}>", names.join(",")))
        }
        "x-api-key" | "x-auth-token" | "api-key" | "token" => Some("<redacted>".into()),
        _ if ["token", "secret", "key", "password", "credential", "auth"].iter().any(|w| n.contains(w)) => {
            Some("<redacted>".into())
        }
        _ => None,
    }
}

/// The `redacted_request_headers` object: every sensitive header of the request, redacted.
pub fn redacted_headers(headers: &http::HeaderMap) -> Value {
    let mut m = serde_json::Map::new();
    for (k, v) in headers {
        if let Some(r) = redact_header(k.as_str(), v.to_str().unwrap_or("")) {
            m.insert(k.as_str().to_string(), Value::String(r));
        }
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_redaction_rules() {
        assert_eq!(redact_header("Authorization", "Bearer abc").as_deref(), Some("<redacted:Bearer>"));
        assert_eq!(redact_header("proxy-authorization", "abc").as_deref(), Some("<redacted:raw>"));
        assert_eq!(redact_header("Cookie", "a=1; b=2").as_deref(), Some("<redacted; names=a,b>"));
        assert_eq!(redact_header("set-cookie", "sid=1; Path=/; HttpOnly").as_deref(), Some("<redacted; names=sid>"));
        assert_eq!(redact_header("X-Api-Key", "k").as_deref(), Some("<redacted>"));
        assert_eq!(redact_header("x-github-token", "k").as_deref(), Some("<redacted>"));
        assert_eq!(redact_header("x-client-secret", "k").as_deref(), Some("<redacted>"));
        assert_eq!(redact_header("user-agent", "curl"), None);
        assert_eq!(redact_header("accept", "*/*"), None);
    }

    #[test]
    fn records_are_json_lines() {
        let dir = std::env::temp_dir().join(format!("cube-egress-audit-{}", std::process::id()));
        let f = dir.join("sub/access.jsonl");
        let log = AuditLog::open(&f).unwrap();
        log.write(json!({"event": "http_request", "n": 1}));
        log.security_event("no_rule_match", "192.168.0.2", json!({"policy": {"decision": "deny"}}));
        let mut text = String::new();
        for _ in 0..100 {
            text = std::fs::read_to_string(&f).unwrap();
            if text.lines().count() == 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["security"]["reason"], "no_rule_match");
        assert_eq!(lines[1]["policy"]["decision"], "deny");
        assert!(lines[0]["ts"].as_str().unwrap().ends_with('Z'));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
