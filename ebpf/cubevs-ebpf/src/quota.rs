//! Per-sandbox live-session budget (`cubevs_common::quota`, decisions Q1-Q3) and node-wide
//! reserved floor (`cubevs_common::floor`, decision Q4): `from_cube` admits a new flow only
//! while its sandbox version holds fewer than `DatapathConfig::session_budget` live sessions
//! (`session_opened - session_closed`) and, once it holds its floor or more, only while the
//! node-wide charged live sessions (`session_floor` `OPENED - CLOSED`) are below the ceiling.
//! Each session it creates is charged to both with an atomic add, and the charges are given
//! back with an atomic subtract when it deletes a charged session itself. Userspace never
//! writes `session_opened` nor the `OPENED` key.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::bindings::BPF_NOEXIST;
use cubevs_common::{QuotaKey, counter, floor};

use crate::maps::{SESSION_CLOSED, SESSION_FLOOR, SESSION_OPENED};

/// `None` when the sandbox version (`ifindex`, `version`) may open one more session, else the
/// drop counter: [`counter::CUBE_DROP_SESSION_QUOTA`] at `budget` (0 = no quota: always
/// admitted, nothing checked), [`counter::CUBE_DROP_NODE_SESSIONS`] at or over its floor while
/// the node-wide count is at the ceiling. Creates its zeroed `session_opened` entry and the
/// node `OPENED` entry on first use; when either cannot be made the flow is refused (fail
/// closed: the reaper collects the entries of released versions).
#[inline(always)]
pub fn admit(ifindex: u32, version: u32, budget: u32) -> Option<u32> {
    if budget == 0 {
        return None;
    }
    let key = QuotaKey { ifindex, version };
    let Some(opened) = get_or_create(&key) else {
        return Some(counter::CUBE_DROP_SESSION_QUOTA);
    };
    // SAFETY: plain map lookups; values are copied out.
    let closed = unsafe { SESSION_CLOSED.get(&key) }.copied().unwrap_or(0);
    // Signed: a userspace delete may be counted in `closed` a moment before the creating CPU's
    // add lands in `opened`.
    let live = opened.wrapping_sub(closed) as i64;
    if live >= budget as i64 {
        return Some(counter::CUBE_DROP_SESSION_QUOTA);
    }
    // The node entry must exist before a session is marked as charged to it.
    // SAFETY: as above.
    let node_opened = match unsafe { SESSION_FLOOR.get(&floor::OPENED) } {
        Some(v) => *v,
        None => {
            let _ = SESSION_FLOOR.insert(&floor::OPENED, &0, BPF_NOEXIST as u64);
            // SAFETY: as above.
            match unsafe { SESSION_FLOOR.get(&floor::OPENED) } {
                Some(v) => *v,
                None => return Some(counter::CUBE_DROP_NODE_SESSIONS),
            }
        }
    };
    // No limits written (userspace older than the floor): floor 0, no node-wide check.
    // SAFETY: as above.
    let (floor_n, ceiling) = unsafe { SESSION_FLOOR.get(&floor::LIMITS) }.map_or((0, 0), |v| floor::unpack(*v));
    if floor_n == 0 || live < floor_n as i64 {
        return None;
    }
    // SAFETY: as above.
    let node_closed = unsafe { SESSION_FLOOR.get(&floor::CLOSED) }.copied().unwrap_or(0);
    if node_opened.wrapping_sub(node_closed) as i64 >= ceiling as i64 {
        return Some(counter::CUBE_DROP_NODE_SESSIONS);
    }
    None
}

/// The sandbox version's `opened` counter, its zeroed entry created when absent; `None` when
/// the map is full.
#[inline(always)]
fn get_or_create(key: &QuotaKey) -> Option<u64> {
    // SAFETY: plain map lookups; values are copied out.
    if let Some(v) = unsafe { SESSION_OPENED.get(key) } {
        return Some(*v);
    }
    let _ = SESSION_OPENED.insert(key, &0, BPF_NOEXIST as u64);
    // SAFETY: as above.
    unsafe { SESSION_OPENED.get(key) }.copied()
}

/// Adds `delta` (two's complement for a subtraction) to the sandbox version's `opened`
/// counter with one atomic instruction; nothing when it has no entry.
#[inline(always)]
fn add(ifindex: u32, version: u32, delta: u64) {
    let key = QuotaKey { ifindex, version };
    if let Some(p) = SESSION_OPENED.get_ptr_mut(&key) {
        // SAFETY: valid map value pointer, 8-byte aligned; BPF atomic add.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, delta) };
    }
}

/// Adds `delta` to the node-wide `OPENED` count (one atomic instruction).
#[inline(always)]
fn add_node(delta: u64) {
    if let Some(p) = SESSION_FLOOR.get_ptr_mut(&floor::OPENED) {
        // SAFETY: valid map value pointer, 8-byte aligned; BPF atomic add.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, delta) };
    }
}

/// Charges one session created by the datapath to (`ifindex`, `version`) and to the node.
#[inline(always)]
pub fn charge(ifindex: u32, version: u32) {
    add(ifindex, version, 1);
    add_node(1);
}

/// Gives back the charges of one session the datapath itself deleted: the sandbox's, and the
/// node's when the session carries one (`node`: `NatSession::node_quota` is `COUNTED`).
#[inline(always)]
pub fn refund(ifindex: u32, version: u32, node: bool) {
    add(ifindex, version, u64::MAX);
    if node {
        add_node(u64::MAX);
    }
}
