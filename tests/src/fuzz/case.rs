//! Regression cases: a failing input with everything needed to reproduce it — the node the
//! fuzzer installed and every step of the epoch up to the failing frame — as JSON under
//! `tests/regressions/`. A frame that replied to a session names that session's guest-side
//! tuple, so replay re-aims it at whatever SNAT port the datapath picks then (ports need not
//! be predictable).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::model::{Event, Model};

/// Where a frame arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Ingress {
    /// The uplink (its ifindex differs between runs).
    Uplink,
    /// This ifindex.
    Ifindex(u32),
}

/// Guest-side tuple of the session a world frame replies to (mvm IP, remote, guest port,
/// remote port, proto; host order).
pub type ReplyTo = ([u8; 4], [u8; 4], u16, u16, u8);

/// One step of an epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Step {
    /// A state change.
    Event(Event),
    /// A frame run through `program`.
    Frame {
        /// `from_cube`, `from_world` or `from_envoy`.
        program: String,
        /// Where it arrived.
        ingress: Ingress,
        /// The frame, hex.
        hex: String,
        /// The session it replies to, when it was aimed at one.
        reply_to: Option<ReplyTo>,
    },
}

/// A saved failing input.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Case {
    /// Fuzz case (program fuzzed) that found it.
    pub case: String,
    /// Seed of that run.
    pub seed: u64,
    /// The broken invariant.
    pub invariant: String,
    /// What was seen.
    pub detail: String,
    /// The node at the start of the epoch.
    pub model: Model,
    /// The steps, the failing frame last.
    pub steps: Vec<Step>,
}

/// The directory regression cases live in (`tests/regressions/`).
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions")
}

/// Lower-case hex of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes of lower-case hex `s` (panics on bad input: cases are written by [`hex`]).
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

impl Case {
    /// Writes the case as `<case>-<invariant>.json` unless a case with that name exists;
    /// returns the path written.
    pub fn save(&self) -> Option<PathBuf> {
        let p = dir().join(format!("{}-{}.json", self.case, self.invariant));
        if p.exists() {
            return None;
        }
        std::fs::create_dir_all(dir()).ok()?;
        std::fs::write(&p, serde_json::to_string_pretty(self).expect("case json") + "\n").ok()?;
        Some(p)
    }

    /// Every saved case, sorted by file name.
    pub fn load_all() -> Vec<(PathBuf, Case)> {
        let mut v: Vec<_> =
            std::fs::read_dir(dir()).map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect()).unwrap_or_default();
        v.retain(|p: &PathBuf| p.extension().is_some_and(|e| e == "json"));
        v.sort();
        v.into_iter()
            .map(|p| {
                let c = serde_json::from_str(&std::fs::read_to_string(&p).expect("read case"))
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                (p, c)
            })
            .collect()
    }
}
