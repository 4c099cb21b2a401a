//! Sandbox address allocation over the configured CIDR (`reference/upstream.md §2.2`): a
//! bitmap with index 0 (network), 1 (gateway, cube-dev) and the broadcast reserved, next-fit
//! from a cursor so recently freed addresses are reused last.

use std::net::Ipv4Addr;

use crate::config::Cidr;

/// The allocator. Not thread-safe by itself (the pool holds it under its lock).
#[derive(Debug)]
pub struct Ipam {
    cidr: Cidr,
    used: Vec<bool>,
    cursor: usize,
}

impl Ipam {
    /// An allocator with only the reserved indices taken.
    pub fn new(cidr: Cidr) -> Self {
        let size = cidr.size() as usize;
        let mut used = vec![false; size];
        used[0] = true;
        used[1] = true;
        used[size - 1] = true;
        Self { cidr, used, cursor: 1 }
    }

    /// Next free address after the cursor (wrapping); `None` when the CIDR is exhausted.
    pub fn allocate(&mut self) -> Option<Ipv4Addr> {
        let n = self.used.len();
        for step in 1..=n {
            let i = (self.cursor + step) % n;
            if !self.used[i] {
                self.used[i] = true;
                self.cursor = i;
                return Some(self.cidr.nth(i as u32));
            }
        }
        None
    }

    /// Marks `ip` used (recovery). Returns false when it is outside the CIDR or reserved.
    pub fn assign(&mut self, ip: Ipv4Addr) -> bool {
        match self.cidr.index_of(ip) {
            Some(i) if i >= 2 && (i as usize) < self.used.len() - 1 => {
                self.used[i as usize] = true;
                true
            }
            _ => false,
        }
    }

    /// Frees `ip`; reserved or foreign addresses are ignored.
    pub fn release(&mut self, ip: Ipv4Addr) {
        if let Some(i) = self.cidr.index_of(ip)
            && i >= 2
            && (i as usize) < self.used.len() - 1
        {
            self.used[i as usize] = false;
        }
    }

    /// Addresses in use, reserved ones excluded.
    pub fn in_use(&self) -> usize {
        self.used.iter().filter(|u| **u).count() - 3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_fit_skips_reserved_and_wraps() {
        let mut ipam = Ipam::new(Cidr::parse("10.0.0.0/29").unwrap());
        let got: Vec<_> = std::iter::from_fn(|| ipam.allocate()).collect();
        let want: Vec<Ipv4Addr> = (2..=6).map(|i| Ipv4Addr::new(10, 0, 0, i)).collect();
        assert_eq!(got, want);
        assert_eq!(ipam.in_use(), 5);
        ipam.release(Ipv4Addr::new(10, 0, 0, 3));
        ipam.release(Ipv4Addr::new(10, 0, 0, 1)); // reserved: ignored
        assert_eq!(ipam.allocate(), Some(Ipv4Addr::new(10, 0, 0, 3)));
        assert_eq!(ipam.allocate(), None);
    }

    #[test]
    fn assign_marks_used() {
        let mut ipam = Ipam::new(Cidr::parse("10.0.0.0/24").unwrap());
        assert!(ipam.assign(Ipv4Addr::new(10, 0, 0, 2)));
        assert!(!ipam.assign(Ipv4Addr::new(10, 0, 0, 255)));
        assert!(!ipam.assign(Ipv4Addr::new(10, 0, 1, 2)));
        assert_eq!(ipam.allocate(), Some(Ipv4Addr::new(10, 0, 0, 3)));
    }
}
