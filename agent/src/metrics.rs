//! Prometheus metrics, all named `cubenet_…`. Monotonic values are counters (`…_total`,
//! `# TYPE … counter`); the datapath's are read from its maps at scrape time
//! ([`Metrics::register_datapath`]).

use std::sync::Arc;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    core::{Collector, Desc},
    proto::MetricFamily,
};

use crate::dataplane::Dataplane;

mod sandbox;

/// `stage` values of `cubenet_tap_create_failures_total`: the TAP could not be made
/// (`create`: tuntap, sysctls, link, neighbour) or `from_cube` not attached to it (`attach`).
pub const TAP_CREATE_STAGES: &[&str] = &["create", "attach"];

/// `result` values of `cubenet_egress_push_total` and `cubenet_egress_learned_push_total`.
pub const PUSH_RESULTS: &[&str] = &["ok", "retry", "refused"];

/// `reason` values of `cubenet_egress_scrape_errors_total` (`GET /metrics/cube-egress`, O26):
/// the gateway's admin address refused or could not be reached (`unreachable`), did not
/// answer within `cube_egress_push_timeout_ms` (`timeout`), answered another status than 200
/// (`status`), or sent more than [`crate::egress_sync::MAX_METRICS_BODY`] (`too_large`).
pub const SCRAPE_ERRORS: &[&str] = &["unreachable", "timeout", "status", "too_large"];

/// `result` values of `cubenet_config_reloads_total` (decision R51).
pub const RELOAD_RESULTS: &[&str] = &["applied", "invalid", "failed", "no_file", "handed_over"];

/// The agent's metrics and their registry.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Registry rendered on `/metrics`.
    pub registry: Registry,
    /// `cubenet_pool_taps{state}`: TAPs by pool state.
    pub pool: IntGaugeVec,
    /// `cubenet_ensure_total{result}`.
    pub ensure: IntCounterVec,
    /// `cubenet_release_total{result}`.
    pub release: IntCounterVec,
    /// `cubenet_ensure_seconds`.
    pub ensure_seconds: Histogram,
    /// `cubenet_release_seconds`.
    pub release_seconds: Histogram,
    /// `cubenet_fd_handoffs_total{err_code}` (`0`, `1001`, `1002`, `-1`).
    pub fd_handoffs: IntCounterVec,
    /// `cubenet_sessions_in_use`.
    pub sessions: IntGauge,
    /// `cubenet_sessions_node_charged`: live sessions charged to the node-wide count (decision
    /// Q4), read from the datapath at scrape time.
    pub sessions_node: IntGauge,
    /// `cubenet_sessions_node_ceiling`: node-wide count at which a sandbox at or over its
    /// floor gets no new flow (`drop_node_sessions`, decision Q4).
    pub sessions_node_ceiling: IntGauge,
    /// `cubenet_tracking_node_charged{map}`: entries of `dns_query_track` / `frag_sessions`
    /// charged to the node-wide count of the tracking floor (decision Q6).
    pub tracking_node: IntGaugeVec,
    /// `cubenet_tracking_node_ceiling{map}`: node-wide count at which a sandbox at or over its
    /// tracking floor gets no new entry in that map (decision Q6).
    pub tracking_node_ceiling: IntGaugeVec,
    /// `cubenet_tap_create_failures_total{stage}` ([`TAP_CREATE_STAGES`]).
    pub tap_create_failures: IntCounterVec,
    /// `cubenet_tap_create_phase_seconds{phase}`: time per step of one TAP creation
    /// (`tuntap`, `sysctl`, `link`, `neighbour` in the dataplane netns, then `attach` of
    /// `from_cube`, `policy` for the baseline deny and `pool` for joining the pool).
    pub tap_create_phase_seconds: HistogramVec,
    /// `cubenet_egress_push_total{result}`: CubeEgress pushes (`ok`, `retry`, `refused`).
    pub egress_push: IntCounterVec,
    /// `cubenet_egress_learned_push_total{result}`: learned-feed pushes (`ok`, `retry`,
    /// `refused`; decision N8).
    pub egress_learned_push: IntCounterVec,
    /// `cubenet_egress_pending`: sandbox addresses whose gateway copy is out of date.
    pub egress_pending: IntGauge,
    /// `cubenet_egress_up`: 1 while the gateway's health endpoint answers.
    pub egress_up: IntGauge,
    /// `cubenet_egress_scrape_errors_total{reason}`: relays of CubeEgress's `/metrics` on
    /// `GET /metrics/cube-egress` that failed ([`SCRAPE_ERRORS`]; O26).
    pub egress_scrape_errors: IntCounterVec,
    /// `cubenet_tap_warmup_filters`: TAPs whose `from_cube` still runs from the warm-up
    /// filter, waiting for the maintenance loop to move them to their tcx link (F5); read
    /// from the datapath at scrape time.
    pub warmup_filters: IntGauge,
    /// `cubenet_config_reloads_total{result}`: SIGHUPs by outcome (`applied`, `invalid`,
    /// `failed`, `no_file`, `handed_over`; decision R51).
    pub config_reloads: IntCounterVec,
    /// `cubenet_fqdn_name_backfill_total{result}`: FQDN pattern keys an agent before R48 left
    /// without a name, found when a sandbox is adopted: `named` from its state record, or
    /// `sealed_out` (no recorded pattern hashes to the key: it matches nothing; R52, R53).
    pub fqdn_backfill: IntCounterVec,
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let buckets = vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];
        let pool = IntGaugeVec::new(Opts::new("cubenet_pool_taps", "TAPs by pool state"), &["state"]).unwrap();
        let ensure = IntCounterVec::new(Opts::new("cubenet_ensure_total", "EnsureNetwork calls"), &["result"]).unwrap();
        let release =
            IntCounterVec::new(Opts::new("cubenet_release_total", "ReleaseNetwork calls"), &["result"]).unwrap();
        let ensure_seconds = Histogram::with_opts(
            HistogramOpts::new("cubenet_ensure_seconds", "EnsureNetwork latency").buckets(buckets.clone()),
        )
        .unwrap();
        let release_seconds = Histogram::with_opts(
            HistogramOpts::new("cubenet_release_seconds", "ReleaseNetwork latency").buckets(buckets),
        )
        .unwrap();
        let fd_handoffs =
            IntCounterVec::new(Opts::new("cubenet_fd_handoffs_total", "TAP fd requests by errCode"), &["err_code"])
                .unwrap();
        let sessions = IntGauge::new("cubenet_sessions_in_use", "Datapath sessions in use").unwrap();
        let sessions_node =
            IntGauge::new("cubenet_sessions_node_charged", "Live sessions charged to the node-wide count").unwrap();
        let sessions_node_ceiling = IntGauge::new(
            "cubenet_sessions_node_ceiling",
            "Node-wide live sessions at which sandboxes at or over their floor open no new flow",
        )
        .unwrap();
        let tracking_node = IntGaugeVec::new(
            Opts::new("cubenet_tracking_node_charged", "Tracked entries charged to the node-wide count, per map"),
            &["map"],
        )
        .unwrap();
        let tracking_node_ceiling = IntGaugeVec::new(
            Opts::new(
                "cubenet_tracking_node_ceiling",
                "Node-wide tracked entries at which sandboxes at or over their floor make no new entry, per map",
            ),
            &["map"],
        )
        .unwrap();
        let tap_create_failures =
            IntCounterVec::new(Opts::new("cubenet_tap_create_failures_total", "Failed TAP creations"), &["stage"])
                .unwrap();
        let tap_create_phase_seconds = HistogramVec::new(
            HistogramOpts::new("cubenet_tap_create_phase_seconds", "Time per step of one TAP creation")
                .buckets(vec![0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]),
            &["phase"],
        )
        .unwrap();
        let egress_push =
            IntCounterVec::new(Opts::new("cubenet_egress_push_total", "CubeEgress policy pushes"), &["result"])
                .unwrap();
        let egress_learned_push = IntCounterVec::new(
            Opts::new("cubenet_egress_learned_push_total", "CubeEgress learned-address feed pushes"),
            &["result"],
        )
        .unwrap();
        let egress_pending =
            IntGauge::new("cubenet_egress_pending", "Sandbox addresses whose CubeEgress policy is out of date")
                .unwrap();
        let egress_up = IntGauge::new("cubenet_egress_up", "CubeEgress admin API reachable").unwrap();
        let egress_scrape_errors = IntCounterVec::new(
            Opts::new("cubenet_egress_scrape_errors_total", "Failed relays of CubeEgress's /metrics by reason"),
            &["reason"],
        )
        .unwrap();
        let warmup_filters =
            IntGauge::new("cubenet_tap_warmup_filters", "TAPs on a warm-up tc filter, waiting for their tcx link")
                .unwrap();
        let config_reloads = IntCounterVec::new(
            Opts::new("cubenet_config_reloads_total", "SIGHUP configuration reloads by outcome"),
            &["result"],
        )
        .unwrap();
        let fqdn_backfill = IntCounterVec::new(
            Opts::new(
                "cubenet_fqdn_name_backfill_total",
                "FQDN pattern keys without a name found at adoption, named from the state record or sealed out",
            ),
            &["result"],
        )
        .unwrap();
        for c in [
            Box::new(warmup_filters.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(config_reloads.clone()),
            Box::new(fqdn_backfill.clone()),
            Box::new(pool.clone()),
            Box::new(egress_push.clone()),
            Box::new(egress_learned_push.clone()),
            Box::new(egress_pending.clone()),
            Box::new(egress_up.clone()),
            Box::new(egress_scrape_errors.clone()),
            Box::new(ensure.clone()),
            Box::new(release.clone()),
            Box::new(ensure_seconds.clone()),
            Box::new(release_seconds.clone()),
            Box::new(fd_handoffs.clone()),
            Box::new(sessions.clone()),
            Box::new(sessions_node.clone()),
            Box::new(sessions_node_ceiling.clone()),
            Box::new(tracking_node.clone()),
            Box::new(tracking_node_ceiling.clone()),
            Box::new(tap_create_failures.clone()),
            Box::new(tap_create_phase_seconds.clone()),
        ] {
            registry.register(c).unwrap();
        }
        // Every label value a counter can take is exported from the start at 0 (O24): a series
        // that first appears at 1 shows no `increase()`/`rate()` in Prometheus, so the first
        // failure of a node would never fire an alert, and an absent series reads as "no data".
        use crate::fdserver::codes;
        let known: [(&IntCounterVec, &[&str]); 9] = [
            (&ensure, &["ok", "error"]),
            (&release, &["ok", "error"]),
            (&fd_handoffs, &[codes::OK.0, codes::PARSE.0, codes::NOT_FOUND.0, codes::UNKNOWN.0]),
            (&tap_create_failures, TAP_CREATE_STAGES),
            (&egress_push, PUSH_RESULTS),
            (&egress_learned_push, PUSH_RESULTS),
            (&egress_scrape_errors, SCRAPE_ERRORS),
            (&config_reloads, RELOAD_RESULTS),
            (&fqdn_backfill, &["named", "sealed_out"]),
        ];
        for (c, values) in known {
            for v in values {
                c.with_label_values(&[v]);
            }
        }
        Self {
            registry,
            pool,
            ensure,
            release,
            ensure_seconds,
            release_seconds,
            fd_handoffs,
            sessions,
            sessions_node,
            sessions_node_ceiling,
            tracking_node,
            tracking_node_ceiling,
            tap_create_failures,
            tap_create_phase_seconds,
            egress_push,
            egress_learned_push,
            egress_pending,
            egress_up,
            egress_scrape_errors,
            warmup_filters,
            config_reloads,
            fqdn_backfill,
        }
    }

    /// Exports the datapath's counters (read from `dp` at every scrape):
    /// `cubenet_datapath_packets_total{program,reason}` (the per-CPU `counters` map summed;
    /// `program` empty for a counter not in `cubevs_common::counter::NAMES`),
    /// `cubenet_reaper_runs_total` and `cubenet_reaper_removed_sessions_total`. Call once.
    /// Also the per-sandbox counters (`cubenet_sandbox_{packets,bytes,drops}_total`, see
    /// [`sandbox`]): one series set per registered sandbox, gone after its Release.
    pub fn register_datapath(&self, dp: Arc<dyn Dataplane>) -> prometheus::Result<()> {
        self.registry.register(Box::new(DatapathCollector::new(dp.clone())))?;
        self.registry.register(Box::new(sandbox::SandboxCollector::new(dp)))
    }

    /// Text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &self.registry.gather(), &mut buf).unwrap();
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Datapath counters as Prometheus counters, read at scrape time.
struct DatapathCollector {
    dp: Arc<dyn Dataplane>,
    /// Templates: their descriptors are this collector's.
    templates: (IntCounterVec, IntCounter, IntCounter),
}

impl DatapathCollector {
    fn new(dp: Arc<dyn Dataplane>) -> Self {
        Self { dp, templates: Self::families() }
    }

    fn families() -> (IntCounterVec, IntCounter, IntCounter) {
        (
            IntCounterVec::new(
                Opts::new("cubenet_datapath_packets_total", "Packets by datapath program and verdict or drop reason"),
                &["program", "reason"],
            )
            .unwrap(),
            IntCounter::new("cubenet_reaper_runs_total", "Session reaper sweeps").unwrap(),
            IntCounter::new("cubenet_reaper_removed_sessions_total", "Sessions removed by the reaper").unwrap(),
        )
    }
}

impl Collector for DatapathCollector {
    fn desc(&self) -> Vec<&Desc> {
        let (p, r, d) = &self.templates;
        p.desc().into_iter().chain(r.desc()).chain(d.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Ok(c) = self.dp.counters() else { return Vec::new() };
        let (packets, runs, removed) = Self::families();
        for (k, v) in &c {
            match k.as_str() {
                "reaper_runs" => runs.inc_by(*v),
                "reaper_removed" => removed.inc_by(*v),
                // Gauges (`cubenet_sessions_in_use`, `cubenet_sessions_node_*`), set by
                // `Agent::refresh_datapath_metrics`.
                "reaper_last_scanned" | "session_floor_live" | "session_floor_ceiling" => {}
                k if k.starts_with("track_floor_") => {}
                _ => {
                    let (program, reason) = cubevs_common::counter::NAMES
                        .iter()
                        .find(|(_, p, r)| k.len() == p.len() + 1 + r.len() && k.starts_with(p) && k.ends_with(r))
                        .map(|(_, p, r)| (*p, *r))
                        .unwrap_or(("", k.as_str()));
                    packets.with_label_values(&[program, reason]).inc_by(*v);
                }
            }
        }
        packets.collect().into_iter().chain(runs.collect()).chain(removed.collect()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// O24: every label value a counter can take is a series at 0 before anything happened,
    /// so the first failure is an `increase()` an alert sees.
    #[test]
    fn labelled_counters_start_at_zero_for_every_known_label() {
        let t = Metrics::new().render();
        let mut want = vec![
            "cubenet_ensure_total{result=\"ok\"} 0".to_string(),
            "cubenet_ensure_total{result=\"error\"} 0".into(),
            "cubenet_release_total{result=\"ok\"} 0".into(),
            "cubenet_release_total{result=\"error\"} 0".into(),
            "cubenet_fqdn_name_backfill_total{result=\"named\"} 0".into(),
            "cubenet_fqdn_name_backfill_total{result=\"sealed_out\"} 0".into(),
        ];
        for c in ["0", "1001", "1002", "-1"] {
            want.push(format!("cubenet_fd_handoffs_total{{err_code=\"{c}\"}} 0"));
        }
        for s in ["create", "attach"] {
            want.push(format!("cubenet_tap_create_failures_total{{stage=\"{s}\"}} 0"));
        }
        for r in ["ok", "retry", "refused"] {
            want.push(format!("cubenet_egress_push_total{{result=\"{r}\"}} 0"));
            want.push(format!("cubenet_egress_learned_push_total{{result=\"{r}\"}} 0"));
        }
        for r in ["applied", "invalid", "failed", "no_file", "handed_over"] {
            want.push(format!("cubenet_config_reloads_total{{result=\"{r}\"}} 0"));
        }
        for r in ["unreachable", "timeout", "status", "too_large"] {
            want.push(format!("cubenet_egress_scrape_errors_total{{reason=\"{r}\"}} 0"));
        }
        for w in want {
            assert!(t.lines().any(|l| l == w), "missing {w:?} in\n{t}");
        }
    }

    #[test]
    fn datapath_counters_are_prometheus_counters() {
        let m = Metrics::new();
        m.register_datapath(Arc::new(crate::dataplane::FakeDataplane::default())).unwrap();
        let t = m.render();
        assert!(t.contains("# TYPE cubenet_reaper_runs_total counter\ncubenet_reaper_runs_total 0\n"), "{t}");
        assert!(t.contains("# TYPE cubenet_reaper_removed_sessions_total counter"), "{t}");
        assert!(!t.contains("cubenet_datapath_counter") && !t.contains("cubenet_reaper_runs "), "{t}");
    }

    #[test]
    fn sandbox_series_exist_only_while_registered_and_start_at_zero() {
        use crate::dataplane::{Dataplane, FakeDataplane, SandboxEntry};
        let dp = Arc::new(FakeDataplane::default());
        let m = Metrics::new();
        m.register_datapath(dp.clone()).unwrap();
        let a = SandboxEntry { ifindex: 7, ip: "192.168.0.2".parse().unwrap(), version: 1, id: "sb-a".into() };
        dp.register_sandbox(&a).unwrap();
        dp.tables.lock().unwrap().count(7, |c| {
            c.out_packets = 3;
            c.out_bytes = 300;
            c.in_packets = 2;
            c.in_bytes = 140;
            *c.drops.get_mut("policy").unwrap() = 5;
        });
        let t = m.render();
        assert!(t.contains("# TYPE cubenet_sandbox_packets_total counter"), "{t}");
        assert!(t.contains(r#"cubenet_sandbox_packets_total{direction="out",sandbox="sb-a"} 3"#), "{t}");
        assert!(t.contains(r#"cubenet_sandbox_bytes_total{direction="in",sandbox="sb-a"} 140"#), "{t}");
        assert!(t.contains(r#"cubenet_sandbox_drops_total{reason="policy",sandbox="sb-a"} 5"#), "{t}");
        assert!(!t.contains(r#"reason="spoof""#), "zero drop reasons are not exported: {t}");
        // Release: the series go; the TAP's next owner starts at zero.
        dp.unregister_sandbox(7).unwrap();
        assert!(!m.render().contains("sb-a"), "series of a released sandbox remain");
        dp.register_sandbox(&SandboxEntry { id: "sb-b".into(), version: 2, ..a.clone() }).unwrap();
        let t = m.render();
        assert!(t.contains(r#"cubenet_sandbox_packets_total{direction="out",sandbox="sb-b"} 0"#), "{t}");
        assert!(!t.contains("sb-a") && !t.contains(r#"reason="policy""#), "{t}");
    }
}
