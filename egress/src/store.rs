//! The in-memory policy store (sandbox IP → policy) and the bootstrap status gate.

use std::{
    collections::HashMap,
    net::Ipv4Addr,
    sync::{Arc, RwLock},
};

use tokio::sync::watch;

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
    /// Per sandbox IP, how many times its policy was removed (decision R71).
    removals: RwLock<HashMap<Ipv4Addr, u64>>,
    /// Bumped after every removal, so that connections waiting in
    /// [`PolicyStore::until_removed`] look again.
    removed: watch::Sender<u64>,
}

impl Default for PolicyStore {
    fn default() -> Self {
        Self {
            policies: Arc::default(),
            status: RwLock::new(BootstrapStatus::Pending),
            removals: RwLock::default(),
            removed: watch::Sender::new(0),
        }
    }
}

/// Which sandbox a proxy connection was accepted for: its IP and the removal count of that
/// IP's policy at the time ([`PolicyStore::incarnation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incarnation {
    ip: Ipv4Addr,
    removals: u64,
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
    /// IPs whose policy is not in `all` end their incarnation, as [`PolicyStore::delete`].
    pub fn replace_all(&self, all: HashMap<Ipv4Addr, Policy>) {
        let m: HashMap<_, _> = all.into_iter().map(|(k, v)| (k, Arc::new(v))).collect();
        let gone: Vec<Ipv4Addr> = {
            let mut cur = self.policies.write().expect("policy lock");
            let gone = cur.keys().filter(|ip| !m.contains_key(ip)).copied().collect();
            *cur = m;
            gone
        };
        self.mark_removed(gone);
    }

    fn mark_removed(&self, ips: impl IntoIterator<Item = Ipv4Addr>) {
        let mut any = false;
        {
            let mut r = self.removals.write().expect("removals lock");
            for ip in ips {
                *r.entry(ip).or_default() += 1;
                any = true;
            }
        }
        if any {
            self.removed.send_modify(|g| *g = g.wrapping_add(1));
        }
    }

    /// The current incarnation of `ip`. Take it together with [`PolicyStore::removals`] (that
    /// first) when a connection is accepted.
    pub fn incarnation(&self, ip: Ipv4Addr) -> Incarnation {
        let removals = self.removals.read().expect("removals lock").get(&ip).copied().unwrap_or(0);
        Incarnation { ip, removals }
    }

    /// A receiver of removals, subscribed now (before [`PolicyStore::incarnation`], so that no
    /// removal in between goes unseen).
    pub fn removals(&self) -> watch::Receiver<u64> {
        self.removed.subscribe()
    }

    /// Resolves once the policy of `inc`'s IP has been removed since `inc` was taken (never
    /// before): the connection belongs to a sandbox that is gone.
    pub async fn until_removed(&self, mut rx: watch::Receiver<u64>, inc: Incarnation) {
        loop {
            if self.incarnation(inc.ip) != inc {
                return;
            }
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Removes a sandbox's policy (no error when absent) and ends the incarnation of `ip`:
    /// every connection accepted from `ip` before this closes ([`PolicyStore::until_removed`]).
    /// The agent deletes a policy on Release; the next sandbox on the address may get the same
    /// IP, and CubeVS delivers what a host socket sends to whoever holds it (decision R71).
    pub fn delete(&self, ip: Ipv4Addr) {
        self.policies.write().expect("policy lock").remove(&ip);
        self.mark_removed([ip]);
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn policy() -> Policy {
        let spec = r#"{"policy_id":"a","rules":[{"id":"r","action":{"allow":true}}]}"#;
        Policy::compile(serde_json::from_str(spec).unwrap()).unwrap()
    }

    async fn removed_within(s: &PolicyStore, rx: watch::Receiver<u64>, inc: Incarnation) -> bool {
        tokio::time::timeout(Duration::from_millis(50), s.until_removed(rx, inc)).await.is_ok()
    }

    /// R71: a connection of A ends when A's policy is deleted, even when B's policy for the
    /// same address arrives before the connection looks; B's connections and other addresses'
    /// are untouched, and so is A's by a policy update.
    #[tokio::test]
    async fn a_deleted_policy_ends_its_incarnation_only() {
        let s = PolicyStore::default();
        let (a, other) = (Ipv4Addr::new(192, 168, 0, 2), Ipv4Addr::new(192, 168, 0, 3));
        s.put(a, policy());
        s.put(other, policy());
        let (rx_a, inc_a) = (s.removals(), s.incarnation(a));
        let (rx_o, inc_o) = (s.removals(), s.incarnation(other));
        s.put(a, policy());
        assert!(!removed_within(&s, s.removals(), inc_a).await, "an update keeps the connection");
        s.delete(a);
        s.put(a, policy());
        let (rx_b, inc_b) = (s.removals(), s.incarnation(a));
        assert!(removed_within(&s, rx_a, inc_a).await, "A's connection ends");
        assert!(!removed_within(&s, rx_o, inc_o).await, "another sandbox's stays");
        assert!(!removed_within(&s, rx_b.clone(), inc_b).await, "B's stays");
        // A full replace without the address (hand-over, bootstrap) ends B's too.
        s.replace_all(HashMap::from([(other, policy())]));
        assert!(removed_within(&s, rx_b, inc_b).await);
        assert!(!removed_within(&s, s.removals(), s.incarnation(other)).await);
    }
}
