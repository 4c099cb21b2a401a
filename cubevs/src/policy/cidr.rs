//! The one IPv4 CIDR parser of CubeNet (policy entries here, the agent's `cidr` key too).
//!
//! Grammar, strict: `a.b.c.d` or `a.b.c.d/N`, where each octet is decimal 0–255 without
//! leading zeros (`0` itself is fine, `01` is not: other parsers read it as octal) and `N` is
//! decimal 0–32 without sign or leading zeros. No whitespace, no IPv6, no names. A bare
//! address is `/32`. Host bits are kept as written: [`Cidr::network`] clears them and
//! [`Cidr::has_host_bits`] tells whether there were any, so each caller decides (policy
//! entries canonicalise like the upstream agent's `net.ParseCIDR`, the IPAM range refuses).

use std::net::Ipv4Addr;

/// An IPv4 network or address with a prefix length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    /// Address as written (see [`Cidr::network`]).
    pub addr: Ipv4Addr,
    /// Prefix length 0–32.
    pub len: u8,
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// Decimal 0..=`max` without sign, spaces or leading zeros.
fn number(s: &str, max: u32) -> Option<u32> {
    if s.is_empty() || s.len() > 3 || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    s.parse::<u32>().ok().filter(|&n| n <= max)
}

impl Cidr {
    /// A network from its parts (`len` clamped to 32); host bits are kept.
    pub const fn new(addr: Ipv4Addr, len: u8) -> Self {
        Self { addr, len: if len > 32 { 32 } else { len } }
    }

    /// Parses the strict grammar of the module docs. The error says what is wrong, without
    /// the field name (callers add it).
    pub fn parse(s: &str) -> Result<Self, String> {
        let (a, l) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        if a.contains(':') {
            return Err(format!("{s:?}: IPv6 is not supported"));
        }
        let octets: Vec<&str> = a.split('.').collect();
        let mut b = [0u8; 4];
        if octets.len() != 4 {
            return Err(format!("{s:?} is not an IPv4 address or CIDR (a.b.c.d or a.b.c.d/N)"));
        }
        for (d, o) in b.iter_mut().zip(&octets) {
            *d = number(o, 255).ok_or_else(|| {
                format!("{s:?} is not an IPv4 address or CIDR (octets 0-255, decimal, no leading zeros)")
            })? as u8;
        }
        let len = match l {
            None => 32,
            Some(l) => number(l, 32)
                .ok_or_else(|| format!("{s:?}: prefix length must be 0-32 (decimal, no sign, no leading zeros)"))?
                as u8,
        };
        Ok(Self { addr: Ipv4Addr::from(b), len })
    }

    /// Network mask as a host-order `u32` (`/0` → 0).
    pub fn mask(&self) -> u32 {
        if self.len == 0 { 0 } else { u32::MAX << (32 - self.len) }
    }

    /// The network: the address with its host bits cleared.
    pub fn network(&self) -> Self {
        Self { addr: Ipv4Addr::from(u32::from(self.addr) & self.mask()), len: self.len }
    }

    /// True when the address has bits set beyond the prefix (`10.1.2.3/8`).
    pub fn has_host_bits(&self) -> bool {
        u32::from(self.addr) & !self.mask() != 0
    }

    /// True when `ip` is inside the network.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        (u32::from(ip) ^ u32::from(self.addr)) & self.mask() == 0
    }

    /// First address of the network (host order).
    pub fn first(&self) -> u32 {
        u32::from(self.addr) & self.mask()
    }

    /// Last address of the network (host order).
    pub fn last(&self) -> u32 {
        self.first() | !self.mask()
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Cidr::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_strict_grammar() {
        assert_eq!(Cidr::parse("10.1.2.3/8").unwrap().network().to_string(), "10.0.0.0/8");
        assert!(Cidr::parse("10.1.2.3/8").unwrap().has_host_bits());
        assert_eq!(Cidr::parse("1.2.3.4").unwrap().to_string(), "1.2.3.4/32");
        assert_eq!(Cidr::parse("0.0.0.0/0").unwrap().len, 0);
        assert_eq!(Cidr::parse("255.255.255.255/32").unwrap().last(), u32::MAX);
        assert!(Cidr::parse("192.168.0.0/16").unwrap().contains(Ipv4Addr::new(192, 168, 9, 9)));
        assert!(!Cidr::parse("192.168.0.0/16").unwrap().contains(Ipv4Addr::new(192, 169, 0, 0)));
        assert!(Cidr::parse("0.0.0.0/0").unwrap().contains(Ipv4Addr::new(8, 8, 8, 8)));
    }

    #[test]
    fn refuses_everything_else() {
        for bad in [
            "",
            "1.2.3",
            "1.2.3.4.5",
            "01.2.3.4",
            "1.2.3.04",
            "256.1.1.1",
            "1.2.3.4/33",
            "1.2.3.4/-1",
            "1.2.3.4/+8",
            "1.2.3.4/08",
            "1.2.3.4/",
            "+1.2.3.4",
            " 1.2.3.4",
            "1.2.3.4 ",
            "1.2.3.4/8/8",
            "::1",
            "example.com",
            "1.2.3.4/٣",
            "1..3.4",
        ] {
            assert!(Cidr::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
