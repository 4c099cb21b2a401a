//! Raw `bpf(2)` commands that aya 0.14 does not expose publicly: creating and pinning a
//! userspace map (the slot metadata), byte-level element access on any map (migration),
//! `BPF_MAP_LOOKUP_AND_DELETE_ELEM` on a hash map (the learned reaper's exact delete),
//! `BPF_PROG_QUERY` with link ids on a tcx hook (orphan detection) and detaching a link by
//! id (`BPF_LINK_GET_FD_BY_ID` + `BPF_LINK_DETACH`). Every `bpf_attr` is built in a
//! zeroed 128-byte buffer at the offsets of the UAPI union (`include/uapi/linux/bpf.h`).

use std::{
    ffi::CString,
    io,
    os::fd::{FromRawFd, OwnedFd, RawFd},
    path::Path,
};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_MAP_LOOKUP_AND_DELETE_ELEM: libc::c_long = 21;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `BPF_MAP_TYPE_ARRAY`.
pub(crate) const MAP_TYPE_ARRAY: u32 = 2;
/// `BPF_TCX_INGRESS`.
pub(crate) const TCX_INGRESS: u32 = 46;
/// `BPF_TCX_EGRESS`.
pub(crate) const TCX_EGRESS: u32 = 47;

#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Self {
        Self([0; 128])
    }
    fn u32(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, off: usize, v: u64) -> &mut Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn get_u32(&self, off: usize) -> u32 {
        u32::from_ne_bytes(self.0[off..off + 4].try_into().expect("4 bytes"))
    }
}

fn sys(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid 128-byte, 8-aligned buffer; pointers inside it refer to
    // buffers that outlive the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), attr.0.len() as libc::c_uint) };
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r) }
}

fn fd_result(r: libc::c_long) -> OwnedFd {
    // SAFETY: the kernel returned a new file descriptor that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(r as RawFd) }
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Creates a map (`name` ≤ 15 bytes) and returns its fd.
pub(crate) fn map_create(map_type: u32, key: u32, value: u32, max: u32, flags: u32, name: &str) -> io::Result<OwnedFd> {
    let mut a = Attr::new();
    a.u32(0, map_type).u32(4, key).u32(8, value).u32(12, max).u32(16, flags);
    let n = name.as_bytes();
    let len = n.len().min(15);
    a.0[28..28 + len].copy_from_slice(&n[..len]);
    sys(BPF_MAP_CREATE, &mut a).map(fd_result)
}

/// Pins `fd` (map, program or link) at `path` on a bpffs.
pub(crate) fn obj_pin(fd: RawFd, path: &Path) -> io::Result<()> {
    let p = cpath(path)?;
    let mut a = Attr::new();
    a.u64(0, p.as_ptr() as u64).u32(8, fd as u32);
    sys(BPF_OBJ_PIN, &mut a).map(drop)
}

/// Opens the object pinned at `path`.
pub(crate) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let p = cpath(path)?;
    let mut a = Attr::new();
    a.u64(0, p.as_ptr() as u64);
    sys(BPF_OBJ_GET, &mut a).map(fd_result)
}

/// Looks `key` up into `value` (sized for the map; per-CPU maps: `round_up(value, 8) * ncpus`).
/// `Ok(false)` when the key is absent.
pub(crate) fn map_lookup(fd: RawFd, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let mut a = Attr::new();
    a.u32(0, fd as u32).u64(8, key.as_ptr() as u64).u64(16, value.as_mut_ptr() as u64);
    match sys(BPF_MAP_LOOKUP_ELEM, &mut a) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Deletes `key` and copies the value it held into `value`, as one kernel operation (hash
/// maps: Linux 5.14+), so the caller knows exactly what its delete removed. `Ok(false)` when
/// the key is absent.
pub(crate) fn map_lookup_and_delete(fd: RawFd, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let mut a = Attr::new();
    a.u32(0, fd as u32).u64(8, key.as_ptr() as u64).u64(16, value.as_mut_ptr() as u64);
    match sys(BPF_MAP_LOOKUP_AND_DELETE_ELEM, &mut a) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Writes `key` → `value` with `flags` (`BPF_ANY` = 0).
pub(crate) fn map_update(fd: RawFd, key: &[u8], value: &[u8], flags: u64) -> io::Result<()> {
    let mut a = Attr::new();
    a.u32(0, fd as u32).u64(8, key.as_ptr() as u64).u64(16, value.as_ptr() as u64).u64(24, flags);
    sys(BPF_MAP_UPDATE_ELEM, &mut a).map(drop)
}

/// The key after `key` (`None`: the first key) into `next`; `Ok(false)` at the end.
pub(crate) fn map_next_key(fd: RawFd, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let mut a = Attr::new();
    a.u32(0, fd as u32).u64(8, key.map_or(0, |k| k.as_ptr() as u64)).u64(16, next.as_mut_ptr() as u64);
    match sys(BPF_MAP_GET_NEXT_KEY, &mut a) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Program ids and link ids attached to tcx hook `attach_type` of `ifindex` (calling
/// thread's netns), in run order. `link_ids[i]` is 0 for a program attached without a link.
pub(crate) fn tcx_query(ifindex: u32, attach_type: u32) -> io::Result<(Vec<u32>, Vec<u32>)> {
    let mut cap = 16usize;
    loop {
        let mut progs = vec![0u32; cap];
        let mut links = vec![0u32; cap];
        let mut a = Attr::new();
        a.u32(0, ifindex)
            .u32(4, attach_type)
            .u64(16, progs.as_mut_ptr() as u64)
            .u32(24, cap as u32)
            .u64(40, links.as_mut_ptr() as u64);
        match sys(BPF_PROG_QUERY, &mut a) {
            Ok(_) => {
                let n = a.get_u32(24) as usize;
                progs.truncate(n);
                links.truncate(n);
                return Ok((progs, links));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && cap < 4096 => cap *= 4,
            Err(e) => return Err(e),
        }
    }
}

/// Detaches the link with kernel id `link_id` (works on links nobody holds an fd or pin of
/// in this process; `PROG_DETACH` cannot detach links).
pub(crate) fn link_detach_by_id(link_id: u32) -> io::Result<()> {
    let mut a = Attr::new();
    a.u32(0, link_id);
    let fd = sys(BPF_LINK_GET_FD_BY_ID, &mut a).map(fd_result)?;
    let mut d = Attr::new();
    d.u32(0, std::os::fd::AsRawFd::as_raw_fd(&fd) as u32);
    sys(BPF_LINK_DETACH, &mut d).map(drop)
}
