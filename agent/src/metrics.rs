//! Prometheus metrics, all named `cubenet_…`.

use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

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
    /// `cubenet_fd_handoffs_total{result}` (errCode).
    pub fd_handoffs: IntCounterVec,
    /// `cubenet_datapath_counter{name}`: datapath verdict/drop counters.
    pub datapath: IntGaugeVec,
    /// `cubenet_sessions_in_use`.
    pub sessions: IntGauge,
    /// `cubenet_reaper_runs`: session reaper runs reported by the datapath.
    pub reaper_runs: IntGauge,
    /// `cubenet_tap_create_failures_total`.
    pub tap_create_failures: IntCounterVec,
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
        let datapath =
            IntGaugeVec::new(Opts::new("cubenet_datapath_counter", "Datapath verdict/drop counters"), &["name"])
                .unwrap();
        let sessions = IntGauge::new("cubenet_sessions_in_use", "Datapath sessions in use").unwrap();
        let reaper_runs = IntGauge::new("cubenet_reaper_runs", "Session reaper runs").unwrap();
        let tap_create_failures =
            IntCounterVec::new(Opts::new("cubenet_tap_create_failures_total", "Failed TAP creations"), &["stage"])
                .unwrap();
        for c in [
            Box::new(pool.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(ensure.clone()),
            Box::new(release.clone()),
            Box::new(ensure_seconds.clone()),
            Box::new(release_seconds.clone()),
            Box::new(fd_handoffs.clone()),
            Box::new(datapath.clone()),
            Box::new(sessions.clone()),
            Box::new(reaper_runs.clone()),
            Box::new(tap_create_failures.clone()),
        ] {
            registry.register(c).unwrap();
        }
        Self {
            registry,
            pool,
            ensure,
            release,
            ensure_seconds,
            release_seconds,
            fd_handoffs,
            datapath,
            sessions,
            reaper_runs,
            tap_create_failures,
        }
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
