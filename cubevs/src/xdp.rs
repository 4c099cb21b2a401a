//! The optional XDP fast path on the uplink (`xdp_world`, issue 15, decisions X1–X4):
//! attach/detach with a pinned bpf_link (`<pin_dir>/links/xdp_world_<mode>_<ifindex>`), so
//! it keeps forwarding across agent restarts like the tcx links and a restarted agent adopts
//! it instead of attaching twice. `from_world` (tcx) stays attached either way: XDP passes
//! everything it does not handle to it.

use std::{fmt, path::PathBuf, str::FromStr};

use aya::{
    Ebpf,
    programs::{
        Xdp, XdpMode as AyaXdpMode,
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
    },
};
use cubevs_common::prog;

use crate::{
    Error,
    datapath::{Datapath, ifindex, prog_err},
};

/// `xdp_mode` of the agent configuration: whether and how `xdp_world` is attached to the
/// uplink. Parsed from / shown as `off`, `generic`, `native`, `auto`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XdpMode {
    /// No XDP program (the default: see `docs/decisions.md` X4 and `cargo xtask bench xdp`).
    #[default]
    Off,
    /// Generic (skb) XDP: runs in the core stack after the skb is built; any device.
    Generic,
    /// Native (driver) XDP: fails when the uplink driver has no XDP support.
    Native,
    /// Native when the driver supports it, generic otherwise.
    Auto,
}

impl XdpMode {
    /// Every accepted spelling, for error messages.
    pub const NAMES: &'static str = "off, generic, native, auto";
}

impl FromStr for XdpMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(Self::Off),
            "generic" => Ok(Self::Generic),
            "native" => Ok(Self::Native),
            "auto" => Ok(Self::Auto),
            _ => Err(format!("unknown xdp_mode {s:?} (expected one of {})", Self::NAMES)),
        }
    }
}

impl fmt::Display for XdpMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Generic => "generic",
            Self::Native => "native",
            Self::Auto => "auto",
        })
    }
}

/// How `xdp_world` ended up attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpAttached {
    /// Generic (skb) mode.
    Generic,
    /// Native (driver) mode.
    Native,
}

impl XdpAttached {
    fn name(self) -> &'static str {
        match self {
            Self::Generic => "generic",
            Self::Native => "native",
        }
    }
    fn aya(self) -> AyaXdpMode {
        match self {
            Self::Generic => AyaXdpMode::Skb,
            Self::Native => AyaXdpMode::Driver,
        }
    }
}

/// The XDP program `name` of `ebpf` (one of `prog::XDP_ALL`).
pub(crate) fn xdp_named<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut Xdp, Error> {
    ebpf.program_mut(name).and_then(|p| <&mut Xdp>::try_from(p).ok()).ok_or(Error::Missing(name))
}

/// The `xdp_world` program of `ebpf`.
pub(crate) fn xdp_program(ebpf: &mut Ebpf) -> Result<&mut Xdp, Error> {
    xdp_named(ebpf, prog::XDP_WORLD)
}

impl Datapath {
    /// The loaded `xdp_world` program (for test runs and inspection).
    pub fn xdp_program(&mut self) -> Result<&mut Xdp, Error> {
        xdp_program(&mut self.ebpf)
    }

    /// The loaded XDP program `name` (`prog::XDP_ALL`: `xdp_world`, `baseline_xdp_pass`).
    pub fn xdp_program_named(&mut self, name: &'static str) -> Result<&mut Xdp, Error> {
        xdp_named(&mut self.ebpf, name)
    }

    fn xdp_pin(&self, m: XdpAttached, ifindex: u32) -> Option<PathBuf> {
        let name = format!("{}_{}_{ifindex}", prog::XDP_WORLD, m.name());
        self.opts.pin_dir.as_ref().map(|d| d.join("links").join(name))
    }

    /// Attaches `xdp_world` to the uplink `ifname` (resolved in the calling thread's netns)
    /// in `mode`; with [`XdpMode::Off`] detaches it instead. A pinned link of the requested
    /// mode (any mode for `Auto`) is adopted; one of another mode is replaced. Returns how it
    /// is attached (`None` for `Off`).
    ///
    /// Errors: [`Error::Program`] when the kernel refuses (e.g. `native` on a driver
    /// without XDP support), [`Error::Pin`] for pin failures.
    pub fn attach_uplink_xdp(&mut self, ifname: &str, mode: XdpMode) -> Result<Option<XdpAttached>, Error> {
        let idx = ifindex(ifname)?;
        let want: &[XdpAttached] = match mode {
            XdpMode::Off => {
                self.detach_uplink_xdp(ifname)?;
                return Ok(None);
            }
            XdpMode::Generic => &[XdpAttached::Generic],
            XdpMode::Native => &[XdpAttached::Native],
            XdpMode::Auto => &[XdpAttached::Native, XdpAttached::Generic],
        };
        if self.opts.pin_dir.is_some() {
            for &m in want {
                if let Some(pin) = self.xdp_pin(m, idx).filter(|p| p.exists()) {
                    self.refresh_xdp_link(&pin)?;
                    return Ok(Some(m));
                }
            }
        }
        // Another mode (or nothing) is attached: start from a clean device.
        self.detach_uplink_xdp(ifname)?;
        let mut last = None;
        for &m in want {
            match self.attach_xdp_as(idx, ifname, m) {
                Ok(()) => return Ok(Some(m)),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(Error::Missing(prog::XDP_WORLD)))
    }

    /// Makes the adopted link pinned at `pin` run this process's `xdp_world` (an upgraded
    /// object replaces the old program atomically, `bpf_link_update`), like the tcx links.
    fn refresh_xdp_link(&mut self, pin: &std::path::Path) -> Result<(), Error> {
        let what = format!("update {}", pin.display());
        let pe =
            |e: &dyn std::fmt::Display| Error::Pin { what: what.clone(), source: std::io::Error::other(e.to_string()) };
        let link = PinnedLink::from_pin(pin).map_err(|e| pe(&e))?;
        let fd: FdLink = link.into();
        let link = XdpLink::try_from(fd).map_err(|e| pe(&e))?;
        let p = xdp_program(&mut self.ebpf)?;
        let id = p.attach_to_link(link).map_err(prog_err(what.clone()))?;
        // Closing our fd leaves the pinned link (and its new program) in place.
        drop(p.take_link(id).map_err(prog_err(what.clone()))?);
        Ok(())
    }

    fn attach_xdp_as(&mut self, idx: u32, ifname: &str, m: XdpAttached) -> Result<(), Error> {
        let what = format!("attach {} ({}) to {ifname}", prog::XDP_WORLD, m.name());
        let pin = self.xdp_pin(m, idx);
        let p = xdp_program(&mut self.ebpf)?;
        let id = p.attach_to_if_index(idx, m.aya()).map_err(prog_err(what.clone()))?;
        let link = p.take_link(id).map_err(prog_err(what.clone()))?;
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
                self.owned_xdp.insert(idx, link);
            }
        }
        Ok(())
    }

    /// Detaches `xdp_world` from `ifname` (any mode) and removes its pins. Returns whether
    /// anything was attached.
    pub fn detach_uplink_xdp(&mut self, ifname: &str) -> Result<bool, Error> {
        let idx = ifindex(ifname)?;
        let mut found = self.owned_xdp.remove(&idx).is_some();
        for m in [XdpAttached::Generic, XdpAttached::Native] {
            if let Some(pin) = self.xdp_pin(m, idx)
                && pin.exists()
            {
                let link = PinnedLink::from_pin(&pin).map_err(|e| Error::Pin {
                    what: format!("open {}", pin.display()),
                    source: std::io::Error::other(e),
                })?;
                // Unpinning and dropping the last fd detaches the program.
                drop(link.unpin().map_err(|source| Error::Pin { what: format!("unpin {}", pin.display()), source })?);
                found = true;
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xdp_mode_round_trips_and_rejects_unknown_names() {
        for m in [XdpMode::Off, XdpMode::Generic, XdpMode::Native, XdpMode::Auto] {
            assert_eq!(m.to_string().parse::<XdpMode>(), Ok(m));
        }
        let e = "fast".parse::<XdpMode>().unwrap_err();
        assert!(e.contains("xdp_mode") && e.contains("fast"), "{e}");
        assert_eq!(XdpMode::default(), XdpMode::Off);
    }
}
