//! Startup recovery: state files × live TAPs × datapath maps.

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    sync::{Arc, atomic::Ordering},
};

use serde::Serialize;

use super::{Agent, AgentError, TapEntry, TapState, Transition, internal, lock};
use crate::{
    handover::ReceivedTap,
    host::{LiveTap, tap_name},
    state::{Phase, SandboxRecord},
};

impl Agent {
    /// Reconciles state files × live TAPs × datapath maps at startup.
    ///
    /// - `success` record + live TAP: adopted Active; the TAP is never reopened, and the
    ///   datapath is only touched where it disagrees with the record.
    /// - `creating` / `deleting` record + live TAP: cleaned back to Ready.
    /// - live TAP without record: cleaned to Ready unless some process holds it (`LOWER_UP`),
    ///   in which case it stays Cleaning, untouched, until it is released.
    /// - record without TAP: its map entries and state are removed.
    ///
    /// Refuses (error) on unreadable state files and on conflicting identities (two records
    /// claiming one TAP or address, a record whose TAP name and address disagree, or a TAP
    /// whose ifindex or datapath registration names another sandbox).
    pub fn recover(&self) -> Result<RecoverySummary, AgentError> {
        self.recover_with(HashMap::new())
    }

    /// [`Agent::recover`] after a hand-over (`crate::handover`): `received` maps TAP names to
    /// the pool state and ifindex the previous agent reported and the queue fd it passed
    /// (already checked with `TUNGETIFF`). A TAP with a received fd keeps it (no `TUNSETIFF`):
    /// an Active one answers fd requests at once, also while its VMM holds the same queue; a
    /// Ready one without state rejoins Ready (the previous agent scrubbed it; the fd we hold is
    /// what makes it look held). Refuses (error, the hand-over aborts) a received TAP whose
    /// ifindex is not the live TAP's, or one the previous agent had Active without a record.
    pub fn recover_with(&self, mut received: HashMap<String, ReceivedTap>) -> Result<RecoverySummary, AgentError> {
        let (records, bad) =
            self.store.scan().map_err(|e| internal(format!("scan {}: {e}", self.store.dir().display())))?;
        if !bad.is_empty() {
            let list: Vec<_> = bad.iter().map(|(p, m)| format!("{}: {m}", p.display())).collect();
            return Err(internal(format!("unreadable state files, refusing to start: {}", list.join("; "))));
        }
        let live = self.host.list_taps().map_err(|e| internal(format!("list TAPs: {e}")))?;
        let live_by_name: HashMap<&str, &LiveTap> = live.iter().map(|t| (t.name.as_str(), t)).collect();

        // Identity checks.
        let mut by_tap: HashMap<&str, &SandboxRecord> = HashMap::new();
        let mut by_ip: HashMap<Ipv4Addr, &SandboxRecord> = HashMap::new();
        for (_, r) in &records {
            if tap_name(r.sandbox_ip) != r.tap_name {
                return Err(internal(format!(
                    "conflicting identity: state of {:?} names TAP {} but address {}; refusing to start",
                    r.sandbox_id, r.tap_name, r.sandbox_ip
                )));
            }
            if let Some(o) = by_tap.insert(&r.tap_name, r) {
                return Err(internal(format!(
                    "conflicting identity: sandboxes {:?} and {:?} both claim TAP {}; refusing to start",
                    o.sandbox_id, r.sandbox_id, r.tap_name
                )));
            }
            if let Some(o) = by_ip.insert(r.sandbox_ip, r) {
                return Err(internal(format!(
                    "conflicting identity: sandboxes {:?} and {:?} both claim {}; refusing to start",
                    o.sandbox_id, r.sandbox_id, r.sandbox_ip
                )));
            }
            if let Some(t) = live_by_name.get(r.tap_name.as_str())
                && t.ifindex != r.tap_ifindex
            {
                return Err(internal(format!(
                    "conflicting identity: {} has ifindex {} but the state of {:?} records {}; refusing to start",
                    r.tap_name, t.ifindex, r.sandbox_id, r.tap_ifindex
                )));
            }
            if let Some(t) = live_by_name.get(r.tap_name.as_str())
                && let Some(e) = self.dp.sandbox(t.ifindex)?
                && e.id != r.sandbox_id
            {
                return Err(internal(format!(
                    "conflicting identity: the datapath registers {:?} on {} but the state says {:?}; refusing to start",
                    e.id, r.tap_name, r.sandbox_id
                )));
            }
        }
        let max_version = records
            .iter()
            .map(|(_, r)| r.version)
            .chain(self.dp.sandboxes()?.iter().map(|e| e.version))
            .chain(self.dp.sessions()?.iter().map(|x| x.version))
            .max()
            .unwrap_or(0);
        // Versions only grow, also across restarts where records were deleted: mix in time.
        let seed = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs()
            as u32)
            .max(max_version.saturating_add(1));
        self.version.store(seed, Ordering::Relaxed);

        let mut summary = RecoverySummary::default();
        let mut to_clean = Vec::new();
        for t in &live {
            if self.cfg.cidr.index_of(t.ip).is_none() {
                tracing::warn!("{} is outside {}; left alone", t.name, self.cfg.cidr);
                summary.foreign += 1;
                continue;
            }
            let rec = records.iter().find(|(_, r)| r.tap_name == t.name);
            let (got_state, fd) = match received.remove(&t.name) {
                Some(r) if r.ifindex != t.ifindex => {
                    return Err(internal(format!(
                        "hand-over: {} has ifindex {} but the previous agent reported {}",
                        t.name, t.ifindex, r.ifindex
                    )));
                }
                Some(r) if r.state == "Active" && !matches!(rec, Some((Phase::Success, _))) => {
                    return Err(internal(format!(
                        "hand-over: {} is Active in the previous agent but has no committed state here",
                        t.name
                    )));
                }
                Some(r) => (Some(r.state), Some(Arc::new(r.fd))),
                None => (None, None),
            };
            if fd.is_some() {
                summary.handed_over_fds += 1;
            }
            let mut inner = lock(&self.inner);
            inner.ipam.assign(t.ip);
            let entry = |state, owner: Option<&str>| {
                Transition::Join(TapEntry::new(
                    t.name.clone(),
                    t.ip,
                    t.ifindex,
                    fd.clone(),
                    state,
                    owner.map(str::to_string),
                ))
            };
            match rec {
                Some((Phase::Success, r)) => {
                    self.transit(&mut inner, &t.name, entry(TapState::Active, Some(&r.sandbox_id)))
                        .map_err(internal)?;
                    for p in &r.port_mappings {
                        inner.ports.reclaim(&r.sandbox_id, p.host_port);
                    }
                    inner.sandboxes.insert(r.sandbox_id.clone(), r.clone());
                    drop(inner);
                    self.converge(r)?;
                    summary.adopted += 1;
                }
                Some((_, r)) => {
                    self.transit(&mut inner, &t.name, entry(TapState::Cleaning, Some(&r.sandbox_id)))
                        .map_err(internal)?;
                    to_clean.push(t.name.clone());
                }
                None if fd.is_some() && got_state.as_deref() == Some("Ready") => {
                    self.transit(&mut inner, &t.name, entry(TapState::Ready, None)).map_err(internal)?;
                }
                None if t.lower_up && fd.is_none() => {
                    let e = TapEntry::new(t.name.clone(), t.ip, t.ifindex, None, TapState::Cleaning, None)
                        .hands_off("held by another process and no state: left untouched until it is free");
                    self.transit(&mut inner, &t.name, Transition::Join(e)).map_err(internal)?;
                    summary.held += 1;
                }
                None => {
                    self.transit(&mut inner, &t.name, entry(TapState::Cleaning, None)).map_err(internal)?;
                    to_clean.push(t.name.clone());
                }
            }
        }
        for name in to_clean {
            // Orphans and pool TAPs of the previous run: re-attach (adopts the pinned link).
            if let Err(e) = self.dp.attach_sandbox(&name) {
                tracing::warn!("re-attach {name}: {e}");
            }
            if self.cleanup_tap(&name) {
                summary.cleaned += 1;
            }
        }
        for (_, r) in &records {
            if !live_by_name.contains_key(r.tap_name.as_str()) {
                let _ = self.dp.delete_port_mappings_of(r.tap_ifindex);
                if self.dp.sandbox(r.tap_ifindex)?.is_some_and(|e| e.id == r.sandbox_id) {
                    self.dp.unregister_sandbox(r.tap_ifindex)?;
                }
                self.store.remove(&r.sandbox_id).map_err(internal)?;
                summary.stale_records += 1;
            }
        }
        // TAPs a previous run left on their warm-up filter (crash or hand-over before the
        // maintenance loop moved them to tcx, or a `legacy` run): queued for conversion.
        let adopted: Vec<String> = {
            let inner = lock(&self.inner);
            inner.pool.names(TapState::Active).chain(inner.pool.names(TapState::Ready)).cloned().collect()
        };
        for name in adopted {
            if let Err(e) = self.dp.defer_sandbox(&name) {
                tracing::warn!("queue {name} for its tcx link: {e}");
            }
        }
        if !received.is_empty() {
            let names: Vec<_> = received.keys().cloned().collect();
            tracing::warn!(?names, "handed-over TAP fds without a live TAP in the dataplane netns: closed");
        }
        Ok(summary)
    }
}

/// What recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RecoverySummary {
    /// Active sandboxes adopted.
    pub adopted: usize,
    /// TAPs scrubbed back to Ready.
    pub cleaned: usize,
    /// TAPs held by an unknown process, left untouched.
    pub held: usize,
    /// Records without TAP removed.
    pub stale_records: usize,
    /// TAPs outside the CIDR, ignored.
    pub foreign: usize,
    /// TAPs whose queue fd came from the previous agent (hand-over), not reopened.
    pub handed_over_fds: usize,
}
