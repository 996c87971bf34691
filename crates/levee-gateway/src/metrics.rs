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
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
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

/// A single `listener` label (`public` or `admin`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabel {
    /// The listener.
    pub listener: String,
}

/// A single `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why.
    pub reason: String,
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

/// Labels of `levee_prompt_correction`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CorrectionLabel {
    /// Model name.
    pub model: String,
    /// The kind of text (`prose`, `symbols`, `dense`).
    pub text: &'static str,
}

/// Labels of `levee_exact_counts_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExactCountLabels {
    /// Model name.
    pub model: String,
    /// `counted`, `timed_out` or `failed`.
    pub outcome: &'static str,
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

/// Labels of `levee_degrade_level_changes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLevelLabels {
    /// Model name (its lane degrades on its own).
    pub model: String,
    /// Degradation level entered.
    pub level: String,
}

/// Every metric the gateway exports.
pub struct Metrics {
    /// The registry `/metrics` encodes.
    pub registry: Registry,
    /// The name and type of every family in `registry` (see [`Metrics::families`]).
    families: Vec<(String, MetricType)>,
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
    /// `levee_ttft_prediction_ratio{backend}`: a streamed response's time to first token
    /// (from dispatch) ÷ the one predicted when it was placed.
    pub ttft_prediction: Family<BackendLabel, Histogram>,
    /// `levee_prompt_cached_tokens_total{model}`: prompt tokens the backends found in their
    /// prefix cache (`usage.prompt_tokens_details.cached_tokens`).
    pub prompt_cached_tokens: Family<ModelLabel, Counter>,
    /// `levee_preempted_total{model}`: requests of a tenant over its fair share cut short
    /// before their answer started, to give their slot to a tenant under its share, and
    /// queued again (`queue.preempt_over_share`).
    pub preempted: Family<ModelLabel, Counter>,
    /// `levee_backend_load{backend}`: last scraped running + waiting.
    pub backend_load: Family<BackendLabel, Gauge<f64, AtomicU64>>,
    /// `levee_backend_kv_usage_ratio{backend}`: last scraped KV-cache use (0..1).
    pub backend_kv: Family<BackendLabel, Gauge<f64, AtomicU64>>,
    /// `levee_backend_healthy{backend}`: 1 healthy, 0 not.
    pub backend_healthy: Family<BackendLabel, Gauge>,
    /// `levee_breaker_state{backend}`: 0 closed, 1 half-open, 2 open.
    pub breaker_state: Family<BackendLabel, Gauge>,
    /// `levee_stream_cuts_total{backend,reason}`: streams levee ended with an error event
    /// (reason = `stream_broken` | `stream_idle_timeout` | `stream_timeout`).
    pub stream_cuts: Family<BackendReasonLabels, Counter>,
    /// `levee_limiter_remaining_requests{tenant}`: requests left in the tenant's quota.
    pub limiter_remaining_requests: Family<TenantLabel, Gauge>,
    /// `levee_limiter_remaining_tokens{tenant}`: tokens left in the tenant's quota.
    pub limiter_remaining_tokens: Family<TenantLabel, Gauge>,
    /// `levee_degrade_level{model}`: 0 normal .. 3 shedding, per model lane.
    pub degrade_level: Family<ModelLabel, Gauge>,
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
    /// `levee_degrade_level_changes_total{model,level}`: changes of level, by level entered.
    pub degrade_changes: Family<ModelLevelLabels, Counter>,
    /// `levee_recommended_replicas{model}`: backend replicas the model needs now.
    pub recommended_replicas: Family<ModelLabel, Gauge>,
    /// `levee_offered_load{model}`: measured offered load in busy backend slots.
    pub offered_load: Family<ModelLabel, Gauge<f64, AtomicU64>>,
    /// `levee_prompt_correction{model,text}`: the factor prompt estimates of each kind of
    /// text (`prose`, `symbols`, `dense`) are scaled by (a high quantile of the engine's
    /// count ÷ levee's estimate).
    pub prompt_correction: Family<CorrectionLabel, Gauge<f64, AtomicU64>>,
    /// `levee_exact_counts_total{model,outcome}`: long prompts a backend was asked to count
    /// (`[models.exact_count]`): `counted`, or `timed_out` / `failed` (the estimate stood).
    pub exact_counts: Family<ExactCountLabels, Counter>,
    /// `levee_watermark{mark}`: the configured queue watermarks (load = queued + in flight).
    pub watermark: Family<MarkLabel, Gauge>,
    /// `levee_lane_load{model}`: each model's lane load (in flight + queued), what the
    /// watermarks are compared with.
    pub lane_load: Family<ModelLabel, Gauge>,
    /// `levee_backend_max_in_flight{backend}`: the configured cap of each backend.
    pub backend_max_in_flight: Family<BackendLabel, Gauge>,
    /// `levee_state_shared`: 1 when limits are decided in the shared store (Redis answers),
    /// 0 when this replica runs on its local fallback (or refuses, `fail_closed`). Exported
    /// only with `[state] backend = "redis"` (see [`Metrics::with_shared_state`]), like the
    /// three below: an in-memory deployment has no such series.
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
    /// `levee_open_connections{listener}`: client connections open, `public` or `admin`.
    pub open_connections: Family<ListenerLabel, Gauge>,
    /// `levee_connections_refused_total{reason}`: connections closed at accept, over
    /// `max_connections` or `max_connections_per_ip`.
    pub connections_refused: Family<ReasonLabel, Counter>,
    /// `levee_connections_expired_total`: connections closed for having no request (none in
    /// time, idle too long) or for having served their request budget.
    pub connections_expired: Counter,
    /// `levee_tasks_reclaimed_total`: tasks this replica claimed from the shared queue after
    /// another replica held them past `tasks.visibility_ms` or handed them back at shutdown.
    pub tasks_reclaimed: Counter,
    /// Tenants with their own series in the per-tenant metrics.
    tenant_series: RwLock<HashSet<String, levee_policy::FastState>>,
    /// Per backend: breaker trips and the time of the last look, to turn breaker stats into
    /// counters.
    breaker_seen: Mutex<HashMap<String, BreakerSeen>>,
    /// Each model's degradation level at the last update.
    last_degrade_level: Mutex<HashMap<String, i64>>,
}

#[derive(Debug, Clone, Copy)]
struct BreakerSeen {
    opened_total: u64,
    open: bool,
    at: Timestamp,
}

/// Buckets of times bounded by the upstream request deadline (`server.request_timeout_ms`,
/// 5 minutes by default): a backend's time to first byte.
fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        120.0, 300.0,
    ]
    .into_iter()
}

/// Buckets of times that can last much longer: a whole stream (up to
/// `server.stream_timeout_ms`, 30 minutes by default) and a wait in the queue (the batch
/// band's tier waits up to 10 minutes). They end at 30 minutes.
fn long_buckets() -> impl Iterator<Item = f64> {
    [
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
        600.0, 1200.0, 1800.0,
    ]
    .into_iter()
}

fn histograms<L>(buckets: fn() -> Histogram) -> Family<L, Histogram>
where
    L: Clone + std::hash::Hash + Eq,
{
    Family::new_with_constructor(buckets)
}

fn latency_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

fn long_histogram() -> Histogram {
    Histogram::new(long_buckets())
}

fn ratio_histogram() -> Histogram {
    Histogram::new([0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0])
}

fn prediction_histogram() -> Histogram {
    Histogram::new([0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0])
}

/// Registers a clone of `metric` (metrics are handles to shared values).
/// A registry being filled, and the name and type of every family put in it.
struct Reg {
    registry: Registry,
    families: Vec<(String, MetricType)>,
}

fn add<M>(r: &mut Reg, name: &str, help: &str, metric: &M)
where
    M: prometheus_client::registry::Metric + Clone,
{
    r.families
        .push((format!("levee_{name}"), metric.metric_type()));
    r.registry.register(name, help, metric.clone());
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric of a gateway that keeps its limits in memory.
    pub fn new() -> Self {
        let mut m = Self::unregistered();
        let mut r = Reg {
            registry: Registry::with_prefix("levee"),
            families: Vec::new(),
        };
        m.register_requests(&mut r);
        m.register_histograms(&mut r);
        m.register_backends(&mut r);
        m.register_lanes(&mut r);
        m.register_tasks(&mut r);
        m.register_connections(&mut r);
        m.registry = r.registry;
        m.families = r.families;
        m
    }

    /// [`Metrics::new`] plus the shared-state series (`levee_state_*`,
    /// `levee_fleet_replicas`), for `[state] backend = "redis"`.
    pub fn with_shared_state() -> Self {
        let mut m = Self::new();
        let mut r = Reg {
            registry: std::mem::take(&mut m.registry),
            families: std::mem::take(&mut m.families),
        };
        m.register_shared_state(&mut r);
        m.registry = r.registry;
        m.families = r.families;
        m
    }

    /// Every registered family as `(name, type)` (`counter`, `gauge`, `histogram`...). The
    /// exposition shows a family only once it has a series, so `/metrics` alone does not
    /// list every metric levee can serve; this does.
    pub fn families(&self) -> impl Iterator<Item = (&str, &str)> {
        self.families.iter().map(|(n, t)| (n.as_str(), t.as_str()))
    }

    fn unregistered() -> Self {
        Metrics {
            registry: Registry::default(),
            families: Vec::new(),
            requests: Family::default(),
            admitted: Family::default(),
            rejected: Family::default(),
            degraded: Family::default(),
            shed: Family::default(),
            queue_depth: Family::default(),
            queue_wait: histograms(long_histogram),
            ttft: histograms(latency_histogram),
            tokens: Family::default(),
            backend_in_flight: Family::default(),
            backend_tokens_in_flight: Family::default(),
            backend_kv_budget: Family::default(),
            estimate_ratio: histograms(ratio_histogram),
            ttft_prediction: histograms(prediction_histogram),
            prompt_cached_tokens: Family::default(),
            preempted: Family::default(),
            backend_load: Family::default(),
            backend_kv: Family::default(),
            backend_healthy: Family::default(),
            breaker_state: Family::default(),
            stream_cuts: Family::default(),
            limiter_remaining_requests: Family::default(),
            limiter_remaining_tokens: Family::default(),
            degrade_level: Family::default(),
            in_flight: Gauge::default(),
            queued: Gauge::default(),
            request_duration: histograms(long_histogram),
            request_ttft: histograms(long_histogram),
            request_queue: histograms(long_histogram),
            tenant_abandoned: Family::default(),
            breaker_trips: Family::default(),
            breaker_open_seconds: Family::default(),
            degrade_changes: Family::default(),
            recommended_replicas: Family::default(),
            offered_load: Family::default(),
            prompt_correction: Family::default(),
            exact_counts: Family::default(),
            watermark: Family::default(),
            lane_load: Family::default(),
            backend_max_in_flight: Family::default(),
            state_shared: Gauge::default(),
            state_switches: Family::default(),
            state_decisions: Family::default(),
            fleet_replicas: Gauge::default(),
            tasks_finished: Family::default(),
            task_band: Family::default(),
            task_callbacks: Family::default(),
            open_connections: Family::default(),
            connections_refused: Family::default(),
            connections_expired: Counter::default(),
            tasks_reclaimed: Counter::default(),
            tenant_series: RwLock::new(HashSet::default()),
            breaker_seen: Mutex::new(HashMap::new()),
            last_degrade_level: Mutex::new(HashMap::new()),
        }
    }

    /// Request counts, refusals, tokens and quotas.
    fn register_requests(&self, r: &mut Reg) {
        let requests = "Requests by tenant, model and outcome";
        add(r, "requests", requests, &self.requests);
        add(
            r,
            "admitted",
            "Requests dispatched to a backend",
            &self.admitted,
        );
        add(r, "rejected", "Requests refused, by code", &self.rejected);
        let degraded = "Requests served degraded, by measure";
        add(r, "degraded", degraded, &self.degraded);
        add(r, "shed", "Requests shed by degradation", &self.shed);
        let cached = "Prompt tokens the backends found in their prefix cache";
        add(
            r,
            "prompt_cached_tokens",
            cached,
            &self.prompt_cached_tokens,
        );
        let preempted = "Requests over their tenant's share cut short for a tenant under its share";
        add(r, "preempted", preempted, &self.preempted);
        add(r, "tokens", "LLM tokens by tenant and kind", &self.tokens);
        let abandoned = "Clients that left before their answer ended, by tenant and phase";
        add(r, "tenant_abandoned", abandoned, &self.tenant_abandoned);
        let remaining = "Requests left in the tenant's quota at its last admission";
        add(
            r,
            "limiter_remaining_requests",
            remaining,
            &self.limiter_remaining_requests,
        );
        let remaining = "Tokens left in the tenant's quota at its last admission";
        add(
            r,
            "limiter_remaining_tokens",
            remaining,
            &self.limiter_remaining_tokens,
        );
        add(
            r,
            "in_flight",
            "Requests being proxied now",
            &self.in_flight,
        );
        add(
            r,
            "queued",
            "Requests waiting in the queue now",
            &self.queued,
        );
        add(
            r,
            "queue_depth",
            "Requests waiting per tier",
            &self.queue_depth,
        );
    }

    /// The time histograms.
    fn register_histograms(&self, r: &mut Reg) {
        add(
            r,
            "queue_wait_seconds",
            "Time spent queued",
            &self.queue_wait,
        );
        let ttft = "Time from dispatch to first response byte";
        add(r, "ttft_seconds", ttft, &self.ttft);
        let duration = "Arrival to last response byte of admitted requests, per model and tenant";
        add(
            r,
            "request_duration_seconds",
            duration,
            &self.request_duration,
        );
        let ttft = "Arrival to first response byte (queue included), per model and tenant";
        add(r, "request_ttft_seconds", ttft, &self.request_ttft);
        let queue = "Time queued before dispatch, per model and tenant";
        add(r, "request_queue_seconds", queue, &self.request_queue);
        let ratio = "Prompt token estimate divided by the backend's own count";
        add(r, "prompt_estimate_ratio", ratio, &self.estimate_ratio);
    }

    /// Per-backend gauges and breaker counters.
    fn register_backends(&self, r: &mut Reg) {
        let help = "Requests levee has outstanding at each backend";
        add(r, "backend_in_flight", help, &self.backend_in_flight);
        let help =
            "KV tokens (prompt estimate + completion budget) levee has reserved at each backend";
        add(
            r,
            "backend_tokens_in_flight",
            help,
            &self.backend_tokens_in_flight,
        );
        let help =
            "KV-cache budget of each backend in tokens (configured or learned from the engine)";
        add(r, "backend_kv_budget_tokens", help, &self.backend_kv_budget);
        let help = "Scraped running + waiting sequences per backend";
        add(r, "backend_load", help, &self.backend_load);
        let help = "Scraped KV-cache usage per backend (0..1)";
        add(r, "backend_kv_usage_ratio", help, &self.backend_kv);
        let help = "1 if the backend passes its health checks";
        add(r, "backend_healthy", help, &self.backend_healthy);
        let help = "Configured most requests levee sends to each backend at once";
        add(
            r,
            "backend_max_in_flight",
            help,
            &self.backend_max_in_flight,
        );
        let help = "Circuit breaker: 0 closed, 1 half-open, 2 open";
        add(r, "breaker_state", help, &self.breaker_state);
        let help = "Times a backend's circuit breaker opened";
        add(r, "breaker_trips", help, &self.breaker_trips);
        let help = "Time a backend's circuit breaker spent open or half-open";
        add(r, "breaker_open_seconds", help, &self.breaker_open_seconds);
        let help = "Streams ended with an SSE error event, by backend and reason";
        add(r, "stream_cuts", help, &self.stream_cuts);
        add(
            r,
            "ttft_prediction_ratio",
            "Time to first token (from dispatch) divided by the one predicted at dispatch",
            &self.ttft_prediction,
        );
    }

    /// Per-model lanes: load, watermarks, degradation, scaling.
    fn register_lanes(&self, r: &mut Reg) {
        let help = "Load of each model's lane (requests in flight + queued): the watermarks apply to it, per model";
        add(r, "lane_load", help, &self.lane_load);
        let help = "Configured queue watermarks over the load (queued + in flight)";
        add(r, "watermark", help, &self.watermark);
        let help =
            "Degradation level per model: 0 normal, 1 cap max_tokens, 2 fallback model, 3 shed";
        add(r, "degrade_level", help, &self.degrade_level);
        let help = "Changes of the degradation level, by model and level entered";
        add(r, "degrade_level_changes", help, &self.degrade_changes);
        let help =
            "Backend replicas each model needs now (see the autoscaling section of the docs)";
        add(r, "recommended_replicas", help, &self.recommended_replicas);
        let help = "Measured offered load per model, in busy backend slots (arrival rate over service rate)";
        add(r, "offered_load", help, &self.offered_load);
        let help = "Factor prompt estimates are scaled by per model: the 95th percentile of the engine's prompt count over levee's estimate, lately";
        add(r, "prompt_correction", help, &self.prompt_correction);
        let help = "Long prompts a backend was asked to count before admission, by outcome (counted, timed_out, failed: the estimate stood)";
        add(r, "exact_counts", help, &self.exact_counts);
    }

    /// Client connections.
    fn register_connections(&self, r: &mut Reg) {
        let help = "Client connections open, by listener";
        add(r, "open_connections", help, &self.open_connections);
        let help = "Connections closed at accept: over max_connections or max_connections_per_ip";
        add(r, "connections_refused", help, &self.connections_refused);
        let help = "Connections closed for holding no request (none in time, idle) or for their request budget";
        add(r, "connections_expired", help, &self.connections_expired);
    }

    /// Async tasks.
    fn register_tasks(&self, r: &mut Reg) {
        add(
            r,
            "tasks_finished",
            "Async tasks by final state",
            &self.tasks_finished,
        );
        let help = "Async tasks waiting for the batch band, and placed in it";
        add(r, "task_band", help, &self.task_band);
        let help = "Task callback POSTs, delivered or failed";
        add(r, "task_callbacks", help, &self.task_callbacks);
        let help =
            "Async tasks claimed after another replica held them past the visibility timeout";
        add(r, "tasks_reclaimed", help, &self.tasks_reclaimed);
    }

    /// The shared limit store (`[state] backend = "redis"`).
    fn register_shared_state(&self, r: &mut Reg) {
        let help = "1 when limits are decided in the shared store, 0 on the local fallback";
        add(r, "state_shared", help, &self.state_shared);
        let help = "Switches between shared (Redis) and local limit decisions";
        add(r, "state_switches", help, &self.state_switches);
        let help = "Shared-limit decisions by where they were made";
        add(r, "state_decisions", help, &self.state_decisions);
        let help = "Live gateway replicas seen in the shared store";
        add(r, "fleet_replicas", help, &self.fleet_replicas);
    }

    /// Renders the text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Counts one finished request (the tenant label bounded as in [`Metrics::tenant_label`]).
    pub fn request(&self, tenant: &str, model: &str, outcome: &str) {
        self.requests
            .get_or_create(&RequestLabels {
                tenant: self.tenant_label(tenant),
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

    /// Counts one exact count of a prompt by a backend.
    pub fn exact_count(&self, model: &str, outcome: &'static str) {
        self.exact_counts
            .get_or_create(&ExactCountLabels {
                model: model.to_string(),
                outcome,
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

    /// Sets a tenant's remaining quota gauges (those of its limits that are known), through
    /// its handles `h`. A tenant past `observe.max_tenant_series` gets none: one `other`
    /// gauge written by many tenants would mean nothing.
    pub fn limiter_remaining_for(
        &self,
        h: &TenantMetrics,
        tenant: &str,
        requests: Option<u64>,
        tokens: Option<u64>,
    ) {
        if !self.tenant_series.read().contains(tenant) {
            return;
        }
        let set = |handle: &OnceLock<Gauge>, family: &Family<TenantLabel, Gauge>, v: u64| {
            handle
                .get_or_init(|| {
                    let label = TenantLabel {
                        tenant: tenant.to_string(),
                    };
                    family.get_or_create(&label).clone()
                })
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        if let Some(v) = requests {
            set(&h.remaining_requests, &self.limiter_remaining_requests, v);
        }
        if let Some(v) = tokens {
            set(&h.remaining_tokens, &self.limiter_remaining_tokens, v);
        }
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
    /// Sets which tenants get their own series in the per-tenant metrics: the first
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
    pub fn request_times(
        &self,
        h: &TenantMetrics,
        model: &str,
        tenant: &str,
        tier: &str,
        t: &RequestTimes,
    ) {
        let queued = t.queued.as_secs_f64();
        let record = |[queue, ttft, duration]: &[Histogram; 3]| {
            queue.observe(queued);
            if let Some(x) = t.ttft {
                ttft.observe(x.as_secs_f64());
            }
            duration.observe(t.total.as_secs_f64());
        };
        let found = |v: &[(Box<str>, [Histogram; 3])]| {
            v.iter()
                .find(|(m, _)| **m == *model)
                .map(|(_, hs)| record(hs))
        };
        if found(&h.times.read()).is_none() {
            let mut v = h.times.write();
            if found(&v).is_none() {
                let labels = ModelTenantLabels {
                    model: model.to_string(),
                    tenant: self.tenant_label(tenant),
                };
                let hs = [
                    self.request_queue.get_or_create(&labels).clone(),
                    self.request_ttft.get_or_create(&labels).clone(),
                    self.request_duration.get_or_create(&labels).clone(),
                ];
                record(&hs);
                v.push((model.into(), hs));
            }
        }
        h.queue_wait
            .get(tier, || {
                self.queue_wait
                    .get_or_create(&TierLabel { tier: tier.into() })
                    .clone()
            })
            .observe(queued);
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

    /// Sets a model's degradation level gauge and counts a change of its level.
    pub fn degrade_level(&self, model: &str, level: u8) {
        let level = i64::from(level);
        self.degrade_level
            .get_or_create(&ModelLabel {
                model: model.to_string(),
            })
            .set(level);
        let before = self
            .last_degrade_level
            .lock()
            .insert(model.to_string(), level);
        if before.is_some_and(|b| b != level) || (before.is_none() && level != 0) {
            self.degrade_changes
                .get_or_create(&ModelLevelLabels {
                    model: model.to_string(),
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

/// A tenant's handles of one tier-labelled series, one per tier it was served in (a
/// tenant has at most two: its own tier and the batch tier of its tasks).
#[derive(Debug)]
struct ByTier<M>(RwLock<Vec<(Box<str>, M)>>);

impl<M> Default for ByTier<M> {
    fn default() -> Self {
        ByTier(RwLock::new(Vec::new()))
    }
}

impl<M: Clone> ByTier<M> {
    fn get(&self, tier: &str, make: impl FnOnce() -> M) -> M {
        if let Some((_, m)) = self.0.read().iter().find(|(t, _)| &**t == tier) {
            return m.clone();
        }
        let mut w = self.0.write();
        if let Some((_, m)) = w.iter().find(|(t, _)| &**t == tier) {
            return m.clone();
        }
        let m = make();
        w.push((tier.into(), m.clone()));
        m
    }
}

/// One tenant's series of the per-request metrics, looked up once and kept (on the
/// tenant). A handle is the series itself, so incrementing it is exactly what
/// `get_or_create(labels).inc()` does, without building the label set — a few `String`
/// allocations, a hash and a lock — on every request. Each series is still created on its
/// first use, so `/metrics` shows the same series as before.
#[derive(Debug, Default)]
pub struct TenantMetrics {
    /// By tier: one tenant's requests run in its own tier and its async tasks in the batch
    /// tier, so a series per tenant alone would count them all under whichever came first.
    admitted: ByTier<Counter>,
    ttft: ByTier<Histogram>,
    prompt_tokens: OnceLock<Counter>,
    completion_tokens: OnceLock<Counter>,
    /// `levee_requests_total` by (model, outcome).
    requests: RwLock<Vec<(Box<str>, &'static str, Counter)>>,
    /// `levee_request_{queue,ttft,duration}_seconds` by model.
    times: RwLock<Vec<(Box<str>, [Histogram; 3])>>,
    /// `levee_queue_wait_seconds` by tier.
    queue_wait: ByTier<Histogram>,
    /// `levee_limiter_remaining_{requests,tokens}`, each created when first set.
    remaining_requests: OnceLock<Gauge>,
    remaining_tokens: OnceLock<Gauge>,
}

/// One model's series of the prompt metrics written on every answer, kept on its lane as
/// [`TenantMetrics`] are on a tenant: created on first use, then written without building
/// a label set.
#[derive(Debug, Default)]
pub struct ModelMetrics {
    estimate_ratio: OnceLock<Histogram>,
    cached_tokens: OnceLock<Counter>,
    correction: [OnceLock<Gauge<f64, AtomicU64>>; levee_policy::TextKind::COUNT],
}

impl Metrics {
    /// Records `levee_prompt_estimate_ratio{model}` (estimate ÷ the engine's count).
    pub fn estimate_ratio_for(&self, h: &ModelMetrics, model: &str, ratio: f64) {
        h.estimate_ratio
            .get_or_init(|| {
                self.estimate_ratio
                    .get_or_create(&ModelLabel {
                        model: model.into(),
                    })
                    .clone()
            })
            .observe(ratio);
    }

    /// Sets `levee_prompt_correction{model,text}` for text of `kind`.
    pub fn correction_for(
        &self,
        h: &ModelMetrics,
        model: &str,
        kind: levee_policy::TextKind,
        factor: f64,
    ) {
        h.correction[kind.index()]
            .get_or_init(|| {
                self.prompt_correction
                    .get_or_create(&CorrectionLabel {
                        model: model.into(),
                        text: kind.as_str(),
                    })
                    .clone()
            })
            .set(factor);
    }

    /// Counts `levee_prompt_cached_tokens_total{model}`.
    pub fn cached_tokens_for(&self, h: &ModelMetrics, model: &str, tokens: u64) {
        h.cached_tokens
            .get_or_init(|| {
                self.prompt_cached_tokens
                    .get_or_create(&ModelLabel {
                        model: model.into(),
                    })
                    .clone()
            })
            .inc_by(tokens);
    }

    /// Counts one admission of a tenant's request in tier `tier`.
    pub fn admitted_for(&self, h: &TenantMetrics, tier: &str) {
        h.admitted
            .get(tier, || {
                self.admitted
                    .get_or_create(&TierLabel { tier: tier.into() })
                    .clone()
            })
            .inc();
    }

    /// Records a time to first byte of a tenant's request in tier `tier`.
    pub fn ttft_for(&self, h: &TenantMetrics, tier: &str, secs: f64) {
        h.ttft
            .get(tier, || {
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
                    tenant: self.tenant_label(tenant),
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
                tenant: self.tenant_label(tenant),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Sample lines (not comments) of the exposition whose name starts with `name`.
    fn samples(m: &Metrics, name: &str) -> Vec<String> {
        m.encode()
            .lines()
            .filter(|l| !l.starts_with('#') && l.starts_with(name))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn shared_state_series_exist_only_with_a_shared_store() {
        let memory = Metrics::new();
        let text = memory.encode();
        assert!(!text.contains("levee_state_shared"), "{text}");
        assert!(!text.contains("levee_fleet_replicas"), "{text}");
        let redis = Metrics::with_shared_state();
        redis.state_shared.set(1);
        assert_eq!(
            samples(&redis, "levee_state_shared"),
            ["levee_state_shared 1"]
        );
    }

    #[test]
    fn tenant_counters_are_bounded_like_the_histograms() {
        let m = Metrics::new();
        m.set_tenant_series(["a", "b"].into_iter(), 1);
        for t in ["a", "b", "c", "-"] {
            m.request(t, "m", "ok");
            let h = TenantMetrics::default();
            m.request_for(&h, t, "m", "ok");
            m.tokens_for(&h, t, 1, 2);
            m.limiter_remaining_for(&h, t, Some(5), Some(50));
        }
        let requests = samples(&m, "levee_requests_total");
        assert!(requests.iter().any(|l| l.contains("tenant=\"a\"")));
        assert!(requests
            .iter()
            .any(|l| l.contains("tenant=\"other\"") && l.ends_with(" 4")));
        assert!(requests.iter().any(|l| l.contains("tenant=\"-\"")));
        let all = m.encode();
        for t in ["b", "c"] {
            assert!(!all.contains(&format!("tenant=\"{t}\"")), "{all}");
        }
        let tokens = samples(&m, "levee_tokens_total");
        assert!(tokens.iter().any(|l| l.contains("tenant=\"other\"")));
        // Remaining quotas are kept only for tenants with their own series, one unit each.
        assert_eq!(
            samples(&m, "levee_limiter_remaining_requests"),
            ["levee_limiter_remaining_requests{tenant=\"a\"} 5"]
        );
        assert_eq!(
            samples(&m, "levee_limiter_remaining_tokens"),
            ["levee_limiter_remaining_tokens{tenant=\"a\"} 50"]
        );
    }

    #[test]
    fn degradation_is_per_model_and_changes_are_counted() {
        let m = Metrics::new();
        m.degrade_level("a", 0);
        m.degrade_level("b", 2);
        m.degrade_level("b", 2);
        m.degrade_level("b", 0);
        let levels = samples(&m, "levee_degrade_level{");
        assert!(levels.contains(&"levee_degrade_level{model=\"a\"} 0".to_string()));
        assert!(levels.contains(&"levee_degrade_level{model=\"b\"} 0".to_string()));
        let changes = samples(&m, "levee_degrade_level_changes_total");
        assert_eq!(changes.len(), 2, "{changes:?}");
        assert!(changes
            .iter()
            .all(|l| l.contains("model=\"b\"") && l.ends_with(" 1")));
    }

    #[test]
    fn long_durations_have_buckets_up_to_30_minutes() {
        let m = Metrics::new();
        let labels = ModelTenantLabels {
            model: "m".into(),
            tenant: "-".into(),
        };
        m.request_duration.get_or_create(&labels).observe(1500.0);
        m.request_queue.get_or_create(&labels).observe(500.0);
        let duration = samples(&m, "levee_request_duration_seconds_bucket");
        let bucket = |le: &str| {
            duration
                .iter()
                .find(|l| l.contains(&format!("le=\"{le}\"")))
                .cloned()
                .unwrap()
        };
        assert!(bucket("1800.0").ends_with(" 1"), "{duration:?}");
        assert!(bucket("1200.0").ends_with(" 0"), "1500 s is over 1200 s");
        let queue = samples(&m, "levee_request_queue_seconds_bucket");
        assert!(queue
            .iter()
            .any(|l| l.contains("le=\"600.0\"") && l.ends_with(" 1")));
    }
}
