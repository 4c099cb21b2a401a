//! UDP reachability of one world address from a TAP guest, beside a control address on the
//! same path: how the always-denied tests (`always_denied`, `upgrade_chaos`) see whether the
//! datapath lets a sandbox reach an address.

use std::{
    net::{SocketAddr, UdpSocket},
    time::Duration,
};

use crate::{agent::AgentUnderTest, guest::TapGuest, packet, topology::WORLD_IP};

/// Listeners in the world namespace on `port`: the probed address (added to the world side
/// as a /32) and the world's own address as the control.
pub struct DenyProbe {
    target: [u8; 4],
    port: u16,
    target_sock: UdpSocket,
    control: UdpSocket,
}

impl DenyProbe {
    /// Adds `target` to the world namespace and binds both listeners on `port`.
    pub fn new(a: &AgentUnderTest, target: [u8; 4], port: u16) -> Self {
        a.topo.add_world_address(target, 32);
        let bind = |ip: [u8; 4]| {
            a.topo.world.run(move || {
                let s = UdpSocket::bind(SocketAddr::from((ip, port))).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                s
            })
        };
        Self { target, port, target_sock: bind(target), control: bind(WORLD_IP) }
    }

    /// Sends `tag` to the target, then to the control address, from `g` (UDP, source port
    /// `sport`); the control datagram must arrive (the sandbox's path works: panics
    /// otherwise). Returns whether the target got its datagram (sent first on the same path,
    /// so it is there by then if at all).
    pub fn reaches(&self, g: &TapGuest, sport: u16, tag: &str) -> bool {
        g.send(&packet::udp(self.target, sport, self.port, tag.as_bytes()));
        g.send(&packet::udp(WORLD_IP, sport, self.port, tag.as_bytes()));
        let mut buf = [0u8; 256];
        let n = self.control.recv(&mut buf).unwrap_or_else(|e| panic!("control datagram {tag} lost: {e}"));
        assert_eq!(&buf[..n], tag.as_bytes());
        self.target_sock.set_nonblocking(true).unwrap();
        let mut got = false;
        while let Ok(n) = self.target_sock.recv(&mut buf) {
            got |= &buf[..n] == tag.as_bytes();
        }
        self.target_sock.set_nonblocking(false).unwrap();
        got
    }
}
