use crate::{Backoff, RetryBudget};
use rand::RngExt;
use std::time::{Duration, Instant};

/// What happened to one attempt, as far as the retry decision cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The server answered with this HTTP status.
    Status(u16),
    /// The client gave up waiting (its own timeout).
    Timeout,
    /// No response: the connection was refused, reset or broke before the status line.
    Connect,
}

impl Outcome {
    /// Whether a retry can help: 429, 502, 503 and 504 are temporary by definition, 500 is
    /// often a crashed backend behind a gateway, and timeouts and connection failures may
    /// hit another replica next time. Other 4xx would fail again the same way.
    pub fn is_retryable(self) -> bool {
        match self {
            Outcome::Status(s) => matches!(s, 429 | 500 | 502 | 503 | 504),
            Outcome::Timeout | Outcome::Connect => true,
        }
    }
}

/// Why the policy refused to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUp {
    /// Success, or an error that a retry would not fix.
    NotRetryable,
    /// `max_attempts` attempts were made.
    MaxAttempts,
    /// The retry budget is spent: retrying now would multiply the load.
    BudgetExhausted,
    /// The server asked for a longer wait than the policy accepts.
    RetryAfterTooLong(Duration),
    /// The answer is marked degraded (`x-levee-degraded`): the server chose to answer less
    /// (a capped `max_tokens`, a fallback model, a canned or cached reply) because it is
    /// overloaded, and asking again would add load for the same answer.
    Degraded,
}

/// The policy's answer after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Wait this long, then retry.
    Retry(Duration),
    /// Do not retry; report the last outcome to the caller.
    GiveUp(GiveUp),
}

/// When and whether to retry: full-jitter backoff, the server's `Retry-After`, an attempt
/// limit and (through the [`RetryBudget`] passed to [`RetryPolicy::decide`]) a retry budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Jittered delay when the server gave no `Retry-After`.
    pub backoff: Backoff,
    /// Attempts in total, the first included (1 = never retry).
    pub max_attempts: u32,
    /// A `Retry-After` longer than this makes the client give up rather than wait.
    pub max_retry_after: Duration,
    /// Share of the server's `Retry-After` added at random (0.2: the wait is drawn from
    /// `[retry_after, 1.2 × retry_after]`), so that clients refused together do not all come
    /// back at the same instant; never earlier than asked.
    pub retry_after_jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            backoff: Backoff::default(),
            max_attempts: 4,
            max_retry_after: Duration::from_secs(60),
            retry_after_jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// Decides after attempt number `attempts_made` (1 = the first attempt just failed).
    ///
    /// The delay is the jittered backoff, raised to the server's `retry_after` (plus up to
    /// `retry_after_jitter` of it, at random) when that is longer: the server knows its
    /// queue, the client does not. A retry token is taken from `budget` only when every
    /// other check passed, so refusals cost nothing.
    pub fn decide<R: RngExt + ?Sized>(
        &self,
        attempts_made: u32,
        outcome: Outcome,
        retry_after: Option<Duration>,
        budget: &mut RetryBudget,
        now: Instant,
        rng: &mut R,
    ) -> Decision {
        self.decide_marked(attempts_made, outcome, retry_after, false, budget, now, rng)
    }

    /// [`RetryPolicy::decide`] for an answer that may carry `x-levee-degraded`
    /// (`degraded`): a degraded answer is never retried ([`GiveUp::Degraded`]).
    #[allow(clippy::too_many_arguments)]
    pub fn decide_marked<R: RngExt + ?Sized>(
        &self,
        attempts_made: u32,
        outcome: Outcome,
        retry_after: Option<Duration>,
        degraded: bool,
        budget: &mut RetryBudget,
        now: Instant,
        rng: &mut R,
    ) -> Decision {
        if !outcome.is_retryable() {
            return Decision::GiveUp(GiveUp::NotRetryable);
        }
        if degraded {
            return Decision::GiveUp(GiveUp::Degraded);
        }
        if attempts_made >= self.max_attempts {
            return Decision::GiveUp(GiveUp::MaxAttempts);
        }
        if let Some(wait) = retry_after {
            if wait > self.max_retry_after {
                return Decision::GiveUp(GiveUp::RetryAfterTooLong(wait));
            }
        }
        if !budget.try_retry(now) {
            return Decision::GiveUp(GiveUp::BudgetExhausted);
        }
        let jitter = self.backoff.delay(attempts_made.saturating_sub(1), rng);
        let asked = retry_after.map(|wait| self.spread(wait, rng));
        Decision::Retry(asked.map_or(jitter, |wait| wait.max(jitter)))
    }

    /// `wait` plus a uniform share of it in `[0, retry_after_jitter]`.
    fn spread<R: RngExt + ?Sized>(&self, wait: Duration, rng: &mut R) -> Duration {
        let share = if self.retry_after_jitter.is_finite() {
            self.retry_after_jitter.clamp(0.0, 10.0)
        } else {
            0.0
        };
        if share == 0.0 || wait.is_zero() {
            return wait;
        }
        wait + wait.mul_f64(rng.random_range(0.0..=share))
    }
}
