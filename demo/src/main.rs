//! `cubenet-demo`: real Linux guests get their network from the network-agent. Run by
//! `scripts/demo.sh` (which installs prerequisites and builds everything first); see the
//! README's "The two commands".

use std::{
    io::Read,
    os::fd::AsRawFd,
    sync::atomic::{AtomicI32, Ordering},
};

use clap::Parser;
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

/// Plays cubelet for real Linux guests under QEMU on TAPs handed out by the network-agent,
/// in namespaces it creates, and prints a summary table. Exits 1 if any check fails.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Leave the topology, agent and guests running and print how to explore and clean up.
    #[arg(long)]
    keep: bool,
    /// Number of sandboxes (1 = default, 2 = + port mapping, 3 = + allow-list, 4 = + L7 through CubeEgress).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(1..=4))]
    guests: u8,
    /// QEMU accelerator (`tcg`, or `kvm` where KVM runs stock guest kernels); sets
    /// CUBENET_ACCEL. Default: $CUBENET_ACCEL, else tcg.
    #[arg(long)]
    accel: Option<String>,
    /// Cargo profile whose network-agent to start (default: this binary's).
    #[arg(long)]
    profile: Option<String>,
}

/// Write end of the self-pipe the signal handler writes to.
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(sig: libc::c_int) {
    let b = sig as u8;
    // SAFETY: write(2) is async-signal-safe; the fd stays open for the process lifetime.
    unsafe { libc::write(SIGNAL_PIPE.load(Ordering::Relaxed), (&raw const b).cast(), 1) };
}

/// SIGINT/SIGTERM: a handler (not a blocked mask, which children would inherit; handlers are
/// reset by exec) writes to a pipe; a thread reading it removes what the run created and
/// exits — destructors of the main thread never run then.
fn on_signal_remove_everything() {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
    SIGNAL_PIPE.store(w.as_raw_fd(), Ordering::Relaxed);
    std::mem::forget(w);
    let act = SigAction::new(SigHandler::Handler(on_signal), SaFlags::SA_RESTART, SigSet::empty());
    for s in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only calls write(2).
        unsafe { sigaction(s, &act) }.expect("sigaction");
    }
    std::thread::spawn(move || {
        let mut f = std::fs::File::from(r);
        let mut b = [0u8; 1];
        if f.read_exact(&mut b).is_ok() {
            eprintln!("\ncubenet-demo: signal {}: removing what this run created", b[0]);
            cubenet_demo::cleanup::remove_all();
            std::process::exit(130);
        }
    });
}

fn main() {
    let args = Args::parse();
    if let Err(e) = cubenet_demo::require_root() {
        eprintln!("cubenet-demo: {e}");
        std::process::exit(2);
    }
    // Namespaces named cubedemo<pid>x…: the tests' sweep of dead `cnt<pid>` namespaces must
    // not remove what `--keep` leaves running.
    cubenet_tests::netns::use_prefix("cubedemo");
    on_signal_remove_everything();
    if let Some(a) = &args.accel {
        // SAFETY: no other thread reads the environment yet (only the signal thread exists).
        unsafe { std::env::set_var("CUBENET_ACCEL", a) };
    }
    let profile = args.profile.unwrap_or_else(|| if cfg!(debug_assertions) { "debug" } else { "release" }.to_string());
    let opts = cubenet_demo::Options { guests: args.guests.into(), profile, keep: args.keep, verbose: true };
    match cubenet_demo::run(&opts) {
        Ok(report) => {
            println!("\n{}", report.table());
            if let Some(k) = &report.kept {
                println!("{k}");
            }
            std::process::exit(if report.passed() { 0 } else { 1 });
        }
        Err(e) => {
            eprintln!("cubenet-demo: {e:#}");
            std::process::exit(1);
        }
    }
}
