//! Where a task callback may go. A tenant chooses its `callback_url`, so without a policy
//! the gateway would POST wherever a tenant asks, from inside the network: its own admin
//! listener, an engine's admin route, a cloud metadata service. The policy refuses
//! loopback, private, link-local (metadata included), CGNAT, multicast and reserved
//! addresses, judged on the addresses the host name resolves to (so `0x7f000001`,
//! `127.1`, `[::ffff:127.0.0.1]` and a name that resolves to 10.0.0.1 are all refused),
//! and the connection is made to the judged address itself: no second resolution can
//! swap it. Internal receivers are let through by name or by CIDR
//! (`tasks.callback_allow`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// One entry of `tasks.callback_allow`: a host name (as written in the URL) or a network.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Allow {
    Host(String),
    Net(IpAddr, u8),
}

/// The callback destination policy: what is refused, and the operator's exceptions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressPolicy {
    allow: Vec<Allow>,
}

impl EgressPolicy {
    /// Builds the policy from `tasks.callback_allow`; each entry is a host name, an IP
    /// address or a CIDR (`10.1.0.0/16`, `fd00::/8`). Errors name the entry.
    pub fn new(entries: &[String]) -> Result<EgressPolicy, String> {
        let allow = entries
            .iter()
            .map(|e| {
                parse_allow(e).ok_or_else(|| format!("{e:?} is not a host name, an IP or a CIDR"))
            })
            .collect::<Result<_, _>>()?;
        Ok(EgressPolicy { allow })
    }

    /// Whether a callback to `host` (the URL's host, brackets removed) may connect to
    /// `addr`, one of the addresses `host` resolved to.
    pub fn permits(&self, host: &str, addr: IpAddr) -> bool {
        let host = host.trim_end_matches('.');
        let listed = self.allow.iter().any(|a| match a {
            Allow::Host(h) => h.eq_ignore_ascii_case(host),
            Allow::Net(net, bits) => in_net(addr, *net, *bits),
        });
        listed || !is_internal(addr)
    }
}

fn parse_allow(entry: &str) -> Option<Allow> {
    let e = entry.trim();
    if let Some((ip, bits)) = e.split_once('/') {
        let ip: IpAddr = ip.parse().ok()?;
        let bits: u8 = bits.parse().ok()?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        return (bits <= max).then_some(Allow::Net(ip, bits));
    }
    if let Ok(ip) = e
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        let bits = if ip.is_ipv4() { 32 } else { 128 };
        return Some(Allow::Net(ip, bits));
    }
    let valid = !e.is_empty()
        && e.len() <= 253
        && e.split('.')
            .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    valid.then(|| Allow::Host(e.trim_end_matches('.').to_ascii_lowercase()))
}

/// Whether `addr` lies in `net/bits` (an IPv4-mapped IPv6 address counts as its IPv4).
fn in_net(addr: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (canonical(addr), net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// An IPv6 address that carries an IPv4 one (mapped `::ffff:a.b.c.d`, compatible
/// `::a.b.c.d`, NAT64 `64:ff9b::a.b.c.d`, 6to4 `2002:AABB:CCDD::`) as that IPv4 address.
fn canonical(addr: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = addr else { return addr };
    let s = v6.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if s[..5] == [0; 5] && (s[5] == 0xffff || (s[5] == 0 && u32::from(low) > 1)) {
        return IpAddr::V4(low);
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return IpAddr::V4(low);
    }
    if s[0] == 0x2002 {
        let v4 = Ipv4Addr::new((s[1] >> 8) as u8, s[1] as u8, (s[2] >> 8) as u8, s[2] as u8);
        return IpAddr::V4(v4);
    }
    addr
}

/// Addresses a callback never reaches unless allowed: this host, private networks,
/// link-local (the cloud metadata service 169.254.169.254 and fd00:ec2::254 among them),
/// CGNAT, multicast, broadcast and reserved ranges.
pub fn is_internal(addr: IpAddr) -> bool {
    match canonical(addr) {
        IpAddr::V4(v4) => internal_v4(v4),
        IpAddr::V6(v6) => internal_v6(v6),
    }
}

fn internal_v4(a: Ipv4Addr) -> bool {
    const NETS: [([u8; 4], u8); 13] = [
        ([0, 0, 0, 0], 8),       // "this network"
        ([10, 0, 0, 0], 8),      // private
        ([100, 64, 0, 0], 10),   // CGNAT
        ([127, 0, 0, 0], 8),     // loopback
        ([169, 254, 0, 0], 16),  // link-local, metadata
        ([172, 16, 0, 0], 12),   // private
        ([192, 0, 0, 0], 24),    // IETF protocol assignments
        ([192, 0, 2, 0], 24),    // documentation
        ([192, 168, 0, 0], 16),  // private
        ([198, 18, 0, 0], 15),   // benchmarking
        ([198, 51, 100, 0], 24), // documentation
        ([203, 0, 113, 0], 24),  // documentation
        ([224, 0, 0, 0], 3),     // multicast, reserved, broadcast
    ];
    NETS.iter()
        .any(|(n, bits)| in_net(IpAddr::V4(a), IpAddr::V4(Ipv4Addr::from(*n)), *bits))
}

fn internal_v6(a: Ipv6Addr) -> bool {
    const NETS: [(u128, u8); 7] = [
        (0, 127),                // :: and ::1
        (0xfc00 << 112, 7),      // unique local (fd00:ec2::254 too)
        (0xfe80 << 112, 10),     // link-local
        (0xfec0 << 112, 10),     // site-local (deprecated)
        (0xff00 << 112, 8),      // multicast
        (0x0100 << 112, 64),     // discard-only
        (0x2001_0db8 << 96, 32), // documentation
    ];
    NETS.iter()
        .any(|(n, bits)| in_net(IpAddr::V6(a), IpAddr::V6(Ipv6Addr::from(*n)), *bits))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn refuses_internal_addresses_in_every_form() {
        for a in [
            "127.0.0.1",
            "127.255.0.9",
            "0.0.0.0",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.255.255",
            "224.0.0.1",
            "239.255.255.250",
            "255.255.255.255",
            "::1",
            "::",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "fd00:ec2::254",
            "fe80::1",
            "ff02::1",
        ] {
            assert!(is_internal(ip(a)), "{a} must be refused");
            assert!(!EgressPolicy::default().permits("x", ip(a)), "{a}");
        }
        for a in [
            "8.8.8.8",
            "1.1.1.1",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
        ] {
            assert!(!is_internal(ip(a)), "{a} is public");
            assert!(EgressPolicy::default().permits("x", ip(a)), "{a}");
        }
    }

    #[test]
    fn the_allow_list_lets_named_hosts_and_networks_through() {
        let p = EgressPolicy::new(&[
            "hooks.internal".into(),
            "10.1.0.0/16".into(),
            "127.0.0.1".into(),
            "fd00::/8".into(),
        ])
        .unwrap();
        assert!(p.permits("hooks.internal", ip("10.9.9.9")));
        assert!(p.permits("HOOKS.internal.", ip("192.168.0.1")));
        assert!(p.permits("other", ip("10.1.200.3")));
        assert!(!p.permits("other", ip("10.2.0.1")));
        assert!(p.permits("other", ip("127.0.0.1")));
        assert!(p.permits("other", ip("::ffff:127.0.0.1")));
        assert!(!p.permits("other", ip("127.0.0.2")));
        assert!(p.permits("other", ip("fd12::1")));
        assert!(!p.permits("other", ip("::1")));
        for bad in ["10.0.0.0/33", "", "a b", "::/129", "x/8"] {
            assert!(EgressPolicy::new(&[bad.into()]).is_err(), "{bad:?}");
        }
    }

    proptest! {
        /// Every IPv4 address is judged the same as its IPv4-mapped IPv6 form.
        #[test]
        fn mapped_forms_are_judged_as_their_ipv4(a in any::<u32>()) {
            let v4 = Ipv4Addr::from(a);
            prop_assert_eq!(
                is_internal(IpAddr::V4(v4)),
                is_internal(IpAddr::V6(v4.to_ipv6_mapped()))
            );
        }

        /// Loopback, private and link-local addresses are never permitted by default.
        #[test]
        fn std_classes_are_refused(a in any::<u32>()) {
            let v4 = Ipv4Addr::from(a);
            if v4.is_loopback() || v4.is_private() || v4.is_link_local() || v4.is_multicast()
                || v4.is_broadcast() || v4.is_unspecified() {
                prop_assert!(!EgressPolicy::default().permits("h", IpAddr::V4(v4)));
            }
        }
    }
}
