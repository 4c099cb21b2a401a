//! Kubernetes deployment: the Helm chart `deploy/helm/cubenet` rendered and validated offline.
//!
//! `chart_renders_and_validates` (no root needed) runs `deploy/tools/chart_check.py check` in
//! the venv of `scripts/k8s-venv.sh` (helm-python-sdk 0.2.2 = Helm v4's SDK, kubernetes-validate
//! 1.37.0): `helm lint --strict`, render of every mode × CA-mode variant, `kubernetes-validate
//! --strict` on every object, the project's semantic asserts (and mutations proving they bite),
//! and values the chart must refuse. Then every rendered agent `config.toml` goes through the
//! real `network-agent --check-config`. When the venv cannot be installed (no network), the
//! test prints a `SKIPPED:` line and passes.
//!
//! The surge upgrade's values (K15: `underlay.surge`, `hostPaths.handoverDir`, no health
//! hostPort) are among the variants, asserts, mutations and refusals of `chart_check.py`.
//!
//! The pod runs (`podman kube play` of the rendered DaemonSet template) are in `k8s_pod.rs`
//! (in-place update) and `k8s_surge.rs` (surge upgrade with hand-over).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

/// The venv's python, or `None` after printing a `SKIPPED:` line.
fn k8s_python(test: &str) -> Option<PathBuf> {
    let out = Command::new("bash").arg(root().join("scripts/k8s-venv.sh")).output().expect("run k8s-venv.sh");
    if !out.status.success() {
        eprintln!(
            "\nSKIPPED: {test}: scripts/k8s-venv.sh could not install helm-python-sdk / kubernetes-validate \
             (PyPI unreachable?): {}\n",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()))
}

#[test]
fn chart_renders_and_validates() {
    let Some(py) = k8s_python("chart_renders_and_validates") else { return };
    let out_dir = root().join(format!("target/k8s/chart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let out = Command::new(&py)
        .arg(root().join("deploy/tools/chart_check.py"))
        .arg("check")
        .arg(&out_dir)
        .output()
        .expect("run chart_check.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "chart_check.py check failed:\n{stdout}");
    assert!(stdout.contains(" 0 failures"), "no summary line:\n{stdout}");

    // Every variant's agent configuration must be accepted by the agent itself.
    let agent = root().join("target/debug/network-agent");
    if !agent.exists() {
        cubenet_tests::skip(
            "chart_renders_and_validates",
            format!("the --check-config part: {} not built", agent.display()),
        );
    } else {
        let mut checked = 0;
        for entry in std::fs::read_dir(&out_dir).unwrap() {
            let cfg = entry.unwrap().path().join("config.toml");
            if !cfg.exists() {
                continue;
            }
            let o = Command::new(&agent).arg("--config").arg(&cfg).arg("--check-config").output().unwrap();
            assert!(
                o.status.success(),
                "network-agent --check-config refused {}: {}",
                cfg.display(),
                String::from_utf8_lossy(&o.stderr)
            );
            checked += 1;
        }
        assert_eq!(checked, 7, "expected the seven variants' config.toml");
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}
