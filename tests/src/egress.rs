//! The real `cube-egress` as the agent tests meet it: a bare process in a namespace with its
//! admin API on its default address ([`ADMIN`]), no TPROXY plumbing (for the L7 path end to
//! end see [`crate::l7::Gateway`]), and a plain HTTP/1.0 client for that admin API.

use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use crate::{
    agent::workspace_bin,
    netns::{ChildGuard, TestNetns},
    tls,
};

/// The gateway's default admin address (`--admin-addr`), in its own namespace; also the
/// agent's default `cube_egress_admin_url`.
pub const ADMIN: &str = "127.0.0.1:9091";

/// `method path` with `body` (JSON, may be empty) to the admin API of the gateway in `ns`,
/// over HTTP/1.0 with a 10 s read timeout: (status, body), status 0 when unreachable.
pub fn admin(ns: &TestNetns, method: &str, path: &str, body: &str) -> (u16, String) {
    let (m, p, b) = (method.to_string(), path.to_string(), body.to_string());
    ns.run(move || -> std::io::Result<(u16, String)> {
        let mut s = std::net::TcpStream::connect(ADMIN)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "{m} {p} HTTP/1.0\r\nHost: {ADMIN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        )?;
        let mut buf = String::new();
        s.read_to_string(&mut buf)?;
        let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
        let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        Ok((code, body.to_string()))
    })
    .unwrap_or((0, String::new()))
}

/// A `cube-egress` process in a namespace (sandbox CIDR 192.168.0.0/18, HTTP/HTTPS ports
/// 18080/18443, admin API on [`ADMIN`]); killed on drop. Its files live in the directory it
/// was started with: `ca/` (a CA of its own, made on the first start and kept across
/// restarts), `audit.jsonl`, and `gateway.log` (stdout and stderr, appended).
#[derive(Debug)]
pub struct AdminGateway {
    child: ChildGuard,
    log: PathBuf,
}

impl AdminGateway {
    /// Starts the gateway in `ns` with `bootstrap` as its `--bootstrap-url` ("" = none: only
    /// the agent's pushes fill it) and waits up to 30 s until `GET /admin/v1/health` answers
    /// 200 with a bootstrap status other than `pending`. Panics with the gateway's log when it
    /// exits or never gets there.
    pub fn start(ns: &TestNetns, dir: &Path, bootstrap: &str) -> AdminGateway {
        let ca = dir.join("ca");
        if !ca.exists() {
            std::fs::create_dir_all(&ca).unwrap();
            let c = tls::make_ca("CubeEgress agent test CA");
            std::fs::write(ca.join("cube-root-ca.crt"), &c.pem).unwrap();
            std::fs::write(ca.join("cube-root-ca.key"), &c.key_pem).unwrap();
        }
        let log = dir.join("gateway.log");
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let child = ns
            .command(workspace_bin("cube-egress").to_str().unwrap())
            .args(["--sandbox-cidr", "192.168.0.0/18", "--http-port", "18080", "--https-port", "18443"])
            .arg("--ca-dir")
            .arg(&ca)
            .arg("--audit-file")
            .arg(dir.join("audit.jsonl"))
            .args(["--bootstrap-url", bootstrap])
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("spawn cube-egress");
        let mut g = AdminGateway { child: ChildGuard::from_child(child), log };
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let (c, b) = admin(ns, "GET", "/admin/v1/health", "");
            if c == 200
                && serde_json::from_str::<serde_json::Value>(&b).is_ok_and(|h| h["bootstrap_status"] != "pending")
            {
                return g;
            }
            if let Ok(Some(st)) = g.child.child().try_wait() {
                panic!("cube-egress exited ({st}):\n{}", g.log());
            }
            assert!(Instant::now() < end, "cube-egress not up after 30 s:\n{}", g.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the gateway and waits until its admin API in `ns` no longer answers.
    pub fn stop(mut self, ns: &TestNetns) {
        let _ = self.child.child().kill();
        let _ = self.child.child().wait();
        crate::wait_for("gateway down", Duration::from_secs(5), || admin(ns, "GET", "/admin/v1/health", "").0 == 0);
    }

    /// The gateway's stdout and stderr so far (every start in this directory).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// `GET path` on the admin API of the gateway in `ns` as JSON: `None` on 404; panics on any
/// other status or a body that is not JSON.
pub fn admin_json(ns: &TestNetns, path: &str) -> Option<serde_json::Value> {
    match admin(ns, "GET", path, "") {
        (200, b) => Some(serde_json::from_str(&b).unwrap_or_else(|e| panic!("GET {path}: {e}: {b}"))),
        (404, _) => None,
        (c, b) => panic!("GET {path}: {c} {b}"),
    }
}
