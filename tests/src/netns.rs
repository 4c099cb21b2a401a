//! Uniquely named test namespaces, removed on drop.

use std::{
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicU32, Ordering},
};

use cubenet_sys::netns::{Netns, NetnsThread, run_in};

/// Prefix of every namespace this harness creates: `cnt<pid>x<n><role>`.
pub const PREFIX: &str = "cnt";

static COUNTER: AtomicU32 = AtomicU32::new(0);
static SWEEP: std::sync::Once = std::sync::Once::new();
static CUSTOM_PREFIX: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Makes this process name its namespaces `<prefix><pid>x<n><role>` instead of
/// `cnt<pid>x<n><role>`, and skips the sweep of stale namespaces. For programs whose
/// namespaces may outlive them on purpose (`cubenet-demo --keep`): the tests' sweep deletes
/// `cnt` namespaces of dead PIDs. Call it before the first [`TestNetns::new`]; later calls
/// are ignored.
pub fn use_prefix(prefix: &str) {
    let _ = CUSTOM_PREFIX.set(prefix.to_string());
}

fn prefix() -> &'static str {
    CUSTOM_PREFIX.get().map_or(PREFIX, String::as_str)
}

/// Runs `ip` with `args`, panicking with the command and its stderr on failure.
pub fn ip(args: &[&str]) -> String {
    let out = run_cmd("ip", args);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `prog args`, panicking with the full command line and stderr when it fails.
pub fn run_cmd(prog: &str, args: &[&str]) -> Output {
    let out =
        Command::new(prog).args(args).stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("spawn {prog}: {e}"));
    assert!(
        out.status.success(),
        "`{prog} {}` failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Deletes namespaces left by earlier test processes that were killed (their pid is gone).
fn sweep_stale() {
    let Ok(entries) = std::fs::read_dir("/run/netns") else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(PREFIX) else { continue };
        let Some(pid) = rest.split('x').next().and_then(|p| p.parse::<i32>().ok()) else { continue };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", &name]).status();
        }
    }
}

/// A network namespace created for one test (`ip netns add`), deleted on drop.
///
/// Deleting it destroys every virtual device inside (veths, TAPs, dummies) once no process
/// or fd keeps it alive.
#[derive(Debug)]
pub struct TestNetns {
    name: String,
}

impl TestNetns {
    /// Creates `cnt<pid>x<n><role>` (or the [`use_prefix`] name) with `lo` up.
    pub fn new(role: &str) -> Self {
        if CUSTOM_PREFIX.get().is_none() {
            SWEEP.call_once(sweep_stale);
        }
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}{}x{n}{role}", prefix(), std::process::id());
        ip(&["netns", "add", &name]);
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// The namespace name (as known to `ip netns`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bind-mounted namespace file, `/run/netns/<name>`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.name))
    }

    /// Opens a handle on the namespace.
    pub fn handle(&self) -> Netns {
        Netns::open(self.path()).expect("open test netns")
    }

    /// Runs `ip -n <ns> args`.
    pub fn ip(&self, args: &[&str]) -> String {
        let mut v = vec!["-n", self.name.as_str()];
        v.extend_from_slice(args);
        ip(&v)
    }

    /// Runs `f` on a fresh thread inside the namespace.
    pub fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> R {
        run_in(&self.handle(), f).expect("enter test netns")
    }

    /// Spawns a thread that enters the namespace and runs `f`; join it for the result.
    pub fn spawn_thread<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> std::thread::JoinHandle<R> {
        let ns = self.handle();
        std::thread::spawn(move || {
            ns.enter().expect("enter test netns");
            f()
        })
    }

    /// A long-lived thread inside the namespace.
    pub fn thread(&self) -> NetnsThread {
        NetnsThread::spawn(&self.handle()).expect("spawn netns thread")
    }

    /// A `Command` that will run inside the namespace (`setns` before `exec`).
    pub fn command(&self, prog: &str) -> Command {
        let ns = self.handle();
        let mut cmd = Command::new(prog);
        // SAFETY: only async-signal-safe work (setns on an fd opened before fork) between
        // fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                nix::sched::setns(std::os::fd::AsFd::as_fd(&ns), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
            });
        }
        cmd
    }

    /// Runs `prog args` inside the namespace and returns its output (no status check).
    pub fn exec(&self, prog: &str, args: &[&str]) -> Output {
        self.command(prog).args(args).stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("spawn {prog}: {e}"))
    }

    /// `curl -s -m 10 args` inside the namespace as `uid` (and gid `uid`, no supplementary
    /// groups; `setpriv`), as another local user would: (HTTP status, 0 when none; body).
    pub fn curl_as(&self, uid: u32, args: &[&str]) -> (u16, String) {
        let id = [format!("--reuid={uid}"), format!("--regid={uid}")];
        let o = self
            .command("setpriv")
            .args(&id)
            .args(["--clear-groups", "curl", "-s", "-m", "10", "-w", "\n%{http_code}"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("setpriv curl");
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let (body, code) = out.rsplit_once('\n').unwrap_or(("", &out));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    /// Spawns `prog args` inside the namespace; the [`ChildGuard`] kills it on drop.
    pub fn spawn(&self, prog: &str, args: &[&str]) -> ChildGuard {
        let child =
            self.command(prog).args(args).stdin(Stdio::null()).spawn().unwrap_or_else(|e| panic!("spawn {prog}: {e}"));
        ChildGuard(Some(child))
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).stderr(Stdio::null()).status();
    }
}

/// A child process killed (by its own PID) and reaped on drop.
#[derive(Debug)]
pub struct ChildGuard(Option<Child>);

impl ChildGuard {
    /// Guards an already spawned child.
    pub fn from_child(child: Child) -> Self {
        Self(Some(child))
    }

    /// The child's PID.
    pub fn id(&self) -> u32 {
        self.0.as_ref().map(Child::id).unwrap_or(0)
    }

    /// Mutable access to the child.
    pub fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("child")
    }

    /// The child's exit status if it exits within `limit` (polled every 50 ms), else `None`
    /// (the child keeps running; the guard still kills it on drop).
    pub fn exit_within(&mut self, limit: std::time::Duration) -> Option<std::process::ExitStatus> {
        let t = std::time::Instant::now();
        while t.elapsed() < limit {
            if let Some(st) = self.child().try_wait().unwrap() {
                return Some(st);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        None
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Names of namespaces created by this process that still exist (for leak checks).
pub fn leftover_namespaces() -> Vec<String> {
    let mine = format!("{}{}x", prefix(), std::process::id());
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(&mine)).collect()
        })
        .unwrap_or_default()
}
