//! The gateway's shared state: the live configuration (swapped atomically on reload), the
//! per-model lanes (queues + backends, kept across reloads), limiters, degradation and
//! drain state, metrics.

use crate::clock::TokioClock;
use crate::config::{Config, ModelConfig, TenantConfig, TierConfig};
use crate::degrade::Degrader;
use crate::lane::Lane;
use crate::limits::Limits;
use crate::metrics::{BackendLabel, Metrics};
use crate::upstream::{build_client, Backend, HttpClient};
use levee_policy::{Clock, DrainRate, KeyedGcra, Quota, RetryBounds, WaitBudget, Watermarks};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// One tenant at run time.
#[derive(Debug)]
pub struct Tenant {
    /// Name.
    pub name: String,
    /// Tier name.
    pub tier: String,
    /// Strict priority (0 first), from the tier.
    pub priority: u8,
    /// Queue wait budgets, from the tier.
    pub budget: WaitBudget,
    /// Degradation level 3 may shed this tenant's tier.
    pub sheddable: bool,
    /// Fairness weight inside the tier.
    pub weight: f64,
    /// Requests/min, tokens/min, concurrency.
    pub limits: Arc<Limits>,
    /// The tighter limit for heavy requests.
    pub heavy: Arc<Limits>,
    /// This tenant's per-request metric series (kept across reloads with the tenant).
    pub metrics: crate::metrics::TenantMetrics,
    /// The name as the fair queue's tenant key (cloned, not allocated, per queued request).
    pub queue_key: Arc<str>,
    cfg: TenantConfig,
    tier_cfg: TierConfig,
}

/// One model at run time (its limits; its queue and backends live in its [`Lane`]).
#[derive(Debug)]
pub struct Model {
    /// Public name.
    pub name: String,
    /// Fallback model under degradation.
    pub fallback: Option<String>,
    /// Canned reply instead of a 503 when no backend can serve.
    pub fallback_response: Option<String>,
    /// Model-wide limits.
    pub limits: Arc<Limits>,
    cfg: ModelConfig,
}

/// Everything derived from one configuration. Replaced whole on reload; requests keep the
/// `Arc` of the runtime they started with.
#[derive(Debug)]
pub struct Runtime {
    /// The configuration.
    pub cfg: Arc<Config>,
    /// SHA-256 of each key → tenant.
    pub keys: HashMap<[u8; 32], Arc<Tenant>>,
    /// Tenants in config order.
    pub tenants: Vec<Arc<Tenant>>,
    /// Models by name.
    pub models: HashMap<String, Arc<Model>>,
    /// Global limits.
    pub global: Arc<Limits>,
    /// Queue watermarks over queued + in flight.
    pub watermarks: Watermarks,
    /// Bounds for capacity Retry-After estimates.
    pub retry_bounds: RetryBounds,
}

fn decode_key(hex_digest: &str) -> Option<[u8; 32]> {
    let v = hex::decode(hex_digest.to_ascii_lowercase()).ok()?;
    v.try_into().ok()
}

impl Runtime {
    /// Builds the runtime view of `cfg`, reusing limiter state from `prev` for tenants,
    /// models and global limits whose settings did not change (a reload must not hand every
    /// tenant a fresh quota).
    pub fn build(cfg: Config, prev: Option<&Runtime>) -> Result<Runtime, Vec<String>> {
        let errors = cfg.validate();
        if !errors.is_empty() {
            return Err(errors);
        }
        let watermarks = Watermarks::new(
            u64::from(cfg.queue.safe),
            u64::from(cfg.queue.soft),
            u64::from(cfg.queue.hard),
        )
        .map_err(|e| vec![format!("queue: {e}")])?;
        let global = match prev {
            Some(p) if p.cfg.limits == cfg.limits => p.global.clone(),
            _ => Arc::new(Limits::new(
                "global",
                cfg.limits.requests_per_minute,
                cfg.limits.tokens_per_minute,
                cfg.limits.max_concurrency,
            )),
        };
        let mut tenants = Vec::new();
        let mut keys = HashMap::new();
        for t in &cfg.tenants {
            let tier_cfg = cfg.tiers.get(&t.tier).cloned().unwrap_or_default();
            let reuse = prev.and_then(|p| {
                p.tenants
                    .iter()
                    .find(|o| o.cfg == *t && o.tier_cfg == tier_cfg && p.cfg.heavy == cfg.heavy)
                    .cloned()
            });
            let tenant = reuse.unwrap_or_else(|| {
                Arc::new(Tenant {
                    name: t.name.clone(),
                    tier: t.tier.clone(),
                    priority: tier_cfg.priority,
                    budget: WaitBudget {
                        normal: Duration::from_millis(tier_cfg.queue_wait_ms),
                        soft: Duration::from_millis(tier_cfg.soft_queue_wait_ms),
                    },
                    sheddable: tier_cfg.sheddable,
                    weight: t.weight,
                    limits: Arc::new(
                        Limits::new(
                            format!("tenant {}", t.name),
                            t.requests_per_minute,
                            t.tokens_per_minute,
                            t.max_concurrency,
                        )
                        .with_request_burst(t.requests_burst),
                    ),
                    heavy: Arc::new(Limits::new(
                        format!("tenant {} heavy requests", t.name),
                        cfg.heavy.requests_per_minute,
                        cfg.heavy.tokens_per_minute,
                        0,
                    )),
                    metrics: crate::metrics::TenantMetrics::default(),
                    queue_key: Arc::from(t.name.as_str()),
                    cfg: t.clone(),
                    tier_cfg: tier_cfg.clone(),
                })
            });
            for k in &t.key_sha256 {
                if let Some(d) = decode_key(k) {
                    keys.insert(d, tenant.clone());
                }
            }
            for var in &t.key_env {
                if let Ok(v) = std::env::var(var) {
                    if let Some(d) = decode_key(&crate::config::hash_key(&v)) {
                        keys.insert(d, tenant.clone());
                    }
                }
            }
            tenants.push(tenant);
        }
        let mut models = HashMap::new();
        for m in &cfg.models {
            let reuse = prev
                .and_then(|p| p.models.get(&m.name))
                .filter(|o| o.cfg.requests_per_minute == m.requests_per_minute)
                .filter(|o| o.cfg.tokens_per_minute == m.tokens_per_minute)
                .map(|o| o.limits.clone());
            let limits = reuse.unwrap_or_else(|| {
                Arc::new(Limits::new(
                    format!("model {}", m.name),
                    m.requests_per_minute,
                    m.tokens_per_minute,
                    0,
                ))
            });
            models.insert(
                m.name.clone(),
                Arc::new(Model {
                    name: m.name.clone(),
                    fallback: m.fallback.clone(),
                    fallback_response: m.fallback_response.clone(),
                    limits,
                    cfg: m.clone(),
                }),
            );
        }
        Ok(Runtime {
            cfg: Arc::new(cfg),
            keys,
            tenants,
            models,
            global,
            watermarks,
            retry_bounds: RetryBounds::default(),
        })
    }

    /// The tenant owning `key`, if any.
    pub fn tenant_for_key(&self, key: &str) -> Option<&Arc<Tenant>> {
        use sha2::{Digest, Sha256};
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        self.keys.get(&digest)
    }
}

/// The shared gateway.
pub struct Gateway {
    runtime: RwLock<Arc<Runtime>>,
    lanes: RwLock<HashMap<String, Arc<Lane>>>,
    /// Every exported metric.
    pub metrics: Metrics,
    /// The pooled upstream client.
    pub client: HttpClient,
    /// The policy clock (tokio time).
    pub clock: TokioClock,
    draining: AtomicBool,
    stopped: CancellationToken,
    /// Degradation state (automatic level, forced level, hysteresis).
    pub degrader: Mutex<Degrader>,
    ip_guard: Mutex<KeyedGcra<IpAddr>>,
    /// Requests queued, all lanes (part of the watermark load).
    pub queued: AtomicI64,
    /// Requests admitted and not finished past the queue, all lanes.
    pub in_flight: AtomicI64,
    /// How fast the queue drains (dispatches per second), for Retry-After estimates.
    pub drain_rate: Mutex<DrainRate>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").finish_non_exhaustive()
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
        let rt = Runtime::build(cfg, None)
            .map_err(|e| anyhow::anyhow!("invalid configuration: {}", e.join("; ")))?;
        let clock = TokioClock::new();
        let degrader = Degrader::new(&rt.cfg);
        let ip_guard = KeyedGcra::new(ip_quota(&rt.cfg), 100_000);
        let gw = Arc::new(Gateway {
            runtime: RwLock::new(Arc::new(rt)),
            lanes: RwLock::new(HashMap::new()),
            metrics: Metrics::new(),
            client: build_client(),
            clock,
            draining: AtomicBool::new(false),
            stopped: CancellationToken::new(),
            degrader: Mutex::new(degrader),
            ip_guard: Mutex::new(ip_guard),
            queued: AtomicI64::new(0),
            in_flight: AtomicI64::new(0),
            drain_rate: Mutex::new(DrainRate::new(Duration::from_secs(5))),
        });
        gw.sync_lanes();
        Ok(gw)
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.runtime.read().cfg.clone()
    }

    /// The runtime in force (tenants, models, limits).
    pub fn runtime(&self) -> Arc<Runtime> {
        self.runtime.read().clone()
    }

    /// The lane of a model.
    pub fn lane(&self, model: &str) -> Option<Arc<Lane>> {
        self.lanes.read().get(model).cloned()
    }

    /// All lanes (including ones of models removed by a reload that still drain).
    pub fn lanes(&self) -> Vec<Arc<Lane>> {
        let mut v: Vec<_> = self.lanes.read().values().cloned().collect();
        v.sort_by(|a, b| a.model.cmp(&b.model));
        v
    }

    /// Watermark load: queued + in flight.
    pub fn load(&self) -> u64 {
        let q = self.queued.load(Ordering::Relaxed).max(0);
        let f = self.in_flight.load(Ordering::Relaxed).max(0);
        u64::try_from(q + f).unwrap_or(0)
    }

    /// The watermark load a request of priority `priority` sees: everything in flight plus
    /// what is queued at its priority or higher. Requests of lower tiers would be served
    /// after it, so they must not push it over a watermark: a flood of free-tier traffic can
    /// fill the queue to the hard mark, but cannot lock premium out of it.
    pub fn load_for_priority(&self, priority: u8) -> u64 {
        let f = self.in_flight.load(Ordering::Relaxed).max(0);
        let q: usize = self
            .lanes
            .read()
            .values()
            .map(|l| l.queued_at_or_above(priority))
            .sum();
        u64::try_from(f).unwrap_or(0) + u64::try_from(q).unwrap_or(u64::MAX)
    }

    /// Per-IP guard: `Err(retry_after)` if `ip` is over its rate.
    pub fn check_ip(&self, ip: IpAddr) -> Result<(), Duration> {
        let now = self.clock.now();
        self.ip_guard
            .lock()
            .check(&ip, now)
            .map_err(|nu| nu.retry_after)
    }

    /// Applies a new configuration. Validation failures leave the old one in force.
    /// Limiter state carries over where settings did not change; lanes keep their queues
    /// and the in-flight counts of backends whose URL did not change.
    pub fn reload(self: &Arc<Self>, cfg: Config) -> Result<(), Vec<String>> {
        let old = self.runtime();
        if cfg.listen != old.cfg.listen {
            tracing::warn!("listen addresses changed in the new config; restart to apply them");
        }
        let rt = Runtime::build(cfg, Some(&old))?;
        let ip_changed = rt.cfg.ip_guard != old.cfg.ip_guard;
        let new_ip_quota = ip_quota(&rt.cfg);
        self.degrader.lock().reconfigure(&rt.cfg);
        *self.runtime.write() = Arc::new(rt);
        if ip_changed {
            *self.ip_guard.lock() = KeyedGcra::new(new_ip_quota, 100_000);
        }
        self.sync_lanes();
        Ok(())
    }

    /// Makes the lanes match the models of the current config.
    fn sync_lanes(self: &Arc<Self>) {
        let rt = self.runtime();
        let mut lanes = self.lanes.write();
        for m in &rt.cfg.models {
            let lane = lanes
                .entry(m.name.clone())
                .or_insert_with(|| {
                    let lane = Lane::new(&m.name);
                    lane.spawn_dispatcher(Arc::downgrade(self));
                    lane
                })
                .clone();
            let backends: Vec<Arc<Backend>> = m
                .backends
                .iter()
                .map(|b| {
                    let fresh = Backend::new(&m.name, b);
                    // Reuse live state (in-flight count, breaker, adaptive limit) when only
                    // the cap changed; a backend whose settings changed starts fresh (its
                    // in-flight requests still release the old one).
                    lane.existing_backend(&fresh.id)
                        .filter(|old| old.same_settings(&fresh))
                        .inspect(|old| {
                            old.max_in_flight.store(b.max_in_flight, Ordering::Relaxed);
                        })
                        .unwrap_or_else(|| Arc::new(fresh))
                })
                .collect();
            lane.configure(backends, &rt.cfg.breaker, self);
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

    /// Starts draining: `/readyz` answers 503, new requests get 503 + Retry-After, queued
    /// requests are answered 503 now, in-flight requests continue.
    pub fn drain(&self) {
        if !self.draining.swap(true, Ordering::SeqCst) {
            tracing::info!("draining: refusing new requests, answering queued ones");
        }
        let retry = Duration::from_millis(self.config().server.drain_retry_after_ms);
        for lane in self.lanes() {
            lane.drain_queue(self, retry);
        }
    }

    /// Stops background tasks.
    pub fn stop(&self) {
        self.stopped.cancel();
    }

    /// Cancelled when the gateway stops.
    pub fn stopped_token(&self) -> CancellationToken {
        self.stopped.clone()
    }

    /// Whether the load is at the hard watermark (then `/readyz` says 503).
    pub fn at_hard_watermark(&self) -> bool {
        self.load() >= self.runtime().watermarks.hard
    }

    /// Spawns the scraper and the degradation ticker.
    pub fn spawn_background(self: &Arc<Self>) {
        let gw = self.clone();
        let stop = self.stopped.clone();
        tokio::spawn(async move {
            loop {
                let cfg = gw.config();
                let interval = Duration::from_millis(cfg.scrape.interval_ms.max(50));
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(interval) => {}
                }
                if cfg.scrape.interval_ms == 0 {
                    continue;
                }
                let timeout = Duration::from_millis(cfg.scrape.timeout_ms.max(10));
                let mut jobs = Vec::new();
                for lane in gw.lanes() {
                    for b in lane.backends() {
                        let client = gw.client.clone();
                        let n = cfg.scrape.unhealthy_after.max(1);
                        jobs.push(async move {
                            b.scrape(&client, timeout, n).await;
                        });
                    }
                }
                futures::future::join_all(jobs).await;
                gw.refresh_backend_metrics();
                // A backend that came back healthy may have room for queued requests.
                for lane in gw.lanes() {
                    lane.pump(&gw);
                }
            }
        });
        let gw = self.clone();
        let stop = self.stopped.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
                gw.update_degrade();
            }
        });
    }

    /// Re-evaluates the automatic degradation level from the current load.
    pub fn update_degrade(&self) -> u8 {
        let rt = self.runtime();
        let load = self.load();
        let now = self.clock.now();
        let level = self.degrader.lock().observe(load, &rt.watermarks, now);
        self.metrics.degrade_level.set(i64::from(level));
        level
    }

    /// Updates per-backend gauges from the lanes.
    pub fn refresh_backend_metrics(&self) {
        for lane in self.lanes() {
            for b in lane.backends() {
                let l = BackendLabel {
                    backend: b.id.clone(),
                };
                self.metrics
                    .backend_in_flight
                    .get_or_create(&l)
                    .set(i64::from(b.in_flight.load(Ordering::Relaxed)));
                self.metrics
                    .backend_healthy
                    .get_or_create(&l)
                    .set(i64::from(b.healthy.load(Ordering::Relaxed)));
                if let Some(load) = *b.load.lock() {
                    self.metrics
                        .backend_load
                        .get_or_create(&l)
                        .set(load.running + load.waiting);
                    self.metrics.backend_kv.get_or_create(&l).set(load.kv_usage);
                }
                self.metrics
                    .breaker_state
                    .get_or_create(&l)
                    .set(lane.breaker_code(&b.id, self.clock.now()));
            }
        }
    }

    /// The `/admin/state` document.
    pub fn state_json(&self) -> serde_json::Value {
        let rt = self.runtime();
        let now = self.clock.now();
        let tenants: Vec<_> = rt
            .tenants
            .iter()
            .map(|t| {
                serde_json::json!({
                    "name": t.name,
                    "tier": t.tier,
                    "priority": t.priority,
                    "weight": t.weight,
                    "limits": t.limits.snapshot(now),
                    "heavy": t.heavy.snapshot(now),
                })
            })
            .collect();
        let lanes: Vec<_> = self
            .lanes()
            .iter()
            .map(|l| l.state_json(self, now))
            .collect();
        let deg = self.degrader.lock().state_json();
        serde_json::json!({
            "draining": self.is_draining(),
            "load": self.load(),
            "queued": self.queued.load(Ordering::Relaxed),
            "in_flight": self.in_flight.load(Ordering::Relaxed),
            "watermarks": {
                "safe": rt.watermarks.safe,
                "soft": rt.watermarks.soft,
                "hard": rt.watermarks.hard,
                "zone": rt.watermarks.zone(self.load()).as_str(),
            },
            "drain_rate_per_s": self.drain_rate.lock().per_second(now),
            "degradation": deg,
            "global_limits": rt.global.snapshot(now),
            "tenants": tenants,
            "models": lanes,
        })
    }
}
