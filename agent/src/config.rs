//! Agent configuration: one TOML file, every key optional with the default documented here
//! and in the README; command-line flags override keys (`main.rs`).

use std::{net::Ipv4Addr, path::PathBuf};

use serde::{Deserialize, Serialize};

/// Errors name the key and the reason.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// File unreadable.
    #[error("config {path}: {source}")]
    Read {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// TOML syntax or type error (the message names the key).
    #[error("config {path}: {msg}")]
    Parse {
        /// Path.
        path: PathBuf,
        /// Parser message.
        msg: String,
    },
    /// A key has an invalid value.
    #[error("config key `{key}`: {reason}")]
    Invalid {
        /// Key.
        key: &'static str,
        /// Why.
        reason: String,
    },
}

fn invalid(key: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key, reason: reason.into() }
}

/// Every key of [`Config`] (the TOML keys), sorted.
pub fn known_keys() -> Vec<String> {
    match toml::Table::try_from(Config::default()) {
        Ok(t) => t.keys().cloned().collect(),
        Err(_) => Vec::new(),
    }
}

/// The known key closest to `key` (normalised Damerau-Levenshtein similarity ≥ 0.7: a few
/// letters off), if any: the likely intended spelling.
fn closest_key(key: &str) -> Option<String> {
    known_keys()
        .into_iter()
        .map(|k| (strsim::normalized_damerau_levenshtein(key, &k), k))
        .filter(|(score, _)| *score >= 0.7)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

/// A TOML error as one line naming the line, its text and the reason; an unknown key gets
/// a "did you mean" instead of toml's list of every key.
fn parse_error(text: &str, e: &toml::de::Error) -> String {
    let msg = e.message().trim();
    let at = e.span().map(|s| {
        let line_no = text[..s.start.min(text.len())].matches('\n').count() + 1;
        let line = text.lines().nth(line_no - 1).unwrap_or("").trim();
        format!("line {line_no} ({line}): ")
    });
    let at = at.unwrap_or_default();
    if let Some(rest) = msg.strip_prefix("unknown field `")
        && let Some((key, _)) = rest.split_once('`')
    {
        let hint = match closest_key(key) {
            Some(k) => format!("did you mean `{k}`? "),
            None => String::new(),
        };
        return format!(
            "{at}unknown key `{key}` ({hint}every key is in the README's Configuration table; \
             `network-agent --print-config` prints them with their values)"
        );
    }
    format!("{at}{}", msg.replace('\n', " "))
}

/// The agent configuration. Field names are the TOML keys.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// gRPC endpoint: `unix:///path`, `tcp://host:port` or `host:port`
    /// (default `unix:///tmp/cube/network-agent-grpc.sock`, `reference/upstream.md §1.4`).
    pub grpc_listen: String,
    /// Path of the TAP fd Unix socket (default `/tmp/cube/network-agent-tap.sock`).
    pub tap_fd_listen: PathBuf,
    /// `host:port` of the health/readiness/metrics HTTP server (default `127.0.0.1:19090`).
    pub health_listen: String,
    /// Network namespace to program (default `/proc/1/ns/net`; empty = the agent's own).
    pub dataplane_netns: String,
    /// `host:port` of the CubeEgress bootstrap listener bound INSIDE `dataplane_netns`
    /// (default `127.0.0.1:19091`; `""` = none). It serves only `GET /v1/policies/dump`, to
    /// loopback peers of that namespace (decision L9). Unused when `dataplane_netns` is empty
    /// (the dump is then on `health_listen`).
    pub egress_dump_listen: String,
    /// Uplink interface in the dataplane netns (default empty = the default-route device).
    pub eth_name: String,
    /// Sandbox address pool (default `192.168.0.0/18`; prefix /16…/24).
    pub cidr: String,
    /// MTU of the TAPs and cube-dev (default 1500).
    pub mtu: u32,
    /// TAPs kept warm (default 500).
    pub tap_init_num: usize,
    /// Parallel TAP creations while warming (default 4).
    pub warm_parallelism: usize,
    /// bpffs directory of the datapath's pins (default `/sys/fs/bpf/cubevs`).
    pub bpffs_dir: PathBuf,
    /// eBPF object path (default empty = `cubevs::default_object_path()`).
    pub bpf_object: String,
    /// Directory of the per-sandbox state files (default `/dev/shm/cube/network-agent/state`:
    /// tmpfs, like upstream's runtime, because TAPs and pins do not survive a reboot either).
    pub state_dir: PathBuf,
    /// Host-port range `"first-last"` for port mappings (default `20000-29999`).
    pub host_port_range: String,
    /// Path of the reserved-ports list (default `/proc/sys/net/ipv4/ip_local_reserved_ports`),
    /// read from a dataplane-netns thread so the per-namespace sysctl is the dataplane's.
    pub reserved_ports_file: PathBuf,
    /// Guest inner IP (default 169.254.68.6).
    pub mvm_inner_ip: Ipv4Addr,
    /// Guest MAC (default 20:90:6f:fc:fc:fc).
    pub mvm_mac_addr: String,
    /// Guest gateway IP (default 169.254.68.5).
    pub mvm_gw_dest_ip: Ipv4Addr,
    /// Gateway MAC, also cube-dev's (default 20:90:6f:cf:cf:cf).
    pub mvm_gw_mac_addr: String,
    /// Guest prefix length (default 30).
    pub mvm_mask: u8,
    /// Name of the gateway dummy device (default `cube-dev`).
    pub cube_dev_name: String,
    /// Value written to the dataplane netns's `net.ipv4.ip_local_port_range` at startup so
    /// host ephemeral ports stay out of the host-port and SNAT ranges (default `10000 19999`,
    /// `reference/upstream.md §2.5`; empty = leave it). Per-netns; written from the netns thread.
    pub ip_local_port_range: String,
    /// Seconds between session reaper sweeps (default 5).
    pub reaper_interval_secs: u64,
    /// How `from_cube`/`from_world`/`from_envoy` are attached: `auto` (default: pinned tcx
    /// links on kernels ≥ 6.6, legacy tc below; a new TAP first gets `from_cube` as a legacy
    /// filter and the maintenance loop moves it to its tcx link in the background, decision
    /// F5), `tcx` (tcx at creation: ~16 ms per TAP), or `legacy` (clsact + direct-action
    /// filter, as upstream; no datapath slots). Pins of `tcx`/`auto` are not converted to
    /// `legacy`; `auto` converts filters a `legacy` run left on TAPs it adopts.
    pub tc_attach: String,
    /// Seconds between maintenance passes (Cleaning retries, refill; default 5). The pool's
    /// surplus is trimmed only in a pass no Ensure/Release woke within this interval (F10).
    pub maintenance_interval_secs: u64,
    /// Entries a sandbox may have in `cubevs_context.allow_out`, and separately in
    /// `deny_out` (default 1024, 1..65536). Over it, Ensure/Reconcile answer INVALID_ARGUMENT.
    /// The datapath's policy tries are sized so that every sandbox can hold this twice.
    pub policy_entries_per_sandbox: u32,
    /// Live sessions (flows) one sandbox may hold in the datapath (default 16384, 1..524288):
    /// its next new flow is dropped and counted (`drop_session_quota` on /metrics, and the
    /// sandbox's `session_quota` drops), so one sandbox can never fill the session maps or one
    /// remote endpoint's SNAT ports for the others (decision Q1).
    pub sessions_per_sandbox: u32,
    /// Live sessions every sandbox may always open, however many the others hold (default 64,
    /// 0..=min(sessions_per_sandbox, 127); 0 = off): a sandbox holding this many or more opens
    /// another only while the node's live sessions are below 1,048,576 − registered sandboxes
    /// × this − possible CPUs, else the flow is dropped and counted (`drop_node_sessions` on
    /// /metrics, the sandbox's `node_sessions` drops). The upper bound keeps the floors of all
    /// 8,192 sandboxes the datapath can hold, plus one per CPU, inside the session maps
    /// (decision Q4).
    pub session_floor_per_sandbox: u32,
    /// Tracked DNS queries (`dns_query_track_v2`, 65,536 entries) every sandbox may always
    /// hold, however many the others track (default 4, 0..=7; 0 = off): above it a query is
    /// tracked only while the node's tracked queries are below 65,536 − registered sandboxes ×
    /// this − possible CPUs, else it is forwarded untracked (its answer not learned;
    /// `dns_query_over_budget`). 7 × 8,192 sandboxes + 1,024 CPUs fit the map (decision Q6).
    pub dns_query_floor_per_sandbox: u32,
    /// Recorded first fragments (`frag_sessions_v2`, 65,536 entries) every sandbox may always
    /// hold (default 4, 0..=7; 0 = off), as `dns_query_floor_per_sandbox` (over it the first
    /// fragment is delivered unrecorded, its later fragments go to the host;
    /// `frag_over_budget`).
    pub frag_floor_per_sandbox: u32,
    /// Learned addresses (`dns_learned`, 262,144 entries) every sandbox may always hold
    /// (default 8, 0..=31; 0 = off): above it a new learned entry is made only while the
    /// node's learned entries are below 262,144 − registered sandboxes × this − possible CPUs,
    /// else the answer's address is not learned (`dns_learn_full`). 31 × 8,192 + 1,024 fit
    /// the map (decision R66).
    pub dns_learned_floor_per_sandbox: u32,
    /// New connections to CubeEgress (TCP SYNs the datapath steers to the gateway) one sandbox
    /// may open per second (default 200, 0..=1000000; 0 = no bound): beyond its bucket the SYN
    /// is dropped and counted (`drop_new_flow_rate`), the guest retransmits it. The node's TCP
    /// stack completes every such handshake before the gateway can admit it, so this is what
    /// keeps one sandbox's connection churn from starving the others' L7 traffic (decision R91).
    pub l7_connect_rate_per_sandbox: u32,
    /// How many of those a sandbox may open back to back after a quiet spell (default 400,
    /// 1..=1000000).
    pub l7_connect_burst_per_sandbox: u32,
    /// A Reconcile whose new policy denies a destination the old one allowed flushes the
    /// sandbox's established flows (default true; sessions are cut by a new sandbox version).
    /// Per request: `persist_metadata["cubenet.io/flush-sessions-on-tighten"]` = `"true"` /
    /// `"false"` overrides it. `false` is upstream's behaviour (flows outlive the change).
    pub flush_sessions_on_policy_tighten: bool,
    /// CubeEgress admin API base URL the agent pushes each sandbox's L7 rules to
    /// (default `http://127.0.0.1:9091`; `""` disables the push). Only `http://host:port`.
    pub cube_egress_admin_url: String,
    /// Timeout of one push to the gateway, in milliseconds (default 2000, 1..60000).
    pub cube_egress_push_timeout_ms: u64,
    /// Unix socket of the live upgrade hand-over (`crate::handover`; default empty = off). The
    /// agent listens there (0600, peer uid checked); a new agent started with the same key
    /// first asks the running one for its listeners and TAP fds instead of binding afresh.
    pub handover_socket: PathBuf,
    /// What the old agent does once it handed over and finished its in-flight requests:
    /// `exit` (default, status 0) or `wait` (close every TAP fd and listener it still holds,
    /// then stay idle until SIGTERM/SIGINT: for supervisors that restart a process that
    /// exits, such as a Kubernetes container with `restartPolicy: Always`).
    pub after_handover: AfterHandover,
    /// XDP fast path on the uplink (`xdp_world`): `"off"` (default), `"generic"`, `"native"`
    /// or `"auto"` (native when the driver supports it, else generic). Only for uplinks that
    /// receive frames from a wire (physical NICs): XDP cannot see an skb's CHECKSUM_PARTIAL
    /// state, so a veth uplink whose peer sends with TX checksum offload breaks (decision X3).
    pub xdp_mode: String,
    /// Destinations every sandbox of this node is always denied, on top of the baseline
    /// ranges (`cubevs::policy::BASELINE_DENY`): IPv4 addresses (/32) or CIDRs (host bits
    /// must be zero), at most 64 (`cubevs_common::limits::NODE_DENY`). Checked before any allow (`allow_out`,
    /// learned FQDN addresses, static L7 entries) and never learned from a DNS answer; written
    /// to the pinned `node_deny` map at every start, replacing what a previous run wrote, and
    /// again on SIGHUP from the re-read file (the one key a reload applies, decision R51).
    /// Default `["100.100.100.200/32", "169.254.169.254/32"]` (the instance metadata services
    /// of Alibaba Cloud and of AWS, GCP, Azure, OpenStack, Oracle; decisions R30, R85);
    /// `[]` = baseline only. CubeEgress has its own key of the same name: keep them equal.
    pub always_denied_cidrs: Vec<String>,
    /// Uids besides root and the agent's own that may use the gRPC socket (`grpc_listen` as
    /// `unix://`) and the TAP fd socket (`tap_fd_listen`): a cubelet or VMM running as another
    /// non-root user (decision R50). Default `[]`. At most 64, no duplicates, not 4294967295.
    /// Each socket file then carries a POSIX ACL granting these uids read/write (mode 0600
    /// otherwise; 0666 on a filesystem without ACLs, logged) and every connection is checked
    /// with SO_PEERCRED; the socket directories must be searchable by them. The hand-over
    /// socket and the `/v1/` dumps of the HTTP listeners stay root and the agent's uid only.
    pub allowed_peer_uids: Vec<u32>,
}

/// The `after_handover` key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AfterHandover {
    /// Exit with status 0.
    #[default]
    Exit,
    /// Hold nothing and wait for SIGTERM/SIGINT.
    Wait,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            grpc_listen: "unix:///tmp/cube/network-agent-grpc.sock".into(),
            tap_fd_listen: "/tmp/cube/network-agent-tap.sock".into(),
            health_listen: "127.0.0.1:19090".into(),
            dataplane_netns: "/proc/1/ns/net".into(),
            egress_dump_listen: "127.0.0.1:19091".into(),
            eth_name: String::new(),
            cidr: "192.168.0.0/18".into(),
            mtu: 1500,
            tap_init_num: 500,
            warm_parallelism: 4,
            bpffs_dir: "/sys/fs/bpf/cubevs".into(),
            bpf_object: String::new(),
            state_dir: "/dev/shm/cube/network-agent/state".into(),
            host_port_range: "20000-29999".into(),
            reserved_ports_file: "/proc/sys/net/ipv4/ip_local_reserved_ports".into(),
            mvm_inner_ip: Ipv4Addr::new(169, 254, 68, 6),
            mvm_mac_addr: "20:90:6f:fc:fc:fc".into(),
            mvm_gw_dest_ip: Ipv4Addr::new(169, 254, 68, 5),
            mvm_gw_mac_addr: "20:90:6f:cf:cf:cf".into(),
            mvm_mask: 30,
            cube_dev_name: "cube-dev".into(),
            ip_local_port_range: "10000 19999".into(),
            reaper_interval_secs: 5,
            tc_attach: "auto".into(),
            maintenance_interval_secs: 5,
            policy_entries_per_sandbox: cubevs::policy::DEFAULT_ENTRIES_PER_SANDBOX,
            sessions_per_sandbox: cubevs_common::limits::SESSIONS_PER_SANDBOX,
            session_floor_per_sandbox: cubevs_common::limits::SESSION_FLOOR,
            dns_query_floor_per_sandbox: cubevs_common::limits::DNS_QUERY_FLOOR,
            frag_floor_per_sandbox: cubevs_common::limits::FRAG_FLOOR,
            dns_learned_floor_per_sandbox: cubevs_common::limits::DNS_LEARNED_FLOOR,
            l7_connect_rate_per_sandbox: cubevs_common::new_flow::RATE,
            l7_connect_burst_per_sandbox: cubevs_common::new_flow::BURST,
            flush_sessions_on_policy_tighten: true,
            cube_egress_admin_url: "http://127.0.0.1:9091".into(),
            cube_egress_push_timeout_ms: 2000,
            handover_socket: PathBuf::new(),
            after_handover: AfterHandover::Exit,
            xdp_mode: "off".into(),
            always_denied_cidrs: DEFAULT_ALWAYS_DENIED.iter().map(|s| s.to_string()).collect(),
            allowed_peer_uids: Vec::new(),
        }
    }
}

/// Default `always_denied_cidrs`: the cloud instance metadata services (decisions R30, R85).
pub const DEFAULT_ALWAYS_DENIED: &[&str] = &["100.100.100.200/32", "169.254.169.254/32"];

/// Most `allowed_peer_uids` entries.
pub const MAX_ALLOWED_PEER_UIDS: usize = 64;

/// An IPv4 network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    /// Network address (host bits zero).
    pub base: Ipv4Addr,
    /// Prefix length.
    pub prefix: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n` with the one CIDR parser (`cubevs::Cidr::parse`, strict); the
    /// length is required and host bits must be zero (a typo here moves every sandbox).
    pub fn parse(s: &str) -> Result<Self, String> {
        if !s.contains('/') {
            return Err(format!("{s:?} is not a.b.c.d/len"));
        }
        let c = cubevs::Cidr::parse(s)?;
        if c.has_host_bits() {
            return Err(format!("{s} has host bits set"));
        }
        Ok(Self { base: c.addr, prefix: c.len })
    }

    /// Number of addresses.
    pub fn size(&self) -> u64 {
        1u64 << (32 - self.prefix)
    }

    /// The `i`-th address of the network.
    pub fn nth(&self, i: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.base).wrapping_add(i))
    }

    /// Index of `ip` inside the network, if it is inside.
    pub fn index_of(&self, ip: Ipv4Addr) -> Option<u32> {
        let off = u32::from(ip).wrapping_sub(u32::from(self.base));
        (u64::from(off) < self.size() && u32::from(ip) >= u32::from(self.base)).then_some(off)
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix)
    }
}

/// Longest interface name Linux accepts (`IFNAMSIZ` − 1).
pub const MAX_IFNAME: usize = 15;

/// The longest TAP name (`z<ip>`, `reference/upstream.md §2.3`) among the sandbox addresses of
/// `cidr` (all but the network, gateway `.1` and broadcast addresses); `None` when it has none.
pub fn longest_tap_name(cidr: Cidr) -> Option<String> {
    let n = u32::try_from(cidr.size()).ok()?;
    (2..n.saturating_sub(1)).map(|i| crate::host::tap_name(cidr.nth(i))).max_by_key(|s| s.len())
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return Err(format!("{s:?} is not a MAC address aa:bb:cc:dd:ee:ff"));
    }
    let mut mac = [0u8; 6];
    for (d, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return Err(format!("{s:?} is not a MAC address aa:bb:cc:dd:ee:ff"));
        }
        *d = u8::from_str_radix(p, 16).map_err(|_| format!("{s:?} is not a MAC address"))?;
    }
    Ok(mac)
}

/// `aa:bb:cc:dd:ee:ff` rendering.
pub fn mac_string(mac: [u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// Parses `first-last` (inclusive, first ≤ last, first ≥ 1).
pub fn parse_port_range(s: &str) -> Result<(u16, u16), String> {
    let (a, b) = s.split_once('-').ok_or_else(|| format!("{s:?} is not first-last"))?;
    let a: u16 = a.trim().parse().map_err(|_| format!("{a:?} is not a port"))?;
    let b: u16 = b.trim().parse().map_err(|_| format!("{b:?} is not a port"))?;
    if a == 0 || a > b {
        return Err(format!("{s:?}: need 1 <= first <= last"));
    }
    Ok((a, b))
}

/// A validated configuration with parsed values.
#[derive(Clone, Debug)]
pub struct Validated {
    /// The raw configuration.
    pub raw: Config,
    /// `cidr` parsed.
    pub cidr: Cidr,
    /// `mvm_mac_addr` parsed.
    pub mvm_mac: [u8; 6],
    /// `mvm_gw_mac_addr` parsed.
    pub gw_mac: [u8; 6],
    /// `host_port_range` parsed.
    pub port_range: (u16, u16),
    /// `xdp_mode` parsed.
    pub xdp_mode: cubevs::XdpMode,
    /// `always_denied_cidrs` parsed (a bare address is a /32), in the given order.
    pub always_denied: Vec<cubevs::Cidr>,
}

impl Config {
    /// Reads and parses `path` (unknown keys are errors).
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Self::parse(&text).map_err(|msg| ConfigError::Parse { path: path.to_path_buf(), msg })
    }

    /// Parses TOML text. The error is one line: `line N (KEY = VALUE): reason`, and for a key
    /// the agent does not know `unknown key `K``, with the closest known key as a suggestion
    /// (decision O1).
    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| parse_error(text, &e))
    }

    /// Checks every key; the error names the first bad key.
    pub fn validate(self) -> Result<Validated, ConfigError> {
        let cidr = Cidr::parse(&self.cidr).map_err(|r| invalid("cidr", r))?;
        if !(16..=24).contains(&cidr.prefix) {
            return Err(invalid("cidr", format!("prefix /{} outside /16../24", cidr.prefix)));
        }
        if let Some(long) = longest_tap_name(cidr).filter(|n| n.len() > MAX_IFNAME) {
            return Err(invalid(
                "cidr",
                format!(
                    "TAP names are z<sandbox ip> and {cidr} needs {long:?} ({} bytes), but Linux interface \
                     names hold at most {MAX_IFNAME} bytes; choose a range whose addresses have at most {} \
                     characters (e.g. 192.168.0.0/18 or 10.x.0.0/16)",
                    long.len(),
                    MAX_IFNAME - 1
                ),
            ));
        }
        if !(576..=65535).contains(&self.mtu) {
            return Err(invalid("mtu", format!("{} outside 576..65535", self.mtu)));
        }
        if self.tap_init_num as u64 > cidr.size() - 3 {
            return Err(invalid(
                "tap_init_num",
                format!("{} exceeds the {} addresses of cidr", self.tap_init_num, cidr),
            ));
        }
        if self.warm_parallelism == 0 || self.warm_parallelism > 64 {
            return Err(invalid("warm_parallelism", "must be 1..64"));
        }
        let mvm_mac = parse_mac(&self.mvm_mac_addr).map_err(|r| invalid("mvm_mac_addr", r))?;
        let gw_mac = parse_mac(&self.mvm_gw_mac_addr).map_err(|r| invalid("mvm_gw_mac_addr", r))?;
        if self.mvm_mask == 0 || self.mvm_mask > 30 {
            return Err(invalid("mvm_mask", format!("/{} outside /1../30", self.mvm_mask)));
        }
        let port_range = parse_port_range(&self.host_port_range).map_err(|r| invalid("host_port_range", r))?;
        // A host port is DNATed into its sandbox whatever else owns the port on the node
        // address, so the range must stay clear of the SNAT ports (decision O16).
        let snat_min = cubevs_common::snat::PORT_MIN;
        if port_range.1 >= snat_min {
            return Err(invalid(
                "host_port_range",
                format!(
                    "{:?} reaches the SNAT ports {snat_min}-65535 (replies to sandboxes' own flows would be \
                     taken for host-port traffic); end it below {snat_min}, e.g. \"20000-29999\"",
                    self.host_port_range
                ),
            ));
        }
        let hp = self.grpc_listen.strip_prefix("tcp://").unwrap_or(&self.grpc_listen);
        let unix_ok = self.grpc_listen.strip_prefix("unix://").is_some_and(|p| p.starts_with('/'));
        let tcp_ok = hp.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !unix_ok && !tcp_ok {
            return Err(invalid(
                "grpc_listen",
                format!("{:?} is not unix:///PATH, tcp://HOST:PORT or HOST:PORT", self.grpc_listen),
            ));
        }
        if self.tap_fd_listen.as_os_str().is_empty() {
            return Err(invalid("tap_fd_listen", "must not be empty"));
        }
        self.health_listen
            .parse::<std::net::SocketAddr>()
            .map_err(|e| invalid("health_listen", format!("{:?}: {e}", self.health_listen)))?;
        if !self.egress_dump_listen.is_empty() {
            self.egress_dump_listen
                .parse::<std::net::SocketAddr>()
                .map_err(|e| invalid("egress_dump_listen", format!("{:?}: {e}", self.egress_dump_listen)))?;
        }
        if self.state_dir.as_os_str().is_empty() {
            return Err(invalid("state_dir", "must not be empty"));
        }
        if !self.handover_socket.as_os_str().is_empty() {
            let h = &self.handover_socket;
            if !h.is_absolute() {
                return Err(invalid("handover_socket", format!("{} is not an absolute path", h.display())));
            }
            let grpc = self.grpc_listen.strip_prefix("unix://").map(std::path::Path::new);
            if h == &self.tap_fd_listen || grpc == Some(h.as_path()) {
                return Err(invalid("handover_socket", "must differ from tap_fd_listen and grpc_listen"));
            }
        }
        if self.bpffs_dir.as_os_str().is_empty() {
            return Err(invalid("bpffs_dir", "must not be empty"));
        }
        if self.cube_dev_name.is_empty() || self.cube_dev_name.len() >= 16 {
            return Err(invalid("cube_dev_name", "must be 1..15 bytes"));
        }
        if !self.ip_local_port_range.is_empty() {
            let v: Vec<&str> = self.ip_local_port_range.split_whitespace().collect();
            let ok = v.len() == 2
                && matches!((v[0].parse::<u16>(), v[1].parse::<u16>()), (Ok(a), Ok(b)) if a >= 1 && a <= b);
            if !ok {
                return Err(invalid(
                    "ip_local_port_range",
                    format!("{:?} is not \"first last\"", self.ip_local_port_range),
                ));
            }
            // The node's own connections draw their local ports from this range: a port that
            // is also a host port or a SNAT port would have its replies taken by the datapath
            // (decision O16).
            let (a, b) = (v[0].parse::<u16>().unwrap_or(0), v[1].parse::<u16>().unwrap_or(0));
            let clash = |first: u16, last: u16| a <= last && first <= b;
            let snat_min = cubevs_common::snat::PORT_MIN;
            let what = if clash(port_range.0, port_range.1) {
                Some(format!("host_port_range {}", self.host_port_range))
            } else if clash(snat_min, u16::MAX) {
                Some(format!("the SNAT ports {snat_min}-65535"))
            } else {
                None
            };
            if let Some(what) = what {
                return Err(invalid(
                    "ip_local_port_range",
                    format!(
                        "{:?} overlaps {what}: the node's own connections would lose their replies to the \
                         datapath; choose ports outside both (default \"10000 19999\") or \"\" to leave the \
                         sysctl alone",
                        self.ip_local_port_range
                    ),
                ));
            }
        }
        if !["auto", "tcx", "legacy"].contains(&self.tc_attach.as_str()) {
            return Err(invalid("tc_attach", format!("{:?} is not auto, tcx or legacy", self.tc_attach)));
        }
        if self.reaper_interval_secs == 0 {
            return Err(invalid("reaper_interval_secs", "must be at least 1"));
        }
        if self.maintenance_interval_secs == 0 {
            return Err(invalid("maintenance_interval_secs", "must be at least 1"));
        }
        if !(1..=65536).contains(&self.policy_entries_per_sandbox) {
            return Err(invalid(
                "policy_entries_per_sandbox",
                format!("{} outside 1..65536", self.policy_entries_per_sandbox),
            ));
        }
        let max_sessions = cubevs_common::limits::SESSIONS / 2;
        if !(1..=max_sessions).contains(&self.sessions_per_sandbox) {
            return Err(invalid(
                "sessions_per_sandbox",
                format!("{} outside 1..{max_sessions} (half of the session maps)", self.sessions_per_sandbox),
            ));
        }
        // Floors of every interface the datapath can register, plus a margin of 1,024 CPUs
        // (more than any node has possible), must fit in the session maps: 127 at the defaults.
        let max_floor = ((cubevs_common::limits::SESSIONS - 1024) / cubevs_common::limits::SANDBOXES)
            .min(self.sessions_per_sandbox);
        if self.session_floor_per_sandbox > max_floor {
            return Err(invalid(
                "session_floor_per_sandbox",
                format!(
                    "{} above {max_floor} (min of sessions_per_sandbox and (1048576 - 1024) / 8192 sandboxes)",
                    self.session_floor_per_sandbox
                ),
            ));
        }
        // The same for the tracking maps (65,536 entries each): 7 at most.
        for (key, floor, capacity) in [
            ("dns_query_floor_per_sandbox", self.dns_query_floor_per_sandbox, cubevs_common::limits::DNS_QUERIES),
            ("frag_floor_per_sandbox", self.frag_floor_per_sandbox, cubevs_common::limits::FRAG_SESSIONS),
            // And for `dns_learned` (262,144 entries): 31 at most (decision R66).
            ("dns_learned_floor_per_sandbox", self.dns_learned_floor_per_sandbox, cubevs_common::limits::DNS_LEARNED),
        ] {
            let max = (capacity - 1024) / cubevs_common::limits::SANDBOXES;
            if floor > max {
                return Err(invalid(key, format!("{floor} above {max} (({capacity} - 1024) / 8192 sandboxes)")));
            }
        }
        if self.l7_connect_rate_per_sandbox > 1_000_000 {
            return Err(invalid(
                "l7_connect_rate_per_sandbox",
                format!("{} outside 0..1000000", self.l7_connect_rate_per_sandbox),
            ));
        }
        if !(1..=1_000_000).contains(&self.l7_connect_burst_per_sandbox) {
            return Err(invalid(
                "l7_connect_burst_per_sandbox",
                format!("{} outside 1..1000000", self.l7_connect_burst_per_sandbox),
            ));
        }
        if !self.cube_egress_admin_url.is_empty() {
            crate::egress_sync::parse_admin_url(&self.cube_egress_admin_url)
                .map_err(|r| invalid("cube_egress_admin_url", r))?;
        }
        if !(1..=60000).contains(&self.cube_egress_push_timeout_ms) {
            return Err(invalid(
                "cube_egress_push_timeout_ms",
                format!("{} outside 1..60000", self.cube_egress_push_timeout_ms),
            ));
        }
        let xdp_mode = self.xdp_mode.parse::<cubevs::XdpMode>().map_err(|r| invalid("xdp_mode", r))?;
        let max = cubevs_common::limits::NODE_DENY as usize;
        if self.always_denied_cidrs.len() > max {
            return Err(invalid(
                "always_denied_cidrs",
                format!("{} entries exceed the limit of {max}", self.always_denied_cidrs.len()),
            ));
        }
        let mut always_denied = Vec::with_capacity(self.always_denied_cidrs.len());
        for (i, s) in self.always_denied_cidrs.iter().enumerate() {
            let bad = |r: String| invalid("always_denied_cidrs", format!("[{i}] {s:?}: {r}"));
            // The parser's reason already quotes the entry.
            let c = cubevs::Cidr::parse(s).map_err(|r| invalid("always_denied_cidrs", format!("[{i}] {r}")))?;
            // Strict, as `cidr`: a typo such as `100.100.100.200/10` would deny a whole range.
            if c.has_host_bits() {
                return Err(bad("host bits set".into()));
            }
            always_denied.push(c);
        }
        if self.allowed_peer_uids.len() > MAX_ALLOWED_PEER_UIDS {
            return Err(invalid(
                "allowed_peer_uids",
                format!("{} entries exceed the limit of {MAX_ALLOWED_PEER_UIDS}", self.allowed_peer_uids.len()),
            ));
        }
        for (i, u) in self.allowed_peer_uids.iter().enumerate() {
            if *u == u32::MAX {
                return Err(invalid("allowed_peer_uids", format!("[{i}] 4294967295 is not a uid (it means none)")));
            }
            if self.allowed_peer_uids[..i].contains(u) {
                return Err(invalid("allowed_peer_uids", format!("[{i}] {u} is listed twice")));
            }
        }
        Ok(Validated { raw: self, cidr, mvm_mac, gw_mac, port_range, xdp_mode, always_denied })
    }
}

impl Validated {
    /// cube-dev's address: the CIDR's `.1`.
    pub fn gateway_ip(&self) -> Ipv4Addr {
        self.cidr.nth(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        let v = Config::default().validate().unwrap();
        assert_eq!(v.cidr.to_string(), "192.168.0.0/18");
        assert_eq!(v.gateway_ip(), Ipv4Addr::new(192, 168, 0, 1));
        assert_eq!(v.port_range, (20000, 29999));
        assert_eq!(v.xdp_mode, cubevs::XdpMode::Off);
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn always_denied_cidrs_default_and_limits() {
        let v = Config::default().validate().unwrap();
        assert_eq!(
            v.always_denied,
            [
                cubevs::Cidr::new(Ipv4Addr::new(100, 100, 100, 200), 32),
                cubevs::Cidr::new(Ipv4Addr::new(169, 254, 169, 254), 32)
            ]
        );
        let v = Config::parse("always_denied_cidrs = []").unwrap().validate().unwrap();
        assert!(v.always_denied.is_empty());
        let v = Config::parse("always_denied_cidrs = [\"10.96.0.1\", \"100.64.0.0/10\"]").unwrap().validate().unwrap();
        assert_eq!(v.always_denied[0], cubevs::Cidr::new(Ipv4Addr::new(10, 96, 0, 1), 32));
        assert_eq!(v.always_denied[1], cubevs::Cidr::new(Ipv4Addr::new(100, 64, 0, 0), 10));
        for bad in ["\"100.100.100.200/10\"", "\"1.2.3\"", "\"1.2.3.4/33\""] {
            let e = Config::parse(&format!("always_denied_cidrs = [\"1.1.1.1\", {bad}]"))
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(e.contains("`always_denied_cidrs`") && e.contains("[1]"), "{e}");
            assert_eq!(e.matches(bad.trim_matches('"')).count(), 1, "the entry once: {e}");
        }
        let many: Vec<String> = (0..65).map(|i| format!("\"203.0.113.{i}\"")).collect();
        let e = Config::parse(&format!("always_denied_cidrs = [{}]", many.join(", ")))
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("65 entries exceed the limit of 64"), "{e}");
    }

    #[test]
    fn port_ranges_stay_clear_of_each_other_and_of_the_snat_ports() {
        let e = |text: &str| Config::parse(text).unwrap().validate().unwrap_err().to_string();
        let ok = |text: &str| Config::parse(text).unwrap().validate().map(|_| ()).unwrap();
        let msg = e("host_port_range = \"20000-30000\"");
        assert!(msg.contains("`host_port_range`") && msg.contains("SNAT ports 30000-65535"), "{msg}");
        ok("host_port_range = \"20000-29999\"\nip_local_port_range = \"10000 19999\"");
        ok("host_port_range = \"1024-9999\"\nip_local_port_range = \"10000 29999\"");
        for (range, clash) in [
            ("20000 25000", "host_port_range 20000-29999"),
            ("19999 19999", "host_port_range 15000-19999"),
            ("32768 60999", "the SNAT ports 30000-65535"),
            ("1024 65535", "host_port_range"),
        ] {
            let hp = if range == "19999 19999" { "15000-19999" } else { "20000-29999" };
            let msg = e(&format!("host_port_range = \"{hp}\"\nip_local_port_range = \"{range}\""));
            assert!(msg.contains("`ip_local_port_range`") && msg.contains(clash) && msg.contains("choose"), "{msg}");
        }
        // "" leaves the sysctl alone: nothing to check.
        ok("ip_local_port_range = \"\"");
    }

    #[test]
    fn allowed_peer_uids_are_checked() {
        assert!(Config::default().allowed_peer_uids.is_empty());
        let v = Config::parse("allowed_peer_uids = [1001, 65534]").unwrap().validate().unwrap();
        assert_eq!(v.raw.allowed_peer_uids, [1001, 65534]);
        for (bad, want) in
            [("[1001, 1001]", "[1] 1001 is listed twice"), ("[4294967295]", "[0] 4294967295 is not a uid")]
        {
            let e = Config::parse(&format!("allowed_peer_uids = {bad}")).unwrap().validate().unwrap_err().to_string();
            assert!(e.contains("`allowed_peer_uids`") && e.contains(want), "{e}");
        }
        let e = Config::parse("allowed_peer_uids = [-1]").unwrap_err();
        assert!(e.contains("allowed_peer_uids"), "{e}");
        let many: Vec<String> = (1000..1065).map(|u| u.to_string()).collect();
        let e = Config::parse(&format!("allowed_peer_uids = [{}]", many.join(", ")))
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("65 entries exceed the limit of 64"), "{e}");
    }

    #[test]
    fn errors_name_the_key() {
        let e = Config::parse("cidr = \"10.0.0.0/8\"").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`cidr`"), "{e}");
        let e = Config::parse("mtu = 10").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`mtu`"), "{e}");
        let e = Config::parse("mvm_mac_addr = \"zz\"").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`mvm_mac_addr`"), "{e}");
        let e = Config::parse("host_port_range = \"3-2\"").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`host_port_range`"), "{e}");
        let e = Config::parse("grpc_listen = \"/tmp/x\"").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`grpc_listen`"), "{e}");
        assert!(Config::parse("grpc_listen = \"tcp://127.0.0.1:9\"").unwrap().validate().is_ok());
        let e = Config::parse("xdp_mode = \"fast\"").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`xdp_mode`") && e.contains("off, generic, native, auto"), "{e}");
        let v = Config::parse("xdp_mode = \"auto\"").unwrap().validate().unwrap();
        assert_eq!(v.xdp_mode, cubevs::XdpMode::Auto);
        let e = Config::parse("bogus = 1").unwrap_err();
        assert!(e.contains("bogus"), "{e}");
        let e = Config::parse("mtu = \"x\"").unwrap_err();
        assert!(e.contains("mtu"), "{e}");
    }

    /// O1: a typo'd key is refused with its line and the key it was probably meant to be, in
    /// one line; a wrong type names the line and its key; an unrelated word gets no guess.
    #[test]
    fn unknown_keys_are_refused_with_a_suggestion() {
        let e = Config::parse("cidr = \"10.9.0.0/24\"\ntap_init_nm = 5\n").unwrap_err();
        assert_eq!(
            e,
            "line 2 (tap_init_nm = 5): unknown key `tap_init_nm` (did you mean `tap_init_num`? every key is in \
             the README's Configuration table; `network-agent --print-config` prints them with their values)"
        );
        let e = Config::parse("always_denied_cidr = []").unwrap_err();
        assert!(e.contains("did you mean `always_denied_cidrs`?"), "{e}");
        let e = Config::parse("[egress]\nfoo = 1").unwrap_err();
        assert!(e.starts_with("line 1 ([egress]): unknown key `egress` (every key"), "{e}");
        let e = Config::parse("mtu = 1500\ntap_init_num = \"5\"").unwrap_err();
        assert!(e.starts_with("line 2 (tap_init_num = \"5\"): invalid type"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let keys = known_keys();
        assert!(keys.iter().any(|k| k == "always_denied_cidrs") && keys.iter().any(|k| k == "handover_socket"));
    }

    #[test]
    fn cidrs_whose_tap_names_do_not_fit_are_refused() {
        // z192.168.100.254 is 16 bytes.
        let e = Config::parse("cidr = \"192.168.100.0/24\"").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`cidr`") && e.contains("z192.168.100.254") && e.contains("15 bytes"), "{e}");
        let e = Config::parse("cidr = \"192.168.128.0/17\"").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("z192.168.255.254"), "{e}");
        // The defaults (upstream's and the Kubernetes chart's) fit: z192.168.63.254 is 15 bytes.
        assert_eq!(longest_tap_name(Cidr::parse("192.168.0.0/18").unwrap()).unwrap(), "z192.168.63.254");
        for ok in ["192.168.0.0/18", "172.16.0.0/18", "10.244.0.0/16", "192.168.99.0/24"] {
            Config::parse(&format!("cidr = \"{ok}\"\ntap_init_num = 10"))
                .unwrap()
                .validate()
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
    }

    #[test]
    fn handover_keys_are_checked() {
        let e = Config::parse("handover_socket = \"rel.sock\"").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`handover_socket`") && e.contains("absolute"), "{e}");
        let same = "handover_socket = \"/tmp/cube/network-agent-tap.sock\"";
        let e = Config::parse(same).unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`handover_socket`"), "{e}");
        let ok = Config::parse("handover_socket = \"/run/cube/handover.sock\"\nafter_handover = \"wait\"").unwrap();
        assert_eq!(ok.after_handover, AfterHandover::Wait);
        assert!(ok.validate().is_ok());
        let e = Config::parse("after_handover = \"later\"").unwrap_err();
        assert!(e.contains("after_handover"), "{e}");
    }

    #[test]
    fn tc_attach_modes() {
        for ok in ["auto", "tcx", "legacy"] {
            Config::parse(&format!("tc_attach = \"{ok}\"")).unwrap().validate().unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let e = Config::parse("tc_attach = \"xdp\"").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("tc_attach") && e.contains("xdp"), "{e}");
    }

    #[test]
    fn cidr_math() {
        let c = Cidr::parse("192.168.0.0/24").unwrap();
        assert_eq!(c.size(), 256);
        assert_eq!(c.nth(2), Ipv4Addr::new(192, 168, 0, 2));
        assert_eq!(c.index_of(Ipv4Addr::new(192, 168, 0, 9)), Some(9));
        assert_eq!(c.index_of(Ipv4Addr::new(192, 168, 1, 0)), None);
        assert!(Cidr::parse("192.168.0.1/24").is_err());
        for bad in ["192.168.0.0/+24", "192.168.0.0/024", "192.168.000.0/24", "192.168.0.0"] {
            assert!(Cidr::parse(bad).is_err(), "{bad}");
        }
        let e = Config::parse("policy_entries_per_sandbox = 0").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`policy_entries_per_sandbox`"), "{e}");
        for bad in ["sessions_per_sandbox = 0", "sessions_per_sandbox = 524289"] {
            let e = Config::parse(bad).unwrap().validate().unwrap_err().to_string();
            assert!(e.contains("`sessions_per_sandbox`"), "{bad}: {e}");
        }
        let c = Config::parse("sessions_per_sandbox = 64").unwrap().validate().unwrap();
        assert_eq!(c.raw.sessions_per_sandbox, 64);
        for bad in ["session_floor_per_sandbox = 128", "sessions_per_sandbox = 10\nsession_floor_per_sandbox = 11"] {
            let e = Config::parse(bad).unwrap().validate().unwrap_err().to_string();
            assert!(e.contains("`session_floor_per_sandbox`"), "{bad}: {e}");
        }
        for ok in ["session_floor_per_sandbox = 0", "session_floor_per_sandbox = 127"] {
            Config::parse(ok).unwrap().validate().unwrap();
        }
        for key in ["dns_query_floor_per_sandbox", "frag_floor_per_sandbox"] {
            let e = Config::parse(&format!("{key} = 8")).unwrap().validate().unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")), "{key}: {e}");
            for ok in [0, 7] {
                Config::parse(&format!("{key} = {ok}")).unwrap().validate().unwrap();
            }
        }
        for bad in ["l7_connect_rate_per_sandbox = 1000001", "l7_connect_burst_per_sandbox = 0"] {
            let e = Config::parse(bad).unwrap().validate().unwrap_err().to_string();
            assert!(e.contains(bad.split(' ').next().unwrap()), "{bad}: {e}");
        }
        let c = Config::parse("l7_connect_rate_per_sandbox = 0").unwrap().validate().unwrap();
        assert_eq!((c.raw.l7_connect_rate_per_sandbox, c.raw.l7_connect_burst_per_sandbox), (0, 400));
        let e = Config::parse("dns_learned_floor_per_sandbox = 32").unwrap().validate().unwrap_err().to_string();
        assert!(e.contains("`dns_learned_floor_per_sandbox`"), "{e}");
        for ok in [0, 8, 31] {
            Config::parse(&format!("dns_learned_floor_per_sandbox = {ok}")).unwrap().validate().unwrap();
        }
        assert_eq!(parse_mac("20:90:6f:cf:cf:cf").unwrap(), [0x20, 0x90, 0x6f, 0xcf, 0xcf, 0xcf]);
        assert_eq!(mac_string([0x20, 0x90, 0x6f, 0xcf, 0xcf, 0xcf]), "20:90:6f:cf:cf:cf");
    }
}
