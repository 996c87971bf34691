//! The runtime view of one configuration: tenants by key, models with their token counters,
//! and the admission settings derived from them. Built whole on start and on each reload;
//! requests keep the `Arc` of the runtime they started with.

use crate::config::{Config, ModelConfig, StateBackend, TenantConfig, TierConfig};
use crate::tokenize::TokenCounter;
use levee_policy::{
    AdmissionConfig, FastState, HeavyRule, Key, LaneConfig, LimitSpec, ModelSpec, RetryBounds,
    SharedLimits, TenantLimits, TenantSpec, WaitBudget, Watermarks,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

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
    /// Its limits and fair-share weight in every lane (the same state across reloads).
    pub limits: Arc<TenantLimits>,
    cfg: TenantConfig,
    tier_cfg: TierConfig,
}

impl Tenant {
    /// Its fairness weight as configured.
    pub fn weight(&self) -> f64 {
        self.cfg.weight
    }

    /// What its tier's request predicted to miss the tier's TTFT objective gets.
    pub fn slo_miss(&self) -> crate::config::SloMiss {
        self.tier_cfg.slo_miss
    }

    /// Whether its deterministic answers are kept and served by the response cache.
    pub fn response_cache(&self) -> bool {
        self.cfg.response_cache
    }

    /// The secret that signs its task callbacks, from `callback_secret_env`.
    pub fn callback_secret(&self) -> Option<String> {
        let var = self.cfg.callback_secret_env.as_ref()?;
        std::env::var(var).ok().filter(|v| !v.is_empty())
    }
}

/// One model at run time (its queue and backends live in its lane).
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
    /// Long prompts counted by a backend before admission.
    pub exact_count: Option<ExactCount>,
    cfg: ModelConfig,
}

/// When a model's prompts are counted by a backend (`[models.exact_count]`).
#[derive(Debug, Clone, Copy)]
pub struct ExactCount {
    /// Corrected estimates from this many tokens on are counted.
    pub min_prompt_tokens: u64,
    /// Past this the estimate stands.
    pub timeout: Duration,
}

/// Everything derived from one configuration. Replaced whole on reload; requests keep the
/// `Arc` of the runtime they started with.
#[derive(Debug)]
pub struct Runtime {
    /// The configuration.
    pub cfg: Arc<Config>,
    /// SHA-256 of each key → tenant (a digest, not the client's bytes: the fast hasher).
    pub keys: HashMap<[u8; 32], Arc<Tenant>, FastState>,
    /// Tenants in config order.
    pub tenants: Vec<Arc<Tenant>>,
    /// Models by name.
    pub models: HashMap<String, Arc<Model>, FastState>,
    /// Each tenant's scopes in the shared limit store (`[state] backend = "redis"` only).
    pub shared_scopes: HashMap<Key, Arc<[levee_store::ScopeLimits]>>,
    /// Some tier's waiting streams get position comments without asking.
    pub queue_updates: bool,
    /// Keys already matched → their tenant, so a known key costs a map lookup instead of a
    /// SHA-256 per request. Only keys that matched a digest are kept, so it holds at most
    /// as many entries as there are configured keys, whatever clients send.
    matched: MatchedKeys,
}

/// Keys already matched (see [`Runtime::tenant_for_key`]); never printed.
#[derive(Default)]
struct MatchedKeys(parking_lot::RwLock<HashMap<Box<str>, Arc<Tenant>>>);

impl std::fmt::Debug for MatchedKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MatchedKeys({} keys)", self.0.read().len())
    }
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

/// A tenant's limits in the admission state: its rates only where the shared store does
/// not decide them.
fn tenant_spec(t: &TenantConfig, rates_shared: bool) -> TenantSpec {
    let (rpm, tpm, concurrency) = if rates_shared {
        (0, 0, 0)
    } else {
        (
            t.requests_per_minute,
            t.tokens_per_minute,
            t.max_concurrency,
        )
    };
    TenantSpec {
        limits: limit_spec(rpm, t.requests_burst, tpm, concurrency),
        weight: weight_units(t.weight),
    }
}

/// The SHA-256 digests of a tenant's keys (configured digests and keys in the environment).
fn tenant_keys(t: &TenantConfig) -> Vec<[u8; 32]> {
    let from_env = t
        .key_env
        .iter()
        .filter_map(|var| std::env::var(var).ok())
        .map(|v| crate::config::hash_key(&v));
    t.key_sha256
        .iter()
        .cloned()
        .chain(from_env)
        .filter_map(|k| decode_key(&k))
        .collect()
}

/// The models of `cfg`, reusing those of `prev` whose settings did not change (they keep
/// their tokenizers).
fn build_models(
    cfg: &Config,
    prev: Option<&Runtime>,
) -> Result<HashMap<String, Arc<Model>, FastState>, Vec<String>> {
    let mut models = HashMap::default();
    let mut errors = Vec::new();
    for (i, m) in cfg.models.iter().enumerate() {
        let default_max_tokens = m
            .default_max_tokens
            .unwrap_or(cfg.server.default_max_tokens);
        let reuse = prev
            .and_then(|p| p.models.get(&m.name))
            .filter(|o| o.cfg == *m && o.default_max_tokens == default_max_tokens)
            .cloned();
        if let Some(model) = reuse {
            models.insert(m.name.clone(), model);
            continue;
        }
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
        let model = Arc::new(Model {
            name: Key::new(&m.name),
            fallback: m.fallback.clone(),
            fallback_response: m.fallback_response.clone(),
            default_max_tokens,
            max_context_tokens: m.max_context_tokens,
            ttft_slo: m.ttft_slo_ms.map(Duration::from_millis),
            counter,
            exact_count: m.exact_count.as_ref().map(|x| ExactCount {
                min_prompt_tokens: x.min_prompt_tokens,
                timeout: Duration::from_millis(x.timeout_ms),
            }),
            cfg: m.clone(),
        });
        models.insert(m.name.clone(), model);
    }
    if errors.is_empty() {
        Ok(models)
    } else {
        Err(errors)
    }
}

/// The admission settings of this configuration. Tenant and global request and token
/// rates are left to the shared store when there is one (the admission state does not
/// decide them again).
pub fn admission_config(cfg: &Config) -> AdmissionConfig {
    let shared = cfg.state.backend == StateBackend::Redis;
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

impl Runtime {
    /// Builds the runtime view of `cfg`, reusing tenants and models whose settings did not
    /// change (they keep their metric handles and tokenizers). Each tenant's limits are set
    /// in `limits` once everything else is known to be valid.
    pub fn build(
        cfg: Config,
        prev: Option<&Runtime>,
        limits: &SharedLimits<Key>,
    ) -> Result<Runtime, Vec<String>> {
        let errors = cfg.validate();
        if !errors.is_empty() {
            return Err(errors);
        }
        let models = build_models(&cfg, prev)?;
        limits.reconfigure_from(&admission_config(&cfg));
        let rates_shared = cfg.state.backend == StateBackend::Redis;
        let mut tenants = Vec::new();
        let mut keys = HashMap::default();
        for t in &cfg.tenants {
            let tier_cfg = cfg.tiers.get(&t.tier).cloned().unwrap_or_default();
            let tenant_limits = limits.set_tenant(Key::new(&t.name), tenant_spec(t, rates_shared));
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
                    limits: tenant_limits,
                    cfg: t.clone(),
                    tier_cfg: tier_cfg.clone(),
                })
            });
            for d in tenant_keys(t) {
                keys.insert(d, tenant.clone());
            }
            tenants.push(tenant);
        }
        let mut shared_scopes = HashMap::new();
        if rates_shared {
            for (t, tenant) in cfg.tenants.iter().zip(&tenants) {
                shared_scopes.insert(tenant.name.clone(), crate::shared::scopes(&cfg, t));
            }
        }
        Ok(Runtime {
            queue_updates: cfg.tiers.values().any(|t| t.queue_updates),
            cfg: Arc::new(cfg),
            keys,
            tenants,
            models,
            shared_scopes,
            matched: Default::default(),
        })
    }

    /// The name of each priority (`priority{p}` where no tier has it).
    pub fn tier_names(&self) -> Vec<String> {
        let max_prio = self
            .cfg
            .tiers
            .values()
            .map(|t| t.priority)
            .max()
            .unwrap_or(0);
        let mut names: Vec<String> = (0..=max_prio).map(|p| format!("priority{p}")).collect();
        for (name, t) in &self.cfg.tiers {
            names[usize::from(t.priority)] = name.clone();
        }
        names
    }

    /// The tenant owning `key`, if any.
    pub fn tenant_for_key(&self, key: &str) -> Option<Arc<Tenant>> {
        use sha2::{Digest, Sha256};
        if let Some(t) = self.matched.0.read().get(key) {
            return Some(t.clone());
        }
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let tenant = self.keys.get(&digest)?.clone();
        self.matched.0.write().insert(key.into(), tenant.clone());
        Some(tenant)
    }

    /// A model's admission settings: its own limits and the lane settings every model
    /// shares.
    pub fn model_spec(&self, m: &ModelConfig) -> ModelSpec {
        ModelSpec {
            limits: limit_spec(m.requests_per_minute, 0, m.tokens_per_minute, 0),
            lane: self.lane_config(),
        }
    }

    /// The lane settings every model shares.
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
        lane.aging = (q.aging_ms > 0).then(|| Duration::from_millis(q.aging_ms));
        lane.shortest_first = q.shortest_first;
        lane.preempt = q.preempt_over_share;
        let a = &self.cfg.affinity;
        lane.affinity = a.enabled.then_some(levee_policy::AffinityConfig {
            epsilon: a.epsilon,
            max_sessions: a.max_sessions,
        });
        lane.kv_headroom = self.cfg.kv.headroom;
        lane.grow_streams = self.cfg.kv.grow_streams;
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
        lane.slo = tier_slos(&self.cfg);
        lane
    }
}

/// Each tier's latency objectives, indexed by its priority.
fn tier_slos(cfg: &Config) -> Vec<levee_policy::LatencySlo> {
    let ms = |v: Option<u64>| v.filter(|v| *v > 0).map(Duration::from_millis);
    let mut slos = Vec::new();
    for t in cfg.tiers.values() {
        let i = usize::from(t.priority);
        if slos.len() <= i {
            slos.resize(i + 1, levee_policy::LatencySlo::default());
        }
        slos[i] = levee_policy::LatencySlo {
            ttft: ms(t.ttft_slo_ms),
            tpot: ms(t.tpot_slo_ms),
        };
    }
    slos
}
