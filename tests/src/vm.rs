//! Real Linux guests under QEMU (TCG, `-M microvm`) on a TAP fd, the way a VMM consumes the
//! agent's fd handoff.
//!
//! - [`GuestImage::ensure`] builds or locates the cached image (`scripts/guest-image.sh`:
//!   Debian 12 kernel + busybox initramfs whose `/init` is `scripts/guest-init.sh`).
//! - [`Vm::boot`] starts `qemu-system-x86_64` with the TAP fd inherited as
//!   `-netdev tap,fd=N` and the guest's network and checks on the kernel command
//!   line ([`GuestConfig`]); a thread reads the serial console.
//! - [`Vm::wait_ready`] / [`Vm::wait_done`] wait for the guest's `CUBENET-READY` /
//!   `CUBENET-DONE` lines; [`CheckResult`]s are parsed from `CUBENET-CHECK` lines.
//! - Dropping a [`Vm`] kills QEMU by its PID and reaps it.
//!
//! QEMU runs in the network namespace of the thread that calls [`Vm::boot`]: it needs the TAP
//! fd only, never the TAP's namespace.

use std::{
    fmt,
    io::{BufRead, BufReader, Read},
    net::{Ipv4Addr, SocketAddrV4},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Condvar, Mutex, OnceLock},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::topology::mac_string;

/// The cached guest image: kernel and initramfs built by `scripts/guest-image.sh`.
#[derive(Clone, Debug)]
pub struct GuestImage {
    /// Directory holding the image (default `target/guest/`, or `$CUBENET_GUEST_DIR`).
    pub dir: PathBuf,
    /// The guest kernel (`vmlinuz`).
    pub kernel: PathBuf,
    /// The busybox initramfs (`initramfs.cpio.gz`).
    pub initramfs: PathBuf,
}

/// Why a guest cannot run on this machine (an environmental reason, proven by the message:
/// a missing program or a failed download), as opposed to a defect.
#[derive(Debug)]
pub struct Unavailable(pub String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "real Linux guest unavailable: {}", self.0)
    }
}

impl std::error::Error for Unavailable {}

/// The QEMU binary: `$CUBENET_QEMU`, else `qemu-system-x86_64` from `PATH`.
pub fn qemu_binary() -> String {
    std::env::var("CUBENET_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into())
}

/// The QEMU accelerator: `$CUBENET_ACCEL` (e.g. `kvm` on hosts where KVM runs stock kernels),
/// else `tcg` (this development machine's KVM is PVM, on which stock kernels hang).
pub fn accel() -> String {
    std::env::var("CUBENET_ACCEL").ok().filter(|a| !a.is_empty()).unwrap_or_else(|| "tcg".into())
}

impl GuestImage {
    /// Runs `scripts/guest-image.sh` once per process (it is itself cached and idempotent) and
    /// returns the image. The error is an [`Unavailable`] (downcast to tell) only for a proven
    /// environmental reason: QEMU not runnable or without TCG or microvm, no `/dev/net/tun`,
    /// or the script's exit status 3
    /// (packages or the kernel could not be obtained); anything else is a plain error.
    pub fn ensure() -> Result<Self> {
        static IMAGE: OnceLock<std::result::Result<GuestImage, (bool, String)>> = OnceLock::new();
        match IMAGE.get_or_init(Self::build) {
            Ok(img) => Ok(img.clone()),
            Err((true, why)) => Err(Unavailable(why.clone()).into()),
            Err((false, why)) => bail!("guest image: {why}"),
        }
    }

    /// [`GuestImage::ensure`] for test `test`: `None` after [`crate::skip`]ping it when the
    /// guest is [`Unavailable`] here (no QEMU, no guest kernel …); panics on any other error.
    pub fn for_test(test: &str) -> Option<Self> {
        match Self::ensure() {
            Ok(img) => Some(img),
            Err(e) if e.downcast_ref::<Unavailable>().is_some() => {
                crate::skip(test, e);
                None
            }
            Err(e) => panic!("{e:#}"),
        }
    }

    /// Builds the image; `Err((true, why))` for an environmental reason.
    fn build() -> std::result::Result<Self, (bool, String)> {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = std::env::var_os("CUBENET_GUEST_DIR").map(PathBuf::from).unwrap_or_else(|| repo.join("target/guest"));
        let qemu = qemu_binary();
        match Command::new(&qemu).arg("--version").stdin(Stdio::null()).output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => return Err((true, format!("{qemu} --version: {}", String::from_utf8_lossy(&o.stderr).trim()))),
            Err(e) => return Err((true, format!("{qemu}: {e} (scripts/setup.sh installs it)"))),
        }
        // The binary must offer what Vm::boot uses: the TCG accelerator and the microvm machine.
        for (probe, want) in [("-accel", "tcg"), ("-machine", "microvm")] {
            let out = Command::new(&qemu).args([probe, "help"]).stdin(Stdio::null()).output();
            let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
            if !text.lines().any(|l| l.split_whitespace().next() == Some(want)) {
                return Err((true, format!("{qemu} {probe} help does not list {want}")));
            }
        }
        if !Path::new("/dev/net/tun").exists() {
            return Err((true, "/dev/net/tun missing".into()));
        }
        let out = Command::new("bash")
            .arg(repo.join("scripts/guest-image.sh"))
            .arg(&dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| (false, format!("run scripts/guest-image.sh: {e}")))?;
        if !out.status.success() {
            // Exit status 3: a prerequisite could not be obtained (documented in the script).
            let env = out.status.code() == Some(3);
            let why = format!("scripts/guest-image.sh {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
            return Err((env, why));
        }
        let img = Self { kernel: dir.join("vmlinuz"), initramfs: dir.join("initramfs.cpio.gz"), dir };
        for p in [&img.kernel, &img.initramfs] {
            if !p.is_file() {
                return Err((false, format!("{} missing after scripts/guest-image.sh", p.display())));
            }
        }
        Ok(img)
    }
}

/// One check the guest runs after its network is up (`cubenet.check=<spec>`, see
/// `scripts/guest-init.sh` and the README for the syntax).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// `arp:IP`: an ARP request for the address is answered; detail is the MAC.
    Arp(Ipv4Addr),
    /// `ping:IP`: one ICMP echo is answered; detail is the round trip.
    Ping(Ipv4Addr),
    /// `http:IP:PORT/PATH`: an HTTP GET succeeds; detail is the body's first line.
    Http(SocketAddrV4, String),
    /// `fetch:IP:PORT/PATH`: an HTTP GET succeeds; detail is `bytes <body size>`.
    Fetch(SocketAddrV4, String),
    /// `send:IP:PORT:BYTES`: that many zero bytes go out over TCP, then EOF; detail is the
    /// first line the server answered.
    Send(SocketAddrV4, u64),
    /// `refused:IP:PORT`: a TCP connect is refused with a RST.
    Refused(SocketAddrV4),
    /// `dns:NAME@SERVER`: busybox `nslookup -type=a NAME SERVER` answers; detail is the first
    /// address.
    Dns(String, Ipv4Addr),
    /// `vhost:NAME@IP:PORT/PATH=CODE`: an HTTP GET to the address with `Host: NAME` answers
    /// status `CODE`; detail is the body's first line.
    HttpHost {
        /// Where to connect.
        addr: SocketAddrV4,
        /// The Host header.
        host: String,
        /// Request path.
        path: String,
        /// The status that passes.
        status: u16,
    },
    /// `https:NAME@IP:PORT/PATH=CODE`: an HTTPS GET to the address (SNI and `Host: NAME`,
    /// `/bin/cubenet-https-get`: rustls default client settings) trusting only the CA given
    /// with [`ca_cmdline`] answers status `CODE`; detail is the body's first line.
    Https {
        /// Where to connect.
        addr: SocketAddrV4,
        /// SNI, the name the certificate must carry, and the Host header.
        host: String,
        /// Request path.
        path: String,
        /// The status that passes.
        status: u16,
    },
}

impl Check {
    /// The spec as passed on the command line and echoed in `CUBENET-CHECK` lines.
    pub fn spec(&self) -> String {
        let path = |p: &str| if p.starts_with('/') { p.to_string() } else { format!("/{p}") };
        match self {
            Check::Arp(ip) => format!("arp:{ip}"),
            Check::Ping(ip) => format!("ping:{ip}"),
            Check::Http(a, p) => format!("http:{a}{}", path(p)),
            Check::Fetch(a, p) => format!("fetch:{a}{}", path(p)),
            Check::Send(a, n) => format!("send:{a}:{n}"),
            Check::Refused(a) => format!("refused:{a}"),
            Check::Dns(name, server) => format!("dns:{name}@{server}"),
            Check::HttpHost { addr, host, path: p, status } => format!("vhost:{host}@{addr}{}={status}", path(p)),
            Check::Https { addr, host, path: p, status } => format!("https:{host}@{addr}{}={status}", path(p)),
        }
    }
}

/// The network and workload of one guest.
#[derive(Clone, Debug)]
pub struct GuestConfig {
    /// eth0 MAC (also given to QEMU's virtio-net device).
    pub mac: [u8; 6],
    /// eth0 address.
    pub ip: Ipv4Addr,
    /// eth0 prefix length.
    pub prefix: u8,
    /// Default gateway.
    pub gw: Ipv4Addr,
    /// Static ARP entry for the gateway, if any.
    pub gw_mac: Option<[u8; 6]>,
    /// Serve HTTP (busybox httpd) on this port: `/` answers `cubenet guest`, `/cgi-bin/whoami`
    /// answers `you are <client ip>:<client port>`. The guest then runs until killed.
    pub serve_port: Option<u16>,
    /// Checks, run in order after the network is up.
    pub checks: Vec<Check>,
    /// Per-check timeout in seconds (`cubenet.timeout`).
    pub check_timeout_secs: u32,
    /// Extra kernel command-line words.
    pub extra_cmdline: Vec<String>,
    /// Guest memory in MiB.
    pub memory_mib: u32,
}

impl GuestConfig {
    /// The CubeVS sandbox NIC: 169.254.68.6/30, MAC 20:90:6f:fc:fc:fc, default via
    /// 169.254.68.5 with a static ARP entry to 20:90:6f:cf:cf:cf; no checks, not serving.
    pub fn cubevs() -> Self {
        Self {
            mac: crate::packet::GUEST_MAC,
            ip: Ipv4Addr::new(169, 254, 68, 6),
            prefix: 30,
            gw: Ipv4Addr::new(169, 254, 68, 5),
            gw_mac: Some(crate::packet::GATEWAY_MAC),
            serve_port: None,
            checks: Vec::new(),
            check_timeout_secs: 5,
            extra_cmdline: Vec::new(),
            memory_mib: 256,
        }
    }

    /// The kernel command line for this configuration.
    pub fn cmdline(&self) -> String {
        // tsc_early_khz: without it TCG boots of this kernel hang now and then calibrating the
        // TSC (reference/toolchain.md).
        let mut w = vec![
            "console=ttyS0".to_string(),
            "panic=-1".into(),
            "tsc_early_khz=2600000".into(),
            format!("cubenet.ip={}/{}", self.ip, self.prefix),
            format!("cubenet.gw={}", self.gw),
            format!("cubenet.mac={}", mac_string(self.mac)),
            format!("cubenet.timeout={}", self.check_timeout_secs),
        ];
        if let Some(m) = self.gw_mac {
            w.push(format!("cubenet.gwmac={}", mac_string(m)));
        }
        if let Some(p) = self.serve_port {
            w.push(format!("cubenet.serve={p}"));
        }
        w.extend(self.checks.iter().map(|c| format!("cubenet.check={}", c.spec())));
        w.extend(self.extra_cmdline.iter().cloned());
        w.join(" ")
    }
}

/// The kernel command-line word `cubenet.ca=<base64 DER>` that makes the guest trust the one
/// certificate in `pem` (a PEM `CERTIFICATE` block) for [`Check::Https`]; the guest writes it
/// back as PEM to `/etc/cubenet-ca.pem`. About 500 characters for an ECDSA P-256 CA: mind the
/// x86 command-line limit (2048 bytes). Errors: `pem` is not exactly one certificate block.
pub fn ca_cmdline(pem: &str) -> Result<String> {
    let begin = pem.matches("-----BEGIN CERTIFICATE-----").count();
    if begin != 1 || pem.matches("-----BEGIN ").count() != 1 {
        bail!("expected exactly one PEM CERTIFICATE block, found {begin}");
    }
    // A PEM body is already base64 of the DER: drop the armour and the line breaks.
    let b64: String = pem.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("-----")).collect();
    if b64.is_empty() || !b64.bytes().all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b)) {
        bail!("PEM certificate body is not base64");
    }
    Ok(format!("cubenet.ca={b64}"))
}

/// One `CUBENET-CHECK <spec> PASS|FAIL <ms> <detail>` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckResult {
    /// The check's spec (`http:198.51.100.1:80/`).
    pub spec: String,
    /// Whether it passed.
    pub pass: bool,
    /// Duration inside the guest, ms (10 ms resolution: `/proc/uptime`).
    pub ms: u64,
    /// One line of detail (the MAC, the body's first line, the error …).
    pub detail: String,
}

impl CheckResult {
    /// Parses the part of a console line after `CUBENET-CHECK `.
    pub fn parse(rest: &str) -> Option<Self> {
        let mut it = rest.splitn(4, ' ');
        let spec = it.next()?.to_string();
        let pass = match it.next()? {
            "PASS" => true,
            "FAIL" => false,
            _ => return None,
        };
        let ms = it.next()?.parse().ok()?;
        let detail = it.next().unwrap_or("").trim_end().to_string();
        Some(Self { spec, pass, ms, detail })
    }
}

#[derive(Debug, Default)]
struct Console {
    log: Vec<String>,
    ready: Option<Instant>,
    guest_ready_ms: Option<u64>,
    checks: Vec<CheckResult>,
    done: bool,
    error: Option<String>,
    eof: bool,
}

type Shared = Arc<(Mutex<Console>, Condvar)>;

/// A running QEMU guest. Killed by PID and reaped on drop.
pub struct Vm {
    child: Child,
    console: Shared,
    started: Instant,
    readers: Vec<thread::JoinHandle<()>>,
}

impl fmt::Debug for Vm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vm").field("pid", &self.child.id()).finish_non_exhaustive()
    }
}

/// Lowest fd number the TAP is duplicated to before QEMU starts (above anything std or the
/// test harness is likely to use, so the number in `fd=N` is stable and readable).
const TAP_FD_MIN: RawFd = 100;

impl Vm {
    /// Boots `image` under QEMU (TCG, microvm, 1 vCPU) with a virtio-net device on `tap`.
    ///
    /// `tap` should be a TAP queue opened with `IFF_VNET_HDR`, like the pool's. QEMU 7.2
    /// rejects `vnet_hdr=` together with `fd=`: it reads `IFF_VNET_HDR` from the fd
    /// (`TUNGETIFF`) and then sets the header size (`TUNSETVNETHDRSZ`) and the offloads
    /// (`TUNSETOFFLOAD`) itself from the features the guest driver negotiates. The fd is duplicated to a number ≥ 100 with `FD_CLOEXEC`, and only in
    /// the child is the flag cleared, so no other process started meanwhile inherits it.
    pub fn boot(image: &GuestImage, tap: OwnedFd, cfg: &GuestConfig) -> Result<Vm> {
        // Own code rather than the `command-fds` crate: it dup2()s onto a fixed child number,
        // which can land on std's exec-status pipe; clearing CLOEXEC on our own dup never collides.
        // SAFETY: F_DUPFD_CLOEXEC returns a new fd we own (or -1).
        let raw = unsafe { libc::fcntl(tap.as_raw_fd(), libc::F_DUPFD_CLOEXEC, TAP_FD_MIN) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error()).context("dup TAP fd");
        }
        // SAFETY: `raw` is a fresh fd nobody else owns.
        let child_tap = unsafe { OwnedFd::from_raw_fd(raw) };
        drop(tap);
        let cmdline = cfg.cmdline();
        // x86 COMMAND_LINE_SIZE (2048 with the NUL): the kernel would cut the rest silently.
        if cmdline.len() >= 2048 {
            bail!("guest kernel command line is {} bytes, the x86 limit is 2047", cmdline.len());
        }
        let qemu = qemu_binary();
        let mut cmd = Command::new(&qemu);
        cmd.args(["-accel", &accel(), "-M", "microvm", "-smp", "1", "-m", &cfg.memory_mib.to_string()])
            .args(["-display", "none", "-nodefaults", "-no-user-config", "-no-reboot", "-serial", "stdio"])
            .arg("-kernel")
            .arg(&image.kernel)
            .arg("-initrd")
            .arg(&image.initramfs)
            .args(["-append", &cmdline])
            .args(["-netdev", &format!("tap,id=n0,fd={raw}")])
            .args(["-device", &format!("virtio-net-device,netdev=n0,mac={}", mac_string(cfg.mac))])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: only fcntl (async-signal-safe) on an fd that stays open in the child.
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(raw, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let started = Instant::now();
        let mut child = cmd.spawn().with_context(|| format!("spawn {qemu}"))?;
        drop(child_tap);
        let console: Shared = Arc::new((Mutex::new(Console::default()), Condvar::new()));
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let readers = vec![
            spawn_reader(stdout, console.clone(), "", true),
            spawn_reader(stderr, console.clone(), "qemu: ", false),
        ];
        Ok(Vm { child, console, started, readers })
    }

    /// QEMU's PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for `CUBENET-READY` and returns the time from spawning QEMU to that line.
    /// Fails with the console tail when the guest reports an error, QEMU exits, or `timeout`
    /// passes.
    pub fn wait_ready(&self, timeout: Duration) -> Result<Duration> {
        let c = self.wait_for(timeout, "CUBENET-READY", |c| c.ready.is_some())?;
        Ok(c.ready.expect("ready") - self.started)
    }

    /// Guest uptime (ms) when it printed `CUBENET-READY`, if it did.
    pub fn guest_ready_ms(&self) -> Option<u64> {
        self.console.0.lock().expect("console").guest_ready_ms
    }

    /// Waits for `CUBENET-DONE` and returns every check's result, in order.
    pub fn wait_done(&self, timeout: Duration) -> Result<Vec<CheckResult>> {
        Ok(self.wait_for(timeout, "CUBENET-DONE", |c| c.done)?.checks.clone())
    }

    /// The console so far (guest serial output and QEMU's stderr prefixed `qemu: `).
    pub fn console(&self) -> String {
        self.console.0.lock().expect("console").log.join("\n")
    }

    fn wait_for(
        &self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&Console) -> bool,
    ) -> Result<std::sync::MutexGuard<'_, Console>> {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.console;
        let mut c = lock.lock().expect("console");
        loop {
            if pred(&c) {
                return Ok(c);
            }
            let why = if let Some(e) = &c.error {
                format!("guest reported CUBENET-ERROR {e}")
            } else if c.eof {
                "QEMU exited".to_string()
            } else if Instant::now() >= deadline {
                format!("no {what} within {timeout:?}")
            } else {
                c = cv.wait_timeout(c, deadline - Instant::now()).expect("console").0;
                continue;
            };
            let tail = c.log.iter().rev().take(40).rev().cloned().collect::<Vec<_>>().join("\n");
            bail!("{why} (QEMU pid {}); console tail:\n{tail}", self.child.id());
        }
    }
}

fn spawn_reader(
    src: impl Read + Send + 'static,
    console: Shared,
    prefix: &'static str,
    serial: bool,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let line = String::from_utf8_lossy(&buf).trim_end_matches(['\r', '\n']).to_string();
            let (lock, cv) = &*console;
            let mut c = lock.lock().expect("console");
            if serial {
                parse_line(&mut c, &line);
            }
            c.log.push(format!("{prefix}{line}"));
            cv.notify_all();
        }
        if serial {
            let (lock, cv) = &*console;
            lock.lock().expect("console").eof = true;
            cv.notify_all();
        }
    })
}

fn parse_line(c: &mut Console, line: &str) {
    // Kernel messages may share a line with ours: look for the marker anywhere.
    let Some(at) = line.find("CUBENET-") else { return };
    let msg = &line[at..];
    if let Some(rest) = msg.strip_prefix("CUBENET-READY") {
        c.ready.get_or_insert_with(Instant::now);
        c.guest_ready_ms = rest.split_whitespace().nth(1).and_then(|m| m.parse().ok());
    } else if let Some(rest) = msg.strip_prefix("CUBENET-CHECK ") {
        if let Some(r) = CheckResult::parse(rest) {
            c.checks.push(r);
        }
    } else if msg.starts_with("CUBENET-DONE") {
        c.done = true;
    } else if let Some(rest) = msg.strip_prefix("CUBENET-ERROR") {
        c.error = Some(rest.trim().to_string());
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        // Child::kill sends SIGKILL to this PID only; wait reaps it.
        let _ = self.child.kill();
        let _ = self.child.wait();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_specs_and_results_round_trip() {
        let a = SocketAddrV4::new(Ipv4Addr::new(198, 51, 100, 1), 80);
        assert_eq!(Check::Http(a, String::new()).spec(), "http:198.51.100.1:80/");
        assert_eq!(Check::Fetch(a, "big".into()).spec(), "fetch:198.51.100.1:80/big");
        assert_eq!(Check::Send(a, 5).spec(), "send:198.51.100.1:80:5");
        assert_eq!(Check::Refused(a).spec(), "refused:198.51.100.1:80");
        assert_eq!(Check::Dns("a.test".into(), *a.ip()).spec(), "dns:a.test@198.51.100.1");
        let h = Check::HttpHost { addr: a, host: "a.test".into(), path: "x".into(), status: 403 };
        assert_eq!(h.spec(), "vhost:a.test@198.51.100.1:80/x=403");
        let a443 = SocketAddrV4::new(*a.ip(), 443);
        let s = Check::Https { addr: a443, host: "a.test".into(), path: "/v1".into(), status: 200 };
        assert_eq!(s.spec(), "https:a.test@198.51.100.1:443/v1=200");
        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\nAQ==\n-----END CERTIFICATE-----\n";
        assert_eq!(ca_cmdline(pem).unwrap(), "cubenet.ca=MIIBAQ==");
        assert!(ca_cmdline(&format!("{pem}{pem}")).is_err());
        assert!(ca_cmdline("-----BEGIN CERTIFICATE-----\nno spaces allowed\n-----END CERTIFICATE-----").is_err());
        let r = CheckResult::parse("http:198.51.100.1:80/ PASS 40 you are 198.51.100.2:30001").unwrap();
        assert_eq!((r.pass, r.ms, r.detail.as_str()), (true, 40, "you are 198.51.100.2:30001"));
        assert!(!CheckResult::parse("ping:1.2.3.4 FAIL 10 ").unwrap().pass);
        assert!(CheckResult::parse("ping:1.2.3.4 MAYBE 10 x").is_none());
        let mut c = Console::default();
        parse_line(&mut c, "[    3.1] x CUBENET-READY 169.254.68.6/30 2950");
        parse_line(&mut c, "CUBENET-CHECK arp:169.254.68.5 PASS 20 20:90:6f:cf:cf:cf");
        parse_line(&mut c, "CUBENET-DONE 1 0");
        assert!(c.ready.is_some() && c.done);
        assert_eq!((c.guest_ready_ms, c.checks.len()), (Some(2950), 1));
        let cmd =
            GuestConfig { checks: vec![Check::Ping(Ipv4Addr::new(1, 2, 3, 4))], ..GuestConfig::cubevs() }.cmdline();
        assert!(cmd.contains("cubenet.ip=169.254.68.6/30 cubenet.gw=169.254.68.5"), "{cmd}");
        assert!(
            cmd.contains("cubenet.gwmac=20:90:6f:cf:cf:cf") && cmd.ends_with("cubenet.check=ping:1.2.3.4"),
            "{cmd}"
        );
    }
}
