//! A model's lane, the I/O side: its backends (URLs, scrapes, learned sizes), its dispatcher
//! task, and the glue that carries a request through levee-policy's admission state.
//!
//! Every decision is the policy's ([`crate::gateway::Adm`], one lock): this module only
//! delivers them. A request that must wait holds a oneshot receiver; the lane's dispatcher
//! task wakes whenever room may have freed (a request ended, a queued one left, a scrape
//! changed a backend) or a queued deadline passes, asks the policy what goes next, and hands
//! each waiter its [`Admitted`] — never while holding the lock, so a waiter that has gone
//! away (its receiver dropped) gives its grant back through [`Admitted`]'s drop, which takes
//! the lock itself.
//!
//! * A waiter whose client disconnects is dropped by hyper; its [`QueueGuard`] cancels the
//!   ticket at once (refunding its charges), so a gone client never reaches a backend.
//! * An [`Admitted`] request ends exactly once: [`Admitted::complete`] with the backend's
//!   outcome and usage, or, when dropped before that, as cancelled (refunded if nothing was
//!   sent upstream yet).

use crate::error::GatewayError;
use crate::gateway::{Adm, Gateway};
use crate::metrics::{ModelLabel, TierLabel};
use crate::upstream::Backend;
use levee_policy::{
    AdmissionRequest, Admit, Clock, Completion, Expired, Grant, Key, LoadSignals, Outcome,
    PrefillFit, Refusal, RefusalReason, Ticket, Timestamp, Unservable,
};
use parking_lot::{Mutex, RwLock};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::{oneshot, Notify};

/// What a queued request receives: its admission, or why it will not get one.
type WaiterResult = Result<Admitted, GatewayError>;

/// A queued request's channel.
#[derive(Debug)]
pub struct Waiter {
    tx: oneshot::Sender<WaiterResult>,
    tier: Arc<str>,
}

/// Where one request stands in its lane, for whoever watches it wait: an async task's
/// status, or the SSE comments of a streaming request that opted in.
#[derive(Debug, Default)]
pub struct QueueSpot {
    state: Mutex<Spot>,
    /// Fires when the request is queued and when it is dispatched.
    changed: Notify,
    /// The watcher wants position comments (set once the request is classified).
    pub updates: AtomicBool,
    /// A task of the batch band: its dispatch fences its backend for its predicted
    /// prefill ([`Lane::fence_for_batch`]).
    pub batch: AtomicBool,
}

#[derive(Debug, Clone, Default)]
enum Spot {
    #[default]
    Before,
    Queued {
        model: Key,
        ticket: Ticket,
    },
    Dispatched,
}

impl QueueSpot {
    fn set(&self, s: Spot) {
        *self.state.lock() = s;
        self.changed.notify_one();
    }

    /// Waits until the request is queued or dispatched (returns at once if a change came
    /// since the last call).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Whether the request left the queue for a backend.
    pub fn dispatched(&self) -> bool {
        matches!(*self.state.lock(), Spot::Dispatched)
    }

    /// Its place in the lane's serving order now (1 = next), while it is queued.
    pub fn position(&self, gw: &Gateway) -> Option<(Key, usize)> {
        let (model, ticket) = match &*self.state.lock() {
            Spot::Queued { model, ticket } => (model.clone(), *ticket),
            _ => return None,
        };
        let p = gw.admission.lock().position_of(&model, ticket)?;
        Some((model, p))
    }
}

/// How long the TTFT and refusal windows look back.
const WINDOW: Duration = Duration::from_secs(10);

/// One model's lane.
pub struct Lane {
    /// The model (its key in the admission state).
    pub model: Key,
    backends: RwLock<Vec<Arc<Backend>>>,
    wake: Notify,
    retired: AtomicBool,
    /// Recent TTFTs (seconds) and capacity refusals, for the degradation signals.
    recent: Mutex<Recent>,
    /// Time to first token over prompt tokens of the last streamed responses.
    prefill: Mutex<PrefillFit>,
}

#[derive(Debug, Default)]
struct Recent {
    ttft: VecDeque<(Timestamp, f64)>,
    outcomes: VecDeque<(Timestamp, bool)>,
}

impl Recent {
    fn trim(&mut self, now: Timestamp) {
        let old = |t: &Timestamp| now.saturating_duration_since(*t) > WINDOW;
        while self.ttft.front().is_some_and(|(t, _)| old(t)) {
            self.ttft.pop_front();
        }
        while self.outcomes.front().is_some_and(|(t, _)| old(t)) {
            self.outcomes.pop_front();
        }
        // Bounded whatever the rate: keep the newest.
        const MAX: usize = 4096;
        while self.ttft.len() > MAX {
            self.ttft.pop_front();
        }
        while self.outcomes.len() > MAX {
            self.outcomes.pop_front();
        }
    }
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").field("model", &self.model).finish()
    }
}

impl Lane {
    /// A lane with no backends yet.
    pub fn new(model: Key) -> Arc<Lane> {
        Arc::new(Lane {
            model,
            backends: RwLock::new(Vec::new()),
            wake: Notify::new(),
            retired: AtomicBool::new(false),
            recent: Mutex::new(Recent::default()),
            prefill: Mutex::new(PrefillFit::new()),
        })
    }

    /// Wakes the dispatcher: room may have freed, or the lane's state changed.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Spawns the dispatcher task: it runs [`Lane::pump`] whenever woken, and at the
    /// earliest queued deadline.
    pub fn spawn_dispatcher(self: &Arc<Self>, gw: Weak<Gateway>) {
        let Some(stop) = gw.upgrade().map(|g| g.stopped_token()) else {
            return;
        };
        spawn_pump(self.clone(), |l| &l.wake, gw, stop, |l, g| l.pump(g));
    }

    /// Answers what must be answered now — expired waiters, and every waiter when the lane
    /// cannot serve anything — and dispatches every queued request that may go. Returns when
    /// to run again for the next deadline.
    pub fn pump(self: &Arc<Self>, gw: &Arc<Gateway>) -> Option<tokio::time::Instant> {
        let now = gw.clock.now();
        let (gone, ready, next) = {
            let mut adm = gw.admission.lock();
            let mut gone = adm.expire(&self.model, now);
            gone.extend(adm.fail_unservable(&self.model, now));
            let mut ready = Vec::new();
            while let Some(d) = adm.dequeue(&self.model, now) {
                ready.push(d);
            }
            let next = adm.next_deadline(&self.model, now);
            if let Some(l) = adm.lane(&self.model) {
                gw.metrics
                    .lane_load
                    .get_or_create(&ModelLabel {
                        model: self.model.to_string(),
                    })
                    .set(i64::try_from(l.load()).unwrap_or(i64::MAX));
            }
            (gone, ready, next)
        };
        for e in gone {
            self.left_queue(gw, &e.item.tier);
            let err = expired_error(&self.model, &e);
            self.note_outcome(now, true);
            let _ = e.item.tx.send(Err(err));
        }
        for d in ready {
            self.left_queue(gw, &d.item.tier);
            gw.metrics
                .queue_wait
                .get_or_create(&TierLabel {
                    tier: d.item.tier.to_string(),
                })
                .observe(d.waited.as_secs_f64());
            let admitted = Admitted::new(gw, self, d.grant, d.waited);
            // A receiver that went away returns the admission, whose drop refunds it and
            // wakes this lane again.
            let _ = d.item.tx.send(Ok(admitted));
        }
        next.map(|t| gw.clock.instant_at(t))
    }

    fn left_queue(&self, gw: &Gateway, tier: &str) {
        gw.queued.fetch_sub(1, Ordering::AcqRel);
        gw.metrics.queued.dec();
        gw.metrics
            .queue_depth
            .get_or_create(&TierLabel {
                tier: tier.to_string(),
            })
            .dec();
    }

    /// Answers every queued waiter with 503 (drain / shutdown).
    pub fn drain_queue(&self, gw: &Gateway, retry_after: Duration) {
        let now = gw.clock.now();
        let items = gw.admission.lock().drain(&self.model, now);
        for w in items {
            self.left_queue(gw, &w.tier);
            let _ = w.tx.send(Err(GatewayError::draining(retry_after)));
        }
    }

    /// A backend of this lane by id (reload keeps its live state).
    pub fn existing_backend(&self, id: &str) -> Option<Arc<Backend>> {
        self.backends.read().iter().find(|b| b.id == id).cloned()
    }

    /// The backends.
    pub fn backends(&self) -> Vec<Arc<Backend>> {
        self.backends.read().clone()
    }

    /// The backend with admission key `key`.
    pub fn backend(&self, key: &str) -> Option<Arc<Backend>> {
        self.backends
            .read()
            .iter()
            .find(|b| &*b.key == key)
            .cloned()
    }

    /// Sets the backends (the admission state gets their limits from the caller).
    pub fn set_backends(&self, backends: Vec<Arc<Backend>>) {
        self.retired.store(false, Ordering::Relaxed);
        *self.backends.write() = backends;
    }

    /// Marks the lane as belonging to a model removed from the config.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    /// Whether the model was removed by a reload.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Records a time to first token of this lane.
    pub fn note_ttft(&self, now: Timestamp, ttft: Duration) {
        let mut r = self.recent.lock();
        r.ttft.push_back((now, ttft.as_secs_f64()));
        r.trim(now);
    }

    /// Records a streamed response's prompt (levee's estimate) and its time to first token,
    /// for the prefill fit.
    pub fn note_prefill(&self, prompt_tokens: u64, ttft: Duration) {
        self.prefill.lock().note(prompt_tokens, ttft);
    }

    /// The predicted time from dispatch to the first token of a prompt of `prompt_tokens`
    /// (see [`PrefillFit::predict`]); `None` until enough streamed responses were measured.
    pub fn predict_prefill(&self, prompt_tokens: u64) -> Option<Duration> {
        self.prefill.lock().predict(prompt_tokens)
    }

    /// Sets the lane's prefill window from its streamed responses: the 90th percentile of
    /// their times to first token (a request dispatched longer ago than that has most likely
    /// had its prefill step). Nothing before any was measured.
    pub fn update_prefill_window(&self, gw: &Gateway) {
        let window = self.prefill.lock().ttft_quantile(0.9);
        if let Some(w) = window {
            gw.admission.lock().set_prefill_window(&self.model, w);
        }
    }

    /// A batch task of `prompt_tokens` was just placed on backend `key`: fences that
    /// backend until its prompt is predicted prefilled, so interactive requests go to
    /// another backend meanwhile. Nothing without a prediction.
    fn fence_for_batch(&self, gw: &Gateway, key: &str, prompt_tokens: u64) {
        if let Some(p) = self.predict_prefill(prompt_tokens) {
            let until = gw.clock.now() + p;
            gw.admission.lock().fence_backend(&self.model, key, until);
        }
    }

    /// Records whether a request of this lane was refused for capacity.
    pub fn note_outcome(&self, now: Timestamp, refused: bool) {
        let mut r = self.recent.lock();
        r.outcomes.push_back((now, refused));
        r.trim(now);
    }

    /// The lane's degradation signals: `queue_ratio` and `kv` as given, P95 TTFT over 1.5×
    /// `slo`, and the share of capacity refusals, over the last 10 s.
    pub fn signals(
        &self,
        queue_ratio: f64,
        kv: f64,
        slo: Option<Duration>,
        now: Timestamp,
    ) -> LoadSignals {
        let mut r = self.recent.lock();
        r.trim(now);
        let ttft_ratio = match slo {
            Some(slo) if !slo.is_zero() => {
                let mut v: Vec<f64> = r.ttft.iter().map(|(_, s)| *s).collect();
                levee_policy::nearest_rank(&mut v, 0.95)
                    .map_or(0.0, |p95| p95 / (1.5 * slo.as_secs_f64()))
            }
            _ => 0.0,
        };
        let refusal_rate = if r.outcomes.is_empty() {
            0.0
        } else {
            r.outcomes.iter().filter(|(_, x)| *x).count() as f64 / r.outcomes.len() as f64
        };
        LoadSignals {
            queue_depth_ratio: queue_ratio,
            kv_cache_usage: kv,
            ttft_ratio,
            refusal_rate,
        }
    }

    /// The lane's part of `/admin/state`.
    /// `tier_names[p]` names priority `p`.
    pub fn state_json(
        &self,
        adm: &Adm,
        now: Timestamp,
        tier_names: &[String],
    ) -> serde_json::Value {
        let Some(l) = adm.lane(&self.model) else {
            return serde_json::json!({"model": &*self.model, "retired": self.is_retired()});
        };
        let stats = l.queue_stats();
        let tiers: Vec<_> = stats
            .tiers
            .iter()
            .enumerate()
            .map(|(i, t)| {
                serde_json::json!({
                    "tier": tier_names.get(i),
                    "priority": i,
                    "queued": t.len,
                    "tokens": t.tokens,
                    "backlogged_tenants": t.backlogged_tenants,
                })
            })
            .collect();
        let tenants: Vec<_> = l
            .backlogged()
            .map(|(tier, k, n, tok)| {
                serde_json::json!({"tenant": &**k, "priority": tier.0, "queued": n, "tokens": tok})
            })
            .collect();
        let backends: Vec<_> = l
            .backend_stats(now)
            .into_iter()
            .map(|st| {
                let b = self.backend(&st.id);
                serde_json::json!({
                    "id": &*st.id,
                    "url": b.as_ref().map(|b| b.base.clone()),
                    "kind": b.as_ref().map(|b| b.kind),
                    "healthy": st.routable,
                    "in_flight": st.in_flight,
                    "max_in_flight": st.request_cap,
                    "tokens_in_flight": st.tokens_in_flight,
                    "kv_tokens": st.kv_tokens,
                    "learned": b.as_ref().map(|b| b.learned()),
                    "adaptive_limit": b.as_ref().and_then(|b| b.adaptive_limit()),
                    "reported": b.as_ref().and_then(|b| b.reported()),
                    "breaker": {
                        "state": st.breaker.state.as_str(),
                        "window_requests": st.breaker.window_requests,
                        "window_failures": st.breaker.window_failures,
                        "consecutive_failures": st.breaker.consecutive_failures,
                        "opened_total": st.breaker.opened_total,
                    },
                })
            })
            .collect();
        serde_json::json!({
            "model": &*self.model,
            "retired": self.is_retired(),
            "queued": stats.len,
            "queued_tokens": stats.tokens,
            "in_flight": l.in_flight(),
            "load": l.load(),
            "mean_service_s": l.mean_service().map(|d| d.as_secs_f64()),
            "dispatch_rate_per_s": l.dispatch_rate(now),
            "tiers": tiers,
            "tenants": tenants,
            "backends": backends,
        })
    }
}

/// The answer for a queued request that leaves the queue unserved.
fn expired_error(model: &str, e: &Expired<Waiter>) -> GatewayError {
    let retry = e.retry_after.as_duration();
    let err = match e.reason {
        RefusalReason::Unservable(Unservable::CircuitOpen) => {
            GatewayError::circuit_open(model, retry)
        }
        RefusalReason::Unservable(Unservable::NoHealthyBackend) => {
            GatewayError::no_healthy_backend(model, retry)
        }
        RefusalReason::Displaced => GatewayError::displaced(retry),
        _ => GatewayError::queue_timeout(e.waited, retry),
    };
    err.with_refusal(e.reason)
}

/// Removes a waiter's ticket from the queue if its future is dropped (client gone).
struct QueueGuard<'a> {
    gw: &'a Gateway,
    lane: &'a Lane,
    ticket: Ticket,
    armed: bool,
}

impl Drop for QueueGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let now = self.gw.clock.now();
        let item = self
            .gw
            .admission
            .lock()
            .cancel(&self.lane.model, self.ticket, now);
        // Counted as abandonment by the request's own phase (`levee_tenant_abandoned_total`).
        if let Some(w) = item {
            self.lane.left_queue(self.gw, &w.tier);
        }
        // A cancel changes who may go next (fair shares, the head of the queue).
        self.lane.wake();
    }
}

/// A request that holds a backend placement (or, before dispatch, its charges). It ends
/// exactly once: [`Admitted::complete`], or its drop.
pub struct Admitted {
    gw: Arc<Gateway>,
    lane: Arc<Lane>,
    grant: Option<Grant<Key>>,
    /// Time spent queued before dispatch.
    pub waited: Duration,
    sent: bool,
    /// Its charge in the shared limit store, settled when it ends.
    charge: Option<crate::shared::Charge>,
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admitted")
            .field("backend", &self.grant.as_ref().and_then(|g| g.backend()))
            .finish()
    }
}

impl Admitted {
    fn new(gw: &Arc<Gateway>, lane: &Arc<Lane>, grant: Grant<Key>, waited: Duration) -> Self {
        gw.in_flight.fetch_add(1, Ordering::AcqRel);
        gw.metrics.in_flight.inc();
        Admitted {
            gw: gw.clone(),
            lane: lane.clone(),
            grant: Some(grant),
            waited,
            sent: false,
            charge: None,
        }
    }

    /// Gives it the charge taken in the shared limit store, to settle when it ends.
    pub fn attach(&mut self, charge: Option<crate::shared::Charge>) {
        self.charge = charge;
    }

    /// The tenant's figures from the shared limit store, if it was decided there.
    pub fn shared_figures(&self) -> Option<levee_store::Figures> {
        self.charge.as_ref().map(|c| c.figures)
    }

    /// The backend it was placed on.
    pub fn backend(&self) -> Option<Arc<Backend>> {
        let key = self.grant.as_ref()?.backend()?;
        self.lane.backend(key)
    }

    /// Tokens reserved (prompt estimate + completion budget).
    pub fn tokens(&self) -> u64 {
        self.grant.as_ref().map_or(0, |g| g.tokens())
    }

    /// Marks that the request is going upstream: from now on, an end without an outcome
    /// counts as a cancelled request, not as one never served.
    pub fn mark_sent(&mut self) {
        self.sent = true;
    }

    /// Moves it to another backend with room after its backend failed before anything
    /// reached the client (`outcome` goes to the failed backend's breaker). `false` if no
    /// other backend can take it now.
    pub fn redispatch(&mut self, outcome: Outcome) -> bool {
        let now = self.gw.clock.now();
        let Some(g) = self.grant.as_mut() else {
            return false;
        };
        let moved = self.gw.admission.lock().redispatch(g, outcome, now);
        self.lane.wake();
        self.sent = false;
        moved
    }

    /// Ends it with the backend's outcome and real usage.
    pub fn complete(mut self, done: Completion) {
        if let Some(g) = self.grant.take() {
            let now = self.gw.clock.now();
            self.gw.admission.lock().complete(g, done, now);
            if let Some(c) = self.charge.take() {
                match done.actual_tokens {
                    Some(actual) => c.reconcile(actual),
                    None => c.keep(),
                }
            }
            self.finish();
        }
    }

    fn finish(&self) {
        self.gw.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.gw.metrics.in_flight.dec();
        self.lane.wake();
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let Some(g) = self.grant.take() else { return };
        let now = self.gw.clock.now();
        {
            let mut adm = self.gw.admission.lock();
            if self.sent {
                // Cut short (client gone, or the proxy gave up): the backend may have spent
                // the tokens, so the estimate stays charged.
                let done = Completion {
                    outcome: Outcome::Cancelled,
                    actual_tokens: None,
                };
                adm.complete(g, done, now);
                if let Some(c) = self.charge.take() {
                    c.keep();
                }
            } else {
                adm.refund(g, now);
                // Dropping the charge refunds it.
                self.charge = None;
            }
        }
        self.finish();
    }
}

/// Takes `req` through the admission state: dispatched at once, or queued until the lane's
/// dispatcher hands it a backend (or its wait ends), or refused.
pub async fn admit(
    gw: &Arc<Gateway>,
    lane: &Arc<Lane>,
    tier: &str,
    req: AdmissionRequest<Key>,
    spot: Option<&QueueSpot>,
) -> Result<Admitted, GatewayError> {
    let now = gw.clock.now();
    if spot.is_some_and(|s| s.batch.load(Ordering::Relaxed)) {
        lane.update_prefill_window(gw);
    }
    let (tx, rx) = oneshot::channel();
    let tier: Arc<str> = Arc::from(tier);
    let waiter = Waiter {
        tx,
        tier: tier.clone(),
    };
    let decided = {
        let mut adm = gw.admission.lock();
        let d = adm.admit(&req, waiter, now);
        match d {
            Admit::Refused(r) => {
                let rate = adm.rate_limit_headers(&req.tenant, now);
                Err(refusal_error(&req, r, rate))
            }
            other => {
                if matches!(other, Admit::Queued { .. }) {
                    gw.queued.fetch_add(1, Ordering::AcqRel);
                }
                Ok(other)
            }
        }
    };
    let decided = match decided {
        Ok(d) => d,
        Err(e) => {
            let capacity = e
                .refusal
                .is_some_and(|r| !matches!(r.code(), "rate_limit_exceeded"));
            lane.note_outcome(now, capacity);
            return Err(e);
        }
    };
    match decided {
        Admit::Dispatch(d) => {
            lane.note_outcome(now, false);
            let a = Admitted::new(gw, lane, d.grant, Duration::ZERO);
            if let Some(s) = spot {
                dispatched(gw, lane, s, &a, req.prompt_tokens);
            }
            Ok(a)
        }
        Admit::Queued {
            ticket, position, ..
        } => {
            gw.metrics.queued.inc();
            gw.metrics
                .queue_depth
                .get_or_create(&TierLabel {
                    tier: tier.to_string(),
                })
                .inc();
            // Dispatch what may go, and answer a request this one displaced from a full lane
            // (displacement only happens to a request that then queues).
            lane.wake();
            if let Some(s) = spot {
                s.set(Spot::Queued {
                    model: lane.model.clone(),
                    ticket,
                });
            }
            let mut guard = QueueGuard {
                gw,
                lane,
                ticket,
                armed: true,
            };
            let got = rx.await;
            guard.armed = false;
            match got {
                Ok(Ok(a)) => {
                    lane.note_outcome(now, false);
                    if let Some(s) = spot {
                        dispatched(gw, lane, s, &a, req.prompt_tokens);
                    }
                    Ok(a)
                }
                // A refusal after waiting carries the place the request took on arrival.
                Ok(Err(e)) if e.position.is_none() => {
                    Err(e.with_position(u32::try_from(position).unwrap_or(u32::MAX)))
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Err(GatewayError::internal(
                    "the lane's dispatcher stopped while this request waited",
                )),
            }
        }
        Admit::Refused(_) => Err(GatewayError::internal("unreachable refusal")),
    }
}

/// Marks a watched request dispatched; a batch task first fences its backend.
fn dispatched(gw: &Gateway, lane: &Lane, spot: &QueueSpot, a: &Admitted, prompt_tokens: u64) {
    if spot.batch.load(Ordering::Relaxed) {
        if let Some(key) = a.grant.as_ref().and_then(|g| g.backend()) {
            lane.fence_for_batch(gw, key, prompt_tokens);
        }
    }
    spot.set(Spot::Dispatched);
}

/// The HTTP error of a refusal, with the tenant's rate-limit figures.
fn refusal_error(
    req: &AdmissionRequest<Key>,
    r: Refusal<Waiter>,
    rate: levee_policy::RateLimitHeaders,
) -> GatewayError {
    let retry = r
        .retry_after
        .map(|x| x.as_duration())
        .unwrap_or(Duration::from_secs(1));
    let rate_info = crate::error::RateInfo {
        limit_requests: rate.requests.map(|i| i.limit),
        remaining_requests: rate.requests.map(|i| i.remaining),
        reset_requests: rate.requests.map(|i| i.reset_after),
        limit_tokens: rate.tokens.map(|i| i.limit),
        remaining_tokens: rate.tokens.map(|i| i.remaining),
        reset_tokens: rate.tokens.map(|i| i.reset_after),
    };
    let tokens = req.tokens();
    let e = match r.reason {
        RefusalReason::RequestRate(s) => GatewayError::rate_limited(
            &format!("{} requests per minute", scope_name(s, req)),
            retry,
            crate::error::RateInfo {
                remaining_requests: Some(0),
                ..rate_info
            },
        ),
        RefusalReason::TokenRate(s) => GatewayError::rate_limited(
            &format!(
                "{} tokens per minute ({tokens} tokens estimated)",
                scope_name(s, req)
            ),
            retry,
            rate_info,
        ),
        RefusalReason::Concurrency(s) => match s {
            levee_policy::Scope::Tenant | levee_policy::Scope::TenantHeavy => {
                GatewayError::rate_limited(
                    &format!("{}: requests in flight at its limit", scope_name(s, req)),
                    retry,
                    rate_info,
                )
            }
            _ => GatewayError::capacity_overload(
                &format!("{} concurrency at its limit", scope_name(s, req)),
                retry,
            ),
        },
        RefusalReason::TooLarge(s) => GatewayError::bad_request(format!(
            "this request needs about {tokens} tokens but the {} token quota is smaller; \
             lower max_tokens or shorten the prompt",
            scope_name(s, req)
        ))
        .with_param("max_tokens"),
        RefusalReason::ExceedsKvBudget => GatewayError::context_length_exceeded(format!(
            "this request needs about {tokens} tokens of KV cache (prompt + max_tokens × n), \
             more than any backend of {:?} holds; lower max_tokens or shorten the prompt",
            &*req.model
        )),
        RefusalReason::Watermark(zone) => GatewayError::capacity_overload(
            &format!("model {:?} load in zone {}", &*req.model, zone.as_str()),
            retry,
        ),
        RefusalReason::QueueFull(p) => GatewayError::capacity_overload(
            &format!("model {:?} queue: {}", &*req.model, p.as_str()),
            retry,
        ),
        RefusalReason::PredictedWait => GatewayError::capacity_overload(
            &format!(
                "position {} in the queue of {:?}; the predicted wait of {} ms exceeds this \
                 request's wait budget",
                r.position.unwrap_or(0),
                &*req.model,
                retry.as_millis()
            ),
            retry,
        ),
        RefusalReason::QueueTimeout => GatewayError::queue_timeout(Duration::ZERO, retry),
        RefusalReason::Displaced => GatewayError::displaced(retry),
        RefusalReason::Unservable(Unservable::CircuitOpen) => {
            GatewayError::circuit_open(&req.model, retry)
        }
        RefusalReason::Unservable(Unservable::NoHealthyBackend) => {
            GatewayError::no_healthy_backend(&req.model, retry)
        }
        RefusalReason::UnknownModel => GatewayError::unknown_model(&req.model),
    };
    let e = e.with_refusal(r.reason);
    match r.position {
        Some(p) => e.with_position(u32::try_from(p).unwrap_or(u32::MAX)),
        None => e,
    }
}

fn scope_name(s: levee_policy::Scope, req: &AdmissionRequest<Key>) -> String {
    match s {
        levee_policy::Scope::Global => "global".to_string(),
        levee_policy::Scope::Model => format!("model {}", req.model),
        levee_policy::Scope::Tenant => format!("tenant {}", req.tenant),
        levee_policy::Scope::TenantHeavy => format!("tenant {} heavy requests", req.tenant),
    }
}

/// Spawns a task that runs `step` at once, then whenever `wake(owner)` is notified or the time
/// `step` returned comes, until `stop` is cancelled or the gateway is gone: the loop behind
/// each lane's dispatcher and the task feeder.
pub(crate) fn spawn_pump<S: Send + Sync + 'static>(
    owner: Arc<S>,
    wake: fn(&S) -> &Notify,
    gw: Weak<Gateway>,
    stop: tokio_util::sync::CancellationToken,
    step: impl Fn(&Arc<S>, &Arc<Gateway>) -> Option<tokio::time::Instant> + Send + 'static,
) {
    tokio::spawn(async move {
        loop {
            let notified = wake(&owner).notified();
            tokio::pin!(notified);
            // Register before stepping, so a wake during the step is not lost.
            notified.as_mut().enable();
            let next = {
                let Some(g) = gw.upgrade() else { break };
                step(&owner, &g)
            };
            let sleep = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = &mut notified => {}
                _ = sleep => {}
            }
        }
    });
}
