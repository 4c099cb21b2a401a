//! Start-up checks of the `cube-egress` binary that need no root: it refuses a CA whose key
//! does not match, an expired CA, and a bad configuration (including a non-loopback admin
//! listener), before binding anything.

use std::{path::Path, process::Command};

use rcgen::{CertificateParams, DnType, IsCa, KeyPair};

fn write_ca(dir: &Path, days: i64, key_for_file: Option<&KeyPair>) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, "cli test CA");
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::days(10);
    p.not_after = now + time::Duration::days(days);
    let cert = p.self_signed(&key).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("cube-root-ca.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("cube-root-ca.key"), key_for_file.unwrap_or(&key).serialize_pem()).unwrap();
}

fn run(dir: &Path, extra: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cube-egress"))
        .args(["--ca-dir", dir.to_str().unwrap(), "--audit-file", dir.join("a.jsonl").to_str().unwrap()])
        .args(["--listen-ip", "127.0.0.1", "--http-port", "0", "--https-port", "0"])
        .args(if extra.contains(&"--admin-addr") { &[][..] } else { &["--admin-addr", "127.0.0.1:0"][..] })
        .args(extra)
        .env("CUBE_EGRESS_LOG", "error")
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn refuses_bad_ca_and_bad_config() {
    let base = std::env::temp_dir().join(format!("cube-egress-cli-{}", std::process::id()));
    let other = KeyPair::generate().unwrap();
    write_ca(&base.join("mismatch"), 365, Some(&other));
    let (code, err) = run(&base.join("mismatch"), &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("does not match"), "{err}");

    write_ca(&base.join("expired"), -1, None);
    let (code, err) = run(&base.join("expired"), &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("expired"), "{err}");

    let (code, err) = run(&base.join("expired"), &["--sandbox-cidr", "10.0.0.0/33"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("sandbox_cidr"), "{err}");
    // The admin API must stay on loopback (refused before the CA is even read).
    let (code, err) = run(&base.join("expired"), &["--admin-addr", "0.0.0.0:9091"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("admin_addr") && err.contains("loopback"), "{err}");
    let (code, err) = run(&base.join("missing"), &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cube-root-ca.crt"), "{err}");
    // It says what belongs there and which key sets the directory (O9).
    let missing = base.join("missing").join("cube-root-ca.crt");
    assert!(
        err.contains(&format!("CA certificate {} not found: ca_dir (--ca-dir, CUBE_EGRESS_CA_DIR)", missing.display()))
            && err.contains("cube-root-ca.key"),
        "{err}"
    );
    std::fs::remove_dir_all(&base).unwrap();
}
