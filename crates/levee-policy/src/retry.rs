//! Retry-After: how long a refused client should wait, computed from the state that refused
//! it (a bucket's refill time, the queue's measured drain rate), never a constant.

use crate::clock::Timestamp;
use std::time::Duration;

/// A wait a client is told to observe, with millisecond resolution.
///
/// The HTTP layer sends [`RetryAfter::header_secs`] as `Retry-After` (whole seconds, rounded
/// up) and [`RetryAfter::as_millis`] as `retry-after-ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct RetryAfter {
    millis: u64,
}

impl RetryAfter {
    /// No wait.
    pub const ZERO: RetryAfter = RetryAfter { millis: 0 };

    /// From a duration, rounded up to whole milliseconds.
    pub fn from_duration(d: Duration) -> Self {
        let ms = d.as_nanos().div_ceil(1_000_000);
        RetryAfter {
            millis: u64::try_from(ms).unwrap_or(u64::MAX),
        }
    }

    /// From milliseconds.
    pub const fn from_millis(millis: u64) -> Self {
        RetryAfter { millis }
    }

    /// Milliseconds, for `retry-after-ms`.
    pub const fn as_millis(self) -> u64 {
        self.millis
    }

    /// Whole seconds rounded up, for `Retry-After`. A nonzero wait is never rounded to 0.
    pub const fn header_secs(self) -> u64 {
        self.millis.div_ceil(1000)
    }

    /// As a duration.
    pub const fn as_duration(self) -> Duration {
        Duration::from_millis(self.millis)
    }

    /// Clamped into `[min, max]`.
    pub fn clamp(self, min: Duration, max: Duration) -> Self {
        let lo = RetryAfter::from_duration(min);
        let hi = RetryAfter::from_duration(max).max(lo);
        RetryAfter {
            millis: self.millis.clamp(lo.millis, hi.millis),
        }
    }
}

/// A measured rate of events per second (dequeues, completions) as an exponentially
/// time-decayed average: each event adds `1/τ`, and the estimate decays by `e^(-Δt/τ)`.
/// Under a steady rate `λ` it converges to `λ`; when events stop it decays toward zero, so
/// Retry-After grows when the queue stops draining.
#[derive(Debug, Clone, Copy)]
pub struct DrainRate {
    /// `1/τ` with `τ` in nanoseconds: kept as a reciprocal so that recording an event
    /// multiplies instead of dividing twice.
    per_nano: f64,
    rate: f64,
    last: Option<Timestamp>,
}

impl DrainRate {
    /// A rate estimator with time constant `tau` (how far back it effectively looks; 5–10 s
    /// suits a queue drain rate). A zero `tau` is treated as 1 ms.
    pub fn new(tau: Duration) -> Self {
        let tau_secs = tau.as_secs_f64().max(1e-3);
        DrainRate {
            per_nano: 1.0 / (tau_secs * 1e9),
            rate: 0.0,
            last: None,
        }
    }

    #[inline]
    fn decayed(&self, now: Timestamp) -> f64 {
        match self.last {
            None => 0.0,
            Some(last) => {
                let x = (now.as_nanos().saturating_sub(last.as_nanos())) as f64 * self.per_nano;
                self.rate * exp_neg(x)
            }
        }
    }

    /// Records `n` events at `now`.
    pub fn record(&mut self, n: u64, now: Timestamp) {
        let r = self.decayed(now);
        self.rate = r + n as f64 * (self.per_nano * 1e9);
        self.last = Some(match self.last {
            Some(l) if l > now => l,
            _ => now,
        });
    }

    /// Events per second as of `now`.
    pub fn per_second(&self, now: Timestamp) -> f64 {
        self.decayed(now)
    }

    /// Time to drain `items` at the measured rate; `None` if nothing has drained recently
    /// (rate below 10⁻⁶/s), so the caller picks its own upper bound.
    pub fn time_to_drain(&self, items: u64, now: Timestamp) -> Option<Duration> {
        let r = self.per_second(now);
        if r < 1e-6 {
            return None;
        }
        Some(Duration::from_secs_f64((items as f64 / r).min(1e9)))
    }
}

/// `e^(-x)` for `x ≥ 0`. Calls between events are usually microseconds apart against a
/// seconds-long time constant, so `x` is tiny and a short series is exact to ~1e-10.
#[inline]
fn exp_neg(x: f64) -> f64 {
    if x < 1e-2 {
        1.0 - x * (1.0 - x * (0.5 - x / 6.0))
    } else {
        (-x).exp()
    }
}

/// Bounds for capacity Retry-After estimates: a refused client is never told to come back
/// sooner than `min` (which would invite a hammering retry loop) nor later than `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryBounds {
    /// Lower bound.
    pub min: Duration,
    /// Upper bound; also used when no drain has been measured.
    pub max: Duration,
}

impl Default for RetryBounds {
    fn default() -> Self {
        RetryBounds {
            min: Duration::from_millis(250),
            max: Duration::from_secs(60),
        }
    }
}

impl RetryBounds {
    /// Retry-After for waiting until `items` have drained at `rate`, clamped to the bounds.
    #[inline]
    pub fn for_drain(&self, items: u64, rate: &DrainRate, now: Timestamp) -> RetryAfter {
        let min_ms = (self.min.as_secs_f64() * 1e3).round();
        let max_ms = (self.max.as_secs_f64() * 1e3).round().max(min_ms);
        let r = rate.per_second(now);
        let ms = if r < 1e-6 {
            max_ms
        } else {
            (items as f64 * 1000.0 / r).ceil()
        };
        RetryAfter::from_millis(ms.clamp(min_ms, max_ms) as u64)
    }

    /// Retry-After for an exact refill wait, clamped below by 1 ms only (the wait is known).
    pub fn for_refill(&self, wait: Duration) -> RetryAfter {
        RetryAfter::from_duration(wait.max(Duration::from_millis(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_rounds_up() {
        assert_eq!(RetryAfter::from_millis(1).header_secs(), 1);
        assert_eq!(RetryAfter::from_millis(1000).header_secs(), 1);
        assert_eq!(RetryAfter::from_millis(1001).header_secs(), 2);
        assert_eq!(
            RetryAfter::from_duration(Duration::from_nanos(1)).as_millis(),
            1
        );
        assert_eq!(RetryAfter::ZERO.header_secs(), 0);
    }

    #[test]
    fn drain_rate_converges_and_decays() {
        let mut d = DrainRate::new(Duration::from_secs(2));
        let mut t = Timestamp::ZERO;
        for _ in 0..2000 {
            t = t + Duration::from_millis(10); // 100/s
            d.record(1, t);
        }
        let r = d.per_second(t);
        assert!((r - 100.0).abs() < 5.0, "rate {r}");
        let w = d.time_to_drain(50, t).unwrap();
        assert!(
            w > Duration::from_millis(400) && w < Duration::from_millis(600),
            "{w:?}"
        );
        let later = t + Duration::from_secs(20);
        assert!(d.per_second(later) < 0.01);
        let b = RetryBounds::default();
        assert_eq!(b.for_drain(50, &d, later).as_duration(), b.max);
    }

    #[test]
    fn retry_after_grows_with_backlog() {
        let mut d = DrainRate::new(Duration::from_secs(1));
        let mut t = Timestamp::ZERO;
        for _ in 0..500 {
            t = t + Duration::from_millis(20);
            d.record(1, t);
        }
        let b = RetryBounds::default();
        let a = b.for_drain(10, &d, t);
        let c = b.for_drain(100, &d, t);
        assert!(c > a);
    }
}
