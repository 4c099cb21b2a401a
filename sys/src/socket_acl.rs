//! Who may `connect(2)` to a Unix socket file: its owner only (mode 0600), or its owner plus
//! a list of other uids through a POSIX access ACL (`system.posix_acl_access`, as `setfacl -m
//! u:UID:rw`). Connecting needs write permission on the socket file; the file check keeps every
//! other user out before the server's SO_PEERCRED check ([`crate::peer_uid`]) even sees them
//! (decisions R40, R50).

// Own 8-byte-entry encoding rather than the `posix-acl` crate: that links libacl (C) for one
// fixed-format xattr written once per socket.
use std::{ffi::CString, io, os::unix::ffi::OsStrExt, path::Path};

/// `system.posix_acl_access`: the access ACL extended attribute.
const XATTR: &str = "system.posix_acl_access";
/// `POSIX_ACL_XATTR_VERSION` (`linux/posix_acl_xattr.h`).
const VERSION: u32 = 2;
/// Entry tags (`linux/posix_acl.h`).
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;
/// `ACL_UNDEFINED_ID`: the id of entries that name no user or group.
const NO_ID: u32 = u32::MAX;
/// Read + write (a socket needs write to connect; read is what `setfacl u:X:rw` gives).
const RW: u16 = 6;

/// How [`restrict`] left the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Mode 0600, no ACL: the owner only.
    OwnerOnly,
    /// Mode 0600 plus an ACL granting read/write to each listed uid (mask rw, group none).
    Acl,
    /// The filesystem has no POSIX ACLs: mode 0666, every local user may connect and only the
    /// server's SO_PEERCRED check refuses those not listed.
    WorldConnectable,
}

/// The `system.posix_acl_access` value granting `uids` read/write beside the owner: little-endian
/// header `{version: u32 = 2}` then 8-byte entries `{tag: u16, perm: u16, id: u32}` sorted by tag,
/// then id (the kernel refuses any other order); duplicates and the owner's own uid are kept
/// out by the caller.
pub fn acl_value(uids: &[u32]) -> Vec<u8> {
    let mut sorted: Vec<u32> = uids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut v = Vec::with_capacity(4 + 8 * (sorted.len() + 4));
    v.extend_from_slice(&VERSION.to_le_bytes());
    let mut entry = |tag: u16, perm: u16, id: u32| {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    };
    entry(USER_OBJ, RW, NO_ID);
    for u in sorted {
        entry(USER, RW, u);
    }
    entry(GROUP_OBJ, 0, NO_ID);
    entry(MASK, RW, NO_ID);
    entry(OTHER, 0, NO_ID);
    v
}

/// Makes the socket file `path` connectable by its owner and by `uids` only (the owner's own
/// uid in `uids` is ignored): mode 0600 and no ACL for an empty list, else mode 0600 plus an
/// access ACL (so `ls -l` shows 0660: the group bits show the ACL mask). On a filesystem
/// without POSIX ACLs (`EOPNOTSUPP`) the file becomes 0666 ([`Access::WorldConnectable`]).
/// Errors: the chmod or setxattr syscalls' errors (the path named by the caller).
pub fn restrict(path: &Path, uids: &[u32]) -> io::Result<Access> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let owner = std::fs::symlink_metadata(path)?.uid();
    let others: Vec<u32> = uids.iter().copied().filter(|u| *u != owner).collect();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let name = CString::new(XATTR).expect("static name");
    if others.is_empty() {
        // A socket handed over by a predecessor configured with a list keeps its ACL otherwise.
        // SAFETY: both strings are NUL-terminated and outlive the call.
        if unsafe { libc::lremovexattr(c.as_ptr(), name.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            if !matches!(e.raw_os_error(), Some(libc::ENODATA) | Some(libc::EOPNOTSUPP)) {
                return Err(e);
            }
        }
        // Removing an ACL leaves the mask as the group bits: 0600 again.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        return Ok(Access::OwnerOnly);
    }
    let value = acl_value(&others);
    // SAFETY: the strings are NUL-terminated, `value` is a valid buffer of its length.
    let r = unsafe { libc::lsetxattr(c.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if r == 0 {
        return Ok(Access::Acl);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
        return Ok(Access::WorldConnectable);
    }
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acl_entries_are_sorted_and_complete() {
        let v = acl_value(&[1001, 65534, 1001]);
        assert_eq!(v.len(), 4 + 8 * 6);
        assert_eq!(&v[..4], &[2, 0, 0, 0]);
        let tags: Vec<(u16, u16, u32)> = v[4..]
            .chunks(8)
            .map(|e| {
                (
                    u16::from_le_bytes([e[0], e[1]]),
                    u16::from_le_bytes([e[2], e[3]]),
                    u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
                )
            })
            .collect();
        assert_eq!(
            tags,
            [(1, 6, NO_ID), (2, 6, 1001), (2, 6, 65534), (4, 0, NO_ID), (0x10, 6, NO_ID), (0x20, 0, NO_ID)]
        );
    }

    #[test]
    fn a_socket_file_gets_the_acl_and_loses_it_again() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("cubenet-acl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("s.sock");
        let _l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let a = restrict(&p, &[65534]).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        match a {
            Access::Acl => assert_eq!(mode, 0o660, "the group bits show the ACL mask"),
            Access::WorldConnectable => assert_eq!(mode, 0o666),
            Access::OwnerOnly => panic!("a listed uid got no access"),
        }
        assert_eq!(restrict(&p, &[]).unwrap(), Access::OwnerOnly);
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
