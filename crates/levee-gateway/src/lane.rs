//! A model's lane: its backends (each with a cap and a breaker) and its fair queue.
//!
//! This is the heart of the gateway. A request that finds a free backend slot (and nobody
//! of its priority or higher waiting) dispatches at once. Otherwise it waits in the policy
//! [`FairQueue`] and its handler awaits a oneshot. Whenever a slot frees, the lane's
//! dispatcher task pops the highest-priority fair head and hands it the slot.
//!
//! * A waiter whose client disconnects is dropped by hyper; its `QueueGuard` cancels the
//!   ticket at once, so a gone client never reaches a backend.
//! * Slots are RAII ([`Slot`]): dropping one decrements the backend's in-flight count and
//!   wakes the dispatcher. Drop never takes the lane lock, so a slot can be dropped
//!   anywhere — including inside a oneshot send performed under the lock.
//! * Backend capacity (`max_in_flight`) is what gates dispatch; it keeps engines alive under
//!   a flood.

use crate::config::BreakerConfig;
use crate::error::GatewayError;
use crate::gateway::{Gateway, Tenant};
use crate::metrics::TierLabel;
use crate::upstream::Backend;
use levee_policy::{
    Breaker, BreakerTicket, Clock, FairQueue, Outcome as BreakerOutcome, QueueLimits, Ticket, Tier,
    Timestamp,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::{oneshot, Notify};

/// What a waiter receives: a slot, or the reason it will not get one.
type WaiterResult = Result<Slot, GatewayError>;

struct Waiter {
    tx: oneshot::Sender<WaiterResult>,
    tier_name: Arc<str>,
}

struct BackendEntry {
    backend: Arc<Backend>,
    breaker: Breaker,
}

struct LaneInner {
    backends: Vec<BackendEntry>,
    queue: FairQueue<Waiter, Arc<str>>,
    /// Tier names by priority number, for per-tier queue metrics.
    tier_names: Vec<Arc<str>>,
}

/// One model's backends and queue.
pub struct Lane {
    /// The model.
    pub model: String,
    inner: Mutex<LaneInner>,
    wake: Notify,
    retired: AtomicBool,
    /// Mirror of the queue's length, readable without the lock: a freed slot wakes the
    /// dispatcher only when someone waits (most requests never queue).
    waiting: AtomicUsize,
    /// Breaker tickets of slots dropped while the lane lock was taken (see `Slot::drop`).
    /// Lock order: `inner` before `deferred_cancels`; `Slot::drop` never waits for `inner`.
    deferred_cancels: Mutex<Vec<(String, BreakerTicket)>>,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").field("model", &self.model).finish()
    }
}

/// A backend slot held by one request. Dropping it frees the slot.
pub struct Slot {
    lane: Arc<Lane>,
    gw: Weak<Gateway>,
    /// The backend this request goes to.
    pub backend: Arc<Backend>,
    ticket: Option<BreakerTicket>,
    /// Time spent queued before the slot was granted.
    pub queued_for: Duration,
    armed: bool,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("backend", &self.backend.id)
            .finish()
    }
}

impl Slot {
    /// Reports how the request went to the backend's breaker (call once, before drop).
    pub fn record(&mut self, outcome: BreakerOutcome, now: Timestamp) {
        if let Some(t) = self.ticket.take() {
            self.lane.record(&self.backend.id, t, outcome, now);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(t) = self.ticket.take() {
            // Never reported: the request was abandoned (client gone) or never sent. A slot
            // can be dropped inside a oneshot send made under the lane lock (the receiver
            // went away at that instant), so never block on the lock here: record now if it
            // is free, else leave the record for the dispatcher.
            let now = self.gw.upgrade().map(|g| g.clock.now()).unwrap_or_default();
            match self.lane.inner.try_lock() {
                Some(mut inner) => record_in(
                    &mut inner,
                    &self.backend.id,
                    t,
                    BreakerOutcome::Cancelled,
                    now,
                ),
                None => {
                    self.lane
                        .deferred_cancels
                        .lock()
                        .push((self.backend.id.clone(), t));
                    self.lane.wake.notify_one();
                }
            }
        }
        // SeqCst pairs with `acquire`: it pushes, then re-checks capacity under the lock;
        // this side frees capacity, then checks for waiters. One of the two sees the other.
        self.backend.in_flight.fetch_sub(1, Ordering::SeqCst);
        if let Some(gw) = self.gw.upgrade() {
            gw.in_flight.fetch_sub(1, Ordering::AcqRel);
            gw.metrics.in_flight.dec();
        }
        // The dispatcher task does the queue work; dropping a slot never takes the lock.
        if self.lane.waiting.load(Ordering::SeqCst) > 0 {
            self.lane.wake.notify_one();
        }
    }
}

fn record_in(
    inner: &mut LaneInner,
    id: &str,
    t: BreakerTicket,
    outcome: BreakerOutcome,
    now: Timestamp,
) {
    if let Some(e) = inner.backends.iter_mut().find(|e| e.backend.id == id) {
        e.breaker.record(t, outcome, now);
    }
}

/// Removes a waiter's ticket from the queue if its future is dropped (client gone, timeout).
struct QueueGuard<'a> {
    lane: &'a Lane,
    gw: &'a Gateway,
    ticket: Ticket,
    armed: bool,
}

impl Drop for QueueGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut inner = self.lane.inner.lock();
            if let Some(e) = inner.queue.cancel(self.ticket) {
                left_queue(self.lane, self.gw, &inner, e.tier);
            }
        }
    }
}

fn left_queue(lane: &Lane, gw: &Gateway, inner: &LaneInner, tier: Tier) {
    lane.waiting.fetch_sub(1, Ordering::SeqCst);
    gw.queued.fetch_sub(1, Ordering::AcqRel);
    gw.metrics.queued.dec();
    if let Some(name) = inner.tier_names.get(usize::from(tier.0)) {
        gw.metrics
            .queue_depth
            .get_or_create(&TierLabel {
                tier: name.to_string(),
            })
            .dec();
    }
}

/// A request asking for a slot.
pub struct SlotRequest<'a> {
    /// Who asks.
    pub tenant: &'a Arc<Tenant>,
    /// Estimated tokens (the fairness cost).
    pub cost: u64,
    /// Longest the request may wait in the queue.
    pub budget: Duration,
    /// Retry-After to give if the wait runs out.
    pub retry_after: Duration,
}

impl Lane {
    /// A lane with no backends yet (see [`Lane::configure`]).
    pub fn new(model: &str) -> Arc<Lane> {
        Arc::new(Lane {
            model: model.to_string(),
            inner: Mutex::new(LaneInner {
                backends: Vec::new(),
                queue: FairQueue::new(QueueLimits {
                    tiers: 1,
                    max_len: usize::MAX,
                    max_tokens: u64::MAX,
                }),
                tier_names: Vec::new(),
            }),
            wake: Notify::new(),
            retired: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            deferred_cancels: Mutex::new(Vec::new()),
        })
    }

    /// Spawns the dispatcher task: it runs [`Lane::pump`] whenever a slot frees.
    pub fn spawn_dispatcher(self: &Arc<Self>, gw: Weak<Gateway>) {
        let lane = self.clone();
        tokio::spawn(async move {
            let Some(stop) = gw.upgrade().map(|g| g.stopped_token()) else {
                return;
            };
            loop {
                let notified = lane.wake.notified();
                tokio::pin!(notified);
                // Register before pumping, so a wake during the pump is not lost.
                notified.as_mut().enable();
                {
                    let Some(g) = gw.upgrade() else { break };
                    lane.pump(&g);
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = &mut notified => {}
                }
            }
        });
    }

    /// A backend of this lane by id (reload keeps its counters).
    pub fn existing_backend(&self, id: &str) -> Option<Arc<Backend>> {
        self.inner
            .lock()
            .backends
            .iter()
            .find(|b| b.backend.id == id)
            .map(|b| b.backend.clone())
    }

    /// The backends.
    pub fn backends(&self) -> Vec<Arc<Backend>> {
        self.inner
            .lock()
            .backends
            .iter()
            .map(|b| b.backend.clone())
            .collect()
    }

    /// Sets the backends (keeping breakers of unchanged ones) and queue tiers from config.
    pub fn configure(&self, backends: Vec<Arc<Backend>>, breaker: &BreakerConfig, gw: &Gateway) {
        self.retired.store(false, Ordering::Relaxed);
        let cfg = gw.config();
        let mut tiers: Vec<(u8, &String)> =
            cfg.tiers.iter().map(|(n, t)| (t.priority, n)).collect();
        tiers.sort();
        let max_prio = tiers.iter().map(|t| t.0).max().unwrap_or(0);
        let mut names: Vec<Arc<str>> = (0..=max_prio)
            .map(|p| Arc::from(format!("priority{p}")))
            .collect();
        for (p, n) in &tiers {
            names[usize::from(*p)] = Arc::from(n.as_str());
        }
        let mut inner = self.inner.lock();
        let policy_breaker = breaker.to_policy();
        let mut entries = Vec::with_capacity(backends.len());
        for b in backends {
            let old = inner
                .backends
                .iter()
                .position(|e| Arc::ptr_eq(&e.backend, &b))
                .map(|i| inner.backends.swap_remove(i));
            let breaker = match old {
                Some(e) if *e.breaker.config() == policy_breaker => e.breaker,
                _ => Breaker::new(policy_breaker),
            };
            entries.push(BackendEntry {
                backend: b,
                breaker,
            });
        }
        inner.backends = entries;
        let want_tiers = max_prio.saturating_add(1);
        let max_tokens = match cfg.queue.max_queued_tokens {
            0 => u64::MAX,
            n => n,
        };
        let limits = QueueLimits {
            tiers: want_tiers,
            max_len: usize::try_from(cfg.queue.hard).unwrap_or(usize::MAX),
            max_tokens,
        };
        if inner.queue.limits() != limits {
            if inner.queue.is_empty() {
                inner.queue = FairQueue::new(limits);
            } else {
                // Queued waiters keep their place; the new bounds apply once it empties.
                tracing::info!(model = %self.model, "queue bounds change deferred until the queue is empty");
            }
        }
        inner.tier_names = names;
        for t in &gw.runtime().tenants {
            inner
                .queue
                .set_weight(Arc::from(t.name.as_str()), weight_units(t.weight));
        }
        drop(inner);
        self.wake.notify_one();
    }

    /// Marks the lane as belonging to a model removed from the config.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    /// Whether the model was removed by a reload.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    fn record(&self, id: &str, t: BreakerTicket, outcome: BreakerOutcome, now: Timestamp) {
        let mut inner = self.inner.lock();
        record_in(&mut inner, id, t, outcome, now);
    }

    /// Breaker state of a backend as the metrics gauge (0 closed, 1 half-open, 2 open).
    pub fn breaker_code(&self, id: &str, now: Timestamp) -> i64 {
        let inner = self.inner.lock();
        inner
            .backends
            .iter()
            .find(|e| e.backend.id == id)
            .map(|e| e.breaker.state(now).as_gauge())
            .unwrap_or(0)
    }

    /// Picks the backend for the next dispatch: healthy, breaker admitting, under its cap,
    /// lowest load score. Takes the breaker ticket and the in-flight count.
    fn take_backend(
        inner: &mut LaneInner,
        now: Timestamp,
    ) -> Option<(Arc<Backend>, BreakerTicket)> {
        Self::take_backend_except(inner, now, None)
    }

    fn take_backend_except(
        inner: &mut LaneInner,
        now: Timestamp,
        except: Option<&str>,
    ) -> Option<(Arc<Backend>, BreakerTicket)> {
        let mut best: Option<(usize, f64)> = None;
        for (i, e) in inner.backends.iter().enumerate() {
            let b = &e.backend;
            if except == Some(b.id.as_str()) {
                continue;
            }
            if !b.healthy.load(Ordering::Relaxed) {
                continue;
            }
            if b.in_flight.load(Ordering::SeqCst) >= b.cap() {
                continue;
            }
            if !e.breaker.would_admit(now) {
                continue;
            }
            let s = b.score();
            if best.is_none_or(|(_, bs)| s < bs) {
                best = Some((i, s));
            }
        }
        let (i, _) = best?;
        let e = &mut inner.backends[i];
        let ticket = e.breaker.try_acquire(now).ok()?;
        e.backend.in_flight.fetch_add(1, Ordering::AcqRel);
        Some((e.backend.clone(), ticket))
    }

    /// Why no backend can ever take a request right now (as opposed to "all busy").
    fn unavailable(&self, inner: &LaneInner, now: Timestamp) -> Option<GatewayError> {
        if inner.backends.is_empty() {
            return Some(GatewayError::no_healthy_backend(
                &self.model,
                Duration::from_secs(5),
            ));
        }
        let healthy: Vec<&BackendEntry> = inner
            .backends
            .iter()
            .filter(|e| e.backend.healthy.load(Ordering::Relaxed))
            .collect();
        if healthy.is_empty() {
            return Some(GatewayError::no_healthy_backend(
                &self.model,
                Duration::from_secs(2),
            ));
        }
        let all_open = healthy
            .iter()
            .all(|e| e.breaker.state(now) == levee_policy::BreakerState::Open);
        if all_open {
            // The earliest time a breaker lets a probe through.
            let wait = healthy
                .iter()
                .filter_map(|e| {
                    let mut b = e.breaker.clone();
                    b.try_acquire(now).err().map(|o| o.retry_after)
                })
                .min()
                .unwrap_or(Duration::from_secs(1));
            return Some(GatewayError::circuit_open(&self.model, wait));
        }
        None
    }

    fn make_slot(
        self: &Arc<Self>,
        gw: &Arc<Gateway>,
        backend: Arc<Backend>,
        ticket: BreakerTicket,
        queued_for: Duration,
    ) -> Slot {
        gw.in_flight.fetch_add(1, Ordering::AcqRel);
        gw.metrics.in_flight.inc();
        Slot {
            lane: self.clone(),
            gw: Arc::downgrade(gw),
            backend,
            ticket: Some(ticket),
            queued_for,
            armed: true,
        }
    }

    /// Gets a backend slot: at once if one is free and nobody of this priority or higher is
    /// waiting, else after waiting in the fair queue for at most `req.budget`.
    pub async fn acquire(
        self: &Arc<Self>,
        gw: &Arc<Gateway>,
        req: SlotRequest<'_>,
    ) -> Result<Slot, GatewayError> {
        let now = gw.clock.now();
        let tier = Tier(req.tenant.priority);
        let rx = {
            let mut inner = self.inner.lock();
            if let Some(e) = self.unavailable(&inner, now) {
                return Err(e);
            }
            if inner.queue.len_at_or_above(tier) == 0 {
                if let Some((b, t)) = Self::take_backend(&mut inner, now) {
                    drop(inner);
                    gw.drain_rate.lock().record(1, now);
                    return Ok(self.make_slot(gw, b, t, Duration::ZERO));
                }
            }
            if req.budget.is_zero() {
                return Err(GatewayError::capacity_overload(
                    "no free backend slot and this tier may not wait",
                    req.retry_after,
                ));
            }
            let (tx, rx) = oneshot::channel();
            let tier_name: Arc<str> = inner
                .tier_names
                .get(usize::from(tier.0))
                .cloned()
                .unwrap_or_else(|| Arc::from(req.tenant.tier.as_str()));
            let deadline = now + req.budget;
            let pushed = inner.queue.push(
                tier,
                req.tenant.queue_key.clone(),
                req.cost,
                now,
                deadline,
                Waiter {
                    tx,
                    tier_name: tier_name.clone(),
                },
            );
            match pushed {
                Ok(ticket) => {
                    self.waiting.fetch_add(1, Ordering::SeqCst);
                    gw.queued.fetch_add(1, Ordering::AcqRel);
                    gw.metrics.queued.inc();
                    gw.metrics
                        .queue_depth
                        .get_or_create(&TierLabel {
                            tier: tier_name.to_string(),
                        })
                        .inc();
                    // A slot may have freed between the capacity check and the push.
                    self.dispatch_locked(gw, &mut inner, now);
                    (rx, ticket)
                }
                Err(rej) => {
                    return Err(GatewayError::capacity_overload(
                        rej.reason.as_str(),
                        req.retry_after,
                    ))
                }
            }
        };
        let (rx, ticket) = rx;
        let mut guard = QueueGuard {
            lane: self,
            gw,
            ticket,
            armed: true,
        };
        let deadline = tokio::time::Instant::now() + req.budget;
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(r)) => {
                // The dispatcher already took the ticket out of the queue.
                guard.armed = false;
                r
            }
            Ok(Err(_)) => {
                guard.armed = false;
                Err(GatewayError::internal("queue entry lost (lane shut down)"))
            }
            Err(_) => {
                drop(guard); // leaves the queue now
                Err(GatewayError::queue_timeout(req.budget, req.retry_after))
            }
        }
    }

    /// A slot on another backend than `except`, only if one is free right now (used to
    /// resend a request whose backend refused the connection; it never queues again).
    pub fn try_take_other(self: &Arc<Self>, gw: &Arc<Gateway>, except: &str) -> Option<Slot> {
        let now = gw.clock.now();
        let mut inner = self.inner.lock();
        let (b, t) = Self::take_backend_except(&mut inner, now, Some(except))?;
        drop(inner);
        Some(self.make_slot(gw, b, t, Duration::ZERO))
    }

    /// Hands free slots to the queue's heads; answers expired waiters.
    pub fn pump(self: &Arc<Self>, gw: &Arc<Gateway>) {
        let now = gw.clock.now();
        let mut inner = self.inner.lock();
        self.dispatch_locked(gw, &mut inner, now);
    }

    fn dispatch_locked(self: &Arc<Self>, gw: &Arc<Gateway>, inner: &mut LaneInner, now: Timestamp) {
        for (id, t) in std::mem::take(&mut *self.deferred_cancels.lock()) {
            record_in(inner, &id, t, BreakerOutcome::Cancelled, now);
        }
        let mut expired = Vec::new();
        inner.queue.expire_into(now, &mut expired);
        for e in expired {
            left_queue(self, gw, inner, e.tier);
            let waited = now - e.enqueued_at;
            let retry = self.retry_hint(gw, inner, now);
            let _ = e
                .item
                .tx
                .send(Err(GatewayError::queue_timeout(waited, retry)));
        }
        while !inner.queue.is_empty() {
            let Some((backend, ticket)) = Self::take_backend(inner, now) else {
                break;
            };
            let Some(entry) = inner.queue.pop() else {
                // Cannot happen (checked non-empty); give the slot back.
                backend.in_flight.fetch_sub(1, Ordering::AcqRel);
                break;
            };
            left_queue(self, gw, inner, entry.tier);
            let waited = now - entry.enqueued_at;
            if entry.item.tx.is_closed() {
                // Client gone between cancel and pop: never send its request upstream.
                backend.in_flight.fetch_sub(1, Ordering::AcqRel);
                if let Some(e) = inner
                    .backends
                    .iter_mut()
                    .find(|e| Arc::ptr_eq(&e.backend, &backend))
                {
                    e.breaker.record(ticket, BreakerOutcome::Cancelled, now);
                }
                continue;
            }
            gw.metrics
                .queue_wait
                .get_or_create(&TierLabel {
                    tier: entry.item.tier_name.to_string(),
                })
                .observe(waited.as_secs_f64());
            gw.drain_rate.lock().record(1, now);
            let slot = self.make_slot(gw, backend, ticket, waited);
            if let Err(Ok(mut slot)) = entry.item.tx.send(Ok(slot)) {
                // The waiter left while we were sending: undo without re-locking.
                slot.armed = false;
                slot.backend.in_flight.fetch_sub(1, Ordering::AcqRel);
                gw.in_flight.fetch_sub(1, Ordering::AcqRel);
                gw.metrics.in_flight.dec();
                if let Some(t) = slot.ticket.take() {
                    if let Some(e) = inner
                        .backends
                        .iter_mut()
                        .find(|e| Arc::ptr_eq(&e.backend, &slot.backend))
                    {
                        e.breaker.record(t, BreakerOutcome::Cancelled, now);
                    }
                }
            }
        }
    }

    fn retry_hint(&self, gw: &Gateway, inner: &LaneInner, now: Timestamp) -> Duration {
        let rt = gw.runtime();
        rt.retry_bounds
            .for_drain(inner.queue.len() as u64 + 1, &gw.drain_rate.lock(), now)
            .as_duration()
    }

    /// Estimated Retry-After for a request refused by this lane now.
    pub fn retry_estimate(&self, gw: &Gateway) -> Duration {
        let now = gw.clock.now();
        let inner = self.inner.lock();
        self.retry_hint(gw, &inner, now)
    }

    /// Answers every queued waiter with 503 (drain / shutdown).
    pub fn drain_queue(&self, gw: &Gateway, retry_after: Duration) {
        let mut inner = self.inner.lock();
        while let Some(e) = inner.queue.pop() {
            left_queue(self, gw, &inner, e.tier);
            let _ = e.item.tx.send(Err(GatewayError::draining(retry_after)));
        }
    }

    /// Queue length of this lane.
    pub fn queue_len(&self) -> usize {
        self.inner.lock().queue.len()
    }

    /// Requests queued in this lane at priority `priority` or higher (a lower number): the
    /// part of the queue a request of that priority would wait behind.
    pub fn queued_at_or_above(&self, priority: u8) -> usize {
        // Most requests arrive to an empty queue: skip the lock then.
        if self.waiting.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        self.inner.lock().queue.len_at_or_above(Tier(priority))
    }

    /// The lane's part of `/admin/state`.
    pub fn state_json(&self, _gw: &Gateway, now: Timestamp) -> serde_json::Value {
        let inner = self.inner.lock();
        let stats = inner.queue.stats();
        let tiers: Vec<_> = stats
            .tiers
            .iter()
            .enumerate()
            .map(|(i, t)| {
                serde_json::json!({
                    "tier": inner.tier_names.get(i).map(|n| n.to_string()),
                    "priority": i,
                    "queued": t.len,
                    "tokens": t.tokens,
                    "backlogged_tenants": t.backlogged_tenants,
                })
            })
            .collect();
        let tenants: Vec<_> = inner
            .queue
            .backlogged()
            .map(|(tier, k, n, tok)| {
                serde_json::json!({"tenant": k.to_string(), "priority": tier.0, "queued": n, "tokens": tok})
            })
            .collect();
        let backends: Vec<_> = inner
            .backends
            .iter()
            .map(|e| {
                let b = &e.backend;
                let st = e.breaker.stats(now);
                serde_json::json!({
                    "id": b.id,
                    "url": b.base,
                    "kind": b.kind,
                    "healthy": b.healthy.load(Ordering::Relaxed),
                    "in_flight": b.in_flight.load(Ordering::Relaxed),
                    "max_in_flight": b.max_in_flight.load(Ordering::Relaxed),
                    "adaptive_limit": b.adaptive_limit(),
                    "reported": *b.load.lock(),
                    "breaker": {
                        "state": st.state.as_str(),
                        "window_requests": st.window_requests,
                        "window_failures": st.window_failures,
                        "consecutive_failures": st.consecutive_failures,
                        "opened_total": st.opened_total,
                    },
                })
            })
            .collect();
        serde_json::json!({
            "model": self.model,
            "retired": self.is_retired(),
            "queued": stats.len,
            "queued_tokens": stats.tokens,
            "tiers": tiers,
            "tenants": tenants,
            "backends": backends,
        })
    }
}

/// Converts a fractional fairness weight to the queue's integer weight (two decimals).
fn weight_units(w: f64) -> u32 {
    (w * 100.0).round().clamp(1.0, f64::from(u32::MAX)) as u32
}
