//! Python grpcio as a real gRPC client of the agent (its default channel options are what
//! cubelet-side tools use): a venv with `grpcio-tools` from PyPI, and the agent's proto compiled
//! into Python stubs.

use std::path::{Path, PathBuf};

/// The Python of a venv under `target/py-grpc-venv` with `grpcio-tools` installed, created on
/// first use (marker file `.grpcio-ok`). Panics when `python3 -m venv` or `pip` fails (PyPI is
/// the one registry this machine reaches).
pub fn python_with_grpcio() -> PathBuf {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/py-grpc-venv");
    let py = venv.join("bin/python");
    if !py.exists() || !venv.join(".grpcio-ok").exists() {
        let st = std::process::Command::new("python3").args(["-m", "venv"]).arg(&venv).status().unwrap();
        assert!(st.success(), "python3 -m venv failed");
        let st =
            std::process::Command::new(&py).args(["-m", "pip", "install", "--quiet", "grpcio-tools"]).status().unwrap();
        assert!(st.success(), "pip install grpcio-tools failed");
        std::fs::write(venv.join(".grpcio-ok"), b"").unwrap();
    }
    py
}

/// Compiles `proto/proto/network_agent.proto` into `<dir>/py` (`network_agent_pb2.py`,
/// `network_agent_pb2_grpc.py`) and returns `(python, stub directory)`. Panics when `protoc` fails.
pub fn agent_stubs(dir: &Path) -> (PathBuf, PathBuf) {
    let py = python_with_grpcio();
    let pydir = dir.join("py");
    std::fs::create_dir_all(&pydir).unwrap();
    let proto_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/proto");
    let st = std::process::Command::new(&py)
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&proto_dir)
        .arg(format!("--python_out={}", pydir.display()))
        .arg(format!("--grpc_python_out={}", pydir.display()))
        .arg(proto_dir.join("network_agent.proto"))
        .status()
        .unwrap();
    assert!(st.success(), "grpc_tools.protoc failed");
    (py, pydir)
}
