//! levee-policy: every overload decision levee makes, as pure code.
//!
//! Nothing here does I/O or spawns tasks; time is injected through [`Clock`] so that every
//! decision can be replayed with a manual clock in tests. State that the gateway mutates per
//! request (`Admission`, `FairQueue`, limiters, `Breaker`, planners) takes `&mut self` and is
//! meant to sit behind one lock; concurrency [`Permit`]s are atomics and can be dropped
//! anywhere.
//!
//! See `docs/policy.md` for how the gateway calls this crate.

#![warn(missing_docs)]

mod adaptive;
mod admission;
mod affinity;
mod autoscale;
mod breaker;
mod clock;
mod completions;
mod concurrency;
mod correction;
mod degrade;
mod fasthash;
mod fleet;
mod gcra;
mod key;
mod keyed;
mod lane;
mod latency;
mod limits;
mod preempt;
mod prefill;
mod quantile;
mod queue;
mod refusal;
mod retry;
mod share;
mod streams;
mod tokens;
mod units;
mod watermark;

pub use adaptive::{AdaptiveConfig, AdaptiveLimit};
pub use admission::{
    Admission, AdmissionConfig, AdmissionRequest, Admit, Completion, Dispatched, Expired, Grant,
    LaneAdmission, ModelSpec, Pending, Refusal,
};
pub use affinity::{
    choose as choose_backend, least_loaded, load_bound, within_bound, Candidate, SessionKey,
    SessionMap,
};
pub use autoscale::{
    erlang_c, mean_wait, replicas_needed, AutoscaleConfig, Autoscaler, Bound, Demand, Need,
    Recommendation,
};
pub use breaker::{
    Breaker, BreakerConfig, BreakerOpen, BreakerState, BreakerStats, BreakerTicket, Outcome,
};
pub use clock::{Clock, ManualClock, StdClock, SystemClock, Timestamp};
pub use completions::OverBudget;
pub use concurrency::{ConcurrencyLimit, KeyedConcurrency, Permit, Saturated};
pub use correction::{PromptCorrection, PromptCorrections, TextKind};
pub use degrade::{
    DegradeConfig, DegradeLevel, DegradePlan, DegradePlanner, DegradeStep, LoadSignals,
};
pub use fasthash::FastState;
pub use fleet::{
    fair_split, slice_want, tiered_split, Budget, FleetLedger, SliceDemand, SliceGrant,
    MIN_MARGIN_SLOTS,
};
pub use gcra::{Gcra, KeyedGcra, NotUntil, Quota, RateLimitInfo};
pub use key::Key;
pub use lane::{
    AffinityConfig, BackendLimits, BackendReport, BackendStats, FleetView, Lane, LaneConfig,
    Placement, Unservable,
};
pub use latency::{LatencyFit, LatencySlo};
pub use limits::{HeavyRule, LimitSpec, RateLimitHeaders, SharedLimits, TenantLimits, TenantSpec};
pub use preempt::RunId;
pub use prefill::PrefillFit;
pub use quantile::nearest_rank;
pub use queue::{
    Entry, FairQueue, Pick, PushRefusal, QueueLimits, QueueStats, Rejected, TenantBacklog, Ticket,
    Tier, TierStats, AGING_WALK, PREFER_PASSES, PREFER_WINDOW, SHORTEST_WINDOW, VIRTUAL_SCALE,
};
pub use refusal::{RefusalReason, Scope};
pub use retry::{DrainRate, RetryAfter, RetryBounds};
pub use streams::StreamId;
pub use tokens::{Refused, Reservation, TokenBucket, TokenLimiter, TokenQuota};
pub use watermark::{
    ConfigError, LoadZone, WaitBudget, WatermarkAction, WatermarkDecision, Watermarks,
};
