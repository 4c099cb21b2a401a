//! Active/standby program slots over one set of pinned maps.
//!
//! Pin layout under the pin directory: `maps/<name>` (shared state, see
//! [`crate::layout`]), `meta` (slot metadata), `slots/a/<program>` and `slots/b/<program>`
//! (the programs of each slot, pinned so that the inactive one stays loaded for a rollback),
//! `links/<program>_<ifindex>` (the tcx links; pins created by [`crate::Datapath`]).
//!
//! - [`load_standby`] loads an object into the slot that is not active, reusing the pinned
//!   maps after [`check_pins`], and runs the [`selftest`] on it before anything is pinned: a
//!   failed self-test changes nothing.
//! - [`switch`] / [`rollback`] replace the program of every pinned tcx link with the target
//!   slot's (`BPF_LINK_UPDATE` through `SchedClassifier::attach_to_link`): the link, its
//!   place in the chain and the attachment stay; per hook there is no instant without a
//!   program. Hooks are updated one after another (a packet may meet the new `from_cube`
//!   and the old `from_world` for microseconds; both read the same maps).
//! - [`migrate_map`] moves one map to a new size through a standby load.
//!
//! Every operation takes the [`UpdateLock`] without waiting ([`Error::Busy`] otherwise).

use std::{
    collections::HashMap,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::MapInfo,
    programs::{
        SchedClassifier,
        links::{FdLink, PinnedLink},
        tc::SchedClassifierLink,
    },
};
use cubevs_common::{CONFIG_GLOBAL, DatapathConfig, MvmMeta, SKB_LAYOUT_GLOBAL, map, prog};
use sha2::{Digest, Sha256};

use crate::{
    Error, bpf_sys,
    layout::{Meta, SelfTestState, SlotRecord, check_pins, read_meta, write_meta},
    lock::UpdateLock,
    selftest,
};

/// Slot names, index 0 and 1.
pub const SLOT_NAMES: [&str; 2] = ["a", "b"];

/// Programs that are attached (pinned per slot; `baseline_pass` is never attached).
pub const ATTACHED: [&str; 3] = [prog::FROM_CUBE, prog::FROM_WORLD, prog::FROM_ENVOY];

/// `<pin_dir>/slots/<a|b>`.
pub fn slot_dir(pin_dir: &Path, slot: usize) -> PathBuf {
    pin_dir.join("slots").join(SLOT_NAMES[slot])
}

fn pin_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Pin { what, source }
}

fn prog_err(what: impl Into<String>) -> impl FnOnce(aya::programs::ProgramError) -> Error {
    let what = what.into();
    move |source| Error::Program { what, source: Box::new(source) }
}

fn other(what: impl Into<String>, e: impl std::fmt::Display) -> Error {
    Error::Pin { what: what.into(), source: std::io::Error::other(e.to_string()) }
}

/// sha256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The object loaded with `config`, its maps pinned under `pin_dir/maps` (reused when
/// present; `map_pins` overrides a map's pin path) and every program loaded, nothing
/// attached or pinned. `max_entries` gives the size of maps created fresh.
pub(crate) fn load_object(
    bytes: &[u8],
    path: &Path,
    config: &DatapathConfig,
    pin_dir: Option<&Path>,
    max_entries: &[(&'static str, u32)],
    map_pins: &[(&'static str, PathBuf)],
) -> Result<Ebpf, Error> {
    // R101: where the kernel keeps the skb's checksum offload fields; an object older than
    // R101 has no such global (not required to exist).
    let skb_layout = crate::skb_layout::running_kernel()
        .map_err(|reason| Error::KernelBtf { what: "sk_buff layout for the checksum offload check (R101)", reason })?;
    let mut loader = EbpfLoader::new();
    loader.override_global(CONFIG_GLOBAL, config, true);
    loader.override_global(SKB_LAYOUT_GLOBAL, &skb_layout, false);
    for &(name, max) in max_entries {
        loader.map_max_entries(name, max);
    }
    if let Some(pin_dir) = pin_dir {
        let maps = pin_dir.join("maps");
        std::fs::create_dir_all(&maps).map_err(pin_err(format!("create {}", maps.display())))?;
        for &name in map::ALL {
            let p = map_pins.iter().find(|(n, _)| *n == name).map_or_else(|| maps.join(name), |(_, p)| p.clone());
            loader.map_pin_path(name, p);
        }
    }
    let mut ebpf =
        loader.load(bytes).map_err(|source| Error::Load { path: path.to_path_buf(), source: Box::new(source) })?;
    for &name in prog::ALL {
        classifier(&mut ebpf, name)?.load().map_err(prog_err(format!("load program {name}")))?;
    }
    for &name in prog::XDP_ALL {
        crate::xdp::xdp_named(&mut ebpf, name)?.load().map_err(prog_err(format!("load program {name}")))?;
    }
    Ok(ebpf)
}

pub(crate) fn classifier<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut SchedClassifier, Error> {
    ebpf.program_mut(name).and_then(|p| <&mut SchedClassifier>::try_from(p).ok()).ok_or(Error::Missing(name))
}

/// Runs the self-test on the programs of a loaded (unpinned, unattached) object, the ARP
/// case on the first sandbox registered in its (live, pinned) `ifindex_to_mvmmeta`.
pub(crate) fn selftest_ebpf(ebpf: &Ebpf, config: &DatapathConfig) -> Result<selftest::Report, Error> {
    let get = |name: &str| ebpf.program(name).and_then(|p| <&SchedClassifier>::try_from(p).ok());
    let sandboxes = ebpf.map(map::IFINDEX_TO_MVMMETA).ok_or(Error::Missing(map::IFINDEX_TO_MVMMETA))?;
    let sandboxes = aya::maps::HashMap::<_, u32, MvmMeta>::try_from(sandboxes).map_err(|e| Error::Map {
        map: map::IFINDEX_TO_MVMMETA,
        op: "open",
        source: Box::new(e),
    })?;
    let registered = sandboxes.keys().find_map(Result::ok);
    selftest::run(get, config, registered)
}

/// Pins the attached programs of `ebpf` as slot `slot`, replacing what the slot held.
pub(crate) fn pin_slot(ebpf: &mut Ebpf, pin_dir: &Path, slot: usize) -> Result<(), Error> {
    let dir = slot_dir(pin_dir, slot);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(pin_err(format!("clear {}", dir.display())))?;
    }
    std::fs::create_dir_all(&dir).map_err(pin_err(format!("create {}", dir.display())))?;
    for name in ATTACHED.iter().chain(&DNS_TAIL) {
        let p = dir.join(name);
        classifier(ebpf, name)?.pin(&p).map_err(|e| other(format!("pin {}", p.display()), e))?;
    }
    Ok(())
}

/// Programs only reached by tail calls through `dns_progs`; pinned per slot beside
/// [`ATTACHED`] so a switch can point the array at the slot's own set.
pub const DNS_TAIL: [&str; 2] = [prog::DNS_QUERY, prog::DNS_RESPONSE];

/// Points the pinned `dns_progs` array at `slot`'s programs (return slots first, so a DNS
/// program is never reachable before the main program it returns to). A slot pinned before
/// DNS learning existed has no DNS programs: nothing to do.
pub(crate) fn fill_dns_progs_of_slot(pin_dir: &Path, slot: usize) -> Result<(), Error> {
    use cubevs_common::dns::slot as s;
    let dir = slot_dir(pin_dir, slot);
    let arr_pin = pin_dir.join("maps").join(map::DNS_PROGS);
    if !dir.join(prog::DNS_QUERY).exists() || !arr_pin.exists() {
        return Ok(());
    }
    let data = aya::maps::MapData::from_pin(&arr_pin).map_err(|e| Error::Map {
        map: map::DNS_PROGS,
        op: "open pin",
        source: Box::new(e),
    })?;
    let mut arr = aya::maps::ProgramArray::try_from(aya::maps::Map::ProgramArray(data))
        .map_err(|_| Error::Missing(map::DNS_PROGS))?;
    for (idx, name) in [
        (s::FROM_CUBE, prog::FROM_CUBE),
        (s::FROM_WORLD, prog::FROM_WORLD),
        (s::QUERY, prog::DNS_QUERY),
        (s::RESPONSE, prog::DNS_RESPONSE),
    ] {
        let p = dir.join(name);
        let c = SchedClassifier::from_pin(&p).map_err(prog_err(format!("open {}", p.display())))?;
        let fd = c.fd().map_err(prog_err(format!("fd of {}", p.display())))?;
        arr.set(idx, fd, 0).map_err(Error::map(map::DNS_PROGS, "update"))?;
    }
    Ok(())
}

/// The program ids in the pinned `dns_progs` array, by slot index
/// ([`cubevs_common::dns::slot`]: query, from_cube, response, from_world); `None` for an
/// empty slot. The kernel answers a userspace lookup in a program array with the program's id.
pub fn dns_prog_ids(pin_dir: &Path) -> Result<Vec<Option<u32>>, Error> {
    let arr_pin = pin_dir.join("maps").join(map::DNS_PROGS);
    let fd = bpf_sys::obj_get(&arr_pin).map_err(|source| Error::MapSyscall {
        map: map::DNS_PROGS,
        op: "open pin",
        source,
    })?;
    (0..cubevs_common::dns::slot::COUNT)
        .map(|i| {
            let mut id = [0u8; 4];
            match bpf_sys::map_lookup(fd.as_raw_fd(), &i.to_ne_bytes(), &mut id) {
                Ok(true) => Ok(Some(u32::from_ne_bytes(id))),
                Ok(false) => Ok(None),
                Err(source) => Err(Error::MapSyscall { map: map::DNS_PROGS, op: "lookup", source }),
            }
        })
        .collect()
}

/// The programs of slot `slot`, opened from their pins.
pub fn slot_programs(pin_dir: &Path, slot: usize) -> Result<HashMap<&'static str, SchedClassifier>, Error> {
    let dir = slot_dir(pin_dir, slot);
    ATTACHED
        .iter()
        .map(|&name| {
            let p = dir.join(name);
            SchedClassifier::from_pin(&p).map(|c| (name, c)).map_err(prog_err(format!("open {}", p.display())))
        })
        .collect()
}

/// One pinned tcx link.
#[derive(Clone, Debug)]
pub struct LinkPin {
    /// Pin path.
    pub path: PathBuf,
    /// Program (hook) name, e.g. `from_cube`.
    pub program: &'static str,
    /// Interface index (in the dataplane netns).
    pub ifindex: u32,
}

/// Every link pin under `pin_dir/links` whose name is `<attached program>_<ifindex>`.
pub fn link_pins(pin_dir: &Path) -> Result<Vec<LinkPin>, Error> {
    let dir = pin_dir.join("links");
    let Ok(rd) = std::fs::read_dir(&dir) else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((p, idx)) = name.rsplit_once('_') else { continue };
        let (Some(&program), Ok(ifindex)) = (ATTACHED.iter().find(|&&a| a == p), idx.parse::<u32>()) else {
            continue;
        };
        out.push(LinkPin { path: e.path(), program, ifindex });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// `(link id, program id)` of the link pinned at `path`.
pub fn link_ids(path: &Path) -> Result<(u32, u32), Error> {
    let l = PinnedLink::from_pin(path).map_err(|e| other(format!("open {}", path.display()), e))?;
    let fd: FdLink = l.into();
    let info = fd.info().map_err(|e| other(format!("link info {}", path.display()), e))?;
    Ok((info.id(), info.program_id()))
}

/// Replaces the program of the link pinned at `path` with `prog` unless it already runs
/// it. `Ok(false)`: nothing to do. A link whose device is gone (`ENOLINK`) has its pin removed
/// and counts as done.
pub(crate) fn replace_on_link(path: &Path, prog: &mut SchedClassifier) -> Result<bool, Error> {
    let want = prog.info().map_err(prog_err("program info"))?.id();
    let l = PinnedLink::from_pin(path).map_err(|e| other(format!("open {}", path.display()), e))?;
    let fd: FdLink = l.into();
    let info = fd.info().map_err(|e| other(format!("link info {}", path.display()), e))?;
    if info.program_id() == want {
        return Ok(false);
    }
    let link =
        SchedClassifierLink::try_from(fd).map_err(|e| other(format!("{} is not a tcx link", path.display()), e))?;
    match prog.attach_to_link(link) {
        Ok(id) => {
            // The pin keeps the link; dropping our fd leaves it attached.
            drop(prog.take_link(id));
            Ok(true)
        }
        Err(e) if has_errno(&e, libc::ENOLINK) => {
            // ENOLINK: the interface is gone (link defunct). Drop the stale pin.
            let _ = std::fs::remove_file(path);
            Ok(true)
        }
        Err(e) => Err(prog_err(format!("replace program on {}", path.display()))(e)),
    }
}

/// True when `e` or an error in its source chain is an `io::Error` with errno `code`.
fn has_errno(e: &(dyn std::error::Error + 'static), code: i32) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.raw_os_error() == Some(code)
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Points every pinned link at slot `slot`'s program. On a failure the links already moved
/// are put back on `previous` (when given) before the error is returned.
pub(crate) fn replace_links(pin_dir: &Path, slot: usize, previous: Option<usize>) -> Result<usize, Error> {
    let mut progs = slot_programs(pin_dir, slot)?;
    // DNS tail calls go to the slot's own programs from now on (before the links: an old
    // main program then reaches the new DNS programs and returns into the new main one).
    fill_dns_progs_of_slot(pin_dir, slot)?;
    let mut done = Vec::new();
    for lp in link_pins(pin_dir)? {
        let p = progs.get_mut(lp.program).ok_or(Error::Missing(lp.program))?;
        match replace_on_link(&lp.path, p) {
            Ok(true) => done.push(lp),
            Ok(false) => {}
            Err(e) => {
                if let Some(prev) = previous
                    && let Ok(mut back) = slot_programs(pin_dir, prev)
                {
                    for d in &done {
                        if let Some(bp) = back.get_mut(d.program) {
                            let _ = replace_on_link(&d.path, bp);
                        }
                    }
                }
                return Err(e);
            }
        }
    }
    Ok(done.len())
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub(crate) fn record(bytes: &[u8], object: &Path) -> SlotRecord {
    SlotRecord {
        sha256: sha256(bytes),
        version: env!("CARGO_PKG_VERSION").to_string(),
        selftest: SelfTestState::Passed,
        loaded_at: now(),
        object: object.display().to_string(),
    }
}

/// What [`load_standby`] did.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The slot the object now sits in (pending a [`switch`]).
    pub slot: usize,
    /// The self-test report (passed).
    pub selftest: selftest::Report,
}

fn need_meta(pin_dir: &Path) -> Result<Meta, Error> {
    read_meta(pin_dir)?.ok_or_else(|| {
        Error::Slot(format!(
            "{} has no slot metadata: start the network-agent (it loads the first datapath) before load/switch",
            pin_dir.display()
        ))
    })
}

fn standby_of(meta: &Meta) -> usize {
    meta.active.map_or(0, |a| 1 - a)
}

/// Loads `object` into the standby slot with the recorded configuration, reusing the
/// pinned maps (refused when incompatible), and self-tests it against the live maps.
/// On success the slot is pending: [`switch`] activates it.
///
/// Errors: [`Error::Busy`], [`Error::IncompatiblePin`], [`Error::Load`], [`Error::SelfTest`]
/// (nothing changed: the previous standby programs are still pinned).
pub fn load_standby(pin_dir: &Path, object: &Path) -> Result<Loaded, Error> {
    let _lock = UpdateLock::try_acquire(pin_dir)?;
    let bytes = std::fs::read(object).map_err(|source| Error::Object { path: object.to_path_buf(), source })?;
    let mut meta = need_meta(pin_dir)?;
    let sizes = check_pins(&bytes, &pin_dir.join("maps"), |_| None)?;
    let mut ebpf = load_object(&bytes, object, &meta.config, Some(pin_dir), &sizes, &[])?;
    let report = selftest_ebpf(&ebpf, &meta.config)?;
    if !report.passed() {
        return Err(Error::SelfTest(report.failures()));
    }
    let slot = standby_of(&meta);
    pin_slot(&mut ebpf, pin_dir, slot)?;
    meta.slots[slot] = record(&bytes, object);
    meta.pending = Some(slot);
    write_meta(pin_dir, &meta)?;
    Ok(Loaded { slot, selftest: report })
}

/// Makes the pending slot (loaded by [`load_standby`]) active on every pinned link. Returns
/// the new active slot.
///
/// Errors: [`Error::Busy`]; [`Error::Slot`] when no slot is pending (nothing loaded since the
/// last switch: a second `switch` is refused, never a flip back).
pub fn switch(pin_dir: &Path) -> Result<usize, Error> {
    let _lock = UpdateLock::try_acquire(pin_dir)?;
    let mut meta = need_meta(pin_dir)?;
    let Some(slot) = meta.pending.filter(|&p| Some(p) != meta.active) else {
        return Err(Error::Slot(
            "no standby datapath is pending: `datapath load OBJECT` first (the last load is already active)".into(),
        ));
    };
    replace_links(pin_dir, slot, meta.active)?;
    meta.active = Some(slot);
    meta.pending = None;
    write_meta(pin_dir, &meta)?;
    Ok(slot)
}

/// Makes the other slot active again (its programs stayed pinned). Returns the new active
/// slot.
///
/// Errors: [`Error::Busy`]; [`Error::Slot`] when the other slot holds no self-tested programs.
pub fn rollback(pin_dir: &Path) -> Result<usize, Error> {
    let _lock = UpdateLock::try_acquire(pin_dir)?;
    let mut meta = need_meta(pin_dir)?;
    let Some(active) = meta.active else { return Err(Error::Slot("no datapath is active".into())) };
    let other = 1 - active;
    if meta.slots[other].selftest != SelfTestState::Passed || !slot_dir(pin_dir, other).join(prog::FROM_CUBE).exists() {
        return Err(Error::Slot(format!("slot {} holds no datapath to roll back to", SLOT_NAMES[other])));
    }
    replace_links(pin_dir, other, Some(active))?;
    meta.active = Some(other);
    meta.pending = None;
    write_meta(pin_dir, &meta)?;
    Ok(other)
}

/// What [`restore`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restored {
    /// The slot holding the object was active already; every pinned link was pointed at it
    /// again (a no-op unless a switch was cut short, e.g. its process killed mid-way).
    AlreadyActive(usize),
    /// The slot holding the object was made active again, from the other one.
    Switched {
        /// The slot active before.
        from: usize,
        /// The slot holding the object, active now.
        to: usize,
    },
}

/// Makes the slot holding the object with `sha256` active on every pinned link, recording
/// `config` (the configuration its programs were loaded with) when given: the undo of another
/// process's start that switched the node to its own object and then gave up or died (agent
/// decisions U11, U13). With `expect_active`, only while that slot is still the active one
/// (nobody switched since). Links already on the slot are left alone, so on an active slot
/// it only repairs links a cut-short switch left on the other slot.
///
/// Errors: [`Error::Busy`]; [`Error::Slot`] when no self-tested slot holds that object (its
/// standby was overwritten since) or the active slot is not `expect_active`.
pub fn restore(
    pin_dir: &Path,
    sha256: &[u8; 32],
    config: Option<DatapathConfig>,
    expect_active: Option<usize>,
) -> Result<Restored, Error> {
    let _lock = UpdateLock::try_acquire(pin_dir)?;
    let mut meta = need_meta(pin_dir)?;
    if expect_active.is_some() && meta.active != expect_active {
        return Err(Error::Slot(format!("the active slot is {:?} now, not {expect_active:?}", meta.active)));
    }
    let holds = |s: usize| {
        meta.slots[s].sha256 == *sha256
            && meta.slots[s].selftest == SelfTestState::Passed
            && slot_dir(pin_dir, s).join(prog::FROM_CUBE).exists()
    };
    // The active slot first, should both hold it.
    let order = meta.active.map_or([0, 1], |a| [a, 1 - a]);
    let Some(to) = order.into_iter().find(|&s| holds(s)) else {
        return Err(Error::Slot(format!("no slot holds the object with sha256 {}", hex(sha256))));
    };
    let from = meta.active;
    replace_links(pin_dir, to, from)?;
    let switched = from != Some(to);
    if switched || config.is_some_and(|c| c != meta.config) {
        if switched {
            meta.active = Some(to);
            meta.pending = None;
        }
        if let Some(c) = config {
            meta.config = c;
        }
        write_meta(pin_dir, &meta)?;
    }
    Ok(match from {
        Some(f) if f != to => Restored::Switched { from: f, to },
        _ => Restored::AlreadyActive(to),
    })
}

/// One attach point as the kernel reports it.
#[derive(Clone, Debug)]
pub struct AttachPoint {
    /// Hook program name.
    pub program: &'static str,
    /// Interface index.
    pub ifindex: u32,
    /// Interface name in the caller's netns, when it resolves there.
    pub ifname: Option<String>,
    /// Kernel link id.
    pub link_id: u32,
    /// Kernel id of the program the link runs.
    pub program_id: u32,
    /// Program tag (hash of the instructions), as the kernel reports it.
    pub tag: u64,
    /// Slot whose pinned program this is (`None`: neither, i.e. a mixed/foreign program).
    pub slot: Option<usize>,
}

/// Everything `datapath status` shows.
#[derive(Clone, Debug)]
pub struct Status {
    /// Metadata (layout version, slots, config).
    pub meta: Meta,
    /// Program ids per slot (`(name, id, tag)`), empty when the slot is empty.
    pub slot_programs: [Vec<(&'static str, u32, u64)>; 2],
    /// Every pinned link.
    pub attach: Vec<AttachPoint>,
}

/// Reads the metadata, the slots' programs and every pinned link (no lock: read-only).
pub fn status(pin_dir: &Path) -> Result<Status, Error> {
    let meta = need_meta(pin_dir)?;
    let mut slot_programs_ids: [Vec<(&'static str, u32, u64)>; 2] = Default::default();
    for (slot, ids) in slot_programs_ids.iter_mut().enumerate() {
        if let Ok(progs) = slot_programs(pin_dir, slot) {
            for name in ATTACHED {
                if let Some(info) = progs.get(name).and_then(|p| p.info().ok()) {
                    ids.push((name, info.id(), info.tag()));
                }
            }
        }
    }
    let mut attach = Vec::new();
    for lp in link_pins(pin_dir)? {
        let (link_id, program_id) = link_ids(&lp.path)?;
        let tag = aya::programs::loaded_programs().flatten().find(|p| p.id() == program_id).map_or(0, |p| p.tag());
        let slot = (0..2).find(|&s| slot_programs_ids[s].iter().any(|&(_, id, _)| id == program_id));
        attach.push(AttachPoint {
            program: lp.program,
            ifindex: lp.ifindex,
            ifname: ifname(lp.ifindex),
            link_id,
            program_id,
            tag,
            slot,
        });
    }
    Ok(Status { meta, slot_programs: slot_programs_ids, attach })
}

/// Detaches every link on tcx hook (`ifindex`, `attach_type` = [`bpf_sys::TCX_INGRESS`] /
/// [`bpf_sys::TCX_EGRESS`]; calling thread's netns) that runs a program named `program`
/// but is not the link `keep_link_id`: duplicates left by a process that lost its pins, or
/// orphans whose pin was removed. Returns the detached link ids.
pub(crate) fn detach_orphans(
    ifindex: u32,
    attach_type: u32,
    program: &str,
    keep_link_id: u32,
) -> Result<Vec<u32>, Error> {
    let (progs, links) = bpf_sys::tcx_query(ifindex, attach_type)
        .map_err(pin_err(format!("query tcx hook {attach_type} of ifindex {ifindex}")))?;
    let mut names: Option<HashMap<u32, String>> = None;
    let mut out = Vec::new();
    for (pid, lid) in progs.into_iter().zip(links) {
        if lid == 0 || lid == keep_link_id {
            continue;
        }
        let names = names.get_or_insert_with(|| {
            aya::programs::loaded_programs()
                .flatten()
                .map(|p| (p.id(), p.name_as_str().unwrap_or("").to_string()))
                .collect()
        });
        if names.get(&pid).is_some_and(|n| n == program) {
            bpf_sys::link_detach_by_id(lid).map_err(pin_err(format!("detach orphan link {lid}")))?;
            out.push(lid);
        }
    }
    Ok(out)
}

/// Grows or shrinks the pinned map `name` to `max_entries`: a new map (same type, key,
/// value, flags) receives a copy of every entry, a standby load of `object` uses it and is
/// self-tested, every link is switched to it, entries written by the old programs
/// meanwhile are copied again (`BPF_NOEXIST`), and the new map replaces the pin. The other
/// slot still references the old map, so it is emptied (no rollback across a migration).
/// A running agent keeps its handle on the old map until it restarts.
///
/// Returns the number of entries copied.
pub fn migrate_map(pin_dir: &Path, object: &Path, name: &'static str, max_entries: u32) -> Result<usize, Error> {
    let _lock = UpdateLock::try_acquire(pin_dir)?;
    let bytes = std::fs::read(object).map_err(|source| Error::Object { path: object.to_path_buf(), source })?;
    let mut meta = need_meta(pin_dir)?;
    let old_path = pin_dir.join("maps").join(name);
    let next_path = pin_dir.join("maps").join(format!("{name}__next"));
    let info = MapInfo::from_pin(&old_path).map_err(|e| other(format!("open {}", old_path.display()), e))?;
    let old = bpf_sys::obj_get(&old_path).map_err(pin_err(format!("open {}", old_path.display())))?;
    let map_type = info.map_type().map(|t| t as u32).map_err(|e| other("map type", e))?;
    if std::fs::remove_file(&next_path).is_ok() {
        log::warn!("removed a leftover {}", next_path.display());
    }
    let new = bpf_sys::map_create(map_type, info.key_size(), info.value_size(), max_entries, info.map_flags(), name)
        .map_err(pin_err(format!("create {name} with max_entries {max_entries}")))?;
    let percpu = matches!(map_type, 5 | 6 | 10);
    let mut copied = copy_entries(&old, &new, info.key_size(), info.value_size(), percpu, 0)?;
    bpf_sys::obj_pin(new.as_raw_fd(), &next_path).map_err(pin_err(format!("pin {}", next_path.display())))?;
    let result = (|| {
        let mut sizes = check_pins(&bytes, &pin_dir.join("maps"), |_| None)?;
        sizes.retain(|(n, _)| *n != name);
        sizes.push((name, max_entries));
        let mut ebpf = load_object(&bytes, object, &meta.config, Some(pin_dir), &sizes, &[(name, next_path.clone())])?;
        let report = selftest_ebpf(&ebpf, &meta.config)?;
        if !report.passed() {
            return Err(Error::SelfTest(report.failures()));
        }
        let slot = standby_of(&meta);
        pin_slot(&mut ebpf, pin_dir, slot)?;
        replace_links(pin_dir, slot, meta.active)?;
        Ok(slot)
    })();
    let slot = match result {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_file(&next_path);
            return Err(e);
        }
    };
    // BPF_NOEXIST: entries the new programs wrote since the switch win over stale copies.
    copied += copy_entries(&old, &new, info.key_size(), info.value_size(), percpu, crate::BPF_NOEXIST)?;
    std::fs::rename(&next_path, &old_path).map_err(pin_err(format!("replace pin {}", old_path.display())))?;
    if let Some(prev) = meta.active {
        let _ = std::fs::remove_dir_all(slot_dir(pin_dir, prev));
        meta.slots[prev] = SlotRecord::default();
    }
    meta.slots[slot] = record(&bytes, object);
    meta.active = Some(slot);
    meta.pending = None;
    write_meta(pin_dir, &meta)?;
    Ok(copied)
}

fn copy_entries(
    from: &std::os::fd::OwnedFd,
    to: &std::os::fd::OwnedFd,
    key_size: u32,
    value_size: u32,
    percpu: bool,
    flags: u64,
) -> Result<usize, Error> {
    let vlen = if percpu { (value_size as usize).div_ceil(8) * 8 * possible_cpus() } else { value_size as usize };
    let mut key: Option<Vec<u8>> = None;
    let mut next = vec![0u8; key_size as usize];
    let mut value = vec![0u8; vlen];
    let mut n = 0;
    while bpf_sys::map_next_key(from.as_raw_fd(), key.as_deref(), &mut next).map_err(pin_err("map next key"))? {
        if bpf_sys::map_lookup(from.as_raw_fd(), &next, &mut value).map_err(pin_err("map lookup"))? {
            match bpf_sys::map_update(to.as_raw_fd(), &next, &value, flags) {
                Ok(()) => n += 1,
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(pin_err("copy entry into the migrated map")(e)),
            }
        }
        key = Some(next.clone());
    }
    Ok(n)
}

/// Number of possible CPUs (`/sys/devices/system/cpu/possible`, e.g. `0-3`), the per-CPU
/// value count the kernel uses.
pub(crate) fn possible_cpus() -> usize {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    s.trim()
        .split(',')
        .filter_map(|r| {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            Some(b.parse::<usize>().ok()? - a.parse::<usize>().ok()? + 1)
        })
        .sum::<usize>()
        .max(1)
}

/// Name of interface `ifindex` in the calling thread's netns.
pub fn ifname(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buffer of IF_NAMESIZE bytes as required.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into `buf`.
    Some(unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
}
