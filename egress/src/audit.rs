//! JSON Lines audit log (`reference/upstream.md §4.7`): one object per request
//! (`event: "http_request"`) and per security event (`security_event`, `tls_handshake`).
//! Header values are redacted by name; bodies are never logged; secrets appear only as
//! fingerprints.

use std::{
    io::Write,
    net::Ipv4Addr,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use prometheus::IntCounter;
use serde_json::{Value, json};

use crate::floor::{Charge, FloorPool, Members, NoMembers, Refusal};

/// Largest batch of whole lines handed to one `write(2)`, bytes.
pub const MAX_WRITE_BYTES: usize = 64 * 1024;

/// Answer to a durable write: `Ok` once the record's line was handed to the kernel.
type Ack = tokio::sync::oneshot::Sender<Result<(), AuditError>>;

/// What the writer thread receives.
#[derive(Debug)]
enum Msg {
    /// A record, with the waiter to answer once its line is written ([`AuditLog::write_durable`])
    /// and its place in the queue (given back when the writer takes it).
    Record(Value, Option<Ack>, Charge),
    /// Answer on the channel once everything queued before it is written.
    Flush(mpsc::Sender<()>),
    /// Nothing to write: wakes the writer to report dropped records.
    Wake,
}

/// Why [`AuditLog::write_durable`] could not write a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuditError {
    /// The record's sandbox used its share of the writer's queue (its floor, and the shared
    /// remainder is full: the disk is slower than the requests, R22).
    #[error("audit queue full")]
    QueueFull,
    /// `write(2)` of the batch holding the record failed (the OS error, as text).
    #[error("audit write failed: {0}")]
    Write(String),
    /// The writer thread is gone.
    #[error("audit writer gone")]
    WriterGone,
}

impl AuditError {
    /// The `reason` label of `cube_egress_audit_refused_total`: `queue_share`, `write_failed`,
    /// `writer_gone`.
    pub fn reason(&self) -> &'static str {
        match self {
            AuditError::QueueFull => "queue_share",
            AuditError::Write(_) => "write_failed",
            AuditError::WriterGone => "writer_gone",
        }
    }
}

/// Writes the batch (whole lines) in one `write_all`, then answers the waiters of its records.
fn write_batch(sink: &mut impl Write, batch: &mut Vec<u8>, acks: &mut Vec<Ack>, what: &str) {
    if batch.is_empty() {
        return;
    }
    let res = sink.write_all(batch).and_then(|()| sink.flush()).map_err(|e| AuditError::Write(e.to_string()));
    batch.clear();
    if let Err(e) = &res {
        tracing::warn!(file = %what, error = %e, "audit write failed");
    }
    for a in acks.drain(..) {
        let _ = a.send(res.clone());
    }
}

/// Appends `v` as one line to `batch`, first writing the batch out when the line would not fit.
fn push_line(sink: &mut impl Write, batch: &mut Vec<u8>, acks: &mut Vec<Ack>, what: &str, v: &Value) {
    let mut line = serde_json::to_vec(v).unwrap_or_default();
    line.push(b'\n');
    if !batch.is_empty() && batch.len() + line.len() > MAX_WRITE_BYTES {
        write_batch(sink, batch, acks, what);
    }
    batch.extend_from_slice(&line);
}

/// How the audit queue is shared between sandboxes (decision R22): each sandbox with a policy
/// in `members` may always have `floor` records queued; the rest of the queue is shared (module
/// [`crate::floor`]).
#[derive(Clone)]
pub struct QueueShare {
    /// Records each sandbox with a policy may always have queued (`audit_floor_per_sandbox`).
    pub floor: usize,
    /// The sandboxes with a policy.
    pub members: Arc<dyn Members>,
}

impl QueueShare {
    /// No floors: the whole queue is shared (one sandbox may fill it).
    pub fn none() -> QueueShare {
        QueueShare { floor: 0, members: Arc::new(NoMembers) }
    }
}

/// The sandbox a record is charged to: its `sandbox.src_ip`, when it has one.
fn sandbox_of(record: &Value) -> Option<Ipv4Addr> {
    record.get("sandbox")?.get("src_ip")?.as_str()?.parse().ok()
}

/// Appends audit records to a file from a dedicated writer thread. The queue is bounded
/// (`capacity` records) and shared between sandboxes by floor and ceiling ([`QueueShare`],
/// R22): a record is charged to the sandbox of its `sandbox.src_ip` (records of no sandbox to
/// the shared remainder) until the writer takes it.
///
/// Two ways in:
/// - [`AuditLog::write_durable`] (records a request's answer or forwarding depends on, E20): the
///   caller waits until the record's line was written (`write(2)` returned: in the page cache,
///   which survives the death of this process, not a power loss); no room for the record in its
///   sandbox's share or a failed write is an error, and the caller fails closed.
/// - [`AuditLog::write`] (completion records, TLS refusals, security events): queued, the caller
///   does not wait; without room in its share the record is dropped (drop-newest), counted in
///   `cube_egress_audit_dropped_total`, and the writer records how many it lost in a
///   `security_event` (`audit_records_dropped`) as soon as it catches up (decision E15).
///
/// Records are written in queue order, so a durable write's answer also means every record
/// queued before it is written. The writer takes everything queued at once (group commit).
///
/// Records reach the file in `write(2)` calls that each hold whole lines (at most
/// [`MAX_WRITE_BYTES`] of them, or one longer line alone): with `O_APPEND`, two gateway processes
/// appending to the same file during a swap never interleave inside a line (E19).
#[derive(Debug, Clone)]
pub struct AuditLog {
    tx: mpsc::Sender<Msg>,
    pool: Arc<FloorPool>,
    pending_drops: Arc<AtomicU64>,
    dropped: IntCounter,
}

impl AuditLog {
    /// Opens (creating parents and the file, append mode) and starts the writer thread with a
    /// queue of `capacity` records shared by `share`; drops are counted in `dropped`. Errors:
    /// the directory or file cannot be created; a directory on the path another user controls
    /// ([`cubenet_sys::trusted_path`]); the file is a symlink (`ELOOP`). Both would let a local
    /// user point the gateway's root appends at any file on the node (decision R44).
    pub fn open(path: &Path, capacity: usize, share: QueueShare, dropped: IntCounter) -> anyhow::Result<AuditLog> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            cubenet_sys::trusted_path::ensure_dir(dir, "audit_file directory")?;
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        // A predecessor killed mid-record (kill -9, OOM) leaves a line without its newline;
        // end it, so our first record stays a line of its own (decision R8).
        let len = file.metadata()?.len();
        if len > 0 {
            use std::io::{Read, Seek, SeekFrom};
            let mut last = [0u8; 1];
            file.seek(SeekFrom::Start(len - 1))?;
            file.read_exact(&mut last)?;
            if last[0] != b'\n' {
                file.write_all(b"\n")?;
            }
        }
        Self::with_writer(file, path.display().to_string(), capacity, share, dropped)
    }

    /// Starts the writer thread on any sink (`what` names it in warnings). The sink gets one
    /// `write_all` per batch; for a file that is one `write(2)` unless the kernel writes short.
    pub fn with_writer(
        sink: impl Write + Send + 'static,
        what: String,
        capacity: usize,
        share: QueueShare,
        dropped: IntCounter,
    ) -> anyhow::Result<AuditLog> {
        // Unbounded channel: the pool bounds the records in it (a flush or a wake-up carries none).
        let (tx, rx) = mpsc::channel::<Msg>();
        let pool = Arc::new(FloorPool::new(capacity.max(1), share.floor, usize::MAX, share.members));
        let pending_drops = Arc::new(AtomicU64::new(0));
        let pending = pending_drops.clone();
        let writer_pool = pool.clone();
        std::thread::Builder::new().name("audit-writer".into()).spawn(move || {
            let mut sink = sink;
            let mut batch = Vec::with_capacity(MAX_WRITE_BYTES);
            let mut acks = Vec::new();
            let mut waiters = Vec::new();
            while let Ok(first) = rx.recv() {
                let mut next = Some(first);
                while let Some(m) = next.take() {
                    match m {
                        Msg::Record(v, ack, charge) => {
                            // Out of the queue: at most one batch is held here.
                            writer_pool.give_back(charge);
                            push_line(&mut sink, &mut batch, &mut acks, &what, &v);
                            acks.extend(ack);
                        }
                        Msg::Flush(w) => waiters.push(w),
                        Msg::Wake => {}
                    }
                    next = rx.try_recv().ok();
                }
                let lost = pending.swap(0, Ordering::Relaxed);
                if lost > 0 {
                    let ev = json!({
                        "ts": now_rfc3339(), "event": "security_event",
                        "security": {"reason": "audit_records_dropped", "dropped": lost},
                    });
                    push_line(&mut sink, &mut batch, &mut acks, &what, &ev);
                }
                write_batch(&mut sink, &mut batch, &mut acks, &what);
                for w in waiters.drain(..) {
                    let _ = w.send(());
                }
            }
        })?;
        Ok(AuditLog { tx, pool, pending_drops, dropped })
    }

    /// Records queued and not yet taken by the writer: (under sandboxes' floors, shared).
    pub fn queued(&self) -> (usize, usize) {
        self.pool.totals()
    }

    /// Queues one record (adds `ts` when missing); drops it when its sandbox has no room left
    /// in its share of the queue.
    pub fn write(&self, record: Value) {
        match self.pool.take(sandbox_of(&record)) {
            Ok(c) => {
                let _ = self.tx.send(Msg::Record(with_ts(record), None, c));
            }
            Err(_) => {
                self.dropped.inc();
                // The writer reports this on its next wake-up: the first drop since its last
                // report makes sure there is one (one message per report, not per drop).
                if self.pending_drops.fetch_add(1, Ordering::Relaxed) == 0 {
                    let _ = self.tx.send(Msg::Wake);
                }
            }
        }
    }

    /// Queues one record (adds `ts` when missing) and waits until its line was written
    /// (`write(2)` returned; with it every record queued earlier). Never waits for queue space:
    /// no room in the share of the record's sandbox is [`AuditError::QueueFull`] at once, so
    /// memory stays bounded by the queue and a slow disk makes requests fail closed instead of
    /// piling up, each sandbox within its own share (R22). Errors: [`AuditError::QueueFull`],
    /// [`AuditError::Write`] (the batch's `write(2)` failed: the line may be missing or
    /// partial), [`AuditError::WriterGone`]. Dropping the future does not unqueue the record.
    pub async fn write_durable(&self, record: Value) -> Result<(), AuditError> {
        let charge = self.pool.take(sandbox_of(&record)).map_err(|_: Refusal| AuditError::QueueFull)?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        match self.tx.send(Msg::Record(with_ts(record), Some(tx), charge)) {
            Ok(()) => rx.await.unwrap_or(Err(AuditError::WriterGone)),
            Err(mpsc::SendError(m)) => {
                if let Msg::Record(_, _, c) = m {
                    self.pool.give_back(c);
                }
                Err(AuditError::WriterGone)
            }
        }
    }

    /// Waits until every record queued before this call is written (at most `timeout`);
    /// `false` on timeout or when the writer is gone. Blocking: call off the async workers.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (tx, rx) = mpsc::channel();
        self.tx.send(Msg::Flush(tx)).is_ok() && rx.recv_timeout(timeout).is_ok()
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

/// `record` with a `ts` field (now) when it has none.
fn with_ts(mut record: Value) -> Value {
    if let Value::Object(m) = &mut record {
        m.entry("ts").or_insert_with(|| json!(now_rfc3339()));
    }
    record
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

/// A request target (`/path?query`) for the audit log: every query value is replaced by
/// `<redacted>` and names are kept (`/v1/x?token=<redacted>&page=<redacted>`); a parameter
/// without `=` is replaced whole; the path and empty values are kept (decision E15). Tokens,
/// signatures and codes travel in URLs under too many names for a name list to be safe.
pub fn redact_query(target: &str) -> String {
    let Some((path, query)) = target.split_once('?') else { return target.to_string() };
    let params: Vec<String> = query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((k, "")) => format!("{k}="),
            Some((k, _)) => format!("{k}=<redacted>"),
            None if p.is_empty() => String::new(),
            None => "<redacted>".to_string(),
        })
        .collect();
    format!("{path}?{}", params.join("&"))
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
    fn query_values_are_redacted() {
        assert_eq!(redact_query("/v1/x"), "/v1/x");
        assert_eq!(
            redact_query("/v1/x?access_token=abc123&page=2&flag&empty="),
            "/v1/x?access_token=<redacted>&page=<redacted>&<redacted>&empty="
        );
        assert_eq!(redact_query("/s?X-Amz-Signature=deadbeef"), "/s?X-Amz-Signature=<redacted>");
    }

    fn counter() -> IntCounter {
        IntCounter::new("t", "t").unwrap()
    }

    /// A sink that blocks until `gate` is opened (a stalled disk); `entered` tells that the
    /// writer is stuck in it.
    struct Stalled {
        gate: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
        entered: Arc<std::sync::atomic::AtomicBool>,
        out: Arc<std::sync::Mutex<Vec<u8>>>,
    }

    impl Write for Stalled {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.entered.store(true, Ordering::SeqCst);
            let (m, cv) = &*self.gate;
            let _open = cv.wait_while(m.lock().unwrap(), |open| !*open).unwrap();
            self.out.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Attack: a stalled writer must not let the queue (memory) grow without bound; the lost
    /// records are counted and reported.
    #[test]
    fn queue_is_bounded_and_drops_are_reported() {
        let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let entered = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let out = Arc::new(std::sync::Mutex::new(Vec::new()));
        let dropped = counter();
        let sink = Stalled { gate: gate.clone(), entered: entered.clone(), out: out.clone() };
        let log = AuditLog::with_writer(sink, "t".into(), 8, QueueShare::none(), dropped.clone()).unwrap();
        log.write(json!({"event": "http_request", "n": "first"}));
        for _ in 0..500 {
            if entered.load(Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(entered.load(Ordering::SeqCst), "writer never reached the sink");
        for i in 0..10_000 {
            log.write(json!({"event": "http_request", "n": i}));
        }
        assert_eq!(dropped.get(), 10_000 - 8, "all but the 8 queued records are dropped");
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        let mut lines = Vec::new();
        for _ in 0..200 {
            let text = String::from_utf8(out.lock().unwrap().clone()).unwrap();
            lines = text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()).collect();
            if lines.iter().any(|l| l["security"]["reason"] == "audit_records_dropped") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let ev = lines.iter().find(|l| l["security"]["reason"] == "audit_records_dropped").expect("drop report");
        assert_eq!(ev["security"]["dropped"].as_u64(), Some(10_000 - 8));
        assert_eq!(lines.len(), 1 + 8 + 1, "first record, the 8 queued ones, the drop report");
    }

    impl Stalled {
        fn new() -> Stalled {
            Stalled {
                gate: Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new())),
                entered: Arc::default(),
                out: Arc::default(),
            }
        }
        /// A handle on the same gate and output (the sink itself moves to the writer).
        fn handle(&self) -> Stalled {
            Stalled { gate: self.gate.clone(), entered: self.entered.clone(), out: self.out.clone() }
        }
        fn open(&self) {
            *self.gate.0.lock().unwrap() = true;
            self.gate.1.notify_all();
        }
        fn text(&self) -> String {
            String::from_utf8(self.out.lock().unwrap().clone()).unwrap()
        }
    }

    fn wait_entered(entered: &std::sync::atomic::AtomicBool) {
        for _ in 0..500 {
            if entered.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("writer never reached the sink");
    }

    /// Attack (E20): a durable write must not answer while its line is still in user space
    /// (the writer is stuck in `write`), and must answer once the line is in the sink.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn durable_write_answers_only_after_the_write() {
        let sink = Stalled::new();
        let h = sink.handle();
        let log = AuditLog::with_writer(sink, "t".into(), 8, QueueShare::none(), counter()).unwrap();
        let l = log.clone();
        let task = tokio::spawn(async move { l.write_durable(json!({"event": "http_request_start", "n": 1})).await });
        wait_entered(&h.entered);
        // The writer holds the record inside the stalled write: the waiter cannot be answered.
        tokio::task::yield_now().await;
        assert!(!task.is_finished(), "durable write answered before its line was written");
        assert!(h.text().is_empty());
        h.open();
        assert_eq!(task.await.unwrap(), Ok(()));
        let text = h.text();
        let v: Value = serde_json::from_str(text.strip_suffix('\n').expect("one whole line")).unwrap();
        assert_eq!(v["n"], 1);
        assert!(v["ts"].is_string());
    }

    /// Attack (E20): a stalled disk must not grow memory: with the queue full a durable write
    /// fails at once (the request is refused) instead of waiting or queueing beyond capacity.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn durable_write_fails_closed_when_the_queue_is_full() {
        let sink = Stalled::new();
        let h = sink.handle();
        let dropped = counter();
        let log = AuditLog::with_writer(sink, "t".into(), 4, QueueShare::none(), dropped.clone()).unwrap();
        log.write(json!({"event": "http_request", "n": "first"}));
        wait_entered(&h.entered);
        for i in 0..4 {
            log.write(json!({"event": "http_request", "n": i}));
        }
        assert_eq!(dropped.get(), 0, "four records fit the queue");
        assert_eq!(log.write_durable(json!({"event": "http_request_start"})).await, Err(AuditError::QueueFull));
        h.open();
        // Once the writer caught up there is room again.
        let l = log.clone();
        assert!(tokio::task::spawn_blocking(move || l.flush(Duration::from_secs(10))).await.unwrap());
        assert_eq!(log.write_durable(json!({"event": "http_request_start", "n": "after"})).await, Ok(()));
        let text = h.text();
        assert_eq!(text.lines().count(), 6, "first, four queued, the one after: {text}");
    }

    /// Two sandboxes with a policy (R22 tests).
    struct Two;
    impl Members for Two {
        fn contains(&self, ip: Ipv4Addr) -> bool {
            ip == Ipv4Addr::new(192, 168, 0, 2) || ip == Ipv4Addr::new(192, 168, 0, 3)
        }
        fn count(&self) -> usize {
            2
        }
    }

    /// Attack (R22): with the writer stalled, one sandbox queues all it may (its floor and the
    /// whole shared remainder); the other's durable record is still queued (its floor), and is
    /// written once the sink moves.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn one_sandbox_cannot_take_another_s_floor() {
        let sink = Stalled::new();
        let h = sink.handle();
        let dropped = counter();
        let share = QueueShare { floor: 3, members: Arc::new(Two) };
        let log = AuditLog::with_writer(sink, "t".into(), 20, share, dropped.clone()).unwrap();
        let rec = |ip: &str, n: usize| json!({"event": "http_request_start", "sandbox": {"src_ip": ip}, "n": n});
        log.write(json!({"event": "security_event", "n": "first"}));
        wait_entered(&h.entered);
        // The attacker: 3 (floor) + 14 (shared: 20 − 2 × 3) queued, the rest refused or dropped.
        let mut waiting = Vec::new();
        for i in 0..17 {
            let l = log.clone();
            let r = rec("192.168.0.2", i);
            waiting.push(tokio::spawn(async move { l.write_durable(r).await }));
        }
        for t in &waiting {
            while log.queued().0 + log.queued().1 < 17 && !t.is_finished() {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(log.queued(), (3, 14));
        assert_eq!(log.write_durable(rec("192.168.0.2", 99)).await, Err(AuditError::QueueFull));
        log.write(rec("192.168.0.2", 100));
        log.write(json!({"event": "security_event", "n": "no sandbox"}));
        assert_eq!(dropped.get(), 2, "over its share, and nothing shared left");
        // The victim: its floor is untouched.
        let l = log.clone();
        let victim = tokio::spawn(async move { l.write_durable(rec("192.168.0.3", 0)).await });
        while log.queued().0 < 4 {
            tokio::task::yield_now().await;
        }
        assert!(!victim.is_finished());
        h.open();
        assert_eq!(victim.await.unwrap(), Ok(()));
        for t in waiting {
            assert_eq!(t.await.unwrap(), Ok(()));
        }
        let text = h.text();
        assert!(text.contains(r#""src_ip":"192.168.0.3""#), "{text}");
        let l = log.clone();
        assert!(tokio::task::spawn_blocking(move || l.flush(Duration::from_secs(10))).await.unwrap());
        assert!(h.text().contains("audit_records_dropped"), "the drops are reported");
        assert_eq!(log.queued(), (0, 0));
    }

    /// A sink whose every write fails (a full or broken disk).
    struct Failing;
    impl Write for Failing {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::from_raw_os_error(libc::ENOSPC))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Attack (E20): a failed `write(2)` is reported to the waiter (which fails closed), never
    /// answered as written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn durable_write_reports_a_failed_write() {
        let log = AuditLog::with_writer(Failing, "t".into(), 8, QueueShare::none(), counter()).unwrap();
        match log.write_durable(json!({"event": "http_request_start"})).await {
            Err(AuditError::Write(e)) => assert!(e.contains("space"), "{e}"),
            other => panic!("expected a write error, got {other:?}"),
        }
    }

    /// Attack: a predecessor killed mid-record leaves a torn last line; the next process's
    /// records must still be whole lines (only the torn one is unreadable).
    #[test]
    fn torn_tail_does_not_swallow_the_next_record() {
        let dir = std::env::temp_dir().join(format!("cube-egress-audit-torn-{}", std::process::id()));
        let f = dir.join("access.jsonl");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&f, b"{\"event\":\"http_request\",\"n\":0}\n{\"event\":\"http_req").unwrap();
        let log = AuditLog::open(&f, 16, QueueShare::none(), counter()).unwrap();
        log.write(json!({"event": "http_request", "n": 1}));
        let mut text = String::new();
        for _ in 0..200 {
            text = std::fs::read_to_string(&f).unwrap();
            if text.lines().count() == 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(serde_json::from_str::<Value>(lines[1]).is_err(), "the torn line stays torn");
        assert_eq!(serde_json::from_str::<Value>(lines[2]).unwrap()["n"], 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Records the byte counts of each `write` call.
    struct Calls(Arc<std::sync::Mutex<Vec<Vec<u8>>>>);
    impl Write for Calls {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().push(b.to_vec());
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Two processes append to one file during a swap: every `write(2)` must hold whole lines
    /// (a line split across two writes could interleave with the other process's lines).
    #[test]
    fn writes_hold_whole_lines_and_flush_waits() {
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = AuditLog::with_writer(Calls(calls.clone()), "t".into(), 4096, QueueShare::none(), counter()).unwrap();
        let pad = "x".repeat(3000);
        for i in 0..200 {
            log.write(json!({"event": "http_request", "n": i, "pad": pad}));
        }
        log.write(json!({"event": "http_request", "big": "y".repeat(MAX_WRITE_BYTES * 2)}));
        assert!(log.flush(Duration::from_secs(10)), "flush returns once everything is written");
        let calls = calls.lock().unwrap();
        let mut n = 0;
        for c in calls.iter() {
            assert!(c.ends_with(b"\n"), "a write ends inside a line");
            assert!(c.len() <= MAX_WRITE_BYTES || c.iter().filter(|b| **b == b'\n').count() == 1);
            n += c.iter().filter(|b| **b == b'\n').count();
        }
        assert_eq!(n, 201, "every record written before flush returned");
    }

    #[test]
    fn records_are_json_lines() {
        let dir = std::env::temp_dir().join(format!("cube-egress-audit-{}", std::process::id()));
        let f = dir.join("sub/access.jsonl");
        let log = AuditLog::open(&f, 16, QueueShare::none(), counter()).unwrap();
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
