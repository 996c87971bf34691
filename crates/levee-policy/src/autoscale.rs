//! The backend replica recommendation: how many inference servers a model needs for the
//! traffic levee measures, so an autoscaler (KEDA, an HPA on external metrics) can add
//! replicas before the queue grows rather than after.
//!
//! Inputs are measured by the gateway: the arrival rate λ (requests per second), the
//! service rate μ of one slot (one concurrent sequence of one replica: completions per
//! second per busy slot, which by Little's law is the inverse of the mean time a request
//! holds a slot) and the requests queued now. A replica serves `slots_per_replica`
//! sequences at once.
//!
//! 1. The backlog must be gone within `drain_within`: it adds `queued / drain_within` to the
//!    arrival rate, `λ' = λ + Q / T`.
//! 2. Little's law gives the offered load in busy slots, `a = λ' / μ` (erlangs).
//! 3. Utilization bound: `n ≥ a / (k · ρ)` replicas, `k` slots each, at most `ρ` busy
//!    (`target_utilization`).
//! 4. Wait bound (M/M/c with `c = n · k` servers): the smallest `n` whose Erlang-C mean
//!    queue wait `W_q = C(c, a) / (c · μ − λ')` is at most `target_wait`.
//! 5. The recommendation is `clamp(max(bounds) + warm_pool, min_replicas, max_replicas)`.
//!
//! Scaling out is immediate. Scaling in waits: a lower figure is adopted only after every
//! figure for `scale_in_hold` has been below the current one, and then the highest of them is
//! taken (a brief lull does not drop replicas that the next burst needs).

use crate::clock::Timestamp;
use crate::watermark::ConfigError;
use std::time::Duration;

/// How a model's backends are sized.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoscaleConfig {
    /// Fewest replicas ever recommended.
    pub min_replicas: u32,
    /// Most replicas ever recommended.
    pub max_replicas: u32,
    /// Idle replicas kept on top of the computed need, to absorb a burst while new ones
    /// start.
    pub warm_pool: u32,
    /// Concurrent sequences one replica serves (the gateway uses its backends' cap).
    pub slots_per_replica: u32,
    /// Busiest a slot may be on average, in (0, 1].
    pub target_utilization: f64,
    /// Longest mean queue wait the M/M/c bound accepts.
    pub target_wait: Duration,
    /// Time within which the current backlog must be served.
    pub drain_within: Duration,
    /// How long every figure must stay below the current one before scaling in.
    pub scale_in_hold: Duration,
}

impl Default for AutoscaleConfig {
    fn default() -> Self {
        AutoscaleConfig {
            min_replicas: 4,
            max_replicas: 32,
            warm_pool: 2,
            slots_per_replica: 64,
            target_utilization: 0.8,
            target_wait: Duration::from_millis(500),
            drain_within: Duration::from_secs(60),
            scale_in_hold: Duration::from_secs(300),
        }
    }
}

impl AutoscaleConfig {
    /// Checks the settings; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.min_replicas > self.max_replicas {
            return Err(ConfigError(format!(
                "autoscale.min_replicas ({}) must not exceed autoscale.max_replicas ({})",
                self.min_replicas, self.max_replicas
            )));
        }
        if self.max_replicas == 0 {
            return Err(ConfigError("autoscale.max_replicas: must be > 0".into()));
        }
        if self.slots_per_replica == 0 {
            return Err(ConfigError(
                "autoscale.slots_per_replica: must be > 0".into(),
            ));
        }
        if !(self.target_utilization > 0.0 && self.target_utilization <= 1.0) {
            return Err(ConfigError(format!(
                "autoscale.target_utilization: must be in (0, 1], got {}",
                self.target_utilization
            )));
        }
        if self.drain_within.is_zero() {
            return Err(ConfigError("autoscale.drain_within: must be > 0".into()));
        }
        Ok(())
    }
}

/// What the gateway measured for one model.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Demand {
    /// Requests arriving per second.
    pub arrival_rate: f64,
    /// Completions per second of one busy slot (`1 / mean service time`); `None` before any
    /// request has finished.
    pub service_rate: Option<f64>,
    /// Requests waiting now.
    pub queued: u64,
}

/// Which rule set the figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// No traffic: the floor.
    Idle,
    /// Slots busy at most `target_utilization`.
    Utilization,
    /// Mean queue wait at most `target_wait` (Erlang C).
    Wait,
    /// No service-rate sample yet: the figure in force is kept.
    NoSample,
}

impl Bound {
    /// A short stable name for logs and `/admin/state`.
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::Idle => "idle",
            Bound::Utilization => "utilization",
            Bound::Wait => "wait",
            Bound::NoSample => "no_sample",
        }
    }
}

/// The computed need before the warm pool, limits and hold are applied.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Need {
    /// Replicas the traffic needs.
    pub replicas: u32,
    /// Offered load in busy slots (erlangs), `λ' / μ`.
    pub offered_load: f64,
    /// The rule that set `replicas`.
    pub bound: Bound,
}

/// Replicas the demand needs (steps 1–4 of the module doc), capped at `max_replicas`
/// (the search stops there). `None` when there is traffic but no service-rate sample.
pub fn replicas_needed(cfg: &AutoscaleConfig, d: &Demand) -> Option<Need> {
    let lambda = finite_nonneg(d.arrival_rate)
        + d.queued as f64 / cfg.drain_within.as_secs_f64().max(f64::MIN_POSITIVE);
    if lambda <= 0.0 {
        return Some(Need {
            replicas: 0,
            offered_load: 0.0,
            bound: Bound::Idle,
        });
    }
    let mu = finite_nonneg(d.service_rate?);
    if mu <= 0.0 {
        return None;
    }
    let a = lambda / mu;
    let k = f64::from(cfg.slots_per_replica.max(1));
    let by_util = (a / (k * cfg.target_utilization)).ceil();
    let n_util = if by_util >= f64::from(cfg.max_replicas) {
        cfg.max_replicas
    } else {
        (by_util as u32).max(1)
    };
    let target = cfg.target_wait.as_secs_f64();
    let mut n = n_util;
    while n < cfg.max_replicas && mean_wait(n, cfg.slots_per_replica, lambda, mu) > target {
        n += 1;
    }
    Some(Need {
        replicas: n,
        offered_load: a,
        bound: if n > n_util {
            Bound::Wait
        } else {
            Bound::Utilization
        },
    })
}

fn finite_nonneg(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 {
        x
    } else {
        0.0
    }
}

/// Mean queue wait of M/M/c with `c = replicas · slots` servers, each serving `mu` per
/// second, at arrival rate `lambda`: `C(c, a) / (c μ − λ)`, infinite when `c μ ≤ λ`.
pub fn mean_wait(replicas: u32, slots: u32, lambda: f64, mu: f64) -> f64 {
    let c = u64::from(replicas) * u64::from(slots);
    let capacity = c as f64 * mu;
    if capacity <= lambda {
        return f64::INFINITY;
    }
    erlang_c(c, lambda / mu) / (capacity - lambda)
}

/// Erlang C: the probability that an arrival waits, for `c` servers and offered load `a`
/// erlangs (`a < c`). Computed through the Erlang B recursion
/// `B(0) = 1, B(j) = a·B(j−1) / (j + a·B(j−1))`, then `C = B / (1 − ρ (1 − B))`, `ρ = a / c`,
/// which stays finite for thousands of servers.
pub fn erlang_c(c: u64, a: f64) -> f64 {
    if c == 0 {
        return 1.0;
    }
    let mut b = 1.0;
    for j in 1..=c {
        b = a * b / (j as f64 + a * b);
    }
    let rho = a / c as f64;
    if rho >= 1.0 {
        return 1.0;
    }
    b / (1.0 - rho * (1.0 - b))
}

/// The recommendation for one model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recommendation {
    /// Replicas to run now (warm pool, limits and scale-in hold applied).
    pub replicas: u32,
    /// What the traffic alone needs (before the warm pool and limits).
    pub needed: u32,
    /// Offered load in busy slots.
    pub offered_load: f64,
    /// The rule that set `needed`.
    pub bound: Bound,
    /// A lower figure is waiting out the scale-in hold.
    pub holding: bool,
}

/// The stateful part: the figure in force and the scale-in hold.
#[derive(Debug, Clone)]
pub struct Autoscaler {
    cfg: AutoscaleConfig,
    current: Option<u32>,
    /// Since when every figure has been below `current`, and the highest of them.
    lower: Option<(Timestamp, u32)>,
}

impl Autoscaler {
    /// A new autoscaler; the first observation sets the figure directly.
    pub fn new(cfg: AutoscaleConfig) -> Self {
        Autoscaler {
            cfg,
            current: None,
            lower: None,
        }
    }

    /// The settings.
    pub fn config(&self) -> &AutoscaleConfig {
        &self.cfg
    }

    /// Replaces the settings, keeping the figure in force.
    pub fn reconfigure(&mut self, cfg: AutoscaleConfig) {
        self.cfg = cfg;
    }

    /// Takes one measurement at `now` and returns the recommendation.
    pub fn observe(&mut self, demand: &Demand, now: Timestamp) -> Recommendation {
        let cfg = &self.cfg;
        let clamp = |n: u32| {
            n.saturating_add(cfg.warm_pool)
                .clamp(cfg.min_replicas, cfg.max_replicas)
        };
        let Some(need) = replicas_needed(cfg, demand) else {
            let replicas = self.current.unwrap_or_else(|| clamp(0));
            self.current = Some(replicas);
            return Recommendation {
                replicas,
                needed: replicas.saturating_sub(cfg.warm_pool),
                offered_load: 0.0,
                bound: Bound::NoSample,
                holding: self.lower.is_some(),
            };
        };
        let want = clamp(need.replicas);
        let replicas = match self.current {
            Some(cur) if want < cur => {
                let (since, highest) = match self.lower {
                    Some((since, h)) => (since, h.max(want)),
                    None => (now, want),
                };
                if now.saturating_duration_since(since) >= cfg.scale_in_hold {
                    self.lower = None;
                    highest
                } else {
                    self.lower = Some((since, highest));
                    cur
                }
            }
            _ => {
                self.lower = None;
                want
            }
        };
        self.current = Some(replicas);
        Recommendation {
            replicas,
            needed: need.replicas,
            offered_load: need.offered_load,
            bound: need.bound,
            holding: self.lower.is_some(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> AutoscaleConfig {
        AutoscaleConfig {
            min_replicas: 1,
            max_replicas: 32,
            warm_pool: 0,
            slots_per_replica: 8,
            target_utilization: 0.8,
            target_wait: Duration::from_secs(3600),
            drain_within: Duration::from_secs(60),
            scale_in_hold: Duration::from_secs(300),
        }
    }

    fn demand(lambda: f64, mu: f64, queued: u64) -> Demand {
        Demand {
            arrival_rate: lambda,
            service_rate: Some(mu),
            queued,
        }
    }

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_nanos(secs * 1_000_000_000)
    }

    #[test]
    fn utilization_bound_by_hand() {
        // λ = 10/s, 2 s per request ⇒ a = 20 busy slots; 8 slots at 80% = 6.4 per
        // replica ⇒ 20 / 6.4 = 3.125 ⇒ 4 replicas.
        let n = replicas_needed(&cfg(), &demand(10.0, 0.5, 0)).unwrap();
        assert_eq!(n.replicas, 4);
        assert!((n.offered_load - 20.0).abs() < 1e-9);
        assert_eq!(n.bound, Bound::Utilization);
    }

    #[test]
    fn backlog_must_drain_within_the_horizon() {
        // 300 queued over 60 s adds 5/s: λ' = 15/s ⇒ a = 30 ⇒ 30 / 6.4 = 4.69 ⇒ 5.
        let n = replicas_needed(&cfg(), &demand(10.0, 0.5, 300)).unwrap();
        assert_eq!(n.replicas, 5);
        assert!((n.offered_load - 30.0).abs() < 1e-9);
    }

    #[test]
    fn erlang_c_by_hand() {
        // c = 2, a = 1: B(1) = 1/2, B(2) = 0.5 / 2.5 = 0.2; ρ = 0.5 ⇒ C = 0.2 / 0.6 = 1/3.
        assert!((erlang_c(2, 1.0) - 1.0 / 3.0).abs() < 1e-12);
        // c = 3, a = 1: B(3) = 0.2 / 3.2 = 0.0625; ρ = 1/3 ⇒ C = 0.0625 / 0.6875 = 1/11.
        assert!((erlang_c(3, 1.0) - 1.0 / 11.0).abs() < 1e-12);
        // W_q = C / (cμ − λ): 1/3 s for c = 2, 1/22 s for c = 3 (λ = μ = 1).
        assert!((mean_wait(2, 1, 1.0, 1.0) - 1.0 / 3.0).abs() < 1e-12);
        assert!((mean_wait(3, 1, 1.0, 1.0) - 1.0 / 22.0).abs() < 1e-12);
        assert_eq!(mean_wait(1, 1, 1.0, 1.0), f64::INFINITY);
    }

    #[test]
    fn wait_bound_by_hand() {
        // One slot per replica, λ = μ = 1, utilization allowed up to 100%: the utilization
        // bound says 1, which is unstable; W_q is 1/3 s at 2 and 1/22 s at 3.
        let mut c = cfg();
        c.slots_per_replica = 1;
        c.target_utilization = 1.0;
        c.target_wait = Duration::from_millis(500);
        let n = replicas_needed(&c, &demand(1.0, 1.0, 0)).unwrap();
        assert_eq!((n.replicas, n.bound), (2, Bound::Wait));
        c.target_wait = Duration::from_millis(100);
        assert_eq!(
            replicas_needed(&c, &demand(1.0, 1.0, 0)).unwrap().replicas,
            3
        );
        c.target_wait = Duration::from_millis(30);
        // c = 4: B(4) = 0.0625 / 4.0625 = 1/65; ρ = 1/4 ⇒ C = (1/65) / (1 − 0.75·64/65)
        // = 1/17; W_q = (1/17) / 3 = 0.0196 s ≤ 0.03.
        assert_eq!(
            replicas_needed(&c, &demand(1.0, 1.0, 0)).unwrap().replicas,
            4
        );
    }

    #[test]
    fn warm_pool_min_and_max() {
        let mut c = cfg();
        c.warm_pool = 2;
        c.min_replicas = 4;
        c.max_replicas = 32;
        let mut a = Autoscaler::new(c.clone());
        // Idle: 0 + 2 warm, raised to the floor of 4.
        let r = a.observe(&demand(0.0, 0.5, 0), at(0));
        assert_eq!((r.replicas, r.needed, r.bound), (4, 0, Bound::Idle));
        // 4 needed + 2 warm = 6.
        assert_eq!(a.observe(&demand(10.0, 0.5, 0), at(1)).replicas, 6);
        // λ = 1000/s needs 313: capped at 32.
        let r = a.observe(&demand(1000.0, 0.5, 0), at(2));
        assert_eq!((r.replicas, r.needed), (32, 32));
    }

    #[test]
    fn no_service_sample_keeps_the_figure() {
        let mut a = Autoscaler::new(cfg());
        assert_eq!(a.observe(&demand(10.0, 0.5, 0), at(0)).replicas, 4);
        let r = a.observe(
            &Demand {
                arrival_rate: 50.0,
                service_rate: None,
                queued: 10,
            },
            at(1),
        );
        assert_eq!((r.replicas, r.bound), (4, Bound::NoSample));
    }

    #[test]
    fn scale_out_at_once_scale_in_after_the_hold() {
        let mut a = Autoscaler::new(cfg());
        assert_eq!(a.observe(&demand(10.0, 0.5, 0), at(0)).replicas, 4);
        assert_eq!(a.observe(&demand(20.0, 0.5, 0), at(1)).replicas, 7); // 40/6.4 = 6.25
                                                                         // Traffic falls to 2/s (needs 1), then briefly 10/s (needs 4): the figure stays 7
                                                                         // for the hold, then drops to the highest figure seen during it, 4.
        let r = a.observe(&demand(2.0, 0.5, 0), at(10));
        assert_eq!((r.replicas, r.holding), (7, true));
        assert_eq!(a.observe(&demand(10.0, 0.5, 0), at(100)).replicas, 7);
        assert_eq!(a.observe(&demand(2.0, 0.5, 0), at(309)).replicas, 7);
        let r = a.observe(&demand(2.0, 0.5, 0), at(310));
        assert_eq!((r.replicas, r.holding), (4, false));
        // Holding again from 4 towards 1; a rise back to 7 cancels the hold at once.
        assert!(a.observe(&demand(2.0, 0.5, 0), at(311)).holding);
        let r = a.observe(&demand(20.0, 0.5, 0), at(312));
        assert_eq!((r.replicas, r.holding), (7, false));
        assert_eq!(a.observe(&demand(2.0, 0.5, 0), at(313)).replicas, 7);
        assert_eq!(a.observe(&demand(2.0, 0.5, 0), at(612)).replicas, 7);
        assert_eq!(a.observe(&demand(2.0, 0.5, 0), at(613)).replicas, 1);
    }

    #[test]
    fn validation_names_the_field() {
        let mut c = cfg();
        c.min_replicas = 40;
        assert!(c.validate().unwrap_err().0.contains("min_replicas"));
        let mut c = cfg();
        c.target_utilization = 0.0;
        assert!(c.validate().unwrap_err().0.contains("target_utilization"));
        assert!(AutoscaleConfig::default().validate().is_ok());
    }

    proptest! {
        /// More traffic, a slower service or a longer queue never asks for fewer replicas.
        #[test]
        fn need_is_monotone(
            lambda in 0.0f64..500.0,
            more in 0.0f64..500.0,
            mu in 0.01f64..10.0,
            q in 0u64..10_000,
            dq in 0u64..10_000,
            slots in 1u32..128,
            wait_ms in 1u64..10_000,
        ) {
            let mut c = cfg();
            c.slots_per_replica = slots;
            c.target_wait = Duration::from_millis(wait_ms);
            let base = replicas_needed(&c, &demand(lambda, mu, q)).unwrap().replicas;
            let busier = replicas_needed(&c, &demand(lambda + more, mu, q + dq)).unwrap().replicas;
            let slower = replicas_needed(&c, &demand(lambda, mu / 2.0, q)).unwrap().replicas;
            prop_assert!(busier >= base);
            prop_assert!(slower >= base);
            prop_assert!(base <= c.max_replicas);
        }

        /// Below the cap, the recommended fleet keeps utilization at or under the target
        /// and is stable (capacity above the offered rate).
        #[test]
        fn recommended_fleet_meets_its_bounds(
            lambda in 0.1f64..200.0,
            mu in 0.05f64..5.0,
            slots in 1u32..64,
        ) {
            let mut c = cfg();
            c.slots_per_replica = slots;
            c.target_wait = Duration::from_millis(200);
            c.max_replicas = 10_000;
            let n = replicas_needed(&c, &demand(lambda, mu, 0)).unwrap();
            let capacity = f64::from(n.replicas) * f64::from(slots) * mu;
            prop_assert!(lambda / capacity <= c.target_utilization + 1e-9);
            prop_assert!(mean_wait(n.replicas, slots, lambda, mu) <= 0.2 + 1e-9);
        }
    }
}
