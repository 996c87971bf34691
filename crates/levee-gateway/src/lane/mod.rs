//! A model's lane, the I/O side: its admission state behind its own lock, its backends
//! (URLs, scrapes, learned sizes), its dispatcher task, and the figures degradation and the
//! admin page read. The request-side glue (waiting for a place, the admission a request
//! holds) is in [`request`].
//!
//! Every decision is levee-policy's [`LaneAdmission`]: this module only delivers it. Lanes
//! decide in parallel; what they share (global and tenant limits, gateway-wide counts,
//! metrics, the clock) is one [`LaneContext`]. A request that must wait holds a oneshot
//! receiver; the dispatcher task wakes whenever room may have freed (a request ended, a
//! queued one left, a scrape changed a backend) or a queued deadline passes, asks the policy
//! what goes next, and hands each waiter its [`Admitted`] — never while holding the lock, so
//! a waiter that has gone away gives its grant back through [`Admitted`]'s drop, which takes
//! the lock itself.

mod request;

pub(crate) use request::{decide, rate_info, Admitted, Decision, QueueSpot, Waiter};

use crate::clock::TokioClock;
use crate::degrade::DegradeDecision;
use crate::error::GatewayError;
use crate::metrics::{Metrics, TierLabel};
use crate::upstream::{Backend, ReportedLoad};
use levee_policy::{
    AdmissionConfig, BackendLimits, Clock, Key, LaneAdmission, LoadSignals, ModelSpec, Pending,
    PrefillFit, SharedLimits, Timestamp,
};
use parking_lot::{Mutex, MutexGuard, RwLock};
use request::expired_error;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The policy's view of one lane, as figures read it.
pub(crate) type PolicyLane = levee_policy::Lane<Pending<Waiter, Key>, Key>;

/// What every lane of one gateway shares.
pub(crate) struct LaneContext {
    /// Global and per-tenant limits.
    pub limits: SharedLimits<Key>,
    pub metrics: Arc<Metrics>,
    pub clock: TokioClock,
    /// Requests queued, all lanes.
    pub queued: AtomicI64,
    /// Requests admitted and not yet finished past the queue, all lanes.
    pub in_flight: AtomicI64,
    /// Cancelled when the gateway stops: dispatchers end.
    pub stopped: CancellationToken,
}

impl std::fmt::Debug for LaneContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneContext").finish_non_exhaustive()
    }
}

impl LaneContext {
    /// Requests queued + in flight, all lanes.
    pub fn load(&self) -> u64 {
        let q = self.queued.load(Ordering::Relaxed).max(0);
        let f = self.in_flight.load(Ordering::Relaxed).max(0);
        u64::try_from(q + f).unwrap_or(0)
    }
}

/// How long the TTFT and refusal windows look back.
const WINDOW: Duration = Duration::from_secs(10);

/// One model's lane.
pub(crate) struct Lane {
    /// The model (its key in metrics and the policy).
    pub model: Key,
    pub(crate) ctx: Arc<LaneContext>,
    adm: Mutex<LaneAdmission<Waiter, Key>>,
    backends: RwLock<Vec<Arc<Backend>>>,
    wake: Notify,
    retired: AtomicBool,
    /// The degradation decision in force for its requests, packed
    /// ([`crate::degrade::DegradeDecision::pack`]): published by the gateway whenever the
    /// degrader changes it, read by every request without a lock.
    degradation: AtomicU64,
    /// Recent TTFTs (seconds) and capacity refusals, for the degradation signals.
    recent: Mutex<Recent>,
    /// Time to first token over prompt tokens of the last streamed responses.
    prefill: Mutex<PrefillFit>,
    /// The engine's prompt counts against levee's estimates (see [`Lane::prompt_reservation`]).
    prompt: Mutex<levee_policy::PromptCorrections>,
    /// This model's series of the per-request prompt metrics.
    pub series: crate::metrics::ModelMetrics,
    /// The signal that cuts each preemptible request short, by its run
    /// (`queue.preempt_over_share`; empty while it is off).
    cuts: Signals,
    /// The signal that cuts each growing stream short when its KV hold goes to a stream of a
    /// tenant within its share, by its stream (`kv.grow_streams`).
    taken: Signals,
}

/// Signals that cut running requests short, by the policy's number for them (a run or a
/// stream): registered while a request may be cut, looked up by its task, sent by whoever
/// holds the lane's decision that named it.
#[derive(Default)]
struct Signals(Mutex<std::collections::HashMap<u64, Arc<Notify>>>);

impl Signals {
    fn register(&self, id: u64) {
        self.0.lock().insert(id, Arc::new(Notify::new()));
    }

    fn get(&self, id: u64) -> Option<Arc<Notify>> {
        self.0.lock().get(&id).cloned()
    }

    fn forget(&self, id: u64) {
        self.0.lock().remove(&id);
    }

    /// Signals each of `ids` still registered (one that ended meanwhile has none left: what
    /// it held came back anyway); with none, the map's lock is not taken.
    fn send(&self, ids: impl IntoIterator<Item = u64>) {
        let mut ids = ids.into_iter().peekable();
        if ids.peek().is_none() {
            return;
        }
        let signals = self.0.lock();
        for id in ids {
            if let Some(signal) = signals.get(&id) {
                signal.notify_one();
            }
        }
    }
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
    /// A lane with no backends yet; its dispatcher runs until the gateway stops.
    pub fn start(
        model: Key,
        ctx: Arc<LaneContext>,
        spec: ModelSpec,
        cfg: &AdmissionConfig,
    ) -> Arc<Lane> {
        let lane = Arc::new(Lane {
            model,
            adm: Mutex::new(LaneAdmission::new(spec, cfg)),
            ctx,
            backends: RwLock::new(Vec::new()),
            wake: Notify::new(),
            retired: AtomicBool::new(false),
            degradation: AtomicU64::new(DegradeDecision::default().pack()),
            recent: Mutex::new(Recent::default()),
            prefill: Mutex::new(PrefillFit::new()),
            prompt: Mutex::new(levee_policy::PromptCorrections::default()),
            series: crate::metrics::ModelMetrics::default(),
            cuts: Signals::default(),
            taken: Signals::default(),
        });
        let stop = lane.ctx.stopped.clone();
        spawn_pump(lane.clone(), |l| &l.wake, stop, |l| l.pump());
        lane
    }

    /// The lane's admission state, locked (briefly: never across an await).
    pub(crate) fn admission(&self) -> MutexGuard<'_, LaneAdmission<Waiter, Key>> {
        self.adm.lock()
    }

    /// Reads the policy's lane under the lock.
    pub fn view<R>(&self, f: impl FnOnce(&PolicyLane) -> R) -> R {
        f(self.adm.lock().lane())
    }

    /// Changes the policy's lane under the lock, then wakes the dispatcher.
    fn change<R>(&self, f: impl FnOnce(&mut PolicyLane) -> R) -> R {
        let r = f(self.adm.lock().lane_mut());
        self.wake();
        r
    }

    /// Wakes the dispatcher: room may have freed, or the lane's state changed.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Applies the model's new settings.
    pub fn set_spec(&self, spec: ModelSpec) {
        self.adm.lock().set_spec(spec);
        self.wake();
    }

    /// Applies the gateway's new tiers and retry bounds.
    pub fn reconfigure(&self, cfg: &AdmissionConfig) {
        self.adm.lock().reconfigure(cfg);
        self.wake();
    }

    /// Answers what must be answered now — expired waiters, and every waiter when the lane
    /// cannot serve anything — dispatches every queued request that may go, and signals the
    /// requests the policy names to be cut short for them. Returns when to run again for the
    /// next deadline.
    fn pump(self: &Arc<Self>) -> Option<tokio::time::Instant> {
        let ctx = &self.ctx;
        let now = ctx.clock.now();
        let (gone, ready, cut, next) = {
            let mut adm = self.adm.lock();
            let mut gone = adm.expire(&ctx.limits, now);
            gone.extend(adm.fail_unservable(&ctx.limits, now));
            let mut ready = Vec::new();
            while let Some(d) = adm.dequeue(&ctx.limits, now) {
                ready.push(d);
            }
            let mut cut = Vec::new();
            while let Some(run) = adm.preempt(now) {
                cut.push(run);
            }
            (gone, ready, cut, adm.next_deadline(now))
        };
        self.cuts.send(cut.into_iter().map(|run| run.get()));
        for e in gone {
            self.left_queue(&e.item.tier);
            let err = expired_error(&self.model, &e);
            self.note_outcome(now, err.code().is_capacity_refusal());
            e.item.answer(Err(err));
        }
        for d in ready {
            // Its wait goes to `levee_queue_wait_seconds` when it settles, with every other
            // admitted request's.
            self.left_queue(&d.item.tier);
            let admitted = Admitted::new(self, d.grant, d.waited);
            // A receiver that went away returns the admission, whose drop refunds it and
            // wakes this lane again.
            d.item.answer(Ok(admitted));
        }
        next.map(|t| ctx.clock.instant_at(t))
    }

    /// The degradation decision in force for its requests.
    pub(crate) fn degradation(&self) -> DegradeDecision {
        DegradeDecision::unpack(self.degradation.load(Ordering::Relaxed))
    }

    /// Publishes the degradation decision its requests follow from now on.
    pub(crate) fn set_degradation(&self, d: DegradeDecision) {
        self.degradation.store(d.pack(), Ordering::Relaxed);
    }

    /// Counts a request out of the queue.
    pub(crate) fn left_queue(&self, tier: &str) {
        self.ctx.queued.fetch_sub(1, Ordering::AcqRel);
        self.ctx.metrics.queued.dec();
        self.ctx
            .metrics
            .queue_depth
            .get_or_create(&TierLabel {
                tier: tier.to_string(),
            })
            .dec();
    }

    /// Answers every queued waiter with 503 (drain / shutdown).
    pub fn drain_queue(&self, retry_after: Duration) {
        let now = self.ctx.clock.now();
        let items = self.adm.lock().drain(&self.ctx.limits, now);
        for w in items {
            self.left_queue(&w.tier);
            w.answer(Err(GatewayError::draining(retry_after)));
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

    /// Sets the backends, here and in the admission state.
    pub fn set_backends(&self, backends: Vec<Arc<Backend>>) {
        let limits: Vec<(Arc<str>, BackendLimits)> = backends
            .iter()
            .map(|b| (b.key.clone(), b.limits()))
            .collect();
        self.retired.store(false, Ordering::Relaxed);
        *self.backends.write() = backends;
        self.change(|l| l.set_backends(limits));
    }

    /// After a scrape of `b`: its limits, health and the load report the scrape read, if it
    /// read one, reach the admission state (stamped now: the one an earlier scrape read
    /// keeps its age).
    pub fn scraped(&self, b: &Backend, reported: Option<ReportedLoad>) {
        let now = self.ctx.clock.now();
        let mut adm = self.adm.lock();
        let l = adm.lane_mut();
        l.set_backend_limits(&b.key, b.limits());
        l.set_routable(&b.key, b.is_routable());
        if let Some(r) = reported {
            l.report(&b.key, r.as_report(), now);
        }
    }

    /// After a renewal of this replica's slice of `b` (a fleet): its limits and what the
    /// other replicas hold there reach the admission state.
    pub fn slice_changed(&self, b: &Backend) {
        let (limits, view) = (b.limits(), b.fleet_view());
        self.change(|l| {
            l.set_backend_limits(&b.key, limits);
            l.set_backend_fleet(&b.key, view);
        });
    }

    /// What this replica has of backend `key` and waiting for it, per tier: its requests
    /// and KV tokens in flight there, and its share of each tier's queue (split evenly over
    /// the lane's backends).
    pub fn demand(&self, key: &str) -> Vec<levee_policy::SliceDemand> {
        self.view(|l| l.fleet_demand(key))
    }

    /// Ejects backend `key` until `until` (outlier detection).
    pub fn eject(&self, key: &str, until: Timestamp) {
        let now = self.ctx.clock.now();
        self.change(|l| l.eject(key, until, now));
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

    /// The prompt tokens to reserve for a prompt of `kind` levee estimated at `estimate`:
    /// the estimate scaled by the 95th percentile of the engine's count ÷ levee's estimate
    /// over the lane's recent answers of that kind (see levee-policy's `PromptCorrections`).
    pub fn prompt_reservation(&self, kind: levee_policy::TextKind, estimate: u64) -> u64 {
        self.prompt.lock().correct(kind, estimate)
    }

    /// The least the engine is likely to count for a prompt levee estimated at `estimate`,
    /// whatever its kind (see levee-policy's `PromptCorrections::floor`): what the context check
    /// refuses by, so that an estimate that errs high never refuses a prompt the engine
    /// would take.
    pub fn prompt_floor(&self, estimate: u64) -> u64 {
        self.prompt.lock().floor(estimate)
    }

    /// Records the engine's own count of a prompt of `kind` levee estimated at `estimate`;
    /// returns that kind's correction factor now.
    pub fn note_prompt_count(
        &self,
        kind: levee_policy::TextKind,
        estimate: u64,
        engine: u64,
    ) -> f64 {
        let now = self.ctx.clock.now();
        let mut p = self.prompt.lock();
        p.note(kind, estimate, engine, now);
        p.factor(kind)
    }

    /// Records a response's prompt (levee's estimate) and the engine's time to first token,
    /// for the prefill fit.
    pub fn note_prefill(&self, prompt_tokens: u64, ttft: Duration) {
        self.prefill.lock().note(prompt_tokens, ttft);
    }

    /// Sets the lane's prefill window from its streamed responses: the 90th percentile of
    /// their times to first token (a request dispatched longer ago than that has most likely
    /// had its prefill step). Nothing before any was measured.
    pub fn update_prefill_window(&self) {
        let window = self.prefill.lock().ttft_quantile(0.9);
        if let Some(w) = window {
            self.change(|l| l.set_prefill_window(w));
        }
    }

    /// A batch task of `prompt_tokens` was just placed on backend `key`: fences that
    /// backend until its prompt is predicted prefilled, so interactive requests go to
    /// another backend meanwhile. Nothing without a prediction.
    pub fn fence_for_batch(&self, key: &str, prompt_tokens: u64) {
        let predicted = self.prefill.lock().predict(prompt_tokens);
        if let Some(p) = predicted {
            let until = self.ctx.clock.now() + p;
            self.change(|l| l.fence_backend(key, until));
        }
    }

    /// Records whether a request of this lane was refused for capacity.
    pub fn note_outcome(&self, now: Timestamp, refused: bool) {
        let mut r = self.recent.lock();
        r.outcomes.push_back((now, refused));
        r.trim(now);
    }

    /// The lane's degradation signals: its load over the hard watermark, its KV fill, P95
    /// TTFT over 1.5× `slo`, and the share of capacity refusals, over the last 10 s.
    pub fn signals(&self, hard: u64, slo: Option<Duration>, now: Timestamp) -> LoadSignals {
        let (load, kv) = self.view(|l| (l.load(), l.kv_fill(now)));
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
            queue_depth_ratio: load as f64 / hard.max(1) as f64,
            kv_cache_usage: kv,
            ttft_ratio,
            refusal_rate,
        }
    }

    /// The expected wait of the request at queue position `position` (1 = next): the
    /// position over the lane's measured dispatch rate, or before any dispatch is measured,
    /// position × mean service time ÷ requests in flight.
    pub fn eta(&self, position: usize) -> Option<Duration> {
        let now = self.ctx.clock.now();
        self.view(|l| {
            let rate = l.dispatch_rate(now);
            if rate > 0.0 {
                Some(Duration::from_secs_f64(position as f64 / rate))
            } else {
                l.mean_service()
                    .map(|s| s.mul_f64(position as f64 / l.in_flight().max(1) as f64))
            }
        })
    }

    /// The lane's part of `/admin/state`. `tier_names[p]` names priority `p`.
    pub fn state_json(&self, now: Timestamp, tier_names: &[String]) -> serde_json::Value {
        let adm = self.adm.lock();
        let l = adm.lane();
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
            .map(|st| self.backend_json(&st))
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

    fn backend_json(&self, st: &levee_policy::BackendStats) -> serde_json::Value {
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
            "fleet_slice": b.as_ref().and_then(|b| b.fleet_slice()).map(|s| serde_json::json!({
                "slots": s.allowed.slots,
                "kv_tokens": s.allowed.kv_tokens,
                "others_slots": s.others.slots,
                "others_kv_tokens": s.others.kv_tokens,
                "replicas": s.replicas,
                "granted": s.granted,
                "lapsed": s.lapsed,
            })),
            "reported": b.as_ref().and_then(|b| b.reported()),
            "breaker": {
                "state": st.breaker.state.as_str(),
                "window_requests": st.breaker.window_requests,
                "window_failures": st.breaker.window_failures,
                "consecutive_failures": st.breaker.consecutive_failures,
                "opened_total": st.breaker.opened_total,
            },
        })
    }
}

/// Spawns a task that runs `step` at once, then whenever `wake(owner)` is notified or the
/// time `step` returned comes, until `stop` is cancelled: the loop behind each lane's
/// dispatcher and the task feeder.
pub(crate) fn spawn_pump<S: Send + Sync + 'static>(
    owner: Arc<S>,
    wake: fn(&S) -> &Notify,
    stop: CancellationToken,
    step: impl Fn(&Arc<S>) -> Option<tokio::time::Instant> + Send + 'static,
) {
    tokio::spawn(async move {
        loop {
            let notified = wake(&owner).notified();
            tokio::pin!(notified);
            // Register before stepping, so a wake during the step is not lost.
            notified.as_mut().enable();
            let next = step(&owner);
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
