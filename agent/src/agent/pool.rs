//! The TAP pool as a state machine (`reference/upstream.md §2.4`).
//!
//! Every change of a TAP's state or owner, including joining and leaving the pool, goes through
//! [`Pool::transition`]. It refuses a transition that is not legal from the TAP's current state
//! (nothing changes then) and checks the invariants afterwards:
//!
//! - **Ready** ⇔ no owner and no cleanup running;
//! - **Active** ⇒ an owner, no cleanup running;
//! - **Cleaning**: the owner is kept until the TAP's datapath state is scrubbed and the owner's
//!   state is gone ([`Transition::Scrubbed`]); after that the TAP waits, ownerless, until no
//!   other process holds it;
//! - a TAP becomes Ready only after that scrub;
//! - a sandbox owns at most one TAP.
//!
//! The pool also keeps a name set per state and an owner index, so counts, "the first Ready
//! TAP" and "the TAP of this sandbox" never walk the pool.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::Ipv4Addr,
    os::fd::OwnedFd,
    sync::Arc,
};

use serde::Serialize;

/// Pool state of a TAP (`reference/upstream.md §2.4`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum TapState {
    /// Unowned, unregistered, no sandbox state, nobody else holds it; baseline deny installed
    /// when the policy tries have room for it.
    Ready,
    /// Owned by a sandbox.
    Active,
    /// Being scrubbed for reuse, or scrubbed and waiting until no other process (a VMM)
    /// holds it; failures stay here and the maintenance loop retries. Also a surplus TAP the
    /// trim is deleting ([`TapEntry::retiring`]): listed until it is gone from the node.
    Cleaning,
}

impl TapState {
    /// Every state, in index order.
    pub const ALL: [TapState; 3] = [TapState::Ready, TapState::Active, TapState::Cleaning];

    /// The name as upstream spells it (`Ready`, `Active`, `Cleaning`).
    pub fn as_str(self) -> &'static str {
        match self {
            TapState::Ready => "Ready",
            TapState::Active => "Active",
            TapState::Cleaning => "Cleaning",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One TAP of the pool. Identity fields are plain; state, owner and cleanup bookkeeping are
/// read through accessors and changed only by [`Pool::transition`].
#[derive(Debug)]
pub struct TapEntry {
    /// `z<ip>`.
    pub name: String,
    /// mvm IP.
    pub ip: Ipv4Addr,
    /// ifindex in the dataplane netns.
    pub ifindex: u32,
    /// The agent's queue fd (`None` for an adopted Active TAP until first needed, and while
    /// the agent waits for another holder to let go).
    pub fd: Option<Arc<OwnedFd>>,
    state: TapState,
    owner: Option<String>,
    retry_count: u32,
    last_error: Option<String>,
    /// A cleanup of this TAP is running (only one at a time: a second one could capture the
    /// next owner and delete its state).
    scrubbing: bool,
    /// Cleaning: the datapath state is scrubbed and the owner's state is gone.
    scrubbed: bool,
    /// Found held by an unknown process at recovery: nothing is touched until it is free.
    hands_off: bool,
    /// Cleaning: a surplus Ready TAP the trim is deleting; never scrubbed or handed out again.
    retiring: bool,
}

impl TapEntry {
    /// A TAP about to join the pool in `state` (owned by `owner` unless Ready).
    pub fn new(
        name: String,
        ip: Ipv4Addr,
        ifindex: u32,
        fd: Option<Arc<OwnedFd>>,
        state: TapState,
        owner: Option<String>,
    ) -> Self {
        Self {
            name,
            ip,
            ifindex,
            fd,
            state,
            owner,
            retry_count: 0,
            last_error: None,
            scrubbing: false,
            scrubbed: false,
            hands_off: false,
            retiring: false,
        }
    }

    /// Marks a Cleaning TAP that some unknown process holds: cleanups leave it untouched until
    /// it is free (recovery).
    pub fn hands_off(mut self, note: impl Into<String>) -> Self {
        self.hands_off = true;
        self.last_error = Some(note.into());
        self
    }

    /// Current state.
    pub fn state(&self) -> TapState {
        self.state
    }

    /// Owning sandbox (Active, and Cleaning until its state is gone).
    pub fn owner(&self) -> Option<&str> {
        self.owner.as_deref()
    }

    /// Failed cleanups since the TAP last was Ready.
    pub fn retry_count(&self) -> u32 {
        self.retry_count
    }

    /// Why the last cleanup failed.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// A cleanup is running.
    pub fn scrubbing(&self) -> bool {
        self.scrubbing
    }

    /// Cleaning: the datapath part of the cleanup is done (only the wait for a free TAP is left).
    pub fn scrubbed(&self) -> bool {
        self.scrubbed
    }

    /// Cleaning: left untouched until no unknown process holds it.
    pub fn is_hands_off(&self) -> bool {
        self.hands_off
    }

    /// Cleaning: a surplus TAP being deleted by the trim (listed until it is gone).
    pub fn retiring(&self) -> bool {
        self.retiring
    }

    fn check(&self) -> Result<(), String> {
        let ok = match self.state {
            TapState::Ready => {
                self.owner.is_none() && !self.scrubbing && !self.scrubbed && !self.hands_off && !self.retiring
            }
            TapState::Active => {
                self.owner.is_some() && !self.scrubbing && !self.scrubbed && !self.hands_off && !self.retiring
            }
            TapState::Cleaning => {
                !(self.scrubbed && self.owner.is_some())
                    && !(self.retiring && (self.owner.is_some() || self.scrubbing || self.scrubbed || self.hands_off))
            }
        };
        if ok {
            return Ok(());
        }
        Err(format!(
            "invariant broken: {:?} with owner={:?} scrubbing={} scrubbed={} hands_off={} retiring={}",
            self.state, self.owner, self.scrubbing, self.scrubbed, self.hands_off, self.retiring
        ))
    }
}

/// A change of one TAP's pool state. `Join` and `Remove` add and remove TAPs; the others
/// move an existing TAP.
#[derive(Debug)]
pub enum Transition<'a> {
    /// A new TAP joins the pool in the state (and with the owner) it carries.
    Join(TapEntry),
    /// Ready → Active: sandbox `owner` takes the TAP.
    Acquire(&'a str),
    /// Active → Ready: the TAP was taken by an Ensure that failed before programming anything.
    Unacquire,
    /// Active → Cleaning: the owner's network is being torn down (the owner stays recorded).
    Release,
    /// Cleaning → Cleaning, scrubbing: a cleanup starts (refused while one runs).
    BeginScrub,
    /// Cleaning, scrubbing → Cleaning, scrubbing, scrubbed: the datapath state is gone and so
    /// is the owner's state; the owner is cleared (its id may be ensured again).
    Scrubbed,
    /// Cleaning, scrubbing, scrubbed → Ready: nobody else holds the TAP; errors are cleared.
    Cleaned,
    /// Cleaning, scrubbing, scrubbed → Cleaning, scrubbed: the cleanup stops after the scrub
    /// without failing; the free check (is the TAP still held elsewhere?) runs later, off the
    /// Release path (the maintenance pass). No retry is counted.
    Deferred,
    /// Cleaning, scrubbing → Cleaning: the cleanup failed with this error; retry count + 1.
    ScrubFailed(String),
    /// Ready → Cleaning, retiring: a surplus TAP the trim is about to delete. It stays listed
    /// (so the pool shows every TAP the agent owns on the node) and is never handed out,
    /// scrubbed or made Ready again.
    Retire,
    /// Cleaning, retiring → removed from the pool once the TAP is gone from the node. The
    /// removed entry is returned.
    Remove,
}

impl Transition<'_> {
    fn name(&self) -> &'static str {
        match self {
            Transition::Join(_) => "join",
            Transition::Acquire(_) => "acquire",
            Transition::Unacquire => "unacquire",
            Transition::Release => "release",
            Transition::BeginScrub => "begin cleanup",
            Transition::Scrubbed => "scrubbed",
            Transition::Cleaned => "cleaned",
            Transition::Deferred => "defer free check",
            Transition::ScrubFailed(_) => "cleanup failed",
            Transition::Retire => "retire",
            Transition::Remove => "remove",
        }
    }
}

/// A refused transition; the pool is unchanged.
#[derive(Debug, thiserror::Error)]
#[error("TAP {name}: {transition} refused: {reason}")]
pub struct PoolError {
    /// TAP name.
    pub name: String,
    /// Which transition.
    pub transition: &'static str,
    /// Why.
    pub reason: String,
}

/// The pool: TAPs by name plus the per-state and per-owner indexes.
#[derive(Debug, Default)]
pub struct Pool {
    taps: BTreeMap<String, TapEntry>,
    by_state: [BTreeSet<String>; 3],
    by_owner: HashMap<String, String>,
}

impl Pool {
    /// The TAP `name`.
    pub fn get(&self, name: &str) -> Option<&TapEntry> {
        self.taps.get(name)
    }

    /// Replaces the agent's queue fd of `name` (not a state change).
    pub fn set_fd(&mut self, name: &str, fd: Option<Arc<OwnedFd>>) {
        if let Some(t) = self.taps.get_mut(name) {
            t.fd = fd;
        }
    }

    /// Every TAP, by name.
    pub fn iter(&self) -> impl Iterator<Item = &TapEntry> {
        self.taps.values()
    }

    /// Number of TAPs in `state`.
    pub fn count(&self, state: TapState) -> usize {
        self.by_state[state.index()].len()
    }

    /// Names of the TAPs in `state`, in name order.
    pub fn names(&self, state: TapState) -> impl DoubleEndedIterator<Item = &String> {
        self.by_state[state.index()].iter()
    }

    /// The first Ready TAP in name order.
    pub fn first_ready(&self) -> Option<&str> {
        self.by_state[TapState::Ready.index()].first().map(String::as_str)
    }

    /// The TAP owned by `owner` (Active, or Cleaning while the owner's state is not gone yet).
    pub fn owned_by(&self, owner: &str) -> Option<&TapEntry> {
        self.by_owner.get(owner).and_then(|n| self.taps.get(n))
    }

    /// Applies `t` to the TAP `name`. Illegal transitions are refused with nothing changed.
    /// Returns the removed entry for [`Transition::Remove`], else `None`.
    pub fn transition(&mut self, name: &str, t: Transition<'_>) -> Result<Option<TapEntry>, PoolError> {
        let tname = t.name();
        let refuse = |reason: String| PoolError { name: name.to_string(), transition: tname, reason };
        if let Transition::Join(entry) = t {
            if entry.name != name {
                return Err(refuse(format!("entry is named {}", entry.name)));
            }
            if self.taps.contains_key(name) {
                return Err(refuse("already in the pool".into()));
            }
            entry.check().map_err(refuse)?;
            if entry.scrubbing || entry.scrubbed || entry.retiring {
                return Err(refuse("cannot join while being cleaned or deleted".into()));
            }
            if let Some(o) = &entry.owner
                && let Some(other) = self.by_owner.get(o)
            {
                return Err(refuse(format!("{o:?} already owns {other}")));
            }
            self.by_state[entry.state.index()].insert(name.to_string());
            if let Some(o) = &entry.owner {
                self.by_owner.insert(o.clone(), name.to_string());
            }
            self.taps.insert(name.to_string(), entry);
            return Ok(None);
        }
        let Some(e) = self.taps.get_mut(name) else { return Err(refuse("not in the pool".into())) };
        let from = e.state;
        let illegal = |e: &TapEntry| refuse(format!("illegal from {:?} (scrubbing={})", e.state, e.scrubbing));
        let mut new_owner: Option<Option<String>> = None;
        match t {
            Transition::Join(_) => unreachable!("handled above"),
            Transition::Acquire(owner) => {
                if from != TapState::Ready {
                    return Err(illegal(e));
                }
                if let Some(other) = self.by_owner.get(owner) {
                    return Err(refuse(format!("{owner:?} already owns {other}")));
                }
                e.state = TapState::Active;
                new_owner = Some(Some(owner.to_string()));
            }
            Transition::Unacquire => {
                if from != TapState::Active {
                    return Err(illegal(e));
                }
                e.state = TapState::Ready;
                new_owner = Some(None);
            }
            Transition::Release => {
                if from != TapState::Active {
                    return Err(illegal(e));
                }
                e.state = TapState::Cleaning;
            }
            Transition::BeginScrub => {
                if from != TapState::Cleaning || e.scrubbing || e.retiring {
                    return Err(illegal(e));
                }
                e.scrubbing = true;
            }
            Transition::Scrubbed => {
                if from != TapState::Cleaning || !e.scrubbing {
                    return Err(illegal(e));
                }
                e.scrubbed = true;
                e.hands_off = false;
                new_owner = Some(None);
            }
            Transition::Cleaned => {
                if from != TapState::Cleaning || !e.scrubbing || !e.scrubbed {
                    return Err(illegal(e));
                }
                e.state = TapState::Ready;
                e.scrubbing = false;
                e.scrubbed = false;
                e.retry_count = 0;
                e.last_error = None;
            }
            Transition::Deferred => {
                if from != TapState::Cleaning || !e.scrubbing || !e.scrubbed {
                    return Err(illegal(e));
                }
                e.scrubbing = false;
            }
            Transition::ScrubFailed(err) => {
                if from != TapState::Cleaning || !e.scrubbing {
                    return Err(illegal(e));
                }
                e.scrubbing = false;
                e.retry_count += 1;
                e.last_error = Some(err);
            }
            Transition::Retire => {
                if from != TapState::Ready || e.scrubbing {
                    return Err(illegal(e));
                }
                e.state = TapState::Cleaning;
                e.retiring = true;
                e.last_error = Some("retiring: surplus Ready TAP being deleted (trim)".into());
            }
            Transition::Remove => {
                if from != TapState::Cleaning || !e.retiring {
                    return Err(illegal(e));
                }
                self.by_state[from.index()].remove(name);
                return Ok(self.taps.remove(name));
            }
        }
        if let Some(owner) = new_owner {
            if let Some(old) = e.owner.take() {
                self.by_owner.remove(&old);
            }
            if let Some(o) = &owner {
                self.by_owner.insert(o.clone(), name.to_string());
            }
            e.owner = owner;
        }
        if e.state != from {
            self.by_state[from.index()].remove(name);
            self.by_state[e.state.index()].insert(name.to_string());
        }
        // Every transition above establishes the invariants; a failure here is a bug in this
        // function, so it is loud in tests and logged in production.
        if let Err(m) = e.check() {
            debug_assert!(false, "{name}: {m}");
            tracing::error!("TAP {name}: {m}");
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, state: TapState, owner: Option<&str>) -> TapEntry {
        TapEntry::new(name.into(), Ipv4Addr::new(10, 0, 0, 2), 7, None, state, owner.map(str::to_string))
    }

    #[test]
    fn lifecycle_and_indexes() {
        let mut p = Pool::default();
        p.transition("z1", Transition::Join(entry("z1", TapState::Ready, None))).unwrap();
        p.transition("z2", Transition::Join(entry("z2", TapState::Ready, None))).unwrap();
        assert_eq!(p.first_ready(), Some("z1"));
        p.transition("z1", Transition::Acquire("sb")).unwrap();
        assert_eq!(p.owned_by("sb").map(|t| t.name.as_str()), Some("z1"));
        assert_eq!((p.count(TapState::Ready), p.count(TapState::Active)), (1, 1));
        // One TAP per owner.
        assert!(p.transition("z2", Transition::Acquire("sb")).is_err());
        p.transition("z1", Transition::Release).unwrap();
        assert_eq!(p.get("z1").unwrap().owner(), Some("sb"), "owner kept while Cleaning");
        p.transition("z1", Transition::BeginScrub).unwrap();
        assert!(p.transition("z1", Transition::BeginScrub).is_err(), "one cleanup at a time");
        p.transition("z1", Transition::ScrubFailed("boom".into())).unwrap();
        assert_eq!((p.get("z1").unwrap().retry_count(), p.get("z1").unwrap().last_error()), (1, Some("boom")));
        p.transition("z1", Transition::BeginScrub).unwrap();
        assert!(p.transition("z1", Transition::Cleaned).is_err(), "never Ready before the scrub");
        p.transition("z1", Transition::Scrubbed).unwrap();
        assert!(p.owned_by("sb").is_none(), "the owner's id is free once scrubbed");
        p.transition("z1", Transition::Deferred).unwrap();
        let t = p.get("z1").unwrap();
        assert_eq!((t.state(), t.scrubbing(), t.scrubbed(), t.retry_count()), (TapState::Cleaning, false, true, 1));
        assert!(p.transition("z1", Transition::Cleaned).is_err(), "never Ready without the free check");
        p.transition("z1", Transition::BeginScrub).unwrap();
        p.transition("z1", Transition::ScrubFailed("held".into())).unwrap();
        assert_eq!(p.get("z1").unwrap().state(), TapState::Cleaning);
        p.transition("z1", Transition::BeginScrub).unwrap();
        p.transition("z1", Transition::Cleaned).unwrap();
        let t = p.get("z1").unwrap();
        assert_eq!((t.state(), t.owner(), t.retry_count(), t.last_error()), (TapState::Ready, None, 0, None));
        assert!(p.owned_by("sb").is_none());
        assert_eq!(p.count(TapState::Ready), 2);
        // Retired: listed as Cleaning until deleted, never handed out or cleaned again.
        assert!(p.transition("z1", Transition::Retire).unwrap().is_none());
        assert_eq!((p.count(TapState::Ready), p.count(TapState::Cleaning)), (1, 1));
        let t = p.get("z1").unwrap();
        assert!(t.retiring() && t.state() == TapState::Cleaning && t.last_error().is_some());
        assert_eq!(p.first_ready(), Some("z2"));
        for t in [Transition::Acquire("x"), Transition::BeginScrub, Transition::Cleaned, Transition::Retire] {
            assert!(p.transition("z1", t).is_err());
        }
        assert!(p.transition("z2", Transition::Remove).is_err(), "only a retiring TAP is removed");
        assert!(p.transition("z1", Transition::Remove).unwrap().is_some());
        assert_eq!((p.count(TapState::Ready), p.count(TapState::Cleaning)), (1, 0));
        assert!(p.get("z1").is_none());
    }

    #[test]
    fn illegal_transitions_change_nothing() {
        let mut p = Pool::default();
        p.transition("z1", Transition::Join(entry("z1", TapState::Ready, None))).unwrap();
        for t in [Transition::Unacquire, Transition::Release, Transition::BeginScrub, Transition::Cleaned] {
            assert!(p.transition("z1", t).is_err());
        }
        assert!(p.transition("z1", Transition::Join(entry("z1", TapState::Ready, None))).is_err());
        assert!(p.transition("z3", Transition::Join(entry("z3", TapState::Ready, Some("x")))).is_err());
        assert!(p.transition("z4", Transition::Join(entry("z4", TapState::Active, None))).is_err());
        p.transition("z1", Transition::Acquire("a")).unwrap();
        // An Active TAP is never retired, scrubbed or acquired again.
        for t in [Transition::Retire, Transition::BeginScrub, Transition::Acquire("b")] {
            assert!(p.transition("z1", t).is_err());
        }
        let t = p.get("z1").unwrap();
        assert_eq!((t.state(), t.owner()), (TapState::Active, Some("a")));
        assert_eq!((p.count(TapState::Ready), p.count(TapState::Active), p.count(TapState::Cleaning)), (0, 1, 0));
    }
}
