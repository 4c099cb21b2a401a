//! Standard gRPC clients on the Unix socket: a connection wrapper that rewrites an invalid
//! HTTP/2 `:authority` to `localhost` before hyper/h2 sees it.
//!
//! Why: for a `unix:` target, grpcio ≥ 1.57 (gRPC core) sends the %-encoded socket path as
//! `:authority` (`%2Ftmp%2Fcube%2Fnetwork-agent-grpc.sock`) and grpc-java sends the raw path.
//! Neither is an RFC 3986 authority, and h2's server (under hyper and tonic) answers such a
//! request with `RST_STREAM(PROTOCOL_ERROR)` while converting the pseudo-headers — before any
//! tower layer runs, with no server option to relax it (hyperium/h2 PR 487, open). grpc-go,
//! Kubernetes and tonic's own clients send `localhost` or a host name and were never affected.
//!
//! How: the client→server byte stream is parsed as HTTP/2 frames. Every header block (HEADERS
//! plus its CONTINUATIONs) is HPACK-decoded with a decoder that mirrors the client's encoder
//! (`loona-hpack`), the `:authority` is replaced when `http::uri::Authority` refuses it, and
//! the block is re-encoded as literals *without indexing* — so the server's HPACK decoder never
//! gains dynamic-table entries and cannot fall out of step — and re-framed into frames of at
//! most 16,384 bytes (the size every HTTP/2 peer accepts). Every other frame passes through
//! byte for byte; server→client bytes are untouched. A stream that does not start with the
//! HTTP/2 preface is passed through unchanged.
//!
//! Fast path (decision F12): the first header block of a connection decides. When its
//! `:authority` is valid (or absent) — tonic, grpc-go and Kubernetes clients — the block's
//! frames go through byte for byte and so does everything after them: the server's HPACK
//! decoder then sees exactly what the client's encoder wrote, and nothing on the connection is
//! decoded here again. The check walks the block's field representations only up to the
//! `:authority` field and Huffman-decodes that one value with the thread's one Huffman decoder
//! (`loona-hpack` builds a decoder table per Huffman string: ~10 % of the agent's CPU per
//! Ensure+fd when every block was decoded, ~5 % when built once per connection; F17).
//! When the first block needs a rewrite, or refers to entries the walk cannot see (dynamic
//! table references), every block of the connection is decoded and re-encoded as above.
//!
//! Limits: a header block over [`MAX_BLOCK`] bytes (encoded, or decoded as name + value + 32
//! per field, RFC 7541 §4.1) or malformed HTTP/2/HPACK closes the connection with an I/O error
//! while blocks are decoded. On a connection that passed through, a later invalid `:authority`
//! gets h2's own answer (`RST_STREAM(PROTOCOL_ERROR)`), as every request would without this
//! wrapper: standard clients send one authority per connection.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Frame types (RFC 9113 §6).
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
/// Flags.
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Largest frame payload we emit: the initial SETTINGS_MAX_FRAME_SIZE every peer accepts.
const OUT_FRAME: usize = 16_384;
/// Largest header block accepted, encoded or decoded (bytes).
pub const MAX_BLOCK: usize = 64 * 1024;
/// The authority that replaces an invalid one (what grpc-go and Kubernetes send on Unix sockets).
pub const REPLACEMENT: &str = "localhost";
/// HPACK dynamic table size the client's encoder may use: the server advertises none, so the
/// RFC 9113 default applies.
const CLIENT_TABLE: usize = 4096;

/// A header block being collected (HEADERS without END_HEADERS, then CONTINUATIONs).
struct Pending {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
    /// The block's frames as received (headers included), for the pass-through.
    raw: Vec<u8>,
}

enum Stage {
    /// Matching the preface; `n` bytes matched so far.
    Preface(usize),
    /// Frame by frame; `pass` payload bytes of the current frame still to copy through.
    Frames { pass: usize },
    /// Not HTTP/2 prior knowledge: everything passes unchanged.
    Transparent,
}

/// The synchronous rewriter: feed it client bytes, it appends what the server should read.
pub struct Rewriter {
    stage: Stage,
    input: Vec<u8>,
    pending: Option<Pending>,
    decoder: loona_hpack::Decoder<'static>,
    /// No header block finished yet: the next one decides between pass-through and rewrite.
    first: bool,
    /// How many `:authority` values were replaced (for tests and logs).
    pub rewritten: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn frame_header(len: usize, ty: u8, flags: u8, stream: u32, out: &mut Vec<u8>) {
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.push(ty);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// HPACK string literal without Huffman coding (RFC 7541 §5.2).
fn hpack_string(s: &[u8], out: &mut Vec<u8>) {
    // A write into a Vec cannot fail.
    let _ = loona_hpack::encoder::encode_integer_into(s.len(), 7, 0, out);
    out.extend_from_slice(s);
}

impl Rewriter {
    /// A rewriter at the start of a connection.
    pub fn new() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(CLIENT_TABLE);
        Self { stage: Stage::Preface(0), input: Vec::new(), pending: None, decoder, first: true, rewritten: 0 }
    }

    /// Whether the connection passes through unchanged from here on (its first header block
    /// had a valid `:authority`, or the stream is not HTTP/2 prior knowledge).
    pub fn passing_through(&self) -> bool {
        matches!(self.stage, Stage::Transparent)
    }

    /// Consumes `data` and appends the bytes to hand to the server to `out`. Bytes of an
    /// incomplete frame are kept for the next call.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        self.input.extend_from_slice(data);
        let mut at = 0;
        let r = self.run(&mut at, out);
        self.input.drain(..at);
        r
    }

    fn run(&mut self, at: &mut usize, out: &mut Vec<u8>) -> io::Result<()> {
        loop {
            let buf = &self.input[*at..];
            match &mut self.stage {
                Stage::Transparent => {
                    out.extend_from_slice(buf);
                    *at += buf.len();
                    return Ok(());
                }
                Stage::Preface(n) => {
                    let take = buf.len().min(PREFACE.len() - *n);
                    if buf[..take] != PREFACE[*n..*n + take] {
                        // Not prior-knowledge HTTP/2: hand over what was held back, then pass all.
                        out.extend_from_slice(&PREFACE[..*n]);
                        self.stage = Stage::Transparent;
                        continue;
                    }
                    *n += take;
                    *at += take;
                    if *n < PREFACE.len() {
                        return Ok(());
                    }
                    out.extend_from_slice(PREFACE);
                    self.stage = Stage::Frames { pass: 0 };
                }
                Stage::Frames { pass } if *pass > 0 => {
                    let take = buf.len().min(*pass);
                    if take == 0 {
                        return Ok(());
                    }
                    out.extend_from_slice(&buf[..take]);
                    *pass -= take;
                    *at += take;
                }
                Stage::Frames { pass } => {
                    if buf.len() < 9 {
                        return Ok(());
                    }
                    let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
                    let (ty, flags) = (buf[3], buf[4]);
                    let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
                    if ty != HEADERS && ty != CONTINUATION {
                        if self.pending.is_some() {
                            return Err(bad("HTTP/2: frame inside a header block"));
                        }
                        out.extend_from_slice(&buf[..9]);
                        *pass = len;
                        *at += 9;
                        continue;
                    }
                    if len > MAX_BLOCK {
                        return Err(bad(format!("HTTP/2: header frame of {len} bytes over {MAX_BLOCK}")));
                    }
                    if buf.len() < 9 + len {
                        return Ok(());
                    }
                    let frame = buf[..9 + len].to_vec();
                    *at += 9 + len;
                    self.header_frame(ty, flags, stream, &frame, out)?;
                }
            }
        }
    }

    /// One HEADERS or CONTINUATION `frame` (9-byte header included).
    fn header_frame(&mut self, ty: u8, flags: u8, stream: u32, frame: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let payload = &frame[9..];
        if ty == HEADERS {
            if self.pending.is_some() {
                return Err(bad("HTTP/2: HEADERS inside a header block"));
            }
            let mut p = payload;
            let mut pad = 0;
            if flags & PADDED != 0 {
                let (&n, rest) = p.split_first().ok_or_else(|| bad("HTTP/2: padded HEADERS too short"))?;
                pad = n as usize;
                p = rest;
            }
            let mut priority = None;
            if flags & PRIORITY != 0 {
                if p.len() < 5 {
                    return Err(bad("HTTP/2: HEADERS priority too short"));
                }
                priority = Some([p[0], p[1], p[2], p[3], p[4]]);
                p = &p[5..];
            }
            if pad > p.len() {
                return Err(bad("HTTP/2: HEADERS padding exceeds the payload"));
            }
            let frag = &p[..p.len() - pad];
            self.pending = Some(Pending {
                stream,
                end_stream: flags & END_STREAM != 0,
                priority,
                block: frag.to_vec(),
                raw: frame.to_vec(),
            });
        } else {
            let p = self.pending.as_mut().ok_or_else(|| bad("HTTP/2: CONTINUATION without HEADERS"))?;
            if p.stream != stream {
                return Err(bad("HTTP/2: CONTINUATION on another stream"));
            }
            if p.block.len() + payload.len() > MAX_BLOCK {
                return Err(bad(format!("HTTP/2: header block over {MAX_BLOCK} bytes")));
            }
            p.block.extend_from_slice(payload);
            p.raw.extend_from_slice(frame);
        }
        if flags & END_HEADERS != 0 {
            let p = self.pending.take().expect("pending header block");
            self.finish(p, out)?;
        }
        Ok(())
    }

    fn finish(&mut self, p: Pending, out: &mut Vec<u8>) -> io::Result<()> {
        if std::mem::take(&mut self.first) && first_block_authority(&p.block) == Some(true) {
            // The server decodes this block itself, from the same HPACK state as the client's
            // encoder: from here on nothing needs to be looked at (F12).
            out.extend_from_slice(&p.raw);
            self.stage = Stage::Transparent;
            return Ok(());
        }
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(&p.block, |n, v| {
                size += n.len() + v.len() + 32;
                if size <= MAX_BLOCK {
                    fields.push((n.into_owned(), v.into_owned()));
                }
            })
            .map_err(|e| bad(format!("HPACK: {e:?}")))?;
        if size > MAX_BLOCK {
            return Err(bad(format!("HTTP/2: decoded header list over {MAX_BLOCK} bytes")));
        }
        let mut block = Vec::with_capacity(p.block.len() + 64);
        for (n, v) in &fields {
            let v: &[u8] = if n.as_slice() == b":authority" && ::http::uri::Authority::try_from(v.as_slice()).is_err() {
                self.rewritten += 1;
                tracing::debug!(authority = %String::from_utf8_lossy(v), "gRPC client sent an invalid :authority; using {REPLACEMENT}");
                REPLACEMENT.as_bytes()
            } else {
                v
            };
            // Literal header field without indexing, new name (RFC 7541 §6.2.2).
            block.push(0);
            hpack_string(n, &mut block);
            hpack_string(v, &mut block);
        }
        let prio = p.priority.map(|x| x.to_vec()).unwrap_or_default();
        let first = (OUT_FRAME - prio.len()).min(block.len());
        let mut flags = if p.end_stream { END_STREAM } else { 0 };
        if p.priority.is_some() {
            flags |= PRIORITY;
        }
        if first == block.len() {
            flags |= END_HEADERS;
        }
        frame_header(prio.len() + first, HEADERS, flags, p.stream, out);
        out.extend_from_slice(&prio);
        out.extend_from_slice(&block[..first]);
        let mut rest = &block[first..];
        while !rest.is_empty() {
            let n = rest.len().min(OUT_FRAME);
            let f = if n == rest.len() { END_HEADERS } else { 0 };
            frame_header(n, CONTINUATION, f, p.stream, out);
            out.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
        }
        Ok(())
    }
}

/// An HPACK integer with an `n`-bit prefix at the start of `b` (RFC 7541 §5.1): (value,
/// bytes used); `None` when truncated or over `usize`.
fn hpack_integer(b: &[u8], n: u8) -> Option<(usize, usize)> {
    let max = (1usize << n) - 1;
    let mut v = (*b.first()? as usize) & max;
    if v < max {
        return Some((v, 1));
    }
    let mut shift = 0u32;
    for (i, &x) in b[1..].iter().enumerate() {
        v = v.checked_add(((x & 0x7f) as usize).checked_shl(shift).filter(|_| shift < 57)?)?;
        if x & 0x80 == 0 {
            return Some((v, i + 2));
        }
        shift += 7;
    }
    None
}

thread_local! {
    /// One Huffman decoder per thread, built on first use: `HuffmanDecoder::new` builds a
    /// two-level `HashMap` of the 257 codes (RFC 7541 Appendix B), which cost ~5 % of the
    /// agent's CPU per Ensure+fd when built for every connection's `:authority` (decision F17).
    /// `decode` keeps no state between calls (it only reads the table).
    static HUFFMAN: std::cell::RefCell<loona_hpack::huffman::HuffmanDecoder> =
        std::cell::RefCell::new(loona_hpack::huffman::HuffmanDecoder::new());
}

/// An HPACK string literal at the start of `b` (RFC 7541 §5.2), Huffman-decoded when so coded:
/// (octets, bytes used).
fn hpack_literal(b: &[u8]) -> Option<(std::borrow::Cow<'_, [u8]>, usize)> {
    let (len, n) = hpack_integer(b, 7)?;
    let raw = b.get(n..n.checked_add(len)?)?;
    let s = if b[0] & 0x80 != 0 {
        std::borrow::Cow::Owned(HUFFMAN.with_borrow_mut(|d| d.decode(raw)).ok()?)
    } else {
        std::borrow::Cow::Borrowed(raw)
    };
    Some((s, n + len))
}

/// The verdict on the first header block of a connection without decoding it whole: walks
/// the field representations (RFC 7541 §6) up to the first `:authority` and checks only its
/// value. `Some(true)`: valid, or no `:authority`; `Some(false)`: invalid; `None`: the walk
/// cannot tell (a dynamic table reference, malformed): decode the block.
fn first_block_authority(block: &[u8]) -> Option<bool> {
    /// Static table index of `:authority` (RFC 7541 Appendix A); 61 entries in all.
    const AUTHORITY: usize = 1;
    const STATIC: usize = 61;
    let valid = |v: &[u8]| ::http::uri::Authority::try_from(v).is_ok();
    let mut b = block;
    while let Some(&first) = b.first() {
        if first & 0x80 != 0 {
            // Indexed field: a static entry's value, `:authority` only with an empty value.
            let (idx, n) = hpack_integer(b, 7)?;
            match idx {
                AUTHORITY => return Some(valid(b"")),
                2..=STATIC => b = &b[n..],
                _ => return None,
            }
            continue;
        }
        let prefix = match first {
            // Dynamic table size update.
            0x20..=0x3f => {
                b = &b[hpack_integer(b, 5)?.1..];
                continue;
            }
            // Literal with incremental indexing; else without / never indexed.
            0x40..=0x7f => 6,
            _ => 4,
        };
        let (idx, n) = hpack_integer(b, prefix)?;
        b = &b[n..];
        let authority = match idx {
            0 => {
                let (name, n) = hpack_literal(b)?;
                b = &b[n..];
                &*name == b":authority"
            }
            AUTHORITY => true,
            2..=STATIC => false,
            _ => return None,
        };
        if authority {
            return Some(valid(&hpack_literal(b)?.0));
        }
        let (len, n) = hpack_integer(b, 7)?;
        b = b.get(n.checked_add(len)?..)?;
    }
    Some(true)
}

/// A server-side connection whose client→server bytes go through a [`Rewriter`].
pub struct NormalizeAuthority<S> {
    inner: S,
    rw: Rewriter,
    out: Vec<u8>,
    out_at: usize,
}

impl<S> NormalizeAuthority<S> {
    /// Wraps an accepted connection.
    pub fn new(inner: S) -> Self {
        Self { inner, rw: Rewriter::new(), out: Vec::new(), out_at: 0 }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for NormalizeAuthority<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        loop {
            if me.out_at < me.out.len() {
                let n = buf.remaining().min(me.out.len() - me.out_at);
                buf.put_slice(&me.out[me.out_at..me.out_at + n]);
                me.out_at += n;
                if me.out_at == me.out.len() {
                    me.out.clear();
                    me.out_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if me.rw.passing_through() {
                // Nothing held back and nothing left to look at: straight into the caller's buffer.
                return Pin::new(&mut me.inner).poll_read(cx, buf);
            }
            let mut raw = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut raw);
            match Pin::new(&mut me.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    if rb.filled().is_empty() {
                        return Poll::Ready(Ok(())); // EOF
                    }
                    me.rw.feed(rb.filled(), &mut me.out)?;
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for NormalizeAuthority<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for NormalizeAuthority<tokio::net::UnixStream> {
    type ConnectInfo = tonic::transport::server::UdsConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers_frame(stream: u32, block: &[u8], flags: u8) -> Vec<u8> {
        let mut f = Vec::new();
        frame_header(block.len(), HEADERS, flags, stream, &mut f);
        f.extend_from_slice(block);
        f
    }

    /// Splits server-bound bytes into (type, flags, stream, payload) frames after the preface.
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert!(b.starts_with(PREFACE));
        b = &b[PREFACE.len()..];
        let mut v = Vec::new();
        while !b.is_empty() {
            let len = u32::from_be_bytes([0, b[0], b[1], b[2]]) as usize;
            v.push((b[3], b[4], u32::from_be_bytes([b[5], b[6], b[7], b[8]]), b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        v
    }

    #[test]
    fn rewrites_path_authorities_keeps_other_frames_and_the_table_in_step() {
        let mut enc = loona_hpack::Encoder::new();
        let req = |auth: &str| {
            vec![
                (b":method".to_vec(), b"POST".to_vec()),
                (b":scheme".to_vec(), b"http".to_vec()),
                (b":path".to_vec(), b"/svc/M".to_vec()),
                (b":authority".to_vec(), auth.as_bytes().to_vec()),
                (b"te".to_vec(), b"trailers".to_vec()),
            ]
        };
        // grpcio style (%-encoded path) then, with the client's dynamic table now holding
        // entries, a second request that references them (loona's encoder indexes).
        let r1 = req("%2Ftmp%2Fcube%2Fgrpc.sock");
        let b1 = enc.encode(r1.iter().map(|(n, v)| (&n[..], &v[..])));
        let b2 = enc.encode(r1.iter().map(|(n, v)| (&n[..], &v[..])));
        assert!(b2.len() < b1.len(), "second block must use the dynamic table");
        let r3 = req("localhost:50051");
        let b3 = enc.encode(r3.iter().map(|(n, v)| (&n[..], &v[..])));
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(1, &b1, END_HEADERS));
        // A DATA frame passes unchanged.
        input.extend([0, 0, 3, 0, 1, 0, 0, 0, 1, b'a', b'b', b'c']);
        // Second request: split across HEADERS + CONTINUATION, padded, with priority.
        let (h, c) = b2.split_at(b2.len() / 2);
        let mut p = vec![2u8]; // pad length
        p.extend([0, 0, 0, 0, 16]); // priority
        p.extend_from_slice(h);
        p.extend([0, 0]);
        input.extend(headers_frame(3, &p, PADDED | PRIORITY | END_STREAM));
        let mut cont = Vec::new();
        frame_header(c.len(), CONTINUATION, END_HEADERS, 3, &mut cont);
        cont.extend_from_slice(c);
        input.extend(cont);
        input.extend(headers_frame(5, &b3, END_HEADERS));

        // Fed one byte at a time: framing state survives every split.
        let mut rw = Rewriter::new();
        let mut out = Vec::new();
        for b in &input {
            rw.feed(std::slice::from_ref(b), &mut out).unwrap();
        }
        assert_eq!(rw.rewritten, 2);
        let f = frames(&out);
        assert_eq!(f.len(), 4, "{f:?}");
        let mut dec = loona_hpack::Decoder::new();
        let auth = |dec: &mut loona_hpack::Decoder, p: &[u8]| {
            let h = dec.decode(p).unwrap();
            assert_eq!(h.len(), 5);
            String::from_utf8(h.iter().find(|(n, _)| n == b":authority").unwrap().1.clone()).unwrap()
        };
        assert_eq!((f[0].0, f[0].1, f[0].2), (HEADERS, END_HEADERS, 1));
        assert_eq!(auth(&mut dec, &f[0].3), "localhost");
        assert_eq!(f[1], (0, 1, 1, b"abc".to_vec()));
        assert_eq!((f[2].0, f[2].1, f[2].2), (HEADERS, END_HEADERS | END_STREAM | PRIORITY, 3));
        assert_eq!(&f[2].3[..5], &[0, 0, 0, 0, 16]);
        assert_eq!(auth(&mut dec, &f[2].3[5..]), "localhost");
        assert_eq!(auth(&mut dec, &f[3].3), "localhost:50051");
    }

    #[test]
    fn big_blocks_are_reframed_and_bombs_refused() {
        let mut enc = loona_hpack::Encoder::new();
        let big = vec![b'x'; 40_000];
        let hs = [(&b":authority"[..], &b"/raw/path.sock"[..]), (&b"x-big"[..], &big[..])];
        let b = enc.encode(hs.iter().copied());
        let mut input = PREFACE.to_vec();
        // 3 frames in: HEADERS + 2 CONTINUATION.
        let parts: Vec<&[u8]> = b.chunks(16_000).collect();
        input.extend(headers_frame(1, parts[0], 0));
        for (i, c) in parts[1..].iter().enumerate() {
            frame_header(c.len(), CONTINUATION, if i + 2 == parts.len() { END_HEADERS } else { 0 }, 1, &mut input);
            input.extend_from_slice(c);
        }
        let mut out = Vec::new();
        Rewriter::new().feed(&input, &mut out).unwrap();
        let f = frames(&out);
        assert!(f.iter().all(|x| x.3.len() <= OUT_FRAME));
        assert_eq!(f[0].0, HEADERS);
        assert!(f[1..].iter().all(|x| x.0 == CONTINUATION));
        assert_eq!(f.last().unwrap().1, END_HEADERS);
        let block: Vec<u8> = f.iter().flat_map(|x| x.3.clone()).collect();
        let h = loona_hpack::Decoder::new().decode(&block).unwrap();
        assert_eq!(h[0].1, b"localhost");
        assert_eq!(h[1].1.len(), 40_000);

        // An HPACK bomb: one 4 KiB table entry referenced thousands of times.
        let mut bomb = vec![0x40];
        hpack_string(b"x-b", &mut bomb);
        hpack_string(&[b'y'; 4000], &mut bomb);
        bomb.extend(std::iter::repeat_n(0x80 | 62, 100));
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(1, &bomb, END_HEADERS));
        assert!(Rewriter::new().feed(&input, &mut Vec::new()).is_err());
        // A frame between HEADERS and its CONTINUATION.
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(1, &[0x82], 0));
        input.extend([0, 0, 0, 4, 0, 0, 0, 0, 0]);
        assert!(Rewriter::new().feed(&input, &mut Vec::new()).is_err());
    }

    /// The header block of a gRPC Health/Check call with `:authority` = `auth`, encoded by
    /// `enc` (HPACK indexing on, as grpc-java and gRPC core encode).
    fn check_block(enc: &mut loona_hpack::Encoder, auth: &[u8]) -> Vec<u8> {
        let hs: [(&[u8], &[u8]); 6] = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/grpc.health.v1.Health/Check"),
            (b":authority", auth),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ];
        enc.encode(hs)
    }

    /// Two gRPC Health/Check calls on one connection, written frame by frame as grpc-java
    /// writes them on a Unix socket (`:authority` = the socket path, HPACK indexing on).
    /// Returns per call `Ok(grpc-status)` or `Err(RST_STREAM error code)`.
    async fn raw_calls(sock: &std::path::Path) -> Vec<Result<String, u32>> {
        let mut enc = loona_hpack::Encoder::new();
        let auth = sock.to_str().unwrap().as_bytes();
        let blocks = [check_block(&mut enc, auth), check_block(&mut enc, auth)];
        exchange(sock, &blocks).await
    }

    /// One call per header block on one connection (streams 1, 3, ...; each followed by an
    /// empty HealthCheckRequest). Per call: `Ok(grpc-status)`, `Err(RST_STREAM error code)`,
    /// `Err(:status)` of a response without `grpc-status`, or `Err(u32::MAX)` when the server
    /// went away (GOAWAY, EOF) before answering it.
    async fn exchange(sock: &std::path::Path, blocks: &[Vec<u8>]) -> Vec<Result<String, u32>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut c = tokio::net::UnixStream::connect(sock).await.unwrap();
        let mut w = PREFACE.to_vec();
        frame_header(0, 0x4, 0, 0, &mut w); // SETTINGS
        let streams: Vec<u32> = (0..blocks.len() as u32).map(|i| 2 * i + 1).collect();
        for (&stream, block) in streams.iter().zip(blocks) {
            frame_header(block.len(), HEADERS, END_HEADERS, stream, &mut w);
            w.extend(block);
            frame_header(5, 0x0, END_STREAM, stream, &mut w); // DATA: empty HealthCheckRequest
            w.extend([0u8; 5]);
        }
        c.write_all(&w).await.unwrap();
        let mut dec = loona_hpack::Decoder::new();
        let mut res: std::collections::BTreeMap<u32, Result<String, u32>> = Default::default();
        let mut buf = Vec::new();
        'read: while res.len() < blocks.len() {
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(std::time::Duration::from_secs(5), c.read(&mut chunk))
                .await
                .expect("server answered within 5 s")
                .unwrap_or(0);
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            while buf.len() >= 9 {
                let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
                if buf.len() < 9 + len {
                    break;
                }
                let (ty, flags) = (buf[3], buf[4]);
                let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]);
                let payload: Vec<u8> = buf.drain(..9 + len).skip(9).collect();
                match ty {
                    0x4 if flags & 1 == 0 => {
                        let mut ack = Vec::new();
                        frame_header(0, 0x4, 1, 0, &mut ack);
                        // The server may already have closed (after a GOAWAY still unread).
                        let _ = c.write_all(&ack).await;
                    }
                    0x3 => {
                        res.insert(stream, Err(u32::from_be_bytes(payload[..4].try_into().unwrap())));
                    }
                    0x7 => break 'read, // GOAWAY
                    HEADERS => {
                        let h = dec.decode(&payload).unwrap();
                        if let Some((_, v)) = h.iter().find(|(n, _)| n == b"grpc-status") {
                            res.insert(stream, Ok(String::from_utf8(v.clone()).unwrap()));
                        } else if flags & END_STREAM != 0 {
                            let st = h.iter().find(|(n, _)| n == b":status").map(|(_, v)| v.clone());
                            let st = st.and_then(|v| String::from_utf8(v).ok()?.parse().ok());
                            res.insert(stream, Err(st.unwrap_or(0)));
                        }
                    }
                    _ => {}
                }
            }
        }
        streams.iter().map(|s| res.remove(s).unwrap_or(Err(u32::MAX))).collect()
    }

    async fn serve(sock: &std::path::Path, normalise: bool) {
        use tokio_stream::{StreamExt, wrappers::UnixListenerStream};
        let _ = std::fs::remove_file(sock);
        let l = tokio::net::UnixListener::bind(sock).unwrap();
        let (_, health) = tonic_health::server::health_reporter();
        let router = tonic::transport::Server::builder().add_service(health);
        if normalise {
            let incoming = UnixListenerStream::new(l).map(|s| s.map(NormalizeAuthority::new));
            tokio::spawn(router.serve_with_incoming(incoming));
        } else {
            tokio::spawn(router.serve_with_incoming(UnixListenerStream::new(l)));
        }
    }

    #[tokio::test]
    async fn tonic_serves_a_socket_path_authority_only_through_the_normaliser() {
        let dir = std::env::temp_dir().join(format!("cubenet-uds-authority-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (bare, fixed) = (dir.join("bare.sock"), dir.join("fixed.sock"));
        serve(&bare, false).await;
        serve(&fixed, true).await;
        // The cause: h2 resets the stream (PROTOCOL_ERROR = 1). Should h2 ever accept any
        // authority, this fails and the normaliser can go.
        assert_eq!(raw_calls(&bare).await, vec![Err(1), Err(1)]);
        assert_eq!(raw_calls(&fixed).await, vec![Ok("0".to_string()), Ok("0".to_string())]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Attack on the pass-through (F12): a connection whose first request has a valid
    /// `:authority` is no longer looked at, so its next block carries a socket-path authority
    /// and, on another such connection, an HPACK bomb (one 4 KiB entry referenced 100 times:
    /// ~400 KB decoded). The server's own checks answer them: the path gets h2's PROTOCOL_ERROR
    /// as without the wrapper, the bomb is refused (never served), and the server keeps
    /// serving.
    #[tokio::test]
    async fn a_passed_through_connection_meets_the_servers_own_limits() {
        let dir = std::env::temp_dir().join(format!("cubenet-uds-passthrough-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("fixed.sock");
        serve(&sock, true).await;
        let mut enc = loona_hpack::Encoder::new();
        let first = check_block(&mut enc, b"localhost");
        let bad = check_block(&mut enc, sock.to_str().unwrap().as_bytes());
        // Indexes a 4 KiB entry (evicting the rest of the table), then references it.
        let mut bomb = vec![0x40];
        hpack_string(b"x-b", &mut bomb);
        hpack_string(&[b'y'; 4000], &mut bomb);
        bomb.extend(std::iter::repeat_n(0x80 | 62, 100));
        let r = exchange(&sock, &[first.clone(), bad]).await;
        assert_eq!(r, vec![Ok("0".to_string()), Err(1)], "h2 refuses the path authority itself");
        // The bomb is a connection error for h2: the connection goes, its first call with it.
        let r = exchange(&sock, &[first, bomb]).await;
        assert!(r[1].is_err(), "the bomb was served: {r:?}");
        // A fresh connection (first authority invalid: rewritten) still works.
        assert_eq!(raw_calls(&sock).await, vec![Ok("0".to_string()), Ok("0".to_string())]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// RFC 7541 C.4.1 and C.4.2: two requests as an encoder with Huffman coding and indexing
    /// writes them (`:authority www.example.com`, then a dynamic table reference).
    const RFC_C41: &[u8] =
        &[0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff];
    const RFC_C42: &[u8] = &[0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf];

    #[test]
    fn first_block_verdict_reads_only_up_to_the_authority() {
        assert_eq!(first_block_authority(RFC_C41), Some(true));
        // RFC 7541 C.3.1: the same without Huffman coding.
        let mut raw = vec![0x82, 0x86, 0x84, 0x41, 0x0f];
        raw.extend_from_slice(b"www.example.com");
        assert_eq!(first_block_authority(&raw), Some(true));
        // No :authority at all: nothing to rewrite.
        assert_eq!(first_block_authority(&[0x82, 0x86, 0x84]), Some(true));
        // The static entry (empty value), a socket path by name index, by a literal name after
        // another literal field, never-indexed.
        assert_eq!(first_block_authority(&[0x82, 0x81]), Some(false));
        let lit = |first: u8, name: Option<&[u8]>, v: &[u8]| {
            let mut b = vec![first];
            if let Some(n) = name {
                hpack_string(n, &mut b);
            }
            hpack_string(v, &mut b);
            b
        };
        assert_eq!(first_block_authority(&lit(0x41, None, b"%2Ftmp%2Fcube%2Fgrpc.sock")), Some(false));
        let mut b = lit(0x00, Some(b"x-a"), b"/not/the/authority");
        b.extend(lit(0x00, Some(b":authority"), b"/tmp/grpc.sock"));
        assert_eq!(first_block_authority(&b), Some(false));
        assert_eq!(first_block_authority(&lit(0x11, None, b"localhost")), Some(true));
        // A dynamic table reference before the authority, truncated blocks: decode instead.
        assert_eq!(first_block_authority(RFC_C42), None);
        assert_eq!(first_block_authority(&RFC_C41[..10]), None);
        assert_eq!(first_block_authority(&[0x82, 0x7f]), None);
    }

    #[test]
    fn a_valid_first_authority_passes_the_connection_through_byte_for_byte() {
        let mut input = PREFACE.to_vec();
        frame_header(0, 0x4, 0, 0, &mut input); // SETTINGS
        // First block split over HEADERS + CONTINUATION, padded.
        let (h, c) = RFC_C41.split_at(7);
        let mut p = vec![1u8];
        p.extend_from_slice(h);
        p.push(0);
        input.extend(headers_frame(1, &p, PADDED));
        frame_header(c.len(), CONTINUATION, END_HEADERS, 1, &mut input);
        input.extend_from_slice(c);
        input.extend(headers_frame(3, RFC_C42, END_HEADERS | END_STREAM));
        // Later blocks are the server's to judge, even an invalid authority.
        input.extend(headers_frame(5, &[0x82, 0x81], END_HEADERS));
        for chunk in [1, 5, input.len()] {
            let mut rw = Rewriter::new();
            let mut out = Vec::new();
            for piece in input.chunks(chunk) {
                rw.feed(piece, &mut out).unwrap();
            }
            assert_eq!(out, input, "fed in pieces of {chunk}");
            assert!(rw.passing_through());
            assert_eq!(rw.rewritten, 0);
        }
        // The same second block after a first one that needed a rewrite is re-encoded.
        let mut rw = Rewriter::new();
        let mut out = Vec::new();
        let mut input = PREFACE.to_vec();
        let mut first = vec![0x82, 0x86, 0x84, 0x41];
        hpack_string(b"/tmp/grpc.sock", &mut first);
        input.extend(headers_frame(1, &first, END_HEADERS));
        input.extend(headers_frame(3, RFC_C42, END_HEADERS));
        rw.feed(&input, &mut out).unwrap();
        assert!(!rw.passing_through());
        assert_eq!(rw.rewritten, 2);
        let f = frames(&out);
        let mut dec = loona_hpack::Decoder::new();
        let h1 = dec.decode(&f[0].3).unwrap();
        assert!(h1.contains(&(b":authority".to_vec(), b"localhost".to_vec())));
        // C.4.2 refers to the `:authority` the first block indexed: resolved here, sent literal.
        let h2 = dec.decode(&f[1].3).unwrap();
        assert!(h2.contains(&(b":authority".to_vec(), b"localhost".to_vec())), "{h2:?}");
        assert!(h2.contains(&(b"cache-control".to_vec(), b"no-cache".to_vec())));
    }

    #[test]
    fn non_http2_streams_pass_unchanged() {
        let mut out = Vec::new();
        let mut rw = Rewriter::new();
        rw.feed(b"PRI * HTTP/1.1", &mut out).unwrap();
        rw.feed(b"\r\nrest", &mut out).unwrap();
        assert_eq!(out, b"PRI * HTTP/1.1\r\nrest");
    }
}
