//! The gateway's shared state: the live configuration (swapped atomically on reload), the
//! one [`Admission`] state every request passes through (limits, lanes, queues, backends,
//! breakers — levee-policy's pure composition behind one lock), each model's lane handle
//! (its backends' I/O side and its dispatcher task), degradation and drain state, metrics.

use crate::clock::TokioClock;
use crate::config::{Config, ModelConfig, StateBackend, TenantConfig, TierConfig};
use crate::degrade::Degrader;
use crate::lane::{Lane, Waiter};
use crate::metrics::{BackendLabel, Metrics};
use crate::tokenize::TokenCounter;
use crate::upstream::{build_client, Backend, HttpClient};
use levee_policy::{
    Admission, AdmissionConfig, BackendLimits, Clock, HeavyRule, Key, KeyedGcra, LaneConfig,
    LimitSpec, ModelSpec, Quota, RetryBounds, TenantSpec, WaitBudget, Watermarks,
};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The admission state: levee-policy's one path, keyed by tenant and model names.
pub type Adm = Admission<Waiter, Key>;

/// One tenant at run time.
#[derive(Debug)]
pub struct Tenant {
    /// Name (also its key in the admission state and the fair queue).
    pub name: Key,
    /// Tier name.
    pub tier: String,
    /// Strict priority (0 first), from the tier.
    pub priority: u8,
    /// Degradation may shed this tenant's tier.
    pub sheddable: bool,
    /// Its tier's waiting streams get position comments without asking.
    pub queue_updates: bool,
    /// This tenant's per-request metric series (kept across reloads with the tenant).
    pub metrics: crate::metrics::TenantMetrics,
    cfg: TenantConfig,
    tier_cfg: TierConfig,
}

impl Tenant {
    /// The secret that signs its task callbacks, from `callback_secret_env`.
    pub fn callback_secret(&self) -> Option<String> {
        let var = self.cfg.callback_secret_env.as_ref()?;
        std::env::var(var).ok().filter(|v| !v.is_empty())
    }
}

/// One model at run time (its queue and backends live in its [`Lane`] and the admission
/// state).
#[derive(Debug)]
pub struct Model {
    /// Public name (also its key in the admission state).
    pub name: Key,
    /// Fallback model under degradation.
    pub fallback: Option<String>,
    /// Canned reply instead of a 503 when no backend can serve.
    pub fallback_response: Option<String>,
    /// Completion budget injected when a request gives no `max_tokens`.
    pub default_max_tokens: u32,
    /// Longest context (prompt + completion) a request may ask for, from config.
    pub max_context_tokens: Option<u64>,
    /// Time-to-first-token target for degradation (1.5× it is the alarm line).
    pub ttft_slo: Option<Duration>,
    /// How prompt tokens are counted.
    pub counter: TokenCounter,
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
    /// Each tenant's scopes in the shared limit store (`[state] backend = "redis"` only).
    pub shared_scopes: HashMap<Key, Arc<[levee_store::ScopeLimits]>>,
}

fn decode_key(hex_digest: &str) -> Option<[u8; 32]> {
    let v = hex::decode(hex_digest.to_ascii_lowercase()).ok()?;
    v.try_into().ok()
}

fn limit_spec(rpm: u32, burst: u32, tpm: u64, concurrency: u32) -> LimitSpec {
    LimitSpec {
        requests_per_minute: (rpm > 0).then_some(u64::from(rpm)),
        request_burst: (rpm > 0 && burst > 0).then_some(u64::from(burst)),
        tokens_per_minute: (tpm > 0).then_some(tpm),
        token_burst: None,
        max_concurrent: (concurrency > 0)
            .then(|| usize::try_from(concurrency).unwrap_or(usize::MAX)),
    }
}

/// Converts a fractional fairness weight to the policy's integer weight (two decimals).
fn weight_units(w: f64) -> u32 {
    (w * 100.0).round().clamp(1.0, f64::from(u32::MAX)) as u32
}

impl Runtime {
    /// Builds the runtime view of `cfg`, reusing tenants and models whose settings did not
    /// change (they keep their metric handles and tokenizers).
    pub fn build(cfg: Config, prev: Option<&Runtime>) -> Result<Runtime, Vec<String>> {
        let errors = cfg.validate();
        if !errors.is_empty() {
            return Err(errors);
        }
        let mut tenants = Vec::new();
        let mut keys = HashMap::new();
        for t in &cfg.tenants {
            let tier_cfg = cfg.tiers.get(&t.tier).cloned().unwrap_or_default();
            let reuse = prev.and_then(|p| {
                p.tenants
                    .iter()
                    .find(|o| o.cfg == *t && o.tier_cfg == tier_cfg)
                    .cloned()
            });
            let tenant = reuse.unwrap_or_else(|| {
                Arc::new(Tenant {
                    name: Key::new(&t.name),
                    tier: t.tier.clone(),
                    priority: tier_cfg.priority,
                    sheddable: tier_cfg.sheddable,
                    queue_updates: tier_cfg.queue_updates,
                    metrics: crate::metrics::TenantMetrics::default(),
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
        let mut errors = Vec::new();
        for (i, m) in cfg.models.iter().enumerate() {
            let reuse = prev
                .and_then(|p| p.models.get(&m.name))
                .filter(|o| {
                    o.cfg == *m
                        && o.default_max_tokens
                            == m.default_max_tokens
                                .unwrap_or(cfg.server.default_max_tokens)
                })
                .cloned();
            let model = match reuse {
                Some(m) => m,
                None => {
                    let counter = match &m.tokenizer {
                        None => TokenCounter::CharsPerToken,
                        Some(path) => match TokenCounter::from_file(path) {
                            Ok(c) => c,
                            Err(e) => {
                                errors.push(format!("models[{i}].tokenizer: {e}"));
                                continue;
                            }
                        },
                    };
                    Arc::new(Model {
                        name: Key::new(&m.name),
                        fallback: m.fallback.clone(),
                        fallback_response: m.fallback_response.clone(),
                        default_max_tokens: m
                            .default_max_tokens
                            .unwrap_or(cfg.server.default_max_tokens),
                        max_context_tokens: m.max_context_tokens,
                        ttft_slo: m.ttft_slo_ms.map(Duration::from_millis),
                        counter,
                        cfg: m.clone(),
                    })
                }
            };
            models.insert(m.name.clone(), model);
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let mut shared_scopes = HashMap::new();
        if cfg.state.backend == StateBackend::Redis {
            for (t, tenant) in cfg.tenants.iter().zip(&tenants) {
                shared_scopes.insert(tenant.name.clone(), crate::shared::scopes(&cfg, t));
            }
        }
        Ok(Runtime {
            cfg: Arc::new(cfg),
            keys,
            tenants,
            models,
            shared_scopes,
        })
    }

    /// The tenant owning `key`, if any.
    pub fn tenant_for_key(&self, key: &str) -> Option<&Arc<Tenant>> {
        use sha2::{Digest, Sha256};
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        self.keys.get(&digest)
    }

    /// Whether tenant and global request and token rates are decided in the shared store
    /// (then the admission state does not decide them again).
    pub fn rates_shared(&self) -> bool {
        self.cfg.state.backend == StateBackend::Redis
    }

    /// The admission settings of this configuration.
    fn admission_config(&self) -> AdmissionConfig {
        let cfg = &self.cfg;
        let shared = self.rates_shared();
        let max_prio = cfg.tiers.values().map(|t| t.priority).max().unwrap_or(0);
        let mut tiers = vec![
            WaitBudget {
                normal: Duration::from_secs(1),
                soft: Duration::ZERO,
            };
            usize::from(max_prio) + 1
        ];
        for t in cfg.tiers.values() {
            tiers[usize::from(t.priority)] = WaitBudget {
                normal: Duration::from_millis(t.queue_wait_ms),
                soft: Duration::from_millis(t.soft_queue_wait_ms),
            };
        }
        let h = &cfg.heavy;
        AdmissionConfig {
            global: limit_spec(
                if shared {
                    0
                } else {
                    cfg.limits.requests_per_minute
                },
                0,
                if shared {
                    0
                } else {
                    cfg.limits.tokens_per_minute
                },
                cfg.limits.max_concurrency,
            ),
            tenant_default: LimitSpec::UNLIMITED,
            heavy: Some(HeavyRule {
                prompt_tokens_over: if h.prompt_tokens_over == 0 {
                    u64::MAX
                } else {
                    h.prompt_tokens_over
                },
                completion_tokens_over: if h.max_tokens_over == 0 {
                    u64::MAX
                } else {
                    h.max_tokens_over
                },
                per_tenant: limit_spec(h.requests_per_minute, 0, h.tokens_per_minute, 0),
            }),
            tiers,
            max_tracked_keys: 100_000,
            retry: RetryBounds::default(),
        }
    }

    fn lane_config(&self) -> LaneConfig {
        let q = &self.cfg.queue;
        let marks = Watermarks::new(u64::from(q.safe), u64::from(q.soft), u64::from(q.hard))
            .unwrap_or(Watermarks {
                safe: 256,
                soft: 1024,
                hard: 4096,
            });
        let mut lane = LaneConfig::new(marks);
        lane.queue_max_tokens = match q.max_queued_tokens {
            0 => u64::MAX,
            n => n,
        };
        lane.fair_share_window = Duration::from_millis(q.fair_share_window_ms);
        lane.kv_headroom = self.cfg.kv.headroom;
        lane.report_max_age = Duration::from_millis(self.cfg.kv.report_max_age_ms);
        lane.breaker = self.cfg.breaker.to_policy();
        // The batch band's tasks run at their tier; its requests keep off a backend that may
        // still have an interactive prompt waiting for a prefill step.
        lane.isolated_tier = self
            .cfg
            .tasks
            .enabled
            .then(|| self.cfg.tiers.get(&self.cfg.tasks.tier))
            .flatten()
            .map(|t| levee_policy::Tier(t.priority));
        lane
    }
}

/// The shared gateway.
pub struct Gateway {
    runtime: RwLock<Arc<Runtime>>,
    lanes: RwLock<HashMap<String, Arc<Lane>>>,
    /// The admission state (one lock; see `docs/policy.md` for why one is enough).
    pub admission: Mutex<Adm>,
    /// Every exported metric.
    pub metrics: Metrics,
    /// The pooled upstream client.
    pub client: HttpClient,
    /// The policy clock (tokio time).
    pub clock: TokioClock,
    draining: AtomicBool,
    /// `/readyz` says 503 (a drain began) while requests are still served.
    leaving: AtomicBool,
    stopped: CancellationToken,
    /// Degradation state, per model lane.
    pub degrader: Mutex<Degrader>,
    ip_guard: Mutex<KeyedGcra<IpAddr>>,
    /// Requests queued, all lanes.
    pub queued: AtomicI64,
    /// Requests admitted and not yet finished past the queue, all lanes.
    pub in_flight: AtomicI64,
    /// Each model's measured demand and backend replica recommendation.
    pub scaling: crate::autoscale::Scaling,
    /// The shared limit store (`[state] backend = "redis"`).
    pub shared: Option<Arc<crate::shared::Shared>>,
    /// Async tasks, when `tasks.enabled`.
    tasks: Option<Arc<crate::tasks::Tasks>>,
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
        let admission = Admission::new(rt.admission_config());
        let metrics = match rt.cfg.state.backend {
            StateBackend::Memory => Metrics::new(),
            StateBackend::Redis => Metrics::with_shared_state(),
        };
        let shared = match rt.cfg.state.backend {
            StateBackend::Memory => None,
            StateBackend::Redis => Some(Arc::new(crate::shared::Shared::new(
                &rt.cfg.state,
                clock,
                &metrics,
            )?)),
        };
        let tasks = match (&shared, rt.cfg.tasks.enabled) {
            (_, false) => None,
            (None, true) => Some(Arc::new(crate::tasks::Tasks::open(&rt.cfg.tasks)?)),
            (Some(s), true) => Some(Arc::new(crate::tasks::Tasks::open_shared(
                &rt.cfg.tasks,
                &rt.cfg.state,
                s.redacted_url(),
                s.replica(),
            )?)),
        };
        let gw = Arc::new(Gateway {
            runtime: RwLock::new(Arc::new(rt)),
            lanes: RwLock::new(HashMap::new()),
            admission: Mutex::new(admission),
            metrics,
            client: build_client().map_err(|e| anyhow::anyhow!(e))?,
            clock,
            draining: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            stopped: CancellationToken::new(),
            degrader: Mutex::new(degrader),
            ip_guard: Mutex::new(ip_guard),
            queued: AtomicI64::new(0),
            in_flight: AtomicI64::new(0),
            scaling: crate::autoscale::Scaling::default(),
            shared,
            tasks,
        });
        gw.set_tenant_series();
        gw.sync_lanes();
        Ok(gw)
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.runtime.read().cfg.clone()
    }

    /// The runtime in force (tenants, models).
    pub fn runtime(&self) -> Arc<Runtime> {
        self.runtime.read().clone()
    }

    /// Async tasks, when enabled.
    pub fn tasks(&self) -> Option<&Arc<crate::tasks::Tasks>> {
        self.tasks.as_ref()
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

    /// Requests queued + in flight, all lanes.
    pub fn load(&self) -> u64 {
        let q = self.queued.load(Ordering::Relaxed).max(0);
        let f = self.in_flight.load(Ordering::Relaxed).max(0);
        u64::try_from(q + f).unwrap_or(0)
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
    /// Limiter state carries over (debt is kept), lanes keep their queues and the live state
    /// of backends whose URL did not change.
    pub fn reload(self: &Arc<Self>, cfg: Config) -> Result<(), Vec<String>> {
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
        let rt = Runtime::build(cfg, Some(&old))?;
        let ip_changed = rt.cfg.ip_guard != old.cfg.ip_guard;
        let new_ip_quota = ip_quota(&rt.cfg);
        self.degrader.lock().reconfigure(&rt.cfg);
        self.admission.lock().reconfigure(rt.admission_config());
        *self.runtime.write() = Arc::new(rt);
        if ip_changed {
            *self.ip_guard.lock() = KeyedGcra::new(new_ip_quota, 100_000);
        }
        self.set_tenant_series();
        self.sync_lanes();
        Ok(())
    }

    /// Tells the metrics which tenants get series of their own, and the watermarks.
    fn set_tenant_series(&self) {
        let rt = self.runtime();
        self.metrics.set_tenant_series(
            rt.tenants.iter().map(|t| &*t.name),
            rt.cfg.observe.max_tenant_series,
        );
        let q = &rt.cfg.queue;
        for (mark, v) in [("safe", q.safe), ("soft", q.soft), ("hard", q.hard)] {
            self.metrics
                .watermark
                .get_or_create(&crate::metrics::MarkLabel { mark: mark.into() })
                .set(i64::from(v));
        }
    }

    /// Makes the lanes and the admission state match the models and tenants of the
    /// current config.
    fn sync_lanes(self: &Arc<Self>) {
        let rt = self.runtime();
        let lane_cfg = rt.lane_config();
        {
            let mut adm = self.admission.lock();
            let shared = rt.rates_shared();
            for t in &rt.tenants {
                adm.set_tenant(
                    t.name.clone(),
                    TenantSpec {
                        limits: limit_spec(
                            if shared { 0 } else { t.cfg.requests_per_minute },
                            t.cfg.requests_burst,
                            if shared { 0 } else { t.cfg.tokens_per_minute },
                            if shared { 0 } else { t.cfg.max_concurrency },
                        ),
                        weight: weight_units(t.cfg.weight),
                    },
                );
            }
        }
        let mut lanes = self.lanes.write();
        for m in &rt.cfg.models {
            let Some(model) = rt.models.get(&m.name) else {
                continue;
            };
            let lane = lanes
                .entry(m.name.clone())
                .or_insert_with(|| {
                    let lane = Lane::new(model.name.clone());
                    lane.spawn_dispatcher(Arc::downgrade(self));
                    lane
                })
                .clone();
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
            let limits: Vec<(Arc<str>, BackendLimits)> = backends
                .iter()
                .map(|b| (b.key.clone(), b.limits()))
                .collect();
            lane.set_backends(backends);
            let mut adm = self.admission.lock();
            adm.set_model(
                model.name.clone(),
                ModelSpec {
                    limits: limit_spec(m.requests_per_minute, 0, m.tokens_per_minute, 0),
                    lane: lane_cfg.clone(),
                },
            );
            adm.set_backends(&model.name, limits);
            drop(adm);
            lane.wake();
        }
        // Models removed from the config: no new requests reach them (the model lookup
        // fails first), and their queued requests still drain to their backends.
        for (name, lane) in lanes.iter() {
            if !rt.models.contains_key(name) {
                lane.retire();
            }
        }
    }

    /// Pushes a backend's current limits (config, learned, adaptive) to the admission state.
    pub fn push_backend_limits(&self, lane: &Lane, b: &Backend) {
        self.admission
            .lock()
            .set_backend_limits(&lane.model, &b.key, b.limits());
    }

    /// Whether the gateway is draining (refusing new work).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether `/readyz` says 503 because a drain began (see [`crate::server::begin_drain`]).
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

    /// Answers every queued request 503 + Retry-After (shutdown).
    pub fn flush_queues(&self) {
        let retry = Duration::from_millis(self.config().server.drain_retry_after_ms);
        for lane in self.lanes() {
            lane.drain_queue(self, retry);
        }
    }

    /// Leaves the fleet's live set at once (a clean shutdown shortens nobody's share) and
    /// hands the async tasks this replica holds back to the fleet's queue.
    pub async fn leave_fleet(&self) {
        if let Some(s) = &self.shared {
            s.leave().await;
        }
        if let Some(t) = &self.tasks {
            t.leave().await;
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

    /// Spawns the scraper, the degradation ticker and, with a shared store, the heartbeat.
    pub fn spawn_background(self: &Arc<Self>) {
        if let Some(shared) = self.shared.clone() {
            let stop = self.stopped.clone();
            tokio::spawn(async move {
                loop {
                    shared.beat().await;
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(shared.heartbeat_interval()) => {}
                    }
                }
            });
        }
        let gw = self.clone();
        let stop = self.stopped.clone();
        tokio::spawn(async move {
            // The first scrape runs at once: a backend that is down at start must not draw
            // traffic until three scrapes have failed.
            let mut first = true;
            loop {
                let cfg = gw.config();
                let interval = Duration::from_millis(cfg.scrape.interval_ms.max(50));
                if !first {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(interval) => {}
                    }
                }
                first = false;
                if cfg.scrape.interval_ms == 0 {
                    continue;
                }
                let timeout = Duration::from_millis(cfg.scrape.timeout_ms.max(10));
                let mut jobs = Vec::new();
                for lane in gw.lanes() {
                    for b in lane.backends() {
                        let gw = gw.clone();
                        let lane = lane.clone();
                        let n = cfg.scrape.unhealthy_after.max(1);
                        jobs.push(async move {
                            b.scrape(&gw.client, timeout, n).await;
                            let now = gw.clock.now();
                            let mut adm = gw.admission.lock();
                            adm.set_backend_limits(&lane.model, &b.key, b.limits());
                            adm.set_routable(&lane.model, &b.key, b.is_routable());
                            if let Some(r) = b.report() {
                                adm.report(&lane.model, &b.key, r, now);
                            }
                        });
                    }
                }
                futures::future::join_all(jobs).await;
                gw.refresh_backend_metrics();
                // A backend that came back may have room for queued requests; one that went
                // away may leave its lane unable to serve them.
                for lane in gw.lanes() {
                    lane.wake();
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
        let gw = self.clone();
        let stop = self.stopped.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                gw.update_scaling();
            }
        });
    }

    /// Samples every lane and updates its backend replica recommendation.
    pub fn update_scaling(&self) {
        let cfg = self.config();
        let now = self.clock.now();
        for lane in self.lanes() {
            if lane.is_retired() {
                continue;
            }
            let (stats, queued) = {
                let adm = self.admission.lock();
                match adm.lane(&lane.model) {
                    Some(l) => (l.backend_stats(now), l.queued()),
                    None => continue,
                }
            };
            let busy: usize = stats.iter().map(|s| s.in_flight).sum();
            let slots: usize = stats.iter().map(|s| s.request_cap).sum();
            let per_replica = slots / stats.len().max(1);
            let sample = crate::autoscale::LaneSample {
                queued: queued as u64,
                busy_slots: busy as u64,
                slots_per_replica: u32::try_from(per_replica).unwrap_or(u32::MAX),
            };
            let snap = self
                .scaling
                .observe(&lane.model, sample, &cfg.autoscale, now);
            let label = crate::metrics::ModelLabel {
                model: lane.model.to_string(),
            };
            self.metrics
                .recommended_replicas
                .get_or_create(&label)
                .set(i64::from(snap.replicas));
            self.metrics
                .offered_load
                .get_or_create(&label)
                .set(snap.offered_load);
        }
    }

    /// Re-evaluates each lane's automatic degradation level; returns the highest.
    pub fn update_degrade(&self) -> u8 {
        let now = self.clock.now();
        let rt = self.runtime();
        let hard = u64::from(rt.cfg.queue.hard).max(1) as f64;
        let mut top = 0;
        for lane in self.lanes() {
            let (load, kv) = {
                let adm = self.admission.lock();
                match adm.lane(&lane.model) {
                    Some(l) => (l.load(), l.kv_fill(now)),
                    None => continue,
                }
            };
            let slo = rt.models.get(&*lane.model).and_then(|m| m.ttft_slo);
            let signals = lane.signals(load as f64 / hard, kv, slo, now);
            let level = self.degrader.lock().observe(&lane.model, signals, now);
            self.metrics.degrade_level(&lane.model, level);
            top = top.max(level);
        }
        top
    }

    /// Updates per-backend gauges from the admission state.
    pub fn refresh_backend_metrics(&self) {
        let now = self.clock.now();
        for lane in self.lanes() {
            let stats = {
                let adm = self.admission.lock();
                match adm.lane(&lane.model) {
                    Some(l) => l.backend_stats(now),
                    None => continue,
                }
            };
            for b in lane.backends() {
                let l = BackendLabel {
                    backend: b.id.clone(),
                };
                if let Some(st) = stats.iter().find(|s| s.id == b.key) {
                    let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
                    self.metrics
                        .backend_in_flight
                        .get_or_create(&l)
                        .set(as_i64(st.in_flight));
                    self.metrics
                        .backend_tokens_in_flight
                        .get_or_create(&l)
                        .set(i64::try_from(st.tokens_in_flight).unwrap_or(i64::MAX));
                    if let Some(kv) = st.kv_tokens {
                        self.metrics
                            .backend_kv_budget
                            .get_or_create(&l)
                            .set(i64::try_from(kv).unwrap_or(i64::MAX));
                    }
                    self.metrics
                        .breaker_state
                        .get_or_create(&l)
                        .set(st.breaker.state.as_gauge());
                    self.metrics.observe_breaker(
                        &b.id,
                        st.breaker.state.as_gauge(),
                        st.breaker.opened_total,
                        now,
                    );
                }
                self.metrics
                    .backend_max_in_flight
                    .get_or_create(&l)
                    .set(i64::from(b.max_in_flight.load(Ordering::Relaxed)));
                self.metrics
                    .backend_healthy
                    .get_or_create(&l)
                    .set(i64::from(b.is_routable()));
                if let Some(load) = b.reported() {
                    self.metrics
                        .backend_load
                        .get_or_create(&l)
                        .set(load.running + load.waiting);
                    self.metrics.backend_kv.get_or_create(&l).set(load.kv_usage);
                }
            }
        }
    }

    /// The `/admin/state` document.
    pub fn state_json(&self) -> serde_json::Value {
        let rt = self.runtime();
        let now = self.clock.now();
        let adm = self.admission.lock();
        let info = |h: levee_policy::RateLimitHeaders| {
            serde_json::json!({
                "requests_limit": h.requests.map(|i| i.limit),
                "requests_remaining": h.requests.map(|i| i.remaining),
                "tokens_limit": h.tokens.map(|i| i.limit),
                "tokens_remaining": h.tokens.map(|i| i.remaining),
                "concurrency_limit": h.concurrency.map(|c| c.1),
                "concurrency_in_use": h.concurrency.map(|c| c.0),
            })
        };
        let tenants: Vec<_> = rt
            .tenants
            .iter()
            .map(|t| {
                serde_json::json!({
                    "name": &*t.name,
                    "tier": t.tier,
                    "priority": t.priority,
                    "weight": t.cfg.weight,
                    "limits": info(match (&self.shared, rt.shared_scopes.get(&t.name)) {
                        (Some(s), Some(scopes)) => s.tenant_figures(scopes, now),
                        _ => adm.rate_limit_headers(&t.name, now),
                    }),
                })
            })
            .collect();
        let global = info(adm.global_headers(now));
        let max_prio = rt.cfg.tiers.values().map(|t| t.priority).max().unwrap_or(0);
        let mut tier_names: Vec<String> = (0..=max_prio).map(|p| format!("priority{p}")).collect();
        for (name, t) in &rt.cfg.tiers {
            tier_names[usize::from(t.priority)] = name.clone();
        }
        let lanes: Vec<_> = self
            .lanes()
            .iter()
            .map(|l| l.state_json(&adm, now, &tier_names))
            .collect();
        drop(adm);
        let deg = self.degrader.lock().state_json();
        serde_json::json!({
            "draining": self.is_draining(),
            "ready": !self.is_leaving(),
            "load": self.load(),
            "queued": self.queued.load(Ordering::Relaxed),
            "in_flight": self.in_flight.load(Ordering::Relaxed),
            "watermarks": {
                "per_model": true,
                "safe": rt.cfg.queue.safe,
                "soft": rt.cfg.queue.soft,
                "hard": rt.cfg.queue.hard,
            },
            "degradation": deg,
            "autoscale": self.scaling.state_json(),
            "global_limits": global,
            "state": match &self.shared {
                Some(s) => s.state_json(),
                None => serde_json::json!({"backend": "memory", "healthy": true, "mode": "local", "live_replicas": 1}),
            },
            "tenants": tenants,
            "models": lanes,
        })
    }
}
