//! Glue from configured quotas to `levee-policy` limiters: one [`Limits`] per scope (global,
//! model, tenant, tenant-heavy), and a [`Grant`] that holds what an admitted request took
//! (concurrency permits, token reservations) until it settles.

use crate::clock::TokioClock;
use crate::error::{GatewayError, RateInfo};
use levee_policy::{
    Clock, ConcurrencyLimit, Gcra, Permit, Quota, RateLimitInfo, Refused, Timestamp, TokenBucket,
    TokenQuota,
};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

/// The limiters of one scope. `None` means unlimited.
#[derive(Debug)]
pub struct Limits {
    /// Human name for messages: `tenant acme`, `model m`, `global`.
    pub scope: String,
    requests: Option<Mutex<Gcra>>,
    tokens: Option<Mutex<TokenBucket>>,
    concurrency: Option<ConcurrencyLimit>,
}

/// Why a scope refused, before it becomes an HTTP error.
#[derive(Debug)]
pub enum LimitRefusal {
    /// Over a rate (requests or tokens): retry after the exact refill time.
    Rate(GatewayError),
    /// The request's token estimate exceeds the scope's whole capacity.
    TooLarge(GatewayError),
}

impl LimitRefusal {
    /// The HTTP error.
    pub fn into_error(self) -> GatewayError {
        match self {
            LimitRefusal::Rate(e) | LimitRefusal::TooLarge(e) => e,
        }
    }
}

impl Limits {
    /// Builds a scope from per-minute figures (0 = unlimited).
    pub fn new(scope: impl Into<String>, rpm: u32, tpm: u64, concurrency: u32) -> Limits {
        Limits {
            scope: scope.into(),
            requests: (rpm > 0).then(|| Mutex::new(Gcra::new(Quota::per_minute(u64::from(rpm))))),
            tokens: (tpm > 0).then(|| Mutex::new(TokenBucket::new(TokenQuota::per_minute(tpm)))),
            concurrency: (concurrency > 0)
                .then(|| ConcurrencyLimit::new(usize::try_from(concurrency).unwrap_or(usize::MAX))),
        }
    }

    /// Sets the request-rate burst (0 keeps the default: one period's worth).
    pub fn with_request_burst(mut self, burst: u32) -> Limits {
        if burst > 0 {
            if let Some(g) = self.requests.as_mut() {
                let quota = g.get_mut().quota().with_burst(u64::from(burst));
                *g.get_mut() = Gcra::new(quota);
            }
        }
        self
    }

    /// Whether this scope limits nothing (lets the caller skip it).
    pub fn is_unlimited(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none() && self.concurrency.is_none()
    }

    /// OpenAI header figures for this scope at `now`.
    pub fn rate_info(&self, now: Timestamp) -> RateInfo {
        let r: Option<RateLimitInfo> = self.requests.as_ref().map(|g| g.lock().info(now));
        let t: Option<RateLimitInfo> = self.tokens.as_ref().map(|b| b.lock().info(now));
        RateInfo {
            limit_requests: r.map(|i| i.limit),
            remaining_requests: r.map(|i| i.remaining),
            reset_requests: r.map(|i| i.reset_after),
            limit_tokens: t.map(|i| i.limit),
            remaining_tokens: t.map(|i| i.remaining),
            reset_tokens: t.map(|i| i.reset_after),
        }
    }

    /// Current figures for admin state: (requests remaining, tokens remaining, in use).
    pub fn snapshot(&self, now: Timestamp) -> serde_json::Value {
        let r = self.requests.as_ref().map(|g| g.lock().info(now));
        let t = self.tokens.as_ref().map(|b| b.lock().info(now));
        serde_json::json!({
            "requests_limit": r.map(|i| i.limit),
            "requests_remaining": r.map(|i| i.remaining),
            "tokens_limit": t.map(|i| i.limit),
            "tokens_remaining": t.map(|i| i.remaining),
            "concurrency_limit": self.concurrency.as_ref().map(|c| c.limit()),
            "concurrency_in_use": self.concurrency.as_ref().map(|c| c.in_use()),
        })
    }

    /// Takes one request and `tokens` estimated tokens from this scope, adding what was
    /// taken to `grant`. On refusal nothing more is taken (earlier scopes in the grant are
    /// released by the caller dropping or refunding it).
    pub fn take(
        self: &Arc<Self>,
        tokens: u64,
        now: Timestamp,
        grant: &mut Grant,
    ) -> Result<(), LimitRefusal> {
        if let Some(c) = &self.concurrency {
            match c.try_acquire() {
                Ok(p) => grant.permits.push(p),
                Err(s) => {
                    return Err(LimitRefusal::Rate(GatewayError::rate_limited(
                        &format!(
                            "{}: {} requests in flight, limit {}",
                            self.scope, s.in_use, s.limit
                        ),
                        // A concurrency slot frees when some request ends; there is no exact
                        // time, so ask for a short, bounded wait.
                        Duration::from_secs(1),
                        self.rate_info(now),
                    )));
                }
            }
        }
        if let Some(g) = &self.requests {
            let mut g = g.lock();
            if let Err(nu) = g.check(now) {
                let info = g.info(now);
                drop(g);
                let mut rate = self.rate_info(now);
                rate.remaining_requests = Some(0);
                rate.reset_requests = Some(info.reset_after);
                return Err(LimitRefusal::Rate(GatewayError::rate_limited(
                    &format!("{} requests per minute", self.scope),
                    nu.retry_after,
                    rate,
                )));
            }
        }
        if let Some(b) = &self.tokens {
            let mut b = b.lock();
            match b.reserve(tokens, now) {
                Ok(()) => {
                    drop(b);
                    grant.tokens.push((self.clone(), tokens));
                }
                Err(Refused::NotUntil { retry_after }) => {
                    drop(b);
                    let mut rate = self.rate_info(now);
                    rate.remaining_tokens = Some(rate.remaining_tokens.unwrap_or(0).min(tokens));
                    return Err(LimitRefusal::Rate(GatewayError::rate_limited(
                        &format!(
                            "{} tokens per minute ({tokens} tokens estimated)",
                            self.scope
                        ),
                        retry_after,
                        rate,
                    )));
                }
                Err(Refused::TooLarge { capacity }) => {
                    return Err(LimitRefusal::TooLarge(
                        GatewayError::bad_request(format!(
                            "this request needs about {tokens} tokens but {} allows at most \
                             {capacity} per minute; lower max_tokens or shorten the prompt",
                            self.scope
                        ))
                        .with_param("max_tokens"),
                    ))
                }
            }
        }
        Ok(())
    }

    fn reconcile(&self, reserved: u64, actual: u64, now: Timestamp) {
        if let Some(b) = &self.tokens {
            b.lock().reconcile(reserved, actual, now);
        }
    }
}

/// What an admitted request holds: concurrency permits (released on drop) and token
/// reservations (reconciled with the real usage at the end, refunded if dropped before).
pub struct Grant {
    clock: TokioClock,
    permits: Vec<Permit>,
    tokens: Vec<(Arc<Limits>, u64)>,
}

impl Drop for Grant {
    fn drop(&mut self) {
        // Dropped unreconciled: the request was refused later in the pipeline or its
        // client left before a backend ran it, so its tokens were never spent.
        if !self.tokens.is_empty() {
            self.refund(self.clock.now());
        }
    }
}

impl Grant {
    /// An empty grant.
    pub fn new(clock: TokioClock) -> Self {
        Grant {
            clock,
            permits: Vec::new(),
            tokens: Vec::new(),
        }
    }

    /// Replaces each reservation with the actual usage (refund or charge).
    pub fn reconcile(&mut self, actual: u64, now: Timestamp) {
        for (limits, reserved) in self.tokens.drain(..) {
            limits.reconcile(reserved, actual, now);
        }
    }

    /// Returns every reservation (the request never reached a backend).
    pub fn refund(&mut self, now: Timestamp) {
        self.reconcile(0, now);
    }
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("permits", &self.permits.len())
            .field("tokens", &self.tokens.len())
            .finish()
    }
}
