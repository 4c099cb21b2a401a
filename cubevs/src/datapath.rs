//! Loading the CubeVS object, pinning/adopting its maps and attaching its programs.
//!
//! Pin layout under `LoadOptions::pin_dir` (a bpffs directory such as `/sys/fs/bpf/cubevs`):
//! `maps/<name>` for every map (reused by the next load when compatible), and
//! `links/<program>_<ifindex>` for every tcx link, so the datapath keeps forwarding after the
//! process exits and a new process adopts the links instead of attaching twice; the optional
//! XDP link of the uplink is pinned the same way (`links/xdp_world_<mode>_<ifindex>`, see
//! [`crate::xdp`]).

use std::{
    collections::{BTreeSet, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
};

use aya::{
    Ebpf,
    programs::{
        SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    },
    util::KernelVersion,
};
use cubevs_common::{DatapathConfig, OBJECT_FILE_NAME, limits, map, prog};

use crate::{
    Error, Maps, bpf_sys,
    counters::Counters,
    layout::{Meta, check_pins, read_meta, write_meta},
    lock::UpdateLock,
    node::NodeTable,
    policy::{PolicyLimits, PolicyTable},
    ports::PortMaps,
    quota::{FloorMap, QuotaMaps},
    sandbox::SandboxTable,
    sandbox_stats::SandboxStatsTable,
    sessions::Sessions,
    slots,
    snat::SnatTable,
    track_floor::{TrackFloor, TrackLimits},
};

/// Where to find the eBPF object when no path is configured, first hit wins:
/// 1. `$CUBEVS_BPF_OBJECT`;
/// 2. `cubevs.bpf.o` next to the running executable (how release bundles ship it);
/// 3. the build tree's `target/ebpf/cubevs.bpf.o` (what `cargo xtask build-ebpf` writes).
pub fn default_object_path() -> PathBuf {
    if let Some(p) = std::env::var_os("CUBEVS_BPF_OBJECT") {
        return PathBuf::from(p);
    }
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        let p = dir.join(OBJECT_FILE_NAME);
        if p.exists() {
            return p;
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("target").join("ebpf").join(OBJECT_FILE_NAME)
}

/// How programs are attached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttachMode {
    /// tcx on kernels ≥ 6.6, legacy tc below.
    #[default]
    Auto,
    /// tcx links (pinned when a pin directory is set).
    Tcx,
    /// clsact qdisc + direct-action filter at priority 1, handle 1 (what upstream uses);
    /// filters persist in the kernel until removed.
    LegacyTc,
    /// Pinned tcx links, but `from_cube` first goes onto a sandbox interface as a legacy
    /// filter running the active slot's program (about 1 ms instead of the ~16 ms RCU grace
    /// period a tcx attach waits for under RTNL), and [`Datapath::convert_next`] later puts
    /// the tcx link in front of it and removes the filter. Legacy tc on kernels < 6.6 and
    /// without a pin directory. Uplink and cube-dev attach with tcx directly.
    TcxDeferred,
}

/// `max_entries` of the resizable maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapLimits {
    /// Sessions per direction (`egress_sessions`, `ingress_sessions`).
    pub sessions: u32,
    /// Sandboxes (`ifindex_to_mvmmeta`, `mvmip_to_ifindex`, `policy_gen`, `sandbox_stats`).
    pub sandboxes: u32,
    /// Port mappings per map.
    pub port_mappings: u32,
    /// Entries one sandbox may have in `allow_out`, and separately in `deny_out` (default
    /// 1,024). The tries are sized from it: see [`MapLimits::policy_entries`].
    pub policy_entries_per_sandbox: u32,
    /// Live sessions one sandbox version may hold (default 16,384,
    /// `cubevs_common::limits::SESSIONS_PER_SANDBOX`; decision Q1): its next new flow is
    /// dropped and counted (`drop_session_quota`). The datapath enforces
    /// [`MapLimits::session_budget`], this value capped at half of `sessions`; 0 = no quota.
    pub sessions_per_sandbox: u32,
    /// Live sessions every registered sandbox version may always open, whatever the other
    /// sandboxes hold (default 64, `cubevs_common::limits::SESSION_FLOOR`; decision Q4): a
    /// sandbox holding this many or more opens another only while the node-wide live sessions
    /// are below `sessions - registered × session_floor - possible CPUs`, else the flow is
    /// dropped and counted (`drop_node_sessions`). 0 = no node-wide check. The datapath
    /// enforces [`MapLimits::session_floor`], this value capped so the reserve always fits.
    pub session_floor: u32,
    /// `dns_query_track_v2` entries every registered sandbox version may always hold (default
    /// 4, `cubevs_common::limits::DNS_QUERY_FLOOR`; decision Q6): above it a query is tracked
    /// only while the node-wide tracked queries are below `capacity - registered × floor -
    /// possible CPUs` (else forwarded untracked, `dns_query_over_budget`). 0 = no node-wide
    /// check. Enforced capped like [`MapLimits::session_floor`], see [`MapLimits::track_floor`].
    pub dns_query_floor: u32,
    /// `frag_sessions_v2` entries every registered sandbox version may always hold (default
    /// 4, `cubevs_common::limits::FRAG_FLOOR`; decision Q6), as [`MapLimits::dns_query_floor`]
    /// (over it: the first fragment is delivered unrecorded, `frag_over_budget`).
    pub frag_floor: u32,
    /// `dns_learned` entries every registered sandbox version may always hold (default 8,
    /// `cubevs_common::limits::DNS_LEARNED_FLOOR`; decision R66): above it a new learned entry
    /// is made only while the node's charged learned entries are below `capacity - registered
    /// × floor - possible CPUs` (else not learned, `dns_learn_full`). 0 = no node-wide check.
    /// Enforced capped like the tracking floors ([`MapLimits::track_floor`], without the
    /// 255 cap: [`MapLimits::learned_floor`]).
    pub dns_learned_floor: u32,
    /// New connections to CubeEgress one sandbox version may open per second (default 200,
    /// `cubevs_common::new_flow::RATE`; 0 = no bound; decision R91): written into
    /// `new_flow_config` at every load.
    pub l7_connect_rate: u32,
    /// The depth of that bucket (default 400, `cubevs_common::new_flow::BURST`).
    pub l7_connect_burst: u32,
}

impl Default for MapLimits {
    fn default() -> Self {
        Self {
            sessions: limits::SESSIONS,
            sandboxes: limits::SANDBOXES,
            port_mappings: limits::PORT_MAPPINGS,
            policy_entries_per_sandbox: crate::policy::DEFAULT_ENTRIES_PER_SANDBOX,
            sessions_per_sandbox: limits::SESSIONS_PER_SANDBOX,
            session_floor: limits::SESSION_FLOOR,
            dns_query_floor: limits::DNS_QUERY_FLOOR,
            frag_floor: limits::FRAG_FLOOR,
            dns_learned_floor: limits::DNS_LEARNED_FLOOR,
            l7_connect_rate: cubevs_common::new_flow::RATE,
            l7_connect_burst: cubevs_common::new_flow::BURST,
        }
    }
}

impl MapLimits {
    /// The policy limits these map sizes give: `sandboxes` interfaces with a policy, each at
    /// most `policy_entries_per_sandbox` entries per list.
    pub fn policy(&self) -> PolicyLimits {
        PolicyLimits { entries_per_sandbox: self.policy_entries_per_sandbox, interfaces: self.sandboxes }
    }

    /// `max_entries` of `allow_out` and of `deny_out`: room for two generations of every
    /// sandbox at its limit (`sandboxes × 2 × (policy_entries_per_sandbox + 6)`; 16,875,520
    /// with the defaults). LPM tries are never preallocated, so unused room costs no memory.
    /// Errors when `policy_entries_per_sandbox` is 0 or the product overflows a `u32`.
    pub fn policy_entries(&self) -> Result<u32, Error> {
        if self.policy_entries_per_sandbox == 0 {
            return Err(Error::invalid("limits.policy_entries_per_sandbox", "must be at least 1"));
        }
        self.policy().trie_entries().ok_or_else(|| {
            Error::invalid(
                "limits.policy_entries_per_sandbox",
                format!(
                    "{} sandboxes x 2 generations x {} entries overflow the trie size",
                    self.sandboxes, self.policy_entries_per_sandbox
                ),
            )
        })
    }

    /// The live-session budget the datapath enforces per sandbox version
    /// (`DatapathConfig::session_budget`): `min(sessions_per_sandbox, sessions / 2)`, so one
    /// sandbox never holds more than half of the session maps, whatever their size.
    /// `sessions_per_sandbox` 0 turns the quota off (budget 0: nothing checked or charged; for
    /// measuring its cost; the agent refuses 0). Errors when `sessions` is below 2.
    pub fn session_budget(&self) -> Result<u32, Error> {
        if self.sessions < 2 {
            return Err(Error::invalid("limits.sessions", "must be at least 2"));
        }
        Ok(self.sessions_per_sandbox.min(self.sessions / 2))
    }

    /// The node-wide floor the datapath enforces (decision Q4): `session_floor` capped at the
    /// budget ([`MapLimits::session_budget`]; a floor is a share of it) and at
    /// `(sessions - cpus) / sandboxes`, so the floors of `sandboxes` registered interfaces plus
    /// one session per possible CPU always fit in the session maps, whatever registers (with
    /// small maps the floor is thus 0: off, like the budget capped at half the maps). The
    /// agent refuses a configuration that would be capped (`session_floor_per_sandbox`).
    pub fn session_floor(&self, cpus: u32) -> Result<u32, Error> {
        let budget = self.session_budget()?;
        let fit = self.sessions.saturating_sub(cpus) / self.sandboxes.max(1);
        Ok(self.session_floor.min(budget).min(fit))
    }

    /// A tracking floor the datapath enforces (decision Q6): `floor` (`dns_query_floor` or
    /// `frag_floor`) capped at `(capacity - cpus) / sandboxes` (the reserve of every interface
    /// plus one entry per CPU fits in the map) and at 255 (the `TRACK_LIMITS` field).
    pub fn track_floor(&self, floor: u32, capacity: u32, cpus: u32) -> u32 {
        let fit = capacity.saturating_sub(cpus) / self.sandboxes.max(1);
        floor.min(fit).min(0xFF)
    }

    /// The learned floor the datapath enforces (decision R66): `dns_learned_floor` capped at
    /// `(capacity - cpus) / sandboxes`, so the reserve of every interface plus one entry per
    /// CPU fits in `dns_learned` (31 at the defaults: 262,144 entries, 8,192 sandboxes).
    pub fn learned_floor(&self, capacity: u32, cpus: u32) -> u32 {
        let fit = capacity.saturating_sub(cpus) / self.sandboxes.max(1);
        self.dns_learned_floor.min(fit)
    }

    /// `max_entries` of `session_opened` and `session_closed`: two sandbox versions per
    /// sandbox (a released one waits for the reaper). Errors on overflow.
    pub fn session_quota_keys(&self) -> Result<u32, Error> {
        self.sandboxes
            .checked_mul(2)
            .ok_or_else(|| Error::invalid("limits.sandboxes", format!("{} x 2 overflows", self.sandboxes)))
    }

    /// Size of `dns_allow`: every sandbox holding two generations of
    /// `min(policy_entries_per_sandbox, MAX_FQDN_PER_SANDBOX)` FQDN patterns (524,288 with the
    /// defaults). A hash map's bucket array is allocated in full at creation (16 B per
    /// power-of-two bucket: 8 MiB here), which is why FQDN patterns have their own cap.
    /// Errors when the product overflows a `u32`.
    pub fn dns_allow_entries(&self) -> Result<u32, Error> {
        let per = self.policy_entries_per_sandbox.min(crate::policy::MAX_FQDN_PER_SANDBOX);
        self.sandboxes.checked_mul(2).and_then(|n| n.checked_mul(per)).ok_or_else(|| {
            Error::invalid(
                "limits.sandboxes",
                format!("{} sandboxes x 2 x {per} FQDN patterns overflow", self.sandboxes),
            )
        })
    }
}

/// How to load the datapath.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Path of the eBPF object (see [`default_object_path`]).
    pub object: PathBuf,
    /// Constants written into the object's `CONFIG` global; its `session_budget` is replaced
    /// by [`MapLimits::session_budget`] of `limits` at load.
    pub config: DatapathConfig,
    /// bpffs directory for pins (e.g. `/sys/fs/bpf/cubevs`); `None`: maps are private to this
    /// process and links detach when the [`Datapath`] is dropped.
    pub pin_dir: Option<PathBuf>,
    /// Map sizes (ignored for maps adopted from pins, which keep their size).
    pub limits: MapLimits,
    /// Attach mechanism.
    pub attach_mode: AttachMode,
}

impl LoadOptions {
    /// Default object path, configuration and limits; no pinning.
    pub fn new() -> Self {
        Self {
            object: default_object_path(),
            config: DatapathConfig::DEFAULT,
            pin_dir: None,
            limits: MapLimits::default(),
            attach_mode: AttachMode::Auto,
        }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self::new()
    }
}

/// A loaded CubeVS datapath: programs (attach/detach need the dataplane netns thread) and
/// the shared, thread-safe [`Maps`].
pub struct Datapath {
    pub(crate) ebpf: Ebpf,
    pub(crate) opts: LoadOptions,
    maps: Arc<Maps>,
    legacy: bool,
    /// [`AttachMode::TcxDeferred`] in effect (pinned tcx, not legacy).
    deferred: bool,
    /// Sandbox interfaces (names) whose `from_cube` still runs from a warm-up filter.
    filtered: BTreeSet<String>,
    /// Slot activated at load (pinned tcx mode).
    slot: Option<usize>,
    /// Unpinned tcx links, keyed by (program, ifindex); detached when dropped.
    owned_links: HashMap<(&'static str, u32), SchedClassifierLink>,
    /// Unpinned XDP links, keyed by ifindex; detached when dropped.
    pub(crate) owned_xdp: HashMap<u32, aya::programs::xdp::XdpLink>,
}

impl std::fmt::Debug for Datapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Datapath").field("opts", &self.opts).field("legacy_tc", &self.legacy).finish_non_exhaustive()
    }
}

pub(crate) fn prog_err(what: impl Into<String>) -> impl FnOnce(aya::programs::ProgramError) -> Error {
    let what = what.into();
    move |source| Error::Program { what, source: Box::new(source) }
}

/// A second handle of the hash map `name` (a dup of its fd), for a table that shares it.
fn second_handle<K: aya::Pod, V: aya::Pod>(
    ebpf: &Ebpf,
    name: &'static str,
) -> Result<aya::maps::HashMap<aya::maps::MapData, K, V>, Error> {
    use std::os::fd::AsFd;
    let Some(aya::maps::Map::HashMap(d)) = ebpf.map(name) else { return Err(Error::Missing(name)) };
    let fd =
        d.fd().as_fd().try_clone_to_owned().map_err(|source| Error::MapSyscall { map: name, op: "dup fd", source })?;
    let data = aya::maps::MapData::from_fd(fd).map_err(Error::map(name, "open"))?;
    aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data)).map_err(|_| Error::Missing(name))
}

fn take<T: TryFrom<aya::maps::Map>>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, Error> {
    let m = ebpf.take_map(name).ok_or(Error::Missing(name))?;
    T::try_from(m).map_err(|_| Error::Missing(name))
}

impl Datapath {
    /// Reads the object, writes `opts.config` into `CONFIG`, creates or adopts the pinned maps
    /// and loads every program (nothing is attached yet).
    ///
    /// Errors: [`Error::Object`] when the file is missing; [`Error::IncompatiblePin`] when a
    /// pinned map's type, key or value size differs from the object's; [`Error::Load`] /
    /// [`Error::Program`] for kernel rejections (the verifier log is in the message).
    pub fn load(mut opts: LoadOptions) -> Result<Self, Error> {
        opts.config.session_budget = opts.limits.session_budget()?;
        let bytes =
            std::fs::read(&opts.object).map_err(|source| Error::Object { path: opts.object.clone(), source })?;
        let map_dir = opts.pin_dir.as_ref().map(|d| d.join("maps"));
        if let Some(dir) = &opts.pin_dir {
            for sub in ["maps", "links"] {
                std::fs::create_dir_all(dir.join(sub))
                    .map_err(|source| Error::Pin { what: format!("create {}", dir.join(sub).display()), source })?;
            }
        }
        let legacy = match opts.attach_mode {
            AttachMode::Tcx => false,
            AttachMode::LegacyTc => true,
            AttachMode::Auto | AttachMode::TcxDeferred => {
                KernelVersion::current().map(|v| v < KernelVersion::new(6, 6, 0)).unwrap_or(false)
            }
        };
        let deferred = opts.attach_mode == AttachMode::TcxDeferred && !legacy && opts.pin_dir.is_some();
        let l = opts.limits;
        let policy_entries = l.policy_entries()?;
        let mut sizes = vec![
            (map::EGRESS_SESSIONS, l.sessions),
            (map::INGRESS_SESSIONS, l.sessions),
            (map::IFINDEX_TO_MVMMETA, l.sandboxes),
            (map::MVMIP_TO_IFINDEX, l.sandboxes),
            (map::POLICY_GEN, l.sandboxes),
            (map::SANDBOX_STATS, l.sandboxes),
            (map::ALLOW_OUT, policy_entries),
            (map::DENY_OUT, policy_entries),
            (map::DNS_ALLOW, l.dns_allow_entries()?),
            (map::DNS_ALLOW_NAMES, l.dns_allow_entries()?),
            (map::SESSION_OPENED, l.session_quota_keys()?),
            (map::SESSION_CLOSED, l.session_quota_keys()?),
            (map::NEW_FLOW_RATE, l.session_quota_keys()?),
            (map::SESSION_FLOOR, limits::SESSION_FLOOR_KEYS),
            (map::TRACK_OPENED, l.session_quota_keys()?),
            (map::TRACK_CLOSED, l.session_quota_keys()?),
            (map::LEARNED_OPENED, l.session_quota_keys()?),
            (map::LEARNED_CLOSED, l.session_quota_keys()?),
            (map::LEARNED_FLOOR, limits::LEARNED_FLOOR_KEYS),
        ];
        for name in [
            map::REMOTE_PORT_MAPPING,
            map::LOCAL_PORT_MAPPING,
            map::REMOTE_PORT_MAPPING_UDP,
            map::LOCAL_PORT_MAPPING_UDP,
        ] {
            sizes.push((name, l.port_mappings));
        }
        // One updater at a time: held until the links run this process's programs.
        let lock = opts.pin_dir.as_deref().map(UpdateLock::acquire).transpose()?;
        let mut meta = None;
        if let Some(dir) = &opts.pin_dir {
            meta = read_meta(dir)?;
            let want = |name: &str| sizes.iter().find(|(n, _)| *n == name).map(|&(_, m)| m);
            // Pins of a datapath without slot metadata (before slots existed) are adopted
            // only when they match exactly; the pinned size wins once metadata exists.
            let pinned = check_pins(&bytes, &dir.join("maps"), |n| if meta.is_none() { want(n) } else { None })?;
            for (name, max) in pinned {
                if let Some(e) = sizes.iter_mut().find(|(n, _)| *n == name) {
                    e.1 = max;
                }
            }
        }
        // The floor from the sizes in effect (a pinned size wins over `limits`), so the reserve
        // fits the maps the programs really use (decision Q4).
        let size_of = |name: &str, dflt: u32| sizes.iter().find(|(n, _)| *n == name).map_or(dflt, |&(_, m)| m);
        let capacity = size_of(map::EGRESS_SESSIONS, l.sessions);
        let cpus = crate::quota::floor_margin();
        let session_floor =
            MapLimits { sessions: capacity, sandboxes: size_of(map::IFINDEX_TO_MVMMETA, l.sandboxes), ..l }
                .session_floor(cpus)?;
        let sandboxes = size_of(map::IFINDEX_TO_MVMMETA, l.sandboxes);
        let track_limits = |floor: u32, name: &str, dflt: u32| {
            let capacity = size_of(name, dflt);
            TrackLimits { floor: MapLimits { sandboxes, ..l }.track_floor(floor, capacity, cpus), capacity }
        };
        let dns_track = track_limits(l.dns_query_floor, map::DNS_QUERY_TRACK, limits::DNS_QUERIES);
        let frag_track = track_limits(l.frag_floor, map::FRAG_SESSIONS, limits::FRAG_SESSIONS);
        let learned_capacity = size_of(map::DNS_LEARNED, limits::DNS_LEARNED);
        let learned_floor = MapLimits { sandboxes, ..l }.learned_floor(learned_capacity, cpus);
        let mut ebpf = slots::load_object(&bytes, &opts.object, &opts.config, opts.pin_dir.as_deref(), &sizes, &[])?;
        let open_lock = || {
            map_dir
                .as_deref()
                .map(std::fs::File::open)
                .transpose()
                .map_err(|source| Error::Pin { what: "open the maps directory for locking".into(), source })
        };
        let learned = crate::learned_floor::LearnedFloor::new(
            take(&mut ebpf, map::LEARNED_OPENED)?,
            take(&mut ebpf, map::LEARNED_CLOSED)?,
            take(&mut ebpf, map::LEARNED_FLOOR)?,
            open_lock()?,
            learned_floor,
            learned_capacity,
            cpus,
        );
        let track = Arc::new(
            TrackFloor::new(
                take(&mut ebpf, map::TRACK_OPENED)?,
                take(&mut ebpf, map::TRACK_CLOSED)?,
                second_handle(&ebpf, map::SESSION_FLOOR)?,
                map_dir
                    .as_deref()
                    .map(std::fs::File::open)
                    .transpose()
                    .map_err(|source| Error::Pin { what: "open the maps directory for locking".into(), source })?,
                dns_track,
                frag_track,
                cpus,
            )
            .with_learned(learned),
        );
        // Checked before any link changes: adopted tries too small for the policy limits
        // refuse the load with the old programs still serving.
        let policy = policy_table(&mut ebpf, l.policy(), map_dir.as_deref(), track.clone())?;
        let mut slot = None;
        if let (Some(dir), false) = (&opts.pin_dir, legacy) {
            slot = Some(Self::activate(&mut ebpf, &bytes, &opts, dir, meta)?);
        }
        drop(lock);
        let registrations = {
            use std::os::fd::AsFd;
            let m = ebpf.map(map::IFINDEX_TO_MVMMETA).ok_or(Error::Missing(map::IFINDEX_TO_MVMMETA))?;
            let data = match m {
                aya::maps::Map::HashMap(d) => d,
                _ => return Err(Error::Missing(map::IFINDEX_TO_MVMMETA)),
            };
            data.fd().as_fd().try_clone_to_owned().map_err(|source| Error::MapSyscall {
                map: map::IFINDEX_TO_MVMMETA,
                op: "dup fd",
                source,
            })?
        };
        // With slots, DNS tail calls go to the active slot's pinned programs (the same
        // programs as the links run, also when this process reuses the slot: N9); without,
        // to this load's own.
        match (&opts.pin_dir, slot) {
            (Some(dir), Some(s)) => slots::fill_dns_progs_of_slot(dir, s)?,
            _ => fill_dns_progs(&mut ebpf)?,
        }
        let sessions = Arc::new(Sessions::new(
            take(&mut ebpf, map::EGRESS_SESSIONS)?,
            take(&mut ebpf, map::INGRESS_SESSIONS)?,
            Some(registrations),
            Some(QuotaMaps {
                opened: take(&mut ebpf, map::SESSION_OPENED)?,
                closed: take(&mut ebpf, map::SESSION_CLOSED)?,
                lock: map_dir
                    .as_deref()
                    .map(std::fs::File::open)
                    .transpose()
                    .map_err(|source| Error::Pin { what: "open the maps directory for locking".into(), source })?,
                floor: Some(FloorMap {
                    map: take(&mut ebpf, map::SESSION_FLOOR)?,
                    floor: session_floor,
                    capacity,
                    margin: cpus,
                }),
                track: Some(track.clone()),
            }),
        ));
        sessions.refresh_floor()?;
        let maps = Arc::new(Maps {
            sandboxes: SandboxTable::new(
                take(&mut ebpf, map::IFINDEX_TO_MVMMETA)?,
                take(&mut ebpf, map::MVMIP_TO_IFINDEX)?,
                sessions.clone(),
            ),
            ports: PortMaps::new(
                (take(&mut ebpf, map::REMOTE_PORT_MAPPING)?, take(&mut ebpf, map::LOCAL_PORT_MAPPING)?),
                (take(&mut ebpf, map::REMOTE_PORT_MAPPING_UDP)?, take(&mut ebpf, map::LOCAL_PORT_MAPPING_UDP)?),
                // Optional (an object older than R74 has none): releases then go unstamped.
                ebpf.take_map(map::HOST_PORT_RELEASED).and_then(|m| m.try_into().ok()),
            ),
            sessions,
            snat: SnatTable::new(take(&mut ebpf, map::SNAT_IPLIST)?),
            policy,
            node: NodeTable::new(take(&mut ebpf, map::NODE_CONFIG)?),
            counters: Counters::new(take(&mut ebpf, map::COUNTERS)?),
            sandbox_stats: SandboxStatsTable::new(take(&mut ebpf, map::SANDBOX_STATS)?),
            frags: crate::FragTable::new(take(&mut ebpf, map::FRAG_SESSIONS)?, Some(track.clone())),
            track,
            // Optional (an object older than R30 has none): `replace` then refuses a list.
            node_deny: crate::NodeDenyTable::new(ebpf.take_map(map::NODE_DENY).and_then(|m| m.try_into().ok())),
            // Optional as well: read for operators only.
            budget: crate::insert_budget::InsertBudgetTable::new(
                ebpf.take_map(map::INSERT_BUDGET).and_then(|m| m.try_into().ok()),
            ),
            new_flow: crate::new_flow::NewFlowTable::new(
                ebpf.take_map(map::NEW_FLOW_RATE).and_then(|m| m.try_into().ok()),
                ebpf.take_map(map::NEW_FLOW_CONFIG).and_then(|m| m.try_into().ok()),
            ),
        });
        maps.new_flow.set_limits(l.l7_connect_rate, l.l7_connect_burst)?;
        Ok(Self {
            ebpf,
            opts,
            maps,
            legacy,
            deferred,
            filtered: BTreeSet::new(),
            slot,
            owned_links: HashMap::new(),
            owned_xdp: HashMap::new(),
        })
    }

    /// Makes this process's programs the ones every pinned link runs (the fix for a new
    /// process silently keeping the old programs): reuses the active slot when it holds the
    /// same object (sha256) with the same configuration, else self-tests the new programs,
    /// pins them as the standby slot and switches every link to it. Returns the slot.
    fn activate(
        ebpf: &mut Ebpf,
        bytes: &[u8],
        opts: &LoadOptions,
        dir: &Path,
        meta: Option<Meta>,
    ) -> Result<usize, Error> {
        let mut meta = meta.unwrap_or_else(|| Meta::new(opts.config));
        let sha = slots::sha256(bytes);
        let same = meta.active.filter(|&a| {
            meta.slots[a].sha256 == sha
                && meta.config == opts.config
                && slots::slot_dir(dir, a).join(prog::FROM_CUBE).exists()
        });
        let slot = match same {
            Some(a) => a,
            None => {
                let report = slots::selftest_ebpf(ebpf, &opts.config)?;
                if !report.passed() {
                    return Err(Error::SelfTest(report.failures()));
                }
                let s = meta.active.map_or(0, |a| 1 - a);
                slots::pin_slot(ebpf, dir, s)?;
                meta.config = opts.config;
                meta.slots[s] = slots::record(bytes, &opts.object);
                if meta.pending == Some(s) {
                    meta.pending = None;
                }
                s
            }
        };
        let replaced = slots::replace_links(dir, slot, meta.active)?;
        if replaced > 0 {
            log::info!("datapath: {replaced} pinned link(s) now run slot {}", slots::SLOT_NAMES[slot]);
        }
        meta.active = Some(slot);
        write_meta(dir, &meta)?;
        Ok(slot)
    }

    fn classifier<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut SchedClassifier, Error> {
        slots::classifier(ebpf, name)
    }

    /// The slot this process activated at load (pinned tcx mode), `None` otherwise.
    pub fn slot(&self) -> Option<usize> {
        self.slot
    }

    /// The options this datapath was loaded with.
    pub fn options(&self) -> &LoadOptions {
        &self.opts
    }

    /// The maps, shareable across threads.
    pub fn maps(&self) -> Arc<Maps> {
        self.maps.clone()
    }

    /// Whether programs are attached with legacy tc instead of tcx.
    pub fn legacy_tc(&self) -> bool {
        self.legacy
    }

    /// The loaded program `name` (for test runs and inspection).
    pub fn program(&mut self, name: &'static str) -> Result<&mut SchedClassifier, Error> {
        Self::classifier(&mut self.ebpf, name)
    }

    fn link_pin_path(&self, name: &str, ifindex: u32) -> Option<PathBuf> {
        self.opts.pin_dir.as_ref().map(|d| d.join("links").join(format!("{name}_{ifindex}")))
    }

    /// Attaches `from_cube` to the ingress of the sandbox interface `ifname` (a TAP, or the
    /// node-side veth of a test guest), resolved in the calling thread's netns. An interface
    /// that already carries our pinned link is adopted, never attached twice. Returns the
    /// ifindex.
    ///
    /// With [`AttachMode::TcxDeferred`], an interface without a pinned link gets a warm-up
    /// filter (clsact, priority 1, handle 1, direct action) running the active slot's
    /// `from_cube`, and is queued for [`Datapath::convert_next`].
    pub fn attach_sandbox(&mut self, ifname: &str) -> Result<u32, Error> {
        if self.deferred {
            let ifindex = ifindex(ifname)?;
            let pinned = self.link_pin_path(prog::FROM_CUBE, ifindex).is_some_and(|p| p.exists());
            if !pinned {
                self.attach_filter(prog::FROM_CUBE, ifname, TcAttachType::Ingress, true)?;
                self.filtered.insert(ifname.to_string());
                return Ok(ifindex);
            }
        }
        self.attach(prog::FROM_CUBE, ifname, TcAttachType::Ingress)
    }

    /// Detaches `from_cube` from `ifname` and removes its pin (and, in
    /// [`AttachMode::TcxDeferred`], its warm-up filter).
    pub fn detach_sandbox(&mut self, ifname: &str) -> Result<(), Error> {
        if self.deferred {
            self.filtered.remove(ifname);
            detach_filter(prog::FROM_CUBE, ifname, TcAttachType::Ingress)?;
        }
        self.detach(prog::FROM_CUBE, ifname, TcAttachType::Ingress)
    }

    /// Queues the sandbox interface `ifname` for [`Datapath::convert_next`] when its
    /// `from_cube` has no pinned tcx link ([`AttachMode::TcxDeferred`] only; e.g. a TAP a
    /// previous process left on its warm-up filter). Returns whether it was queued.
    pub fn defer_sandbox(&mut self, ifname: &str) -> Result<bool, Error> {
        if !self.deferred {
            return Ok(false);
        }
        let ifindex = ifindex(ifname)?;
        if self.link_pin_path(prog::FROM_CUBE, ifindex).is_some_and(|p| p.exists()) {
            return Ok(false);
        }
        Ok(self.filtered.insert(ifname.to_string()))
    }

    /// How many sandbox interfaces still run `from_cube` from a warm-up filter.
    pub fn filters_pending(&self) -> usize {
        self.filtered.len()
    }

    /// Moves one queued sandbox interface from its warm-up filter to a pinned tcx link:
    /// attaches the link (the active slot's `from_cube`; tcx runs before clsact and
    /// `from_cube` never returns `TC_ACT_UNSPEC`, so from that instant the filter sees no
    /// packet), then deletes the filter. No instant without a program. Returns the
    /// interface, `None` when nothing is queued. An interface that vanished meanwhile is
    /// dropped from the queue with its error.
    pub fn convert_next(&mut self) -> Result<Option<String>, Error> {
        let Some(ifname) = self.filtered.pop_first() else { return Ok(None) };
        self.attach(prog::FROM_CUBE, &ifname, TcAttachType::Ingress)?;
        detach_filter(prog::FROM_CUBE, &ifname, TcAttachType::Ingress)?;
        Ok(Some(ifname))
    }

    /// Attaches `from_world` to the ingress of the uplink `ifname` and records its ifindex
    /// and address (host ports are DNATed when addressed to `ip`). Returns the ifindex.
    pub fn attach_uplink(&mut self, ifname: &str, ip: std::net::Ipv4Addr) -> Result<u32, Error> {
        let ifindex = self.attach(prog::FROM_WORLD, ifname, TcAttachType::Ingress)?;
        self.maps.node.set_uplink(ifindex, ip)?;
        Ok(ifindex)
    }

    /// Attaches `from_envoy` to the egress of cube-dev `ifname` and records its ifindex and
    /// address (the sandbox CIDR's .1). Returns the ifindex.
    pub fn attach_cube_dev(&mut self, ifname: &str, ip: std::net::Ipv4Addr) -> Result<u32, Error> {
        let ifindex = self.attach(prog::FROM_ENVOY, ifname, TcAttachType::Egress)?;
        self.maps.node.set_cube_dev(ifindex, ip)?;
        Ok(ifindex)
    }

    fn attach(&mut self, name: &'static str, ifname: &str, kind: TcAttachType) -> Result<u32, Error> {
        let ifindex = ifindex(ifname)?;
        if self.legacy {
            self.attach_filter(name, ifname, kind, false)?;
            return Ok(ifindex);
        }
        let what = format!("attach {name} to {kind:?} of {ifname}");
        if let (Some(dir), Some(slot)) = (self.opts.pin_dir.clone(), self.slot) {
            return self.attach_pinned(&dir, slot, name, ifname, ifindex, kind);
        }
        if self.owned_links.contains_key(&(name, ifindex)) {
            return Ok(ifindex);
        }
        let prog = Self::classifier(&mut self.ebpf, name)?;
        let id = prog
            .attach_with_options(ifname, kind, TcAttachOptions::TcxOrder(Default::default()))
            .map_err(prog_err(what.clone()))?;
        let link = prog.take_link(id).map_err(prog_err(what.clone()))?;
        self.owned_links.insert((name, ifindex), link);
        Ok(ifindex)
    }

    /// Legacy attach: clsact qdisc (kept when present) and a direct-action filter at priority
    /// 1, handle 1 that outlives this process (an existing one is kept: `EEXIST`). With
    /// `from_slot`, the filter runs the active slot's pinned program (read under the update
    /// lock), else this process's.
    fn attach_filter(
        &mut self,
        name: &'static str,
        ifname: &str,
        kind: TcAttachType,
        from_slot: bool,
    ) -> Result<(), Error> {
        let what = format!("attach {name} to {kind:?} of {ifname} (tc filter)");
        if let Err(e) = tc::qdisc_add_clsact(ifname)
            && !is_eexist(&e)
        {
            return Err(Error::Program { what: format!("{what}: add clsact"), source: Box::new(e.into()) });
        }
        let nl = NlOptions { priority: 1, handle: TcHandle::new(0, 1), ..Default::default() };
        let mut pinned;
        let mut _lock = None;
        let prog = match (&self.opts.pin_dir, self.slot, from_slot) {
            (Some(dir), Some(slot), true) => {
                _lock = Some(UpdateLock::acquire(dir)?);
                let slot = read_meta(dir)?.and_then(|m| m.active).unwrap_or(slot);
                let prog_pin = slots::slot_dir(dir, slot).join(name);
                pinned =
                    SchedClassifier::from_pin(&prog_pin).map_err(prog_err(format!("open {}", prog_pin.display())))?;
                &mut pinned
            }
            _ => Self::classifier(&mut self.ebpf, name)?,
        };
        match prog.attach_with_options(ifname, kind, TcAttachOptions::Netlink(nl)) {
            Ok(id) => {
                // Keep the filter after this process exits: take the link out of aya's
                // bookkeeping and forget it so nothing detaches it on drop.
                let link = prog.take_link(id).map_err(prog_err(what.clone()))?;
                std::mem::forget(link);
            }
            Err(e) if is_eexist(&e) => {}
            Err(e) => return Err(prog_err(what)(e)),
        }
        Ok(())
    }

    /// Pinned tcx attach under the update lock with the ACTIVE slot's program (which a
    /// `datapath switch` may have changed since this process loaded): an existing link pin
    /// is adopted and its program replaced when it differs; a new link is created and
    /// pinned otherwise. Afterwards every other link on the hook running a program of the
    /// same name (a duplicate or an orphan) is detached by link id.
    fn attach_pinned(
        &mut self,
        dir: &Path,
        slot: usize,
        name: &'static str,
        ifname: &str,
        ifindex: u32,
        kind: TcAttachType,
    ) -> Result<u32, Error> {
        let what = format!("attach {name} to {kind:?} of {ifname}");
        let _lock = UpdateLock::acquire(dir)?;
        let slot = read_meta(dir)?.and_then(|m| m.active).unwrap_or(slot);
        let prog_pin = slots::slot_dir(dir, slot).join(name);
        let mut prog =
            SchedClassifier::from_pin(&prog_pin).map_err(prog_err(format!("open {}", prog_pin.display())))?;
        let pin = dir.join("links").join(format!("{name}_{ifindex}"));
        if pin.exists() {
            slots::replace_on_link(&pin, &mut prog)?;
        }
        let link_id = if pin.exists() {
            slots::link_ids(&pin)?.0
        } else {
            let id = prog
                .attach_with_options(ifname, kind, TcAttachOptions::TcxOrder(Default::default()))
                .map_err(prog_err(what.clone()))?;
            let link = prog.take_link(id).map_err(prog_err(what.clone()))?;
            let fd_link: FdLink = link.try_into().map_err(|e| Error::Pin {
                what: format!("{what}: not a bpf_link"),
                source: std::io::Error::other(e),
            })?;
            let link_id = fd_link
                .info()
                .map_err(|e| Error::Pin { what: format!("{what}: link info"), source: std::io::Error::other(e) })?
                .id();
            fd_link
                .pin(&pin)
                .map_err(|e| Error::Pin { what: format!("pin {}", pin.display()), source: std::io::Error::other(e) })?;
            link_id
        };
        let hook = match kind {
            TcAttachType::Egress => bpf_sys::TCX_EGRESS,
            _ => bpf_sys::TCX_INGRESS,
        };
        let removed = slots::detach_orphans(ifindex, hook, name, link_id)?;
        if !removed.is_empty() {
            log::warn!("{what}: detached duplicate/orphan link(s) {removed:?}");
        }
        Ok(ifindex)
    }

    fn detach(&mut self, name: &'static str, ifname: &str, kind: TcAttachType) -> Result<(), Error> {
        if self.legacy {
            return detach_filter(name, ifname, kind);
        }
        let ifindex = ifindex(ifname)?;
        self.owned_links.remove(&(name, ifindex));
        let _lock = self.opts.pin_dir.as_deref().map(UpdateLock::acquire).transpose()?;
        if let Some(pin) = self.link_pin_path(name, ifindex)
            && pin.exists()
        {
            let link = PinnedLink::from_pin(&pin).map_err(|e| Error::Pin {
                what: format!("open {}", pin.display()),
                source: std::io::Error::other(e),
            })?;
            // Unpinning and dropping the last fd detaches the program.
            drop(link.unpin().map_err(|source| Error::Pin { what: format!("unpin {}", pin.display()), source })?);
        }
        Ok(())
    }

    /// Removes link pins whose interface no longer exists in the calling thread's netns
    /// (garbage left by deleted TAPs). Returns the removed pin names.
    pub fn gc_link_pins(&self) -> Result<Vec<String>, Error> {
        let Some(dir) = &self.opts.pin_dir else { return Ok(Vec::new()) };
        let dir = dir.join("links");
        let mut removed = Vec::new();
        let entries =
            std::fs::read_dir(&dir).map_err(|source| Error::Pin { what: format!("read {}", dir.display()), source })?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(idx) = name.rsplit('_').next().and_then(|s| s.parse::<u32>().ok()) else { continue };
            if nix_if_exists(idx) {
                continue;
            }
            if std::fs::remove_file(e.path()).is_ok() {
                removed.push(name);
            }
        }
        Ok(removed)
    }
}

/// Deletes every filter running a program called `name` on `kind` of `ifname` (none: Ok).
fn detach_filter(name: &'static str, ifname: &str, kind: TcAttachType) -> Result<(), Error> {
    match tc::qdisc_detach_program(ifname, kind, name) {
        Ok(()) => Ok(()),
        Err(aya::programs::tc::TcError::IoError(e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.to_string().contains("No such file") || e.to_string().contains("not found") => Ok(()),
        Err(e) => Err(Error::Program { what: format!("detach {name} from {ifname}"), source: Box::new(e.into()) }),
    }
}

/// True when `e` or any error in its source chain is `EEXIST` (qdisc or filter already there).
fn is_eexist(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.raw_os_error() == Some(libc::EEXIST)
        {
            return true;
        }
        cur = err.source();
    }
    // Some aya netlink errors carry the errno only in their message.
    format!("{e:?}").contains("code: 17")
}

fn nix_if_exists(ifindex: u32) -> bool {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buffer of IF_NAMESIZE bytes as required.
    !unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) }.is_null()
}

/// Fills `dns_progs` with this load's programs: the return slots first, so a DNS program is
/// never reachable before the program it returns to.
fn fill_dns_progs(ebpf: &mut Ebpf) -> Result<(), Error> {
    use cubevs_common::dns::slot;
    let mut fds = Vec::new();
    for (slot, name) in [
        (slot::FROM_CUBE, prog::FROM_CUBE),
        (slot::FROM_WORLD, prog::FROM_WORLD),
        (slot::QUERY, prog::DNS_QUERY),
        (slot::RESPONSE, prog::DNS_RESPONSE),
    ] {
        let fd = Datapath::classifier(ebpf, name)?
            .fd()
            .map_err(prog_err(format!("fd of {name}")))?
            .try_clone()
            .map_err(|e| Error::Map { map: map::DNS_PROGS, op: "dup program fd", source: Box::new(e.into()) })?;
        fds.push((slot, fd));
    }
    let m = ebpf.map_mut(map::DNS_PROGS).ok_or(Error::Missing(map::DNS_PROGS))?;
    let mut arr = aya::maps::ProgramArray::try_from(m).map_err(|_| Error::Missing(map::DNS_PROGS))?;
    for (slot, fd) in &fds {
        arr.set(*slot, fd, 0).map_err(Error::map(map::DNS_PROGS, "update"))?;
    }
    Ok(())
}

/// The policy table over the loaded maps, after checking that the (possibly adopted) tries
/// can hold two generations of every interface `policy_gen` can hold at `limits`.
fn policy_table(
    ebpf: &mut Ebpf,
    limits: PolicyLimits,
    map_dir: Option<&Path>,
    track: Arc<TrackFloor>,
) -> Result<PolicyTable, Error> {
    let allow: aya::maps::LpmTrie<_, _, _> = take(ebpf, map::ALLOW_OUT)?;
    let deny: aya::maps::LpmTrie<_, _, _> = take(ebpf, map::DENY_OUT)?;
    let generation: aya::maps::HashMap<_, _, _> = take(ebpf, map::POLICY_GEN)?;
    let max = |m: &aya::maps::MapData, name: &'static str| {
        m.info().map(|i| i.max_entries()).map_err(|e| Error::Map { map: name, op: "info", source: Box::new(e) })
    };
    use aya::maps::IterableMap;
    let interfaces = max(generation.map(), map::POLICY_GEN)?;
    let limits = PolicyLimits { interfaces, ..limits };
    let need = limits.trie_entries().unwrap_or(u32::MAX);
    for (name, have) in
        [(map::ALLOW_OUT, max(allow.map(), map::ALLOW_OUT)?), (map::DENY_OUT, max(deny.map(), map::DENY_OUT)?)]
    {
        if have < need {
            return Err(Error::IncompatiblePin {
                path: map_dir.map(|d| d.join(name)).unwrap_or_else(|| PathBuf::from(name)),
                reason: format!(
                    "holds {have} entries, but {interfaces} sandboxes x 2 generations x ({} + {}) entries need {need}; \
                     remove the pins or lower policy_entries_per_sandbox",
                    limits.entries_per_sandbox,
                    crate::policy::EXTRA_ENTRIES
                ),
            });
        }
    }
    let dns = crate::policy::dns::DnsMaps {
        allow: take(ebpf, map::DNS_ALLOW)?,
        // Optional (an object older than R48 has none): patterns then match by hash alone.
        names: ebpf.take_map(map::DNS_ALLOW_NAMES).and_then(|m| m.try_into().ok()),
        learned: take(ebpf, map::DNS_LEARNED)?,
        queries: take(ebpf, map::DNS_QUERY_TRACK)?,
        track: Some(track),
    };
    Ok(PolicyTable::new(allow, deny, generation, dns, limits))
}

/// Names of the programs attached to the tcx ingress of `ifname` (calling thread's netns), in
/// run order. Kernel program names are truncated to 15 bytes.
pub fn tcx_ingress_programs(ifname: &str) -> Result<Vec<String>, Error> {
    tcx_programs(ifname, TcAttachType::Ingress)
}

/// Names of the programs attached to tcx `kind` of `ifname` (calling thread's netns).
pub fn tcx_programs(ifname: &str, kind: TcAttachType) -> Result<Vec<String>, Error> {
    let (_, infos) =
        SchedClassifier::query_tcx(ifname, kind).map_err(prog_err(format!("query tcx {kind:?} of {ifname}")))?;
    Ok(infos.iter().map(|i| i.name_as_str().unwrap_or("?").to_string()).collect())
}

pub(crate) fn ifindex(name: &str) -> Result<u32, Error> {
    cubenet_sys::ifindex(name).map_err(|source| Error::Interface { name: name.to_string(), source })
}
