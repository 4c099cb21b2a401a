//! Host-port allocation for port mappings (`reference/upstream.md §2.5`): a range (default
//! 20000–29999), next-fit with wrap, ports of `ip_local_reserved_ports` pre-claimed, an owner
//! per port so a sandbox's ports are freed together.

use std::collections::HashMap;

/// Owner recorded for reserved ports.
pub const SYSTEM_OWNER: &str = "__system__";

/// Why a port could not be had.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    /// Explicit port outside the range.
    #[error("host port {0} is outside the host_port_range {1}-{2}")]
    OutOfRange(u16, u16, u16),
    /// Explicit port already taken.
    #[error("host port {0} is already in use")]
    InUse(u16),
    /// The range is full.
    #[error("no free host port in {0}-{1}")]
    Exhausted(u16, u16),
}

/// Parses the kernel's reserved-ports list (`8080,9000-9010`; empty allowed).
pub fn parse_reserved(s: &str) -> Vec<(u16, u16)> {
    s.trim()
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .filter_map(|p| {
            let p = p.trim();
            match p.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => p.parse().ok().map(|v| (v, v)),
            }
        })
        .collect()
}

/// The allocator (held under the agent's lock).
#[derive(Debug)]
pub struct PortAllocator {
    first: u16,
    last: u16,
    owners: HashMap<u16, String>,
    cursor: u16,
}

impl PortAllocator {
    /// An allocator over `first..=last` with `reserved` ranges pre-claimed.
    pub fn new(first: u16, last: u16, reserved: &[(u16, u16)]) -> Self {
        let mut owners = HashMap::new();
        for &(a, b) in reserved {
            for p in a.max(first)..=b.min(last) {
                owners.insert(p, SYSTEM_OWNER.to_string());
            }
        }
        Self { first, last, owners, cursor: last }
    }

    /// Claims `port` (or the next free one when 0) for `owner`.
    pub fn claim(&mut self, owner: &str, port: u16) -> Result<u16, PortError> {
        if port != 0 {
            if port < self.first || port > self.last {
                return Err(PortError::OutOfRange(port, self.first, self.last));
            }
            if self.owners.contains_key(&port) {
                return Err(PortError::InUse(port));
            }
            self.owners.insert(port, owner.to_string());
            return Ok(port);
        }
        let span = u32::from(self.last - self.first) + 1;
        for step in 1..=span {
            let off = (u32::from(self.cursor - self.first) + step) % span;
            let p = self.first + off as u16;
            if let std::collections::hash_map::Entry::Vacant(e) = self.owners.entry(p) {
                e.insert(owner.to_string());
                self.cursor = p;
                return Ok(p);
            }
        }
        Err(PortError::Exhausted(self.first, self.last))
    }

    /// Re-claims a port recorded in state (recovery); ports outside the range are tolerated.
    pub fn reclaim(&mut self, owner: &str, port: u16) {
        self.owners.insert(port, owner.to_string());
    }

    /// Frees every port of `owner`.
    pub fn release_owner(&mut self, owner: &str) {
        self.owners.retain(|_, o| o != owner);
    }

    /// Ports held by sandboxes (reserved ones excluded).
    pub fn in_use(&self) -> usize {
        self.owners.values().filter(|o| *o != SYSTEM_OWNER).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_ports_are_skipped() {
        let r = parse_reserved("20000,20002-20003\n");
        assert_eq!(r, vec![(20000, 20000), (20002, 20003)]);
        let mut a = PortAllocator::new(20000, 20005, &r);
        assert_eq!(a.claim("s1", 0), Ok(20001));
        assert_eq!(a.claim("s1", 0), Ok(20004));
        assert_eq!(a.claim("s2", 0), Ok(20005));
        assert_eq!(a.claim("s2", 0), Err(PortError::Exhausted(20000, 20005)));
        a.release_owner("s1");
        assert_eq!(a.in_use(), 1);
        assert_eq!(a.claim("s3", 0), Ok(20001));
    }

    #[test]
    fn explicit_ports_checked() {
        let mut a = PortAllocator::new(20000, 29999, &[]);
        assert_eq!(a.claim("s", 25000), Ok(25000));
        assert_eq!(a.claim("t", 25000), Err(PortError::InUse(25000)));
        assert_eq!(a.claim("t", 80), Err(PortError::OutOfRange(80, 20000, 29999)));
        assert!(parse_reserved("").is_empty());
    }
}
