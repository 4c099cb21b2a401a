//! The chart's CubeEgress slot entrypoint (`deploy/images/cube-egress-slot.sh`) during a CA
//! rotation: a standby slot that parked before the CA Secret changed must start its gateway
//! with the Secret's current CA, not a copy taken when the slot started (decision O6).
//!
//! No root: the image's programs are stand-ins in a temporary `CUBENET_IMAGE_BIN` — the
//! namespace wrapper runs its command (and answers the health poll from a flag file), and
//! `cube-egress` records the CA it was given — while the script and `openssl` are real.

use std::{
    io::{BufRead, BufReader},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use cubenet_tests::netns::ChildGuard;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

fn write_exec(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn openssl(args: &[&str]) -> String {
    let o = Command::new("openssl").args(args).output().expect("openssl");
    assert!(o.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// A SEC1 EC key (`EC PRIVATE KEY`, what Helm's `genPrivateKey "ecdsa"` writes) at `path`.
fn sec1_key(path: &Path) {
    openssl(&["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", path.to_str().unwrap()]);
    assert!(std::fs::read_to_string(path).unwrap().starts_with("-----BEGIN EC PRIVATE KEY-----"));
}

fn public_key(path: &Path) -> String {
    openssl(&["pkey", "-in", path.to_str().unwrap(), "-pubout"])
}

#[test]
fn parked_standby_takes_over_with_the_rotated_ca() {
    let dir = std::env::temp_dir().join(format!("cubenet-egress-slot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (bin, ca, run) = (dir.join("bin"), dir.join("ca"), dir.join("run"));
    for d in [&bin, &ca, &run] {
        std::fs::create_dir_all(d).unwrap();
    }
    let alive = dir.join("alive");
    let seen = dir.join("seen");
    // The wrapper: the health poll (`timeout 3 wget …`) succeeds while the flag exists.
    write_exec(
        &bin.join("cubenet-netns-exec.sh"),
        &format!("#!/bin/bash\nif [[ \"$1\" == timeout ]]; then [[ -e {} ]]; exit; fi\nexec \"$@\"\n", alive.display()),
    );
    // The gateway: records the CA directory it was given, then exits.
    write_exec(
        &bin.join("cube-egress"),
        &format!(
            "#!/bin/bash\ncat \"$CUBE_EGRESS_CA_DIR/cube-root-ca.crt\" \"$CUBE_EGRESS_CA_DIR/cube-root-ca.key\" > {s}.tmp\nmv {s}.tmp {s}\n",
            s = seen.display()
        ),
    );
    sec1_key(&ca.join("cube-root-ca.key"));
    std::fs::write(ca.join("cube-root-ca.crt"), "cert A\n").unwrap();
    std::fs::write(&alive, "").unwrap();

    let mut slot = ChildGuard::from_child(
        Command::new("bash")
            .arg(root().join("deploy/images/cube-egress-slot.sh"))
            .env("CUBENET_IMAGE_BIN", &bin)
            .env("CUBE_EGRESS_CA_DIR", &ca)
            .env("CUBE_EGRESS_RUN_DIR", &run)
            .env("CUBE_EGRESS_SLOT", "b")
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = slot.child().stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut log = Vec::new();
    while !log.iter().any(|l: &String| l.contains("parked as standby")) {
        log.push(rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e}: {log:?}")));
    }

    // The rotation, as the kubelet applies a changed Secret to the mounted volume.
    let new_key = dir.join("new.key");
    sec1_key(&new_key);
    std::fs::copy(&new_key, ca.join("cube-root-ca.key")).unwrap();
    std::fs::write(ca.join("cube-root-ca.crt"), "cert B\n").unwrap();
    // The active gateway stops answering: the standby takes over.
    std::fs::remove_file(&alive).unwrap();
    let st = slot.exit_within(Duration::from_secs(30)).expect("the standby never took over");
    assert!(st.success(), "{st:?}");
    while let Ok(l) = rx.try_recv() {
        log.push(l);
    }

    let got = std::fs::read_to_string(&seen).unwrap();
    assert!(got.starts_with("cert B\n"), "the gateway got the CA from before the rotation: {got}\n{log:?}");
    // Converted to PKCS#8 for cube-egress, and the rotated key, not the old one.
    let key = dir.join("got.key");
    std::fs::write(&key, got.trim_start_matches("cert B\n")).unwrap();
    assert!(got.contains("-----BEGIN PRIVATE KEY-----"), "{got}");
    assert_eq!(public_key(&key), public_key(&new_key), "{log:?}");
    assert!(log.iter().any(|l| l.contains("taking over")) && log.iter().any(|l| l.contains("PKCS#8")), "{log:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
