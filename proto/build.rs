//! Generates the tonic client and server from `proto/network_agent.proto` with `protoc`
//! (Debian `protobuf-compiler`, installed by `scripts/setup.sh`; `$PROTOC` overrides).
//! Also the client of `tests/network_agent_v1_old.proto` (the API before the CubeNet
//! additions, same package) into `$OUT_DIR/v1_old/`, for the wire-compatibility tests.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/network_agent.proto");
    println!("cargo:rerun-if-changed=tests/network_agent_v1_old.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/network_agent.proto"], &["proto"])?;
    let old = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("v1_old");
    std::fs::create_dir_all(&old)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .build_transport(false)
        .out_dir(&old)
        .compile_protos(&["tests/network_agent_v1_old.proto"], &["tests"])?;
    Ok(())
}
