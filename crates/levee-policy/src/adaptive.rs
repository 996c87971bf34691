//! Adaptive concurrency from latency, after Netflix concurrency-limits' `Gradient2Limit` and
//! Envoy's adaptive concurrency filter.
//!
//! It keeps a long-term RTT average (the baseline) and a short-term one. When the short-term
//! RTT rises above `tolerance × baseline`, the gradient `tolerance·long/short` drops below 1
//! and the limit shrinks; when they agree the limit grows by a queue allowance of `√limit`.
//! The new value is smoothed and clamped into `[min, max]`. Samples taken while the backend is
//! far from its limit (in flight < limit/2) do not raise it (the app is not limit-bound).
//! A dropped request (timeout, backend failure) multiplies the limit by `backoff`.
//!
//! Feed it per backend and copy [`AdaptiveLimit::limit`] into that backend's
//! [`crate::ConcurrencyLimit::set_limit`].

use std::time::Duration;

/// Settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveConfig {
    /// Starting limit.
    pub initial: usize,
    /// Lower bound.
    pub min: usize,
    /// Upper bound.
    pub max: usize,
    /// How far the short RTT may exceed the long one before the limit shrinks (Gradient2: 1.5).
    pub tolerance: f64,
    /// Weight of each new limit estimate (Gradient2: 0.2).
    pub smoothing: f64,
    /// Samples in the long-term RTT average (Gradient2: 600).
    pub long_window: u32,
    /// Samples in the short-term RTT average.
    pub short_window: u32,
    /// Factor applied on a dropped request.
    pub backoff: f64,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        AdaptiveConfig {
            initial: 20,
            min: 1,
            max: 1000,
            tolerance: 1.5,
            smoothing: 0.2,
            long_window: 600,
            short_window: 10,
            backoff: 0.9,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Ewma {
    value: f64,
    count: u32,
    window: u32,
}

impl Ewma {
    fn new(window: u32) -> Self {
        Ewma {
            value: 0.0,
            count: 0,
            window: window.max(1),
        }
    }
    fn add(&mut self, x: f64) -> f64 {
        // A plain mean during warm-up, then exponential.
        if self.count < self.window.min(10) {
            self.count += 1;
            self.value += (x - self.value) / self.count as f64;
        } else {
            let a = 2.0 / (self.window as f64 + 1.0);
            self.value += a * (x - self.value);
        }
        self.value
    }
}

/// A gradient concurrency limit. `&mut self`; one per backend.
#[derive(Debug, Clone)]
pub struct AdaptiveLimit {
    cfg: AdaptiveConfig,
    estimate: f64,
    long: Ewma,
    short: Ewma,
}

impl AdaptiveLimit {
    /// A limit starting at `cfg.initial` (clamped into bounds).
    pub fn new(cfg: AdaptiveConfig) -> Self {
        let max = cfg.max.max(cfg.min).max(1);
        let min = cfg.min.clamp(1, max);
        let cfg = AdaptiveConfig { min, max, ..cfg };
        AdaptiveLimit {
            estimate: cfg.initial.clamp(min, max) as f64,
            long: Ewma::new(cfg.long_window),
            short: Ewma::new(cfg.short_window),
            cfg,
        }
    }

    /// The current limit.
    pub fn limit(&self) -> usize {
        (self.estimate as usize).clamp(self.cfg.min, self.cfg.max)
    }

    /// The long-term RTT baseline.
    pub fn baseline_rtt(&self) -> Duration {
        Duration::from_secs_f64(self.long.value.max(0.0) / 1e9)
    }

    /// Feeds one completed request: its latency, the in-flight count when it started, and
    /// whether it was dropped (timeout or backend failure). Returns the new limit.
    pub fn on_sample(&mut self, rtt: Duration, in_flight: usize, dropped: bool) -> usize {
        let cfg = self.cfg;
        if dropped {
            self.estimate = (self.estimate * cfg.backoff).max(cfg.min as f64);
            return self.limit();
        }
        let rtt = (rtt.as_nanos() as f64).max(1.0);
        let short = self.short.add(rtt);
        let mut long = self.long.add(rtt);
        // The baseline drifted far above now (load went away): pull it down faster.
        if long / short > 2.0 {
            long *= 0.95;
            self.long.value = long;
        }
        if (in_flight as f64) < self.estimate / 2.0 {
            return self.limit();
        }
        let gradient = (cfg.tolerance * long / short).clamp(0.5, 1.0);
        let queue = self.estimate.sqrt();
        let new = self.estimate * gradient + queue;
        let smoothed = self.estimate * (1.0 - cfg.smoothing) + new * cfg.smoothing;
        self.estimate = smoothed.clamp(cfg.min as f64, cfg.max as f64);
        self.limit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_when_latency_is_flat_and_shrinks_when_it_rises() {
        let mut a = AdaptiveLimit::new(AdaptiveConfig {
            initial: 10,
            max: 200,
            ..Default::default()
        });
        for _ in 0..200 {
            let l = a.limit();
            a.on_sample(Duration::from_millis(100), l, false);
        }
        let grown = a.limit();
        assert!(grown > 50, "grew to {grown}");
        for _ in 0..100 {
            let l = a.limit();
            a.on_sample(Duration::from_millis(400), l, false);
        }
        assert!(a.limit() < grown / 2, "shrank to {}", a.limit());
    }

    #[test]
    fn app_limited_samples_do_not_grow() {
        let mut a = AdaptiveLimit::new(AdaptiveConfig {
            initial: 50,
            ..Default::default()
        });
        for _ in 0..100 {
            a.on_sample(Duration::from_millis(10), 1, false);
        }
        assert_eq!(a.limit(), 50);
    }

    #[test]
    fn drops_back_off_within_bounds() {
        let mut a = AdaptiveLimit::new(AdaptiveConfig {
            initial: 50,
            min: 5,
            ..Default::default()
        });
        for _ in 0..100 {
            a.on_sample(Duration::from_millis(10), 50, true);
        }
        assert_eq!(a.limit(), 5);
    }
}
