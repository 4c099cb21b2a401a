//! Linux plumbing shared by the network-agent and the test harness.
//!
//! - [`netns`]: run work inside a network namespace on a dedicated OS thread that has
//!   `setns(2)`-ed into it (never on a tokio worker), the way netavark and aya's test helpers do.
//! - [`tap`]: create and open TAP devices with `TUNSETIFF` and friends (persistent, vnet header,
//!   offloads), which netlink cannot do.
//! - [`peer_uid`]: the uid owning a loopback TCP client's socket (who may use a loopback API).
//! - [`trusted_path`]: directories no other user controls (OpenSSH `StrictModes` walk).
//! - [`socket_acl`]: which uids may connect to a Unix socket file (mode 0600 plus an ACL).
//! - [`sock_abort`]: abort the namespace's TCP sockets connected to one address (`SOCK_DESTROY`).
pub mod netns;
pub mod peer_uid;
pub mod sock_abort;
pub mod socket_acl;
pub mod tap;
pub mod trusted_path;

/// The ifindex of the interface `name` in the calling thread's netns (`if_nametoindex(3)`).
///
/// Errors: `NotFound` naming the interface when it does not exist there.
pub fn ifindex(name: &str) -> std::io::Result<u32> {
    nix::net::if_::if_nametoindex(name)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::NotFound, format!("interface {name}: {e}")))
}
