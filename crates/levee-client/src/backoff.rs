use rand::RngExt;
use std::time::Duration;

/// Exponential backoff with full jitter.
///
/// The delay before retry number `n` (counting from 0) is drawn uniformly from
/// `[0, min(cap, base * multiplier^n)]`. Full jitter is the variant that spreads
/// synchronised clients best: with "equal" or no jitter, clients that failed together
/// retry together and the server sees the same spike again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Upper bound of the first retry's delay.
    pub base: Duration,
    /// No delay is ever longer than this.
    pub cap: Duration,
    /// Growth of the upper bound per attempt; 2.0 doubles it.
    pub multiplier: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(20),
            multiplier: 2.0,
        }
    }
}

impl Backoff {
    /// The upper bound of the delay before retry number `retry` (0 = first retry).
    pub fn ceiling(&self, retry: u32) -> Duration {
        let cap = self.cap.as_secs_f64();
        let grown = self.base.as_secs_f64() * self.multiplier.max(1.0).powi(retry.min(1024) as i32);
        // `grown` can be infinite or NaN for absurd inputs; the cap bounds it either way.
        let secs = if grown.is_finite() {
            grown.min(cap)
        } else {
            cap
        };
        Duration::from_secs_f64(secs.max(0.0))
    }

    /// A delay drawn uniformly from `[0, ceiling(retry)]`.
    pub fn delay<R: RngExt + ?Sized>(&self, retry: u32, rng: &mut R) -> Duration {
        let ceiling = self.ceiling(retry);
        if ceiling.is_zero() {
            return Duration::ZERO;
        }
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.random_range(0..=nanos))
    }
}
