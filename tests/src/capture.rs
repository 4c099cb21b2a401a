//! A packet capture on one interface (`AF_PACKET`, `ETH_P_ALL`) that also reports the 802.1Q /
//! 802.1ad tag the kernel took off the frame (`PACKET_AUXDATA`): on receive the kernel moves a
//! VLAN tag into `skb->vlan_tci` before any tap sees the frame, so the bytes alone never show it.
//! Used by the attack tests to see what actually went out on the node's wire.

use std::{mem::size_of, os::fd::AsRawFd, os::fd::FromRawFd, os::fd::OwnedFd, time::Duration};

/// One captured frame.
#[derive(Debug, Clone)]
pub struct Captured {
    /// The frame as the tap saw it (Ethernet header first; a VLAN tag the kernel removed is not
    /// in these bytes).
    pub data: Vec<u8>,
    /// The removed VLAN tag: (TPID, TCI), host byte order; `None` when the frame had none.
    pub vlan: Option<(u16, u16)>,
}

/// See the module docs. Create it inside the namespace of the interface (e.g. with
/// `TestNetns::run`); the socket keeps that namespace and can be read from any thread.
pub struct Capture {
    fd: OwnedFd,
}

impl Capture {
    /// Opens a capture of every frame received or sent on `ifindex`; panics on failure (tests
    /// only).
    pub fn open(ifindex: u32) -> Self {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2) call; the fd is owned right below.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, i32::from(proto)) };
        assert!(raw >= 0, "AF_PACKET socket: {}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: zeroed sockaddr_ll is a valid value; fields set below.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: `sll` is a valid sockaddr_ll of the given length.
        let rc = unsafe {
            libc::bind(fd.as_raw_fd(), (&sll as *const libc::sockaddr_ll).cast(), size_of::<libc::sockaddr_ll>() as u32)
        };
        assert_eq!(rc, 0, "bind AF_PACKET: {}", std::io::Error::last_os_error());
        let one: i32 = 1;
        // SAFETY: option value is an int of the given size.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_AUXDATA,
                (&one as *const i32).cast(),
                size_of::<i32>() as u32,
            )
        };
        assert_eq!(rc, 0, "PACKET_AUXDATA: {}", std::io::Error::last_os_error());
        Self { fd }
    }

    /// Sends `frame` (Ethernet header first, VLAN tags in-band) out of the interface the
    /// capture is bound to, as a wire would deliver it to the peer; panics on failure.
    pub fn send(&self, frame: &[u8]) {
        // SAFETY: the buffer is live for the call; the socket is bound to one interface.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        assert_eq!(n, frame.len() as isize, "AF_PACKET send: {}", std::io::Error::last_os_error());
    }

    /// Reads frames until `until` returns true for one of them (that frame included) or
    /// nothing arrives for `idle`; returns every frame read.
    pub fn read_until(&self, idle: Duration, mut until: impl FnMut(&Captured) -> bool) -> Vec<Captured> {
        let tv = libc::timeval {
            tv_sec: idle.as_secs() as libc::time_t,
            tv_usec: idle.subsec_micros() as libc::suseconds_t,
        };
        // SAFETY: option value is a timeval of the given size.
        unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as u32,
            );
        }
        let mut out = Vec::new();
        while let Some(c) = self.recv_one() {
            let done = until(&c);
            out.push(c);
            if done {
                break;
            }
        }
        out
    }

    fn recv_one(&self) -> Option<Captured> {
        let mut buf = vec![0u8; 65536];
        let mut cmsg = [0u64; 16];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: zeroed msghdr is valid; pointers set below outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr().cast();
        msg.msg_controllen = size_of::<[u64; 16]>() as _;
        // SAFETY: msg points at live buffers.
        let n = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, 0) };
        if n < 0 {
            return None;
        }
        buf.truncate(n as usize);
        let mut vlan = None;
        // SAFETY: walking the control buffer the kernel filled, with the libc macros.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_PACKET && (*c).cmsg_type == libc::PACKET_AUXDATA {
                    let aux = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::tpacket_auxdata);
                    if aux.tp_status & libc::TP_STATUS_VLAN_VALID != 0 {
                        let tpid = if aux.tp_status & libc::TP_STATUS_VLAN_TPID_VALID != 0 {
                            aux.tp_vlan_tpid
                        } else {
                            0x8100
                        };
                        vlan = Some((tpid, aux.tp_vlan_tci));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        Some(Captured { data: buf, vlan })
    }
}
