//! Connection tracking: the TCP state machine (after Linux nf_conntrack's
//! `tcp_conntracks[2][6][10]` table, `reference/upstream.md §3.5`), UDP/ICMP states and the
//! per-state idle timeouts the userspace reaper applies.
//!
//! Pure functions, shared by the datapath (per packet) and userspace (tests, dumps).

/// Packet class of a session: plain SNAT.
pub const CLASS_SNAT: u8 = 0;
/// Packet class of a session: steered unchanged to CubeEgress (L7), no SNAT.
pub const CLASS_L7: u8 = 1;

/// Direction of a packet relative to its session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Dir {
    /// Guest → world (the direction that opened the session).
    Original = 0,
    /// World → guest.
    Reply = 1,
}

/// TCP conntrack states (nf_conntrack numbering).
pub mod tcp {
    /// No state yet.
    pub const NONE: u8 = 0;
    /// SYN seen from the original side.
    pub const SYN_SENT: u8 = 1;
    /// SYN-ACK seen from the reply side.
    pub const SYN_RECV: u8 = 2;
    /// Three-way handshake complete.
    pub const ESTABLISHED: u8 = 3;
    /// First FIN seen.
    pub const FIN_WAIT: u8 = 4;
    /// First FIN acknowledged by the other side.
    pub const CLOSE_WAIT: u8 = 5;
    /// Second FIN seen.
    pub const LAST_ACK: u8 = 6;
    /// Second FIN acknowledged.
    pub const TIME_WAIT: u8 = 7;
    /// Reset or closed.
    pub const CLOSE: u8 = 8;
    /// Simultaneous open (SYN from both sides).
    pub const SYN_SENT2: u8 = 9;
    /// Number of states.
    pub const MAX: u8 = 10;
    /// Table marker: invalid transition (state unchanged).
    pub const INVALID: u8 = 10;
    /// Table marker: ignored packet (state unchanged).
    pub const IGNORE: u8 = 11;

    /// Lower-case name as dumps print it.
    pub const fn name(state: u8) -> &'static str {
        match state {
            NONE => "none",
            SYN_SENT => "syn_sent",
            SYN_RECV => "syn_recv",
            ESTABLISHED => "established",
            FIN_WAIT => "fin_wait",
            CLOSE_WAIT => "close_wait",
            LAST_ACK => "last_ack",
            TIME_WAIT => "time_wait",
            CLOSE => "close",
            SYN_SENT2 => "syn_sent2",
            _ => "invalid",
        }
    }
}

/// UDP and ICMP session states, numbered as upstream (`reference/upstream.md §3.5`): a tool
/// reading the pinned `egress_sessions` map sees the same values for the same meaning.
pub mod udp {
    /// Only the original direction has been seen (upstream 0).
    pub const UNREPLIED: u8 = 0;
    /// A reply has been seen (upstream 1).
    pub const REPLIED: u8 = 1;

    /// Lower-case name as dumps print it.
    pub const fn name(state: u8) -> &'static str {
        match state {
            UNREPLIED => "unreplied",
            REPLIED => "replied",
            _ => "invalid",
        }
    }
}

/// TCP flag bits as they appear in byte 13 of the TCP header.
pub mod flags {
    /// FIN.
    pub const FIN: u8 = 0x01;
    /// SYN.
    pub const SYN: u8 = 0x02;
    /// RST.
    pub const RST: u8 = 0x04;
    /// ACK.
    pub const ACK: u8 = 0x10;
}

/// Row of the transition table for a packet's flags (nf_conntrack `get_conntrack_index`):
/// 0 syn, 1 synack, 2 fin, 3 ack, 4 rst, 5 none.
#[inline(always)]
pub const fn flag_index(tcp_flags: u8) -> usize {
    if tcp_flags & flags::RST != 0 {
        4
    } else if tcp_flags & flags::SYN != 0 {
        if tcp_flags & flags::ACK != 0 { 1 } else { 0 }
    } else if tcp_flags & flags::FIN != 0 {
        2
    } else if tcp_flags & flags::ACK != 0 {
        3
    } else {
        5
    }
}

use tcp::{
    CLOSE as CL, CLOSE_WAIT as CW, ESTABLISHED as ES, FIN_WAIT as FW, IGNORE as IG, INVALID as IV, LAST_ACK as LA,
    SYN_RECV as SR, SYN_SENT as SS, SYN_SENT2 as S2, TIME_WAIT as TW,
};

/// `TABLE[dir][flag_index][state]`, columns NONE, SYN_SENT, SYN_RECV, ESTABLISHED, FIN_WAIT,
/// CLOSE_WAIT, LAST_ACK, TIME_WAIT, CLOSE, SYN_SENT2, then 6 padding columns (invalid) so the
/// datapath can index with `state & 15`, a bound the BPF verifier always sees.
const TABLE: [[[u8; 16]; 6]; 2] = [
    [
        // ORIGINAL
        [SS, SS, IG, IG, IG, IG, IG, SS, SS, S2, IV, IV, IV, IV, IV, IV], // syn
        [IV, IV, SR, IV, IV, IV, IV, IV, IV, SR, IV, IV, IV, IV, IV, IV], // synack
        [IV, IV, FW, FW, LA, LA, LA, TW, CL, IV, IV, IV, IV, IV, IV, IV], // fin
        [ES, IV, ES, ES, CW, CW, TW, TW, CL, IV, IV, IV, IV, IV, IV, IV], // ack
        [IV, CL, CL, CL, CL, CL, CL, CL, CL, CL, IV, IV, IV, IV, IV, IV], // rst
        [IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV], // none
    ],
    [
        // REPLY
        [IV, S2, IV, IV, IV, IV, IV, SS, IV, S2, IV, IV, IV, IV, IV, IV], // syn
        [IV, SR, IG, IG, IG, IG, IG, IG, IG, SR, IV, IV, IV, IV, IV, IV], // synack
        [IV, IV, FW, FW, LA, LA, LA, TW, CL, IV, IV, IV, IV, IV, IV, IV], // fin
        [IV, IG, SR, ES, CW, CW, TW, TW, CL, IG, IV, IV, IV, IV, IV, IV], // ack
        [IV, CL, CL, CL, CL, CL, CL, CL, CL, CL, IV, IV, IV, IV, IV, IV], // rst
        [IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV, IV], // none
    ],
];

/// Outcome of one TCP packet on a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpStep {
    /// New state (unchanged on invalid/ignored packets).
    pub state: u8,
    /// New `close_dir` (0 none, 1 original, 2 reply): who sent the first FIN.
    pub close_dir: u8,
    /// New `active_close`: 1 once the original side's FIN moved the session into FIN_WAIT.
    pub active_close: u8,
}

/// Applies one packet with `tcp_flags` travelling in `dir` to a session in `state`.
///
/// On top of the nf_conntrack table: a FIN retransmitted by the side that closed first keeps
/// FIN_WAIT / CLOSE_WAIT instead of advancing to LAST_ACK (`reference/upstream.md §3.5`).
#[inline(always)]
pub fn tcp_step(state: u8, close_dir: u8, active_close: u8, dir: Dir, tcp_flags: u8) -> TcpStep {
    let same = TcpStep { state, close_dir, active_close };
    // No early `state >= MAX` return: the compiler would then drop the mask below, and the
    // verifier (which may lose the bound across a stack spill) would reject the table access.
    // States 10..15 are padding columns (invalid), so masking is exact for every stored state.
    let idx = flag_index(tcp_flags);
    let dir_code = dir as u8 + 1;
    if idx == 2 && close_dir == dir_code && (state == FW || state == CW) {
        return same;
    }
    let next = TABLE[dir as usize & 1][idx][(state & 15) as usize];
    if next == IV || next == IG {
        return same;
    }
    let mut out = TcpStep { state: next, close_dir, active_close };
    if next == FW && state != FW && close_dir == 0 {
        out.close_dir = dir_code;
        if dir == Dir::Original {
            out.active_close = 1;
        }
    }
    out
}

/// Window scale assumed for a raw advertised window when the RST window is computed: the
/// datapath does not parse TCP options, and 7 is what Linux advertises with its default buffer
/// sizes. A peer scaling by more, with more than `maxwin << 7` bytes in flight, may see a
/// legitimate RST judged out of window: it is then handled as such (decision D21).
pub const ASSUMED_WSCALE: u32 = 7;

/// True when `a` is after `b` in sequence space (RFC 793 modular comparison).
#[inline(always)]
pub const fn seq_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// Sequence tracking of one direction after a segment: `(end, maxwin)` become the highest
/// `seq + len` (`len` counts payload, SYN and FIN) and the largest raw window, as nf_conntrack's
/// `td_end` / `td_maxwin`. `seen` says whether `end` / `maxwin` hold anything yet.
#[inline(always)]
pub const fn track(seen: bool, end: u32, maxwin: u32, seq: u32, len: u32, win: u16) -> (u32, u32) {
    let new_end = seq.wrapping_add(len);
    let end = if !seen || seq_after(new_end, end) { new_end } else { end };
    let win = win as u32;
    let maxwin = if !seen || win > maxwin { win } else { maxwin };
    (end, maxwin)
}

/// True when an RST with sequence number `seq` is inside the tracked window: the sender can
/// only reset with a sequence number the receiver still accepts, i.e. one in
/// `[sender_end - receiver_maxwin << ASSUMED_WSCALE, sender_end]` (nf_conntrack
/// `tcp_in_window`, reduced to the RST case). When nothing was seen from the sender yet (an RST
/// answering a SYN), the RST must carry an ACK of exactly `receiver_end` (what the SYN side
/// sent).
#[inline(always)]
pub const fn rst_in_window(
    seq: u32,
    ack: Option<u32>,
    sender_seen: bool,
    sender_end: u32,
    receiver_seen: bool,
    receiver_end: u32,
    receiver_maxwin: u32,
) -> bool {
    if !sender_seen {
        return match ack {
            Some(a) => receiver_seen && a == receiver_end,
            None => false,
        };
    }
    let mut win = receiver_maxwin;
    if win == 0 {
        win = 1;
    }
    let win = (win as u64) << ASSUMED_WSCALE;
    (sender_end.wrapping_sub(seq) as u64) <= win
}

/// Idle timeouts (ns) of the reaper (`reference/upstream.md §3.5`).
pub mod timeout {
    const S: u64 = 1_000_000_000;
    /// SYN_SENT, SYN_RECV, SYN_SENT2, CLOSE_WAIT: 1 min.
    pub const TCP_SYN: u64 = 60 * S;
    /// ESTABLISHED: 3 h.
    pub const TCP_ESTABLISHED: u64 = 3 * 3600 * S;
    /// FIN_WAIT and TIME_WAIT: 2 min.
    pub const TCP_FIN_WAIT: u64 = 120 * S;
    /// TIME_WAIT after the guest closed first: 10 s.
    pub const TCP_TIME_WAIT_ACTIVE: u64 = 10 * S;
    /// LAST_ACK: 30 s.
    pub const TCP_LAST_ACK: u64 = 30 * S;
    /// CLOSE: 10 s.
    pub const TCP_CLOSE: u64 = 10 * S;
    /// UDP without reply: 30 s.
    pub const UDP_UNREPLIED: u64 = 30 * S;
    /// UDP replied: 180 s.
    pub const UDP_REPLIED: u64 = 180 * S;
    /// ICMP echo: 30 s.
    pub const ICMP: u64 = 30 * S;
}

#[cfg(test)]
mod tests {
    use super::{Dir::*, flags::*, tcp::*, *};

    fn run(steps: &[(Dir, u8)]) -> TcpStep {
        let mut s = TcpStep { state: NONE, close_dir: 0, active_close: 0 };
        for &(d, f) in steps {
            s = tcp_step(s.state, s.close_dir, s.active_close, d, f);
        }
        s
    }

    #[test]
    fn handshake_reaches_established() {
        assert_eq!(run(&[(Original, SYN)]).state, SYN_SENT);
        assert_eq!(run(&[(Original, SYN), (Reply, SYN | ACK)]).state, SYN_RECV);
        assert_eq!(run(&[(Original, SYN), (Reply, SYN | ACK), (Original, ACK)]).state, ESTABLISHED);
    }

    #[test]
    fn guest_close_is_active_close_to_time_wait() {
        let open = [(Original, SYN), (Reply, SYN | ACK), (Original, ACK)];
        let mut v = open.to_vec();
        v.push((Original, FIN | ACK));
        let s = run(&v);
        assert_eq!((s.state, s.active_close, s.close_dir), (FIN_WAIT, 1, 1));
        // Retransmitted FIN from the guest keeps FIN_WAIT.
        v.push((Original, FIN | ACK));
        assert_eq!(run(&v).state, FIN_WAIT);
        v.push((Reply, ACK));
        assert_eq!(run(&v).state, CLOSE_WAIT);
        v.push((Original, FIN | ACK));
        assert_eq!(run(&v).state, CLOSE_WAIT, "FIN retransmit from the closer keeps CLOSE_WAIT");
        v.push((Reply, FIN | ACK));
        assert_eq!(run(&v).state, LAST_ACK);
        v.push((Original, ACK));
        let s = run(&v);
        assert_eq!((s.state, s.active_close), (TIME_WAIT, 1));
    }

    #[test]
    fn world_close_is_passive() {
        let s = run(&[(Original, SYN), (Reply, SYN | ACK), (Original, ACK), (Reply, FIN | ACK)]);
        assert_eq!((s.state, s.active_close, s.close_dir), (FIN_WAIT, 0, 2));
    }

    #[test]
    fn rst_closes_and_invalid_keeps_state() {
        assert_eq!(run(&[(Original, SYN), (Reply, RST | ACK)]).state, CLOSE);
        // A bare ACK from the reply side in SYN_SENT is ignored.
        assert_eq!(run(&[(Original, SYN), (Reply, ACK)]).state, SYN_SENT);
        // SYN on TIME_WAIT reopens (guest port reuse).
        let s = run(&[(Original, SYN), (Reply, SYN | ACK), (Original, ACK), (Original, RST)]);
        assert_eq!(s.state, CLOSE);
        assert_eq!(tcp_step(CLOSE, 0, 0, Original, SYN).state, SYN_SENT);
    }

    #[test]
    fn rst_window() {
        // Sender sent up to 1000, receiver advertised 100 (x128 = 12,800).
        assert!(rst_in_window(1000, None, true, 1000, true, 5, 100));
        assert!(rst_in_window(1000u32.wrapping_sub(12_800), None, true, 1000, true, 5, 100));
        assert!(!rst_in_window(1000u32.wrapping_sub(12_801), None, true, 1000, true, 5, 100));
        assert!(!rst_in_window(1001, None, true, 1000, true, 5, 100), "beyond what was sent");
        assert!(!rst_in_window(0x8000_0000, None, true, 1000, true, 5, 100));
        // Wrap-around.
        assert!(rst_in_window(u32::MAX - 10, None, true, 20, true, 5, 100));
        // RST answering a SYN: only with the exact ACK.
        assert!(rst_in_window(0, Some(101), false, 0, true, 101, 100));
        assert!(!rst_in_window(0, Some(102), false, 0, true, 101, 100));
        assert!(!rst_in_window(0, None, false, 0, true, 101, 100));
    }

    #[test]
    fn track_keeps_the_highest_end() {
        let (e, w) = track(false, 0, 0, 100, 1, 500);
        assert_eq!((e, w), (101, 500));
        assert_eq!(track(true, e, w, 50, 10, 200), (101, 500), "old segment");
        assert_eq!(track(true, e, w, 101, 10, 600), (111, 600));
        assert_eq!(track(true, u32::MAX - 1, 1, u32::MAX - 1, 4, 1), (2, 1), "wraps");
    }

    #[test]
    fn flag_rows() {
        assert_eq!(flag_index(SYN), 0);
        assert_eq!(flag_index(SYN | ACK), 1);
        assert_eq!(flag_index(FIN | ACK), 2);
        assert_eq!(flag_index(ACK), 3);
        assert_eq!(flag_index(RST | ACK), 4);
        assert_eq!(flag_index(0), 5);
    }
}
