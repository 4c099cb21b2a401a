//! Prometheus metrics served at `GET /metrics` on the admin listener.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric the gateway exports (names prefixed `cube_egress_`).
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// Requests by `decision` (`allow`, `deny`).
    pub requests: IntCounterVec,
    /// Credentials injected (one per header).
    pub injections: IntCounter,
    /// Injections dropped by a gate.
    pub injections_dropped: IntCounter,
    /// Leaf certificates minted.
    pub mints: IntCounter,
    /// Leaf certificate cache hits.
    pub cert_cache_hits: IntCounter,
    /// Mints refused by the per-sandbox rate limit.
    pub mint_rate_limited: IntCounter,
    /// TLS connections refused before minting (SNI denied or no policy).
    pub handshakes_refused: IntCounter,
    /// Client TLS handshakes that waited for their sandbox's turn (`handshakes_per_sandbox`
    /// were in progress, R90).
    pub handshakes_waited: IntCounter,
    /// Completed client TLS handshakes by `kind`: `full` or `resumed` (a session ticket, also
    /// one a predecessor issued, E23).
    pub tls_handshakes: IntCounterVec,
    /// Connections closed at accept, by `reason`: `sandbox_budget` (the sandbox held
    /// `max_conns_per_sandbox`, R18), `node_ceiling` (its floor was used, or it has no policy,
    /// and the shared remainder was full, R22), `sandbox_rate` (it opened more than
    /// `new_conns_per_sandbox_per_sec`, R102); requests refused a second upstream socket of
    /// their connection: `upstream_sandbox_budget`, `upstream_node_ceiling` (503, R24).
    pub connections_refused: IntCounterVec,
    /// Live proxy connections by `pool` (`floor`, `shared`), set when `/metrics` is read (R22).
    pub connections: IntGaugeVec,
    /// Audit records queued for the writer by `pool` (`floor`, `shared`), set when `/metrics`
    /// is read (R22).
    pub audit_queued: IntGaugeVec,
    /// Upstream failures by `kind` (`connect`, `tls`, `timeout`, `other`).
    pub upstream_errors: IntCounterVec,
    /// Audit records dropped because the writer's queue was full.
    pub audit_dropped: IntCounter,
    /// Requests whose record could not be written before forwarding or answering (E20), by
    /// `reason`: `queue_share` (no room in the sandbox's share of the queue, R22),
    /// `write_failed`, `writer_gone`. Allowed ones are refused with 503, denied ones still get
    /// their 403.
    pub audit_refused: IntCounterVec,
    /// Request duration until response headers, seconds.
    pub request_seconds: Histogram,
    /// Upstream time to response headers, seconds (request − upstream ≈ added latency).
    pub upstream_seconds: Histogram,
    /// SIGHUP configuration reloads by `result` (`applied`, `invalid`, `no_file`; R51).
    pub config_reloads: IntCounterVec,
    /// Live proxy connections closed because a reload listed their original destination in
    /// `always_denied_cidrs` (R51).
    pub connections_closed_always_denied: IntCounter,
    /// Live connections reset because their sandbox's policy was deleted (R71).
    pub connections_closed_released: IntCounter,
}

impl Metrics {
    /// Registers all metrics in a fresh registry.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let buckets = vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
        let requests =
            IntCounterVec::new(Opts::new("cube_egress_requests_total", "Requests by decision"), &["decision"])
                .expect("metric");
        let c = |n: &str, h: &str| IntCounter::new(n, h).expect("metric");
        let injections = c("cube_egress_injections_total", "Credentials injected");
        let injections_dropped = c("cube_egress_injections_dropped_total", "Injections dropped by a gate");
        let mints = c("cube_egress_cert_mints_total", "Leaf certificates minted");
        let cert_cache_hits = c("cube_egress_cert_cache_hits_total", "Leaf certificate cache hits");
        let mint_rate_limited = c("cube_egress_cert_mint_rate_limited_total", "Mints refused by the per-sandbox limit");
        let handshakes_refused = c("cube_egress_tls_handshakes_refused_total", "TLS handshakes refused before minting");
        let handshakes_waited = c(
            "cube_egress_tls_handshakes_waited_total",
            "TLS handshakes that waited for their sandbox's turn (handshakes_per_sandbox in progress)",
        );
        let vec = |n: &str, h: &str, l: &str| IntCounterVec::new(Opts::new(n, h), &[l]).expect("metric");
        let gauges = |n: &str, h: &str| IntGaugeVec::new(Opts::new(n, h), &["pool"]).expect("metric");
        let connections_refused = vec(
            "cube_egress_connections_refused_total",
            "Connections closed at accept, and requests refused an upstream socket (upstream_*), by reason",
            "reason",
        );
        let connections = gauges("cube_egress_connections", "Live proxy connections by pool (floor, shared)");
        let audit_queued = gauges("cube_egress_audit_queued_records", "Audit records queued by pool (floor, shared)");
        let audit_dropped = c("cube_egress_audit_dropped_total", "Audit records dropped (writer queue full)");
        let audit_refused = vec(
            "cube_egress_audit_refused_total",
            "Requests whose audit record could not be written first (allowed: 503), by reason",
            "reason",
        );
        let upstream_errors =
            IntCounterVec::new(Opts::new("cube_egress_upstream_errors_total", "Upstream failures by kind"), &["kind"])
                .expect("metric");
        let request_seconds = Histogram::with_opts(
            HistogramOpts::new("cube_egress_request_duration_seconds", "Request duration to response headers")
                .buckets(buckets.clone()),
        )
        .expect("metric");
        let upstream_seconds = Histogram::with_opts(
            HistogramOpts::new("cube_egress_upstream_duration_seconds", "Upstream time to response headers")
                .buckets(buckets),
        )
        .expect("metric");
        let config_reloads =
            vec("cube_egress_config_reloads_total", "SIGHUP configuration reloads by result", "result");
        let connections_closed_always_denied = c(
            "cube_egress_connections_closed_always_denied_total",
            "Live connections closed because a reload listed their destination as always denied",
        );
        let connections_closed_released = c(
            "cube_egress_connections_closed_released_total",
            "Live connections reset because their sandbox's policy was deleted (Release): its address may go to another sandbox",
        );
        for m in [
            &connections_closed_released,
            &connections_closed_always_denied,
            &injections,
            &injections_dropped,
            &mints,
            &cert_cache_hits,
            &mint_rate_limited,
            &handshakes_refused,
            &handshakes_waited,
            &audit_dropped,
        ] {
            registry.register(Box::new(m.clone())).expect("register");
        }
        let tls_handshakes =
            vec("cube_egress_tls_handshakes_total", "Completed client TLS handshakes by kind (full, resumed)", "kind");
        for m in [&connections_refused, &audit_refused, &config_reloads, &tls_handshakes] {
            registry.register(Box::new(m.clone())).expect("register");
        }
        for m in [&connections, &audit_queued] {
            registry.register(Box::new(m.clone())).expect("register");
        }
        registry.register(Box::new(requests.clone())).expect("register");
        registry.register(Box::new(upstream_errors.clone())).expect("register");
        registry.register(Box::new(request_seconds.clone())).expect("register");
        registry.register(Box::new(upstream_seconds.clone())).expect("register");
        // Label values from a fixed set are exported at 0 from the start (decision O24): a
        // series that first appears at 1 shows no `increase()` to an alert.
        let known: [(&IntCounterVec, &[&str]); 6] = [
            (&requests, &["allow", "deny"]),
            (
                &connections_refused,
                &["sandbox_budget", "node_ceiling", "sandbox_rate", "upstream_sandbox_budget", "upstream_node_ceiling"],
            ),
            (&upstream_errors, &["timeout", "tls", "connect", "other"]),
            (&audit_refused, &["queue_share", "write_failed", "writer_gone"]),
            (&config_reloads, &["applied", "invalid", "no_file"]),
            (&tls_handshakes, &["full", "resumed"]),
        ];
        for (c, values) in known {
            for v in values {
                c.with_label_values(&[v]);
            }
        }
        Metrics {
            registry,
            requests,
            injections,
            injections_dropped,
            mints,
            cert_cache_hits,
            mint_rate_limited,
            handshakes_refused,
            handshakes_waited,
            tls_handshakes,
            connections_refused,
            connections,
            audit_queued,
            upstream_errors,
            audit_dropped,
            audit_refused,
            request_seconds,
            upstream_seconds,
            config_reloads,
            connections_closed_always_denied,
            connections_closed_released,
        }
    }

    /// Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// O24: fixed label values are series at 0 before anything happened.
    #[test]
    fn fixed_label_values_start_at_zero() {
        let t = Metrics::new().render();
        for w in [
            "cube_egress_requests_total{decision=\"allow\"} 0",
            "cube_egress_requests_total{decision=\"deny\"} 0",
            "cube_egress_upstream_errors_total{kind=\"timeout\"} 0",
            "cube_egress_upstream_errors_total{kind=\"connect\"} 0",
            "cube_egress_audit_refused_total{reason=\"write_failed\"} 0",
            "cube_egress_config_reloads_total{result=\"invalid\"} 0",
            "cube_egress_tls_handshakes_total{kind=\"resumed\"} 0",
            "cube_egress_connections_refused_total{reason=\"node_ceiling\"} 0",
            "cube_egress_connections_refused_total{reason=\"upstream_sandbox_budget\"} 0",
        ] {
            assert!(t.lines().any(|l| l == w), "missing {w:?} in\n{t}");
        }
    }
}
