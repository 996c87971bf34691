use std::time::{Duration, Instant};

/// Configuration of a [`RetryBudget`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryBudgetConfig {
    /// Share of requests that may be retried: each first attempt deposits this many retry
    /// tokens (0.1 = retries are at most 10% of requests).
    pub ratio: f64,
    /// Retries always allowed per second, however few requests there are, so that a
    /// client sending little traffic can still retry once in a while.
    pub min_per_sec: f64,
    /// Most tokens the budget can hold: bounds the burst of retries after a quiet period.
    pub max_tokens: f64,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.1,
            min_per_sec: 1.0,
            max_tokens: 10.0,
        }
    }
}

/// A token bucket of retries: first attempts and time fill it, each retry spends one token.
///
/// Over any run, `retries ≤ max_tokens + ratio × requests + min_per_sec × elapsed`, so when
/// a server fails every request, the client adds at most `ratio` to the offered load instead
/// of multiplying it by the number of attempts. Time is passed in, never read, so the budget
/// is testable with a manual clock.
#[derive(Debug, Clone)]
pub struct RetryBudget {
    config: RetryBudgetConfig,
    tokens: f64,
    last: Instant,
}

impl RetryBudget {
    /// A budget that starts full at time `now`.
    pub fn new(config: RetryBudgetConfig, now: Instant) -> Self {
        Self {
            tokens: config.max_tokens.max(0.0),
            config,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last);
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed.as_secs_f64() * self.config.min_per_sec.max(0.0))
            .min(self.config.max_tokens.max(0.0));
    }

    /// Records a first attempt (not a retry): it earns `ratio` retry tokens.
    pub fn on_request(&mut self, now: Instant) {
        self.refill(now);
        self.tokens = (self.tokens + self.config.ratio.max(0.0)).min(self.config.max_tokens);
    }

    /// Takes one retry token if there is one. `false` means the retry must not happen.
    pub fn try_retry(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Tokens left (whole retries available now, before refill).
    pub fn tokens(&self) -> f64 {
        self.tokens
    }

    /// The configuration.
    pub fn config(&self) -> RetryBudgetConfig {
        self.config
    }

    /// How long until one retry token is available if no request arrives, or `None` if the
    /// budget never refills by time alone.
    pub fn time_to_next(&self) -> Option<Duration> {
        if self.tokens >= 1.0 {
            return Some(Duration::ZERO);
        }
        (self.config.min_per_sec > 0.0)
            .then(|| Duration::from_secs_f64((1.0 - self.tokens) / self.config.min_per_sec))
    }
}
