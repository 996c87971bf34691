//! Glue from the gateway's load figures to the policy [`DegradePlanner`], plus the
//! per-model fallback (the policy step names one fallback model; levee's config gives
//! each model its own, so the gateway resolves `use_fallback` itself).

use crate::config::Config;
use levee_policy::{DegradePlanner, LoadSignals, Tier, Timestamp, Watermarks};

/// What the level in force does to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DegradeDecision {
    /// Level in force (0 = normal).
    pub level: u8,
    /// Cap on `max_tokens`.
    pub max_tokens_cap: Option<u32>,
    /// Route to the model's fallback.
    pub use_fallback: bool,
    /// Shed sheddable tiers with priority at or above this number.
    pub shed_from_priority: Option<u8>,
}

/// The gateway's degradation state.
#[derive(Debug)]
pub struct Degrader {
    planner: DegradePlanner,
    policy_cfg: levee_policy::DegradeConfig,
    enabled: bool,
    kv_signal: bool,
    use_fallback: Vec<bool>,
    last_signals: LoadSignals,
    /// Worst scraped KV-cache use, fed by the scraper.
    pub kv_usage: f64,
}

impl Degrader {
    /// Builds the planner from config (validated beforehand).
    pub fn new(cfg: &Config) -> Self {
        Degrader {
            planner: DegradePlanner::new(cfg.degrade.to_policy()),
            policy_cfg: cfg.degrade.to_policy(),
            enabled: cfg.degrade.enabled,
            kv_signal: cfg.degrade.kv_signal,
            use_fallback: cfg.degrade.levels.iter().map(|l| l.use_fallback).collect(),
            last_signals: LoadSignals::default(),
            kv_usage: 0.0,
        }
    }

    /// Applies a new config, keeping a forced level if it is still in range.
    pub fn reconfigure(&mut self, cfg: &Config) {
        if cfg.degrade.to_policy() == *self.planner_config() {
            self.enabled = cfg.degrade.enabled;
            self.kv_signal = cfg.degrade.kv_signal;
            self.use_fallback = cfg.degrade.levels.iter().map(|l| l.use_fallback).collect();
            return;
        }
        let forced = self
            .planner
            .plan()
            .forced
            .then(|| self.planner.effective_level());
        *self = Degrader::new(cfg);
        self.planner.force(forced);
    }

    fn planner_config(&self) -> &levee_policy::DegradeConfig {
        &self.policy_cfg
    }

    /// Feeds the current load; returns the level in force.
    pub fn observe(&mut self, load: u64, marks: &Watermarks, now: Timestamp) -> u8 {
        let hard = marks.hard.max(1) as f64;
        let signals = if self.enabled {
            LoadSignals {
                queue_depth_ratio: load as f64 / hard,
                // A full backend with an empty queue is healthy use, not overload; the
                // queue term already captures "more work than capacity".
                in_flight_ratio: 0.0,
                kv_cache_usage: if self.kv_signal { self.kv_usage } else { 0.0 },
            }
        } else {
            LoadSignals::default()
        };
        self.last_signals = signals;
        u8::try_from(self.planner.observe(signals, now)).unwrap_or(u8::MAX)
    }

    /// Forces a level, or back to automatic with `None`.
    pub fn force(&mut self, level: Option<usize>) {
        self.planner.force(level);
    }

    /// The decision for requests now.
    pub fn decision(&self) -> DegradeDecision {
        let plan = self.planner.plan();
        let use_fallback = plan
            .level
            .checked_sub(1)
            .and_then(|i| self.use_fallback.get(i).copied())
            .unwrap_or(false);
        DegradeDecision {
            level: u8::try_from(plan.level).unwrap_or(u8::MAX),
            max_tokens_cap: plan.step.max_tokens_cap,
            use_fallback,
            shed_from_priority: plan.step.shed_from_tier.map(|Tier(t)| t),
        }
    }

    /// Number of configured levels.
    pub fn max_level(&self) -> usize {
        self.planner.max_level()
    }

    /// `/admin/state` part.
    pub fn state_json(&self) -> serde_json::Value {
        let d = self.decision();
        let plan = self.planner.plan();
        serde_json::json!({
            "level": d.level,
            "automatic_level": self.planner.automatic_level(),
            "forced": plan.forced,
            "max_level": self.max_level(),
            "score": self.planner.last_score(),
            "signals": {
                "queue_depth_ratio": self.last_signals.queue_depth_ratio,
                "kv_cache_usage": self.last_signals.kv_cache_usage,
            },
            "max_tokens_cap": d.max_tokens_cap,
            "use_fallback": d.use_fallback,
            "shed_from_priority": d.shed_from_priority,
        })
    }
}
