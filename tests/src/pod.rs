//! The CubeNode pod under podman, for the pod drills (`tests/tests/k8s_surge.rs`): the private
//! podman/buildah configuration of `scripts/k8s-lib.sh`, the chart rendered and converted to a
//! Pod (`deploy/tools/chart_check.py pod`), pods removed on drop, `wget` inside a container,
//! and a keep-alive HTTP/1.1 client that records every failure.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::netns::TestNetns;

/// The checkout's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().expect("checkout root")
}

/// What a pod drill needs before it starts: root, podman and buildah, and the chart venv
/// (`scripts/k8s-venv.sh`). Returns the venv's python, or `None` after reporting `test` as
/// skipped ([`crate::skip`]), so a machine without them shows the drill as skipped, not passed.
pub fn drill_prerequisites(test: &str) -> Option<PathBuf> {
    if !crate::require_root(test) {
        return None;
    }
    if Command::new("podman").arg("--version").output().is_err()
        || Command::new("buildah").arg("--version").output().is_err()
    {
        crate::skip(test, "podman/buildah not installed (scripts/setup.sh installs them)");
        return None;
    }
    let venv = Command::new("bash").arg(root().join("scripts/k8s-venv.sh")).output().expect("run k8s-venv.sh");
    if !venv.status.success() {
        crate::skip(test, format!("scripts/k8s-venv.sh failed: {}", String::from_utf8_lossy(&venv.stderr)));
        return None;
    }
    Some(PathBuf::from(String::from_utf8(venv.stdout).expect("venv path").trim()))
}

/// Builds (or finds, cached by their inputs' digest) the debug network-agent and cube-egress
/// images with `scripts/build-images.sh`; returns their references `(agent, egress)`.
pub fn build_images() -> (String, String) {
    let b = Command::new("bash")
        .arg(root().join("scripts/build-images.sh"))
        .args(["--profile", "debug", "--no-save"])
        .output()
        .expect("run build-images.sh");
    assert!(b.status.success(), "build-images.sh: {}", String::from_utf8_lossy(&b.stderr));
    let refs = String::from_utf8(b.stdout).expect("image refs");
    let find = |what: &str| refs.lines().find(|l| l.contains(what)).unwrap_or_else(|| panic!("no {what} in {refs}"));
    (find("/network-agent:").to_string(), find("/cube-egress:").to_string())
}

fn private(cmd: &str) -> Command {
    let dir = root().join("target/k8s/containers");
    let mut c = Command::new(cmd);
    c.env("CONTAINERS_CONF", dir.join("containers.conf")).env("CONTAINERS_STORAGE_CONF", dir.join("storage.conf"));
    c
}

/// `podman ARGS` with the private configuration.
pub fn podman(args: &[&str]) -> Output {
    private("podman").args(args).output().expect("run podman")
}

/// `podman ARGS`, panicking with its output on failure; returns stdout.
pub fn podman_ok(args: &[&str]) -> String {
    let o = podman(args);
    assert!(
        o.status.success(),
        "podman {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `buildah ARGS` with the private configuration, panicking on failure; returns stdout trimmed.
pub fn buildah(args: &[&str]) -> String {
    let o = private("buildah").args(args).output().expect("run buildah");
    assert!(o.status.success(), "buildah {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// A copy of image `src` tagged `dst` with one more label: a "newer" image whose content is
/// the same build (what a registry push of a new tag looks like to the kubelet).
pub fn retag_newer(src: &str, dst: &str, label: &str) {
    let ctr = buildah(&["from", "--pull=never", src]);
    buildah(&["config", "--label", label, &ctr]);
    buildah(&["commit", "--quiet", "--rm", &ctr, dst]);
}

/// stdout + stderr of a container.
pub fn logs(container: &str) -> String {
    let o = podman(&["logs", container]);
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Removes the pod (all its containers) on drop, also on panic (then prints every
/// container's logs first).
#[derive(Debug)]
pub struct PodGuard(pub String);

impl Drop for PodGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let ps = podman(&["ps", "-a", "--pod", "--format", "{{.Names}} {{.Status}}"]);
            let ps = String::from_utf8_lossy(&ps.stdout).into_owned();
            eprintln!("[pod] containers:\n{ps}");
            for name in ps.lines().filter_map(|l| l.split_whitespace().next()).filter(|n| n.starts_with(&self.0)) {
                eprintln!("[pod] ---- logs of {name}:\n{}", logs(name));
            }
        }
        let _ = podman(&["pod", "rm", "--force", "--time", "2", &self.0]);
    }
}

/// `wget -O - url` inside `container` (busybox in the images), through
/// cubenet-netns-exec.sh (the dataplane namespace) when `dataplane`: the body, `None` on any
/// failure (including an HTTP error status).
pub fn exec_wget(container: &str, url: &str, dataplane: bool) -> Option<String> {
    let mut args = vec!["exec", container];
    if dataplane {
        args.push("/usr/local/bin/cubenet-netns-exec.sh");
    }
    args.extend(["timeout", "3", "wget", "-q", "-O", "-", url]);
    let o = podman(&args);
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

/// Polls `f` every 500 ms until it gives a value; panics after `timeout`.
pub fn wait_value(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<String>) -> String {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Renders the chart with `values` (merged over its defaults) into `out` and converts the
/// DaemonSet template to a Pod named `name` (`chart_check.py pod`); returns the pod file.
pub fn render_pod(py: &Path, out: &Path, values: &serde_json::Value, name: &str) -> PathBuf {
    let o = Command::new(py)
        .arg(root().join("deploy/tools/chart_check.py"))
        .arg("pod")
        .arg(out)
        .arg(values.to_string())
        .arg(name)
        .output()
        .expect("run chart_check.py");
    assert!(o.status.success(), "chart_check.py pod: {}", String::from_utf8_lossy(&o.stderr));
    out.join("pod.yaml")
}

/// What [`KeepAlive`] saw.
#[derive(Debug, Default, Clone)]
pub struct KeepAliveReport {
    /// Requests answered 200 with the body the world server writes for their path.
    pub ok: u64,
    /// Failures: connects refused or failed, resets, requests without a (valid) answer.
    pub failures: Vec<String>,
    /// Connections opened (the first one, then one after each `Connection: close`).
    pub connects: u64,
    /// Responses that asked for a reconnect (`Connection: close`, a draining gateway).
    pub closes: u64,
    /// Paths answered, in order.
    pub paths: Vec<String>,
}

/// An HTTP/1.1 keep-alive client in a namespace: one connection to `addr` reused for a GET of
/// a fresh path every `period`, reconnecting only when a response says `Connection: close`
/// (what a default client does: hyper, curl, browsers), every failure recorded.
#[derive(Debug)]
pub struct KeepAlive {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<KeepAliveReport>>,
}

impl KeepAlive {
    /// Starts the client on a thread inside `ns` (so the flow leaves from there).
    pub fn start(ns: &TestNetns, addr: SocketAddr, host: &str, tag: &str, period: Duration) -> KeepAlive {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, host, tag) = (stop.clone(), host.to_string(), tag.to_string());
        // The whole client runs on a thread inside `ns`.
        let handle = ns.spawn_thread(move || {
            let mut r = KeepAliveReport::default();
            let mut conn: Option<BufReader<TcpStream>> = None;
            let mut n = 0u64;
            while !s.load(Ordering::Relaxed) {
                if conn.is_none() {
                    match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
                        Ok(c) => {
                            c.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
                            r.connects += 1;
                            conn = Some(BufReader::new(c));
                        }
                        Err(e) => {
                            r.failures.push(format!("connect #{}: {e}", r.connects + 1));
                            std::thread::sleep(period);
                            continue;
                        }
                    }
                }
                n += 1;
                let path = format!("/{tag}/{n}");
                let c = conn.as_mut().expect("connected");
                match get(c, &host, &path) {
                    Ok((200, body, close)) if body.contains(&path) => {
                        r.ok += 1;
                        r.paths.push(path);
                        if close {
                            r.closes += 1;
                            conn = None;
                        }
                    }
                    Ok((code, body, _)) => {
                        r.failures.push(format!("{path}: status {code}: {}", body.trim()));
                        conn = None;
                    }
                    Err(e) => {
                        r.failures.push(format!("{path} on connection #{}: {e}", r.connects));
                        conn = None;
                    }
                }
                std::thread::sleep(period);
            }
            r
        });
        KeepAlive { stop, handle: Some(handle) }
    }

    /// Stops the client and returns what it saw.
    pub fn finish(mut self) -> KeepAliveReport {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.take().expect("running").join().expect("keep-alive client")
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One `GET path` on `c`: (status, body, the response asked to close the connection).
/// Handles `Content-Length` and chunked bodies.
fn get(c: &mut BufReader<TcpStream>, host: &str, path: &str) -> std::io::Result<(u16, String, bool)> {
    write!(c.get_mut(), "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: cubenet-keepalive\r\n\r\n")?;
    c.get_mut().flush()?;
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let mut line = String::new();
    if c.read_line(&mut line)? == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed before the response"));
    }
    let code: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("status line {line:?}")))?;
    let (mut len, mut chunked, mut close) = (None, false, false);
    loop {
        let mut h = String::new();
        c.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':').ok_or_else(|| bad(format!("header {h:?}")))?;
        match k.trim().to_ascii_lowercase().as_str() {
            "content-length" => len = v.trim().parse::<usize>().ok(),
            "transfer-encoding" => chunked = v.to_ascii_lowercase().contains("chunked"),
            "connection" => close = v.to_ascii_lowercase().contains("close"),
            _ => {}
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            c.read_line(&mut size)?;
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| bad(format!("chunk size {size:?}")))?;
            let mut chunk = vec![0u8; n + 2];
            c.read_exact(&mut chunk)?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(n) = len {
        body.resize(n, 0);
        c.read_exact(&mut body)?;
    } else {
        c.read_to_end(&mut body)?;
        close = true;
    }
    Ok((code, String::from_utf8_lossy(&body).into_owned(), close))
}
