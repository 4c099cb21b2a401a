//! `cube-egress`: see the crate docs of `cube_egress` and the README's CubeEgress section.

use clap::Parser;
use cube_egress::config::{Cli, Config};

/// Log setup: filter from `CUBE_EGRESS_LOG` (default `info`), to stderr.
/// `CUBE_EGRESS_LOG_FORMAT=json` writes one JSON object per line (`timestamp`, `level`,
/// `target`, the event's fields flattened), as the Helm chart sets it; `text` (the default) is
/// the human format, coloured only when stderr is a terminal. An unknown value exits with
/// status 2.
fn init_logging() -> Result<(), String> {
    let filter = || tracing_subscriber::EnvFilter::try_from_env("CUBE_EGRESS_LOG").unwrap_or_else(|_| "info".into());
    match std::env::var("CUBE_EGRESS_LOG_FORMAT").as_deref() {
        Ok("json") => tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .init(),
        Ok("text") | Ok("") | Err(_) => {
            // Colour only on a terminal: a log file or a collector must get plain
            // `key=value` text that grep finds (decision O2).
            tracing_subscriber::fmt()
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_env_filter(filter())
                .with_writer(std::io::stderr)
                .init()
        }
        Ok(other) => return Err(format!("CUBE_EGRESS_LOG_FORMAT: unknown format {other:?} (json or text)")),
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let _ = cube_egress::PROCESS_START.set(std::time::Instant::now());
    if let Err(e) = init_logging() {
        eprintln!("cube-egress: {e}");
        return std::process::ExitCode::from(2);
    }
    let cli = Cli::parse();
    // SIGHUP re-reads the file with the same environment and flags over it (R51).
    let load: Option<cube_egress::Loader> = cli.config.is_some().then(|| {
        let cli = cli.clone();
        Box::new(move || Config::load(cli.clone())) as cube_egress::Loader
    });
    let cfg = match Config::load(cli) {
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
    match rt.block_on(cube_egress::run_reloadable(cfg, load)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cube-egress: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
