//! A circuit breaker per backend.
//!
//! ```text
//!  Closed ──(failure rate ≥ threshold over the window with ≥ min_requests,
//!            or consecutive_failures in a row)──▶ Open
//!  Open ──(cooldown elapsed)──▶ HalfOpen
//!  HalfOpen: admits at most `half_open_probes` probes at a time;
//!            `success_threshold` probe successes ──▶ Closed
//!            one probe BackendFailure ──▶ Open (a fresh cooldown)
//! ```
//!
//! Only [`Outcome::BackendFailure`] counts as failure. [`Outcome::Backpressure`] (the
//! backend's own 429/503) and [`Outcome::ClientError`] (4xx) count for nothing, and neither
//! does [`Outcome::Cancelled`]; in half-open they just give the probe slot back.
//!
//! Every transition starts a new generation; an outcome reported with a ticket from an older
//! generation is ignored, so a slow failure from before a recovery cannot reopen the breaker.

use crate::clock::{duration_nanos, Timestamp};
use crate::watermark::ConfigError;
use std::time::Duration;

/// Breaker settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    /// Length of the sliding window for the failure rate.
    pub window: Duration,
    /// Buckets the window is split into (the window slides one bucket at a time).
    pub buckets: u32,
    /// The failure rate is only judged once the window holds this many counted requests.
    pub min_requests: u32,
    /// Failure rate (0..=1) at which the breaker opens.
    pub failure_rate: f64,
    /// Consecutive failures at which the breaker opens (0: never on this rule).
    pub consecutive_failures: u32,
    /// Time open before probing.
    pub cooldown: Duration,
    /// Probes allowed in flight in half-open.
    pub half_open_probes: u32,
    /// Probe successes needed to close.
    pub success_threshold: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            window: Duration::from_secs(10),
            buckets: 10,
            min_requests: 20,
            failure_rate: 0.5,
            consecutive_failures: 5,
            cooldown: Duration::from_secs(5),
            half_open_probes: 1,
            success_threshold: 1,
        }
    }
}

impl BreakerConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.window.is_zero() || self.buckets == 0 {
            return Err(ConfigError(
                "breaker.window and breaker.buckets must be > 0".into(),
            ));
        }
        if !(self.failure_rate > 0.0 && self.failure_rate <= 1.0) {
            return Err(ConfigError("breaker.failure_rate must be in (0, 1]".into()));
        }
        if self.half_open_probes == 0 || self.success_threshold == 0 {
            return Err(ConfigError(
                "breaker.half_open_probes and breaker.success_threshold must be > 0".into(),
            ));
        }
        Ok(())
    }
}

/// How a request to a backend ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// It worked.
    Success,
    /// 5xx, connect error, timeout: counts as failure.
    BackendFailure,
    /// The backend's own 429/503: a load signal, not a failure.
    Backpressure,
    /// The client's 4xx: counts for nothing.
    ClientError,
    /// Abandoned (client went away) before an outcome: counts for nothing.
    Cancelled,
}

/// The breaker's state, for routing and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Passing traffic.
    Closed,
    /// Refusing traffic.
    Open,
    /// Passing a few probes.
    HalfOpen,
}

impl BreakerState {
    /// Stable name for metrics (`closed`, `open`, `half_open`).
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
    /// Gauge value: 0 closed, 1 half-open, 2 open.
    pub fn as_gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }
}

/// Permission to send one request; give it back with [`Breaker::record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "report the outcome with Breaker::record"]
pub struct BreakerTicket {
    generation: u64,
    probe: bool,
}

impl BreakerTicket {
    /// True if this request is a half-open probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }
}

/// Refused by an open breaker (or a half-open one with all probe slots taken).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerOpen {
    /// Time until the breaker will admit a probe (at least 1 ms).
    pub retry_after: Duration,
}

/// Figures for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerStats {
    /// The state.
    pub state: BreakerState,
    /// Counted requests in the window.
    pub window_requests: u64,
    /// Failures in the window.
    pub window_failures: u64,
    /// Current run of failures.
    pub consecutive_failures: u32,
    /// Times the breaker has opened.
    pub opened_total: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    index: u64,
    total: u32,
    failures: u32,
}

#[derive(Debug, Clone, Copy)]
enum Inner {
    Closed,
    Open { until: Timestamp },
    HalfOpen { in_flight: u32, successes: u32 },
}

/// A circuit breaker. `&mut self`; one per backend, behind the caller's lock.
#[derive(Debug, Clone)]
pub struct Breaker {
    cfg: BreakerConfig,
    bucket_ns: u64,
    buckets: Vec<Bucket>,
    consecutive: u32,
    inner: Inner,
    generation: u64,
    opened_total: u64,
}

impl Breaker {
    /// A closed breaker. Invalid settings are clamped to the nearest sensible value; use
    /// [`BreakerConfig::validate`] to report them.
    pub fn new(cfg: BreakerConfig) -> Self {
        let buckets = cfg.buckets.max(1);
        let bucket_ns = (duration_nanos(cfg.window) / buckets as u64).max(1);
        Breaker {
            cfg: BreakerConfig {
                buckets,
                half_open_probes: cfg.half_open_probes.max(1),
                success_threshold: cfg.success_threshold.max(1),
                ..cfg
            },
            bucket_ns,
            buckets: vec![
                Bucket {
                    index: u64::MAX,
                    total: 0,
                    failures: 0
                };
                buckets as usize
            ],
            consecutive: 0,
            inner: Inner::Closed,
            generation: 0,
            opened_total: 0,
        }
    }

    /// The settings.
    pub fn config(&self) -> &BreakerConfig {
        &self.cfg
    }

    fn bucket_index(&self, now: Timestamp) -> u64 {
        now.as_nanos() / self.bucket_ns
    }

    fn window_counts(&self, now: Timestamp) -> (u64, u64) {
        let cur = self.bucket_index(now);
        let n = self.cfg.buckets as u64;
        self.buckets
            .iter()
            .filter(|b| b.index != u64::MAX && b.index <= cur && cur - b.index < n)
            .fold((0, 0), |(t, f), b| {
                (t + b.total as u64, f + b.failures as u64)
            })
    }

    fn reset_window(&mut self) {
        for b in &mut self.buckets {
            *b = Bucket {
                index: u64::MAX,
                total: 0,
                failures: 0,
            };
        }
        self.consecutive = 0;
    }

    fn transition(&mut self, to: Inner) {
        self.generation += 1;
        if let Inner::Open { .. } = to {
            self.opened_total += 1;
        }
        self.inner = to;
        self.reset_window();
    }

    fn open(&mut self, now: Timestamp) {
        self.transition(Inner::Open {
            until: now + self.cfg.cooldown,
        });
    }

    /// Holds the breaker open until `until` (outlier ejection: the backend said it cannot
    /// serve for that long). When the time is up it goes half-open like any open breaker,
    /// so the backend comes back through probes. A breaker already open at least that long
    /// is left alone (no new generation, no second count in `opened_total`).
    pub fn hold_open(&mut self, until: Timestamp, now: Timestamp) {
        if until <= now {
            return;
        }
        if let Inner::Open { until: u } = self.inner {
            if u >= until {
                return;
            }
        }
        self.transition(Inner::Open { until });
    }

    /// The state at `now` (an open breaker whose cooldown has passed reads as half-open).
    pub fn state(&self, now: Timestamp) -> BreakerState {
        match self.inner {
            Inner::Closed => BreakerState::Closed,
            Inner::Open { until } if now < until => BreakerState::Open,
            Inner::Open { .. } | Inner::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Whether a request would be admitted now (no side effects), for routing.
    pub fn would_admit(&self, now: Timestamp) -> bool {
        match self.inner {
            Inner::Closed => true,
            Inner::Open { until } => now >= until,
            Inner::HalfOpen { in_flight, .. } => in_flight < self.cfg.half_open_probes,
        }
    }

    /// Asks to send one request at `now`.
    pub fn try_acquire(&mut self, now: Timestamp) -> Result<BreakerTicket, BreakerOpen> {
        if let Inner::Open { until } = self.inner {
            if now < until {
                return Err(BreakerOpen {
                    retry_after: (until - now).max(Duration::from_millis(1)),
                });
            }
            self.transition(Inner::HalfOpen {
                in_flight: 0,
                successes: 0,
            });
        }
        match &mut self.inner {
            Inner::Closed => Ok(BreakerTicket {
                generation: self.generation,
                probe: false,
            }),
            Inner::HalfOpen { in_flight, .. } => {
                if *in_flight < self.cfg.half_open_probes {
                    *in_flight += 1;
                    Ok(BreakerTicket {
                        generation: self.generation,
                        probe: true,
                    })
                } else {
                    // Probes are out; their answers decide. A probe takes about a request's
                    // time, which we do not know here: suggest a tenth of the cooldown.
                    Err(BreakerOpen {
                        retry_after: (self.cfg.cooldown / 10).max(Duration::from_millis(1)),
                    })
                }
            }
            Inner::Open { .. } => Err(BreakerOpen {
                retry_after: Duration::from_millis(1),
            }),
        }
    }

    /// Reports how the request of `ticket` ended.
    pub fn record(&mut self, ticket: BreakerTicket, outcome: Outcome, now: Timestamp) {
        if ticket.generation != self.generation {
            return;
        }
        match self.inner {
            Inner::Closed => self.record_closed(outcome, now),
            Inner::HalfOpen {
                in_flight,
                successes,
            } => {
                let in_flight = in_flight.saturating_sub(1);
                match outcome {
                    Outcome::Success => {
                        let successes = successes + 1;
                        if successes >= self.cfg.success_threshold {
                            self.transition(Inner::Closed);
                        } else {
                            self.inner = Inner::HalfOpen {
                                in_flight,
                                successes,
                            };
                        }
                    }
                    Outcome::BackendFailure => self.open(now),
                    Outcome::Backpressure | Outcome::ClientError | Outcome::Cancelled => {
                        self.inner = Inner::HalfOpen {
                            in_flight,
                            successes,
                        };
                    }
                }
            }
            Inner::Open { .. } => {}
        }
    }

    fn record_closed(&mut self, outcome: Outcome, now: Timestamp) {
        let failed = match outcome {
            Outcome::Success => false,
            Outcome::BackendFailure => true,
            Outcome::Backpressure | Outcome::ClientError | Outcome::Cancelled => return,
        };
        let idx = self.bucket_index(now);
        let n = self.buckets.len();
        let b = &mut self.buckets[(idx % n as u64) as usize];
        if b.index != idx {
            *b = Bucket {
                index: idx,
                total: 0,
                failures: 0,
            };
        }
        b.total += 1;
        if failed {
            b.failures += 1;
            self.consecutive += 1;
            if self.cfg.consecutive_failures > 0
                && self.consecutive >= self.cfg.consecutive_failures
            {
                self.open(now);
                return;
            }
            let (total, failures) = self.window_counts(now);
            if total >= self.cfg.min_requests as u64
                && failures as f64 >= self.cfg.failure_rate * total as f64
            {
                self.open(now);
            }
        } else {
            self.consecutive = 0;
        }
    }

    /// Figures for metrics.
    pub fn stats(&self, now: Timestamp) -> BreakerStats {
        let (window_requests, window_failures) = self.window_counts(now);
        BreakerStats {
            state: self.state(now),
            window_requests,
            window_failures,
            consecutive_failures: self.consecutive,
            opened_total: self.opened_total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            window: Duration::from_secs(10),
            buckets: 10,
            min_requests: 10,
            failure_rate: 0.5,
            consecutive_failures: 0,
            cooldown: Duration::from_secs(5),
            half_open_probes: 2,
            success_threshold: 2,
        }
    }

    fn run(b: &mut Breaker, o: Outcome, now: Timestamp) {
        let t = b.try_acquire(now).unwrap();
        b.record(t, o, now);
    }

    #[test]
    fn opens_on_failure_rate_with_min_requests() {
        let mut b = Breaker::new(cfg());
        let t = Timestamp::from_nanos(1);
        for _ in 0..4 {
            run(&mut b, Outcome::BackendFailure, t);
        }
        assert_eq!(b.state(t), BreakerState::Closed, "below min_requests");
        for _ in 0..5 {
            run(&mut b, Outcome::Success, t);
        }
        run(&mut b, Outcome::BackendFailure, t);
        assert_eq!(b.state(t), BreakerState::Open);
        assert!(b.try_acquire(t).is_err());
    }

    #[test]
    fn backpressure_and_client_errors_do_not_count() {
        let mut b = Breaker::new(BreakerConfig {
            consecutive_failures: 3,
            ..cfg()
        });
        let t = Timestamp::from_nanos(1);
        for _ in 0..100 {
            run(&mut b, Outcome::Backpressure, t);
            run(&mut b, Outcome::ClientError, t);
        }
        assert_eq!(b.stats(t).window_requests, 0);
        run(&mut b, Outcome::BackendFailure, t);
        run(&mut b, Outcome::BackendFailure, t);
        assert_eq!(b.state(t), BreakerState::Closed);
        run(&mut b, Outcome::BackendFailure, t);
        assert_eq!(b.state(t), BreakerState::Open);
    }

    #[test]
    fn half_open_probes_then_close_or_reopen() {
        let mut b = Breaker::new(BreakerConfig {
            consecutive_failures: 1,
            ..cfg()
        });
        let t0 = Timestamp::from_nanos(1);
        run(&mut b, Outcome::BackendFailure, t0);
        let e = b.try_acquire(t0 + Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.retry_after, Duration::from_secs(4));
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(b.state(t1), BreakerState::HalfOpen);
        let p1 = b.try_acquire(t1).unwrap();
        let p2 = b.try_acquire(t1).unwrap();
        assert!(p1.is_probe());
        assert!(b.try_acquire(t1).is_err(), "only two probes");
        b.record(p1, Outcome::Success, t1);
        b.record(p2, Outcome::BackendFailure, t1);
        assert_eq!(b.state(t1), BreakerState::Open);
        let t2 = t1 + Duration::from_secs(5);
        let p = b.try_acquire(t2).unwrap();
        b.record(p, Outcome::Success, t2);
        let p = b.try_acquire(t2).unwrap();
        b.record(p, Outcome::Success, t2);
        assert_eq!(b.state(t2), BreakerState::Closed);
        assert_eq!(b.stats(t2).opened_total, 2);
    }

    #[test]
    fn hold_open_lasts_until_then_probes() {
        let mut b = Breaker::new(cfg());
        let t0 = Timestamp::from_nanos(1);
        let late = b.try_acquire(t0).unwrap();
        let until = t0 + Duration::from_secs(30);
        b.hold_open(until, t0);
        assert_eq!(b.state(t0), BreakerState::Open);
        // Longer than the 5 s cooldown: held for the whole time asked.
        let before = until.saturating_sub(Duration::from_millis(1));
        assert_eq!(
            b.try_acquire(before).unwrap_err().retry_after,
            Duration::from_millis(1)
        );
        // A shorter hold and a request from before the hold change nothing.
        b.hold_open(t0 + Duration::from_secs(1), t0);
        b.record(late, Outcome::Success, before);
        assert_eq!(b.state(before), BreakerState::Open);
        assert_eq!(b.stats(before).opened_total, 1);
        // Then probes decide, as after any opening.
        let p = b.try_acquire(until).unwrap();
        assert!(p.is_probe());
        b.record(p, Outcome::Success, until);
        let p = b.try_acquire(until).unwrap();
        b.record(p, Outcome::Success, until);
        assert_eq!(b.state(until), BreakerState::Closed);
        // A hold that has already ended does nothing.
        b.hold_open(until, until);
        assert_eq!(b.state(until), BreakerState::Closed);
    }

    #[test]
    fn stale_outcomes_are_ignored() {
        let mut b = Breaker::new(BreakerConfig {
            consecutive_failures: 1,
            ..cfg()
        });
        let t0 = Timestamp::from_nanos(1);
        let old = b.try_acquire(t0).unwrap();
        run(&mut b, Outcome::BackendFailure, t0);
        let t1 = t0 + Duration::from_secs(5);
        let p = b.try_acquire(t1).unwrap();
        b.record(old, Outcome::BackendFailure, t1);
        assert_eq!(b.state(t1), BreakerState::HalfOpen);
        b.record(p, Outcome::Success, t1);
    }

    #[test]
    fn window_slides() {
        let mut b = Breaker::new(cfg());
        let t0 = Timestamp::from_nanos(1);
        for _ in 0..9 {
            run(&mut b, Outcome::BackendFailure, t0);
        }
        // Ten seconds later those failures have left the window.
        let t1 = t0 + Duration::from_secs(10);
        for _ in 0..9 {
            run(&mut b, Outcome::Success, t1);
        }
        run(&mut b, Outcome::BackendFailure, t1);
        assert_eq!(b.state(t1), BreakerState::Closed);
    }
}
