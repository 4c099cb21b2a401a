//! CubeNet network-agent library (the `network-agent` binary is a thin `main.rs` over it).
#![warn(missing_docs)]
pub mod agent;
pub mod client;
pub mod config;
pub mod cubevs_dp;
pub mod dataplane;
pub mod dataplane_sockets;
pub mod egress_sync;
pub mod fdserver;
pub mod grpc;
pub mod handover;
pub mod host;
pub mod http;
pub mod ipam;
pub mod listeners;
pub mod metrics;
pub mod policy_dump;
pub mod ports;
pub mod reload;
pub mod state;
pub mod uds_authority;
