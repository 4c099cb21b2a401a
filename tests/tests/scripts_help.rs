//! The README's two commands and `k8s-demo.sh` answer `--help` without installing, building or testing anything,
//! and `test.sh` / `k8s-demo.sh` refuse an argument it does not know instead of running everything.
//! Run with `PATH` pointing nowhere, so a regression fails at once (no `bash scripts/setup.sh`,
//! no `cargo`) instead of starting a build (no root needed).

use std::process::{Command, Output, Stdio};

fn script(name: &str, arg: &str) -> Output {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    Command::new("/bin/bash")
        .arg(root.join("scripts").join(name))
        .arg(arg)
        .env("PATH", "/nonexistent")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn demo_and_test_scripts_print_help_without_building() {
    let demo = script("demo.sh", "--help");
    let out = String::from_utf8_lossy(&demo.stdout);
    assert_eq!(demo.status.code(), Some(0), "{demo:?}");
    assert!(out.starts_with("The main job in one command") && out.contains("--guests 1|2|3|4"), "{out}");
    let test = script("test.sh", "-h");
    let out = String::from_utf8_lossy(&test.stdout);
    assert_eq!(test.status.code(), Some(0), "{test:?}");
    assert!(out.contains("--tests-only [ARGS...]"), "{out}");
    let k8s = script("k8s-demo.sh", "--help");
    assert_eq!(k8s.status.code(), Some(0), "{k8s:?}");
    assert!(String::from_utf8_lossy(&k8s.stdout).contains("podman kube play"), "{k8s:?}");
    assert_eq!(script("k8s-demo.sh", "--keep").status.code(), Some(2));
    let bad = script("test.sh", "--release");
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown argument --release"), "{bad:?}");
}
