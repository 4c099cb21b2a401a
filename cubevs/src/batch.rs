//! Batched map reads, updates and deletes (`BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_UPDATE_BATCH`,
//! `BPF_MAP_DELETE_BATCH`).
//!
//! Own code rather than aya's: aya 0.14 has no batch API, and iterating a 1M-entry session map
//! one `get_next_key` + `lookup` pair at a time takes seconds (two syscalls per entry). These
//! two commands move thousands of entries per syscall.

use std::os::fd::{AsRawFd, BorrowedFd};

use aya::Pod;

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// The `batch` member of `union bpf_attr` (UAPI `<linux/bpf.h>`).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> std::io::Result<()> {
    // SAFETY: `attr` is a valid bpf_attr prefix for the batch commands and lives for the call.
    let r =
        unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut BatchAttr, std::mem::size_of::<BatchAttr>() as u32) };
    if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// Reads every (key, value) of the hash map `fd`, `chunk` entries per syscall.
///
/// Errors: the kernel's (`EINVAL` on kernels or map types without batch support, < 5.6).
pub fn lookup_all<K: Pod, V: Pod>(fd: BorrowedFd<'_>, chunk: usize) -> std::io::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for_each(fd, chunk, |k: &K, v: &V| out.push((*k, *v)))?;
    Ok(out)
}

/// Calls `f` on every (key, value) of the hash map `fd`, reading `chunk` entries per syscall
/// into one reused buffer (memory: one chunk, whatever the map's size).
///
/// Errors: as [`lookup_all`].
pub fn for_each<K: Pod, V: Pod>(fd: BorrowedFd<'_>, chunk: usize, mut f: impl FnMut(&K, &V)) -> std::io::Result<()> {
    // SAFETY: Pod types are valid for all-zero bytes.
    let (zk, zv): (K, V) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    let mut keys = vec![zk; chunk];
    let mut values = vec![zv; chunk];
    // Hash-map batch tokens are u32 bucket indexes.
    let (mut in_tok, mut out_tok) = (0u32, 0u32);
    let mut first = true;
    loop {
        let mut a = BatchAttr {
            in_batch: if first { 0 } else { &mut in_tok as *mut u32 as u64 },
            out_batch: &mut out_tok as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        let r = bpf(BPF_MAP_LOOKUP_BATCH, &mut a);
        let n = a.count as usize;
        for (k, v) in keys[..n].iter().zip(values[..n].iter()) {
            f(k, v);
        }
        match r {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(e),
        }
        in_tok = out_tok;
        first = false;
    }
}

/// Deletes `keys` from the map `fd`; returns how many were deleted. Missing keys stop a batch
/// with `ENOENT`, so the rest is retried one chunk further.
pub fn delete<K: Pod>(fd: BorrowedFd<'_>, keys: &[K], chunk: usize) -> std::io::Result<usize> {
    let mut n = 0;
    delete_with(fd, keys, chunk, |_| n += 1)?;
    Ok(n)
}

/// [`delete`], calling `deleted(i)` for each index `i` of `keys` that this call removed (a key
/// already gone is skipped: `BPF_MAP_DELETE_BATCH` stops at it with `ENOENT` after deleting
/// exactly the keys before it, so the caller knows which deletes were its own).
pub fn delete_with<K: Pod>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    chunk: usize,
    mut deleted: impl FnMut(usize),
) -> std::io::Result<()> {
    let mut at = 0;
    while at < keys.len() {
        let n = (keys.len() - at).min(chunk);
        let mut a = BatchAttr {
            keys: keys[at..].as_ptr() as u64,
            count: n as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        let r = bpf(BPF_MAP_DELETE_BATCH, &mut a);
        let done = (a.count as usize).min(n);
        (at..at + done).for_each(&mut deleted);
        match r {
            Ok(()) => at += n,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => at += done + 1,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Inserts or overwrites `keys[i]` → `values[i]` in the map `fd`, `chunk` entries per syscall;
/// returns how many were written. Errors: the kernel's (`E2BIG` when the map is full).
pub fn update<K: Pod, V: Pod>(fd: BorrowedFd<'_>, keys: &[K], values: &[V], chunk: usize) -> std::io::Result<usize> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    let mut done = 0;
    while done < keys.len() {
        let n = (keys.len() - done).min(chunk);
        let mut a = BatchAttr {
            keys: keys[done..].as_ptr() as u64,
            values: values[done..].as_ptr() as u64,
            count: n as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        let r = bpf(BPF_MAP_UPDATE_BATCH, &mut a);
        done += a.count as usize;
        r?;
    }
    Ok(done)
}
