//! Exact rational time shared by the rate limiters ([`crate::Gcra`], [`crate::TokenBucket`]).
//!
//! A rate of `count` per `period` keeps time in units of `ns × count/g`, with
//! `g = gcd(count, period_ns)`: one request (or token) then costs exactly `period_ns/g`
//! units, so no rounding drift accumulates. For the usual rates (`period_ns` divisible by
//! `count`) a unit is one nanosecond and the hot paths need no division.

use crate::clock::{duration_nanos, Timestamp};
use std::time::Duration;

/// A rate in exact units: `count` per `period_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct RateUnits {
    pub(crate) count: u64,
    pub(crate) period_ns: u64,
    /// `count / gcd(count, period_ns)`: time is kept in units of `ns × ucount`.
    pub(crate) ucount: u64,
    /// `period_ns / gcd(count, period_ns)`: units per request/token.
    pub(crate) uunit: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl RateUnits {
    /// `count` per `period`; zeros are raised to 1.
    pub(crate) fn new(count: u64, period: Duration) -> Self {
        let count = count.max(1);
        let period_ns = duration_nanos(period).max(1);
        let g = gcd(count, period_ns);
        RateUnits {
            count,
            period_ns,
            ucount: count / g,
            uunit: period_ns / g,
        }
    }

    /// Units one request or token costs.
    #[inline]
    pub(crate) fn unit(&self) -> u128 {
        self.uunit as u128
    }

    /// Units `n` requests or tokens cost (a burst, a capacity).
    #[inline]
    pub(crate) fn of(&self, n: u64) -> u128 {
        self.uunit as u128 * n as u128
    }

    /// `now` in units.
    #[inline]
    pub(crate) fn units_at(&self, now: Timestamp) -> u128 {
        now.as_nanos() as u128 * self.ucount as u128
    }

    /// `units` as a duration, rounded up to the nanosecond.
    #[inline]
    pub(crate) fn units_to_duration(&self, units: u128) -> Duration {
        // u64 division when it fits: u128 division is a slow library call.
        let ns = match u64::try_from(units) {
            Ok(u) if self.ucount == 1 => u,
            Ok(u) => u.div_ceil(self.ucount),
            Err(_) => u64::try_from(units.div_ceil(self.ucount as u128)).unwrap_or(u64::MAX),
        };
        Duration::from_nanos(ns)
    }
}
