//! The admission pipeline for one request: limits (global, model, tenant; requests/min,
//! tokens/min, concurrency; the heavy-request rule), then the watermark decision, then
//! dispatch or enqueue; and [`Admission::dequeue`] when a dispatch slot frees.
//!
//! Checks run before anything is charged, so a refused request costs the tenant nothing: the
//! rate limiters are peeked, the watermark and queue room are checked, and only then are the
//! limiters committed. Concurrency permits are RAII and live in the [`Grant`]: dropping the
//! grant (or passing it to [`Admission::complete`]) releases them.
//!
//! Tenant and model concurrency count *outstanding* requests (queued + in flight), so one
//! tenant cannot fill the queue. The dispatch limit (`max_in_flight`) counts in-flight only.

use crate::clock::Timestamp;
use crate::concurrency::{ConcurrencyLimit, Permit};
use crate::degrade::LoadSignals;
use crate::fasthash::FastState;
use crate::gcra::{Gcra, Quota, RateLimitInfo};
use crate::keyed::{BoundedMap, Evictable};
use crate::queue::{Entry, FairQueue, PushRefusal, QueueLimits, QueueStats, Ticket, Tier};
use crate::retry::{DrainRate, RetryAfter, RetryBounds};
use crate::tokens::{Refused, TokenBucket, TokenQuota};
use crate::watermark::{
    ConfigError, LoadZone, WaitBudget, WatermarkAction, WatermarkDecision, Watermarks,
};
use std::collections::HashMap;
use std::hash::Hash;
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

/// A tenant's limits and fairness weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantSpec {
    /// Limits.
    pub limits: LimitSpec,
    /// Weight in the fair queue (≥ 1).
    pub weight: u32,
}

/// Requests whose estimate is at least `min_tokens` are "heavy": at most `max_concurrent` of
/// them may be outstanding at once, across all tenants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeavyRule {
    /// Threshold in estimated tokens.
    pub min_tokens: u64,
    /// Outstanding heavy requests allowed.
    pub max_concurrent: usize,
}

/// Settings for [`Admission`].
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    /// Limits across all traffic (its `max_concurrent` bounds outstanding requests).
    pub global: LimitSpec,
    /// Limits for a tenant not configured with [`Admission::set_tenant`].
    pub tenant_default: LimitSpec,
    /// The heavy-request rule.
    pub heavy: Option<HeavyRule>,
    /// Requests dispatched to backends at once (the dispatch slots).
    pub max_in_flight: usize,
    /// Watermarks over `queued + in flight`.
    pub watermarks: Watermarks,
    /// Wait budgets per tier; the number of tiers is `tiers.len()` (tier 0 first).
    pub tiers: Vec<WaitBudget>,
    /// Queue bound in entries.
    pub queue_max_len: usize,
    /// Queue bound in tokens.
    pub queue_max_tokens: u64,
    /// Per-key limiter state kept at most (tenants).
    pub max_tracked_keys: usize,
    /// Time constant of the dispatch-rate average used for Retry-After.
    pub drain_time_constant: Duration,
    /// Bounds on capacity Retry-After estimates.
    pub retry: RetryBounds,
}

impl AdmissionConfig {
    /// A small working configuration: `max_in_flight` slots, watermarks at 1×/2×/4× of it,
    /// three tiers, no rate limits.
    pub fn with_capacity(max_in_flight: usize) -> Self {
        let c = max_in_flight.max(1) as u64;
        AdmissionConfig {
            global: LimitSpec::UNLIMITED,
            tenant_default: LimitSpec::UNLIMITED,
            heavy: None,
            max_in_flight: max_in_flight.max(1),
            watermarks: Watermarks {
                safe: c,
                soft: 2 * c,
                hard: 4 * c,
            },
            tiers: vec![
                WaitBudget {
                    normal: Duration::from_secs(30),
                    soft: Duration::from_secs(10),
                },
                WaitBudget {
                    normal: Duration::from_secs(15),
                    soft: Duration::from_secs(3),
                },
                WaitBudget {
                    normal: Duration::from_secs(5),
                    soft: Duration::ZERO,
                },
            ],
            queue_max_len: 3 * max_in_flight.max(1),
            queue_max_tokens: u64::MAX,
            max_tracked_keys: 100_000,
            drain_time_constant: Duration::from_secs(5),
            retry: RetryBounds::default(),
        }
    }

    /// Checks the settings; each message names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let w = self.watermarks;
        Watermarks::new(w.safe, w.soft, w.hard)?;
        if self.tiers.is_empty() || self.tiers.len() > 255 {
            return Err(ConfigError("tiers: need between 1 and 255 tiers".into()));
        }
        if self.max_in_flight == 0 {
            return Err(ConfigError("max_in_flight: must be > 0".into()));
        }
        if self.retry.min > self.retry.max {
            return Err(ConfigError("retry: min must be <= max".into()));
        }
        Ok(())
    }
}

/// The scope a limit belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// All traffic.
    Global,
    /// One model.
    Model,
    /// One tenant.
    Tenant,
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalReason {
    /// Requests-per-minute limit.
    RequestRate(Scope),
    /// Tokens-per-minute limit.
    TokenRate(Scope),
    /// The estimate exceeds a token bucket's capacity: it can never pass as sent.
    TooLarge(Scope),
    /// Outstanding-request limit.
    Concurrency(Scope),
    /// Too many heavy requests outstanding.
    HeavyRequests,
    /// The degradation plan sheds this tier.
    Shed,
    /// Load watermark: at `hard`, or in a zone where the tier may not wait.
    Watermark(LoadZone),
    /// The queue is full.
    QueueFull(PushRefusal),
}

impl RefusalReason {
    /// The OpenAI-shaped error code: `rate_limit_exceeded` for a quota of the tenant (or a
    /// global/model rate), `capacity_overload` for load.
    pub fn code(&self) -> &'static str {
        match self {
            RefusalReason::RequestRate(_)
            | RefusalReason::TokenRate(_)
            | RefusalReason::TooLarge(_)
            | RefusalReason::Concurrency(Scope::Tenant) => "rate_limit_exceeded",
            RefusalReason::Concurrency(_)
            | RefusalReason::HeavyRequests
            | RefusalReason::Shed
            | RefusalReason::Watermark(_)
            | RefusalReason::QueueFull(_) => "capacity_overload",
        }
    }

    /// A short stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            RefusalReason::RequestRate(Scope::Global) => "global_requests",
            RefusalReason::RequestRate(Scope::Model) => "model_requests",
            RefusalReason::RequestRate(Scope::Tenant) => "tenant_requests",
            RefusalReason::TokenRate(Scope::Global) => "global_tokens",
            RefusalReason::TokenRate(Scope::Model) => "model_tokens",
            RefusalReason::TokenRate(Scope::Tenant) => "tenant_tokens",
            RefusalReason::TooLarge(_) => "too_large",
            RefusalReason::Concurrency(Scope::Global) => "global_concurrency",
            RefusalReason::Concurrency(Scope::Model) => "model_concurrency",
            RefusalReason::Concurrency(Scope::Tenant) => "tenant_concurrency",
            RefusalReason::HeavyRequests => "heavy_requests",
            RefusalReason::Shed => "shed",
            RefusalReason::Watermark(LoadZone::AtHard) => "hard_watermark",
            RefusalReason::Watermark(_) => "soft_watermark",
            RefusalReason::QueueFull(p) => p.as_str(),
        }
    }

    /// False when retrying the same request cannot help ([`RefusalReason::TooLarge`]).
    pub fn is_retryable(&self) -> bool {
        !matches!(self, RefusalReason::TooLarge(_))
    }
}

/// One request to admit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionRequest<K> {
    /// The tenant (from the API key, never from a client header).
    pub tenant: K,
    /// The model asked for (after any degradation reroute).
    pub model: K,
    /// The tenant's tier.
    pub tier: Tier,
    /// Prompt estimate + max_tokens.
    pub estimated_tokens: u64,
    /// The client's own limit on queueing, if shorter than the tier budget.
    pub max_wait: Option<Duration>,
}

/// What one admitted request holds until it completes: its reservations and permits.
/// Pass it to [`Admission::complete`] with the actual token count; dropping it instead releases
/// the permits and leaves the estimate charged.
#[derive(Debug)]
#[must_use = "pass the grant to Admission::complete when the request ends"]
pub struct Grant<K> {
    tenant: K,
    model: K,
    tier: Tier,
    estimated_tokens: u64,
    charged_global: bool,
    charged_model: bool,
    charged_tenant: bool,
    admitted_at: Timestamp,
    _tenant_permit: Option<Permit>,
    _model_permit: Option<Permit>,
    _heavy_permit: Option<Permit>,
    _global_permit: Option<Permit>,
    dispatch_permit: Option<Permit>,
}

impl<K> Grant<K> {
    /// The tenant.
    pub fn tenant(&self) -> &K {
        &self.tenant
    }
    /// The model.
    pub fn model(&self) -> &K {
        &self.model
    }
    /// The tier.
    pub fn tier(&self) -> Tier {
        self.tier
    }
    /// Tokens reserved.
    pub fn estimated_tokens(&self) -> u64 {
        self.estimated_tokens
    }
    /// When it was admitted.
    pub fn admitted_at(&self) -> Timestamp {
        self.admitted_at
    }
    /// True once it holds a dispatch slot (it came out of `admit` or `dequeue` as
    /// [`Dispatched`]).
    pub fn is_dispatched(&self) -> bool {
        self.dispatch_permit.is_some()
    }
}

/// A request to send to a backend now.
#[derive(Debug)]
pub struct Dispatched<T, K> {
    /// The caller's payload.
    pub item: T,
    /// Reservations and permits (including the dispatch slot).
    pub grant: Grant<K>,
    /// Time spent queued (zero if dispatched at once).
    pub waited: Duration,
}

/// A refused request.
#[derive(Debug)]
pub struct Refusal<T> {
    /// The caller's payload, back.
    pub item: T,
    /// Why.
    pub reason: RefusalReason,
    /// When to retry; `None` if retrying cannot help.
    pub retry_after: Option<RetryAfter>,
}

/// The admission decision.
#[derive(Debug)]
pub enum Admit<T, K> {
    /// Send it now.
    Dispatch(Dispatched<T, K>),
    /// Queued; it comes out of [`Admission::dequeue`], [`Admission::expire`] or
    /// [`Admission::cancel`].
    Queued {
        /// For cancelling.
        ticket: Ticket,
        /// The watermark decision (zone, budget, expected wait).
        decision: WatermarkDecision,
        /// When it expires.
        deadline: Timestamp,
    },
    /// Refused.
    Refused(Refusal<T>),
}

/// A queued request that waited past its deadline: answer `queue_timeout`.
#[derive(Debug)]
pub struct Expired<T> {
    /// The caller's payload.
    pub item: T,
    /// Its tier.
    pub tier: Tier,
    /// How long it waited.
    pub waited: Duration,
    /// Suggested Retry-After from the current backlog and drain rate.
    pub retry_after: RetryAfter,
}

/// Rate-limit figures for the `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateLimitHeaders {
    /// The `-requests` trio (tenant scope), if limited.
    pub requests: Option<RateLimitInfo>,
    /// The `-tokens` trio (tenant scope), if limited.
    pub tokens: Option<RateLimitInfo>,
}

/// Figures for metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionStats {
    /// Queue depth and tokens, per tier.
    pub queue: QueueStats,
    /// Requests in flight (holding a dispatch slot).
    pub in_flight: usize,
    /// Dispatch slots.
    pub max_in_flight: usize,
    /// The watermark load (queued + in flight).
    pub load: u64,
    /// Its zone.
    pub zone: LoadZone,
    /// Measured dispatches per second.
    pub dispatch_rate: f64,
    /// Tenants with limiter state.
    pub tracked_tenants: usize,
}

#[derive(Debug)]
struct ModelLimits {
    rpm: Option<Gcra>,
    tpm: Option<TokenBucket>,
    concurrency: Option<ConcurrencyLimit>,
}

/// Everything kept per tenant, in one map entry so a decision hashes the tenant once.
#[derive(Debug)]
struct TenantState {
    rpm: Option<Gcra>,
    tpm: Option<TokenBucket>,
    concurrency: Option<ConcurrencyLimit>,
}

impl TenantState {
    fn new(spec: &LimitSpec) -> Self {
        TenantState {
            rpm: spec.request_quota().map(Gcra::new),
            tpm: spec.token_quota().map(TokenBucket::new),
            concurrency: spec.max_concurrent.map(ConcurrencyLimit::new),
        }
    }
}

impl Evictable for TenantState {
    fn is_idle(&self, now: Timestamp) -> bool {
        self.rpm.as_ref().is_none_or(|g| g.is_idle(now))
            && self.tpm.as_ref().is_none_or(|b| b.is_idle(now))
    }
    fn debt(&self, now: Timestamp) -> u128 {
        let a = self.rpm.as_ref().map_or(0, |g| g.debt(now));
        let b = self.tpm.as_ref().map_or(0, |t| t.debt(now));
        a.max(b)
    }
    fn pinned(&self) -> bool {
        // Live permits point at this limit; a fresh one would let the tenant exceed it.
        self.concurrency.as_ref().is_some_and(|c| c.in_use() > 0)
    }
}

#[derive(Debug)]
struct Pending<T, K> {
    item: T,
    grant: Grant<K>,
}

/// The admission state for one gateway. `&mut self`: hold it behind one lock. Permits inside
/// grants are atomics and may be dropped anywhere.
///
/// Tenant and model maps use a fast seeded hash (keys are authenticated identities, not
/// client-chosen strings); per-tenant state is bounded by `max_tracked_keys`.
#[derive(Debug)]
pub struct Admission<T, K> {
    cfg: AdmissionConfig,
    global_rpm: Option<Gcra>,
    global_tpm: Option<TokenBucket>,
    global_concurrency: Option<ConcurrencyLimit>,
    models: HashMap<K, ModelLimits, FastState>,
    tenant_specs: HashMap<K, LimitSpec, FastState>,
    tenants: BoundedMap<K, TenantState, FastState>,
    heavy: Option<(u64, ConcurrencyLimit)>,
    dispatch: ConcurrencyLimit,
    queue: FairQueue<Pending<T, K>, K>,
    drain: DrainRate,
    shed_from: Option<Tier>,
    expired: Vec<Entry<Pending<T, K>, K>>,
}

fn refused<T, K>(item: T, reason: RefusalReason, retry_after: Option<RetryAfter>) -> Admit<T, K> {
    Admit::Refused(Refusal {
        item,
        reason,
        retry_after,
    })
}

fn rate_retry(wait: Duration) -> Option<RetryAfter> {
    Some(RetryAfter::from_duration(
        wait.max(Duration::from_millis(1)),
    ))
}

fn token_refusal(scope: Scope, r: Refused) -> (RefusalReason, Option<RetryAfter>) {
    match r {
        Refused::NotUntil { retry_after } => {
            (RefusalReason::TokenRate(scope), rate_retry(retry_after))
        }
        Refused::TooLarge { .. } => (RefusalReason::TooLarge(scope), None),
    }
}

/// Peeks an optional limiter; `Err` carries the refusal.
macro_rules! peek_rate {
    ($lim:expr, $now:expr, $scope:expr) => {
        match $lim.map(|g| g.peek($now)) {
            None => Ok(None),
            Some(Ok(t)) => Ok(Some(t)),
            Some(Err(e)) => Err((
                RefusalReason::RequestRate($scope),
                rate_retry(e.retry_after),
            )),
        }
    };
}

macro_rules! peek_tokens {
    ($lim:expr, $est:expr, $now:expr, $scope:expr) => {
        match $lim.map(|b| b.peek($est, $now)) {
            None => Ok(None),
            Some(Ok(t)) => Ok(Some(t)),
            Some(Err(e)) => Err(token_refusal($scope, e)),
        }
    };
}

impl<T, K: Hash + Eq + Ord + Clone> Admission<T, K> {
    /// Builds the admission state. Call [`AdmissionConfig::validate`] first to report bad
    /// settings; here they are clamped.
    pub fn new(cfg: AdmissionConfig) -> Self {
        let tiers = cfg.tiers.len().clamp(1, 255) as u8;
        Admission {
            global_rpm: cfg.global.request_quota().map(Gcra::new),
            global_tpm: cfg.global.token_quota().map(TokenBucket::new),
            global_concurrency: cfg.global.max_concurrent.map(ConcurrencyLimit::new),
            models: HashMap::default(),
            tenant_specs: HashMap::default(),
            tenants: BoundedMap::new(cfg.max_tracked_keys),
            heavy: cfg
                .heavy
                .map(|h| (h.min_tokens, ConcurrencyLimit::new(h.max_concurrent))),
            dispatch: ConcurrencyLimit::new(cfg.max_in_flight.max(1)),
            queue: FairQueue::new(QueueLimits {
                tiers,
                max_len: cfg.queue_max_len,
                max_tokens: cfg.queue_max_tokens,
            }),
            drain: DrainRate::new(cfg.drain_time_constant),
            shed_from: None,
            expired: Vec::new(),
            cfg,
        }
    }

    /// The settings.
    pub fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    /// Configures a tenant's limits and weight (replacing the default for it). Debt already
    /// accrued is kept; a changed concurrency limit applies to new permits.
    pub fn set_tenant(&mut self, tenant: K, spec: TenantSpec) {
        let l = spec.limits;
        if let Some(st) = self.tenants.get_mut(&tenant) {
            match (l.request_quota(), st.rpm.as_mut()) {
                (Some(q), Some(g)) => g.set_quota(q),
                (q, _) => st.rpm = q.map(Gcra::new),
            }
            match (l.token_quota(), st.tpm.as_mut()) {
                (Some(q), Some(b)) => b.set_quota(q),
                (q, _) => st.tpm = q.map(TokenBucket::new),
            }
            match (l.max_concurrent, st.concurrency.as_ref()) {
                (Some(n), Some(c)) => c.set_limit(n),
                (n, _) => st.concurrency = n.map(ConcurrencyLimit::new),
            }
        }
        self.tenant_specs.insert(tenant.clone(), l);
        self.queue.set_weight(tenant, spec.weight);
    }

    /// Configures a model's limits (models without limits are not limited per model).
    pub fn set_model_limits(&mut self, model: K, limits: LimitSpec) {
        self.models.insert(
            model,
            ModelLimits {
                rpm: limits.request_quota().map(Gcra::new),
                tpm: limits.token_quota().map(TokenBucket::new),
                concurrency: limits.max_concurrent.map(ConcurrencyLimit::new),
            },
        );
    }

    /// Sheds new requests of `tier` and lower priorities (from the degradation plan);
    /// `None` stops shedding.
    pub fn set_shed_from(&mut self, tier: Option<Tier>) {
        self.shed_from = tier;
    }

    /// Changes the number of dispatch slots (e.g. the sum of the backends' adaptive limits).
    pub fn set_max_in_flight(&mut self, n: usize) {
        self.dispatch.set_limit(n.max(1));
    }

    /// The watermark load: queued + in flight.
    #[inline]
    pub fn load(&self) -> u64 {
        (self.queue.len() + self.dispatch.in_use()) as u64
    }

    fn capacity_retry(&self, items: u64, now: Timestamp) -> RetryAfter {
        self.cfg.retry.for_drain(items, &self.drain, now)
    }

    /// Decides one request at `now`. `item` is the caller's payload (a response channel, a
    /// request context); it comes back in the decision.
    pub fn admit(&mut self, req: &AdmissionRequest<K>, item: T, now: Timestamp) -> Admit<T, K> {
        let est = req.estimated_tokens;
        let Some(&tier_budget) = self.cfg.tiers.get(req.tier.0 as usize) else {
            return refused(
                item,
                RefusalReason::QueueFull(PushRefusal::NoSuchTier),
                None,
            );
        };
        if matches!(self.shed_from, Some(s) if req.tier >= s) {
            let r = self.capacity_retry(self.load() + 1, now);
            return refused(item, RefusalReason::Shed, Some(r));
        }
        let retry = self.cfg.retry;

        // One lookup for all of the tenant's state.
        let tenant = match self.tenants.get_mut(&req.tenant) {
            Some(t) => t,
            None => {
                let spec = self
                    .tenant_specs
                    .get(&req.tenant)
                    .unwrap_or(&self.cfg.tenant_default);
                let st = TenantState::new(spec);
                self.tenants.insert_new(&req.tenant, now, st)
            }
        };

        // Concurrency first: permits roll back by drop on any later refusal.
        let tenant_permit = match tenant.concurrency.as_ref().map(|c| c.try_acquire()) {
            None => None,
            Some(Ok(p)) => Some(p),
            Some(Err(s)) => {
                let r = retry.for_drain(s.in_use as u64, &self.drain, now);
                return refused(item, RefusalReason::Concurrency(Scope::Tenant), Some(r));
            }
        };
        let global_permit = match self.global_concurrency.as_ref().map(|c| c.try_acquire()) {
            None => None,
            Some(Ok(p)) => Some(p),
            Some(Err(s)) => {
                let r = retry.for_drain(s.in_use as u64, &self.drain, now);
                return refused(item, RefusalReason::Concurrency(Scope::Global), Some(r));
            }
        };
        let heavy_permit = match &self.heavy {
            Some((min, c)) if est >= *min => match c.try_acquire() {
                Ok(p) => Some(p),
                Err(s) => {
                    let r = retry.for_drain(s.in_use as u64, &self.drain, now);
                    return refused(item, RefusalReason::HeavyRequests, Some(r));
                }
            },
            _ => None,
        };
        let mut model = self.models.get_mut(&req.model);
        let model_permit = match model
            .as_ref()
            .and_then(|m| m.concurrency.as_ref())
            .map(|c| c.try_acquire())
        {
            None => None,
            Some(Ok(p)) => Some(p),
            Some(Err(s)) => {
                let r = retry.for_drain(s.in_use as u64, &self.drain, now);
                return refused(item, RefusalReason::Concurrency(Scope::Model), Some(r));
            }
        };

        // Rates: peek everything, commit only once the request is certain to be taken.
        let peeked = (|| {
            Ok((
                peek_rate!(self.global_rpm.as_ref(), now, Scope::Global)?,
                peek_rate!(
                    model.as_ref().and_then(|m| m.rpm.as_ref()),
                    now,
                    Scope::Model
                )?,
                peek_rate!(tenant.rpm.as_ref(), now, Scope::Tenant)?,
                peek_tokens!(self.global_tpm.as_ref(), est, now, Scope::Global)?,
                peek_tokens!(
                    model.as_ref().and_then(|m| m.tpm.as_ref()),
                    est,
                    now,
                    Scope::Model
                )?,
                peek_tokens!(tenant.tpm.as_ref(), est, now, Scope::Tenant)?,
            ))
        })();
        let (g_rpm, m_rpm, t_rpm, g_tpm, m_tpm, t_tpm) = match peeked {
            Ok(p) => p,
            Err((reason, r)) => return refused(item, reason, r),
        };

        // Watermark.
        let load = (self.queue.len() + self.dispatch.in_use()) as u64;
        let decision = self
            .cfg
            .watermarks
            .decide(load, tier_budget, &self.drain, &retry, now);
        let mut dispatch_permit = None;
        let budget = match decision.action {
            WatermarkAction::Refuse => {
                let reason = RefusalReason::Watermark(decision.zone);
                return refused(item, reason, Some(decision.retry_after));
            }
            WatermarkAction::DispatchNow => {
                // Never overtake queued requests of equal or higher priority.
                if self.queue.len_at_or_above(req.tier) == 0 {
                    dispatch_permit = self.dispatch.try_acquire().ok();
                }
                tier_budget.normal
            }
            WatermarkAction::Wait { budget } => budget,
        };
        let budget = match req.max_wait {
            Some(w) => budget.min(w),
            None => budget,
        };
        if dispatch_permit.is_none() {
            if budget.is_zero() {
                let reason = RefusalReason::Watermark(decision.zone);
                return refused(item, reason, Some(decision.retry_after));
            }
            if let Err(p) = self.queue.can_push(req.tier, est) {
                let r = retry.for_drain(self.queue.len() as u64 + 1, &self.drain, now);
                return refused(item, RefusalReason::QueueFull(p), Some(r));
            }
        }

        // Commit.
        if let (Some(g), Some(t)) = (self.global_rpm.as_mut(), g_rpm) {
            g.commit(t);
        }
        if let (Some(g), Some(t)) = (self.global_tpm.as_mut(), g_tpm) {
            g.commit(t);
        }
        if let Some(m) = model.as_mut() {
            if let (Some(g), Some(t)) = (m.rpm.as_mut(), m_rpm) {
                g.commit(t);
            }
            if let (Some(g), Some(t)) = (m.tpm.as_mut(), m_tpm) {
                g.commit(t);
            }
        }
        if let (Some(g), Some(t)) = (tenant.rpm.as_mut(), t_rpm) {
            g.commit(t);
        }
        if let (Some(g), Some(t)) = (tenant.tpm.as_mut(), t_tpm) {
            g.commit(t);
        }
        let grant = Grant {
            tenant: req.tenant.clone(),
            model: req.model.clone(),
            tier: req.tier,
            estimated_tokens: est,
            charged_global: g_tpm.is_some(),
            charged_model: m_tpm.is_some(),
            charged_tenant: t_tpm.is_some(),
            admitted_at: now,
            _tenant_permit: tenant_permit,
            _model_permit: model_permit,
            _heavy_permit: heavy_permit,
            _global_permit: global_permit,
            dispatch_permit: None,
        };
        if let Some(p) = dispatch_permit {
            self.drain.record(1, now);
            return Admit::Dispatch(Dispatched {
                item,
                grant: Grant {
                    dispatch_permit: Some(p),
                    ..grant
                },
                waited: Duration::ZERO,
            });
        }
        let deadline = now + budget;
        match self.queue.push(
            req.tier,
            req.tenant.clone(),
            est,
            now,
            deadline,
            Pending { item, grant },
        ) {
            Ok(ticket) => Admit::Queued {
                ticket,
                decision,
                deadline,
            },
            Err(rej) => {
                // Unreachable after can_push; undo the charge to be safe.
                let reason = RefusalReason::QueueFull(rej.reason);
                let Pending { item, grant } = rej.item;
                self.refund(grant, now);
                refused(item, reason, None)
            }
        }
    }

    /// Takes the next queued request if a dispatch slot is free. Call it whenever a slot may
    /// have freed (a request completed, was cancelled, or right after `Admit::Queued`), in a
    /// loop until `None`. Entries past their deadline are set aside for
    /// [`Admission::expire`].
    pub fn dequeue(&mut self, now: Timestamp) -> Option<Dispatched<T, K>> {
        loop {
            if self.queue.is_empty() {
                return None;
            }
            let permit = self.dispatch.try_acquire().ok()?;
            let e = self.queue.pop()?;
            if e.deadline <= now {
                self.expired.push(e);
                continue;
            }
            self.drain.record(1, now);
            let Pending { item, grant } = e.item;
            return Some(Dispatched {
                item,
                grant: Grant {
                    dispatch_permit: Some(permit),
                    ..grant
                },
                waited: now - e.enqueued_at,
            });
        }
    }

    /// Removes every queued request past its deadline and refunds its reservations.
    /// Call it on a timer (see [`Admission::next_deadline`]) and before `dequeue`.
    pub fn expire(&mut self, now: Timestamp) -> Vec<Expired<T>> {
        let mut entries = std::mem::take(&mut self.expired);
        self.queue.expire_into(now, &mut entries);
        if entries.is_empty() {
            self.expired = entries;
            return Vec::new();
        }
        let retry = self.capacity_retry(self.load().max(1), now);
        entries
            .into_iter()
            .map(|e| {
                let Pending { item, grant } = e.item;
                self.refund(grant, now);
                Expired {
                    item,
                    tier: e.tier,
                    waited: now - e.enqueued_at,
                    retry_after: retry,
                }
            })
            .collect()
    }

    /// The earliest queued deadline, to schedule the next [`Admission::expire`].
    pub fn next_deadline(&self) -> Option<Timestamp> {
        match self.expired.first() {
            Some(e) => Some(e.deadline),
            None => self.queue.next_deadline(),
        }
    }

    /// Withdraws a queued request (the client went away) and refunds it. `None` if it already
    /// left the queue.
    pub fn cancel(&mut self, ticket: Ticket, now: Timestamp) -> Option<T> {
        let e = self.queue.cancel(ticket)?;
        let Pending { item, grant } = e.item;
        self.refund(grant, now);
        Some(item)
    }

    fn refund(&mut self, grant: Grant<K>, now: Timestamp) {
        self.complete(grant, 0, now);
    }

    /// Settles a finished request with its actual token count (prompt + completion), refunding
    /// or charging each token bucket, and releases its permits.
    pub fn complete(&mut self, grant: Grant<K>, actual_tokens: u64, now: Timestamp) {
        let est = grant.estimated_tokens;
        if est != actual_tokens {
            if grant.charged_global {
                if let Some(b) = self.global_tpm.as_mut() {
                    b.reconcile(est, actual_tokens, now);
                }
            }
            if grant.charged_model {
                if let Some(b) = self
                    .models
                    .get_mut(&grant.model)
                    .and_then(|m| m.tpm.as_mut())
                {
                    b.reconcile(est, actual_tokens, now);
                }
            }
            if grant.charged_tenant {
                // If the tenant's state was evicted meanwhile, its fresh bucket is full: a
                // refund has nothing to add and a charge is forgiven.
                if let Some(b) = self
                    .tenants
                    .get_mut(&grant.tenant)
                    .and_then(|t| t.tpm.as_mut())
                {
                    b.reconcile(est, actual_tokens, now);
                }
            }
        }
        drop(grant);
    }

    /// The tenant's `x-ratelimit-*` figures at `now`.
    pub fn rate_limit_headers(&self, tenant: &K, now: Timestamp) -> RateLimitHeaders {
        match self.tenants.get(tenant) {
            Some(t) => RateLimitHeaders {
                requests: t.rpm.as_ref().map(|g| g.info(now)),
                tokens: t.tpm.as_ref().map(|b| b.info(now)),
            },
            None => {
                let spec = self
                    .tenant_specs
                    .get(tenant)
                    .unwrap_or(&self.cfg.tenant_default);
                RateLimitHeaders {
                    requests: spec.request_quota().map(|q| Gcra::new(q).info(now)),
                    tokens: spec.token_quota().map(|q| TokenBucket::new(q).info(now)),
                }
            }
        }
    }

    /// Queue and in-flight ratios for the degradation planner; the caller adds backend KV
    /// usage.
    pub fn load_signals(&self, kv_cache_usage: f64) -> LoadSignals {
        LoadSignals {
            queue_depth_ratio: self.queue.len() as f64 / self.cfg.queue_max_len.max(1) as f64,
            in_flight_ratio: self.dispatch.in_use() as f64 / self.dispatch.limit().max(1) as f64,
            kv_cache_usage,
        }
    }

    /// Figures for metrics.
    pub fn stats(&self, now: Timestamp) -> AdmissionStats {
        let load = self.load();
        AdmissionStats {
            queue: self.queue.stats(),
            in_flight: self.dispatch.in_use(),
            max_in_flight: self.dispatch.limit(),
            load,
            zone: self.cfg.watermarks.zone(load),
            dispatch_rate: self.drain.per_second(now),
            tracked_tenants: self.tenants.len(),
        }
    }

    /// Entries queued.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.dispatch.in_use()
    }

    /// Drops limiter state of idle tenants (optional housekeeping; the cap holds anyway).
    pub fn evict_idle(&mut self, now: Timestamp) -> usize {
        self.tenants.evict_idle(now)
    }

    #[doc(hidden)]
    pub fn for_each_tenant_bucket(&mut self, mut f: impl FnMut(&mut TokenBucket)) {
        for t in self.tenants.values_mut() {
            if let Some(b) = t.tpm.as_mut() {
                f(b);
            }
        }
    }
}
