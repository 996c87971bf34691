//! GCRA (generic cell rate algorithm) request-rate limiting.
//!
//! State is one "theoretical arrival time" (TAT). Arithmetic is exact: time is kept in units
//! of `ns × count/g` with `g = gcd(count, period_ns)`, so a quota of `count` per `period`
//! costs exactly `period_ns/g` units per request and the limiter admits at most
//! `⌊t·count/period⌋ + burst` requests in any window of length `t` — no rounding drift.
//! For the usual quotas (`period_ns` divisible by `count`) a unit is one nanosecond and the
//! hot path and the Retry-After computation need no division.

use crate::clock::Timestamp;
use crate::keyed::{BoundedMap, Evictable};
use crate::units::RateUnits;
use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

/// A rate: `count` requests per `period`, with up to `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    units: RateUnits,
    burst: u64,
}

impl Quota {
    /// `count` per `period`, burst = `count`. Zero `count`/`period` are raised to 1.
    pub fn new(count: u64, period: Duration) -> Self {
        let units = RateUnits::new(count, period);
        Quota {
            burst: units.count,
            units,
        }
    }

    /// `n` per second, burst `n`.
    pub fn per_second(n: u64) -> Self {
        Quota::new(n, Duration::from_secs(1))
    }

    /// `n` per minute, burst `n`.
    pub fn per_minute(n: u64) -> Self {
        Quota::new(n, Duration::from_secs(60))
    }

    /// The same rate with a different burst (raised to at least 1).
    pub fn with_burst(mut self, burst: u64) -> Self {
        self.burst = burst.max(1);
        self
    }

    /// Requests per period.
    pub fn count(&self) -> u64 {
        self.units.count
    }

    /// The period.
    pub fn period(&self) -> Duration {
        Duration::from_nanos(self.units.period_ns)
    }

    /// Requests allowed at once.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Average time between requests at the sustained rate.
    pub fn emission_interval(&self) -> Duration {
        Duration::from_nanos(self.units.period_ns / self.units.count)
    }

    #[inline]
    fn tolerance(&self) -> u128 {
        self.units.of(self.burst)
    }
}

/// A request refused by a rate limit: try again after `retry_after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotUntil {
    /// The exact time until one request would be admitted.
    pub retry_after: Duration,
}

/// Rate-limit state in the shape of OpenAI's `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateLimitInfo {
    /// `x-ratelimit-limit-*`: the most that can be used at once (the burst / capacity).
    pub limit: u64,
    /// `x-ratelimit-remaining-*`: what could be used right now.
    pub remaining: u64,
    /// `x-ratelimit-reset-*`: time until the limit is fully replenished.
    pub reset_after: Duration,
}

/// One GCRA limiter. `&mut self`: hold it behind the caller's lock.
#[derive(Debug, Clone)]
pub struct Gcra {
    quota: Quota,
    tat: u128,
}

impl Gcra {
    /// A full limiter.
    pub fn new(quota: Quota) -> Self {
        Gcra { quota, tat: 0 }
    }

    /// The quota.
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// Changes the quota, keeping the debt already accrued.
    pub fn set_quota(&mut self, quota: Quota) {
        // Re-express the theoretical arrival time in the new quota's units.
        let ns = self.tat / self.quota.units.ucount as u128;
        self.tat = ns * quota.units.ucount as u128;
        self.quota = quota;
    }

    /// Decides one request at `now` without recording it: `Ok(new_tat)` to pass to
    /// [`Gcra::commit`].
    #[inline]
    pub(crate) fn peek(&self, now: Timestamp) -> Result<u128, NotUntil> {
        self.peek_n(1, now)
    }

    /// [`Gcra::peek`] for `n` requests at once.
    #[inline]
    pub(crate) fn peek_n(&self, n: u64, now: Timestamp) -> Result<u128, NotUntil> {
        let q = &self.quota;
        let t = q.units.units_at(now);
        let new_tat = self.tat.max(t) + q.units.of(n);
        let allow_at = new_tat.saturating_sub(q.tolerance());
        if t >= allow_at {
            Ok(new_tat)
        } else {
            Err(NotUntil {
                retry_after: q.units.units_to_duration(allow_at - t),
            })
        }
    }

    #[inline]
    pub(crate) fn commit(&mut self, new_tat: u128) {
        self.tat = new_tat;
    }

    /// Admits one request at `now` (and records it) or says when one would be admitted.
    #[inline]
    pub fn check(&mut self, now: Timestamp) -> Result<(), NotUntil> {
        let new_tat = self.peek(now)?;
        self.tat = new_tat;
        Ok(())
    }

    /// Gives back one admitted request (it was refused later, or never served): the
    /// limiter is as if it had not been admitted, except for time already passed.
    pub fn refund(&mut self, now: Timestamp) {
        self.refund_n(1, now);
    }

    /// [`Gcra::refund`] of `n` requests.
    pub(crate) fn refund_n(&mut self, n: u64, now: Timestamp) {
        let t = self.quota.units.units_at(now);
        if self.tat > t {
            self.tat = self.tat.saturating_sub(self.quota.units.of(n)).max(t);
        }
    }

    /// Requests in `window` at the sustained rate, rounded down.
    pub(crate) fn per(&self, window: Duration) -> u64 {
        self.quota.units.per(window)
    }

    /// Header figures at `now`.
    pub fn info(&self, now: Timestamp) -> RateLimitInfo {
        let q = &self.quota;
        let t = q.units.units_at(now);
        let tat = self.tat.max(t);
        let room = (t + q.tolerance()).saturating_sub(tat);
        RateLimitInfo {
            limit: q.burst,
            remaining: u64::try_from(room / q.units.unit())
                .unwrap_or(u64::MAX)
                .min(q.burst),
            reset_after: q.units.units_to_duration(tat - t),
        }
    }
}

impl Evictable for Gcra {
    fn is_idle(&self, now: Timestamp) -> bool {
        self.tat <= self.quota.units.units_at(now)
    }
    fn debt(&self, now: Timestamp) -> u128 {
        // Normalised to time so keys with different quotas compare fairly.
        self.tat.saturating_sub(self.quota.units.units_at(now)) / self.quota.units.ucount as u128
    }
}

/// Per-key GCRA limiters with a default quota, per-key overrides, and bounded memory (see
/// the crate docs on eviction). A key whose quota is `None` is not limited.
#[derive(Debug, Clone)]
pub struct KeyedGcra<K> {
    default: Option<Quota>,
    overrides: HashMap<K, Option<Quota>>,
    states: BoundedMap<K, Gcra>,
}

impl<K: Hash + Eq + Clone> KeyedGcra<K> {
    /// Every key gets `default` unless overridden; at most `max_keys` keys are tracked.
    pub fn new(default: Option<Quota>, max_keys: usize) -> Self {
        KeyedGcra {
            default,
            overrides: HashMap::new(),
            states: BoundedMap::new(max_keys),
        }
    }

    /// Sets `key`'s quota (`None`: unlimited). Overrides are configuration and never evicted.
    pub fn set_quota(&mut self, key: K, quota: Option<Quota>) {
        if let Some(state) = self.states.get_mut(&key) {
            match quota {
                Some(q) => state.set_quota(q),
                None => {
                    self.states.remove(&key);
                }
            }
        }
        self.overrides.insert(key, quota);
    }

    /// The quota that applies to `key`.
    pub fn quota_for(&self, key: &K) -> Option<Quota> {
        match self.overrides.get(key) {
            Some(q) => *q,
            None => self.default,
        }
    }

    /// Admits one request for `key` at `now`, or says when.
    #[inline]
    pub fn check(&mut self, key: &K, now: Timestamp) -> Result<(), NotUntil> {
        if let Some(g) = self.states.get_mut(key) {
            return g.check(now);
        }
        match self.quota_for(key) {
            Some(q) => self.states.insert_new(key, now, Gcra::new(q)).check(now),
            None => Ok(()),
        }
    }

    /// Header figures for `key`; `None` if unlimited.
    pub fn info(&self, key: &K, now: Timestamp) -> Option<RateLimitInfo> {
        match self.states.get(key) {
            Some(g) => Some(g.info(now)),
            None => self.quota_for(key).map(|q| Gcra::new(q).info(now)),
        }
    }

    /// Drops state of keys that are back to full; returns how many. Optional housekeeping:
    /// the cap is enforced on insert regardless.
    pub fn evict_idle(&mut self, now: Timestamp) -> usize {
        self.states.evict_idle(now)
    }

    /// Keys currently tracked.
    pub fn tracked_keys(&self) -> usize {
        self.states.len()
    }

    /// The cap on tracked keys.
    pub fn max_keys(&self) -> usize {
        self.states.cap()
    }

    /// Keys evicted so far (idle or not).
    pub fn evictions(&self) -> u64 {
        self.states.evicted()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn burst_then_rate() {
        let mut g = Gcra::new(Quota::per_second(10).with_burst(3));
        let t0 = Timestamp::from_nanos(1_000_000_000);
        for _ in 0..3 {
            assert!(g.check(t0).is_ok());
        }
        let e = g.check(t0).unwrap_err();
        assert_eq!(e.retry_after, ms(100));
        assert!(g.check(t0 + ms(99)).is_err());
        assert!(g.check(t0 + ms(100)).is_ok());
        assert!(g.check(t0 + ms(100)).is_err());
    }

    #[test]
    fn info_reports_remaining_and_reset() {
        let mut g = Gcra::new(Quota::per_minute(60));
        let t0 = Timestamp::from_nanos(5);
        assert_eq!(g.info(t0).remaining, 60);
        assert_eq!(g.info(t0).reset_after, Duration::ZERO);
        g.check(t0).unwrap();
        g.check(t0).unwrap();
        let i = g.info(t0);
        assert_eq!(i.limit, 60);
        assert_eq!(i.remaining, 58);
        assert_eq!(i.reset_after, Duration::from_secs(2));
    }

    #[test]
    fn keyed_overrides_and_unlimited() {
        let mut k = KeyedGcra::new(Some(Quota::per_second(1)), 100);
        k.set_quota("vip", Some(Quota::per_second(5)));
        k.set_quota("free-for-all", None);
        let t = Timestamp::from_nanos(10);
        assert!(k.check(&"a", t).is_ok());
        assert!(k.check(&"a", t).is_err());
        for _ in 0..5 {
            assert!(k.check(&"vip", t).is_ok());
        }
        assert!(k.check(&"vip", t).is_err());
        for _ in 0..100 {
            assert!(k.check(&"free-for-all", t).is_ok());
        }
    }

    #[test]
    fn keyed_memory_is_bounded_under_key_flood() {
        let mut k: KeyedGcra<u64> = KeyedGcra::new(Some(Quota::per_minute(1)), 1000);
        let t = Timestamp::from_nanos(1);
        for key in 0..100_000u64 {
            let _ = k.check(&key, t);
            assert!(k.tracked_keys() <= 1000);
        }
        assert!(k.evictions() >= 99_000);
    }

    #[test]
    fn idle_keys_are_evicted_first() {
        let mut k: KeyedGcra<u64> = KeyedGcra::new(Some(Quota::per_second(1)), 4);
        let t0 = Timestamp::from_nanos(1);
        k.check(&1, t0).unwrap();
        k.check(&1, t0 + ms(900)).unwrap_err();
        let t1 = t0 + ms(950);
        k.check(&9, t1).unwrap();
        assert_eq!(k.evict_idle(t1 + ms(2000)), 2);
    }
}
