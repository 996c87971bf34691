//! The degradation planner: turns load signals into a level, with hysteresis, and the level
//! into configured steps (cap `max_tokens`, route to a fallback model, shed the lowest
//! tiers).
//!
//! The load score is the largest of the signals (each 0..1). Level `i` (1-based) is entered
//! when the score reaches `levels[i-1].enter` and left when it falls below `levels[i-1].exit`
//! (`exit < enter`). Escalation is immediate and may skip levels; de-escalation goes one level
//! at a time and only after `min_dwell` at the current level, so the plan does not flap.
//! An operator can force a level; [`DegradePlanner::force`] with `None` returns to automatic.

use crate::clock::Timestamp;
use crate::queue::Tier;
use crate::watermark::ConfigError;
use std::time::Duration;

/// Load signals, each a ratio where 1.0 means "at the limit".
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LoadSignals {
    /// Load (queued + in flight) over the hard watermark.
    pub queue_depth_ratio: f64,
    /// Backend KV-cache fill, 0..1 (the worst backend).
    pub kv_cache_usage: f64,
    /// What users feel: P95 time to first token over its alarm line (1.5× the SLO).
    pub ttft_ratio: f64,
    /// Share of recent requests refused for capacity, 0..1.
    pub refusal_rate: f64,
}

impl LoadSignals {
    /// The load score: the largest signal (NaN counts as 0).
    pub fn score(&self) -> f64 {
        [
            self.queue_depth_ratio,
            self.kv_cache_usage,
            self.ttft_ratio,
            self.refusal_rate,
        ]
        .into_iter()
        .map(|x| if x.is_nan() { 0.0 } else { x.max(0.0) })
        .fold(0.0, f64::max)
    }
}

/// What to do to requests at a level. Steps are cumulative only if configured so: each level
/// lists its full plan.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DegradeStep {
    /// Cap each request's `max_tokens` at this.
    pub max_tokens_cap: Option<u32>,
    /// Route requests to their model's fallback model (each model names its own).
    pub use_fallback: bool,
    /// Refuse new requests of this tier and every lower-priority (larger-numbered) tier.
    pub shed_from_tier: Option<Tier>,
}

/// One level's thresholds and plan.
#[derive(Debug, Clone, PartialEq)]
pub struct DegradeLevel {
    /// Enter at or above this score.
    pub enter: f64,
    /// Leave below this score (must be < `enter`).
    pub exit: f64,
    /// The plan at this level.
    pub step: DegradeStep,
}

/// Planner settings. Level 0 is normal operation (no step); `levels[0]` is level 1.
#[derive(Debug, Clone, PartialEq)]
pub struct DegradeConfig {
    /// Levels in increasing severity (`enter` increasing).
    pub levels: Vec<DegradeLevel>,
    /// Least time at a level before stepping down.
    pub min_dwell: Duration,
}

impl DegradeConfig {
    /// Checks thresholds.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut prev_enter = f64::NEG_INFINITY;
        for (i, l) in self.levels.iter().enumerate() {
            if l.exit.is_nan() || l.enter.is_nan() || l.exit >= l.enter {
                return Err(ConfigError(format!(
                    "degrade.levels[{i}]: exit must be < enter"
                )));
            }
            if l.enter <= prev_enter {
                return Err(ConfigError(format!(
                    "degrade.levels[{i}].enter: must be greater than the previous level's"
                )));
            }
            prev_enter = l.enter;
        }
        Ok(())
    }
}

/// The current plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DegradePlan<'a> {
    /// The level (0 = normal).
    pub level: usize,
    /// Whether an operator forced it.
    pub forced: bool,
    /// What to do.
    pub step: &'a DegradeStep,
}

/// The planner. `&mut self`; one per gateway.
#[derive(Debug, Clone)]
pub struct DegradePlanner {
    cfg: DegradeConfig,
    level: usize,
    since: Timestamp,
    forced: Option<usize>,
    last_score: f64,
    normal: DegradeStep,
}

impl DegradePlanner {
    /// A planner at level 0. Validate the config first with [`DegradeConfig::validate`].
    pub fn new(cfg: DegradeConfig) -> Self {
        DegradePlanner {
            cfg,
            level: 0,
            since: Timestamp::ZERO,
            forced: None,
            last_score: 0.0,
            normal: DegradeStep::default(),
        }
    }

    /// Number of levels above normal.
    pub fn max_level(&self) -> usize {
        self.cfg.levels.len()
    }

    /// Feeds the signals at `now`; returns the effective level.
    pub fn observe(&mut self, signals: LoadSignals, now: Timestamp) -> usize {
        let score = signals.score();
        self.last_score = score;
        // Escalate at once, as far as the score says.
        let target_up = self
            .cfg
            .levels
            .iter()
            .take_while(|l| score >= l.enter)
            .count();
        if target_up > self.level {
            self.level = target_up;
            self.since = now;
        } else if self.level > 0 {
            let cur = &self.cfg.levels[self.level - 1];
            if score < cur.exit && now - self.since >= self.cfg.min_dwell {
                self.level -= 1;
                self.since = now;
            }
        }
        self.effective_level()
    }

    /// The level in force (forced or automatic).
    pub fn effective_level(&self) -> usize {
        self.forced.unwrap_or(self.level)
    }

    /// The automatic level, ignoring any force.
    pub fn automatic_level(&self) -> usize {
        self.level
    }

    /// The last score observed.
    pub fn last_score(&self) -> f64 {
        self.last_score
    }

    /// Forces a level (clamped to the configured ones), or `None` for automatic.
    pub fn force(&mut self, level: Option<usize>) {
        self.forced = level.map(|l| l.min(self.max_level()));
    }

    /// The plan in force.
    pub fn plan(&self) -> DegradePlan<'_> {
        let level = self.effective_level();
        let step = if level == 0 {
            &self.normal
        } else {
            &self.cfg.levels[level - 1].step
        };
        DegradePlan {
            level,
            forced: self.forced.is_some(),
            step,
        }
    }

    /// `max_tokens` after the cap in force (`None` requested means "model default", which is
    /// capped too when a cap is set).
    pub fn cap_max_tokens(&self, requested: Option<u32>) -> Option<u32> {
        match (self.plan().step.max_tokens_cap, requested) {
            (Some(cap), Some(r)) => Some(r.min(cap)),
            (Some(cap), None) => Some(cap),
            (None, r) => r,
        }
    }

    /// Whether new requests of `tier` are shed at the level in force.
    pub fn sheds(&self, tier: Tier) -> bool {
        matches!(self.plan().step.shed_from_tier, Some(t) if tier >= t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planner() -> DegradePlanner {
        let cfg = DegradeConfig {
            levels: vec![
                DegradeLevel {
                    enter: 0.7,
                    exit: 0.6,
                    step: DegradeStep {
                        max_tokens_cap: Some(512),
                        ..Default::default()
                    },
                },
                DegradeLevel {
                    enter: 0.9,
                    exit: 0.8,
                    step: DegradeStep {
                        max_tokens_cap: Some(256),
                        use_fallback: true,
                        shed_from_tier: Some(Tier(2)),
                    },
                },
            ],
            min_dwell: Duration::from_secs(10),
        };
        cfg.validate().unwrap();
        DegradePlanner::new(cfg)
    }

    fn sig(x: f64) -> LoadSignals {
        LoadSignals {
            kv_cache_usage: x,
            ..Default::default()
        }
    }

    #[test]
    fn hysteresis_and_dwell() {
        let mut p = planner();
        let t0 = Timestamp::from_nanos(1);
        assert_eq!(p.observe(sig(0.5), t0), 0);
        assert_eq!(p.observe(sig(0.95), t0), 2, "jumps straight up");
        assert!(p.sheds(Tier(3)) && p.sheds(Tier(2)) && !p.sheds(Tier(1)));
        assert_eq!(p.cap_max_tokens(Some(1000)), Some(256));
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(p.observe(sig(0.1), t1), 2, "dwell not reached");
        let t2 = t0 + Duration::from_secs(10);
        assert_eq!(p.observe(sig(0.85), t2), 2, "between exit and enter: stay");
        assert_eq!(p.observe(sig(0.75), t2), 1, "one level down");
        assert_eq!(
            p.observe(sig(0.1), t2 + Duration::from_secs(1)),
            1,
            "dwell again"
        );
        assert_eq!(
            p.observe(sig(0.65), t2 + Duration::from_secs(20)),
            1,
            "above exit"
        );
        assert_eq!(p.observe(sig(0.5), t2 + Duration::from_secs(20)), 0);
    }

    #[test]
    fn forced_level_overrides_then_releases() {
        let mut p = planner();
        p.force(Some(7));
        assert_eq!(p.plan().level, 2);
        assert!(p.plan().forced);
        assert_eq!(p.observe(sig(0.0), Timestamp::ZERO), 2);
        p.force(None);
        assert_eq!(p.effective_level(), 0);
    }

    #[test]
    fn rejects_inverted_thresholds() {
        let cfg = DegradeConfig {
            levels: vec![DegradeLevel {
                enter: 0.5,
                exit: 0.6,
                step: DegradeStep::default(),
            }],
            min_dwell: Duration::ZERO,
        };
        assert!(cfg.validate().is_err());
    }
}
