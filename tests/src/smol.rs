//! A userspace TCP/IP stack (smoltcp) on a [`TapGuest`]'s fd: the TAP guest's way to speak TCP.
//!
//! The guest is configured like a microVM: 169.254.68.6/30, MAC 20:90:6f:fc:fc:fc, default
//! route via 169.254.68.5.

use std::time::{Duration, Instant as StdInstant};

use smoltcp::{
    iface::{Config, Interface, SocketSet},
    phy::{self, Checksum, ChecksumCapabilities, DeviceCapabilities, Medium},
    socket::tcp,
    time::Instant,
    wire::{EthernetAddress, IpAddress, IpCidr, Ipv4Address},
};

use crate::{guest::TapGuest, packet};

/// smoltcp device over a [`TapGuest`]'s fd (the guest strips/prepends the vnet header).
pub struct GuestDevice<'a> {
    guest: &'a TapGuest,
    mtu: usize,
    verify_rx_checksums: bool,
    divert: Option<Divert<'a>>,
}

/// A frame filter that consumes the frames it returns true for.
type Divert<'a> = Box<dyn FnMut(&[u8]) -> bool + 'a>;

impl<'a> GuestDevice<'a> {
    /// A device on `guest`. `verify_rx_checksums`: check received checksums — only possible
    /// when the TAP has no checksum offload (the kernel may hand over partial checksums).
    pub fn new(guest: &'a TapGuest, verify_rx_checksums: bool) -> Self {
        Self { guest, mtu: 1514, verify_rx_checksums, divert: None }
    }

    /// Frames for which `f` returns true are consumed by `f` and never reach smoltcp (e.g.
    /// ICMP echo replies counted by a test; smoltcp has no ICMP socket here).
    pub fn with_divert(mut self, f: impl FnMut(&[u8]) -> bool + 'a) -> Self {
        self.divert = Some(Box::new(f));
        self
    }
}

/// A received frame (smoltcp receive token).
pub struct Rx(Vec<u8>);
/// A transmit slot on the guest fd (smoltcp transmit token).
pub struct Tx<'a>(&'a TapGuest);

impl phy::RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = vec![0u8; len];
        let r = f(&mut buf);
        self.0.send(&buf);
        r
    }
}

impl phy::Device for GuestDevice<'_> {
    type RxToken<'b>
        = Rx
    where
        Self: 'b;
    type TxToken<'b>
        = Tx<'b>
    where
        Self: 'b;

    fn receive(&mut self, _t: Instant) -> Option<(Rx, Tx<'_>)> {
        loop {
            let f = self.guest.recv(Duration::ZERO)?;
            if let Some(d) = self.divert.as_mut()
                && d(&f)
            {
                continue;
            }
            return Some((Rx(f), Tx(self.guest)));
        }
    }

    fn transmit(&mut self, _t: Instant) -> Option<Tx<'_>> {
        Some(Tx(self.guest))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = self.mtu;
        // A TAP without checksum offload (what the harness creates) delivers full checksums:
        // verify them, so datapath checksum bugs fail the tests. With offload the kernel may
        // hand over partial checksums, which cannot be verified.
        let rx = if self.verify_rx_checksums { Checksum::Both } else { Checksum::Tx };
        let mut cs = ChecksumCapabilities::default();
        cs.ipv4 = rx;
        cs.tcp = rx;
        cs.udp = rx;
        cs.icmpv4 = rx;
        caps.checksum = cs;
        caps
    }
}

/// Result of [`tcp_exchange`].
#[derive(Debug)]
pub struct TcpOutcome {
    /// Bytes received before the peer closed (or the timeout hit).
    pub received: Vec<u8>,
    /// Whether the connection was established.
    pub connected: bool,
    /// Whether the peer reset the connection (e.g. a policy RST).
    pub reset: bool,
}

/// A smoltcp interface configured like a microVM NIC (169.254.68.6/30, guest MAC, default
/// route via 169.254.68.5) on `dev`.
pub fn guest_interface(dev: &mut GuestDevice<'_>, seed: u64) -> Interface {
    let mut cfg = Config::new(EthernetAddress(packet::GUEST_MAC).into());
    cfg.random_seed = seed;
    let mut iface = Interface::new(cfg, dev, Instant::now());
    iface.update_ip_addrs(|a| {
        a.push(IpCidr::new(IpAddress::from(Ipv4Address::from(packet::GUEST_IP)), 30)).expect("addr");
    });
    iface.routes_mut().add_default_ipv4_route(Ipv4Address::from(packet::GATEWAY_IP)).expect("route");
    iface
}

/// Connects from the guest (169.254.68.6:`sport`) to `dst:dport`, sends `request`, and reads
/// until the peer closes or `timeout` passes. Received checksums are verified (the TAP must
/// have no checksum offload, as the harness's TAPs do).
pub fn tcp_exchange(
    guest: &TapGuest,
    dst: [u8; 4],
    dport: u16,
    sport: u16,
    request: &[u8],
    timeout: Duration,
) -> TcpOutcome {
    tcp_exchange_with(&mut GuestDevice::new(guest, true), dst, dport, sport, request, timeout)
}

/// [`tcp_exchange`] on a caller-configured device.
pub fn tcp_exchange_with(
    dev: &mut GuestDevice<'_>,
    dst: [u8; 4],
    dport: u16,
    sport: u16,
    request: &[u8],
    timeout: Duration,
) -> TcpOutcome {
    let guest = dev.guest;
    let mut iface = guest_interface(dev, u64::from(sport));

    let sock = tcp::Socket::new(tcp::SocketBuffer::new(vec![0; 65535]), tcp::SocketBuffer::new(vec![0; 65535]));
    let mut sockets = SocketSet::new(vec![]);
    let h = sockets.add(sock);
    sockets
        .get_mut::<tcp::Socket>(h)
        .connect(iface.context(), (IpAddress::from(Ipv4Address::from(dst)), dport), sport)
        .expect("connect");

    let deadline = StdInstant::now() + timeout;
    let mut out = TcpOutcome { received: Vec::new(), connected: false, reset: false };
    let mut sent = false;
    let mut was_open = false;
    while StdInstant::now() < deadline {
        iface.poll(Instant::now(), &mut *dev, &mut sockets);
        let s = sockets.get_mut::<tcp::Socket>(h);
        if s.state() == tcp::State::Established {
            out.connected = true;
        }
        if s.is_open() {
            was_open = true;
        }
        if s.can_send() && !sent {
            s.send_slice(request).expect("send");
            sent = true;
        }
        if s.can_recv() {
            s.recv(|d| {
                out.received.extend_from_slice(d);
                (d.len(), ())
            })
            .expect("recv");
        }
        if sent && !s.may_recv() && s.state() != tcp::State::Closed {
            // Peer sent FIN: close our side too.
            s.close();
        }
        if was_open && s.state() == tcp::State::Closed {
            // Closed without a FIN exchange => reset (or never connected).
            out.reset = !out.connected || out.received.is_empty() && sent;
            break;
        }
        if s.state() == tcp::State::TimeWait {
            break;
        }
        let wait = iface.poll_delay(Instant::now(), &sockets).map(Into::into).unwrap_or(Duration::from_millis(5));
        let wait = wait.min(Duration::from_millis(5));
        let mut fds = [nix::poll::PollFd::new(std::os::fd::AsFd::as_fd(guest.fd()), nix::poll::PollFlags::POLLIN)];
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(wait.as_millis() as u16));
    }
    out
}
