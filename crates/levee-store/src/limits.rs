//! The store interface and the values that cross it.

use levee_policy::{Quota, RateLimitInfo, TokenQuota};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// The limits of one scope (the fleet-wide global scope, or one tenant), under a stable id
/// that names its state in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeLimits {
    /// The scope's id: `global`, or `t:<tenant>`. Part of the store key.
    pub id: Arc<str>,
    /// Requests per period with a burst; `None`: not limited.
    pub requests: Option<Quota>,
    /// Tokens per period with a capacity; `None`: not limited.
    pub tokens: Option<TokenQuota>,
    /// Requests outstanding at once (each holds a lease until it is settled); `None`: not
    /// limited.
    pub concurrency: Option<u64>,
}

impl ScopeLimits {
    /// Whether the scope limits anything.
    pub fn is_limited(&self) -> bool {
        self.requests.is_some() || self.tokens.is_some() || self.concurrency.is_some()
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limited {
    /// The request rate.
    Requests,
    /// The token rate.
    Tokens,
    /// The estimate is larger than the token bucket's capacity: it can never pass.
    TooLarge {
        /// The bucket's capacity.
        capacity: u64,
    },
    /// Every lease is held: too many requests outstanding.
    Concurrency,
}

/// Rate-limit figures of the last scope decided (the tenant's), for the `x-ratelimit-*`
/// headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Figures {
    /// Requests, if limited.
    pub requests: Option<RateLimitInfo>,
    /// Tokens, if limited.
    pub tokens: Option<RateLimitInfo>,
}

/// A slice of the budget granted by [`LimitStore::take_slice`], charged at once, for a
/// replica to hand out locally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    /// Requests granted (at least 1).
    pub requests: u64,
    /// Tokens granted (at least the minimum asked for).
    pub tokens: u64,
    /// The last scope's figures after the charge.
    pub figures: Figures,
}

/// The answer to [`LimitStore::take_slice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SliceDecision {
    /// Granted and charged.
    Granted(Slice),
    /// Nothing was charged: not even one request with `min_tokens` fits now.
    Refused {
        /// Index of the refusing scope.
        scope: usize,
        /// Which of its limits.
        limit: Limited,
        /// When one request of `min_tokens` would pass.
        retry_after: Duration,
    },
}

/// The answer to [`LimitStore::take`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Charged one request and the tokens in every scope, and holds the lease in every
    /// scope with a concurrency limit.
    Admitted(Figures),
    /// Nothing was charged.
    Refused {
        /// Index of the refusing scope in the slice passed to `take`.
        scope: usize,
        /// Which of its limits.
        limit: Limited,
        /// When the request would pass (zero for [`Limited::TooLarge`] and
        /// [`Limited::Concurrency`], which wait for nothing the store can time).
        retry_after: Duration,
    },
}

/// How an admitted request ended, for [`LimitStore::settle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    /// Tokens reserved at admission.
    pub reserved: u64,
    /// Tokens really used: less refunds the difference, more charges it (as debt of at most
    /// one capacity).
    pub actual: u64,
    /// Request-rate charges to give back: 1 for a request never served, the unused count
    /// of a returned slice.
    pub give_back_requests: u64,
}

impl Settlement {
    /// A request never served: everything comes back.
    pub fn refund(reserved: u64) -> Self {
        Settlement {
            reserved,
            actual: 0,
            give_back_requests: 1,
        }
    }

    /// The unused rest of a slice: `requests` and `tokens` come back.
    pub fn unused(requests: u64, tokens: u64) -> Self {
        Settlement {
            reserved: tokens,
            actual: 0,
            give_back_requests: requests,
        }
    }

    /// A served request that used `actual` tokens.
    pub fn reconcile(reserved: u64, actual: u64) -> Self {
        Settlement {
            reserved,
            actual,
            give_back_requests: 0,
        }
    }
}

/// What went wrong talking to a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The Redis server failed or could not be reached.
    #[error("the Redis limit store failed ({0}); check that the server in [state] url is up and reachable")]
    Redis(#[from] redis::RedisError),
    /// A script answered something it never answers: a different script under the same
    /// name, or a server that is not Redis-compatible.
    #[error("the Redis limit script answered {0:?}, which this levee does not understand; check that [state] url points at Redis or Valkey")]
    Reply(Vec<i64>),
}

/// Decides requests against the limits of a few scopes, atomically across them.
pub trait LimitStore: Send + Sync {
    /// Charges one request and `tokens` in every scope of `scopes` and takes the lease
    /// `lease` (unique per request) where concurrency is limited — or nothing, if any scope
    /// refuses. The figures returned are those of the last scope.
    fn take(
        &self,
        scopes: &[ScopeLimits],
        tokens: u64,
        lease: &str,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send;

    /// Charges as much of the budget as every scope has now, up to `requests` requests and
    /// `max_tokens` tokens, and at least one request and `min_tokens` tokens — or nothing.
    /// For local batching; scopes with a concurrency limit are not sliced (the caller takes
    /// a lease per request) and their concurrency is ignored here. Give the unused rest
    /// back with [`LimitStore::settle`] and [`Settlement::unused`].
    fn take_slice(
        &self,
        scopes: &[ScopeLimits],
        requests: u64,
        max_tokens: u64,
        min_tokens: u64,
    ) -> impl Future<Output = Result<SliceDecision, StoreError>> + Send;

    /// Settles a request `take` admitted with the same scopes, and frees its lease.
    fn settle(
        &self,
        scopes: &[ScopeLimits],
        settlement: Settlement,
        lease: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}
