//! Exact rational time shared by the rate limiters ([`crate::Gcra`], [`crate::TokenBucket`]).
//!
//! A rate of `count` per `period` keeps time in units of `ns × count/g`, with
//! `g = gcd(count, period_ns)`: one request (or token) then costs exactly `period_ns/g`
//! units, so no rounding drift accumulates. For the usual rates (`period_ns` divisible by
//! `count`) a unit is one nanosecond and the hot paths need no division.

use crate::clock::{duration_nanos, Timestamp};
use std::time::Duration;

/// `x.ceil() as u64`, for every `x` (negative, NaN and infinite ones included), without the
/// call to libm's `ceil` that the baseline x86-64 target makes of `f64::ceil` (no SSE4.1
/// `roundsd`): the fair-share rule rounds a square root up several times per decision.
#[inline]
pub(crate) fn ceil_u64(x: f64) -> u64 {
    let t = x as u64;
    if (t as f64) < x {
        t.saturating_add(1)
    } else {
        t
    }
}

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

    /// Requests or tokens in `window` at this rate, rounded down.
    pub(crate) fn per(&self, window: Duration) -> u64 {
        let n = duration_nanos(window) as u128 * self.count as u128 / self.period_ns as u128;
        u64::try_from(n).unwrap_or(u64::MAX)
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

#[cfg(test)]
mod tests {
    use super::ceil_u64;
    use proptest::prelude::*;

    #[test]
    fn ceil_u64_agrees_with_ceil_at_the_edges() {
        let edges = [
            0.0,
            -0.0,
            0.5,
            1.0,
            1.000_000_1,
            -0.5,
            -3.0,
            2f64.powi(52) + 0.5,
            2f64.powi(53),
            2f64.powi(64) - 2048.0,
            2f64.powi(64),
            1e300,
            f64::MIN_POSITIVE,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
        ];
        for x in edges {
            assert_eq!(ceil_u64(x), x.ceil() as u64, "{x}");
        }
    }

    proptest! {
        #[test]
        fn ceil_u64_agrees_with_ceil(x in proptest::num::f64::ANY) {
            prop_assert_eq!(ceil_u64(x), x.ceil() as u64);
        }

        #[test]
        fn ceil_u64_agrees_with_ceil_on_the_fair_share_inputs(n in 0u64..=u64::MAX, z in 0.0f64..10.0) {
            let x = z * (n as f64).sqrt();
            prop_assert_eq!(ceil_u64(x), x.ceil() as u64);
        }
    }
}
