//! Degradation per model lane: each lane has its own [`DegradePlanner`] fed with its own
//! signals (load over the hard watermark, P95 TTFT against the model's SLO, the share of
//! requests refused for capacity, KV-cache fill), so a flood on one model never caps, reroutes
//! or sheds another. An operator's forced level (`/admin/degrade`) applies to every lane.

use crate::config::Config;
use levee_policy::{DegradePlanner, LoadSignals, Tier, Timestamp};
use std::collections::HashMap;

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

impl DegradeDecision {
    /// The decision in one word, for a lane to publish to its requests without a lock
    /// ([`DegradeDecision::unpack`]): the level in bits 0–7, the fallback in bit 8, the tier
    /// shed from in bits 16–23 (bit 9: any), the `max_tokens` cap in bits 32–63 (bit 10: any).
    pub(crate) fn pack(self) -> u64 {
        let mut w = u64::from(self.level) | (u64::from(self.use_fallback) << 8);
        if let Some(p) = self.shed_from_priority {
            w |= 1 << 9 | u64::from(p) << 16;
        }
        if let Some(cap) = self.max_tokens_cap {
            w |= 1 << 10 | u64::from(cap) << 32;
        }
        w
    }

    /// The decision [`DegradeDecision::pack`] made `w` of.
    pub(crate) fn unpack(w: u64) -> Self {
        let byte = |shift: u32| (w >> shift) as u8;
        DegradeDecision {
            level: byte(0),
            use_fallback: w & 1 << 8 != 0,
            shed_from_priority: (w & 1 << 9 != 0).then_some(byte(16)),
            max_tokens_cap: (w & 1 << 10 != 0).then_some((w >> 32) as u32),
        }
    }
}

#[derive(Debug)]
struct LaneState {
    planner: DegradePlanner,
    signals: LoadSignals,
}

/// The gateway's degradation state: one planner per model lane.
#[derive(Debug)]
pub struct Degrader {
    policy_cfg: levee_policy::DegradeConfig,
    enabled: bool,
    kv_signal: bool,
    refusal_signal: bool,
    forced: Option<usize>,
    lanes: HashMap<String, LaneState, levee_policy::FastState>,
}

impl Degrader {
    /// Builds the planners' settings from config (validated beforehand).
    pub fn new(cfg: &Config) -> Self {
        Degrader {
            policy_cfg: cfg.degrade.to_policy(),
            enabled: cfg.degrade.enabled,
            kv_signal: cfg.degrade.kv_signal,
            refusal_signal: cfg.degrade.refusal_signal,
            forced: None,
            lanes: HashMap::default(),
        }
    }

    /// Applies a new config, keeping a forced level if it is still in range.
    pub fn reconfigure(&mut self, cfg: &Config) {
        let forced = self.forced;
        let same_levels = cfg.degrade.to_policy() == self.policy_cfg;
        let lanes = std::mem::take(&mut self.lanes);
        *self = Degrader::new(cfg);
        if same_levels {
            self.lanes = lanes;
        }
        self.force(forced);
    }

    fn lane(&mut self, model: &str) -> &mut LaneState {
        let cfg = &self.policy_cfg;
        let forced = self.forced;
        self.lanes.entry(model.to_string()).or_insert_with(|| {
            let mut planner = DegradePlanner::new(cfg.clone());
            planner.force(forced);
            LaneState {
                planner,
                signals: LoadSignals::default(),
            }
        })
    }

    /// Feeds one lane's current signals; returns its level in force.
    pub fn observe(&mut self, model: &str, signals: LoadSignals, now: Timestamp) -> u8 {
        let signals = if self.enabled {
            LoadSignals {
                kv_cache_usage: if self.kv_signal {
                    signals.kv_cache_usage
                } else {
                    0.0
                },
                refusal_rate: if self.refusal_signal {
                    signals.refusal_rate
                } else {
                    0.0
                },
                ..signals
            }
        } else {
            LoadSignals::default()
        };
        let lane = self.lane(model);
        lane.signals = signals;
        u8::try_from(lane.planner.observe(signals, now)).unwrap_or(u8::MAX)
    }

    /// Forces a level on every lane, or back to automatic with `None`.
    pub fn force(&mut self, level: Option<usize>) {
        self.forced = level;
        for l in self.lanes.values_mut() {
            l.planner.force(level);
        }
    }

    /// The decision for requests of `model` now.
    pub fn decision(&self, model: &str) -> DegradeDecision {
        let Some(lane) = self.lanes.get(model) else {
            // A lane not yet observed runs at the forced level, or normal.
            let mut p = DegradePlanner::new(self.policy_cfg.clone());
            p.force(self.forced);
            return decision_of(&p);
        };
        decision_of(&lane.planner)
    }

    /// Number of configured levels.
    pub fn max_level(&self) -> usize {
        self.policy_cfg.levels.len()
    }

    /// `/admin/state` part: the forced level and each lane's level and signals.
    pub fn state_json(&self) -> serde_json::Value {
        let mut names: Vec<&String> = self.lanes.keys().collect();
        names.sort();
        let lanes: Vec<_> = names
            .into_iter()
            .filter_map(|n| self.lanes.get(n).map(|l| (n, l)))
            .map(|(name, l)| {
                let d = decision_of(&l.planner);
                serde_json::json!({
                    "model": name,
                    "level": d.level,
                    "automatic_level": l.planner.automatic_level(),
                    "score": l.planner.last_score(),
                    "signals": {
                        "queue_depth_ratio": l.signals.queue_depth_ratio,
                        "kv_cache_usage": l.signals.kv_cache_usage,
                        "ttft_ratio": l.signals.ttft_ratio,
                        "refusal_rate": l.signals.refusal_rate,
                    },
                    "max_tokens_cap": d.max_tokens_cap,
                    "use_fallback": d.use_fallback,
                    "shed_from_priority": d.shed_from_priority,
                })
            })
            .collect();
        let level = self
            .lanes
            .values()
            .map(|l| l.planner.effective_level())
            .max()
            .unwrap_or(self.forced.unwrap_or(0));
        serde_json::json!({
            "level": level,
            "forced": self.forced.is_some(),
            "forced_level": self.forced,
            "max_level": self.max_level(),
            "lanes": lanes,
        })
    }
}

fn decision_of(planner: &DegradePlanner) -> DegradeDecision {
    let plan = planner.plan();
    DegradeDecision {
        level: u8::try_from(plan.level).unwrap_or(u8::MAX),
        max_tokens_cap: plan.step.max_tokens_cap,
        use_fallback: plan.step.use_fallback,
        shed_from_priority: plan.step.shed_from_tier.map(|Tier(t)| t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_decision_packed_in_one_word_unpacks_the_same(
            level in any::<u8>(),
            max_tokens_cap in any::<Option<u32>>(),
            use_fallback in any::<bool>(),
            shed_from_priority in any::<Option<u8>>(),
        ) {
            let d = DegradeDecision { level, max_tokens_cap, use_fallback, shed_from_priority };
            prop_assert_eq!(DegradeDecision::unpack(d.pack()), d);
        }
    }
}
