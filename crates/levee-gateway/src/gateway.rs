//! The gateway: what one `levee serve` process holds, composed from parts that each own
//! their state — the runtime view of the configuration (swapped whole on reload), one lane
//! per model (each with its admission state behind its own lock), the limits and counts the
//! lanes share, degradation, the drain switch, the per-IP guard, the autoscaling figures and
//! the shared store. The request path ([`crate::pipeline`]) and the periodic work
//! ([`crate::upkeep`]) reach the parts through it.

use crate::config::{Config, StateBackend};
use crate::conn_pool::Connector;
use crate::degrade::Degrader;
use crate::lane::{Lane, LaneContext};
use crate::metrics::Metrics;
use crate::runtime::{admission_config, Runtime};
use crate::upstream::{build_client, Backend, HttpClient};
use levee_policy::{Clock, Key, KeyedGcra, Quota, SharedLimits, Timestamp};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The shared gateway.
pub struct Gateway {
    runtime: RwLock<Arc<Runtime>>,
    lanes: RwLock<HashMap<String, Arc<Lane>, levee_policy::FastState>>,
    /// What every lane shares: limits, counts, metrics, clock, the stop signal.
    ctx: Arc<LaneContext>,
    /// The shared upstream client, and the connector backends' own pools dial with.
    upstream: (HttpClient, Connector),
    draining: AtomicBool,
    /// `/readyz` says 503 (a drain began) while requests are still served.
    leaving: AtomicBool,
    degrader: Mutex<Degrader>,
    ip_guard: Mutex<KeyedGcra<IpAddr>>,
    scaling: crate::autoscale::Scaling,
    shared: Option<Arc<crate::shared::Shared>>,
    /// Stored answers of the tenants that opted in.
    response_cache: crate::response_cache::ResponseCache,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").finish_non_exhaustive()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // The lanes' dispatchers end with the gateway.
        self.ctx.stopped.cancel();
    }
}

fn ip_quota(cfg: &Config) -> Option<Quota> {
    if !cfg.ip_guard.enabled {
        return None;
    }
    // Per-second rate with a burst, expressed over one second in millis for precision.
    let per_sec = cfg.ip_guard.requests_per_second.max(0.001);
    let per_kilo_sec = (per_sec * 1000.0).round().max(1.0) as u64;
    Some(
        Quota::new(per_kilo_sec, Duration::from_secs(1000))
            .with_burst(u64::from(cfg.ip_guard.burst.max(1))),
    )
}

impl Gateway {
    /// Builds the gateway from a validated config.
    pub fn new(cfg: Config) -> anyhow::Result<Arc<Gateway>> {
        let limits = SharedLimits::from_config(&admission_config(&cfg));
        let rt = Runtime::build(cfg, None, &limits)
            .map_err(|e| anyhow::anyhow!("invalid configuration: {}", e.join("; ")))?;
        let clock = crate::clock::TokioClock::new();
        let metrics = Arc::new(match rt.cfg.state.backend {
            StateBackend::Memory => Metrics::new(),
            StateBackend::Redis => Metrics::with_shared_state(),
        });
        let shared = match rt.cfg.state.backend {
            StateBackend::Memory => None,
            StateBackend::Redis => Some(Arc::new(crate::shared::Shared::new(
                &rt.cfg.state,
                clock,
                &metrics,
            )?)),
        };
        let ctx = Arc::new(LaneContext {
            limits,
            metrics,
            clock,
            queued: AtomicI64::new(0),
            in_flight: AtomicI64::new(0),
            stopped: CancellationToken::new(),
        });
        let cache = &rt.cfg.cache;
        let response_cache = crate::response_cache::ResponseCache::new(
            usize::try_from(cache.max_bytes).unwrap_or(usize::MAX),
            Duration::from_millis(cache.ttl_ms),
        );
        let gw = Arc::new(Gateway {
            response_cache,
            degrader: Mutex::new(Degrader::new(&rt.cfg)),
            ip_guard: Mutex::new(KeyedGcra::new(ip_quota(&rt.cfg), 100_000)),
            runtime: RwLock::new(Arc::new(rt)),
            lanes: RwLock::new(HashMap::default()),
            ctx,
            upstream: build_client().map_err(|e| anyhow::anyhow!(e))?,
            draining: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            scaling: crate::autoscale::Scaling::default(),
            shared,
        });
        gw.set_tenant_series();
        gw.sync_lanes();
        gw.publish_degradation();
        Ok(gw)
    }

    /// The response cache.
    pub(crate) fn response_cache(&self) -> &crate::response_cache::ResponseCache {
        &self.response_cache
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.runtime.read().cfg.clone()
    }

    /// The runtime in force (tenants, models).
    pub(crate) fn runtime(&self) -> Arc<Runtime> {
        self.runtime.read().clone()
    }

    /// Every exported metric.
    pub fn metrics(&self) -> &Metrics {
        &self.ctx.metrics
    }

    /// The policy clock (tokio time).
    pub(crate) fn clock(&self) -> &crate::clock::TokioClock {
        &self.ctx.clock
    }

    /// Now, on the policy clock.
    pub(crate) fn now(&self) -> Timestamp {
        self.ctx.clock.now()
    }

    /// The pooled upstream client.
    pub(crate) fn client(&self) -> &HttpClient {
        &self.upstream.0
    }

    /// The connector proxied requests dial backends with (see [`Backend::connector`]).
    pub(crate) fn connector(&self) -> &Connector {
        &self.upstream.1
    }

    /// The limits every lane shares (global, per tenant).
    pub(crate) fn limits(&self) -> &SharedLimits<Key> {
        &self.ctx.limits
    }

    /// Each model's measured demand and backend replica recommendation.
    pub(crate) fn scaling(&self) -> &crate::autoscale::Scaling {
        &self.scaling
    }

    /// The shared store (`[state] backend = "redis"`).
    pub fn shared(&self) -> Option<&Arc<crate::shared::Shared>> {
        self.shared.as_ref()
    }

    /// Publishes each lane's degradation measures to its requests, which read them without
    /// taking the degrader's lock (see [`Lane::degradation`]).
    fn publish_degradation(&self) {
        let lanes = self.lanes();
        let degrader = self.degrader.lock();
        for lane in lanes {
            lane.set_degradation(degrader.decision(&lane.model));
        }
    }

    /// The degradation state (`/admin/state`'s `degradation`).
    pub fn degradation_json(&self) -> serde_json::Value {
        self.degrader.lock().state_json()
    }

    /// Forces a degradation level (`None`: back to automatic).
    pub(crate) fn force_degradation(&self, level: Option<usize>) {
        self.degrader.lock().force(level);
        self.publish_degradation();
    }

    /// The highest degradation level configured.
    pub(crate) fn max_degradation(&self) -> usize {
        self.degrader.lock().max_level()
    }

    /// Feeds a lane's signals to degradation and publishes the measures they lead to; returns
    /// its level.
    pub(crate) fn observe_degradation(
        &self,
        lane: &Lane,
        signals: levee_policy::LoadSignals,
        now: Timestamp,
    ) -> u8 {
        let mut degrader = self.degrader.lock();
        let level = degrader.observe(&lane.model, signals, now);
        lane.set_degradation(degrader.decision(&lane.model));
        level
    }

    /// The lane of a model.
    pub(crate) fn lane(&self, model: &str) -> Option<Arc<Lane>> {
        self.lanes.read().get(model).cloned()
    }

    /// All lanes (including ones of models removed by a reload that still drain).
    pub(crate) fn lanes(&self) -> Vec<Arc<Lane>> {
        let mut v: Vec<_> = self.lanes.read().values().cloned().collect();
        v.sort_by(|a, b| a.model.cmp(&b.model));
        v
    }

    /// Requests queued + in flight, all lanes.
    pub fn load(&self) -> u64 {
        self.ctx.load()
    }

    /// Requests queued now, all lanes.
    pub fn queued(&self) -> i64 {
        self.ctx.queued.load(Ordering::Relaxed)
    }

    /// Requests admitted and not yet finished, all lanes.
    pub fn in_flight(&self) -> i64 {
        self.ctx.in_flight.load(Ordering::Relaxed)
    }

    /// Per-IP guard: `Err(retry_after)` if `ip` is over its rate.
    pub(crate) fn check_ip(&self, ip: IpAddr) -> Result<(), Duration> {
        let now = self.now();
        self.ip_guard
            .lock()
            .check(&ip, now)
            .map_err(|nu| nu.retry_after)
    }

    /// Applies a new configuration. Validation failures leave the old one in force.
    /// Limiter state carries over (debt is kept), lanes keep their queues and the live state
    /// of backends whose URL did not change.
    pub fn reload(&self, cfg: Config) -> Result<(), Vec<String>> {
        let old = self.runtime();
        if cfg.listen != old.cfg.listen {
            tracing::warn!("listen addresses changed in the new config; restart to apply them");
        }
        if cfg.observe.otlp_endpoint != old.cfg.observe.otlp_endpoint {
            tracing::warn!("observe.otlp_endpoint changed in the new config; restart to apply it");
        }
        if cfg.state != old.cfg.state {
            // The store's kind and connection are fixed at start; the admission state must
            // keep agreeing with it about who decides the rates.
            return Err(vec![
                "state: [state] changed; restart the gateway to apply it".to_string(),
            ]);
        }
        if cfg.tasks != old.cfg.tasks {
            tracing::warn!("[tasks] changed in the new config; restart to apply it");
        }
        let rt = Runtime::build(cfg, Some(&old), &self.ctx.limits)?;
        let ip_changed = rt.cfg.ip_guard != old.cfg.ip_guard;
        let new_ip_quota = ip_quota(&rt.cfg);
        self.degrader.lock().reconfigure(&rt.cfg);
        *self.runtime.write() = Arc::new(rt);
        if ip_changed {
            *self.ip_guard.lock() = KeyedGcra::new(new_ip_quota, 100_000);
        }
        self.set_tenant_series();
        self.sync_lanes();
        self.publish_degradation();
        Ok(())
    }

    /// Tells the metrics which tenants get series of their own, and the watermarks.
    fn set_tenant_series(&self) {
        let rt = self.runtime();
        let m = &self.ctx.metrics;
        m.set_tenant_series(
            rt.tenants.iter().map(|t| &*t.name),
            rt.cfg.observe.max_tenant_series,
        );
        let q = &rt.cfg.queue;
        for (mark, v) in [("safe", q.safe), ("soft", q.soft), ("hard", q.hard)] {
            m.watermark
                .get_or_create(&crate::metrics::MarkLabel { mark: mark.into() })
                .set(i64::from(v));
        }
    }

    /// Makes the lanes match the models of the current config.
    fn sync_lanes(&self) {
        let rt = self.runtime();
        let adm_cfg = admission_config(&rt.cfg);
        let mut lanes = self.lanes.write();
        for m in &rt.cfg.models {
            let Some(model) = rt.models.get(&m.name) else {
                continue;
            };
            let spec = rt.model_spec(m);
            let lane = match lanes.get(&m.name) {
                Some(lane) => {
                    lane.reconfigure(&adm_cfg);
                    lane.set_spec(spec);
                    lane.clone()
                }
                None => {
                    let lane = Lane::start(model.name.clone(), self.ctx.clone(), spec, &adm_cfg);
                    lanes.insert(m.name.clone(), lane.clone());
                    lane
                }
            };
            let backends: Vec<Arc<Backend>> = m
                .backends
                .iter()
                .map(|b| {
                    let fresh = Backend::new(&m.name, b);
                    // Reuse live state (learned limits, health, adaptive limit) when only the
                    // caps changed; a backend whose settings changed starts fresh.
                    lane.existing_backend(&fresh.id)
                        .filter(|old| old.same_settings(&fresh))
                        .inspect(|old| old.set_config(b))
                        .unwrap_or_else(|| Arc::new(fresh))
                })
                .collect();
            if let Some(shared) = &self.shared {
                // On a fleet a backend never starts on the whole budget: until its first
                // grant, an equal part over the replicas last counted.
                let now = self.now();
                for b in backends.iter().filter(|b| b.fleet_slice().is_none()) {
                    b.set_fleet_slice(shared.slice_now(&b.key, b.budget(), now));
                }
            }
            lane.set_backends(backends);
        }
        // Models removed from the config: no new requests reach them (the model lookup
        // fails first), and their queued requests still drain to their backends.
        for (name, lane) in lanes.iter() {
            if !rt.models.contains_key(name) {
                lane.retire();
            }
        }
    }

    /// Whether the gateway is draining (refusing new work).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether `/readyz` says 503 because a drain began (see [`Gateway::begin_drain`]).
    pub fn is_leaving(&self) -> bool {
        self.leaving.load(Ordering::Relaxed)
    }

    /// Stops advertising: `/readyz` answers 503, requests are still served. Returns whether
    /// this call made the change.
    pub fn leave(&self) -> bool {
        !self.leaving.swap(true, Ordering::SeqCst)
    }

    /// Starts draining: new requests get 503 + Retry-After; queued and in-flight requests
    /// continue to completion.
    pub fn drain(&self) {
        self.leaving.store(true, Ordering::SeqCst);
        if !self.draining.swap(true, Ordering::SeqCst) {
            tracing::info!("draining: refusing new requests; queued and in-flight ones finish");
        }
    }

    /// Undoes a drain, begun or complete: `/readyz` answers 200 again and new requests are
    /// accepted (requests already answered 503 stay answered). Returns whether it was
    /// leaving or draining.
    pub fn undrain(&self) -> bool {
        let was_leaving = self.leaving.swap(false, Ordering::SeqCst);
        let was_draining = self.draining.swap(false, Ordering::SeqCst);
        if was_leaving || was_draining {
            tracing::info!("drain undone: advertised again, accepting new requests");
        }
        was_leaving || was_draining
    }

    /// Begins a drain in two steps, as a Kubernetes preStop hook needs them. At once the
    /// gateway stops advertising (`/readyz` answers 503, HTTP/1 answers close their connection
    /// so that clients reconnect to another replica) and keeps serving requests normally, for
    /// `server.drain_grace_ms`: the time endpoints take to drop the replica. Then it drains: new
    /// requests get 503 + Retry-After, queued and in-flight ones run to completion. Returns the
    /// grace. A second call changes nothing.
    pub fn begin_drain(self: &Arc<Self>) -> Duration {
        let grace = Duration::from_millis(self.config().server.drain_grace_ms);
        if !self.leave() {
            return grace;
        }
        tracing::info!(
            grace_ms = grace.as_millis() as u64,
            "drain: /readyz answers 503; serving until the grace has passed"
        );
        let gw = self.clone();
        let stopped = gw.stopped_token();
        tokio::spawn(async move {
            tokio::select! {
                _ = stopped.cancelled() => return,
                _ = tokio::time::sleep(grace) => {}
            }
            // Undone in the meantime: advertised again, nothing to drain.
            if gw.is_leaving() {
                gw.drain();
            }
        });
        grace
    }

    /// Answers every queued request 503 + Retry-After (shutdown).
    pub fn flush_queues(&self) {
        let retry = Duration::from_millis(self.config().server.drain_retry_after_ms);
        for lane in self.lanes() {
            lane.drain_queue(retry);
        }
    }

    /// Leaves the fleet's live set at once (a clean shutdown shortens nobody's share).
    pub async fn leave_fleet(&self) {
        if let Some(s) = &self.shared {
            s.leave().await;
        }
    }

    /// Stops background work and the lanes' dispatchers.
    pub fn stop(&self) {
        self.ctx.stopped.cancel();
    }

    /// Cancelled when the gateway stops.
    pub(crate) fn stopped_token(&self) -> CancellationToken {
        self.ctx.stopped.clone()
    }

    /// The `/admin/state` document.
    pub fn state_json(&self) -> serde_json::Value {
        let rt = self.runtime();
        let now = self.now();
        let limits = &self.ctx.limits;
        let tenants: Vec<_> = rt
            .tenants
            .iter()
            .map(|t| {
                let figures = match (&self.shared, rt.shared_scopes.get(&t.name)) {
                    (Some(s), Some(scopes)) => s.tenant_figures(scopes, now),
                    _ => limits.rate_limit_headers(&t.name, now),
                };
                serde_json::json!({
                    "name": &*t.name,
                    "tier": t.tier,
                    "priority": t.priority,
                    "weight": t.weight(),
                    "limits": limits_json(figures),
                })
            })
            .collect();
        let lanes: Vec<_> = self
            .lanes()
            .iter()
            .map(|l| l.state_json(now, &rt.tier_names()))
            .collect();
        serde_json::json!({
            "draining": self.is_draining(),
            "ready": !self.is_leaving(),
            "load": self.load(),
            "queued": self.queued(),
            "in_flight": self.in_flight(),
            "watermarks": {
                "per_model": true,
                "safe": rt.cfg.queue.safe,
                "soft": rt.cfg.queue.soft,
                "hard": rt.cfg.queue.hard,
            },
            "degradation": self.degradation_json(),
            "autoscale": self.scaling.state_json(),
            "global_limits": limits_json(limits.global_headers(now)),
            "state": match &self.shared {
                Some(s) => s.state_json(),
                None => serde_json::json!({"backend": "memory", "healthy": true, "mode": "local", "live_replicas": 1}),
            },
            "tenants": tenants,
            "models": lanes,
        })
    }
}

/// A scope's limits and what remains of them, for `/admin/state`.
fn limits_json(h: levee_policy::RateLimitHeaders) -> serde_json::Value {
    serde_json::json!({
        "requests_limit": h.requests.map(|i| i.limit),
        "requests_remaining": h.requests.map(|i| i.remaining),
        "tokens_limit": h.tokens.map(|i| i.limit),
        "tokens_remaining": h.tokens.map(|i| i.remaining),
        "concurrency_limit": h.concurrency.map(|c| c.1),
        "concurrency_in_use": h.concurrency.map(|c| c.0),
    })
}
