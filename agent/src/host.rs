//! Everything the agent does to the dataplane namespace's links, addresses, routes,
//! neighbours, sysctls and TAPs ("netlink HandleAt").
//!
//! [`NetnsHost`] owns a few [`NetnsThread`]s that entered `dataplane_netns`; each keeps its own
//! rtnetlink socket, opened **on that thread** (so bound to that namespace) on first use and
//! driven by a current-thread tokio runtime private to the thread. Work never runs on the
//! agent's tokio workers: callers hand closures to the threads (from async code through
//! `spawn_blocking`). TAP ioctls (`cubenet_sys::tap`) and `/proc/sys/net` writes also happen on
//! these threads, so they act on the dataplane namespace, never on the agent's.

use std::{
    cell::RefCell,
    io,
    net::{IpAddr, Ipv4Addr},
    os::fd::OwnedFd,
    rc::Rc,
    sync::atomic::{AtomicUsize, Ordering},
};

use cubenet_sys::{
    netns::{Netns, NetnsThread},
    tap::{Tap, TapOptions},
};
use futures::TryStreamExt;
use netlink_packet_route::{
    AddressFamily,
    address::AddressAttribute,
    link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo},
    neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState},
    route::{RouteAttribute, RouteProtocol, RouteScope},
};
use rtnetlink::{LinkMessageBuilder, LinkUnspec, RouteMessageBuilder};

use crate::config::Cidr;

/// A cube TAP found in the dataplane namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveTap {
    /// `z<ip>`.
    pub name: String,
    /// ifindex.
    pub ifindex: u32,
    /// The IP parsed from the name.
    pub ip: Ipv4Addr,
    /// `IFF_LOWER_UP`: some process holds a queue fd (a VMM, or an agent).
    pub lower_up: bool,
}

/// TAP name of a sandbox IP: `z` + dotted quad (`reference/upstream.md §2.3`).
pub fn tap_name(ip: Ipv4Addr) -> String {
    format!("z{ip}")
}

/// The IP of a cube TAP name, if it is one.
pub fn parse_tap_name(name: &str) -> Option<Ipv4Addr> {
    name.strip_prefix('z')?.parse().ok()
}

/// Time spent in each step of one TAP creation, in order (`tuntap`: `TUNSETIFF`, vnet header,
/// offloads and persist; `sysctl`: IPv6 off; `link`: MTU and up over netlink; `neighbour`:
/// the permanent neighbour on cube-dev). Exported as `cubenet_tap_create_phase_seconds`.
pub type Phases = Vec<(&'static str, std::time::Duration)>;

/// A TAP made by [`Host::create_tap`].
#[derive(Debug)]
pub struct NewTap {
    /// ifindex in the dataplane namespace.
    pub ifindex: u32,
    /// The agent's queue fd.
    pub fd: OwnedFd,
    /// Where the time went.
    pub phases: Phases,
}

/// Appends the time since `*t` as `phase` and restarts `*t`.
fn lap(phases: &mut Phases, t: &mut std::time::Instant, phase: &'static str) {
    let now = std::time::Instant::now();
    phases.push((phase, now - *t));
    *t = now;
}

/// TAP and device operations in the dataplane namespace. Blocking; thread-safe.
pub trait Host: Send + Sync {
    /// Creates (or attaches to a leftover) persistent pool TAP `z<ip>` with
    /// `IFF_TAP|IFF_NO_PI|IFF_VNET_HDR`, vnet header 12, CSUM/TSO4/TSO6 offloads, the MTU, up,
    /// IPv6 off, and a permanent neighbour `ip → mvm MAC` on cube-dev. Returns the ifindex,
    /// the queue fd and the time per step. `EBUSY` when another process holds the TAP.
    fn create_tap(&self, ip: Ipv4Addr) -> io::Result<NewTap>;
    /// Opens a queue fd on an existing TAP (`EBUSY` if held elsewhere: never retry that).
    fn reopen_tap(&self, name: &str) -> io::Result<OwnedFd>;
    /// Deletes the TAP and its neighbour entry (absent is fine).
    fn delete_tap(&self, name: &str) -> io::Result<()>;
    /// Every cube TAP (`z<ip>` TUN/TAP links) in the namespace.
    fn list_taps(&self) -> io::Result<Vec<LiveTap>>;
    /// Reads a file as seen from the dataplane namespace: `/proc/sys/net/…` shows the values
    /// of the namespace of the reading thread, so per-netns sysctls such as
    /// `ip_local_reserved_ports` must be read on a namespace thread, never the agent's own.
    fn read_netns_file(&self, path: &std::path::Path) -> io::Result<String>;
    /// Aborts every TCP socket of the dataplane namespace connected to one of `ips` (released
    /// sandboxes' mvm IPs, before their TAPs are reused: decision R72), one sock_diag dump per
    /// 256 addresses. Returns how many. Default: none (hosts without sockets of their own).
    fn abort_sockets_to(&self, ips: &[Ipv4Addr]) -> io::Result<usize> {
        let _ = ips;
        Ok(0)
    }
}

struct Nl {
    rt: tokio::runtime::Runtime,
    handle: rtnetlink::Handle,
}

thread_local! {
    static NL: RefCell<Option<Rc<Nl>>> = const { RefCell::new(None) };
}

/// This thread's netlink context, created in the thread's current netns on first use.
fn nl() -> io::Result<Rc<Nl>> {
    NL.with(|cell| {
        if let Some(n) = cell.borrow().as_ref() {
            return Ok(n.clone());
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = {
            let _g = rt.enter();
            let (conn, handle, _) = rtnetlink::new_connection()?;
            rt.spawn(conn);
            handle
        };
        let n = Rc::new(Nl { rt, handle });
        *cell.borrow_mut() = Some(n.clone());
        Ok(n)
    })
}

fn nlerr(what: impl std::fmt::Display) -> impl FnOnce(rtnetlink::Error) -> io::Error {
    let what = what.to_string();
    move |e| io::Error::other(format!("{what}: {e}"))
}

fn is_errno(e: &rtnetlink::Error, errno: i32) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -errno)
}

/// Parameters the host needs for TAPs and cube-dev.
#[derive(Clone, Debug)]
pub struct HostParams {
    /// TAP/cube-dev MTU.
    pub mtu: u32,
    /// Guest MAC (neighbour entries).
    pub mvm_mac: [u8; 6],
    /// cube-dev name.
    pub cube_dev: String,
}

/// The real [`Host`]: netns-bound worker threads with their own netlink sockets.
pub struct NetnsHost {
    threads: Vec<NetnsThread>,
    next: AtomicUsize,
    params: HostParams,
}

impl std::fmt::Debug for NetnsHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetnsHost").field("threads", &self.threads.len()).field("params", &self.params).finish()
    }
}

impl NetnsHost {
    /// Spawns `workers` threads inside `ns` (`None`: the agent's own namespace).
    pub fn new(ns: Option<&Netns>, workers: usize, params: HostParams) -> io::Result<Self> {
        let own;
        let ns = match ns {
            Some(n) => n,
            None => {
                own = Netns::current().map_err(io::Error::other)?;
                &own
            }
        };
        let threads = (0..workers.max(1))
            .map(|_| NetnsThread::spawn(ns).map_err(io::Error::other))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Self { threads, next: AtomicUsize::new(0), params })
    }

    /// Runs `f` on one of the namespace threads (round robin) and waits.
    pub fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> io::Result<R> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.threads.len();
        self.threads[i].run(f).map_err(io::Error::other)
    }

    /// Runs `f` on the first namespace thread (used for datapath attachment so it stays
    /// serialised with the loader).
    pub fn run_first<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> io::Result<R> {
        self.threads[0].run(f).map_err(io::Error::other)
    }

    /// Creates or reconciles cube-dev: a dummy (an ifb on kernels without dummy links) with the gateway MAC, txqlen 1000, the MTU,
    /// exactly the address `gw/prefix`, up, and the route `cidr dev cube-dev scope link proto
    /// static` (`reference/upstream.md §2.8`). Returns its ifindex.
    pub fn ensure_cube_dev(&self, gw_mac: [u8; 6], gw: Ipv4Addr, cidr: Cidr) -> io::Result<u32> {
        let p = self.params.clone();
        self.run_first(move || {
            let nl = nl()?;
            nl.rt.block_on(async {
                let h = &nl.handle;
                let idx = match cubenet_sys::ifindex(&p.cube_dev) {
                    Ok(i) => i,
                    Err(_) => {
                        let add = |kind: InfoKind| {
                            h.link()
                                .add(
                                    LinkMessageBuilder::<LinkUnspec>::new_with_info_kind(kind)
                                        .name(p.cube_dev.clone())
                                        .mtu(p.mtu)
                                        .address(gw_mac.to_vec())
                                        .txqueuelen(1000)
                                        .build(),
                                )
                                .execute()
                        };
                        match add(InfoKind::Dummy).await {
                            Ok(()) => {}
                            // Kernels built without CONFIG_DUMMY: an ifb is the same kind of
                            // sink device (carrier on, transmits nowhere by itself).
                            Err(e) if is_errno(&e, libc::EOPNOTSUPP) => {
                                tracing::warn!("kernel has no dummy links; creating {} as ifb", p.cube_dev);
                                add(InfoKind::Ifb).await.map_err(nlerr(format!("create ifb {}", p.cube_dev)))?
                            }
                            Err(e) => return Err(nlerr(format!("create dummy {}", p.cube_dev))(e)),
                        }
                        cubenet_sys::ifindex(&p.cube_dev)?
                    }
                };
                let link = h.link().get().match_index(idx).execute().try_next().await.map_err(nlerr("get cube-dev"))?;
                let is_dummy = link.as_ref().is_some_and(|l| {
                    l.attributes.iter().any(|a| {
                        matches!(a, LinkAttribute::LinkInfo(i) if i.iter().any(|x| matches!(x, LinkInfo::Kind(InfoKind::Dummy | InfoKind::Ifb))))
                    })
                });
                if !is_dummy {
                    return Err(io::Error::other(format!("{} exists and is not a dummy (or ifb) device", p.cube_dev)));
                }
                let mac_ok = link.as_ref().is_some_and(|l| {
                    l.attributes.iter().any(|a| matches!(a, LinkAttribute::Address(m) if m.as_slice() == gw_mac))
                });
                if !mac_ok {
                    h.link()
                        .set(LinkUnspec::new_with_index(idx).address(gw_mac.to_vec()).build())
                        .execute()
                        .await
                        .map_err(nlerr("set cube-dev MAC"))?;
                }
                h.link()
                    .set(LinkUnspec::new_with_index(idx).mtu(p.mtu).txqueuelen(1000).up().build())
                    .execute()
                    .await
                    .map_err(nlerr("configure cube-dev"))?;
                let mut have = false;
                let addrs: Vec<_> = h
                    .address()
                    .get()
                    .set_link_index_filter(idx)
                    .execute()
                    .try_collect()
                    .await
                    .map_err(nlerr("list cube-dev addresses"))?;
                for a in addrs {
                    let ip = a.attributes.iter().find_map(|x| match x {
                        AddressAttribute::Address(ip) => Some(*ip),
                        _ => None,
                    });
                    if ip == Some(IpAddr::V4(gw)) && a.header.prefix_len == cidr.prefix {
                        have = true;
                    } else if a.header.family == AddressFamily::Inet {
                        h.address().del(a).execute().await.map_err(nlerr("delete stray cube-dev address"))?;
                    }
                }
                if !have {
                    h.address()
                        .add(idx, IpAddr::V4(gw), cidr.prefix)
                        .execute()
                        .await
                        .map_err(nlerr("add cube-dev address"))?;
                }
                let route = RouteMessageBuilder::<Ipv4Addr>::new()
                    .destination_prefix(cidr.base, cidr.prefix)
                    .output_interface(idx)
                    .scope(RouteScope::Link)
                    .protocol(RouteProtocol::Static)
                    .build();
                h.route().add(route).replace().execute().await.map_err(nlerr(format!("route {cidr} dev cube-dev")))?;
                Ok(idx)
            })
        })?
    }

    /// The device of the lowest-metric IPv4 default route in the namespace.
    pub fn default_route_dev(&self) -> io::Result<Option<String>> {
        self.run_first(|| {
            let nl = nl()?;
            nl.rt.block_on(async {
                let routes: Vec<_> = nl
                    .handle
                    .route()
                    .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
                    .execute()
                    .try_collect()
                    .await
                    .map_err(nlerr("dump routes"))?;
                let best = routes
                    .iter()
                    .filter(|r| r.header.destination_prefix_length == 0 && r.header.table == 254)
                    .filter_map(|r| {
                        let oif = r.attributes.iter().find_map(|a| match a {
                            RouteAttribute::Oif(i) => Some(*i),
                            _ => None,
                        })?;
                        let prio = r
                            .attributes
                            .iter()
                            .find_map(|a| match a {
                                RouteAttribute::Priority(p) => Some(*p),
                                _ => None,
                            })
                            .unwrap_or(0);
                        Some((prio, oif))
                    })
                    .min();
                let Some((_, oif)) = best else { return Ok(None) };
                let link =
                    nl.handle.link().get().match_index(oif).execute().try_next().await.map_err(nlerr("get link"))?;
                Ok(link.and_then(|l| {
                    l.attributes.into_iter().find_map(|a| match a {
                        LinkAttribute::IfName(n) => Some(n),
                        _ => None,
                    })
                }))
            })
        })?
    }

    /// ifindex and IPv4 addresses of `name`.
    pub fn link_ipv4(&self, name: &str) -> io::Result<(u32, Vec<Ipv4Addr>)> {
        let name = name.to_string();
        self.run_first(move || {
            let idx = cubenet_sys::ifindex(&name)?;
            let nl = nl()?;
            nl.rt.block_on(async {
                let addrs: Vec<_> = nl
                    .handle
                    .address()
                    .get()
                    .set_link_index_filter(idx)
                    .execute()
                    .try_collect()
                    .await
                    .map_err(nlerr(format!("addresses of {name}")))?;
                let v4 = addrs
                    .iter()
                    .flat_map(|a| a.attributes.iter())
                    .filter_map(|a| match a {
                        AddressAttribute::Address(IpAddr::V4(ip)) => Some(*ip),
                        _ => None,
                    })
                    .collect::<std::collections::BTreeSet<_>>();
                Ok((idx, v4.into_iter().collect()))
            })
        })?
    }

    /// Writes a per-netns sysctl under `/proc/sys/net/` from a namespace thread (so it lands
    /// in the dataplane namespace). `key` is relative to `/proc/sys/net/`.
    pub fn netns_sysctl(&self, key: &str, value: &str) -> io::Result<()> {
        let (k, v) = (key.to_string(), value.to_string());
        self.run_first(move || std::fs::write(format!("/proc/sys/net/{k}"), v))?
    }
}

fn neighbour_msg(cube_idx: u32, ip: Ipv4Addr) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = AddressFamily::Inet;
    m.header.ifindex = cube_idx;
    m.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
    m
}

impl Host for NetnsHost {
    fn create_tap(&self, ip: Ipv4Addr) -> io::Result<NewTap> {
        let p = self.params.clone();
        self.run(move || {
            let mut phases = Phases::with_capacity(4);
            let mut t = std::time::Instant::now();
            let name = tap_name(ip);
            // Recovery adopted every TAP of ours and IPAM hands out only free addresses, so an
            // interface of this name is someone else's: TUNSETIFF would attach to a foreign
            // TAP (or fail on another kind), and cleaning up after that would delete it
            // (found by reliability_faults::tap_creation_collision; decision R6).
            if cubenet_sys::ifindex(&name).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("an interface named {name} already exists in the dataplane namespace (not this agent's)"),
                ));
            }
            let tap = Tap::open(&name, TapOptions::POOL)?;
            let mut set_up = || -> io::Result<u32> {
                let idx = cubenet_sys::ifindex(&name)?;
                lap(&mut phases, &mut t, "tuntap");
                // Per-netns sysctl of the TAP, written from this thread (dataplane netns).
                std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1")?;
                lap(&mut phases, &mut t, "sysctl");
                let cube_idx = cubenet_sys::ifindex(&p.cube_dev)?;
                let nl = nl()?;
                nl.rt.block_on(async {
                    nl.handle
                        .link()
                        .set(LinkUnspec::new_with_index(idx).mtu(p.mtu).up().build())
                        .execute()
                        .await
                        .map_err(nlerr(format!("set {name} up")))?;
                    lap(&mut phases, &mut t, "link");
                    nl.handle
                        .neighbours()
                        .add(cube_idx, IpAddr::V4(ip))
                        .link_layer_address(&p.mvm_mac)
                        .state(NeighbourState::Permanent)
                        .replace()
                        .execute()
                        .await
                        .map_err(nlerr(format!("neighbour {ip} on {}", p.cube_dev)))
                })?;
                lap(&mut phases, &mut t, "neighbour");
                Ok(idx)
            };
            match set_up() {
                Ok(idx) => Ok(NewTap { ifindex: idx, fd: tap.into_fd(), phases }),
                Err(e) => {
                    // Ours and half set up: not persistent any more, it vanishes with our fd.
                    let _ = tap.set_persist(false);
                    Err(e)
                }
            }
        })?
    }

    fn abort_sockets_to(&self, ips: &[Ipv4Addr]) -> io::Result<usize> {
        let ips = ips.to_vec();
        self.run(move || cubenet_sys::sock_abort::abort_tcp_to(&ips))?
    }

    fn reopen_tap(&self, name: &str) -> io::Result<OwnedFd> {
        let name = name.to_string();
        self.run(move || {
            cubenet_sys::ifindex(&name)?;
            Ok(Tap::open(&name, TapOptions::POOL)?.into_fd())
        })?
    }

    fn delete_tap(&self, name: &str) -> io::Result<()> {
        let name = name.to_string();
        let cube = self.params.cube_dev.clone();
        self.run(move || {
            let nl = nl()?;
            nl.rt.block_on(async {
                if let (Some(ip), Ok(cube_idx)) = (parse_tap_name(&name), cubenet_sys::ifindex(&cube)) {
                    match nl.handle.neighbours().del(neighbour_msg(cube_idx, ip)).execute().await {
                        Ok(()) => {}
                        Err(e) if is_errno(&e, libc::ENOENT) => {}
                        Err(e) => return Err(nlerr(format!("delete neighbour {ip}"))(e)),
                    }
                }
                let Ok(idx) = cubenet_sys::ifindex(&name) else { return Ok(()) };
                match nl.handle.link().del(idx).execute().await {
                    Ok(()) => Ok(()),
                    Err(e) if is_errno(&e, libc::ENODEV) => Ok(()),
                    Err(e) => Err(nlerr(format!("delete {name}"))(e)),
                }
            })
        })?
    }

    fn read_netns_file(&self, path: &std::path::Path) -> io::Result<String> {
        let p = path.to_path_buf();
        self.run_first(move || std::fs::read_to_string(p))?
    }

    fn list_taps(&self) -> io::Result<Vec<LiveTap>> {
        self.run_first(|| {
            let nl = nl()?;
            nl.rt.block_on(async {
                let links: Vec<_> =
                    nl.handle.link().get().execute().try_collect().await.map_err(nlerr("dump links"))?;
                let mut out = Vec::new();
                for l in links {
                    let name = l.attributes.iter().find_map(|a| match a {
                        LinkAttribute::IfName(n) => Some(n.clone()),
                        _ => None,
                    });
                    let is_tun = l.attributes.iter().any(|a| {
                        matches!(a, LinkAttribute::LinkInfo(i) if i.iter().any(|x| matches!(x, LinkInfo::Kind(InfoKind::Tun))))
                    });
                    if let Some(name) = name
                        && is_tun
                        && let Some(ip) = parse_tap_name(&name)
                    {
                        out.push(LiveTap {
                            name,
                            ifindex: l.header.index,
                            ip,
                            lower_up: l.header.flags.contains(LinkFlags::LowerUp),
                        });
                    }
                }
                out.sort_by_key(|t| t.ip);
                Ok(out)
            })
        })?
    }
}

/// In-memory [`Host`] for unit tests: TAP fds are `/dev/null` handles.
#[derive(Debug, Default)]
pub struct FakeHost {
    /// Live TAPs by name.
    pub taps: std::sync::Mutex<std::collections::BTreeMap<String, LiveTap>>,
    /// TAPs another process (a VMM) holds: reopening them fails with `EBUSY`.
    pub held: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Injected failure of every `delete_tap`.
    pub fail_delete: std::sync::atomic::AtomicBool,
    /// How long each `create_tap` takes (default none): a creation in flight for tests.
    pub create_delay: std::sync::Mutex<std::time::Duration>,
    next: AtomicUsize,
}

impl Host for FakeHost {
    fn create_tap(&self, ip: Ipv4Addr) -> io::Result<NewTap> {
        let delay = *self.create_delay.lock().unwrap();
        std::thread::sleep(delay);
        let name = tap_name(ip);
        let mut t = self.taps.lock().unwrap();
        let idx = t
            .entry(name.clone())
            .or_insert_with(|| LiveTap {
                name,
                ifindex: 1000 + self.next.fetch_add(1, Ordering::Relaxed) as u32,
                ip,
                lower_up: false,
            })
            .ifindex;
        Ok(NewTap { ifindex: idx, fd: std::fs::File::open("/dev/null")?.into(), phases: Phases::new() })
    }
    fn reopen_tap(&self, name: &str) -> io::Result<OwnedFd> {
        if !self.taps.lock().unwrap().contains_key(name) {
            return Err(io::Error::new(io::ErrorKind::NotFound, name.to_string()));
        }
        if self.held.lock().unwrap().contains(name) {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        Ok(std::fs::File::open("/dev/null")?.into())
    }
    fn delete_tap(&self, name: &str) -> io::Result<()> {
        if self.fail_delete.load(Ordering::Relaxed) {
            return Err(io::Error::other("injected delete failure"));
        }
        self.taps.lock().unwrap().remove(name);
        Ok(())
    }
    fn list_taps(&self) -> io::Result<Vec<LiveTap>> {
        Ok(self.taps.lock().unwrap().values().cloned().collect())
    }
    fn read_netns_file(&self, path: &std::path::Path) -> io::Result<String> {
        std::fs::read_to_string(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_round_trip() {
        let ip = Ipv4Addr::new(192, 168, 0, 2);
        assert_eq!(tap_name(ip), "z192.168.0.2");
        assert_eq!(parse_tap_name("z192.168.0.2"), Some(ip));
        assert_eq!(parse_tap_name("eth0"), None);
        assert_eq!(parse_tap_name("zfoo"), None);
    }
}
