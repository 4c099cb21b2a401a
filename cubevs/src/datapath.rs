//! Loading the CubeVS object and attaching its programs.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    programs::{
        SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::SchedClassifierLink,
    },
};
use cubevs_common::{CONFIG_GLOBAL, DatapathConfig, OBJECT_FILE_NAME, prog};

use crate::Error;

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

/// How to load the datapath.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Path of the eBPF object (see [`default_object_path`]).
    pub object: PathBuf,
    /// Constants written into the object's `CONFIG` global.
    pub config: DatapathConfig,
    /// bpffs directory for pins (e.g. `/sys/fs/bpf/cubevs`); `None` keeps links owned by the
    /// process, so they detach when the [`Datapath`] is dropped.
    pub pin_dir: Option<PathBuf>,
}

impl LoadOptions {
    /// Default object path and configuration, no pinning.
    pub fn new() -> Self {
        Self { object: default_object_path(), config: DatapathConfig::DEFAULT, pin_dir: None }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self::new()
    }
}

/// A loaded CubeVS datapath.
pub struct Datapath {
    ebpf: Ebpf,
    opts: LoadOptions,
    /// Unpinned links, keyed by (program, ifindex); dropped (detached) with the datapath.
    owned_links: HashMap<(&'static str, u32), SchedClassifierLink>,
}

impl std::fmt::Debug for Datapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Datapath").field("opts", &self.opts).finish_non_exhaustive()
    }
}

fn prog_err(what: impl Into<String>) -> impl FnOnce(aya::programs::ProgramError) -> Error {
    let what = what.into();
    move |source| Error::Program { what, source: Box::new(source) }
}

impl Datapath {
    /// Reads the object, writes `opts.config` into `CONFIG`, and loads every program into the
    /// kernel (nothing is attached yet).
    ///
    /// Errors: [`Error::Object`] when the file is missing, [`Error::Load`] /
    /// [`Error::Program`] for kernel rejections (the verifier log is in the message).
    pub fn load(opts: LoadOptions) -> Result<Self, Error> {
        let bytes =
            std::fs::read(&opts.object).map_err(|source| Error::Object { path: opts.object.clone(), source })?;
        let mut ebpf = EbpfLoader::new()
            .override_global(CONFIG_GLOBAL, &opts.config, true)
            .load(&bytes)
            .map_err(|source| Error::Load { path: opts.object.clone(), source: Box::new(source) })?;
        for &name in prog::ALL {
            Self::classifier(&mut ebpf, name)?.load().map_err(prog_err(format!("load program {name}")))?;
        }
        if let Some(dir) = &opts.pin_dir {
            std::fs::create_dir_all(dir.join("links"))
                .map_err(|source| Error::Pin { what: format!("create {}", dir.display()), source })?;
        }
        Ok(Self { ebpf, opts, owned_links: HashMap::new() })
    }

    fn classifier<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut SchedClassifier, Error> {
        ebpf.program_mut(name).and_then(|p| <&mut SchedClassifier>::try_from(p).ok()).ok_or(Error::NoProgram(name))
    }

    /// The options this datapath was loaded with.
    pub fn options(&self) -> &LoadOptions {
        &self.opts
    }

    /// The loaded program `name` (for test runs and inspection).
    pub fn program(&mut self, name: &'static str) -> Result<&mut SchedClassifier, Error> {
        Self::classifier(&mut self.ebpf, name)
    }

    fn link_pin_path(&self, name: &str, ifindex: u32) -> Option<PathBuf> {
        self.opts.pin_dir.as_ref().map(|d| d.join("links").join(format!("{name}_{ifindex}")))
    }

    /// Attaches `from_cube` to the tcx ingress of the sandbox interface `ifname` (a TAP, or the
    /// node-side veth of a test guest), resolved in the calling thread's netns.
    ///
    /// With a pin directory the link is pinned at `<pin_dir>/links/from_cube_<ifindex>` and
    /// survives the process; attaching again to an interface that already has a pinned link
    /// is a no-op (the existing link is adopted, never attached twice). Returns the ifindex.
    pub fn attach_sandbox(&mut self, ifname: &str) -> Result<u32, Error> {
        self.attach(prog::FROM_CUBE, ifname, TcAttachType::Ingress)
    }

    /// Detaches `from_cube` from `ifname` and removes its pin, if any.
    pub fn detach_sandbox(&mut self, ifname: &str) -> Result<(), Error> {
        let ifindex = ifindex(ifname)?;
        self.owned_links.remove(&(prog::FROM_CUBE, ifindex));
        if let Some(pin) = self.link_pin_path(prog::FROM_CUBE, ifindex)
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

    fn attach(&mut self, name: &'static str, ifname: &str, kind: TcAttachType) -> Result<u32, Error> {
        let ifindex = ifindex(ifname)?;
        let pin = self.link_pin_path(name, ifindex);
        if let Some(pin) = &pin {
            if pin.exists() {
                return Ok(ifindex);
            }
        } else if self.owned_links.contains_key(&(name, ifindex)) {
            return Ok(ifindex);
        }
        let what = format!("attach {name} to tcx {kind:?} of {ifname}");
        let prog = Self::classifier(&mut self.ebpf, name)?;
        let id = prog.attach(ifname, kind).map_err(prog_err(what.clone()))?;
        let link = prog.take_link(id).map_err(prog_err(what.clone()))?;
        match pin {
            Some(pin) => {
                let fd_link: FdLink = link.try_into().map_err(|e| Error::Pin {
                    what: format!("{what}: not a bpf_link"),
                    source: std::io::Error::other(e),
                })?;
                fd_link.pin(&pin).map_err(|e| Error::Pin {
                    what: format!("pin {}", pin.display()),
                    source: std::io::Error::other(e),
                })?;
            }
            None => {
                self.owned_links.insert((name, ifindex), link);
            }
        }
        Ok(ifindex)
    }
}

/// Names of the programs attached to the tcx ingress of `ifname` (calling thread's netns), in
/// run order. Kernel program names are truncated to 15 bytes (`from_cube` fits).
pub fn tcx_ingress_programs(ifname: &str) -> Result<Vec<String>, Error> {
    let (_, infos) = SchedClassifier::query_tcx(ifname, TcAttachType::Ingress)
        .map_err(prog_err(format!("query tcx ingress of {ifname}")))?;
    Ok(infos.iter().map(|i| i.name_as_str().unwrap_or("?").to_string()).collect())
}

fn ifindex(name: &str) -> Result<u32, Error> {
    cubenet_sys::ifindex(name).map_err(|source| Error::Interface { name: name.to_string(), source })
}
