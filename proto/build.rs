//! Generates the tonic client and server from `proto/network_agent.proto` with `protoc`
//! (Debian `protobuf-compiler`, installed by `scripts/setup.sh`; `$PROTOC` overrides).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/network_agent.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/network_agent.proto"], &["proto"])?;
    Ok(())
}
