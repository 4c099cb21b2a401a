//! The service operations: Ensure, Release, Reconcile, Get, List and the fd handoff lookup.

use std::{os::fd::OwnedFd, sync::Arc, time::Instant};

use super::{
    Agent, AgentError, EnsureRequest, NetworkView, PortRequest, TapState, Transition, internal, invalid, lock,
};
use crate::{
    dataplane::{EgressPolicy, PortMapping, SandboxEntry, compile_policy},
    ports::PortError,
    state::{Phase, PortRecord, SandboxRecord, validate_sandbox_id},
};

/// Invalid fields whose reason the log shows: their values are ids, ports and addresses.
/// Every other field (L7 `rules`, which carry injected credentials; `persist_metadata`; any
/// field added later) is logged by its name only, the reason stays in the gRPC answer.
const REASON_LOGGED: &[&str] = &[
    "sandbox_id",
    "network_handle",
    "port_mappings[",
    "cubevs_context.allow_out",
    "cubevs_context.deny_out",
    "cubevs_context.allow_fqdn",
];

/// An error as the log may show it: an invalid field with its reason when the field is in
/// [`REASON_LOGGED`], else by its name only (the reason can quote request values, e.g. an
/// injected credential); everything else in full.
fn loggable(e: &AgentError) -> String {
    match e {
        AgentError::Invalid { field, reason } if REASON_LOGGED.iter().any(|f| field.starts_with(f)) => {
            format!("invalid {field}: {reason}")
        }
        AgentError::Invalid { field, .. } => format!("invalid {field}"),
        e => e.to_string(),
    }
}

impl Agent {
    /// EnsureNetwork: idempotent per sandbox id; on failure nothing is left behind.
    /// Logs `network ensured` (info) or `ensure failed` (warn) with `sandbox_id`.
    pub fn ensure(&self, req: EnsureRequest) -> Result<NetworkView, AgentError> {
        let t0 = Instant::now();
        let id = req.sandbox_id.clone();
        let call = self.calls.begin();
        let r = self.ensure_inner(req);
        drop(call);
        self.kick.notify_one();
        self.metrics.ensure_seconds.observe(t0.elapsed().as_secs_f64());
        self.metrics.ensure.with_label_values(&[if r.is_ok() { "ok" } else { "error" }]).inc();
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        match &r {
            Ok(v) => tracing::info!(
                sandbox_id = %crate::state::LogSafe(&id),
                tap = %v.record.tap_name,
                ifindex = v.record.tap_ifindex,
                sandbox_ip = %v.record.sandbox_ip,
                version = v.record.version,
                ms,
                "network ensured"
            ),
            Err(e) => {
                tracing::warn!(sandbox_id = %crate::state::LogSafe(&id), ms, error = %loggable(e), "ensure failed")
            }
        }
        r
    }

    fn ensure_inner(&self, req: EnsureRequest) -> Result<NetworkView, AgentError> {
        validate_sandbox_id(&req.sandbox_id).map_err(|r| invalid("sandbox_id", r))?;
        super::check_metadata(&req.persist_metadata)?;
        let ports = self.distinct_ports(&req.ports)?;
        for (i, p) in req.ports.iter().enumerate() {
            if p.host_port != 0 && (p.host_port < self.cfg.port_range.0 || p.host_port > self.cfg.port_range.1) {
                return Err(invalid(
                    format!("port_mappings[{i}].host_port"),
                    format!("{} is outside host_port_range {}", p.host_port, self.cfg.raw.host_port_range),
                ));
            }
        }
        let policy = req.policy.clone().unwrap_or_default();
        compile_policy(&policy, self.cfg.raw.policy_entries_per_sandbox)?;

        let id = req.sandbox_id.clone();
        let _g = self.locks.lock(&id);
        {
            let inner = lock(&self.inner);
            if let Some(rec) = inner.sandboxes.get(&id) {
                return Ok(self.view(rec));
            }
            if let Some(t) = inner.pool.owned_by(&id) {
                return Err(AgentError::Busy(format!(
                    "the previous network of {id:?} ({}) is still being cleaned; retry later",
                    t.name
                )));
            }
        }

        // 1. A TAP: first Ready one, else a released one whose free check passes now, else
        //    on demand (T2); with every address taken by TAPs the refill is still creating,
        //    the first of them that joins the pool (A38).
        let name = match self.acquire_ready(&id)? {
            Some(n) => n,
            None => match self.reclaim_released(&id)? {
                Some(n) => n,
                None => match self.create_tap(Some(&id)) {
                    Err(AgentError::Exhausted(why)) => self.await_refill(&id)?.ok_or(AgentError::Exhausted(why))?,
                    r => r?,
                },
            },
        };
        let (ip, ifindex) = {
            let inner = lock(&self.inner);
            let t = inner.pool.get(&name).ok_or_else(|| internal(format!("{name} left the pool")))?;
            (t.ip, t.ifindex)
        };

        // 2. Host ports.
        let mut records = Vec::new();
        {
            let mut inner = lock(&self.inner);
            for (i, p) in &ports {
                match inner.ports.claim(&id, p.host_port) {
                    Ok(hp) => records.push(PortRecord {
                        proto: p.proto,
                        container_port: p.container_port,
                        host_port: hp,
                        host_ip: p.host_ip.clone(),
                    }),
                    Err(e) => {
                        inner.ports.release_owner(&id);
                        drop(inner);
                        self.return_unprogrammed(&name);
                        return Err(match e {
                            PortError::Exhausted(..) => AgentError::Exhausted(e.to_string()),
                            _ => invalid(format!("port_mappings[{i}].host_port"), e.to_string()),
                        });
                    }
                }
            }
        }

        // 3. Intent, then datapath, then commit.
        let mut meta = req.persist_metadata.clone();
        meta.insert("sandbox_ip".into(), ip.to_string());
        meta.insert("host_tap_name".into(), name.clone());
        meta.insert("mvm_inner_ip".into(), self.cfg.raw.mvm_inner_ip.to_string());
        meta.insert("gateway_ip".into(), self.cfg.gateway_ip().to_string());
        let rec = SandboxRecord {
            sandbox_id: id.clone(),
            tap_name: name.clone(),
            tap_ifindex: ifindex,
            sandbox_ip: ip,
            version: self.next_version(),
            port_mappings: records,
            policy,
            persist_metadata: meta,
        };
        if let Err(e) = self.store.write(&rec, Phase::Creating) {
            lock(&self.inner).ports.release_owner(&id);
            self.return_unprogrammed(&name);
            return Err(internal(format!("write state of {id}: {e}")));
        }
        let programmed = (|| -> Result<(), AgentError> {
            for p in &rec.port_mappings {
                self.dp.add_port_mapping(&PortMapping {
                    proto: p.proto,
                    host_port: p.host_port,
                    ifindex,
                    guest_port: p.container_port,
                })?;
            }
            self.dp.replace_policy(ifindex, &rec.policy)?;
            self.dp.register_sandbox(&SandboxEntry { ifindex, ip, version: rec.version, id: id.clone() })?;
            self.store.advance(&id, Phase::Creating, Phase::Success).map_err(|e| internal(format!("commit {id}: {e}")))
        })();
        if let Err(e) = programmed {
            tracing::warn!(sandbox_id = %crate::state::LogSafe(&id), error = %loggable(&e), "ensure failed, rolling back");
            if let Err(pe) = self.transit(&mut lock(&self.inner), &name, Transition::Release) {
                tracing::error!("{pe}");
            }
            self.cleanup_tap(&name);
            return Err(e);
        }
        lock(&self.inner).sandboxes.insert(id.clone(), rec.clone());
        // The gateway gets the L7 rules before the guest can run (L3: never fails Ensure).
        self.push_egress(ip, Some(&rec.policy.rules));
        Ok(self.view(&rec))
    }

    /// The mappings to make (decision O23): an entry identical to an earlier one is dropped
    /// (upstream dedupes); a guest port (protocol and `container_port`) mapped again with
    /// another host port or `host_ip`, or a non-zero host port given twice (TCP and UDP alike:
    /// a host port has one owner), is `INVALID_ARGUMENT` naming the later entry and the earlier
    /// one. Checked before anything is taken, so such a request leaves nothing behind. Each
    /// mapping kept comes with its index in the request (for the errors of later steps).
    fn distinct_ports(&self, ports: &[PortRequest]) -> Result<Vec<(usize, PortRequest)>, AgentError> {
        use std::collections::hash_map::{Entry, HashMap};
        let mut out = Vec::with_capacity(ports.len());
        // First index of each guest port and of each explicit host port: linear in the list
        // (a request may carry 100,000 entries).
        let mut guest: HashMap<(crate::dataplane::Proto, u16), usize> = HashMap::new();
        let mut host: HashMap<u16, usize> = HashMap::new();
        for (i, p) in ports.iter().enumerate() {
            match guest.entry((p.proto, p.container_port)) {
                Entry::Occupied(j) if ports[*j.get()] == *p => continue,
                Entry::Occupied(j) => {
                    return Err(invalid(
                        format!("port_mappings[{i}].container_port"),
                        format!(
                            "{}/{} is already mapped by port_mappings[{}] (a guest port has one host port)",
                            p.proto,
                            p.container_port,
                            j.get()
                        ),
                    ));
                }
                Entry::Vacant(v) => {
                    v.insert(i);
                }
            }
            if p.host_port != 0
                && let Some(j) = host.insert(p.host_port, i)
            {
                return Err(invalid(
                    format!("port_mappings[{i}].host_port"),
                    format!(
                        "{} is already requested by port_mappings[{j}] (a host port serves one mapping, TCP or UDP)",
                        p.host_port
                    ),
                ));
            }
            out.push((i, p.clone()));
        }
        Ok(out)
    }

    /// Puts a TAP that was taken for `owner` but never programmed back to Ready.
    fn return_unprogrammed(&self, name: &str) {
        if let Err(e) = self.transit(&mut lock(&self.inner), name, Transition::Unacquire) {
            tracing::error!("{e}");
        }
    }

    // ---------------------------------------------------------------- Release / cleanup

    /// ReleaseNetwork: idempotent (unknown ids report released). The durable `deleting`
    /// intent is written first: if that fails, the call fails and nothing changes (the
    /// sandbox stays Active with its ports and registration; a retry works). After it, the
    /// call succeeds whatever the cleanup meets: the TAP goes through Cleaning back to Ready,
    /// or stays Cleaning for the maintenance loop (datapath error, or a VMM still holds it).
    /// Logs `network released` (info) or `release failed` (warn) with `sandbox_id`.
    pub fn release(&self, sandbox_id: &str) -> Result<bool, AgentError> {
        let t0 = Instant::now();
        let call = self.calls.begin();
        let r = self.release_inner(sandbox_id);
        drop(call);
        self.kick.notify_one();
        self.metrics.release_seconds.observe(t0.elapsed().as_secs_f64());
        self.metrics.release.with_label_values(&[if r.is_ok() { "ok" } else { "error" }]).inc();
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        match &r {
            Ok(_) => tracing::info!(sandbox_id = %crate::state::LogSafe(sandbox_id), ms, "network released"),
            Err(e) => {
                tracing::warn!(sandbox_id = %crate::state::LogSafe(sandbox_id), ms, error = %loggable(e), "release failed")
            }
        }
        r
    }

    fn release_inner(&self, id: &str) -> Result<bool, AgentError> {
        validate_sandbox_id(id).map_err(|r| invalid("sandbox_id", r))?;
        let _g = self.locks.lock(id);
        let (rec, cleaning) = {
            let inner = lock(&self.inner);
            (inner.sandboxes.get(id).cloned(), inner.pool.owned_by(id).is_some())
        };
        let Some(rec) = rec else {
            // Its TAP still being scrubbed: the maintenance loop finishes that, and deletes the
            // state record last.
            if cleaning {
                return Ok(true);
            }
            // Durable leftovers only: a stale record would claim a TAP the next owner gets.
            self.store.remove(id).map_err(|e| internal(format!("remove state of {id}: {e}")))?;
            return Ok(true);
        };
        // Durable intent first: until it is written, the sandbox stays as it is. By rename of
        // the committed record (every change is written there before it is kept in memory):
        // a rename needs no space, so a full disk never keeps a sandbox from being released
        // (decision R5). A missing file falls back to writing the record.
        let marked = match self.store.advance(id, Phase::Success, Phase::Deleting) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.store.write(&rec, Phase::Deleting),
            r => r,
        };
        marked.map_err(|e| internal(format!("mark {id} deleting: {e}")))?;
        {
            let mut inner = lock(&self.inner);
            inner.sandboxes.remove(id);
            if let Err(e) = self.transit(&mut inner, &rec.tap_name, Transition::Release) {
                tracing::error!("{e}");
            }
        }
        // Before the TAP (and so the IP) can be reused.
        self.push_egress(rec.sandbox_ip, None);
        // The scrub now; the free check (a reopen, which waits on the kernel) in the
        // maintenance pass that `release` wakes (decision F2).
        let ports: Vec<PortMapping> = rec
            .port_mappings
            .iter()
            .map(|p| PortMapping {
                proto: p.proto,
                host_port: p.host_port,
                ifindex: rec.tap_ifindex,
                guest_port: p.container_port,
            })
            .collect();
        self.scrub_released(&rec.tap_name, &ports);
        Ok(true)
    }

    /// GetNetwork.
    pub fn get(&self, sandbox_id: &str) -> Result<NetworkView, AgentError> {
        validate_sandbox_id(sandbox_id).map_err(|r| invalid("sandbox_id", r))?;
        lock(&self.inner)
            .sandboxes
            .get(sandbox_id)
            .map(|r| self.view(r))
            .ok_or_else(|| AgentError::NotFound(sandbox_id.to_string()))
    }

    /// ListNetworks, sorted by sandbox id.
    pub fn list(&self) -> Vec<SandboxRecord> {
        let mut v: Vec<_> = lock(&self.inner).sandboxes.values().cloned().collect();
        v.sort_by(|a, b| a.sandbox_id.cmp(&b.sandbox_id));
        v
    }

    /// ReconcileNetwork: re-asserts attachment, registration, port maps and (when given) the
    /// policy of a live sandbox. When the new policy denies a destination the old one allowed
    /// and `flush` (default: `flush_sessions_on_policy_tighten`) is on, the sandbox gets a new
    /// version after the new policy is in force: its established flows no longer match a
    /// session, and every new flow is classified by the new policy.
    pub fn reconcile(
        &self,
        sandbox_id: &str,
        policy: Option<EgressPolicy>,
        flush: Option<bool>,
    ) -> Result<NetworkView, AgentError> {
        validate_sandbox_id(sandbox_id).map_err(|r| invalid("sandbox_id", r))?;
        let limit = self.cfg.raw.policy_entries_per_sandbox;
        let compiled = policy.as_ref().map(|p| compile_policy(p, limit)).transpose()?;
        let _g = self.locks.lock(sandbox_id);
        let mut rec = lock(&self.inner)
            .sandboxes
            .get(sandbox_id)
            .cloned()
            .ok_or_else(|| AgentError::NotFound(sandbox_id.to_string()))?;
        if let (Some(p), Some(new)) = (policy, compiled) {
            // The stored policy was accepted under the limit of its day: compile it unlimited.
            let old = compile_policy(&rec.policy, u32::MAX)?;
            let tightened = new.tightens(&old);
            let flush = flush.unwrap_or(self.cfg.raw.flush_sessions_on_policy_tighten) && tightened.is_some();
            rec.policy = p;
            if flush {
                rec.version = self.next_version();
            }
            // Intent first: a restart converges to the record.
            self.store.write(&rec, Phase::Success).map_err(internal)?;
            self.dp.replace_policy(rec.tap_ifindex, &rec.policy)?;
            if let Some(ip) = tightened {
                tracing::info!(sandbox_id = %sandbox_id, denied = %ip, flush, "policy tightened");
            }
            // With a new version, converge re-registers the sandbox (after the replace: a flow
            // opened in between is classified by the new policy).
        }
        self.converge(&rec)?;
        lock(&self.inner).sandboxes.insert(sandbox_id.to_string(), rec.clone());
        // Re-asserts the gateway's copy too (new rules, or the same ones).
        self.push_egress(rec.sandbox_ip, Some(&rec.policy.rules));
        Ok(self.view(&rec))
    }

    /// Makes the datapath match a committed record without disturbing what already matches.
    pub(super) fn converge(&self, rec: &SandboxRecord) -> Result<(), AgentError> {
        let ifindex = self.dp.attach_sandbox(&rec.tap_name)?;
        if ifindex != rec.tap_ifindex {
            return Err(internal(format!("{}: ifindex {} != recorded {}", rec.tap_name, ifindex, rec.tap_ifindex)));
        }
        let want = SandboxEntry { ifindex, ip: rec.sandbox_ip, version: rec.version, id: rec.sandbox_id.clone() };
        match self.dp.sandbox(ifindex)? {
            Some(e) if e == want => {}
            Some(e) if e.id != rec.sandbox_id => {
                return Err(internal(format!(
                    "{}: datapath registers sandbox {:?}, state says {:?}",
                    rec.tap_name, e.id, rec.sandbox_id
                )));
            }
            _ => {
                self.dp.replace_policy(ifindex, &rec.policy)?;
                self.dp.register_sandbox(&want)?;
            }
        }
        let mut have: Vec<_> = self.dp.port_mappings()?.into_iter().filter(|m| m.ifindex == ifindex).collect();
        let mut wanted: Vec<_> = rec
            .port_mappings
            .iter()
            .map(|p| PortMapping { proto: p.proto, host_port: p.host_port, ifindex, guest_port: p.container_port })
            .collect();
        have.sort_by_key(|m| (m.proto, m.host_port));
        wanted.sort_by_key(|m| (m.proto, m.host_port));
        if have != wanted {
            self.dp.delete_port_mappings_of(ifindex)?;
            for m in &wanted {
                self.dp.add_port_mapping(m)?;
            }
        }
        let want = compile_policy(&rec.policy, u32::MAX)?;
        if !self.dp.policy(ifindex)?.is_some_and(|d| d.allow == want.allow && d.deny == want.deny) {
            self.dp.replace_policy(ifindex, &rec.policy)?;
        }
        // FQDN patterns a loader before R48 wrote are matched by their forgeable hash alone
        // until they have their names: named from the record, the generation sealed (R52).
        if !rec.policy.allow_fqdn.is_empty() {
            let b = self.dp.backfill_fqdn_names(ifindex, &rec.policy);
            if let Ok(b) = &b {
                self.metrics.fqdn_backfill.with_label_values(&["named"]).inc_by(b.named as u64);
                self.metrics.fqdn_backfill.with_label_values(&["sealed_out"]).inc_by(b.unnamed as u64);
            }
            match b {
                Ok(b) if b.unnamed > 0 => tracing::warn!(
                    sandbox_id = %rec.sandbox_id,
                    named = b.named,
                    unnamed = b.unnamed,
                    "FQDN keys no pattern of the record names: sealed out, they match nothing until the next policy write"
                ),
                Ok(b) if b.named > 0 => {
                    tracing::info!(sandbox_id = %rec.sandbox_id, named = b.named, "FQDN pattern names backfilled and sealed")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(
                    sandbox_id = %rec.sandbox_id,
                    "FQDN name backfill: {e}; its patterns written before R48 keep the hash-only match"
                ),
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- fd handoff

    /// A duplicate of the queue fd of `tap_name` for `sandbox_id` (`reference/upstream.md
    /// §1.3`): only an Active TAP owned by a committed sandbox. `Ok(None)` = no such TAP or
    /// not this sandbox's (errCode 1002); `Err` = anything else (errCode -1). An empty name
    /// means "the sandbox's TAP".
    pub fn tap_fd(&self, tap_name: &str, sandbox_id: &str) -> Result<Option<OwnedFd>, String> {
        if let Some(r) = self.tap_fd_if_open(tap_name, sandbox_id) {
            return r;
        }
        let (name, fd) = {
            let inner = lock(&self.inner);
            let Some(rec) = inner.sandboxes.get(sandbox_id) else { return Ok(None) };
            if !tap_name.is_empty() && rec.tap_name != tap_name {
                return Ok(None);
            }
            let Some(t) = inner.pool.get(&rec.tap_name) else { return Ok(None) };
            if t.state() != TapState::Active || t.owner() != Some(sandbox_id) {
                return Ok(None);
            }
            (t.name.clone(), t.fd.clone())
        };
        let fd = match fd {
            Some(fd) => fd,
            None => {
                // Adopted after a restart: open lazily; EBUSY means a VMM holds it (no reopen).
                let fd = Arc::new(self.host.reopen_tap(&name).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::ResourceBusy {
                        format!(
                            "{name} is held by another process (the sandbox's VMM, since before this agent \
                             started without a hand-over): it cannot be handed out again until the sandbox \
                             is released; its traffic is unaffected ({e})"
                        )
                    } else {
                        format!("open {name}: {e}")
                    }
                })?);
                lock(&self.inner).pool.set_fd(&name, Some(fd.clone()));
                fd
            }
        };
        fd.try_clone().map(Some).map_err(|e| format!("dup fd of {name}: {e}"))
    }

    /// [`Agent::tap_fd`] when it needs no blocking work: `None` when the TAP's queue fd must
    /// first be opened (adopted after a restart), else the answer of [`Agent::tap_fd`]. Takes
    /// the pool lock (held only for map lookups, never across a syscall) and dups an fd, so the
    /// fd server calls it on its async task and goes to the blocking pool only for the open.
    pub fn tap_fd_if_open(&self, tap_name: &str, sandbox_id: &str) -> Option<Result<Option<OwnedFd>, String>> {
        let (name, fd) = {
            let inner = lock(&self.inner);
            let Some(rec) = inner.sandboxes.get(sandbox_id) else { return Some(Ok(None)) };
            if !tap_name.is_empty() && rec.tap_name != tap_name {
                return Some(Ok(None));
            }
            let Some(t) = inner.pool.get(&rec.tap_name) else { return Some(Ok(None)) };
            if t.state() != TapState::Active || t.owner() != Some(sandbox_id) {
                return Some(Ok(None));
            }
            (t.name.clone(), t.fd.clone()?)
        };
        Some(fd.try_clone().map(Some).map_err(|e| format!("dup fd of {name}: {e}")))
    }
}

#[cfg(test)]
mod loggable_tests {
    use super::*;

    #[test]
    fn reasons_are_logged_for_address_fields_and_never_for_rules() {
        let port = invalid("port_mappings[0].host_port", "80 is outside host_port_range 20000-29999");
        assert_eq!(loggable(&port), "invalid port_mappings[0].host_port: 80 is outside host_port_range 20000-29999");
        let cidr = invalid("cubevs_context.allow_out[1]", "\"10.0.0.0/33\" is not a CIDR");
        assert!(loggable(&cidr).ends_with("is not a CIDR"), "{}", loggable(&cidr));
        let secret = invalid("cubevs_context.rules[0].action.inject[0].secret", "sk-live-123 is too long");
        assert_eq!(loggable(&secret), "invalid cubevs_context.rules[0].action.inject[0].secret");
        let meta = invalid("persist_metadata[\"k\"]", "value v");
        assert_eq!(loggable(&meta), "invalid persist_metadata[\"k\"]");
    }
}
