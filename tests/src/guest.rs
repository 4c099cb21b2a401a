//! Test guests: a TAP guest (raw frames on a TAP fd) and a veth guest (a namespace whose
//! kernel stack plays the microVM).

use std::{
    os::fd::{AsRawFd, OwnedFd},
    path::PathBuf,
    time::{Duration, Instant},
};

use nix::{
    fcntl::{FcntlArg, OFlag, fcntl},
    poll::{PollFd, PollFlags, PollTimeout, poll},
};

use crate::packet;

/// A guest that owns a TAP queue fd and exchanges raw Ethernet frames on it, as a VMM would.
///
/// With a vnet header configured on the TAP, every frame is preceded by a `virtio_net_hdr`
/// of `vnet_hdr_len` bytes; [`TapGuest::send`] writes a zero header (no offloads) and
/// [`TapGuest::recv`] strips it.
#[derive(Debug)]
pub struct TapGuest {
    fd: OwnedFd,
    vnet_hdr_len: usize,
}

impl TapGuest {
    /// Wraps a TAP fd; sets `O_NONBLOCK`.
    pub fn new(fd: OwnedFd, vnet_hdr_len: usize) -> Self {
        let flags = fcntl(&fd, FcntlArg::F_GETFL).expect("F_GETFL");
        fcntl(&fd, FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK)).expect("F_SETFL");
        Self { fd, vnet_hdr_len }
    }

    /// The raw fd (for smoltcp).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Size of the vnet header on this fd (0 = none).
    pub fn vnet_hdr_len(&self) -> usize {
        self.vnet_hdr_len
    }

    /// Writes one frame into the TAP (the host sees it arrive on the TAP's ingress).
    pub fn send(&self, frame: &[u8]) {
        let mut buf = vec![0u8; self.vnet_hdr_len];
        buf.extend_from_slice(frame);
        let n = nix::unistd::write(&self.fd, &buf).expect("write frame to TAP");
        assert_eq!(n, buf.len(), "short write to TAP");
    }

    /// Reads one frame, waiting at most `timeout`. `None` on timeout.
    pub fn recv(&self, timeout: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; 65536 + self.vnet_hdr_len];
        loop {
            match nix::unistd::read(&self.fd, &mut buf) {
                Ok(n) if n >= self.vnet_hdr_len => return Some(buf[self.vnet_hdr_len..n].to_vec()),
                Ok(_) => continue,
                Err(nix::errno::Errno::EAGAIN) => {}
                Err(e) => panic!("read TAP: {e}"),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let ms = u16::try_from(left.as_millis().max(1)).unwrap_or(u16::MAX);
            let mut fds = [PollFd::new(std::os::fd::AsFd::as_fd(&self.fd), PollFlags::POLLIN)];
            let _ = poll(&mut fds, PollTimeout::from(ms));
        }
    }

    /// Reads frames until `pred` accepts one (others are discarded) or `timeout` passes.
    pub fn recv_matching(&self, timeout: Duration, mut pred: impl FnMut(&[u8]) -> bool) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let f = self.recv(left)?;
            if pred(&f) {
                return Some(f);
            }
        }
    }

    /// Discards every queued frame.
    pub fn drain(&self) {
        while self.recv(Duration::ZERO).is_some() {}
    }

    /// Sends an ARP request for `target` from the guest address and returns the reply frame.
    pub fn arp(&self, target: [u8; 4], timeout: Duration) -> Option<Vec<u8>> {
        self.send(&packet::arp_request(packet::GUEST_MAC, packet::GUEST_IP, target));
        self.recv_matching(timeout, |f| {
            packet::parse_arp(f)
                .is_some_and(|(_, a)| a.operation == etherparse::ArpOperation::REPLY && a.sender_ipv4 == target)
        })
    }
}

impl AsRawFd for TapGuest {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

/// A guest namespace configured like a microVM NIC, attached to the node by a veth pair.
#[derive(Clone, Debug)]
pub struct VethGuest {
    /// Name of the guest namespace.
    pub ns_name: String,
    /// Its `/run/netns` path.
    pub ns_path: PathBuf,
    /// Node-side veth name (`vg<N>`): where the datapath attaches `from_cube`.
    pub node_if: String,
    /// Node-side veth ifindex (in the node namespace).
    pub node_ifindex: u32,
}

/// One neighbour entry as `ip -j neigh show` reports it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct Neighbour {
    /// Address.
    #[serde(rename = "dst")]
    pub ip: String,
    /// Link-layer address, when resolved.
    #[serde(rename = "lladdr")]
    pub mac: Option<String>,
    /// NUD states (e.g. `REACHABLE`, `STALE`, `FAILED`).
    #[serde(default)]
    pub state: Vec<String>,
}

/// Parses `ip -j neigh show` output.
pub fn parse_neigh_json(json: &str) -> Vec<Neighbour> {
    serde_json::from_str(json).unwrap_or_else(|e| panic!("parse `ip -j neigh` output {json:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ip_neigh_json() {
        let j = r#"[{"dst":"169.254.68.5","dev":"eth0","lladdr":"20:90:6f:cf:cf:cf","state":["REACHABLE"]},{"dst":"10.0.0.9","dev":"eth0","state":["FAILED"]}]"#;
        let n = parse_neigh_json(j);
        assert_eq!(n.len(), 2);
        assert_eq!(n[0].mac.as_deref(), Some("20:90:6f:cf:cf:cf"));
        assert_eq!(n[0].state, vec!["REACHABLE"]);
        assert_eq!(n[1].mac, None);
    }
}
