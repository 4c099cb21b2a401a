//! Active/standby CubeVS (issue 12): load into the standby slot, self-test against the live
//! maps, atomic switch and rollback on every pinned tcx link under traffic, a broken object
//! refused by the self-test, layout mismatches refused, map migration, the update lock, and
//! the restart fix (a new process replaces the programs on adopted links and removes
//! duplicate links).

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, TcpStream},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use cubenet_sys::netns::NetnsThread;
use cubenet_tests::{
    agent::workspace_bin,
    bpffs::BpfFs,
    ebpf_object,
    guest::VethGuest,
    require_root,
    topology::{CUBE_DEV, CUBE_DEV_IP, NODE_IP, NODE_UPLINK, Topology},
};
use cubevs::{
    AttachMode, Datapath, DatapathConfig, Error, LoadOptions, MapLimits, SandboxEntry, SnatAddr,
    layout::{self, LAYOUT_VERSION},
    slots,
};

const VETH_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 3);
const WORLD: &str = "198.51.100.1";

struct Node {
    veth: VethGuest,
    dp: Option<Datapath>,
    thread: NetnsThread,
    bpffs: BpfFs,
    topo: Topology,
}

impl Node {
    fn pin_dir(&self) -> PathBuf {
        self.bpffs.path().join("cubevs")
    }
}

fn opts(bpffs: &BpfFs, object: PathBuf) -> LoadOptions {
    LoadOptions {
        object,
        config: DatapathConfig::DEFAULT,
        pin_dir: Some(bpffs.path().join("cubevs")),
        ..LoadOptions::new()
    }
}

fn attach_all(thread: &NetnsThread, mut dp: Datapath, veth_if: String) -> Datapath {
    thread
        .run(move || {
            dp.attach_uplink(NODE_UPLINK, Ipv4Addr::from(NODE_IP)).expect("attach uplink");
            dp.attach_cube_dev(CUBE_DEV, Ipv4Addr::from(CUBE_DEV_IP)).expect("attach cube-dev");
            dp.attach_sandbox(&veth_if).expect("attach veth");
            dp
        })
        .expect("node thread")
}

fn setup() -> Node {
    setup_with(AttachMode::Auto)
}

fn setup_with(attach_mode: AttachMode) -> Node {
    let mut topo = Topology::new();
    topo.add_cube_dev();
    let veth = topo.add_veth_guest(0);
    let bpffs = BpfFs::new();
    let thread = topo.node.thread();
    let dp = Datapath::load(LoadOptions { attach_mode, ..opts(&bpffs, ebpf_object()) })
        .unwrap_or_else(|e| panic!("load datapath: {e}"));
    let dp = attach_all(&thread, dp, veth.node_if.clone());
    let maps = dp.maps();
    let uplink_ifindex = topo.node.run(|| cubenet_sys::ifindex(NODE_UPLINK).unwrap());
    maps.snat.set(&[SnatAddr { ip: Ipv4Addr::from(NODE_IP), ifindex: uplink_ifindex }]).expect("snat");
    maps.sandboxes
        .register(&SandboxEntry { ifindex: veth.node_ifindex, ip: VETH_IP, version: 1, id: "sb-veth".into() })
        .expect("register");
    // Without a policy an interface denies every new flow; the baseline allows the world.
    maps.policy.install_default_deny(veth.node_ifindex).expect("baseline policy");
    Node { veth, dp: Some(dp), thread, bpffs, topo }
}

/// Traffic from the guest during an operation: a long-lived TCP echo (every 20 ms), a new
/// TCP connection every 20 ms, and a ping every 50 ms. Counts failures of each.
struct Load {
    stop: Arc<AtomicBool>,
    echo_ok: Arc<AtomicU64>,
    echo_fail: Arc<AtomicU64>,
    connect_ok: Arc<AtomicU64>,
    connect_fail: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
    server_stop: Arc<AtomicBool>,
    server: Option<std::thread::JoinHandle<()>>,
    pinger: cubenet_tests::netns::ChildGuard,
    maps: Arc<cubevs::Maps>,
    /// Drop counters (`program/reason` → packets) when the load started.
    drops_before: std::collections::HashMap<String, u64>,
}

/// Every `drop_*` counter of the datapath, keyed `program/reason`.
fn drop_counters(maps: &cubevs::Maps) -> std::collections::HashMap<String, u64> {
    maps.counters
        .read()
        .expect("counters")
        .into_iter()
        .filter(|c| c.reason.starts_with("drop"))
        .map(|c| (format!("{}/{}", c.program, c.reason), c.packets))
        .collect()
}

impl Load {
    fn start(n: &Node, port: u16) -> Self {
        let listener = n.topo.world.run(move || std::net::TcpListener::bind((WORLD, port))).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        // The server stops after the clients: a listener closed under a connecting client
        // resets it, which would count as a failure of the operation under test.
        let server_stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let s = server_stop.clone();
        let server = std::thread::spawn(move || {
            listener.set_nonblocking(true).unwrap();
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut c, _)) => {
                        c.set_nonblocking(false).unwrap();
                        std::thread::spawn(move || {
                            let mut buf = [0u8; 64];
                            while let Ok(k) = c.read(&mut buf) {
                                if k == 0 || c.write_all(&buf[..k]).is_err() {
                                    break;
                                }
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        let gns = n.topo.guest_ns(&n.veth);
        let mut conn = gns.run(move || TcpStream::connect((WORLD, port))).expect("connect echo");
        // Timeouts of 1 s as in `bench upgrade`: a stall of the busy test machine is no
        // failure; a reset is (immediate), and so is any datapath drop (counted below).
        conn.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let (echo_ok, echo_fail) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (s, ok, fail) = (stop.clone(), echo_ok.clone(), echo_fail.clone());
        threads.push(std::thread::spawn(move || {
            let mut buf = [0u8; 4];
            while !s.load(Ordering::Relaxed) {
                let good = conn.write_all(b"ping").is_ok() && conn.read_exact(&mut buf).is_ok() && &buf == b"ping";
                if good {
                    ok.fetch_add(1, Ordering::Relaxed)
                } else {
                    fail.fetch_add(1, Ordering::Relaxed)
                };
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
        let (connect_ok, connect_fail) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (s, ok, fail) = (stop.clone(), connect_ok.clone(), connect_fail.clone());
        let connector = gns.spawn_thread(move || {
            while !s.load(Ordering::Relaxed) {
                let addr = (WORLD.parse::<Ipv4Addr>().unwrap(), port).into();
                let t = std::time::Instant::now();
                let r = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).and_then(|mut c| {
                    let mut b = [0u8; 2];
                    c.set_read_timeout(Some(Duration::from_secs(1)))?;
                    c.write_all(b"hi")?;
                    c.read_exact(&mut b)
                });
                match r {
                    Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        eprintln!("new connection failed after {:?}: {e}", t.elapsed());
                        fail.fetch_add(1, Ordering::Relaxed)
                    }
                };
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        threads.push(std::thread::spawn(move || {
            let _ = connector.join();
        }));
        let pinger = cubenet_tests::netns::ChildGuard::from_child(
            gns.command("ping")
                .args(["-c", "40", "-i", "0.05", "-W", "1", "-q", WORLD])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn ping"),
        );
        let maps = n.dp.as_ref().expect("datapath").maps();
        let drops_before = drop_counters(&maps);
        Self {
            stop,
            echo_ok,
            echo_fail,
            connect_ok,
            connect_fail,
            threads,
            server_stop,
            server: Some(server),
            pinger,
            maps,
            drops_before,
        }
    }

    /// Stops the load and asserts that nothing failed, everything made progress, no ping was
    /// lost and the datapath dropped nothing, apart from `selftests` self-test runs during the
    /// load (each drops exactly one canned frame in `from_cube/drop_unregistered` and one in
    /// `from_envoy/drop_unknown`) and `drop_proto` (the guest kernel's own IPv6 frames).
    fn finish(mut self, what: &str, selftests: u64) {
        let ping = self.pinger.child().wait().unwrap();
        let mut ping_out = String::new();
        if let Some(mut o) = self.pinger.child().stdout.take() {
            let _ = o.read_to_string(&mut ping_out);
        }
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.server_stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
        if self.echo_fail.load(Ordering::Relaxed) + self.connect_fail.load(Ordering::Relaxed) > 0 {
            for c in self.maps.counters.read().unwrap_or_default() {
                if c.packets > 0 {
                    eprintln!("{what}: counter {}/{} = {}", c.program, c.reason, c.packets);
                }
            }
        }
        assert_eq!(self.echo_fail.load(Ordering::Relaxed), 0, "{what}: echo round trips failed (reset/stall)");
        assert_eq!(self.connect_fail.load(Ordering::Relaxed), 0, "{what}: new connections failed");
        assert!(self.echo_ok.load(Ordering::Relaxed) > 20, "{what}: echo made no progress");
        assert!(self.connect_ok.load(Ordering::Relaxed) > 20, "{what}: connections made no progress");
        assert!(ping.success() && ping_out.contains(" 0% packet loss"), "{what}: ping lost packets: {ping_out}");
        let after = drop_counters(&self.maps);
        for (name, n) in &after {
            let grew = n - self.drops_before.get(name).copied().unwrap_or(0);
            let allowed = match name.as_str() {
                "from_cube/drop_unregistered" | "from_envoy/drop_unknown" => selftests,
                "from_cube/drop_proto" => grew,
                _ => 0,
            };
            assert_eq!(grew, allowed, "{what}: the datapath dropped packets ({name})");
        }
    }
}

/// The program ids every pinned link runs must be exactly slot `slot`'s.
fn assert_links_on(pin_dir: &Path, slot: usize) {
    let st = slots::status(pin_dir).expect("status");
    assert_eq!(st.meta.active, Some(slot), "active slot in metadata");
    assert_eq!(st.attach.len(), 3, "uplink, cube-dev, veth: {:?}", st.attach);
    for a in &st.attach {
        assert_eq!(
            a.slot,
            Some(slot),
            "{} on ifindex {} runs program {} outside slot {slot}",
            a.program,
            a.ifindex,
            a.program_id
        );
    }
}

fn veth_programs(n: &Node) -> Vec<String> {
    let veth_if = n.veth.node_if.clone();
    n.thread.run(move || cubevs::tcx_ingress_programs(&veth_if).unwrap()).unwrap()
}

/// Program ids of the `from_cube` tc filters on the veth's ingress (`tc filter show`).
fn veth_filter_ids(n: &Node) -> Vec<u32> {
    let out = n.topo.node.exec("tc", &["filter", "show", "dev", &n.veth.node_if, "ingress"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .filter(|l| l.contains("from_cube") && l.contains("direct-action"))
        .map(|l| {
            let id = l.split_whitespace().skip_while(|w| *w != "id").nth(1);
            id.and_then(|w| w.parse().ok()).unwrap_or_else(|| panic!("no program id in {l:?}"))
        })
        .collect()
}

/// Id of the `from_cube` pinned in slot `slot`.
fn slot_from_cube_id(pin_dir: &Path, slot: usize) -> u32 {
    let p = slots::slot_dir(pin_dir, slot).join("from_cube");
    aya::programs::SchedClassifier::from_pin(&p).unwrap().info().unwrap().id()
}

/// Runs `f` on the node thread with the node's datapath.
fn with_dp<R: Send + 'static>(n: &mut Node, f: impl FnOnce(&mut Datapath) -> R + Send + 'static) -> R {
    let mut dp = n.dp.take().expect("datapath");
    let (dp, r) = n
        .thread
        .run(move || {
            let r = f(&mut dp);
            (dp, r)
        })
        .expect("node thread");
    n.dp = Some(dp);
    r
}

/// The real object with `from_world` starting `r0 = TC_ACT_SHOT; if r0 != 2 goto +1; exit`
/// over its first three instructions: it verifies and loads (the rest of the program stays
/// reachable in the control-flow graph through the never-taken jump), but drops everything it
/// should pass, which the self-test's pass-through frames catch.
fn broken_object(dir: &Path) -> PathBuf {
    let mut elf = std::fs::read(ebpf_object()).unwrap();
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap()) as usize;
    let (shoff, shentsize, shnum) = (u64_at(&elf, 0x28), u16_at(&elf, 0x3a), u16_at(&elf, 0x3c));
    let sh = |i: usize| shoff + i * shentsize;
    let symtab = (0..shnum).find(|&i| u32_at(&elf, sh(i) + 4) == 2).expect("symtab");
    let strtab = u32_at(&elf, sh(symtab) + 40);
    let (sym_off, sym_size) = (u64_at(&elf, sh(symtab) + 24), u64_at(&elf, sh(symtab) + 32));
    let str_off = u64_at(&elf, sh(strtab) + 24);
    let (mut shndx, mut value, mut size) = (0, 0, 0);
    for s in (sym_off..sym_off + sym_size).step_by(24) {
        let name_at = str_off + u32_at(&elf, s);
        if elf[name_at..].starts_with(b"from_world\0") {
            (shndx, value, size) = (u16_at(&elf, s + 6), u64_at(&elf, s + 8), u64_at(&elf, s + 16));
        }
    }
    assert!(size > 32, "from_world symbol");
    let start = u64_at(&elf, sh(shndx) + 24) + value;
    // The overwritten instructions must carry no relocation (no 64-bit load, no call) and the
    // jump target must not be the second half of a 64-bit load.
    for k in 0..3 {
        let op = elf[start + 8 * k];
        assert!(op != 0x18 && op != 0x85, "instruction {k} of from_world is {op:#x}: pick another patch");
    }
    let insns: [[u8; 8]; 3] = [
        [0xb7, 0x00, 0, 0, 2, 0, 0, 0], // r0 = 2 (TC_ACT_SHOT)
        [0x55, 0x00, 1, 0, 2, 0, 0, 0], // if r0 != 2 goto +1
        [0x95, 0x00, 0, 0, 0, 0, 0, 0], // exit
    ];
    for (k, insn) in insns.iter().enumerate() {
        elf[start + 8 * k..start + 8 * k + 8].copy_from_slice(insn);
    }
    let p = dir.join("cubevs-broken.bpf.o");
    std::fs::write(&p, elf).unwrap();
    p
}

/// The real object with one byte appended: the same programs, a different sha256 (what a
/// rebuilt release looks like to the loader).
fn other_build(dir: &Path) -> PathBuf {
    let mut elf = std::fs::read(ebpf_object()).unwrap();
    elf.push(0);
    let p = dir.join("cubevs-next.bpf.o");
    std::fs::write(&p, elf).unwrap();
    p
}

/// A scratch directory for object files, removed on drop (also on panic).
struct TmpDir(PathBuf);

impl TmpDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tmpdir(name: &str) -> TmpDir {
    let d = std::env::temp_dir().join(format!("cubenet-upgrade-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    TmpDir(d)
}

#[test]
fn switch_and_rollback_under_load() {
    if !require_root("switch_and_rollback_under_load") {
        return;
    }
    let n = setup();
    let pin = n.pin_dir();
    assert_links_on(&pin, 0);
    let tmp1 = tmpdir("switch");
    let next = other_build(tmp1.path());
    let loaded = slots::load_standby(&pin, &next).expect("load standby");
    assert_eq!(loaded.slot, 1);
    assert!(loaded.selftest.passed());
    let names: Vec<_> = loaded.selftest.checks.iter().map(|c| c.name).collect();
    assert_eq!(names.len(), 5, "{names:?}");
    assert!(names.contains(&"from_cube arp proxy"), "the ARP case runs on the registered sandbox: {names:?}");
    // Loading changes no link.
    assert_links_on(&pin, 0);

    let load = Load::start(&n, 7101);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(slots::switch(&pin).expect("switch"), 1);
    assert_links_on(&pin, 1);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(slots::rollback(&pin).expect("rollback"), 0);
    assert_links_on(&pin, 0);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(slots::rollback(&pin).expect("roll forward again"), 1);
    assert_links_on(&pin, 1);
    load.finish("switch, rollback, roll forward", 0);
    assert_eq!(veth_programs(&n), vec!["from_cube".to_string()], "one program on the hook, same link");
    let st = slots::status(&pin).unwrap();
    assert_eq!(st.meta.slots[1].sha256, slots::sha256(&std::fs::read(&next).unwrap()));
}

#[test]
fn broken_object_fails_selftest_and_changes_nothing() {
    if !require_root("broken_object_fails_selftest_and_changes_nothing") {
        return;
    }
    let n = setup();
    let pin = n.pin_dir();
    let before = slots::status(&pin).unwrap();
    let tmp2 = tmpdir("broken");
    let broken = broken_object(tmp2.path());
    let load = Load::start(&n, 7102);
    let err = slots::load_standby(&pin, &broken).expect_err("the broken object must fail its self-test");
    let msg = err.to_string();
    assert!(matches!(err, Error::SelfTest(_)), "{msg}");
    assert!(msg.contains("from_world") && msg.contains("verdict 2"), "{msg}");
    let after = slots::status(&pin).unwrap();
    assert_eq!(after.meta, before.meta, "metadata unchanged");
    assert!(!slots::slot_dir(&pin, 1).exists(), "nothing pinned into the standby slot");
    let ids = |s: &slots::Status| s.attach.iter().map(|a| a.program_id).collect::<Vec<_>>();
    assert_eq!(ids(&after), ids(&before), "links untouched");
    let e = slots::switch(&pin).expect_err("nothing pending");
    assert!(e.to_string().contains("no standby datapath is pending"), "{e}");
    load.finish("failed self-test", 1);
}

#[test]
fn layout_mismatch_is_refused() {
    if !require_root("layout_mismatch_is_refused") {
        return;
    }
    // max_entries differs from what is pinned (pins from before slot metadata existed are
    // compared with the configured sizes).
    let bpffs = BpfFs::new();
    let small =
        LoadOptions { limits: MapLimits { sessions: 4096, ..MapLimits::default() }, ..opts(&bpffs, ebpf_object()) };
    drop(Datapath::load(small).expect("first load"));
    std::fs::remove_file(layout::meta_path(&bpffs.path().join("cubevs"))).unwrap();
    let e = Datapath::load(opts(&bpffs, ebpf_object())).expect_err("size mismatch must be refused");
    assert!(matches!(e, Error::IncompatiblePin { .. }), "{e}");
    assert!(e.to_string().contains("max_entries 4096") && e.to_string().contains("migration"), "{e}");

    // An unknown layout version in the metadata.
    let bpffs = BpfFs::new();
    let pin = bpffs.path().join("cubevs");
    drop(Datapath::load(opts(&bpffs, ebpf_object())).expect("load"));
    let mut meta = layout::read_meta(&pin).unwrap().unwrap();
    meta.layout = LAYOUT_VERSION + 98;
    layout::write_meta(&pin, &meta).unwrap();
    for e in [
        Datapath::load(opts(&bpffs, ebpf_object())).expect_err("agent start refuses"),
        slots::load_standby(&pin, &ebpf_object()).expect_err("cli load refuses"),
    ] {
        let msg = e.to_string();
        assert!(msg.contains(&format!("layout version {}", LAYOUT_VERSION + 98)) && msg.contains("refusing"), "{msg}");
    }
}

#[test]
fn restart_with_new_object_replaces_programs_and_removes_duplicates() {
    if !require_root("restart_with_new_object_replaces_programs_and_removes_duplicates") {
        return;
    }
    let mut n = setup();
    let pin = n.pin_dir();
    let old_ids: Vec<u32> = slots::status(&pin).unwrap().attach.iter().map(|a| a.program_id).collect();
    // A stray second link running our program on the veth hook, pinned elsewhere (what a
    // process that lost its pins leaves behind).
    let veth_if = n.veth.node_if.clone();
    let stray = n.bpffs.path().join("stray");
    let s = stray.clone();
    // The kernel refuses the same program twice on one hook: a second, unpinned load.
    let mut other = Datapath::load(LoadOptions { pin_dir: None, ..opts(&n.bpffs, ebpf_object()) }).unwrap();
    n.thread
        .run(move || {
            let prog = other.program("from_cube").unwrap();
            let id = prog
                .attach_with_options(
                    &veth_if,
                    aya::programs::TcAttachType::Ingress,
                    aya::programs::tc::TcAttachOptions::TcxOrder(Default::default()),
                )
                .unwrap();
            let link: aya::programs::links::FdLink = prog.take_link(id).unwrap().try_into().unwrap();
            link.pin(&s).unwrap();
        })
        .unwrap();
    assert_eq!(veth_programs(&n), vec!["from_cube".to_string(); 2], "duplicate planted");

    let load = Load::start(&n, 7103);
    std::thread::sleep(Duration::from_millis(300));
    drop(n.dp.take());
    let tmp3 = tmpdir("restart");
    let next = other_build(tmp3.path());
    let dp = Datapath::load(opts(&n.bpffs, next)).expect("restart with the new build");
    let dp = attach_all(&n.thread, dp, n.veth.node_if.clone());
    n.dp = Some(dp);
    assert_links_on(&pin, 1);
    let st = slots::status(&pin).unwrap();
    for (a, old) in st.attach.iter().zip(&old_ids) {
        assert_ne!(a.program_id, *old, "{} still runs the old program", a.program);
    }
    assert_eq!(veth_programs(&n), vec!["from_cube".to_string()], "duplicate detached by link id");
    std::thread::sleep(Duration::from_millis(300));
    load.finish("restart with a new build", 1);
    let _ = std::fs::remove_file(stray);

    // A restart with the same build reuses the active slot: no replacement.
    let before: Vec<u32> = slots::status(&pin).unwrap().attach.iter().map(|a| a.program_id).collect();
    drop(n.dp.take());
    let tmp4 = tmpdir("restart");
    let dp = Datapath::load(opts(&n.bpffs, other_build(tmp4.path()))).expect("same build");
    assert_eq!(dp.slot(), Some(1));
    let after: Vec<u32> = slots::status(&pin).unwrap().attach.iter().map(|a| a.program_id).collect();
    assert_eq!(before, after);
}

#[test]
fn migrate_map_to_new_size_keeps_entries_and_traffic() {
    if !require_root("migrate_map_to_new_size_keeps_entries_and_traffic") {
        return;
    }
    let mut n = setup();
    let pin = n.pin_dir();
    let map_pin = pin.join("maps").join(cubevs_common::map::IFINDEX_TO_MVMMETA);
    let old_max = aya::maps::MapInfo::from_pin(&map_pin).unwrap().max_entries();
    let load = Load::start(&n, 7104);
    std::thread::sleep(Duration::from_millis(300));
    let copied =
        slots::migrate_map(&pin, &ebpf_object(), cubevs_common::map::IFINDEX_TO_MVMMETA, old_max * 2).expect("migrate");
    assert!(copied >= 1, "the registered sandbox was copied");
    assert_eq!(aya::maps::MapInfo::from_pin(&map_pin).unwrap().max_entries(), old_max * 2, "pin replaced");
    assert_links_on(&pin, 1);
    std::thread::sleep(Duration::from_millis(300));
    load.finish("map migration", 1);
    let e = slots::rollback(&pin).expect_err("no rollback across a migration");
    assert!(e.to_string().contains("no datapath to roll back to"), "{e}");
    // A new process opens the migrated map with its entry.
    drop(n.dp.take());
    let dp = Datapath::load(opts(&n.bpffs, ebpf_object())).expect("reload after migration");
    assert_eq!(dp.maps().sandboxes.list().unwrap().len(), 1);
}

#[test]
fn concurrent_switch_one_wins() {
    if !require_root("concurrent_switch_one_wins") {
        return;
    }
    let n = setup();
    let pin = n.pin_dir();
    let cli = workspace_bin("cubenet-cli");
    let tmp5 = tmpdir("concurrent");
    let next = other_build(tmp5.path());
    let out = std::process::Command::new(&cli)
        .args(["datapath", "--bpffs-dir"])
        .arg(&pin)
        .arg("load")
        .arg(&next)
        .output()
        .unwrap();
    assert!(out.status.success(), "cli load: {}", String::from_utf8_lossy(&out.stderr));
    // A lock held by a concurrent updater is a clear, immediate error.
    {
        let _held = cubevs::lock::UpdateLock::try_acquire(&pin).unwrap();
        let out = std::process::Command::new(&cli)
            .args(["datapath", "--bpffs-dir"])
            .arg(&pin)
            .arg("switch")
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("another updater holds the lock"), "{err}");
    }
    let spawn = || {
        std::process::Command::new(&cli)
            .args(["datapath", "--bpffs-dir"])
            .arg(&pin)
            .arg("switch")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let outs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];
    let wins = outs.iter().filter(|o| o.status.success()).count();
    assert_eq!(wins, 1, "exactly one switch wins: {outs:?}");
    let loser = outs.iter().find(|o| !o.status.success()).unwrap();
    let err = String::from_utf8_lossy(&loser.stderr);
    assert!(
        err.contains("another updater holds the lock") || err.contains("no standby datapath is pending"),
        "clear error: {err}"
    );
    assert_links_on(&pin, 1);
    let out = std::process::Command::new(&cli)
        .args(["--json", "datapath", "--bpffs-dir"])
        .arg(&pin)
        .arg("status")
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status json");
    assert_eq!(j["active"], "b");
    assert_eq!(j["attachPoints"].as_array().unwrap().len(), 3);
    assert_eq!(j["slots"][1]["selfTest"], "passed");
    // The table: the summary line, both slots, and every hook on slot b.
    let out =
        std::process::Command::new(&cli).args(["datapath", "--bpffs-dir"]).arg(&pin).arg("status").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("active slot b") && text.contains("pending slot -"), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    let hooks = lines.iter().position(|l| l.starts_with("HOOK")).expect("attach table");
    let rows: Vec<Vec<&str>> = lines[hooks + 1..].iter().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows.len(), 3, "{text}");
    for r in &rows {
        assert!(slots::ATTACHED.contains(&r[0]), "{text}");
        assert_eq!(r.last(), Some(&"b"), "{text}");
    }
    let slot_rows: Vec<&&str> = lines.iter().filter(|l| l.starts_with("a ") || l.starts_with("b ")).collect();
    assert_eq!(slot_rows.len(), 2, "{text}");
    assert!(slot_rows.iter().all(|l| l.contains("passed")), "{text}");
}

#[test]
fn switch_drops_pins_of_deleted_interfaces() {
    if !require_root("switch_drops_pins_of_deleted_interfaces") {
        return;
    }
    let mut n = setup();
    let pin = n.pin_dir();
    let gone = n.topo.add_veth_guest(1);
    let (name, ifindex) = (gone.node_if.clone(), gone.node_ifindex);
    let mut dp = n.dp.take().unwrap();
    let nm = name.clone();
    dp = n
        .thread
        .run(move || {
            dp.attach_sandbox(&nm).unwrap();
            dp
        })
        .unwrap();
    n.dp = Some(dp);
    let link_pin = pin.join("links").join(format!("from_cube_{ifindex}"));
    assert!(link_pin.exists());
    n.topo.node.ip(&["link", "del", &name]);
    let tmp6 = tmpdir("enolink");
    slots::load_standby(&pin, &other_build(tmp6.path())).expect("load");
    // The defunct link (ENOLINK on update) loses its pin; every live link switches.
    assert_eq!(slots::switch(&pin).expect("switch with a defunct link"), 1);
    assert!(!link_pin.exists(), "pin of the deleted interface removed");
    assert_links_on(&pin, 1);
}

/// `AttachMode::TcxDeferred` (the agent's default, decision F5): the sandbox interface first
/// gets `from_cube` as a tc filter running the active slot's program, no tcx link; a process
/// restart finds it without a link pin and queues it again (`defer_sandbox`); `convert_next`
/// under traffic puts the pinned tcx link in front and removes the filter: no reset, no
/// failed connection, no lost ping, no datapath drop, one program on the hook.
#[test]
fn warmup_filter_moves_to_tcx_under_load() {
    if !require_root("warmup_filter_moves_to_tcx_under_load") {
        return;
    }
    let mut n = setup_with(AttachMode::TcxDeferred);
    let pin = n.pin_dir();
    assert!(veth_programs(&n).is_empty(), "no tcx link yet: {:?}", veth_programs(&n));
    assert_eq!(veth_filter_ids(&n), vec![slot_from_cube_id(&pin, 0)], "one filter with slot a's from_cube");
    assert_eq!(n.dp.as_ref().unwrap().filters_pending(), 1);
    let load = Load::start(&n, 7111);
    std::thread::sleep(Duration::from_millis(300));
    // A restart before the conversion: the new process queues the interface again.
    drop(n.dp.take());
    n.dp = Some(
        Datapath::load(LoadOptions { attach_mode: AttachMode::TcxDeferred, ..opts(&n.bpffs, ebpf_object()) })
            .expect("restart"),
    );
    let veth_if = n.veth.node_if.clone();
    assert!(with_dp(&mut n, move |dp| dp.defer_sandbox(&veth_if).unwrap()), "queued after a restart");
    std::thread::sleep(Duration::from_millis(300));
    let converted = with_dp(&mut n, |dp| dp.convert_next().unwrap());
    assert_eq!(converted.as_deref(), Some(n.veth.node_if.as_str()));
    std::thread::sleep(Duration::from_millis(300));
    load.finish("warm-up filter to tcx link", 0);
    assert_eq!(veth_programs(&n), vec!["from_cube".to_string()]);
    assert!(veth_filter_ids(&n).is_empty(), "filter removed: {:?}", veth_filter_ids(&n));
    assert_links_on(&pin, 0);
    assert_eq!(with_dp(&mut n, |dp| dp.convert_next().unwrap()), None);
    let veth_if = n.veth.node_if.clone();
    assert!(!with_dp(&mut n, move |dp| dp.defer_sandbox(&veth_if).unwrap()), "a linked interface is not queued");
}

/// A `datapath switch` while an interface is still on its warm-up filter: the pinned links
/// switch at once, the filter keeps slot a's program (both read the same maps), and the
/// conversion attaches the ACTIVE slot's program, so afterwards every link runs slot b; a
/// rollback then switches the converted link like any other. All under traffic, no failure.
#[test]
fn switch_during_warmup_reaches_the_interface_at_conversion() {
    if !require_root("switch_during_warmup_reaches_the_interface_at_conversion") {
        return;
    }
    let mut n = setup_with(AttachMode::TcxDeferred);
    let pin = n.pin_dir();
    let tmp = tmpdir("warmup-switch");
    let next = other_build(tmp.path());
    assert!(slots::load_standby(&pin, &next).expect("load standby").selftest.passed());
    let load = Load::start(&n, 7112);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(slots::switch(&pin).expect("switch"), 1);
    let st = slots::status(&pin).unwrap();
    assert_eq!(st.attach.len(), 2, "uplink and cube-dev linked, veth not yet: {:?}", st.attach);
    assert!(st.attach.iter().all(|a| a.slot == Some(1)), "{:?}", st.attach);
    assert_eq!(veth_filter_ids(&n), vec![slot_from_cube_id(&pin, 0)], "the filter keeps slot a until converted");
    std::thread::sleep(Duration::from_millis(300));
    with_dp(&mut n, |dp| dp.convert_next().unwrap()).expect("one interface converted");
    assert_links_on(&pin, 1);
    assert!(veth_filter_ids(&n).is_empty());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(slots::rollback(&pin).expect("rollback"), 0);
    assert_links_on(&pin, 0);
    std::thread::sleep(Duration::from_millis(300));
    load.finish("switch during warm-up, conversion, rollback", 0);
    assert_eq!(veth_programs(&n), vec!["from_cube".to_string()]);
}

/// The ids of slot `slot`'s pinned programs, in `dns_progs` slot order (query, from_cube,
/// response, from_world).
fn dns_targets_of(pin_dir: &Path, slot: usize) -> Vec<Option<u32>> {
    use cubevs::prog;
    [prog::DNS_QUERY, prog::FROM_CUBE, prog::DNS_RESPONSE, prog::FROM_WORLD]
        .iter()
        .map(|name| {
            let p = aya::programs::SchedClassifier::from_pin(slots::slot_dir(pin_dir, slot).join(name)).unwrap();
            Some(p.info().unwrap().id())
        })
        .collect()
}

/// A guest DNS query for `api.example.com` (guest port `gport`, id `id`) through the active
/// slot's pinned `from_cube` on the veth, and the resolver's answer `addr` through its
/// `from_world` on the uplink (`BPF_PROG_TEST_RUN`; the programs on the links are these,
/// [`assert_links_on`]). Returns both verdicts.
fn dns_through_slot(n: &Node, slot: usize, gport: u16, id: u16, addr: [u8; 4]) -> (u32, u32) {
    use cubenet_tests::{
        dns::{self, Owner, a},
        frames::udp,
        packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
        topology::WORLD_IP,
    };
    use cubevs::testrun::{self, SkBuffCtx};
    let pin = n.pin_dir();
    let (world_mac, up_mac, veth_if) = (n.topo.world_mac(), n.topo.node_uplink_mac(), n.veth.node_ifindex);
    n.thread
        .run(move || {
            let progs = slots::slot_programs(&pin, slot).unwrap();
            let up_if = cubenet_sys::ifindex(NODE_UPLINK).unwrap();
            let ctx = |i| SkBuffCtx { ingress_ifindex: i, ..Default::default() };
            let q = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, gport, 53, &dns::query(id, "api.example.com"));
            let out = testrun::run(&progs["from_cube"], &q, ctx(veth_if), 1).unwrap();
            let (snat_ip, snat_port) = (
                [out.data[26], out.data[27], out.data[28], out.data[29]],
                u16::from_be_bytes([out.data[34], out.data[35]]),
            );
            let r = dns::response(id, "api.example.com", &[a(Owner::Question, addr, 600)]);
            let back = udp(world_mac, up_mac, WORLD_IP, snat_ip, 53, snat_port, &r);
            (out.verdict, testrun::run(&progs["from_world"], &back, ctx(up_if), 1).unwrap().verdict)
        })
        .unwrap()
}

/// DNS learning survives a switch and a rollback: `dns_progs` points at the active slot's
/// own programs after each, and a DNS response through the active programs is learned with
/// no failed tail call (there or back).
#[test]
fn dns_learning_survives_switch_and_rollback() {
    if !require_root("dns_learning_survives_switch_and_rollback") {
        return;
    }
    use cubevs_common::counter;
    let n = setup();
    let pin = n.pin_dir();
    let maps = n.dp.as_ref().unwrap().maps();
    maps.policy.replace(n.veth.node_ifindex, &world_and_api_policy()).expect("policy");
    let tmp = tmpdir("dns");
    let next = other_build(tmp.path());
    assert_eq!(slots::load_standby(&pin, &next).expect("load standby").slot, 1);
    assert_eq!(slots::dns_prog_ids(&pin).unwrap(), dns_targets_of(&pin, 0), "loading moves nothing");

    let steps: [(&str, usize, [u8; 4]); 3] =
        [("before", 0, [203, 0, 113, 1]), ("switch", 1, [203, 0, 113, 2]), ("rollback", 0, [203, 0, 113, 3])];
    for (i, (step, slot, addr)) in steps.into_iter().enumerate() {
        match step {
            "switch" => assert_eq!(slots::switch(&pin).expect("switch"), 1),
            "rollback" => assert_eq!(slots::rollback(&pin).expect("rollback"), 0),
            _ => {}
        }
        assert_links_on(&pin, slot);
        assert_eq!(slots::dns_prog_ids(&pin).unwrap(), dns_targets_of(&pin, slot), "{step}: dns_progs");
        let learned_before = maps.counters.get(counter::DNS_RESP_LEARNED).unwrap();
        let verdicts = dns_through_slot(&n, slot, 40000 + i as u16, 0x100 + i as u16, addr);
        assert_eq!(verdicts, (cubevs::testrun::TC_ACT_REDIRECT, cubevs::testrun::TC_ACT_REDIRECT), "{step}");
        let l = maps.policy.learned(Some(n.veth.node_ifindex));
        assert!(l.iter().any(|e| e.ip == Ipv4Addr::from(addr) && e.port == 0), "{step}: not learned: {l:?}");
        assert_eq!(maps.counters.get(counter::DNS_RESP_LEARNED).unwrap(), learned_before + 1, "{step}");
        assert_eq!(maps.counters.get(counter::DNS_TAIL_CALL_FAILED).unwrap(), 0, "{step}: tail call failed");
        assert_eq!(maps.counters.get(counter::DNS_TAIL_BACK_FAILED).unwrap(), 0, "{step}: tail call back failed");
    }

    // A new process with the active slot's object (an agent restart) reuses the slot, and
    // `dns_progs` stays on the slot's programs, not on the new process's own copies.
    let again = Datapath::load(opts(&n.bpffs, ebpf_object())).expect("reload");
    assert_eq!(again.slot(), Some(0), "reused the active slot");
    assert_eq!(slots::dns_prog_ids(&pin).unwrap(), dns_targets_of(&pin, 0), "after a restart");
    drop(again);
    let verdicts = dns_through_slot(&n, 0, 40010, 0x200, [203, 0, 113, 4]);
    assert_eq!(verdicts, (cubevs::testrun::TC_ACT_REDIRECT, cubevs::testrun::TC_ACT_REDIRECT));
    assert!(maps.policy.learned(Some(n.veth.node_ifindex)).iter().any(|e| e.ip == Ipv4Addr::new(203, 0, 113, 4)));
    assert_eq!(maps.counters.get(counter::DNS_TAIL_CALL_FAILED).unwrap(), 0);
}

/// The eBPF object of main before the node-wide floor (decision Q4; commit 1d868c8, debug info
/// stripped): it charges the per-sandbox budget but has no `session_floor` map and writes
/// `NatSession::node_quota` 0.
fn q3_object() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/cubevs-q3.bpf.o")
}

/// `n` new guest UDP flows (guest ports from `base`) through slot `slot`'s pinned `from_cube`
/// on the veth (`BPF_PROG_TEST_RUN`); returns how many were forwarded.
fn udp_through_slot(n: &Node, slot: usize, base: u16, count: u16) -> usize {
    use cubenet_tests::{
        frames::udp,
        packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
        topology::WORLD_IP,
    };
    use cubevs::testrun::{self, SkBuffCtx, TC_ACT_REDIRECT};
    let pin = n.pin_dir();
    let veth_if = n.veth.node_ifindex;
    n.thread
        .run(move || {
            let progs = slots::slot_programs(&pin, slot).unwrap();
            let ctx = SkBuffCtx { ingress_ifindex: veth_if, ..Default::default() };
            (0..count)
                .filter(|i| {
                    let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, base + i, 53, b"q");
                    testrun::run(&progs["from_cube"], &f, ctx, 1).unwrap().verdict == TC_ACT_REDIRECT
                })
                .count()
        })
        .unwrap()
}

/// Switching to an object older than the node-wide floor and rolling back neither underflows
/// nor drifts the node count: the older object's sessions are never charged to it (their
/// `node_quota` is 0), so deleting them subtracts nothing, and after each step the count
/// equals the node-charged sessions in the map.
#[test]
fn node_count_survives_switch_to_older_object_and_rollback() {
    if !require_root("node_count_survives_switch_to_older_object_and_rollback") {
        return;
    }
    use cubevs_common::quota::COUNTED;
    let n = setup();
    let pin = n.pin_dir();
    let maps = n.dp.as_ref().unwrap().maps();
    let node = |m: &cubevs::Maps| m.sessions.floor_state().unwrap().expect("floor map");
    let charged =
        |m: &cubevs::Maps| m.sessions.entries().unwrap().iter().filter(|(_, s)| s.node_quota == COUNTED).count() as i64;
    assert_eq!(udp_through_slot(&n, 0, 41_000, 3), 3);
    assert_eq!(node(&maps).usage.live(), 3);

    // Switch to the older object: its new flows are charged to the sandbox only.
    assert_eq!(slots::load_standby(&pin, &q3_object()).expect("load the older object").slot, 1);
    assert_eq!(slots::switch(&pin).expect("switch"), 1);
    assert_links_on(&pin, 1);
    assert_eq!(udp_through_slot(&n, 1, 42_000, 4), 4);
    let all = maps.sessions.entries().unwrap();
    assert_eq!(all.len(), 7);
    assert_eq!(all.iter().filter(|(_, s)| s.quota == COUNTED && s.node_quota == 0).count(), 4, "older sessions");
    assert_eq!(node(&maps).usage.opened, 3, "the older object never adds");
    assert_eq!(node(&maps).usage.live(), charged(&maps));

    // Roll back to the floor's object, which opens more; then every session expires.
    assert_eq!(slots::rollback(&pin).expect("rollback"), 0);
    assert_links_on(&pin, 0);
    assert_eq!(udp_through_slot(&n, 0, 43_000, 2), 2);
    assert_eq!(node(&maps).usage.live(), 5);
    assert_eq!(node(&maps).usage.live(), charged(&maps));
    let later = cubevs::reaper::monotonic_ns() + 31_000_000_000;
    let swept = cubevs::reaper::sweep(&maps.sessions, &cubevs::reaper::Timeouts::default(), later).unwrap();
    assert_eq!(swept.removed, 9);
    let st = node(&maps);
    assert_eq!((st.usage.opened, st.usage.closed), (5, 5), "only node-charged sessions subtracted: no underflow");
    // The sandbox's own budget is back to 0 as well.
    let sb = maps.sessions.quota_usage(n.veth.node_ifindex, 1).unwrap().unwrap();
    assert_eq!(sb.live(), 0);
    // And the ceiling is the one the registrations give (one sandbox).
    let cpus = cubevs::quota::floor_margin();
    assert_eq!(st.ceiling, cubevs::quota::floor_ceiling(1 << 20, 1, 64, cpus));
}

/// The node's always-denied list (`node_deny`, decision R30) across a switch to an object older
/// than it and back: the older object loads as the standby beside the pin (it is optional) and
/// runs without the list, as documented; the pin keeps its entries, and after the rollback the
/// newer object denies the listed address again without anything being rewritten.
#[test]
fn node_deny_survives_switch_to_older_object_and_rollback() {
    if !require_root("node_deny_survives_switch_to_older_object_and_rollback") {
        return;
    }
    use cubenet_tests::topology::WORLD_IP;
    let n = setup();
    let pin = n.pin_dir();
    let maps = n.dp.as_ref().unwrap().maps();
    assert_eq!(udp_through_slot(&n, 0, 44_000, 2), 2, "control: the world is open before the list");
    let list = [cubevs::Cidr::new(Ipv4Addr::from(WORLD_IP), 32)];
    maps.node_deny.replace(&list).expect("node_deny");
    assert_eq!(udp_through_slot(&n, 0, 44_100, 3), 0, "the listed address is denied");

    assert_eq!(slots::load_standby(&pin, &q3_object()).expect("load the older object").slot, 1);
    assert_eq!(slots::switch(&pin).expect("switch"), 1);
    assert_links_on(&pin, 1);
    assert_eq!(udp_through_slot(&n, 1, 44_200, 3), 3, "the older object has no list (documented limit)");
    assert_eq!(maps.node_deny.list(), list.to_vec(), "the pin keeps its entries");

    assert_eq!(slots::rollback(&pin).expect("rollback"), 0);
    assert_links_on(&pin, 0);
    assert_eq!(udp_through_slot(&n, 0, 44_300, 3), 0, "denied again after the rollback");
    maps.node_deny.replace(&[]).expect("node_deny");
    assert_eq!(udp_through_slot(&n, 0, 44_400, 2), 2, "emptied in place: open again");
}

/// `count` guest DNS queries for an allowed name (guest ports from `base`, ids from `base`)
/// through slot `slot`'s pinned `from_cube` on the veth (`BPF_PROG_TEST_RUN`; the DNS tail
/// call goes to the active slot's `dns_query`, N9); returns how many were forwarded.
fn queries_through_slot(n: &Node, slot: usize, base: u16, count: u16) -> usize {
    use cubenet_tests::{
        dns,
        frames::udp,
        packet::{GATEWAY_MAC, GUEST_IP, GUEST_MAC},
        topology::WORLD_IP,
    };
    use cubevs::testrun::{self, SkBuffCtx, TC_ACT_REDIRECT};
    let pin = n.pin_dir();
    let veth_if = n.veth.node_ifindex;
    n.thread
        .run(move || {
            let progs = slots::slot_programs(&pin, slot).unwrap();
            let ctx = SkBuffCtx { ingress_ifindex: veth_if, ..Default::default() };
            (0..count)
                .filter(|i| {
                    let q = dns::query(base + i, "api.example.com");
                    let f = udp(GUEST_MAC, GATEWAY_MAC, GUEST_IP, WORLD_IP, base + i, 53, &q);
                    testrun::run(&progs["from_cube"], &f, ctx, 1).unwrap().verdict == TC_ACT_REDIRECT
                })
                .count()
        })
        .unwrap()
}

/// The DNS tests' policy: the world host by CIDR (its name server) and `api.example.com` on
/// every port by name, nothing else.
fn world_and_api_policy() -> cubevs::EgressPolicy {
    cubevs::EgressPolicy {
        allow_internet_access: false,
        allow_out: vec![format!("{}/32", Ipv4Addr::from(cubenet_tests::topology::WORLD_IP))],
        allow_fqdn: vec![cubevs::policy::FqdnAllow { name: "api.example.com".into(), ports: vec![] }],
        ..Default::default()
    }
}

/// Switching to an object older than the tracking floor (decision Q6) and rolling back
/// neither underflows nor drifts the DNS tracking counts: the older object's tracked queries
/// are unmarked (`_pad` 0) and never subtracted, and after each step the node count equals
/// the charged queries in the map.
#[test]
fn tracking_counts_survive_switch_to_older_object_and_rollback() {
    if !require_root("tracking_counts_survive_switch_to_older_object_and_rollback") {
        return;
    }
    use cubevs::track_floor::KIND_DNS_QUERY;
    use cubevs_common::track::DNS_CHARGED;
    let n = setup();
    let pin = n.pin_dir();
    let maps = n.dp.as_ref().unwrap().maps();
    let sb = n.veth.node_ifindex;
    maps.policy.replace(sb, &world_and_api_policy()).expect("dns policy");
    let node = |m: &cubevs::Maps| m.track.state(KIND_DNS_QUERY).unwrap();
    let queries = |m: &cubevs::Maps| m.policy.dns_queries(Some(sb));
    let charged = |m: &cubevs::Maps| queries(m).iter().filter(|(_, v)| v._pad == DNS_CHARGED).count() as i64;
    assert_eq!(queries_through_slot(&n, 0, 41_000, 3), 3);
    assert_eq!(queries(&maps).len(), 3);
    assert_eq!(node(&maps).node.live(), 3);
    assert_eq!(charged(&maps), 3);

    // Switch to the older object (no track maps: loaded as the standby all the same); its
    // queries are tracked unmarked and charged to nothing.
    assert_eq!(slots::load_standby(&pin, &q3_object()).expect("load the older object").slot, 1);
    assert_eq!(slots::switch(&pin).expect("switch"), 1);
    assert_links_on(&pin, 1);
    assert_eq!(queries_through_slot(&n, 1, 42_000, 4), 4);
    assert_eq!(queries(&maps).len(), 7, "the older object tracks too");
    assert_eq!(charged(&maps), 3, "its queries are unmarked");
    assert_eq!(node(&maps).node.opened, 3, "the older object never adds");

    // Roll back to the floor's object, which tracks more; then every query expires.
    assert_eq!(slots::rollback(&pin).expect("rollback"), 0);
    assert_links_on(&pin, 0);
    assert_eq!(queries_through_slot(&n, 0, 43_000, 2), 2);
    assert_eq!(node(&maps).node.live(), 5);
    assert_eq!(node(&maps).node.live(), charged(&maps));
    let r = maps.policy.reap_dns(u64::MAX).expect("reap");
    assert_eq!(r.queries, 9);
    let st = node(&maps);
    assert_eq!((st.node.opened, st.node.closed), (5, 5), "only charged queries subtracted: no underflow");
    let u = maps.track.usage(sb, 1, KIND_DNS_QUERY).unwrap().expect("charged");
    assert_eq!(u.live(), 0);
    // The ceiling is the one the registrations give (one sandbox).
    let cpus = cubevs::quota::floor_margin();
    assert_eq!((st.floor, st.ceiling), (4, cubevs::quota::floor_ceiling(1 << 16, 1, 4, cpus)));
}

/// Switching to an object older than the learned floor (decision R66) and rolling back neither
/// underflows nor drifts the learned counts: the older object's learned entries are unmarked
/// (`LearnedValue::flags` bits 8–15 are 0) and never subtracted, the pinned `learned_*` maps it
/// lacks are kept for the rollback, and after each step the node count equals the charged
/// entries in the map.
#[test]
fn learned_counts_survive_switch_to_older_object_and_rollback() {
    if !require_root("learned_counts_survive_switch_to_older_object_and_rollback") {
        return;
    }
    use cubevs::testrun::TC_ACT_REDIRECT;
    use cubevs_common::learned_floor::is_charged;
    let n = setup();
    let pin = n.pin_dir();
    let maps = n.dp.as_ref().unwrap().maps();
    let sb = n.veth.node_ifindex;
    maps.policy.replace(sb, &world_and_api_policy()).expect("dns policy");
    let lf = maps.track.learned().expect("learned floor");
    let node = || lf.state().unwrap().node;
    // Charged entries, read from the map itself.
    let handle: aya::maps::HashMap<_, cubevs_common::dns::LearnedKey, cubevs_common::dns::LearnedValue> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(
            aya::maps::MapData::from_pin(pin.join("maps").join(cubevs_common::map::DNS_LEARNED)).unwrap(),
        ))
        .unwrap();
    let charged = |h: &aya::maps::HashMap<_, cubevs_common::dns::LearnedKey, cubevs_common::dns::LearnedValue>| {
        h.iter().filter(|e| is_charged(e.as_ref().unwrap().1.flags)).count() as i64
    };
    let learn = |slot: usize, i: u16| {
        let v = dns_through_slot(&n, slot, 45_000 + i, 0x300 + i, [203, 0, 113, 20 + i as u8]);
        assert_eq!(v, (TC_ACT_REDIRECT, TC_ACT_REDIRECT), "answer {i} through slot {slot}");
    };
    learn(0, 0);
    learn(0, 1);
    assert_eq!(maps.policy.learned(Some(sb)).len(), 2);
    assert_eq!((node().live(), charged(&handle)), (2, 2));

    // Switch to the older object (no learned_* maps: loaded as the standby all the same); its
    // entries are learned unmarked and charged to nothing.
    assert_eq!(slots::load_standby(&pin, &q3_object()).expect("load the older object").slot, 1);
    assert_eq!(slots::switch(&pin).expect("switch"), 1);
    assert_links_on(&pin, 1);
    learn(1, 2);
    learn(1, 3);
    assert_eq!(maps.policy.learned(Some(sb)).len(), 4, "the older object learns too");
    assert_eq!(charged(&handle), 2, "its entries are unmarked");
    assert_eq!(node().opened, 2, "the older object never adds");

    // Roll back to the floor's object, which learns more; then every entry expires.
    assert_eq!(slots::rollback(&pin).expect("rollback"), 0);
    assert_links_on(&pin, 0);
    learn(0, 4);
    assert_eq!((node().live(), charged(&handle)), (3, 3));
    let r = maps.policy.reap_dns(u64::MAX).expect("reap");
    assert_eq!(r.learned, 5);
    let st = lf.state().unwrap();
    assert_eq!((st.node.opened, st.node.closed), (3, 3), "only charged entries subtracted: no underflow");
    assert_eq!(lf.usage(sb, 1).unwrap().expect("charged").live(), 0);
    // The ceiling is the one the registrations give (one sandbox).
    let cpus = cubevs::quota::floor_margin();
    assert_eq!((st.floor, st.ceiling), (8, cubevs::quota::floor_ceiling(1 << 18, 1, 8, cpus)));
}
