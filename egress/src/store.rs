//! The in-memory policy store (sandbox IP → policy) and the bootstrap status gate.

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    sync::{Arc, RwLock},
};

use crate::{
    floor::Members,
    policy::{Policy, RuleSpec, ValidationError},
};

/// Bootstrap state (upstream.md §4.5). Requests are served only when `Ready` or `Skipped`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootstrapStatus {
    /// Still fetching the dump.
    Pending,
    /// Dump loaded.
    Ready,
    /// No bootstrap URL configured.
    Skipped,
    /// The first round of attempts failed; still retrying in the background.
    Failed,
}

impl BootstrapStatus {
    /// `pending` / `ready` / `skipped` / `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            BootstrapStatus::Pending => "pending",
            BootstrapStatus::Ready => "ready",
            BootstrapStatus::Skipped => "skipped",
            BootstrapStatus::Failed => "failed",
        }
    }

    /// The inverse of [`Self::as_str`].
    pub fn parse(s: &str) -> Option<BootstrapStatus> {
        [BootstrapStatus::Pending, BootstrapStatus::Ready, BootstrapStatus::Skipped, BootstrapStatus::Failed]
            .into_iter()
            .find(|b| b.as_str() == s)
    }

    /// Whether policies are authoritative (fail closed otherwise).
    pub fn serving(self) -> bool {
        matches!(self, BootstrapStatus::Ready | BootstrapStatus::Skipped)
    }
}

/// Thread-safe policy store; readers clone an `Arc<Policy>` and never block writers for long.
#[derive(Debug)]
pub struct PolicyStore {
    policies: Arc<RwLock<HashMap<Ipv4Addr, Arc<Policy>>>>,
    status: RwLock<BootstrapStatus>,
}

impl Default for PolicyStore {
    fn default() -> Self {
        Self { policies: Arc::default(), status: RwLock::new(BootstrapStatus::Pending) }
    }
}

impl PolicyStore {
    /// The policy of one sandbox.
    pub fn get(&self, ip: Ipv4Addr) -> Option<Arc<Policy>> {
        self.policies.read().expect("policy lock").get(&ip).cloned()
    }

    /// Full replace of one sandbox's policy.
    pub fn put(&self, ip: Ipv4Addr, p: Policy) {
        self.policies.write().expect("policy lock").insert(ip, Arc::new(p));
    }

    /// Upserts one rule by id (appended when new). Errors: no policy for `ip` (`Ok(false)`),
    /// or the resulting policy does not validate.
    pub fn patch_rule(&self, ip: Ipv4Addr, rule: RuleSpec) -> Result<bool, ValidationError> {
        let mut map = self.policies.write().expect("policy lock");
        let Some(cur) = map.get(&ip) else { return Ok(false) };
        let mut spec = cur.spec.clone();
        match spec.rules.iter_mut().find(|r| r.id == rule.id) {
            Some(r) => *r = rule,
            None => spec.rules.push(rule),
        }
        let p = Policy::compile(spec)?;
        map.insert(ip, Arc::new(p));
        Ok(true)
    }

    /// Replaces every policy at once (state hand-over from a predecessor, E18).
    pub fn replace_all(&self, all: HashMap<Ipv4Addr, Policy>) {
        let m = all.into_iter().map(|(k, v)| (k, Arc::new(v))).collect();
        *self.policies.write().expect("policy lock") = m;
    }

    /// Removes a sandbox's policy (no error when absent).
    pub fn delete(&self, ip: Ipv4Addr) {
        self.policies.write().expect("policy lock").remove(&ip);
    }

    /// Snapshot of every policy, sorted by IP.
    pub fn all(&self) -> Vec<(Ipv4Addr, Arc<Policy>)> {
        let mut v: Vec<_> = self.policies.read().expect("policy lock").iter().map(|(k, v)| (*k, v.clone())).collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Number of policies.
    pub fn len(&self) -> usize {
        self.policies.read().expect("policy lock").len()
    }

    /// True when no policy is loaded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sandboxes with a policy, as a live view for the floors of [`crate::floor`] (R22).
    pub fn members(&self) -> Arc<dyn Members> {
        Arc::new(Known(self.policies.clone()))
    }

    /// Current bootstrap status.
    pub fn status(&self) -> BootstrapStatus {
        *self.status.read().expect("status lock")
    }

    /// Sets the bootstrap status.
    pub fn set_status(&self, s: BootstrapStatus) {
        *self.status.write().expect("status lock") = s;
    }
}

/// Live view of the sandboxes with a policy (every change of the store shows at once).
struct Known(Arc<RwLock<HashMap<Ipv4Addr, Arc<Policy>>>>);

impl Members for Known {
    fn contains(&self, ip: Ipv4Addr) -> bool {
        self.0.read().expect("policy lock").contains_key(&ip)
    }
    fn count(&self) -> usize {
        self.0.read().expect("policy lock").len()
    }
}
