//! `cube-egress`: see the crate docs of `cube_egress` and the README's CubeEgress section.

use clap::Parser;
use cube_egress::config::{Cli, Config};

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CUBE_EGRESS_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = match Config::load(Cli::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cube-egress: config: {e:#}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cube-egress: runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(cube_egress::run(cfg)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cube-egress: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
