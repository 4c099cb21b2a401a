//! FQDN allow by DNS learning: map layouts and the DNS message parser shared by the datapath
//! (`ebpf/cubevs-ebpf/src/dns.rs`) and userspace (`cubevs::dns`, unit tests).
//!
//! Upstream learns in the kernel too (`reference/upstream.md §3.8`): a guest's query for an
//! allowed name is tracked, and the A records of the matching response become per-sandbox
//! allow entries with an expiry. Differences (decisions N1–N6 in `docs/decisions.md`):
//! - names are matched by hash, not by a reversed-name LPM trie: [`name_hash`] of the
//!   lower-case wire-format name, computed over its bytes **from the end**, so one backward
//!   pass over a queried name yields the hash of every suffix that starts at a label
//!   ([`hash_name`]); an exact pattern matches the whole name, a `*.` pattern a proper suffix;
//! - the parser is a pure function over a bounded buffer (the first [`MSG_WINDOW`] bytes of
//!   the UDP payload copied into a per-CPU scratch map), every index masked, every loop
//!   bounded, so the same code runs in the verifier and in `cargo test`;
//! - TTL 0 (upstream bug #799) and short TTLs are raised to [`TTL_FLOOR_S`]; TTLs are capped
//!   at [`TTL_CAP_S`].
//!
//! Byte order: `*_ip` and `*port*` fields are network byte order (as on the wire); hashes,
//! expiries, counts and DNS ids are host order.

/// Slots of the `dns_progs` program array. The main programs tail-call the DNS programs
/// (which have their own 512-byte stack: `from_cube` alone uses ~440) and are tail-called
/// back, marked by [`CB_MAGIC`] in `skb->cb[0]` so they do not enter DNS twice.
pub mod slot {
    /// `dns_query`.
    pub const QUERY: u32 = 0;
    /// `from_cube` (back from `dns_query`).
    pub const FROM_CUBE: u32 = 1;
    /// `dns_response`.
    pub const RESPONSE: u32 = 2;
    /// `from_world` (back from `dns_response`).
    pub const FROM_WORLD: u32 = 3;
    /// Slots in the array.
    pub const COUNT: u32 = 4;
}

/// `skb->cb[0]` value meaning "the DNS hook already ran for this packet".
pub const CB_MAGIC: u32 = 0xd45c_0de5;

/// `DnsAllowValue::flags` / `LearnedValue::flags`: addresses of this name are steered to
/// CubeEgress (a policy rule names it as `host` or `sni`).
pub const FLAG_L7: u8 = 1;

/// DNS server port (host order). Only UDP to/from this port is parsed.
pub const SERVER_PORT: u16 = 53;
/// Bytes of a DNS message the datapath copies and parses (the rest of a longer EDNS answer
/// is not walked; counted as `dns_window`).
pub const MSG_WINDOW: usize = 1024;
const MSG_MASK: usize = MSG_WINDOW - 1;
/// Most labels in a name (a 255-byte wire name has at most 127).
pub const MAX_LABELS: usize = 128;
const LABEL_MASK: usize = MAX_LABELS - 1;
/// Longest wire-format name without its terminating zero (RFC 1035: 255 with it).
pub const MAX_NAME_WIRE: usize = 254;
/// Answer records walked per response; later ones are not learned (counted).
pub const MAX_ANSWERS: u32 = 16;
/// A tracked query waits this long for its response (upstream: 10 s).
pub const QUERY_TIMEOUT_NS: u64 = 10_000_000_000;
/// Learned entries live at least this long whatever the TTL (upstream: 300 s, ec68520e).
pub const TTL_FLOOR_S: u32 = 300;
/// ... and at most this long (a resolver cannot pin an address for days).
pub const TTL_CAP_S: u32 = 86_400;
/// Ports one FQDN entry may carry (upstream `MAX_L7_PORTS_PER_HOST`).
pub const MAX_PORTS: usize = 8;
/// DNS record type A.
pub const TYPE_A: u16 = 1;
/// DNS record type CNAME.
pub const TYPE_CNAME: u16 = 5;
/// DNS class IN.
pub const CLASS_IN: u16 = 1;

/// Header flag bits (host order, as read big-endian from bytes 2-3).
pub mod flags {
    /// Response.
    pub const QR: u16 = 0x8000;
    /// Opcode field (4 bits).
    pub const OPCODE: u16 = 0x7800;
    /// Truncated.
    pub const TC: u16 = 0x0200;
    /// Response code field (4 bits).
    pub const RCODE: u16 = 0x000f;
}

/// `dns_allow` key (24 bytes): one FQDN allow pattern of one sandbox's policy generation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DnsAllowKey {
    /// Sandbox interface ifindex.
    pub ifindex: u32,
    /// Policy generation (the one `policy_gen` names; written before it flips).
    pub generation: u32,
    /// [`name_hash`] of the name (for `*.example.com`: of `example.com`).
    pub name_hash: u64,
    /// 1 for a `*.` pattern (proper subdomains only), 0 for an exact name.
    pub subdomains: u8,
    /// Padding; zero.
    pub _pad: [u8; 7],
}
const _: () = assert!(core::mem::size_of::<DnsAllowKey>() == 24);

/// [`DnsAllowKey::subdomains`] of a generation's seal in `dns_allow_names` (never a pattern's:
/// those are 0 or 1).
pub const SEAL_SUBDOMAINS: u8 = 0xff;
const _: () = assert!(SEAL_SUBDOMAINS > 1);

impl DnsAllowKey {
    /// The seal of (`ifindex`, `generation`): a `dns_allow_names` entry under this key (any
    /// value; userspace writes a zero-length name) says every pattern of that generation has
    /// its name there, so a `dns_allow` key of that generation without one matches nothing
    /// (decision R52). `name_hash` 0, `subdomains` [`SEAL_SUBDOMAINS`]: no pattern's key.
    /// A generation without a seal (written by a loader before R52, or not yet backfilled)
    /// keeps the hash-only match for its unnamed keys (R48).
    pub const fn seal(ifindex: u32, generation: u32) -> Self {
        Self { ifindex, generation, name_hash: 0, subdomains: SEAL_SUBDOMAINS, _pad: [0; 7] }
    }
}

/// `dns_allow` value (20 bytes): the ports a learned address is allowed on.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DnsAllowValue {
    /// Valid entries of `ports`; 0 = every port.
    pub port_count: u8,
    /// Flags ([`FLAG_L7`]).
    pub flags: u8,
    /// The pattern's [`pattern_tag`] (native order; 0 = none, written by loaders before
    /// N8): copied into the learned value's [`TAG_SHIFT`] bits so userspace can name what
    /// an address was learned for.
    pub tag: u16,
    /// Destination ports (NBO).
    pub ports: [u16; MAX_PORTS],
}
const _: () = assert!(core::mem::size_of::<DnsAllowValue>() == 20);

/// `dns_allow_names` value (256 bytes), under the same key as `dns_allow`: the pattern's name
/// (for `*.example.com`: `example.com`) in lower-case wire format without the terminating
/// zero (`07 example 03 com`). A 64-bit FNV hash is not collision-resistant: the datapath
/// tracks a query only when the suffix whose hash matched is this name byte for byte
/// (decision R48). Entries written before R48 have none: the hash alone decides for them,
/// unless their generation is sealed ([`DnsAllowKey::seal`], decision R52): then they match
/// nothing.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DnsAllowName {
    /// Bytes of `wire` in use (at most [`MAX_NAME_WIRE`]).
    pub len: u8,
    /// The wire-format name, zero-filled past `len`.
    pub wire: [u8; 255],
}
const _: () = assert!(core::mem::size_of::<DnsAllowName>() == 256);

impl DnsAllowName {
    /// The zero-length name, written as the value of a generation's seal
    /// ([`DnsAllowKey::seal`]).
    pub const EMPTY: Self = Self { len: 0, wire: [0; 255] };

    /// The entry of dotted `name` (no trailing dot, labels 1-63 bytes, as callers validate);
    /// `None` when its wire format is longer than [`MAX_NAME_WIRE`].
    pub fn of(name: &str) -> Option<Self> {
        let mut v = Self { len: 0, wire: [0; 255] };
        let mut n = 0usize;
        for label in name.split('.') {
            if label.is_empty() || label.len() > 63 || n + 1 + label.len() > MAX_NAME_WIRE {
                return None;
            }
            v.wire[n] = label.len() as u8;
            for (i, b) in label.bytes().enumerate() {
                v.wire[n + 1 + i] = lower(b);
            }
            n += 1 + label.len();
        }
        v.len = n as u8;
        Some(v)
    }
}

/// `dns_query_track` key (16 bytes): a guest query waiting for its response. The server
/// port is always [`SERVER_PORT`] (only UDP/53 is tracked), so it is not stored.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DnsQueryKey {
    /// Sandbox interface ifindex.
    pub ifindex: u32,
    /// Resolver address the query went to (NBO).
    pub server_ip: u32,
    /// Guest source port (NBO), before SNAT.
    pub guest_port: u16,
    /// DNS message id (host order).
    pub id: u16,
    /// Sandbox version when the query was sent.
    pub version: u32,
}
const _: () = assert!(core::mem::size_of::<DnsQueryKey>() == 16);

/// `dns_query_track` value (40 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DnsQueryValue {
    /// Expiry, CLOCK_MONOTONIC ns (`bpf_ktime_get_ns`).
    pub expires_ns: u64,
    /// [`name_hash`] of the queried name: the response's question must hash the same.
    pub name_hash: u64,
    /// The matched pattern's ports ([`DnsAllowValue`]).
    pub allow: DnsAllowValue,
    /// [`crate::track::DNS_CHARGED`] in queries charged to the tracking floor (decision Q6);
    /// 0 in those of older objects (never subtracted).
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<DnsQueryValue>() == 40);

/// `dns_learned` key (12 bytes): an address a sandbox may reach because an allowed name
/// resolved to it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LearnedKey {
    /// Sandbox interface ifindex.
    pub ifindex: u32,
    /// Learned IPv4 address (NBO).
    pub ip: u32,
    /// Destination port (NBO); 0 = every port (and ICMP).
    pub port: u16,
    /// Padding; zero.
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<LearnedKey>() == 12);

/// `dns_learned` value (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnedValue {
    /// Expiry, CLOCK_MONOTONIC ns: now + clamp(TTL, [`TTL_FLOOR_S`], [`TTL_CAP_S`]).
    pub expires_ns: u64,
    /// Sandbox version that learned it (a reused interface never inherits it).
    pub version: u32,
    /// Bits 0–7: the pattern's flags ([`FLAG_L7`]); bits 8–15: the charge mark
    /// ([`crate::learned_floor::CHARGED`], decision R66; 0 = made by an object before R66,
    /// never subtracted); bits 16–31: the matched pattern's [`pattern_tag`] (0 = unknown:
    /// learned by a program before N8).
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<LearnedValue>() == 16);

/// Shift of the pattern tag in [`LearnedValue::flags`].
pub const TAG_SHIFT: u32 = 16;

impl LearnedValue {
    /// The matched pattern's [`pattern_tag`] (0 = unknown).
    pub fn tag(&self) -> u16 {
        (self.flags >> TAG_SHIFT) as u16
    }
}

/// The 16-bit tag of a `dns_allow` pattern: the low bits of its [`name_hash`] mixed with the
/// `*.` flag, never 0. Not unique: userspace names a learned entry only when exactly one of
/// the sandbox's patterns has its tag (decision N8).
pub const fn pattern_tag(name_hash: u64, subdomains: bool) -> u16 {
    let h = name_hash ^ (name_hash >> 32) ^ (name_hash >> 16) ^ (subdomains as u64).wrapping_mul(0x9e37);
    let t = h as u16;
    if t == 0 { 1 } else { t }
}

/// Per-CPU scratch (`dns_scratch`, 1,280 bytes): the copied DNS message and the label
/// offsets of the name being parsed.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Scratch {
    /// The first [`MSG_WINDOW`] bytes of the UDP payload.
    pub msg: [u8; MSG_WINDOW],
    /// Offsets (relative to the name start) of each label's length byte.
    pub starts: [u8; MAX_LABELS],
    /// Loop state of [`walk_answers`] (position, records walked, phase). Kept in the map
    /// value rather than on the stack on purpose: the verifier does not track map contents,
    /// so the loop body's states converge at once instead of once per position.
    pub walk: [u32; 4],
    /// Reserved; contents undefined.
    pub _spare: [u8; 112],
}
const _: () = assert!(core::mem::size_of::<Scratch>() == 1280);

impl Scratch {
    /// An all-zero scratch (userspace tests).
    pub const ZERO: Self = Self { msg: [0; MSG_WINDOW], starts: [0; MAX_LABELS], walk: [0; 4], _spare: [0; 112] };
}

/// FNV-1a 64 offset basis.
pub const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

#[inline(always)]
fn fnv(h: u64, b: u8) -> u64 {
    (h ^ b as u64).wrapping_mul(FNV_PRIME)
}

#[inline(always)]
fn lower(b: u8) -> u8 {
    if b.is_ascii_uppercase() { b | 0x20 } else { b }
}

/// The hash a pattern is stored under: FNV-1a 64 over the lower-case wire format of `name`
/// (`example.com` → `07 example 03 com`, no terminating zero) taken **last byte first**.
/// `name` is dotted, without a trailing dot; labels must be 1-63 bytes (callers validate).
pub fn name_hash(name: &str) -> u64 {
    let mut h = FNV_BASIS;
    for label in name.rsplit('.') {
        for &b in label.as_bytes().iter().rev() {
            h = fnv(h, lower(b));
        }
        h = fnv(h, label.len() as u8);
    }
    h
}

/// Why a message was not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reject {
    /// Not a standard query/response with one question (opcode, QR, counts), or a question
    /// other than IN A.
    NotStandard,
    /// Shorter than its header or its names/records claim, bad label, pointer in a question.
    Malformed,
}

#[inline(always)]
fn byte(s: &Scratch, off: usize) -> u8 {
    s.msg[off & MSG_MASK]
}

#[inline(always)]
fn be16(s: &Scratch, off: usize) -> u16 {
    ((byte(s, off) as u16) << 8) | byte(s, off + 1) as u16
}

#[inline(always)]
fn be32(s: &Scratch, off: usize) -> u32 {
    ((be16(s, off) as u32) << 16) | be16(s, off + 2) as u32
}

/// A parsed header (host order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Message id.
    pub id: u16,
    /// Flags word ([`flags`]).
    pub flags: u16,
    /// Question count.
    pub qdcount: u16,
    /// Answer count.
    pub ancount: u16,
}

/// Reads the 12-byte header of a `len`-byte message.
#[inline(always)]
pub fn header(s: &Scratch, len: usize) -> Result<Header, Reject> {
    if len < 12 {
        return Err(Reject::Malformed);
    }
    Ok(Header { id: be16(s, 0), flags: be16(s, 2), qdcount: be16(s, 4), ancount: be16(s, 6) })
}

/// Runs a loop body at most `n` times (index 0, 1, …) until it returns false. The datapath
/// implements it with `bpf_loop` (the verifier checks the body once instead of unrolling
/// every iteration: the plain bounded loops of this parser exceeded the 1M-instruction
/// limit); userspace with a plain loop ([`PlainLoop`]). The parser is generic over it so one
/// implementation runs in both places.
pub trait Loop {
    /// Calls `body(i)` for i in 0..n while it returns true.
    fn run<F: FnMut(u32) -> bool>(n: u32, body: F);
}

/// [`Loop`] as an ordinary `for` loop (userspace, tests).
pub struct PlainLoop;

impl Loop for PlainLoop {
    #[inline(always)]
    fn run<F: FnMut(u32) -> bool>(n: u32, mut body: F) {
        let mut i = 0;
        while i < n {
            if !body(i) {
                break;
            }
            i += 1;
        }
    }
}

/// An uncompressed name at `off`: its wire length without the terminating zero and its
/// label count; label offsets (relative to `off`) go to `s.starts`. Compression pointers are
/// refused (a question never needs one).
#[inline(always)]
pub fn walk_name<L: Loop>(s: &mut Scratch, len: usize, off: usize) -> Result<(usize, usize), Reject> {
    // (position, labels, 0 running / 1 done / 2 bad)
    let mut st = (0usize, 0usize, 0u8);
    L::run(MAX_LABELS as u32, |_| {
        let (pos, labels) = (st.0, st.1);
        if off + pos >= len || pos > MAX_NAME_WIRE {
            st.2 = 2;
            return false;
        }
        let l = byte(s, off + pos) as usize;
        if l == 0 {
            st.2 = if labels == 0 { 2 } else { 1 };
            return false;
        }
        if l > 63 {
            st.2 = 2;
            return false;
        }
        s.starts[labels & LABEL_MASK] = pos as u8;
        st.1 = labels + 1;
        st.0 = pos + l + 1;
        true
    });
    if st.2 == 1 && st.0 <= MAX_NAME_WIRE { Ok((st.0, st.1)) } else { Err(Reject::Malformed) }
}

/// The [`name_hash`] of the name [`walk_name`] found at `off` (`wire` bytes, `labels`
/// labels). `on_suffix(hash, subdomain, at)` is called for every suffix starting at a label,
/// shortest first: `subdomain` is true for proper suffixes (candidates for `*.` patterns)
/// and false for the whole name (exact patterns); `at` is the suffix's offset in the name.
#[inline(always)]
pub fn hash_name<L: Loop>(
    s: &Scratch,
    off: usize,
    wire: usize,
    labels: usize,
    mut on_suffix: impl FnMut(u64, bool, usize),
) -> u64 {
    if labels == 0 || wire == 0 {
        return FNV_BASIS;
    }
    // (hash, label index j, offset of label j)
    let mut st = (FNV_BASIS, labels - 1, s.starts[(labels - 1) & LABEL_MASK] as usize);
    L::run(MAX_NAME_WIRE as u32, |k| {
        let k = k as usize;
        if k >= wire {
            return false;
        }
        let i = wire - 1 - k;
        st.0 = fnv(st.0, lower(byte(s, off + i)));
        if i == st.2 {
            on_suffix(st.0, i != 0, i);
            if st.1 == 0 {
                return false;
            }
            st.1 -= 1;
            st.2 = s.starts[st.1 & LABEL_MASK] as usize;
        }
        true
    });
    st.0
}

/// A query the datapath may track.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Query {
    /// Message id.
    pub id: u16,
    /// [`name_hash`] of the question name.
    pub name_hash: u64,
    /// Wire length of the question name (at offset 12) without its terminating zero.
    pub wire: usize,
}

/// Parses a `len`-byte guest query: QR 0, opcode 0, exactly one question, no answers, the
/// question IN A with an uncompressed name. `on_suffix` sees every suffix hash (see
/// [`hash_name`]).
#[inline(always)]
pub fn parse_query<L: Loop>(
    s: &mut Scratch,
    len: usize,
    on_suffix: impl FnMut(u64, bool, usize),
) -> Result<Query, Reject> {
    let h = header(s, len)?;
    if h.flags & (flags::QR | flags::OPCODE) != 0 || h.qdcount != 1 || h.ancount != 0 {
        return Err(Reject::NotStandard);
    }
    let (wire, labels) = walk_name::<L>(s, len, 12)?;
    let q = 12 + wire + 1;
    if q + 4 > len {
        return Err(Reject::Malformed);
    }
    if be16(s, q) != TYPE_A || be16(s, q + 2) != CLASS_IN {
        return Err(Reject::NotStandard);
    }
    let name_hash = hash_name::<L>(s, 12, wire, labels, on_suffix);
    Ok(Query { id: h.id, name_hash, wire })
}

/// True when the query name at offset 12 (`wire` bytes), from its label at `at` to its end,
/// is `name` byte for byte, letters compared in lower case (decision R48).
#[inline(always)]
pub fn suffix_is<L: Loop>(s: &Scratch, wire: usize, at: usize, name: &DnsAllowName) -> bool {
    let n = name.len as usize;
    if at > wire || wire - at != n || n > MAX_NAME_WIRE {
        return false;
    }
    // (bytes compared, all equal so far)
    let mut st = (0usize, true);
    L::run(MAX_NAME_WIRE as u32, |k| {
        let k = k as usize;
        if k >= n || k >= 255 {
            return false;
        }
        st.0 = k + 1;
        if lower(byte(s, 12 + at + k)) != name.wire[k] {
            st.1 = false;
            return false;
        }
        true
    });
    st.1 && st.0 == n
}

/// What a response walk found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Walk {
    /// IN A records handed to the callback.
    pub a_records: u32,
    /// Records skipped (CNAME, other types).
    pub other: u32,
    /// Answers not walked: beyond [`MAX_ANSWERS`] or beyond the copied window.
    pub not_walked: u32,
}

/// The question of a `len`-byte response: header checks (QR 1, opcode 0, one question),
/// question IN A, uncompressed. Returns the header, the question's [`name_hash`] and the
/// offset of the answer section.
#[inline(always)]
pub fn response_question<L: Loop>(s: &mut Scratch, len: usize) -> Result<(Header, u64, usize), Reject> {
    let h = header(s, len)?;
    if h.flags & flags::QR == 0 || h.flags & flags::OPCODE != 0 || h.qdcount != 1 {
        return Err(Reject::NotStandard);
    }
    let (wire, labels) = walk_name::<L>(s, len, 12)?;
    let q = 12 + wire + 1;
    if q + 4 > len {
        return Err(Reject::Malformed);
    }
    if be16(s, q) != TYPE_A || be16(s, q + 2) != CLASS_IN {
        return Err(Reject::NotStandard);
    }
    Ok((h, hash_name::<L>(s, 12, wire, labels, |_, _, _| {}), q + 4))
}

/// Steps [`walk_answers`] may take: one per label of an owner name plus one per record.
pub const MAX_WALK_STEPS: u32 = 256;

/// Walks the answer section of a `len`-byte message from `pos` (`ancount` records, at most
/// [`MAX_ANSWERS`]): owner names skipped (compression pointers allowed), every IN A record
/// with 4 bytes of data handed to `on_a(ip NBO, ttl seconds)`, CNAME and other records
/// skipped. The owner names are not compared with the question: the resolver that answered
/// the tracked query vouches for the chain (Cilium#39926 reached the same conclusion), and
/// CNAME chains resolve naturally. A record cut by the window or the message ends the walk.
///
/// One flat loop of [`MAX_WALK_STEPS`] steps (a label of an owner name, or a record's fixed
/// part), not a loop over records with a loop over labels inside: nested `bpf_loop`
/// callbacks multiply the verifier's work past its limit.
#[inline(always)]
pub fn walk_answers<L: Loop>(
    s: &mut Scratch,
    len: usize,
    pos: usize,
    ancount: u16,
    mut on_a: impl FnMut(u32, u32),
) -> Walk {
    let mut w = Walk::default();
    let want = if (ancount as u32) < MAX_ANSWERS { ancount as u32 } else { MAX_ANSWERS };
    // walk = [position, records walked, 1 when in the record's fixed part]
    s.walk = [pos as u32, 0, 0, 0];
    if want > 0 {
        L::run(MAX_WALK_STEPS, |_| {
            let pos = s.walk[0] as usize;
            if pos > MSG_WINDOW {
                return false;
            }
            if s.walk[2] == 0 {
                // A label of the owner name, its terminating zero, or a pointer.
                if pos >= len {
                    return false;
                }
                let b = byte(s, pos);
                if b == 0 {
                    s.walk[0] = (pos + 1) as u32;
                    s.walk[2] = 1;
                } else if b & 0xc0 == 0xc0 {
                    s.walk[0] = (pos + 2) as u32;
                    s.walk[2] = 1;
                } else if b & 0xc0 != 0 {
                    return false;
                } else {
                    s.walk[0] = (pos + b as usize + 1) as u32;
                }
                return true;
            }
            if pos + 10 > len {
                return false;
            }
            let (typ, class, ttl, rdlen) =
                (be16(s, pos), be16(s, pos + 2), be32(s, pos + 4), be16(s, pos + 8) as usize);
            let data = pos + 10;
            if data + rdlen > len {
                return false;
            }
            if typ == TYPE_A && class == CLASS_IN && rdlen == 4 {
                let ip = u32::from_ne_bytes([byte(s, data), byte(s, data + 1), byte(s, data + 2), byte(s, data + 3)]);
                on_a(ip, ttl);
                w.a_records += 1;
            } else {
                w.other += 1;
            }
            let n = s.walk[1] + 1;
            s.walk = [(data + rdlen) as u32, n, 0, 0];
            n < want
        });
    }
    w.not_walked = (ancount as u32).saturating_sub(s.walk[1]);
    w
}

/// The ranges every sandbox is always denied, as (network, prefix length): private,
/// loopback and link-local (the same list as `cubevs::policy::BASELINE_DENY`, which a unit
/// test there compares with this one).
pub const ALWAYS_DENIED: [([u8; 4], u32); 5] =
    [([10, 0, 0, 0], 8), ([127, 0, 0, 0], 8), ([169, 254, 0, 0], 16), ([172, 16, 0, 0], 12), ([192, 168, 0, 0], 16)];

/// True when `ip` (NBO, as [`walk_answers`] hands it over) lies in [`ALWAYS_DENIED`]: such an
/// answer is not learned, so a name whose records a sandbox controls never opens the cloud
/// metadata address, the node's network or loopback (decision R15).
#[inline(always)]
pub fn always_denied(ip: u32) -> bool {
    let host = u32::from_be(ip);
    let mut i = 0;
    while i < ALWAYS_DENIED.len() {
        let (net, len) = ALWAYS_DENIED[i];
        let mask = u32::MAX << (32 - len);
        if host & mask == u32::from_be_bytes(net) {
            return true;
        }
        i += 1;
    }
    false
}

/// Lifetime in ns of an entry learned from a record with `ttl` seconds.
#[inline(always)]
pub fn learned_lifetime_ns(ttl: u32) -> u64 {
    let t = ttl.clamp(TTL_FLOOR_S, TTL_CAP_S);
    t as u64 * 1_000_000_000
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_seal_is_no_pattern_key() {
        use super::{DnsAllowKey, SEAL_SUBDOMAINS};
        let seal = DnsAllowKey::seal(7, 3);
        assert_eq!((seal.ifindex, seal.generation, seal.name_hash, seal.subdomains), (7, 3, 0, SEAL_SUBDOMAINS));
        assert_eq!(super::DnsAllowName::EMPTY.len, 0);
    }

    #[test]
    fn always_denied_ranges() {
        let nbo = |a: [u8; 4]| u32::from_ne_bytes(a);
        for ip in [
            [10, 1, 2, 3],
            [127, 0, 0, 1],
            [169, 254, 169, 254],
            [172, 16, 0, 1],
            [172, 31, 255, 255],
            [192, 168, 0, 4],
        ] {
            assert!(super::always_denied(nbo(ip)), "{ip:?}");
        }
        for ip in [
            [9, 255, 255, 255],
            [11, 0, 0, 0],
            [172, 32, 0, 0],
            [172, 15, 255, 255],
            [192, 169, 0, 0],
            [203, 0, 113, 10],
        ] {
            assert!(!super::always_denied(nbo(ip)), "{ip:?}");
        }
    }

    extern crate std;
    use std::vec::Vec;

    use super::*;

    fn wire(name: &str) -> Vec<u8> {
        let mut v = Vec::new();
        for l in name.split('.') {
            v.push(l.len() as u8);
            v.extend_from_slice(l.as_bytes());
        }
        v.push(0);
        v
    }

    fn msg(flags: u16, an: u16, name: &str, answers: &[u8]) -> (Scratch, usize) {
        let mut m = Vec::new();
        m.extend_from_slice(&0x1234u16.to_be_bytes());
        m.extend_from_slice(&flags.to_be_bytes());
        m.extend_from_slice(&1u16.to_be_bytes());
        m.extend_from_slice(&an.to_be_bytes());
        m.extend_from_slice(&[0, 0, 0, 0]);
        m.extend_from_slice(&wire(name));
        m.extend_from_slice(&[0, 1, 0, 1]);
        m.extend_from_slice(answers);
        let mut s = Scratch::ZERO;
        s.msg[..m.len()].copy_from_slice(&m);
        (s, m.len())
    }

    #[test]
    fn suffix_hashes_match_pattern_hashes() {
        let (mut s, len) = msg(0x0100, 0, "Api.Example.COM", &[]);
        let mut seen = Vec::new();
        let q = parse_query::<PlainLoop>(&mut s, len, |h, sub, _| seen.push((h, sub))).unwrap();
        assert_eq!(q.id, 0x1234);
        assert_eq!(q.name_hash, name_hash("api.example.com"));
        assert_eq!(
            seen,
            [(name_hash("com"), true), (name_hash("example.com"), true), (name_hash("api.example.com"), false)]
        );
    }

    /// R48: the matched suffix is compared with the pattern's name, case-insensitively, at
    /// the label the hash matched at; a name of another length or content is refused.
    #[test]
    fn suffix_is_compares_the_matched_suffix_byte_for_byte() {
        let (mut s, len) = msg(0x0100, 0, "Api.Example.COM", &[]);
        let mut at = Vec::new();
        let q = parse_query::<PlainLoop>(&mut s, len, |_, _, i| at.push(i)).unwrap();
        assert_eq!((q.wire, at.as_slice()), (16, [12usize, 4, 0].as_slice()));
        let example = DnsAllowName::of("example.com").unwrap();
        assert_eq!(&example.wire[..example.len as usize], b"\x07example\x03com");
        assert!(suffix_is::<PlainLoop>(&s, q.wire, 4, &example));
        assert!(suffix_is::<PlainLoop>(&s, q.wire, 0, &DnsAllowName::of("API.example.com").unwrap()));
        assert!(!suffix_is::<PlainLoop>(&s, q.wire, 0, &example), "whole name vs suffix");
        assert!(!suffix_is::<PlainLoop>(&s, q.wire, 4, &DnsAllowName::of("examplf.com").unwrap()));
        assert!(!suffix_is::<PlainLoop>(&s, q.wire, 12, &example), "shorter suffix");
        assert!(!suffix_is::<PlainLoop>(&s, q.wire, 20, &example), "past the name");
        assert_eq!(DnsAllowName::of(&"a.".repeat(127)[..253]).map(|n| n.len), Some(254));
        assert!(DnsAllowName::of(&"ab.".repeat(85)[..254]).is_none(), "255 wire bytes");
    }

    #[test]
    fn rejects_non_a_and_responses_as_queries() {
        let (mut s, len) = msg(0x8180, 0, "a.com", &[]);
        assert_eq!(parse_query::<PlainLoop>(&mut s, len, |_, _, _| {}), Err(Reject::NotStandard));
        let (mut s, len) = msg(0x0100, 0, "a.com", &[]);
        s.msg[len - 3] = 28; // AAAA
        assert_eq!(parse_query::<PlainLoop>(&mut s, len, |_, _, _| {}), Err(Reject::NotStandard));
        assert_eq!(parse_query::<PlainLoop>(&mut s, 11, |_, _, _| {}), Err(Reject::Malformed));
        let (mut s, len) = msg(0x0100, 0, "a.com", &[]);
        s.msg[12] = 0xc0; // pointer in the question
        assert_eq!(parse_query::<PlainLoop>(&mut s, len, |_, _, _| {}), Err(Reject::Malformed));
    }

    #[test]
    fn answers_with_pointers_and_cname() {
        // c00c CNAME -> "b.com" (uncompressed), then two A records owned by a pointer.
        let mut a = Vec::new();
        a.extend_from_slice(&[0xc0, 0x0c, 0, 5, 0, 1, 0, 0, 0, 60]);
        let target = wire("b.com");
        a.extend_from_slice(&(target.len() as u16).to_be_bytes());
        a.extend_from_slice(&target);
        for (ip, ttl) in [([1, 2, 3, 4], 0u32), ([5, 6, 7, 8], 7200)] {
            a.extend_from_slice(&[0xc0, 0x1b, 0, 1, 0, 1]);
            a.extend_from_slice(&ttl.to_be_bytes());
            a.extend_from_slice(&[0, 4]);
            a.extend_from_slice(&ip);
        }
        let (mut s, len) = msg(0x8180, 3, "a.com", &a);
        let (h, qh, pos) = response_question::<PlainLoop>(&mut s, len).unwrap();
        assert_eq!((h.id, h.ancount, qh), (0x1234, 3, name_hash("a.com")));
        let mut got = Vec::new();
        let w = walk_answers::<PlainLoop>(&mut s, len, pos, h.ancount, |ip, ttl| got.push((ip.to_ne_bytes(), ttl)));
        assert_eq!(got, [([1, 2, 3, 4], 0), ([5, 6, 7, 8], 7200)]);
        assert_eq!(w, Walk { a_records: 2, other: 1, not_walked: 0 });
        // Cut inside the last record: only the first A is learned.
        let w = walk_answers::<PlainLoop>(&mut s, len - 1, pos, h.ancount, |_, _| {});
        assert_eq!((w.a_records, w.not_walked), (1, 1));
    }

    #[test]
    fn lifetime_is_floored_and_capped() {
        assert_eq!(learned_lifetime_ns(0), TTL_FLOOR_S as u64 * 1_000_000_000);
        assert_eq!(learned_lifetime_ns(3600), 3_600_000_000_000);
        assert_eq!(learned_lifetime_ns(u32::MAX), TTL_CAP_S as u64 * 1_000_000_000);
    }
}
