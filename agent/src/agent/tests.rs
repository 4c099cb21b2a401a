//! Unit tests of the service core over the fake host and dataplane.

use super::maintenance::REFILL_WAIT;
use super::*;
use crate::{config::Config, dataplane::FakeDataplane, host::FakeHost, state::Phase};
use std::time::{Duration, Instant};

struct Fixture {
    agent: Agent,
    dp: Arc<FakeDataplane>,
    host: Arc<FakeHost>,
    dir: std::path::PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn fixture(tag: &str) -> Fixture {
    let dir = std::env::temp_dir().join(format!("cubenet-agent-unit-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = Config {
        cidr: "10.9.0.0/24".into(),
        tap_init_num: 2,
        state_dir: dir.clone(),
        reserved_ports_file: "/nonexistent".into(),
        ..Config::default()
    };
    let cfg = Arc::new(cfg.validate().unwrap());
    let dp = Arc::new(FakeDataplane::default());
    let host = Arc::new(FakeHost::default());
    let h = host.clone();
    *dp.resolver.lock().unwrap() = Some(Box::new(move |n| h.taps.lock().unwrap().get(n).map(|t| t.ifindex)));
    let store = StateStore::open(&dir).unwrap();
    let agent = Agent::new(cfg, host.clone(), dp.clone(), store);
    Fixture { agent, dp, host, dir }
}

fn req(id: &str) -> EnsureRequest {
    EnsureRequest {
        sandbox_id: id.into(),
        ports: vec![parse_port_request(0, "", 80, 0, "").unwrap()],
        policy: Some(EgressPolicy {
            allow_internet_access: false,
            allow_out: vec!["1.1.1.1/32".into()],
            ..Default::default()
        }),
        persist_metadata: BTreeMap::new(),
    }
}

#[test]
fn ensure_release_reuse() {
    let f = fixture("reuse");
    f.agent.recover().unwrap();
    assert_eq!(f.agent.warm(2, 2), 2);
    assert!(f.agent.readiness().is_err(), "not started yet");
    f.agent.set_started();
    f.agent.readiness().unwrap();

    let v = f.agent.ensure(req("sb-1")).unwrap();
    let r = &v.record;
    assert_eq!(r.tap_name, "z10.9.0.2");
    assert_eq!(r.port_mappings[0].host_port, 20000);
    assert_eq!(r.persist_metadata["sandbox_ip"], "10.9.0.2");
    assert_eq!(r.persist_metadata["gateway_ip"], "10.9.0.1");
    assert_eq!(v.ip_cidr, "169.254.68.6/30");
    // Idempotent.
    assert_eq!(f.agent.ensure(req("sb-1")).unwrap(), v);
    assert_eq!(f.dp.sandbox(r.tap_ifindex).unwrap().unwrap().id, "sb-1");
    assert_eq!(f.dp.port_mappings().unwrap().len(), 1);
    assert!(f.agent.tap_fd(&r.tap_name, "sb-1").unwrap().is_some());
    assert!(f.agent.tap_fd(&r.tap_name, "other").unwrap().is_none());
    assert!(f.agent.tap_fd("z10.9.0.3", "sb-1").unwrap().is_none());

    // A stray cleanup (e.g. a maintenance pass that raced a Release) never scrubs an
    // Active TAP or touches its owner's state.
    assert!(!f.agent.cleanup_tap(&r.tap_name));
    assert_eq!(f.agent.store.count(), 1);
    assert_eq!(f.agent.pool_counts()[&TapState::Active], 1);
    assert!(f.agent.release("sb-1").unwrap());
    assert!(f.agent.release("sb-1").unwrap(), "release is idempotent");
    assert!(f.dp.sandbox(r.tap_ifindex).unwrap().is_none());
    assert!(f.dp.port_mappings().unwrap().is_empty());
    let p = f.dp.policy(r.tap_ifindex).unwrap().unwrap();
    // Back to what the datapath gives a Ready TAP: the baseline deny only.
    assert!(p.allow.is_empty() && p.deny == cubevs::policy::BASELINE_DENY.to_vec(), "baseline deny back: {p:?}");
    assert_eq!(f.agent.store.count(), 0);
    assert_eq!(f.agent.host_ports_in_use(), 0);
    assert!(matches!(f.agent.get("sb-1"), Err(AgentError::NotFound(_))));
    // Scrubbed, but not reusable before the free check (run by the maintenance pass).
    assert_eq!(f.agent.pool_counts()[&TapState::Cleaning], 1);
    let ready = f.agent.pool_counts()[&TapState::Ready];
    assert_eq!(f.agent.finish_cleanups(), 1);
    assert_eq!(f.agent.pool_counts()[&TapState::Ready], ready + 1);

    // Reuse: same TAP, new version, none of the old policy.
    let v2 = f.agent.ensure(EnsureRequest { sandbox_id: "sb-2".into(), ..Default::default() }).unwrap();
    assert_eq!(v2.record.tap_name, r.tap_name);
    assert!(v2.record.version > r.version);
    let p = f.dp.policy(r.tap_ifindex).unwrap().unwrap();
    assert!(p.allow.is_empty() && p.deny == cubevs::policy::BASELINE_DENY.to_vec(), "{p:?}");
}

#[test]
fn failed_ensure_leaves_nothing() {
    let f = fixture("rollback");
    f.agent.recover().unwrap();
    f.agent.warm(1, 1);
    f.dp.fail_register.store(true, Ordering::Relaxed);
    assert!(f.agent.ensure(req("sb-x")).is_err());
    assert_eq!(f.agent.store.count(), 0);
    assert!(f.dp.port_mappings().unwrap().is_empty());
    assert_eq!(f.agent.host_ports_in_use(), 0);
    assert_eq!(f.agent.pool_counts()[&TapState::Ready], 1);
    assert!(f.agent.list().is_empty());
}

#[test]
fn failed_cleanup_stays_cleaning_and_is_retried() {
    let f = fixture("retry");
    f.agent.recover().unwrap();
    f.agent.warm(1, 1);
    let v = f.agent.ensure(req("sb-r")).unwrap();
    f.dp.fail_delete_ports.store(true, Ordering::Relaxed);
    assert!(f.agent.release("sb-r").unwrap());
    assert_eq!(f.agent.pool_counts()[&TapState::Cleaning], 1);
    let t = f.agent.taps().into_iter().find(|t| t.tap_name == v.record.tap_name).unwrap();
    assert_eq!((t.retry_count, t.last_error.contains("injected")), (1, true), "{t:?}");
    assert_eq!(f.agent.store.count(), 1, "the deleting record stays until cleanup succeeds");
    // The same id cannot be ensured while its old network is still being cleaned.
    assert!(matches!(f.agent.ensure(req("sb-r")), Err(AgentError::Busy(_))));
    f.dp.fail_delete_ports.store(false, Ordering::Relaxed);
    f.agent.maintain();
    assert_eq!(f.agent.pool_counts()[&TapState::Cleaning], 0);
    assert_eq!(f.agent.store.count(), 0);
    assert_eq!(f.agent.host_ports_in_use(), 0);
    assert!(f.dp.port_mappings().unwrap().is_empty());
    f.agent.ensure(req("sb-r")).unwrap();
}

#[test]
fn invalid_fields_are_named() {
    let f = fixture("invalid");
    let e = f.agent.ensure(EnsureRequest { sandbox_id: "a/b".into(), ..Default::default() }).unwrap_err();
    assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "sandbox_id"), "{e}");
    let mut r = req("ok");
    r.policy = Some(EgressPolicy { allow_out: vec!["nope".into()], ..Default::default() });
    let e = f.agent.ensure(r).unwrap_err();
    assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "cubevs_context.allow_out[0]"), "{e}");
    let e = parse_port_request(3, "sctp", 80, 0, "").unwrap_err();
    assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "port_mappings[3].protocol"), "{e}");
    let e = parse_port_request(0, "tcp", 0, 0, "").unwrap_err();
    assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "port_mappings[0].container_port"), "{e}");
    let mut r = req("ok2");
    r.ports = vec![parse_port_request(0, "tcp", 80, 80, "").unwrap()];
    let e = f.agent.ensure(r).unwrap_err();
    assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "port_mappings[0].host_port"), "{e}");
}

/// O23: a guest port mapped twice, or a host port given twice (TCP and UDP alike), is
/// INVALID_ARGUMENT naming the later entry before a TAP or port is taken; identical entries
/// collapse into one mapping.
#[test]
fn duplicate_port_mappings_are_refused_or_collapsed() {
    let f = fixture("dupports");
    f.agent.recover().unwrap();
    f.agent.warm(1, 1);
    let p = |proto: &str, guest: u32, host: u32| parse_port_request(0, proto, guest, host, "").unwrap();
    let cases = [
        (vec![p("tcp", 80, 20700), p("tcp", 80, 20701)], "port_mappings[1].container_port", "port_mappings[0]"),
        (
            vec![p("tcp", 81, 0), p("udp", 81, 0), p("", 81, 0), p("tcp", 81, 20702)],
            "port_mappings[3].container_port",
            "port_mappings[0]",
        ),
        (vec![p("tcp", 80, 20703), p("udp", 53, 20703)], "port_mappings[1].host_port", "port_mappings[0]"),
        (
            vec![p("udp", 53, 0), p("tcp", 80, 20704), p("tcp", 81, 20704)],
            "port_mappings[2].host_port",
            "port_mappings[1]",
        ),
    ];
    for (ports, field, earlier) in cases {
        let mut r = req("dup");
        r.ports = ports;
        let e = f.agent.ensure(r).unwrap_err();
        assert!(matches!(&e, AgentError::Invalid { field: got, .. } if got == field), "{field}: {e}");
        assert!(e.to_string().contains(earlier), "{e}");
        assert_eq!(f.agent.pool_counts()[&TapState::Ready], 1, "a refused request took its TAP");
        assert_eq!(f.agent.host_ports_in_use(), 0);
        assert!(f.dp.port_mappings().unwrap().is_empty());
    }
    // Identical entries (the protocol as spelt or defaulted) are one mapping.
    let mut r = req("dup");
    r.ports = vec![p("", 80, 0), p("tcp", 80, 0), p("TCP", 80, 0), p("udp", 80, 0), p("udp", 80, 0)];
    let v = f.agent.ensure(r).unwrap();
    let got: Vec<_> = v.record.port_mappings.iter().map(|m| (m.proto, m.container_port)).collect();
    assert_eq!(got, vec![(Proto::Tcp, 80), (Proto::Udp, 80)]);
    assert_eq!(f.dp.port_mappings().unwrap().len(), 2);
    assert_eq!(f.agent.host_ports_in_use(), 2);
    // A later error still names the entry by its index in the request, collapsed ones counted.
    let mut r = req("dup2");
    let taken = v.record.port_mappings[0].host_port.into();
    r.ports = vec![p("tcp", 80, 0), p("tcp", 80, 0), p("tcp", 81, taken)];
    let e = f.agent.ensure(r).unwrap_err();
    assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "port_mappings[2].host_port"), "{e}");
}

/// O25: `persist_metadata` is bounded in entries and bytes; over either, INVALID_ARGUMENT
/// naming the field and no value, before anything is taken.
#[test]
fn persist_metadata_is_bounded() {
    let f = fixture("meta");
    f.agent.recover().unwrap();
    f.agent.warm(1, 1);
    let mut r = req("meta");
    r.persist_metadata = (0..=MAX_METADATA_ENTRIES).map(|i| (format!("k{i}"), String::new())).collect();
    let e = f.agent.ensure(r).unwrap_err();
    assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "persist_metadata"), "{e}");
    let mut r = req("meta");
    r.persist_metadata = BTreeMap::from([("secret".into(), "s".repeat(MAX_METADATA_BYTES))]);
    let e = f.agent.ensure(r).unwrap_err();
    assert!(matches!(&e, AgentError::Invalid { field, .. } if field == "persist_metadata"), "{e}");
    assert!(!e.to_string().contains("sss"), "{e}");
    assert_eq!(f.agent.pool_counts()[&TapState::Ready], 1);
    assert_eq!(f.agent.store.count(), 0);
    // At the limits it is stored and returned.
    let mut r = req("meta");
    let mut m: BTreeMap<String, String> =
        (0..MAX_METADATA_ENTRIES - 1).map(|i| (format!("k{i:03}"), String::new())).collect();
    let used: usize = m.keys().map(String::len).sum();
    m.insert("big".into(), "v".repeat(MAX_METADATA_BYTES - used - 3));
    r.persist_metadata = m.clone();
    let v = f.agent.ensure(r).unwrap();
    assert!(m.iter().all(|(k, val)| v.record.persist_metadata.get(k) == Some(val)));
}

#[test]
fn recovery_adopts_and_cleans() {
    let f = fixture("recover");
    f.agent.recover().unwrap();
    f.agent.warm(2, 1);
    let v = f.agent.ensure(req("sb-1")).unwrap();
    // A second agent over the same host, datapath and state directory.
    let store = StateStore::open(&f.dir).unwrap();
    let cfg = f.agent.cfg.clone();
    let a2 = Agent::new(cfg, f.host.clone(), f.dp.clone(), store);
    let s = a2.recover().unwrap();
    assert_eq!(s.adopted, 1);
    assert_eq!(s.cleaned, 1);
    assert_eq!(a2.get("sb-1").unwrap(), v);
    assert_eq!(a2.pool_counts()[&TapState::Active], 1);
    assert_eq!(a2.host_ports_in_use(), 1);
    // Its TAP, held by the VMM since before the restart, is refused with a reason an operator
    // can act on (errCode -1); once nobody holds it, it is reopened and handed out.
    let tap = v.record.tap_name.clone();
    f.host.held.lock().unwrap().insert(tap.clone());
    let e = a2.tap_fd(&tap, "sb-1").unwrap_err();
    assert!(e.contains("held by another process") && e.contains("until the sandbox is released"), "{e}");
    f.host.held.lock().unwrap().clear();
    assert!(a2.tap_fd(&tap, "sb-1").unwrap().is_some());
    // A conflicting record makes recovery refuse.
    let mut bad = v.record.clone();
    bad.sandbox_id = "sb-evil".into();
    a2.store.write(&bad, Phase::Success).unwrap();
    let a3 = Agent::new(f.agent.cfg.clone(), f.host.clone(), f.dp.clone(), StateStore::open(&f.dir).unwrap());
    let e = a3.recover().unwrap_err().to_string();
    assert!(e.contains("conflicting identity"), "{e}");
}

#[test]
fn release_writes_its_intent_before_forgetting() {
    let f = fixture("intent");
    f.agent.recover().unwrap();
    f.agent.warm(1, 1);
    let v = f.agent.ensure(req("sb-i")).unwrap();
    let ifindex = v.record.tap_ifindex;
    // The store cannot mark sb-i deleting: a directory squats on that record's name (the
    // intent is a rename, R5, so squatting on the temporary file would not stop it).
    let squat = f.dir.join("sb-i.deleting.json");
    std::fs::create_dir(&squat).unwrap();
    let e = f.agent.release("sb-i").unwrap_err();
    assert!(matches!(e, AgentError::Internal(_)), "{e}");
    // Nothing was forgotten: still Active, registered, mapped, with its ports and state file.
    assert_eq!(f.agent.get("sb-i").unwrap(), v);
    assert_eq!(f.agent.pool_counts()[&TapState::Active], 1);
    assert_eq!(f.dp.sandbox(ifindex).unwrap().map(|e| e.id), Some("sb-i".to_string()));
    assert_eq!(f.dp.port_mappings().unwrap().len(), 1);
    assert_eq!(f.agent.host_ports_in_use(), 1);
    assert!(f.dir.join("sb-i.success.json").exists());
    // Once the store works again, a retry releases for real.
    std::fs::remove_dir(&squat).unwrap();
    assert!(f.agent.release("sb-i").unwrap());
    assert!(matches!(f.agent.get("sb-i"), Err(AgentError::NotFound(_))));
    f.agent.finish_cleanups();
    assert_eq!(f.agent.pool_counts()[&TapState::Ready], 1);
    assert!(f.dp.sandbox(ifindex).unwrap().is_none());
    assert!(f.dp.port_mappings().unwrap().is_empty());
    assert_eq!((f.agent.host_ports_in_use(), f.agent.store.count()), (0, 0));
}

#[test]
fn sandbox_lock_map_does_not_grow() {
    let f = fixture("locks");
    f.agent.recover().unwrap();
    f.agent.warm(2, 1);
    for i in 0..20 {
        f.agent.ensure(req(&format!("sb-{i}"))).unwrap();
        assert!(matches!(f.agent.reconcile(&format!("ghost-{i}"), None, None), Err(AgentError::NotFound(_))));
        assert!(f.agent.release(&format!("never-{i}")).unwrap());
    }
    assert_eq!(f.agent.lock_entries(), 0, "live sandboxes and unknown ids keep no lock entry");
    for i in 0..20 {
        assert!(f.agent.release(&format!("sb-{i}")).unwrap());
    }
    assert_eq!(f.agent.lock_entries(), 0);
}

#[test]
fn maintenance_pass_does_not_copy_sessions() {
    let f = fixture("maint");
    f.agent.recover().unwrap();
    f.agent.warm(2, 1);
    f.agent.ensure(req("sb-m")).unwrap();
    f.agent.release("sb-m").unwrap();
    // Recovery reads the sessions once (version seeding); passes must not.
    f.dp.sessions_calls.store(0, Ordering::Relaxed);
    f.agent.maintain();
    f.agent.maintain();
    assert_eq!(f.dp.sessions_calls.load(Ordering::Relaxed), 0, "a maintenance pass listed every session");
    assert_eq!(f.agent.pool_counts()[&TapState::Ready], 2);
}

#[test]
fn policy_write_failures_never_strand_a_tap_or_state() {
    let f = fixture("policyfull");
    f.agent.recover().unwrap();
    f.agent.warm(2, 1);
    let a = f.agent.ensure(req("sb-a")).unwrap();
    // From here on every policy write fails (the tries are full).
    f.dp.fail_policy.store(true, Ordering::Relaxed);
    // A failed Ensure leaves nothing behind: no state file, no ports, its TAP back to Ready.
    assert!(f.agent.ensure(req("sb-b")).is_err());
    let files: Vec<_> = std::fs::read_dir(&f.dir).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(files, vec![std::ffi::OsString::from("sb-a.success.json")]);
    assert_eq!(f.agent.host_ports_in_use(), 1);
    let counts = f.agent.pool_counts();
    assert_eq!((counts[&TapState::Ready], counts[&TapState::Active], counts[&TapState::Cleaning]), (1, 1, 0));
    // Release always succeeds and returns the TAP although no baseline can be written; the
    // sandbox is unregistered (its TAP drops everything) and its policy entries are gone.
    assert!(f.agent.release("sb-a").unwrap());
    f.agent.finish_cleanups();
    let counts = f.agent.pool_counts();
    assert_eq!((counts[&TapState::Ready], counts[&TapState::Cleaning]), (2, 0));
    assert!(f.dp.sandbox(a.record.tap_ifindex).unwrap().is_none());
    assert!(f.dp.policy(a.record.tap_ifindex).unwrap().is_none());
    assert_eq!((f.agent.host_ports_in_use(), f.agent.store.count()), (0, 0));
    // A restart over a half-released sandbox recovers while the tries are still full.
    f.dp.fail_policy.store(false, Ordering::Relaxed);
    let c = f.agent.ensure(req("sb-c")).unwrap();
    f.dp.fail_policy.store(true, Ordering::Relaxed);
    f.agent.store.write(&c.record, Phase::Deleting).unwrap();
    let a2 = Agent::new(f.agent.cfg.clone(), f.host.clone(), f.dp.clone(), StateStore::open(&f.dir).unwrap());
    let s = a2.recover().unwrap();
    assert_eq!(s.cleaned, 2, "{s:?}");
    assert_eq!(a2.pool_counts()[&TapState::Ready], 2);
    assert_eq!(a2.store.count(), 0);
    assert!(f.dp.sandbox(c.record.tap_ifindex).unwrap().is_none());
}

#[test]
fn readiness_says_whether_an_ensure_can_succeed() {
    let f = fixture("ready");
    f.agent.recover().unwrap();
    let ready = f.agent.watch_readiness();
    f.agent.warm(1, 1);
    f.agent.set_started();
    f.agent.readiness().unwrap();
    assert!(*ready.borrow());
    // No Ready TAP, but the pool can refill: an Ensure would create one on demand.
    f.agent.ensure(req("sb-1")).unwrap();
    assert_eq!(f.agent.pool_counts()[&TapState::Ready], 0);
    f.agent.readiness().unwrap();
    // TAP creation fails from now on: no interface can be attached.
    *f.dp.resolver.lock().unwrap() = Some(Box::new(|_| None));
    f.agent.maintain();
    let e = f.agent.readiness().unwrap_err();
    assert!(e.contains("no Ready TAP and the pool cannot refill") && e.contains("no interface"), "{e}");
    assert!(!*ready.borrow(), "the watch follows");
    assert!(f.agent.ensure(req("sb-2")).is_err(), "readiness told the truth");
    // A TAP back in Ready makes it ready again, although creation still fails.
    f.agent.release("sb-1").unwrap();
    f.agent.finish_cleanups();
    f.agent.readiness().unwrap();
    assert!(*ready.borrow());
}

#[test]
fn reconcile_flushes_only_when_the_policy_tightens() {
    let f = fixture("tighten");
    f.agent.recover().unwrap();
    f.agent.warm(1, 1);
    let open = EgressPolicy::default();
    let v0 = f.agent.ensure(EnsureRequest { sandbox_id: "sb-t".into(), ..Default::default() }).unwrap();
    let version = |f: &Fixture| f.dp.sandbox(v0.record.tap_ifindex).unwrap().unwrap().version;
    let base = version(&f);
    assert_eq!(base, v0.record.version);
    // The same policy again, and a looser one: no flush.
    f.agent.reconcile("sb-t", Some(open.clone()), None).unwrap();
    let looser = EgressPolicy { allow_out: vec!["10.1.0.0/16".into()], ..Default::default() };
    f.agent.reconcile("sb-t", Some(looser.clone()), None).unwrap();
    assert_eq!(version(&f), base, "a non-tightening Reconcile flushed");
    // Tightening with the override off keeps the version; with the default it changes,
    // in the datapath and in the record.
    let tight = EgressPolicy { deny_out: vec!["198.51.100.1".into()], ..looser.clone() };
    f.agent.reconcile("sb-t", Some(tight.clone()), Some(false)).unwrap();
    assert_eq!(version(&f), base);
    let v = f.agent.reconcile("sb-t", Some(looser), None).unwrap();
    assert_eq!(version(&f), base, "loosening again");
    assert_eq!(v.record.version, base);
    let v = f.agent.reconcile("sb-t", Some(tight), None).unwrap();
    assert!(version(&f) > base, "tightening did not flush");
    assert_eq!(v.record.version, version(&f));
    assert_eq!(f.agent.get("sb-t").unwrap().record.version, version(&f));
    // Over the limit: refused naming the list and the limit, nothing changes.
    let many: Vec<String> = (0..1025u32).map(|i| Ipv4Addr::from(0x0b00_0000 + i).to_string()).collect();
    let before = f.dp.policy(v0.record.tap_ifindex).unwrap();
    let e = f.agent.reconcile("sb-t", Some(EgressPolicy { allow_out: many, ..Default::default() }), None);
    let e = e.unwrap_err().to_string();
    assert!(e.contains("cubevs_context.allow_out") && e.contains("1024"), "{e}");
    assert_eq!(f.dp.policy(v0.record.tap_ifindex).unwrap(), before);
}

#[test]
fn taps_never_outnumber_the_datapath_interfaces() {
    let f = fixture("capacity");
    f.dp.interface_limit.store(3, std::sync::atomic::Ordering::Relaxed);
    f.agent.recover().unwrap();
    assert_eq!(f.agent.warm(2, 2), 2);
    f.agent.set_started();
    for id in ["sb-1", "sb-2", "sb-3"] {
        f.agent.ensure(EnsureRequest { sandbox_id: id.into(), ..Default::default() }).unwrap();
    }
    // A refill wants two more Ready TAPs; none may be created past the limit.
    f.agent.warm(2, 2);
    let total: usize = f.agent.pool_counts().values().sum();
    assert_eq!(total, 3, "{:?}", f.agent.pool_counts());
    let e = f.agent.ensure(EnsureRequest { sandbox_id: "sb-4".into(), ..Default::default() }).unwrap_err();
    assert!(matches!(&e, AgentError::Exhausted(m) if m.contains("at most 3")), "{e}");
    assert!(matches!(f.agent.get("sb-4"), Err(AgentError::NotFound(_))), "nothing left of the refused Ensure");
    // A Release frees the interface for the next sandbox.
    assert!(f.agent.release("sb-1").unwrap());
    f.agent.finish_cleanups();
    f.agent.ensure(EnsureRequest { sandbox_id: "sb-4".into(), ..Default::default() }).unwrap();
}

#[test]
fn an_ensure_waits_for_the_tap_the_refill_is_creating_with_the_last_address() {
    let f = fixture("refill-wait");
    f.dp.interface_limit.store(3, std::sync::atomic::Ordering::Relaxed);
    f.agent.recover().unwrap();
    assert_eq!(f.agent.warm(2, 2), 2);
    f.agent.set_started();
    for id in ["sb-1", "sb-2"] {
        f.agent.ensure(EnsureRequest { sandbox_id: id.into(), ..Default::default() }).unwrap();
    }
    // The refill creates the third and last TAP, slowly; an Ensure arrives meanwhile. Before
    // A38 it was refused RESOURCE_EXHAUSTED while the TAP it needed was being made.
    *f.host.create_delay.lock().unwrap() = Duration::from_millis(300);
    std::thread::scope(|s| {
        let refill = s.spawn(|| f.agent.warm(1, 1));
        let end = Instant::now() + Duration::from_secs(5);
        while lock(&f.agent.inner).ipam.in_use() < 3 {
            assert!(Instant::now() < end, "the refill never took the last address");
            std::thread::sleep(Duration::from_millis(1));
        }
        let t = Instant::now();
        let v = f.agent.ensure(EnsureRequest { sandbox_id: "sb-3".into(), ..Default::default() }).unwrap();
        assert_eq!(v.record.tap_name, "z10.9.0.4", "the refill's TAP");
        assert!(t.elapsed() < REFILL_WAIT, "waited {:?}", t.elapsed());
        assert_eq!(refill.join().unwrap(), 1);
    });
    // Nothing in flight: refused at once, as before.
    *f.host.create_delay.lock().unwrap() = Duration::ZERO;
    let t = Instant::now();
    let e = f.agent.ensure(EnsureRequest { sandbox_id: "sb-4".into(), ..Default::default() }).unwrap_err();
    assert!(matches!(&e, AgentError::Exhausted(m) if m.contains("at most 3")), "{e}");
    assert!(t.elapsed() < Duration::from_millis(500), "refused after {:?}", t.elapsed());
}

#[test]
fn an_ensure_reclaims_a_released_tap_before_creating_one() {
    let f = fixture("reclaim");
    f.agent.recover().unwrap();
    f.agent.warm(1, 1);
    let a = f.agent.ensure(req("sb-a")).unwrap().record.tap_name;
    assert!(f.agent.release("sb-a").unwrap());
    // Released: scrubbed, waiting for the maintenance pass's free check; nothing is Ready.
    assert_eq!((f.agent.pool_counts()[&TapState::Ready], f.agent.pool_counts()[&TapState::Cleaning]), (0, 1));
    // The next Ensure runs that free check itself and takes the TAP: no new TAP on the node.
    let b = f.agent.ensure(req("sb-b")).unwrap().record.tap_name;
    assert_eq!(b, a);
    assert_eq!(f.host.taps.lock().unwrap().len(), 1);
    assert!(f.agent.release("sb-b").unwrap());
    // A released TAP its VMM still holds is never handed out: the Ensure creates one.
    f.host.held.lock().unwrap().insert(a.clone());
    let c = f.agent.ensure(req("sb-c")).unwrap().record.tap_name;
    assert_ne!(c, a);
    assert_eq!(f.host.taps.lock().unwrap().len(), 2);
    let held = f.agent.taps().into_iter().find(|t| t.tap_name == a).unwrap();
    assert_eq!(held.state, TapState::Cleaning, "{held:?}");
    assert!(held.last_error.contains("held"), "{held:?}");
    // Once the VMM let go, the maintenance pass makes it Ready as before.
    f.host.held.lock().unwrap().clear();
    assert_eq!(f.agent.finish_cleanups(), 1);
    assert_eq!(f.agent.pool_counts()[&TapState::Ready], 1);
}

#[test]
fn a_trimmed_tap_stays_listed_until_it_is_deleted() {
    let f = fixture("trim");
    f.agent.recover().unwrap();
    f.agent.warm(3, 1);
    f.host.fail_delete.store(true, Ordering::Relaxed);
    assert_eq!(f.agent.trim(1), 0, "no deletion succeeded");
    // Both surplus TAPs are still on the node, and the pool still lists them: retiring.
    assert_eq!(f.host.taps.lock().unwrap().len(), 3);
    let listed = f.agent.taps();
    assert_eq!(listed.len(), 3);
    let retiring: Vec<_> = listed.iter().filter(|t| t.last_error.contains("retiring")).collect();
    assert_eq!(retiring.len(), 2, "{listed:?}");
    assert!(retiring.iter().all(|t| t.state == TapState::Cleaning));
    // Never handed out, never cleaned back to Ready.
    assert_eq!(f.agent.finish_cleanups(), 0);
    let first = f.agent.ensure(req("sb-1")).unwrap().record.tap_name;
    assert!(retiring.iter().all(|t| t.tap_name != first));
    let second = f.agent.ensure(req("sb-2")).unwrap().record.tap_name;
    assert!(retiring.iter().all(|t| t.tap_name != second), "a new TAP, not a retiring one");
    // The next pass deletes them; then they leave the pool and their addresses are free.
    f.host.fail_delete.store(false, Ordering::Relaxed);
    assert_eq!(f.agent.trim(1), 2);
    let names: Vec<String> = f.agent.taps().into_iter().map(|t| t.tap_name).collect();
    let node: Vec<String> = f.host.taps.lock().unwrap().keys().cloned().collect();
    assert_eq!(names, node);
    assert_eq!(names.len(), 2);
}

#[test]
fn upkeep_yields_to_calls_only_above_the_low_watermark() {
    let f = fixture("yield");
    f.agent.recover().unwrap();
    assert_eq!(f.agent.warm(2, 2), 2);
    assert_eq!(f.agent.low_watermark(), 1, "a quarter of tap_init_num = 2, at least 1");
    f.agent.ensure(req("sb-a")).unwrap();
    assert!(f.agent.release("sb-a").unwrap());
    let counts = |a: &Agent| (a.pool_counts()[&TapState::Ready], a.pool_counts()[&TapState::Cleaning]);
    assert_eq!(counts(&f.agent), (1, 1));
    let taps_on_node = || f.host.taps.lock().unwrap().len();
    assert_eq!(taps_on_node(), 2);

    // A call in flight, the pool at its watermark: the pass holds back and does nothing.
    let call = f.agent.calls.begin();
    assert!(f.agent.upkeep_wait(true).is_some());
    assert_eq!(f.agent.finish_cleanups(), 0, "the free check waits for the call");
    assert_eq!(f.agent.warm(2, 2), 0, "the refill waits for the call");
    assert_eq!(counts(&f.agent), (1, 1));

    // The pool below its watermark: the same pass runs at once, call or not.
    f.agent.ensure(req("sb-b")).unwrap();
    assert_eq!(counts(&f.agent), (0, 1));
    assert_eq!(f.agent.upkeep_wait(true), None);
    assert_eq!(f.agent.finish_cleanups(), 1, "the released TAP's free check runs");
    assert_eq!(counts(&f.agent), (1, 0));
    // Back at the watermark with the call still in flight: the refill stops again.
    assert_eq!(f.agent.warm(2, 2), 0);
    assert_eq!(taps_on_node(), 2);

    // The call ended: the loop waits for the quiet period, then the refill runs.
    drop(call);
    assert!(f.agent.upkeep_wait(true).is_some(), "ended less than QUIET ago");
    assert!(f.agent.upkeep_wait(false).is_some());
    assert!(!f.agent.upkeep_should_yield());
    assert_eq!(f.agent.warm(2, 2), 1);
    assert_eq!(counts(&f.agent), (2, 0));
    assert_eq!(taps_on_node(), 3);
}
