//! Prometheus metrics, all named `levee_*` (the list with meanings is in docs/gateway.md).

use parking_lot::RwLock;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::OnceLock;

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
    /// `levee_abandoned_total{tier}`: clients that left while queued.
    pub abandoned: Family<TierLabel, Counter>,
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
        let abandoned = Family::<TierLabel, Counter>::default();
        registry.register(
            "abandoned",
            "Clients that went away while their request was queued",
            abandoned.clone(),
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
        Metrics {
            registry,
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
            abandoned,
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
