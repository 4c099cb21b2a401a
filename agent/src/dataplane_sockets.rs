//! TCP sockets in the dataplane network namespace for the CubeEgress bridge (decision L9).
//!
//! CubeEgress runs where the TPROXY plumbing is: the `dataplane_netns` (in the Helm chart's
//! `underlay` mode the node's namespace, while the agent lives in the pod's). Its admin API
//! and the agent's bootstrap dump are on that namespace's loopback, which the agent's own
//! namespace cannot reach. A socket belongs to the namespace it was created in, for its whole
//! life, whichever thread later uses it (netavark does the same): so each socket is created
//! on a dedicated [`NetnsThread`] that entered the dataplane namespace once, and handed to
//! tokio (connected asynchronously, or accepted on) from any worker. No tokio worker ever
//! calls `setns`.
//!
//! Without a dataplane namespace ([`DataplaneSockets::local`]) sockets are the agent's own.

use std::{io, net::SocketAddr, sync::Arc};

use cubenet_sys::netns::{Netns, NetnsThread};

/// Creates TCP sockets in the dataplane namespace (or the agent's own).
#[derive(Debug, Clone, Default)]
pub struct DataplaneSockets {
    /// `None`: the agent's own namespace.
    thread: Option<Arc<NetnsThread>>,
}

impl DataplaneSockets {
    /// Sockets in the agent's own namespace.
    pub fn local() -> Self {
        Self { thread: None }
    }

    /// Sockets in the namespace at `path` (e.g. `/proc/1/ns/net`): spawns the thread that
    /// creates them. Errors: the namespace cannot be opened or entered.
    pub fn open(path: &str) -> io::Result<Self> {
        let ns = Netns::open(path).map_err(io::Error::other)?;
        Ok(Self { thread: Some(Arc::new(NetnsThread::spawn(&ns).map_err(io::Error::other)?)) })
    }

    /// Whether sockets are made in another namespace than the agent's own.
    pub fn is_dataplane(&self) -> bool {
        self.thread.is_some()
    }

    /// Runs `f` on the namespace thread (or here, without one), waiting on the blocking pool
    /// so no runtime worker is held.
    async fn on_thread<R, F>(&self, f: F) -> io::Result<R>
    where
        R: Send + 'static,
        F: FnOnce() -> io::Result<R> + Send + 'static,
    {
        let Some(t) = &self.thread else { return f() };
        let rx = t.submit(f).map_err(io::Error::other)?;
        match tokio::task::spawn_blocking(move || rx.recv()).await {
            Ok(Ok(Ok(r))) => r,
            Ok(Ok(Err(panic))) => std::panic::resume_unwind(panic),
            Ok(Err(_)) => Err(io::Error::other("dataplane netns thread is gone")),
            Err(e) => Err(io::Error::other(e)),
        }
    }

    /// Connects to `authority` (`host:port`; a name is resolved in the agent's own
    /// namespace) from a socket created in the dataplane namespace; tries each address in
    /// turn and returns the last error. The connect itself runs on the caller's runtime.
    pub async fn connect(&self, authority: &str) -> io::Result<tokio::net::TcpStream> {
        let addrs: Vec<SocketAddr> = match authority.parse() {
            Ok(a) => vec![a],
            Err(_) => tokio::net::lookup_host(authority).await?.collect(),
        };
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{authority}: no address"));
        for addr in addrs {
            let sock = self
                .on_thread(move || {
                    if addr.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }
                })
                .await?;
            match sock.connect(addr).await {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Binds a listening socket on `addr` in the dataplane namespace (non-blocking, ready for
    /// `tokio::net::TcpListener::from_std`). Errors: the address is in use or not local there.
    pub async fn bind(&self, addr: SocketAddr) -> io::Result<std::net::TcpListener> {
        self.on_thread(move || {
            let l = std::net::TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            Ok(l)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::DataplaneSockets;

    /// Without a namespace the sockets are the agent's own: bind, connect and talk.
    #[tokio::test]
    async fn local_sockets_connect_and_accept() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let s = DataplaneSockets::local();
        assert!(!s.is_dataplane());
        let l = tokio::net::TcpListener::from_std(s.bind("127.0.0.1:0".parse().unwrap()).await.unwrap()).unwrap();
        let at = l.local_addr().unwrap().to_string();
        let (c, a) = tokio::join!(s.connect(&at), l.accept());
        let (mut c, (mut a, _)) = (c.unwrap(), a.unwrap());
        c.write_all(b"hi").await.unwrap();
        let mut buf = [0u8; 2];
        a.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hi");
        assert!(s.connect("127.0.0.1:1").await.is_err(), "a closed port is refused");
    }
}
