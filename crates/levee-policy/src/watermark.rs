//! Watermarks over a load measure (the gateway uses queued + in flight): below `safe` a
//! request is dispatched at once, from `safe` to `soft` it may wait up to its tier's normal
//! budget, from `soft` to `hard` only up to its tier's (shorter) soft budget, and at `hard`
//! it is refused at once.

use crate::clock::Timestamp;
use crate::retry::{DrainRate, RetryAfter, RetryBounds};
use std::fmt;
use std::time::Duration;

/// Three load thresholds, `safe ≤ soft ≤ hard`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watermarks {
    /// Below this, dispatch at once.
    pub safe: u64,
    /// From here, only the tier's soft budget applies.
    pub soft: u64,
    /// At or above this, refuse at once.
    pub hard: u64,
}

/// A configuration value that does not make sense; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Where a load value falls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoadZone {
    /// `load < safe`.
    BelowSafe,
    /// `safe ≤ load < soft`.
    SafeToSoft,
    /// `soft ≤ load < hard`.
    SoftToHard,
    /// `load ≥ hard`.
    AtHard,
}

impl LoadZone {
    /// A short stable name for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadZone::BelowSafe => "below_safe",
            LoadZone::SafeToSoft => "safe_to_soft",
            LoadZone::SoftToHard => "soft_to_hard",
            LoadZone::AtHard => "at_hard",
        }
    }
}

/// How long a tier may wait in the queue in each zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitBudget {
    /// Between `safe` and `soft`.
    pub normal: Duration,
    /// Between `soft` and `hard`; zero means the tier is refused there.
    pub soft: Duration,
}

/// What to do with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatermarkAction {
    /// Dispatch at once.
    DispatchNow,
    /// Queue it, waiting at most `budget`.
    Wait {
        /// The longest wait allowed.
        budget: Duration,
    },
    /// Refuse at once.
    Refuse,
}

/// A watermark decision with its reason and a Retry-After.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatermarkDecision {
    /// What to do.
    pub action: WatermarkAction,
    /// Why: the zone the load was in.
    pub zone: LoadZone,
    /// The load measured.
    pub load: u64,
    /// For `Refuse`: when to come back (time for the queue to drain below `soft` at the
    /// measured rate). For `Wait`: the expected wait. For `DispatchNow`: zero.
    pub retry_after: RetryAfter,
}

impl Watermarks {
    /// Checked constructor: `safe ≤ soft ≤ hard` and `hard > 0`.
    pub fn new(safe: u64, soft: u64, hard: u64) -> Result<Self, ConfigError> {
        if !(safe <= soft && soft <= hard) || hard == 0 {
            return Err(ConfigError(format!(
                "watermarks: need safe <= soft <= hard and hard > 0, got {safe}/{soft}/{hard}"
            )));
        }
        Ok(Watermarks { safe, soft, hard })
    }

    /// The zone of `load`.
    #[inline]
    pub fn zone(&self, load: u64) -> LoadZone {
        if load >= self.hard {
            LoadZone::AtHard
        } else if load >= self.soft {
            LoadZone::SoftToHard
        } else if load >= self.safe {
            LoadZone::SafeToSoft
        } else {
            LoadZone::BelowSafe
        }
    }

    /// Decides for `load` given the tier's budgets and the measured drain rate.
    #[inline]
    pub fn decide(
        &self,
        load: u64,
        budget: WaitBudget,
        drain: &DrainRate,
        bounds: &RetryBounds,
        now: Timestamp,
    ) -> WatermarkDecision {
        let zone = self.zone(load);
        let (action, retry_after) = match zone {
            LoadZone::BelowSafe => (WatermarkAction::DispatchNow, RetryAfter::ZERO),
            LoadZone::SafeToSoft | LoadZone::SoftToHard => {
                let b = if zone == LoadZone::SafeToSoft {
                    budget.normal
                } else {
                    budget.soft
                };
                if b.is_zero() {
                    (
                        WatermarkAction::Refuse,
                        self.refuse_retry(load, drain, bounds, now),
                    )
                } else {
                    let expected = bounds.for_drain(load + 1 - self.safe, drain, now);
                    (WatermarkAction::Wait { budget: b }, expected)
                }
            }
            LoadZone::AtHard => (
                WatermarkAction::Refuse,
                self.refuse_retry(load, drain, bounds, now),
            ),
        };
        WatermarkDecision {
            action,
            zone,
            load,
            retry_after,
        }
    }

    fn refuse_retry(
        &self,
        load: u64,
        drain: &DrainRate,
        bounds: &RetryBounds,
        now: Timestamp,
    ) -> RetryAfter {
        // Come back when the queue has drained below `soft` (or `safe` if the tier cannot
        // wait at all between the two).
        let target = if load >= self.soft {
            self.soft
        } else {
            self.safe
        };
        bounds.for_drain(load + 1 - target, drain, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zones_and_actions() {
        let w = Watermarks::new(10, 20, 30).unwrap();
        let b = WaitBudget {
            normal: Duration::from_secs(5),
            soft: Duration::from_secs(1),
        };
        let mut d = DrainRate::new(Duration::from_secs(1));
        let mut t = Timestamp::ZERO;
        for _ in 0..1000 {
            t = t + Duration::from_millis(10);
            d.record(1, t);
        }
        let r = RetryBounds::default();
        assert_eq!(
            w.decide(9, b, &d, &r, t).action,
            WatermarkAction::DispatchNow
        );
        assert_eq!(
            w.decide(10, b, &d, &r, t).action,
            WatermarkAction::Wait {
                budget: Duration::from_secs(5)
            }
        );
        assert_eq!(
            w.decide(25, b, &d, &r, t).action,
            WatermarkAction::Wait {
                budget: Duration::from_secs(1)
            }
        );
        let refuse = w.decide(30, b, &d, &r, t);
        assert_eq!(refuse.action, WatermarkAction::Refuse);
        assert_eq!(refuse.zone, LoadZone::AtHard);
        // 11 items to drain at ~100/s ≈ 110 ms, raised to the 250 ms floor.
        assert_eq!(refuse.retry_after.as_millis(), 250);
        let deep = w.decide(130, b, &d, &r, t);
        assert!(
            deep.retry_after.as_millis() > 1000,
            "{:?}",
            deep.retry_after
        );
        let no_soft = WaitBudget {
            normal: Duration::from_secs(5),
            soft: Duration::ZERO,
        };
        assert_eq!(
            w.decide(25, no_soft, &d, &r, t).action,
            WatermarkAction::Refuse
        );
    }

    #[test]
    fn rejects_bad_order() {
        assert!(Watermarks::new(5, 4, 10).is_err());
        assert!(Watermarks::new(0, 0, 0).is_err());
    }
}
