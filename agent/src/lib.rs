//! CubeNet network-agent library (the `network-agent` binary is a thin `main.rs` over it).
pub mod agent;
pub mod config;
pub mod cubevs_dp;
pub mod dataplane;
pub mod host;
pub mod ipam;
pub mod metrics;
pub mod ports;
pub mod state;
