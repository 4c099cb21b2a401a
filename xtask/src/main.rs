//! Developer tasks. `cargo xtask build-ebpf [--release]` builds the CubeVS eBPF object;
//! `cargo xtask clippy-ebpf` lints the eBPF crate with the nightly toolchain;
//! `cargo xtask bench egress` benchmarks cube-egress against mitmproxy (root);
//! `cargo xtask reliability [--long]` runs the reliability suite (root).

mod reliability;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "CubeNet developer tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the CubeVS eBPF object (with BTF) into `target/ebpf/cubevs.bpf.o`.
    BuildEbpf {
        /// Use the release profile (default: dev profile, still optimised for the verifier).
        #[arg(long)]
        release: bool,
    },
    /// Run clippy on the eBPF crate for bpfel-unknown-none with `-D warnings`.
    ClippyEbpf,
    /// Run benchmarks (root): print a table, write JSON, refresh docs/benchmarks.md.
    /// Names: per-packet, throughput (crr: its connect-request-close rows alone), scale, agent, agent-sessions, agent-scale, gateway-swap,
    /// upgrade, soak (`--minutes`), xdp, dns, l7 (cubenet-bench) and egress (cube-egress vs mitmproxy;
    /// BENCH_SECS, BENCH_CONC); default: the first five. Never fails on time.
    Bench {
        /// Benchmarks to run.
        names: Vec<String>,
        /// Also write the cubenet-bench results as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Repetitions of each throughput measurement.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Length of `soak` in minutes (default 10).
        #[arg(long)]
        minutes: Option<f64>,
    },
    /// Run the reliability suite (root): fuzzing (20,000 frames per program; --long:
    /// 1,000,000), storms, crash points; prints a table and writes JSON
    /// (default target/reliability.json).
    Reliability {
        /// Long mode (benchmark-sized).
        #[arg(long)]
        long: bool,
        /// Fuzz seed (default: the tests' fixed seed).
        #[arg(long)]
        seed: Option<u64>,
        /// Where to write the JSON report.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

/// mitmproxy version the egress benchmark installs into `target/mitmproxy-venv` (PyPI).
const MITMPROXY_VERSION: &str = "11.0.2";

fn bench_egress() -> Result<()> {
    let root = workspace_root();
    let target = target_dir(&root);
    // One invocation, so both targets share one feature resolution (no double build).
    let mut build = Command::new("cargo");
    build.current_dir(&root).args(["build", "--release", "-p", "cube-egress", "-p", "cubenet-tests"]);
    build.args(["--bin", "cube-egress", "--example", "egress_bench"]);
    run(build)?;
    // mitmproxy in its own virtualenv, so the system Python is left alone.
    let venv = target.join("mitmproxy-venv");
    let mitmdump = venv.join("bin/mitmdump");
    if !mitmdump.exists() {
        let mut mk = Command::new("python3");
        mk.args(["-m", "venv"]).arg(&venv);
        run(mk)?;
        let mut pip = Command::new(venv.join("bin/pip"));
        pip.args(["install", "-q", &format!("mitmproxy=={MITMPROXY_VERSION}")]);
        run(pip)?;
    }
    let mut bench = Command::new(target.join("release/examples/egress_bench"));
    bench.env("MITMDUMP", &mitmdump).env("CUBE_EGRESS_BIN", target.join("release/cube-egress"));
    bench.env("CUBE_EGRESS_LOG", "warn");
    run(bench)
}

/// Toolchain that builds the eBPF crate: its LLVM major must match bpf-linker's (22 here).
const EBPF_TOOLCHAIN: &str = "nightly";
const EBPF_TARGET: &str = "bpfel-unknown-none";
const EBPF_PACKAGE: &str = "cubevs-ebpf";
const EBPF_BIN: &str = "cubevs";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"))
}

/// A `cargo +nightly …` command for the eBPF target, with the environment of the outer
/// (stable) cargo removed so the inner one picks its own toolchain.
fn ebpf_cargo(root: &Path, sub: &str) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root)
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env(
            "CARGO_TARGET_BPFEL_UNKNOWN_NONE_RUSTFLAGS",
            // BTF is required for pinned-map reuse and CO-RE (../shared/reference/toolchain.md).
            "--cfg=bpf_target_arch=\"x86_64\" -Cdebuginfo=2 -Clink-arg=--btf -Ctarget-cpu=v3",
        )
        .args([
            &format!("+{EBPF_TOOLCHAIN}"),
            sub,
            "-p",
            EBPF_PACKAGE,
            "--target",
            EBPF_TARGET,
            "-Z",
            "build-std=core",
        ]);
    cmd
}

fn run(mut cmd: Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("spawn {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn build_ebpf(release: bool) -> Result<()> {
    let root = workspace_root();
    let mut cmd = ebpf_cargo(&root, "build");
    cmd.arg("--bins");
    if release {
        cmd.arg("--release");
    }
    run(cmd)?;
    let target = target_dir(&root);
    let built = target.join(EBPF_TARGET).join(if release { "release" } else { "debug" }).join(EBPF_BIN);
    let out_dir = target.join("ebpf");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("create {}", out_dir.display()))?;
    let out = out_dir.join(cubevs_common::OBJECT_FILE_NAME);
    std::fs::copy(&built, &out).with_context(|| format!("copy {} to {}", built.display(), out.display()))?;
    println!("eBPF object: {}", out.display());
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::BuildEbpf { release } => build_ebpf(release),
        Cmd::Bench { names, json, rounds, minutes } => {
            let egress = names.iter().any(|n| n == "egress");
            let names: Vec<String> = names.into_iter().filter(|n| n != "egress").collect();
            if egress {
                bench_egress()?;
                if names.is_empty() {
                    return Ok(());
                }
            }
            build_ebpf(true)?;
            let root = workspace_root();
            // The agent benchmark starts the release network-agent; gateway-swap (also part of
            // upgrade) and l7 the release cube-egress.
            let mut build = Command::new("cargo");
            build.current_dir(&root).args([
                "build",
                "--release",
                "--quiet",
                "--bins",
                "-p",
                "network-agent",
                "-p",
                "cubenet-bench",
            ]);
            if names.iter().any(|n| n == "gateway-swap" || n == "upgrade" || n == "l7") {
                build.args(["-p", "cube-egress"]);
            }
            run(build)?;
            let mut cmd = Command::new("cargo");
            cmd.current_dir(&root).args(["run", "--release", "--quiet", "-p", "cubenet-bench", "--"]).args(&names);
            cmd.env("CUBENET_BIN_DIR", target_dir(&root).join("release"));
            // Agent state, sockets and pins on tmpfs, like the agent's default state_dir.
            cmd.env("TMPDIR", "/dev/shm");
            cmd.arg("--rounds").arg(rounds.to_string());
            let soak = names.iter().any(|n| n == "soak");
            if let Some(m) = minutes {
                cmd.arg("--minutes").arg(m.to_string());
            }
            // The soak is a time series of one machine's run, not a figure for the benchmark
            // table: it writes its rows as JSON (default target/bench-soak.json) beside its
            // series (target/soak.json) and plot (target/soak.png), and leaves
            // docs/benchmarks.md alone.
            if !soak {
                cmd.arg("--markdown").arg(root.join("docs").join("benchmarks.md"));
            }
            match json {
                Some(j) => {
                    cmd.arg("--json").arg(j);
                }
                None if soak => {
                    cmd.arg("--json").arg(target_dir(&root).join("bench-soak.json"));
                }
                None => {}
            }
            run(cmd)
        }
        Cmd::Reliability { long, seed, json } => {
            build_ebpf(true)?;
            reliability::run(workspace_root(), long, seed, json)
        }
        Cmd::ClippyEbpf => {
            let mut cmd = ebpf_cargo(&workspace_root(), "clippy");
            cmd.args(["--", "-D", "warnings"]);
            run(cmd)
        }
    }
}
