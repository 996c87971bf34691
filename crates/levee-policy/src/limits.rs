//! The limits every lane shares: the gateway-wide scope and each tenant's (requests per
//! minute, tokens per minute, requests outstanding, and the tenant's heavy-request rates).
//!
//! Lanes decide in parallel, each under its own lock, so this state synchronises itself, in
//! pieces small enough that two lanes rarely wait for each other: a scope's rates sit behind
//! a mutex held only for a peek or a take (tens of nanoseconds), its concurrency is an
//! atomic count, and a scope with no rate configured takes no lock at all. A configured
//! tenant's state is created once and handed out as an [`Arc`] the caller may keep (the
//! gateway keeps it with the tenant, so a decision does not even look the tenant up);
//! tenants without a configuration share a bounded map.
//!
//! Rates are checked twice: a *peek* before the lane's work (a request over quota is refused
//! before it costs a queue decision) and a *take* once the lane has decided to take it,
//! which peeks again and commits under the same locks (model, then tenant: one order
//! everywhere), so two lanes can never both spend the last of a quota. The global scope,
//! which every decision of every lane charges, is taken by each lane in small slices and
//! spent under the lane's own lock ([`crate::share`]).

use crate::clock::Timestamp;
use crate::concurrency::{ConcurrencyLimit, Permit};
use crate::fasthash::FastState;
use crate::gcra::{Gcra, Quota, RateLimitInfo};
use crate::keyed::{BoundedMap, Evictable};
use crate::refusal::{RefusalReason, Scope};
use crate::retry::RetryAfter;
use crate::tokens::{Refused, TokenBucket, TokenQuota};
use parking_lot::{Mutex, MutexGuard, RwLock};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Limits at one scope. `None` fields are unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LimitSpec {
    /// Requests per minute.
    pub requests_per_minute: Option<u64>,
    /// Requests allowed at once (default: `requests_per_minute`).
    pub request_burst: Option<u64>,
    /// LLM tokens per minute (prompt estimate + max_tokens, reconciled to actual).
    pub tokens_per_minute: Option<u64>,
    /// Token bucket capacity (default: `tokens_per_minute`); also the largest request.
    pub token_burst: Option<u64>,
    /// Outstanding requests (queued + in flight).
    pub max_concurrent: Option<usize>,
}

impl LimitSpec {
    /// No limits.
    pub const UNLIMITED: LimitSpec = LimitSpec {
        requests_per_minute: None,
        request_burst: None,
        tokens_per_minute: None,
        token_burst: None,
        max_concurrent: None,
    };

    /// The request quota, if any.
    pub fn request_quota(&self) -> Option<Quota> {
        self.requests_per_minute.map(|n| {
            let q = Quota::per_minute(n);
            match self.request_burst {
                Some(b) => q.with_burst(b),
                None => q,
            }
        })
    }

    /// The token quota, if any.
    pub fn token_quota(&self) -> Option<TokenQuota> {
        self.tokens_per_minute.map(|n| {
            let q = TokenQuota::per_minute(n);
            match self.token_burst {
                Some(b) => q.with_capacity(b),
                None => q,
            }
        })
    }
}

/// The heavy-request rule: a request whose prompt or completion budget passes a threshold
/// also passes its tenant's heavy limits (rates only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeavyRule {
    /// Prompt tokens above which a request is heavy (`u64::MAX`: never).
    pub prompt_tokens_over: u64,
    /// Completion tokens (effective `max_tokens` × choices) above which it is heavy.
    pub completion_tokens_over: u64,
    /// Each tenant's limits for its heavy requests.
    pub per_tenant: LimitSpec,
}

/// A tenant's limits and fairness weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantSpec {
    /// Limits.
    pub limits: LimitSpec,
    /// Weight in the fair queue and in the lanes' fair shares (≥ 1).
    pub weight: u32,
}

/// A refusal by a limit: why, and when a retry may pass (`None`: never as sent).
pub(crate) type LimitRefusal = (RefusalReason, Option<RetryAfter>);

/// The request and token rates of one scope.
#[derive(Debug, Default)]
pub(crate) struct Rates {
    rpm: Option<Gcra>,
    tpm: Option<TokenBucket>,
}

/// What a peek found room for: the new states to commit (`None`: not limited).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Peeked {
    rpm: Option<u128>,
    tpm: Option<u128>,
}

/// What a take charged: `(request rate, token rate)`.
pub(crate) type Charged = (bool, bool);

/// How much of a scope's rates a holder may keep for itself at once (see
/// [`Rates::take_share`]).
pub(crate) const SHARE_WINDOW: Duration = Duration::from_millis(1);

/// What [`Rates::take_share`] took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShareTaken {
    pub(crate) requests: Option<u64>,
    pub(crate) tokens: Option<u64>,
    pub(crate) slice: (u64, u64),
}

pub(crate) fn rate_retry(wait: Duration) -> Option<RetryAfter> {
    Some(RetryAfter::from_duration(
        wait.max(Duration::from_millis(1)),
    ))
}

impl Rates {
    fn new(spec: &LimitSpec) -> Self {
        Rates {
            rpm: spec.request_quota().map(Gcra::new),
            tpm: spec.token_quota().map(TokenBucket::new),
        }
    }

    fn is_limited(&self) -> bool {
        self.rpm.is_some() || self.tpm.is_some()
    }

    /// Changes the quotas in place, keeping debt.
    fn update(&mut self, spec: &LimitSpec) {
        match (spec.request_quota(), self.rpm.as_mut()) {
            (Some(q), Some(g)) => g.set_quota(q),
            (q, _) => self.rpm = q.map(Gcra::new),
        }
        match (spec.token_quota(), self.tpm.as_mut()) {
            (Some(q), Some(b)) => b.set_quota(q),
            (q, _) => self.tpm = q.map(TokenBucket::new),
        }
    }

    pub(crate) fn peek(
        &self,
        tokens: u64,
        now: Timestamp,
        scope: Scope,
    ) -> Result<Peeked, LimitRefusal> {
        self.peek_n(1, tokens, now, scope)
    }

    /// [`Rates::peek`] for `requests` requests of `tokens` tokens in all (0 of either: that
    /// rate is not charged).
    fn peek_n(
        &self,
        requests: u64,
        tokens: u64,
        now: Timestamp,
        scope: Scope,
    ) -> Result<Peeked, LimitRefusal> {
        let rpm = match &self.rpm {
            Some(g) if requests > 0 => Some(
                g.peek_n(requests, now)
                    .map_err(|e| (RefusalReason::RequestRate(scope), rate_retry(e.retry_after)))?,
            ),
            _ => None,
        };
        let tpm = match &self.tpm {
            Some(b) if tokens > 0 || requests > 0 => {
                Some(b.peek(tokens, now).map_err(|e| match e {
                    Refused::NotUntil { retry_after } => {
                        (RefusalReason::TokenRate(scope), rate_retry(retry_after))
                    }
                    Refused::TooLarge { .. } => (RefusalReason::TooLarge(scope), None),
                })?)
            }
            _ => None,
        };
        Ok(Peeked { rpm, tpm })
    }

    /// What a holder takes at once from these rates into its share ([`crate::share`]):
    /// [`SHARE_WINDOW`] of each rate, at most a quarter of its burst; 0 where that is under
    /// two (the rate is then shared exactly, one request at a time).
    fn slice(&self) -> (u64, u64) {
        let fit = |n: u64, burst: u64| {
            if n.min(burst / 4) < 2 {
                0
            } else {
                n.min(burst / 4)
            }
        };
        (
            self.rpm
                .as_ref()
                .map_or(0, |g| fit(g.per(SHARE_WINDOW), g.quota().burst())),
            self.tpm
                .as_ref()
                .map_or(0, |b| fit(b.per(SHARE_WINDOW), b.quota().capacity())),
        )
    }

    /// Takes at least `requests` requests and `tokens` tokens, a slice of each when there is
    /// room for it: what was taken of each rate (`None`: that rate is not limited) and the
    /// slice sizes. Refused only when the need itself does not fit, with that refusal.
    pub(crate) fn take_share(
        &mut self,
        requests: u64,
        tokens: u64,
        now: Timestamp,
        scope: Scope,
    ) -> Result<ShareTaken, LimitRefusal> {
        let slice = self.slice();
        let want = |need: u64, slice: u64| if need > 0 { need.max(slice) } else { 0 };
        let wanted = (want(requests, slice.0), want(tokens, slice.1));
        let (taken, peeked) = match self.peek_n(wanted.0, wanted.1, now, scope) {
            Ok(p) => (wanted, p),
            Err(e) if wanted == (requests, tokens) => return Err(e),
            Err(_) => (
                (requests, tokens),
                self.peek_n(requests, tokens, now, scope)?,
            ),
        };
        self.commit(peeked);
        Ok(ShareTaken {
            requests: self.rpm.as_ref().map(|_| taken.0),
            tokens: self.tpm.as_ref().map(|_| taken.1),
            slice,
        })
    }

    /// Gives back what a share held unspent.
    pub(crate) fn give_back(&mut self, requests: u64, tokens: u64, now: Timestamp) {
        if let (Some(g), true) = (self.rpm.as_mut(), requests > 0) {
            g.refund_n(requests, now);
        }
        if let (Some(b), true) = (self.tpm.as_mut(), tokens > 0) {
            b.reconcile(tokens, 0, now);
        }
    }

    pub(crate) fn commit(&mut self, p: Peeked) -> Charged {
        if let (Some(g), Some(t)) = (self.rpm.as_mut(), p.rpm) {
            g.commit(t);
        }
        if let (Some(b), Some(t)) = (self.tpm.as_mut(), p.tpm) {
            b.commit(t);
        }
        (p.rpm.is_some(), p.tpm.is_some())
    }

    /// Settles one request's charges: a refund of its request (`refund_request`), and its
    /// token reservation reconciled to `actual`.
    pub(crate) fn settle(
        &mut self,
        (rated, charged): Charged,
        refund_request: bool,
        reserved: u64,
        actual: u64,
        now: Timestamp,
    ) {
        if charged && reserved != actual {
            if let Some(b) = self.tpm.as_mut() {
                b.reconcile(reserved, actual, now);
            }
        }
        if rated && refund_request {
            if let Some(g) = self.rpm.as_mut() {
                g.refund(now);
            }
        }
    }

    fn info(&self, now: Timestamp) -> (Option<RateLimitInfo>, Option<RateLimitInfo>) {
        (
            self.rpm.as_ref().map(|g| g.info(now)),
            self.tpm.as_ref().map(|b| b.info(now)),
        )
    }

    fn is_idle(&self, now: Timestamp) -> bool {
        self.rpm.as_ref().is_none_or(|g| g.is_idle(now))
            && self.tpm.as_ref().is_none_or(|b| b.is_idle(now))
    }

    fn debt(&self, now: Timestamp) -> u128 {
        let a = self.rpm.as_ref().map_or(0, |g| g.debt(now));
        let b = self.tpm.as_ref().map_or(0, |t| t.debt(now));
        a.max(b)
    }
}

/// The limits of one scope, shared by every lane: its rates behind a mutex that only a
/// limited scope takes, and its concurrency as an atomic count.
#[derive(Debug)]
pub(crate) struct ScopeLimits {
    rates: Mutex<Rates>,
    rated: AtomicBool,
    concurrency: ConcurrencyLimit,
    bounded: AtomicBool,
    /// Counts changes of the limits, so that shares taken under old ones are given back.
    generation: AtomicU64,
}

impl ScopeLimits {
    pub(crate) fn new(spec: &LimitSpec) -> Self {
        let rates = Rates::new(spec);
        ScopeLimits {
            rated: AtomicBool::new(rates.is_limited()),
            rates: Mutex::new(rates),
            concurrency: ConcurrencyLimit::new(spec.max_concurrent.unwrap_or(usize::MAX)),
            bounded: AtomicBool::new(spec.max_concurrent.is_some()),
            generation: AtomicU64::new(0),
        }
    }

    /// Changes the limits in place, keeping debt and the permits out.
    pub(crate) fn update(&self, spec: &LimitSpec) {
        let mut r = self.rates.lock();
        r.update(spec);
        self.rated.store(r.is_limited(), Ordering::Release);
        self.concurrency
            .set_limit(spec.max_concurrent.unwrap_or(usize::MAX));
        self.bounded
            .store(spec.max_concurrent.is_some(), Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// How many times the limits changed.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether the scope has a rate.
    pub(crate) fn is_rated(&self) -> bool {
        self.rated.load(Ordering::Acquire)
    }

    /// Its concurrency limit, when it bounds requests outstanding.
    pub(crate) fn bounded_concurrency(&self) -> Option<&ConcurrencyLimit> {
        self.bounded
            .load(Ordering::Acquire)
            .then_some(&self.concurrency)
    }

    /// The scope's rates, locked; `None` when it has none (no lock taken).
    pub(crate) fn rates(&self) -> Option<MutexGuard<'_, Rates>> {
        self.rated
            .load(Ordering::Acquire)
            .then(|| self.rates.lock())
    }

    /// Checks the rates without charging.
    pub(crate) fn peek(
        &self,
        tokens: u64,
        now: Timestamp,
        scope: Scope,
    ) -> Result<(), LimitRefusal> {
        match self.rates() {
            Some(r) => r.peek(tokens, now, scope).map(|_| ()),
            None => Ok(()),
        }
    }

    /// A permit for one outstanding request; `None` when the scope does not bound them. A
    /// refusal is this scope's concurrency (the caller knows when a permit frees).
    pub(crate) fn acquire(&self, scope: Scope) -> Result<Option<Permit>, RefusalReason> {
        if !self.bounded.load(Ordering::Acquire) {
            return Ok(None);
        }
        self.concurrency
            .try_acquire()
            .map(Some)
            .map_err(|_| RefusalReason::Concurrency(scope))
    }

    /// Settles one request's charges (see [`Rates::settle`]).
    pub(crate) fn settle(
        &self,
        charged: Charged,
        refund_request: bool,
        reserved: u64,
        actual: u64,
        now: Timestamp,
    ) {
        if charged != (false, false) {
            self.rates
                .lock()
                .settle(charged, refund_request, reserved, actual, now);
        }
    }

    fn figures(&self, now: Timestamp) -> (Option<RateLimitInfo>, Option<RateLimitInfo>) {
        self.rates.lock().info(now)
    }

    fn concurrency_figures(&self) -> Option<(usize, usize)> {
        self.bounded
            .load(Ordering::Acquire)
            .then(|| (self.concurrency.in_use(), self.concurrency.limit()))
    }

    fn is_idle(&self, now: Timestamp) -> bool {
        self.rates.lock().is_idle(now)
    }

    fn debt(&self, now: Timestamp) -> u128 {
        self.rates.lock().debt(now)
    }
}

/// One tenant's limits and fairness weight, shared by every lane. Keep the `Arc` from
/// [`SharedLimits::tenant`] to decide without looking the tenant up again.
#[derive(Debug)]
pub struct TenantLimits {
    pub(crate) limits: ScopeLimits,
    pub(crate) heavy: ScopeLimits,
    weight: AtomicU32,
}

impl TenantLimits {
    fn new(limits: &LimitSpec, heavy: &LimitSpec, weight: u32) -> Self {
        TenantLimits {
            limits: ScopeLimits::new(limits),
            heavy: ScopeLimits::new(heavy),
            weight: AtomicU32::new(weight.max(1)),
        }
    }

    /// Its weight in the fair queue and the lanes' fair shares.
    pub fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }
}

impl Evictable for Arc<TenantLimits> {
    fn is_idle(&self, now: Timestamp) -> bool {
        self.limits.is_idle(now) && self.heavy.is_idle(now)
    }
    fn debt(&self, now: Timestamp) -> u128 {
        self.limits.debt(now).max(self.heavy.debt(now))
    }
    fn pinned(&self) -> bool {
        // Live grants point at this state; a fresh one would let the tenant exceed it.
        Arc::strong_count(self) > 1
    }
}

/// The settings of the shared limits.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LimitsConfig {
    pub global: LimitSpec,
    pub tenant_default: LimitSpec,
    pub heavy: Option<HeavyRule>,
    pub max_tracked_keys: usize,
}

impl LimitsConfig {
    fn heavy_spec(&self) -> LimitSpec {
        self.heavy
            .map(|h| h.per_tenant)
            .unwrap_or(LimitSpec::UNLIMITED)
    }
}

#[derive(Debug)]
struct Tenants<K> {
    /// Tenants given limits with [`SharedLimits::set_tenant`]: kept for good.
    configured: HashMap<K, (TenantSpec, Arc<TenantLimits>), FastState>,
    /// Every other tenant, on the default limits, in a bounded map.
    others: BoundedMap<K, Arc<TenantLimits>, FastState>,
}

/// A value on cache lines of its own (128 bytes: two lines, as adjacent-line prefetchers
/// fetch them in pairs), so that what other threads write next to it never takes its line
/// away from the threads that read or write it.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The heavy rule's thresholds, read by every decision without a lock: a sequence lock over
/// two atomics, so that readers only ever load (their cache line stays shared by every
/// core) and still see both thresholds of one configuration.
#[derive(Debug, Default)]
struct HeavyThresholds {
    /// Odd while a reconfiguration writes.
    seq: AtomicU64,
    prompt_over: AtomicU64,
    completion_over: AtomicU64,
}

impl HeavyThresholds {
    fn of(heavy: Option<HeavyRule>) -> (u64, u64) {
        // Without the rule nothing is over `u64::MAX`.
        heavy.map_or((u64::MAX, u64::MAX), |h| {
            (h.prompt_tokens_over, h.completion_tokens_over)
        })
    }

    /// Writes new thresholds; one writer at a time (the caller holds the config's lock).
    fn set(&self, heavy: Option<HeavyRule>) {
        let (prompt, completion) = Self::of(heavy);
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.prompt_over.store(prompt, Ordering::Relaxed);
        self.completion_over.store(completion, Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    fn get(&self) -> (u64, u64) {
        loop {
            let before = self.seq.load(Ordering::Acquire);
            let prompt = self.prompt_over.load(Ordering::Relaxed);
            let completion = self.completion_over.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if before.is_multiple_of(2) && self.seq.load(Ordering::Relaxed) == before {
                return (prompt, completion);
            }
            std::hint::spin_loop();
        }
    }
}

/// The limits shared by every lane of one gateway: global and per tenant.
///
/// What every decision touches is on cache lines of its own: the global scope (written by
/// every decision) and the heavy rule's thresholds (only read), apart from each other and
/// from the configuration and tenant map locks.
#[derive(Debug)]
pub struct SharedLimits<K> {
    cfg: RwLock<LimitsConfig>,
    heavy: Padded<HeavyThresholds>,
    pub(crate) global: Padded<ScopeLimits>,
    tenants: RwLock<Tenants<K>>,
}

impl<K: Hash + Eq + Clone> SharedLimits<K> {
    pub(crate) fn new(cfg: LimitsConfig) -> Self {
        let heavy = Padded(HeavyThresholds::default());
        heavy.set(cfg.heavy);
        SharedLimits {
            global: Padded(ScopeLimits::new(&cfg.global)),
            heavy,
            tenants: RwLock::new(Tenants {
                configured: HashMap::default(),
                others: BoundedMap::new(cfg.max_tracked_keys),
            }),
            cfg: RwLock::new(cfg),
        }
    }

    /// Applies new settings, keeping limiter state (debt) and permits out.
    pub(crate) fn reconfigure(&self, cfg: LimitsConfig) {
        let old = self.cfg.read().clone();
        if cfg.global != old.global {
            self.global.update(&cfg.global);
        }
        if cfg.heavy != old.heavy || cfg.tenant_default != old.tenant_default {
            let heavy = cfg.heavy_spec();
            let t = self.tenants.read();
            for (_, st) in t.configured.values() {
                st.heavy.update(&heavy);
            }
            // Default-limit tenants start over on the new limits.
            drop(t);
            let mut t = self.tenants.write();
            t.others = BoundedMap::new(cfg.max_tracked_keys);
        }
        let mut current = self.cfg.write();
        self.heavy.set(cfg.heavy);
        *current = cfg;
    }

    /// Configures a tenant's limits and weight. Debt already accrued is kept; a changed
    /// concurrency limit applies to new permits.
    pub fn set_tenant(&self, tenant: K, spec: TenantSpec) -> Arc<TenantLimits> {
        let heavy = self.cfg.read().heavy_spec();
        let mut t = self.tenants.write();
        if let Some((old, st)) = t.configured.get_mut(&tenant) {
            st.limits.update(&spec.limits);
            st.weight.store(spec.weight.max(1), Ordering::Relaxed);
            *old = spec;
            return st.clone();
        }
        let st = match t.others.remove(&tenant) {
            Some(st) => {
                st.limits.update(&spec.limits);
                st.weight.store(spec.weight.max(1), Ordering::Relaxed);
                st
            }
            None => Arc::new(TenantLimits::new(&spec.limits, &heavy, spec.weight)),
        };
        t.configured.insert(tenant, (spec, st.clone()));
        st
    }

    /// The tenant's limits: its configured ones, or (created on first use) the default.
    pub fn tenant(&self, tenant: &K, now: Timestamp) -> Arc<TenantLimits> {
        {
            let t = self.tenants.read();
            if let Some((_, st)) = t.configured.get(tenant) {
                return st.clone();
            }
            if let Some(st) = t.others.get(tenant) {
                return st.clone();
            }
        }
        let cfg = self.cfg.read().clone();
        let mut t = self.tenants.write();
        let fresh = Arc::new(TenantLimits::new(&cfg.tenant_default, &cfg.heavy_spec(), 1));
        t.others.insert_new(tenant, now, fresh).clone()
    }

    /// The tenant's `x-ratelimit-*` figures at `now` (its configured or default limits when
    /// it has no state yet).
    pub fn rate_limit_headers(&self, tenant: &K, now: Timestamp) -> RateLimitHeaders {
        let st = {
            let t = self.tenants.read();
            t.configured
                .get(tenant)
                .map(|(_, st)| st.clone())
                .or_else(|| t.others.get(tenant).cloned())
        };
        match st {
            Some(st) => scope_headers(&st.limits, now),
            None => scope_headers(&ScopeLimits::new(&self.cfg.read().tenant_default), now),
        }
    }

    /// Global figures (`requests`, `tokens`, `concurrency`).
    pub fn global_headers(&self, now: Timestamp) -> RateLimitHeaders {
        scope_headers(&self.global, now)
    }

    /// Tenants with limiter state (configured ones included).
    pub fn tracked_tenants(&self) -> usize {
        let t = self.tenants.read();
        t.configured.len() + t.others.len()
    }

    /// Drops the state of idle tenants without a configuration (optional housekeeping; the
    /// cap holds anyway).
    pub fn evict_idle(&self, now: Timestamp) -> usize {
        self.tenants.write().others.evict_idle(now)
    }

    /// The heavy-request rule.
    pub(crate) fn heavy_applies(&self, prompt: u64, completion: u64) -> bool {
        let (prompt_over, completion_over) = self.heavy.get();
        prompt > prompt_over || completion > completion_over
    }
}

fn scope_headers(s: &ScopeLimits, now: Timestamp) -> RateLimitHeaders {
    let (requests, tokens) = s.figures(now);
    RateLimitHeaders {
        requests,
        tokens,
        concurrency: s.concurrency_figures(),
    }
}

/// Rate-limit figures for the `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateLimitHeaders {
    /// The `-requests` trio (tenant scope), if limited.
    pub requests: Option<RateLimitInfo>,
    /// The `-tokens` trio (tenant scope), if limited.
    pub tokens: Option<RateLimitInfo>,
    /// Outstanding requests and the limit, if limited.
    pub concurrency: Option<(usize, usize)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(heavy: Option<(u64, u64)>) -> LimitsConfig {
        LimitsConfig {
            global: LimitSpec::UNLIMITED,
            tenant_default: LimitSpec::UNLIMITED,
            heavy: heavy.map(|(p, c)| HeavyRule {
                prompt_tokens_over: p,
                completion_tokens_over: c,
                per_tenant: LimitSpec::UNLIMITED,
            }),
            max_tracked_keys: 16,
        }
    }

    #[test]
    fn the_heavy_rule_follows_reconfiguration() {
        let s: SharedLimits<u64> = SharedLimits::new(config(None));
        assert!(
            !s.heavy_applies(u64::MAX, u64::MAX),
            "no rule: nothing is heavy"
        );
        s.reconfigure(config(Some((100, 50))));
        assert!(!s.heavy_applies(100, 50), "at the thresholds: not over");
        assert!(s.heavy_applies(101, 0));
        assert!(s.heavy_applies(0, 51));
        s.reconfigure(config(Some((1_000, 500))));
        assert!(!s.heavy_applies(101, 51));
        assert!(s.heavy_applies(1_001, 0));
        s.reconfigure(config(None));
        assert!(!s.heavy_applies(u64::MAX, u64::MAX));
    }

    #[test]
    fn a_decision_racing_a_reconfiguration_sees_one_rule_whole() {
        // Two rules whose thresholds, mixed, would give a pair neither has.
        let (a, b) = ((10, 20), (30, 40));
        let s: SharedLimits<u64> = SharedLimits::new(config(Some(a)));
        std::thread::scope(|sc| {
            let s = &s;
            sc.spawn(move || {
                for i in 0..20_000 {
                    s.reconfigure(config(Some(if i % 2 == 0 { b } else { a })));
                }
            });
            for _ in 0..200_000 {
                let seen = s.heavy.get();
                assert!(seen == a || seen == b, "{seen:?}");
            }
        });
    }
}
