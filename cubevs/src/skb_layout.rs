//! Where the running kernel keeps the `struct sk_buff` fields `from_cube` checks a guest's
//! checksum offload request with (decision R101): read from the kernel's BTF
//! (`/sys/kernel/btf/vmlinux`), written into the object's load-time global `SKB_LAYOUT`
//! ([`SkbLayout`]).
//!
//! A minimal BTF reader of our own: aya-obj parses BTF but keeps its types crate-private, and
//! btf-rs is LGPL (this crate links statically and is Apache-2.0). It reads only what this needs:
//! the header, the type table's records (to step over them) and struct/union members.

use std::{path::Path, sync::OnceLock};

use cubevs_common::SkbLayout;

/// The kernel's BTF, as every BPF loader finds it.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_INT: u32 = 1;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_TYPE_TAG: u32 = 18;

/// The running kernel's layout, read once per process from [`VMLINUX_BTF`].
///
/// Errors: the file is missing or unreadable (a kernel without `CONFIG_DEBUG_INFO_BTF`), or
/// its `sk_buff` lacks one of the fields or has it in an unexpected shape; the message says
/// which. The datapath refuses to load without it: the check it feeds is an isolation property.
pub fn running_kernel() -> Result<SkbLayout, String> {
    static LAYOUT: OnceLock<Result<SkbLayout, String>> = OnceLock::new();
    LAYOUT.get_or_init(|| from_file(Path::new(VMLINUX_BTF))).clone()
}

/// [`SkbLayout`] from the BTF file at `path` (see [`running_kernel`]).
pub fn from_file(path: &Path) -> Result<SkbLayout, String> {
    let raw = std::fs::read(path).map_err(|e| format!("read {}: {e}", path.display()))?;
    parse(&raw).map_err(|e| format!("{}: {e}", path.display()))
}

/// One member of a struct or union: name, type id, bit offset, bitfield size (0 = none).
#[derive(Clone, Copy)]
struct Member {
    name: u32,
    ty: u32,
    bit_offset: u32,
    bitfield: u32,
}

/// The parts of one BTF type this reader keeps.
enum Ty {
    Int {
        bits: u32,
    },
    Aggregate {
        name: u32,
        members: Vec<Member>,
    },
    /// typedef, const, volatile, restrict, type tag: refers on to another type.
    Alias(u32),
    Other,
}

struct Btf<'a> {
    strings: &'a [u8],
    /// Index = type id - 1.
    types: Vec<Ty>,
}

fn u32_at(b: &[u8], off: usize) -> Result<u32, String> {
    b.get(off..off + 4).map(|s| u32::from_le_bytes(s.try_into().unwrap())).ok_or_else(|| "truncated".to_string())
}

impl<'a> Btf<'a> {
    fn parse(raw: &'a [u8]) -> Result<Self, String> {
        if raw.len() < 24 || u16::from_le_bytes([raw[0], raw[1]]) != BTF_MAGIC {
            return Err("not little-endian BTF (bad magic)".into());
        }
        let hdr_len = u32_at(raw, 4)? as usize;
        let (type_off, type_len) = (u32_at(raw, 8)? as usize, u32_at(raw, 12)? as usize);
        let (str_off, str_len) = (u32_at(raw, 16)? as usize, u32_at(raw, 20)? as usize);
        let section = |off: usize, len: usize| {
            raw.get(hdr_len + off..hdr_len + off + len).ok_or_else(|| "section past the end".to_string())
        };
        let (table, strings) = (section(type_off, type_len)?, section(str_off, str_len)?);
        let mut types = Vec::new();
        let mut at = 0;
        while at < table.len() {
            let (name, info, size_or_type) = (u32_at(table, at)?, u32_at(table, at + 4)?, u32_at(table, at + 8)?);
            at += 12;
            let (vlen, kind, kflag) = ((info & 0xffff) as usize, (info >> 24) & 0x1f, info >> 31 == 1);
            // Bytes that follow the common record, per kind (include/uapi/linux/btf.h).
            let extra = match kind {
                1 | 14 | 17 => 4,          // INT, VAR, DECL_TAG
                3 => 12,                   // ARRAY
                4 | 5 | 15 => 12 * vlen,   // STRUCT, UNION, DATASEC
                6 | 13 => 8 * vlen,        // ENUM, FUNC_PROTO
                19 => 12 * vlen,           // ENUM64
                2 | 7..=12 | 16 | 18 => 0, // PTR, FWD, TYPEDEF…FUNC, FLOAT, TYPE_TAG
                k => return Err(format!("unknown BTF kind {k}")),
            };
            let body = table.get(at..at + extra).ok_or("type table truncated")?;
            types.push(match kind {
                KIND_INT => Ty::Int { bits: u32_at(body, 0)? & 0xff },
                KIND_STRUCT | KIND_UNION => {
                    let mut members = Vec::with_capacity(vlen);
                    for m in body.chunks_exact(12) {
                        let off = u32_at(m, 8)?;
                        let (bit_offset, bitfield) = if kflag { (off & 0xff_ffff, off >> 24) } else { (off, 0) };
                        members.push(Member { name: u32_at(m, 0)?, ty: u32_at(m, 4)?, bit_offset, bitfield });
                    }
                    Ty::Aggregate { name, members }
                }
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => Ty::Alias(size_or_type),
                _ => Ty::Other,
            });
            at += extra;
        }
        Ok(Self { strings, types })
    }

    fn name(&self, off: u32) -> &[u8] {
        let s = self.strings.get(off as usize..).unwrap_or_default();
        &s[..s.iter().position(|&c| c == 0).unwrap_or(s.len())]
    }

    /// The type `id` refers to once aliases are followed (`None` for id 0 or out of range).
    fn resolve(&self, mut id: u32) -> Option<&Ty> {
        for _ in 0..32 {
            match self.types.get(id.checked_sub(1)? as usize)? {
                Ty::Alias(next) => id = *next,
                t => return Some(t),
            }
        }
        None
    }

    /// Finds `field` in `members`, descending into anonymous structs and unions; returns it
    /// with its bit offset from the outermost struct.
    fn find(&self, members: &[Member], base: u32, field: &[u8]) -> Option<Member> {
        for m in members {
            if self.name(m.name) == field {
                return Some(Member { bit_offset: base + m.bit_offset, ..*m });
            }
            if m.name == 0
                && let Some(Ty::Aggregate { members: inner, .. }) = self.resolve(m.ty)
                && let Some(found) = self.find(inner, base + m.bit_offset, field)
            {
                return Some(found);
            }
        }
        None
    }
}

/// [`SkbLayout`] from raw BTF (little-endian, as the kernel's own).
fn parse(raw: &[u8]) -> Result<SkbLayout, String> {
    let btf = Btf::parse(raw)?;
    let skb = btf
        .types
        .iter()
        .find_map(|t| match t {
            Ty::Aggregate { name, members } if btf.name(*name) == b"sk_buff" && !members.is_empty() => Some(members),
            _ => None,
        })
        .ok_or("no struct sk_buff")?;
    let field = |name: &str| btf.find(skb, 0, name.as_bytes()).ok_or_else(|| format!("sk_buff has no {name}"));
    // A plain u16 member's byte offset.
    let u16_field = |name: &str| -> Result<u16, String> {
        let m = field(name)?;
        match btf.resolve(m.ty) {
            Some(Ty::Int { bits: 16 }) if m.bitfield == 0 && m.bit_offset % 8 == 0 => {
                u16::try_from(m.bit_offset / 8).map_err(|_| format!("sk_buff.{name} beyond 64 KiB"))
            }
            _ => Err(format!("sk_buff.{name} is not a plain 16-bit integer")),
        }
    };
    let summed = field("ip_summed")?;
    if summed.bitfield != 2 {
        return Err(format!("sk_buff.ip_summed is {} bits wide, not 2", summed.bitfield));
    }
    let (byte, shift) = (summed.bit_offset / 8, summed.bit_offset % 8);
    if shift > 6 {
        return Err("sk_buff.ip_summed straddles two bytes".into());
    }
    let layout = SkbLayout {
        ip_summed: u16::try_from(byte).map_err(|_| "sk_buff.ip_summed beyond 64 KiB")?,
        csum_start: u16_field("csum_start")?,
        csum_offset: u16_field("csum_offset")?,
        mac_header: u16_field("mac_header")?,
        ip_summed_shift: shift as u8,
        _pad: [0; 3],
    };
    if layout.ip_summed == 0 {
        return Err("sk_buff.ip_summed at offset 0".into());
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A little BTF blob: `__u16` (typedef of a 16-bit int), `u8`, and
    /// `struct sk_buff { u64 x; union { u32 csum; struct { __u16 csum_start; __u16 csum_offset; }; };
    /// u8 a:5, ip_summed:2; __u16 mac_header; }` laid out at bytes 0, 8, 12 (bits 5-6), 14.
    fn blob(summed_bits: u32) -> Vec<u8> {
        let mut strings =
            b"\0u16\0__u16\0u8\0sk_buff\0csum_start\0csum_offset\0ip_summed\0a\0mac_header\0csum\0x\0".to_vec();
        let off = |s: &str, strings: &[u8]| -> u32 {
            let mut pat = s.as_bytes().to_vec();
            pat.push(0);
            strings.windows(pat.len()).position(|w| w == pat).unwrap() as u32
        };
        let mut t = Vec::new();
        let mut push = |words: &[u32]| words.iter().for_each(|w| t.extend_from_slice(&w.to_le_bytes()));
        let s = |n: &str| off(n, &strings);
        // 1: int u16 (16 bits)
        push(&[s("u16"), KIND_INT << 24, 2, 16]);
        // 2: typedef __u16 -> 1
        push(&[s("__u16"), KIND_TYPEDEF << 24, 1]);
        // 3: int u8
        push(&[s("u8"), KIND_INT << 24, 1, 8]);
        // 4: anonymous struct { __u16 csum_start; __u16 csum_offset; }
        push(&[0, KIND_STRUCT << 24 | 2, 4, s("csum_start"), 2, 0, s("csum_offset"), 2, 16]);
        // 5: anonymous union { u32 csum (int 1 reused); struct 4 }
        push(&[0, KIND_UNION << 24 | 2, 4, s("csum"), 1, 0, 0, 4, 0]);
        // 6: struct sk_buff (bitfield offsets: kind_flag)
        push(&[
            s("sk_buff"),
            1 << 31 | KIND_STRUCT << 24 | 5,
            16,
            s("x"),
            3,
            0,
            0,
            5,
            64,
            s("a"),
            3,
            5 << 24 | 96,
            s("ip_summed"),
            3,
            summed_bits << 24 | 101,
            s("mac_header"),
            2,
            112,
        ]);
        let mut raw = Vec::new();
        raw.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        raw.extend_from_slice(&[1, 0]);
        for w in [24u32, 0, t.len() as u32, t.len() as u32, strings.len() as u32] {
            raw.extend_from_slice(&w.to_le_bytes());
        }
        raw.extend(t);
        raw.append(&mut strings);
        raw
    }

    #[test]
    fn fields_are_found_through_anonymous_unions_and_typedefs() {
        let l = parse(&blob(2)).unwrap();
        assert_eq!(
            l,
            SkbLayout {
                ip_summed: 12,
                ip_summed_shift: 5,
                csum_start: 8,
                csum_offset: 10,
                mac_header: 14,
                _pad: [0; 3]
            }
        );
    }

    #[test]
    fn an_unexpected_shape_is_refused() {
        assert!(parse(&blob(3)).unwrap_err().contains("3 bits"));
        assert!(parse(b"not btf at all, not btf at all").is_err());
    }

    /// The running kernel's layout (every kernel this project runs on has BTF): each field at a
    /// distinct offset inside `sk_buff`, `ip_summed` a 2-bit field.
    #[test]
    fn the_running_kernel_has_a_layout() {
        let l = running_kernel().unwrap();
        let offs = [l.ip_summed, l.csum_start, l.csum_offset, l.mac_header];
        assert!(offs.iter().all(|&o| o > 0 && o < 512), "{l:?}");
        assert_eq!(l.csum_offset, l.csum_start + 2, "csum_offset follows csum_start: {l:?}");
    }
}
