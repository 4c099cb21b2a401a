//! Per-packet TCP tracking of a session: the nf_conntrack state machine
//! (`cubevs_common::conntrack::tcp_step`) plus per-direction sequence tracking, so that an RST
//! changes the state only when it is inside the tracked window (decision D21).

use cubevs_common::{
    NatSession,
    conntrack::{
        Dir,
        flags::{ACK, RST},
        rst_in_window, tcp, tcp_step, track,
    },
};

use crate::packet::{Ipv4, L4, tcp_seg_len};

/// Applies the TCP segment (`ip`, `l4`) travelling in `dir` to the session `s`. With `reopen`
/// (a guest SYN reusing the 5-tuple of a finished connection) the session restarts in
/// SYN_SENT and forgets both directions' sequence tracking.
///
/// Returns `false`, leaving the session untouched, for an RST outside the tracked window.
#[inline(always)]
pub fn tcp_segment(s: *mut NatSession, dir: Dir, ip: &Ipv4, l4: &L4, reopen: bool) -> bool {
    let d = dir as usize & 1;
    let o = d ^ 1;
    let (bit_d, bit_o) = (1u8 << d, 1u8 << o);
    // SAFETY: `s` is a valid map value pointer; indexes are masked to 0..=1.
    unsafe {
        if l4.tcp_flags & RST != 0 {
            let ack = if l4.tcp_flags & ACK != 0 { Some(l4.ack) } else { None };
            let seen = (*s).td_seen;
            if !rst_in_window(
                l4.seq,
                ack,
                seen & bit_d != 0,
                (*s).td_end[d],
                seen & bit_o != 0,
                (*s).td_end[o],
                (*s).td_maxwin[o],
            ) {
                return false;
            }
        }
        if reopen {
            (*s).td_seen = 0;
        }
        let seen = (*s).td_seen & bit_d != 0;
        let (end, win) = track(seen, (*s).td_end[d], (*s).td_maxwin[d], l4.seq, tcp_seg_len(ip, l4), l4.win);
        (*s).td_end[d] = end;
        (*s).td_maxwin[d] = win;
        (*s).td_seen |= bit_d;
        if reopen {
            (*s).state = tcp::SYN_SENT;
            (*s).close_dir = 0;
            (*s).active_close = 0;
        } else {
            let st = tcp_step((*s).state, (*s).close_dir, (*s).active_close, dir, l4.tcp_flags);
            (*s).state = st.state;
            (*s).close_dir = st.close_dir;
            (*s).active_close = st.active_close;
        }
    }
    true
}

/// True when a guest SYN (no other flag) on a session in `state` starts a new connection on
/// the same 5-tuple: any state past the handshake (decisions D15, D24).
#[inline(always)]
pub fn is_reopen(state: u8) -> bool {
    (tcp::ESTABLISHED..=tcp::CLOSE).contains(&state)
}
