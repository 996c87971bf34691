//! The one admission path: every decision the gateway makes about a request between
//! authentication and the upstream call, as pure code over a manual-clock-friendly state.
//!
//! For one request, in order: the lane (the model) must be able to serve at all and the
//! request must fit a backend's KV budget; then concurrency (tenant, model, global), the
//! heavy-request rule and the rates (requests/min and tokens/min at global, model, tenant and
//! tenant-heavy scope) are *checked* without charging anything; then the lane's watermark
//! gives the wait budget (or refuses at the hard mark); then the request either goes to a
//! backend at once (nobody of its priority or higher waits, a backend has room in requests
//! and KV tokens, and its tenant is within its fair share) or joins the lane's fair queue —
//! unless the wait predicted from its position and the lane's measured service time exceeds
//! its budget, when it is refused at once. Only a request certain to be taken is charged.
//!
//! A request charged and later not served — expired in the queue, cancelled, failed before
//! reaching a backend, or drained because no backend can serve — gets its request-rate and
//! token charges back ([`Admission::refund`]). A served request reconciles its estimate with
//! its real usage ([`Admission::complete`]): a refund when it used less, a charge when it used
//! more, carried as debt up to one bucket's worth so a client cannot dodge its token quota by
//! under-declaring `max_tokens`.
//!
//! A [`Grant`] must end in exactly one of `complete`, `refund` or (while queued) `cancel`;
//! dropping one leaks its backend slot. The gateway wraps it in an RAII guard.

use crate::breaker::Outcome;
use crate::clock::Timestamp;
use crate::concurrency::{ConcurrencyLimit, Permit};
use crate::fasthash::FastState;
use crate::gcra::{Gcra, Quota, RateLimitInfo};
use crate::keyed::{BoundedMap, Evictable};
use crate::lane::{BackendLimits, BackendReport, Lane, LaneConfig, Placement, Unservable};
use crate::queue::{Entry, PushRefusal, Ticket, Tier};
use crate::retry::{RetryAfter, RetryBounds};
use crate::tokens::{Refused, TokenBucket, TokenQuota};
use crate::watermark::{ConfigError, LoadZone, WaitBudget, WatermarkAction, WatermarkDecision};
use std::collections::HashMap;
use std::hash::Hash;
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

impl HeavyRule {
    fn applies(&self, prompt: u64, completion: u64) -> bool {
        prompt > self.prompt_tokens_over || completion > self.completion_tokens_over
    }
}

/// A tenant's limits and fairness weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantSpec {
    /// Limits.
    pub limits: LimitSpec,
    /// Weight in the fair queue and in the lanes' fair shares (≥ 1).
    pub weight: u32,
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
    /// Wait budgets per tier; the number of tiers is `tiers.len()` (tier 0 first).
    pub tiers: Vec<WaitBudget>,
    /// Per-key limiter state kept at most (tenants).
    pub max_tracked_keys: usize,
    /// Bounds on capacity Retry-After estimates.
    pub retry: RetryBounds,
}

impl AdmissionConfig {
    /// No limits and three tiers waiting 30 s / 15 s / 5 s (soft zone 10 s / 3 s / none).
    pub fn new() -> Self {
        let budget = |normal: u64, soft: u64| WaitBudget {
            normal: Duration::from_secs(normal),
            soft: Duration::from_secs(soft),
        };
        AdmissionConfig {
            global: LimitSpec::UNLIMITED,
            tenant_default: LimitSpec::UNLIMITED,
            heavy: None,
            tiers: vec![budget(30, 10), budget(15, 3), budget(5, 0)],
            max_tracked_keys: 100_000,
            retry: RetryBounds::default(),
        }
    }

    /// Checks the settings; each message names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tiers.is_empty() || self.tiers.len() > 255 {
            return Err(ConfigError("tiers: need between 1 and 255 tiers".into()));
        }
        if self.retry.min > self.retry.max {
            return Err(ConfigError("retry: min must be <= max".into()));
        }
        Ok(())
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self::new()
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
    /// One tenant's heavy requests.
    TenantHeavy,
}

impl Scope {
    /// `global`, `model`, `tenant`, `tenant_heavy`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Model => "model",
            Scope::Tenant => "tenant",
            Scope::TenantHeavy => "tenant_heavy",
        }
    }
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
    /// Larger than any backend's KV budget: it can never be served as sent.
    ExceedsKvBudget,
    /// Load watermark: at `hard`, or in a zone where the tier may not wait.
    Watermark(LoadZone),
    /// The queue is full.
    QueueFull(PushRefusal),
    /// The wait predicted from its place in the queue exceeds its budget.
    PredictedWait,
    /// It waited its whole budget in the queue.
    QueueTimeout,
    /// The lane cannot serve anything now (no healthy backend, every breaker open).
    Unservable(Unservable),
    /// The model has no lane.
    UnknownModel,
    /// It was queued, and a peer of its tier with less waiting took its place when the lane
    /// was full (longest-queue drop).
    Displaced,
}

impl RefusalReason {
    /// The OpenAI-shaped error code.
    pub fn code(&self) -> &'static str {
        match self {
            RefusalReason::RequestRate(_)
            | RefusalReason::TokenRate(_)
            | RefusalReason::TooLarge(_)
            | RefusalReason::Concurrency(Scope::Tenant | Scope::TenantHeavy) => {
                "rate_limit_exceeded"
            }
            RefusalReason::Concurrency(_)
            | RefusalReason::Watermark(_)
            | RefusalReason::QueueFull(_)
            | RefusalReason::Displaced
            | RefusalReason::PredictedWait => "capacity_overload",
            RefusalReason::ExceedsKvBudget => "context_length_exceeded",
            RefusalReason::QueueTimeout => "queue_timeout",
            RefusalReason::Unservable(Unservable::NoHealthyBackend) => "no_healthy_backend",
            RefusalReason::Unservable(Unservable::CircuitOpen) => "circuit_open",
            RefusalReason::UnknownModel => "model_not_found",
        }
    }

    /// A short stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            RefusalReason::RequestRate(Scope::Global) => "global_requests",
            RefusalReason::RequestRate(Scope::Model) => "model_requests",
            RefusalReason::RequestRate(Scope::Tenant) => "tenant_requests",
            RefusalReason::RequestRate(Scope::TenantHeavy) => "heavy_requests",
            RefusalReason::TokenRate(Scope::Global) => "global_tokens",
            RefusalReason::TokenRate(Scope::Model) => "model_tokens",
            RefusalReason::TokenRate(Scope::Tenant) => "tenant_tokens",
            RefusalReason::TokenRate(Scope::TenantHeavy) => "heavy_tokens",
            RefusalReason::TooLarge(_) => "too_large",
            RefusalReason::Concurrency(Scope::Global) => "global_concurrency",
            RefusalReason::Concurrency(Scope::Model) => "model_concurrency",
            RefusalReason::Concurrency(Scope::Tenant) => "tenant_concurrency",
            RefusalReason::Concurrency(Scope::TenantHeavy) => "heavy_concurrency",
            RefusalReason::ExceedsKvBudget => "exceeds_kv_budget",
            RefusalReason::Watermark(LoadZone::AtHard) => "hard_watermark",
            RefusalReason::Watermark(_) => "soft_watermark",
            RefusalReason::QueueFull(p) => p.as_str(),
            RefusalReason::PredictedWait => "predicted_wait",
            RefusalReason::QueueTimeout => "queue_timeout",
            RefusalReason::Unservable(Unservable::NoHealthyBackend) => "no_healthy_backend",
            RefusalReason::Unservable(Unservable::CircuitOpen) => "circuit_open",
            RefusalReason::UnknownModel => "unknown_model",
            RefusalReason::Displaced => "displaced",
        }
    }

    /// False when retrying the same request cannot help.
    pub fn is_retryable(&self) -> bool {
        !matches!(
            self,
            RefusalReason::TooLarge(_)
                | RefusalReason::ExceedsKvBudget
                | RefusalReason::UnknownModel
        )
    }
}

/// One request to admit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionRequest<K> {
    /// The tenant (from the API key, never from a client header).
    pub tenant: K,
    /// The model's lane (after any degradation reroute).
    pub model: K,
    /// The tenant's tier.
    pub tier: Tier,
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// Completion budget: the effective `max_tokens` × the number of choices.
    pub completion_tokens: u64,
    /// The client's own limit on queueing, if shorter than the tier budget.
    pub max_wait: Option<Duration>,
}

impl<K> AdmissionRequest<K> {
    /// Tokens charged to quotas and reserved in a backend's KV cache.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// What one admitted request holds until it ends: its charges, its permits and, once
/// dispatched, its backend placement. End it with [`Admission::complete`],
/// [`Admission::refund`] or [`Admission::cancel`].
#[derive(Debug)]
#[must_use = "end a grant with Admission::complete or Admission::refund"]
pub struct Grant<K> {
    tenant: K,
    model: K,
    tier: Tier,
    tokens: u64,
    charged: [bool; 4],
    rated: [bool; 4],
    admitted_at: Timestamp,
    placement: Option<Placement>,
    _permits: [Option<Permit>; 3],
}

const GLOBAL: usize = 0;
const MODEL: usize = 1;
const TENANT: usize = 2;
const HEAVY: usize = 3;

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
    /// Tokens reserved (prompt estimate + completion budget).
    pub fn tokens(&self) -> u64 {
        self.tokens
    }
    /// When it was admitted.
    pub fn admitted_at(&self) -> Timestamp {
        self.admitted_at
    }
    /// The backend it was sent to, once dispatched.
    pub fn backend(&self) -> Option<&Arc<str>> {
        self.placement.as_ref().map(|p| &p.backend)
    }
}

/// A request to send to a backend now.
#[derive(Debug)]
pub struct Dispatched<T, K> {
    /// The caller's payload.
    pub item: T,
    /// Charges, permits and the backend placement.
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
    /// The place in the queue it had or would have had, for refusals by the queue.
    pub position: Option<usize>,
}

/// The admission decision.
#[derive(Debug)]
pub enum Admit<T, K> {
    /// Send it now.
    Dispatch(Dispatched<T, K>),
    /// Queued; it comes out of [`Admission::dequeue`], [`Admission::expire`],
    /// [`Admission::fail_unservable`] or [`Admission::cancel`].
    Queued {
        /// For cancelling.
        ticket: Ticket,
        /// The watermark decision (zone, budget).
        decision: WatermarkDecision,
        /// When it expires.
        deadline: Timestamp,
        /// Its estimated place in the queue (1 = next).
        position: usize,
    },
    /// Refused.
    Refused(Refusal<T>),
}

/// How a dispatched request ended, for [`Admission::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// What it tells the backend's breaker.
    pub outcome: Outcome,
    /// Tokens really used (prompt + completion), if the backend said; `None` keeps the
    /// estimate charged.
    pub actual_tokens: Option<u64>,
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

/// A model's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Limits across tenants for this model.
    pub limits: LimitSpec,
    /// Its lane.
    pub lane: LaneConfig,
}

#[derive(Debug)]
struct RateLimits {
    rpm: Option<Gcra>,
    tpm: Option<TokenBucket>,
    concurrency: Option<ConcurrencyLimit>,
}

impl RateLimits {
    fn new(spec: &LimitSpec) -> Self {
        RateLimits {
            rpm: spec.request_quota().map(Gcra::new),
            tpm: spec.token_quota().map(TokenBucket::new),
            concurrency: spec.max_concurrent.map(ConcurrencyLimit::new),
        }
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
        match (spec.max_concurrent, self.concurrency.as_ref()) {
            (Some(n), Some(c)) => c.set_limit(n),
            (n, _) => self.concurrency = n.map(ConcurrencyLimit::new),
        }
    }

    fn peek(&self, tokens: u64, now: Timestamp, scope: Scope) -> Result<Peeked, Refused2> {
        let rpm = match &self.rpm {
            None => None,
            Some(g) => Some(
                g.peek(now)
                    .map_err(|e| (RefusalReason::RequestRate(scope), rate_retry(e.retry_after)))?,
            ),
        };
        let tpm = match &self.tpm {
            None => None,
            Some(b) => Some(b.peek(tokens, now).map_err(|e| match e {
                Refused::NotUntil { retry_after } => {
                    (RefusalReason::TokenRate(scope), rate_retry(retry_after))
                }
                Refused::TooLarge { .. } => (RefusalReason::TooLarge(scope), None),
            })?),
        };
        Ok(Peeked { rpm, tpm })
    }

    fn commit(&mut self, p: Peeked) -> (bool, bool) {
        if let (Some(g), Some(t)) = (self.rpm.as_mut(), p.rpm) {
            g.commit(t);
        }
        if let (Some(b), Some(t)) = (self.tpm.as_mut(), p.tpm) {
            b.commit(t);
        }
        (p.rpm.is_some(), p.tpm.is_some())
    }

    fn settle(&mut self, rated: bool, charged: bool, reserved: u64, actual: u64, now: Timestamp) {
        if charged && reserved != actual {
            if let Some(b) = self.tpm.as_mut() {
                b.reconcile(reserved, actual, now);
            }
        }
        if rated {
            if let Some(g) = self.rpm.as_mut() {
                g.refund(now);
            }
        }
    }

    fn acquire(&self, scope: Scope, retry: Option<RetryAfter>) -> Result<Option<Permit>, Refused2> {
        match self.concurrency.as_ref().map(|c| c.try_acquire()) {
            None => Ok(None),
            Some(Ok(p)) => Ok(Some(p)),
            Some(Err(_)) => Err((RefusalReason::Concurrency(scope), retry)),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Peeked {
    rpm: Option<u128>,
    tpm: Option<u128>,
}

type Refused2 = (RefusalReason, Option<RetryAfter>);

/// Everything kept per tenant, in one map entry so a decision hashes the tenant once.
#[derive(Debug)]
struct TenantState {
    limits: RateLimits,
    heavy: RateLimits,
}

impl Evictable for TenantState {
    fn is_idle(&self, now: Timestamp) -> bool {
        [&self.limits, &self.heavy].iter().all(|l| {
            l.rpm.as_ref().is_none_or(|g| g.is_idle(now))
                && l.tpm.as_ref().is_none_or(|b| b.is_idle(now))
        })
    }
    fn debt(&self, now: Timestamp) -> u128 {
        [&self.limits, &self.heavy]
            .iter()
            .map(|l| {
                let a = l.rpm.as_ref().map_or(0, |g| g.debt(now));
                let b = l.tpm.as_ref().map_or(0, |t| t.debt(now));
                a.max(b)
            })
            .max()
            .unwrap_or(0)
    }
    fn pinned(&self) -> bool {
        // Live permits point at this limit; a fresh one would let the tenant exceed it.
        self.limits
            .concurrency
            .as_ref()
            .is_some_and(|c| c.in_use() > 0)
    }
}

/// A queued request inside a lane: the caller's payload and its grant.
#[derive(Debug)]
pub struct Pending<T, K> {
    item: T,
    grant: Grant<K>,
    /// The wait predicted at arrival (before calibration), to learn from how it ended.
    predicted: Option<Duration>,
}

#[derive(Debug)]
struct ModelState<T, K> {
    spec: ModelSpec,
    limits: RateLimits,
    lane: Lane<Pending<T, K>, K>,
    /// Entries `dequeue` found past their deadline, for `expire`.
    expired: Vec<Entry<Pending<T, K>, K>>,
    /// Entries a peer with less waiting displaced from a full lane, for `expire`.
    displaced: Vec<Entry<Pending<T, K>, K>>,
}

/// A queued request that waited past its deadline, or was drained: answer it with `reason`.
#[derive(Debug)]
pub struct Expired<T> {
    /// The caller's payload.
    pub item: T,
    /// Its tier.
    pub tier: Tier,
    /// How long it waited.
    pub waited: Duration,
    /// Why it leaves the queue unserved.
    pub reason: RefusalReason,
    /// Suggested Retry-After.
    pub retry_after: RetryAfter,
}

/// The admission state of one gateway. `&mut self`: hold it behind one lock. Permits inside
/// grants are atomics and may be dropped anywhere.
#[derive(Debug)]
pub struct Admission<T, K> {
    cfg: AdmissionConfig,
    global: RateLimits,
    models: HashMap<K, ModelState<T, K>, FastState>,
    tenant_specs: HashMap<K, TenantSpec, FastState>,
    tenants: BoundedMap<K, TenantState, FastState>,
}

fn rate_retry(wait: Duration) -> Option<RetryAfter> {
    Some(RetryAfter::from_duration(
        wait.max(Duration::from_millis(1)),
    ))
}

fn refused<T, K>(item: T, (reason, retry_after): Refused2) -> Admit<T, K> {
    Admit::Refused(Refusal {
        item,
        reason,
        retry_after,
        position: None,
    })
}

impl<T, K: Hash + Eq + Ord + Clone> Admission<T, K> {
    /// Builds the admission state. Call [`AdmissionConfig::validate`] first to report bad
    /// settings; here they are clamped.
    pub fn new(cfg: AdmissionConfig) -> Self {
        Admission {
            global: RateLimits::new(&cfg.global),
            models: HashMap::default(),
            tenant_specs: HashMap::default(),
            tenants: BoundedMap::new(cfg.max_tracked_keys),
            cfg,
        }
    }

    /// The settings.
    pub fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    fn tiers(&self) -> u8 {
        self.cfg.tiers.len().clamp(1, 255) as u8
    }

    /// Applies new settings, keeping limiter state (debt) where the quotas did not change
    /// and the lanes' queues and backends.
    pub fn reconfigure(&mut self, cfg: AdmissionConfig) {
        if cfg.global != self.cfg.global {
            self.global.update(&cfg.global);
        }
        if cfg.heavy != self.cfg.heavy || cfg.tenant_default != self.cfg.tenant_default {
            // Default-limit tenants and heavy limits are rebuilt on next use.
            let specs = &self.tenant_specs;
            let default = cfg.tenant_default;
            let heavy = cfg
                .heavy
                .map(|h| h.per_tenant)
                .unwrap_or(LimitSpec::UNLIMITED);
            self.tenants.for_each_mut(|k, st| {
                st.limits
                    .update(specs.get(k).map_or(&default, |s| &s.limits));
                st.heavy.update(&heavy);
            });
        }
        self.cfg = cfg;
        let tiers = self.tiers();
        for m in self.models.values_mut() {
            let lane_cfg = m.spec.lane.clone();
            m.lane.reconfigure(lane_cfg, tiers);
        }
    }

    /// Configures a tenant's limits and weight (replacing the default for it). Debt already
    /// accrued is kept; a changed concurrency limit applies to new permits.
    pub fn set_tenant(&mut self, tenant: K, spec: TenantSpec) {
        if let Some(st) = self.tenants.get_mut(&tenant) {
            st.limits.update(&spec.limits);
        }
        self.tenant_specs.insert(tenant, spec);
    }

    /// Adds or reconfigures a model and its lane (queue, watermarks, breaker settings).
    pub fn set_model(&mut self, model: K, spec: ModelSpec) {
        let tiers = self.tiers();
        match self.models.get_mut(&model) {
            Some(m) => {
                if m.spec.limits != spec.limits {
                    m.limits.update(&spec.limits);
                }
                m.lane.reconfigure(spec.lane.clone(), tiers);
                m.spec = spec;
            }
            None => {
                self.models.insert(
                    model,
                    ModelState {
                        limits: RateLimits::new(&spec.limits),
                        lane: Lane::new(spec.lane.clone(), tiers),
                        expired: Vec::new(),
                        displaced: Vec::new(),
                        spec,
                    },
                );
            }
        }
    }

    /// Sets a model's backends by id, keeping the live state of those that stay.
    pub fn set_backends(&mut self, model: &K, backends: Vec<(Arc<str>, BackendLimits)>) {
        if let Some(m) = self.models.get_mut(model) {
            m.lane.set_backends(backends);
        }
    }

    /// Changes one backend's limits (learned from the engine).
    pub fn set_backend_limits(&mut self, model: &K, backend: &str, limits: BackendLimits) {
        if let Some(m) = self.models.get_mut(model) {
            m.lane.set_backend_limits(backend, limits);
        }
    }

    /// Marks a backend routable or not (health, outlier ejection).
    pub fn set_routable(&mut self, model: &K, backend: &str, routable: bool) {
        if let Some(m) = self.models.get_mut(model) {
            m.lane.set_routable(backend, routable);
        }
    }

    /// Sets `model`'s prefill window (see [`Lane::set_prefill_window`]).
    pub fn set_prefill_window(&mut self, model: &K, window: Duration) {
        if let Some(m) = self.models.get_mut(model) {
            m.lane.set_prefill_window(window);
        }
    }

    /// Fences a backend while a batch task's prompt is prefilled there (see
    /// [`Lane::fence_backend`]).
    pub fn fence_backend(&mut self, model: &K, backend: &str, until: Timestamp) {
        if let Some(m) = self.models.get_mut(model) {
            m.lane.fence_backend(backend, until);
        }
    }

    /// Ejects a backend until `until` (see [`Lane::eject`]).
    pub fn eject(&mut self, model: &K, backend: &str, until: Timestamp, now: Timestamp) {
        if let Some(m) = self.models.get_mut(model) {
            m.lane.eject(backend, until, now);
        }
    }

    /// Records a backend's own report of its load.
    pub fn report(&mut self, model: &K, backend: &str, report: BackendReport, now: Timestamp) {
        if let Some(m) = self.models.get_mut(model) {
            m.lane.report(backend, report, now);
        }
    }

    /// A model's lane, for figures.
    pub fn lane(&self, model: &K) -> Option<&Lane<Pending<T, K>, K>> {
        self.models.get(model).map(|m| &m.lane)
    }

    /// The models with lanes.
    pub fn models(&self) -> impl Iterator<Item = &K> + '_ {
        self.models.keys()
    }

    /// Decides one request at `now`. `item` is the caller's payload (a response channel);
    /// it comes back in the decision.
    pub fn admit(&mut self, req: &AdmissionRequest<K>, item: T, now: Timestamp) -> Admit<T, K> {
        let est = req.tokens();
        let Some(&tier_budget) = self.cfg.tiers.get(req.tier.0 as usize) else {
            return refused(
                item,
                (RefusalReason::QueueFull(PushRefusal::NoSuchTier), None),
            );
        };
        let retry = self.cfg.retry;
        let Some(model) = self.models.get_mut(&req.model) else {
            return refused(item, (RefusalReason::UnknownModel, None));
        };
        if let Some((u, wait)) = model.lane.unservable(now) {
            let wait = wait.unwrap_or(retry.min.max(Duration::from_secs(1)));
            return refused(item, (RefusalReason::Unservable(u), rate_retry(wait)));
        }
        if model.lane.largest_fit().is_some_and(|max| est > max) {
            return refused(item, (RefusalReason::ExceedsKvBudget, None));
        }

        // One lookup for all of the tenant's state.
        let spec = self.tenant_specs.get(&req.tenant);
        let weight = spec.map_or(1, |s| s.weight);
        let tenant = match self.tenants.get_mut(&req.tenant) {
            Some(t) => t,
            None => {
                let limits = spec.map_or(&self.cfg.tenant_default, |s| &s.limits);
                let heavy = self
                    .cfg
                    .heavy
                    .map(|h| h.per_tenant)
                    .unwrap_or(LimitSpec::UNLIMITED);
                let st = TenantState {
                    limits: RateLimits::new(limits),
                    heavy: RateLimits::new(&heavy),
                };
                self.tenants.insert_new(&req.tenant, now, st)
            }
        };
        let heavy = self
            .cfg
            .heavy
            .is_some_and(|h| h.applies(req.prompt_tokens, req.completion_tokens));

        // Concurrency first: permits roll back by drop on any later refusal. A permit frees
        // when some request ends: about one mean service time.
        let soon = capacity_retry(&model.lane, &retry, 1);
        let permits = (|| {
            Ok::<_, Refused2>([
                tenant.limits.acquire(Scope::Tenant, soon)?,
                model.limits.acquire(Scope::Model, soon)?,
                self.global.acquire(Scope::Global, soon)?,
            ])
        })();
        let permits = match permits {
            Ok(p) => p,
            Err(r) => return refused(item, r),
        };

        // Rates: peek everything, commit only once the request is certain to be taken.
        let peeked = (|| {
            Ok::<_, Refused2>([
                self.global.peek(est, now, Scope::Global)?,
                model.limits.peek(est, now, Scope::Model)?,
                tenant.limits.peek(est, now, Scope::Tenant)?,
                if heavy {
                    tenant.heavy.peek(est, now, Scope::TenantHeavy)?
                } else {
                    Peeked {
                        rpm: None,
                        tpm: None,
                    }
                },
            ])
        })();
        let peeked = match peeked {
            Ok(p) => p,
            Err(r) => return refused(item, r),
        };

        // The lane: watermark, then dispatch now or queue.
        let lane = &mut model.lane;
        lane.note_arrival(&req.tenant, req.tier, weight, now);
        let load = lane.load_for(req.tier);
        let watermarks = lane.config().watermarks;
        let mut decision = watermarks.decide(load, tier_budget, lane.drain(), &retry, now);
        // A full lane gives a place to a peer with less waiting: the newest entry of the
        // tier's longest backlog leaves (answered by `expire`) if that lets this one in.
        let mut displace = None;
        if decision.action == WatermarkAction::Refuse {
            if let Some((ticket, _)) = lane.displaceable(req.tier, &req.tenant) {
                let d = watermarks.decide(load - 1, tier_budget, lane.drain(), &retry, now);
                if d.action != WatermarkAction::Refuse {
                    decision = d;
                    displace = Some(ticket);
                }
            }
        }
        let budget = match decision.action {
            WatermarkAction::Refuse => {
                let r = capacity_retry(lane, &retry, 1);
                return refused(item, (RefusalReason::Watermark(decision.zone), r));
            }
            WatermarkAction::DispatchNow => tier_budget.normal,
            WatermarkAction::Wait { budget } => budget,
        };
        let budget = match req.max_wait {
            Some(w) => budget.min(w),
            None => budget,
        };
        let target = if lane.queued_at_or_above(req.tier) == 0 {
            lane.can_dispatch(req.tier, &req.tenant, est, now, None)
        } else {
            None
        };
        let mut position = 0;
        let mut raw_wait = None;
        if target.is_none() {
            // A background request held back only until a backend is quiet waits that long,
            // whatever the queue model says.
            let quiet = if lane.queued_at_or_above(req.tier) == 0 {
                lane.quiet_wait(req.tier, &req.tenant, est, now)
            } else {
                None
            };
            let (pos, raw) = match quiet {
                Some(w) => (1, Some(w)),
                None => lane.predict_wait(req.tier, &req.tenant, now),
            };
            position = pos;
            raw_wait = raw;
            let predicted = raw.map(|w| lane.calibrated_wait(&req.tenant, w));
            let refusal = if budget.is_zero() {
                Some((
                    RefusalReason::Watermark(decision.zone),
                    capacity_retry(lane, &retry, pos),
                ))
            } else if let Some(wait) = predicted.filter(|w| *w > budget) {
                let r = RetryAfter::from_duration(wait).clamp(retry.min, retry.max);
                Some((RefusalReason::PredictedWait, Some(r)))
            } else if let Err(p) = lane.can_push(req.tier, est) {
                // A displacement makes room for one entry, and for this one's tokens if the
                // displaced entry had as many: first a peer's in this tier with a longer
                // backlog, else the newest of the lowest tier below (a higher tier is never
                // refused for a full queue while a lower one waits in it).
                let fits = |&(_, cost): &(_, u64)| p == PushRefusal::QueueFull || cost >= est;
                let freed = match (displace, p) {
                    (Some(_), PushRefusal::QueueFull) => true,
                    (None, PushRefusal::QueueFull | PushRefusal::TokensFull) => {
                        match lane
                            .displaceable(req.tier, &req.tenant)
                            .filter(fits)
                            .or_else(|| lane.lower_displaceable(req.tier).filter(fits))
                        {
                            Some((ticket, _)) => {
                                displace = Some(ticket);
                                true
                            }
                            None => false,
                        }
                    }
                    _ => false,
                };
                (!freed).then(|| {
                    (
                        RefusalReason::QueueFull(p),
                        capacity_retry(lane, &retry, pos),
                    )
                })
            } else {
                None
            };
            if let Some((reason, retry_after)) = refusal {
                return Admit::Refused(Refusal {
                    item,
                    reason,
                    retry_after,
                    position: Some(pos),
                });
            }
        }

        // Commit.
        let (g_r, g_t) = self.global.commit(peeked[GLOBAL]);
        let (m_r, m_t) = model.limits.commit(peeked[MODEL]);
        let (t_r, t_t) = tenant.limits.commit(peeked[TENANT]);
        let (h_r, h_t) = tenant.heavy.commit(peeked[HEAVY]);
        let mut grant = Grant {
            tenant: req.tenant.clone(),
            model: req.model.clone(),
            tier: req.tier,
            tokens: est,
            charged: [g_t, m_t, t_t, h_t],
            rated: [g_r, m_r, t_r, h_r],
            admitted_at: now,
            placement: None,
            _permits: permits,
        };
        let lane = &mut model.lane;
        if let Some(ticket) = displace {
            if let Some(e) = lane.cancel(ticket) {
                model.displaced.push(e);
            }
        }
        lane.note_admitted(req.tier, est, now);
        if let Some(i) = target {
            if let Some(p) = lane.place(i, &req.tenant, est, now) {
                lane.charge(req.tier, &req.tenant, est);
                grant.placement = Some(p);
                return Admit::Dispatch(Dispatched {
                    item,
                    grant,
                    waited: Duration::ZERO,
                });
            }
        }
        let deadline = now + budget;
        match lane.push(
            req.tier,
            &req.tenant,
            est,
            now,
            deadline,
            Pending {
                item,
                grant,
                predicted: raw_wait,
            },
        ) {
            Ok(ticket) => Admit::Queued {
                ticket,
                decision,
                deadline,
                position: position.max(1),
            },
            Err(rej) => {
                // Unreachable after can_push; undo the charge.
                let reason = RefusalReason::QueueFull(rej.reason);
                let Pending { item, grant, .. } = rej.item;
                self.refund(grant, now);
                Admit::Refused(Refusal {
                    item,
                    reason,
                    retry_after: None,
                    position: None,
                })
            }
        }
    }

    /// Takes the next queued request of `model` that may go now, placed on a backend. Call
    /// it after anything that may free room (a completion, a cancel, a backend coming back,
    /// right after `Admit::Queued`) in a loop until `None`. Entries past their deadline are
    /// left for [`Admission::expire`].
    pub fn dequeue(&mut self, model: &K, now: Timestamp) -> Option<Dispatched<T, K>> {
        let m = self.models.get_mut(model)?;
        let lane = &mut m.lane;
        let expired = &mut m.expired;
        loop {
            let (e, i) = lane.next_ready(now, |_, cost| cost)?;
            if e.deadline <= now {
                // Expiry runs on its own timer; leave this one for it.
                expired.push(e);
                continue;
            }
            let Pending {
                item,
                mut grant,
                predicted,
            } = e.item;
            match lane.place(i, &e.tenant, e.cost, now) {
                Some(p) => {
                    grant.placement = Some(p);
                    let waited = now.saturating_duration_since(e.enqueued_at);
                    if let Some(predicted) = predicted {
                        let budget = e.deadline.saturating_duration_since(e.enqueued_at);
                        lane.note_wait(&e.tenant, predicted, waited, budget, false);
                    }
                    return Some(Dispatched {
                        item,
                        grant,
                        waited,
                    });
                }
                None => {
                    // The breaker refused between the check and the take (they read the
                    // same state, so this does not happen): keep the request queued.
                    let pending = Pending {
                        item,
                        grant,
                        predicted,
                    };
                    let back = lane.push(
                        e.tier,
                        &e.tenant,
                        e.cost,
                        e.enqueued_at,
                        e.deadline,
                        pending,
                    );
                    if let Err(rej) = back {
                        let Pending { grant, .. } = rej.item;
                        self.refund(grant, now);
                    }
                    return None;
                }
            }
        }
    }

    /// Removes every queued request of `model` past its deadline and refunds it.
    pub fn expire(&mut self, model: &K, now: Timestamp) -> Vec<Expired<T>> {
        let Some(m) = self.models.get_mut(model) else {
            return Vec::new();
        };
        let mut entries = Vec::new();
        m.lane.expire_into(now, &mut entries);
        entries.append(&mut m.expired);
        // A wait that ran out of budget teaches its tenant's calibration the most.
        for e in &entries {
            if let Some(predicted) = e.item.predicted {
                let budget = e.deadline.saturating_duration_since(e.enqueued_at);
                m.lane.note_wait(&e.tenant, predicted, budget, budget, true);
            }
        }
        let displaced = std::mem::take(&mut m.displaced);
        if entries.is_empty() && displaced.is_empty() {
            return Vec::new();
        }
        let retry = capacity_retry(&m.lane, &self.cfg.retry, 1)
            .unwrap_or(RetryAfter::from_duration(self.cfg.retry.min));
        let mut out = self.refund_all(entries, RefusalReason::QueueTimeout, retry, now);
        out.extend(self.refund_all(displaced, RefusalReason::Displaced, retry, now));
        out
    }

    /// When `model`'s lane cannot serve anything (no healthy backend, every breaker open),
    /// takes every queued request out, refunded, to be answered at once rather than left to
    /// wait out its budget. Empty otherwise.
    pub fn fail_unservable(&mut self, model: &K, now: Timestamp) -> Vec<Expired<T>> {
        let Some(m) = self.models.get_mut(model) else {
            return Vec::new();
        };
        let Some((u, wait)) = m.lane.unservable(now) else {
            return Vec::new();
        };
        let mut entries = Vec::new();
        m.lane.drain_into(&mut entries);
        let wait = wait.unwrap_or(self.cfg.retry.min.max(Duration::from_secs(1)));
        let retry = RetryAfter::from_duration(wait);
        self.refund_all(entries, RefusalReason::Unservable(u), retry, now)
    }

    /// Refunds every entry taken out of a queue unserved, to be answered with `reason`.
    fn refund_all(
        &mut self,
        entries: Vec<Entry<Pending<T, K>, K>>,
        reason: RefusalReason,
        retry_after: RetryAfter,
        now: Timestamp,
    ) -> Vec<Expired<T>> {
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let Pending { item, grant, .. } = e.item;
            self.refund(grant, now);
            out.push(Expired {
                item,
                tier: e.tier,
                waited: now.saturating_duration_since(e.enqueued_at),
                reason,
                retry_after,
            });
        }
        out
    }

    /// Takes every queued request of `model` out, refunded (the gateway is draining).
    pub fn drain(&mut self, model: &K, now: Timestamp) -> Vec<T> {
        let Some(m) = self.models.get_mut(model) else {
            return Vec::new();
        };
        let mut entries = std::mem::take(&mut m.expired);
        entries.append(&mut m.displaced);
        m.lane.drain_into(&mut entries);
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let Pending { item, grant, .. } = e.item;
            self.refund(grant, now);
            out.push(item);
        }
        out
    }

    /// Whether `model` holds requests displaced from its queue, to be answered by
    /// [`Admission::expire`] at once.
    pub fn has_displaced(&self, model: &K) -> bool {
        self.models
            .get(model)
            .is_some_and(|m| !m.displaced.is_empty())
    }

    /// When `model`'s queue next changes by time alone after `now` (the earliest queued
    /// deadline, or a backend's prefill window ending while a request of the isolated tier
    /// waits), to schedule the next [`Admission::expire`] and [`Admission::dequeue`].
    pub fn next_deadline(&self, model: &K, now: Timestamp) -> Option<Timestamp> {
        let m = self.models.get(model)?;
        // Displaced entries are due at once; expired ones were due at their deadline.
        match (m.displaced.first(), m.expired.first()) {
            (Some(e), _) => Some(e.enqueued_at),
            (None, Some(e)) => Some(e.deadline),
            (None, None) => m.lane.next_deadline(now),
        }
    }

    /// The place of a queued request in its lane's serving order now (1 = next); `None` once
    /// it has left the queue.
    pub fn position_of(&self, model: &K, ticket: Ticket) -> Option<usize> {
        self.models.get(model)?.lane.position_of(ticket)
    }

    /// Withdraws a queued request (the client went away) and refunds it. `None` if it already
    /// left the queue.
    pub fn cancel(&mut self, model: &K, ticket: Ticket, now: Timestamp) -> Option<T> {
        let e = self.models.get_mut(model)?.lane.cancel(ticket)?;
        let Pending { item, grant, .. } = e.item;
        self.refund(grant, now);
        Some(item)
    }

    /// Moves a dispatched request whose backend failed before anything reached the client
    /// to another backend with room (never the one that failed). `outcome` is reported to the
    /// failed backend's breaker. `false` if no other backend can take it now; the grant then
    /// holds no placement and should be refunded.
    pub fn redispatch(&mut self, grant: &mut Grant<K>, outcome: Outcome, now: Timestamp) -> bool {
        let Some(m) = self.models.get_mut(&grant.model) else {
            return false;
        };
        let Some(p) = grant.placement.take() else {
            return false;
        };
        let failed = p.backend.clone();
        m.lane.release(&grant.tenant, p, outcome, now);
        let Some(i) =
            m.lane
                .can_dispatch(grant.tier, &grant.tenant, grant.tokens, now, Some(&failed))
        else {
            return false;
        };
        grant.placement = m.lane.place(i, &grant.tenant, grant.tokens, now);
        grant.placement.is_some()
    }

    /// Ends a request that was never served (refused after admission, expired, cancelled, or
    /// failed before reaching a backend): every token and request-rate charge comes back.
    pub fn refund(&mut self, grant: Grant<K>, now: Timestamp) {
        self.settle(grant, Outcome::Cancelled, 0, true, now);
    }

    /// Ends a dispatched request: frees its backend, reports `outcome` to the breaker, and
    /// reconciles its token estimate with the real usage (the difference is refunded, or
    /// charged as debt of at most one bucket).
    pub fn complete(&mut self, grant: Grant<K>, done: Completion, now: Timestamp) {
        let actual = done.actual_tokens.unwrap_or(grant.tokens);
        self.settle(grant, done.outcome, actual, false, now);
    }

    fn settle(
        &mut self,
        grant: Grant<K>,
        outcome: Outcome,
        actual: u64,
        refund: bool,
        now: Timestamp,
    ) {
        let Grant {
            tenant,
            model,
            tokens,
            charged,
            rated,
            placement,
            ..
        } = grant;
        let reserved = tokens;
        if let Some(m) = self.models.get_mut(&model) {
            if let Some(p) = placement {
                m.lane.release(&tenant, p, outcome, now);
            }
            m.limits.settle(
                refund && rated[MODEL],
                charged[MODEL],
                reserved,
                actual,
                now,
            );
        }
        self.global.settle(
            refund && rated[GLOBAL],
            charged[GLOBAL],
            reserved,
            actual,
            now,
        );
        // If the tenant's state was evicted meanwhile, its fresh bucket is full: a refund has
        // nothing to add and a charge is forgiven.
        if let Some(t) = self.tenants.get_mut(&tenant) {
            t.limits.settle(
                refund && rated[TENANT],
                charged[TENANT],
                reserved,
                actual,
                now,
            );
            t.heavy.settle(
                refund && rated[HEAVY],
                charged[HEAVY],
                reserved,
                actual,
                now,
            );
        }
    }

    /// The tenant's `x-ratelimit-*` figures at `now`.
    pub fn rate_limit_headers(&self, tenant: &K, now: Timestamp) -> RateLimitHeaders {
        match self.tenants.get(tenant) {
            Some(t) => RateLimitHeaders {
                requests: t.limits.rpm.as_ref().map(|g| g.info(now)),
                tokens: t.limits.tpm.as_ref().map(|b| b.info(now)),
                concurrency: t
                    .limits
                    .concurrency
                    .as_ref()
                    .map(|c| (c.in_use(), c.limit())),
            },
            None => {
                let spec = self
                    .tenant_specs
                    .get(tenant)
                    .map_or(&self.cfg.tenant_default, |s| &s.limits);
                RateLimitHeaders {
                    requests: spec.request_quota().map(|q| Gcra::new(q).info(now)),
                    tokens: spec.token_quota().map(|q| TokenBucket::new(q).info(now)),
                    concurrency: spec.max_concurrent.map(|n| (0, n)),
                }
            }
        }
    }

    /// Global figures (`requests`, `tokens`, `concurrency`) for admin state.
    pub fn global_headers(&self, now: Timestamp) -> RateLimitHeaders {
        RateLimitHeaders {
            requests: self.global.rpm.as_ref().map(|g| g.info(now)),
            tokens: self.global.tpm.as_ref().map(|b| b.info(now)),
            concurrency: self
                .global
                .concurrency
                .as_ref()
                .map(|c| (c.in_use(), c.limit())),
        }
    }

    /// Tenants with limiter state.
    pub fn tracked_tenants(&self) -> usize {
        self.tenants.len()
    }

    /// Drops limiter state of idle tenants (optional housekeeping; the cap holds anyway).
    pub fn evict_idle(&mut self, now: Timestamp) -> usize {
        self.tenants.evict_idle(now)
    }

    #[doc(hidden)]
    pub fn for_each_tenant_bucket(&mut self, mut f: impl FnMut(&mut TokenBucket)) {
        for t in self.tenants.values_mut() {
            if let Some(b) = t.limits.tpm.as_mut() {
                f(b);
            }
        }
    }
}

/// Retry-After for a capacity refusal: the time for `items` requests to drain at the lane's
/// measured service rate, within the bounds.
fn capacity_retry<P, K: Hash + Eq + Ord + Clone>(
    lane: &Lane<P, K>,
    bounds: &RetryBounds,
    items: usize,
) -> Option<RetryAfter> {
    let d = match lane.mean_service() {
        Some(s) => s.mul_f64(items.max(1) as f64 / lane.in_flight().max(1) as f64),
        None => bounds.min,
    };
    Some(RetryAfter::from_duration(d).clamp(bounds.min, bounds.max))
}
