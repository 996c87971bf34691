//! Prometheus metrics, all named `levee_*` (the table with meanings is in
//! docs/operations.md).

use levee_policy::Timestamp;
use parking_lot::Mutex;
use parking_lot::RwLock;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Labels of `levee_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Tenant name (`-` before authentication).
    pub tenant: String,
    /// The model (`-` before the body is read, `unknown` for a name not configured: a
    /// client's string never becomes a label).
    pub model: String,
    /// `ok`, `upstream_error`, or the refusal code (`rate_limit_exceeded`, ...).
    pub outcome: String,
}

/// A single `tier` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabel {
    /// Tier name.
    pub tier: String,
}

/// A single `tenant` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabel {
    /// Tenant name.
    pub tenant: String,
}

/// Labels for per-tenant, per-kind series (tokens: prompt/completion; limits: requests/tokens).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantKindLabels {
    /// Tenant name.
    pub tenant: String,
    /// What is counted.
    pub kind: String,
}

/// A single `state` label (async tasks).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// The state.
    pub state: String,
}

/// A single `backend` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    /// `model@url`.
    pub backend: String,
}

/// A single `model` label (configured model names only).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    /// Model name.
    pub model: String,
}

/// Labels of per-backend counters with a reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendReasonLabels {
    /// `model@url`.
    pub backend: String,
    /// A fixed code (never a client string).
    pub reason: String,
}

/// Labels of the refusal counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Tier of the request (`-` before authentication).
    pub tier: String,
    /// The refusal code or degradation measure.
    pub reason: String,
}

/// Labels of the per-model, per-tenant histograms. `tenant` is bounded by
/// `observe.max_tenant_series`: tenants past the bound share `other`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelTenantLabels {
    /// Model name.
    pub model: String,
    /// Tenant name, `other`, or `-` before authentication.
    pub tenant: String,
}

/// Labels of `levee_tenant_abandoned_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AbandonLabels {
    /// Tenant name (bounded as in [`ModelTenantLabels`]).
    pub tenant: String,
    /// `queued` (left while waiting) or `dispatched` (left after its request reached a
    /// backend, before the answer ended).
    pub phase: String,
}

/// A single `mark` label (`safe`, `soft`, `hard`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MarkLabel {
    /// Watermark name.
    pub mark: String,
}

/// A single `level` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LevelLabel {
    /// Degradation level entered.
    pub level: String,
}

/// `to` of a shared-state switch.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SwitchLabel {
    /// `shared` (Redis answers again), `local` (`fail_open` shares) or `closed`
    /// (`fail_closed`).
    pub to: String,
}

/// `source` of a shared-limit decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    /// `redis` or `local`.
    pub source: String,
}

/// Every metric the gateway exports.
pub struct Metrics {
    /// The registry `/metrics` encodes.
    pub registry: Registry,
    /// `levee_requests_total{tenant,model,outcome}`.
    pub requests: Family<RequestLabels, Counter>,
    /// `levee_admitted_total{tier}`: requests that reached a backend.
    pub admitted: Family<TierLabel, Counter>,
    /// `levee_rejected_total{tier,reason}`: refusals by code.
    pub rejected: Family<ReasonLabels, Counter>,
    /// `levee_degraded_total{tier,reason}`: requests served degraded, by measure.
    pub degraded: Family<ReasonLabels, Counter>,
    /// `levee_shed_total{tier}`: requests shed by degradation.
    pub shed: Family<TierLabel, Counter>,
    /// `levee_queue_depth{tier}`.
    pub queue_depth: Family<TierLabel, Gauge>,
    /// `levee_queue_wait_seconds{tier}`.
    pub queue_wait: Family<TierLabel, Histogram>,
    /// `levee_ttft_seconds{tier}`: time from dispatch to the first response byte.
    pub ttft: Family<TierLabel, Histogram>,
    /// `levee_tokens_total{tenant,kind}` (kind = prompt | completion).
    pub tokens: Family<TenantKindLabels, Counter>,
    /// `levee_backend_in_flight{backend}`.
    pub backend_in_flight: Family<BackendLabel, Gauge>,
    /// `levee_backend_tokens_in_flight{backend}`: KV tokens levee has reserved there.
    pub backend_tokens_in_flight: Family<BackendLabel, Gauge>,
    /// `levee_backend_kv_budget_tokens{backend}`: its KV budget (configured or learned).
    pub backend_kv_budget: Family<BackendLabel, Gauge>,
    /// `levee_prompt_estimate_ratio{model}`: prompt estimate ÷ the backend's count.
    pub estimate_ratio: Family<ModelLabel, Histogram>,
    /// `levee_backend_load{backend}`: last scraped running + waiting.
    pub backend_load: Family<BackendLabel, Gauge<f64, AtomicU64>>,
    /// `levee_backend_kv_usage{backend}`: last scraped KV-cache use (0..1).
    pub backend_kv: Family<BackendLabel, Gauge<f64, AtomicU64>>,
    /// `levee_backend_healthy{backend}`: 1 healthy, 0 not.
    pub backend_healthy: Family<BackendLabel, Gauge>,
    /// `levee_breaker_state{backend}`: 0 closed, 1 half-open, 2 open.
    pub breaker_state: Family<BackendLabel, Gauge>,
    /// `levee_stream_cuts_total{backend,reason}`: streams levee ended with an error event
    /// (reason = `stream_broken` | `stream_idle_timeout` | `stream_timeout`).
    pub stream_cuts: Family<BackendReasonLabels, Counter>,
    /// `levee_limiter_remaining{tenant,kind}` (kind = requests | tokens).
    pub limiter_remaining: Family<TenantKindLabels, Gauge>,
    /// `levee_degrade_level`: 0 normal .. 3 shedding.
    pub degrade_level: Gauge,
    /// `levee_in_flight`: requests being proxied now.
    pub in_flight: Gauge,
    /// `levee_queued`: requests waiting in the queue now (all tiers).
    pub queued: Gauge,
    /// `levee_request_duration_seconds{model,tenant}`: arrival to last byte, admitted
    /// requests.
    pub request_duration: Family<ModelTenantLabels, Histogram>,
    /// `levee_request_ttft_seconds{model,tenant}`: arrival to first response byte.
    pub request_ttft: Family<ModelTenantLabels, Histogram>,
    /// `levee_request_queue_seconds{model,tenant}`: time queued before dispatch.
    pub request_queue: Family<ModelTenantLabels, Histogram>,
    /// `levee_tenant_abandoned_total{tenant,phase}`: clients that left before their answer
    /// ended, by tenant.
    pub tenant_abandoned: Family<AbandonLabels, Counter>,
    /// `levee_breaker_trips_total{backend}`: times a breaker opened.
    pub breaker_trips: Family<BackendLabel, Counter>,
    /// `levee_breaker_open_seconds_total{backend}`: time spent open.
    pub breaker_open_seconds: Family<BackendLabel, Counter<f64, AtomicU64>>,
    /// `levee_degrade_level_changes_total{level}`: changes of level, by level entered.
    pub degrade_changes: Family<LevelLabel, Counter>,
    /// `levee_recommended_replicas{model}`: backend replicas the model needs now.
    pub recommended_replicas: Family<ModelLabel, Gauge>,
    /// `levee_offered_load{model}`: measured offered load in busy backend slots.
    pub offered_load: Family<ModelLabel, Gauge<f64, AtomicU64>>,
    /// `levee_watermark{mark}`: the configured queue watermarks (load = queued + in flight).
    pub watermark: Family<MarkLabel, Gauge>,
    /// `levee_lane_load{model}`: each model's lane load (in flight + queued), what the
    /// watermarks are compared with.
    pub lane_load: Family<ModelLabel, Gauge>,
    /// `levee_backend_max_in_flight{backend}`: the configured cap of each backend.
    pub backend_max_in_flight: Family<BackendLabel, Gauge>,
    /// `levee_state_shared`: 1 when limits are decided in the shared store (Redis answers),
    /// 0 when this replica runs on its local fallback (or refuses, `fail_closed`); absent
    /// with `backend = "memory"`.
    pub state_shared: Gauge,
    /// `levee_state_switches_total{to}`: switches between shared and local decisions.
    pub state_switches: Family<SwitchLabel, Counter>,
    /// `levee_state_decisions_total{source}`: shared-limit decisions by where they were made.
    pub state_decisions: Family<SourceLabel, Counter>,
    /// `levee_fleet_replicas`: live gateway replicas seen in the shared store's heartbeats.
    pub fleet_replicas: Gauge,
    /// `levee_tasks_finished_total{state}`: async tasks by final state.
    pub tasks_finished: Family<StateLabel, Counter>,
    /// `levee_task_band{state}`: async tasks `waiting` for the batch band and `placed` in it
    /// (in a fair queue or at a backend).
    pub task_band: Family<StateLabel, Gauge>,
    /// `levee_task_callbacks_total{state}`: callback POSTs, `delivered` or `failed`.
    pub task_callbacks: Family<StateLabel, Counter>,
    /// `levee_tasks_reclaimed_total`: tasks this replica claimed from the shared queue after
    /// another replica held them past `tasks.visibility_ms` or handed them back at shutdown.
    pub tasks_reclaimed: Counter,
    /// Tenants with their own series in the per-tenant histograms.
    tenant_series: RwLock<HashSet<String>>,
    /// Per backend: breaker trips and the time of the last look, to turn breaker stats into
    /// counters.
    breaker_seen: Mutex<HashMap<String, BreakerSeen>>,
    last_degrade_level: AtomicI64,
}

#[derive(Debug, Clone, Copy)]
struct BreakerSeen {
    opened_total: u64,
    open: bool,
    at: Timestamp,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ]
    .into_iter()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("levee");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests by tenant, model and outcome",
            requests.clone(),
        );
        let admitted = Family::<TierLabel, Counter>::default();
        registry.register(
            "admitted",
            "Requests dispatched to a backend",
            admitted.clone(),
        );
        let rejected = Family::<ReasonLabels, Counter>::default();
        registry.register("rejected", "Requests refused, by code", rejected.clone());
        let degraded = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "degraded",
            "Requests served degraded, by measure",
            degraded.clone(),
        );
        let shed = Family::<TierLabel, Counter>::default();
        registry.register("shed", "Requests shed by degradation", shed.clone());
        let queue_depth = Family::<TierLabel, Gauge>::default();
        registry.register(
            "queue_depth",
            "Requests waiting per tier",
            queue_depth.clone(),
        );
        let queue_wait = Family::<TierLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register(
            "queue_wait_seconds",
            "Time spent queued",
            queue_wait.clone(),
        );
        let ttft = Family::<TierLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register(
            "ttft_seconds",
            "Time from dispatch to first response byte",
            ttft.clone(),
        );
        let tokens = Family::<TenantKindLabels, Counter>::default();
        registry.register("tokens", "LLM tokens by tenant and kind", tokens.clone());
        let backend_in_flight = Family::<BackendLabel, Gauge>::default();
        registry.register(
            "backend_in_flight",
            "Requests levee has outstanding at each backend",
            backend_in_flight.clone(),
        );
        let backend_tokens_in_flight = Family::<BackendLabel, Gauge>::default();
        registry.register(
            "backend_tokens_in_flight",
            "KV tokens (prompt estimate + completion budget) levee has reserved at each backend",
            backend_tokens_in_flight.clone(),
        );
        let backend_kv_budget = Family::<BackendLabel, Gauge>::default();
        registry.register(
            "backend_kv_budget_tokens",
            "KV-cache budget of each backend in tokens (configured or learned from the engine)",
            backend_kv_budget.clone(),
        );
        let estimate_ratio = Family::<ModelLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0])
        });
        registry.register(
            "prompt_estimate_ratio",
            "Prompt token estimate divided by the backend's own count",
            estimate_ratio.clone(),
        );
        let backend_load = Family::<BackendLabel, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "backend_load",
            "Scraped running + waiting sequences per backend",
            backend_load.clone(),
        );
        let backend_kv = Family::<BackendLabel, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "backend_kv_usage",
            "Scraped KV-cache usage per backend (0..1)",
            backend_kv.clone(),
        );
        let backend_healthy = Family::<BackendLabel, Gauge>::default();
        registry.register(
            "backend_healthy",
            "1 if the backend answers its metrics scrape",
            backend_healthy.clone(),
        );
        let breaker_state = Family::<BackendLabel, Gauge>::default();
        registry.register(
            "breaker_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open",
            breaker_state.clone(),
        );
        let stream_cuts = Family::<BackendReasonLabels, Counter>::default();
        registry.register(
            "stream_cuts",
            "Streams ended with an SSE error event, by backend and reason",
            stream_cuts.clone(),
        );
        let limiter_remaining = Family::<TenantKindLabels, Gauge>::default();
        registry.register(
            "limiter_remaining",
            "Remaining tenant quota (requests or tokens) at the last decision",
            limiter_remaining.clone(),
        );
        let degrade_level = Gauge::default();
        registry.register(
            "degrade_level",
            "Degradation level: 0 normal, 1 cap max_tokens, 2 fallback model, 3 shed",
            degrade_level.clone(),
        );
        let in_flight = Gauge::default();
        registry.register("in_flight", "Requests being proxied now", in_flight.clone());
        let queued = Gauge::default();
        registry.register(
            "queued",
            "Requests waiting in the queue now",
            queued.clone(),
        );
        let model_tenant_histogram = || {
            Family::<ModelTenantLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(latency_buckets())
            })
        };
        let request_duration = model_tenant_histogram();
        registry.register(
            "request_duration_seconds",
            "Arrival to last response byte of admitted requests, per model and tenant",
            request_duration.clone(),
        );
        let request_ttft = model_tenant_histogram();
        registry.register(
            "request_ttft_seconds",
            "Arrival to first response byte (queue included), per model and tenant",
            request_ttft.clone(),
        );
        let request_queue = model_tenant_histogram();
        registry.register(
            "request_queue_seconds",
            "Time queued before dispatch, per model and tenant",
            request_queue.clone(),
        );
        let tasks_finished = Family::<StateLabel, Counter>::default();
        registry.register(
            "tasks_finished",
            "Async tasks by final state",
            tasks_finished.clone(),
        );
        let task_band = Family::<StateLabel, Gauge>::default();
        registry.register(
            "task_band",
            "Async tasks waiting for the batch band, and placed in it",
            task_band.clone(),
        );
        let task_callbacks = Family::<StateLabel, Counter>::default();
        registry.register(
            "task_callbacks",
            "Task callback POSTs, delivered or failed",
            task_callbacks.clone(),
        );
        let tasks_reclaimed = Counter::default();
        registry.register(
            "tasks_reclaimed",
            "Async tasks claimed after another replica held them past the visibility timeout",
            tasks_reclaimed.clone(),
        );
        let tenant_abandoned = Family::<AbandonLabels, Counter>::default();
        registry.register(
            "tenant_abandoned",
            "Clients that left before their answer ended, by tenant and phase",
            tenant_abandoned.clone(),
        );
        let breaker_trips = Family::<BackendLabel, Counter>::default();
        registry.register(
            "breaker_trips",
            "Times a backend's circuit breaker opened",
            breaker_trips.clone(),
        );
        let breaker_open_seconds = Family::<BackendLabel, Counter<f64, AtomicU64>>::default();
        registry.register(
            "breaker_open_seconds",
            "Time a backend's circuit breaker spent open or half-open",
            breaker_open_seconds.clone(),
        );
        let degrade_changes = Family::<LevelLabel, Counter>::default();
        registry.register(
            "degrade_level_changes",
            "Changes of the degradation level, by level entered",
            degrade_changes.clone(),
        );
        let recommended_replicas = Family::<ModelLabel, Gauge>::default();
        registry.register(
            "recommended_replicas",
            "Backend replicas each model needs now (see the autoscaling section of the docs)",
            recommended_replicas.clone(),
        );
        let offered_load = Family::<ModelLabel, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "offered_load",
            "Measured offered load per model, in busy backend slots (arrival rate over service rate)",
            offered_load.clone(),
        );
        let lane_load = Family::<ModelLabel, Gauge>::default();
        registry.register(
            "lane_load",
            "Load of each model's lane (requests in flight + queued): the watermarks apply to it, per model",
            lane_load.clone(),
        );
        let watermark = Family::<MarkLabel, Gauge>::default();
        registry.register(
            "watermark",
            "Configured queue watermarks over the load (queued + in flight)",
            watermark.clone(),
        );
        let backend_max_in_flight = Family::<BackendLabel, Gauge>::default();
        registry.register(
            "backend_max_in_flight",
            "Configured most requests levee sends to each backend at once",
            backend_max_in_flight.clone(),
        );
        let state_shared = Gauge::default();
        registry.register(
            "state_shared",
            "1 when limits are decided in the shared store, 0 on the local fallback",
            state_shared.clone(),
        );
        let state_switches = Family::<SwitchLabel, Counter>::default();
        registry.register(
            "state_switches",
            "Switches between shared (Redis) and local limit decisions",
            state_switches.clone(),
        );
        let state_decisions = Family::<SourceLabel, Counter>::default();
        registry.register(
            "state_decisions",
            "Shared-limit decisions by where they were made",
            state_decisions.clone(),
        );
        let fleet_replicas = Gauge::default();
        registry.register(
            "fleet_replicas",
            "Live gateway replicas seen in the shared store",
            fleet_replicas.clone(),
        );
        Metrics {
            state_shared,
            state_switches,
            state_decisions,
            fleet_replicas,
            registry,
            watermark,
            backend_max_in_flight,
            request_duration,
            request_ttft,
            request_queue,
            breaker_trips,
            breaker_open_seconds,
            degrade_changes,
            recommended_replicas,
            offered_load,
            lane_load,
            tenant_series: RwLock::new(HashSet::new()),
            breaker_seen: Mutex::new(HashMap::new()),
            last_degrade_level: AtomicI64::new(0),
            requests,
            admitted,
            rejected,
            degraded,
            shed,
            queue_depth,
            queue_wait,
            ttft,
            tokens,
            backend_in_flight,
            backend_tokens_in_flight,
            backend_kv_budget,
            tenant_abandoned,
            tasks_finished,
            task_band,
            task_callbacks,
            tasks_reclaimed,
            estimate_ratio,
            backend_load,
            backend_kv,
            backend_healthy,
            breaker_state,
            stream_cuts,
            limiter_remaining,
            degrade_level,
            in_flight,
            queued,
        }
    }

    /// Renders the text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Counts one finished request.
    pub fn request(&self, tenant: &str, model: &str, outcome: &str) {
        self.requests
            .get_or_create(&RequestLabels {
                tenant: tenant.to_string(),
                model: model.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts one stream levee cut with an error event.
    pub fn stream_cut(&self, backend: &str, reason: &'static str) {
        self.stream_cuts
            .get_or_create(&BackendReasonLabels {
                backend: backend.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts one refusal.
    pub fn reject(&self, tier: &str, reason: &str) {
        self.rejected
            .get_or_create(&ReasonLabels {
                tier: tier.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }
}

/// How one admitted request went, for the per-model, per-tenant metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestTimes {
    /// Time queued before dispatch.
    pub queued: Duration,
    /// Queue wait plus the backend's time to first byte, if one came.
    pub ttft: Option<Duration>,
    /// Queue wait plus the time from sending upstream to the end of the response.
    pub total: Duration,
    /// The client left before the response ended.
    pub abandoned: bool,
}

impl Metrics {
    /// Sets which tenants get their own series in the per-tenant histograms: the first
    /// `max` of `tenants` (config order). Called at start and on reload.
    pub fn set_tenant_series<'a>(&self, tenants: impl Iterator<Item = &'a str>, max: usize) {
        *self.tenant_series.write() = tenants.take(max).map(str::to_string).collect();
    }

    /// The `tenant` label value for `tenant`: itself if it has its own series, else
    /// `other` (clients cannot grow the label set: tenants come from the config, and only
    /// the first few of them are kept apart).
    pub fn tenant_label(&self, tenant: &str) -> String {
        if tenant == "-" || self.tenant_series.read().contains(tenant) {
            tenant.to_string()
        } else {
            "other".to_string()
        }
    }

    /// Records an admitted request's times (and abandonment) under its model and tenant.
    pub fn request_times(&self, model: &str, tenant: &str, tier: &str, t: &RequestTimes) {
        let labels = ModelTenantLabels {
            model: model.to_string(),
            tenant: self.tenant_label(tenant),
        };
        let queued = t.queued.as_secs_f64();
        self.request_queue.get_or_create(&labels).observe(queued);
        self.queue_wait
            .get_or_create(&TierLabel { tier: tier.into() })
            .observe(queued);
        if let Some(ttft) = t.ttft {
            self.request_ttft
                .get_or_create(&labels)
                .observe(ttft.as_secs_f64());
        }
        self.request_duration
            .get_or_create(&labels)
            .observe(t.total.as_secs_f64());
        if t.abandoned {
            self.abandon(tenant, "dispatched");
        }
    }

    /// A guard for a request waiting in the queue: dropped before [`QueuedWait::done`] (the
    /// client left, so its handler was dropped), it counts an abandonment while queued.
    pub fn queued_wait<'a>(&'a self, tenant: &'a str) -> QueuedWait<'a> {
        QueuedWait {
            metrics: self,
            tenant,
            armed: true,
        }
    }

    /// Counts a client that left while its request was `phase` (`queued` or `dispatched`).
    pub fn abandon(&self, tenant: &str, phase: &str) {
        self.tenant_abandoned
            .get_or_create(&AbandonLabels {
                tenant: self.tenant_label(tenant),
                phase: phase.to_string(),
            })
            .inc();
    }

    /// Turns a backend breaker's cumulative stats into the trips and open-time counters.
    /// `state` is the breaker code (0 closed, 1 half-open, 2 open); `opened_total` its
    /// count of openings.
    pub fn observe_breaker(&self, backend: &str, state: i64, opened_total: u64, now: Timestamp) {
        let open = state != 0;
        let label = BackendLabel {
            backend: backend.to_string(),
        };
        let mut seen = self.breaker_seen.lock();
        let prev = seen.insert(
            backend.to_string(),
            BreakerSeen {
                opened_total,
                open,
                at: now,
            },
        );
        let trips = self.breaker_trips.get_or_create(&label);
        let open_secs = self.breaker_open_seconds.get_or_create(&label);
        let Some(prev) = prev else {
            trips.inc_by(opened_total);
            return;
        };
        trips.inc_by(opened_total.saturating_sub(prev.opened_total));
        if prev.open || open {
            open_secs.inc_by(now.saturating_duration_since(prev.at).as_secs_f64());
        }
    }

    /// Sets the degradation level gauge and counts a change of level.
    pub fn degrade_level(&self, level: u8) {
        let level = i64::from(level);
        self.degrade_level.set(level);
        if self.last_degrade_level.swap(level, Ordering::Relaxed) != level {
            self.degrade_changes
                .get_or_create(&LevelLabel {
                    level: level.to_string(),
                })
                .inc();
        }
    }
}

/// See [`Metrics::queued_wait`].
pub struct QueuedWait<'a> {
    metrics: &'a Metrics,
    tenant: &'a str,
    armed: bool,
}

impl QueuedWait<'_> {
    /// The wait ended with the client still there (dispatched, refused or timed out).
    pub fn done(mut self) {
        self.armed = false;
    }
}

impl Drop for QueuedWait<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.metrics.abandon(self.tenant, "queued");
        }
    }
}

/// One tenant's series of the per-request metrics, looked up once and kept (on the
/// tenant). A handle is the series itself, so incrementing it is exactly what
/// `get_or_create(labels).inc()` does, without building the label set — a few `String`
/// allocations, a hash and a lock — on every request. Each series is still created on its
/// first use, so `/metrics` shows the same series as before.
#[derive(Debug, Default)]
pub struct TenantMetrics {
    admitted: OnceLock<Counter>,
    ttft: OnceLock<Histogram>,
    prompt_tokens: OnceLock<Counter>,
    completion_tokens: OnceLock<Counter>,
    /// `levee_requests_total` by (model, outcome).
    requests: RwLock<Vec<(Box<str>, &'static str, Counter)>>,
}

impl Metrics {
    /// Counts one admission of a tenant of tier `tier`.
    pub fn admitted_for(&self, h: &TenantMetrics, tier: &str) {
        h.admitted
            .get_or_init(|| {
                self.admitted
                    .get_or_create(&TierLabel { tier: tier.into() })
                    .clone()
            })
            .inc();
    }

    /// Records a time to first byte of a tenant of tier `tier`.
    pub fn ttft_for(&self, h: &TenantMetrics, tier: &str, secs: f64) {
        h.ttft
            .get_or_init(|| {
                self.ttft
                    .get_or_create(&TierLabel { tier: tier.into() })
                    .clone()
            })
            .observe(secs);
    }

    /// Adds a tenant's reported token usage.
    pub fn tokens_for(&self, h: &TenantMetrics, tenant: &str, prompt: u64, completion: u64) {
        let series = |kind: &str| {
            self.tokens
                .get_or_create(&TenantKindLabels {
                    tenant: tenant.into(),
                    kind: kind.into(),
                })
                .clone()
        };
        h.prompt_tokens
            .get_or_init(|| series("prompt"))
            .inc_by(prompt);
        h.completion_tokens
            .get_or_init(|| series("completion"))
            .inc_by(completion);
    }

    /// Counts one finished request of a tenant (as [`Metrics::request`]).
    pub fn request_for(&self, h: &TenantMetrics, tenant: &str, model: &str, outcome: &'static str) {
        let find = |v: &[(Box<str>, &'static str, Counter)]| {
            v.iter()
                .find(|(m, o, _)| **m == *model && *o == outcome)
                .map(|(_, _, c)| c.inc())
                .is_some()
        };
        if find(&h.requests.read()) {
            return;
        }
        let mut v = h.requests.write();
        if find(&v) {
            return;
        }
        let c = self
            .requests
            .get_or_create(&RequestLabels {
                tenant: tenant.to_string(),
                model: model.to_string(),
                outcome: outcome.to_string(),
            })
            .clone();
        c.inc();
        // Bounded by models x outcomes; past a sanity bound, stop caching.
        if v.len() < 256 {
            v.push((model.into(), outcome, c));
        }
    }
}
