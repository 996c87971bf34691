//! The request side of a lane: taking a request through its lane's admission (dispatched at
//! once, queued until the dispatcher hands it a backend, or refused), and the admission it
//! then holds.
//!
//! * A waiter whose client disconnects is dropped by hyper; its [`QueueGuard`] cancels the
//!   ticket at once (refunding its charges), so a gone client never reaches a backend.
//! * An [`Admitted`] request ends exactly once: [`Admitted::complete`] with the backend's
//!   outcome and usage, or, when dropped before that, as cancelled (refunded if nothing was
//!   sent upstream yet).

use super::Lane;
use crate::error::{GatewayError, RateInfo};
use crate::metrics::TierLabel;
use crate::upstream::Backend;
use levee_policy::{
    AdmissionRequest, Admit, Clock, Completion, Expired, Grant, Key, Outcome, OverBudget,
    RateLimitHeaders, Refusal, RefusalReason, Scope, TenantLimits, Ticket, Unservable,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, Notify};

/// What a queued request receives: its admission, or why it will not get one.
type WaiterResult = Result<Admitted, GatewayError>;

/// A queued request's channel. The answer travels boxed: a channel holds room for its
/// value from the start, and a queued request should not hold an admission's worth of it
/// while it waits.
#[derive(Debug)]
pub(crate) struct Waiter {
    tx: oneshot::Sender<Box<WaiterResult>>,
    /// Its tier's name (metric label).
    pub tier: Arc<str>,
}

impl Waiter {
    /// Hands the waiter its answer; one that went away drops it (an admission's drop gives
    /// its grant back).
    pub fn answer(self, r: WaiterResult) {
        let _ = self.tx.send(Box::new(r));
    }
}

/// Where one request stands in its lane, for whoever watches it wait: an async task's
/// status, or the SSE comments of a streaming request that opted in.
#[derive(Debug, Default)]
pub(crate) struct QueueSpot {
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
        lane: Arc<Lane>,
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

    /// Its lane and its place in the lane's serving order now (1 = next), while queued.
    pub fn position(&self) -> Option<(Arc<Lane>, usize)> {
        let (lane, ticket) = match &*self.state.lock() {
            Spot::Queued { lane, ticket } => (lane.clone(), *ticket),
            _ => return None,
        };
        let p = lane.admission().position_of(ticket)?;
        Some((lane, p))
    }
}

/// Removes a waiter's ticket from the queue if its future is dropped (client gone).
struct QueueGuard<'a> {
    lane: &'a Lane,
    ticket: Ticket,
    armed: bool,
}

impl Drop for QueueGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let ctx = &self.lane.ctx;
        let now = ctx.clock.now();
        let item = self.lane.admission().cancel(&ctx.limits, self.ticket, now);
        // Counted as abandonment by the request's own phase (`levee_tenant_abandoned_total`).
        if let Some(w) = item {
            self.lane.left_queue(&w.tier);
        }
        // A cancel changes who may go next (fair shares, the head of the queue).
        self.lane.wake();
    }
}

/// A request that holds a backend placement (or, before dispatch, its charges). It ends
/// exactly once: [`Admitted::complete`], or its drop.
pub(crate) struct Admitted {
    lane: Arc<Lane>,
    grant: Option<Grant<Key>>,
    /// Time spent queued before dispatch.
    pub waited: Duration,
    sent: bool,
    /// Its charge in the shared limit store, settled when it ends (boxed: most requests
    /// carry none, and a queued request holds this struct's room in its future).
    charge: Option<Box<crate::shared::Charge>>,
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admitted")
            .field("backend", &self.grant.as_ref().and_then(|g| g.backend()))
            .finish()
    }
}

impl Admitted {
    /// The admission of `grant` in `lane`, counted in flight until it ends.
    pub(crate) fn new(lane: &Arc<Lane>, grant: Grant<Key>, waited: Duration) -> Self {
        lane.ctx.in_flight.fetch_add(1, Ordering::AcqRel);
        lane.ctx.metrics.in_flight.inc();
        if let Some(run) = grant.run() {
            lane.cuts.register(run.get());
        }
        Admitted {
            lane: lane.clone(),
            grant: Some(grant),
            waited,
            sent: false,
            charge: None,
        }
    }

    /// Gives it the charge taken in the shared limit store, to settle when it ends.
    pub fn attach(&mut self, charge: Option<Box<crate::shared::Charge>>) {
        self.charge = charge;
    }

    /// The tenant's figures from the shared limit store, if it was decided there.
    pub fn shared_figures(&self) -> Option<levee_store::Figures> {
        self.charge.as_ref().map(|c| c.figures)
    }

    /// Its tier's priority.
    pub fn priority(&self) -> Option<u8> {
        self.grant.as_ref().map(|g| g.tier().0)
    }

    /// The backend it was placed on.
    pub fn backend(&self) -> Option<Arc<Backend>> {
        let key = self.grant.as_ref()?.backend()?;
        self.lane.backend(key)
    }

    /// The signal that it is to be cut short, while it may be (`queue.preempt_over_share`).
    pub fn cut_signal(&self) -> Option<Arc<Notify>> {
        let run = self.grant.as_ref()?.run()?;
        self.lane.cuts.get(run.get())
    }

    /// Its answer started reaching the client: it can no longer be cut short.
    pub fn answered(&mut self) {
        let Some(g) = self.grant.as_mut() else { return };
        let Some(run) = g.run() else { return };
        self.lane.admission().answered(g);
        self.lane.cuts.forget(run.get());
    }

    /// Gives its backend slot back and queues it again, its charges kept, after it was cut
    /// short for a tenant under its share ([`Admitted::cut_signal`]); `tier` names its tier
    /// (metric label). The caller waits on the answer for its new placement; this
    /// admission is then spent (its drop does nothing), and its fleet-wide charge goes to
    /// the new one ([`Admitted::take_over`]). `Err` when its queue has no room for it.
    pub fn requeue(&mut self, tier: &str) -> Result<QueueWait, GatewayError> {
        let ctx = &self.lane.ctx;
        let Some(g) = self.grant.take() else {
            return Err(GatewayError::internal("a request was queued again twice"));
        };
        if let Some(run) = g.run() {
            self.lane.cuts.forget(run.get());
        }
        let now = ctx.clock.now();
        let (tx, rx) = oneshot::channel();
        let tier: Arc<str> = Arc::from(tier);
        let waiter = Waiter {
            tx,
            tier: tier.clone(),
        };
        let prompt_tokens = g.prompt_tokens();
        let queued = self.lane.admission().requeue(&ctx.limits, g, waiter, now);
        // Out of flight whatever came of it; the wait counts it queued.
        self.finish(false);
        ctx.metrics
            .preempted
            .get_or_create(&crate::metrics::ModelLabel {
                model: self.lane.model.to_string(),
            })
            .inc();
        match queued {
            Ok(ticket) => Ok(QueueWait {
                q: Queued {
                    ticket,
                    position: 1,
                    tier,
                    prompt_tokens,
                    at: now,
                },
                rx,
            }),
            Err(_) => Err(GatewayError::capacity_overload(
                "this request was cut short for a tenant under its fair share, and its queue \
                 had no room to take it back",
                Duration::from_secs(1),
            )),
        }
    }

    /// Takes over the fleet-wide charge of `spent`, an admission queued again
    /// ([`Admitted::requeue`]).
    pub fn take_over(&mut self, spent: &mut Admitted) {
        self.charge = spent.charge.take();
    }

    /// Marks that the request is going upstream: from now on, an end without an outcome
    /// counts as a cancelled request, not as one never served.
    pub fn mark_sent(&mut self) {
        self.sent = true;
    }

    /// The request never reached a backend (nothing listened): its end refunds it.
    pub fn never_reached(&mut self) {
        self.sent = false;
    }

    /// Moves it to another backend with room after its backend failed before anything
    /// reached the client (`outcome` goes to the failed backend's breaker). `false` if no
    /// other backend can take it now: it then holds no placement, but it did reach a
    /// backend, so its charges stand when it ends.
    pub fn redispatch(&mut self, outcome: Outcome) -> bool {
        let now = self.lane.ctx.clock.now();
        let Some(g) = self.grant.as_mut() else {
            return false;
        };
        if let Some(run) = g.run() {
            self.lane.cuts.forget(run.get());
        }
        // On another backend it is a new stream.
        if let Some(id) = g.stream() {
            self.lane.taken.forget(id.get());
        }
        let moved = self.lane.admission().redispatch(g, outcome, now);
        self.lane.wake();
        if let Some(run) = g.run() {
            self.lane.cuts.register(run.get());
        }
        if moved {
            // Not sent to the new backend yet.
            self.sent = false;
        }
        moved
    }

    /// Feeds its response's time to first token and time per output token (from sending)
    /// to its backend's latency fit; returns the time to first token predicted when it was
    /// placed.
    pub fn observe(&self, ttft: Duration, tpot: Option<Duration>) -> Option<Duration> {
        let g = self.grant.as_ref()?;
        self.lane.admission().observe(g, Some(ttft), tpot)
    }

    /// The count of its stream's generated tokens at which its KV hold must grow
    /// (`kv.grow_streams`); `None` when it holds its whole completion budget.
    pub fn grows_at(&self) -> Option<u64> {
        self.grant.as_ref()?.grows_at()
    }

    /// Its stream has `generated` tokens: its hold grows where they reach
    /// [`Admitted::grows_at`]. `Err` when its backend has no room: cut the stream.
    pub fn grow(&mut self, generated: u64) -> Result<Option<u64>, OverBudget> {
        self.hold(|adm, g, now| adm.grow(g, generated, now))
            .unwrap_or(Ok(None))
    }

    /// Its stream's tokens may pile up out of levee's sight (its client stopped reading):
    /// it holds its whole completion budget. `Err` when its backend has no room: cut it.
    pub fn hold_whole(&mut self) -> Result<(), OverBudget> {
        self.hold(|adm, g, now| adm.hold_whole(g, now))
            .unwrap_or(Ok(()))
    }

    /// Changes its stream's KV hold through `change`, under the lane's lock: a stream that
    /// grew (or tried to) gets its signal ([`Admitted::taken_signal`]) before the lock goes,
    /// and the streams whose hold went to it are signalled to cut themselves short. `None`
    /// once it ended.
    fn hold<R>(
        &mut self,
        change: impl FnOnce(
            &mut levee_policy::LaneAdmission<super::Waiter, Key>,
            &mut Grant<Key>,
            levee_policy::Timestamp,
        ) -> R,
    ) -> Option<R> {
        let g = self.grant.as_mut()?;
        let now = self.lane.ctx.clock.now();
        let named = g.stream().is_some();
        let (out, cut) = {
            let mut adm = self.lane.admission();
            let out = change(&mut adm, g, now);
            if let Some(id) = g.stream().filter(|_| !named) {
                self.lane.taken.register(id.get());
            }
            (out, adm.streams_to_cut())
        };
        self.lane.taken.send(cut.into_iter().map(|id| id.get()));
        Some(out)
    }

    /// The signal that its stream's KV hold went to a stream of a tenant within its fair
    /// share: cut it short at once (once it grew, or tried to; `None` before).
    pub fn taken_signal(&self) -> Option<Arc<Notify>> {
        self.lane.taken.get(self.grant.as_ref()?.stream()?.get())
    }

    /// Ends it with the backend's outcome and real usage.
    pub fn complete(mut self, done: Completion) {
        if let Some(g) = self.grant.take() {
            self.forget_signals(&g);
            let ctx = &self.lane.ctx;
            let now = ctx.clock.now();
            let waiting = {
                let mut adm = self.lane.admission();
                adm.complete(&ctx.limits, g, done, now);
                adm.has_waiting()
            };
            if let Some(c) = self.charge.take() {
                match done.actual_tokens {
                    Some(actual) => (*c).reconcile(actual),
                    None => (*c).keep(),
                }
            }
            self.finish(waiting);
        }
    }

    /// It ends: its signals go.
    fn forget_signals(&self, g: &Grant<Key>) {
        if let Some(run) = g.run() {
            self.lane.cuts.forget(run.get());
        }
        if let Some(id) = g.stream() {
            self.lane.taken.forget(id.get());
        }
    }

    /// Counts it out of flight; the dispatcher runs only if the room it freed may go to a
    /// waiting request (waking it for nothing would cost a task switch per request).
    fn finish(&self, waiting: bool) {
        self.lane.ctx.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.lane.ctx.metrics.in_flight.dec();
        if waiting {
            self.lane.wake();
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let Some(g) = self.grant.take() else { return };
        self.forget_signals(&g);
        let ctx = &self.lane.ctx;
        let now = ctx.clock.now();
        let waiting = if self.sent {
            // Cut short (client gone, or the proxy gave up): the backend may have spent the
            // tokens, so the estimate stays charged.
            let done = Completion {
                outcome: Outcome::Cancelled,
                actual_tokens: None,
                generated: None,
            };
            let mut adm = self.lane.admission();
            adm.complete(&ctx.limits, g, done, now);
            if let Some(c) = self.charge.take() {
                (*c).keep();
            }
            adm.has_waiting()
        } else {
            let mut adm = self.lane.admission();
            adm.refund(&ctx.limits, g, now);
            // Dropping the charge refunds it.
            self.charge = None;
            adm.has_waiting()
        };
        self.finish(waiting);
    }
}

/// Takes `req` through its lane's admission: dispatched at once, refused, or queued — then
/// [`QueueWait::wait`] waits until the lane's dispatcher hands it a backend (or its wait
/// ends). Deciding is not async: a request that does not queue holds no waiting state, and
/// one that does holds only its ticket and channel while it waits.
pub(crate) fn decide(
    lane: &Arc<Lane>,
    tenant: &Arc<TenantLimits>,
    tier: &str,
    req: AdmissionRequest<Key>,
    spot: Option<&QueueSpot>,
) -> Decision {
    let ctx = &lane.ctx;
    let now = ctx.clock.now();
    if spot.is_some_and(|s| s.batch.load(Ordering::Relaxed)) {
        lane.update_prefill_window();
    }
    let (tx, rx) = oneshot::channel();
    let tier: Arc<str> = Arc::from(tier);
    let waiter = Waiter {
        tx,
        tier: tier.clone(),
    };
    let decided = lane
        .admission()
        .admit_as(&ctx.limits, tenant, &req, waiter, now);
    match decided {
        Admit::Refused(r) => {
            let rate = ctx.limits.rate_limit_headers(&req.tenant, now);
            let e = refusal_error(&req, r, rate);
            lane.note_outcome(now, e.code().is_capacity_refusal());
            Decision::Now(Err(e))
        }
        Admit::Dispatch(d) => {
            lane.note_outcome(now, false);
            let a = Admitted::new(lane, d.grant, Duration::ZERO);
            if let Some(s) = spot {
                dispatched(lane, s, &a, req.prompt_tokens);
            }
            Decision::Now(Ok(a))
        }
        Admit::Queued {
            ticket, position, ..
        } => Decision::Queued(QueueWait {
            q: Queued {
                ticket,
                position,
                tier,
                prompt_tokens: req.prompt_tokens,
                at: now,
            },
            rx,
        }),
    }
}

/// What the lane decided for a request.
pub(crate) enum Decision {
    /// Dispatched or refused at once.
    Now(Result<Admitted, GatewayError>),
    /// Queued: wait for the dispatcher's answer.
    Queued(QueueWait),
}

/// A queued request's ticket and channel.
pub(crate) struct QueueWait {
    q: Queued,
    rx: oneshot::Receiver<Box<WaiterResult>>,
}

impl QueueWait {
    /// Waits in the lane's queue until the dispatcher answers: a backend, or why not. The
    /// ticket is cancelled if this future is dropped (the client went away).
    pub(crate) fn wait<'a>(
        self,
        lane: &'a Arc<Lane>,
        spot: Option<&'a QueueSpot>,
    ) -> impl std::future::Future<Output = Result<Admitted, GatewayError>> + 'a {
        wait_in_queue(lane, self.q, self.rx, spot)
    }
}

/// A request the lane queued.
struct Queued {
    ticket: Ticket,
    /// Its place on arrival.
    position: usize,
    tier: Arc<str>,
    prompt_tokens: u64,
    at: levee_policy::Timestamp,
}

async fn wait_in_queue(
    lane: &Arc<Lane>,
    q: Queued,
    rx: oneshot::Receiver<Box<WaiterResult>>,
    spot: Option<&QueueSpot>,
) -> Result<Admitted, GatewayError> {
    let ctx = &lane.ctx;
    ctx.queued.fetch_add(1, Ordering::AcqRel);
    ctx.metrics.queued.inc();
    ctx.metrics
        .queue_depth
        .get_or_create(&TierLabel {
            tier: q.tier.to_string(),
        })
        .inc();
    // Dispatch what may go, and answer a request this one displaced from a full lane
    // (displacement only happens to a request that then queues).
    lane.wake();
    if let Some(s) = spot {
        s.set(Spot::Queued {
            lane: lane.clone(),
            ticket: q.ticket,
        });
    }
    let mut guard = QueueGuard {
        lane,
        ticket: q.ticket,
        armed: true,
    };
    let got = rx.await.map(|b| *b);
    guard.armed = false;
    match got {
        Ok(Ok(a)) => {
            lane.note_outcome(q.at, false);
            if let Some(s) = spot {
                dispatched(lane, s, &a, q.prompt_tokens);
            }
            Ok(a)
        }
        // A refusal after waiting carries the place the request took on arrival.
        Ok(Err(e)) if e.position().is_none() => {
            Err(e.with_position(u32::try_from(q.position).unwrap_or(u32::MAX)))
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Err(GatewayError::internal(
            "the lane's dispatcher stopped while this request waited",
        )),
    }
}

/// Marks a watched request dispatched; a batch task first fences its backend.
fn dispatched(lane: &Lane, spot: &QueueSpot, a: &Admitted, prompt_tokens: u64) {
    if spot.batch.load(Ordering::Relaxed) {
        if let Some(key) = a.grant.as_ref().and_then(|g| g.backend()) {
            lane.fence_for_batch(key, prompt_tokens);
        }
    }
    spot.set(Spot::Dispatched);
}

/// The answer for a queued request that leaves the queue unserved.
pub(crate) fn expired_error(model: &str, e: &Expired<Waiter>) -> GatewayError {
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

/// The tenant's `x-ratelimit-*` figures as the error type carries them.
pub(crate) fn rate_info(rate: &RateLimitHeaders) -> RateInfo {
    RateInfo {
        limit_requests: rate.requests.map(|i| i.limit),
        remaining_requests: rate.requests.map(|i| i.remaining),
        reset_requests: rate.requests.map(|i| i.reset_after),
        limit_tokens: rate.tokens.map(|i| i.limit),
        remaining_tokens: rate.tokens.map(|i| i.remaining),
        reset_tokens: rate.tokens.map(|i| i.reset_after),
    }
}

/// The HTTP error of a refusal, with the tenant's rate-limit figures.
fn refusal_error(
    req: &AdmissionRequest<Key>,
    r: Refusal<Waiter>,
    rate: RateLimitHeaders,
) -> GatewayError {
    let retry = r
        .retry_after
        .map(|x| x.as_duration())
        .unwrap_or(Duration::from_secs(1));
    let e = match r.reason {
        RefusalReason::RequestRate(_)
        | RefusalReason::TokenRate(_)
        | RefusalReason::TooLarge(_)
        | RefusalReason::Concurrency(_) => limit_error(req, r.reason, retry, rate_info(&rate)),
        RefusalReason::ExceedsKvBudget => GatewayError::context_length_exceeded(format!(
            "this request needs about {} tokens of KV cache (prompt + max_tokens × n), \
             more than any backend of {:?} holds; lower max_tokens or shorten the prompt",
            req.tokens(),
            &*req.model
        )),
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
        RefusalReason::PredictedSloMiss => GatewayError::slo_unattainable(&req.model, retry),
        reason => lane_error(req, reason, retry),
    };
    let e = e.with_refusal(r.reason);
    match r.position {
        Some(p) => e.with_position(u32::try_from(p).unwrap_or(u32::MAX)),
        None => e,
    }
}

/// A refusal by a limit: a rate, a concurrency limit, or a request larger than a quota.
fn limit_error(
    req: &AdmissionRequest<Key>,
    reason: RefusalReason,
    retry: Duration,
    rate: RateInfo,
) -> GatewayError {
    let tokens = req.tokens();
    match reason {
        RefusalReason::RequestRate(s) => GatewayError::rate_limited(
            &format!("{} requests per minute", scope_name(s, req)),
            retry,
            RateInfo {
                remaining_requests: Some(0),
                ..rate
            },
        ),
        RefusalReason::TokenRate(s) => GatewayError::rate_limited(
            &format!(
                "{} tokens per minute ({tokens} tokens estimated)",
                scope_name(s, req)
            ),
            retry,
            rate,
        ),
        RefusalReason::Concurrency(s @ (Scope::Tenant | Scope::TenantHeavy)) => {
            GatewayError::rate_limited(
                &format!("{}: requests in flight at its limit", scope_name(s, req)),
                retry,
                rate,
            )
        }
        RefusalReason::Concurrency(s) => GatewayError::capacity_overload(
            &format!("{} concurrency at its limit", scope_name(s, req)),
            retry,
        ),
        RefusalReason::TooLarge(s) => GatewayError::bad_request(format!(
            "this request needs about {tokens} tokens but the {} token quota is smaller; \
             lower max_tokens or shorten the prompt",
            scope_name(s, req)
        ))
        .with_param("max_tokens"),
        other => lane_error(req, other, retry),
    }
}

/// A refusal by the lane: its load, its queue, its backends.
fn lane_error(req: &AdmissionRequest<Key>, reason: RefusalReason, retry: Duration) -> GatewayError {
    match reason {
        RefusalReason::Watermark(zone) => GatewayError::capacity_overload(
            &format!("model {:?} load in zone {}", &*req.model, zone.as_str()),
            retry,
        ),
        RefusalReason::QueueFull(p) => GatewayError::capacity_overload(
            &format!("model {:?} queue: {}", &*req.model, p.as_str()),
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
        other => GatewayError::internal(format!(
            "refusal {} reached the lane's error mapping",
            other.label()
        )),
    }
}

fn scope_name(s: Scope, req: &AdmissionRequest<Key>) -> String {
    match s {
        Scope::Global => "global".to_string(),
        Scope::Model => format!("model {}", req.model),
        Scope::Tenant => format!("tenant {}", req.tenant),
        Scope::TenantHeavy => format!("tenant {} heavy requests", req.tenant),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request predicted to miss its tier's time to first token objective is answered
    /// 429 `slo_unattainable`, from the gateway, with the predicted excess as Retry-After.
    #[test]
    fn a_predicted_slo_miss_is_a_429_with_its_own_code_and_the_excess_as_retry_after() {
        let (tx, _rx) = oneshot::channel();
        let req = AdmissionRequest {
            tenant: Key::new("t"),
            model: Key::new("m"),
            tier: levee_policy::Tier(1),
            prompt_tokens: 1_000,
            completion_tokens: 10,
            max_wait: None,
            session: None,
            answered_at_end: false,
        };
        let refusal = Refusal {
            item: Waiter {
                tx,
                tier: Arc::from("standard"),
            },
            reason: RefusalReason::PredictedSloMiss,
            retry_after: Some(levee_policy::RetryAfter::from_duration(
                Duration::from_millis(600),
            )),
            position: None,
        };
        let e = refusal_error(&req, refusal, RateLimitHeaders::default());
        assert_eq!(e.code(), crate::error::ErrorCode::SloUnattainable);
        assert_eq!(e.status().as_u16(), 429);
        assert_eq!(e.retry_after(), Some(Duration::from_millis(600)));
        assert!(e.code().is_capacity_refusal());
    }
}
