//! CubeEgress active/standby swap under load, through the real TPROXY path (rig:
//! `cubenet_tests::egress_swap`).
//!
//! `egress_gateway_swap_under_load`: 12 keep-alive HTTPS clients and 4 connection-per-request
//! HTTPS clients run for the whole test. Meanwhile: a successor with a bad config exits and
//! changes nothing; a successor that takes the sockets and dies before READY leaves the old
//! gateway serving with its admin API unfrozen; then slot B takes over from slot A. Asserted:
//! 0 failed handshakes, 0 failed requests, every request answered once and seen once by the
//! world, the credential injected on every request (the learned address moved with the policy),
//! one complete audit record per request, the old gateway exits 0 after draining.
//!
//! Resumption across the swap (E23): an `openssl s_client` session saved against slot A
//! resumes against slot B (`Reused`, same answer); the load's clients (rustls defaults, shared
//! session store) do no full handshake after B was spawned. A TLS 1.2 session resumed by
//! session ID only (`openssl s_client -tls1_2 -no_ticket`) made with A resumes with B too
//! (E26). The dying successor of step 2 asks for the extras (ticket keys, leaf keys, TLS 1.2
//! sessions) the way a real one does; none of those key bytes appears in either gateway's log
//! or in the audit file.

use std::{
    collections::{HashMap, HashSet},
    io::Read,
    time::Duration,
};

use cubenet_tests::{
    egress_swap::{ADMIN, NAME, SANDBOX_IP, SwapRig, egress_bin, sigterm, text, wait_exit},
    require_root, wait_for,
};
use serde_json::Value;

#[test]
fn egress_gateway_swap_under_load() {
    if !require_root("egress_gateway_swap_under_load") {
        return;
    }
    let rig = SwapRig::new();
    let mut a = rig.spawn_gateway_logged(&egress_bin(), "a", &[]);
    rig.configure();
    // A TLS session of a real client at its defaults, made with slot A.
    let sess = rig.dir.join("ossl.sess");
    let first = rig.openssl_get("/ossl/1", &sess, false);
    assert!(first.contains("New, TLSv1.3") && first.contains("ok /ossl/1"), "{first}");
    // E26: a client that resumes by TLS 1.2 session ID only (no ticket extension).
    let (sess12, tls12) = (rig.dir.join("ossl12.sess"), ["-tls1_2", "-no_ticket"]);
    let first12 = rig.openssl_get_with("/ossl/12a", &sess12, false, &tls12);
    assert!(first12.contains("New, TLSv1.2") && first12.contains("ok /ossl/12a"), "{first12}");
    let with_a = rig.openssl_get_with("/ossl/12b", &sess12, true, &tls12);
    assert!(with_a.contains("Reused, TLSv1.2") && with_a.contains("ok /ossl/12b"), "{with_a}");
    // Warm the leaf cache so the first handshakes do not race the per-sandbox mint budget.
    let warm = rig.start_load(1, 0, Duration::from_millis(300)).join().unwrap();
    assert!(warm.ok > 0 && warm.failed_requests + warm.failed_connects == 0, "warm-up: {warm:?}");

    let load = rig.start_load(12, 4, Duration::from_secs(9));
    std::thread::sleep(Duration::from_millis(1000));

    // 1. A successor with a bad configuration exits 2 before touching the handoff socket.
    let sock = rig.handoff_socket();
    let mut bad_args = rig.gateway_args(&["--takeover-socket", sock.to_str().unwrap()]);
    let cidr = bad_args.iter().position(|x| x == "--sandbox-cidr").unwrap();
    bad_args[cidr + 1] = "not-a-cidr".into();
    let o = rig.topo.node.command(egress_bin().to_str().unwrap()).args(&bad_args).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "bad config must fail: {}", text(&o));
    assert!(a.child().try_wait().unwrap().is_none(), "the running gateway must survive a failed successor");

    // 2. A successor that takes the sockets, the state and the extras, then dies before READY.
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut first = [0u8; 23];
    c.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"cube-egress-handoff v2\n");
    let doc = |c: &mut std::os::unix::net::UnixStream| -> Value {
        let mut len = [0u8; 4];
        c.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        c.read_exact(&mut body).unwrap();
        serde_json::from_slice(&body).unwrap()
    };
    let _state = doc(&mut c);
    std::io::Write::write_all(&mut c, b"more1\n").unwrap();
    let extras = doc(&mut c);
    drop(c);
    let mut secrets: Vec<String> = Vec::new();
    for k in extras["ticket_keys"].as_array().expect("ticket keys handed over") {
        secrets.push(k["key"].as_str().unwrap().to_string());
    }
    for l in extras["leaves"].as_array().expect("leaves handed over") {
        secrets.push(l["key"].as_str().unwrap().to_string());
    }
    let sessions = extras["tls12_sessions"].as_array().expect("TLS 1.2 sessions handed over");
    assert!(!sessions.is_empty(), "the TLS 1.2 session made with A is handed over");
    for x in sessions {
        secrets.push(x["value"].as_str().unwrap().to_string());
    }
    assert!(secrets.len() >= 3, "a ticket key, the leaf of {NAME}, a TLS 1.2 session: {}", secrets.len());
    let learned = serde_json::json!({"names": {NAME: ["198.51.100.1"]}, "ttl_secs": 600}).to_string();
    let put_learned = || rig.admin(&["-X", "PUT", "--data", &learned, &format!("{ADMIN}/learned/{SANDBOX_IP}")]);
    wait_for("admin unfrozen after the aborted hand-over", Duration::from_secs(12), || put_learned().0 == 200);
    assert!(a.child().try_wait().unwrap().is_none(), "the old gateway keeps serving after an aborted hand-over");
    std::thread::sleep(Duration::from_millis(1000));

    // 3. The swap: slot B takes the listeners and the state; slot A drains and exits.
    let spawned = std::time::Instant::now();
    let mut b = rig.spawn_gateway_logged(&egress_bin(), "b", &["--takeover-socket", sock.to_str().unwrap()]);
    let status = wait_exit(&mut a, Duration::from_secs(25)).expect("old gateway exits after draining");
    assert!(status.success(), "old gateway exit: {status}");
    assert!(b.child().try_wait().unwrap().is_none(), "successor running");
    let report = load.join().unwrap();
    eprintln!(
        "swap load: ok {} closes {} failed connects {} failed requests {} resets {} max gap {:?}",
        report.ok, report.closes, report.failed_connects, report.failed_requests, report.resets, report.max_gap
    );
    assert_eq!(
        (report.failed_connects, report.failed_requests, report.resets),
        (0, 0, 0),
        "failures during the swap: {:#?}",
        report.errors
    );
    assert!(report.ok > 100, "too little load to prove anything: {report:?}");
    assert!(report.closes > 0, "keep-alive clients were asked to reconnect by the draining gateway");
    let from = Duration::from_secs_f64(report.instant_ms(spawned).max(0.0) / 1e3);
    let after: Vec<_> = report.full_handshakes.iter().filter(|t| **t >= from).collect();
    let reconnects = report.connects.iter().filter(|(t, _)| *t >= from).count();
    eprintln!("connects after B was spawned: {reconnects}, full handshakes among them: {}", after.len());
    assert!(reconnects > 0, "clients reconnected to the successor");
    assert!(after.is_empty(), "full handshakes after the swap (sessions should resume): {after:?}");
    let blog = std::fs::read_to_string(rig.dir.join("b.log")).unwrap();
    let phases: Vec<&str> = blog
        .lines()
        .filter(|l| l.contains("startup phases") || l.contains("state taken over") || l.contains("gateway state built"))
        .collect();
    eprintln!("successor start-up:\n{}", phases.join("\n"));
    assert!(blog.contains("\"ticket_keys\":1") || blog.contains("\"ticket_keys\":2"), "ticket keys taken: {blog}");

    // The session made with A resumes with B and gets the same answer.
    let again = rig.openssl_get("/ossl/2", &sess, true);
    assert!(again.contains("Reused, TLSv1.3") && again.contains("ok /ossl/2"), "{again}");
    // The TLS 1.2 session ID made with A resumes with B (E26), same answer.
    assert!(!blog.contains("\"tls12_sessions\":0") && blog.contains("\"tls12_sessions\":"), "{blog}");
    let again12 = rig.openssl_get_with("/ossl/12c", &sess12, true, &tls12);
    assert!(again12.contains("Reused, TLSv1.2") && again12.contains("ok /ossl/12c"), "{again12}");
    let (code, metrics) = rig.admin(&["http://127.0.0.1:9091/metrics"]);
    assert_eq!(code, 200);
    let resumed = metrics.lines().find(|l| l.starts_with("cube_egress_tls_handshakes_total{kind=\"resumed\"}"));
    assert!(resumed.is_some_and(|l| !l.ends_with(" 0")), "B counts resumed handshakes: {metrics}");

    // The successor has the policy and the learned table (moved, not re-learned).
    let (code, health) = rig.admin(&[&format!("{ADMIN}/health")]);
    assert!(code == 200 && health.contains("\"policy_count\":1"), "{health}");
    let (code, l) = rig.admin(&[&format!("{ADMIN}/learned/{SANDBOX_IP}")]);
    assert!(code == 200 && l.contains(NAME), "learned table on the successor: {l}");

    // Exactly once at the world, with the credential (learned binding) every time.
    let seen = rig.seen.lock().unwrap().clone();
    let ok: HashSet<&String> = report.ok_paths.iter().collect();
    assert_eq!(ok.len(), report.ok_paths.len(), "a path answered twice");
    for p in &report.ok_paths {
        let s = seen.get(p).unwrap_or_else(|| panic!("{p} answered but never reached the world"));
        assert_eq!(s.count, 1, "{p} reached the world {} times", s.count);
        assert_eq!(s.with_credential, 1, "{p} lacks the injected credential");
    }
    let answered: HashSet<&String> = ok.iter().copied().chain(warm.ok_paths.iter()).collect();
    let extra: Vec<_> = seen.keys().filter(|k| k.starts_with("/swap/") && !answered.contains(k)).collect();
    assert!(extra.is_empty(), "requests that reached the world without an answer: {extra:?}");

    // Audit: after the successor stops, one complete allow record per request.
    sigterm(&b);
    let status = wait_exit(&mut b, Duration::from_secs(25)).expect("successor exits on SIGTERM");
    assert!(status.success(), "successor exit: {status}");
    let lines = rig.audit_lines();
    let mut per_path: HashMap<&str, u32> = HashMap::new();
    for l in lines.iter().filter(|l| l["event"] == "http_request") {
        let p = l["http"]["path"].as_str().unwrap_or_default();
        if p.starts_with("/swap/") {
            assert_eq!(l["http"]["status"], 200, "{l}");
            assert_eq!(l["policy"]["decision"], "allow", "{l}");
            *per_path.entry(p).or_default() += 1;
        }
    }
    for p in &report.ok_paths {
        assert_eq!(per_path.get(p.as_str()).copied(), Some(1), "audit records of {p}");
    }
    assert!(lines.iter().any(|l| l["security"]["reason"] == "handoff_aborted"), "the aborted hand-over is audited");

    // No key material handed over appears in either log or in the audit file.
    let logs = ["a.log", "b.log"].map(|n| std::fs::read_to_string(rig.dir.join(n)).unwrap());
    let audit = std::fs::read_to_string(rig.audit_file()).unwrap();
    for k in &secrets {
        for (what, t) in [("a.log", &logs[0]), ("b.log", &logs[1]), ("audit", &audit)] {
            assert!(!t.to_ascii_lowercase().contains(k.as_str()), "key material in {what}");
        }
    }
}

/// E24 with real binaries: a pre-E24 build (`CUBENET_BASELINE_EGRESS`; `scripts/test.sh`
/// builds 7c0ffea's `cube-egress`; reported skipped without it) hands over to this build, which hands back to the
/// pre-E24 build (a rollback). Each swap completes (predecessor exits 0 after READY), the
/// policy survives both, requests are answered after each; this build logs that its
/// predecessor predates the extras, and the pre-E24 predecessor audits the refused request
/// once (`handoff_aborted`).
#[test]
fn egress_swap_with_a_pre_e24_build() {
    if !require_root("egress_swap_with_a_pre_e24_build") {
        return;
    }
    let Some(old) = std::env::var_os("CUBENET_BASELINE_EGRESS").map(std::path::PathBuf::from) else {
        cubenet_tests::skip(
            "egress_swap_with_a_pre_e24_build",
            "CUBENET_BASELINE_EGRESS names no pre-E24 cube-egress (scripts/test.sh builds one from git history)",
        );
        return;
    };
    let rig = SwapRig::new();
    let sock = rig.handoff_socket();
    let take = ["--takeover-socket", sock.to_str().unwrap()];
    let mut a = rig.spawn_gateway_logged(&old, "old1", &[]);
    rig.configure();
    let sess = rig.dir.join("ossl.sess");
    let out = rig.openssl_get("/ossl/o1", &sess, false);
    assert!(out.contains("ok /ossl/o1"), "{out}");

    // Upgrade: pre-E24 A → this build.
    let mut b = rig.spawn_gateway_logged(&egress_bin(), "new1", &take);
    let status = wait_exit(&mut a, Duration::from_secs(25)).expect("pre-E24 predecessor exits after the swap");
    assert!(status.success(), "pre-E24 predecessor exit: {status}");
    let (code, health) = rig.admin(&[&format!("{ADMIN}/health")]);
    assert!(code == 200 && health.contains("\"policy_count\":1"), "{health}");
    let blog = std::fs::read_to_string(rig.dir.join("new1.log")).unwrap();
    assert!(blog.contains("predates hand-over extras"), "fallback logged: {blog}");
    let out = rig.openssl_get("/ossl/o2", &sess, true);
    assert!(out.contains("ok /ossl/o2"), "{out}");

    // Rollback: this build → pre-E24 C (never asks for extras).
    let mut c = rig.spawn_gateway_logged(&old, "old2", &take);
    let status = wait_exit(&mut b, Duration::from_secs(25)).expect("this build exits after handing back");
    assert!(status.success(), "exit: {status}");
    let (code, health) = rig.admin(&[&format!("{ADMIN}/health")]);
    assert!(code == 200 && health.contains("\"policy_count\":1"), "{health}");
    let out = rig.openssl_get("/ossl/o3", &sess, true);
    assert!(out.contains("ok /ossl/o3"), "{out}");
    sigterm(&c);
    assert!(wait_exit(&mut c, Duration::from_secs(25)).is_some_and(|s| s.success()));
    let aborted = rig.audit_lines().iter().filter(|l| l["security"]["reason"] == "handoff_aborted").count();
    assert_eq!(aborted, 1, "the pre-E24 predecessor refused the extras request once");
}

/// E26 with real binaries: a build with the extras but without TLS 1.2 sessions
/// (`CUBENET_PRE_E26_EGRESS`; `scripts/test.sh` builds 420fe3d's `cube-egress`; reported
/// skipped without it) hands over to this build, which hands back to it (a rollback). Each swap
/// completes, the policy survives both, and a client resuming by TLS 1.2 session ID only is
/// answered after each: with a full handshake after the upgrade (the older predecessor sends
/// no sessions); after the rollback only the answer is asserted (the older successor ignores
/// the sessions it is sent and has its own per-leaf caches).
#[test]
fn egress_swap_with_a_pre_e26_build() {
    if !require_root("egress_swap_with_a_pre_e26_build") {
        return;
    }
    let Some(old) = std::env::var_os("CUBENET_PRE_E26_EGRESS").map(std::path::PathBuf::from) else {
        cubenet_tests::skip(
            "egress_swap_with_a_pre_e26_build",
            "CUBENET_PRE_E26_EGRESS names no pre-E26 cube-egress (scripts/test.sh builds one from git history)",
        );
        return;
    };
    let rig = SwapRig::new();
    let sock = rig.handoff_socket();
    let take = ["--takeover-socket", sock.to_str().unwrap()];
    let (sess12, tls12) = (rig.dir.join("ossl12.sess"), ["-tls1_2", "-no_ticket"]);
    let mut a = rig.spawn_gateway_logged(&old, "old1", &[]);
    rig.configure();
    let out = rig.openssl_get_with("/ossl/p1", &sess12, false, &tls12);
    assert!(out.contains("New, TLSv1.2") && out.contains("ok /ossl/p1"), "{out}");

    // Upgrade: pre-E26 A → this build; A's extras carry no sessions.
    let mut b = rig.spawn_gateway_logged(&egress_bin(), "new1", &take);
    let status = wait_exit(&mut a, Duration::from_secs(25)).expect("pre-E26 predecessor exits after the swap");
    assert!(status.success(), "pre-E26 predecessor exit: {status}");
    let blog = std::fs::read_to_string(rig.dir.join("new1.log")).unwrap();
    assert!(blog.contains("\"tls12_sessions\":0") && blog.contains("\"ticket_keys\":"), "{blog}");
    let out = rig.openssl_get_with("/ossl/p2", &sess12, true, &tls12);
    assert!(out.contains("New, TLSv1.2") && out.contains("ok /ossl/p2"), "no sessions came over: {out}");

    // Rollback: this build → pre-E26 C, which ignores the sessions it is sent.
    let mut c = rig.spawn_gateway_logged(&old, "old2", &take);
    let status = wait_exit(&mut b, Duration::from_secs(25)).expect("this build exits after handing back");
    assert!(status.success(), "exit: {status}");
    let (code, health) = rig.admin(&[&format!("{ADMIN}/health")]);
    assert!(code == 200 && health.contains("\"policy_count\":1"), "{health}");
    let out = rig.openssl_get_with("/ossl/p3", &sess12, true, &tls12);
    assert!(out.contains("ok /ossl/p3"), "{out}");
    sigterm(&c);
    assert!(wait_exit(&mut c, Duration::from_secs(25)).is_some_and(|s| s.success()));
    let aborted = rig.audit_lines().iter().filter(|l| l["security"]["reason"] == "handoff_aborted").count();
    assert_eq!(aborted, 0, "no hand-over was refused");
}
