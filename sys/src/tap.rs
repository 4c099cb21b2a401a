//! TAP devices through `/dev/net/tun` ioctls.
//!
//! Own code rather than a crate: the TUN crates on crates.io do not expose persistence, the
//! vnet header size and `TUNSETOFFLOAD` together, and the ioctls are a handful of lines.
//! The device is created in (and its name resolved in) the calling thread's netns.

use std::{
    ffi::CStr,
    fs::{File, OpenOptions},
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::fs::OpenOptionsExt,
    },
};

/// `IFF_TAP`: Ethernet frames.
pub const IFF_TAP: libc::c_short = 0x0002;
/// `IFF_NO_PI`: no packet-information prefix.
pub const IFF_NO_PI: libc::c_short = 0x1000;
/// `IFF_ONE_QUEUE` (ignored by current kernels, kept for parity with upstream flags).
pub const IFF_ONE_QUEUE: libc::c_short = 0x2000;
/// `IFF_VNET_HDR`: every frame is prefixed by a `virtio_net_hdr`.
pub const IFF_VNET_HDR: libc::c_short = 0x4000;

/// `TUN_F_CSUM`: the reader accepts partial checksums.
pub const TUN_F_CSUM: libc::c_uint = 0x01;
/// `TUN_F_TSO4`: the reader accepts TSO over IPv4.
pub const TUN_F_TSO4: libc::c_uint = 0x02;
/// `TUN_F_TSO6`: the reader accepts TSO over IPv6.
pub const TUN_F_TSO6: libc::c_uint = 0x04;

/// Size of the legacy `virtio_net_hdr` (no `num_buffers`): 10 bytes.
pub const VNET_HDR_LEN_LEGACY: usize = 10;
/// Size of `virtio_net_hdr_mrg_rxbuf` / virtio 1.0 header: 12 bytes (what upstream configures).
pub const VNET_HDR_LEN: usize = 12;

// _IOW('T', n, int) and _IOR('T', n, unsigned int); from <linux/if_tun.h>.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNGETIFF: libc::c_ulong = 0x8004_54d2;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;

/// How to open a TAP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TapOptions {
    /// Prefix frames with a `virtio_net_hdr` of [`TapOptions::vnet_hdr_len`] bytes.
    pub vnet_hdr: bool,
    /// Size of that header (10 or 12); upstream uses 12.
    pub vnet_hdr_len: usize,
    /// `TUNSETOFFLOAD` flags (`TUN_F_*`); requires `vnet_hdr`.
    pub offload: libc::c_uint,
    /// Keep the device after the last fd closes.
    pub persist: bool,
}

impl TapOptions {
    /// The upstream pool configuration: vnet header 12, CSUM|TSO4|TSO6, persistent
    /// (`reference/upstream.md §2.3`).
    pub const POOL: Self = Self {
        vnet_hdr: true,
        vnet_hdr_len: VNET_HDR_LEN,
        offload: TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6,
        persist: true,
    };
    /// A plain, non-persistent TAP without vnet header (raw Ethernet frames).
    pub const PLAIN: Self = Self { vnet_hdr: false, vnet_hdr_len: 0, offload: 0, persist: false };
}

#[repr(C)]
struct IfReqFlags {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

const _: () = assert!(std::mem::size_of::<IfReqFlags>() == 40);

/// An open TAP queue fd.
#[derive(Debug)]
pub struct Tap {
    fd: OwnedFd,
    name: String,
}

fn ifreq(name: &str, flags: libc::c_short) -> io::Result<IfReqFlags> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', ' ', '\0']) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("invalid interface name {name:?}")));
    }
    let mut req = IfReqFlags { name: [0; libc::IFNAMSIZ], flags, _pad: [0; 22] };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    Ok(req)
}

fn check(ret: libc::c_int, what: &str) -> io::Result<()> {
    if ret < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

impl Tap {
    /// Creates the TAP `name` if missing, or attaches to it, with `opts`.
    ///
    /// Errors: `EBUSY` when another fd already holds this single-queue TAP (a VMM is using
    /// it; never treat that as stale, `reference/upstream.md §8.1`), `EINVAL` for a name of a
    /// non-TAP device, `EPERM` without `CAP_NET_ADMIN`.
    pub fn open(name: &str, opts: TapOptions) -> io::Result<Self> {
        let file: File =
            OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open("/dev/net/tun")?;
        let fd: OwnedFd = file.into();
        let mut flags = IFF_TAP | IFF_NO_PI | IFF_ONE_QUEUE;
        if opts.vnet_hdr {
            flags |= IFF_VNET_HDR;
        }
        let mut req = ifreq(name, flags)?;
        // SAFETY: TUNSETIFF reads/writes a struct ifreq, which `req` is laid out as.
        check(unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, &mut req) }, &format!("TUNSETIFF {name}"))?;
        // SAFETY: the kernel NUL-terminates ifr_name.
        let actual = unsafe { CStr::from_ptr(req.name.as_ptr()) }.to_string_lossy().into_owned();
        let tap = Self { fd, name: actual };
        if opts.vnet_hdr {
            let sz: libc::c_int = opts.vnet_hdr_len as libc::c_int;
            // SAFETY: TUNSETVNETHDRSZ reads an int.
            check(unsafe { libc::ioctl(tap.fd.as_raw_fd(), TUNSETVNETHDRSZ, &sz) }, "TUNSETVNETHDRSZ")?;
            // SAFETY: TUNSETOFFLOAD takes the flags by value.
            check(
                unsafe { libc::ioctl(tap.fd.as_raw_fd(), TUNSETOFFLOAD, opts.offload as libc::c_ulong) },
                "TUNSETOFFLOAD",
            )?;
        }
        tap.set_persist(opts.persist)?;
        Ok(tap)
    }

    /// Sets or clears `TUNSETPERSIST`. Clearing it makes the device vanish with its last fd.
    pub fn set_persist(&self, persist: bool) -> io::Result<()> {
        // SAFETY: TUNSETPERSIST takes an int by value.
        check(unsafe { libc::ioctl(self.fd.as_raw_fd(), TUNSETPERSIST, persist as libc::c_ulong) }, "TUNSETPERSIST")
    }

    /// Interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `IFF_*` flags of the attached device (`TUNGETIFF`).
    pub fn flags(&self) -> io::Result<libc::c_short> {
        let mut req = IfReqFlags { name: [0; libc::IFNAMSIZ], flags: 0, _pad: [0; 22] };
        // SAFETY: TUNGETIFF fills a struct ifreq.
        check(unsafe { libc::ioctl(self.fd.as_raw_fd(), TUNGETIFF, &mut req) }, "TUNGETIFF")?;
        Ok(req.flags)
    }

    /// Consumes the handle, returning the queue fd.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }
}

/// Name of the TAP a queue fd is attached to (`TUNGETIFF`), for checking fds received from
/// another process (agent hand-over) without reopening anything. Errors: `EBADFD` for a
/// detached queue, `EINVAL`/`ENOTTY` for an fd that is not a TUN/TAP queue.
pub fn attached_name(fd: BorrowedFd<'_>) -> io::Result<String> {
    let mut req = IfReqFlags { name: [0; libc::IFNAMSIZ], flags: 0, _pad: [0; 22] };
    // SAFETY: TUNGETIFF fills a struct ifreq, which `req` is laid out as.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), TUNGETIFF, &mut req) }, "TUNGETIFF")?;
    // SAFETY: the kernel NUL-terminates ifr_name (IFNAMSIZ includes the NUL).
    Ok(unsafe { CStr::from_ptr(req.name.as_ptr()) }.to_string_lossy().into_owned())
}

impl AsFd for Tap {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_names() {
        assert!(ifreq("", 0).is_err());
        assert!(ifreq("abcdefghijklmnop", 0).is_err());
        assert!(ifreq("a/b", 0).is_err());
        assert!(ifreq("z192.168.0.2", 0).is_ok());
    }
}
