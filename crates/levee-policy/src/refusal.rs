//! Why a request is refused, and the scope of the limit that refused it.

use crate::lane::Unservable;
use crate::queue::PushRefusal;
use crate::watermark::LoadZone;

/// The scope a limit belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// All traffic.
    Global,
    /// One model.
    Model,
    /// One tenant.
    Tenant,
    /// One tenant's heavy requests.
    TenantHeavy,
}

impl Scope {
    /// `global`, `model`, `tenant`, `tenant_heavy`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Model => "model",
            Scope::Tenant => "tenant",
            Scope::TenantHeavy => "tenant_heavy",
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalReason {
    /// Requests-per-minute limit.
    RequestRate(Scope),
    /// Tokens-per-minute limit.
    TokenRate(Scope),
    /// The estimate exceeds a token bucket's capacity: it can never pass as sent.
    TooLarge(Scope),
    /// Outstanding-request limit.
    Concurrency(Scope),
    /// Larger than any backend's KV budget: it can never be served as sent.
    ExceedsKvBudget,
    /// Load watermark: at `hard`, or in a zone where the tier may not wait.
    Watermark(LoadZone),
    /// The queue is full.
    QueueFull(PushRefusal),
    /// The wait predicted from its place in the queue exceeds its budget.
    PredictedWait,
    /// Its time to first token, predicted from its wait and the backend's learned latency,
    /// misses its tier's objective even if it were admitted now.
    PredictedSloMiss,
    /// It waited its whole budget in the queue.
    QueueTimeout,
    /// The lane cannot serve anything now (no healthy backend, every breaker open).
    Unservable(Unservable),
    /// The model has no lane.
    UnknownModel,
    /// It was queued, and a peer of its tier with less waiting took its place when the lane
    /// was full (longest-queue drop).
    Displaced,
}

impl RefusalReason {
    /// The OpenAI-shaped error code.
    pub fn code(&self) -> &'static str {
        match self {
            RefusalReason::RequestRate(_)
            | RefusalReason::TokenRate(_)
            | RefusalReason::TooLarge(_)
            | RefusalReason::Concurrency(Scope::Tenant | Scope::TenantHeavy) => {
                "rate_limit_exceeded"
            }
            RefusalReason::Concurrency(_)
            | RefusalReason::Watermark(_)
            | RefusalReason::QueueFull(_)
            | RefusalReason::Displaced
            | RefusalReason::PredictedWait => "capacity_overload",
            RefusalReason::PredictedSloMiss => "slo_unattainable",
            RefusalReason::ExceedsKvBudget => "context_length_exceeded",
            RefusalReason::QueueTimeout => "queue_timeout",
            RefusalReason::Unservable(Unservable::NoHealthyBackend) => "no_healthy_backend",
            RefusalReason::Unservable(Unservable::CircuitOpen) => "circuit_open",
            RefusalReason::UnknownModel => "model_not_found",
        }
    }

    /// A short stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            RefusalReason::RequestRate(Scope::Global) => "global_requests",
            RefusalReason::RequestRate(Scope::Model) => "model_requests",
            RefusalReason::RequestRate(Scope::Tenant) => "tenant_requests",
            RefusalReason::RequestRate(Scope::TenantHeavy) => "heavy_requests",
            RefusalReason::TokenRate(Scope::Global) => "global_tokens",
            RefusalReason::TokenRate(Scope::Model) => "model_tokens",
            RefusalReason::TokenRate(Scope::Tenant) => "tenant_tokens",
            RefusalReason::TokenRate(Scope::TenantHeavy) => "heavy_tokens",
            RefusalReason::TooLarge(_) => "too_large",
            RefusalReason::Concurrency(Scope::Global) => "global_concurrency",
            RefusalReason::Concurrency(Scope::Model) => "model_concurrency",
            RefusalReason::Concurrency(Scope::Tenant) => "tenant_concurrency",
            RefusalReason::Concurrency(Scope::TenantHeavy) => "heavy_concurrency",
            RefusalReason::ExceedsKvBudget => "exceeds_kv_budget",
            RefusalReason::Watermark(LoadZone::AtHard) => "hard_watermark",
            RefusalReason::Watermark(_) => "soft_watermark",
            RefusalReason::QueueFull(p) => p.as_str(),
            RefusalReason::PredictedWait => "predicted_wait",
            RefusalReason::PredictedSloMiss => "predicted_slo_miss",
            RefusalReason::QueueTimeout => "queue_timeout",
            RefusalReason::Unservable(Unservable::NoHealthyBackend) => "no_healthy_backend",
            RefusalReason::Unservable(Unservable::CircuitOpen) => "circuit_open",
            RefusalReason::UnknownModel => "unknown_model",
            RefusalReason::Displaced => "displaced",
        }
    }

    /// False when retrying the same request cannot help.
    pub fn is_retryable(&self) -> bool {
        !matches!(
            self,
            RefusalReason::TooLarge(_)
                | RefusalReason::ExceedsKvBudget
                | RefusalReason::UnknownModel
        )
    }
}
