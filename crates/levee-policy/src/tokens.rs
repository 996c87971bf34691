//! LLM-token rate limiting with reserve-then-reconcile.
//!
//! At admission the gateway reserves an estimate (prompt tokens + `max_tokens`); when the
//! response ends it reconciles with the actual count, refunding or charging the difference.
//! The bucket never holds more than its capacity; a charge past empty is carried as debt of
//! at most one capacity (the client waits until it is paid back: under-declaring
//! `max_tokens` does not dodge the quota), and a refund past full is dropped.
//!
//! Like [`crate::Gcra`], the state is a theoretical arrival time in exact `ns × count` units.

use crate::clock::Timestamp;
use crate::gcra::RateLimitInfo;
use crate::keyed::{BoundedMap, Evictable};
use crate::units::RateUnits;
use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

/// A token budget: `tokens` per `period`, holding at most `capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenQuota {
    units: RateUnits,
    capacity: u64,
}

impl TokenQuota {
    /// `tokens` per `period`, capacity = `tokens`. Zeros are raised to 1.
    pub fn new(tokens: u64, period: Duration) -> Self {
        let units = RateUnits::new(tokens, period);
        TokenQuota {
            capacity: units.count,
            units,
        }
    }

    /// `tokens` per minute (OpenAI's TPM), capacity = `tokens`.
    pub fn per_minute(tokens: u64) -> Self {
        TokenQuota::new(tokens, Duration::from_secs(60))
    }

    /// The same refill rate with a different capacity (at least 1).
    pub fn with_capacity(mut self, capacity: u64) -> Self {
        self.capacity = capacity.max(1);
        self
    }

    /// The most the bucket holds; also the largest single reservation that can ever pass.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Tokens per period.
    pub fn count(&self) -> u64 {
        self.units.count
    }

    /// The period.
    pub fn period(&self) -> Duration {
        Duration::from_nanos(self.units.period_ns)
    }

    #[inline]
    fn tolerance(&self) -> u128 {
        self.units.of(self.capacity)
    }
}

/// Why a token reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not enough tokens now; enough will have refilled after `retry_after`.
    NotUntil {
        /// Exact refill wait.
        retry_after: Duration,
    },
    /// The estimate is larger than the bucket's capacity: it can never pass. The caller should
    /// answer 4xx (lower `max_tokens`), not tell the client to retry.
    TooLarge {
        /// The bucket's capacity.
        capacity: u64,
    },
}

impl Refused {
    /// The wait, if waiting can help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Refused::NotUntil { retry_after } => Some(*retry_after),
            Refused::TooLarge { .. } => None,
        }
    }
}

/// One token bucket.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    quota: TokenQuota,
    tat: u128,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(quota: TokenQuota) -> Self {
        TokenBucket { quota, tat: 0 }
    }

    /// The quota.
    pub fn quota(&self) -> TokenQuota {
        self.quota
    }

    /// Changes the quota. The fill level is clamped into the new capacity.
    pub fn set_quota(&mut self, quota: TokenQuota) {
        // Re-express the theoretical arrival time in the new quota's units.
        let ns = self.tat / self.quota.units.ucount as u128;
        self.tat = ns * quota.units.ucount as u128;
        self.quota = quota;
    }

    /// Tokens available at `now`, in `0..=capacity`.
    pub fn available(&self, now: Timestamp) -> u64 {
        let q = &self.quota;
        let t = q.units.units_at(now);
        let tat = self.tat.max(t);
        let room = (t + q.tolerance()).saturating_sub(tat);
        u64::try_from(room / q.units.unit())
            .unwrap_or(u64::MAX)
            .min(q.capacity)
    }

    #[inline]
    pub(crate) fn peek(&self, tokens: u64, now: Timestamp) -> Result<u128, Refused> {
        let q = &self.quota;
        if tokens > q.capacity {
            return Err(Refused::TooLarge {
                capacity: q.capacity,
            });
        }
        let t = q.units.units_at(now);
        let new_tat = self.tat.max(t) + q.units.unit() * tokens as u128;
        let limit = t + q.tolerance();
        if new_tat <= limit {
            Ok(new_tat)
        } else {
            Err(Refused::NotUntil {
                retry_after: q.units.units_to_duration(new_tat - limit),
            })
        }
    }

    /// Tokens in `window` at the refill rate, rounded down.
    pub(crate) fn per(&self, window: Duration) -> u64 {
        self.quota.units.per(window)
    }

    #[inline]
    pub(crate) fn commit(&mut self, new_tat: u128) {
        self.tat = new_tat;
    }

    /// Takes `tokens` at `now`, or says when they would be there.
    #[inline]
    pub fn reserve(&mut self, tokens: u64, now: Timestamp) -> Result<(), Refused> {
        let new_tat = self.peek(tokens, now)?;
        self.tat = new_tat;
        Ok(())
    }

    /// Settles a reservation of `reserved` tokens that actually used `actual`: refunds or
    /// charges the difference. A charge past empty is carried as debt, down to one
    /// capacity below zero (the level stays within `-capacity..=capacity`): the client
    /// waits until it is paid back instead of having its overage forgiven.
    pub fn reconcile(&mut self, reserved: u64, actual: u64, now: Timestamp) {
        let q = &self.quota;
        let t = q.units.units_at(now);
        let tat = self.tat.max(t);
        self.tat = if actual >= reserved {
            let charge = q.units.unit() * (actual - reserved) as u128;
            (tat + charge).min(t + 2 * q.tolerance())
        } else {
            let refund = q.units.unit() * (reserved - actual) as u128;
            tat.saturating_sub(refund).max(t)
        };
    }

    /// Header figures at `now`.
    pub fn info(&self, now: Timestamp) -> RateLimitInfo {
        let q = &self.quota;
        let t = q.units.units_at(now);
        let tat = self.tat.max(t);
        RateLimitInfo {
            limit: q.capacity,
            remaining: self.available(now),
            reset_after: q.units.units_to_duration(tat - t),
        }
    }

    /// Internal state for invariant tests: `(debt, capacity)` in internal units, where the
    /// level is `capacity − debt`. `debt` is never negative by construction; the invariant
    /// "never more than one capacity below zero" is `debt ≤ 2 × capacity`.
    #[doc(hidden)]
    pub fn debt_units(&self, now: Timestamp) -> (u128, u128) {
        let q = &self.quota;
        let t = q.units.units_at(now);
        (self.tat.max(t) - t, q.tolerance())
    }
}

impl Evictable for TokenBucket {
    fn is_idle(&self, now: Timestamp) -> bool {
        self.tat <= self.quota.units.units_at(now)
    }
    fn debt(&self, now: Timestamp) -> u128 {
        self.tat.saturating_sub(self.quota.units.units_at(now)) / self.quota.units.ucount as u128
    }
}

/// A reservation to settle with [`TokenLimiter::reconcile`]. Dropping it unsettled leaves the
/// estimate charged, which is the safe default.
#[derive(Debug)]
#[must_use = "reconcile the reservation with the actual token count"]
pub struct Reservation<K> {
    key: K,
    tokens: u64,
}

impl<K> Reservation<K> {
    /// The key charged.
    pub fn key(&self) -> &K {
        &self.key
    }
    /// Tokens reserved.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }
}

/// Per-key token buckets with a default quota, per-key overrides and bounded memory.
/// A key whose quota is `None` is not limited (its reservations are still returned, so the
/// caller's code path does not change).
#[derive(Debug, Clone)]
pub struct TokenLimiter<K> {
    default: Option<TokenQuota>,
    overrides: HashMap<K, Option<TokenQuota>>,
    states: BoundedMap<K, TokenBucket>,
}

impl<K: Hash + Eq + Clone> TokenLimiter<K> {
    /// Every key gets `default` unless overridden; at most `max_keys` keys are tracked.
    pub fn new(default: Option<TokenQuota>, max_keys: usize) -> Self {
        TokenLimiter {
            default,
            overrides: HashMap::new(),
            states: BoundedMap::new(max_keys),
        }
    }

    /// Sets `key`'s quota (`None`: unlimited). Never evicted.
    pub fn set_quota(&mut self, key: K, quota: Option<TokenQuota>) {
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
    pub fn quota_for(&self, key: &K) -> Option<TokenQuota> {
        match self.overrides.get(key) {
            Some(q) => *q,
            None => self.default,
        }
    }

    /// Reserves `estimate` tokens for `key` at `now`.
    pub fn reserve(
        &mut self,
        key: &K,
        estimate: u64,
        now: Timestamp,
    ) -> Result<Reservation<K>, Refused> {
        match self.states.get_mut(key) {
            Some(b) => b.reserve(estimate, now)?,
            None => {
                if let Some(q) = self.quota_for(key) {
                    let mut b = TokenBucket::new(q);
                    b.reserve(estimate, now)?;
                    self.states.insert_new(key, now, b);
                }
            }
        }
        Ok(Reservation {
            key: key.clone(),
            tokens: estimate,
        })
    }

    /// Settles `reservation` with the `actual` count. If the key was evicted meanwhile the
    /// refund is lost (a fresh bucket is already full) and a charge applies to a fresh bucket.
    pub fn reconcile(&mut self, reservation: Reservation<K>, actual: u64, now: Timestamp) {
        self.reconcile_raw(&reservation.key, reservation.tokens, actual, now);
    }

    pub(crate) fn reconcile_raw(&mut self, key: &K, reserved: u64, actual: u64, now: Timestamp) {
        if reserved == actual {
            return;
        }
        match self.states.get_mut(key) {
            Some(b) => b.reconcile(reserved, actual, now),
            None => {
                // Evicted meanwhile: a fresh bucket is full, so only a charge matters.
                if let (Some(q), true) = (self.quota_for(key), actual > reserved) {
                    let mut b = TokenBucket::new(q);
                    b.reconcile(reserved, actual, now);
                    self.states.insert_new(key, now, b);
                }
            }
        }
    }

    /// Tokens available to `key` now; `None` if unlimited.
    pub fn available(&self, key: &K, now: Timestamp) -> Option<u64> {
        self.info(key, now).map(|i| i.remaining)
    }

    /// Header figures for `key`; `None` if unlimited.
    pub fn info(&self, key: &K, now: Timestamp) -> Option<RateLimitInfo> {
        match self.states.get(key) {
            Some(b) => Some(b.info(now)),
            None => self.quota_for(key).map(|q| TokenBucket::new(q).info(now)),
        }
    }

    /// Drops state of keys whose buckets are full again; returns how many.
    pub fn evict_idle(&mut self, now: Timestamp) -> usize {
        self.states.evict_idle(now)
    }

    /// Keys currently tracked.
    pub fn tracked_keys(&self) -> usize {
        self.states.len()
    }

    /// Keys evicted so far.
    pub fn evictions(&self) -> u64 {
        self.states.evicted()
    }

    #[doc(hidden)]
    pub fn bucket(&self, key: &K) -> Option<&TokenBucket> {
        self.states.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_then_refund_and_charge() {
        let mut b = TokenBucket::new(TokenQuota::per_minute(6000)); // 100 tokens/s
        let t0 = Timestamp::from_nanos(1);
        b.reserve(1000, t0).unwrap();
        assert_eq!(b.available(t0), 5000);
        b.reconcile(1000, 200, t0);
        assert_eq!(b.available(t0), 5800);
        b.reconcile(100, 600, t0);
        assert_eq!(b.available(t0), 5300);
        // A huge charge empties the bucket and leaves a debt of at most one capacity.
        b.reconcile(0, 1_000_000, t0);
        assert_eq!(b.available(t0), 0);
        // Refill: 100 tokens per second pays the 6,000 of debt back first.
        let t1 = t0 + Duration::from_secs(60);
        assert_eq!(b.available(t1), 0);
        let t1 = t0 + Duration::from_secs(62);
        assert_eq!(b.available(t1), 200);
        // A refund never overfills.
        b.reconcile(1_000_000, 0, t1);
        assert_eq!(b.available(t1), 6000);
    }

    #[test]
    fn refusal_says_when() {
        let mut b = TokenBucket::new(TokenQuota::per_minute(6000));
        let t0 = Timestamp::from_nanos(0);
        b.reserve(6000, t0).unwrap();
        let e = b.reserve(50, t0).unwrap_err();
        assert_eq!(e.retry_after(), Some(Duration::from_millis(500)));
        assert!(b.reserve(50, t0 + Duration::from_millis(500)).is_ok());
        assert_eq!(
            b.reserve(6001, t0).unwrap_err(),
            Refused::TooLarge { capacity: 6000 }
        );
    }

    #[test]
    fn keyed_reserve_reconcile() {
        let mut l = TokenLimiter::new(Some(TokenQuota::per_minute(1000)), 10);
        let t = Timestamp::from_nanos(3);
        let r = l.reserve(&"a", 800, t).unwrap();
        assert!(l.reserve(&"a", 800, t).is_err());
        l.reconcile(r, 100, t);
        assert_eq!(l.available(&"a", t), Some(900));
        assert!(l.reserve(&"a", 800, t).is_ok());
        assert_eq!(l.available(&"b", t), Some(1000));
    }
}
