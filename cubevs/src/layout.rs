//! Map-layout versioning and the slot metadata pinned beside the maps.
//!
//! `<pin_dir>/meta` is a one-entry `BPF_MAP_TYPE_ARRAY` (key `u32` 0, value [`META_SIZE`]
//! bytes, created from userspace; bpffs holds no regular files) with [`Meta`]: the layout
//! version of the pinned maps, the active and pending slots, the [`DatapathConfig`] every
//! slot is loaded with, and per slot the object's sha256, loader version and self-test
//! result. Before any pinned map is reused, [`check_pins`] compares it with the object
//! (type, key size, value size, max_entries, flags) and the recorded layout version with
//! [`LAYOUT_VERSION`]; anything else is refused with [`Error::IncompatiblePin`].

use std::{
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use aya::maps::MapInfo;
use cubevs_common::{DatapathConfig, map};

use crate::{Error, bpf_sys};

/// Version of the pinned map layout this library reads and writes. Bump it when a map's
/// key/value struct changes meaning without changing size; maps pinned under another
/// version are refused (migrate them first, see [`crate::slots::migrate_map`]).
pub const LAYOUT_VERSION: u32 = 1;

/// Size of the metadata value in bytes.
pub const META_SIZE: usize = 512;
const MAGIC: u32 = u32::from_be_bytes(*b"CBVS");
const SLOT_OFF: [usize; 2] = [48, 248];
const NONE: u32 = u32::MAX;

/// Self-test outcome recorded per slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SelfTestState {
    /// Never run (slot empty).
    #[default]
    None,
    /// Every canned packet gave the expected verdict and bytes.
    Passed,
    /// At least one canned packet did not.
    Failed,
}

impl SelfTestState {
    fn code(self) -> u32 {
        match self {
            Self::None => 0,
            Self::Passed => 1,
            Self::Failed => 2,
        }
    }
    fn from_code(c: u32) -> Self {
        match c {
            1 => Self::Passed,
            2 => Self::Failed,
            _ => Self::None,
        }
    }
    /// `none`, `passed` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Passed => "passed",
            Self::Failed => "failed",
        }
    }
}

/// What is recorded about one slot (bytes 48.. and 248.. of the value, 200 bytes each:
/// sha256 32, version 32, self-test u32, pad u32, loaded_at u64, object path 120).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotRecord {
    /// sha256 of the object file.
    pub sha256: [u8; 32],
    /// Version of the loader (`cubevs` crate) that filled the slot, ≤ 32 bytes.
    pub version: String,
    /// Self-test outcome.
    pub selftest: SelfTestState,
    /// Load time, seconds since the Unix epoch.
    pub loaded_at: u64,
    /// Object path as given to `load` (truncated to 120 bytes).
    pub object: String,
}

/// Decoded metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Layout version of the pinned maps.
    pub layout: u32,
    /// Slot whose programs the links run (0 = `a`, 1 = `b`), `None` before the first load.
    pub active: Option<usize>,
    /// Slot loaded and self-tested but not yet switched to.
    pub pending: Option<usize>,
    /// `CONFIG` written into every slot's object.
    pub config: DatapathConfig,
    /// Per slot.
    pub slots: [SlotRecord; 2],
}

fn put_str(buf: &mut [u8], s: &str) {
    let b = s.as_bytes();
    let n = b.len().min(buf.len());
    buf[..n].copy_from_slice(&b[..n]);
}

fn get_str(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

fn opt(v: u32) -> Option<usize> {
    (v != NONE).then_some(v as usize)
}

impl Meta {
    /// Fresh metadata for `config` at [`LAYOUT_VERSION`], no slot loaded.
    pub fn new(config: DatapathConfig) -> Self {
        Self { layout: LAYOUT_VERSION, active: None, pending: None, config, slots: Default::default() }
    }

    fn encode(&self) -> [u8; META_SIZE] {
        let mut b = [0u8; META_SIZE];
        b[0..4].copy_from_slice(&MAGIC.to_ne_bytes());
        b[4..8].copy_from_slice(&self.layout.to_ne_bytes());
        b[8..12].copy_from_slice(&self.active.map_or(NONE, |s| s as u32).to_ne_bytes());
        b[12..16].copy_from_slice(&self.pending.map_or(NONE, |s| s as u32).to_ne_bytes());
        let c = &self.config;
        b[16..20].copy_from_slice(&c.mvm_inner_ip.to_ne_bytes());
        b[20..24].copy_from_slice(&c.mvm_gateway_ip.to_ne_bytes());
        b[24..30].copy_from_slice(&c.mvm_mac);
        b[30..36].copy_from_slice(&c.gateway_mac);
        b[36..40].copy_from_slice(&c.session_budget.to_ne_bytes());
        for (slot, &off) in self.slots.iter().zip(&SLOT_OFF) {
            b[off..off + 32].copy_from_slice(&slot.sha256);
            put_str(&mut b[off + 32..off + 64], &slot.version);
            b[off + 64..off + 68].copy_from_slice(&slot.selftest.code().to_ne_bytes());
            b[off + 72..off + 80].copy_from_slice(&slot.loaded_at.to_ne_bytes());
            put_str(&mut b[off + 80..off + 200], &slot.object);
        }
        b
    }

    fn decode(b: &[u8; META_SIZE], path: &Path) -> Result<Self, Error> {
        if u32_at(b, 0) != MAGIC {
            return Err(Error::IncompatiblePin {
                path: path.to_path_buf(),
                reason: "metadata has no CBVS magic: unknown layout, refusing to reuse these pins".into(),
            });
        }
        let mut config = DatapathConfig::DEFAULT;
        config.mvm_inner_ip = u32_at(b, 16);
        config.mvm_gateway_ip = u32_at(b, 20);
        config.mvm_mac.copy_from_slice(&b[24..30]);
        config.gateway_mac.copy_from_slice(&b[30..36]);
        // Zero in metadata written before the quota existed: no budget, so a load with one
        // differs from the recorded configuration and switches in a self-tested slot.
        config.session_budget = u32_at(b, 36);
        let slots = SLOT_OFF.map(|off| SlotRecord {
            sha256: b[off..off + 32].try_into().expect("32 bytes"),
            version: get_str(&b[off + 32..off + 64]),
            selftest: SelfTestState::from_code(u32_at(b, off + 64)),
            loaded_at: u64::from_ne_bytes(b[off + 72..off + 80].try_into().expect("8 bytes")),
            object: get_str(&b[off + 80..off + 200]),
        });
        Ok(Self { layout: u32_at(b, 4), active: opt(u32_at(b, 8)), pending: opt(u32_at(b, 12)), config, slots })
    }
}

/// Path of the metadata map under `pin_dir`.
pub fn meta_path(pin_dir: &Path) -> PathBuf {
    pin_dir.join("meta")
}

/// Reads the metadata; `Ok(None)` when no metadata is pinned. Errors when it is unreadable,
/// has no magic, or records a layout version other than [`LAYOUT_VERSION`].
pub fn read_meta(pin_dir: &Path) -> Result<Option<Meta>, Error> {
    let path = meta_path(pin_dir);
    if !path.exists() {
        return Ok(None);
    }
    let pin_err = |what: &str, source| Error::Pin { what: format!("{what} {}", path.display()), source };
    let fd = bpf_sys::obj_get(&path).map_err(|e| pin_err("open", e))?;
    let info = MapInfo::from_pin(&path)
        .map_err(|e| Error::IncompatiblePin { path: path.clone(), reason: format!("cannot read map info: {e}") })?;
    if info.value_size() as usize != META_SIZE || info.key_size() != 4 {
        return Err(Error::IncompatiblePin {
            path,
            reason: format!("metadata value is {} B, expected {META_SIZE} B: unknown layout", info.value_size()),
        });
    }
    let mut b = [0u8; META_SIZE];
    bpf_sys::map_lookup(fd.as_raw_fd(), &0u32.to_ne_bytes(), &mut b).map_err(|e| pin_err("read", e))?;
    let meta = Meta::decode(&b, &path)?;
    if meta.layout != LAYOUT_VERSION {
        return Err(Error::IncompatiblePin {
            path,
            reason: format!(
                "pinned maps have layout version {}, this cubevs knows only version {LAYOUT_VERSION}: \
                 refusing to reuse them (migrate the maps or remove the pin directory)",
                meta.layout
            ),
        });
    }
    Ok(Some(meta))
}

/// Writes `meta`, creating and pinning the metadata map on first use.
pub fn write_meta(pin_dir: &Path, meta: &Meta) -> Result<(), Error> {
    write_raw(pin_dir, &meta.encode())
}

/// Writes a raw metadata value (tests use it to plant an unknown layout version).
pub fn write_raw(pin_dir: &Path, value: &[u8; META_SIZE]) -> Result<(), Error> {
    let path = meta_path(pin_dir);
    let pin_err = |what: &str, source| Error::Pin { what: format!("{what} {}", path.display()), source };
    let fd = if path.exists() {
        bpf_sys::obj_get(&path).map_err(|e| pin_err("open", e))?
    } else {
        let fd = bpf_sys::map_create(bpf_sys::MAP_TYPE_ARRAY, 4, META_SIZE as u32, 1, 0, "cubevs_meta")
            .map_err(|e| pin_err("create", e))?;
        bpf_sys::obj_pin(fd.as_raw_fd(), &path).map_err(|e| pin_err("pin", e))?;
        fd
    };
    bpf_sys::map_update(fd.as_raw_fd(), &0u32.to_ne_bytes(), value, 0).map_err(|e| pin_err("write", e))
}

/// Compares every map pinned in `dir` with the object's definition: type, key size, value
/// size, flags, and max_entries against `want_max(name)` when it returns `Some`. A pin of a
/// map in `cubevs_common::map::OPTIONAL` that the object lacks is skipped (an older object). Returns
/// the pinned max_entries of each existing pin (the loader must create nothing bigger).
///
/// Errors: [`Error::IncompatiblePin`] naming the map and what differs.
pub fn check_pins(
    object: &[u8],
    dir: &Path,
    want_max: impl Fn(&str) -> Option<u32>,
) -> Result<Vec<(&'static str, u32)>, Error> {
    let obj = aya_obj::Object::parse(object)
        .map_err(|e| Error::IncompatiblePin { path: dir.to_path_buf(), reason: format!("cannot parse object: {e}") })?;
    let mut pinned = Vec::new();
    for &name in map::ALL {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let Some(m) = obj.maps.get(name) else {
            // An object older than a map runs without it (a rollback target loaded as the
            // standby); userspace keeps maintaining the pin for the newer slots.
            if map::OPTIONAL.contains(&name) {
                continue;
            }
            return Err(Error::IncompatiblePin { path, reason: "the object has no map of this name".into() });
        };
        let info = MapInfo::from_pin(&path)
            .map_err(|e| Error::IncompatiblePin { path: path.clone(), reason: format!("cannot read map info: {e}") })?;
        let have_type = info.map_type().map(|t| t as u32).unwrap_or(u32::MAX);
        let have = (have_type, info.key_size(), info.value_size(), info.map_flags());
        let want = (m.map_type(), m.key_size(), m.value_size(), m.map_flags());
        if have != want {
            return Err(Error::IncompatiblePin {
                path,
                reason: format!(
                    "pinned (type {}, key {} B, value {} B, flags {:#x}) vs object (type {}, key {} B, value {} B, \
                     flags {:#x})",
                    have.0, have.1, have.2, have.3, want.0, want.1, want.2, want.3
                ),
            });
        }
        if let Some(max) = want_max(name)
            && max != info.max_entries()
        {
            return Err(Error::IncompatiblePin {
                path,
                reason: format!(
                    "pinned max_entries {} vs requested {max}: a size change needs a migration \
                     (cubevs::slots::migrate_map) before the new size is used",
                    info.max_entries()
                ),
            });
        }
        pinned.push((name, info.max_entries()));
    }
    Ok(pinned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Meta {
        let mut config = DatapathConfig::DEFAULT;
        config.gateway_mac = [2, 4, 6, 8, 10, 12];
        // A budget that is neither the default nor 0: the round trip must keep it.
        config.session_budget = 777;
        let mut m = Meta::new(config);
        m.active = Some(1);
        m.pending = None;
        m.slots[1] = SlotRecord {
            sha256: [0xab; 32],
            version: "0.1.0".into(),
            selftest: SelfTestState::Passed,
            loaded_at: 1_700_000_000,
            object: "/opt/cubenet/cubevs.bpf.o".into(),
        };
        m.slots[0].selftest = SelfTestState::Failed;
        m
    }

    #[test]
    fn metadata_round_trips() {
        let m = sample();
        assert_eq!(Meta::decode(&m.encode(), Path::new("meta")).unwrap(), m);
        let fresh = Meta::new(DatapathConfig::DEFAULT);
        let back = Meta::decode(&fresh.encode(), Path::new("meta")).unwrap();
        assert_eq!((back.active, back.pending, back.layout), (None, None, LAYOUT_VERSION));
    }

    #[test]
    fn metadata_without_magic_is_an_unknown_layout() {
        let mut b = sample().encode();
        b[0] ^= 0xff;
        let e = Meta::decode(&b, Path::new("/sys/fs/bpf/cubevs/meta")).unwrap_err();
        assert!(matches!(e, Error::IncompatiblePin { .. }), "{e}");
        assert!(e.to_string().contains("unknown layout"), "{e}");
    }

    #[test]
    fn long_strings_are_truncated_to_their_fields() {
        let mut m = sample();
        m.slots[1].version = "v".repeat(40);
        m.slots[1].object = "o".repeat(200);
        let back = Meta::decode(&m.encode(), Path::new("meta")).unwrap();
        assert_eq!(back.slots[1].version.len(), 32);
        assert_eq!(back.slots[1].object.len(), 120);
        assert_eq!(back.slots[1].sha256, [0xab; 32]);
    }
}
