//! What a newcomer sees when a command goes wrong before any agent is involved (no root): the
//! binaries' own error text names the path or key and says what to do.

use std::process::Command;

/// `cubenet-cli` with no agent at the socket names the endpoint and how to point it elsewhere
/// (it printed `transport error` and `No such file or directory` without the path).
#[test]
fn cli_without_an_agent_names_the_socket() {
    let out = Command::new(env!("CARGO_BIN_EXE_cubenet-cli"))
        .args(["--grpc", "unix:///nonexistent/cubenet-test/grpc.sock", "list"])
        .env("RUST_BACKTRACE", "0")
        .env("RUST_LIB_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("cubenet-cli: connect unix:///nonexistent/cubenet-test/grpc.sock: No such file or directory")
            && err.contains("CUBENET_GRPC"),
        "{err}"
    );
    // One line, no backtrace even when the shell asks for them.
    let again = Command::new(env!("CARGO_BIN_EXE_cubenet-cli"))
        .args(["--grpc", "unix:///nonexistent/cubenet-test/grpc.sock", "list"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&again.stderr).lines().count(), 1, "{again:?}");
}

/// A typo'd key in the agent's file: exit 2, the file, the line and the intended key (O1).
#[test]
fn agent_config_typo_names_line_and_suggestion() {
    let dir = std::env::temp_dir().join(format!("cubenet-cli-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("agent.toml");
    std::fs::write(&cfg, "cidr = \"10.9.0.0/24\"\nalways_denied_cidr = [\"10.0.0.1\"]\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_network-agent"))
        .arg("--config")
        .arg(&cfg)
        .arg("--check-config")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(
        err.trim(),
        format!(
            "network-agent: config {}: line 2 (always_denied_cidr = [\"10.0.0.1\"]): unknown key \
             `always_denied_cidr` (did you mean `always_denied_cidrs`? every key is in the README's \
             Configuration table; `network-agent --print-config` prints them with their values)",
            cfg.display()
        )
    );
    let _ = std::fs::remove_dir_all(&dir);
}
