//! Configuration: defaults < TOML file (`--config`) < environment (`CUBE_EGRESS_*`) < flags.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, bail};
use clap::Parser;
use serde::{Deserialize, Serialize};

/// Upstream's default bootstrap URL (the agent's policy dump; upstream.md §4.5).
pub const DEFAULT_BOOTSTRAP_URL: &str = "http://127.0.0.1:9998/v1/policies/dump";

/// Effective configuration of one `cube-egress` process. Every field is also a TOML key of the
/// same name.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Sandbox (mvm IP) CIDR; the listeners bind its network address + 1. Default `192.168.0.0/18`.
    pub sandbox_cidr: String,
    /// Overrides the listen address derived from `sandbox_cidr`.
    pub listen_ip: Option<Ipv4Addr>,
    /// Transparent HTTP listener port (default 8080).
    pub http_port: u16,
    /// Transparent HTTPS listener port (default 8443).
    pub https_port: u16,
    /// Admin API and `/metrics` (default `127.0.0.1:9091`).
    pub admin_addr: SocketAddr,
    /// Directory holding `cube-root-ca.crt` and `cube-root-ca.key` (default `/etc/cube/ca`).
    pub ca_dir: PathBuf,
    /// Extra PEM CA bundle trusted for upstream TLS besides the system store (tests).
    pub upstream_extra_ca: Option<PathBuf>,
    /// Audit JSON Lines file (default `/data/log/cube-egress/access.jsonl`).
    pub audit_file: PathBuf,
    /// Policy dump URL fetched at start; empty string = no bootstrap (status `skipped`).
    pub bootstrap_url: String,
    /// Bootstrap attempts before status `failed` (then retried every `bootstrap_retry_secs`).
    pub bootstrap_attempts: u32,
    /// Delay between bootstrap rounds after the first `bootstrap_attempts` failed, seconds.
    pub bootstrap_retry_secs: u64,
    /// Certificate mints each sandbox may do per second (token refill rate).
    pub mint_rate_per_sec: f64,
    /// Burst of certificate mints per sandbox.
    pub mint_burst: u32,
    /// Most cached leaf certificates.
    pub cert_cache_size: usize,
    /// Upstream connect timeout, seconds (default 10).
    pub upstream_connect_timeout_secs: u64,
    /// How long SIGTERM waits for in-flight requests, seconds (default 30).
    pub drain_timeout_secs: u64,
    /// Serve the listening sockets to a successor on this Unix socket path.
    pub handoff_socket: Option<PathBuf>,
    /// Take the listening sockets and the state from a predecessor's `handoff_socket` instead
    /// of binding (E18).
    pub takeover_socket: Option<PathBuf>,
    /// With `takeover_socket`: bind fresh when nobody serves that path (no file or a stale one)
    /// instead of failing; lets both slots of a pair run the same command (default false).
    pub takeover_optional: bool,
    /// DNS servers (`ip:port`) the gateway resolves Host/SNI names with to check that the
    /// original destination belongs to the name (E14). Empty (default) = the `nameserver`
    /// lines of `/etc/resolv.conf`.
    pub dns_servers: Vec<SocketAddr>,
    /// Per-server DNS timeout, milliseconds (default 2000).
    pub dns_timeout_ms: u64,
    /// Most audit records queued for the writer; newer records are dropped (and counted) when
    /// it is full (default 16384).
    pub audit_queue_capacity: usize,
    /// Concurrent proxy connections one sandbox may hold; the next is closed at accept
    /// (decision R18). 0 (default) = max(64, soft descriptor limit / 16), after the soft limit
    /// was raised to the hard one.
    pub max_conns_per_sandbox: usize,
    /// Destinations the gateway never dials, whatever a rule or a learned name says: IPv4
    /// addresses (/32) or CIDRs (host bits zero), at most 64. The same list as the agent's
    /// `always_denied_cidrs` (decision R30): keep them equal. Default
    /// `["100.100.100.200/32", "169.254.169.254/32"]` (cloud instance metadata services, R85);
    /// `[]` = none. The one key
    /// a SIGHUP re-reads (R51).
    pub always_denied_cidrs: Vec<String>,
    /// Proxy connections each sandbox with a policy may always hold, whatever other sandboxes
    /// hold (decision R22; default 8). All sandboxes together hold at most (soft descriptor
    /// limit − 64) / 2; the floor in force is min(this, that / (2 × sandboxes with a policy)),
    /// at least 1 while there are no more sandboxes than places.
    pub conn_floor_per_sandbox: usize,
    /// Audit records each sandbox with a policy may always have queued, whatever other
    /// sandboxes queue (decision R23; default 8; 0 = none); the floor in force is min(this,
    /// `audit_queue_capacity` / (2 × sandboxes with a policy)), at least 1 while there are no
    /// more sandboxes than records.
    pub audit_floor_per_sandbox: usize,
    /// Uids besides root and the gateway's own whose loopback clients the admin API serves
    /// (decision R50; default `[]`, at most 64, no duplicates): an agent or operator tool
    /// running as another non-root user. `/metrics` and `/admin/v1/health` stay open to every
    /// local client; the handoff socket stays root and our uid only.
    pub allowed_peer_uids: Vec<u32>,
    /// Client TLS handshakes one sandbox may have in progress at a time, from its ClientHello
    /// to the end of the handshake (mint included) or 1 s at most; its further connections
    /// wait for a turn (up to 10 s, then closed) without being served, never another
    /// sandbox's (decision R90; default 1, 1–1024).
    pub handshakes_per_sandbox: usize,
    /// New proxy connections one sandbox (source address) may open per second; a connection
    /// over it is reset at accept (decision R102; default 400, twice the datapath's own bound
    /// `l7_connect_rate_per_sandbox`; 0 = unbounded).
    pub new_conns_per_sandbox_per_sec: u32,
    /// Connections a sandbox may open at once above `new_conns_per_sandbox_per_sec` (default
    /// 800; at least 1 when the rate is on).
    pub new_conns_burst_per_sandbox: u32,
}

/// Default `always_denied_cidrs`, the agent's default too (decisions R30, R85).
pub const DEFAULT_ALWAYS_DENIED: &[&str] = &["100.100.100.200/32", "169.254.169.254/32"];

/// Most `allowed_peer_uids` entries.
pub const MAX_ALLOWED_PEER_UIDS: usize = 64;

/// Most `always_denied_cidrs` entries (the agent's `node_deny` map holds 64).
pub const MAX_ALWAYS_DENIED: usize = 64;

impl Default for Config {
    fn default() -> Self {
        Self {
            sandbox_cidr: "192.168.0.0/18".into(),
            listen_ip: None,
            http_port: 8080,
            https_port: 8443,
            admin_addr: "127.0.0.1:9091".parse().expect("static addr"),
            ca_dir: "/etc/cube/ca".into(),
            upstream_extra_ca: None,
            audit_file: "/data/log/cube-egress/access.jsonl".into(),
            bootstrap_url: DEFAULT_BOOTSTRAP_URL.into(),
            bootstrap_attempts: 3,
            bootstrap_retry_secs: 5,
            mint_rate_per_sec: 2.0,
            mint_burst: 20,
            cert_cache_size: 10_000,
            upstream_connect_timeout_secs: 10,
            drain_timeout_secs: 30,
            handoff_socket: None,
            takeover_socket: None,
            takeover_optional: false,
            dns_servers: Vec::new(),
            dns_timeout_ms: 2000,
            audit_queue_capacity: 16_384,
            max_conns_per_sandbox: 0,
            always_denied_cidrs: DEFAULT_ALWAYS_DENIED.iter().map(|s| s.to_string()).collect(),
            conn_floor_per_sandbox: crate::conns::DEFAULT_FLOOR,
            audit_floor_per_sandbox: 8,
            allowed_peer_uids: Vec::new(),
            handshakes_per_sandbox: crate::handshakes::DEFAULT_PER_SANDBOX,
            new_conns_per_sandbox_per_sec: crate::accept_rate::DEFAULT_RATE,
            new_conns_burst_per_sandbox: crate::accept_rate::DEFAULT_BURST,
        }
    }
}

/// Command line; each flag also reads the `CUBE_EGRESS_<NAME>` environment variable.
#[derive(Debug, Clone, Parser)]
#[command(name = "cube-egress", version, about = "CubeEgress L7 egress gateway")]
pub struct Cli {
    /// TOML configuration file (keys = `Config` field names).
    #[arg(long, env = "CUBE_EGRESS_CONFIG")]
    pub config: Option<PathBuf>,
    /// Sandbox CIDR (listen address = network + 1).
    #[arg(long, env = "CUBE_SANDBOX_NETWORK_CIDR")]
    pub sandbox_cidr: Option<String>,
    /// Listen address override.
    #[arg(long, env = "CUBE_EGRESS_LISTEN_IP")]
    pub listen_ip: Option<Ipv4Addr>,
    /// HTTP listener port.
    #[arg(long, env = "CUBE_EGRESS_HTTP_PORT")]
    pub http_port: Option<u16>,
    /// HTTPS listener port.
    #[arg(long, env = "CUBE_EGRESS_HTTPS_PORT")]
    pub https_port: Option<u16>,
    /// Admin listener address.
    #[arg(long, env = "CUBE_EGRESS_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    /// CA directory.
    #[arg(long, env = "CUBE_EGRESS_CA_DIR")]
    pub ca_dir: Option<PathBuf>,
    /// Extra upstream CA bundle (PEM).
    #[arg(long, env = "CUBE_EGRESS_UPSTREAM_EXTRA_CA")]
    pub upstream_extra_ca: Option<PathBuf>,
    /// Audit file.
    #[arg(long, env = "CUBE_EGRESS_AUDIT_FILE")]
    pub audit_file: Option<PathBuf>,
    /// Bootstrap URL ("" disables bootstrap).
    #[arg(long, env = "CUBE_EGRESS_BOOTSTRAP_URL")]
    pub bootstrap_url: Option<String>,
    /// Bootstrap attempts.
    #[arg(long, env = "CUBE_EGRESS_BOOTSTRAP_ATTEMPTS")]
    pub bootstrap_attempts: Option<u32>,
    /// Seconds between bootstrap rounds after the first round failed.
    #[arg(long, env = "CUBE_EGRESS_BOOTSTRAP_RETRY_SECS")]
    pub bootstrap_retry_secs: Option<u64>,
    /// Mint rate per sandbox (per second).
    #[arg(long, env = "CUBE_EGRESS_MINT_RATE_PER_SEC")]
    pub mint_rate_per_sec: Option<f64>,
    /// Mint burst per sandbox.
    #[arg(long, env = "CUBE_EGRESS_MINT_BURST")]
    pub mint_burst: Option<u32>,
    /// Client TLS handshakes one sandbox may have in progress (R90).
    #[arg(long, env = "CUBE_EGRESS_HANDSHAKES_PER_SANDBOX")]
    pub handshakes_per_sandbox: Option<usize>,
    /// New connections one sandbox may open per second, 0 = unbounded (R102).
    #[arg(long, env = "CUBE_EGRESS_NEW_CONNS_PER_SANDBOX_PER_SEC")]
    pub new_conns_per_sandbox_per_sec: Option<u32>,
    /// Burst of new connections per sandbox (R102).
    #[arg(long, env = "CUBE_EGRESS_NEW_CONNS_BURST_PER_SANDBOX")]
    pub new_conns_burst_per_sandbox: Option<u32>,
    /// Drain deadline on SIGTERM (seconds).
    #[arg(long, env = "CUBE_EGRESS_DRAIN_TIMEOUT_SECS")]
    pub drain_timeout_secs: Option<u64>,
    /// Unix socket on which to hand the listeners to a successor.
    #[arg(long, env = "CUBE_EGRESS_HANDOFF_SOCKET")]
    pub handoff_socket: Option<PathBuf>,
    /// Unix socket of a predecessor to take the listeners from.
    #[arg(long, env = "CUBE_EGRESS_TAKEOVER_SOCKET")]
    pub takeover_socket: Option<PathBuf>,
    /// Bind fresh when nobody serves `--takeover-socket` instead of failing.
    #[arg(long, env = "CUBE_EGRESS_TAKEOVER_OPTIONAL")]
    pub takeover_optional: bool,
    /// DNS servers for the destination check (`ip:port`, comma-separated or repeated).
    #[arg(long = "dns-server", env = "CUBE_EGRESS_DNS_SERVERS", value_delimiter = ',')]
    pub dns_servers: Option<Vec<SocketAddr>>,
    /// Destinations never dialled (`a.b.c.d[/len]`, comma-separated or repeated; replaces
    /// `always_denied_cidrs`; an empty value = none).
    #[arg(long = "always-denied-cidr", env = "CUBE_EGRESS_ALWAYS_DENIED_CIDRS", value_delimiter = ',')]
    pub always_denied_cidrs: Option<Vec<String>>,
    /// Uids besides root and ours the admin API serves (comma-separated or repeated; replaces
    /// `allowed_peer_uids`).
    #[arg(long = "allowed-peer-uid", env = "CUBE_EGRESS_ALLOWED_PEER_UIDS", value_delimiter = ',')]
    pub allowed_peer_uids: Option<Vec<u32>>,
}

impl Config {
    /// Builds the effective configuration from a parsed command line (and its `--config` file).
    pub fn load(cli: Cli) -> anyhow::Result<Config> {
        let mut c = match &cli.config {
            Some(p) => Self::from_toml_file(p)?,
            None => Config::default(),
        };
        macro_rules! over {
            ($($f:ident),*) => { $( if let Some(v) = cli.$f { c.$f = v; } )* };
        }
        over!(sandbox_cidr, http_port, https_port, admin_addr, ca_dir, audit_file, bootstrap_url, bootstrap_attempts);
        over!(bootstrap_retry_secs, mint_rate_per_sec, mint_burst, drain_timeout_secs, dns_servers);
        over!(handshakes_per_sandbox, new_conns_per_sandbox_per_sec, new_conns_burst_per_sandbox);
        if let Some(v) = cli.always_denied_cidrs {
            c.always_denied_cidrs = v.into_iter().filter(|s| !s.is_empty()).collect();
        }
        if let Some(v) = cli.allowed_peer_uids {
            c.allowed_peer_uids = v;
        }
        if cli.listen_ip.is_some() {
            c.listen_ip = cli.listen_ip;
        }
        if cli.upstream_extra_ca.is_some() {
            c.upstream_extra_ca = cli.upstream_extra_ca;
        }
        if cli.handoff_socket.is_some() {
            c.handoff_socket = cli.handoff_socket;
        }
        if cli.takeover_socket.is_some() {
            c.takeover_socket = cli.takeover_socket;
        }
        if cli.takeover_optional {
            c.takeover_optional = true;
        }
        c.validate()?;
        Ok(c)
    }

    /// Reads a TOML file; unknown keys are an error.
    pub fn from_toml_file(p: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(p).with_context(|| format!("read config {}", p.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("parse config {}: {}", p.display(), parse_error(&text, &e)))
    }

    fn validate(&self) -> anyhow::Result<()> {
        gateway_of(&self.sandbox_cidr)?;
        if !self.mint_rate_per_sec.is_finite() || self.mint_rate_per_sec <= 0.0 || self.mint_burst == 0 {
            bail!("mint_rate_per_sec and mint_burst must be positive");
        }
        if self.bootstrap_attempts == 0 {
            bail!("bootstrap_attempts must be at least 1");
        }
        // The admin API changes every sandbox's policy: never reachable from off the node or
        // from a sandbox (which can reach the gateway address).
        if !self.admin_addr.ip().is_loopback() {
            bail!("admin_addr {}: must be a loopback address (127.0.0.0/8 or ::1)", self.admin_addr);
        }
        self.always_denied()?;
        if self.allowed_peer_uids.len() > MAX_ALLOWED_PEER_UIDS {
            bail!(
                "allowed_peer_uids: {} entries exceed the limit of {MAX_ALLOWED_PEER_UIDS}",
                self.allowed_peer_uids.len()
            );
        }
        for (i, u) in self.allowed_peer_uids.iter().enumerate() {
            if *u == u32::MAX {
                bail!("allowed_peer_uids[{i}]: 4294967295 is not a uid (it means none)");
            }
            if self.allowed_peer_uids[..i].contains(u) {
                bail!("allowed_peer_uids[{i}]: {u} is listed twice");
            }
        }
        if !(1..=crate::handshakes::MAX_PER_SANDBOX).contains(&self.handshakes_per_sandbox) {
            bail!(
                "handshakes_per_sandbox: {} is outside 1..={}",
                self.handshakes_per_sandbox,
                crate::handshakes::MAX_PER_SANDBOX
            );
        }
        if self.new_conns_per_sandbox_per_sec > 0 && self.new_conns_burst_per_sandbox == 0 {
            bail!("new_conns_burst_per_sandbox: must be at least 1 while new_conns_per_sandbox_per_sec is on");
        }
        if self.dns_timeout_ms == 0 || self.audit_queue_capacity == 0 {
            bail!("dns_timeout_ms and audit_queue_capacity must be positive");
        }
        Ok(())
    }

    /// `dns_servers`, else the nameservers of `/etc/resolv.conf` (none readable → empty: only
    /// IP literals and learned names pass the destination check).
    pub fn dns_servers(&self) -> anyhow::Result<Vec<SocketAddr>> {
        if !self.dns_servers.is_empty() {
            return Ok(self.dns_servers.clone());
        }
        match crate::dns::servers_from_resolv_conf(Path::new("/etc/resolv.conf")) {
            Ok(v) => Ok(v),
            Err(e) => {
                tracing::warn!(error = %e, "no DNS servers: only IP-literal and learned names pass the destination check");
                Ok(Vec::new())
            }
        }
    }

    /// `always_denied_cidrs` parsed: (network, mask), host order. Errors name the entry.
    pub fn always_denied(&self) -> anyhow::Result<Vec<(Ipv4Addr, u32)>> {
        if self.always_denied_cidrs.len() > MAX_ALWAYS_DENIED {
            bail!(
                "always_denied_cidrs: {} entries exceed the limit of {MAX_ALWAYS_DENIED}",
                self.always_denied_cidrs.len()
            );
        }
        let mut v = Vec::with_capacity(self.always_denied_cidrs.len());
        for (i, s) in self.always_denied_cidrs.iter().enumerate() {
            let bad = |r: &str| anyhow::anyhow!("always_denied_cidrs[{i}] {s:?}: {r}");
            let (a, len) = s.split_once('/').unwrap_or((s, "32"));
            let addr: Ipv4Addr = a.parse().map_err(|_| bad("bad address"))?;
            let len: u32 = len.parse().ok().filter(|l| *l <= 32).ok_or_else(|| bad("bad prefix length"))?;
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            if u32::from(addr) & !mask != 0 {
                return Err(bad("host bits set"));
            }
            v.push((addr, mask));
        }
        Ok(v)
    }

    /// The listen address: `listen_ip`, else network(`sandbox_cidr`) + 1 (upstream.md §4.2).
    pub fn gateway_ip(&self) -> anyhow::Result<Ipv4Addr> {
        if let Some(ip) = self.listen_ip {
            return Ok(ip);
        }
        gateway_of(&self.sandbox_cidr)
    }

    /// Upstream connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_secs(self.upstream_connect_timeout_secs)
    }
}

/// Network address + 1 of an IPv4 CIDR such as `192.168.0.0/18` (→ 192.168.0.1).
pub fn gateway_of(cidr: &str) -> anyhow::Result<Ipv4Addr> {
    let (net, _) = network_of(cidr)?;
    Ok(Ipv4Addr::from(u32::from(net) + 1))
}

/// The network address and mask (host order) of the sandbox CIDR `a.b.c.d/len` (len ≤ 30).
pub fn network_of(cidr: &str) -> anyhow::Result<(Ipv4Addr, u32)> {
    let (addr, len) = cidr.split_once('/').with_context(|| format!("sandbox_cidr {cidr:?}: expected a.b.c.d/len"))?;
    let addr: Ipv4Addr = addr.parse().with_context(|| format!("sandbox_cidr {cidr:?}: bad address"))?;
    let len: u32 = len.parse().with_context(|| format!("sandbox_cidr {cidr:?}: bad prefix length"))?;
    if len > 30 {
        bail!("sandbox_cidr {cidr:?}: prefix must be /30 or shorter");
    }
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ok((Ipv4Addr::from(u32::from(addr) & mask), mask))
}

/// A TOML error as one line naming the line, its text and the reason; an unknown key gets the
/// closest known key (normalised Damerau-Levenshtein similarity ≥ 0.7) instead of toml's list
/// of every key (decision O21, the agent's O1).
fn parse_error(text: &str, e: &toml::de::Error) -> String {
    let msg = e.message().trim();
    let at = e
        .span()
        .map(|s| {
            let line_no = text[..s.start.min(text.len())].matches('\n').count() + 1;
            let line = text.lines().nth(line_no - 1).unwrap_or("").trim();
            format!("line {line_no} ({line}): ")
        })
        .unwrap_or_default();
    if let Some(rest) = msg.strip_prefix("unknown field `")
        && let Some((key, known)) = rest.split_once('`')
    {
        // toml lists the known keys as "expected one of `a`, `b`, …".
        let hint = known
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|k| (strsim::normalized_damerau_levenshtein(key, k), k))
            .filter(|(score, _)| *score >= 0.7)
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, k)| format!("did you mean `{k}`? "))
            .unwrap_or_default();
        return format!("{at}unknown key `{key}` ({hint}every key is in the README's CubeEgress configuration table)");
    }
    format!("{at}{}", msg.replace('\n', " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_file_errors_are_one_line_with_a_suggestion() {
        let dir = std::env::temp_dir().join(format!("cube-egress-cfg-errors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("egress.toml");
        let err = |text: &str| {
            std::fs::write(&f, text).unwrap();
            format!("{:#}", Config::from_toml_file(&f).unwrap_err())
        };
        let e = err("http_port = 8080\nmint_brust = 5\n");
        assert!(!e.contains('\n'), "{e}");
        assert!(e.contains("line 2 (mint_brust = 5): unknown key `mint_brust` (did you mean `mint_burst`?"), "{e}");
        assert!(!e.contains("expected one of"), "{e}");
        let e = err("zzz = 1\n");
        assert!(e.contains("unknown key `zzz` (every key is in"), "{e}");
        let e = err("http_port = \"x\"\n");
        assert!(!e.contains('\n') && e.contains("line 1 (http_port = \"x\"): invalid type"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn handshakes_per_sandbox_is_bounded() {
        let ok = |n: usize| Config { handshakes_per_sandbox: n, ..Config::default() }.validate();
        assert_eq!(Config::default().handshakes_per_sandbox, 1);
        assert!(ok(1).is_ok() && ok(crate::handshakes::MAX_PER_SANDBOX).is_ok());
        for n in [0, crate::handshakes::MAX_PER_SANDBOX + 1] {
            let e = ok(n).unwrap_err().to_string();
            assert!(e.starts_with(&format!("handshakes_per_sandbox: {n} is outside 1..=1024")), "{e}");
        }
    }

    #[test]
    fn new_conn_rate_needs_a_burst_while_on() {
        let cfg = |rate: u32, burst: u32| Config {
            new_conns_per_sandbox_per_sec: rate,
            new_conns_burst_per_sandbox: burst,
            ..Config::default()
        };
        let d = Config::default();
        assert_eq!((d.new_conns_per_sandbox_per_sec, d.new_conns_burst_per_sandbox), (400, 800));
        assert!(cfg(0, 0).validate().is_ok(), "off needs no burst");
        assert!(cfg(1, 1).validate().is_ok());
        let e = cfg(10, 0).validate().unwrap_err().to_string();
        assert!(e.starts_with("new_conns_burst_per_sandbox: must be at least 1"), "{e}");
    }

    #[test]
    fn gateway_is_network_plus_one() {
        assert_eq!(gateway_of("192.168.0.0/18").unwrap(), Ipv4Addr::new(192, 168, 0, 1));
        assert_eq!(gateway_of("10.1.77.9/16").unwrap(), Ipv4Addr::new(10, 1, 0, 1));
        assert!(gateway_of("10.0.0.0").is_err());
        assert!(gateway_of("10.0.0.0/31").is_err());
        assert_eq!(network_of("192.168.7.9/18").unwrap(), (Ipv4Addr::new(192, 168, 0, 0), 0xffff_c000));
    }

    #[test]
    fn layers_override_in_order() {
        let dir = std::env::temp_dir().join(format!("cube-egress-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(&f, "http_port = 1080\nhttps_port = 1443\nbootstrap_url = \"\"\n").unwrap();
        let cli = Cli::parse_from(["cube-egress", "--config", f.to_str().unwrap(), "--https-port", "2443"]);
        let c = Config::load(cli).unwrap();
        assert_eq!((c.http_port, c.https_port, c.bootstrap_url.as_str()), (1080, 2443, ""));
        assert_eq!(c.admin_addr.to_string(), "127.0.0.1:9091");
        assert_eq!((c.conn_floor_per_sandbox, c.audit_floor_per_sandbox), (8, 8), "R22/R23 defaults");
        std::fs::write(&f, "conn_floor_per_sandbox = 2\naudit_floor_per_sandbox = 0\n").unwrap();
        let c = Config::load(Cli::parse_from(["cube-egress", "--config", f.to_str().unwrap()])).unwrap();
        assert_eq!((c.conn_floor_per_sandbox, c.audit_floor_per_sandbox), (2, 0));
        std::fs::write(&f, "admin_addr = \"0.0.0.0:9091\"\n").unwrap();
        let e = Config::load(Cli::parse_from(["cube-egress", "--config", f.to_str().unwrap()])).unwrap_err();
        assert!(e.to_string().contains("loopback"), "{e}");
        let cli = Cli::parse_from(["cube-egress", "--dns-server", "10.0.0.53:53,10.0.0.54:5353"]);
        assert_eq!(Config::load(cli).unwrap().dns_servers.len(), 2);
        assert_eq!(
            Config::load(Cli::parse_from(["cube-egress"])).unwrap().always_denied_cidrs,
            ["100.100.100.200/32", "169.254.169.254/32"]
        );
        let cli = Cli::parse_from(["cube-egress", "--always-denied-cidr", "10.96.0.1,100.64.0.0/10"]);
        let d = Config::load(cli).unwrap().always_denied().unwrap();
        assert_eq!(d, [(Ipv4Addr::new(10, 96, 0, 1), u32::MAX), (Ipv4Addr::new(100, 64, 0, 0), 0xffc0_0000)]);
        let cli = Cli::parse_from(["cube-egress", "--always-denied-cidr", ""]);
        assert!(Config::load(cli).unwrap().always_denied_cidrs.is_empty());
        let cli = Cli::parse_from(["cube-egress", "--always-denied-cidr", "1.1.1.1,100.100.100.200/10"]);
        let e = Config::load(cli).unwrap_err().to_string();
        assert!(e.contains("always_denied_cidrs[1]") && e.contains("host bits"), "{e}");
        std::fs::write(&f, "allowed_peer_uids = [1001, 65534]\n").unwrap();
        let c = Config::load(Cli::parse_from(["cube-egress", "--config", f.to_str().unwrap()])).unwrap();
        assert_eq!(c.allowed_peer_uids, [1001, 65534]);
        let cli = Cli::parse_from(["cube-egress", "--allowed-peer-uid", "7,7"]);
        let e = Config::load(cli).unwrap_err().to_string();
        assert!(e.contains("allowed_peer_uids[1]") && e.contains("twice"), "{e}");
        std::fs::write(&f, "htp_port = 1\n").unwrap();
        assert!(Config::from_toml_file(&f).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
