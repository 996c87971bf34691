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

use crate::affinity::SessionKey;
use crate::breaker::Outcome;
use crate::clock::Timestamp;
use crate::completions::{CompletionSizes, OverBudget, Reservation};
use crate::concurrency::Permit;
use crate::fasthash::FastState;
use crate::lane::{BackendLimits, BackendReport, Lane, LaneConfig, Placement};
use crate::limits::{
    rate_retry, Charged, HeavyRule, LimitRefusal, LimitSpec, LimitsConfig, Peeked,
    RateLimitHeaders, ScopeLimits, SharedLimits, TenantLimits, TenantSpec,
};
use crate::preempt::RunId;
use crate::queue::{Entry, PushRefusal, Ticket, Tier};
use crate::refusal::{RefusalReason, Scope};
use crate::retry::{RetryAfter, RetryBounds};
use crate::share::GlobalShare;
use crate::streams::StreamId;
use crate::watermark::{ConfigError, WaitBudget, WatermarkAction, WatermarkDecision};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

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

impl AdmissionConfig {
    pub(crate) fn tier_count(&self) -> u8 {
        self.tiers.len().clamp(1, 255) as u8
    }

    pub(crate) fn limits(&self) -> LimitsConfig {
        LimitsConfig {
            global: self.global,
            tenant_default: self.tenant_default,
            heavy: self.heavy,
            max_tracked_keys: self.max_tracked_keys,
        }
    }
}

impl<K: Hash + Eq + Clone> SharedLimits<K> {
    /// The shared limits of `cfg` (its global, default-tenant and heavy limits).
    pub fn from_config(cfg: &AdmissionConfig) -> Self {
        SharedLimits::new(cfg.limits())
    }

    /// Applies `cfg`'s limits, keeping limiter state (debt) and permits out.
    pub fn reconfigure_from(&self, cfg: &AdmissionConfig) {
        self.reconfigure(cfg.limits());
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self::new()
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
    /// Its conversation, for session affinity (see [`crate::LaneConfig::affinity`]).
    pub session: Option<SessionKey>,
    /// Its answer reaches its client only when it ends (it is not streamed): with
    /// preemption on ([`crate::LaneConfig::preempt`]) it may be cut short at any point of its
    /// run, so a slot it holds is room the others can take back when they need it.
    pub answered_at_end: bool,
}

impl<K> AdmissionRequest<K> {
    /// Tokens charged to quotas (prompt and whole completion budget); a backend's KV cache
    /// holds as many, or less for a stream ([`Grant::kv_tokens`]).
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
    /// Its prompt's tokens (levee's estimate).
    prompt_tokens: u64,
    /// Its completion tokens held in the KV budget (of its completion budget, `tokens` less
    /// `prompt_tokens`); a `u32`, as `max_tokens` is, to keep the grant small.
    held: u32,
    /// `(request rate, token rate)` charged at each scope (global, model, tenant, heavy).
    charged: [Charged; 4],
    admitted_at: Timestamp,
    session: Option<SessionKey>,
    placement: Option<Placement>,
    /// The tenant's limits, to settle with (and to keep its state while it is out).
    limits: Arc<TenantLimits>,
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
    /// Tokens charged to quotas (prompt estimate + completion budget); what its backend's KV
    /// budget holds is [`Grant::kv_tokens`].
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
    /// Its prompt's tokens (levee's estimate).
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens
    }
    /// KV tokens it holds (or will hold, once placed): its prompt and the completion tokens
    /// held ([`crate::LaneConfig::grow_streams`]).
    pub fn kv_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(u64::from(self.held))
    }
    /// The count of generated tokens at which its hold must grow
    /// ([`LaneAdmission::grow`]); `None` when it holds its whole completion budget.
    pub fn grows_at(&self) -> Option<u64> {
        self.completion().grows_at()
    }
    /// Its completion tokens held, of its completion budget.
    fn completion(&self) -> Reservation {
        Reservation {
            held: u64::from(self.held),
            budget: self.tokens.saturating_sub(self.prompt_tokens),
        }
    }
    /// Its name among its lane's preemptible requests, while it is one
    /// ([`crate::LaneConfig::preempt`]).
    pub fn run(&self) -> Option<RunId> {
        self.placement.as_ref().and_then(Placement::run)
    }
    /// Its name among its lane's growing streams, from its first growth on
    /// ([`LaneAdmission::streams_to_cut`]).
    pub fn stream(&self) -> Option<StreamId> {
        self.placement.as_ref().and_then(Placement::stream)
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
    /// Completion tokens its answer had (the backend's count, or those read of a stream cut
    /// short: at least that many), to learn what streams hold at first
    /// ([`crate::LaneConfig::grow_streams`]); `None` when unknown.
    pub generated: Option<u64>,
}

/// A model's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Limits across tenants for this model.
    pub limits: LimitSpec,
    /// Its lane.
    pub lane: LaneConfig,
}

/// A queued request inside a lane: the caller's payload and its grant.
#[derive(Debug)]
pub struct Pending<T, K> {
    item: T,
    grant: Grant<K>,
    /// The wait predicted at arrival (before calibration), to learn from how it ended.
    predicted: Option<Duration>,
    /// See [`AdmissionRequest::answered_at_end`].
    answered_at_end: bool,
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

fn refused<T, K>(item: T, (reason, retry_after): LimitRefusal) -> Admit<T, K> {
    Admit::Refused(Refusal {
        item,
        reason,
        retry_after,
        position: None,
    })
}

/// One model's admission state: its lane (queue, backends, fair shares, breakers) and its
/// model-wide limits. `&mut self`: hold it behind the lane's own lock; the limits it shares
/// with other lanes ([`SharedLimits`]) synchronise themselves, so lanes decide in parallel.
#[derive(Debug)]
pub struct LaneAdmission<T, K> {
    spec: ModelSpec,
    tiers: Vec<WaitBudget>,
    retry: RetryBounds,
    limits: ScopeLimits,
    lane: Lane<Pending<T, K>, K>,
    /// Entries `dequeue` found past their deadline, for `expire`.
    expired: Vec<Entry<Pending<T, K>, K>>,
    /// Entries a peer with less waiting displaced from a full lane, for `expire`.
    displaced: Vec<Entry<Pending<T, K>, K>>,
    /// This lane's share of the global limits (see [`crate::share`]).
    share: GlobalShare,
    /// Its answers' completion lengths, for what a stream holds at first.
    completions: CompletionSizes,
}

impl<T, K: Hash + Eq + Ord + Clone> LaneAdmission<T, K> {
    /// A model's admission state under `cfg`'s tiers and retry bounds.
    pub fn new(spec: ModelSpec, cfg: &AdmissionConfig) -> Self {
        LaneAdmission {
            limits: ScopeLimits::new(&spec.limits),
            lane: Lane::new(spec.lane.clone(), cfg.tier_count()),
            tiers: cfg.tiers.clone(),
            retry: cfg.retry,
            expired: Vec::new(),
            displaced: Vec::new(),
            share: GlobalShare::default(),
            completions: CompletionSizes::default(),
            spec,
        }
    }

    /// Applies new tiers and retry bounds, keeping the queue and the backends.
    pub fn reconfigure(&mut self, cfg: &AdmissionConfig) {
        self.tiers = cfg.tiers.clone();
        self.retry = cfg.retry;
        self.lane
            .reconfigure(self.spec.lane.clone(), cfg.tier_count());
    }

    /// Applies a model's new settings, keeping limiter debt, the queue and the backends.
    pub fn set_spec(&mut self, spec: ModelSpec) {
        if self.spec.limits != spec.limits {
            self.limits.update(&spec.limits);
        }
        self.lane
            .reconfigure(spec.lane.clone(), self.tiers.len().clamp(1, 255) as u8);
        self.spec = spec;
    }

    /// The lane, for figures and the backends' settings.
    pub fn lane(&self) -> &Lane<Pending<T, K>, K> {
        &self.lane
    }

    /// The lane, to change its backends (limits, health, reports, fences, ejections).
    pub fn lane_mut(&mut self) -> &mut Lane<Pending<T, K>, K> {
        &mut self.lane
    }

    /// Decides one request at `now`, looking its tenant up in `shared`. `item` is the
    /// caller's payload (a response channel); it comes back in the decision.
    pub fn admit(
        &mut self,
        shared: &SharedLimits<K>,
        req: &AdmissionRequest<K>,
        item: T,
        now: Timestamp,
    ) -> Admit<T, K> {
        let tenant = shared.tenant(&req.tenant, now);
        self.admit_as(shared, &tenant, req, item, now)
    }

    /// [`LaneAdmission::admit`] with the tenant's limits already in hand.
    pub fn admit_as(
        &mut self,
        shared: &SharedLimits<K>,
        tenant: &Arc<TenantLimits>,
        req: &AdmissionRequest<K>,
        item: T,
        now: Timestamp,
    ) -> Admit<T, K> {
        let est = req.tokens();
        let Some(&tier_budget) = self.tiers.get(req.tier.0 as usize) else {
            return refused(
                item,
                (RefusalReason::QueueFull(PushRefusal::NoSuchTier), None),
            );
        };
        if let Some(r) = self.unservable(est, now) {
            return refused(item, r);
        }
        let heavy = shared.heavy_applies(req.prompt_tokens, req.completion_tokens);
        // Concurrency first: permits roll back by drop on any later refusal. A permit frees
        // when some request ends: about one mean service time.
        let permits = (|| {
            Ok::<_, RefusalReason>([
                tenant.limits.acquire(Scope::Tenant)?,
                self.limits.acquire(Scope::Model)?,
                self.share.acquire(&shared.global)?,
            ])
        })();
        let permits = match permits {
            Ok(p) => p,
            Err(r) => return refused(item, (r, capacity_retry(&self.lane, &self.retry, 1))),
        };
        // Rates: a peek now (over quota is refused before any queue work); the charge is
        // taken only once the request is certain to be taken. The global rates are this
        // lane's share of them, made sure of now and spent with the others.
        if let Err(r) = self.share.ensure(&shared.global, est, now) {
            return refused(item, r);
        }
        let scopes = rate_scopes(&self.limits, tenant, heavy);
        if let Err(r) = peek_rates(&scopes, est, now) {
            self.share.trim(&shared.global, now);
            return refused(item, r);
        }
        let weight = tenant.weight();
        let held = self.first_hold(req);
        let kv = req.prompt_tokens.saturating_add(u64::from(held));
        let placed = match place_or_queue(
            &mut self.lane,
            self.retry,
            (req, kv),
            tier_budget,
            weight,
            now,
        ) {
            Ok(p) => p,
            Err((reason, retry_after, position)) => {
                self.share.trim(&shared.global, now);
                return Admit::Refused(Refusal {
                    item,
                    reason,
                    retry_after,
                    position,
                });
            }
        };
        let mut charged = match take_rates(&scopes, est, now) {
            Ok(c) => c,
            Err(r) => {
                self.share.trim(&shared.global, now);
                return refused(item, r);
            }
        };
        charged[GLOBAL] = self.share.spend(est);
        let grant = Grant {
            tenant: req.tenant.clone(),
            model: req.model.clone(),
            tier: req.tier,
            tokens: est,
            prompt_tokens: req.prompt_tokens,
            held,
            charged,
            admitted_at: now,
            session: req.session,
            placement: None,
            limits: tenant.clone(),
            _permits: permits,
        };
        self.commit(shared, req, placed, grant, item, now)
    }

    /// What `req`'s completion holds in the KV budget at first: a stream, where the lane
    /// grows streams, the quantile of recent answers or its tenant's longest recent one
    /// ([`CompletionSizes::first_hold`]); anything else its whole budget.
    fn first_hold(&self, req: &AdmissionRequest<K>) -> u32 {
        let budget = req.completion_tokens;
        let held = if self.spec.lane.grow_streams && !req.answered_at_end {
            let longest = self.lane.longest_answer(&req.tenant);
            self.completions.first_hold(budget, longest)
        } else {
            budget
        };
        u32::try_from(held).unwrap_or(u32::MAX)
    }

    /// Refuses what this lane cannot serve at all, or what is larger than any backend.
    fn unservable(&self, est: u64, now: Timestamp) -> Option<LimitRefusal> {
        if let Some((u, wait)) = self.lane.unservable(now) {
            let wait = wait.unwrap_or(self.retry.min.max(Duration::from_secs(1)));
            return Some((RefusalReason::Unservable(u), rate_retry(wait)));
        }
        if self.lane.largest_fit().is_some_and(|max| est > max) {
            return Some((RefusalReason::ExceedsKvBudget, None));
        }
        None
    }

    /// Applies a decision whose charges were taken: the displacement, then the backend or
    /// the queue.
    fn commit(
        &mut self,
        shared: &SharedLimits<K>,
        req: &AdmissionRequest<K>,
        placed: Placed,
        mut grant: Grant<K>,
        item: T,
        now: Timestamp,
    ) -> Admit<T, K> {
        let est = grant.kv_tokens();
        let lane = &mut self.lane;
        if let Some(ticket) = placed.displace {
            if let Some(e) = lane.cancel(ticket) {
                self.displaced.push(e);
            }
        }
        lane.note_admitted(req.tier, est, now);
        if let Some(i) = placed.target {
            if let Some(mut p) = lane.place(i, req.tier, &req.tenant, est, req.prompt_tokens, now) {
                if req.answered_at_end {
                    lane.lend(&req.tenant, &mut p);
                }
                lane.note_session(req.session, i);
                lane.charge(req.tier, &req.tenant, est);
                grant.placement = Some(p);
                return Admit::Dispatch(Dispatched {
                    item,
                    grant,
                    waited: Duration::ZERO,
                });
            }
        }
        let deadline = now + placed.budget;
        let pending = Pending {
            item,
            grant,
            predicted: placed.raw_wait,
            answered_at_end: req.answered_at_end,
        };
        match lane.push(req.tier, &req.tenant, est, now, deadline, pending) {
            Ok(ticket) => Admit::Queued {
                ticket,
                decision: placed.decision,
                deadline,
                position: placed.position.max(1),
            },
            Err(rej) => {
                // Unreachable after can_push; undo the charge.
                let reason = RefusalReason::QueueFull(rej.reason);
                let Pending { item, grant, .. } = rej.item;
                self.refund(shared, grant, now);
                Admit::Refused(Refusal {
                    item,
                    reason,
                    retry_after: None,
                    position: None,
                })
            }
        }
    }

    /// Takes the next queued request that may go now, placed on a backend. Call it after
    /// anything that may free room (a completion, a cancel, a backend coming back, right
    /// after `Admit::Queued`) in a loop until `None`. Entries past their deadline are left
    /// for [`LaneAdmission::expire`].
    pub fn dequeue(
        &mut self,
        shared: &SharedLimits<K>,
        now: Timestamp,
    ) -> Option<Dispatched<T, K>> {
        loop {
            let (e, i) = self
                .lane
                .next_ready(now, |_, cost| cost, |p| p.grant.session)?;
            if e.deadline <= now {
                // Expiry runs on its own timer; leave this one for it.
                self.expired.push(e);
                continue;
            }
            let Pending {
                item,
                mut grant,
                predicted,
                answered_at_end,
            } = e.item;
            match self
                .lane
                .place(i, e.tier, &e.tenant, e.cost, grant.prompt_tokens, now)
            {
                Some(mut p) => {
                    if answered_at_end {
                        self.lane.lend(&e.tenant, &mut p);
                    }
                    self.lane.note_session(grant.session, i);
                    grant.placement = Some(p);
                    let waited = now.saturating_duration_since(e.enqueued_at);
                    if let Some(predicted) = predicted {
                        let budget = e.deadline.saturating_duration_since(e.enqueued_at);
                        self.lane
                            .note_wait(&e.tenant, predicted, waited, budget, false);
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
                        answered_at_end,
                    };
                    let back = self.lane.push(
                        e.tier,
                        &e.tenant,
                        e.cost,
                        e.enqueued_at,
                        e.deadline,
                        pending,
                    );
                    if let Err(rej) = back {
                        self.refund(shared, rej.item.grant, now);
                    }
                    return None;
                }
            }
        }
    }

    /// Removes every queued request past its deadline, and every displaced one, refunded.
    pub fn expire(&mut self, shared: &SharedLimits<K>, now: Timestamp) -> Vec<Expired<T>> {
        let mut entries = Vec::new();
        self.lane.expire_into(now, &mut entries);
        entries.append(&mut self.expired);
        // A wait that ran out of budget teaches its tenant's calibration the most.
        for e in &entries {
            if let Some(predicted) = e.item.predicted {
                let budget = e.deadline.saturating_duration_since(e.enqueued_at);
                self.lane
                    .note_wait(&e.tenant, predicted, budget, budget, true);
            }
        }
        let displaced = std::mem::take(&mut self.displaced);
        if entries.is_empty() && displaced.is_empty() {
            return Vec::new();
        }
        let retry = capacity_retry(&self.lane, &self.retry, 1)
            .unwrap_or(RetryAfter::from_duration(self.retry.min));
        let mut out = self.refund_all(shared, entries, RefusalReason::QueueTimeout, retry, now);
        out.extend(self.refund_all(shared, displaced, RefusalReason::Displaced, retry, now));
        out
    }

    /// When the lane cannot serve anything (no healthy backend, every breaker open), takes
    /// every queued request out, refunded, to be answered at once rather than left to wait
    /// out its budget. Empty otherwise.
    pub fn fail_unservable(&mut self, shared: &SharedLimits<K>, now: Timestamp) -> Vec<Expired<T>> {
        let Some((u, wait)) = self.lane.unservable(now) else {
            return Vec::new();
        };
        let mut entries = Vec::new();
        self.lane.drain_into(&mut entries);
        let wait = wait.unwrap_or(self.retry.min.max(Duration::from_secs(1)));
        let retry = RetryAfter::from_duration(wait);
        self.refund_all(shared, entries, RefusalReason::Unservable(u), retry, now)
    }

    /// Refunds every entry taken out of a queue unserved, to be answered with `reason`.
    fn refund_all(
        &mut self,
        shared: &SharedLimits<K>,
        entries: Vec<Entry<Pending<T, K>, K>>,
        reason: RefusalReason,
        retry_after: RetryAfter,
        now: Timestamp,
    ) -> Vec<Expired<T>> {
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let Pending { item, grant, .. } = e.item;
            self.refund(shared, grant, now);
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

    /// Takes every queued request out, refunded (the gateway is draining).
    pub fn drain(&mut self, shared: &SharedLimits<K>, now: Timestamp) -> Vec<T> {
        let mut entries = std::mem::take(&mut self.expired);
        entries.append(&mut self.displaced);
        self.lane.drain_into(&mut entries);
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let Pending { item, grant, .. } = e.item;
            self.refund(shared, grant, now);
            out.push(item);
        }
        out
    }

    /// Whether anything waits for the dispatcher: a queued request, or one that left the
    /// queue unserved and is still to be answered. When nothing does, freed room has no one
    /// to go to and the dispatcher need not run.
    pub fn has_waiting(&self) -> bool {
        self.lane.queued() > 0 || !self.expired.is_empty() || !self.displaced.is_empty()
    }

    /// Whether it holds requests displaced from its queue, to be answered by
    /// [`LaneAdmission::expire`] at once.
    pub fn has_displaced(&self) -> bool {
        !self.displaced.is_empty()
    }

    /// When the queue next changes by time alone after `now` (the earliest queued deadline,
    /// or a backend's prefill window ending while a request of the isolated tier waits), to
    /// schedule the next [`LaneAdmission::expire`] and [`LaneAdmission::dequeue`].
    pub fn next_deadline(&self, now: Timestamp) -> Option<Timestamp> {
        // Displaced entries are due at once; expired ones were due at their deadline.
        match (self.displaced.first(), self.expired.first()) {
            (Some(e), _) => Some(e.enqueued_at),
            (None, Some(e)) => Some(e.deadline),
            (None, None) => self.lane.next_deadline(now),
        }
    }

    /// The place of a queued request in the serving order now (1 = next); `None` once it
    /// has left the queue.
    pub fn position_of(&self, ticket: Ticket) -> Option<usize> {
        self.lane.position_of(ticket)
    }

    /// Withdraws a queued request (the client went away) and refunds it. `None` if it already
    /// left the queue.
    pub fn cancel(
        &mut self,
        shared: &SharedLimits<K>,
        ticket: Ticket,
        now: Timestamp,
    ) -> Option<T> {
        let e = self.lane.cancel(ticket)?;
        let Pending { item, grant, .. } = e.item;
        self.refund(shared, grant, now);
        Some(item)
    }

    /// Moves a dispatched request whose backend failed before anything reached the client
    /// to another backend with room (never the one that failed). `outcome` is reported to
    /// the failed backend's breaker, which frees its slot. `false` if no other backend can
    /// take it now: the grant then holds no placement, and its charges stand (the request
    /// did reach a backend) until it is ended with [`LaneAdmission::complete`].
    pub fn redispatch(&mut self, grant: &mut Grant<K>, outcome: Outcome, now: Timestamp) -> bool {
        let Some(p) = grant.placement.take() else {
            return false;
        };
        let lasting = p.lasting();
        let failed = p.backend.clone();
        self.lane.release(&grant.tenant, p, outcome, now);
        let Some(i) = self.lane.can_dispatch(
            grant.tier,
            &grant.tenant,
            grant.kv_tokens(),
            now,
            Some(&failed),
            None,
        ) else {
            return false;
        };
        grant.placement = self.lane.place(
            i,
            grant.tier,
            &grant.tenant,
            grant.kv_tokens(),
            grant.prompt_tokens,
            now,
        );
        if let (Some(p), true) = (grant.placement.as_mut(), lasting) {
            self.lane.lend(&grant.tenant, p);
        }
        if grant.placement.is_some() {
            // The session's prefix is warm there now.
            self.lane.note_session(grant.session, i);
        }
        grant.placement.is_some()
    }

    /// Its answer started reaching its client: it may no longer be cut short
    /// ([`crate::LaneConfig::preempt`]).
    pub fn answered(&mut self, grant: &mut Grant<K>) {
        if let Some(p) = grant.placement.as_mut() {
            self.lane.answered(&grant.tenant, p);
        }
    }

    /// A running request to cut short now to give its slot to a tenant under its share
    /// (see [`crate::LaneConfig::preempt`]); call it after [`LaneAdmission::dequeue`] found
    /// nothing more, in a loop until `None`. The caller stops that request before anything
    /// of it reaches its client and gives it back with [`LaneAdmission::requeue`] (or ends
    /// it as usual if it ended first).
    pub fn preempt(&mut self, now: Timestamp) -> Option<RunId> {
        self.lane.preempt(now).map(|(id, _)| id)
    }

    /// The streams whose KV hold went to a stream of a tenant within its fair share since
    /// the last call ([`LaneAdmission::grow`]): the caller cuts each short at once (as for a
    /// backend with no room, `OverBudget`), which stops it at its engine's next step, within
    /// the lead the growth kept; it never grows again.
    pub fn streams_to_cut(&mut self) -> Vec<StreamId> {
        self.lane.streams_to_cut()
    }

    /// Queues again a request cut short ([`LaneAdmission::preempt`]): its backend slot
    /// comes back (its breaker counts nothing), its charges stand, and it waits with its
    /// tier's full wait budget from now, behind what its tenant already has queued. `Err`
    /// gives the payload back, the grant refunded, when the queue has no room for it.
    pub fn requeue(
        &mut self,
        shared: &SharedLimits<K>,
        mut grant: Grant<K>,
        item: T,
        now: Timestamp,
    ) -> Result<Ticket, T> {
        let mut answered_at_end = false;
        if let Some(p) = grant.placement.take() {
            answered_at_end = p.lasting();
            self.lane.release(&grant.tenant, p, Outcome::Cancelled, now);
        }
        let budget = self
            .tiers
            .get(usize::from(grant.tier.0))
            .map_or(self.retry.min, |b| b.normal);
        let (tier, tenant, cost) = (grant.tier, grant.tenant.clone(), grant.kv_tokens());
        let pending = Pending {
            item,
            grant,
            predicted: None,
            answered_at_end,
        };
        match self
            .lane
            .push(tier, &tenant, cost, now, now + budget, pending)
        {
            Ok(ticket) => Ok(ticket),
            Err(rej) => {
                let Pending { item, grant, .. } = rej.item;
                self.refund(shared, grant, now);
                Err(item)
            }
        }
    }

    /// Feeds what a dispatched request's response showed — its time to first token and its
    /// time per output token after the first, from the moment it was sent, as far as known —
    /// to its backend's latency fit ([`crate::LatencyFit`]); returns the time to first token
    /// predicted when it was placed, to measure the prediction's error. `None` for a grant
    /// that holds no placement.
    pub fn observe(
        &mut self,
        grant: &Grant<K>,
        ttft: Option<Duration>,
        tpot: Option<Duration>,
    ) -> Option<Duration> {
        let p = grant.placement.as_ref()?;
        self.lane.observe(p, ttft, tpot)
    }

    /// Ends a request that was never served (refused after admission, expired, cancelled,
    /// or failed before reaching a backend): every token and request-rate charge comes back.
    pub fn refund(&mut self, shared: &SharedLimits<K>, grant: Grant<K>, now: Timestamp) {
        self.settle(shared, grant, Outcome::Cancelled, 0, true, now);
    }

    /// Ends a dispatched request: frees its backend, reports `outcome` to the breaker, and
    /// reconciles its token estimate with the real usage (the difference is refunded, or
    /// charged as debt of at most one bucket).
    pub fn complete(
        &mut self,
        shared: &SharedLimits<K>,
        grant: Grant<K>,
        done: Completion,
        now: Timestamp,
    ) {
        let actual = done.actual_tokens.unwrap_or(grant.tokens);
        if let Some(g) = done.generated {
            self.completions.note(g);
            // A stream cut for want of room ran at least `g` tokens, and its tenant's may
            // run to their end: its next ones hold their whole budget until its answers
            // show otherwise.
            let cut = grant
                .placement
                .as_ref()
                .is_some_and(|p| self.lane.cut_for_room(p));
            let budget = grant.completion().budget;
            self.lane
                .note_answer(&grant.tenant, if cut { budget.max(g) } else { g });
        }
        self.settle(shared, grant, done.outcome, actual, false, now);
    }

    /// A stream's answer has `generated` tokens so far: where that reaches its hold's
    /// [`Grant::grows_at`], its backend holds more of its completion budget for it (double
    /// the hold, or just enough to keep the lead, if only that fits), as far as the
    /// fair-share rule lets its tenant hold more. When the backend is full and its tenant
    /// would stay within its share, the youngest streams of tenants over theirs give it the
    /// room ([`LaneAdmission::streams_to_cut`]). `Err` when none of that gives it room: the
    /// caller cuts the stream short, before the engine's cache holds more than levee
    /// reserved (so is a stream whose own hold was taken). `Ok` with the next count to call
    /// at (`None`: it holds its whole budget).
    pub fn grow(
        &mut self,
        grant: &mut Grant<K>,
        generated: u64,
        now: Timestamp,
    ) -> Result<Option<u64>, OverBudget> {
        let growths: Vec<u64> = grant.completion().growths(generated).collect();
        self.hold(grant, growths, now)
    }

    /// Holds a stream's whole completion budget (its client stopped reading: its tokens
    /// may pile up out of sight). `Err` when its backend has no room for it.
    pub fn hold_whole(&mut self, grant: &mut Grant<K>, now: Timestamp) -> Result<(), OverBudget> {
        let whole = grant.completion().whole();
        if whole <= u64::from(grant.held) {
            return Ok(());
        }
        self.hold(grant, vec![whole], now).map(|_| ())
    }

    /// Grows `grant`'s hold to the first of `holds` its backend has room for.
    fn hold(
        &mut self,
        grant: &mut Grant<K>,
        holds: Vec<u64>,
        now: Timestamp,
    ) -> Result<Option<u64>, OverBudget> {
        if holds.is_empty() {
            return Ok(grant.grows_at());
        }
        let Some(p) = grant.placement.as_mut() else {
            return Err(OverBudget);
        };
        // Each hold is tried on the backend's free room first; only then the least of them
        // on room taken from tenants over their share.
        let least = holds.last().copied();
        let tries = holds.into_iter().map(|h| (h, false));
        for (h, take) in tries.chain(least.map(|h| (h, true))) {
            // A hold past u32 (no context is that long) stays where it is.
            let Ok(h32) = u32::try_from(h) else { continue };
            let extra = h - u64::from(grant.held);
            if self.lane.grow(&grant.tenant, p, extra, take, now) {
                grant.held = h32;
                return Ok(grant.grows_at());
            }
        }
        self.lane.growth_refused(p);
        Err(OverBudget)
    }

    fn settle(
        &mut self,
        shared: &SharedLimits<K>,
        grant: Grant<K>,
        outcome: Outcome,
        actual: u64,
        refund: bool,
        now: Timestamp,
    ) {
        let Grant {
            tenant,
            tokens: reserved,
            charged,
            placement,
            limits,
            ..
        } = grant;
        if let Some(p) = placement {
            self.lane.release(&tenant, p, outcome, now);
        }
        self.limits
            .settle(charged[MODEL], refund, reserved, actual, now);
        self.share.settle(
            &shared.global,
            charged[GLOBAL],
            refund,
            reserved,
            actual,
            now,
        );
        limits
            .limits
            .settle(charged[TENANT], refund, reserved, actual, now);
        limits
            .heavy
            .settle(charged[HEAVY], refund, reserved, actual, now);
    }
}

/// The lane's decision, before anything is charged: the watermark, then a backend now
/// or a place in the queue (with whom it displaces), or a refusal. `est` is the KV tokens
/// the request holds ([`Grant::kv_tokens`]).
fn place_or_queue<P, K: Hash + Eq + Ord + Clone>(
    lane: &mut Lane<P, K>,
    retry: RetryBounds,
    (req, est): (&AdmissionRequest<K>, u64),
    tier_budget: WaitBudget,
    weight: u32,
    now: Timestamp,
) -> Result<Placed, (RefusalReason, Option<RetryAfter>, Option<usize>)> {
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
            return Err((RefusalReason::Watermark(decision.zone), r, None));
        }
        WatermarkAction::DispatchNow => tier_budget.normal,
        WatermarkAction::Wait { budget } => budget,
    };
    let budget = match req.max_wait {
        Some(w) => budget.min(w),
        None => budget,
    };
    let nobody_ahead = lane.queued_at_or_above(req.tier) == 0;
    let target = if nobody_ahead {
        lane.can_dispatch(req.tier, &req.tenant, est, now, None, req.session)
    } else {
        None
    };
    let mut placed = Placed {
        target,
        displace,
        decision,
        budget,
        position: 0,
        raw_wait: None,
    };
    if let Some(i) = target {
        slo_check(lane, req, &retry, Some(i), Duration::ZERO, now)?;
    } else {
        // A background request held back only until a backend is quiet waits that long,
        // whatever the queue model says.
        let quiet = nobody_ahead
            .then(|| lane.quiet_wait(req.tier, &req.tenant, est, now))
            .flatten();
        let (pos, raw) = match quiet {
            Some(w) => (1, Some(w)),
            None => lane.predict_wait(req.tier, &req.tenant, now),
        };
        // A request preemption places at once waits only for the cut, whatever the queue
        // model says of a queue drained by ends.
        let raw = if lane.placed_by_preemption(req.tier, &req.tenant, now) {
            Some(Duration::ZERO)
        } else {
            raw
        };
        placed.position = pos;
        placed.raw_wait = raw;
        let predicted = raw.map(|w| lane.calibrated_wait(&req.tenant, w));
        if let Some((reason, retry_after)) =
            queue_refusal(lane, (req, est), &retry, &mut placed, predicted)
        {
            return Err((reason, retry_after, Some(pos)));
        }
        if let Some(wait) = predicted {
            slo_check(lane, req, &retry, None, wait, now).map_err(|(r, a, _)| (r, a, Some(pos)))?;
        }
    }
    Ok(placed)
}

/// Refuses a request whose predicted time to first token — `wait` before it is placed,
/// then the time to first token learned for backend `target` (or the best backend, for a
/// request that queues) with the prompt tokens being prefilled there — misses its tier's
/// objective ([`LaneConfig::slo`]). Retry-After is the predicted excess: what must drain
/// before a request like it would make it. Nothing without an objective or a prediction.
fn slo_check<P, K: Hash + Eq + Ord + Clone>(
    lane: &Lane<P, K>,
    req: &AdmissionRequest<K>,
    retry: &RetryBounds,
    target: Option<usize>,
    wait: Duration,
    now: Timestamp,
) -> Result<(), (RefusalReason, Option<RetryAfter>, Option<usize>)> {
    let Some(slo) = lane.config().ttft_slo(req.tier) else {
        return Ok(());
    };
    let Some(engine) = lane.predict_ttft(req.prompt_tokens, target, now) else {
        return Ok(());
    };
    let predicted = wait.saturating_add(engine);
    if predicted <= slo {
        return Ok(());
    }
    let r = RetryAfter::from_duration(predicted - slo).clamp(retry.min, retry.max);
    Err((RefusalReason::PredictedSloMiss, Some(r), None))
}

/// What the lane decided before the charges were taken.
#[derive(Debug, Clone, Copy)]
struct Placed {
    /// The backend to place it on now, if any.
    target: Option<usize>,
    /// The queued entry it displaces.
    displace: Option<Ticket>,
    decision: WatermarkDecision,
    /// Its wait budget.
    budget: Duration,
    /// Its place in the queue (0: not queued).
    position: usize,
    /// Its predicted wait before calibration.
    raw_wait: Option<Duration>,
}

/// Why a request that cannot go now may not queue either: no wait allowed in its zone, a
/// predicted wait past its budget, or a full queue that no displacement frees.
fn queue_refusal<P, K: Hash + Eq + Ord + Clone>(
    lane: &Lane<P, K>,
    (req, est): (&AdmissionRequest<K>, u64),
    retry: &RetryBounds,
    placed: &mut Placed,
    predicted: Option<Duration>,
) -> Option<LimitRefusal> {
    let pos = placed.position;
    if placed.budget.is_zero() {
        return Some((
            RefusalReason::Watermark(placed.decision.zone),
            capacity_retry(lane, retry, pos),
        ));
    }
    if let Some(wait) = predicted.filter(|w| *w > placed.budget) {
        let r = RetryAfter::from_duration(wait).clamp(retry.min, retry.max);
        return Some((RefusalReason::PredictedWait, Some(r)));
    }
    let Err(p) = lane.can_push(req.tier, est) else {
        return None;
    };
    // A displacement makes room for one entry, and for this one's tokens if the displaced
    // entry had as many: first a peer's in this tier with a longer backlog, else the newest
    // of the lowest tier below (a higher tier is never refused for a full queue while a lower
    // one waits in it).
    let fits = |&(_, cost): &(_, u64)| p == PushRefusal::QueueFull || cost >= est;
    let freed = match (placed.displace, p) {
        (Some(_), PushRefusal::QueueFull) => true,
        (None, PushRefusal::QueueFull | PushRefusal::TokensFull) => {
            match lane
                .displaceable(req.tier, &req.tenant)
                .filter(fits)
                .or_else(|| lane.lower_displaceable(req.tier).filter(fits))
            {
                Some((ticket, _)) => {
                    placed.displace = Some(ticket);
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
            capacity_retry(lane, retry, pos),
        )
    })
}

/// The four rate scopes of a request, in the one order their locks are taken: global,
/// model, tenant, the tenant's heavy rule (only for a heavy request). The global scope's
/// place is empty: a lane charges it from its share ([`GlobalShare`]), locked apart.
fn rate_scopes<'a>(
    model: &'a ScopeLimits,
    tenant: &'a TenantLimits,
    heavy: bool,
) -> [(Option<&'a ScopeLimits>, Scope); 4] {
    [
        (None, Scope::Global),
        (Some(model), Scope::Model),
        (Some(&tenant.limits), Scope::Tenant),
        (heavy.then_some(&tenant.heavy), Scope::TenantHeavy),
    ]
}

fn peek_rates(
    scopes: &[(Option<&ScopeLimits>, Scope); 4],
    est: u64,
    now: Timestamp,
) -> Result<(), LimitRefusal> {
    for (s, scope) in scopes {
        if let Some(s) = s {
            s.peek(est, now, *scope)?;
        }
    }
    Ok(())
}

/// Peeks every scope again and commits all of them under their locks, held together (in
/// the order of [`rate_scopes`]): all four are charged, or none.
fn take_rates(
    scopes: &[(Option<&ScopeLimits>, Scope); 4],
    est: u64,
    now: Timestamp,
) -> Result<[Charged; 4], LimitRefusal> {
    let mut guards = scopes.map(|(s, _)| s.and_then(ScopeLimits::rates));
    let mut peeked = [Peeked::default(); 4];
    for ((g, (_, scope)), p) in guards.iter().zip(scopes).zip(peeked.iter_mut()) {
        if let Some(g) = g {
            *p = g.peek(est, now, *scope)?;
        }
    }
    let mut charged = [(false, false); 4];
    for ((g, p), c) in guards.iter_mut().zip(peeked).zip(charged.iter_mut()) {
        if let Some(g) = g {
            *c = g.commit(p);
        }
    }
    Ok(charged)
}

/// The admission state of one gateway in one value: the shared limits and every model's
/// lane, each decision under `&mut self`. The gateway holds the same parts apart (each lane
/// behind its own lock); tests and benchmarks use this.
#[derive(Debug)]
pub struct Admission<T, K> {
    cfg: AdmissionConfig,
    shared: SharedLimits<K>,
    models: HashMap<K, LaneAdmission<T, K>, FastState>,
}

impl<T, K: Hash + Eq + Ord + Clone> Admission<T, K> {
    /// Builds the admission state. Call [`AdmissionConfig::validate`] first to report bad
    /// settings; here they are clamped.
    pub fn new(cfg: AdmissionConfig) -> Self {
        Admission {
            shared: SharedLimits::from_config(&cfg),
            models: HashMap::default(),
            cfg,
        }
    }

    /// The settings.
    pub fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    /// The limits every lane shares.
    pub fn shared(&self) -> &SharedLimits<K> {
        &self.shared
    }

    /// Applies new settings, keeping limiter state (debt) where the quotas did not change
    /// and the lanes' queues and backends.
    pub fn reconfigure(&mut self, cfg: AdmissionConfig) {
        self.shared.reconfigure_from(&cfg);
        for m in self.models.values_mut() {
            m.reconfigure(&cfg);
        }
        self.cfg = cfg;
    }

    /// Configures a tenant's limits and weight (replacing the default for it).
    pub fn set_tenant(&mut self, tenant: K, spec: TenantSpec) {
        self.shared.set_tenant(tenant, spec);
    }

    /// Adds or reconfigures a model and its lane (queue, watermarks, breaker settings).
    pub fn set_model(&mut self, model: K, spec: ModelSpec) {
        match self.models.get_mut(&model) {
            Some(m) => m.set_spec(spec),
            None => {
                self.models
                    .insert(model, LaneAdmission::new(spec, &self.cfg));
            }
        }
    }

    /// A model's admission state.
    pub fn lane_admission(&mut self, model: &K) -> Option<&mut LaneAdmission<T, K>> {
        self.models.get_mut(model)
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

    /// Decides one request at `now` (see [`LaneAdmission::admit`]).
    pub fn admit(&mut self, req: &AdmissionRequest<K>, item: T, now: Timestamp) -> Admit<T, K> {
        match self.models.get_mut(&req.model) {
            Some(m) => m.admit(&self.shared, req, item, now),
            None => refused(item, (RefusalReason::UnknownModel, None)),
        }
    }

    /// See [`LaneAdmission::dequeue`].
    pub fn dequeue(&mut self, model: &K, now: Timestamp) -> Option<Dispatched<T, K>> {
        self.models.get_mut(model)?.dequeue(&self.shared, now)
    }

    /// See [`LaneAdmission::observe`].
    pub fn observe(
        &mut self,
        grant: &Grant<K>,
        ttft: Option<Duration>,
        tpot: Option<Duration>,
    ) -> Option<Duration> {
        self.models
            .get_mut(&grant.model)?
            .observe(grant, ttft, tpot)
    }

    /// See [`LaneAdmission::expire`].
    pub fn expire(&mut self, model: &K, now: Timestamp) -> Vec<Expired<T>> {
        match self.models.get_mut(model) {
            Some(m) => m.expire(&self.shared, now),
            None => Vec::new(),
        }
    }

    /// See [`LaneAdmission::fail_unservable`].
    pub fn fail_unservable(&mut self, model: &K, now: Timestamp) -> Vec<Expired<T>> {
        match self.models.get_mut(model) {
            Some(m) => m.fail_unservable(&self.shared, now),
            None => Vec::new(),
        }
    }

    /// See [`LaneAdmission::drain`].
    pub fn drain(&mut self, model: &K, now: Timestamp) -> Vec<T> {
        match self.models.get_mut(model) {
            Some(m) => m.drain(&self.shared, now),
            None => Vec::new(),
        }
    }

    /// See [`LaneAdmission::has_displaced`].
    pub fn has_displaced(&self, model: &K) -> bool {
        self.models.get(model).is_some_and(|m| m.has_displaced())
    }

    /// See [`LaneAdmission::next_deadline`].
    pub fn next_deadline(&self, model: &K, now: Timestamp) -> Option<Timestamp> {
        self.models.get(model)?.next_deadline(now)
    }

    /// See [`LaneAdmission::position_of`].
    pub fn position_of(&self, model: &K, ticket: Ticket) -> Option<usize> {
        self.models.get(model)?.position_of(ticket)
    }

    /// See [`LaneAdmission::cancel`].
    pub fn cancel(&mut self, model: &K, ticket: Ticket, now: Timestamp) -> Option<T> {
        self.models
            .get_mut(model)?
            .cancel(&self.shared, ticket, now)
    }

    /// See [`LaneAdmission::redispatch`].
    pub fn redispatch(&mut self, grant: &mut Grant<K>, outcome: Outcome, now: Timestamp) -> bool {
        match self.models.get_mut(&grant.model) {
            Some(m) => m.redispatch(grant, outcome, now),
            None => false,
        }
    }

    /// See [`LaneAdmission::preempt`].
    pub fn preempt(&mut self, model: &K, now: Timestamp) -> Option<RunId> {
        self.models.get_mut(model)?.preempt(now)
    }

    /// See [`LaneAdmission::streams_to_cut`].
    pub fn streams_to_cut(&mut self, model: &K) -> Vec<StreamId> {
        self.models
            .get_mut(model)
            .map(LaneAdmission::streams_to_cut)
            .unwrap_or_default()
    }

    /// See [`LaneAdmission::grow`]; `Err` also for a model that is gone.
    pub fn grow(
        &mut self,
        grant: &mut Grant<K>,
        generated: u64,
        now: Timestamp,
    ) -> Result<Option<u64>, OverBudget> {
        match self.models.get_mut(&grant.model) {
            Some(m) => m.grow(grant, generated, now),
            None => Err(OverBudget),
        }
    }

    /// See [`LaneAdmission::hold_whole`]; `Err` also for a model that is gone.
    pub fn hold_whole(&mut self, grant: &mut Grant<K>, now: Timestamp) -> Result<(), OverBudget> {
        match self.models.get_mut(&grant.model) {
            Some(m) => m.hold_whole(grant, now),
            None => Err(OverBudget),
        }
    }

    /// See [`LaneAdmission::answered`].
    pub fn answered(&mut self, grant: &mut Grant<K>) {
        if let Some(m) = self.models.get_mut(&grant.model) {
            m.answered(grant);
        }
    }

    /// See [`LaneAdmission::requeue`]; `Err` also for a model that is gone (refunded).
    pub fn requeue(&mut self, grant: Grant<K>, item: T, now: Timestamp) -> Result<Ticket, T> {
        match self.models.get_mut(&grant.model) {
            Some(m) => m.requeue(&self.shared, grant, item, now),
            None => {
                self.refund(grant, now);
                Err(item)
            }
        }
    }

    /// See [`LaneAdmission::refund`].
    pub fn refund(&mut self, grant: Grant<K>, now: Timestamp) {
        if let Some(m) = self.models.get_mut(&grant.model) {
            m.refund(&self.shared, grant, now);
        }
    }

    /// See [`LaneAdmission::complete`].
    pub fn complete(&mut self, grant: Grant<K>, done: Completion, now: Timestamp) {
        if let Some(m) = self.models.get_mut(&grant.model) {
            m.complete(&self.shared, grant, done, now);
        }
    }

    /// The tenant's `x-ratelimit-*` figures at `now`.
    pub fn rate_limit_headers(&self, tenant: &K, now: Timestamp) -> RateLimitHeaders {
        self.shared.rate_limit_headers(tenant, now)
    }

    /// Global figures (`requests`, `tokens`, `concurrency`) for admin state.
    pub fn global_headers(&self, now: Timestamp) -> RateLimitHeaders {
        self.shared.global_headers(now)
    }

    /// Tenants with limiter state.
    pub fn tracked_tenants(&self) -> usize {
        self.shared.tracked_tenants()
    }

    /// Drops limiter state of idle tenants (optional housekeeping; the cap holds anyway).
    pub fn evict_idle(&mut self, now: Timestamp) -> usize {
        self.shared.evict_idle(now)
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
